"""DMM's RESHARE at a member (docs/dmm-design.md, step 7), as :class:`ReshareDuties` of
:class:`protocols.dmm.member.MemberGroup`: as the *old* committee, deal each seat's
partial-sum shares, scaled by its Lagrange column, to the next committee
(:class:`protocols.dmm.resharing.OldMember`), then :meth:`~ReshareDuties.retire`, or
:meth:`~ReshareDuties.keep` when the handoff fails; as the *next* committee, receive,
accumulate, answer the parity checks and commit (:class:`protocols.dmm.resharing.NewMember`),
or discard what it received. Each method turns its request into a typed message of
:mod:`protocols.dmm.reshare_stages` and runs that module's handler on the group's state."""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np

from protocols.dmm import reshare_stages as stages
from protocols.dmm.common import request


class ReshareDuties:
    """RESHARE requests of a :class:`protocols.dmm.member.MemberGroup` (which provides
    ``_run(handler, message)``: the handler run on the group's state, the new state kept)."""

    @request
    def deal(self, columns, mix, receivers, tamper, seed: int, rngs=None) -> dict:
        """DEAL: each online seat in ``columns`` re-shares its partial-sum shares of the rows
        still open, scaled by its Lagrange column (None: check block only), for the next
        committee's seats ``receivers``; returns seat -> one sealed row per receiver."""
        message = stages.Deal(columns, mix, receivers, tamper, seed, rngs)
        return self._run(stages.handle_deal, message)

    @request
    def retire(self) -> None:
        """The handoff succeeded: forget everything (state included)."""
        return self._run(stages.handle_retire, stages.Retire())

    @request
    def keep(self) -> None:
        """The release stands but the handoff failed: the combined partial sums become this
        committee's state for the next step."""
        return self._run(stages.handle_keep, stages.Keep())

    @request
    def discard(self) -> None:
        """Abort the round: drop what it brought; the committed state is kept."""
        return self._run(stages.handle_discard, stages.Discard())

    @request
    def receive(self, deliveries: Mapping[int, Mapping[int, object]]) -> list[int]:
        """``deliveries[seat][dealer]`` is a deal for an online seat; returns the dealers whose
        deal some seat here could not authenticate or read."""
        return self._run(stages.handle_receive, stages.Receive(deliveries))

    @request
    def accumulate(self, chosen) -> None:
        """Each online seat sums the deals of the dealers ``chosen``."""
        return self._run(stages.handle_accumulate, stages.Accumulate(chosen))

    @request
    def check_shares(self, checks, candidates) -> dict[int, np.ndarray]:
        """VERIFY: each online seat's shares of the parity-check syndromes."""
        return self._run(stages.handle_check_shares, stages.CheckShares(checks, candidates))

    @request
    def commit(self) -> list[int]:
        """The handoff succeeded: the accumulated rows become this committee's state for its
        step; returns the seats that hold it."""
        return self._run(stages.handle_commit, stages.Commit())
