"""Kind ``tree_restart``: DP-FTRL's binary tree restarted every ``restart_every`` rounds
(Kairouz et al. 2021, "Practical and Private (Deep) Learning without Sampling or Shuffling",
Sec. 4 "tree restarts").

Rounds split into blocks of ``restart_every`` (the last one shorter when it does not divide n);
each block gets a fresh binary tree (:mod:`fedsim.privacy.matrix.tree`). C (m x n) is the
block-diagonal of the blocks' tree node matrices, its rows in completion order; B (n x m) gives
round t of block j the sum of every earlier block's estimate of its total (the last row of that
block's tree decoder) plus its own block's binary-tree prefix, so B C = A, the prefix sums.
Each round lies in at most ``floor(log2 restart_every) + 1`` nodes, all of its own block: the
single-participation sensitivity is the tree's for ``restart_every`` rounds, and with
``min_sep >= restart_every`` every participation falls in a block of its own (orthogonal
columns, sensitivity sqrt(k) times that; the paper restarts every epoch).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from fedsim.config import ConfigError, require
from fedsim.privacy.matrix.factorization import Factorization, check_rounds
from fedsim.privacy.matrix.kind import Kind
from fedsim.privacy.matrix.streaming import NoiseStream, RoundNoise
from fedsim.privacy.matrix.structure import (
    nodes_completed_at,
    tree_decoder,
    tree_encoder,
    tree_height,
)

#: the kind's one option (``--option restart_every=R``, ``strategy.options.kind_options``)
OPTION = "restart_every"


def blocks(n: int, restart_every: int) -> list[tuple[int, int]]:
    """(first round, length) of each block of at most ``restart_every`` of n rounds."""
    n = check_rounds(n)
    require(
        isinstance(restart_every, int | np.integer)
        and not isinstance(restart_every, bool)
        and restart_every >= 1,
        OPTION,
        restart_every,
        "an integer >= 1",
    )
    every = int(restart_every)
    return [(start, min(every, n - start)) for start in range(0, n, every)]


def restart_encoder(n: int, restart_every: int) -> np.ndarray:
    """C (m x n): the block-diagonal of each block's binary-tree node matrix."""
    parts = [tree_encoder(length) for _, length in blocks(n, restart_every)]
    C = np.zeros((sum(p.shape[0] for p in parts), n))
    row = 0
    for (start, length), part in zip(blocks(n, restart_every), parts, strict=True):
        C[row : row + part.shape[0], start : start + length] = part
        row += part.shape[0]
    return C


def restart_decoder(n: int, restart_every: int) -> np.ndarray:
    """B (n x m): round t of block j reads every earlier block's total (the last row of its
    tree decoder) and block j's own prefix row, so that ``B C`` is the prefix-sum matrix."""
    parts = [
        tree_decoder(length, np.ones(tree_height(length) + 1))
        for _, length in blocks(n, restart_every)
    ]
    B = np.zeros((n, sum(p.shape[1] for p in parts)))
    column = 0
    for (start, length), part in zip(blocks(n, restart_every), parts, strict=True):
        width = part.shape[1]
        B[start : start + length, column : column + width] = part
        B[start + length :, column : column + width] = part[-1]
        column += width
    return B


def tree_restart(n: int, restart_every: int) -> Factorization:
    """The binary tree restarted every ``restart_every`` rounds, for the n-round prefix sums."""
    n = check_rounds(n)
    A = np.tril(np.ones((n, n)))
    C, B = restart_encoder(n, restart_every), restart_decoder(n, restart_every)
    return Factorization("tree_restart", A, C, B, {OPTION: int(restart_every)})


class RestartTreeStream(NoiseStream):
    """The binary tree's gradient-space noise ``y_t = p_t - p_{t-1}`` with its node stack and
    prefix cleared at every restart (a restart's first round starts a new tree: the earlier
    blocks' totals are already in the released sum). Round t draws one fresh value per node of
    its block's tree completing at t (leaf first)."""

    _buffers = ("stack", "prefix")

    def __init__(self, n: int, restart_every: int, noise: RoundNoise, shape: Any) -> None:
        super().__init__(n, noise, shape)
        blocks(n, restart_every)
        self.restart_every = int(restart_every)
        # the noise of the nodes in the binary expansion of the block's rounds so far
        self.stack: list[np.ndarray] = []
        self.prefix = np.zeros(self.shape)

    def fresh_per_round(self, t: int) -> int:
        return nodes_completed_at(t % self.restart_every)

    def _step(self, t: int) -> np.ndarray:
        if t % self.restart_every == 0:
            self.stack, self.prefix = [], np.zeros(self.shape)
        count = self.fresh_per_round(t)
        z = self.fresh(t, count)
        # the node of height count - 1 ending at t replaces its count - 1 descendants
        del self.stack[len(self.stack) - (count - 1) :]
        self.stack.append(z[count - 1])
        prefix = np.sum(self.stack, axis=0)
        y = prefix - self.prefix
        self.prefix = prefix
        return y


def restart_stream(f: Factorization, noise: RoundNoise, shape: Any) -> RestartTreeStream:
    """The restarted tree's noise for ``f``'s ``restart_every``."""
    return RestartTreeStream(f.n, int(f.params[OPTION]), noise, shape)


def restart_mismatch(f: Any) -> str | None:
    """C the block-diagonal tree node matrix of ``f``'s ``restart_every``, B its decoder."""
    every = f.params.get(OPTION)
    try:
        C, B = restart_encoder(f.n, every), restart_decoder(f.n, every)
    except ConfigError:
        return f"{OPTION} {every!r} is not an integer >= 1"
    if f.encoder.shape != C.shape or not np.array_equal(f.encoder, C):
        return f"C (shape {f.encoder.shape}) is not the node matrix of the trees ({OPTION} {every})"
    if f.decoder.shape != B.shape or not np.allclose(f.decoder, B, rtol=0, atol=1e-12):
        return f"B is not the decoder of the trees ({OPTION} {every})"
    return None


def _build(spec: Any, progress: Any) -> Factorization:
    every = spec.option(OPTION)
    require(
        every is not None,
        f"kind_options.{OPTION}",
        every,
        "an integer >= 1, the rounds between restarts (required by kind tree_restart)",
    )
    return tree_restart(spec.rounds, every)


TREE_RESTART = Kind(
    name="tree_restart",
    build=_build,
    stream=restart_stream,
    mismatch=restart_mismatch,
    closed_form=True,
    zero_one_encoder=True,
    options=(OPTION,),
)
