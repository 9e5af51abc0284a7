"""HDM-HB: hypergradient descent with heavy-ball momentum, monotone (Gao, Chu, Ye, Udell 2025).

"Gradient Methods with Online Scaling" (parts I and II; udellgroup/osgm-best-hypergrad,
``algorithms/hdm.py``). At iterate ``x`` with gradient ``g`` and previous iterate
``x_prev`` the trial point is::

    x~ = x - P * g + beta * (x - x_prev)           (P: diagonal step sizes, beta: momentum)

and the stepsizes follow AdaGrad on the hypergradients of the relative progress
``f(x~) / ||g||^2``::

    h_P    = -grad f(x~) * g / (||g||^2 + e)              d/dP    of f(x~), normalised
    h_beta = <grad f(x~), x - x_prev> / (||g||^2 + e)     d/dbeta of f(x~), normalised
    G += h_P^2;   P    <- max(P - lr * h_P / sqrt(G), 0)
    Gm += h_beta^2; beta <- clip(beta - beta_lr * h_beta / sqrt(Gm), 0, beta_max)

The trial is accepted only if ``f(x~) < f(x)`` (a *null step* otherwise: ``x`` stays and the
momentum term becomes zero, ``x_prev <- x``), so ``f`` never increases. ``P`` starts at 0 and
``beta`` at 0.95; ``lr`` decays by 0.8 every 50 steps until a curvature estimate
``L = mean ||grad f(x~) - g|| / ||x~ - x||`` over accepted steps is available (after
``curvature_steps`` net accepted steps), then ``lr = 1 / L``, ``G`` restarts and
``e = ||x - x_prev||^2 L^2 / 4`` damps the hypergradient near convergence (the reference's
convex setting). A non-finite trial loss is a null step that halves ``P``.

Full batch: ``step(closure)`` needs a closure that zeroes the gradients, evaluates the
*whole* objective, calls ``backward`` and returns the loss; it is called once per step (twice
on the first) and ``step`` returns the loss at the accepted iterate. A fresh optimiser's
first trial is ``x`` itself (``P = 0``, no momentum yet): a null step that only learns ``P``.
All parameters share one ``beta`` and one ``||g||`` (the iterate is their concatenation).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from typing import Any

import torch


class HDMHB(torch.optim.Optimizer):
    """Monotone hypergradient descent with heavy ball (see the module docstring)."""

    def __init__(
        self,
        params: Iterable[Any],
        lr: float = 0.1,
        beta_lr: float = 1.0,
        beta0: float = 0.95,
        beta_max: float = 0.9995,
        decay_every: int = 50,
        decay: float = 0.8,
        curvature_steps: int = 20,
    ) -> None:
        for key, value, ok, allowed in (
            ("lr", lr, lr > 0, "a number > 0"),
            ("beta_lr", beta_lr, beta_lr >= 0, "a number >= 0"),
            ("beta_max", beta_max, 0 <= beta_max < 1, "a number in [0, 1)"),
            ("beta0", beta0, 0 <= beta0 <= beta_max, "a number in [0, beta_max]"),
            ("decay_every", decay_every, decay_every >= 1, "an integer >= 1"),
            ("decay", decay, 0 < decay <= 1, "a number in (0, 1]"),
            ("curvature_steps", curvature_steps, curvature_steps >= 1, "an integer >= 1"),
        ):
            if not ok:
                raise ValueError(f"HDMHB {key}={value!r}: expected {allowed}")
        defaults = dict(
            lr=lr,
            beta_lr=beta_lr,
            beta0=beta0,
            beta_max=beta_max,
            decay_every=decay_every,
            decay=decay,
            curvature_steps=curvature_steps,
        )
        super().__init__(params, defaults)
        if len(self.param_groups) != 1:
            raise ValueError(
                f"HDMHB params: {len(self.param_groups)} groups given; expected one group "
                "(the iterate is the concatenation of all parameters)"
            )

    def _params(self) -> list[torch.Tensor]:
        return list(self.param_groups[0]["params"])

    def _evaluate(self, closure: Callable[[], Any]) -> tuple[float, list[torch.Tensor]]:
        with torch.enable_grad():
            value = closure()
        loss = float(value.detach() if isinstance(value, torch.Tensor) else value)
        grads = [
            torch.zeros_like(p) if p.grad is None else p.grad.detach().clone()
            for p in self._params()
        ]
        return loss, grads

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> torch.Tensor:  # type: ignore[override]
        """One HDM-HB trial (accepted only if the loss decreases); returns the current loss."""
        if closure is None:
            raise ValueError("HDMHB.step closure=None: expected a full-batch loss closure")
        params = self._params()
        group = self.param_groups[0]
        hyper = self.state[params[0]]
        if "fx" not in hyper:
            self._first_state(closure, params, group, hyper)
        states = [self.state[p] for p in params]
        x = [p.detach().clone() for p in params]
        g = [s["grad"] for s in states]
        momentum = [xi - s["x_prev"] for xi, s in zip(x, states, strict=True)]
        beta = hyper["beta"]
        for p, xi, gi, mi, s in zip(params, x, g, momentum, states, strict=True):
            p.copy_(xi - s["P"] * gi + beta * mi)
        trial_f, trial_g = self._evaluate(closure)
        grad_sq = float(sum((gi * gi).sum() for gi in g))
        guessed = not math.isnan(hyper["L"])
        momentum_sq = float(sum((mi * mi).sum() for mi in momentum))
        damping = 0.25 * momentum_sq * hyper["L"] ** 2 if guessed else 1e-12
        scale = grad_sq + damping
        finite = math.isfinite(trial_f)
        if finite:
            _learn_steps(g, trial_g, momentum, states, hyper, group, scale)
        else:
            for s in states:
                s["P"].mul_(0.5)
        hyper["steps"] += 1
        if not guessed and hyper["steps"] % group["decay_every"] == group["decay_every"] - 1:
            hyper["lr"] = max(hyper["lr"] * group["decay"], hyper["lr_start"] * 1e-3)
        for xi, s in zip(x, states, strict=True):
            s["x_prev"] = xi
        if finite and trial_f < hyper["fx"]:
            _accept(params, x, g, (trial_f, trial_g), states, hyper)
        else:
            for p, xi in zip(params, x, strict=True):
                p.copy_(xi)
            hyper["monotone"] = max(hyper["monotone"] - 2, 0)
        for p, s in zip(params, states, strict=True):
            p.grad = s["grad"].clone()
        if (
            not guessed
            and hyper["monotone"] > group["curvature_steps"]
            and hyper["curvature_count"] > 0
        ):
            hyper["L"] = hyper["curvature_sum"] / hyper["curvature_count"]
            hyper["lr"] = hyper["lr_start"] = 1.0 / hyper["L"]
            for s in states:
                s["G"].zero_()
        return torch.tensor(hyper["fx"], dtype=torch.float64)

    def _first_state(
        self, closure: Callable[[], Any], params: list, group: dict, hyper: dict
    ) -> None:
        """The first call: the loss and gradients at the start, zero preconditioner and
        accumulators, the starting hyper-parameters."""
        fx, grads = self._evaluate(closure)
        for p, g in zip(params, grads, strict=True):
            self.state[p].update(
                grad=g,
                x_prev=p.detach().clone(),
                P=torch.zeros_like(p),
                G=torch.zeros_like(p),
            )
        hyper.update(
            fx=fx,
            beta=group["beta0"],
            Gm=0.0,
            lr=group["lr"],
            lr_start=group["lr"],
            steps=0,
            monotone=0,
            curvature_sum=0.0,
            curvature_count=0,
            L=math.nan,
        )

    @property
    def beta(self) -> float:
        """The current momentum coefficient (``beta0`` before the first step)."""
        params = self._params()
        return float(self.state[params[0]].get("beta", self.param_groups[0]["beta0"]))


def _accept(
    params: list, x: list, g: list, trial: tuple[float, list], states: list, hyper: dict
) -> None:
    """Keep the trial point (its loss and gradients ``trial``), and add the secant
    curvature of the step (gradient change / step length) to the estimate of L."""
    trial_f, trial_g = trial
    step_norm = math.sqrt(
        sum(float(((p - xi) ** 2).sum()) for p, xi in zip(params, x, strict=True))
    )
    if step_norm > 1e-3:
        change = math.sqrt(
            sum(float(((ti - gi) ** 2).sum()) for ti, gi in zip(trial_g, g, strict=True))
        )
        hyper["curvature_sum"] += change / step_norm
        hyper["curvature_count"] += 1
    hyper["fx"] = trial_f
    for ti, s in zip(trial_g, states, strict=True):
        s["grad"] = ti
    hyper["monotone"] += 1


def _learn_steps(
    g: list, trial_g: list, momentum: list, states: list, hyper: dict, group: dict, scale: float
) -> None:
    """After a finite trial: one AdaGrad step on the diagonal preconditioner ``P`` and on
    the momentum ``beta`` (clipped to ``[0, beta_max]``), along the hypergradients of the
    trial loss (normalised by ``scale``)."""
    for gi, ti, s in zip(g, trial_g, states, strict=True):
        h_p = -ti * gi / scale
        s["G"].add_(h_p * h_p)
        s["P"].sub_(hyper["lr"] * h_p / (s["G"].sqrt() + 1e-12)).clamp_(min=0.0)
    h_beta = float(sum((ti * mi).sum() for ti, mi in zip(trial_g, momentum, strict=True)))
    h_beta /= scale
    hyper["Gm"] += h_beta * h_beta
    beta = hyper["beta"] - group["beta_lr"] * h_beta / (math.sqrt(hyper["Gm"]) + 1e-12)
    hyper["beta"] = min(max(beta, 0.0), group["beta_max"])
