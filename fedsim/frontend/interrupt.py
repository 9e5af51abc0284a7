"""Stopping a run from outside: Ctrl-C (SIGINT) or SIGTERM.

While a :func:`stop_requests` block is open, the first SIGINT or SIGTERM only asks the run to
stop: the round in progress finishes, is written and checkpointed, and the run then ends with
:class:`Interrupted` (``at_once`` False) before the next round starts
(:meth:`StopRequests.after_round`, called by the run's round handler). A second signal stops
at once (``at_once`` True), abandoning the round in progress; it is held back only while a
checkpoint or a rounds.jsonl line is being written (:meth:`StopRequests.writing`), so the run
directory is left as a kill at a round boundary would leave it, which ``--resume`` continues
from its last checkpoint (:mod:`fedsim.frontend.rundir`). Once the run is stopping (either way),
further signals are ignored, so its files are closed and the command's last line is printed.

:class:`Interrupted` is a ``KeyboardInterrupt``: no ``except Exception`` on the way swallows
it. The command line turns it into one line with the ``--resume`` command and exit status 130.

Signal handlers are process-wide and set from the main thread only, so there is one set of
stop requests per process, found with :func:`active`. ``ray.init`` installs its own SIGTERM
handler; :meth:`StopRequests.install` is called again once the engine is up.
"""

from __future__ import annotations

import contextlib
import signal
import sys
import threading
from collections.abc import Iterator
from types import FrameType
from typing import TextIO

#: the signals that ask a run to stop
SIGNALS = (signal.SIGINT, signal.SIGTERM)

#: the exit status of a run stopped by a signal (128 + SIGINT, as shells report Ctrl-C)
EXIT_INTERRUPTED = 130


class Interrupted(KeyboardInterrupt):
    """A run stopped by a signal.

    Attributes:
        signal_name: ``"SIGINT"`` or ``"SIGTERM"`` (the first signal received).
        at_once: True when a second signal abandoned the round in progress.
        server_round: the last round written and checkpointed (graceful stop), else None.
    """

    def __init__(self, signal_name: str, at_once: bool, server_round: int | None = None) -> None:
        self.signal_name, self.at_once, self.server_round = signal_name, at_once, server_round
        how = "at once" if at_once else f"after round {server_round}"
        super().__init__(f"{signal_name}: the run stopped {how}")


class StopRequests:
    """The SIGINT/SIGTERM handler of a run and what it has received (see the module)."""

    def __init__(self, stream: TextIO | None = None, announce: bool = True) -> None:
        self.received: list[str] = []
        self._stream, self._announce = stream, announce
        self._writing = 0
        self._held: bool = False
        self._raised = False  # the run is already stopping: later signals change nothing
        self._previous: dict[int, object] = {}

    @property
    def requested(self) -> bool:
        """Whether a signal has asked the run to stop."""
        return bool(self.received)

    def install(self) -> None:
        """Make this the handler of :data:`SIGNALS` (again, if another took them over); in a
        thread other than the main one, where no handler can be set, nothing changes."""
        if threading.current_thread() is not threading.main_thread():
            return
        for sig in SIGNALS:
            current = signal.getsignal(sig)
            if current != self._handle:
                previous = signal.signal(sig, self._handle)
                self._previous.setdefault(sig, previous)

    def restore(self) -> None:
        """Put back the handlers there were before :meth:`install`."""
        for sig, previous in self._previous.items():
            signal.signal(sig, previous)  # type: ignore[arg-type]
        self._previous.clear()

    def _say(self, text: str) -> None:
        stream = self._stream if self._stream is not None else sys.stderr
        with contextlib.suppress(OSError, ValueError):  # a closed stderr never stops the stop
            stream.write(text + "\n")
            stream.flush()

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        del frame
        self.received.append(signal.Signals(signum).name)
        if len(self.received) == 1:
            if not self._announce:
                return
            self._say(
                f"fedsim: {self.received[0]} received: stopping after the current round "
                "(again to stop at once)"
            )
            return
        if self._raised:
            return
        if self._writing:
            self._held = True
            return
        self._raise(at_once=True)

    def _raise(self, at_once: bool, server_round: int | None = None) -> None:
        self._raised = True
        raise Interrupted(self.received[0], at_once=at_once, server_round=server_round)

    @contextlib.contextmanager
    def writing(self) -> Iterator[None]:
        """A block a second signal does not cut (a checkpoint, a rounds.jsonl line): a stop
        at once that arrives inside it is raised when it ends."""
        self._writing += 1
        try:
            yield
        finally:
            self._writing -= 1
        if not self._writing and self._held:
            self._held = False
            self._raise(at_once=True)

    def after_round(self, server_round: int) -> None:
        """Called once round ``server_round`` is written and checkpointed: end the run here
        (raise :class:`Interrupted`) if a signal asked it to stop."""
        if self.requested and not self._raised:
            self._raise(at_once=False, server_round=server_round)


_ACTIVE: list[StopRequests] = []


def active() -> StopRequests | None:
    """The stop requests of the open :func:`stop_requests` block, if any."""
    return _ACTIVE[-1] if _ACTIVE else None


def writing() -> contextlib.AbstractContextManager[None]:
    """:meth:`StopRequests.writing` of the active stop requests (nothing when none is)."""
    stops = active()
    return stops.writing() if stops is not None else contextlib.nullcontext()


@contextlib.contextmanager
def stop_requests(stream: TextIO | None = None, announce: bool = True) -> Iterator[StopRequests]:
    """Handle SIGINT and SIGTERM as stop requests for the block (main thread only: elsewhere
    the block runs with the handlers it has and nothing is requested). ``announce``: say on
    ``stream`` (default stderr) that the first signal was received and what a second does."""
    stops = StopRequests(stream, announce)
    main = threading.current_thread() is threading.main_thread()
    if main:
        stops.install()
    _ACTIVE.append(stops)
    try:
        yield stops
    finally:
        _ACTIVE.remove(stops)
        if main:
            stops.restore()
