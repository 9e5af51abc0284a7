"""One round of the distributed matrix mechanism (DMM) between clients, a committee and a server.

Bienstock, Kumar & Polychroniadou, ICML 2025; reference/dmm.md steps 2-6. Round t (the
mechanism's step, advanced only by a successful release) with committee C_t of n members
(packed Shamir, threshold t_c, packing k, :class:`protocols.shamir.PackedShamir`), public integer
noising matrix M = round(2^f G) (:class:`fedsim.privacy.dmm.IntegerNoising`) and the noise rows
R_t drawn this round:

1. **SHARE**: the online members publish fresh channel keys (:meth:`DMMCommitteeProtocol.
   open_round`, public :class:`RoundKeys`); client i shares u_i (its rounded update, D
   integers) and zeta_{i,r} ~ N_Z(0, s^2) for every r in R_t *itself*, each segment packed in
   ceil(D / k) blocks, and seals member j's shares under its own ephemeral X25519 key
   (:func:`seal_client_shares`, ``mode="full"``); the server only relays the envelopes
   (:meth:`DMMCommitteeProtocol.run_sealed_round`) and cannot open them.
2. **COMBINE**: the members agree on the clients whose shares reached every live member and sum
   them: shares of U_t = sum_i u_i and of z_r = sum_i zeta_{i,r}; they add the z_r to the noise
   state they hold (shares of every earlier noise row still used) and compute, locally and with
   integer coefficients, shares of w_t = sum_r M[t, r] z_r and of 2^f U_t + w_t.
3. **RELEASE**: members send those shares to the server, which reconstructs from any t_c + k
   (degree check over the extras: tampered shares are named and left out when unique decoding
   allows, otherwise :class:`ReleaseTampering`), decodes signed integers and divides by 2^f.
4. **RESHARE**: the members hand the noise rows still needed (:meth:`IntegerNoising.needed_after`)
   to committee C_{t+1} by linear packed resharing (the member pieces and the announce / deal /
   accumulate / verify rules of :mod:`protocols.resharing`); members named at RELEASE do not
   deal.

Aborts. Fewer than t_c + k live members at SHARE/COMBINE lose the committee's state:
:class:`StateLost`. Fewer than ``min_clients`` agreed clients or t_c + k releases abort the round
(:class:`RoundAborted`): nothing is released, the step does not advance and the state is as
before the round. A failed handoff raises :class:`protocols.resharing.ReshareAbort` after the
release (the released aggregate stays valid).

Client, member and server sides. :func:`seal_client_shares` is what a client runs: it sees
only the round's public keys and parameters and outputs ciphertexts and its public key.
:class:`DMMMembers` is what committee members run: each holds its
own shares of the noise state across rounds, opens the clients' sealed shares, combines
locally, seals its release share to the server and deals / accumulates its part of the
handoff. :class:`DMMCommitteeProtocol` is the server: it orchestrates the stages, relays and
counts every message, agrees on clients and dealers, and reconstructs only the release (and the
handoff's parity-check syndromes). Members live in two pools that take turns being the current
and the next committee (:class:`MemberPool` in process; :mod:`fedsim.engine.dmm_committee`
puts each group of members in a Ray actor); both give the same results.

``mode="ideal"`` is the no-cryptography reference: :meth:`DMMCommitteeProtocol.run_round` takes
the clients' plaintext integers and computes the same sums with no shares, applying the
same agreement rules to client and member dropouts (tampering has nothing to act on there), so
both modes release identical aggregates for the same inputs and faults.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from enum import Enum
from typing import TYPE_CHECKING

import numpy as np

from protocols.channels import (
    PUBLIC_KEY_BYTES,
    SERVER_ID,
    ChannelError,
    Endpoint,
    Envelope,
    Relay,
    Transcript,
    new_session_id,
)
from protocols.field import DEFAULT_FIELD, MersenneField
from protocols.resharing import (
    NEW_ID_BASE,
    OLD_ID_BASE,
    NewMember,
    OldMember,
    ReshareAbort,
    ReshareStage,
    ReshareTampering,
    _Randomness,
    open_parity_checks,
    parity_checks,
    reshare_coefficients,
)
from protocols.secagg import TooManyDropoutsError, check_move
from protocols.shamir import InconsistentSharesError, PackedShamir

if TYPE_CHECKING:  # members (actors) never need the privacy package
    from fedsim.privacy.dmm import IntegerNoising

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
    ``client_partial``: clients whose shares reach only members ``< n // 2`` (the relay drops
    the rest; they are left out);
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


@dataclass(frozen=True)
class RoundKeys:
    """What a client needs to share in one round, all public: the scheme (n, t, k, field
    exponent), D, the round and mechanism step, the number of noise rows drawn, the channel
    session id (None: plain rows, no encryption) and the online members' fresh X25519 public
    keys (member -> 32 bytes; b'' without encryption)."""

    round: int
    step: int
    rows: int
    n: int
    t: int
    k: int
    field_exponent: int
    dim: int
    session_id: bytes | None
    member_keys: Mapping[int, bytes]

    def scheme(self) -> PackedShamir:
        return PackedShamir(self.n, self.t, self.k, MersenneField(self.field_exponent))


@dataclass(frozen=True)
class SealedShares:
    """One client's SHARE message as the server holds it: its channel party id, its ephemeral
    public key, and per member j one :class:`protocols.channels.Envelope` addressed to
    ``MEMBER_ID_BASE + j`` (plain share rows only when the round runs without encryption)."""

    party: int
    public_key: bytes
    shares: Mapping[int, object]


def seal_client_shares(
    keys: RoundKeys,
    party: int,
    update,
    noise,
    rng: np.random.Generator | None = None,
) -> SealedShares:
    """Client side of SHARE (reference/dmm.md step 2): packed-Shamir-share the rounded update
    u_i (D signed integers) and the noise rows zeta_{i,r} (``keys.rows`` x D) segment by segment,
    then seal member j's row of shares under a fresh X25519 key of this client (party id
    ``party``) bound to (client, member, round, SHARE). ``rng`` seeds the share polynomials for
    reproducible simulation; None (the secure default) draws them from the OS CSPRNG."""
    if not isinstance(party, int | np.integer) or not 0 <= party < OLD_ID_BASE:
        raise ValueError(f"party={party!r}; allowed: an integer in [0, 2^62)")
    update = np.asarray(update)
    noise = np.asarray(noise)
    if update.shape != (keys.dim,) or update.dtype.kind not in "iu":
        raise ValueError(
            f"update has shape {update.shape} and dtype {update.dtype}; allowed: ({keys.dim},) "
            "integers"
        )
    if noise.shape != (keys.rows, keys.dim) or (noise.size and noise.dtype.kind not in "iu"):
        raise ValueError(
            f"noise has shape {noise.shape} and dtype {noise.dtype}; allowed: "
            f"({keys.rows}, {keys.dim}) integers"
        )
    scheme = keys.scheme()
    segments = [update.astype(np.int64), *noise.astype(np.int64)]
    shares = np.hstack([_share_signed(scheme, segment, rng) for segment in segments])
    if keys.session_id is None:
        return SealedShares(int(party), b"", {int(j): shares[j] for j in keys.member_keys})
    endpoint = Endpoint(int(party), keys.session_id)
    sealed = {}
    for j, key in sorted(keys.member_keys.items()):
        endpoint.connect(MEMBER_ID_BASE + j, key)
        sealed[int(j)] = endpoint.seal_array(
            MEMBER_ID_BASE + j, keys.round, DMMStage.SHARE, shares[j]
        )
    return SealedShares(int(party), endpoint.public_key, sealed)


def _share_signed(
    scheme: PackedShamir, values: np.ndarray, rng: np.random.Generator | None
) -> np.ndarray:
    """(n, blocks) packed shares of signed integers ``values`` (OS randomness when ``rng`` is
    None)."""
    encoded = scheme.field.encode_signed(values)
    if rng is None:
        return scheme.share(encoded, secure=True)
    return scheme.share(encoded, rng=rng)


class DMMMembers:
    """Member side: members ``members`` of one committee, each holding its own shares.

    Steps 2-6 of reference/dmm.md as one committee member runs them; several members may share
    one object (their rows are stacked, one per member, in ``members`` order). Across rounds it
    keeps :attr:`state`: noise row r -> (len(members), blocks) shares of z_r. A round adds the
    received client shares, the combined rows, the *tentative* state (with the rows drawn this
    step) and the release rows; the handoff or :meth:`discard` ends them. A plain class:
    :mod:`fedsim.engine.dmm_committee` runs it as a Ray actor, :class:`MemberPool` in process.

    Every method takes and returns plain data (indices, numpy arrays, public keys,
    :class:`protocols.channels.Envelope`): what travels between the server and an actor.
    Members answer only while online: a member in a stage's ``drop`` set stays silent for the
    rest of the round. Tampering (simulation) adds an offset from ``(seed, salt, step, member)``.
    """

    SILENT: dict[str, object] = {
        "announce": {},
        "share": {"online": [], "refused": {}},
        "combine": [],
        "release": {"members": [], "rows": [], "late": []},
        "deal": {},
        "receive": [],
        "check_shares": {},
        "snapshot": {},
    }
    """What each method returns for members that are gone (a crashed process): they answer
    nothing, so the server counts them as dropped."""

    def __init__(self, members, n: int, t: int, k: int, field_exponent: int, dim: int) -> None:
        self.members = [int(m) for m in members]
        self.scheme = PackedShamir(n, t, k, MersenneField(field_exponent))
        self.dim = int(dim)
        self.blocks = self.scheme.blocks_for(self.dim)
        self.state: dict[int, np.ndarray] = {}
        self._index = {m: a for a, m in enumerate(self.members)}
        self.reset()

    def reset(self) -> None:
        """Forget everything, state included (a pool reassigned to a later committee)."""
        self.state = {}
        self.discard()

    def discard(self) -> None:
        """Drop the round's data (after an abort or a handoff); the state is kept."""
        self._stage = DMMStage.SETUP
        self._round = 0
        self._endpoints: dict[int, Endpoint] = {}
        self._online: set[int] = set()
        self._received: dict[int, np.ndarray] = {}
        self._tentative: dict[int, np.ndarray] | None = None
        self._release: np.ndarray | None = None
        self._incoming: dict[int, NewMember] = {}
        self._handed: np.ndarray | None = None

    def __getstate__(self) -> dict:
        """Pickles (checkpoints) keep the state only, never a round's channel keys."""
        return {"members": self.members, "scheme": self.scheme, "dim": self.dim, "s": self.state}

    def __setstate__(self, saved: dict) -> None:
        self.members, self.scheme, self.dim = saved["members"], saved["scheme"], saved["dim"]
        self.blocks = self.scheme.blocks_for(self.dim)
        self._index = {m: a for a, m in enumerate(self.members)}
        self.reset()
        self.state = saved["s"]

    def snapshot(self) -> dict[int, np.ndarray]:
        """The committed state (checkpoints of actor pools)."""
        return dict(self.state)

    def load(self, state: Mapping[int, np.ndarray]) -> None:
        self.reset()
        self.state = {int(r): np.asarray(v, dtype=np.int64) for r, v in state.items()}

    def _offset(self, rows: np.ndarray, who, seed: int, salt: int, step: int) -> np.ndarray:
        """``rows`` with a non-zero offset added to the rows of the members in ``who``."""
        rows = rows.copy()
        for m in sorted(set(who) & set(self.members)):
            rows[self._index[m]] = self._offset_row(rows[self._index[m]], m, seed, salt, step)
        return rows

    def _offset_row(self, row: np.ndarray, member: int, seed: int, salt: int, step: int):
        f = self.scheme.field
        offsets = np.random.default_rng([seed, salt, step, member])
        return f.add(row, offsets.integers(1, f.modulus, size=row.shape[-1]))

    # ------------------------------------------------------------------ channels
    def announce(
        self, asked, drop, session_id: bytes | None, base: int, fresh: bool, round_: int = 0
    ) -> dict[int, bytes]:
        """The asked members that are online answer with a fresh channel key (party id
        ``base + member``; b'' without encryption) for ``round_``, the round whose envelopes
        they will accept. ``fresh`` starts a round (everyone may answer again); otherwise
        members silent earlier in the round stay silent."""
        if fresh:
            self.discard()
        self._round = int(round_)
        online = [
            m
            for m in asked
            if m in self._index and m not in set(drop) and (fresh or m in self._online)
        ]
        self._online = set(online)
        if session_id is None:
            self._endpoints = {}
            return {m: b"" for m in online}
        self._endpoints = {m: Endpoint(base + m, session_id) for m in online}
        return {m: self._endpoints[m].public_key for m in online}

    def connect(self, peers: Mapping[int, bytes]) -> None:
        """Every online member opens a channel with each ``party id -> public key``."""
        for endpoint in self._endpoints.values():
            for party, key in peers.items():
                endpoint.connect(party, key)

    def _move(self, target: DMMStage) -> None:
        """Members follow the round's stages in order (:data:`TRANSITIONS`; DEAL may repeat)."""
        if not (target is DMMStage.RESHARE and self._stage is DMMStage.RESHARE):
            check_transition(self._stage, target, f"DMM members {self.members}")
        self._stage = target

    def _open(self, member: int, item, stage: Enum) -> np.ndarray:
        if isinstance(item, Envelope):
            opened = self._endpoints[member].open_array(item, round_=self._round, stage=stage)
            return self.scheme.field.asarray(opened, "share")
        return self.scheme.field.asarray(item, "share")

    # ------------------------------------------------------------------ one round
    def share(self, deliveries: Mapping[int, Mapping[int, object]], width: int) -> dict:
        """SHARE: ``deliveries[client][member]`` is the client's sealed (or plain) row for an
        online member. Returns the clients each online member lacks or cannot authenticate."""
        self._move(DMMStage.SHARE)
        refused: dict[int, list[int]] = {}
        for client, rows_in in deliveries.items():
            rows = np.zeros((len(self.members), width), dtype=np.int64)
            for m in sorted(self._online):
                item = rows_in.get(m)
                try:
                    if item is None:
                        raise ChannelError(f"member {m} received nothing from client {client}")
                    rows[self._index[m]] = self._open(m, item, DMMStage.SHARE)
                except (ChannelError, ValueError):
                    refused.setdefault(int(client), []).append(m)
            self._received[int(client)] = rows
        return {"online": sorted(self._online), "refused": refused}

    def combine(self, clients, drawn, coefficients, fractional_bits, drop, tamper, seed, step):
        """COMBINE: sum the rows of the agreed ``clients``: shares of U_t and of the new noise
        rows z_r (r in ``drawn``), added to the state; then shares of 2^f U_t + w_t with
        w_t = sum_r coefficients[r] z_r. Returns the members still online."""
        self._move(DMMStage.COMBINE)
        f = self.scheme.field
        self._online -= set(drop)
        width = (1 + len(drawn)) * self.blocks
        if clients:
            total = f.sum(np.stack([self._received[int(i)] for i in clients]), axis=0)
        else:
            total = np.zeros((len(self.members), width), dtype=np.int64)
        self._received = {}
        total = self._offset(total, set(tamper) & self._online, seed, 1, step)
        segments = total.reshape(len(self.members), 1 + len(drawn), self.blocks)
        new = {int(r): segments[:, 1 + a] for a, r in enumerate(drawn)}
        self._tentative = {**self.state, **new}
        release = f.mul_pow2(segments[:, 0], fractional_bits)
        for r, rows in self._tentative.items():
            coefficient = int(coefficients.get(r, 0))
            if coefficient:
                release = f.add(release, f.mul(rows, f.encode_signed(np.array([coefficient]))))
        self._release = release
        return sorted(self._online)

    def release(self, round_: int, drop, late, tamper, seed: int, step: int) -> dict:
        """RELEASE: each online member sends its row of 2^f U_t + w_t (sealed to the server);
        ``late`` lists those whose answer misses the deadline."""
        self._move(DMMStage.RELEASE)
        self._online -= set(drop)
        rows = self._offset(self._release, set(tamper) & self._online, seed, 2, step)
        members = sorted(self._online)
        sent = [
            self._endpoints[m].seal_array(SERVER_ID, round_, DMMStage.RELEASE, rows[self._index[m]])
            if self._endpoints
            else rows[self._index[m]]
            for m in members
        ]
        return {"members": members, "rows": sent, "late": sorted(set(late) & self._online)}

    # ------------------------------------------------------------------ handoff, old side
    def deal(self, round_, keep, columns, mix, receivers, tamper, seed, share_seed, step):
        """DEAL (:class:`protocols.resharing.OldMember`): each member in ``columns`` re-shares
        its state rows ``keep`` scaled by its Lagrange column (None: check block only) for the
        new members ``receivers``. Returns member -> one sealed (or plain) row per receiver."""
        self._move(DMMStage.RESHARE)
        out = {}
        for m, column in columns.items():
            if m not in self._online:
                continue
            flat = np.concatenate([self._tentative[r][self._index[m]] for r in keep])
            if m in set(tamper):
                flat = self._offset_row(flat, m, seed, 3, step)
            randomness = (
                _Randomness(None, True)
                if share_seed is None
                else _Randomness(np.random.default_rng([share_seed, m]), False)
            )
            rows = OldMember(m, flat).deal(self.scheme, self.scheme, column, mix, randomness)
            endpoint = self._endpoints.get(m)
            out[m] = [
                endpoint.seal_array(NEW_ID_BASE + j, round_, ReshareStage.DEAL, rows[j])
                if endpoint is not None
                else rows[j]
                for j in receivers
            ]
        return out

    # ------------------------------------------------------------------ handoff, new side
    def receive(self, deliveries: Mapping[int, Mapping[int, object]]) -> list[int]:
        """ACCUMULATE, first half: ``deliveries[member][dealer]`` is a deal; returns the
        dealers whose deal some member of this group could not authenticate."""
        refused: set[int] = set()
        self._incoming = {m: NewMember(m) for m in sorted(self._online)}
        for m, deals in deliveries.items():
            for dealer, item in deals.items():
                try:
                    self._incoming[m].received[int(dealer)] = self._open(
                        m, item, ReshareStage.DEAL
                    )
                except (ChannelError, ValueError):
                    refused.add(int(dealer))
        return sorted(refused)

    def accumulate(self, chosen) -> None:
        """ACCUMULATE: each member sums the deals of the dealers ``chosen``."""
        f = self.scheme.field
        sums = {m: member.accumulate(f, chosen) for m, member in self._incoming.items()}
        width = len(next(iter(sums.values()))) if sums else 0
        self._handed = np.zeros((len(self.members), width), dtype=np.int64)
        for m, row in sums.items():
            self._handed[self._index[m]] = row

    def check_shares(self, checks: np.ndarray, candidates) -> dict[int, np.ndarray]:
        """VERIFY: each member's shares of the parity-check syndromes."""
        f = self.scheme.field
        return {
            m: member.check_shares(f, checks, candidates) for m, member in self._incoming.items()
        }

    def commit(self, keep) -> None:
        """The handoff succeeded: the accumulated rows become this committee's state."""
        handed = self._handed
        if handed is None or handed.size == 0:
            handed = np.zeros((len(self.members), len(keep) * self.blocks), dtype=np.int64)
        split = handed.reshape(len(self.members), len(keep), self.blocks)
        self.discard()
        self.state = {int(r): split[:, a].copy() for a, r in enumerate(keep)}


