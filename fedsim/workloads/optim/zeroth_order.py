"""Adaptive zeroth-order optimisers: R-AdaZO (ICML 2025) and ZO-AdaMM (Chen et al., 2019).

Forward-only: ``step(closure)`` evaluates the loss ``f`` at ``x`` and at ``q``
perturbed points and never calls ``backward``. With Gaussian directions
``u_i ~ N(0, I)`` over all parameters jointly::

    g_hat = (1/q) * sum_i (f(x + mu u_i) - f(x)) / mu * u_i
    m = beta1 * m + (1 - beta1) * g_hat
    v = beta2 * v + (1 - beta2) * m^2        (R-AdaZO: the variance-reduced m)
    v = beta2 * v + (1 - beta2) * g_hat^2    (ZO-AdaMM)
    x = x - lr * m / (sqrt(v) + eps)

(R-AdaZO's eqs. for the first and refined second moment.) With i.i.d.
estimates the first moment has ``Var(m) / Var(g_hat) -> (1 - beta1) / (1 + beta1)``,
the variance reduction R-AdaZO builds on. Defaults: lr 1e-3, betas
(0.9, 0.999), mu 5e-3, q 2, eps 1e-8. The directions come from the
``torch.Generator`` passed in. ``state[p]["grad_estimate"]`` keeps the last ``g_hat``.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch


class _AdaptiveZO(torch.optim.Optimizer):
    refined = False  # second moment on m (R-AdaZO) or on g_hat (ZO-AdaMM)
    zeroth_order = True  # step(closure) needs only forward passes

    def __init__(
        self,
        params: Iterable[Any],
        *,
        generator: torch.Generator,
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        mu: float = 5e-3,
        q: int = 2,
        eps: float = 1e-8,
    ) -> None:
        if not isinstance(generator, torch.Generator):
            raise ValueError(f"generator = {generator!r} is not allowed: a torch.Generator")
        if lr <= 0:
            raise ValueError(f"lr = {lr!r} is not allowed: a number > 0")
        if len(betas) != 2 or not all(0 <= b < 1 for b in betas):
            raise ValueError(f"betas = {betas!r} is not allowed: two numbers in [0, 1)")
        if mu <= 0:
            raise ValueError(f"mu = {mu!r} is not allowed: a number > 0")
        if q < 1:
            raise ValueError(f"q = {q!r} is not allowed: an integer >= 1")
        if eps <= 0:
            raise ValueError(f"eps = {eps!r} is not allowed: a number > 0")
        super().__init__(params, dict(lr=lr, betas=tuple(betas), mu=mu, q=q, eps=eps))
        self.generator = generator

    @torch.no_grad()
    def step(self, closure: Callable[[], torch.Tensor] | None = None) -> torch.Tensor:
        """One update; ``closure`` returns the loss at the current parameters."""
        if closure is None:
            raise ValueError("closure = None is not allowed: zeroth-order steps evaluate the loss")
        for group in self.param_groups:
            params = [p for p in group["params"] if p.requires_grad]
            mu, q = group["mu"], group["q"]
            origin = [p.detach().clone() for p in params]
            base = float(closure())
            estimate = [torch.zeros_like(p) for p in params]
            for _ in range(q):
                directions = [
                    torch.randn(p.shape, generator=self.generator, dtype=p.dtype).to(p.device)
                    for p in params
                ]
                for p, x, u in zip(params, origin, directions, strict=True):
                    p.copy_(x + mu * u)
                scale = (float(closure()) - base) / (mu * q)
                for e, u in zip(estimate, directions, strict=True):
                    e.add_(u, alpha=scale)
            beta1, beta2 = group["betas"]
            for p, x, g in zip(params, origin, estimate, strict=True):
                p.copy_(x)
                state = self.state[p]
                if not state:
                    state["step"] = 0
                    state["exp_avg"] = torch.zeros_like(p)
                    state["exp_avg_sq"] = torch.zeros_like(p)
                state["step"] += 1
                state["grad_estimate"] = g
                m, v = state["exp_avg"], state["exp_avg_sq"]
                m.mul_(beta1).add_(g, alpha=1.0 - beta1)
                second = m if self.refined else g
                v.mul_(beta2).addcmul_(second, second, value=1.0 - beta2)
                p.addcdiv_(m, v.sqrt().add_(group["eps"]), value=-group["lr"])
        return torch.as_tensor(base)


class RAdaZO(_AdaptiveZO):
    """R-AdaZO: second moment of the variance-reduced first moment (module docstring)."""

    refined = True


class ZOAdaMM(_AdaptiveZO):
    """ZO-AdaMM: Adam moments on the raw zeroth-order estimate (module docstring)."""

    refined = False
