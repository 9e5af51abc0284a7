"""The shell the DP strategies share around a wrapped Flower strategy.

:class:`LedgerShell` holds the privacy ledger and what a round record shows of it
(DP-FedAvg, the matrix mechanism, DMM, DDGauss). :class:`ClippedSumShell` adds the central-DP
round of DP-FedAvg and the matrix mechanism: the clients' updates are clipped and summed by
:class:`~strategies.plumbing.clipped_sum.ClippedSum` (on the workers when ``worker_reduction``), the
server adds noise drawn from its own secret
(:class:`~strategies.plumbing.server_secret.ServerNoise`) and divides by the *expected* cohort size
``m``; refused replies are listed as ``rejected`` and the clients' own metrics and the exact clipped
fraction are released only with ``metrics_in_clear``. Each strategy keeps only its noise and its
ledger events.

At the release boundary (:mod:`fedsim.engine.boundary`) the shell sums only the replies that
answer the instructions it sent that round: each at most once, from a node it sent to, and
no more clients than it sent; a reply handed twice, or answering another instruction, is
refused (listed under ``rejected``) and, never claimed, counts as an unaccounted release. The
replies it sums are claimed for its ledger; evaluation replies are withheld (consumed, their
un-noised means returned only with ``metrics_in_clear``). A round is aggregated once.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import numpy as np
from flwr.app import ArrayRecord, ConfigRecord, Message, MetricRecord, RecordDict
from flwr.serverapp import Grid

from fedsim.engine.boundary import ClaimRefused, ReleaseBoundary, boundary_of
from fedsim.privacy.ledger import PrivacyLedger
from fedsim.record_codec import to_numpy
from fedsim.worker_reduce import attach_reducer, is_partial, single
from strategies.plumbing.clipped_sum import BOOKKEEPING, CLIENTS_KEY, CLIPPED_KEY
from strategies.plumbing.participation_guard import ParticipationGuard
from strategies.plumbing.server_secret import ServerNoise
from strategies.plumbing.wrapper import StrategyWrapper, arrayrecord_key


class LedgerShell(StrategyWrapper):
    """A wrapped strategy whose releases are recorded in ``self.ledger``.

    Subclasses set ``ledger`` (and ``accountant``, "rdp" unless they say otherwise) and add
    their own fields to the report with :meth:`report_details`.
    """

    ledger: PrivacyLedger
    accountant: str = "rdp"
    _epsilon_cache: tuple[int, float] | None = None

    def epsilon(self) -> float:
        """Epsilon (nats) at the ledger's delta of every round released so far (0: none)."""
        entries = len(self.ledger)
        if self._epsilon_cache is None or self._epsilon_cache[0] != entries:
            eps = self.ledger.epsilon(accountant=self.accountant) if entries else 0.0
            self._epsilon_cache = (entries, eps)
        return self._epsilon_cache[1]

    def report_details(self) -> dict[str, Any]:
        """What this mechanism's report adds to the ledger's (none by default)."""
        return {}

    def privacy_report(self) -> dict[str, Any]:
        """What a round record shows: epsilon so far and how it was computed."""
        return {
            "epsilon": self.epsilon(),
            "delta": self.ledger.delta,
            "accountant": self.accountant,
            "relation": self.ledger.relation.value,
            "rounds_accounted": len(self.ledger),
            **self.report_details(),
        }


@dataclass(frozen=True)
class ClippedRound:
    """One round's clipped sum: ``total`` (float64, shaped like ``reference``, the global
    model), the reducer's ``metrics``, how many ``clients`` were summed and ``clipped``, and
    the ``rejected`` clients whose replies it refused."""

    key: str
    reference: dict[str, np.ndarray]
    total: dict[str, np.ndarray]
    metrics: MetricRecord
    clients: int
    clipped: int
    rejected: list[int]