class MemberPool:
    """One committee's members in groups (``groups``: member indices per group), each a
    :class:`DMMMembers`; :meth:`call` runs a method on every group. This pool keeps the groups
    in process; :class:`fedsim.engine.dmm_committee.ActorPool` keeps each in a Ray actor."""

    def __init__(self, groups, member_kwargs: Mapping[str, int]) -> None:
        self.groups = [[int(m) for m in g] for g in groups]
        self.member_kwargs = dict(member_kwargs)
        self.objects = [DMMMembers(g, **self.member_kwargs) for g in self.groups]

    def call(self, method: str, args_per_group) -> list:
        return [getattr(o, method)(*a) for o, a in zip(self.objects, args_per_group)]

    def broadcast(self, method: str, *args) -> list:
        return self.call(method, [args] * len(self.groups))

    def close(self) -> None:
        """Nothing to release in process."""


def _merge(dicts) -> dict:
    out: dict = {}
    for d in dicts:
        out.update(d)
    return out


class DMMCommitteeProtocol:
    """The server's driver of DMM rounds: it orchestrates the stages, relays sealed messages,
    and reconstructs only the release.

    ``scheme``: (n, t, k) and field of every committee; ``noising``: the integer matrix;
    ``dim``: D; ``mode``: 'full' or 'ideal'; ``encrypt``: seal shares in full mode;
    ``rng``: share randomness of the clients :meth:`run_round` simulates and of the handoff,
    for reproducible simulation (None: OS randomness, the secure default). Real clients share
    with their own randomness (:func:`seal_client_shares`); the server sees only envelopes.
    In full mode the members are :class:`DMMMembers` in two pools of ``shards``
    groups that take turns: the current committee and the next one, which receives the handoff
    and then becomes current while the old pool is wiped for the committee after it.
    ``pool_factory(groups, member_kwargs)`` builds a pool (:class:`MemberPool` in process; the
    engine's Ray actors). The noise state survives aborted rounds.
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
        shards: int = 1,
        pool_factory: Callable[..., MemberPool] = MemberPool,
    ) -> None:
        if mode not in ("full", "ideal"):
            raise ValueError(f"mode={mode!r}; allowed: 'full', 'ideal'")
        if not isinstance(dim, int | np.integer) or dim < 1:
            raise ValueError(f"dim={dim!r}; allowed: a positive integer")
        if scheme.field != DEFAULT_FIELD and scheme.field.exponent < 31:
            raise ValueError(f"scheme.field={scheme.field!r} is too small for DMM sums")
        if not isinstance(shards, int | np.integer) or not 1 <= shards <= scheme.n:
            raise ValueError(f"shards={shards!r}; allowed: an integer in [1, n={scheme.n}]")
        self.scheme, self.noising, self.dim, self.mode = scheme, noising, int(dim), mode
        self.encrypt = bool(encrypt)
        self.min_clients = int(min_clients)
        self.rng = rng
        self.step = 0
        self.stage = DMMStage.SETUP
        self.blocks = scheme.blocks_for(self.dim)
        # ideal mode: noise row -> signed integer row; full mode: the members hold the shares
        self.plain_state: dict[int, np.ndarray] = {}
        self.held_rows: tuple[int, ...] = ()
        # members of the current committee holding the state
        self.holders: tuple[int, ...] = tuple(range(scheme.n))
        self.noise_counts: dict[int, int] = {}
        self.last_output: RoundOutput | None = None
        self._opened: tuple[RoundKeys, DMMFaults, Transcript] | None = None
        self.pools: list[MemberPool] = []
        if mode == "full":
            groups = [g.tolist() for g in np.array_split(np.arange(scheme.n), int(shards))]
            kwargs = {
                "n": scheme.n,
                "t": scheme.t,
                "k": scheme.k,
                "field_exponent": scheme.field.exponent,
                "dim": self.dim,
            }
            self.pools = [pool_factory(groups, kwargs), pool_factory(groups, kwargs)]

    def __getstate__(self) -> dict:
        """Checkpoints keep the state shares and counters, never a round's channel keys."""
        state = dict(self.__dict__)
        for key in ("_server", "_session", "_opened"):
            state.pop(key, None)
        return state

    def close(self) -> None:
        """Release the member pools (kills actors)."""
        for pool in self.pools:
            pool.close()

    def member_shares(self) -> dict[int, np.ndarray]:
        """Full mode: noise row -> (n, blocks) shares, gathered from the current committee
        (zeros for members that hold nothing); for tests and inspection only."""
        if not self.pools:
            raise ValueError(f"mode={self.mode!r}: only mode='full' has member shares")
        parts = self.pools[0].broadcast("snapshot")
        out = {r: np.zeros((self.scheme.n, self.blocks), dtype=np.int64) for r in self.held_rows}
        for group, part in zip(self.pools[0].groups, parts):
            for r, rows in part.items():
                out[r][group] = rows
        return out

    # ------------------------------------------------------------------ helpers
    def _enter(self, target: DMMStage) -> None:
        check_transition(self.stage, target, f"DMM round (step {self.step})")
        self.stage = target

    def _abort(self, error: RoundAborted) -> RoundAborted:
        self.stage = DMMStage.ABORTED
        self._discard_round()
        return error

    def _discard_round(self) -> None:
        """The current committee drops the aborted round's data and keeps its state."""
        if self.pools:
            self.pools[0].broadcast("discard")

    def _per_group(self, pool: MemberPool, items: Mapping[int, object]) -> list[dict]:
        return [{m: items[m] for m in group if m in items} for group in pool.groups]

    # ------------------------------------------------------------------ one round
    def run_round(
        self,
        updates: Mapping[int, np.ndarray],
        noises: Mapping[int, np.ndarray],
        faults: DMMFaults | None = None,
        round_: int = 0,
    ) -> RoundOutput:
        """Run step ``self.step`` from the clients' plaintext: ``updates[i]`` (D signed ints)
        and ``noises[i]`` (rows drawn this step x D signed ints) of each client i.

        Ideal mode (the no-cryptography reference) computes on these integers directly. Full
        mode runs the real protocol with the clients simulated here: :meth:`open_round`, each
        client's :func:`seal_client_shares` (party id = its position among the senders, share
        randomness from ``rng``), then :meth:`run_sealed_round`; a deployment runs the client
        side on the clients (:func:`strategies.dmm.dmm_client_app`) and the server calls only
        :meth:`open_round` and :meth:`run_sealed_round`."""
        faults = faults or DMMFaults()
        t = self._check_step()
        drawn = self.noising.rows_drawn_at(t)
        for i in updates:
            if i not in noises or np.shape(noises[i]) != (drawn.size, self.dim):
                raise ValueError(
                    f"client {i}: noises must have shape ({drawn.size}, {self.dim}) at step {t}"
                )
            if np.size(updates[i]) != self.dim:
                raise ValueError(f"client {i}: update has {np.size(updates[i])} != D = {self.dim}")
        senders = [i for i in sorted(updates) if faults.client_drop.get(i) is not DMMStage.SHARE]
        if self.pools:
            keys = self.open_round(faults, round_)
            sealed = {
                i: seal_client_shares(
                    keys,
                    position,
                    np.asarray(updates[i], dtype=np.int64).ravel(),
                    np.asarray(noises[i], dtype=np.int64),
                    self.rng,
                )
                for position, i in enumerate(senders)
            }
            return self.run_sealed_round(sealed)
        # ideal mode
        self.stage = DMMStage.SETUP
        self._enter(DMMStage.SHARE)
        live = [j for j in self.holders if j not in faults.dropped_by(DMMStage.SHARE)]
        if len(live) < self.scheme.threshold:
            raise self._abort(self._state_lost(t, DMMStage.SHARE, len(live)))
        excluded = set(faults.client_partial) & set(senders)
        clients = [i for i in senders if i not in excluded]
        return self._finish_round(
            t, clients, excluded, live, faults, round_, Transcript(), (updates, noises)
        )

    def open_round(self, faults: DMMFaults | None = None, round_: int = 0) -> RoundKeys:
        """Full mode, SETUP -> SHARE of step ``self.step``: the current committee's online
        holders publish fresh channel keys (members dropped at SHARE stay silent). Returns the
        public :class:`RoundKeys` the clients share with; :meth:`run_sealed_round` finishes
        the round under the same ``faults``."""
        if not self.pools:
            raise ValueError(
                f"mode={self.mode!r}: only mode='full' opens rounds for sealed shares; ideal "
                "mode takes the clients' plaintext integers through run_round"
            )
        faults = faults or DMMFaults()
        t = self._check_step()
        self.stage = DMMStage.SETUP
        self._enter(DMMStage.SHARE)
        transcript = Transcript()
        member_keys = self._announce_round(self.pools[0], faults, transcript, round_)
        keys = RoundKeys(
            round=int(round_),
            step=t,
            rows=int(self.noising.rows_drawn_at(t).size),
            n=self.scheme.n,
            t=self.scheme.t,
            k=self.scheme.k,
            field_exponent=self.scheme.field.exponent,
            dim=self.dim,
            session_id=self._session if self.encrypt else None,
            member_keys=member_keys,
        )
        self._opened = (keys, faults, transcript)
        return keys

    def run_sealed_round(self, sealed: Mapping[int, SealedShares]) -> RoundOutput:
        """Finish the round :meth:`open_round` opened from the clients' sealed shares only
        (``sealed[i]``: client i's :class:`SealedShares`): the server relays each envelope to
        its member (the relay-side faults of the round's plan apply: ``client_drop`` at SHARE,
        ``client_partial``, ``corrupt_in_transit``), the members open them, and a client
        whose envelope some live member lacks or cannot authenticate is left out (its update
        and noise are in no sum)."""
        opened = self._opened
        if opened is None or self.stage is not DMMStage.SHARE:
            raise ValueError(
                f"run_sealed_round at stage {self.stage.name}: call open_round first (once per "
                "round)"
            )
        keys, faults, transcript = opened
        parties: dict[int, int] = {}
        for i, item in sealed.items():
            if not isinstance(item, SealedShares):
                raise ValueError(f"sealed[{i}] is a {type(item).__name__}; allowed: SealedShares")
            if item.party in parties or not 0 <= item.party < OLD_ID_BASE:
                raise ValueError(
                    f"sealed[{i}].party={item.party}; allowed: distinct integers in [0, 2^62)"
                )
            parties[item.party] = i
        self._opened = None
        t = keys.step
        senders = [i for i in sorted(sealed) if faults.client_drop.get(i) is not DMMStage.SHARE]
        live = sorted(keys.member_keys)
        if len(live) < self.scheme.threshold:
            raise self._abort(self._state_lost(t, DMMStage.SHARE, len(live)))
        excluded = set(faults.client_partial) & set(senders)
        excluded |= self._relay_shares(sealed, senders, live, faults, transcript, keys.rows)
        clients = [i for i in senders if i not in excluded]
        return self._finish_round(t, clients, excluded, live, faults, keys.round, transcript, None)

    def _check_step(self) -> int:
        if self.step >= self.noising.n:
            raise ValueError(
                f"step {self.step} is past the factorization's n = {self.noising.n} rounds"
            )
        return self.step

    def _state_lost(self, t: int, stage: DMMStage, live: int) -> StateLost:
        need = self.scheme.threshold
        return StateLost(
            f"step {t}: {live} members alive at {stage.name}, t + k = {need} needed; the noise "
            "state is lost",
            stage,
            need,
            live,
        )

    def _finish_round(self, t, clients, excluded, live, faults, round_, transcript, plain):
        """COMBINE, RELEASE and RESHARE of step ``t`` over the agreed ``clients``; ``plain``:
        ideal mode's (updates, noises), None in full mode (the members hold the shares)."""
        need = self.scheme.threshold
        members = self.pools[0] if self.pools else None
        drawn = self.noising.rows_drawn_at(t)

        # COMBINE
        self._enter(DMMStage.COMBINE)
        f = self.scheme.field
        coefficients = self.noising.integer_matrix[t]
        if members is not None:
            combined = members.broadcast(
                "combine",
                clients,
                [int(r) for r in drawn],
                {int(r): int(c) for r, c in enumerate(coefficients) if c},
                self.noising.fractional_bits,
                faults.members("drop", DMMStage.COMBINE),
                faults.members("tamper", DMMStage.COMBINE),
                faults.seed,
                t,
            )
            live = sorted(j for part in combined for j in part)
        else:
            live = [j for j in live if j not in faults.dropped_by(DMMStage.COMBINE)]
        if len(live) < need:
            raise self._abort(self._state_lost(t, DMMStage.COMBINE, len(live)))
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
        if members is None:
            # the same field operations on the secrets themselves (sharing is linear)
            updates, noises = plain
            U = np.sum([np.asarray(updates[i], dtype=np.int64) for i in clients], axis=0)
            new_state = {
                int(r): f.encode_signed(
                    np.sum([np.asarray(noises[i][a], dtype=np.int64) for i in clients], axis=0)
                )
                for a, r in enumerate(drawn)
            }
            state = {**self.plain_state, **new_state}
            release = f.mul_pow2(f.encode_signed(U), self.noising.fractional_bits)
            for r, row in state.items():
                if coefficients[r]:
                    scaled = f.mul(row, f.encode_signed(np.array([coefficients[r]])))
                    release = f.add(release, scaled)

        # RELEASE
        self._enter(DMMStage.RELEASE)
        faulty: tuple[int, ...] = ()
        if members is not None:
            answered = members.broadcast(
                "release",
                round_,
                faults.members("drop", DMMStage.RELEASE),
                faults.members("late", DMMStage.RELEASE),
                faults.members("tamper", DMMStage.RELEASE),
                faults.seed,
                t,
            )
            sent = sorted(j for part in answered for j in part["members"])
            late = {j for part in answered for j in part["late"]}
            rows = {
                j: row
                for part in answered
                for j, row in zip(part["members"], part["rows"])
                if j not in late
            }
            answering, stacked = self._open_release(rows, transcript, round_)
        else:
            sent = [j for j in live if j not in faults.dropped_by(DMMStage.RELEASE)]
            late = faults.members("late", DMMStage.RELEASE)
            answering = [j for j in sent if j not in late]
        if len(answering) < need:
            self.holders = tuple(sent)
            raise self._abort(
                RoundAborted(
                    f"step {t}: {len(answering)} members released, t + k = {need} needed; "
                    "nothing released, the state is kept",
                    DMMStage.RELEASE,
                    need,
                    len(answering),
                )
            )
        if members is not None:
            opened, faulty = self._reconstruct(stacked, answering, t)
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
            if members is not None:
                attempts = self._reshare_full(t, live, faulty, faults, round_, transcript)
            else:
                attempts = self._reshare_ideal(t, state, live, faulty, faults)
            self.last_output.reshare_attempts = attempts
        except (ReshareAbort, ReshareTampering):
            self.stage = DMMStage.ABORTED
            self.plain_state, self.held_rows, self.holders = {}, (), ()
            for pool in self.pools:
                pool.broadcast("reset")
            raise
        self._enter(DMMStage.DONE)
        return self.last_output

    def _reshare_ideal(self, t, state, live, faulty, faults) -> int:
        """Ideal mode: the same agreement rules, no shares."""
        n, need = self.scheme.n, self.scheme.threshold
        keep = [int(r) for r in self.noising.needed_after(t)]
        dealers = [
            j for j in live if j not in faults.dropped_by(DMMStage.RESHARE) and j not in faulty
        ]
        holders = [j for j in range(n) if j not in faults.next_drop]
        if keep and (len(dealers) < need or len(holders) < need):
            side, answered = ("old", len(dealers)) if len(dealers) < need else ("new", len(holders))
            raise ReshareAbort(
                f"resharing of step {t}: {answered} {side} members, t + k = {need} needed",
                side,
                need,
                answered,
            )
        self.plain_state = {r: state[r] for r in keep}
        self.held_rows, self.holders = tuple(keep), tuple(holders)
        return 1 if keep else 0

    # ------------------------------------------------------------------ full-mode transport
    def _announce_round(self, members, faults, transcript, round_: int) -> dict[int, bytes]:
        """The holders that are online publish fresh channel keys; returns member -> key."""
        session = new_session_id() if self.encrypt else None
        keys = _merge(
            members.broadcast(
                "announce",
                list(self.holders),
                faults.members("drop", DMMStage.SHARE),
                session,
                MEMBER_ID_BASE,
                True,
                round_,
            )
        )
        if session is not None:
            self._session = session
            self._server = Endpoint(SERVER_ID, session)
            for j in sorted(keys):
                transcript.record(MEMBER_ID_BASE + j, SERVER_ID, DMMStage.SHARE, len(keys[j]) + 8)
                self._server.connect(MEMBER_ID_BASE + j, keys[j])
        return {int(j): keys[j] for j in sorted(keys)}

    def _relay_shares(self, sealed, senders, live, faults, transcript, rows_drawn) -> set[int]:
        """The server relays each sender's envelopes to the live members it can reach (it
        holds no key that opens them) and the members open their rows. Returns the clients
        some live member lacks or refused (unauthentic, misaddressed or malformed)."""
        n = self.scheme.n
        members = self.pools[0]
        relay = Relay(transcript) if self.encrypt else None
        deliveries: dict[int, dict[int, object]] = {i: {} for i in senders}
        client_keys: dict[int, bytes] = {}
        by_party: dict[int, int] = {}
        for i in senders:
            item = sealed[i]
            reach = [j for j in live if i not in faults.client_partial or j < n // 2]
            if relay is None:
                for j in reach:
                    row = item.shares.get(j)
                    if isinstance(row, np.ndarray):
                        transcript.record(
                            item.party, MEMBER_ID_BASE + j, DMMStage.SHARE, row.size * 8
                        )
                        deliveries[i][j] = row
                continue
            key = item.public_key
            if not isinstance(key, bytes) or len(key) != PUBLIC_KEY_BYTES:
                continue  # no channel can be opened: every member refuses this client
            transcript.record(item.party, SERVER_ID, DMMStage.SHARE, len(key) + 8)
            client_keys[item.party] = key
            by_party[item.party] = i
            for j in reach:
                envelope = item.shares.get(j)
                if (
                    not isinstance(envelope, Envelope)
                    or envelope.sender != item.party
                    or envelope.receiver != MEMBER_ID_BASE + j
                ):
                    continue  # misaddressed: the member receives nothing from this client
                if (i, j) in faults.corrupt_in_transit:
                    envelope = _flip(envelope, 0)
                relay.post(envelope)
        width = (1 + rows_drawn) * self.blocks
        if relay is not None:
            members.broadcast("connect", {SERVER_ID: self._server.public_key, **client_keys})
            for j in live:
                for envelope in relay.deliver(MEMBER_ID_BASE + j):
                    deliveries[by_party[envelope.sender]][j] = envelope
        parts = [
            {i: {j: rows[j] for j in group if j in rows} for i, rows in deliveries.items()}
            for group in members.groups
        ]
        answers = members.call("share", [(part, width) for part in parts])
        return {i for part in answers for i in part["refused"]}

    def _open_release(self, rows, transcript, round_: int) -> tuple[list[int], np.ndarray]:
        """The server opens the released rows (the relay counts them); a row that fails
        authentication is not counted as an answer."""
        f = self.scheme.field
        opened = {}
        for j, row in sorted(rows.items()):
            if isinstance(row, Envelope):
                transcript.record(row.sender, row.receiver, row.stage, row.nbytes)
                try:
                    opened[j] = f.asarray(
                        self._server.open_array(
                            row, round_=round_, stage=DMMStage.RELEASE, sender=MEMBER_ID_BASE + j
                        ),
                        "released share",
                    )
                except (ChannelError, ValueError):
                    continue
            else:
                transcript.record(MEMBER_ID_BASE + j, SERVER_ID, DMMStage.RELEASE, row.size * 8)
                opened[j] = row
        answering = sorted(opened)
        if not answering:
            return [], np.zeros((0, self.blocks), dtype=np.int64)
        return answering, np.stack([opened[j] for j in answering])

    def _reshare_full(self, t, live, faulty, faults, round_, transcript) -> int:
        """Hand the noise rows still needed to the next committee (the other pool) by linear
        packed resharing, run with its member-side pieces
        (:class:`protocols.resharing.OldMember`, :class:`~protocols.resharing.NewMember`) and
        the same announce / deal / accumulate / verify rules as
        :meth:`protocols.resharing.Resharing.run`; returns DEAL attempts."""
        old, new = self.pools
        scheme, f = self.scheme, self.scheme.field
        need = scheme.threshold
        keep = [int(r) for r in self.noising.needed_after(t)]
        session = new_session_id() if self.encrypt else None
        # ANNOUNCE
        asked = [j for j in live if j not in faulty]
        old_keys = _merge(
            old.broadcast(
                "announce",
                asked,
                faults.members("drop", DMMStage.RESHARE),
                session,
                OLD_ID_BASE,
                False,
                round_,
            )
        )
        new.broadcast("reset")
        new_keys = _merge(
            new.broadcast(
                "announce",
                list(range(scheme.n)),
                faults.next_drop,
                session,
                NEW_ID_BASE,
                True,
                round_,
            )
        )
        holders = sorted(new_keys)
        candidates = sorted(old_keys)
        if not keep:
            self._hand_over(keep, holders)
            return 0
        if len(holders) < need:
            raise ReshareAbort(
                f"resharing of round {round_}: {len(holders)} new members answered, "
                f"t + k = {need} needed; the old committee keeps its shares",
                "new",
                need,
                len(holders),
            )
        if session is not None:
            for party, keys in ((OLD_ID_BASE, old_keys), (NEW_ID_BASE, new_keys)):
                for j, key in sorted(keys.items()):
                    transcript.record(party + j, SERVER_ID, ReshareStage.ANNOUNCE, len(key) + 8)
            old.broadcast("connect", {NEW_ID_BASE + j: k for j, k in new_keys.items()})
            new.broadcast("connect", {OLD_ID_BASE + i: k for i, k in old_keys.items()})
        share_seed = None if self.rng is None else int(self.rng.integers(2**62))
        removed: list[int] = []
        attempts = 0
        while True:
            if len(candidates) < need:
                raise ReshareAbort(
                    f"resharing of round {round_}: {len(candidates)} old members can deal, "
                    f"t + k = {need} needed (removed after failing: {removed}); the old "
                    "committee keeps its shares",
                    "old",
                    need,
                    len(candidates),
                )
            # DEAL
            attempts += 1
            chosen = candidates[:need]
            lam = reshare_coefficients(scheme, chosen)
            size = len(keep) * self.blocks
            mix = f.random_secure(size) if self.rng is None else f.random(self.rng, size)
            columns = {i: (lam[:, chosen.index(i)] if i in chosen else None) for i in candidates}
            deals = _merge(
                old.call(
                    "deal",
                    [
                        (
                            round_,
                            keep,
                            {i: c for i, c in columns.items() if i in group},
                            mix,
                            holders,
                            faults.members("tamper", DMMStage.RESHARE),
                            faults.seed,
                            None if share_seed is None else share_seed + attempts,
                            t,
                        )
                        for group in old.groups
                    ],
                )
            )
            inbox: dict[int, dict[int, object]] = {j: {} for j in holders}
            for i, rows in deals.items():
                for j, item in zip(holders, rows):
                    if isinstance(item, Envelope):
                        transcript.record(item.sender, item.receiver, item.stage, item.nbytes)
                    else:
                        transcript.record(
                            OLD_ID_BASE + i, NEW_ID_BASE + j, ReshareStage.DEAL, item.size * 8
                        )
                    inbox[j][i] = item
            refused = set().union(*new.call("receive", [(d,) for d in self._per_group(new, inbox)]))
            failed = [i for i in candidates if i not in deals or i in refused]
            if failed:
                removed.extend(failed)
                candidates = [i for i in candidates if i not in failed]
                continue
            new.broadcast("accumulate", chosen)
            # VERIFY
            checks = parity_checks(scheme, candidates)
            if checks.shape[0] == 0:
                break
            check_rows = _merge(new.broadcast("check_shares", checks, candidates))
            checked = [j for j in holders if j in check_rows]
            if len(checked) < need:
                raise ReshareAbort(
                    f"resharing of round {round_}: {len(checked)} new members answered the "
                    f"check, t + k = {need} needed; the old committee keeps its shares",
                    "new",
                    need,
                    len(checked),
                )
            stacked = np.stack([check_rows[j] for j in checked])
            for j in checked:
                transcript.record(
                    NEW_ID_BASE + j, SERVER_ID, ReshareStage.VERIFY, stacked.shape[1] * 8
                )
            culprit = open_parity_checks(
                scheme, scheme, stacked, checked, candidates, checks, round_
            )
            if culprit is None:
                break
            removed.append(culprit)
            candidates = [i for i in candidates if i != culprit]
        self._hand_over(keep, holders)
        return attempts

    def _hand_over(self, keep, holders) -> None:
        """The next committee commits what it accumulated and becomes current; the old pool
        is wiped for the committee after it."""
        old, new = self.pools
        new.broadcast("commit", keep)
        old.broadcast("reset")
        self.pools = [new, old]
        self.held_rows, self.holders = tuple(keep), tuple(holders)

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
            self._discard_round()
            raise ReleaseTampering(
                f"step {t}: released shares of members {answering} are inconsistent and "
                f"cannot be corrected (suspects {list(suspects)}); nothing released, the state "
                "is kept",
                suspects,
            ) from error


def _flip(envelope: Envelope, position: int) -> Envelope:
    """``envelope`` with one ciphertext bit flipped (a relay altering a message in transit)."""
    body = bytearray(envelope.ciphertext)
    body[position] ^= 0x01
    return Envelope(
        envelope.sender,
        envelope.receiver,
        envelope.round,
        envelope.stage,
        envelope.nonce,
        bytes(body),
    )
