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
from fedsim.privacy.matrix.structure import decomposition as decomposition
from fedsim.privacy.matrix.structure import nodes_completed_at as nodes_completed_at
from fedsim.privacy.matrix.structure import tree_decoder, tree_encoder, tree_height
from fedsim.privacy.matrix.structure import tree_nodes as tree_nodes


def honaker_alphas(height: int) -> np.ndarray:
    """``alpha_h = v_h = 2^h / (2^{h+1} - 1)`` for ``h = 0..height``: the weight of a node's own
    noisy value in its online estimate (unit node noise)."""
    v = [1.0]
    for _ in range(height):
        v.append(1.0 / (1.0 + 1.0 / (2.0 * v[-1])))
    return np.array(v)


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
