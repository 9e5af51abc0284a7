"""Server side of a committee round: relay sealed shares, run the stages, decode the sum.

The server (:class:`CommitteeServer`) drives the members through one round of
:mod:`protocols.committee` (:meth:`CommitteeServer.run_round_sealed`):

1. **SHARE**: it checks each client's :class:`protocols.committee.common.SealedInput` (usable key,
   one envelope per member and none for anyone else, headers for this round and stage, ciphertexts
   of the right length) and relays member j's envelope to member j, who opens it;
2. **COMBINE**: the members agree (on the server's list) on the clients whose shares reached
   every live member, and each sums its rows of those clients locally: shares of sum_i x_i;
3. **RELEASE**: members seal their summed rows for the server, which decodes the sum.

Members are reached through a pool (:class:`protocols.kit.LocalMembers` in this process;
:mod:`fedsim.engine.committee_host` hosts them on Ray actors): ``groups`` (member indices per
shard) and ``call(call, args_per_shard)`` with a typed :class:`CommitteeCall`. Transport:
every share travels over an authenticated encrypted channel (:mod:`protocols.channels`:
X25519, HKDF, ChaCha20-Poly1305, bound to protocol, session, sender, receiver, round and
stage) relayed by the server, which counts bytes in a transcript: client -> member in SHARE,
member -> server in RELEASE.

Faults (:class:`protocols.committee.common.CommitteeFaults`) are drawn per member and per stage:
a member that **drops** at a stage is silent from then on; one that is **late** at a stage
answers after the deadline, so its share does not count this round (nothing sleeps); one that
**tampers** adds a random non-zero offset to what it holds or sends.

Replies are validated where they arrive. A client whose sealed input the server finds
malformed, or whose share a live member cannot open or finds malformed (e.g.
``corrupt_in_transit``, the relay flipping a byte), is left out of the sum
(:attr:`CommitteeResult.excluded`); a member whose release does not open or is malformed is
not counted as an answer (:attr:`CommitteeResult.rejected`); the reasons are in
:attr:`CommitteeResult.reasons`. Nothing a party sends raises out of the committee.

Outcomes. The server needs ``t + k + detect`` answers: ``t + k`` to reconstruct and ``detect``
more so that up to ``detect`` tampered shares are always caught. Fewer answers ->
:class:`protocols.committee.common.CommitteeAbort` (a :class:`protocols.kit.TooManyDropoutsError`)
naming how many were needed and how many answered. The quorum is checked on the members online
after COMBINE, before any member is asked to release, and again on the on-time envelopes at
RELEASE before the server opens any. **Opened is released**: once more than t members' rows
have reached the server (on time or late; it holds the key that opens them) the round is an
:class:`protocols.committee.common.OpenedRelease` in :attr:`CommitteeServer.opened`, and an abort
after that point carries it (``error.opened``) for the strategy to account. The answers are decoded
by Berlekamp-Welch (:meth:`protocols.shamir.PackedShamir.decode`): wrong shares are corrected and
their members named only within the sound radius
min(floor((m - t - k) / 2), m - t - k - max(t, detect)), so neither t colluding members nor
``detect`` tampered shares can choose the release or get an honest member blamed; beyond it
:class:`protocols.kit.TamperingDetected` is raised naming nobody and no sum is decoded
(the rows it holds still count as opened). With exactly t + k answers nothing can be checked:
the result says ``verified=False``. A round that fails is left ABORTED
(:meth:`CommitteeServer.stage`) on the server and in every shard, the exception names the
clients excluded before it (``excluded``), and earlier rounds' results stay in
:attr:`CommitteeServer.history`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any, Protocol

import numpy as np

from protocols.channels import NONCE_BYTES, PUBLIC_KEY_BYTES, SERVER_ID, Endpoint, Envelope, Relay
from protocols.committee.common import (
    CHANNEL_PROTOCOL,
    CommitteeAbort,
    CommitteeCall,
    CommitteeFaults,
    CommitteeKeys,
    CommitteeResult,
    CommitteeStage,
    OpenedRelease,
    ReleaseAnswer,
    SealedInput,
    ShardSealedShares,
    ShareAnswer,
    StageFaults,
    check_client_id,
    check_layout,
    check_transition,
    sealed_row_bytes,
)
from protocols.field import DEFAULT_FIELD, MersenneField
from protocols.kit import MEMBER_ID_BASE, TamperingDetected
from protocols.shamir import PackedShamir, UncorrectableSharesError


class CommitteeMembers(Protocol):
    """How the server reaches the members: ``groups[i]``, the member indices shard i holds
    (together 0..n-1, each once); ``call(call, args_per_shard)`` sends a typed
    :class:`CommitteeCall` to every shard (:meth:`protocols.committee.member.CommitteeShard.
    answer`) and returns the answers in shard order; ``close()`` forgets the members."""

    groups: list[list[int]]

    def call(self, call: CommitteeCall, args_per_shard: Sequence[tuple]) -> list[Any]: ...

    def close(self) -> None: ...


class CommitteeServer:
    """The server of a committee of ``n`` members with privacy threshold ``t`` and packing
    ``k``, reached through ``members`` (a :class:`CommitteeMembers` whose shards were built for
    ``session_id``).

    ``detect``: extra answers required beyond t + k, so that up to ``detect`` tampered shares
    are always caught (0 trusts every answer). Shares travel over authenticated encrypted
    channels through :attr:`relay`, whose transcript counts the bytes; the server's channel key
    comes from the OS CSPRNG. A committee is never pickled: its members' keys and shares are
    theirs.
    """

    def __init__(
        self,
        n: int,
        t: int,
        k: int = 1,
        *,
        members: CommitteeMembers,
        session_id: bytes,
        detect: int = 1,
        field_: MersenneField = DEFAULT_FIELD,
    ) -> None:
        groups = [[int(m) for m in g] for g in members.groups]
        check_layout(n, t, k, len(groups), detect)
        if sorted(m for g in groups for m in g) != list(range(n)):
            raise ValueError(
                f"members.groups={groups!r}; allowed: groups holding members 0..{n - 1} once each"
            )
        self.scheme = PackedShamir(n=n, t=t, k=k, field=field_)
        self.detect = detect
        self.groups = groups
        self.pool = members
        self.session_id = session_id
        self.history: dict[int, CommitteeResult] = {}
        #: every round whose sum the server holds enough to determine, completed or aborted
        self.opened: dict[int, OpenedRelease] = {}
        self.stages: dict[int, CommitteeStage] = {}
        self.relay = Relay()
        self.member_keys: dict[int, bytes] = {}
        self._server = Endpoint(SERVER_ID, self.session_id, CHANNEL_PROTOCOL)
        for part in self.pool.call(CommitteeCall.PUBLIC_KEYS, [() for _ in self.groups]):
            self.member_keys.update(part)
        #: each enrolled member's proof of its key, relayed to the clients with it
        self.member_proofs: dict[int, bytes] = {}
        for part in self.pool.call(CommitteeCall.KEY_PROOFS, [() for _ in self.groups]):
            self.member_proofs.update(part)
        for member, key in sorted(self.member_keys.items()):
            self.relay.publish(MEMBER_ID_BASE + member, key)
            self._server.connect(MEMBER_ID_BASE + member, key)
        server_key = (SERVER_ID, self._server.public_key)
        self.pool.call(CommitteeCall.CONNECT, [server_key for _ in self.groups])

    def __reduce__(self):
        raise TypeError("a Committee is never pickled: its members' keys and shares are theirs")

    @property
    def needed(self) -> int:
        """Answers the server needs: t + k + detect."""
        return self.scheme.threshold + self.detect

    def stage(self, round_: int) -> CommitteeStage:
        """Where round ``round_`` stands: SETUP before it runs, DONE or ABORTED after."""
        return self.stages.get(round_, CommitteeStage.SETUP)

    def keys_for(self, round_: int) -> CommitteeKeys:
        """What the clients of ``round_`` need to share with this committee (all public)."""
        return CommitteeKeys(
            round=int(round_),
            n=self.scheme.n,
            t=self.scheme.t,
            k=self.scheme.k,
            field_exponent=self.scheme.field.exponent,
            session_id=self.session_id,
            member_keys=tuple(self.member_keys[m] for m in range(self.scheme.n)),
            member_proofs=tuple(self.member_proofs[m] for m in range(self.scheme.n))
            if len(self.member_proofs) == self.scheme.n
            else (),
        )

    def _advance(self, round_: int, target: CommitteeStage) -> None:
        check_transition(self.stage(round_), target, f"committee round {round_}")
        self.stages[round_] = target

    def close(self) -> None:
        """Forget the members (on Ray, their actors are killed)."""
        self.pool.close()

    def run_round_sealed(
        self,
        round_: int,
        sealed: Mapping[int, SealedInput],
        length: int,
        faults: CommitteeFaults | None = None,
    ) -> CommitteeResult:
        """Run round ``round_`` on the clients' sealed inputs (client channel id ->
        :class:`~protocols.committee.common.SealedInput`, made by
        :func:`protocols.committee.client.seal_input` against :meth:`keys_for`) of ``length`` field
        elements each: relay each member's envelopes, combine, release, decode
        sum_i x_i mod p. A malformed sealed input excludes its client with a reason. Each round
        number runs once; a failed round is left ABORTED. Raises :class:`CommitteeAbort` or
        :class:`TamperingDetected` (each with ``excluded``, client -> reason)."""
        if isinstance(round_, bool) or not isinstance(round_, int | np.integer):
            raise ValueError(f"round_={round_!r} must be an integer in [0, 2^63)")
        if not 0 <= round_ < 2**63:
            raise ValueError(f"round_={round_!r} must be an integer in [0, 2^63)")
        if isinstance(length, bool) or not isinstance(length, int | np.integer) or length < 1:
            raise ValueError(f"length={length!r} must be a positive integer")
        if round_ in self.stages:
            raise ValueError(
                f"round {round_} was already run (it is {self.stages[round_].name}); each "
                "round number runs once"
            )
        if not isinstance(sealed, Mapping) or not sealed:
            raise ValueError("sealed is empty: no client to aggregate")
        for client in sealed:
            check_client_id(client)
        self.stages[round_] = CommitteeStage.SETUP
        excluded: dict[int, str] = {}
        try:
            result = self._run_round(
                int(round_), sealed, int(length), faults or CommitteeFaults(), excluded
            )
        except BaseException as error:
            self.stages[round_] = CommitteeStage.ABORTED
            self.pool.call(CommitteeCall.ABORT, [(round_,) for _ in self.groups])
            if round_ in self.opened:  # the rows reached the server before the abort
                opened = dataclasses.replace(self.opened[round_], outcome=str(error)[:500])
                self.opened[round_] = opened
            if isinstance(error, CommitteeAbort | TamperingDetected):
                error.excluded = dict(excluded)
                error.opened = self.opened.get(round_)
            raise
        self.history[round_] = result
        return result

    def _run_round(self, round_, sealed, length, faults, excluded) -> CommitteeResult:
        """One round, one handler per stage: SHARE (relay, open), COMBINE, RELEASE (decode)."""
        parts, width = self._relay_shares(round_, sealed, length, faults, excluded)
        if not parts[0]:
            reasons = "; ".join(f"client {c}: {r}" for c, r in sorted(excluded.items()))
            raise CommitteeAbort(
                f"round {round_}: no usable client input: {reasons[:500]}", needed=1, answered=0
            )
        clients, late = self._share(round_, parts, width, faults.at(CommitteeStage.SHARE), excluded)
        combine = faults.at(CommitteeStage.COMBINE)
        late |= combine.late
        self._combine(round_, clients, combine, late)
        return self._release(
            round_, clients, length, late, faults.at(CommitteeStage.RELEASE), excluded
        )

    def _share(
        self,
        round_: int,
        parts: list[dict[int, ShardSealedShares]],
        width: int,
        faults: StageFaults,
        excluded: dict[int, str],
    ) -> tuple[tuple[int, ...], set[int]]:
        """SHARE at the members: each shard opens its envelopes. Returns the clients whose
        shares reached every member that is online and on time (the others are ``excluded``)
        and the members late at SHARE; aborts when too few members are online."""
        self._advance(round_, CommitteeStage.SHARE)
        answers = self.pool.call(
            CommitteeCall.SHARE, [(round_, part, faults, width) for part in parts]
        )
        late = set(faults.late)
        shares_answered = [ShareAnswer.from_record(part) for part in answers]
        online = sorted(m for part in shares_answered for m in part.online if m not in late)
        self._require(len(online), CommitteeStage.SHARE, round_)
        refusals: dict[int, set[int]] = {}
        for part in shares_answered:
            for client, who in part.refused.items():
                refusals.setdefault(client, set()).update(who)
        for client, who in refusals.items():
            if who - late:
                excluded[client] = f"members {sorted(who)} refused its share"
        return tuple(sorted(set(parts[0]) - set(excluded))), late

    def _combine(
        self, round_: int, clients: tuple[int, ...], faults: StageFaults, late: set[int]
    ) -> None:
        """COMBINE: every shard sums its members' rows of ``clients``; aborts, before any
        member is asked to release, when too few are online and on time."""
        self._advance(round_, CommitteeStage.COMBINE)
        answers = self.pool.call(
            CommitteeCall.COMBINE, [(round_, list(clients), faults) for _ in self.groups]
        )
        online: set[int] = set()
        for group, part in zip(self.groups, answers):
            if isinstance(part, list | tuple):  # a malformed answer: its members are offline
                online |= {int(m) for m in part if isinstance(m, int | np.integer) and m in group}
        self._require(len(online - late), CommitteeStage.COMBINE, round_)

    def _release(
        self,
        round_: int,
        clients: tuple[int, ...],
        length: int,
        late: set[int],
        faults: StageFaults,
        excluded: dict[int, str],
    ) -> CommitteeResult:
        """RELEASE: the members seal their summed rows; once more than t of them reach the
        server the round is an :class:`OpenedRelease` (:attr:`opened`), whatever follows. The
        server checks the quorum on the on-time envelopes before opening any (adding the late
        members to ``late``), then opens them and decodes the sum; aborts when too few
        answered."""
        self._advance(round_, CommitteeStage.RELEASE)
        released = self.pool.call(CommitteeCall.RELEASE, [(round_, faults) for _ in self.groups])
        reasons = [f"client {c}: {r}" for c, r in sorted(excluded.items())]
        arrived, on_time, rejected = self._arrivals(round_, released, late, reasons)
        self._note_opened(round_, clients, arrived)
        self._require(len(on_time), CommitteeStage.RELEASE, round_)  # nothing opened yet
        members, rows, unopened = self._open_release(round_, on_time, length, reasons)
        rejected += unopened
        self._require(len(members), CommitteeStage.RELEASE, round_)
        aggregate, tampered = self._reconstruct(np.stack(rows), members, length, round_)
        self._advance(round_, CommitteeStage.DONE)
        dropped = set(range(self.scheme.n)) - set(members) - late - set(rejected)
        return CommitteeResult(
            round_,
            aggregate,
            clients,
            tuple(m for m in members if m not in tampered),
            tuple(sorted(late)),
            tuple(sorted(dropped)),
            tampered,
            tuple(sorted(excluded)),
            tuple(sorted(rejected)),
            verified=len(members) > self.scheme.threshold,
            reasons=tuple(reasons),
        )

    def _relay_shares(
        self,
        round_: int,
        sealed: Mapping[int, Any],
        length: int,
        faults: CommitteeFaults,
        excluded: dict[int, str],
    ) -> tuple[list[dict[int, ShardSealedShares]], int]:
        """SHARE at the server: check each client's sealed input (excluding it, with the
        reason, when malformed), relay the envelopes (counted; those in
        ``faults.corrupt_in_transit`` altered on the way) and group them per shard. Returns
        each shard's deliveries and the field elements per share row."""
        width = self.scheme.blocks_for(length)
        size = sealed_row_bytes(width)
        accepted = {}
        for client, delivery in sealed.items():
            problem = self._sealed_problem(round_, int(client), delivery, size)
            if problem is None:
                accepted[int(client)] = delivery
            else:
                excluded[int(client)] = problem
        for client, delivery in accepted.items():
            for member in range(self.scheme.n):
                envelope = delivery.envelopes[member]
                if (client, member) in faults.corrupt_in_transit:
                    flipped = bytes([envelope.ciphertext[0] ^ 1]) + envelope.ciphertext[1:]
                    envelope = dataclasses.replace(envelope, ciphertext=flipped)
                self.relay.post(envelope)
        inbox = {
            member: {e.sender: e for e in self.relay.deliver(MEMBER_ID_BASE + member)}
            for member in range(self.scheme.n)
        }
        parts = [
            {
                client: ShardSealedShares(
                    delivery.public_key, tuple(inbox[m][client] for m in group), width
                )
                for client, delivery in accepted.items()
            }
            for group in self.groups
        ]
        return parts, width

    def _sealed_problem(self, round_: int, client: int, delivery: Any, size: int) -> str | None:
        """Why a client's sealed input is no SHARE message of this round (None if its form is
        right): a public key of 32 bytes, exactly one envelope per member, each from the
        client to that member for this round and stage SHARE, with a nonce and ``size``
        ciphertext bytes. Whether it opens is for its member to find."""
        if not isinstance(delivery, SealedInput):
            return f"its input is a {type(delivery).__name__}, not a SealedInput"
        key, envelopes = delivery.public_key, delivery.envelopes
        if not isinstance(key, bytes) or len(key) != PUBLIC_KEY_BYTES:
            return f"its public key is not {PUBLIC_KEY_BYTES} bytes"
        if not isinstance(envelopes, Mapping):
            return "its envelopes are not a mapping member -> envelope"
        members = range(self.scheme.n)
        strangers = [j for j in envelopes if j not in members]
        if strangers:
            return f"envelopes for non-members {strangers[:5]}"
        missing = [j for j in members if j not in envelopes]
        if missing:
            return f"no envelope for members {missing[:5]}"
        for j in members:
            envelope = envelopes[j]
            if not isinstance(envelope, Envelope):
                return f"its envelope for member {j} is a {type(envelope).__name__}"
            header = (envelope.sender, envelope.receiver, envelope.round, envelope.stage)
            expected = (client, MEMBER_ID_BASE + j, round_, CommitteeStage.SHARE.name)
            if header != expected:
                return (
                    f"its envelope for member {j} has header (sender, receiver, round, stage) "
                    f"= {header!r}; expected {expected!r}"
                )
            nonce, body = envelope.nonce, envelope.ciphertext
            if not isinstance(nonce, bytes) or len(nonce) != NONCE_BYTES:
                return f"its envelope for member {j} has no {NONCE_BYTES}-byte nonce"
            if not isinstance(body, bytes) or len(body) != size:
                got = len(body) if isinstance(body, bytes) else type(body).__name__
                return f"its envelope for member {j} holds {got} ciphertext bytes, {size} expected"
        return None

    def _arrivals(
        self, round_: int, released: list[Any], late: set[int], reasons: list[str]
    ) -> tuple[set[int], list[tuple[int, Envelope]], list[int]]:
        """RELEASE at the server, before anything is opened: the members whose rows reached it
        (on time or late, whatever their form), the on-time envelopes that claim to be a
        member's release of this round for the server, and the on-time members whose reply is
        no such envelope (rejected, with the reason in ``reasons``). Adds the members that
        answered late to ``late``."""
        arrived: set[int] = set()
        on_time: list[tuple[int, Envelope]] = []
        rejected: list[int] = []
        for group, part in zip(self.groups, released):
            try:
                answer = ReleaseAnswer.from_record(part)
                pairs = list(zip(answer.members, answer.rows, strict=True))
                late |= {int(m) for m in answer.late if m in group}
            except (TypeError, KeyError, ValueError):
                reasons.append(f"members {group}: malformed release reply")
                continue
            for member, row in pairs:
                if not isinstance(member, int | np.integer) or member not in group:
                    continue
                if int(member) in arrived:
                    continue
                arrived.add(int(member))
                if member in late:
                    continue
                problem = _release_problem(round_, int(member), row)
                if problem is None:
                    self.relay.post(row)  # counted
                    on_time.append((int(member), row))
                else:
                    rejected.append(int(member))
                    reasons.append(f"member {member}: {problem}")
        self.relay.deliver(SERVER_ID)  # the server holds them all now, opened or not
        return arrived, on_time, rejected

    def _note_opened(self, round_: int, clients: tuple[int, ...], arrived: set[int]) -> None:
        """Record round ``round_`` as opened when more than t members' rows reached the server
        (:class:`OpenedRelease`)."""
        if len(arrived) > self.scheme.t:
            self.opened[round_] = OpenedRelease(round_, clients, tuple(sorted(arrived)))

    def _open_release(
        self, round_: int, on_time: list[tuple[int, Envelope]], length: int, reasons: list[str]
    ) -> tuple[list[int], list[np.ndarray], list[int]]:
        """Each on-time member's row, opened and checked (blocks field elements); a row that
        does not open or is malformed rejects its member."""
        width = self.scheme.blocks_for(length)
        members, rows, rejected = [], [], []
        for member, row in on_time:
            try:
                rows.append(self._open_row(round_, member, row, width))
                members.append(member)
            except ValueError as error:  # ChannelError is a ValueError
                rejected.append(member)
                reasons.append(f"member {member}: {error}")
        return members, rows, rejected

    def _open_row(self, round_: int, member: int, row: Envelope, width: int) -> np.ndarray:
        opened = self._server.open_array(
            row, round_=round_, stage=CommitteeStage.RELEASE, sender=MEMBER_ID_BASE + member
        )
        return self.scheme.field.vector(opened, width, f"release of member {member}")

    def _require(self, answered: int, stage: CommitteeStage, round_: int) -> None:
        if answered < self.needed:
            raise CommitteeAbort(
                f"round {round_} aborted in {stage.name}: {self.needed} committee members needed "
                f"(t + k = {self.scheme.threshold} to reconstruct, + detect = {self.detect}), "
                f"{answered} answered in time; earlier rounds are unaffected",
                needed=self.needed,
                answered=answered,
            )

    def _reconstruct(
        self, rows: np.ndarray, members: list[int], length: int, round_: int
    ) -> tuple[np.ndarray, tuple[int, ...]]:
        """The sum and the members whose shares were corrected, decoded leaving room for
        max(t, detect) faulty members (:meth:`protocols.shamir.PackedShamir.decode`)."""
        bound = max(self.scheme.t, self.detect)
        try:
            decoding = self.scheme.decode(rows, members, length, max_faulty=bound)
        except UncorrectableSharesError as error:
            raise TamperingDetected(
                f"round {round_}: released shares of members {members} are inconsistent in "
                f"{error.blocks.size} blocks and the tampering members cannot be singled out "
                f"leaving room for {bound} faulty members; nothing was released",
                blocks=error.blocks,
            ) from error
        return decoding.values, decoding.corrected


def _release_problem(round_: int, member: int, row: Any) -> str | None:
    """Why ``row`` is no sealed release of ``member`` for the server in ``round_`` (None if its
    form is right; whether it opens is checked only after the quorum)."""
    if not isinstance(row, Envelope):
        return f"its release is a {type(row).__name__}, not an Envelope"
    header = (row.sender, row.receiver, row.round, row.stage)
    expected = (MEMBER_ID_BASE + member, SERVER_ID, round_, CommitteeStage.RELEASE.name)
    if header != expected:
        return f"its release has header {header!r}; expected {expected!r}"
    if not isinstance(row.nonce, bytes) or not isinstance(row.ciphertext, bytes):
        return "its release has no nonce and ciphertext bytes"
    return None
