"""DMM's release at the server (docs/dmm-design.md, steps 8-9): COMBINE and RELEASE of a round
(:class:`ReleaseSteps`, part of :class:`protocols.dmm.server.DMMServer`) -- collect the sealed
release shares of the rows of M released at the step, check their form and the quorum before
opening any, decode them (:meth:`protocols.shamir.PackedShamir.decode`) -- and the
post-processing x_hat = D y (:class:`ReleaseDecoder`) into a :class:`RoundOutput`."""

from __future__ import annotations

import functools
from collections.abc import Mapping
from dataclasses import dataclass, field

import numpy as np

from protocols.channels import (
    SERVER_ID,
    TAG_BYTES,
    ChannelError,
    Envelope,
    Transcript,
    encode_array,
    stage_label,
)
from protocols.dmm.common import DMMAbort, DMMStage, MemberCall, ReleaseAnswer, Schedule
from protocols.dmm.rows import row_decoder
from protocols.kit import SEAT_ID_BASE, Fault, TamperingDetected
from protocols.shamir import UncorrectableSharesError


class ReleaseDecoder:
    """x_hat = D y with D M = I, row by row as releases arrive (post-processing).

    Square lower-triangular M with a non-zero diagonal (banded): forward substitution,
    x_hat_t = (y_t - sum_{s < t} M[t, s] x_hat_s) / M[t, t], keeping only the x_hat_s later rows
    still use. Otherwise ``decoding`` (T x m, float64) must be causal -- row t reads only rows
    released by t -- with D M = I (the tree: D = A^{-1} B of its factorization). float64; the
    releases are exact integers below 2^53.
    """

    def __init__(self, schedule: Schedule, decoding: np.ndarray | None = None) -> None:
        M = schedule.matrix
        self.schedule = schedule
        if decoding is None:
            square = M.shape[0] == M.shape[1]
            if not (square and np.all(np.triu(M, 1) == 0) and np.all(np.diag(M) != 0)):
                raise ValueError(
                    "decoding=None needs a square lower-triangular M with a non-zero diagonal; "
                    "pass the factorization's causal decoding matrix D (D M = I)"
                )
            self.decoding = None
        else:
            D = np.asarray(decoding, dtype=np.float64)
            if D.shape != (M.shape[1], M.shape[0]):
                raise ValueError(
                    f"decoding has shape {D.shape}; allowed {(M.shape[1], M.shape[0])}"
                )
            late = schedule.release_rounds[None, :] > np.arange(M.shape[1])[:, None]
            if np.any(D[late] != 0):
                raise ValueError("decoding reads rows before they are released (not causal)")
            if not np.allclose(D @ M, np.eye(M.shape[1]), atol=1e-8):
                raise ValueError("decoding is not a left inverse of M (D M != I)")
            self.decoding = D
        self.rows: dict[int, np.ndarray] = {}
        self.estimates: dict[int, np.ndarray] = {}

    def add(self, t: int, rows: Mapping[int, np.ndarray]) -> np.ndarray:
        """Take round t's released rows (row -> D signed integers); return x_hat_t."""
        M = self.schedule.matrix
        for i, y in rows.items():
            self.rows[int(i)] = np.asarray(y, dtype=np.float64)
        if self.decoding is None:
            y = self.rows.pop(t)
            for s in np.flatnonzero(M[t, :t]):
                y = y - float(M[t, s]) * self.estimates[int(s)]
            estimate = y / float(M[t, t])
            self.estimates[t] = estimate
            still = {int(s) for s in np.flatnonzero(np.any(M[t + 1 :] != 0, axis=0))}
            self.estimates = {s: v for s, v in self.estimates.items() if s in still}
            return estimate
        weights = self.decoding[t]
        estimate = sum(weights[i] * y for i, y in sorted(self.rows.items()) if weights[i] != 0)
        if isinstance(estimate, int):
            raise ValueError(f"round {t}: the decoding reads no released row")
        needed = {int(i) for i in np.flatnonzero(np.any(self.decoding[t + 1 :] != 0, axis=0))}
        self.rows = {i: y for i, y in self.rows.items() if i in needed}
        return estimate


