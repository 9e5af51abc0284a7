"""Approximate unlearning of a forget set from a causal LM: gradient ascent, ascent+descent and
random labels.

As compared in minority-aware unlearning (ICML 2025; Jesson-Wei/Minority_Aware_LLM_Unlearning),
after the baselines of Maini et al. ("TOFU", 2024):

* gradient ascent (GA): ``steps`` AdamW steps on ``-L(forget batch)``, i.e. raise the loss of
  the texts to forget;
* ascent+descent (GA+GD, "gradient difference"): steps on ``-L(forget batch) +
  retain_weight * L(retain batch)``, which keeps the loss on the retained data down while the
  forget loss rises;
* random label: descend on the forget texts with every target token replaced by a uniform
  random byte (plus ``retain_weight * L(retain batch)`` when a retain set is given), so the
  model unlearns the texts by fitting noise instead of ascending without bound.

``L`` is the mean token NLL of :func:`fedsim.audits.lm.mean_loss`. The audit then
compares the forget set's MIA AUC (forget vs unseen texts of the same kind) after unlearning
with that of a model retrained without the forget set, the gold standard (AUC near 0.5).
Gradient ascent has no natural end; ``stop_at_loss`` stops it once the forget set's loss
reaches a target (such as the loss on unseen texts of the same kind).
SCRUB (teacher-student distillation) is not implemented here.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from fedsim.audits.lm import batch_tensors, max_len_of, mean_loss, sequence_losses

METHODS = ("gradient_ascent", "ascent_descent", "random_label")


def _batches(n: int, batch_size: int, generator: torch.Generator):
    order, cursor = torch.randperm(n, generator=generator), 0
    while True:
        if cursor >= n:
            order, cursor = torch.randperm(n, generator=generator), 0
        yield order[cursor : cursor + batch_size].tolist()
        cursor += batch_size


def _random_label_loss(
    model: nn.Module, texts: Sequence[str], generator: torch.Generator
) -> torch.Tensor:
    """Mean NLL of ``texts``' inputs against uniform random byte targets (padding masked)."""
    ids, mask = batch_tensors(texts, max_len_of(model))
    noisy = torch.randint(0, 256, ids.shape, generator=generator)
    return sequence_losses(model, ids, mask, noisy).sum() / mask[:, 1:].sum()


def unlearn(
    model: nn.Module,
    forget: Sequence[str],
    *,
    method: str,
    steps: int,
    lr: float = 1e-3,
    batch_size: int = 16,
    retain: Sequence[str] = (),
    retain_weight: float = 1.0,
    stop_at_loss: float | None = None,
    generator: torch.Generator,
) -> list[float]:
    """Unlearn ``forget`` from ``model`` in place; returns the forget-batch loss per step.

    ``stop_at_loss``: stop early once the mean NLL of the whole forget set reaches this value
    (e.g. the model's NLL on unseen texts of the same kind, where a retrained model would be),
    instead of ascending without bound.
    """
    if method not in METHODS:
        raise ValueError(f"method = {method!r} is not allowed: one of {', '.join(METHODS)}")
    if steps < 1 or not forget:
        raise ValueError(f"steps = {steps} must be >= 1 and forget must hold texts")
    if method == "ascent_descent" and not retain:
        raise ValueError("retain must hold texts for ascent_descent (the descent term)")
    model.train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    forget_batches = _batches(len(forget), batch_size, generator)
    retain_batches = _batches(len(retain), batch_size, generator) if retain else None
    history = []
    for _ in range(steps):
        optimizer.zero_grad(set_to_none=True)
        batch = [forget[i] for i in next(forget_batches)]
        if method == "random_label":
            with torch.no_grad():
                forget_loss = mean_loss(model, batch)
            objective = _random_label_loss(model, batch, generator)
        else:
            forget_loss = mean_loss(model, batch)
            objective = -forget_loss
        if method == "ascent_descent" or (method == "random_label" and retain):
            retain_loss = mean_loss(model, [retain[i] for i in next(retain_batches)])
            objective = objective + retain_weight * retain_loss
        objective.backward()
        optimizer.step()
        history.append(float(forget_loss.detach()))
        if stop_at_loss is not None:
            with torch.no_grad():
                if float(mean_loss(model, forget)) >= stop_at_loss:
                    break
    return history
