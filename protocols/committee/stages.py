"""The committee member side as stage handlers
``handle_<stage>(shard, state, message) -> (state, reply)`` (:mod:`protocols.committee` steps
1-3 at the members).

Each handler takes a shard's fixed parts (:class:`ShardContext`: its members, the field and one
channel endpoint per member), the shard's stored state of the round
(:class:`~protocols.committee.state.ShardState`) and a typed message; it checks the stage move
(:func:`~protocols.committee.common.check_transition`) before anything else and returns the new
state with the reply, leaving the old state as it was. A handler called out of order raises
:class:`~protocols.kit.StageError` and returns no new state. The table :data:`HANDLERS` maps each
:class:`~protocols.committee.common.CommitteeStage` a message enters to its handler.

1. **SHARE** (:func:`handle_share`): each member opens its envelope of every client's
   :class:`~protocols.committee.common.ShardSealedShares`; one that cannot open it, or finds no
   ``width`` field elements in it (unusable key, unauthenticated, replayed, wrong round or stage,
   wrong length, dtype or range), refuses it and the server leaves the client out;
2. **COMBINE** (:func:`handle_combine`): each online member sums its rows of the clients the
   server names, mod p;
3. **RELEASE** (:func:`handle_release`): each member that answers seals its summed row for the
   server; the round is then DONE.

:func:`handle_abort` ends a round from any stage (ABORTED, nothing kept). Faults
(:class:`~protocols.committee.common.StageFaults`, per stage): a member that **drops** is silent
from then on; one that is **late** answers after the deadline; one that **tampers** adds a random
non-zero offset (drawn from the faults' public seed) to what it holds (SHARE, COMBINE) or sends
(RELEASE).

The endpoints are the members' channel identity, not round state: SHARE connects each client's
key to them and their records of seen counters refuse a replayed envelope in any later round.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

import numpy as np

from protocols.channels import SERVER_ID, Endpoint
from protocols.committee.common import (
    CommitteeStage,
    ReleaseAnswer,
    ShardSealedShares,
    ShareAnswer,
    StageFaults,
    check_transition,
)
from protocols.committee.state import ABORTED, DONE, ShardState
from protocols.field import MersenneField
from protocols.kit import StageError

COMBINE_SALT = 2**62 + 1
"""Salt of the tamper offsets a member adds to its summed rows at COMBINE (SHARE's salt is the
client's id, below 2^62)."""
RELEASE_SALT = 2**62 + 2
"""Salt of the tamper offsets a member adds to the rows it releases."""


@dataclass(frozen=True)
class ShardContext:
    """A shard's fixed parts, the same in every round: ``members`` (global indices, one array
    row each), the ``field`` and ``endpoints``, member -> its channel endpoint."""

    members: np.ndarray
    field: MersenneField
    endpoints: Mapping[int, Endpoint]

    def who(self, round_: int) -> str:
        """How a stage error names this shard in ``round_``."""
        return f"committee shard {self.members[:1].tolist()}.. round {round_}"


@dataclass(frozen=True)
class Share:
    """SHARE: ``shares[client]``, the client's :class:`ShardSealedShares` for this shard (any
    other delivery is refused), this stage's ``faults`` and ``width``, the field elements per
    row (None: that of the first client)."""

    round_: int
    shares: Mapping[int, Any]
    faults: StageFaults
    width: int | None = None


@dataclass(frozen=True)
class Combine:
    """COMBINE: the ``clients`` whose rows the members sum, and this stage's ``faults``."""

    round_: int
    clients: Sequence[int]
    faults: StageFaults


@dataclass(frozen=True)
class Release:
    """RELEASE: this stage's ``faults``."""

    round_: int
    faults: StageFaults


@dataclass(frozen=True)
class Abort:
    """The driver aborted the round."""

    round_: int


def _entered(shard: ShardContext, state: ShardState, target: CommitteeStage, round_: int):
    """Raise StageError unless ``state`` may move to ``target`` (TypeError for no state)."""
    if not isinstance(state, ShardState):
        raise TypeError(f"state must be a ShardState, got {type(state).__name__}")
    check_transition(state.stage, target, shard.who(round_))


def _tamper(
    shard: ShardContext, rows: np.ndarray, who: frozenset[int], seed: int, salt: int
) -> np.ndarray:
    """``rows`` with a random non-zero offset (from ``seed``, ``salt`` and the shard's first
    member) added to the rows of the members in ``who``."""
    hit = np.isin(shard.members, list(who))
    if not hit.any():
        return rows
    rng = np.random.default_rng([seed, salt, int(shard.members[0])])
    offset = rng.integers(1, shard.field.modulus, size=(int(hit.sum()), rows.shape[1]))
    rows = rows.copy()
    rows[hit] = shard.field.add(rows[hit], offset)
    return rows


def _open(
    shard: ShardContext, round_: int, client: int, sealed: ShardSealedShares, width: int
) -> tuple[np.ndarray, list[int]]:
    """One client's sealed rows, opened and checked by each member; a member that cannot
    open its envelope, or finds no ``width`` field elements in it, refuses it (its row
    stays 0 and the driver leaves the client out). Returns the rows and who refused."""
    rows = np.zeros((shard.members.size, width), dtype=np.int64)
    refused = []
    for index, (member, envelope) in enumerate(zip(shard.members, sealed.envelopes)):
        endpoint = shard.endpoints[int(member)]
        try:
            endpoint.connect(client, sealed.public_key)
            opened = endpoint.open_array(
                envelope, round_=round_, stage=CommitteeStage.SHARE, sender=client
            )
            rows[index] = shard.field.vector(opened, width, f"share from client {client}")
        except ValueError:  # ChannelError is a ValueError
            refused.append(int(member))
    return rows, refused


def _client_rows(
    shard: ShardContext, round_: int, client: int, delivered: Any, width: int
) -> tuple[np.ndarray, list[int]]:
    """SHARE for one client: its rows for this shard (zeros where refused) and the members
    that refused them: a sealed share that does not open or is malformed is refused by its
    member; a delivery that is not one sealed envelope per member of ``width`` elements
    (plain rows included: members take only sealed shares), by every member."""
    if (
        not isinstance(delivered, ShardSealedShares)
        or not isinstance(delivered.envelopes, tuple | list)
        or len(delivered.envelopes) != shard.members.size
        or delivered.width != width
    ):
        everyone = [int(m) for m in shard.members]
        return np.zeros((shard.members.size, width), dtype=np.int64), everyone
    return _open(shard, round_, client, delivered, width)


def _width_of(delivered: Any) -> int:
    """Elements per row that a client's delivery claims (0 when it claims nothing usable)."""
    width = delivered.width if isinstance(delivered, ShardSealedShares) else 0
    return int(width) if isinstance(width, int | np.integer) and width >= 0 else 0


def handle_share(
    shard: ShardContext, state: ShardState, message: Share
) -> tuple[ShardState, dict]:
    """SHARE: store this shard's rows of each client's shares (``message.width`` field
    elements per row, by default that of the first client); the reply is the
    :class:`ShareAnswer` record: the members still online and, per client, the online members
    that refused its share."""
    round_, faults = message.round_, message.faults
    _entered(shard, state, CommitteeStage.SHARE, round_)
    width = state.width if message.width is None else int(message.width)
    offline = state.offline | frozenset(faults.drop)
    stored = dict(state.rows)
    refused: dict[int, list[int]] = {}
    for client, delivered in message.shares.items():
        if width is None:
            width = _width_of(delivered)
        rows, bad = _client_rows(shard, round_, int(client), delivered, width)
        bad = [m for m in bad if m not in offline]
        if bad:
            refused[int(client)] = bad
        stored[int(client)] = _tamper(shard, rows, faults.tamper, faults.seed, int(client))
    online = [int(m) for m in shard.members if m not in offline]
    new = replace(
        state, stage=CommitteeStage.SHARE, width=width, rows=stored, offline=offline
    )
    return new, ShareAnswer(online, refused).to_record()


def handle_combine(
    shard: ShardContext, state: ShardState, message: Combine
) -> tuple[ShardState, list[int]]:
    """COMBINE: each online member sums its rows of ``message.clients`` (all at once, mod p);
    the reply is the members still online. ValueError for a client never shared."""
    _entered(shard, state, CommitteeStage.COMBINE, message.round_)
    faults, clients = message.faults, message.clients
    offline = state.offline | frozenset(faults.drop)
    stored = state.rows
    missing = [c for c in clients if c not in stored]
    if missing:
        raise ValueError(f"clients {missing[:5]} were never shared with this shard")
    width = 0 if state.width is None else state.width
    total = shard.field.sum_rows((stored[c] for c in clients), (shard.members.size, width))
    total = _tamper(shard, total, faults.tamper, faults.seed, COMBINE_SALT)
    new = replace(state, stage=CommitteeStage.COMBINE, rows={}, total=total, offline=offline)
    return new, [int(m) for m in shard.members if m not in offline]


def handle_release(
    shard: ShardContext, state: ShardState, message: Release
) -> tuple[ShardState, dict[str, Any]]:
    """RELEASE: the :class:`ReleaseAnswer` record of the summed rows of the members that
    answer (each sealed to the server) and who answered late; the round is then DONE."""
    round_, faults = message.round_, message.faults
    _entered(shard, state, CommitteeStage.RELEASE, round_)
    offline = state.offline | frozenset(faults.drop)
    total = _tamper(shard, state.total, faults.tamper, faults.seed, RELEASE_SALT)
    keep = np.array([m not in offline for m in shard.members], dtype=bool)
    members = shard.members[keep].tolist()
    rows: Any = total[keep]
    if shard.endpoints:
        rows = [
            shard.endpoints[m].seal_array(SERVER_ID, round_, CommitteeStage.RELEASE, row)
            for m, row in zip(members, rows)
        ]
    late = [int(m) for m in shard.members[keep] if m in faults.late]
    return DONE, ReleaseAnswer(members, rows, late).to_record()


def handle_abort(
    shard: ShardContext, state: ShardState, message: Abort
) -> tuple[ShardState, None]:
    """The driver aborted the round: ABORTED from any stage (DONE and ABORTED included, so that
    a round the server refuses after its release ends ABORTED everywhere), nothing kept."""
    if not isinstance(state, ShardState):
        raise TypeError(f"state must be a ShardState, got {type(state).__name__}")
    return ABORTED, None


HANDLERS: Mapping[CommitteeStage, Callable[[ShardContext, ShardState, Any], tuple]] = {
    CommitteeStage.SHARE: handle_share,
    CommitteeStage.COMBINE: handle_combine,
    CommitteeStage.RELEASE: handle_release,
    CommitteeStage.ABORTED: handle_abort,
}
"""The member's stage handlers, by the stage each message enters."""


def handle(
    stage: CommitteeStage, shard: ShardContext, state: ShardState, message: Any
) -> tuple[ShardState, Any]:
    """:data:`HANDLERS`\\ [stage](shard, state, message); StageError for a stage with no
    handler."""
    handler = HANDLERS.get(stage)
    if handler is None:
        allowed = ", ".join(s.name for s in HANDLERS)
        raise StageError(f"a committee member has no handler for {stage!r}; allowed: {allowed}")
    return handler(shard, state, message)