class ClippedSumShell(ServerNoise, LedgerShell):
    """Central DP over a clipped sum (see the module docstring).

    Subclasses set ``reducer`` (a :class:`~strategies.plumbing.clipped_sum.ClippedSum`),
    ``weight_key``, ``expected_clients``, ``worker_reduction`` and ``metrics_in_clear``, and
    implement ``aggregate_train`` with :meth:`clipped_round` and :meth:`add_round_metrics`.
    """

    _global: tuple[str, ArrayRecord] | None = None
    #: the replies this shell sums are claimed for its ledger (fedsim.engine.boundary)
    claims_replies = True
    _boundary: ReleaseBoundary | None = None
    #: (round, the instructions sent that round), until that round is aggregated
    _instructions: tuple[int, list[Message]] | None = None
    #: the participation schema the ledger assumes, enforced on every instruction (None:
    #: nothing to enforce); refused nodes are named under ``participation-refused``
    guard: ParticipationGuard | None = None
    participation_refused: list[int] = []  # noqa: RUF012 - replaced, never mutated

    @property
    def clipping_norm(self) -> float:
        """The clipping norm the next round uses."""
        return self.reducer.clipping_norm

    def configure_train(
        self, server_round: int, arrays: ArrayRecord, config: ConfigRecord, grid: Grid
    ) -> Iterable[Message]:
        if self.should_stop(server_round):
            return []
        messages = list(self.strategy.configure_train(server_round, arrays, config, grid))
        if self.guard is not None:
            messages, self.participation_refused = self.guard.admit(server_round - 1, messages)
        key = arrayrecord_key(self.strategy)
        self._global = (key, arrays)
        if self.worker_reduction:
            attach_reducer(messages, self.reducer)
        self.instructions_sent(server_round, messages, grid)
        return messages

    def instructions_sent(self, server_round: int, messages: list[Message], grid: Grid) -> None:
        """``messages`` are round ``server_round``'s instructions: the only ones whose replies
        :meth:`clipped_round` sums; registers this mechanism with ``grid``'s boundary."""
        self._instructions = (int(server_round), messages)
        boundary = boundary_of(grid)
        if boundary is not None:
            self._boundary = boundary
            boundary.register(self)

    def _admitted(self, replies: Iterable[Message]) -> tuple[list[Message], list[int]]:
        """The replies that answer this round's instructions, each once (see the module
        docstring), claimed at the boundary; and the nodes of those refused."""
        if self._instructions is None:
            raise RuntimeError(
                "aggregate_train without instructions to aggregate: configure_train was not "
                "called for this round, or the round was already aggregated (a round "
                "releases once)"
            )
        _, messages = self._instructions
        ids = {m.metadata.message_id for m in messages if m.metadata.message_id}
        nodes = {int(m.metadata.dst_node_id) for m in messages}
        keys: set[str] = set()
        senders: set[int] = set()
        admitted: list[Message] = []
        refused: list[int] = []
        for reply in replies:
            if reply.has_error():
                continue
            key, node = reply.metadata.reply_to_message_id, int(reply.metadata.src_node_id)
            partial = is_partial(reply)
            bad = (ids and key not in ids) or (key and key in keys)
            bad = bad or (not partial and (node not in nodes or node in senders))
            if not bad and partial and self._boundary is not None and ids:
                # a worker fold must answer only this shell's instructions
                covers = self._boundary.covers(reply)
                bad = covers is None or not set(covers) <= ids
            if not bad and self._boundary is not None:
                try:
                    self._boundary.claim([reply], self)
                except ClaimRefused:
                    bad = True
            if bad:
                refused.append(node)
                continue
            keys.add(key)
            if not partial:
                senders.add(node)
            admitted.append(reply)
        return admitted, refused

    def aggregate_evaluate(
        self, server_round: int, replies: Iterable[Message]
    ) -> MetricRecord | None:
        """The clients' evaluation means (un-noised) only with ``metrics_in_clear``; the
        replies are withheld at the boundary either way."""
        replies = [r for r in replies if not r.has_error()]
        if self._boundary is not None:
            for reply in replies:
                try:
                    self._boundary.withhold([reply], type(self).__name__)
                except ClaimRefused:
                    continue
        metrics = self.strategy.aggregate_evaluate(server_round, replies)
        return metrics if self.metrics_in_clear else None

    def __getstate__(self) -> dict[str, Any]:
        state = super().__getstate__()
        state.pop("_boundary", None)  # the run's, bound again by the next configure_train
        state.pop("_instructions", None)
        return state

    def clipped_round(self, replies: Iterable[Message]) -> tuple[ClippedRound, list[Message]]:
        """The clipped sum of the valid ``replies`` (zeros when none replied: the round
        still releases its noise), and those replies."""
        if self._global is None:
            raise RuntimeError("aggregate_train called before configure_train")
        valid, refused = self._admitted(replies)
        sent = len(self._instructions[1]) if self._instructions is not None else 0
        self._instructions = None  # a round is aggregated once
        key, global_record = self._global
        reference = to_numpy(global_record)
        if not valid:
            zeros = {k: np.zeros(v.shape, dtype=np.float64) for k, v in reference.items()}
            return ClippedRound(key, reference, zeros, MetricRecord(), 0, 0, refused), valid
        summed = self.reducer.reduce(RecordDict({key: global_record}), valid)
        metrics = single(summed.content, MetricRecord)[1]
        clients = int(metrics[CLIENTS_KEY])
        if clients > sent:
            raise RuntimeError(
                f"the replies fold {clients} clients' updates but {sent} instructions were "
                "sent this round; nothing is released"
            )
        return ClippedRound(
            key,
            reference,
            to_numpy(single(summed.content, ArrayRecord)[1]),
            metrics,
            clients,
            int(metrics[CLIPPED_KEY]),
            sorted([*getattr(summed, "rejected", ()), *refused]),
        ), valid

    def clients_metrics(self, round_: ClippedRound) -> MetricRecord:
        """The clients' own metrics (only with ``metrics_in_clear``; never the bookkeeping)."""
        return MetricRecord(
            {
                k: v
                for k, v in round_.metrics.items()
                if self.metrics_in_clear and k not in BOOKKEEPING and k != self.weight_key
            }
        )

    def add_round_metrics(
        self,
        aggregated: MetricRecord,
        round_: ClippedRound,
        clipping_norm: float,
        noise_multiplier: float,
        sum_noise_std: float,
    ) -> None:
        """The mechanism's own round metrics: clients, rejected, clipping, noise of the mean."""
        aggregated["dp-clients"] = round_.clients
        aggregated["rejected"] = round_.rejected
        if self.guard is not None:
            aggregated["participation-refused"] = self.participation_refused
        if round_.clients and self.metrics_in_clear:
            aggregated["dp-clipped-fraction"] = round_.clipped / round_.clients
        aggregated["dp-clipping-norm"] = clipping_norm
        aggregated["dp-noise-multiplier"] = noise_multiplier
        aggregated["dp-noise-std"] = sum_noise_std / self.expected_clients
