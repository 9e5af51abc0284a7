"""Progress of a run on stderr: round, clients per second, epsilon so far (a private run's
``privacy`` section, and with client DP-SGD the worst client's), latest metrics.

On a terminal, a live bar (rich). Anywhere else (a batch job, ``nohup``, a pipe), plain
lines, flushed as they are written, never cut and without cursor control, at the
:class:`Cadence` asked for: every N rounds, or at most one line per S seconds.
"""

from __future__ import annotations

import re
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TextIO

from fedsim.config import ConfigError

_SHOWN = ("accuracy", "loss", "train_loss")


def _latest_metrics(record: dict[str, Any]) -> str:
    parts = []
    for section in ("central", "evaluate", "train"):
        values = record.get(section)
        if not isinstance(values, dict):
            continue
        metrics = values.get("metrics", values)
        for key in _SHOWN:
            if isinstance(metrics.get(key), (int, float)):
                parts.append(f"{section}.{key}={metrics[key]:.4g}")
    return " ".join(parts[:3])


def _epsilon_of(value: Any) -> float | None:
    """A privacy section's epsilon: a number, or the largest of a list of them (one per
    delta or per party); None when there is none."""
    if isinstance(value, (list, tuple)):
        numbers = [v for v in value if isinstance(v, (int, float)) and not isinstance(v, bool)]
        return max(numbers) if numbers else None
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return float(value)
    return None


def _privacy(record: dict[str, Any], symbol: str) -> str:
    """The run's epsilon so far (``privacy``), and with client DP-SGD the worst client's
    (``client_privacy``), as ``ε=1.23 (δ=1e-05)``; empty for a run with neither."""
    parts = []
    run = record.get("privacy")
    if isinstance(run, dict) and (eps := _epsilon_of(run.get("epsilon"))) is not None:
        delta = run.get("delta")
        at = f" (δ={delta:g})" if isinstance(delta, (int, float)) else ""
        parts.append(f"{symbol}={eps:.4g}{at}")
    client = record.get("client_privacy")
    if isinstance(client, dict) and (eps := _epsilon_of(client.get("max_epsilon"))) is not None:
        parts.append(f"client {symbol}<={eps:.4g}")
    text = " ".join(parts)
    return text if symbol == "ε" else text.replace("δ", "delta")


def _symbol(stream: TextIO) -> str:
    """``ε`` where ``stream`` can encode it, else ``epsilon`` (a stream in ASCII)."""
    try:
        "εδ".encode(getattr(stream, "encoding", None) or "ascii")
    except (LookupError, UnicodeEncodeError):
        return "epsilon"
    return "ε"


@dataclass(frozen=True, kw_only=True)
class Cadence:
    """When plain progress lines are written: after every ``rounds`` rounds, or (with
    ``seconds`` set instead) at the first round finished ``seconds`` or more after the last
    line. The first and the last round always get a line."""

    rounds: int | None = 1
    seconds: float | None = None

    def __post_init__(self) -> None:
        if (self.rounds is None) == (self.seconds is None):
            raise ConfigError("progress cadence", (self.rounds, self.seconds), "rounds or seconds")
        if self.rounds is not None and self.rounds < 1:
            raise ConfigError("--progress-every", self.rounds, "an integer >= 1 (rounds)")
        if self.seconds is not None and not self.seconds > 0:
            raise ConfigError("--progress-every", f"{self.seconds}s", "seconds > 0, e.g. 30s")

    @classmethod
    def parse(cls, text: str) -> Cadence:
        """``"N"``: every N rounds; ``"Ss"``: at most one line per S seconds (``"30s"``)."""
        match = re.fullmatch(r"\s*(\d+)\s*|\s*(\d+(?:\.\d*)?|\.\d+)\s*s\s*", text)
        if match is None:
            raise ConfigError(
                "--progress-every", text, "a number of rounds (e.g. 10) or seconds (e.g. 30s)"
            )
        if match.group(1) is not None:
            return cls(rounds=int(match.group(1)))
        return cls(rounds=None, seconds=float(match.group(2)))


def _incomplete(record: dict[str, Any]) -> str:
    """How a round the ServerApp stopped is shown (empty for a finished round)."""
    errors = record.get("incomplete")
    if not errors:
        return ""
    return f"did not complete (the ServerApp logged: {' '.join(map(str, errors))})"


