"""One round of the distributed matrix mechanism (DMM) between clients, a committee and a server.

Bienstock, Kumar & Polychroniadou, ICML 2025; reference/dmm.md steps 2-6. Round t (the
mechanism's step, advanced only by a successful release) with committee C_t of n members
(packed Shamir, threshold t_c, packing k, :class:`protocols.shamir.PackedShamir`), public integer
noising matrix M = round(2^f G) (:class:`fedsim.privacy.dmm.IntegerNoising`) and the noise rows
R_t drawn this round:

1. **SHARE**: client i sends member j its shares of u_i (its rounded update, D integers) and of
   zeta_{i,r} ~ N_Z(0, s^2) for every r in R_t, each segment packed in ceil(D / k) blocks, over
   an authenticated encrypted channel relayed by the server (``mode="full"``).
2. **COMBINE**: the members agree on the clients whose shares reached every live member and sum
   them: shares of U_t = sum_i u_i and of z_r = sum_i zeta_{i,r}; they add the z_r to the noise
   state they hold (shares of every earlier noise row still used) and compute, locally and with
   integer coefficients, shares of w_t = sum_r M[t, r] z_r and of 2^f U_t + w_t.
3. **RELEASE**: members send those shares to the server, which reconstructs from any t_c + k
   (degree check over the extras: tampered shares are named and left out when unique decoding
   allows, otherwise :class:`ReleaseTampering`), decodes signed integers and divides by 2^f.
4. **RESHARE**: the members hand the noise rows still needed (:meth:`IntegerNoising.needed_after`)
   to committee C_{t+1} with :class:`protocols.resharing.Resharing`; members named at RELEASE do
   not deal.

Aborts. Fewer than t_c + k live members at SHARE/COMBINE lose the committee's state:
:class:`StateLost`. Fewer than ``min_clients`` agreed clients or t_c + k releases abort the round
(:class:`RoundAborted`): nothing is released, the step does not advance and the state is as
before the round. A failed handoff raises :class:`protocols.resharing.ReshareAbort` after the
release (the released aggregate stays valid).

``mode="ideal"`` computes the same integers with no shares and no cryptography, applying the
same agreement rules to client and member dropouts (tampering has nothing to act on there), so
both modes release identical aggregates for the same inputs and faults.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from enum import Enum

import numpy as np

from fedsim.privacy.dmm import IntegerNoising
from protocols.channels import SERVER_ID, ChannelError, Endpoint, Relay, Transcript, new_session_id
from protocols.field import DEFAULT_FIELD
from protocols.resharing import ReshareAbort, ReshareFaults, ReshareTampering, Resharing
from protocols.secagg import TooManyDropoutsError, check_move
from protocols.shamir import InconsistentSharesError, PackedShamir

MEMBER_ID_BASE = 2**62 + 2**41
"""Channel party id of member j of the round's committee: MEMBER_ID_BASE + j."""


class DMMStage(Enum):
    """Stages of one DMM round, in order; ABORTED is reachable from every live stage."""

    SETUP = 0
    SHARE = 1
    COMBINE = 2
    RELEASE = 3
    RESHARE = 4
    DONE = 5
    ABORTED = 6


ACTIVE = (DMMStage.SHARE, DMMStage.COMBINE, DMMStage.RELEASE, DMMStage.RESHARE)

TRANSITIONS: dict[DMMStage, frozenset[DMMStage]] = {
    DMMStage.SETUP: frozenset({DMMStage.SHARE, DMMStage.ABORTED}),
    DMMStage.SHARE: frozenset({DMMStage.COMBINE, DMMStage.ABORTED}),
    DMMStage.COMBINE: frozenset({DMMStage.RELEASE, DMMStage.ABORTED}),
    DMMStage.RELEASE: frozenset({DMMStage.RESHARE, DMMStage.ABORTED}),
    DMMStage.RESHARE: frozenset({DMMStage.DONE, DMMStage.ABORTED}),
    DMMStage.DONE: frozenset(),
    DMMStage.ABORTED: frozenset(),
}


def check_transition(current: DMMStage, target: DMMStage, who: str) -> None:
    """Raise :class:`protocols.secagg.StageError` unless ``current -> target`` is allowed."""
    check_move(TRANSITIONS, current, target, who)


class RoundAborted(TooManyDropoutsError):
    """The round released nothing; ``stage``, ``needed`` and ``answered`` say why. The state is
    as before the round."""

    def __init__(self, message: str, stage: DMMStage, needed: int, answered: int) -> None:
        super().__init__(message)
        self.stage, self.needed, self.answered = stage, needed, answered


