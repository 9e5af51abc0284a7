"""A DMM member group's round as stage handlers ``handle_<call>(context, state, message) ->
(state, reply)`` (docs/dmm-design.md, steps 4 and 5; the protocol in
:mod:`protocols.dmm.member`).

Each handler takes the group's fixed parts (:class:`~protocols.dmm.state.GroupContext`), its
stored state (:class:`~protocols.dmm.state.GroupState`) and a typed message (what the server
sent, checked here: it may be hostile), checks the stage move first
(:func:`~protocols.dmm.state.expect`, :func:`~protocols.dmm.state.moved`), and returns the new
state with the reply. A handler called out of order raises :class:`~protocols.kit.StageError`;
a request the group refuses (wrong step, seat, client, shape, or malformed) raises
:class:`~protocols.dmm.common.MemberRefused`; either way no new state comes back, so the old
one stands. The channel endpoints inside a state are held by reference
(:mod:`protocols.dmm.state`): opening or sealing moves their counters whatever the outcome.

SHARE (:func:`handle_announce`, :func:`handle_connect`, :func:`handle_share`), COMBINE
(:func:`handle_combine`), RELEASE (:func:`handle_release`); RESHARE enters by
:func:`handle_announce_handoff` and runs in :mod:`protocols.dmm.reshare_stages`.
:data:`HANDLERS` maps each :class:`~protocols.dmm.common.MemberCall` to its handler.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

import numpy as np

from protocols.channels import SERVER_ID, ChannelError, Endpoint, KeySubstitution
from protocols.dmm import reshare_stages as reshare
from protocols.dmm.client import pad_words
from protocols.dmm.common import (
    CLIENT_ID_LIMIT,
    FOLD_PAD,
    PROTOCOL,
    DMMStage,
    MemberCall,
    MemberRefused,
    ReleaseAnswer,
    refusing,
)
from protocols.dmm.state import (
    ROLE_BASES,
    GroupContext,
    GroupState,
    base_of,
    expect,
    moved,
    offset,
    open_row,
    own_seats,
)
from protocols.kit import NEW_ID_BASE, OLD_ID_BASE, SEAT_ID_BASE, StageError
from protocols.limbs import MersenneSum

Reply = tuple[GroupState, Any]


@dataclass(frozen=True)
class Announce:
    """ANNOUNCE: start round ``round`` as the current committee; the ``asked`` seats not in
    ``drop`` answer with a fresh channel key under ``session_id`` (None: no channels);
    ``private_keys``: seat -> 32 bytes of its own secret for that key (None: the group's
    secrets, else the OS)."""

    round: int
    session_id: bytes | None
    asked: Sequence[int]
    drop: Sequence[int]
    private_keys: Mapping[int, bytes] | None = None


@dataclass(frozen=True)
class AnnounceHandoff:
    """ANNOUNCE_HANDOFF: enter RESHARE of round ``round`` (mechanism step ``step``) as
    ``role`` ('old' or 'new'); the rest as in :class:`Announce`."""

    round: int
    session_id: bytes | None
    role: str
    step: int
    asked: Sequence[int]
    drop: Sequence[int]
    private_keys: Mapping[int, bytes] | None = None


@dataclass(frozen=True)
class KeyProofs:
    """KEY_PROOFS: the enrolment proofs of the keys announced this stage."""


@dataclass(frozen=True)
class Connect:
    """CONNECT: ``peers`` (party -> public key) to open a channel with, and their enrolment
    ``proofs`` (party -> proof; needed for another committee's seats under an authority)."""

    peers: Mapping[int, bytes]
    proofs: Mapping[int, bytes] | None = None


@dataclass(frozen=True)
class Share:
    """SHARE: ``deliveries[party][seat]``, a client's (or a fold's) sealed row per seat;
    ``pads[party][seat]``: for a folded message, the (client party, sealed pad seed) of every
    client it lists."""

    deliveries: Mapping[int, Mapping[int, object]]
    pads: Mapping[int, Mapping[int, Sequence[tuple[int, object]]]] | None = None


@dataclass(frozen=True)
class Combine:
    """COMBINE of ``step`` over the agreed ``clients``; ``drop``: seats gone; ``tamper``:
    seats that add their offset (simulation, from ``seed``); ``weights``: party -> the clients
    its message folds (default 1 each)."""

    step: int
    clients: Sequence[int]
    drop: Sequence[int]
    tamper: Sequence[int]
    seed: int
    weights: Mapping[int, int] | None = None


@dataclass(frozen=True)
class Release:
    """RELEASE of round ``round``; ``drop``, ``late`` (the answer misses the deadline) and
    ``tamper`` (from ``seed``) name seats."""

    round: int
    drop: Sequence[int]
    late: Sequence[int]
    tamper: Sequence[int]
    seed: int


@dataclass(frozen=True)
class Snapshot:
    """SNAPSHOT: the committed state (step, row -> (len(seats), blocks) shares)."""


@dataclass(frozen=True, eq=False)
class Load:
    """Hold ``partials`` (a saved snapshot) as the committed state of ``step``."""

    step: int
    partials: Mapping[int, np.ndarray]


# ---------------------------------------------------------------------- channels
def _announced(
    context: GroupContext, state: GroupState, round_, session_id, asked, drop, keys, role: str
) -> Reply:
    """``state`` (already moved) with the round's online seats and fresh channels: each
    answers its public key (b'' without channels); its enrolled seats sign them."""
    if isinstance(round_, bool) or not isinstance(round_, int | np.integer) or round_ < 0:
        raise MemberRefused(f"round_={round_!r}; allowed: an integer >= 0")
    if session_id is not None and (not isinstance(session_id, bytes) or len(session_id) < 16):
        raise MemberRefused("session_id must be None or at least 16 bytes")
    asked = own_seats(context, asked, "asked")
    gone = set(own_seats(context, drop, "drop"))
    if role == "old":
        asked = [s for s in asked if s in state.online]
    keys = dict(keys or {})
    if any(k is not None and (not isinstance(k, bytes) or len(k) != 32) for k in keys.values()):
        raise MemberRefused("private keys must be 32 bytes of the member's own secret")
    online = sorted(s for s in asked if s not in gone)
    state = replace(state, round=int(round_), online=frozenset(online))
    if session_id is None:
        return replace(state, endpoints={}), {s: b"" for s in online}
    base = ROLE_BASES[role]
    endpoints = {
        s: Endpoint(base + s, session_id, protocol=PROTOCOL, private_key=keys.get(s))
        for s in online
    }
    proofs = {
        s: context.identities[s].prove(PROTOCOL, session_id, base + s, (endpoints[s].public_key,))
        for s in online
        if s in context.identities
    }
    state = replace(state, endpoints=endpoints, proofs=proofs)
    return state, {s: endpoints[s].public_key for s in online}


@refusing("announce")
def handle_announce(context: GroupContext, state: GroupState, message: Announce) -> Reply:
    """SHARE begins: the asked seats not dropped answer with a fresh channel key."""
    if state.stage is not DMMStage.SETUP or state.role is not None:
        raise StageError(f"DMM members {context.shown} are mid-round ({state.stage.name})")
    target = moved(context, state, DMMStage.SHARE, "current")
    expected = context.schedule.open_after(state.step - 1)
    if sorted(state.partials) != sorted(expected):
        raise MemberRefused(f"members {context.shown} hold rows {sorted(state.partials)}")
    if state.step >= context.schedule.rounds:
        raise MemberRefused(f"step {state.step} is past M's {context.schedule.rounds} rounds")
    keys = message.private_keys
    if keys is None and context.secrets is not None:
        keys = context.secrets.channel_keys(message.round, "current")
    m = message
    return _announced(context, target, m.round, m.session_id, m.asked, m.drop, keys, "current")


@refusing("announce_handoff")
def handle_announce_handoff(
    context: GroupContext, state: GroupState, message: AnnounceHandoff
) -> Reply:
    """RESHARE begins as ``role``: 'old', the releasing committee (only its seats still
    online), or 'new', the next committee (it must hold nothing yet and will hold the state
    of step + 1)."""
    role, step = message.role, message.step
    if role == "old":
        expect(context, state, DMMStage.RELEASE, "current")
        target = moved(context, replace(state, role=None), DMMStage.RESHARE, "old")
        if int(message.round) != state.round or step != state.step:
            raise MemberRefused(
                f"handoff of round {message.round}, step {step}; these members run round "
                f"{state.round}, step {state.step}"
            )
    elif role == "new":
        if state.partials or state.stage is not DMMStage.SETUP or state.role is not None:
            raise MemberRefused(f"members {context.shown} are not an empty next committee")
        target = moved(context, state, DMMStage.RESHARE, "new")
        if isinstance(step, bool) or not isinstance(step, int | np.integer) or step < 0:
            raise MemberRefused(f"step={step!r}; allowed: an integer >= 0")
        target = replace(target, step=int(step) + 1)
    else:
        raise MemberRefused(f"role={role!r}; allowed: 'old', 'new'")
    keys = message.private_keys
    if context.secrets is not None:
        target = replace(target, reshare_rngs=context.secrets.reshare_rngs(message.round))
        if keys is None:
            keys = context.secrets.channel_keys(message.round, str(role))
    m = message
    return _announced(context, target, m.round, m.session_id, m.asked, m.drop, keys, role)


def handle_key_proofs(context: GroupContext, state: GroupState, message: KeyProofs) -> Reply:
    """Seat -> the enrolment proof of the channel key it announced this stage (seats without
    an identity give none)."""
    return state, dict(state.proofs)


@refusing("connect")
def handle_connect(context: GroupContext, state: GroupState, message: Connect) -> Reply:
    """Every online seat opens a channel with each peer; the reply lists the parties whose key
    is unusable (refused; nobody else is affected). Under the enrolment authority a seat of
    another committee must come with its proof, signed by a distinct enrolled party for this
    session and seat; one without is refused and never dealt to."""
    if state.stage not in (DMMStage.SHARE, DMMStage.RESHARE) or state.retired:
        raise StageError(f"DMM members {context.shown} cannot connect in {state.stage.name}")
    peers = message.peers
    if not isinstance(peers, Mapping):
        raise MemberRefused(f"peers is a {type(peers).__name__}; allowed: party -> key")
    unverified = _check_member_keys(context, state, peers, message.proofs or {})
    refused = set(unverified)
    for party, key in peers.items():
        if party in refused:
            continue
        for endpoint in state.endpoints.values():
            try:
                endpoint.connect(int(party), key)
            except (ChannelError, ValueError, TypeError):
                refused.add(party)
    reasons = {**state.unverified, **{int(p): why for p, why in unverified.items()}}
    state = replace(state, unverified=reasons)
    return state, sorted(int(p) for p in refused if isinstance(p, int | np.integer))


def _check_member_keys(
    context: GroupContext, state: GroupState, peers: Mapping[int, bytes], proofs: Mapping
) -> dict:
    """Party -> why its key is refused, for the seats of other committees among ``peers``
    whose keys are not bound to a distinct enrolled party (none without the authority)."""
    if context.verifier is None or not state.endpoints:
        return {}
    session = next(iter(state.endpoints.values())).session_id
    drawn = None if context.next_names is None else list(context.next_names(state.round + 1))
    names: dict[str, int] = {}
    refused = {}
    for party, key in peers.items():
        if not isinstance(party, int | np.integer) or not (
            OLD_ID_BASE <= int(party) < SEAT_ID_BASE
        ):
            continue  # the server and the clients: what they send is checked as it opens
        seat = int(party) - base_of(int(party))
        who = f"seat {seat} of the other committee"
        expected = None
        if drawn is not None and base_of(int(party)) == NEW_ID_BASE:
            expected = drawn[seat] if seat < len(drawn) else f"no seat {seat} of the draw"
        try:
            name = context.verifier.check(
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
            refused[party] = str(error)
    return refused


# ---------------------------------------------------------------------- one round
@refusing("share")
def handle_share(context: GroupContext, state: GroupState, message: Share) -> Reply:
    """SHARE: every online seat opens its row from each party; the reply is party -> the
    seats that lack it or refuse it (unauthentic, misaddressed, replayed, wrong length, out of
    the field). A folded message has the pad of every client it lists removed
    (:func:`protocols.dmm.client.fold_pad`), and the clients so verified are counted
    (:func:`handle_combine` refuses a weight above that count)."""
    expect(context, state, DMMStage.SHARE, "current")
    deliveries = message.deliveries
    if not isinstance(deliveries, Mapping):
        raise MemberRefused(f"deliveries is a {type(deliveries).__name__}; allowed: a dict")
    pads = message.pads if isinstance(message.pads, Mapping) else {}
    width, f = context.width(state.step), context.scheme.field
    received, carried = dict(state.received), dict(state.carried)
    refused: dict[int, list[int]] = {}
    for party, rows_in in deliveries.items():
        if isinstance(party, bool) or not isinstance(party, int | np.integer):
            continue
        party = int(party)
        if not 0 <= party < CLIENT_ID_LIMIT or party in received:
            refused[party] = sorted(state.online)  # replayed or not a client id
            continue
        if not isinstance(rows_in, Mapping):
            rows_in = {}
        rows = np.zeros((len(context.seats), width), dtype=np.int64)
        for s in sorted(state.online):
            try:
                item = rows_in.get(s)
                if item is None:
                    raise ChannelError(f"seat {s} received nothing from client {party}")
                row = open_row(context, state, s, item, DMMStage.SHARE, party, width)
                count, total = _unpad(context, state, s, party, pads.get(party))
                rows[context.index[s]] = _remove_pad(row, total, f.modulus)
                if carried.setdefault(party, max(1, count)) != max(1, count):
                    raise ChannelError(f"seat {s} was given another fold list")
            except (ChannelError, ValueError):
                refused.setdefault(party, []).append(s)
        received[party] = rows
    return replace(state, received=received, carried=carried), refused


def _remove_pad(row: np.ndarray, pad: np.ndarray | None, modulus: int) -> np.ndarray:
    """``row`` (field elements in [0, p)) minus ``pad`` (uint64 in [0, p); None: nothing to
    remove) mod p: the difference taken in uint64, where min(d, d + p) is d when no borrow
    wrapped it and d + p when one did."""
    if pad is None:
        return row
    out = row.astype(np.uint64, copy=True)
    scratch = np.empty_like(out)
    p = np.uint64(modulus)
    np.subtract(out, pad, out=out)
    np.add(out, p, out=scratch)
    np.minimum(out, scratch, out=out)
    return out.view(np.int64)


def _unpad(context: GroupContext, state: GroupState, seat: int, party: int, pads):
    """(clients, their pads' sum mod p) that seat ``seat`` removes from fold ``party``'s row:
    :func:`protocols.dmm.client.pad_words` of the seed sealed from each listed client, summed
    as they are expanded ((0, None) for a client's own message)."""
    if pads is None:
        return 0, None
    listed = pads.get(seat) if isinstance(pads, Mapping) else None
    if not isinstance(listed, list | tuple) or not listed:
        raise ChannelError(f"seat {seat} received no fold list from party {party}")
    endpoint = state.endpoints.get(seat)
    if endpoint is None:
        raise ChannelError(f"seat {seat} has no channel this round")
    width, field = context.width(state.step), context.scheme.field
    seen: set[int] = set()
    total = MersenneSum(field.exponent, width)
    pad = np.empty(width, dtype="<u8")  # each pad is expanded into it and added
    for entry in listed:
        client, envelope = entry
        client = int(client)
        if client in seen or client == party or not 0 <= client < CLIENT_ID_LIMIT:
            raise ChannelError(f"fold {party} lists client {client} twice or wrongly")
        seen.add(client)
        seed = endpoint.open(envelope, round_=state.round, stage=FOLD_PAD, sender=client)
        total.add(pad_words(field, seed, width, out=pad))
    return len(seen), total.value()


def _checked_clients(context: GroupContext, state: GroupState, message: Combine) -> list[int]:
    """The agreed clients of ``message``, refused unless their weights stay within what their
    folds proved, they carry ``min_clients`` clients' noise and every one shared here."""
    if message.step != state.step:
        raise MemberRefused(
            f"combine for step {message.step}; these members run step {state.step}"
        )
    chosen = sorted({int(c) for c in message.clients})
    weights = {int(p): int(w) for p, w in dict(message.weights or {}).items()}
    if any(w < 1 for w in weights.values()):
        raise MemberRefused(f"weights={weights!r}; allowed: party -> an integer >= 1")
    inflated = [c for c in chosen if weights.get(c, 1) > state.carried.get(c, 1)]
    if inflated:
        raise MemberRefused(
            f"weights claim more clients for parties {inflated} than their folds proved "
            f"({ {c: state.carried.get(c, 1) for c in inflated} })"
        )
    carried = sum(weights.get(c, 1) for c in chosen)
    if carried < context.min_clients:
        raise MemberRefused(
            f"{carried} clients agreed, min_clients = {context.min_clients}: a release "
            "must carry their fresh noise"
        )
    missing = [c for c in chosen if c not in state.received]
    if missing:
        raise MemberRefused(f"clients {missing} never shared with members {context.shown}")
    return chosen


@refusing("combine")
def handle_combine(context: GroupContext, state: GroupState, message: Combine) -> Reply:
    """COMBINE: sum the agreed clients' rows into shares of X_t and the z_i, then, with M's
    own coefficients, shares of y_i = P_i + M[i, t] X_t + z_i for the rows released at t and
    of the updated partial sums of the rows still open. The reply is the seats still online."""
    expect(context, state, DMMStage.SHARE, "current")
    target = moved(context, state, DMMStage.COMBINE)
    chosen = _checked_clients(context, state, message)
    gone, seed = set(own_seats(context, message.drop, "drop")), int(message.seed)
    tamper = own_seats(context, message.tamper, "tamper")
    f, schedule, step = context.scheme.field, context.schedule, state.step
    online = state.online - gone
    shape = (len(context.seats), context.width(step))
    total = f.sum_rows((state.received[c] for c in chosen), shape)
    total = offset(context, step, total, set(tamper) & online, seed, 1)
    released = schedule.released_at(step)
    segments = total.reshape(len(context.seats), 1 + len(released), context.blocks)
    X = segments[:, 0]

    def plus(row: int) -> np.ndarray:
        held = state.partials.get(row, np.zeros_like(X))
        coefficient = f.encode_signed(np.array([schedule.coefficient(row, step)]))
        return f.add(held, f.mul(X, coefficient))

    parts = [f.add(plus(i), segments[:, 1 + a]) for a, i in enumerate(released)]
    target = replace(
        target,
        online=online,
        received={},
        release=np.hstack(parts),
        tentative={j: plus(j) for j in schedule.open_after(step)},
    )
    return target, sorted(online)


@refusing("release")
def handle_release(context: GroupContext, state: GroupState, message: Release) -> Reply:
    """RELEASE: each online seat sends its shares of the released rows (sealed to the server
    when channels are on); the reply is a :class:`~protocols.dmm.common.ReleaseAnswer` record."""
    expect(context, state, DMMStage.COMBINE, "current")
    target = moved(context, state, DMMStage.RELEASE)
    if message.round != state.round:
        raise MemberRefused(f"release for round {message.round} in round {state.round}")
    gone = set(own_seats(context, message.drop, "drop"))
    late = set(own_seats(context, message.late, "late"))
    tamper, seed = own_seats(context, message.tamper, "tamper"), int(message.seed)
    online = state.online - gone
    rows = offset(context, state.step, state.release, set(tamper) & online, seed, 2)
    seats = sorted(online)
    sent = [rows[context.index[s]] for s in seats]
    if state.endpoints:
        sent = [
            state.endpoints[s].seal_array(SERVER_ID, state.round, DMMStage.RELEASE, row)
            for s, row in zip(seats, sent)
        ]
    answer = ReleaseAnswer(seats, sent, sorted(late & online)).to_record()
    return replace(target, online=online), answer


# ---------------------------------------------------------------------- committed state
def handle_snapshot(context: GroupContext, state: GroupState, message: Snapshot) -> Reply:
    """(step, row -> (len(seats), blocks) shares): the committed state, copied."""
    return state, (state.step, {r: v.copy() for r, v in state.partials.items()})


@refusing("load")
def handle_load(context: GroupContext, state: GroupState, message: Load) -> Reply:
    """The committed state of ``message.step`` (a saved snapshot), the round cleared; refused
    unless it holds exactly M's open rows, each (len(seats), blocks) field elements."""
    step, partials = message.step, message.partials
    expected = context.schedule.open_after(int(step) - 1)
    if sorted(int(r) for r in partials) != sorted(expected):
        raise MemberRefused(
            f"a state for step {step} holds rows {sorted(partials)}; M's open rows are "
            f"{list(expected)}"
        )
    loaded = {}
    shape = (len(context.seats), context.blocks)
    for r, rows in partials.items():
        rows = context.scheme.field.asarray(rows, f"partials[{r}]")
        if rows.shape != shape:
            raise MemberRefused(
                f"partials[{r}] has shape {rows.shape}; allowed ({shape[0]}, {shape[1]})"
            )
        loaded[int(r)] = rows
    return replace(state.cleared(), step=int(step), partials=loaded), None


Handler = Callable[[GroupContext, GroupState, Any], Reply]

HANDLERS: Mapping[MemberCall, Handler] = {
    MemberCall.ANNOUNCE: handle_announce,
    MemberCall.ANNOUNCE_HANDOFF: handle_announce_handoff,
    MemberCall.KEY_PROOFS: handle_key_proofs,
    MemberCall.CONNECT: handle_connect,
    MemberCall.SHARE: handle_share,
    MemberCall.COMBINE: handle_combine,
    MemberCall.RELEASE: handle_release,
    MemberCall.SNAPSHOT: handle_snapshot,
    MemberCall.DEAL: reshare.handle_deal,
    MemberCall.RETIRE: reshare.handle_retire,
    MemberCall.KEEP: reshare.handle_keep,
    MemberCall.DISCARD: reshare.handle_discard,
    MemberCall.RECEIVE: reshare.handle_receive,
    MemberCall.ACCUMULATE: reshare.handle_accumulate,
    MemberCall.CHECK_SHARES: reshare.handle_check_shares,
    MemberCall.COMMIT: reshare.handle_commit,
}
"""A member group's handlers, by the call each answers."""


def handle(call: MemberCall, context: GroupContext, state: GroupState, message: Any) -> Reply:
    """:data:`HANDLERS`\\ [call](context, state, message); StageError for a call with no
    handler."""
    handler = HANDLERS.get(call)
    if handler is None:
        allowed = ", ".join(sorted(str(c) for c in HANDLERS))
        raise StageError(f"a DMM member group has no handler for {call!r}; allowed: {allowed}")
    return handler(context, state, message)
