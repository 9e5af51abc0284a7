"""Server side of DMM: orchestrate a round, relay ciphertexts, decode the release.

docs/dmm-design.md, steps 3-9. The server of round t (:class:`DMMServer`)

1. SHARE: asks the committee holding the state (a :class:`protocols.dmm.member.MemberPool`, or
   the engine's actor-hosted pool) for fresh channel keys and hands the clients the public
   :class:`protocols.dmm.common.RoundKeys` (:meth:`DMMServer.open_round`); it then validates every
   client's :class:`protocols.dmm.common.DMMSealedShares` (type, party, public key usable, exactly
   the announced seats, envelope headers, nonce and ciphertext lengths) -- a bad one is *rejected*
   with its reason and the round goes on -- and relays the envelopes, which it cannot open;
2. agrees with the members on the clients whose shares every live member opened;
3. COMBINE / RELEASE: collects the sealed release shares of the rows of M released at t,
   validates them, and decodes with :meth:`protocols.shamir.PackedShamir.decode` (corrects at
   most floor((m - t - k) / 2) wrong shares among m, names members only when the decoding is
   unique, reports ``verified = False`` when m = t + k; beyond the radius no release is
   decoded and nobody is named: :class:`protocols.kit.TamperingDetected`). **Opened is
   released**: the quorum (t + k on-time shares) is checked before any share is opened, and
   once more than t members' shares have reached the server (on time or late: it holds the
   key that opens them) the step is an :class:`protocols.dmm.common.OpenedRelease`
   (:attr:`DMMServer.opened`), carried by an abort after that point (``error.opened``) for the
   strategy to account; such a step is never run again (:meth:`DMMServer.open_round`
   refuses it), so its state is not released a second time with fresh noise;
4. RESHARE: runs the linear packed resharing of the open rows' partial sums from the old to the
   next committee (announce / deal / accumulate / verify of :mod:`protocols.dmm.resharing`); if it
   fails the release stands and the old committee keeps the state. A dealing is checked only
   when more than t + k members deal (m - t - k parity checks), so the server needs
   t + k + ``reshare_checks`` dealers (default 1: a wrong dealing is always caught) and
   otherwise keeps the state with the old committee; with ``reshare_checks = 0`` a dealing by
   exactly t + k goes through unchecked and every later release of the rows it carried is
   reported ``verified = False`` (:attr:`DMMServer.unverified_rows`);
5. decodes x_hat_t = (D y)_t with D M = I (:class:`ReleaseDecoder`): post-processing.

``mode="ideal"`` (:meth:`DMMServer.run_plain_round`) is the no-cryptography reference: the
clients' plaintext integers, the same agreement, dropout and abort rules, and bit-identical
releases. COMBINE and RELEASE are :mod:`protocols.dmm.release`'s (:class:`ReleaseSteps`),
RESHARE :mod:`protocols.dmm.handoff`'s (:class:`HandoffSteps`), ideal mode
:mod:`protocols.dmm.ideal`'s (:class:`IdealRound`). Nothing here draws randomness except the
public resharing check vector and session ids (OS CSPRNG).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np

from protocols.channels import (
    NONCE_BYTES,
    PUBLIC_KEY_BYTES,
    SERVER_ID,
    TAG_BYTES,
    ChannelError,
    Endpoint,
    Envelope,
    Relay,
    Transcript,
    new_session_id,
    stage_label,
)
from protocols.dmm.common import (
    CLIENT_ID_LIMIT,
    FOLD_PAD,
    PAD_SEED_BYTES,
    PROTOCOL,
    DMMAbort,
    DMMFaults,
    DMMSealedShares,
    DMMStage,
    FoldedClient,
    MemberCall,
    OpenedRelease,
    RoundKeys,
    Schedule,
    StateLost,
    check_transition,
)
from protocols.dmm.handoff import HandoffSteps, answer_union, key_proofs
from protocols.dmm.ideal import IdealRound
from protocols.dmm.release import ReleaseDecoder, ReleaseSteps, RoundOutput, ciphertext_bytes
from protocols.field import DEFAULT_FIELD
from protocols.kit import SEAT_ID_BASE, Fault, TamperingDetected
from protocols.shamir import PackedShamir


@dataclass
class _Round:
    """The open round's bookkeeping (full mode)."""

    keys: RoundKeys
    faults: DMMFaults
    transcript: Transcript
    rejected_members: dict[int, str]
    holders: tuple[int, ...]


