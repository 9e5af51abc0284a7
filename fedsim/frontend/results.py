"""Results on disk: one JSON line per round as the run goes, a summary at the end.

``DIR/rounds.jsonl`` gets one line per finished round, flushed immediately, so
an interrupted run keeps every round it finished. ``DIR/summary.json`` is
written (atomically) when the run ends.

A round's line::

    {"round": 3, "time_s": 12.4, "seconds": 0.41, "clients_per_s": 121.9,
     "bytes_down": ..., "bytes_up": ...,
     "train":    {"clients": 50, "failed": 0, "timed_out": 0, "seconds": ...,
                  "compute_s": ..., "metrics": {client-weighted means}},
     "evaluate": {... same for federated evaluation, when there was one},
     "aggregated": {the strategy's aggregated train metrics},
     "aggregated_evaluate": {...}, "central": {server-side evaluation}}

A phase sent under a ``send_and_receive`` timeout says so (``"timeout_s"``; its
``timed_out`` counts the replies that missed it). A round in which the ServerApp logged an
error through Flower's logger (Flower's workflows stop a round that way, e.g. SecAgg+'s
``Insufficient available nodes.``) is not a finished round: its line has ``"incomplete"``,
the messages logged, and the progress line says so.

A private run (DP or secure strategies, DP-SGD clients) writes no client metrics:
its phase sections carry no ``metrics`` and its lines no ``aggregated_evaluate``
(un-noised means of the clients' own numbers); the strategy's ``aggregated`` holds
only what its mechanism released. With ``[privacy] metrics_in_clear = true`` they
are written, and every line that carries them says so: ``"metrics_in_clear": true``.
The server's ``central`` evaluation on its own held-out set is always written.

:class:`RoundRecorder` builds these lines from the grid's phase reports. With
``infer_rounds`` (a Flower ServerApp whose loop fedsim does not see) a round
ends when a phase of a later round starts or when the run closes, or, after an evaluate
phase that carries no round number (nothing else would close it), when the next phase
starts. Phases of one kind in one round make one section (``start_grid`` sends each node
its own message, SecAgg+ sends its stages to the same nodes): counts, bytes and seconds add
up, except that a node in several of them counts once among ``clients``; client metrics are
client-weighted means.
Legacy phases (``get_parameters``, ``get_properties``) have sections of their own name,
other query phases ``query``; a legacy phase before any round, without a round number
(``start_grid``'s initial ``get_parameters``), is round 0. What a plain Flower strategy or
the ServerApp's legacy workflow files each round (:mod:`fedsim.frontend.flwr_metrics`: aggregated
train and evaluate metrics, central evaluation) lands in the round's ``aggregated``,
``aggregated_evaluate`` and ``central`` sections (:meth:`RoundRecorder.strategy_metrics`); a
central evaluation of the initial model before any phase makes a round-0 line. A fedsim
strategy started inside such a ServerApp reports its rounds itself (the recorder is the grid's
:class:`~fedsim.engine.phase_report.RoundLog`), with the same sections as ``fedsim run``.

A private run's ``privacy`` section is the run's, from the grid's release boundary
(:mod:`fedsim.engine.boundary`): its ``epsilon`` composes every accounted mechanism of the
run, ``unaccounted_releases`` counts the client contributions that reached the server side
outside any of them, and any such release makes ``epsilon`` infinite (with ``unaccounted``:
how many of each message type). The last line and summary.json say the same.

Every epsilon is written as :mod:`fedsim.results_json` says (an infinite one as ``1e999``
with a boolean ``<key>_infinite`` next to it).
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import numpy as np
from flwr.app import MetricRecord

from fedsim.config import ConfigError
from fedsim.engine.boundary import ReleaseBoundary
from fedsim.engine.message_types import LEGACY_MESSAGE_TYPES
from fedsim.engine.phase_report import PhaseReport
from fedsim.results_json import ROUNDS_FILE, SUMMARY_FILE, dumps, json_ready, read_rounds
from fedsim.runfiles import write_atomic


def metrics_dict(record: MetricRecord | None) -> dict[str, Any] | None:
    return None if record is None else json_ready(dict(record.items()))


class RunWriter:
    """Writes ``rounds.jsonl`` line by line and ``summary.json`` at the end.

    A new run refuses a directory that already holds results, so nothing
    written before is ever overwritten (an empty ``rounds.jsonl``, left by a run
    refused before its first round, is not a result). A resumed run (``resume_after``, the
    round of its checkpoint) keeps the lines up to that round and drops any
    later ones, which the resumed run writes again, identically.
    """

    def __init__(
        self, out_dir: str | Path, key: str = "--out", resume_after: int | None = None
    ) -> None:
        self.out_dir = Path(out_dir)
        self.rounds_path = self.out_dir / ROUNDS_FILE
        self.summary_path = self.out_dir / SUMMARY_FILE
        if resume_after is None:
            self.check_new(out_dir, key)
            self.out_dir.mkdir(parents=True, exist_ok=True)
        else:
            kept = [r for r in read_rounds(self.rounds_path) if r["round"] <= resume_after]
            text = "".join(dumps(r, sort_keys=True) + "\n" for r in kept)
            write_atomic(self.rounds_path, text.encode())
        self._rounds = self.rounds_path.open("a", encoding="utf-8")

    @staticmethod
    def check_new(out_dir: str | Path, key: str = "--out") -> None:
        """Raise :class:`ConfigError` on ``key`` unless ``out_dir`` can hold a new run."""
        out = Path(out_dir)
        rounds = out / ROUNDS_FILE
        if (rounds.is_file() and rounds.stat().st_size > 0) or (out / SUMMARY_FILE).exists():
            raise ConfigError(
                key, str(out_dir), "a new or empty directory (this one already holds results)"
            )
        if out.exists() and not out.is_dir():
            raise ConfigError(key, str(out_dir), "a directory path (a file has this name)")

    def write_round(self, record: Mapping[str, Any]) -> None:
        self._rounds.write(dumps(record, sort_keys=True) + "\n")
        self._rounds.flush()

    def sync(self) -> None:
        """Make the lines written so far durable (before a checkpoint that covers them)."""
        self._rounds.flush()
        os.fsync(self._rounds.fileno())

    def write_summary(self, summary: Mapping[str, Any]) -> None:
        text = dumps(summary, indent=2, sort_keys=True) + "\n"
        write_atomic(self.summary_path, text.encode())

    def close(self) -> None:
        self._rounds.close()


def _phase_section(report: PhaseReport, client_metrics: bool) -> dict[str, Any]:
    section = {
        "clients": report.succeeded,
        "failed": report.failed,
        "timed_out": report.timed_out,
        "dropped": report.dropped,
        "messages": report.messages,
        "seconds": report.wall_s,
        "compute_s": report.compute_s,
        "bytes_down": report.bytes_down,
        "bytes_up": report.bytes_up,
    }
    if report.timeout_s is not None:
        section["timeout_s"] = report.timeout_s
    if client_metrics:
        section["metrics"] = report.client_metrics
    return section


def _section_name(message_type: str) -> str:
    """The round line's section for a phase of ``message_type``."""
    category = message_type.split(".")[0]
    if category in ("train", "evaluate") or message_type in LEGACY_MESSAGE_TYPES:
        return category
    return "query"


