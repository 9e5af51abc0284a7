"""Smoothed primal-dual training under linear inequality constraints ``A w <= b``.

The single-loop smoothed (proximal) linearised augmented-Lagrangian method of Huang, Zhang
and Alacaoglu (ICML 2025, arXiv 2504.07607), built on Zhang & Luo's smoothed proximal ALM.
For ``min f(w) s.t. A w <= b, w in X`` (``X`` a box, possibly all of R^n) and the function

    K(w, z; y) = f(w) + y^T (A w - b) + (rho/2) ||[A w - b]_+||^2 + (p/2) ||w - z||^2,

one step with one (stochastic) gradient ``g ~ grad f(w)`` is::

    y+ = [y + alpha (A w - b)]_+                              (projected dual ascent, y >= 0)
    w+ = proj_X(w - c (g + A^T (y+ + rho [A w - b]_+) + p (w - z)))    (= w - c grad_w K)
    z+ = z + beta (w+ - z)                                    (smoothing / proximal centre)

The proximal centre ``z`` is what makes the dual update stable without increasing
penalties (the "smoothing"); ``rho`` (default 0) adds an exact-penalty term that vanishes on
the feasible set, so it does not move the solution. The paper's text was not available here;
this is the Zhang & Luo form the brief states, with the dual projected onto ``y >= 0`` for
inequalities. Defaults c 0.05, alpha 0.5, beta 0.5, p 1: for a convex QP with exact gradients
(``c`` below ``1 / (L + p)``) the iterates converge to the KKT point.

:class:`SmoothedPrimalDual` is the optimiser (over all of a model's parameters, flattened in
``parameters()`` order); :class:`LinearConstraints` is the ``[client.constraints]`` table: a
per-client fairness constraint on a linear model — for every class ``k`` the gap between the
mean logit of the client's rows in group 1 and in group 0 is at most ``epsilon``
(``|(mu_1 - mu_0)^T W_k| <= epsilon``, two rows of ``A`` per class; the group of a row is
``x[feature] > threshold``). :class:`ConstrainedTraining` trains such clients; each keeps
its dual ``y`` in its ``context.state`` across rounds and reports ``constraint-violation``
(``max [A w - b]_+``, before and after its local steps).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any, Literal

import numpy as np
import torch
from flwr.app import RecordDict
from torch import nn

from fedsim.config import require
from fedsim.data import DatasetSpec, cached_dataset
from fedsim.models import ModelSpec
from fedsim.record_codec import to_numpy, to_record
from fedsim.workloads.training import (
    ClientTraining,
    Exclusion,
    LocalSteps,
    TrainResult,
    TrainTask,
    as_tensors,
    minibatches,
)


class SmoothedPrimalDual(torch.optim.Optimizer):
    """One smoothed primal-dual step per ``step()`` from the parameters' ``.grad``.

    Args:
        params: the parameters; their flattened concatenation is ``w`` (length ``A``'s columns).
        A, b: the constraints ``A w <= b`` (``m x n`` and ``m``; ``m = 0`` is allowed).
        lr: primal step ``c``; dual_lr: ``alpha``; smoothing: ``beta`` in (0, 1];
        proximal: ``p``; penalty: ``rho``; lower, upper: the box ``X`` (None: unbounded);
        dual: the starting ``y`` (>= 0; None: zeros).
    """

    def __init__(
        self,
        params: Iterable[Any],
        A: torch.Tensor,
        b: torch.Tensor,
        *,
        lr: float = 0.05,
        dual_lr: float = 0.5,
        smoothing: float = 0.5,
        proximal: float = 1.0,
        penalty: float = 0.0,
        lower: float | None = None,
        upper: float | None = None,
        dual: torch.Tensor | None = None,
    ) -> None:
        for key, value, ok, allowed in (
            ("lr", lr, lr > 0, "a number > 0"),
            ("dual_lr", dual_lr, dual_lr > 0, "a number > 0"),
            ("smoothing", smoothing, 0 < smoothing <= 1, "a number in (0, 1]"),
            ("proximal", proximal, proximal >= 0, "a number >= 0"),
            ("penalty", penalty, penalty >= 0, "a number >= 0"),
        ):
            if not ok:
                raise ValueError(f"SmoothedPrimalDual {key}={value!r}: expected {allowed}")
        if lower is not None and upper is not None and lower > upper:
            raise ValueError(
                f"SmoothedPrimalDual lower={lower}, upper={upper}: need lower <= upper"
            )
        super().__init__(params, dict(lr=lr))
        self.settings = dict(dual_lr=dual_lr, smoothing=smoothing, proximal=proximal)
        self.penalty, self.lower, self.upper = penalty, lower, upper
        size = sum(p.numel() for group in self.param_groups for p in group["params"])
        if A.ndim != 2 or A.shape[1] != size or b.shape != (A.shape[0],):
            raise ValueError(
                f"SmoothedPrimalDual A {tuple(A.shape)}, b {tuple(b.shape)}: expected "
                f"(m, {size}) and (m,) for {size} parameters"
            )
        self.A, self.b = A.detach(), b.detach()
        self.dual = torch.zeros_like(self.b) if dual is None else dual.detach().clone()
        if self.dual.shape != self.b.shape or bool((self.dual < 0).any()):
            raise ValueError(f"SmoothedPrimalDual dual: expected {tuple(self.b.shape)} values >= 0")
        self.center = self._flat().clone()

    def _params(self) -> list[torch.Tensor]:
        return [p for group in self.param_groups for p in group["params"]]

    def _flat(self) -> torch.Tensor:
        return torch.cat([p.detach().reshape(-1) for p in self._params()]).to(self.A.dtype)

    def residual(self) -> torch.Tensor:
        """``A w - b`` at the current parameters."""
        return self.A @ self._flat() - self.b

    def violation(self) -> float:
        """``max_i [A w - b]_i^+`` (0 when feasible or without constraints)."""
        r = self.residual()
        return float(r.clamp(min=0).max()) if len(r) else 0.0

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> Any:  # type: ignore[override]
        """The dual, primal and smoothing updates (see the module docstring)."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        params = self._params()
        w = self._flat()
        grad = torch.cat(
            [
                torch.zeros(p.numel(), dtype=w.dtype, device=w.device)
                if p.grad is None
                else p.grad.detach().reshape(-1).to(w.dtype)
                for p in params
            ]
        )
        r = self.A @ w - self.b
        self.dual = (self.dual + self.settings["dual_lr"] * r).clamp(min=0)
        weights = self.dual + self.penalty * r.clamp(min=0)
        direction = grad + self.A.T @ weights + self.settings["proximal"] * (w - self.center)
        w_next = w - self.param_groups[0]["lr"] * direction
        if self.lower is not None or self.upper is not None:
            w_next = w_next.clamp(min=self.lower, max=self.upper)
        self.center += self.settings["smoothing"] * (w_next - self.center)
        offset = 0
        for p in params:
            p.copy_(w_next[offset : offset + p.numel()].reshape(p.shape).to(p.dtype))
            offset += p.numel()
        return loss


@dataclass(frozen=True, kw_only=True)
class LinearConstraints:
    """The ``[client.constraints]`` table (see the module docstring).

    Attributes:
        kind: "parity" — per class, |mean logit(group 1) - mean logit(group 0)| <= epsilon.
        feature: column of the (flattened) input that defines the group.
        threshold: a row is in group 1 iff ``x[feature] > threshold``.
        epsilon: the allowed gap (>= 0).
        lr, dual_lr, smoothing, proximal, penalty: :class:`SmoothedPrimalDual`'s c, alpha,
            beta, p, rho.
        keep_dual: keep each client's dual ``y`` in its ``context.state`` across rounds.
    """

    kind: Literal["parity"] = "parity"
    feature: int = 0
    threshold: float = 0.0
    epsilon: float = 0.1
    lr: float = 0.05
    dual_lr: float = 0.5
    smoothing: float = 0.5
    proximal: float = 1.0
    penalty: float = 0.0
    keep_dual: bool = True

    def __post_init__(self) -> None:
        require(self.kind == "parity", "client.constraints.kind", self.kind, "'parity'")
        require(self.feature >= 0, "client.constraints.feature", self.feature, "an index >= 0")
        require(self.epsilon >= 0, "client.constraints.epsilon", self.epsilon, "a number >= 0")
        require(self.lr > 0, "client.constraints.lr", self.lr, "a number > 0")
        require(self.dual_lr > 0, "client.constraints.dual_lr", self.dual_lr, "a number > 0")
        require(
            0 < self.smoothing <= 1,
            "client.constraints.smoothing",
            self.smoothing,
            "a number in (0, 1]",
        )
        require(self.proximal >= 0, "client.constraints.proximal", self.proximal, ">= 0")
        require(self.penalty >= 0, "client.constraints.penalty", self.penalty, ">= 0")

    def matrices(self, model: nn.Module, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``(A, b)`` over ``model``'s flattened parameters for the rows ``x``.

        ``model`` must be a linear model (one ``nn.Linear`` holding all its parameters); a
        client whose rows all fall in one group gets no constraints (``m = 0``).
        """
        linears = [m for m in model.modules() if isinstance(m, nn.Linear)]
        total = sum(p.numel() for p in model.parameters())
        if len(linears) != 1 or sum(p.numel() for p in linears[0].parameters()) != total:
            raise ValueError(
                f"client.constraints: model {type(model).__name__} with {len(linears)} Linear "
                "layers; expected a linear model (model.kind = 'logreg')"
            )
        layer = linears[0]
        classes, features = layer.weight.shape
        flat = x.reshape(len(x), -1).to(torch.float64)
        require(
            self.feature < features,
            "client.constraints.feature",
            self.feature,
            f"an index < {features} (the input's flattened size)",
        )
        group = flat[:, self.feature] > self.threshold
        on = {"dtype": torch.float64, "device": flat.device}  # where the rows (and model) are
        if bool(group.all()) or not bool(group.any()):
            return torch.zeros(0, total, **on), torch.zeros(0, **on)
        gap = flat[group].mean(0) - flat[~group].mean(0)
        offsets = {id(p): 0 for p in model.parameters()}
        offset = 0
        for p in model.parameters():
            offsets[id(p)] = offset
            offset += p.numel()
        start = offsets[id(layer.weight)]
        A = torch.zeros(2 * classes, total, **on)
        for k in range(classes):
            cols = slice(start + k * features, start + (k + 1) * features)
            A[2 * k, cols] = gap
            A[2 * k + 1, cols] = -gap
        return A, torch.full((2 * classes,), float(self.epsilon), **on)


DUAL_STATE = "fedsim.constraints.dual"


def train_constrained(
    model: nn.Module,
    x: torch.Tensor,
    y: torch.Tensor,
    constraints: LinearConstraints,
    *,
    epochs: int,
    batch_size: int,
    max_steps: int,
    generator: torch.Generator,
    dual: np.ndarray | None = None,
) -> dict[str, Any]:
    """Minibatch smoothed primal-dual training (one minibatch gradient per step).

    Returns the mean loss, steps, the violations before and after, and the final dual.
    """
    model.train()
    A, b = constraints.matrices(model, x)
    optimizer = SmoothedPrimalDual(
        model.parameters(),
        A,
        b,
        lr=constraints.lr,
        dual_lr=constraints.dual_lr,
        smoothing=constraints.smoothing,
        proximal=constraints.proximal,
        penalty=constraints.penalty,
        dual=None
        if dual is None or len(dual) != len(b)
        else torch.from_numpy(np.array(dual)).to(b.device),
    )
    before = optimizer.violation()
    steps, total = 0, 0.0
    for idx in minibatches(len(y), batch_size, generator, epochs=epochs, max_steps=max_steps):
        optimizer.zero_grad(set_to_none=True)
        loss = nn.functional.cross_entropy(model(x[idx]), y[idx])
        loss.backward()
        optimizer.step()
        total += float(loss.detach())
        steps += 1
    return {
        "loss": total / steps if steps else 0.0,
        "steps": steps,
        "violation_before": before,
        "violation": optimizer.violation(),
        "dual": optimizer.dual.cpu().numpy().copy(),
    }


_ALONE = "unset with client.constraints (smoothed primal-dual training)"
_OTHER_PARTS = ("dp_sgd", "optimizer", "averaging", "compression", "conformal", "sst", "lora")

EXCLUDES = {
    "constraints": (
        *(Exclusion(key, _ALONE, named=key) for key in _OTHER_PARTS),
        Exclusion(
            "fedprox", "unset with FedProx (the smoothed primal-dual has its own proximal centre)"
        ),
    )
}
"""What ``[client.constraints]`` cannot be combined with: it replaces SGD and combines with no
other client method (checked by :func:`fedsim.workloads.supervised.check_parts`)."""


class ConstrainedTraining(ClientTraining):
    """Clients trained under their own :class:`LinearConstraints` (``[client.constraints]``;
    the steps' epochs, batch_size, max_steps and seed are used, the step size is
    ``constraints.lr``). Needs a linear model (``model.kind = 'logreg'``)."""

    name = "client.constraints (the smoothed primal-dual has its own proximal centre)"

    def __init__(self, spec: ModelSpec, steps: LocalSteps, constraints: LinearConstraints) -> None:
        if spec.kind != "logreg":
            raise ValueError(
                f"model.kind = {spec.kind!r} with client.constraints: expected 'logreg' "
                "(the constraints are linear in a linear model's weights)"
            )
        super().__init__(spec, steps)
        self.constraints = constraints

    def train(
        self, model: nn.Module, task: TrainTask, generator: torch.Generator, state: RecordDict
    ) -> TrainResult:
        keep = self.constraints.keep_dual
        dual = to_numpy(state[DUAL_STATE])["y"] if keep and DUAL_STATE in state else None
        result = train_constrained(
            model,
            task.x,
            task.y,
            self.constraints,
            epochs=self.steps.epochs,
            batch_size=self.steps.batch_size,
            max_steps=self.steps.max_steps,
            generator=generator,
            dual=dual,
        )
        if keep:
            state[DUAL_STATE] = to_record({"y": result["dual"]})
        metrics = {
            "constraint-violation-start": result["violation_before"],
            "constraint-violation": result["violation"],
            "dual-norm": float(np.linalg.norm(result["dual"])) if len(result["dual"]) else 0.0,
        }
        return TrainResult(result["loss"], result["steps"], metrics)

    def evaluation_metrics(
        self, model: nn.Module, data: DatasetSpec, partition: int
    ) -> dict[str, float]:
        """The global model's ``constraint-violation`` on the client's training rows."""
        train_x = as_tensors(*cached_dataset(data).train.client(partition))[0].to(self.device)
        A, b = self.constraints.matrices(model, train_x)
        w = torch.cat([p.detach().reshape(-1) for p in model.parameters()]).to(torch.float64)
        return {"constraint-violation": float((A @ w - b).clamp(min=0).max()) if len(b) else 0.0}
