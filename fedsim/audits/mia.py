"""Reference-free membership-inference attacks and their exact ROC metrics.

Every attack maps an example to a *membership score*: higher means "more likely a training
member". For a language model the input is the example's per-token log-probabilities
``log p(x_t | x_<t)`` (natural log, one entry per predicted token):

* loss (Yeom et al., CSF 2018): ``score = -NLL = mean_t log p(x_t | x_<t)``;
* zlib (Carlini et al., USENIX Security 2021, Sec. 5.1): the loss calibrated by the
  example's zlib entropy, ``score = -NLL / len(zlib.compress(text))`` (bytes at level 9), so
  text that is easy for any compressor (and for any model) does not look like a member;
* min-k% prob (Shi et al., ICLR 2024, Eq. 1): the mean of the ``k %`` lowest token
  log-probabilities (``ceil(k n / 100)`` of the ``n`` tokens), which ignores the tokens every
  model predicts well and keeps the surprising ones, where membership shows.

Metrics (exact, no interpolation): :func:`roc_curve` lists every distinct threshold (predict
"member" when ``score >= t``), :func:`roc_auc` is the Mann-Whitney probability
``P(s_member > s_non) + P(s_member = s_non) / 2`` (the trapezoidal area of that curve, ties as
diagonal segments), and :func:`tpr_at_fpr` is the largest TPR over the curve's vertices with
FPR ``<= max_fpr`` (Carlini et al., S&P 2022, "Membership inference attacks from first
principles", report TPR at 0.1 % / 1 % FPR the same way).
"""

from __future__ import annotations

import math
import zlib
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

ATTACKS = ("loss", "zlib", "mink")


def _check_scores(values: object, key: str) -> np.ndarray:
    arr = np.asarray(values, dtype=np.float64)
    if arr.ndim != 1 or arr.size == 0 or not np.all(np.isfinite(arr)):
        raise ValueError(f"{key} must be a non-empty 1-D array of finite scores; got {arr.shape}")
    return arr


@dataclass(frozen=True)
class RocCurve:
    """An empirical ROC curve: ``fpr[i]``, ``tpr[i]`` when predicting member iff
    ``score >= thresholds[i]``; starts at (0, 0) (threshold +inf) and ends at (1, 1)."""

    fpr: np.ndarray
    tpr: np.ndarray
    thresholds: np.ndarray


def roc_curve(member_scores: Sequence[float], nonmember_scores: Sequence[float]) -> RocCurve:
    """The exact ROC curve of member (positive) vs non-member (negative) scores."""
    pos = _check_scores(member_scores, "member_scores")
    neg = _check_scores(nonmember_scores, "nonmember_scores")
    thresholds = np.unique(np.concatenate([pos, neg]))[::-1]  # descending
    pos_sorted, neg_sorted = np.sort(pos), np.sort(neg)
    # Number of scores >= t: n - (number < t).
    tp = pos.size - np.searchsorted(pos_sorted, thresholds, side="left")
    fp = neg.size - np.searchsorted(neg_sorted, thresholds, side="left")
    return RocCurve(
        fpr=np.concatenate([[0.0], fp / neg.size]),
        tpr=np.concatenate([[0.0], tp / pos.size]),
        thresholds=np.concatenate([[np.inf], thresholds]),
    )


def roc_auc(member_scores: Sequence[float], nonmember_scores: Sequence[float]) -> float:
    """Area under the ROC curve: ``P(member > non-member) + P(tie) / 2`` over all pairs."""
    pos = _check_scores(member_scores, "member_scores")
    neg = _check_scores(nonmember_scores, "nonmember_scores")
    neg_sorted = np.sort(neg)
    below = np.searchsorted(neg_sorted, pos, side="left")  # non-members strictly below
    ties = np.searchsorted(neg_sorted, pos, side="right") - below
    return float((below.sum() + 0.5 * ties.sum()) / (pos.size * neg.size))


def tpr_at_fpr(
    member_scores: Sequence[float], nonmember_scores: Sequence[float], max_fpr: float = 0.05
) -> float:
    """The largest true-positive rate at a threshold whose false-positive rate is ``<= max_fpr``."""
    if not (isinstance(max_fpr, (int, float)) and 0.0 <= max_fpr <= 1.0):
        raise ValueError(f"max_fpr = {max_fpr!r} is not allowed: a number in [0, 1]")
    curve = roc_curve(member_scores, nonmember_scores)
    ok = curve.fpr <= max_fpr + 1e-12
    return float(curve.tpr[ok].max())


def attack_metrics(
    member_scores: Sequence[float], nonmember_scores: Sequence[float], max_fpr: float = 0.05
) -> dict[str, float | int]:
    """AUC, TPR at ``max_fpr`` and the counts, JSON-ready."""
    return {
        "auc": roc_auc(member_scores, nonmember_scores),
        "tpr_at_fpr": tpr_at_fpr(member_scores, nonmember_scores, max_fpr),
        "max_fpr": float(max_fpr),
        "members": len(member_scores),
        "non_members": len(nonmember_scores),
    }


# --------------------------------------------------------------------------- scores


def _token_array(log_probs: Sequence[float], key: str) -> np.ndarray:
    arr = np.asarray(log_probs, dtype=np.float64)
    if arr.ndim != 1 or arr.size == 0:
        raise ValueError(f"{key} must hold at least one token log-probability; got {arr.shape}")
    if np.any(arr > 1e-9):
        raise ValueError(f"{key} must hold log-probabilities (<= 0); got max {arr.max():.3g}")
    return arr


def zlib_length(text: str | bytes) -> int:
    """Bytes of ``text`` (UTF-8) compressed by zlib at level 9."""
    data = text.encode("utf-8") if isinstance(text, str) else bytes(text)
    return len(zlib.compress(data, 9))


def loss_score(log_probs: Sequence[float]) -> float:
    """The loss attack's score: the mean token log-probability (minus the mean NLL)."""
    return float(_token_array(log_probs, "log_probs").mean())


def zlib_score(log_probs: Sequence[float], text: str | bytes) -> float:
    """The zlib attack's score: ``-NLL / zlib_length(text)``."""
    return loss_score(log_probs) / zlib_length(text)


def mink_score(log_probs: Sequence[float], k: float = 20.0) -> float:
    """Min-k% prob: the mean of the ``ceil(k n / 100)`` smallest token log-probabilities."""
    if not (isinstance(k, (int, float)) and 0.0 < k <= 100.0):
        raise ValueError(f"k = {k!r} is not allowed: a percentage in (0, 100]")
    arr = _token_array(log_probs, "log_probs")
    count = max(1, math.ceil(k * arr.size / 100.0))
    return float(np.sort(arr)[:count].mean())


def sequence_scores(
    attack: str,
    log_probs: Sequence[Sequence[float]],
    texts: Sequence[str | bytes] | None = None,
    k: float = 20.0,
) -> np.ndarray:
    """One membership score per sequence for ``attack`` in ``ATTACKS`` (zlib needs ``texts``)."""
    if attack not in ATTACKS:
        raise ValueError(f"attack = {attack!r} is not allowed: one of {', '.join(ATTACKS)}")
    if attack == "loss":
        return np.array([loss_score(lp) for lp in log_probs])
    if attack == "mink":
        return np.array([mink_score(lp, k) for lp in log_probs])
    if texts is None or len(texts) != len(log_probs):
        raise ValueError(
            f"texts must give one text per sequence for the zlib attack "
            f"({len(log_probs)} sequences, {None if texts is None else len(texts)} texts)"
        )
    return np.array([zlib_score(lp, t) for lp, t in zip(log_probs, texts, strict=True)])
