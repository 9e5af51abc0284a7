"""DMM's ideal mode (:meth:`IdealRound.run_plain_round`, part of
:class:`protocols.dmm.server.DMMServer`): the no-cryptography reference round on the clients'
plaintext integers, with the same agreement, dropout and abort rules and bit-identical
releases."""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np

from protocols.channels import Transcript
from protocols.dmm.common import DMMFaults, DMMStage
from protocols.dmm.release import RoundOutput
from protocols.kit import Fault


class IdealRound:
    """Ideal mode of :class:`protocols.dmm.server.DMMServer`."""

    def run_plain_round(
        self,
        round_: int,
        updates: Mapping[int, np.ndarray],
        noises: Mapping[int, np.ndarray],
        faults: DMMFaults | None = None,
    ) -> RoundOutput:
        """Ideal mode: the same round on the clients' plaintext integers (``updates[c]``: D
        signed ints; ``noises[c]``: rows released this step x D) under the same rules."""
        if self.mode != "ideal":
            raise ValueError("run_plain_round is ideal mode's; full mode shares and seals")
        faults = faults or DMMFaults()
        t, need = self._check_step(), self.scheme.threshold
        released = self.schedule.released_at(t)
        self.stage = DMMStage.SETUP
        self._enter(DMMStage.SHARE)
        rejected = {
            c: reason
            for c in sorted(updates)
            if (reason := self._check_plain(updates.get(c), noises.get(c), len(released)))
        }
        senders = [
            c
            for c in sorted(updates)
            if c not in rejected and faults.client_drop.get(c) is not DMMStage.SHARE
        ]
        live = [j for j in self.holders if j not in faults.dropped_by(DMMStage.SHARE)]
        if len(live) < need:
            raise self._abort(self._state_lost(t, DMMStage.SHARE, len(live)))
        excluded = set(faults.client_partial) & set(senders)
        clients = [c for c in senders if c not in excluded]
        self._enter(DMMStage.COMBINE)
        if len(clients) < self.min_clients:
            raise self._abort(self._too_few_clients(t, len(clients)))
        live = [j for j in live if j not in faults.dropped_by(DMMStage.COMBINE)]
        if len(live) < need:
            raise self._abort(self._state_lost(t, DMMStage.COMBINE, len(live)))
        self._enter(DMMStage.RELEASE)
        sent = [j for j in live if j not in faults.dropped_by(DMMStage.RELEASE)]
        answering = [j for j in sent if j not in faults.members(Fault.LATE, DMMStage.RELEASE)]
        self._note_opened(t, sent, len(clients))
        if len(answering) < need:
            self.holders = tuple(sent)
            raise self._abort(self._too_few_members(t, len(answering)))
        release, tentative = self._plain_release(t, released, clients, updates, noises)
        output = self._released(t, released, release, clients, excluded, rejected, Transcript())
        output.verified = len(answering) > need and not self.unverified_rows & set(released)
        output.radius = (len(answering) - need) // 2
        output.dropped = tuple(s for s in self.holders if s not in answering)
        self._enter(DMMStage.RESHARE)
        self._plain_handoff(round_, sent, faults, tentative, output)
        self._enter(DMMStage.DONE)
        return output

    def _plain_release(self, t, released, clients, updates, noises):
        """(the rows y_i released at step ``t``, the open rows' partial sums after it)."""
        X = np.sum([np.asarray(updates[c], dtype=np.int64) for c in clients], axis=0)
        Z = np.sum([np.asarray(noises[c], dtype=np.int64) for c in clients], axis=0)
        M = self.schedule.matrix
        release = np.stack(
            [self.plain_state.get(i, 0) + M[i, t] * X + Z[a] for a, i in enumerate(released)]
        )
        tentative = {
            j: self.plain_state.get(j, 0) + M[j, t] * X for j in self.schedule.open_after(t)
        }
        return release, tentative

    def _plain_handoff(self, round_, sent, faults, tentative, output) -> None:
        """Ideal mode's RESHARE: the next committee takes the ``tentative`` state unless too
        few of its members or (with rows to carry) too few dealers remain."""
        need = self.scheme.threshold
        dealers = [j for j in sent if j not in faults.dropped_by(DMMStage.RESHARE)]
        holders = [j for j in range(self.scheme.n) if j not in faults.next_drop]
        dealing = need + self.reshare_checks
        if len(holders) < need or (tentative and len(dealers) < dealing):
            side, count = ("new", len(holders)) if len(holders) < need else ("old", len(dealers))
            self.plain_state, self.holders = tentative, tuple(sent)
            output.holders, output.handed_over = self.holders, False
            output.handoff_error = f"resharing of round {round_}: {count} {side} members"
        else:
            self.plain_state, self.holders = tentative, tuple(holders)
            output.holders = self.holders
            if tentative and len(dealers) == need:  # reshare_checks = 0: nothing checked
                self.unverified_rows |= set(tentative)
            output.reshare_attempts = 1 if tentative else 0

    def _check_plain(self, update, noise, rows: int) -> str | None:
        """Why an ideal-mode client input is malformed, or None."""
        expected = (("update", update, (self.dim,)), ("noise", noise, (rows, self.dim)))
        for name, value, shape in expected:
            array = np.asarray(value) if value is not None else None
            if array is None or array.shape != shape or (
                array.size and array.dtype.kind not in "iu"
            ):
                got = None if array is None else (array.shape, str(array.dtype))
                return f"{name} is {got}; allowed {shape} integers"
        return None