@dataclass
class RoundOutput:
    """What a round released and what it cost.

    ``rows``: rows of M released; ``release``: (len(rows), D) signed integers y_i; ``clients``:
    the clients (caller's keys) whose update and noise are in it; ``excluded``: clients the
    members left out (missing, unauthentic or unreadable shares, unusable keys); ``rejected``:
    client -> reason its message failed the server's validation; ``rejected_members``: seat ->
    reason; ``corrected``: seats whose release shares were corrected (named only when the
    decoding is unique); ``verified``/``radius``: of that decoding; ``holders``: seats of the
    committee holding the state after the round; ``handed_over``: whether that is the next
    committee; ``handoff_error``: why not; ``dropped``: holders of this committee whose release
    share did not arrive; ``estimate``: x_hat_t = (D y)_t (float64, integer units of X);
    ``transcript``: bytes per (sender, receiver, stage).
    """

    step: int
    rows: tuple[int, ...]
    release: np.ndarray
    clients: tuple[int, ...]
    contributors: int = 0
    excluded: tuple[int, ...] = ()
    rejected: dict[int, str] = field(default_factory=dict)
    rejected_members: dict[int, str] = field(default_factory=dict)
    corrected: tuple[int, ...] = ()
    verified: bool = True
    radius: int = 0
    holders: tuple[int, ...] = ()
    handed_over: bool = True
    handoff_error: str | None = None
    dropped: tuple[int, ...] = ()
    estimate: np.ndarray | None = None
    reshare_attempts: int = 0
    transcript: Transcript = field(default_factory=Transcript)


@functools.lru_cache(maxsize=64)
def ciphertext_bytes(width: int) -> int:
    """Length of the ciphertext of one sealed row of ``width`` int64 field elements."""
    return len(encode_array(np.zeros(width, dtype=np.int64))) + TAG_BYTES


