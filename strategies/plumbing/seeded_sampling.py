"""Reproducible sampling for Flower strategies that draw from Python's ``random``.

Flower's built-in strategies pick nodes with ``random.sample`` on the
interpreter-wide generator, so two runs of the same experiment pick different
clients. :class:`SeededSampling` wraps any strategy and runs each
``configure_*`` call under Python's ``random`` seeded from ``(seed, round,
phase)``, restoring the generator's previous state afterwards, so nothing else
in the process is affected and a run can be repeated (or resumed) exactly.

Why the global generator and not an explicit one: Flower (1.42) gives no hook for
one. ``FedAvg.configure_train``/``configure_evaluate`` (and every strategy built on
them) call ``flwr.serverapp.strategy.strategy_utils.sample_nodes(grid,
min_available_nodes, sample_size)``, which draws ``random.sample(all_nodes,
sample_size)`` from the module ``random`` and takes no generator. Handing the inner
strategy a grid that reports only nodes we sampled from a ``random.Random`` would
still have Flower permute them with the global generator (and change how many it
takes, since the sample size is a fraction of what the grid reports); replacing
``strategy_utils.random`` is process-wide state too; re-implementing each Flower
strategy's ``configure_*`` would copy Flower. The seeded block is therefore the
narrowest change: it holds the global generator only for the duration of one
``configure_*`` call on the server's thread and gives it back untouched.
"""

from __future__ import annotations

import random
from collections.abc import Iterable, Iterator
from contextlib import contextmanager

import numpy as np
from flwr.app import ArrayRecord, ConfigRecord, Message
from flwr.serverapp import Grid
from flwr.serverapp.strategy import Strategy

from strategies.plumbing.wrapper import StrategyWrapper

_TRAIN, _EVALUATE = 0, 1


def sampling_seed(*words: int) -> int:
    """The 128-bit seed of Python's ``random`` for ``words`` (``seed, round, phase``): four
    32-bit words of ``np.random.SeedSequence(words)``, little-endian. Seeding the global
    generator with it draws exactly what ``random.Random(sampling_seed(*words))`` draws."""
    state = np.random.SeedSequence([int(w) for w in words]).generate_state(4, np.uint32)
    return int.from_bytes(state.tobytes(), "little")


@contextmanager
def python_random(*words: int) -> Iterator[None]:
    """Seed Python's ``random`` with :func:`sampling_seed` of ``words`` for the duration of
    the block, then restore its previous state."""
    state = random.getstate()
    random.seed(sampling_seed(*words))
    try:
        yield
    finally:
        random.setstate(state)


class SeededSampling(StrategyWrapper):
    """``strategy`` with its node sampling drawn from ``(seed, round, phase)``."""

    def __init__(self, strategy: Strategy, seed: int) -> None:
        super().__init__(strategy)
        self.seed = seed

    def configure_train(
        self, server_round: int, arrays: ArrayRecord, config: ConfigRecord, grid: Grid
    ) -> Iterable[Message]:
        with python_random(self.seed, server_round, _TRAIN):
            return list(self.strategy.configure_train(server_round, arrays, config, grid))

    def configure_evaluate(
        self, server_round: int, arrays: ArrayRecord, config: ConfigRecord, grid: Grid
    ) -> Iterable[Message]:
        with python_random(self.seed, server_round, _EVALUATE):
            return list(self.strategy.configure_evaluate(server_round, arrays, config, grid))