_ADDED = ("clients", "failed", "timed_out", "dropped", "messages", "seconds", "compute_s",
          "bytes_down", "bytes_up")


def _merged_section(reports: list[PhaseReport], client_metrics: bool) -> dict[str, Any]:
    """Several phases of one kind in one round as one section: sums, except that a node
    answering in several phases (SecAgg+'s stages) counts once among ``clients``, and client
    metrics weighted by each phase's clients."""
    sections = [_phase_section(report, client_metrics) for report in reports]
    out = {key: sum(section[key] for section in sections) for key in _ADDED}
    timeouts = [report.timeout_s for report in reports if report.timeout_s is not None]
    if timeouts:  # the longest any of them waited
        out["timeout_s"] = max(timeouts)
    if all(report.nodes for report in reports):
        nodes = frozenset().union(*(report.nodes for report in reports))
        out["clients"] = min(out["clients"], len(nodes))
    if client_metrics:
        weights = [section["clients"] for section in sections]
        keys = sorted({key for section in sections for key in section["metrics"]})
        metrics = {}
        for key in keys:
            parts = [
                (w, np.asarray(section["metrics"][key], dtype=np.float64))
                for w, section in zip(weights, sections, strict=True)
                if key in section["metrics"] and w > 0
            ]
            total = sum(w for w, _ in parts)
            if total > 0 and len({v.shape for _, v in parts}) == 1:  # a list metric: per entry
                mean = sum(w * v for w, v in parts) / total
                metrics[key] = mean.tolist() if mean.ndim else float(mean)
        out["metrics"] = metrics
    return out


