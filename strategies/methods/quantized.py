"""Server side of quantised uploads: unpack each reply before the wrapped strategy sees it.

Clients running :func:`fedsim.workloads.upload.quantized_upload` send
``Q(local - global)`` packed into bytes; this wrapper keeps the global arrays it
sent in ``configure_train`` and turns every reply back into ``global + Q(delta)``,
so FedAvg (or any strategy) aggregates as usual. Packed codes cannot be summed
on workers, so the wrapped strategy must not opt in to worker-side sums; a reply
without a quantised upload is an error. The aggregated train metrics
gain ``upload-bits-total``, the bits all replies of the round put on the wire.
"""

from __future__ import annotations

from collections.abc import Iterable

from flwr.app import ArrayRecord, ConfigRecord, Message, MetricRecord
from flwr.serverapp import Grid
from flwr.serverapp.strategy import Strategy

from fedsim.record_codec import to_numpy
from fedsim.workloads.upload import QUANTIZED, UPLOAD_BITS, dequantize_reply
from strategies.plumbing.wrapper import StrategyWrapper


class DequantizedUploads(StrategyWrapper):
    """Unpacks quantised uploads for ``strategy`` (see the module docstring)."""

    def __init__(self, strategy: Strategy) -> None:
        super().__init__(strategy)
        self._sent: dict[int, ArrayRecord] = {}

    def configure_train(
        self, server_round: int, arrays: ArrayRecord, config: ConfigRecord, grid: Grid
    ) -> Iterable[Message]:
        self._sent = {server_round: arrays}
        return self.strategy.configure_train(server_round, arrays, config, grid)

    def aggregate_train(
        self, server_round: int, replies: Iterable[Message]
    ) -> tuple[ArrayRecord | None, MetricRecord | None]:
        if server_round not in self._sent:
            raise RuntimeError(f"round {server_round} was not configured by this strategy")
        sent = to_numpy(self._sent[server_round])
        replies = list(replies)
        plain = sum(1 for r in replies if not r.has_error() and QUANTIZED not in r.content)
        if plain:
            raise RuntimeError(
                f"{plain} of {len(replies)} replies carry no quantised upload ({QUANTIZED!r}): "
                "run the clients with client.compression, and without worker-side sums "
                "(packed codes cannot be summed)"
            )
        total = 0
        for reply in replies:
            if reply.has_error():
                continue
            for record in reply.content.values():
                if isinstance(record, MetricRecord) and UPLOAD_BITS in record:
                    total += int(record[UPLOAD_BITS])
        unpacked = [dequantize_reply(reply, sent) for reply in replies]
        arrays, metrics = self.strategy.aggregate_train(server_round, unpacked)
        if metrics is not None:
            metrics = MetricRecord({**dict(metrics.items()), "upload-bits-total": total})
        return arrays, metrics
