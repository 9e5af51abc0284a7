"""Conformal prediction for classifiers: split calibration, online multi-group
calibration, and conformal training (DPSM).

Scores are the usual nonconformity ``s_k(x) = 1 - p_k(x)`` of a softmax
classifier; the prediction set at threshold ``q`` is ``{k : s_k(x) <= q}`` and a
point is *missed* when its true label's score exceeds ``q``.

* **Split conformal** (:func:`split_conformal_threshold`): the
  ``ceil((n + 1)(1 - alpha))``-th smallest calibration score, which covers a new
  exchangeable point with probability >= 1 - alpha.
* **Online multi-group conformal** (:class:`OnlineCalibrator`; Ramalingam et al.,
  ICML 2025, the multi-group generalisation of ACI, Gibbs & Candes 2021): the
  threshold of a point is ``q(x) = sum_{g ni x} theta_g`` and after observing
  its miss ``theta_g += eta * (miss - alpha) * 1[x in g]`` for every group ``g``
  (online gradient descent on the pinball loss). A group that owns a coordinate
  of theta has a long-run miss rate of alpha, whatever the other groups do.
  ``kind = "aci"`` is the baseline with one global theta (marginal coverage
  only). In a federation the groups are the clients (plus an optional global
  group); the server runs the calibrator over the clients' evaluation streams
  (``strategies.methods.conformal.ConformalEvaluation``), fed by
  :func:`score_reply_record` on the clients.
* **DPSM conformal training** (:class:`DPSM`; Shi et al., ICML 2025, "Direct
  Prediction Set Minimization"): each batch is split in two; on the first half
  the learned quantile ``tau`` takes one gradient step on the pinball loss at
  level 1 - alpha (lower level); on the second half the soft set size
  ``sum_k sigmoid((tau - s_k) / T)`` is added to the cross-entropy with weight
  ``mu_size`` (upper level).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Literal

import numpy as np
import torch
from flwr.app import ArrayRecord
from torch import nn

from fedsim.config import require
from fedsim.record_codec import to_record

SCORES_REQUEST = "fedsim.conformal-scores"
"""Config key of an evaluate instruction asking the client for its scores."""
SCORES_RECORD = "fedsim.conformal"
"""Key of the ArrayRecord of scores in an evaluate reply (see :func:`score_reply_record`)."""
TAU_STATE = "fedsim.dpsm-tau"
"""Key of a DPSM client's learned quantile in its ``context.state``."""


# ---------------------------------------------------------------- scores and sets


def class_scores(model: nn.Module, x: torch.Tensor, batch_size: int = 1024) -> np.ndarray:
    """Nonconformity ``1 - softmax(model(x))_k`` of every class, shape (n, classes)."""
    model.eval()
    chunks = []
    with torch.no_grad():
        for start in range(0, len(x), batch_size):
            probs = torch.softmax(model(x[start : start + batch_size]).double(), dim=1)
            chunks.append((1.0 - probs).cpu().numpy())
    if not chunks:
        raise ValueError("x has no rows: scores need at least one example")
    return np.concatenate(chunks)


def label_scores(scores: np.ndarray, y: np.ndarray) -> np.ndarray:
    """The true label's score of each row of ``scores`` (n, classes)."""
    return np.asarray(scores)[np.arange(len(y)), np.asarray(y, dtype=np.int64)]


def prediction_sets(scores: np.ndarray, threshold: float | np.ndarray) -> np.ndarray:
    """Boolean (n, classes) membership of ``{k : s_k <= q}``; ``threshold`` is one
    q or one per row."""
    q = np.asarray(threshold, dtype=np.float64)
    return np.asarray(scores) <= (q[:, None] if q.ndim == 1 else q)


def split_conformal_threshold(calibration_scores: np.ndarray, alpha: float) -> float:
    """The split-conformal threshold for miscoverage ``alpha`` (Vovk et al. 2005;
    Angelopoulos & Bates 2021, eq. 1): the ``ceil((n + 1)(1 - alpha))``-th
    smallest calibration score, or +inf when that rank exceeds n."""
    if not 0 < alpha < 1:
        raise ValueError(f"alpha = {alpha!r} is not allowed: a number in (0, 1)")
    scores = np.sort(np.asarray(calibration_scores, dtype=np.float64).ravel())
    if scores.size == 0:
        raise ValueError("calibration_scores is empty: at least one score is needed")
    rank = math.ceil((scores.size + 1) * (1 - alpha))
    return float(scores[rank - 1]) if rank <= scores.size else math.inf


