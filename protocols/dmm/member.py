"""Member side of DMM: what the committee members of one round hold and do.

docs/dmm-design.md, steps 4-7. A :class:`MemberGroup` hosts some seats
of one committee (several seats may share an object or an actor; each seat's rows are its own
shares). A committee holds, between rounds, packed Shamir shares of the partial sums
P_j = sum_{s < t} M[j, s] X_s of the rows j of M still open (:meth:`protocols.dmm.common.Schedule.
open_after`): data, never noise. Round t (its :attr:`step`), as the *current* committee:

1. SHARE (:meth:`announce`, :meth:`connect`, :meth:`share`): publish fresh X25519 keys, open the
   clients' sealed rows: per client (1 + R_t) segments -- shares of its rounded update and of
   one fresh noise row for each row released at t. A worker's folded row has the pad of every
   client it lists removed (each opened from that client's sealed seed), and :meth:`combine`
   refuses to count more clients for it than the pads removed.
2. COMBINE (:meth:`combine`): sum the agreed clients' rows into shares of X_t and z_i, then,
   with M's integer coefficients (read from the member's own copy of M, never from the server),
   shares of y_i = P_i + M[i, t] X_t + z_i for the rows released at t and of the updated partial
   sums of the rows still open. A member refuses to combine fewer than ``min_clients`` clients:
   a release always carries their fresh noise.
3. RELEASE (:meth:`release`): send its shares of the y_i, sealed to the server.
4. RESHARE as the *old* committee (:meth:`announce_handoff`, :meth:`deal`, then :meth:`retire`,
   or :meth:`keep` when the handoff fails): re-share each seat's partial-sum shares, scaled by
   its Lagrange column, to the next committee (:class:`protocols.dmm.resharing.OldMember`).

As the *next* committee a group only receives (:meth:`announce_handoff` with role 'new',
:meth:`receive`, :meth:`accumulate`, :meth:`check_shares`, :meth:`commit`). The RESHARE
handlers are :class:`protocols.dmm.reshare_member.ReshareDuties`.

Every handler checks the stage (:data:`protocols.dmm.common.TRANSITIONS`), the step, the seats and
the shapes and field ranges of what it is given; a bad request raises :class:`protocols.dmm.
MemberRefused` (or :class:`protocols.kit.StageError`) and changes nothing. Randomness is
passed in: ``private_keys`` (seat -> 32 bytes of the member's own secret) fix its channel keys,
``rngs`` (seat -> the member's own Generator) its resharing randomness; None draws from the OS.
A group answers typed calls (:meth:`MemberGroup.answer`, :data:`protocols.dmm.common.MEMBERS`):
:class:`MemberPool` keeps groups in process; :mod:`fedsim.engine.dmm_committee` hosts them on
Ray actors, one member per client, with each client's own secret (``secrets``).

Keys are bound at enrolment (:mod:`protocols.enrolment`): a group built
with its seats' ``identities`` signs every channel key it announces (:meth:`key_proofs`), and one
built with the enrolment ``authority`` connects to another committee's seat only under that
seat's valid proof: a member never deals its shares to a key no enrolled member signed
(:meth:`connect`, :meth:`deal`).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from enum import Enum
from typing import Protocol

import numpy as np

from protocols.channels import SERVER_ID, ChannelError, Endpoint, Envelope, KeySubstitution
from protocols.dmm.client import fold_pad
from protocols.dmm.common import (
    CLIENT_ID_LIMIT,
    FOLD_PAD,
    MEMBERS,
    PROTOCOL,
    DMMStage,
    MemberCall,
    MemberRefused,
    ReleaseAnswer,
    Schedule,
    check_transition,
    request,
)
from protocols.dmm.reshare_member import ReshareDuties
from protocols.dmm.resharing import NewMember
from protocols.enrolment import Certificate, Identity, KeyVerifier
from protocols.field import MersenneField
from protocols.kit import (
    NEW_ID_BASE,
    OLD_ID_BASE,
    SEAT_ID_BASE,
    LocalMembers,
    StageError,
    answer_by,
)
from protocols.shamir import PackedShamir

ROLE_BASES = {"current": SEAT_ID_BASE, "old": OLD_ID_BASE, "new": NEW_ID_BASE}


class MemberSecrets(Protocol):
    """A host's supply of its seats' own randomness (each seat's secret stays with it)."""

    def channel_keys(self, round_: int, role: str) -> dict[int, bytes]:
        """Seat -> 32 bytes of its own secret for its channel key of ``round_`` as ``role``."""
        ...

    def reshare_rngs(self, round_: int) -> dict[int, np.random.Generator]:
        """Seat -> its own resharing Generator for ``round_``."""
        ...


def _base_of(party: int) -> int:
    """The role base a channel id lies above (the highest not above it)."""
    return max(base for base in ROLE_BASES.values() if base <= party)


class MemberGroup(ReshareDuties):
    """Seats ``seats`` of one committee (n, t, k over F_{2^e - 1}, D = ``dim``) for the public
    integer matrix ``matrix``; ``step`` is the next round this committee runs."""

    def __init__(
        self,
        seats: Sequence[int],
        *,
        n: int,
        t: int,
        k: int,
        field_exponent: int,
        dim: int,
        matrix,
        min_clients: int = 1,
        step: int = 0,
        identities: Mapping[int, tuple[bytes, bytes]] | None = None,
        authority: bytes | None = None,
        next_names: Callable[[int], Sequence[str]] | None = None,
        secrets: MemberSecrets | None = None,
    ) -> None:
        """``identities``: seat -> (its identity seed, its certificate bytes), for the seats
        here that sign their keys (others are ignored); ``authority``: the enrolment
        authority's public key, under which peers' member keys are checked (None: taken as
        relayed); ``next_names``: round -> the enrolled names, seat order, of the committee the
        public draw makes for that round: a dealer of round r deals to seat j of the next
        committee only under a proof signed by ``next_names(r + 1)[j]`` (None: any distinct
        enrolled party); ``secrets``: the seats' own randomness (channel keys and resharing
        streams) where no request passes it (None: the OS's)."""
        self.scheme = PackedShamir(int(n), int(t), int(k), MersenneField(int(field_exponent)))
        self.seats = [int(s) for s in seats]
        self._identities = {
            int(s): Identity.from_seed(seed, Certificate.from_bytes(cert))
            for s, (seed, cert) in (identities or {}).items()
            if int(s) in self.seats
        }
        self._verifier = None if authority is None else KeyVerifier(authority)
        self._next_names = next_names
        self._secrets = secrets
        self._reshare_rngs: Mapping[int, np.random.Generator] = {}
        if not self.seats or len(set(self.seats)) != len(self.seats):
            raise ValueError(f"seats={seats!r}; allowed: distinct seats in [0, n={n})")
        if min(self.seats) < 0 or max(self.seats) >= self.scheme.n:
            raise ValueError(f"seats={seats!r}; allowed: distinct seats in [0, n={n})")
        if not isinstance(dim, int | np.integer) or dim < 1:
            raise ValueError(f"dim={dim!r}; allowed: a positive integer")
        if not isinstance(min_clients, int | np.integer) or min_clients < 1:
            raise ValueError(f"min_clients={min_clients!r}; allowed: an integer >= 1")
        self.schedule = Schedule(matrix)
        self.dim = int(dim)
        self.blocks = self.scheme.blocks_for(self.dim)
        self.min_clients = int(min_clients)
        self.step = int(step)
        self.partials: dict[int, np.ndarray] = {}
        self.retired = False
        self._index = {s: a for a, s in enumerate(self.seats)}
        self._clear_round()

    def answer(self, call: MemberCall, args: tuple):
        """The handler of ``call`` with ``args`` (:class:`protocols.kit.Member`)."""
        handlers = {
            MemberCall.ACCUMULATE: self.accumulate,
            MemberCall.ANNOUNCE: self.announce,
            MemberCall.ANNOUNCE_HANDOFF: self.announce_handoff,
            MemberCall.CHECK_SHARES: self.check_shares,
            MemberCall.COMBINE: self.combine,
            MemberCall.COMMIT: self.commit,
            MemberCall.CONNECT: self.connect,
            MemberCall.DEAL: self.deal,
            MemberCall.DISCARD: self.discard,
            MemberCall.KEEP: self.keep,
            MemberCall.KEY_PROOFS: self.key_proofs,
            MemberCall.RECEIVE: self.receive,
            MemberCall.RELEASE: self.release,
            MemberCall.RETIRE: self.retire,
            MemberCall.SHARE: self.share,
            MemberCall.SNAPSHOT: self.snapshot,
        }
        return answer_by(handlers, call, args)

    # ------------------------------------------------------------------ state
    def _clear_round(self) -> None:
        self.stage = DMMStage.SETUP
        self.role: str | None = None
        self._round = -1
        self._endpoints: dict[int, Endpoint] = {}
        self._proofs: dict[int, bytes] = {}
        self._unverified: dict[int, str] = {}
        self._online: set[int] = set()
        self._received: dict[int, np.ndarray] = {}
        #: party -> the clients whose pads this member removed from its message (1: its own)
        self._carried: dict[int, int] = {}
        self._tentative: dict[int, np.ndarray] | None = None
        self._release: np.ndarray | None = None
        self._incoming: dict[int, NewMember] = {}
        self._handed: np.ndarray | None = None

    def __getstate__(self) -> dict:
        """Pickles keep the committed state only, never a round's channel keys."""
        return {
            "seats": self.seats,
            "scheme": self.scheme,
            "dim": self.dim,
            "matrix": self.schedule.matrix,
            "min_clients": self.min_clients,
            "step": self.step,
            "partials": self.partials,
        }

    def __setstate__(self, saved: dict) -> None:
        scheme = saved["scheme"]
        self.__init__(
            saved["seats"],
            n=scheme.n,
            t=scheme.t,
            k=scheme.k,
            field_exponent=scheme.field.exponent,
            dim=saved["dim"],
            matrix=saved["matrix"],
            min_clients=saved["min_clients"],
            step=saved["step"],
        )
        self.partials = saved["partials"]

    def snapshot(self) -> tuple[int, dict[int, np.ndarray]]:
        """(step, row -> (len(seats), blocks) shares): the committed state."""
        return self.step, {r: v.copy() for r, v in self.partials.items()}

    @request
    def load(self, step: int, partials: Mapping[int, np.ndarray]) -> None:
        """Hold ``partials`` (a saved :meth:`snapshot`) as the committed state of ``step``."""
        expected = self.schedule.open_after(int(step) - 1)
        if sorted(int(r) for r in partials) != sorted(expected):
            raise MemberRefused(
                f"a state for step {step} holds rows {sorted(partials)}; M's open rows are "
                f"{list(expected)}"
            )
        loaded = {}
        for r, rows in partials.items():
            rows = self.scheme.field.asarray(rows, f"partials[{r}]")
            if rows.shape != (len(self.seats), self.blocks):
                raise MemberRefused(
                    f"partials[{r}] has shape {rows.shape}; allowed ({len(self.seats)}, "
                    f"{self.blocks})"
                )
            loaded[int(r)] = rows
        self._clear_round()
        self.step, self.partials = int(step), loaded

    # ------------------------------------------------------------------ checks
    def _move(self, target: DMMStage, role: str | None = None) -> None:
        if self.retired:
            raise MemberRefused(f"members {self.seats} retired: they hold nothing any more")
        if role is not None and self.role is not None and self.role != role:
            raise MemberRefused(f"members {self.seats} act as {self.role!r}, not {role!r}")
        check_transition(self.stage, target, f"DMM members {self.seats}")
        self.stage = target
        if role is not None:
            self.role = role

    def _expect(self, stage: DMMStage, role: str) -> None:
        if self.retired or self.stage is not stage or self.role != role:
            raise StageError(
                f"DMM members {self.seats} are in stage {self.stage.name} as {self.role!r}; "
                f"this request needs stage {stage.name} as {role!r}"
            )

    def _seat_list(self, seats, name: str) -> list[int]:
        try:
            out = sorted({int(s) for s in seats})
        except (TypeError, ValueError):
            raise MemberRefused(f"{name}={seats!r}; allowed: seat numbers") from None
        return [s for s in out if s in self._index]

    def _offset(self, rows: np.ndarray, who, seed: int, salt: int) -> np.ndarray:
        """``rows`` with a non-zero public offset added to the rows of the seats ``who``
        (simulated tampering)."""
        rows = rows.copy()
        for s in sorted(set(who) & set(self.seats)):
            rows[self._index[s]] = self._offset_row(rows[self._index[s]], s, seed, salt)
        return rows

    def _offset_row(self, row: np.ndarray, seat: int, seed: int, salt: int) -> np.ndarray:
        f = self.scheme.field
        offsets = np.random.default_rng([int(seed), salt, self.step, seat])
        return f.add(row, offsets.integers(1, f.modulus, size=row.shape[-1]))

    def _open(self, seat: int, item, stage: Enum, sender: int, width: int) -> np.ndarray:
        if isinstance(item, Envelope):
            endpoint = self._endpoints.get(seat)
            if endpoint is None:
                raise ChannelError(f"seat {seat} has no channel this round")
            opened = endpoint.open_array(item, round_=self._round, stage=stage, sender=sender)
        elif not self._endpoints and isinstance(item, np.ndarray):
            opened = item
        else:
            raise ChannelError(f"seat {seat} received a {type(item).__name__}, not an Envelope")
        if opened.ndim != 1 or opened.shape[0] != width:
            raise ChannelError(f"a row of {opened.shape} field elements; expected ({width},)")
        return self.scheme.field.asarray(opened, "share")

    # ------------------------------------------------------------------ channels
    @request
    def announce(self, round_: int, session_id, asked, drop, private_keys=None) -> dict:
        """Start round ``round_`` as the current committee: the asked seats not in ``drop``
        answer with a fresh channel key (b'' when ``session_id`` is None)."""
        if private_keys is None and self._secrets is not None:
            private_keys = self._secrets.channel_keys(round_, "current")
        if self.stage is not DMMStage.SETUP or self.role is not None:
            raise StageError(f"DMM members {self.seats} are mid-round ({self.stage.name})")
        expected = self.schedule.open_after(self.step - 1)
        if sorted(self.partials) != sorted(expected):
            raise MemberRefused(f"members {self.seats} hold rows {sorted(self.partials)}")
        if self.step >= self.schedule.rounds:
            raise MemberRefused(f"step {self.step} is past M's {self.schedule.rounds} rounds")
        return self._announce(round_, session_id, asked, drop, private_keys, "current")

    @request
    def announce_handoff(
        self, round_, session_id, role, step, asked, drop, private_keys=None
    ) -> dict:
        """Enter RESHARE of round ``round_`` (mechanism step ``step``) as the ``role`` ('old':
        the releasing committee, only seats still online; 'new': the next committee, which
        must hold nothing yet and will hold the state of step + 1)."""
        if self._secrets is not None:
            self._reshare_rngs = self._secrets.reshare_rngs(round_)
            if private_keys is None:
                private_keys = self._secrets.channel_keys(round_, str(role))
        if role == "old":
            self._expect(DMMStage.RELEASE, "current")
            if int(round_) != self._round or step != self.step:
                raise MemberRefused(
                    f"handoff of round {round_}, step {step}; these members run round "
                    f"{self._round}, step {self.step}"
                )
            self.role = None
        elif role == "new":
            if self.partials or self.stage is not DMMStage.SETUP or self.role is not None:
                raise MemberRefused(f"members {self.seats} are not an empty next committee")
            if isinstance(step, bool) or not isinstance(step, int | np.integer) or step < 0:
                raise MemberRefused(f"step={step!r}; allowed: an integer >= 0")
            self.step = int(step) + 1
        else:
            raise MemberRefused(f"role={role!r}; allowed: 'old', 'new'")
        return self._announce(round_, session_id, asked, drop, private_keys, role)

    def _announce(self, round_, session_id, asked, drop, private_keys, role) -> dict:
        if isinstance(round_, bool) or not isinstance(round_, int | np.integer) or round_ < 0:
            raise MemberRefused(f"round_={round_!r}; allowed: an integer >= 0")
        if session_id is not None and (not isinstance(session_id, bytes) or len(session_id) < 16):
            raise MemberRefused("session_id must be None or at least 16 bytes")
        asked = self._seat_list(asked, "asked")
        gone = set(self._seat_list(drop, "drop"))
        if role == "old":
            asked = [s for s in asked if s in self._online]
        keys = dict(private_keys or {})
        if any(k is not None and (not isinstance(k, bytes) or len(k) != 32) for k in keys.values()):
            raise MemberRefused("private keys must be 32 bytes of the member's own secret")
        self._move(DMMStage.RESHARE if role != "current" else DMMStage.SHARE, role)
        self._round = int(round_)
        self._online = {s for s in asked if s not in gone}
        if session_id is None:
            self._endpoints = {}
            return {s: b"" for s in sorted(self._online)}
        base = ROLE_BASES[role]
        self._endpoints = {
            s: Endpoint(base + s, session_id, protocol=PROTOCOL, private_key=keys.get(s))
            for s in sorted(self._online)
        }
        self._proofs = {
            s: self._identities[s].prove(
                PROTOCOL, session_id, base + s, (self._endpoints[s].public_key,)
            )
            for s in sorted(self._online)
            if s in self._identities
        }
        return {s: self._endpoints[s].public_key for s in sorted(self._online)}

    def key_proofs(self) -> dict[int, bytes]:
        """Seat -> the enrolment proof of the channel key it announced this stage (seats
        without an identity give none)."""
        return dict(self._proofs)

    @request
    def connect(
        self, peers: Mapping[int, bytes], proofs: Mapping[int, bytes] | None = None
    ) -> list[int]:
        """Every online seat opens a channel with each ``party -> public key``; returns the
        parties whose key is unusable (they are refused, nobody else is affected). With the
        enrolment authority, a peer that is a seat of another committee (the handoff's old or
        new side) must come with its ``proofs[party]``, signed by a distinct enrolled party for
        this session and seat; one without is refused and never dealt to."""
        if self.stage not in (DMMStage.SHARE, DMMStage.RESHARE) or self.retired:
            raise StageError(f"DMM members {self.seats} cannot connect in {self.stage.name}")
        if not isinstance(peers, Mapping):
            raise MemberRefused(f"peers is a {type(peers).__name__}; allowed: party -> key")
        refused = self._check_member_keys(peers, proofs or {})
        for party, key in peers.items():
            if party in refused:
                continue
            for endpoint in self._endpoints.values():
                try:
                    endpoint.connect(int(party), key)
                except (ChannelError, ValueError, TypeError):
                    refused.add(party)
        return sorted(int(p) for p in refused if isinstance(p, int | np.integer))

    def _check_member_keys(self, peers: Mapping[int, bytes], proofs: Mapping[int, bytes]) -> set:
        """The seats of other committees among ``peers`` whose keys are not bound to a
        distinct enrolled party (none without the authority); reasons in ``_unverified``."""
        if self._verifier is None or not self._endpoints:
            return set()
        session = next(iter(self._endpoints.values())).session_id
        drawn = None if self._next_names is None else list(self._next_names(self._round + 1))
        names: dict[str, int] = {}
        refused = set()
        for party, key in peers.items():
            if not isinstance(party, int | np.integer) or not (
                OLD_ID_BASE <= int(party) < SEAT_ID_BASE
            ):
                continue  # the server and the clients: what they send is checked as it opens
            seat = int(party) - _base_of(int(party))
            who = f"seat {seat} of the other committee"
            expected = None
            if drawn is not None and _base_of(int(party)) == NEW_ID_BASE:
                expected = drawn[seat] if seat < len(drawn) else f"no seat {seat} of the draw"
            try:
                name = self._verifier.check(
                    proofs.get(party),
                    protocol=PROTOCOL,
                    session_id=session,
                    party_id=int(party),
                    keys=(key,),
                    who=who,
                    name=expected,
                )
                if name in names:  # one enrolled party stands for one seat of a committee
                    raise KeySubstitution(f"{who}'s key is signed by {name!r}, already a seat")
                names[name] = int(party)
            except KeySubstitution as error:
                self._unverified[int(party)] = str(error)
                refused.add(party)
        return refused

    # ------------------------------------------------------------------ one round
    @property
    def width(self) -> int:
        """Field elements per client per seat this step: (1 + rows released) * blocks."""
        return (1 + len(self.schedule.released_at(self.step))) * self.blocks

    @request
    def share(
        self, deliveries: Mapping[int, Mapping[int, object]], pads=None
    ) -> dict[int, list[int]]:
        """SHARE: ``deliveries[party][seat]`` is a client's sealed row for an online seat.
        Returns party -> the seats that lack it or refuse it (unauthentic, misaddressed,
        replayed, wrong length, out of the field). ``pads[party][seat]``: for a folded message,
        the (client party, sealed pad seed) of every client it lists; the seat removes each
        client's pad (:func:`protocols.dmm.client.fold_pad`) and counts the clients it
        verified so (:meth:`combine` refuses a weight above that count)."""
        self._expect(DMMStage.SHARE, "current")
        if not isinstance(deliveries, Mapping):
            raise MemberRefused(f"deliveries is a {type(deliveries).__name__}; allowed: a dict")
        pads = pads if isinstance(pads, Mapping) else {}
        refused: dict[int, list[int]] = {}
        for party, rows_in in deliveries.items():
            if isinstance(party, bool) or not isinstance(party, int | np.integer):
                continue
            party = int(party)
            if not 0 <= party < CLIENT_ID_LIMIT or party in self._received:
                refused[party] = sorted(self._online)  # replayed or not a client id
                continue
            if not isinstance(rows_in, Mapping):
                rows_in = {}
            rows = np.zeros((len(self.seats), self.width), dtype=np.int64)
            for s in sorted(self._online):
                try:
                    item = rows_in.get(s)
                    if item is None:
                        raise ChannelError(f"seat {s} received nothing from client {party}")
                    row = self._open(s, item, DMMStage.SHARE, party, self.width)
                    listed = self._unpad(s, party, pads.get(party))
                    for pad in listed.values():
                        row = self.scheme.field.sub(row, pad)
                    rows[self._index[s]] = row
                    if self._carried.setdefault(party, max(1, len(listed))) != max(1, len(listed)):
                        raise ChannelError(f"seat {s} was given another fold list")
                except (ChannelError, ValueError):
                    refused.setdefault(party, []).append(s)
            self._received[party] = rows
        return refused

    def _unpad(self, seat: int, party: int, pads) -> dict[int, np.ndarray]:
        """client party -> the pad seat ``seat`` removes from fold ``party``'s row (its sealed
        seed opened from that client; {} for a client's own message)."""
        if pads is None:
            return {}
        listed = pads.get(seat) if isinstance(pads, Mapping) else None
        if not isinstance(listed, list | tuple) or not listed:
            raise ChannelError(f"seat {seat} received no fold list from party {party}")
        endpoint = self._endpoints.get(seat)
        if endpoint is None:
            raise ChannelError(f"seat {seat} has no channel this round")
        out: dict[int, np.ndarray] = {}
        for entry in listed:
            client, envelope = entry
            client = int(client)
            if client in out or client == party or not 0 <= client < CLIENT_ID_LIMIT:
                raise ChannelError(f"fold {party} lists client {client} twice or wrongly")
            seed = endpoint.open(envelope, round_=self._round, stage=FOLD_PAD, sender=client)
            out[client] = fold_pad(self.scheme.field, seed, self.width)
        return out

    @request
    def combine(self, step: int, clients, drop, tamper, seed: int, weights=None) -> list[int]:
        """COMBINE of ``step`` over the agreed ``clients`` (channel party ids). ``weights``:
        party -> the clients whose inputs it folded (a worker batch; default 1 each). Returns
        the seats still online."""
        self._expect(DMMStage.SHARE, "current")
        if step != self.step:
            raise MemberRefused(f"combine for step {step}; these members run step {self.step}")
        chosen = sorted({int(c) for c in clients})
        weights = {int(p): int(w) for p, w in dict(weights or {}).items()}
        if any(w < 1 for w in weights.values()):
            raise MemberRefused(f"weights={weights!r}; allowed: party -> an integer >= 1")
        inflated = [c for c in chosen if weights.get(c, 1) > self._carried.get(c, 1)]
        if inflated:
            raise MemberRefused(
                f"weights claim more clients for parties {inflated} than their folds proved "
                f"({ {c: self._carried.get(c, 1) for c in inflated} })"
            )
        carried = sum(weights.get(c, 1) for c in chosen)
        if carried < self.min_clients:
            raise MemberRefused(
                f"{carried} clients agreed, min_clients = {self.min_clients}: a release "
                "must carry their fresh noise"
            )
        missing = [c for c in chosen if c not in self._received]
        if missing:
            raise MemberRefused(f"clients {missing} never shared with members {self.seats}")
        gone, seed = set(self._seat_list(drop, "drop")), int(seed)
        tamper = self._seat_list(tamper, "tamper")
        self._move(DMMStage.COMBINE)
        f = self.scheme.field
        self._online -= gone
        total = f.sum(np.stack([self._received[c] for c in chosen]), axis=0)
        self._received = {}
        total = self._offset(total, set(tamper) & self._online, seed, 1)
        released = self.schedule.released_at(self.step)
        segments = total.reshape(len(self.seats), 1 + len(released), self.blocks)
        X = segments[:, 0]

        def plus(row: int) -> np.ndarray:
            held = self.partials.get(row, np.zeros_like(X))
            coefficient = f.encode_signed(np.array([self.schedule.coefficient(row, self.step)]))
            return f.add(held, f.mul(X, coefficient))

        parts = [f.add(plus(i), segments[:, 1 + a]) for a, i in enumerate(released)]
        self._release = np.hstack(parts)
        self._tentative = {j: plus(j) for j in self.schedule.open_after(self.step)}
        return sorted(self._online)

    @request
    def release(self, round_: int, drop, late, tamper, seed: int) -> dict:
        """RELEASE: each online seat sends its shares of the released rows (sealed to the
        server); ``late`` lists those whose answer misses the deadline."""
        self._expect(DMMStage.COMBINE, "current")
        if round_ != self._round:
            raise MemberRefused(f"release for round {round_} in round {self._round}")
        gone, late = set(self._seat_list(drop, "drop")), set(self._seat_list(late, "late"))
        tamper, seed = self._seat_list(tamper, "tamper"), int(seed)
        self._move(DMMStage.RELEASE)
        self._online -= gone
        rows = self._offset(self._release, set(tamper) & self._online, seed, 2)
        seats = sorted(self._online)
        sent = [rows[self._index[s]] for s in seats]
        if self._endpoints:
            sent = [
                self._endpoints[s].seal_array(SERVER_ID, self._round, DMMStage.RELEASE, row)
                for s, row in zip(seats, sent)
            ]
        return ReleaseAnswer(seats, sent, sorted(late & self._online)).to_record()

class MemberPool(LocalMembers):
    """One committee in this process: ``members`` (client ids, seat order) whose seats are split
    in ``groups``, each a :class:`MemberGroup` built with ``member_kwargs``, reached as a
    :class:`protocols.kit.LocalMembers` under :data:`protocols.dmm.common.MEMBERS`.
    :mod:`fedsim.engine.dmm_committee` hosts groups on actors."""

    def __init__(self, members, groups, member_kwargs: Mapping[str, object]) -> None:
        self.member_kwargs = dict(member_kwargs)
        groups = [[int(s) for s in g] for g in groups]
        super().__init__(MEMBERS, groups, [MemberGroup(g, **self.member_kwargs) for g in groups])
        self.members = [int(m) for m in members]
