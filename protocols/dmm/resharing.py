"""Linear packed resharing: hand packed Shamir shares from one committee to the next.

The secure transfer between committees of the distributed matrix mechanism (Bienstock, Kumar &
Polychroniadou, ICML 2025; docs/dmm-design.md step 7: the partial sums of the data the committees
hold). The old committee (``old``: n members, threshold t, packing k) holds, per block b,
shares s_i[b] = f_b(x_i) of a polynomial of degree < t + k whose values at the k secret points
are the block's secrets. For any set S of t + k members, secret j is
sum_{i in S} lambda_{j,i} s_i[b] (Lagrange coefficients of S at secret point j;
:meth:`protocols.field.MersenneField.lagrange_coefficients`). Steps:

1. **ANNOUNCE**: the server lists the old members still alive (the candidate dealers) and the new
   members still alive; it picks S = the first t + k dealers. Fewer than t + k on either side ->
   :class:`ReshareAbort` naming the side, how many were needed and how many answered; nothing is
   lost: the old members still hold their shares.
2. **DEAL**: old member i in S packs the block (lambda_{0,i} s_i[b], .., lambda_{k-1,i} s_i[b])
   into a fresh packed sharing for the new committee (same k, the new committee's t', degree
   < t' + k) and sends new member j one field element per block, over an authenticated encrypted
   channel (:mod:`protocols.channels`). Every dealer (in S or not) also shares its *check value*
   c_i = sum_b r_b s_i[b] (r: a public random vector drawn by the server after the shares are
   fixed) in all k slots of one extra block.
3. **ACCUMULATE**: new member j sums what the dealers of S sent: by linearity it holds a share
   of a polynomial whose slot j is sum_{i in S} lambda_{j,i} s_i[b], i.e. the same secrets.
   A dealer that delivered nothing (dropped while dealing), or whose message fails authentication
   at some new member, is removed and the server restarts DEAL with the others (retries are
   counted and their traffic stays in the transcript).
4. **VERIFY**: with m dealers and m > t + k, the old shares must lie on one polynomial of degree
   < t + k, i.e. satisfy the m - t - k parity checks sum_i v_i x_i^a s_i = 0 of the generalised
   Reed-Solomon code (v_i = 1 / prod_{l != i} (x_i - x_l), a = 0..m-t-k-1). New members combine
   their check shares with these coefficients and send them to the server, which opens the
   syndromes c^(a) = sum_i v_i x_i^a c_i by decoding the new members' shares
   (:meth:`protocols.shamir.PackedShamir.decode`). All zero -> DONE. Otherwise the syndromes are
   those of the old members' errors alone, and syndrome decoding (a word with these syndromes,
   decoded by Berlekamp-Welch) names the wrong old members within the decoding's sound radius
   (at most min(floor((m-t-k)/2), m-t-k-t) of them, room being kept for t colluders); they are
   removed and DEAL restarts. Beyond it, or when the syndromes could not be verified (exactly
   t' + k new members answered), :class:`TamperingDetected` is raised naming nobody; new members
   whose check shares were wrong are named. With m = t + k nothing can be checked
   (``verified`` is False in the result).

Cost. Each dealer of S sends n_new elements per block of k secrets: n_new / k elements per
secret, a constant when k grows with n (naive resharing, k = 1, sends n_new per secret). The
check adds one block per dealer and m - t - k elements per new member, independent of the
number of secrets.

Scope. The check catches a held share that was altered (a faulty or tampering member's state);
a dealer that deals an inconsistent sharing on purpose needs verifiable secret sharing, which
this module does not implement. Privacy: any t' new members see uniformly random shares of each
dealer's block; the opened syndromes are 0 for honest members.

Randomness: sharing randomness and the check vector come from the OS (``secure=True``, the
default) or from a passed ``numpy.random.Generator`` (simulation, reproducible).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from enum import Enum
from typing import Any

import numpy as np

from protocols.channels import (
    SERVER_ID,
    ChannelError,
    Endpoint,
    Envelope,
    Relay,
    Transcript,
    new_session_id,
)
from protocols.dmm.parity import parity_checks, reshare_coefficients, verify_dealings
from protocols.dmm.rows import row_decoder
from protocols.kit import (
    NEW_ID_BASE,
    OLD_ID_BASE,
    TamperingDetected,
    TooManyDropoutsError,
    check_move,
)
from protocols.shamir import PackedShamir


class ReshareStage(Enum):
    """Stages of one resharing, in order; ABORTED is reachable from every live stage."""

    SETUP = 0
    ANNOUNCE = 1
    DEAL = 2
    ACCUMULATE = 3
    VERIFY = 4
    DONE = 5
    ABORTED = 6


TRANSITIONS: dict[ReshareStage, frozenset[ReshareStage]] = {
    ReshareStage.SETUP: frozenset({ReshareStage.ANNOUNCE, ReshareStage.ABORTED}),
    ReshareStage.ANNOUNCE: frozenset({ReshareStage.DEAL, ReshareStage.ABORTED}),
    ReshareStage.DEAL: frozenset({ReshareStage.ACCUMULATE, ReshareStage.ABORTED}),
    ReshareStage.ACCUMULATE: frozenset(
        {ReshareStage.VERIFY, ReshareStage.DEAL, ReshareStage.ABORTED}
    ),
    ReshareStage.VERIFY: frozenset({ReshareStage.DONE, ReshareStage.DEAL, ReshareStage.ABORTED}),
    ReshareStage.DONE: frozenset(),
    ReshareStage.ABORTED: frozenset(),
}
"""Allowed moves: forward, back to DEAL after removing a failed dealer, or to ABORTED."""


def check_transition(current: ReshareStage, target: ReshareStage, who: str) -> None:
    """Raise :class:`protocols.kit.StageError` unless ``current -> target`` is allowed."""
    check_move(TRANSITIONS, current, target, who)


class ReshareAbort(TooManyDropoutsError):
    """Fewer than t + k members on one side: ``side`` ('old' or 'new'), ``needed``, ``answered``."""

    def __init__(self, message: str, side: str, needed: int, answered: int) -> None:
        super().__init__(message)
        self.side = side
        self.needed = needed
        self.answered = answered


@dataclass(frozen=True)
class ReshareFaults:
    """Injected faults of one resharing (member indices of each committee).

    ``old_drop``: old members silent from ANNOUNCE on; ``old_drop_deal``: old members that are
    announced alive but never deliver their deal; ``new_drop``: new members that are gone (they
    receive and hold nothing); ``tamper``: old members whose held shares carry a non-zero offset
    (drawn from ``seed``) when they deal; ``corrupt_in_transit``: (old, new) pairs whose sealed
    deal the relay alters. Hostile parties, for protocol testing: ``rewrite_deal(old, new,
    row)`` returns what a hostile old member seals for a new member instead of its row (any
    array); ``rewrite_check(new, row)`` what a hostile new member sends the server in VERIFY;
    ``relay(envelope)`` the envelopes a hostile relay delivers in place of one (dropped,
    replayed, altered or invented).
    """

    old_drop: frozenset[int] = frozenset()
    old_drop_deal: frozenset[int] = frozenset()
    new_drop: frozenset[int] = frozenset()
    tamper: frozenset[int] = frozenset()
    corrupt_in_transit: frozenset[tuple[int, int]] = frozenset()
    seed: int = 0
    rewrite_deal: Callable[[int, int, np.ndarray], Any] | None = None
    rewrite_check: Callable[[int, np.ndarray], Any] | None = None
    relay: Callable[[Envelope], Sequence[Any]] | None = None


@dataclass
class ReshareResult:
    """The new committee's shares and what it cost.

    ``shares[j]``: new member j's shares, shape (blocks,); ``holders``: the new members holding
    them; ``dealers``: the t + k old members whose deals were summed; ``removed``: old members
    removed after failing (dropped while dealing, unauthenticated, or named by the check);
    ``attempts``: DEAL runs; ``verified``: whether the parity check ran; ``transcript``: bytes
    per (sender, receiver, stage), DEAL and VERIFY.
    """

    shares: dict[int, np.ndarray]
    holders: tuple[int, ...]
    dealers: tuple[int, ...]
    removed: tuple[int, ...]
    attempts: int
    verified: bool
    transcript: Transcript
    secrets: int = 0

    def bytes_per_secret(self) -> float:
        """Deal bytes of every dealer together, per shared secret."""
        return self.transcript.nbytes(stage=ReshareStage.DEAL) / max(self.secrets, 1)

    def bytes_per_dealer_per_secret(self) -> float:
        """Deal bytes one dealer sends, per shared secret (averaged over the dealers)."""
        return self.bytes_per_secret() / max(len(self.dealers), 1)


class ShareRandomness:
    """Where a dealer's sharing randomness comes from: its own generator ``rng`` (simulation)
    or the OS with ``secure`` (exactly one of them); share polynomials and field vectors are
    drawn from it."""

    def __init__(self, rng: np.random.Generator | None, secure: bool) -> None:
        if secure == (rng is not None):
            raise ValueError(
                "pass exactly one source of randomness: rng=numpy.random.Generator for "
                f"simulation or secure=True for OS randomness (got rng={rng!r}, secure={secure})"
            )
        self.rng, self.secure = rng, secure

    def share(self, scheme: PackedShamir, secrets: np.ndarray) -> np.ndarray:
        if self.secure:
            return scheme.share(secrets, secure=True)
        return scheme.share(secrets, rng=self.rng)

    def field_vector(self, scheme: PackedShamir, size: int) -> np.ndarray:
        if self.secure:
            return scheme.field.random_secure(size)
        return scheme.field.random(self.rng, size)


@dataclass(frozen=True, eq=False)
class OldMember:
    """Old member ``index`` holding its shares (blocks,) of the committee's state; ``endpoint``:
    its channel (None: none; held by reference, its nonce counters only move forward)."""

    index: int
    shares: np.ndarray
    endpoint: Endpoint | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "index", int(self.index))
        object.__setattr__(self, "shares", np.asarray(self.shares, dtype=np.int64))

    def deal(
        self,
        old: PackedShamir,
        new: PackedShamir,
        coefficients: np.ndarray | None,
        mix: np.ndarray,
        randomness: ShareRandomness,
    ) -> np.ndarray:
        """(n_new, blocks + 1): row j for new member j -- the packed sharing of this member's
        block scaled by ``coefficients`` (its column of the Lagrange matrix of S), then its share
        of the check value sum_b mix[b] s[b] held in all k slots; only the check column,
        (n_new, 1), when ``coefficients`` is None (a dealer outside S)."""
        f = old.field
        check_value = f.matmul(self.shares[None, :], mix[:, None]).ravel()[0]
        check = randomness.share(new, np.full(new.k, check_value, dtype=np.int64))
        if coefficients is None:  # not in S: only the check block travels
            return check
        scaled = f.mul(np.asarray(coefficients)[None, :], self.shares[:, None])  # (blocks, k)
        return np.hstack([randomness.share(new, scaled.ravel()), check])


@dataclass(frozen=True, eq=False)
class NewMember:
    """New member ``index`` as a value: the deals it ``received`` (dealer -> row) and the
    dealers it ``refused`` this DEAL; ``endpoint``: its channel (None: none; held by
    reference). Taking a deal returns the member that holds it; it sums those of S and
    combines check shares."""

    index: int
    endpoint: Endpoint | None = None
    received: Mapping[int, np.ndarray] = field(default_factory=dict)
    refused: frozenset[int] = frozenset()

    def __post_init__(self) -> None:
        object.__setattr__(self, "index", int(self.index))
        object.__setattr__(self, "refused", frozenset(self.refused))

    def reset(self) -> NewMember:
        """This member before a DEAL: nothing received, nobody refused."""
        return replace(self, received={}, refused=frozenset())

    def refusing(self, dealers) -> NewMember:
        """This member with ``dealers`` refused as well."""
        return replace(self, refused=self.refused | set(dealers))

    def take(self, field_, dealer: int, payload, width: int) -> NewMember:
        """This member keeping ``dealer``'s deal if it is ``width`` field elements and the first
        this DEAL (a second one replaces it and refuses the dealer); otherwise refusing the
        dealer."""
        try:
            row = field_.vector(payload, width, f"deal from old member {dealer}")
        except ValueError:
            return self.refusing({dealer})
        refused = self.refused | {dealer} if dealer in self.received else self.refused
        return replace(self, received={**self.received, dealer: row}, refused=refused)

    def receive(self, field_, envelope, round_: int, widths: Mapping[int, int]) -> NewMember:
        """DEAL handler: this member after opening a sealed deal from a dealer of this attempt
        (``widths``: dealer -> elements expected) and :meth:`take`-ing it; a deal that does not
        open (unauthenticated, replayed, misbound, not an array) refuses its dealer; envelopes
        that claim no current dealer as sender are dropped."""
        sender = getattr(envelope, "sender", None)
        if not isinstance(sender, int | np.integer) or sender - OLD_ID_BASE not in widths:
            return self
        dealer = int(sender) - OLD_ID_BASE
        try:
            payload = self.endpoint.open_array(
                envelope,
                round_=round_,
                stage=ReshareStage.DEAL,
                sender=int(sender),
                decode=row_decoder(widths[dealer]),
            )
        except ChannelError:
            return self.refusing({dealer})
        return self.take(field_, dealer, payload, widths[dealer])

    def accumulate(self, field_, dealers: Sequence[int]) -> np.ndarray:
        """Shares (blocks,) of the secrets: the sum of the main parts dealt by ``dealers``."""
        stacked = np.stack([self.received[i][:-1] for i in dealers])
        return field_.sum(stacked, axis=0)

    def check_shares(self, field_, checks: np.ndarray, members: Sequence[int]) -> np.ndarray:
        """Shares of the syndromes: sum_i checks[a, i] * (check share from members[i])."""
        column = np.array([self.received[i][-1] for i in members], dtype=np.int64)
        return field_.matmul(checks, column[:, None]).ravel()


class Resharing:
    """The server's side of one resharing from committee ``old`` to committee ``new``.

    ``old`` and ``new`` must use the same field and packing k (the block layout is kept); n and
    t may differ. ``encrypt`` sends every deal sealed (X25519/HKDF/ChaCha20-Poly1305 bound to
    (dealer, receiver, round, stage)) through a :class:`protocols.channels.Relay`; without it
    the transcript counts ``bytes_per_element`` per element sent. ``round_`` binds the messages.
    A resharing runs once: it ends in DONE, or in ABORTED with :class:`ReshareAbort`,
    :class:`TamperingDetected` or (bad arguments) ``ValueError``.
    """

    def __init__(
        self,
        old: PackedShamir,
        new: PackedShamir,
        *,
        round_: int = 0,
        encrypt: bool = True,
    ) -> None:
        if old.field != new.field:
            raise ValueError(f"old.field={old.field!r} and new.field={new.field!r} must agree")
        if old.k != new.k:
            raise ValueError(
                f"old.k={old.k} and new.k={new.k} must agree: resharing keeps the block layout"
            )
        self.old, self.new = old, new
        self.round = int(round_)
        self.encrypt = bool(encrypt)
        self.stage = ReshareStage.SETUP
        self.transcript = Transcript()
        self.relay: Relay | None = None

    def _enter(self, target: ReshareStage) -> None:
        check_transition(self.stage, target, f"resharing of round {self.round}")
        self.stage = target

    def _abort(self, error: Exception) -> Exception:
        self.stage = ReshareStage.ABORTED
        return error

    def run(
        self,
        old_shares: Mapping[int, np.ndarray],
        faults: ReshareFaults | None = None,
        *,
        rng: np.random.Generator | None = None,
        secure: bool = False,
    ) -> ReshareResult:
        """Reshare ``old_shares`` (old member -> shares (blocks,)) to the new committee."""
        try:
            return self._run(old_shares, faults or ReshareFaults(), ShareRandomness(rng, secure))
        except BaseException:
            if self.stage is not ReshareStage.DONE:
                self.stage = ReshareStage.ABORTED
            raise

    def _run(
        self,
        old_shares: Mapping[int, np.ndarray],
        faults: ReshareFaults,
        randomness: ShareRandomness,
    ) -> ReshareResult:
        old, new = self.old, self.new
        olds, blocks = self._old_members(old_shares, faults)
        news = {j: NewMember(j) for j in range(new.n)}
        self.relay = self._connect(olds, news)
        # ANNOUNCE
        self._enter(ReshareStage.ANNOUNCE)
        candidates = [i for i in olds if i not in faults.old_drop]
        holders = [j for j in news if j not in faults.new_drop]
        self._require("new", len(holders), [])
        removed: list[int] = []
        attempts = 0
        while True:
            self._require("old", len(candidates), removed)
            attempts += 1
            chosen = candidates[: old.threshold]
            failed = self._deal(olds, news, candidates, holders, blocks, faults, randomness)
            if failed:  # back to DEAL without them
                removed.extend(failed)
                candidates = [i for i in candidates if i not in failed]
                continue
            new_shares = {j: news[j].accumulate(new.field, chosen) for j in holders}
            self._enter(ReshareStage.VERIFY)
            if len(candidates) == old.threshold:  # no parity check exists
                verified = False
                break
            culprits, verified = self._verify(news, holders, candidates, faults)
            if not culprits:
                break
            removed.extend(culprits)
            candidates = [i for i in candidates if i not in culprits]
        self._enter(ReshareStage.DONE)
        return ReshareResult(
            shares=new_shares,
            holders=tuple(holders),
            dealers=tuple(chosen),
            removed=tuple(removed),
            attempts=attempts,
            verified=verified,
            transcript=self.transcript,
            secrets=blocks * old.k,
        )

    def _require(self, side: str, answered: int, removed: list[int]) -> None:
        scheme = self.old if side == "old" else self.new
        if answered >= scheme.threshold:
            return
        verb = "can deal" if side == "old" else "answered"
        after = f" (removed after failing: {removed})" if side == "old" else ""
        raise self._abort(
            ReshareAbort(
                f"resharing of round {self.round}: {answered} {side} members {verb}, t + k = "
                f"{scheme.threshold} needed{after}; the old committee keeps its shares",
                side,
                scheme.threshold,
                answered,
            )
        )

    def _old_members(
        self, old_shares: Mapping[int, np.ndarray], faults: ReshareFaults
    ) -> tuple[dict[int, OldMember], int]:
        """The old members holding ``old_shares`` (checked: members of ``old``, equal lengths,
        field elements), with the injected tampering applied; and the number of blocks."""
        f = self.old.field
        if not isinstance(old_shares, Mapping) or not old_shares:
            raise ValueError("old_shares must map old members to their shares; got none")
        rows = {}
        for i, shares in old_shares.items():
            if not isinstance(i, int | np.integer) or not 0 <= int(i) < self.old.n:
                raise ValueError(f"old_shares has member {i!r}; allowed: 0..{self.old.n - 1}")
            rows[int(i)] = f.asarray(shares, f"old_shares[{i}]").ravel()
        lengths = {row.size for row in rows.values()}
        if len(lengths) != 1:
            raise ValueError(f"old_shares rows have different lengths {sorted(lengths)}")
        blocks = lengths.pop()
        olds = {i: OldMember(i, rows[i]) for i in sorted(rows)}
        offsets = np.random.default_rng(faults.seed)
        for i in sorted(faults.tamper & set(olds)):
            delta = offsets.integers(1, f.modulus, size=blocks, dtype=np.int64)
            olds[i] = replace(olds[i], shares=f.add(olds[i].shares, delta))
        return olds, blocks

    def _connect(self, olds, news) -> Relay | None:
        """Without encryption None; else every member's endpoint (fresh keys, one session)
        published through a relay that counts into the transcript, old x new connected."""
        if not self.encrypt:
            return None
        relay = Relay(self.transcript)
        session = new_session_id()
        for i in list(olds):
            olds[i] = replace(olds[i], endpoint=Endpoint(OLD_ID_BASE + i, session))
        for j in list(news):
            news[j] = replace(news[j], endpoint=Endpoint(NEW_ID_BASE + j, session))
        for m in list(olds.values()) + list(news.values()):
            relay.publish(m.endpoint.party_id, m.endpoint.public_key, ReshareStage.ANNOUNCE)
        for o in olds.values():
            for n_ in news.values():
                o.endpoint.connect(n_.endpoint.party_id, n_.endpoint.public_key)
                n_.endpoint.connect(o.endpoint.party_id, o.endpoint.public_key)
        return relay

    def _deal(self, olds, news, candidates, holders, blocks, faults, randomness) -> list[int]:
        """DEAL and ACCUMULATE of one attempt; returns the dealers that failed (delivered
        nothing, or some holder refused or missed their deal)."""
        self._enter(ReshareStage.DEAL)
        old, new = self.old, self.new
        chosen = candidates[: old.threshold]
        lam = reshare_coefficients(old, chosen)
        mix = randomness.field_vector(old, blocks)
        for j in list(news):
            news[j] = news[j].reset()
        delivered = [i for i in candidates if i not in faults.old_drop_deal]
        widths = {i: (blocks + 1 if i in chosen else 1) for i in delivered}
        for i in delivered:
            column = lam[:, chosen.index(i)] if i in chosen else None
            rows = olds[i].deal(old, new, column, mix, randomness)
            for j in holders:
                news[j] = self._send(olds[i], news[j], rows[j], widths[i], faults)
        self._enter(ReshareStage.ACCUMULATE)
        for j in holders:
            member = news[j]
            if self.relay is not None:
                for envelope in self.relay.deliver(member.endpoint.party_id):
                    for arrived in faults.relay(envelope) if faults.relay else [envelope]:
                        member = member.receive(new.field, arrived, self.round, widths)
            member = member.refusing({i for i in delivered if i not in member.received})
            news[j] = member
        refused = set().union(*(news[j].refused for j in holders))
        return [i for i in candidates if i not in delivered or i in refused]

    def _verify(self, news, holders, candidates, faults) -> tuple[tuple[int, ...], bool]:
        """VERIFY: collect the holders' check shares (checked: one field element per parity
        check) and open them (:func:`verify_dealings`)."""
        f = self.old.field
        checks = parity_checks(self.old, candidates)
        rows = []
        for j in holders:
            row = news[j].check_shares(f, checks, candidates)
            if faults.rewrite_check is not None:
                row = faults.rewrite_check(j, row)
            try:
                rows.append(f.vector(row, checks.shape[0], f"check shares of new member {j}"))
            except ValueError as error:
                raise self._abort(TamperingDetected(str(error), (NEW_ID_BASE + j,))) from None
            self.transcript.record(
                NEW_ID_BASE + j, SERVER_ID, ReshareStage.VERIFY, row.size * f.bytes_per_element
            )
        try:
            return verify_dealings(
                self.old, self.new, np.stack(rows), holders, candidates, self.round
            )
        except TamperingDetected as error:
            raise self._abort(error) from error.__cause__

    def _send(self, sender, receiver, row, width: int, faults: ReshareFaults) -> NewMember:
        """One deal from ``sender`` to ``receiver``: handed over (plain: the receiver that took
        it is returned) or sealed and posted (the receiver returned as it was); a hostile
        dealer's payload that cannot even be sealed is never delivered."""
        if faults.rewrite_deal is not None:
            row = faults.rewrite_deal(sender.index, receiver.index, row)
        if self.relay is None:
            self.transcript.record(
                OLD_ID_BASE + sender.index,
                NEW_ID_BASE + receiver.index,
                ReshareStage.DEAL,
                np.size(row) * self.old.field.bytes_per_element,
            )
            return receiver.take(self.old.field, sender.index, row, width)
        try:
            envelope = sender.endpoint.seal_array(
                receiver.endpoint.party_id, self.round, ReshareStage.DEAL, row
            )
        except ValueError:
            return receiver
        if (sender.index, receiver.index) in faults.corrupt_in_transit:
            body = bytearray(envelope.ciphertext)
            body[len(body) // 2] ^= 0x01
            envelope = type(envelope)(
                envelope.sender,
                envelope.receiver,
                envelope.round,
                envelope.stage,
                envelope.nonce,
                bytes(body),
            )
        self.relay.post(envelope)
        return receiver