def coverage_and_size(scores: np.ndarray, y: np.ndarray, threshold: float) -> tuple[float, float]:
    """(fraction of rows whose label is in its set, mean set size) at ``threshold``."""
    sets = prediction_sets(scores, threshold)
    covered = sets[np.arange(len(y)), np.asarray(y, dtype=np.int64)]
    return float(covered.mean()), float(sets.sum(1).mean())


# ---------------------------------------------------------------- online calibration


@dataclass(frozen=True, kw_only=True)
class OnlineConformal:
    """Online calibration of the clients' evaluation streams (``[evaluation.conformal]``).

    Attributes:
        kind: "multigroup" (a theta per client, plus a global one with
            ``global_group``) or "aci" (one global theta; Gibbs & Candes 2021).
        alpha: target miss rate, in (0, 1).
        eta: step size of the theta updates, > 0 (scores are in [0, 1]).
        global_group: with "multigroup", every point also belongs to a global
            group whose theta all clients share.
    """

    kind: Literal["multigroup", "aci"] = "multigroup"
    alpha: float = 0.1
    eta: float = 0.05
    global_group: bool = True

    def __post_init__(self) -> None:
        require(
            self.kind in ("multigroup", "aci"),
            "evaluation.conformal.kind",
            self.kind,
            "'multigroup' or 'aci'",
        )
        require(0 < self.alpha < 1, "evaluation.conformal.alpha", self.alpha, "a number in (0, 1)")
        require(self.eta > 0, "evaluation.conformal.eta", self.eta, "a number > 0")


@dataclass(frozen=True)
class GroupStream:
    """One group's (client's) scores in the order it observed them."""

    group: int
    scores: np.ndarray
    """True-label nonconformity scores, shape (n,)."""
    class_scores: np.ndarray | None = None
    """All classes' scores, shape (n, classes); optional, for set sizes."""


