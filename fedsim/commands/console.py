"""What the command line writes to stderr: one handler for every log line, a level per
verbosity, and the chatter of dependencies kept in the log's DEBUG level.

Three verbosities, chosen by the global flags of ``fedsim``:

- ``QUIET`` (``--quiet``): errors only; the command's result still goes to stdout;
- ``NORMAL``: warnings and errors;
- ``VERBOSE`` (``--verbose``): everything down to DEBUG from fedsim, Flower, absl and Python
  warnings (other libraries from INFO).

Every line goes through one stderr handler on the root logger, as ``LEVEL name: message``.
Flower installs its own console handler on the ``flwr`` logger when it is imported (at any
point of a command), and its records also reach the root: that printed each line twice. A
filter on the ``flwr`` logger detaches Flower's handler the first time a record passes it,
before any handler runs, so each line is printed once and none is lost.

Processes the command starts (a local Ray instance's workers) inherit ``FLWR_LOG_LEVEL``, the
level of Flower's own console handler there: ERROR, WARNING or INFO by verbosity, unless the
user has set it.

With ``--quiet``, what Ray's driver prints by itself (a dead worker's ``(raylet)`` text for
each injected crash, the workers' output) goes to the log at DEBUG too (:func:`hush_ray`).

Kept at DEBUG (shown only with ``--verbose``):

- absl's log, where dp_accounting reports each fractional RDP order whose series did not
  converge (the order is left out of the minimum over orders; the bound stays valid);
- Python warnings raised from dp_accounting's or absl's code (other warnings stay warnings);
- Flower's advisory that ``fraction_evaluate`` is 0.0 (fedsim's strategies evaluate
  centrally), at most once per command.
"""

from __future__ import annotations

import contextlib
import enum
import logging
import os
import sys
import warnings
from collections.abc import Callable, Iterator
from pathlib import PurePath
from typing import Any, TextIO

#: loggers shown down to DEBUG with --verbose (the rest of the root from INFO)
_VERBOSE_LOGGERS = ("fedsim", "strategies", "protocols", "flwr", "absl", "py.warnings")

#: Flower advisories that fedsim's runs trigger by design: DEBUG, and once per command
_ADVISORIES = ("fraction_evaluate is set to 0.0",)

#: packages whose Python warnings are logged at DEBUG
_QUIET_PACKAGES = ("dp_accounting", "absl")

_FORMAT = "%(levelname)s %(name)s: %(message)s"


class Verbosity(enum.Enum):
    """How much a command prints besides its result."""

    QUIET = logging.ERROR
    NORMAL = logging.WARNING
    VERBOSE = logging.DEBUG


#: FLWR_LOG_LEVEL for the processes a command starts (Flower's DEBUG level adds a warning)
_CHILD_FLOWER_LEVEL = {
    Verbosity.QUIET: "ERROR",
    Verbosity.NORMAL: "WARNING",
    Verbosity.VERBOSE: "INFO",
}


class _Stderr(logging.StreamHandler):  # type: ignore[type-arg]
    """Writes to whatever ``sys.stderr`` is when a record arrives (as logging's last-resort
    handler does), so a replaced stderr (a test's capture) is followed."""

    def __init__(self, level: int) -> None:
        super().__init__()
        self.setLevel(level)
        self.setFormatter(logging.Formatter(_FORMAT))

    @property  # type: ignore[override]
    def stream(self) -> TextIO:
        return sys.stderr

    @stream.setter
    def stream(self, value: TextIO) -> None:  # StreamHandler.__init__ assigns it
        del value


class _FlowerOnce(logging.Filter):
    """On the ``flwr`` logger: detach Flower's own console handlers (the root's handler
    prints its records), and demote the advisories in ``_ADVISORIES`` to DEBUG, once."""

    def __init__(self) -> None:
        super().__init__()
        self.detached: list[logging.Handler] = []
        self._seen: set[str] = set()

    def filter(self, record: logging.LogRecord) -> bool:
        flower = logging.getLogger("flwr")
        for handler in list(flower.handlers):
            flower.removeHandler(handler)
            self.detached.append(handler)
        flower.propagate = True
        message = record.getMessage()
        advisory = next((a for a in _ADVISORIES if message.startswith(a)), None)
        if advisory is None:
            return True
        if advisory in self._seen:
            return False
        self._seen.add(advisory)
        record.levelno, record.levelname = logging.DEBUG, "DEBUG"
        # the logger's own level was checked before this filter: check it again at DEBUG
        return flower.isEnabledFor(logging.DEBUG)


