"""Server-side online conformal calibration over the clients' evaluation streams.

:class:`ConformalEvaluation` wraps any Message-API strategy. Its evaluate
instructions ask the clients for their scores (config key
:data:`fedsim.workloads.conformal.SCORES_REQUEST`); each client answers with its
test rows' nonconformity scores in an ArrayRecord
(:func:`fedsim.workloads.conformal.score_reply_record`), which the wrapper takes
out of the reply before the wrapped strategy aggregates the metrics. The
replies of a round form one stream, interleaved round-robin over the clients in
partition order, that an :class:`~fedsim.workloads.conformal.OnlineCalibrator`
processes point by point: each client is a group with its own theta (plus the
shared global theta), or, with ``kind = "aci"``, all points share one theta.
The calibrator's metrics (``conformal-miss``, ``conformal-set-size``,
``conformal-groups``, ``conformal-group-miss``, ``conformal-group-miss-total``,
``conformal-max-gap``) join the aggregated evaluate metrics, so they reach
rounds.jsonl as ``aggregated_evaluate``. The thetas live in the wrapper, so a
checkpointed run resumes with them; ``last_streams`` holds the latest round's
streams (e.g. to run a second calibrator on the same points). A successful
reply without scores (a ClientApp that ignores the request) is an error.
"""

from __future__ import annotations

from collections.abc import Iterable

from flwr.app import ArrayRecord, ConfigRecord, Message, MetricRecord, RecordDict
from flwr.serverapp import Grid
from flwr.serverapp.strategy import Strategy

from fedsim.record_codec import to_numpy
from fedsim.workloads.conformal import (
    SCORES_RECORD,
    SCORES_REQUEST,
    GroupStream,
    OnlineCalibrator,
    OnlineConformal,
    stream_from_arrays,
)
from strategies.plumbing.wrapper import StrategyWrapper


class ConformalEvaluation(StrategyWrapper):
    """Online (multi-group) conformal calibration of ``strategy``'s federated
    evaluation (see the module docstring)."""

    def __init__(self, strategy: Strategy, calibration: OnlineConformal) -> None:
        super().__init__(strategy)
        self.calibrator = OnlineCalibrator(calibration)
        self.last_streams: list[GroupStream] = []

    def configure_evaluate(
        self, server_round: int, arrays: ArrayRecord, config: ConfigRecord, grid: Grid
    ) -> Iterable[Message]:
        messages = list(self.strategy.configure_evaluate(server_round, arrays, config, grid))
        for message in messages:
            configs = [r for r in message.content.values() if isinstance(r, ConfigRecord)]
            if not configs:
                configs = [ConfigRecord()]
                message.content["config"] = configs[0]
            for record in configs:
                record[SCORES_REQUEST] = True
        return messages

    def aggregate_evaluate(
        self, server_round: int, replies: Iterable[Message]
    ) -> MetricRecord | None:
        replies = list(replies)
        plain = sum(1 for r in replies if not r.has_error() and SCORES_RECORD not in r.content)
        if plain:
            raise RuntimeError(
                f"{plain} of {len(replies)} evaluate replies carry no conformal scores "
                f"({SCORES_RECORD!r}): run clients whose ClientApp answers {SCORES_REQUEST!r} "
                "(fedsim.workloads.supervised.make_client_app)"
            )
        streams = []
        for reply in replies:
            if reply.has_error():
                continue
            streams.append(stream_from_arrays(to_numpy(reply.content[SCORES_RECORD])))
            reply.content = RecordDict(
                {k: v for k, v in reply.content.items() if k != SCORES_RECORD}
            )
        metrics = self.strategy.aggregate_evaluate(server_round, replies)
        if not streams:
            return metrics
        self.last_streams = streams
        calibrated = self.calibrator.observe_round(streams)
        return MetricRecord(
            {**(dict(metrics.items()) if metrics is not None else {}), **calibrated}
        )