#: sections of a round line that hold the clients' own numbers
CLIENT_SECTIONS = ("aggregated_evaluate",)


class RoundRecorder:
    """Collects phase reports into round records and hands each to ``sinks``.

    ``private``: the run is private, so the clients' metrics are left out unless
    ``metrics_in_clear``, which writes them and marks the lines that hold them.
    """

    def __init__(
        self,
        sinks: list[Callable[[dict[str, Any]], None]],
        *,
        infer_rounds: bool,
        private: bool = False,
        metrics_in_clear: bool = False,
    ) -> None:
        self.sinks = sinks
        self.infer_rounds = infer_rounds
        self.client_metrics = not private or metrics_in_clear
        self.mark_in_clear = private and metrics_in_clear
        self.started = time.perf_counter()
        self.records: list[dict[str, Any]] = []
        self._round: int | None = None
        self._phases: list[PhaseReport] = []
        #: what a Flower strategy or ServerApp filed for the open round, by section
        self._filed: dict[str, dict[str, Any]] = {}
        #: an evaluate phase without a round number ended the open round (inferred rounds)
        self._ended = False
        self._round_start = self.started
        self._errors: list[str] = []
        #: what the strategy adds to summary.json (its final privacy report, ...)
        self.run_summary: dict[str, Any] = {}
        #: the grid's release boundary (the run's privacy), once the grid attached it
        self.boundary: ReleaseBoundary | None = None

    def attach_boundary(self, boundary: ReleaseBoundary) -> None:
        """The grid's release boundary: every line of a private run gets its report."""
        self.boundary = boundary

    def run_privacy(self, privacy: Mapping[str, Any] | None) -> dict[str, Any] | None:
        """``privacy`` (a strategy's report) with the run's boundary report over it; None
        when the run has no accounted mechanism and no report."""
        if self.boundary is None or not self.boundary.private:
            return None if privacy is None else dict(privacy)
        return json_ready({**(privacy or {}), **self.boundary.report()})

    def _open(self) -> bool:
        """Whether a round is open: it has phases or values a strategy filed."""
        return bool(self._phases or self._filed)

    # PhaseObserver
    def phase_finished(self, report: PhaseReport) -> None:
        server_round = report.server_round
        legacy = report.message_type in LEGACY_MESSAGE_TYPES
        if server_round is None and legacy and not self.records and not self._phases:
            server_round = 0  # start_grid's initial parameters: before round 1
        if self.infer_rounds and self._open():
            if self._ended or (server_round is not None and server_round != self._round):
                self._flush(None)
        if self._round is None or not self._open():
            self._round = server_round if server_round is not None else (self._last_round() + 1)
        self._phases.append(report)
        if (
            self.infer_rounds
            and report.message_type.startswith("evaluate")
            and server_round is None
        ):
            # nothing else delimits this ServerApp's rounds: the next phase starts a new one
            # (what the strategy files in between, its aggregated metrics, is this round's)
            self._ended = True

    # fedsim.frontend.flwr_metrics.MetricsSink: a Flower strategy's or ServerApp's own results
    def strategy_metrics(self, server_round: int, section: str, values: dict[str, Any]) -> None:
        """What a Flower strategy or ServerApp filed for ``server_round`` (its aggregated
        train or evaluate metrics, its central evaluation): section ``section`` of that
        round's line. Inferred rounds close the open round first when it is another one, as a
        phase of another round does; so a round without phases (central evaluation of the
        initial model, round 0) gets a line of its own. In a private run (or one whose
        release boundary accounted a mechanism) the clients' aggregated numbers are left out
        unless ``metrics_in_clear`` (the server's ``central`` is always kept)."""
        if section != "central" and not self.client_metrics:
            return
        if self.infer_rounds and self._open() and server_round != self._round:
            self._flush(None)  # as a phase of another round would
        if not self._open():
            self._round = server_round
        self._filed[section] = {**self._filed.get(section, {}), **values}

    def server_error(self, message: str) -> None:
        """The ServerApp logged an error during the open round (a stopped round)."""
        self._errors.append(message)

    def _last_round(self) -> int:
        return int(self.records[-1]["round"]) if self.records else 0

    def end_round(self, server_round: int, **sections: Any) -> dict[str, Any]:
        """Close round ``server_round`` with extra sections (strategy metrics, ...; a
        MetricRecord is written as its dict)."""
        self._round = server_round
        return self._flush(
            {
                name: metrics_dict(value) if isinstance(value, MetricRecord) else value
                for name, value in sections.items()
            }
        )

    # RoundLog (fedsim.engine.phase_report): a fedsim strategy inside a Flower ServerApp
    def open_rounds(self, *, private: bool, metrics_in_clear: bool) -> None:
        """From now on the strategy closes each round (:meth:`end_round`), and a private
        one's clients' metrics are left out unless ``metrics_in_clear``."""
        self.infer_rounds = False
        self.client_metrics = not private or metrics_in_clear
        self.mark_in_clear = private and metrics_in_clear

    def end_run(self, **summary: Any) -> None:
        """Keep what the strategy adds to the run's summary (:attr:`run_summary`)."""
        self.run_summary.update(json_ready(summary))

    def summary_privacy(self) -> dict[str, Any]:
        """What summary.json says of the run's privacy: the last strategy's final report with
        the boundary's over it, and ``unaccounted_releases`` (nothing for a run without an
        accounted mechanism)."""
        privacy = self.run_privacy(self.run_summary.get("privacy"))
        if privacy is None:
            return {}
        return {"privacy": privacy, "unaccounted_releases": privacy.get("unaccounted_releases", 0)}

    def _flush(self, sections: dict[str, Any] | None) -> dict[str, Any]:
        now = time.perf_counter()
        phases, self._phases = self._phases, []
        record: dict[str, Any] = {
            "round": self._round if self._round is not None else self._last_round() + 1,
            "time_s": now - self.started,
            "seconds": now - self._round_start,
        }
        bytes_down = bytes_up = 0
        trained = 0
        kinds: dict[str, list[PhaseReport]] = {}
        for report in phases:
            kinds.setdefault(_section_name(report.message_type), []).append(report)
            bytes_down += report.bytes_down
            bytes_up += report.bytes_up
        for name, reports in kinds.items():
            record[name] = (
                _phase_section(reports[0], self.client_metrics)
                if len(reports) == 1
                else _merged_section(reports, self.client_metrics)
            )
        if "train" in record:
            trained = record["train"]["clients"]
        record["bytes_down"] = bytes_down
        record["bytes_up"] = bytes_up
        record["clients_per_s"] = trained / record["seconds"] if record["seconds"] > 0 else 0.0
        filed, self._filed, self._ended = self._filed, {}, False
        accounted = self.boundary is not None and self.boundary.private
        for name, value in filed.items():
            # a Flower strategy's aggregates of the clients' numbers are un-noised: left out
            # of a run with an accounted mechanism unless its metrics are in clear
            if name == "central" or not accounted or self.mark_in_clear:
                record[name] = value
        for name, value in (sections or {}).items():
            if value is not None and (self.client_metrics or name not in CLIENT_SECTIONS):
                given = record.get(name)
                both = isinstance(given, dict) and isinstance(value, dict)
                record[name] = {**given, **value} if both else value
        privacy = self.run_privacy(record.get("privacy"))
        if privacy is not None:
            record["privacy"] = privacy
        if self._errors:
            record["incomplete"], self._errors = self._errors, []
        if self.boundary is not None:
            self.boundary.close_round()
        if self.mark_in_clear and (phases or any(k in record for k in CLIENT_SECTIONS)):
            record["metrics_in_clear"] = True
        self._round_start = now
        self._round = None
        self.records.append(record)
        for sink in self.sinks:
            sink(record)
        return record

    def close(self) -> None:
        """Flush a round that is still open (inferred rounds)."""
        if self._open():
            self._flush(None)