class OnlineCalibrator:
    """Multi-group online conformal calibration (see the module docstring).

    Points are fed one at a time (:meth:`observe`) or as a round of group
    streams (:meth:`observe_round`, which interleaves the groups). The miss and
    point counts per group are kept over the calibrator's lifetime.
    """

    def __init__(self, config: OnlineConformal) -> None:
        self.config = config
        self.theta_global = 0.0
        self.theta: dict[int, float] = {}
        self.points: dict[int, int] = {}
        self.misses: dict[int, int] = {}

    @property
    def _uses_global(self) -> bool:
        return self.config.kind == "aci" or self.config.global_group

    def threshold(self, group: int) -> float:
        """The current q for a point of ``group``: the sum of its groups' thetas."""
        if self.config.kind == "aci":
            return self.theta_global
        own = self.theta.get(group, 0.0)
        return own + self.theta_global if self.config.global_group else own

    def observe(self, score: float, group: int) -> tuple[bool, float]:
        """Predict with the current threshold, then update; returns (missed, threshold)."""
        q = self.threshold(group)
        missed = bool(score > q)
        step = self.config.eta * (float(missed) - self.config.alpha)
        if self._uses_global:
            self.theta_global += step
        if self.config.kind == "multigroup":
            self.theta[group] = self.theta.get(group, 0.0) + step
        self.points[group] = self.points.get(group, 0) + 1
        self.misses[group] = self.misses.get(group, 0) + int(missed)
        return missed, q

    def observe_stream(
        self, scores: Sequence[float] | np.ndarray, groups: Sequence[int] | np.ndarray
    ) -> tuple[np.ndarray, np.ndarray]:
        """Feed points in order; returns (misses, thresholds) as arrays."""
        if len(scores) != len(groups):
            raise ValueError(f"scores and groups differ in length ({len(scores)} vs {len(groups)})")
        misses = np.zeros(len(scores), dtype=bool)
        thresholds = np.zeros(len(scores))
        for i, (score, group) in enumerate(zip(scores, groups, strict=True)):
            misses[i], thresholds[i] = self.observe(float(score), int(group))
        return misses, thresholds

    def observe_round(self, streams: Sequence[GroupStream]) -> dict[str, float | list]:
        """Feed one round of group streams, interleaved round-robin in group order
        (each group's points keep their order); returns the round's metrics:

        ``conformal-miss`` and ``conformal-set-size`` (means over the round's
        points; the size needs ``class_scores``), ``conformal-groups`` (ids, sorted),
        ``conformal-group-miss`` (their miss rates this round),
        ``conformal-group-miss-total`` (over all rounds so far) and
        ``conformal-max-gap`` (max over these groups of |total miss rate - alpha|).
        """
        ordered = sorted(streams, key=lambda s: s.group)
        if len({s.group for s in ordered}) != len(ordered):
            raise ValueError("streams: each group may send one stream per round")
        position = np.concatenate([np.arange(len(s.scores)) for s in ordered] or [[]])
        rank = np.concatenate(
            [np.full(len(s.scores), i) for i, s in enumerate(ordered)] or [[]]
        ).astype(np.int64)
        offsets = np.cumsum([0] + [len(s.scores) for s in ordered])
        order = np.lexsort((rank, position))  # by position, then by group
        flat_scores = np.concatenate([np.asarray(s.scores, np.float64) for s in ordered] or [[]])
        groups = np.array([ordered[r].group for r in rank], dtype=np.int64)
        misses_in_order, thresholds_in_order = self.observe_stream(
            flat_scores[order], groups[order]
        )
        misses = np.empty_like(misses_in_order)
        misses[order] = misses_in_order
        thresholds = np.empty_like(thresholds_in_order)
        thresholds[order] = thresholds_in_order
        metrics: dict[str, float | list] = {
            "conformal-miss": float(misses.mean()) if misses.size else 0.0,
        }
        sizes = [
            prediction_sets(s.class_scores, thresholds[offsets[i] : offsets[i + 1]]).sum(1)
            for i, s in enumerate(ordered)
            if s.class_scores is not None and len(s.scores)
        ]
        if sizes:
            metrics["conformal-set-size"] = float(np.concatenate(sizes).mean())
        ids = [s.group for s in ordered if len(s.scores)]
        metrics["conformal-groups"] = ids
        metrics["conformal-group-miss"] = [
            float(misses[offsets[i] : offsets[i + 1]].mean())
            for i, s in enumerate(ordered)
            if len(s.scores)
        ]
        totals = self.miss_rates()
        metrics["conformal-group-miss-total"] = [totals[g] for g in ids]
        metrics["conformal-max-gap"] = max(
            (abs(totals[g] - self.config.alpha) for g in ids), default=0.0
        )
        return metrics

    def miss_rates(self) -> dict[int, float]:
        """Each group's miss rate over every point it has observed."""
        return {g: self.misses[g] / self.points[g] for g in sorted(self.points)}


# ---------------------------------------------------------------- client side


def score_reply_record(
    model: nn.Module, x: torch.Tensor, y: torch.Tensor, group: int
) -> ArrayRecord:
    """The ArrayRecord a client adds to its evaluate reply under
    :data:`SCORES_RECORD`: ``scores`` (true-label scores, in row order),
    ``class-scores`` (all classes) and ``group`` (the client's partition id).

    These are the client's raw evaluation scores: they leave the client in the
    clear (the server-side online calibration needs them point by point).
    """
    every = class_scores(model, x).astype(np.float32)
    return to_record(
        {
            "scores": label_scores(every, y.cpu().numpy()),
            "class-scores": every,
            "group": np.array([group], dtype=np.int64),
        }
    )


def stream_from_arrays(arrays: Mapping[str, np.ndarray]) -> GroupStream:
    """The :class:`GroupStream` of one reply's :data:`SCORES_RECORD` arrays."""
    for key in ("scores", "class-scores", "group"):
        if key not in arrays:
            raise ValueError(f"a {SCORES_RECORD!r} record has no {key!r} array")
    return GroupStream(
        group=int(arrays["group"][0]),
        scores=np.asarray(arrays["scores"], dtype=np.float64),
        class_scores=np.asarray(arrays["class-scores"], dtype=np.float64),
    )


