"""DMM's RESHARE at a member (docs/dmm-design.md, step 7), as :class:`ReshareDuties` of
:class:`protocols.dmm.member.MemberGroup`: as the *old* committee, deal each seat's
partial-sum shares, scaled by its Lagrange column, to the next committee
(:class:`protocols.dmm.resharing.OldMember`), then :meth:`~ReshareDuties.retire`, or
:meth:`~ReshareDuties.keep` when the handoff fails; as the *next* committee, receive,
accumulate, answer the parity checks and commit (:class:`protocols.dmm.resharing.NewMember`),
or discard what it received."""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np

from protocols.channels import ChannelError, Envelope
from protocols.dmm.common import DMMStage, MemberRefused, request
from protocols.dmm.resharing import NewMember, OldMember, ShareRandomness
from protocols.kit import NEW_ID_BASE, OLD_ID_BASE, StageError


class ReshareDuties:
    """RESHARE handlers of a :class:`protocols.dmm.member.MemberGroup`."""

    @request
    def deal(self, columns, mix, receivers, tamper, seed: int, rngs=None) -> dict:
        """DEAL: each online seat in ``columns`` re-shares its partial-sum shares of the rows
        still open, scaled by its Lagrange column (None: check block only), for the next
        committee's seats ``receivers``; returns seat -> one sealed row per receiver."""
        self._expect(DMMStage.RESHARE, "old")
        f = self.scheme.field
        mix = f.asarray(mix, "mix")
        keep = self.schedule.open_after(self.step)
        if mix.shape != (len(keep) * self.blocks,):
            raise MemberRefused(f"mix has shape {mix.shape}; allowed ({len(keep) * self.blocks},)")
        receivers = [int(j) for j in receivers]
        if len(set(receivers)) != len(receivers) or not all(
            0 <= j < self.scheme.n for j in receivers
        ):
            raise MemberRefused(f"receivers={receivers}; allowed: distinct seats < n")
        columns, tamper, seed = dict(columns), set(self._seat_list(tamper, "tamper")), int(seed)
        out = {}
        for s, column in columns.items():
            if s not in self._online:
                continue
            if column is not None:
                column = f.asarray(column, "column")
                if column.shape != (self.scheme.k,):
                    raise MemberRefused(f"column has shape {column.shape}; allowed (k,)")
            flat = np.concatenate([self._tentative[r][self._index[s]] for r in keep])
            if s in tamper:
                flat = self._offset_row(flat, s, seed, 3)
            unverified = [j for j in receivers if NEW_ID_BASE + j in self._unverified]
            if unverified and self._endpoints.get(s) is not None:
                raise MemberRefused(
                    f"seat {s} refuses to deal: {self._unverified[NEW_ID_BASE + unverified[0]]}"
                )
            rng = (self._reshare_rngs if rngs is None else rngs).get(s)
            randomness = ShareRandomness(rng, rng is None)
            rows = OldMember(s, flat).deal(self.scheme, self.scheme, column, mix, randomness)
            endpoint = self._endpoints.get(s)
            out[s] = [
                endpoint.seal_array(NEW_ID_BASE + j, self._round, DMMStage.RESHARE, rows[j])
                if endpoint is not None
                else rows[j]
                for j in receivers
            ]
        return out

    @request
    def retire(self) -> None:
        """The handoff succeeded: forget everything (state included)."""
        self._expect(DMMStage.RESHARE, "old")
        self._move(DMMStage.DONE)
        self.partials, self.retired = {}, True
        self._clear_round()
        self.stage = DMMStage.DONE

    @request
    def keep(self) -> None:
        """The release stands but the handoff failed: the combined partial sums become this
        committee's state for the next step."""
        if self._tentative is None or self.role not in ("current", "old") or self.stage not in (
            DMMStage.RELEASE,
            DMMStage.RESHARE,
        ):
            raise StageError(f"DMM members {self.seats}: nothing released to keep")
        tentative, step = self._tentative, self.step + 1
        self._clear_round()
        self.partials, self.step = tentative, step

    @request
    def discard(self) -> None:
        """Abort the round: drop what it brought; the committed state is kept."""
        if self.retired:
            raise MemberRefused(f"members {self.seats} retired")
        if self.role == "new":
            self.partials = {}
        self._clear_round()

    @request
    def receive(self, deliveries: Mapping[int, Mapping[int, object]]) -> list[int]:
        """``deliveries[seat][dealer]`` is a deal for an online seat; returns the dealers whose
        deal some seat here could not authenticate or read."""
        self._expect(DMMStage.RESHARE, "new")
        if not isinstance(deliveries, Mapping):
            raise MemberRefused(f"deliveries is a {type(deliveries).__name__}; allowed: a dict")
        refused: set[int] = set()
        self._incoming = {s: NewMember(s) for s in sorted(self._online)}
        for s, deals in deliveries.items():
            if s not in self._incoming or not isinstance(deals, Mapping):
                continue
            for dealer, item in deals.items():
                try:
                    dealer = int(dealer)
                    opened = self._open_deal(s, item, dealer)
                    self._incoming[s].received[dealer] = opened
                except (ChannelError, ValueError, TypeError):
                    if isinstance(dealer, int):
                        refused.add(dealer)
        return sorted(refused)

    def _open_deal(self, seat: int, item, dealer: int) -> np.ndarray:
        keep = self.schedule.open_after(self.step - 1)
        full = len(keep) * self.blocks + 1
        if isinstance(item, Envelope):
            opened = self._endpoints[seat].open_array(
                item, round_=self._round, stage=DMMStage.RESHARE, sender=OLD_ID_BASE + dealer
            )
        elif not self._endpoints and isinstance(item, np.ndarray):
            opened = item
        else:
            raise ChannelError(f"seat {seat} received a {type(item).__name__} from {dealer}")
        if opened.ndim != 1 or opened.shape[0] not in (1, full):
            raise ChannelError(f"a deal of shape {opened.shape}; expected (1,) or ({full},)")
        return self.scheme.field.asarray(opened, "deal")

    @request
    def accumulate(self, chosen) -> None:
        """Each online seat sums the deals of the dealers ``chosen``."""
        self._expect(DMMStage.RESHARE, "new")
        chosen = [int(i) for i in chosen]
        keep = self.schedule.open_after(self.step - 1)
        full = len(keep) * self.blocks + 1
        for s, member in self._incoming.items():
            if any(member.received.get(i, np.zeros(0)).shape != (full,) for i in chosen):
                raise MemberRefused(f"seat {s} lacks a full deal from some of {chosen}")
        f = self.scheme.field
        self._handed = np.zeros((len(self.seats), len(keep) * self.blocks), dtype=np.int64)
        for s, member in self._incoming.items():
            self._handed[self._index[s]] = member.accumulate(f, chosen)

    @request
    def check_shares(self, checks, candidates) -> dict[int, np.ndarray]:
        """VERIFY: each online seat's shares of the parity-check syndromes."""
        self._expect(DMMStage.RESHARE, "new")
        f = self.scheme.field
        checks = f.asarray(checks, "checks")
        candidates = [int(i) for i in candidates]
        if checks.ndim != 2 or checks.shape[1] != len(candidates):
            raise MemberRefused(f"checks has shape {checks.shape} for {len(candidates)} dealers")
        out = {}
        for s, member in self._incoming.items():
            if any(i not in member.received for i in candidates):
                raise MemberRefused(f"seat {s} has no check block from some of {candidates}")
            out[s] = member.check_shares(f, checks, candidates)
        return out

    @request
    def commit(self) -> list[int]:
        """The handoff succeeded: the accumulated rows become this committee's state for its
        step; returns the seats that hold it."""
        self._expect(DMMStage.RESHARE, "new")
        keep = self.schedule.open_after(self.step - 1)
        if self._handed is None:
            if keep:
                raise MemberRefused(f"nothing accumulated for rows {list(keep)}")
            self._handed = np.zeros((len(self.seats), 0), dtype=np.int64)
        split = self._handed.reshape(len(self.seats), len(keep), self.blocks)
        holders = sorted(self._online)
        self._move(DMMStage.DONE)
        self._clear_round()
        self.partials = {int(r): split[:, a].copy() for a, r in enumerate(keep)}
        return holders
