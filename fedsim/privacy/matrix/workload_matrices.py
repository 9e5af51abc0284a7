"""Workload matrices A for the matrix mechanism (release A x for a stream x of gradients).

Row t of A is the linear query answered after round t (rounds are 0-based, ``n`` rounds in
all). Every workload here is lower-triangular, so a row only reads rounds already seen.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from fedsim.config import require


def _check_n(n: int) -> int:
    require(isinstance(n, (int, np.integer)) and int(n) >= 1, "n", n, "an integer >= 1")
    return int(n)


def prefix_sum(n: int) -> np.ndarray:
    """The prefix-sum workload ``A[t, s] = 1 if s <= t else 0`` (an n x n float64 matrix).

    Row t sums the gradients of rounds 0..t: the workload of DP-FTRL / SGD with a constant
    learning rate (Kairouz et al. 2021, "Practical and Private (Deep) Learning without
    Sampling or Shuffling").
    """
    n = _check_n(n)
    return np.tri(n, dtype=np.float64)


def momentum(
    n: int,
    momentum: float = 0.0,
    learning_rates: float | Sequence[float] | np.ndarray = 1.0,
) -> np.ndarray:
    """The workload of SGD with heavy-ball momentum and a learning-rate schedule.

    With ``m_t = beta m_{t-1} + g_t`` and ``theta_t = theta_{t-1} - eta_t m_t`` (``m_{-1} = 0``),
    ``theta_0 - theta_t = sum_s A[t, s] g_s`` with

        ``A[t, s] = sum_{r=s}^{t} eta_r beta^(r - s)``  for ``s <= t``, 0 otherwise

    (Denisov et al. 2022, "Improved Differential Privacy for SGD via Optimal Private Linear
    Operators on Adaptive Streams", momentum and learning-rate workloads).

    ``momentum`` is beta in [0, 1); ``learning_rates`` is one positive rate for every round or
    a sequence of ``n`` positive rates (eta_0..eta_{n-1}). ``momentum=0`` with unit rates gives
    :func:`prefix_sum`. A is lower-triangular with diagonal eta, so it is invertible.
    """
    n = _check_n(n)
    beta = float(momentum)
    require(0.0 <= beta < 1.0, "momentum", momentum, "a float in [0, 1)")
    eta = np.asarray(learning_rates, dtype=np.float64)
    if eta.ndim == 0:
        eta = np.full(n, float(eta))
    require(eta.shape == (n,), "learning_rates", learning_rates, f"a float or {n} floats (n = {n})")
    require(
        bool(np.all(np.isfinite(eta)) and np.all(eta > 0)),
        "learning_rates",
        learning_rates,
        "positive finite floats",
    )
    # M[r, s] = beta^(r - s) for s <= r: momentum buffer after round r as a function of g_s.
    lags = np.subtract.outer(np.arange(n), np.arange(n))
    decay = np.where(lags >= 0, beta ** np.maximum(lags, 0), 0.0)
    # A = L diag(eta) M, where L is the prefix sum over r.
    return np.cumsum(eta[:, None] * decay, axis=0)