# ---------------------------------------------------------------- DPSM training


@dataclass(frozen=True, kw_only=True)
class ConformalTraining:
    """A conformal training objective for clients (``[client.conformal]``).

    Attributes:
        kind: "dpsm" (Direct Prediction Set Minimization, Shi et al., ICML 2025).
        alpha: target miscoverage; tau tracks the 1 - alpha quantile of the scores.
        mu_size: weight of the soft set size in the loss, >= 0 (0: cross-entropy
            only, tau still learned).
        lr_qr: step size of tau's pinball-loss (quantile regression) updates.
        temperature: T of the sigmoid in the soft set size.
        initial_tau: tau before a client's first step (kept in its state afterwards).
    """

    kind: Literal["dpsm"] = "dpsm"
    alpha: float = 0.1
    mu_size: float = 0.05
    lr_qr: float = 0.01
    temperature: float = 1.0
    initial_tau: float = 0.5

    def __post_init__(self) -> None:
        require(self.kind == "dpsm", "client.conformal.kind", self.kind, "'dpsm'")
        require(0 < self.alpha < 1, "client.conformal.alpha", self.alpha, "a number in (0, 1)")
        require(self.mu_size >= 0, "client.conformal.mu_size", self.mu_size, "a number >= 0")
        require(self.lr_qr > 0, "client.conformal.lr_qr", self.lr_qr, "a number > 0")
        require(
            self.temperature > 0, "client.conformal.temperature", self.temperature, "a number > 0"
        )
        require(
            0 <= self.initial_tau <= 1,
            "client.conformal.initial_tau",
            self.initial_tau,
            "a number in [0, 1] (scores are 1 - probability)",
        )


def pinball_tau_gradient(tau: float, scores: torch.Tensor, alpha: float) -> float:
    """d/dtau of the mean pinball loss at level 1 - alpha,
    ``mean((1 - alpha)(s - tau)_+ + alpha (tau - s)_+)``: ``P(s <= tau) - (1 - alpha)``
    over the scores (the subgradient at s = tau taken from the left)."""
    return float((scores <= tau).double().mean()) - (1.0 - alpha)


def soft_set_size(scores: torch.Tensor, tau: float, temperature: float) -> torch.Tensor:
    """Mean over rows of ``sum_k sigmoid((tau - s_k) / T)``, differentiable in the scores."""
    return torch.sigmoid((tau - scores) / temperature).sum(1).mean()


class DPSM:
    """DPSM's per-batch objective with its learned quantile ``tau`` (see the module docstring).

    :meth:`loss` splits a batch in halves (rows ``[:n//2]`` and ``[n//2:]``; the
    training loop shuffles), steps tau on the first half's true-label scores
    (detached), and returns ``CE(whole batch) + mu_size * soft size(second half)``.
    """

    def __init__(self, config: ConformalTraining, tau: float | None = None) -> None:
        self.config = config
        self.tau = config.initial_tau if tau is None else float(tau)
        self.last_size = 0.0

    def step_quantile(self, scores: torch.Tensor) -> float:
        """One pinball-loss step of tau on true-label ``scores``; returns the new tau."""
        grad = pinball_tau_gradient(self.tau, scores.detach(), self.config.alpha)
        self.tau -= self.config.lr_qr * grad
        return self.tau

    def loss(self, logits: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """The batch's training loss (updates tau first). A one-row batch (a
        client's last, at most) cannot be split: its loss is the cross-entropy."""
        if len(y) < 2:
            return nn.functional.cross_entropy(logits, y)
        half = len(y) // 2
        scores = 1.0 - torch.softmax(logits, dim=1)
        first = scores[:half].detach().gather(1, y[:half, None]).squeeze(1)
        self.step_quantile(first)
        size = soft_set_size(scores[half:], self.tau, self.config.temperature)
        self.last_size = float(size.detach())
        return nn.functional.cross_entropy(logits, y) + self.config.mu_size * size
