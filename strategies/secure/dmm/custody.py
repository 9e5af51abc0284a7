"""Custody of DMM's state between rounds (docs/dmm-design.md, steps 7-8): which committee
holds the partial sums of the rows still open, the public draw it came from, and the
engine-side committee host its members live on (:class:`fedsim.engine.dmm_committee.
CommitteeHost`, bound by the front end; the strategy never holds the members' secrets).

Committees are n distinct clients drawn publicly, ``public_committee(seed, round,
population, n)``; a committee that releases hands the open rows' state to the next round's
draw, and one that cannot keeps it."""

from __future__ import annotations

import logging
from typing import Any

from fedsim.engine.client_registry import public_committee
from protocols.dmm.common import DMMFaults
from protocols.dmm.release import RoundOutput
from protocols.dmm.server import DMMServer

log = logging.getLogger(__name__)


class Custody:
    """The committee now holding the state (client ids in seat order), the server round whose
    public draw it is, and the host its members run on (never pickled: the front end binds it
    again after a resume, and the holders are re-hosted from their sealed states)."""

    def __init__(self, seed: int, population: int, size: int) -> None:
        self.seed, self.population, self.size = int(seed), int(population), int(size)
        self.host: Any = None
        self.committee: list[int] = []
        #: the server round whose public draw is ``committee`` (None: a checkpoint from
        #: before it was kept; :meth:`claim` finds it again)
        self.committee_round: int | None = None

    def __getstate__(self) -> dict:
        """Checkpoints keep the committee's ids and draw, never the host."""
        return {**self.__dict__, "host": None}

    def draw(self, server_round: int) -> list[int]:
        """The committee of ``server_round``: n distinct clients drawn publicly."""
        return public_committee(self.seed, server_round, self.population, self.size)

    def seat(self, server_round: int) -> None:
        """Seat ``server_round``'s draw as the committee holding the state."""
        self.committee, self.committee_round = self.draw(server_round), server_round

    def claim(self, server_round: int) -> tuple[int, list[int]]:
        """(the round whose public draw is the committee now holding the state, its client
        ids): what the clients check the seats' certificates against."""
        drawn_at = self.committee_round
        if drawn_at is None or self.draw(drawn_at) != self.committee:
            drawn_at = next(  # a checkpoint from before the draw's round was kept
                (r for r in range(server_round, -1, -1) if self.draw(r) == self.committee),
                server_round,
            )
            self.committee_round = drawn_at
        return drawn_at, list(self.committee)

    def ensure_pool(self, server: DMMServer, server_round: int) -> None:
        """Full mode: the committee holding the state is hosted (a fresh committee at step 0;
        after a resume, the holders re-hosted from their sealed states)."""
        if server.pool is not None:
            return
        if self.host is None:
            raise RuntimeError(
                "mode='full' needs a committee host: the front end binds one with "
                "bind_committee_host (fedsim.engine.dmm_committee.CommitteeHost)"
            )
        kwargs = server.member_kwargs
        if server.step == 0:
            self.seat(server_round)
            server.attach(self.host.pool(self.committee, kwargs), range(self.size))
        else:
            server.attach(self.host.restore(self.committee, server.holders, kwargs, server.step))

    def faults(self, server_round: int, following: list[int]) -> DMMFaults:
        """The member faults the host injects into this round (none without a host)."""
        if self.host is None:
            return DMMFaults()
        return self.host.member_faults(server_round, self.committee, following)

    def persist(
        self,
        server: DMMServer,
        output: RoundOutput,
        server_round: int,
        following: list[int],
        full: bool,
    ) -> None:
        """After a released round: the committee now holding the state (``following`` when
        it was handed over) stores it, sealed, as its members' own state."""
        if output.handed_over:
            retired, self.committee = self.committee, list(following)
            self.committee_round = server_round + 1
        else:
            retired = []
            if output.handoff_error:
                log.warning(
                    "DMM round %s: the state stays with this committee: %s",
                    server_round, output.handoff_error,
                )  # fmt: skip
        if full and self.host is not None:
            self.host.persist(server.pool, output.holders, server_round, forget=retired)
