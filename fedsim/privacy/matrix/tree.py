"""Tree aggregation: the binary-tree mechanism and Honaker's online (efficient) variant.

Nodes are the dyadic intervals ``[k 2^h, (k + 1) 2^h - 1]`` that end before round n; node
``(h, k)`` is complete, and gets its noise, at round ``(k + 1) 2^h - 1``. C (m x n) has one
0/1 row per node, ordered by completion round and then by height (the order in which
:class:`fedsim.privacy.matrix.streaming.TreeStream` draws their noise). Each round lies in at
most ``floor(log2 n) + 1`` nodes, so the single-participation sensitivity is
``sqrt(floor(log2 n) + 1)`` for n a power of two (Dwork et al. 2010, Chan et al. 2011).

- Binary tree: the prefix ``[0, t]`` is the sum of the nodes of the binary expansion of
  ``t + 1`` (B has 0/1 rows).
- Honaker online (Honaker 2015, "Efficient Use of Differentially Private Binary Trees";
  the efficient tree aggregation used with DP-FTRL): every complete node is
  re-estimated bottom-up from its own noisy value and its two children's estimates,
  ``est_h = alpha_h node_h + (1 - alpha_h)(est_left + est_right)``, with the variance-optimal
  ``alpha_h = v_h`` and ``v_h = 1 / (1 + 1 / (2 v_{h-1}))``, ``v_0 = 1`` (unit node noise),
  i.e. ``v_h = 2^h / (2^{h+1} - 1)``. This is the best linear unbiased estimate of each prefix
  from the nodes complete at that round.
"""

from __future__ import annotations

import numpy as np

from fedsim.privacy.matrix.factorization import Factorization, check_rounds, check_workload


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


def honaker_alphas(height: int) -> np.ndarray:
    """``alpha_h = v_h = 2^h / (2^{h+1} - 1)`` for ``h = 0..height``: the weight of a node's own
    noisy value in its online estimate (unit node noise)."""
    v = [1.0]
    for _ in range(height):
        v.append(1.0 / (1.0 + 1.0 / (2.0 * v[-1])))
    return np.array(v)


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


def _tree(n: int, workload: np.ndarray | None, honaker: bool) -> Factorization:
    n = check_rounds(n)
    A = check_workload(workload, n)
    height = tree_height(n)
    alphas = honaker_alphas(height) if honaker else np.ones(height + 1)
    B = tree_decoder(n, alphas, None if workload is None else A)
    kind = "honaker" if honaker else "tree"
    return Factorization(kind, A, tree_encoder(n), B, {"alphas": alphas})


def binary_tree(n: int, workload: np.ndarray | None = None) -> Factorization:
    """The binary-tree factorization of prefix sums (B = sums of expansion nodes)."""
    return _tree(n, workload, honaker=False)


def honaker_tree(n: int, workload: np.ndarray | None = None) -> Factorization:
    """Honaker's online variance-optimal tree factorization of prefix sums."""
    return _tree(n, workload, honaker=True)
