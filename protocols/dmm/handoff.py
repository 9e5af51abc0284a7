"""DMM's RESHARE at the server (docs/dmm-design.md, step 7): hand the open rows' partial sums
from the round's committee to the next by linear packed resharing (announce / deal /
accumulate / verify, :mod:`protocols.dmm.resharing`; the checks of :mod:`protocols.dmm.parity`),
as :class:`HandoffSteps` of :class:`protocols.dmm.server.DMMServer`. If it fails the release
stands and the old committee keeps the state."""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np

from protocols.channels import (
    SERVER_ID,
    Endpoint,
    Envelope,
    new_session_id,
)
from protocols.dmm.common import PROTOCOL, DMMStage, MemberCall
from protocols.dmm.parity import open_parity_checks, parity_checks, reshare_coefficients
from protocols.dmm.resharing import ReshareAbort
from protocols.kit import NEW_ID_BASE, OLD_ID_BASE, Fault, TamperingDetected


def merge_answers(dicts) -> dict:
    out: dict = {}
    for d in dicts:
        if isinstance(d, Mapping):
            out.update(d)
    return out


def new_commit(pool, holders) -> list[int]:
    """The next committee commits the handed state; the seats that hold it."""
    answers = pool.broadcast(MemberCall.COMMIT)
    held = sorted({int(s) for part in answers if isinstance(part, list) for s in part})
    return [s for s in held if s in holders]


def deal_refusal(pool) -> str:
    """Why the old committee's last refusing dealer refused (a key it could not verify, ...),
    for the hand-off's error; empty when none refused."""
    reasons = [r for _, method, r in getattr(pool, "refusals", ()) if method == MemberCall.DEAL]
    return f"; a dealer refused: {reasons[-1]}" if reasons else ""


def key_proofs(pool, keys: Mapping[int, bytes], base: int, transcript) -> dict[int, bytes]:
    """Seat -> the enrolment proof ``pool``'s members gave for the key they announced (relayed
    as given: the receivers check them), for the seats in ``keys``; each proof's bytes are
    counted in ``transcript`` with its key's message (channel id ``base + seat``)."""
    proofs: dict[int, bytes] = {}
    for answer in pool.broadcast(MemberCall.KEY_PROOFS):
        if isinstance(answer, Mapping):
            proofs.update(
                {int(s): p for s, p in answer.items() if s in keys and isinstance(p, bytes)}
            )
    for seat, proof in proofs.items():
        transcript.record(base + seat, SERVER_ID, DMMStage.SHARE, len(proof), messages=0)
    return dict(sorted(proofs.items()))


def answer_union(answers) -> set[int]:
    out: set[int] = set()
    for answer in answers:
        if isinstance(answer, list):
            out |= {int(p) for p in answer if isinstance(p, int | np.integer)}
    return out