class _PlainLines:
    """Progress as plain lines on ``stream`` at a :class:`Cadence`; ``clock`` in seconds."""

    def __init__(
        self,
        total: int | None,
        done: int,
        cadence: Cadence,
        stream: TextIO,
        clock: Callable[[], float],
    ) -> None:
        self._total, self._cadence, self._stream, self._clock = total, cadence, stream, clock
        self._started = self._last_time = clock()
        self._last_round: int | None = None
        self._first = done + 1
        self._symbol = _symbol(stream)

    def _due(self, round_: int, now: float) -> bool:
        if round_ in (self._first, self._total) or self._last_round is None:
            return True
        if self._cadence.rounds is not None:
            return round_ - self._last_round >= self._cadence.rounds
        return now - self._last_time >= (self._cadence.seconds or 0.0)

    def write(self, record: dict[str, Any]) -> None:
        round_, now = int(record.get("round", 0)), self._clock()
        stopped = _incomplete(record)
        if round_ == 0 or not (stopped or self._due(round_, now)):
            return
        of = f"/{self._total}" if self._total else ""
        parts = [
            f"fedsim: round {round_}{of}" + (f" {stopped}" if stopped else ""),
            f"{now - self._started:.1f} s",
            f"{record.get('clients_per_s', 0.0):.0f} clients/s",
        ]
        privacy = _privacy(record, self._symbol)
        if privacy:
            parts.append(privacy)
        metrics = _latest_metrics(record)
        self._stream.write(", ".join(parts) + (f", {metrics}" if metrics else "") + "\n")
        self._stream.flush()
        self._last_round, self._last_time = round_, now


class RunProgress:
    """Shows a run's progress; call it with each round record.

    ``enabled``: False shows nothing; True, or a :class:`Cadence` for the plain lines, shows
    a live bar when ``stream`` (default: stderr) is a terminal and plain lines otherwise
    (their times read from ``clock``, in seconds).
    """

    def __init__(
        self,
        total_rounds: int | None,
        *,
        done: int = 0,
        enabled: bool | Cadence = True,
        stream: TextIO | None = None,
        clock: Callable[[], float] = time.perf_counter,
    ) -> None:
        stream = sys.stderr if stream is None else stream
        live = enabled is not False and bool(getattr(stream, "isatty", lambda: False)())
        self._plain = None
        if enabled is not False and not live:
            cadence = enabled if isinstance(enabled, Cadence) else Cadence()
            self._plain = _PlainLines(total_rounds, done, cadence, stream, clock)
        self._progress = None
        if live:
            from rich.console import Console  # noqa: PLC0415
            from rich.progress import (  # noqa: PLC0415
                BarColumn,
                MofNCompleteColumn,
                Progress,
                TextColumn,
                TimeElapsedColumn,
            )

            self._progress = Progress(
                TextColumn("[bold]round"),
                MofNCompleteColumn(),
                BarColumn(),
                TextColumn("{task.fields[rate]}"),
                TextColumn("{task.fields[privacy]}"),
                TextColumn("{task.fields[metrics]}"),
                TimeElapsedColumn(),
                console=Console(file=stream),
            )
            self._symbol = _symbol(stream)
            self._task = self._progress.add_task(
                "run", total=total_rounds, completed=done, rate="", privacy="", metrics=""
            )

    def __enter__(self) -> RunProgress:
        if self._progress is not None:
            self._progress.start()
        return self

    def __exit__(self, *exc: object) -> None:
        if self._progress is not None:
            self._progress.stop()

    def __call__(self, record: dict[str, Any]) -> None:
        if self._plain is not None:
            self._plain.write(record)
        if self._progress is None:
            return
        privacy = _privacy(record, self._symbol)
        if record.get("round", 0) == 0:
            self._progress.update(self._task, privacy=privacy, metrics=_latest_metrics(record))
            return
        self._progress.update(
            self._task,
            advance=1,
            rate=f"{record.get('clients_per_s', 0.0):.0f} clients/s",
            privacy=privacy,
            metrics=_incomplete(record) or _latest_metrics(record),
        )
