"""A tiny byte-level causal language model for audits, trained from scratch (also federated).

Tokenizer: the UTF-8 bytes of the text (ids 0-255) between ``BOS = 256`` and ``EOS = 257``;
batches are right-padded with EOS and the padding is masked out of attention and loss. No
vocabulary file is needed, any text is representable and a rare character costs several
tokens, as rare PII does in a real subword vocabulary.

Model: ``transformers``' GPT-2 (``GPT2LMHeadModel``) or Llama (``LlamaForCausalLM``) with a
few small layers, initialised from a seed. :func:`federated_train` runs FedAvg (McMahan et
al., AISTATS 2017: each round every client takes ``local_steps`` AdamW steps from the global
weights, the server averages the client weights weighted by the clients' text counts) in this
process; :func:`token_log_probs` gives every sequence's ``log p(x_t | x_<t)`` for the attacks
of :mod:`fedsim.audits.mia`.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

import numpy as np
import torch
from torch import nn

from fedsim.extras import require_extra

BOS = 256
EOS = 257
VOCAB_SIZE = 258


def encode(text: str, max_len: int) -> list[int]:
    """``[BOS] + utf8(text) + [EOS]``, cut to ``max_len`` tokens (EOS then dropped)."""
    if not isinstance(text, str):
        raise ValueError(f"text must be a str; got {type(text).__name__}")
    return ([BOS, *text.encode("utf-8"), EOS])[:max_len]


def decode(ids: Sequence[int]) -> str:
    """The text of byte ids (BOS/EOS dropped; invalid UTF-8 replaced)."""
    return bytes(int(i) for i in ids if int(i) < 256).decode("utf-8", errors="replace")


def batch_tensors(texts: Sequence[str], max_len: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(input_ids, attention_mask)`` of ``texts``, right-padded with EOS."""
    if len(texts) == 0:
        raise ValueError("texts must hold at least one text")
    encoded = [encode(t, max_len) for t in texts]
    width = max(len(e) for e in encoded)
    ids = torch.full((len(encoded), width), EOS, dtype=torch.long)
    mask = torch.zeros((len(encoded), width), dtype=torch.long)
    for row, e in enumerate(encoded):
        ids[row, : len(e)] = torch.tensor(e)
        mask[row, : len(e)] = 1
    return ids, mask


@dataclass(frozen=True, kw_only=True)
class TinyLMConfig:
    """Shape of the tiny LM: ``arch`` (gpt2 / llama), ``width`` (hidden size), ``layers``,
    ``heads`` and ``max_len`` (tokens, BOS and EOS included)."""

    arch: Literal["gpt2", "llama"] = "gpt2"
    width: int = 48
    layers: int = 1
    heads: int = 4
    max_len: int = 96

    def __post_init__(self) -> None:
        if self.arch not in ("gpt2", "llama"):
            raise ValueError(f"arch = {self.arch!r} is not allowed: 'gpt2' or 'llama'")
        for key in ("width", "layers", "heads", "max_len"):
            value = getattr(self, key)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{key} = {value!r} is not allowed: an integer >= 1")
        if self.width % self.heads:
            raise ValueError(
                f"width = {self.width} is not allowed: a multiple of heads = {self.heads}"
            )


def build_lm(config: TinyLMConfig, seed: int) -> nn.Module:
    """A freshly initialised causal LM of ``config`` (weights drawn from ``seed``)."""
    require_extra("the language-model audits", modules=("transformers",))
    from transformers import (  # noqa: PLC0415  (heavy import, only when an LM is built)
        GPT2Config,
        GPT2LMHeadModel,
        LlamaConfig,
        LlamaForCausalLM,
    )
    from transformers.utils import logging as hf_logging  # noqa: PLC0415

    hf_logging.set_verbosity_error()
    logging.getLogger("transformers").setLevel(logging.ERROR)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        if config.arch == "gpt2":
            hf_config = GPT2Config(
                vocab_size=VOCAB_SIZE,
                n_positions=config.max_len,
                n_embd=config.width,
                n_layer=config.layers,
                n_head=config.heads,
                bos_token_id=BOS,
                eos_token_id=EOS,
                resid_pdrop=0.0,
                embd_pdrop=0.0,
                attn_pdrop=0.0,
            )
            model = GPT2LMHeadModel(hf_config)
        else:
            hf_config = LlamaConfig(
                vocab_size=VOCAB_SIZE,
                hidden_size=config.width,
                intermediate_size=4 * config.width,
                num_hidden_layers=config.layers,
                num_attention_heads=config.heads,
                num_key_value_heads=config.heads,
                max_position_embeddings=config.max_len,
                bos_token_id=BOS,
                eos_token_id=EOS,
                pad_token_id=EOS,
            )
            model = LlamaForCausalLM(hf_config)
    return model


