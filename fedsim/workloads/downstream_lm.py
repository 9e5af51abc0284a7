"""Downstream evaluation of synthetic text: train a small LM, report next-token accuracy.

POPri (Hou et al., ICML 2025, Sec. 5) and PrE-Text (Hou et al., ICML 2024) judge a synthetic
data set by the model it trains: a small causal LM is trained on the texts and its next-token
top-1 accuracy is measured on the clients' private held-out text. The non-private reference
trains on the private text itself; the fully private baseline uses no private information.

The model is a small :class:`transformers.LlamaForCausalLM` trained from scratch with the
generator's tokenizer (SmolLM2's byte-level BPE). To keep it CPU-sized its output layer covers a
*compact vocabulary*: the ``size - 2`` most frequent tokenizer ids of a reference corpus chosen
by the caller (the experiment uses public text, so it holds no private information), plus
``<unk>`` (every other id) and ``<bos>``. Accuracy counts every held-out text token, and a
target outside the compact vocabulary is always a miss, so the figure is a lower bound on what
the same model with the full vocabulary would score.

Each text is one sequence ``<bos> t_1 ... t_L`` (``L <= max_tokens``, POPri truncates samples
to 64 tokens); position ``i`` predicts ``t_{i+1}`` from ``<bos> t_1 .. t_i``, so a text of
``L`` tokens has ``L`` predictions. Everything is seeded: model initialisation and batch order
come from the ``seed`` / ``torch.Generator`` passed in.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch import nn

from fedsim.config import positive_int, require
from fedsim.extras import require_extra
from fedsim.models import model_device, place

UNK, BOS = 0, 1
IGNORE = -100


class Vocabulary:
    """A compact vocabulary: tokenizer ids -> ids ``0 .. size-1`` (0 ``<unk>``, 1 ``<bos>``).

    Args:
        token_ids: the tokenizer ids kept, most frequent first; compact id ``2 + i``.
    """

    __slots__ = ("token_ids", "_lookup")

    def __init__(self, token_ids: Sequence[int]) -> None:
        ids = [int(t) for t in token_ids]
        if len(set(ids)) != len(ids):
            raise ValueError("token_ids = ... holds duplicates; each tokenizer id at most once")
        if any(t < 0 for t in ids):
            raise ValueError(f"token_ids = {min(ids)} ...: tokenizer ids are >= 0")
        self.token_ids = tuple(ids)
        self._lookup = {t: i + 2 for i, t in enumerate(ids)}

    @classmethod
    def from_sequences(cls, sequences: Iterable[Sequence[int]], size: int) -> Vocabulary:
        """The ``size - 2`` most frequent ids of ``sequences`` (ties: smaller id first)."""
        size = positive_int(size, "size")
        require(size >= 3, "size", size, "an integer >= 3 (<unk>, <bos> and one token)")
        counts: Counter[int] = Counter()
        for seq in sequences:
            counts.update(int(t) for t in seq)
        ranked = sorted(counts.items(), key=lambda kv: (-kv[1], kv[0]))
        return cls([t for t, _ in ranked[: size - 2]])

    @property
    def size(self) -> int:
        """Compact ids in use (the model's vocabulary size)."""
        return len(self.token_ids) + 2

    def encode(self, token_ids: Sequence[int]) -> np.ndarray:
        """Tokenizer ids -> compact ids (``UNK`` for ids outside the vocabulary)."""
        get = self._lookup.get
        return np.fromiter((get(int(t), UNK) for t in token_ids), dtype=np.int64)

    def coverage(self, sequences: Iterable[Sequence[int]]) -> float:
        """Fraction of the tokens of ``sequences`` inside the vocabulary (1.0 when empty)."""
        total = hit = 0
        for seq in sequences:
            total += len(seq)
            hit += sum(1 for t in seq if int(t) in self._lookup)
        return hit / total if total else 1.0


def tokenize(
    tokenizer: Any, texts: Sequence[str], max_tokens: int | None = None
) -> list[list[int]]:
    """Each text's tokenizer ids (no special tokens), cut to ``max_tokens`` if given.

    ``tokenizer`` is a Hugging Face tokenizer (anything with
    ``encode(text, add_special_tokens=False)``).
    """
    if max_tokens is not None:
        positive_int(max_tokens, "max_tokens")
    out = []
    for text in texts:
        if not isinstance(text, str):
            raise ValueError(f"texts holds {type(text).__name__} {text!r}; texts must be str")
        ids = list(tokenizer.encode(text, add_special_tokens=False))
        out.append(ids[:max_tokens] if max_tokens is not None else ids)
    return out


def to_sequences(
    token_ids: Sequence[Sequence[int]], vocabulary: Vocabulary, max_tokens: int
) -> list[np.ndarray]:
    """``<bos>`` + the compact ids of each text's first ``max_tokens`` tokens (empty texts
    are dropped: they have nothing to predict)."""
    max_tokens = positive_int(max_tokens, "max_tokens")
    out = []
    for ids in token_ids:
        if len(ids) == 0:
            continue
        body = vocabulary.encode(list(ids)[:max_tokens])
        out.append(np.concatenate([np.array([BOS], dtype=np.int64), body]))
    return out


def batch(sequences: Sequence[np.ndarray]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Right-padded ``(input_ids, attention_mask, labels)``; labels are the inputs shifted by
    one (``labels[:, i]`` is the target at position ``i``), ``IGNORE`` past each end."""
    if not sequences:
        raise ValueError("sequences = []: a batch needs at least one sequence")
    width = max(len(s) for s in sequences)
    ids = torch.full((len(sequences), width), UNK, dtype=torch.long)
    mask = torch.zeros((len(sequences), width), dtype=torch.long)
    labels = torch.full((len(sequences), width), IGNORE, dtype=torch.long)
    for row, seq in enumerate(sequences):
        s = torch.as_tensor(seq, dtype=torch.long)
        ids[row, : len(s)] = s
        mask[row, : len(s)] = 1
        labels[row, : len(s) - 1] = s[1:]
    return ids, mask, labels


def _logits(model: nn.Module, ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    out = model(input_ids=ids, attention_mask=mask)
    return out.logits if hasattr(out, "logits") else out


@dataclass(frozen=True, slots=True)
class Evaluation:
    """Next-token results on held-out text: ``accuracy`` = correct / predictions (OOV
    targets count as misses), ``loss`` = mean cross-entropy (nats) over in-vocabulary targets."""

    accuracy: float
    loss: float
    correct: int
    predictions: int
    oov_targets: int

    def as_dict(self) -> dict[str, float | int]:
        return {
            "accuracy": self.accuracy,
            "loss": self.loss,
            "correct": self.correct,
            "predictions": self.predictions,
            "oov_targets": self.oov_targets,
        }


@torch.no_grad()
def next_token_accuracy(
    model: nn.Module, sequences: Sequence[np.ndarray], batch_size: int = 64
) -> Evaluation:
    """Top-1 next-token accuracy of ``model`` on ``sequences`` (from :func:`to_sequences`).

    ``model(input_ids=, attention_mask=)`` returns logits ``(batch, length, vocab)`` (or an
    object with ``.logits``). A prediction is correct when the arg-max equals the target and the
    target is not ``<unk>``.
    """
    batch_size = positive_int(batch_size, "batch_size")
    was_training = model.training
    model.eval()
    correct = predictions = oov = 0
    loss_sum, loss_count = 0.0, 0
    device = model_device(model)
    for start in range(0, len(sequences), batch_size):
        ids, mask, labels = (t.to(device) for t in batch(sequences[start : start + batch_size]))
        logits = _logits(model, ids, mask).float()
        valid = labels != IGNORE
        known = valid & (labels != UNK)
        predicted = logits.argmax(-1)
        correct += int(((predicted == labels) & known).sum())
        predictions += int(valid.sum())
        oov += int((valid & ~known).sum())
        if bool(known.any()):
            loss_sum += float(
                nn.functional.cross_entropy(logits[known], labels[known], reduction="sum")
            )
            loss_count += int(known.sum())
    model.train(was_training)
    return Evaluation(
        accuracy=correct / predictions if predictions else 0.0,
        loss=loss_sum / loss_count if loss_count else math.nan,
        correct=correct,
        predictions=predictions,
        oov_targets=oov,
    )


@dataclass(frozen=True, kw_only=True)
class LMSpec:
    """A small LLaMA-style causal LM (pre-norm, RoPE, SwiGLU) trained from scratch.

    Attributes:
        vocab_size: the compact vocabulary's size (:attr:`Vocabulary.size`).
        hidden: model width; ``heads`` must divide it.
        layers, heads: decoder blocks and attention heads.
        intermediate: SwiGLU width (default ``4 * hidden``).
        max_positions: longest sequence (``<bos>`` + ``max_tokens``).
    """

    vocab_size: int
    hidden: int = 64
    layers: int = 2
    heads: int = 4
    intermediate: int = 0
    max_positions: int = 65

    def __post_init__(self) -> None:
        require(
            isinstance(self.vocab_size, int) and self.vocab_size >= 3,
            "vocab_size",
            self.vocab_size,
            "an integer >= 3",
        )
        for key in ("hidden", "layers", "heads", "max_positions"):
            positive_int(getattr(self, key), key)
        require(
            self.hidden % self.heads == 0,
            "heads",
            self.heads,
            f"a divisor of hidden = {self.hidden}",
        )
        require(
            isinstance(self.intermediate, int) and self.intermediate >= 0,
            "intermediate",
            self.intermediate,
            "an integer >= 0 (0: 4 * hidden)",
        )

    def build(self, seed: int) -> nn.Module:
        """The model with weights initialised from ``seed`` (global RNG left untouched)."""
        require_extra("the downstream language model", modules=("transformers",))
        from transformers import LlamaConfig, LlamaForCausalLM  # noqa: PLC0415

        config = LlamaConfig(
            vocab_size=self.vocab_size,
            hidden_size=self.hidden,
            intermediate_size=self.intermediate or 4 * self.hidden,
            num_hidden_layers=self.layers,
            num_attention_heads=self.heads,
            num_key_value_heads=self.heads,
            max_position_embeddings=self.max_positions,
            tie_word_embeddings=True,
            bos_token_id=BOS,
            eos_token_id=None,
            pad_token_id=UNK,
        )
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(int(seed))
            model = LlamaForCausalLM(config)
        return model


def lm_arrays(model: nn.Module) -> dict[str, np.ndarray]:
    """The model's trainable parameters as float32 arrays (tied weights once)."""
    return {k: v.detach().cpu().numpy().copy() for k, v in model.named_parameters()}


def load_lm_arrays(model: nn.Module, arrays: Mapping[str, np.ndarray]) -> None:
    """Copy ``arrays`` (as :func:`lm_arrays` writes them) into ``model`` in place."""
    params = dict(model.named_parameters())
    if params.keys() != arrays.keys():
        differing = sorted(set(params) ^ set(arrays))[:5]
        raise ValueError(f"arrays do not match the model's parameters; differing keys: {differing}")
    with torch.no_grad():
        for key, p in params.items():
            p.copy_(torch.tensor(np.asarray(arrays[key]), dtype=p.dtype))


@dataclass(frozen=True, kw_only=True)
class LMTraining:
    """AdamW with linear warm-up and cosine decay, on whole sequences.

    Attributes:
        epochs: passes over the training texts (capped by ``max_steps``).
        batch_size: sequences per step.
        lr: peak learning rate; ``warmup`` is the fraction of steps spent ramping up to it.
        weight_decay: AdamW's.
        max_steps: cap on optimiser steps (0: no cap).
        grad_clip: global gradient-norm clip (0: none).
    """

    epochs: int = 4
    batch_size: int = 16
    lr: float = 3e-3
    warmup: float = 0.05
    weight_decay: float = 0.01
    max_steps: int = 0
    grad_clip: float = 1.0

    def __post_init__(self) -> None:
        positive_int(self.epochs, "epochs")
        positive_int(self.batch_size, "batch_size")
        require(self.lr > 0, "lr", self.lr, "a number > 0")
        require(0 <= self.warmup < 1, "warmup", self.warmup, "a number in [0, 1)")
        require(self.weight_decay >= 0, "weight_decay", self.weight_decay, "a number >= 0")
        require(
            isinstance(self.max_steps, int) and self.max_steps >= 0,
            "max_steps",
            self.max_steps,
            "an integer >= 0 (0: no cap)",
        )
        require(self.grad_clip >= 0, "grad_clip", self.grad_clip, "a number >= 0 (0: none)")

    def steps_for(self, num_sequences: int) -> int:
        per_epoch = -(-num_sequences // self.batch_size)
        total = per_epoch * self.epochs
        return min(total, self.max_steps) if self.max_steps else total


def train_lm(
    model: nn.Module,
    sequences: Sequence[np.ndarray],
    training: LMTraining,
    generator: torch.Generator,
    on_step: Callable[[int, float], None] | None = None,
    on_epoch: Callable[[int, int], None] | None = None,
) -> list[float]:
    """Train ``model`` in place on ``sequences`` (next-token cross-entropy over in-vocabulary
    targets); returns the loss of every step. Batch order comes from ``generator``.
    ``on_epoch(epoch, steps)`` is called after every pass over ``sequences``, the last one
    possibly cut short by ``max_steps`` (it must leave the model's weights as they are)."""
    if not sequences:
        raise ValueError("sequences = []: nothing to train on")
    total = training.steps_for(len(sequences))
    warm = max(1, int(round(training.warmup * total)))

    def schedule(step: int) -> float:
        if step < warm:
            return (step + 1) / warm
        progress = (step - warm) / max(1, total - warm)
        return 0.5 * (1 + math.cos(math.pi * progress))

    optimizer = torch.optim.AdamW(
        model.parameters(), lr=training.lr, weight_decay=training.weight_decay
    )
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, schedule)
    model.train()
    device = model_device(model)  # batches go where the model is
    losses: list[float] = []
    step = epoch = 0
    while step < total:
        order = torch.randperm(len(sequences), generator=generator).tolist()
        for start in range(0, len(order), training.batch_size):
            if step >= total:
                break
            ids, mask, labels = (
                t.to(device)
                for t in batch([sequences[i] for i in order[start : start + training.batch_size]])
            )
            labels = labels.masked_fill(labels == UNK, IGNORE)  # <unk> is never a target
            logits = _logits(model, ids, mask)
            if bool((labels != IGNORE).any()):
                loss = nn.functional.cross_entropy(
                    logits.reshape(-1, logits.shape[-1]), labels.reshape(-1), ignore_index=IGNORE
                )
                optimizer.zero_grad(set_to_none=True)
                loss.backward()
                if training.grad_clip:
                    nn.utils.clip_grad_norm_(model.parameters(), training.grad_clip)
                optimizer.step()
                losses.append(float(loss.detach()))
            scheduler.step()
            step += 1
            if on_step is not None and losses:
                on_step(step, losses[-1])
        epoch += 1
        if on_epoch is not None:
            on_epoch(epoch, step)
    return losses


def torch_generator(seed: int) -> torch.Generator:
    """A CPU ``torch.Generator`` seeded with ``seed``."""
    return torch.Generator().manual_seed(int(seed))


def train_and_evaluate(
    train_sequences: Sequence[np.ndarray],
    eval_sequences: Sequence[np.ndarray],
    spec: LMSpec,
    training: LMTraining,
    seed: int,
    initial: Mapping[str, np.ndarray] | None = None,
    device: str = "cpu",
    on_epoch: Callable[[int, int, nn.Module], None] | None = None,
) -> tuple[Evaluation, dict[str, np.ndarray], list[float]]:
    """Build the model (from ``seed``, or ``initial`` weights) on ``device``, train it on
    ``train_sequences`` and evaluate on ``eval_sequences``; returns (evaluation, final
    weights, step losses). ``on_epoch(epoch, steps, model)`` as in :func:`train_lm`."""
    model = place(spec.build(seed), device)
    if initial is not None:
        load_lm_arrays(model, initial)
    hook = None if on_epoch is None else (lambda epoch, steps: on_epoch(epoch, steps, model))
    losses = train_lm(model, train_sequences, training, torch_generator(seed), on_epoch=hook)
    return next_token_accuracy(model, eval_sequences), lm_arrays(model), losses