def _weights(weights, sealed) -> dict:
    """client -> clients folded in its message (default 1), each an integer >= 1."""
    out = {c: 1 for c in sealed}
    for c, w in dict(weights or {}).items():
        if isinstance(w, bool) or not isinstance(w, int | np.integer) or w < 1:
            raise ValueError(f"weights[{c!r}]={w!r}; allowed: an integer >= 1")
        if c not in out:
            raise ValueError(f"weights[{c!r}] names no message in sealed")
        out[c] = int(w)
    return out


class DMMServer(ReleaseSteps, HandoffSteps, IdealRound):
    """The server's driver of DMM rounds over the public integer ``schedule``.

    ``scheme``: (n, t, k) and field of every committee; ``dim``: D; ``mode``: 'full' (members
    hold shares; call :meth:`attach`, :meth:`open_round`, :meth:`finish_round`) or 'ideal'
    (:meth:`run_plain_round`); ``encrypt``: seal everything in full mode; ``min_clients``: fewest
    agreed clients a release may carry; ``decoding``: see :class:`ReleaseDecoder`;
    ``reshare_checks``: parity checks a handoff needs (dealers beyond t + k; module docstring).
    """

    def __init__(
        self,
        scheme: PackedShamir,
        schedule: Schedule,
        dim: int,
        *,
        mode: str = "full",
        encrypt: bool = True,
        min_clients: int = 1,
        decoding: np.ndarray | None = None,
        reshare_checks: int = 1,
    ) -> None:
        if mode not in ("full", "ideal"):
            raise ValueError(f"mode={mode!r}; allowed: 'full', 'ideal'")
        if not isinstance(dim, int | np.integer) or dim < 1:
            raise ValueError(f"dim={dim!r}; allowed: a positive integer")
        if scheme.field != DEFAULT_FIELD and scheme.field.exponent < 31:
            raise ValueError(f"scheme.field={scheme.field!r} is too small for DMM sums")
        if not isinstance(min_clients, int | np.integer) or min_clients < 1:
            raise ValueError(f"min_clients={min_clients!r}; allowed: an integer >= 1")
        if (
            isinstance(reshare_checks, bool)
            or not isinstance(reshare_checks, int | np.integer)
            or not 0 <= reshare_checks <= scheme.n - scheme.threshold
        ):
            raise ValueError(
                f"reshare_checks={reshare_checks!r}; allowed: an integer in [0, n - t - k = "
                f"{scheme.n - scheme.threshold}]"
            )
        self.reshare_checks = int(reshare_checks)
        #: rows whose partial sums went through a handoff nobody could check
        self.unverified_rows: set[int] = set()
        self.scheme, self.schedule, self.dim, self.mode = scheme, schedule, int(dim), mode
        self.encrypt = bool(encrypt)
        self.min_clients = int(min_clients)
        self.blocks = scheme.blocks_for(self.dim)
        self.decoder = ReleaseDecoder(schedule, decoding)
        self.step = 0
        self.stage = DMMStage.SETUP
        self.holders: tuple[int, ...] = tuple(range(scheme.n))
        self.counts: dict[int, int] = {}
        self.plain_state: dict[int, np.ndarray] = {}
        self.pool = None
        self.last_output: RoundOutput | None = None
        #: every step whose release the server holds enough to determine, completed or aborted
        self.opened: dict[int, OpenedRelease] = {}
        self._open: _Round | None = None
        self._server: Endpoint | None = None

    def __getstate__(self) -> dict:
        """Checkpoints keep the public state (step, holders, counts, decoder); never a pool
        (the members' shares are theirs) nor a round's channel keys."""
        state = dict(self.__dict__)
        state.update(pool=None, _open=None, _server=None)
        return state

    def __setstate__(self, state: dict) -> None:
        """A checkpoint written before :attr:`opened` and the handoff checks existed loads
        with none opened, none unverified and the default check."""
        self.__dict__.update({"opened": {}, "unverified_rows": set(), "reshare_checks": 1})
        self.__dict__.update(state)

    @property
    def member_kwargs(self) -> dict[str, object]:
        """What a :class:`protocols.dmm.member.MemberGroup` of this run is built with."""
        return {
            "n": self.scheme.n,
            "t": self.scheme.t,
            "k": self.scheme.k,
            "field_exponent": self.scheme.field.exponent,
            "dim": self.dim,
            "matrix": self.schedule.matrix,
            "min_clients": self.min_clients,
        }

    def attach(self, pool, holders=None) -> None:
        """Full mode: ``pool`` is the committee holding the state of :attr:`step` (its
        ``holders`` seats; all seats for a fresh committee)."""
        if self.mode != "full":
            raise ValueError("mode='ideal' has no committee pools")
        self.pool = pool
        if holders is not None:
            self.holders = tuple(int(s) for s in holders)

    # ------------------------------------------------------------------ helpers
    def _enter(self, target: DMMStage) -> None:
        check_transition(self.stage, target, f"DMM round (step {self.step})")
        self.stage = target

    def _abort(self, error: DMMAbort | TamperingDetected):
        self.stage = DMMStage.ABORTED
        step = self.step
        if step in self.opened:  # the release shares reached the server before the abort
            record = self.opened[step]
            error.args = (
                f"{error}; but the release shares of {len(record.members)} members (more than "
                f"t = {self.scheme.t}) reached the server: step {step} counts as released",
            )
            self.opened[step] = dataclasses.replace(record, outcome=str(error)[:500])
            error.opened = self.opened[step]
        if self.pool is not None:
            self.pool.broadcast(MemberCall.DISCARD)
        return error

    def _check_step(self) -> int:
        if self.step >= self.schedule.rounds:
            raise ValueError(f"step {self.step} is past M's {self.schedule.rounds} rounds")
        if self.step in self.opened:
            raise ValueError(
                f"step {self.step}'s release was opened in an aborted round "
                f"({self.opened[self.step].outcome}); its state is not released again with "
                "fresh noise"
            )
        return self.step

    def _note_opened(self, t: int, arrived, carried: int) -> None:
        """Record step ``t`` as opened when more than t members' shares reached the server."""
        if len(set(arrived)) > self.scheme.t:
            rows = tuple(int(i) for i in self.schedule.released_at(t))
            members = tuple(sorted({int(s) for s in arrived}))
            self.opened[t] = OpenedRelease(t, rows, int(carried), members)

    def _state_lost(self, t: int, stage: DMMStage, live: int) -> StateLost:
        need = self.scheme.threshold
        return StateLost(
            f"step {t}: {live} members alive at {stage.name}, t + k = {need} needed; the "
            "state is lost",
            stage,
            need,
            live,
        )

    # ------------------------------------------------------------------ SHARE
    def open_round(self, round_: int, faults: DMMFaults | None = None) -> RoundKeys:
        """SETUP -> SHARE of :attr:`step`: the committee's online holders publish fresh
        channel keys; returns the public :class:`RoundKeys` the clients share with."""
        if self.pool is None:
            raise ValueError("open_round needs a committee: call attach(pool) in full mode")
        faults = faults or DMMFaults()
        t = self._check_step()
        self.stage = DMMStage.SETUP
        self._enter(DMMStage.SHARE)
        transcript = Transcript()
        session = new_session_id() if self.encrypt else None
        self._server = Endpoint(SERVER_ID, session, protocol=PROTOCOL) if session else None
        answers = self.pool.broadcast(
            MemberCall.ANNOUNCE,
            int(round_),
            session,
            list(self.holders),
            faults.dropped_by(DMMStage.SHARE),
        )
        keys, rejected = self._check_keys(
            self.pool, answers, self.holders, SEAT_ID_BASE, transcript
        )
        round_keys = RoundKeys(
            round=int(round_),
            step=t,
            rows=len(self.schedule.released_at(t)),
            n=self.scheme.n,
            t=self.scheme.t,
            k=self.scheme.k,
            field_exponent=self.scheme.field.exponent,
            dim=self.dim,
            session_id=session,
            member_keys=keys,
            member_proofs=key_proofs(self.pool, keys, SEAT_ID_BASE, transcript),
        )
        self._open = _Round(round_keys, faults, transcript, rejected, self.holders)
        return round_keys

    def _check_keys(self, pool, answers, asked, base, transcript) -> tuple[dict[int, bytes], dict]:
        """Seat -> key from ``pool``'s answers; a seat not asked is ignored and a key the server
        cannot use is rejected (seat -> reason)."""
        keys, rejected = {}, {}
        asked = set(asked)
        for group, answer in zip(pool.groups, answers):
            for seat, key in (answer or {}).items() if isinstance(answer, Mapping) else ():
                if seat not in group or seat not in asked:
                    continue
                if self._server is None:
                    if key == b"":
                        keys[int(seat)] = b""
                    continue
                try:
                    if not isinstance(key, bytes) or len(key) != PUBLIC_KEY_BYTES:
                        raise ChannelError(f"a {type(key).__name__} of {len(key or b'')} bytes")
                    self._server.connect(base + int(seat), key)
                except (ChannelError, ValueError, TypeError) as error:
                    rejected[int(seat)] = f"unusable channel key: {error}"
                    continue
                keys[int(seat)] = key
                transcript.record(base + int(seat), SERVER_ID, DMMStage.SHARE, len(key) + 8)
        return dict(sorted(keys.items())), rejected

    def check_sealed(self, item, keys: RoundKeys) -> str | None:
        """Why a client's SHARE message is malformed, or None when it is well formed."""
        if not isinstance(item, DMMSealedShares):
            return f"a {type(item).__name__}, not DMMSealedShares"
        if isinstance(item.party, bool) or not isinstance(item.party, int | np.integer):
            return f"party {item.party!r} is not an integer"
        if not 0 <= int(item.party) < CLIENT_ID_LIMIT:
            return f"party {item.party} is outside [0, 2^40)"
        if not isinstance(item.shares, Mapping) or set(item.shares) != set(keys.member_keys):
            return f"shares for seats {sorted(getattr(item.shares, 'keys', list)())} != announced"
        if keys.session_id is None:
            ok = all(
                isinstance(r, np.ndarray) and r.shape == (keys.width,) for r in item.shares.values()
            )
            return None if ok else "plain rows of the wrong shape"
        if not isinstance(item.public_key, bytes) or len(item.public_key) != PUBLIC_KEY_BYTES:
            return "public key is not 32 bytes"
        try:
            self._server.connect(int(item.party), item.public_key)
        except (ChannelError, ValueError) as error:
            return f"unusable public key: {error}"
        length = ciphertext_bytes(keys.width)
        label = stage_label(DMMStage.SHARE)
        for seat, envelope in item.shares.items():
            if not isinstance(envelope, Envelope):
                return f"seat {seat}: a {type(envelope).__name__}, not an Envelope"
            header = (envelope.sender, envelope.receiver, envelope.round, envelope.stage)
            if header != (item.party, SEAT_ID_BASE + seat, keys.round, label):
                return f"seat {seat}: envelope header {header} is not this round's SHARE"
            if not isinstance(envelope.nonce, bytes) or len(envelope.nonce) != NONCE_BYTES:
                return f"seat {seat}: nonce is not {NONCE_BYTES} bytes"
            if not isinstance(envelope.ciphertext, bytes) or len(envelope.ciphertext) != length:
                return f"seat {seat}: ciphertext is not {length} bytes"
        return self._check_folded(item, keys)

    def _check_folded(self, item: DMMSealedShares, keys: RoundKeys) -> str | None:
        """Why a folded message's list of clients is malformed (None if well formed): each
        listed client a distinct party other than the fold's, a usable key, one sealed pad
        seed per announced seat (:class:`protocols.dmm.common.FoldedClient`)."""
        folded = item.folded
        if not isinstance(folded, tuple):
            return f"folded is a {type(folded).__name__}, not a tuple"
        parties = set()
        for client in folded:
            if not isinstance(client, FoldedClient):
                return f"a folded {type(client).__name__}, not a FoldedClient"
            party = client.party
            if isinstance(party, bool) or not isinstance(party, int | np.integer):
                return f"folded party {party!r} is not an integer"
            if not 0 <= int(party) < CLIENT_ID_LIMIT or party == item.party or party in parties:
                return f"folded party {party} is outside [0, 2^40), the fold's own or repeated"
            parties.add(int(party))
            key = client.public_key
            if not isinstance(key, bytes) or len(key) != PUBLIC_KEY_BYTES:
                return f"folded party {party}: public key is not 32 bytes"
            pads = client.pads
            if not isinstance(pads, Mapping) or set(pads) != set(keys.member_keys):
                return f"folded party {party}: pads for seats != announced"
            for seat, envelope in pads.items():
                header = (
                    getattr(envelope, "sender", None),
                    getattr(envelope, "receiver", None),
                    getattr(envelope, "round", None),
                    getattr(envelope, "stage", None),
                )
                if not isinstance(envelope, Envelope) or header != (
                    party, SEAT_ID_BASE + seat, keys.round, FOLD_PAD
                ):
                    return f"folded party {party}, seat {seat}: not its sealed pad seed"
                if not isinstance(envelope.nonce, bytes) or len(envelope.nonce) != NONCE_BYTES:
                    return f"folded party {party}, seat {seat}: nonce is not {NONCE_BYTES} bytes"
                if not isinstance(envelope.ciphertext, bytes) or len(envelope.ciphertext) != (
                    PAD_SEED_BYTES + TAG_BYTES
                ):
                    return f"folded party {party}, seat {seat}: the sealed seed has a wrong size"
        return None

    def finish_round(
        self,
        sealed: Mapping[int, DMMSealedShares],
        next_pool,
        weights: Mapping[int, int] | None = None,
    ) -> RoundOutput:
        """Finish the round :meth:`open_round` opened from the clients' sealed shares
        (``sealed[client]``) and hand the state to ``next_pool`` (the next round's committee).
        ``weights[client]``: how many clients' inputs that message folded (a worker batch,
        :class:`protocols.dmm.client.ShareFold`; default 1). Raises
        :class:`protocols.dmm.common.DMMAbort` / :class:`~protocols.dmm.common.StateLost` /
        :class:`protocols.kit.TamperingDetected` when nothing is released."""
        opened = self._open
        if opened is None or self.stage is not DMMStage.SHARE:
            raise ValueError(f"finish_round at stage {self.stage.name}: call open_round first")
        self._open = None
        keys, faults, transcript = opened.keys, opened.faults, opened.transcript
        if not isinstance(sealed, Mapping):
            raise ValueError(f"sealed is a {type(sealed).__name__}; allowed: client -> message")
        weights = _weights(weights, sealed)
        rejected, parties = self._screen(sealed, keys, weights)
        senders = [
            c
            for c in sorted(parties.values())
            if faults.client_drop.get(c) is not DMMStage.SHARE
        ]
        live = sorted(keys.member_keys)
        if len(live) < self.scheme.threshold:
            raise self._abort(self._state_lost(keys.step, DMMStage.SHARE, len(live)))
        excluded = set(faults.client_partial) & set(senders)
        excluded |= self._relay(sealed, senders, live, faults, transcript)
        clients = [c for c in senders if c not in excluded]
        party_of = {c: int(sealed[c].party) for c in clients}
        carried = sum(weights[c] for c in clients)
        combined = self.pool.broadcast(
            MemberCall.COMBINE,
            keys.step,
            sorted(party_of.values()),
            faults.members(Fault.DROP, DMMStage.COMBINE),
            faults.members(Fault.TAMPER, DMMStage.COMBINE),
            faults.seed,
            {party_of[c]: weights[c] for c in clients},
        ) if carried >= self.min_clients else None
        output = self._release_full(keys, faults, transcript, opened, clients, excluded,
                                    rejected, combined, next_pool, carried)
        output.contributors = carried
        return output

    def _screen(self, sealed, keys, weights) -> tuple[dict[int, str], dict[int, int]]:
        """(client -> why its message is rejected, party -> client of each accepted message);
        a folded message's weight is set to the clients it lists (``weights``, in place)."""
        rejected: dict[int, str] = {}
        parties: dict[int, int] = {}
        listed: dict[int, int] = {}
        for client, item in sealed.items():
            reason = self.check_sealed(item, keys)
            used = [] if reason else [int(item.party), *(int(c.party) for c in item.folded)]
            if reason is None and any(p in parties or p in listed for p in used):
                reason = f"parties {used} already used by another message"
            if reason is not None:
                rejected[client] = reason
                continue
            parties[int(item.party)] = client
            listed.update({p: client for p in used[1:]})
            if item.folded:  # the weight is what the members can check, never more
                weights[client] = len(item.folded)
        return rejected, parties

    def _relay(self, sealed, senders, live, faults, transcript) -> set[int]:
        """Relay each sender's envelopes to the live seats it reaches; the members open them.
        Returns the clients some live seat lacks or refused."""
        n = self.scheme.n
        relay = Relay(transcript) if self.encrypt else None
        deliveries: dict[int, dict[int, object]] = {}
        pads: dict[int, dict[int, list]] = {}
        fold_of: dict[int, int] = {}
        keys: dict[int, bytes] = {}
        client_of = {int(sealed[c].party): c for c in senders}
        for c in senders:
            item = sealed[c]
            party = int(item.party)
            reach = [j for j in live if c not in faults.client_partial or j < n // 2]
            deliveries[party] = {}
            if relay is None:
                for j in reach:
                    row = item.shares[j]
                    transcript.record(party, SEAT_ID_BASE + j, DMMStage.SHARE, row.size * 8)
                    deliveries[party][j] = row
                continue
            transcript.record(party, SERVER_ID, DMMStage.SHARE, len(item.public_key) + 8)
            keys[party] = item.public_key
            for j in reach:
                envelope = item.shares[j]
                if (c, j) in faults.corrupt_in_transit:
                    envelope = flip(envelope)
                relay.post(envelope)
            if item.folded:  # who is in the fold: each client's sealed pad seeds
                pads[party] = {j: [] for j in reach}
            for folded in item.folded:
                fold_of[int(folded.party)] = party
                client_of[int(folded.party)] = c
                keys[int(folded.party)] = folded.public_key
                for j in reach:
                    relay.post(folded.pads[j])
        if relay is not None:
            peers = {SERVER_ID: self._server.public_key, **keys}
            refused_keys = answer_union(self.pool.broadcast(MemberCall.CONNECT, peers))
            for j in live:
                for envelope in relay.deliver(SEAT_ID_BASE + j):
                    if envelope.stage == FOLD_PAD:
                        pads[fold_of[envelope.sender]][j].append((envelope.sender, envelope))
                    else:
                        deliveries[envelope.sender][j] = envelope
        else:
            refused_keys = set()
        parts = [
            (
                {p: {j: rows[j] for j in group if j in rows} for p, rows in deliveries.items()},
                {p: {j: seats[j] for j in group if j in seats} for p, seats in pads.items()},
            )
            for group in self.pool.groups
        ]
        answers = self.pool.call(MemberCall.SHARE, parts)
        refused = set(refused_keys)
        for answer in answers:
            if isinstance(answer, Mapping):
                refused |= {p for p, seats in answer.items() if seats}
        return {client_of[p] for p in refused if p in client_of}





def flip(envelope: Envelope) -> Envelope:
    """``envelope`` with its first ciphertext bit flipped (a relay altering it in transit)."""
    body = bytearray(envelope.ciphertext)
    body[0] ^= 0x01
    return Envelope(
        envelope.sender,
        envelope.receiver,
        envelope.round,
        envelope.stage,
        envelope.nonce,
        bytes(body),
    )