class StateLost(RoundAborted):
    """Fewer than t + k members still hold the noise state: the mechanism cannot continue."""


class ReleaseTampering(RuntimeError):
    """Released shares are inconsistent and the faulty members cannot be removed."""

    def __init__(self, message: str, suspects: tuple[int, ...]) -> None:
        super().__init__(message)
        self.suspects = suspects


@dataclass(frozen=True)
class DMMFaults:
    """Faults of one round.

    ``member[(j, stage)]``: 'drop' (silent from ``stage`` on), 'late' (RELEASE only: its share
    misses the deadline) or 'tamper' (adds a non-zero offset to what it holds at COMBINE, sends
    at RELEASE, or deals at RESHARE); ``client_drop[i]``: the stage at which client i stops (at
    SHARE it sends nothing; later its shares are already with the members, so nothing changes);
    ``client_partial``: clients whose shares reach only members ``< n // 2`` (they are left out);
    ``next_drop``: members of the next committee that are gone at RESHARE;
    ``corrupt_in_transit``: (client, member) pairs whose sealed shares the relay alters.
    """

    member: Mapping[tuple[int, DMMStage], str] = field(default_factory=dict)
    client_drop: Mapping[int, DMMStage] = field(default_factory=dict)
    client_partial: frozenset[int] = frozenset()
    next_drop: frozenset[int] = frozenset()
    corrupt_in_transit: frozenset[tuple[int, int]] = frozenset()
    seed: int = 0

    def __post_init__(self) -> None:
        for (j, stage), kind in self.member.items():
            if stage not in ACTIVE or kind not in ("drop", "late", "tamper"):
                raise ValueError(
                    f"member[({j}, {stage})] = {kind!r}; allowed stages "
                    f"{[s.name for s in ACTIVE]} and faults 'drop', 'late', 'tamper'"
                )
            if kind == "tamper" and stage is DMMStage.SHARE:
                raise ValueError(
                    f"member[({j}, SHARE)] = 'tamper'; members hold nothing to alter before "
                    "COMBINE (a corrupted client share is corrupt_in_transit)"
                )
            if kind == "late" and stage is not DMMStage.RELEASE:
                raise ValueError(
                    f"member[({j}, {stage.name})] = 'late'; only RELEASE has a deadline"
                )
        for i, stage in self.client_drop.items():
            if stage not in ACTIVE:
                raise ValueError(f"client_drop[{i}] = {stage!r}; allowed: {ACTIVE}")

    def members(self, kind: str, stage: DMMStage) -> set[int]:
        return {j for (j, s), f in self.member.items() if s is stage and f == kind}

    def dropped_by(self, stage: DMMStage) -> set[int]:
        """Members silent at ``stage`` (dropped there or earlier)."""
        order = ACTIVE.index(stage)
        return {j for (j, s), f in self.member.items() if f == "drop" and ACTIVE.index(s) <= order}


@dataclass
class RoundOutput:
    """What a round released and what it cost.

    ``release``: signed integers 2^f U_t + w_t (length D); ``clients``: the clients whose update
    and noise are in it; ``excluded``: clients left out (partial or unauthenticated shares);
    ``faulty``: members named by the degree check; ``reshare_attempts``, ``transcript``: bytes per
    (sender, receiver, stage) of SHARE, RELEASE and the resharing's DEAL/VERIFY.
    """

    release: np.ndarray
    clients: tuple[int, ...]
    excluded: tuple[int, ...]
    faulty: tuple[int, ...]
    reshare_attempts: int
    transcript: Transcript