def max_len_of(model: nn.Module) -> int:
    """The longest sequence (tokens) ``model`` takes."""
    cfg = model.config
    return int(getattr(cfg, "n_positions", None) or cfg.max_position_embeddings)


def sequence_losses(
    model: nn.Module, ids: torch.Tensor, mask: torch.Tensor, targets: torch.Tensor | None = None
) -> torch.Tensor:
    """Per-token NLL ``-log p(y_t | x_<t)`` of shape (batch, width - 1), 0 at padding, with
    ``y = targets`` (default: the inputs ``ids`` themselves, the usual LM loss)."""
    targets = ids if targets is None else targets
    logits = model(input_ids=ids, attention_mask=mask).logits[:, :-1]
    nll = nn.functional.cross_entropy(
        logits.reshape(-1, logits.shape[-1]), targets[:, 1:].reshape(-1), reduction="none"
    ).view(ids.shape[0], -1)
    return nll * mask[:, 1:]


def mean_loss(model: nn.Module, texts: Sequence[str]) -> torch.Tensor:
    """Mean token NLL over ``texts`` (a differentiable scalar)."""
    ids, mask = batch_tensors(texts, max_len_of(model))
    return sequence_losses(model, ids, mask).sum() / mask[:, 1:].sum()


def train_lm(
    model: nn.Module,
    texts: Sequence[str],
    *,
    steps: int,
    batch_size: int = 16,
    lr: float = 3e-3,
    generator: torch.Generator,
) -> float:
    """``steps`` AdamW steps on minibatches of ``texts`` drawn without replacement per epoch;
    returns the mean training loss."""
    if steps < 0 or batch_size < 1:
        raise ValueError(f"steps = {steps} and batch_size = {batch_size} must be >= 0 and >= 1")
    if len(texts) == 0:
        raise ValueError("texts must hold at least one text to train on")
    model.train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    order = torch.randperm(len(texts), generator=generator)
    cursor, total = 0, 0.0
    for _ in range(steps):
        if cursor >= len(texts):
            order, cursor = torch.randperm(len(texts), generator=generator), 0
        pick = order[cursor : cursor + batch_size].tolist()
        cursor += batch_size
        optimizer.zero_grad(set_to_none=True)
        loss = mean_loss(model, [texts[i] for i in pick])
        loss.backward()
        optimizer.step()
        total += float(loss.detach())
    return total / steps if steps else 0.0


def federated_train(
    model: nn.Module,
    client_texts: Sequence[Sequence[str]],
    *,
    rounds: int,
    local_steps: int,
    batch_size: int = 16,
    lr: float = 3e-3,
    seed: int,
) -> list[float]:
    """FedAvg of ``model`` over all clients for ``rounds`` rounds (in place); returns the
    client-weighted mean training loss of each round. Client ``k`` in round ``r`` draws its
    batches from ``SeedSequence([seed, r, k])``."""
    if rounds < 1 or local_steps < 1:
        raise ValueError(f"rounds = {rounds} and local_steps = {local_steps} must be >= 1")
    clients = [list(t) for t in client_texts if len(t)]
    if not clients:
        raise ValueError("client_texts must hold at least one client with text")
    weights = np.array([len(t) for t in clients], dtype=np.float64)
    weights /= weights.sum()
    global_state = {k: v.detach().clone() for k, v in model.state_dict().items()}
    history = []
    for r in range(rounds):
        summed = {k: torch.zeros_like(v, dtype=torch.float32) for k, v in global_state.items()}
        losses = []
        for k, texts in enumerate(clients):
            model.load_state_dict(global_state)
            state = np.random.SeedSequence([seed, r, k]).generate_state(1, np.uint64)[0]
            gen = torch.Generator().manual_seed(int(state >> np.uint64(1)))
            losses.append(
                train_lm(
                    model, texts, steps=local_steps, batch_size=batch_size, lr=lr, generator=gen
                )
            )
            for key, value in model.state_dict().items():
                summed[key] += weights[k] * value.detach().float()
        global_state = {k: summed[k].to(v.dtype) for k, v in global_state.items()}
        history.append(float(np.dot(weights, losses)))
    model.load_state_dict(global_state)
    return history


@torch.no_grad()
def token_log_probs(
    model: nn.Module, texts: Sequence[str], batch_size: int = 64
) -> list[np.ndarray]:
    """Per sequence, ``log p(x_t | x_<t)`` for every token after BOS (EOS included)."""
    model.eval()
    out: list[np.ndarray] = []
    max_len = max_len_of(model)
    for start in range(0, len(texts), batch_size):
        ids, mask = batch_tensors(texts[start : start + batch_size], max_len)
        nll = sequence_losses(model, ids, mask)
        lengths = mask[:, 1:].sum(1)
        out += [-nll[i, : int(lengths[i])].numpy().astype(np.float64) for i in range(len(ids))]
    return out
