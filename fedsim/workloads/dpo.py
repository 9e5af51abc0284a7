"""Direct Preference Optimisation with a LoRA adapter, written out (no TRL).

DPO (Rafailov et al., "Direct Preference Optimization: Your Language Model is Secretly a
Reward Model", NeurIPS 2023, eq. 7) fits a policy ``pi_theta`` to preference pairs
``(x, y_w, y_l)`` (``y_w`` preferred) against a frozen reference ``pi_ref``:

    L = -log sigmoid( beta * [ (log pi_theta(y_w|x) - log pi_ref(y_w|x))
                               - (log pi_theta(y_l|x) - log pi_ref(y_l|x)) ] )

with ``log pi(y|x)`` summed over the completion's tokens
(:func:`sequence_logprobs`). POPri (Hou et al., ICML 2025,
Sec. 3.2 and App. C) uses the sigmoid loss with ``beta = 0.01``, LoRA (Hu et al., ICLR 2022)
of rank 16 and alpha 16 on the attention and MLP projections, one epoch per round, a cosine
learning-rate schedule and batches of 24 pairs; the reference model is the base model, i.e.
the same network with the adapter disabled, and the adapter keeps training across rounds.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch import nn

from fedsim.config import require
from fedsim.extras import require_extra
from fedsim.models import model_device
from fedsim.workloads.text_models import check_texts

#: LLaMA's attention and MLP projections (where POPri puts its LoRA adapters).
LLAMA_PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


@dataclass(frozen=True)
class PreferencePair:
    """One preference: ``chosen`` is preferred to ``rejected`` as a completion of ``prompt``."""

    prompt: str
    chosen: str
    rejected: str


@dataclass(frozen=True, kw_only=True)
class DPOSettings:
    """The DPO step of one round (defaults: POPri's App. C, except the learning rate, which
    is sized for a few steps per round on a CPU; the paper uses 8e-7 over thousands).

    Attributes:
        beta: DPO's inverse temperature, > 0.
        lr: peak learning rate of AdamW (cosine decay to 0 over the round's steps).
        batch_size: pairs per optimiser step.
        epochs: passes over the round's pairs.
        lora_rank, lora_alpha, lora_dropout: the LoRA adapter (created once, kept across rounds).
        target_modules: module names that get adapters.
        max_grad_norm: gradient clipping of the adapter's parameters (0: none).
    """

    beta: float = 0.01
    lr: float = 5e-4
    batch_size: int = 24
    epochs: int = 1
    lora_rank: int = 16
    lora_alpha: float = 16.0
    lora_dropout: float = 0.0
    target_modules: tuple[str, ...] = LLAMA_PROJECTIONS
    max_grad_norm: float = 1.0

    def __post_init__(self) -> None:
        require(self.beta > 0, "dpo.beta", self.beta, "a number > 0")
        require(self.lr > 0, "dpo.lr", self.lr, "a number > 0")
        require(self.batch_size >= 1, "dpo.batch_size", self.batch_size, "an integer >= 1")
        require(self.epochs >= 1, "dpo.epochs", self.epochs, "an integer >= 1")
        require(self.lora_rank >= 1, "dpo.lora_rank", self.lora_rank, "an integer >= 1")
        require(self.lora_alpha > 0, "dpo.lora_alpha", self.lora_alpha, "a number > 0")
        require(
            0 <= self.lora_dropout < 1, "dpo.lora_dropout", self.lora_dropout, "a number in [0, 1)"
        )
        require(
            len(self.target_modules) > 0,
            "dpo.target_modules",
            self.target_modules,
            "at least one module name",
        )
        require(self.max_grad_norm >= 0, "dpo.max_grad_norm", self.max_grad_norm, "a number >= 0")
        object.__setattr__(self, "target_modules", tuple(self.target_modules))


def dpo_loss(
    policy_chosen: torch.Tensor,
    policy_rejected: torch.Tensor,
    reference_chosen: torch.Tensor,
    reference_rejected: torch.Tensor,
    beta: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The sigmoid DPO loss (mean over pairs) and each pair's implicit-reward margin
    ``beta * (log-ratio(chosen) - log-ratio(rejected))``; inputs are ``(n,)`` sequence
    log-probabilities."""
    if not beta > 0:
        raise ValueError(f"beta = {beta!r} is not allowed: a number > 0")
    margins = beta * ((policy_chosen - reference_chosen) - (policy_rejected - reference_rejected))
    return -torch.nn.functional.logsigmoid(margins).mean(), margins.detach()


def add_lora(model: nn.Module, settings: DPOSettings, seed: int) -> nn.Module:
    """``model`` wrapped in a peft ``PeftModel`` with one trainable LoRA adapter (B = 0, so
    the policy starts equal to the base model; A's initialisation drawn from ``seed``).
    Only the adapter's parameters are trainable."""
    require_extra("POPri's DPO fine-tuning", modules=("peft",))
    from peft import LoraConfig, get_peft_model

    config = LoraConfig(
        r=settings.lora_rank,
        lora_alpha=settings.lora_alpha,
        lora_dropout=settings.lora_dropout,
        target_modules=list(settings.target_modules),
        bias="none",
        task_type="CAUSAL_LM",
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        peft_model = get_peft_model(model, config)
    return peft_model


def pair_logprobs(
    model: nn.Module, tokenizer: Any, pairs: Sequence[PreferencePair]
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(log pi(chosen|prompt), log pi(rejected|prompt))`` for each pair, in one forward
    pass over the ``2n`` sequences."""
    prompts = [p.prompt for p in pairs]
    both = sequence_logprobs(
        model, tokenizer, prompts + prompts, [p.chosen for p in pairs] + [p.rejected for p in pairs]
    )
    return both[: len(pairs)], both[len(pairs) :]


@torch.no_grad()
def reference_logprobs(
    model: nn.Module, tokenizer: Any, pairs: Sequence[PreferencePair], batch_size: int = 24
) -> tuple[torch.Tensor, torch.Tensor]:
    """The reference model's log-probabilities: ``model`` (a ``PeftModel``) with its adapter
    disabled, i.e. the base model."""
    chosen, rejected = [], []
    with model.disable_adapter():
        for start in range(0, len(pairs), batch_size):
            c, r = pair_logprobs(model, tokenizer, pairs[start : start + batch_size])
            chosen.append(c)
            rejected.append(r)
    return torch.cat(chosen), torch.cat(rejected)


def cosine_lr(step: int, total: int, peak: float) -> float:
    """Cosine decay from ``peak`` at step 0 to 0 after ``total`` steps."""
    return peak * 0.5 * (1.0 + math.cos(math.pi * step / max(total, 1)))


def train_dpo(
    model: nn.Module,
    tokenizer: Any,
    pairs: Sequence[PreferencePair],
    settings: DPOSettings,
    *,
    seed: int,
) -> dict[str, float]:
    """One round of DPO on ``pairs``: ``settings.epochs`` passes in batches (order shuffled
    with ``seed``), AdamW on the adapter only, cosine learning rate over the round's steps.

    ``model`` is a ``PeftModel`` (:func:`add_lora`); its adapter is updated in place, so it
    carries over to the next round. Returns the mean loss, the mean reward margin and the
    fraction of pairs whose margin is positive (reward accuracy), all before each step, and
    the number of steps.
    """
    require(len(pairs) > 0, "pairs", len(pairs), "at least one preference pair")
    require(hasattr(model, "disable_adapter"), "model", type(model).__name__, "a peft PeftModel")
    ref_chosen, ref_rejected = reference_logprobs(model, tokenizer, pairs, settings.batch_size)
    params = [p for p in model.parameters() if p.requires_grad]
    require(len(params) > 0, "model", type(model).__name__, "a model with a trainable adapter")
    optimiser = torch.optim.AdamW(params, lr=settings.lr, weight_decay=0.0)
    rng = np.random.default_rng(np.random.SeedSequence([seed, len(pairs)]))
    steps_per_epoch = -(-len(pairs) // settings.batch_size)
    total = steps_per_epoch * settings.epochs
    losses, margins, correct, seen = [], [], 0, 0
    was_training = model.training
    model.train()
    step = 0
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)  # LoRA dropout, if any
        for _ in range(settings.epochs):
            order = rng.permutation(len(pairs))
            for start in range(0, len(pairs), settings.batch_size):
                index = order[start : start + settings.batch_size]
                batch = [pairs[i] for i in index]
                chosen, rejected = pair_logprobs(model, tokenizer, batch)
                idx = torch.as_tensor(index, device=ref_chosen.device)
                loss, margin = dpo_loss(
                    chosen, rejected, ref_chosen[idx], ref_rejected[idx], settings.beta
                )
                for group in optimiser.param_groups:
                    group["lr"] = cosine_lr(step, total, settings.lr)
                optimiser.zero_grad(set_to_none=True)
                loss.backward()
                if settings.max_grad_norm > 0:
                    torch.nn.utils.clip_grad_norm_(params, settings.max_grad_norm)
                optimiser.step()
                step += 1
                losses.append(float(loss.detach()) * len(batch))
                margins.append(float(margin.sum()))
                correct += int((margin > 0).sum())
                seen += len(batch)
    model.train(was_training)
    return {
        "dpo_loss": sum(losses) / seen,
        "dpo_margin": sum(margins) / seen,
        "dpo_reward_accuracy": correct / seen,
        "dpo_steps": float(step),
    }


def sequence_logprobs(
    model: nn.Module, tokenizer: Any, prompts: list[str], completions: list[str]
) -> torch.Tensor:
    """``log pi(completion_i | prompt_i)``: the sum of the model's token log-probabilities over
    the completion's tokens only (the prompt's are context), shape ``(n,)``.

    Prompt and completion are tokenised separately (no special tokens) and concatenated,
    so the completion's tokens are the same whatever the prompt; a non-empty completion is
    preceded by a space, as it follows "Sample k:" in a prompt. Rows are left-padded with
    position ids counted from each row's first real token (as in generation), so every row
    ends at the same position and only the last ``max completion length + 1`` positions go
    through the output layer (``logits_to_keep``), which keeps the ``(rows, positions,
    vocabulary)`` logits small. Differentiable: gradients flow when the model is trainable.
    Inputs are built on the model's device; the result lives there too.
    """
    prompts, completions = (
        check_texts(prompts, "prompts"),
        check_texts(completions, "completions"),
    )
    if len(prompts) != len(completions):
        raise ValueError(
            f"completions has {len(completions)} entries; it must have one per prompt "
            f"({len(prompts)})"
        )
    if not prompts:
        return torch.zeros(0)
    prompt_ids = tokenizer(prompts, add_special_tokens=False)["input_ids"]
    if any(len(p) == 0 for p in prompt_ids):
        raise ValueError("prompts contains an empty prompt: every completion needs a context")
    completion_ids = tokenizer(
        [" " + c if c else c for c in completions], add_special_tokens=False
    )["input_ids"]
    rows = [p + c for p, c in zip(prompt_ids, completion_ids, strict=True)]
    width = max(len(r) for r in rows)
    span = max(1, max(len(c) for c in completion_ids))  # target positions kept per row
    ids = torch.full((len(rows), width), tokenizer.pad_token_id, dtype=torch.long)
    attention = torch.zeros((len(rows), width), dtype=torch.long)
    scored = torch.zeros((len(rows), span), dtype=torch.bool)
    for i, (row, c) in enumerate(zip(rows, completion_ids, strict=True)):
        ids[i, width - len(row) :] = torch.tensor(row, dtype=torch.long)
        attention[i, width - len(row) :] = 1
        if c:
            scored[i, span - len(c) :] = True
    device = model_device(model)
    ids, attention, scored = ids.to(device), attention.to(device), scored.to(device)
    positions = (attention.cumsum(dim=1) - 1).clamp_min(0)
    logits = model(
        input_ids=ids, attention_mask=attention, position_ids=positions, logits_to_keep=span + 1
    ).logits[:, :-1]  # position t predicts token t + 1
    targets = ids[:, width - span :]
    logits = logits.float()
    picked = logits.gather(-1, targets.unsqueeze(-1)).squeeze(-1) - torch.logsumexp(logits, -1)
    return (picked * scored).sum(dim=1)
