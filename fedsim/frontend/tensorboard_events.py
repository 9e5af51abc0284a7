"""TensorBoard event files of a run (``[output] tensorboard = true``).

:class:`TensorBoardEvents` is a sink of :class:`fedsim.frontend.results.RoundRecorder`: every round
line it is handed becomes TensorBoard scalars under ``RUN_DIR/tensorboard/``, one per metric of
:func:`fedsim.frontend.run_series.round_values` (tag = the metric's name, e.g. ``central/accuracy``,
``privacy/epsilon``, ``bytes_up``, ``seconds``; step = the round), so TensorBoard shows what
``fedsim plot`` shows. TensorBoard stores scalars as float32.

The event files mirror ``rounds.jsonl``: when the sink opens it removes the directory's event
files and writes the round lines ``rounds.jsonl`` already holds again (none for a new run; for
a resumed run the lines up to its checkpoint, which :class:`~fedsim.frontend.results.RunWriter`
kept), so a resumed run's events hold each round once, as its ``rounds.jsonl`` does. The events are
flushed after every round.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from types import TracebackType
from typing import Any

from fedsim.config import ConfigError
from fedsim.frontend.run_series import round_values

#: the folder of a run directory that holds its event files
TENSORBOARD_DIR = "tensorboard"
#: how TensorBoard names event files
EVENT_FILES = "events.out.tfevents.*"


class TensorBoardEvents:
    """Writes round lines as TensorBoard scalars in ``out_dir/tensorboard/``.

    ``written``: the round lines the run directory already holds (replayed first, after the
    folder's old event files are removed). Use as a context manager, or call :meth:`close`.
    """

    def __init__(self, out_dir: str | Path, written: Sequence[dict[str, Any]] = ()) -> None:
        try:
            from torch.utils.tensorboard import SummaryWriter  # noqa: PLC0415
        except ImportError as err:
            raise ConfigError(
                "output.tensorboard",
                True,
                f"false, or the tensorboard package installed (pip install "
                f"'fedsim[tensorboard]'); importing it failed: {err}",
            ) from None
        self.directory = Path(out_dir) / TENSORBOARD_DIR
        for old in self.directory.glob(EVENT_FILES):
            old.unlink()
        self._writer = SummaryWriter(log_dir=str(self.directory))
        for record in written:
            self._add(record)
        self._writer.flush()

    def __call__(self, record: dict[str, Any]) -> None:
        """The sink: write one round line's scalars and flush them."""
        self._add(record)
        self._writer.flush()

    def _add(self, record: dict[str, Any]) -> None:
        step = int(record["round"])
        for name, value in round_values(record).items():
            self._writer.add_scalar(name, value, global_step=step)

    def close(self) -> None:
        self._writer.close()

    def __enter__(self) -> TensorBoardEvents:
        return self

    def __exit__(
        self,
        kind: type[BaseException] | None,
        error: BaseException | None,
        trace: TracebackType | None,
    ) -> None:
        self.close()