class ReleaseSteps:
    """COMBINE and RELEASE of a DMM round, for :class:`protocols.dmm.server.DMMServer`."""

    def _release_full(self, keys, faults, transcript, opened, clients, excluded, rejected,
                      combined, next_pool, carried) -> RoundOutput:
        t, need = keys.step, self.scheme.threshold
        self._enter(DMMStage.COMBINE)
        if combined is None:
            raise self._abort(self._too_few_clients(t, carried))
        live = sorted({int(s) for part in combined if isinstance(part, list) for s in part})
        live = [s for s in live if s in keys.member_keys]
        if len(live) < need:
            raise self._abort(self._state_lost(t, DMMStage.COMBINE, len(live)))
        self._enter(DMMStage.RELEASE)
        answered = self.pool.broadcast(
            MemberCall.RELEASE,
            keys.round,
            faults.members(Fault.DROP, DMMStage.RELEASE),
            faults.members(Fault.LATE, DMMStage.RELEASE),
            faults.members(Fault.TAMPER, DMMStage.RELEASE),
            faults.seed,
        )
        rows, sent, on_time = self._open_release(
            answered, live, keys, transcript, opened.rejected_members, carried
        )
        if len(rows) < need:
            self.holders = tuple(sent)
            raise self._abort(self._too_few_members(t, len(rows) if rows else on_time))
        answering = sorted(rows)
        released = self.schedule.released_at(t)
        length = len(released) * self.blocks * self.scheme.k
        try:
            decoding = self.scheme.decode(np.stack([rows[j] for j in answering]), answering, length)
        except UncorrectableSharesError as error:
            raise self._abort(
                TamperingDetected(
                    f"step {t}: the release shares of seats {answering} hold more errors than "
                    f"the {len(answering)} answers can correct; no release decoded, nobody "
                    "named, the state is kept"
                )
            ) from error
        values = self.scheme.field.decode_signed(decoding.values)
        release = values.reshape(len(released), self.blocks * self.scheme.k)[:, : self.dim]
        output = self._released(t, released, release, clients, excluded, rejected, transcript,
                                carried)
        output.rejected_members = dict(opened.rejected_members)
        output.corrected = tuple(int(s) for s in decoding.corrected)
        output.verified = bool(decoding.verified) and not self.unverified_rows & set(released)
        output.radius = int(decoding.radius)
        output.dropped = tuple(s for s in opened.holders if s not in rows)
        self._enter(DMMStage.RESHARE)
        dealers = [s for s in live if s in sent and s not in output.corrected]
        self._handoff(keys.round, t, dealers, faults, transcript, next_pool, output)
        self._enter(DMMStage.DONE)
        return output

    def _too_few_clients(self, t: int, count: int) -> DMMAbort:
        return DMMAbort(
            f"step {t}: {count} clients' shares reached every member, min_clients = "
            f"{self.min_clients} needed; nothing released",
            DMMStage.COMBINE,
            self.min_clients,
            count,
        )

    def _too_few_members(self, t: int, count: int) -> DMMAbort:
        need = self.scheme.threshold
        return DMMAbort(
            f"step {t}: {count} members released, t + k = {need} needed; nothing released, "
            "the state is kept",
            DMMStage.RELEASE,
            need,
            count,
        )

    def _open_release(self, answered, live, keys, transcript, rejected_members, carried):
        """seat -> its opened release row; the seats that sent (late ones included); how many
        well-formed shares came on time.
        Notes the step as opened when more than t seats sent (:meth:`_note_opened`) and opens
        nothing when fewer than t + k well-formed shares came on time (the quorum)."""
        width = len(self.schedule.released_at(keys.step)) * self.blocks
        arrived, sent = [], []
        for group, answer in zip(self.pool.groups, answered):
            if not isinstance(answer, Mapping):
                continue
            answer = ReleaseAnswer.from_record(answer)
            seats, items, late = answer.seats, answer.rows, set(answer.late)
            if len(seats) != len(items):
                rejected_members.update({int(s): "release answer is malformed" for s in group})
                continue
            for seat, item in zip(seats, items):
                if seat not in group or seat not in live or int(seat) in sent:
                    continue
                sent.append(int(seat))
                if seat not in late:
                    arrived.append((int(seat), item))
        self._note_opened(keys.step, sent, carried)
        well_formed = [(s, i) for s, i in arrived if self._release_form(s, i, keys) is None]
        if len(well_formed) < self.scheme.threshold:
            for seat, item in arrived:
                if (problem := self._release_form(seat, item, keys)) is not None:
                    rejected_members[seat] = f"release share refused: {problem}"
            return {}, sorted(sent), len(well_formed)
        rows = self._open_rows(arrived, keys, transcript, rejected_members, width)
        return rows, sorted(sent), len(well_formed)

    def _release_form(self, seat: int, item, keys) -> str | None:
        """Why ``item`` is no release share of ``seat`` for the server (None if its form is
        right; whether it opens is checked only after the quorum)."""
        if self._server is None:
            return None if isinstance(item, np.ndarray) else f"a {type(item).__name__}"
        if not isinstance(item, Envelope):
            return f"a {type(item).__name__}, not an Envelope"
        header = (item.sender, item.receiver, item.round, item.stage)
        expected = (SEAT_ID_BASE + seat, SERVER_ID, keys.round, stage_label(DMMStage.RELEASE))
        if header != expected:
            return f"envelope header {header!r}; expected {expected!r}"
        return None

    def _open_rows(self, arrived, keys, transcript, rejected_members, width):
        """seat -> its opened, checked release row (``arrived``: the on-time (seat, share))."""
        f = self.scheme.field
        rows = {}
        for seat, item in arrived:
            try:
                if isinstance(item, Envelope) and self._server is not None:
                    transcript.record(item.sender, item.receiver, item.stage, item.nbytes)
                    row = self._server.open_array(
                        item,
                        round_=keys.round,
                        stage=DMMStage.RELEASE,
                        sender=SEAT_ID_BASE + int(seat),
                        decode=row_decoder(width),
                    )
                elif self._server is None and isinstance(item, np.ndarray):
                    row = item
                    transcript.record(
                        SEAT_ID_BASE + seat, SERVER_ID, DMMStage.RELEASE, row.size * 8
                    )
                else:
                    raise ChannelError(f"a {type(item).__name__}, not an Envelope")
                if row.shape != (width,):
                    raise ChannelError(f"a row of shape {row.shape}, not ({width},)")
                rows[int(seat)] = f.asarray(row, "release share")
            except (ChannelError, ValueError) as error:
                rejected_members[int(seat)] = f"release share refused: {error}"
        return rows

    def _released(self, t, released, release, clients, excluded, rejected, transcript,
                  carried=None):
        """Record a final release: counts (``carried``: the clients whose noise it holds,
        default one per entry of ``clients``), step, decoder."""
        for i in released:
            self.counts[int(i)] = len(clients) if carried is None else int(carried)
        self.step += 1
        estimate = self.decoder.add(t, dict(zip(released, release)))
        self.last_output = RoundOutput(
            estimate=estimate,
            step=t,
            rows=tuple(int(i) for i in released),
            release=np.asarray(release, dtype=np.int64),
            clients=tuple(clients),
            contributors=len(clients) if carried is None else int(carried),
            excluded=tuple(sorted(excluded)),
            rejected=dict(rejected),
            transcript=transcript,
        )
        return self.last_output