class HandoffSteps:
    """RESHARE of a DMM round, for :class:`protocols.dmm.server.DMMServer`."""

    def _handoff(self, round_, t, dealers, faults, transcript, next_pool, output) -> None:
        """Hand the open rows' partial sums to ``next_pool``; on failure the old committee
        keeps them (the release stands)."""
        try:
            holders, attempts = self._reshare(round_, t, dealers, faults, transcript, next_pool)
        except (ReshareAbort, TamperingDetected) as error:
            self.pool.broadcast(MemberCall.KEEP)
            next_pool.broadcast(MemberCall.DISCARD)
            next_pool.close()
            self.holders = tuple(dealers)
            output.holders, output.handed_over = self.holders, False
            output.handoff_error = str(error) + deal_refusal(self.pool)
            return
        self.pool.broadcast(MemberCall.RETIRE)
        self.pool.close()
        self.pool, self.holders = next_pool, tuple(holders)
        output.holders, output.reshare_attempts = self.holders, attempts

    def _reshare(self, round_, t, dealers, faults, transcript, new) -> tuple[list[int], int]:
        """The linear packed resharing of :mod:`protocols.dmm.resharing`, run by the members.
        Returns the new holders and the DEAL attempts."""
        need = self.scheme.threshold
        keep = self.schedule.open_after(t)
        session = new_session_id() if self.encrypt else None
        self._server = Endpoint(SERVER_ID, session, protocol=PROTOCOL) if session else None
        old_keys, new_keys = self._announce_handoff(
            round_, t, dealers, faults, transcript, new, session
        )
        holders, candidates = sorted(new_keys), sorted(old_keys)
        if len(holders) < need:
            raise ReshareAbort(
                f"resharing of round {round_}: {len(holders)} new members answered, t + k = "
                f"{need} needed; the old committee keeps its shares",
                "new",
                need,
                len(holders),
            )
        if not keep:
            return new_commit(new, holders), 0
        if session is not None:  # each side checks the other's keys against their proofs
            new_proofs = key_proofs(new, new_keys, NEW_ID_BASE, transcript)
            old_proofs = key_proofs(self.pool, old_keys, OLD_ID_BASE, transcript)
            self.pool.broadcast(
                MemberCall.CONNECT,
                {NEW_ID_BASE + j: k for j, k in new_keys.items()},
                {NEW_ID_BASE + j: p for j, p in new_proofs.items()},
            )
            new.broadcast(
                MemberCall.CONNECT,
                {OLD_ID_BASE + i: k for i, k in old_keys.items()},
                {OLD_ID_BASE + i: p for i, p in old_proofs.items()},
            )
        attempts, checked = self._deal_until_verified(
            round_, len(keep), candidates, holders, faults, transcript, new
        )
        if not checked:
            self.unverified_rows |= set(keep)
        return new_commit(new, holders), attempts

    def _announce_handoff(
        self, round_, t, dealers, faults, transcript, new, session
    ) -> tuple[dict[int, bytes], dict[int, bytes]]:
        """ANNOUNCE: the old committee's ``dealers`` and every seat of ``new`` take fresh
        channel keys for ``session``; returns old seat -> key and new seat -> key of the
        members that answered with a usable one."""
        old, n = self.pool, self.scheme.n
        old_answers = old.broadcast(
            MemberCall.ANNOUNCE_HANDOFF,
            round_,
            session,
            "old",
            t,
            dealers,
            faults.members(Fault.DROP, DMMStage.RESHARE),
        )
        new_answers = new.broadcast(
            MemberCall.ANNOUNCE_HANDOFF, round_, session, "new", t, list(range(n)), faults.next_drop
        )
        old_keys, _ = self._check_keys(old, old_answers, dealers, OLD_ID_BASE, transcript)
        new_keys, _ = self._check_keys(new, new_answers, range(n), NEW_ID_BASE, transcript)
        return old_keys, new_keys

    def _deal_until_verified(
        self, round_, rows, candidates, holders, faults, transcript, new
    ) -> tuple[int, bool]:
        """DEAL, ACCUMULATE and VERIFY of ``rows`` open rows from the first t + k
        ``candidates`` to ``holders``, again without every dealer that fails to deal or is
        caught by the parity checks until a dealing verifies; returns the DEAL attempts and
        whether a parity check ran. Raises :class:`protocols.dmm.resharing.ReshareAbort` when
        fewer than t + k + ``reshare_checks`` can deal (a dealing by t + k is unchecked)."""
        old, scheme = self.pool, self.scheme
        need = scheme.threshold
        dealing = need + self.reshare_checks
        removed: list[int] = []
        attempts = 0
        while True:
            if len(candidates) < dealing:
                raise ReshareAbort(
                    f"resharing of round {round_}: {len(candidates)} old members can deal, "
                    f"t + k + reshare_checks = {need} + {self.reshare_checks} needed so that a "
                    f"wrong dealing is caught (removed after failing: {removed}); the old "
                    "committee keeps its shares",
                    "old",
                    dealing,
                    len(candidates),
                )
            attempts += 1
            chosen = candidates[:need]
            lam = reshare_coefficients(scheme, chosen)
            mix = scheme.field.random_secure(rows * self.blocks)
            columns = {i: (lam[:, chosen.index(i)] if i in chosen else None) for i in candidates}
            tamper = faults.members(Fault.TAMPER, DMMStage.RESHARE)
            deal_args = [
                ({i: c for i, c in columns.items() if i in g}, mix, holders, tamper, faults.seed)
                for g in old.groups
            ]
            deals = merge_answers(old.call(MemberCall.DEAL, deal_args))
            inbox = self._deal_inbox(deals, candidates, holders, transcript)
            parts = [({j: inbox[j] for j in g if j in inbox},) for g in new.groups]
            refused = answer_union(new.call(MemberCall.RECEIVE, parts))
            failed = [i for i in candidates if i not in deals or i in refused]
            if failed:
                removed.extend(failed)
                candidates = [i for i in candidates if i not in failed]
                continue
            new.broadcast(MemberCall.ACCUMULATE, chosen)
            checks = parity_checks(scheme, candidates)
            if checks.shape[0] == 0:
                return attempts, False
            culprit = self._verify(round_, new, checks, candidates, holders, transcript)
            if culprit is None:
                return attempts, True
            removed.append(culprit)
            candidates = [i for i in candidates if i != culprit]

    def _deal_inbox(self, deals, candidates, holders, transcript) -> dict[int, dict[int, object]]:
        """new seat -> dealer -> its deal; a dealer whose answer is malformed delivers
        nothing (it is removed and DEAL restarts)."""
        inbox: dict[int, dict[int, object]] = {j: {} for j in holders}
        for i, items in list(deals.items()):
            if i not in candidates or not isinstance(items, list) or len(items) != len(holders):
                deals.pop(i, None)
                continue
            for j, item in zip(holders, items):
                if isinstance(item, Envelope):
                    transcript.record(item.sender, item.receiver, item.stage, item.nbytes)
                elif isinstance(item, np.ndarray):
                    transcript.record(
                        OLD_ID_BASE + i, NEW_ID_BASE + j, DMMStage.RESHARE, item.size * 8
                    )
                inbox[j][int(i)] = item
        return inbox

    def _verify(self, round_, new, checks, candidates, holders, transcript) -> int | None:
        """VERIFY: the parity checks of the dealings; the single faulty dealer or None."""
        scheme, need = self.scheme, self.scheme.threshold
        answers = merge_answers(new.broadcast(MemberCall.CHECK_SHARES, checks, candidates))
        rows = {}
        for j in holders:
            row = answers.get(j)
            if isinstance(row, np.ndarray) and row.shape == (checks.shape[0],):
                try:
                    rows[j] = scheme.field.asarray(row, "check share")
                except ValueError:
                    continue
        checked = sorted(rows)
        if len(checked) < need:
            raise ReshareAbort(
                f"resharing of round {round_}: {len(checked)} new members answered the check, "
                f"t + k = {need} needed; the old committee keeps its shares",
                "new",
                need,
                len(checked),
            )
        stacked = np.stack([rows[j] for j in checked])
        for j in checked:
            transcript.record(NEW_ID_BASE + j, SERVER_ID, DMMStage.RESHARE, stacked.shape[1] * 8)
        return open_parity_checks(scheme, scheme, stacked, checked, candidates, checks, round_)
