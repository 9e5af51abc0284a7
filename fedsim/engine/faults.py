"""Faults as configuration: dropouts, stragglers past a deadline, worker crashes.

All decisions are drawn from ``default_rng([seed, round, kind, stream])`` over
the phase's messages in node order, so a run with faults is as reproducible as
one without, and a resumed run draws the same faults.

* **Dropout**: a sampled client goes offline before training, with probability
  ``dropout``; it never replies (the strategy gets fewer replies, as when a real
  device disappears) and does not run.
* **Stragglers**: with probability ``straggler_fraction`` a client is slow and
  its reply is delayed by an exponential time with mean ``straggler_delay_s``
  (simulated seconds: nothing sleeps, so runs stay fast and reproducible). When
  the phase has a ``deadline_s``, a reply whose delay exceeds it is late: the
  client ran (its state is kept) but the reply is dropped, as Flower drops
  replies that miss ``send_and_receive``'s timeout.
* **Crashes**: a batch's first attempt kills its worker process after a random
  number of its clients, with probability ``crash_probability``. The engine
  replaces the worker and runs the batch again from the same inputs, so the
  round's result is the same as without the crash.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from fedsim.config import require

_CLIENTS, _CRASHES = 1, 2


@dataclass(frozen=True, kw_only=True)
class FaultConfig:
    """Faults to inject (all off by default)."""

    dropout: float = 0.0
    straggler_fraction: float = 0.0
    straggler_delay_s: float = 0.0
    deadline_s: float = 0.0
    crash_probability: float = 0.0
    seed: int = 0

    def __post_init__(self) -> None:
        for key in ("dropout", "straggler_fraction", "crash_probability"):
            value = getattr(self, key)
            require(0.0 <= value <= 1.0, f"faults.{key}", value, "a probability in [0, 1]")
        require(
            self.straggler_delay_s >= 0,
            "faults.straggler_delay_s",
            self.straggler_delay_s,
            "a number of seconds >= 0",
        )
        require(
            self.deadline_s >= 0,
            "faults.deadline_s",
            self.deadline_s,
            "a number of seconds >= 0 (0: no deadline)",
        )

    @property
    def active(self) -> bool:
        return bool(
            self.dropout or (self.straggler_fraction and self.deadline_s) or self.crash_probability
        )


@dataclass(frozen=True)
class ClientFaults:
    """Per-message outcomes for one phase (messages in node order)."""

    dropped: np.ndarray
    late: np.ndarray
    delay_s: np.ndarray


def client_faults(config: FaultConfig, server_round: int, kind: int, count: int) -> ClientFaults:
    """Which of a phase's ``count`` clients drop out, and which reply late."""
    rng = np.random.default_rng([config.seed, server_round, kind, _CLIENTS])
    dropped = rng.random(count) < config.dropout
    slow = rng.random(count) < config.straggler_fraction
    delay = np.where(slow, rng.exponential(config.straggler_delay_s or 1.0, count), 0.0)
    if not config.straggler_delay_s:
        delay = np.zeros(count)
    late = (delay > config.deadline_s) & (config.deadline_s > 0) & ~dropped
    return ClientFaults(dropped=dropped, late=late, delay_s=delay)


def crash_point(
    config: FaultConfig, server_round: int, kind: int, batch: int, size: int
) -> int | None:
    """After how many of its ``size`` clients batch number ``batch`` of a phase
    kills its worker on the first attempt (None: it does not)."""
    if not config.crash_probability:
        return None
    rng = np.random.default_rng([config.seed, server_round, kind, _CRASHES, batch])
    if rng.random() >= config.crash_probability:
        return None
    return int(rng.integers(0, size))
