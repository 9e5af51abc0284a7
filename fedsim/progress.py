"""A terminal progress bar for runs: round, clients per second, latest metrics."""

from __future__ import annotations

from typing import Any

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

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


class RunProgress:
    """Shows one bar per run; call it with each round record."""

    def __init__(self, total_rounds: int | None, *, done: int = 0, enabled: bool = True) -> None:
        self.enabled = enabled
        self._progress = Progress(
            TextColumn("[bold]round"),
            MofNCompleteColumn(),
            BarColumn(),
            TextColumn("{task.fields[rate]}"),
            TextColumn("{task.fields[metrics]}"),
            TimeElapsedColumn(),
            console=Console(stderr=True),
            disable=not enabled,
        )
        self._task = self._progress.add_task(
            "run", total=total_rounds, completed=done, rate="", metrics=""
        )

    def __enter__(self) -> RunProgress:
        self._progress.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._progress.stop()

    def __call__(self, record: dict[str, Any]) -> None:
        if record.get("round", 0) == 0:
            self._progress.update(self._task, metrics=_latest_metrics(record))
            return
        self._progress.update(
            self._task,
            advance=1,
            rate=f"{record.get('clients_per_s', 0.0):.0f} clients/s",
            metrics=_latest_metrics(record),
        )