class DMMCommitteeProtocol:
    """The server's driver of DMM rounds with in-process committees (one per round).

    ``scheme``: (n, t, k) and field of every committee; ``noising``: the integer matrix;
    ``dim``: D; ``mode``: 'full' or 'ideal'; ``encrypt``: seal shares in full mode;
    ``rng``: share randomness for reproducible simulation (None: OS randomness, the secure
    default). The noise state survives aborted rounds.
    """

    def __init__(
        self,
        scheme: PackedShamir,
        noising: IntegerNoising,
        dim: int,
        *,
        mode: str = "full",
        encrypt: bool = True,
        min_clients: int = 1,
        rng: np.random.Generator | None = None,
    ) -> None:
        if mode not in ("full", "ideal"):
            raise ValueError(f"mode={mode!r}; allowed: 'full', 'ideal'")
        if not isinstance(dim, int | np.integer) or dim < 1:
            raise ValueError(f"dim={dim!r}; allowed: a positive integer")
        if scheme.field != DEFAULT_FIELD and scheme.field.exponent < 31:
            raise ValueError(f"scheme.field={scheme.field!r} is too small for DMM sums")
        self.scheme, self.noising, self.dim, self.mode = scheme, noising, int(dim), mode
        self.encrypt = bool(encrypt)
        self.min_clients = int(min_clients)
        self.rng = rng
        self.step = 0
        self.stage = DMMStage.SETUP
        self.blocks = scheme.blocks_for(self.dim)
        # state: noise row -> (n, blocks) shares held by the current committee (full) or the
        # signed integer row (ideal); ``holders``: members of the current committee holding it
        self.state: dict[int, np.ndarray] = {}
        self.holders: tuple[int, ...] = tuple(range(scheme.n))
        self.noise_counts: dict[int, int] = {}
        self.last_output: RoundOutput | None = None

    def __getstate__(self) -> dict:
        """Checkpoints keep the state shares and counters, never a round's channel keys."""
        state = dict(self.__dict__)
        state.pop("_members", None)
        state.pop("_server", None)
        return state

    # ------------------------------------------------------------------ helpers
    def _enter(self, target: DMMStage) -> None:
        check_transition(self.stage, target, f"DMM round (step {self.step})")
        self.stage = target

    def _share(self, values: np.ndarray) -> np.ndarray:
        encoded = self.scheme.field.encode_signed(values)
        if self.rng is None:
            return self.scheme.share(encoded, secure=True)
        return self.scheme.share(encoded, rng=self.rng)

    def _abort(self, error: RoundAborted) -> RoundAborted:
        self.stage = DMMStage.ABORTED
        return error

    # ------------------------------------------------------------------ one round
    def run_round(
        self,
        updates: Mapping[int, np.ndarray],
        noises: Mapping[int, np.ndarray],
        faults: DMMFaults | None = None,
        round_: int = 0,
    ) -> RoundOutput:
        """Run step ``self.step`` with ``updates[i]`` (D signed ints) and ``noises[i]``
        (rows drawn this step x D signed ints) of each client i."""
        faults = faults or DMMFaults()
        self.stage = DMMStage.SETUP
        t = self.step
        if t >= self.noising.n:
            raise ValueError(f"step {t} is past the factorization's n = {self.noising.n} rounds")
        drawn = self.noising.rows_drawn_at(t)
        for i in updates:
            if i not in noises or np.shape(noises[i]) != (drawn.size, self.dim):
                raise ValueError(
                    f"client {i}: noises must have shape ({drawn.size}, {self.dim}) at step {t}"
                )
            if np.size(updates[i]) != self.dim:
                raise ValueError(f"client {i}: update has {np.size(updates[i])} != D = {self.dim}")
        n, need = self.scheme.n, self.scheme.threshold
        transcript = Transcript()

        # SHARE
        self._enter(DMMStage.SHARE)
        senders = [i for i in sorted(updates) if faults.client_drop.get(i) is not DMMStage.SHARE]
        live = [j for j in self.holders if j not in faults.dropped_by(DMMStage.SHARE)]
        if len(live) < need:
            raise self._abort(
                StateLost(
                    f"step {t}: {len(live)} members alive at SHARE, t + k = {need} needed; "
                    "the noise state is lost",
                    DMMStage.SHARE,
                    need,
                    len(live),
                )
            )
        excluded = set(faults.client_partial) & set(senders)
        if self.mode == "full":
            received, refused = self._share_full(
                updates, noises, senders, live, faults, round_, transcript
            )
            excluded |= refused
        clients = [i for i in senders if i not in excluded]

        # COMBINE
        self._enter(DMMStage.COMBINE)
        live = [j for j in live if j not in faults.dropped_by(DMMStage.COMBINE)]
        if len(live) < need:
            raise self._abort(
                StateLost(
                    f"step {t}: {len(live)} members alive at COMBINE, t + k = {need} needed; "
                    "the noise state is lost",
                    DMMStage.COMBINE,
                    need,
                    len(live),
                )
            )
        if len(clients) < self.min_clients:
            self.holders = tuple(live)
            raise self._abort(
                RoundAborted(
                    f"step {t}: {len(clients)} clients' shares reached every member, "
                    f"min_clients = {self.min_clients} needed; nothing released",
                    DMMStage.COMBINE,
                    self.min_clients,
                    len(clients),
                )
            )
        f = self.scheme.field
        coefficients = self.noising.integer_matrix[t]
        if self.mode == "full":
            total = f.sum(np.stack([received[i] for i in clients]), axis=0)  # (n, segs*blocks)
            total = self._tamper(
                total, faults.members("tamper", DMMStage.COMBINE), live, faults.seed, 1
            )
            segments = total.reshape(n, 1 + drawn.size, self.blocks)
            new_state = {int(r): segments[:, 1 + a] for a, r in enumerate(drawn)}
            state = {**self.state, **new_state}
            release = f.mul_pow2(segments[:, 0], self.noising.fractional_bits)
            for r, rows in state.items():
                if coefficients[r]:
                    scaled = f.mul(rows, f.encode_signed(np.array([coefficients[r]])))
                    release = f.add(release, scaled)
        else:
            # the same field operations on the secrets themselves (sharing is linear)
            U = np.sum([np.asarray(updates[i], dtype=np.int64) for i in clients], axis=0)
            new_state = {
                int(r): f.encode_signed(
                    np.sum([np.asarray(noises[i][a], dtype=np.int64) for i in clients], axis=0)
                )
                for a, r in enumerate(drawn)
            }
            state = {**self.state, **new_state}
            release = f.mul_pow2(f.encode_signed(U), self.noising.fractional_bits)
            for r, row in state.items():
                if coefficients[r]:
                    scaled = f.mul(row, f.encode_signed(np.array([coefficients[r]])))
                    release = f.add(release, scaled)

        # RELEASE
        self._enter(DMMStage.RELEASE)
        answering = [
            j
            for j in live
            if j not in faults.dropped_by(DMMStage.RELEASE)
            and j not in faults.members("late", DMMStage.RELEASE)
        ]
        if len(answering) < need:
            self.holders = tuple(j for j in live if j not in faults.dropped_by(DMMStage.RELEASE))
            raise self._abort(
                RoundAborted(
                    f"step {t}: {len(answering)} members released, t + k = {need} needed; "
                    "nothing released, the state is kept",
                    DMMStage.RELEASE,
                    need,
                    len(answering),
                )
            )
        faulty: tuple[int, ...] = ()
        if self.mode == "full":
            rows = self._tamper(
                release, faults.members("tamper", DMMStage.RELEASE), answering, faults.seed, 2
            )[answering]
            rows = self._release_full(rows, answering, round_, transcript)
            opened, faulty = self._reconstruct(rows, answering, t)
        else:
            opened = release
        signed = f.decode_signed(opened)

        # the release is final from here: the step advances whatever the handoff does
        for r in drawn:
            self.noise_counts[int(r)] = len(clients)
        self.step += 1
        self.last_output = RoundOutput(
            release=signed,
            clients=tuple(clients),
            excluded=tuple(sorted(excluded)),
            faulty=faulty,
            reshare_attempts=0,
            transcript=transcript,
        )

        # RESHARE
        self._enter(DMMStage.RESHARE)
        try:
            self.last_output.reshare_attempts = self._reshare(
                t, state, live, faulty, faults, round_, transcript
            )
        except (ReshareAbort, ReshareTampering):
            self.stage = DMMStage.ABORTED
            self.state, self.holders = {}, ()
            raise
        self._enter(DMMStage.DONE)
        return self.last_output

    def _reshare(self, t, state, live, faulty, faults, round_, transcript) -> int:
        """Hand the noise rows still needed to the next committee; returns DEAL attempts."""
        n, need = self.scheme.n, self.scheme.threshold
        keep = [int(r) for r in self.noising.needed_after(t)]
        dealers = [
            j for j in live if j not in faults.dropped_by(DMMStage.RESHARE) and j not in faulty
        ]
        attempts = 0
        if self.mode == "full" and keep:
            flat = {j: np.concatenate([state[r][j] for r in keep]) for j in dealers}
            resharing = Resharing(self.scheme, self.scheme, round_=round_, encrypt=self.encrypt)
            result = resharing.run(
                flat,
                ReshareFaults(
                    new_drop=frozenset(faults.next_drop),
                    tamper=frozenset(faults.members("tamper", DMMStage.RESHARE)),
                    seed=faults.seed,
                ),
                rng=self.rng,
                secure=self.rng is None,
            )
            for key, (m, b) in result.transcript.counts.items():
                transcript.counts[key][0] += m
                transcript.counts[key][1] += b
            attempts = result.attempts
            new_rows = np.zeros((n, len(keep) * self.blocks), dtype=np.int64)
            for j in result.holders:
                new_rows[j] = result.shares[j]
            split = new_rows.reshape(n, len(keep), self.blocks)
            self.state = {r: split[:, a] for a, r in enumerate(keep)}
            self.holders = result.holders
        else:
            holders = [j for j in range(n) if j not in faults.next_drop]
            if keep and (len(dealers) < need or len(holders) < need):
                side, answered = (
                    ("old", len(dealers)) if len(dealers) < need else ("new", len(holders))
                )
                raise ReshareAbort(
                    f"resharing of step {t}: {answered} {side} members, t + k = {need} needed",
                    side,
                    need,
                    answered,
                )
            self.state = {r: state[r] for r in keep}
            self.holders = tuple(holders)
            attempts = 1 if keep else 0
        return attempts

    # ------------------------------------------------------------------ full-mode transport
    def _share_full(self, updates, noises, senders, live, faults, round_, transcript):
        """Clients share every segment; members open their rows. Returns (received, refused):
        received[i] is (n, segments * blocks) with the rows the live members opened. Client i's
        channel party id is its position in ``senders``."""
        n, f = self.scheme.n, self.scheme.field
        relay = Relay(transcript) if self.encrypt else None
        if self.encrypt:
            session = new_session_id()
            self._members = {j: Endpoint(MEMBER_ID_BASE + j, session) for j in range(n)}
            self._server = Endpoint(SERVER_ID, session)
            clients = {i: Endpoint(a, session) for a, i in enumerate(senders)}
            for member in self._members.values():
                relay.publish(member.party_id, member.public_key, DMMStage.SHARE)
                member.connect(SERVER_ID, self._server.public_key)
                self._server.connect(member.party_id, member.public_key)
                for client in clients.values():
                    client.connect(member.party_id, member.public_key)
                    member.connect(client.party_id, client.public_key)
        received, refused = {}, set()
        for i in senders:
            segments = [np.asarray(updates[i], dtype=np.int64)] + list(np.asarray(noises[i]))
            shares = np.hstack([self._share(np.asarray(seg, dtype=np.int64)) for seg in segments])
            reach = [j for j in live if i not in faults.client_partial or j < n // 2]
            rows = np.zeros_like(shares)
            for j in reach:
                if relay is None:
                    transcript.record(
                        senders.index(i), MEMBER_ID_BASE + j, DMMStage.SHARE, shares[j].size * 8
                    )
                    rows[j] = shares[j]
                    continue
                envelope = clients[i].seal_array(
                    MEMBER_ID_BASE + j, round_, DMMStage.SHARE, shares[j]
                )
                if (i, j) in faults.corrupt_in_transit:
                    body = bytearray(envelope.ciphertext)
                    body[0] ^= 0x01
                    envelope = type(envelope)(
                        envelope.sender,
                        envelope.receiver,
                        envelope.round,
                        envelope.stage,
                        envelope.nonce,
                        bytes(body),
                    )
                relay.post(envelope)
            if relay is not None:
                for j in reach:
                    for envelope in relay.deliver(MEMBER_ID_BASE + j):
                        try:
                            rows[j] = f.asarray(self._members[j].open_array(envelope))
                        except ChannelError:
                            refused.add(i)
            received[i] = rows
        return received, refused

    def _tamper(self, rows, who, live, seed, salt):
        who = sorted(set(who) & set(live))
        if not who:
            return rows
        f = self.scheme.field
        rows = rows.copy()
        offsets = np.random.default_rng([seed, salt, self.step])
        for j in who:
            rows[j] = f.add(rows[j], offsets.integers(1, f.modulus, size=rows.shape[1]))
        return rows

    def _release_full(self, rows, answering, round_, transcript):
        if not self.encrypt:
            for j, row in zip(answering, rows):
                transcript.record(MEMBER_ID_BASE + j, SERVER_ID, DMMStage.RELEASE, row.size * 8)
            return rows
        relay = Relay(transcript)
        for j, row in zip(answering, rows):
            relay.post(self._members[j].seal_array(SERVER_ID, round_, DMMStage.RELEASE, row))
        opened = {
            e.sender - MEMBER_ID_BASE: self._server.open_array(e) for e in relay.deliver(SERVER_ID)
        }
        return np.stack([opened[j] for j in answering])

    def _reconstruct(self, rows, answering, t):
        need = self.scheme.threshold
        try:
            return self.scheme.reconstruct(rows, answering, self.dim), ()
        except InconsistentSharesError as error:
            suspects = tuple(int(s) for s in error.suspects)
            keep = [a for a, j in enumerate(answering) if j not in suspects]
            if suspects and len(keep) >= need:
                members = [answering[a] for a in keep]
                return self.scheme.reconstruct(rows[keep], members, self.dim), suspects
            self.stage = DMMStage.ABORTED
            raise ReleaseTampering(
                f"step {t}: released shares of members {answering} are inconsistent and "
                f"cannot be corrected (suspects {list(suspects)}); nothing released, the state "
                "is kept",
                suspects,
            ) from error
