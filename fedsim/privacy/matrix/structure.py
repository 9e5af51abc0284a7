"""The fixed structure of the factorization families, as pure functions of their parameters:
what a noise stream's parameters generate (:mod:`fedsim.privacy.matrix.verify` compares it with
a factorization's C and B), and the tree's node bookkeeping.

- trees (:mod:`.tree`): nodes ``[k 2^h, (k + 1) 2^h - 1]`` in completion order, the 0/1 node
  matrix C and the decoder B of the online estimates weighted by ``alphas``;
- Toeplitz (:mod:`.toeplitz`): the lower-triangular Toeplitz matrix of a first column;
- BLT (:mod:`.blt`): ``c_0 = 1``, ``c_j = sum_i w_i theta_i^(j - 1)``.
"""

from __future__ import annotations

import numpy as np
import scipy.linalg

from fedsim.config import require


def check_rounds(n: int) -> int:
    """``n`` as an int >= 1."""
    require(isinstance(n, (int, np.integer)) and int(n) >= 1, "n", n, "an integer >= 1")
    return int(n)


def tree_nodes(n: int) -> list[tuple[int, int]]:
    """``(height, index)`` of every node, in completion order (round, then height)."""
    n = check_rounds(n)
    nodes = []
    for t in range(n):
        h = 0
        while (t + 1) % (1 << h) == 0:
            nodes.append((h, (t + 1) // (1 << h) - 1))
            h += 1
    return nodes


def nodes_completed_at(t: int) -> int:
    """How many nodes complete at round t: one plus the trailing zeros of ``t + 1``."""
    return ((t + 1) & -(t + 1)).bit_length()


def decomposition(t: int) -> list[tuple[int, int]]:
    """The maximal complete nodes covering ``[0, t]``: the binary expansion of ``t + 1``."""
    out, start, m = [], 0, t + 1
    for h in range(m.bit_length() - 1, -1, -1):
        if m >> h & 1:
            out.append((h, start >> h))
            start += 1 << h
    return out


def tree_encoder(n: int) -> np.ndarray:
    """C (m x n): one 0/1 row per node of :func:`tree_nodes`, in completion order."""
    nodes = tree_nodes(n)
    C = np.zeros((len(nodes), n))
    for i, (h, k) in enumerate(nodes):
        C[i, k << h : (k + 1) << h] = 1.0
    return C


def tree_decoder(n: int, alphas: np.ndarray, workload: np.ndarray | None = None) -> np.ndarray:
    """B (n x m) of the online tree estimate with per-height own-value weights ``alphas``
    (``alphas[h]``, h = 0..height): the prefix of round t is the sum of the estimates of the
    nodes in the binary expansion of ``t + 1``, each node's estimate
    ``alphas[h] node + (1 - alphas[h]) (est_left + est_right)``. This is the map
    :class:`fedsim.privacy.matrix.streaming.TreeStream` applies to the node noise, times A."""
    nodes = tree_nodes(n)
    index = {node: i for i, node in enumerate(nodes)}
    m = len(nodes)
    est: dict[tuple[int, int], np.ndarray] = {}
    for h, k in nodes:
        row = np.zeros(m)
        row[index[(h, k)]] = alphas[h]
        if h > 0 and alphas[h] != 1.0:
            row += (1.0 - alphas[h]) * (est[(h - 1, 2 * k)] + est[(h - 1, 2 * k + 1)])
        est[(h, k)] = row
    prefix = np.stack([sum(est[node] for node in decomposition(t)) for t in range(n)])
    # prefix = P^{-1}-free estimate of tri(n) x; a general workload post-processes it:
    # A = A P^{-1} P with P^{-1} the first-difference matrix.
    if workload is not None:
        diff = np.eye(n) - np.eye(n, k=-1)
        prefix = workload @ (diff @ prefix)
    return prefix


def tree_height(n: int) -> int:
    """The height of the tallest node for n rounds: ``floor(log2 n)``."""
    return int(check_rounds(n)).bit_length() - 1


def toeplitz_matrix(coef: np.ndarray, n: int) -> np.ndarray:
    """The n x n lower-triangular Toeplitz matrix with first column ``coef`` (zero-padded)."""
    c = np.zeros(n)
    coef = np.asarray(coef, dtype=np.float64)[:n]
    c[: coef.shape[0]] = coef
    return scipy.linalg.toeplitz(c, np.zeros(n))


def blt_coefficients(weights: np.ndarray, thetas: np.ndarray, n: int) -> np.ndarray:
    """``c_0 = 1``, ``c_j = sum_i w_i theta_i^(j - 1)`` for ``1 <= j < n``."""
    w = np.asarray(weights, dtype=np.float64)
    th = np.asarray(thetas, dtype=np.float64)
    require(w.shape == th.shape and w.ndim == 1, "weights", w.shape, f"shape {th.shape}")
    powers = th[None, :] ** np.arange(max(n - 1, 0))[:, None]
    return np.concatenate([[1.0], powers @ w])
