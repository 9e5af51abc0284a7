"""Member side of a committee round: the shards that hold the members and answer the server.

:mod:`protocols.committee` steps 1-3 at the members. Members are simulated in groups: one
:class:`CommitteeShard` holds many members and works on all of them at once (an array with one
row per member), with one channel endpoint per member (:mod:`protocols.channels`: X25519 key
from 32 bytes of the member's own secret, or from the OS CSPRNG). A shard answers the typed
calls of :data:`MEMBERS` (:meth:`CommitteeShard.answer`); :class:`protocols.kit.LocalMembers`
hosts a committee's shards in this process, :mod:`fedsim.engine.committee_host` on Ray actors.

The stages themselves -- SHARE (open the clients' sealed shares), COMBINE (sum them), RELEASE
(seal the sums for the server) and ABORT, with the faults each applies -- are the handlers of
:mod:`protocols.committee.stages` ``(shard, state, message) -> (state, reply)``. A shard is
their thin holder: it keeps each round's :class:`~protocols.committee.state.ShardState`, and
each stage call builds the stage's message, runs its handler and stores the new state. The
setup calls (:meth:`CommitteeShard.public_keys`, :meth:`CommitteeShard.key_proofs`,
:meth:`CommitteeShard.connect`) are not round stages. Rounds are independent.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from protocols.channels import Endpoint
from protocols.committee.common import (
    CHANNEL_PROTOCOL,
    CommitteeCall,
    CommitteeStage,
    StageFaults,
)
from protocols.committee.stages import (
    Abort,
    Combine,
    Release,
    ShardContext,
    Share,
    handle,
)
from protocols.committee.state import ABORTED, ShardState
from protocols.enrolment import Certificate, Identity
from protocols.field import MersenneField
from protocols.kit import MEMBER_ID_BASE, MemberSide, StageError, answer_by

MEMBERS = MemberSide(calls=(CommitteeCall,))
"""The committee's member side: shards answer :class:`CommitteeCall`; none is ever silenced
(a shard's error, or its actor's death, reaches the server)."""


class CommitteeShard:
    """Members ``members`` (global indices) of one committee, held as one array per client.

    A plain class, hosted in process or on a Ray actor by the engine. Rounds are independent:
    each has its own :class:`~protocols.committee.state.ShardState` (:meth:`state`), which each
    stage call replaces by the one its handler returns. A call out of order raises
    :class:`~protocols.kit.StageError` and leaves the round as it was; any other error of a
    handler leaves the round ABORTED. :attr:`context`: the shard's fixed parts (members, field,
    endpoints), the context of every handler. ``session_id``: the committee's channel session;
    ``private_keys``: member -> 32 bytes of that member's own secret for its channel key (else
    the OS CSPRNG); ``identities``: member -> (32-byte seed of its Ed25519 identity, its
    enrolment certificate as bytes), with which it signs its channel key (:meth:`key_proofs`;
    None: enrolled nowhere).
    """

    def __init__(
        self,
        members: Sequence[int],
        field_exponent: int,
        session_id: bytes,
        private_keys: Mapping[int, bytes] | None = None,
        identities: Mapping[int, tuple[bytes, bytes]] | None = None,
    ):
        indices = np.asarray(members, dtype=np.int64)
        keys = private_keys or {}
        endpoints = {
            int(m): Endpoint(
                MEMBER_ID_BASE + int(m), session_id, CHANNEL_PROTOCOL, keys.get(int(m))
            )
            for m in indices
        }
        self.context = ShardContext(indices, MersenneField(field_exponent), endpoints)
        self._proofs = {
            int(m): Identity.from_seed(seed, Certificate.from_bytes(certificate)).prove(
                CHANNEL_PROTOCOL,
                session_id,
                MEMBER_ID_BASE + int(m),
                (endpoints[int(m)].public_key,),
            )
            for m, (seed, certificate) in (identities or {}).items()
        }
        self._states: dict[int, ShardState] = {}

    @property
    def members(self) -> np.ndarray:
        """The members' global indices, one array row each."""
        return self.context.members

    @property
    def field(self) -> MersenneField:
        """The field the members' rows lie in."""
        return self.context.field

    def answer(self, call: CommitteeCall, args: tuple) -> Any:
        """The handler of ``call`` with ``args`` (:class:`protocols.kit.Member`)."""
        handlers = {
            CommitteeCall.ABORT: self.abort,
            CommitteeCall.COMBINE: self.combine,
            CommitteeCall.CONNECT: self.connect,
            CommitteeCall.KEY_PROOFS: self.key_proofs,
            CommitteeCall.PUBLIC_KEYS: self.public_keys,
            CommitteeCall.RELEASE: self.release,
            CommitteeCall.SHARE: self.share,
        }
        return answer_by(handlers, call, args)

    def state(self, round_: int) -> ShardState:
        """This shard's state of ``round_`` (a SETUP state before its first message)."""
        return self._states.get(round_, _SETUP)

    def store(self, round_: int, state: ShardState) -> None:
        """Keep ``state`` as this shard's state of ``round_`` (what every stage call does with
        its handler's; a hostile subclass alters what its members hold by storing another)."""
        if not isinstance(state, ShardState):
            raise TypeError(f"state must be a ShardState, got {type(state).__name__}")
        self._states[round_] = state

    def stage(self, round_: int) -> CommitteeStage:
        """Where this shard stands in ``round_`` (SETUP before its first message)."""
        return self.state(round_).stage

    def _step(self, round_: int, stage: CommitteeStage, message: Any) -> Any:
        """Run ``stage``'s handler on the round's state and keep the state it returns; the
        reply. Out of order: StageError, nothing changed; any other error: round ABORTED."""
        try:
            state, reply = handle(stage, self.context, self.state(round_), message)
        except StageError:
            raise
        except Exception:
            self.store(round_, ABORTED)
            raise
        self.store(round_, state)
        return reply

    def public_keys(self) -> dict[int, bytes]:
        """Each member's channel public key."""
        return {m: e.public_key for m, e in self.context.endpoints.items()}

    def key_proofs(self) -> dict[int, bytes]:
        """Each enrolled member's proof of its channel key (empty when enrolled nowhere)."""
        return dict(self._proofs)

    def connect(self, party_id: int, public_key: bytes) -> None:
        """Every member opens a channel with ``party_id`` (the server, or a client)."""
        for endpoint in self.context.endpoints.values():
            endpoint.connect(party_id, public_key)

    def share(
        self,
        round_: int,
        shares: Mapping[int, Any],
        faults: StageFaults,
        width: int | None = None,
    ) -> dict:
        """SHARE (:func:`protocols.committee.stages.handle_share`): store this shard's rows of
        each client's shares (``shares[client]``: a
        :class:`~protocols.committee.common.ShardSealedShares`; ``width`` field elements per
        row, by default that of the first client); returns the members still online and, per
        client, the online members that refused its share."""
        return self._step(round_, CommitteeStage.SHARE, Share(round_, shares, faults, width))

    def combine(self, round_: int, clients: Sequence[int], faults: StageFaults) -> list[int]:
        """COMBINE (:func:`protocols.committee.stages.handle_combine`): each online member sums
        its rows of ``clients`` (all at once, mod p); returns the members still online."""
        return self._step(round_, CommitteeStage.COMBINE, Combine(round_, clients, faults))

    def release(self, round_: int, faults: StageFaults) -> dict[str, Any]:
        """RELEASE (:func:`protocols.committee.stages.handle_release`): the summed rows of the
        members that answer, and who answered late."""
        return self._step(round_, CommitteeStage.RELEASE, Release(round_, faults))

    def abort(self, round_: int) -> None:
        """The driver aborted ``round_`` (:func:`protocols.committee.stages.handle_abort`):
        drop everything of it and leave it ABORTED."""
        self._step(round_, CommitteeStage.ABORTED, Abort(round_))


_SETUP = ShardState()
"""Every round's state before its first message."""


def shard_arguments(
    groups: Sequence[Sequence[int]],
    field_exponent: int,
    session_id: bytes,
    private_keys: Mapping[int, bytes] | None,
    identities: Mapping[int, tuple[bytes, bytes]] | None = None,
) -> list[tuple]:
    """The :class:`CommitteeShard` constructor arguments of each group: its members, the field
    exponent, the channel session, its members' channel keys (None: from the OS CSPRNG) and
    their enrolled identities (None: enrolled nowhere)."""
    return [
        (
            list(g),
            field_exponent,
            session_id,
            private_keys and {m: private_keys[m] for m in g},
            identities and {m: identities[m] for m in g},
        )
        for g in groups
    ]
