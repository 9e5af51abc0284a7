"""Reproducible sampling for Flower strategies that draw from Python's ``random``.

Flower's built-in strategies pick nodes with ``random.sample`` on the
interpreter-wide generator, so two runs of the same experiment pick different
clients. :class:`SeededSampling` wraps any strategy and runs each
``configure_*`` call under Python's ``random`` seeded from ``(seed, round,
phase)``, restoring the generator's previous state afterwards, so nothing else
in the process is affected and a run can be repeated (or resumed) exactly.
"""

from __future__ import annotations

import random
from collections.abc import Iterable, Iterator
from contextlib import contextmanager

import numpy as np
from flwr.app import ArrayRecord, ConfigRecord, Message
from flwr.serverapp import Grid
from flwr.serverapp.strategy import Strategy

from strategies.wrapper import StrategyWrapper

_TRAIN, _EVALUATE = 0, 1


@contextmanager
def python_random(*words: int) -> Iterator[None]:
    """Seed Python's ``random`` from ``words`` for the duration of the block."""
    state = random.getstate()
    seed = np.random.SeedSequence([int(w) for w in words]).generate_state(4, np.uint32)
    random.seed(int.from_bytes(seed.tobytes(), "little"))
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