#: what :func:`console` undoes when its command ends (set by :func:`hush_ray`)
_UNDO: list[Callable[[], None]] = []


def hush_ray() -> None:
    """Under ``--quiet``, for a command that starts Ray: what Ray's driver prints on its own
    (``(raylet) A worker died or was killed ...``, with its OOM-killer guesses, for each
    injected worker crash, and the workers' own output) goes to the ``fedsim.ray_driver`` log at
    DEBUG instead of stdout and stderr. Called before ``ray.init`` (which binds the printer
    of the workers' output); undone when the command's :func:`console` block ends."""
    import ray._private.worker as ray_worker  # noqa: PLC0415

    printer = ray_worker.print_to_stdstream
    if getattr(printer, "hushed", False):
        return

    def to_log(data: dict[str, Any], ignore_prefix: bool = False) -> None:
        del ignore_prefix
        log = logging.getLogger("fedsim.ray_driver")
        for line in data.get("lines", ()):
            log.debug("(%s) %s", data.get("pid", "ray"), line)

    to_log.hushed = True  # type: ignore[attr-defined]
    ray_worker.print_to_stdstream = to_log
    _UNDO.append(lambda: setattr(ray_worker, "print_to_stdstream", printer))


def _quiet_package(filename: str) -> bool:
    return any(part in _QUIET_PACKAGES for part in PurePath(filename).parts)


def _log_warning(
    message: Warning | str,
    category: type[Warning],
    filename: str,
    lineno: int,
    file: TextIO | None = None,
    line: str | None = None,
) -> None:
    """``warnings.showwarning`` for a command: into the ``py.warnings`` log, at DEBUG when
    raised from dp_accounting's or absl's code, else at WARNING."""
    text = warnings.formatwarning(message, category, filename, lineno, line).rstrip()
    if file is not None:  # an explicit destination is honoured
        file.write(text + "\n")
        return
    level = logging.DEBUG if _quiet_package(filename) else logging.WARNING
    logging.getLogger("py.warnings").log(level, "%s", text)


@contextlib.contextmanager
def console(verbosity: Verbosity) -> Iterator[None]:
    """Configure logging and warnings for one command; restore what was there afterwards
    (Flower's handlers included), so that calling ``fedsim.cli.main`` twice in one process
    behaves like two commands."""
    from absl import logging as absl_logging  # noqa: PLC0415, F401  (makes absl's logger)

    root = logging.getLogger()
    handler = _Stderr(verbosity.value)
    flower_filter = _FlowerOnce()
    flower = logging.getLogger("flwr")
    verbose = verbosity is Verbosity.VERBOSE
    levels: dict[str, Any] = {
        "": logging.INFO if verbose else verbosity.value,
        "absl": logging.DEBUG if verbose else logging.ERROR,
        # Flower sets its logger's level from FLWR_LOG_LEVEL when first imported, which may
        # be inside an earlier command of this process: set it for this one
        "flwr": logging.DEBUG if verbose else verbosity.value,
        **{name: logging.DEBUG for name in _VERBOSE_LOGGERS if verbose and name != "flwr"},
    }
    before = {name: logging.getLogger(name).level for name in levels}
    flower_propagate = flower.propagate
    shown = warnings.showwarning
    child_level = os.environ.get("FLWR_LOG_LEVEL")
    if child_level is None:
        os.environ["FLWR_LOG_LEVEL"] = _CHILD_FLOWER_LEVEL[verbosity]
    root.addHandler(handler)
    flower.addFilter(flower_filter)
    for name, level in levels.items():
        logging.getLogger(name).setLevel(level)
    warnings.showwarning = _log_warning
    try:
        yield
    finally:
        while _UNDO:
            _UNDO.pop()()
        if child_level is None:
            os.environ.pop("FLWR_LOG_LEVEL", None)
        warnings.showwarning = shown
        root.removeHandler(handler)
        flower.removeFilter(flower_filter)
        for detached in flower_filter.detached:
            flower.addHandler(detached)
        flower.propagate = flower_propagate
        for name, level in before.items():
            logging.getLogger(name).setLevel(level)
