"""MARS: variance reduction for adaptive optimisers (Yuan et al., ICML 2025, Alg. 1-2).

For every parameter tensor of two or more dimensions, at step ``t``::

    c_t = g_t + gamma * beta1 / (1 - beta1) * (g_t - g_{t-1})      (scaled gradient correction)
    c_t <- c_t / ||c_t||   if ||c_t|| > 1                           (per tensor)
    m_t = beta1 * m_{t-1} + (1 - beta1) * c_t

then ``mars-adamw``: ``v_t = beta2 v_{t-1} + (1 - beta2) c_t^2`` and the AdamW
step ``x <- x (1 - lr wd) - lr * (m_t / (1 - beta1^t)) / (sqrt(v_t / (1 - beta2^t)) + eps)``;
``mars-lion``: ``x <- x (1 - lr wd) - lr * sign(m_t)`` (as in AGI-Arena/MARS).
This is MARS-approx: ``g_{t-1}`` is the previous step's gradient (on its own
batch). Vectors and scalars (biases, norms) fall back to AdamW on the raw
gradient with ``betas_1d``, ``lr_1d`` and ``weight_decay_1d``, unless
``optimize_1d``.

Defaults: lr 3e-3, betas (0.95, 0.99), gamma 0.025, eps 1e-8; 1-D: betas
(0.9, 0.95), weight decay 0.1, lr = ``lr`` (the reference code's values).

With ``gamma = 0`` and every ``||g_t|| <= 1`` this is exactly AdamW; larger
gradients are clipped, which AdamW does not do.

**First step and new global models.** At the first step there is no earlier
gradient, so ``g_0 = g_1`` (no correction; the reference code uses
``g_0 = 0``, which inflates the first step by ``1 + gamma beta1/(1-beta1)``).
On a federated client the optimiser is created afresh for each round, so
``g_{t-1}`` (and the moments) reset whenever a new global model arrives: the
correction ``g_t - g_{t-1}`` estimates the gradient change between two nearby
iterates, which the jump to a new global model is not.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from typing import Any

import torch

VARIANTS = ("mars-adamw", "mars-lion")


class MARS(torch.optim.Optimizer):
    """MARS-AdamW / MARS-Lion (see the module docstring)."""

    def __init__(
        self,
        params: Iterable[Any],
        lr: float = 3e-3,
        betas: tuple[float, float] = (0.95, 0.99),
        eps: float = 1e-8,
        weight_decay: float = 0.0,
        gamma: float = 0.025,
        variant: str = "mars-adamw",
        optimize_1d: bool = False,
        lr_1d: float | None = None,
        betas_1d: tuple[float, float] = (0.9, 0.95),
        weight_decay_1d: float = 0.1,
    ) -> None:
        if lr <= 0:
            raise ValueError(f"lr = {lr!r} is not allowed: a number > 0")
        for name, pair in (("betas", betas), ("betas_1d", betas_1d)):
            if len(pair) != 2 or not all(0 <= b < 1 for b in pair):
                raise ValueError(f"{name} = {pair!r} is not allowed: two numbers in [0, 1)")
        if eps <= 0:
            raise ValueError(f"eps = {eps!r} is not allowed: a number > 0")
        if weight_decay < 0 or weight_decay_1d < 0:
            raise ValueError(
                f"weight_decay = {weight_decay!r}, weight_decay_1d = {weight_decay_1d!r}: "
                "both must be >= 0"
            )
        if gamma < 0:
            raise ValueError(f"gamma = {gamma!r} is not allowed: a number >= 0")
        if variant not in VARIANTS:
            raise ValueError(f"variant = {variant!r} is not allowed: one of {VARIANTS}")
        if lr_1d is not None and lr_1d <= 0:
            raise ValueError(f"lr_1d = {lr_1d!r} is not allowed: a number > 0 (or None: lr)")
        defaults = dict(
            lr=lr,
            betas=tuple(betas),
            eps=eps,
            weight_decay=weight_decay,
            gamma=gamma,
            variant=variant,
            optimize_1d=optimize_1d,
            lr_1d=lr_1d,
            betas_1d=tuple(betas_1d),
            weight_decay_1d=weight_decay_1d,
        )
        super().__init__(params, defaults)

    @torch.no_grad()
    def step(self, closure: Callable[[], torch.Tensor] | None = None) -> torch.Tensor | None:
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                if p.grad.is_sparse:
                    raise RuntimeError("MARS does not support sparse gradients")
                state = self.state[p]
                if not state:
                    state["step"] = 0
                    state["exp_avg"] = torch.zeros_like(p)
                    state["exp_avg_sq"] = torch.zeros_like(p)
                    state["last_grad"] = p.grad.detach().clone()
                state["step"] += 1
                if p.dim() >= 2 or group["optimize_1d"]:
                    self._mars_update(p, state, group)
                else:
                    lr = group["lr_1d"] if group["lr_1d"] is not None else group["lr"]
                    _adamw_update(
                        p,
                        p.grad,
                        state,
                        lr,
                        group["betas_1d"],
                        group["eps"],
                        group["weight_decay_1d"],
                    )
        return loss

    @staticmethod
    def _mars_update(p: torch.Tensor, state: dict[str, Any], group: dict[str, Any]) -> None:
        grad = p.grad
        beta1, _ = group["betas"]
        scale = group["gamma"] * beta1 / (1.0 - beta1)
        c = grad + scale * (grad - state["last_grad"]) if scale else grad.clone()
        norm = torch.linalg.vector_norm(c)
        if norm > 1.0:
            c = c / norm
        state["last_grad"].copy_(grad)
        if group["variant"] == "mars-adamw":
            _adamw_update(
                p, c, state, group["lr"], group["betas"], group["eps"], group["weight_decay"]
            )
            return
        exp_avg = state["exp_avg"]
        exp_avg.mul_(beta1).add_(c, alpha=1.0 - beta1)
        p.mul_(1.0 - group["lr"] * group["weight_decay"])
        p.add_(exp_avg.sign(), alpha=-group["lr"])


def _adamw_update(
    p: torch.Tensor,
    direction: torch.Tensor,
    state: dict[str, Any],
    lr: float,
    betas: tuple[float, float],
    eps: float,
    weight_decay: float,
) -> None:
    """AdamW (Loshchilov and Hutter 2019) with moments on ``direction``."""
    beta1, beta2 = betas
    step = state["step"]
    exp_avg, exp_avg_sq = state["exp_avg"], state["exp_avg_sq"]
    exp_avg.lerp_(direction, 1.0 - beta1)
    exp_avg_sq.mul_(beta2).addcmul_(direction, direction, value=1.0 - beta2)
    bias_correction1 = 1.0 - beta1**step
    bias_correction2 = 1.0 - beta2**step
    p.mul_(1.0 - lr * weight_decay)
    denom = (exp_avg_sq.sqrt() / math.sqrt(bias_correction2)).add_(eps)
    p.addcdiv_(exp_avg, denom, value=-lr / bias_correction1)
