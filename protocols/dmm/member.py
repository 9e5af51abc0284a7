"""Member side of DMM: what the committee members of one round hold and do.

docs/dmm-design.md, steps 4, 5 and 7. A :class:`MemberGroup` hosts some seats
of one committee (several seats may share an object or an actor; each seat's rows are its own
shares). A committee holds, between rounds, packed Shamir shares of the partial sums
P_j = sum_{s < t} M[j, s] X_s of the rows j of M still open (:meth:`protocols.dmm.common.Schedule.
open_after`): data, never noise. Round t (its :attr:`~MemberGroup.step`), as the *current*
committee:

- SHARE (:meth:`~MemberGroup.announce`, :meth:`~MemberGroup.connect`,
  :meth:`~MemberGroup.share`): publish fresh X25519 keys, open the clients' sealed rows: per
  client (1 + R_t) segments -- shares of its rounded update and of one fresh noise row for each
  row released at t. A worker's folded row has the pad of every client it lists removed (each
  opened from that client's sealed seed), and COMBINE refuses to count more clients for it
  than the pads removed.
- COMBINE (design step 4, :meth:`~MemberGroup.combine`): sum the agreed clients' rows into
  shares of X_t and z_i, then, with M's integer coefficients (read from the member's own copy
  of M, never from the server), shares of y_i = P_i + M[i, t] X_t + z_i for the rows released
  at t and of the updated partial sums of the rows still open. A member refuses to combine
  fewer than ``min_clients`` clients: a release always carries their fresh noise.
- RELEASE (step 5, :meth:`~MemberGroup.release`): send its shares of the y_i, sealed to the
  server.
- RESHARE (step 7) as the *old* committee (:meth:`~MemberGroup.announce_handoff`, ``deal``,
  then ``retire``, or ``keep`` when the handoff fails): re-share each seat's partial-sum
  shares, scaled by its Lagrange column, to the next committee
  (:class:`protocols.dmm.resharing.OldMember`). As the *next* committee a group only receives
  (``announce_handoff`` with role 'new', ``receive``, ``accumulate``, ``check_shares``,
  ``commit``; :class:`protocols.dmm.reshare_member.ReshareDuties`).

The work is done by stage handlers ``(context, state, message) -> (state, reply)``
(:mod:`protocols.dmm.stages` for SHARE, COMBINE, RELEASE and the handoff's announcement,
:mod:`protocols.dmm.reshare_stages` for step 7): a group is a thin holder of its fixed parts
(:class:`protocols.dmm.state.GroupContext`) and its stored state value
(:class:`protocols.dmm.state.GroupState`); each request becomes a typed message, the handler
runs, and the group keeps the state it returns. Every handler checks the stage first
(:data:`protocols.dmm.common.TRANSITIONS`), then the step, the seats and the shapes and field
ranges of what it is given; a bad request raises :class:`protocols.dmm.common.MemberRefused` (or
:class:`protocols.kit.StageError`) and changes nothing. Randomness is passed in:
``private_keys`` (seat -> 32 bytes of the member's own secret) fix its channel keys, ``rngs``
(seat -> the member's own Generator) its resharing randomness; None draws from the group's
``secrets``, else the OS. A group answers typed calls (:meth:`MemberGroup.answer`,
:data:`protocols.dmm.common.MEMBERS`): :class:`MemberPool` keeps groups in process;
:mod:`fedsim.engine.dmm_committee` hosts them on Ray actors, one member per client, with each
client's own secret (``secrets``).

Keys are bound at enrolment (:mod:`protocols.enrolment`): a group built
with its seats' ``identities`` signs every channel key it announces (:meth:`~MemberGroup.
key_proofs`), and one built with the enrolment ``authority`` connects to another committee's
seat only under that seat's valid proof: a member never deals its shares to a key no enrolled
member signed (:meth:`~MemberGroup.connect`, ``deal``).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from protocols.dmm import stages
from protocols.dmm.common import MEMBERS, DMMStage, MemberCall, Schedule, request
from protocols.dmm.reshare_member import ReshareDuties
from protocols.dmm.state import GroupContext, GroupState, MemberSecrets
from protocols.kit import LocalMembers, answer_by
from protocols.shamir import PackedShamir

__all__ = ["MemberGroup", "MemberPool", "MemberSecrets"]


class MemberGroup(ReshareDuties):
    """Seats ``seats`` of one committee (n, t, k over F_{2^e - 1}, D = ``dim``) for the public
    integer matrix ``matrix``; ``step`` is the next round this committee runs. Holds the
    group's :attr:`context` and its :attr:`state` (replaced by every request served)."""

    def __init__(self, seats: Sequence[int], *, step: int = 0, **context: Any) -> None:
        """``context``: the group's fixed parts as :meth:`GroupContext.build` takes them (n, t,
        k, field_exponent, dim, matrix, min_clients, identities, authority, next_names,
        secrets), checked there."""
        self.context = GroupContext.build(seats, **context)
        self.state = GroupState(step=int(step))

    def _run(self, handler: stages.Handler, message):
        """``handler`` on this group's state and ``message``: its reply; the new state kept
        (none when it raises)."""
        self.state, reply = handler(self.context, self.state, message)
        return reply

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

    # ------------------------------------------------------------------ fixed parts, state
    @property
    def seats(self) -> list[int]:
        return list(self.context.seats)

    @property
    def scheme(self) -> PackedShamir:
        return self.context.scheme

    @property
    def schedule(self) -> Schedule:
        return self.context.schedule

    @property
    def dim(self) -> int:
        return self.context.dim

    @property
    def blocks(self) -> int:
        return self.context.blocks

    @property
    def min_clients(self) -> int:
        return self.context.min_clients

    @property
    def step(self) -> int:
        """The next round (mechanism step) this committee runs."""
        return self.state.step

    @property
    def stage(self) -> DMMStage:
        return self.state.stage

    @property
    def role(self) -> str | None:
        return self.state.role

    @property
    def partials(self) -> Mapping[int, np.ndarray]:
        """Row of M -> (len(seats), blocks) shares of its partial sum: the committed state."""
        return self.state.partials

    @property
    def retired(self) -> bool:
        return self.state.retired

    @property
    def width(self) -> int:
        """Field elements per client per seat this step: (1 + rows released) * blocks."""
        return self.context.width(self.state.step)

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
        self.state = GroupState(step=self.state.step, partials=saved["partials"])

    def snapshot(self) -> tuple[int, dict[int, np.ndarray]]:
        """(step, row -> (len(seats), blocks) shares): the committed state."""
        return self._run(stages.handle_snapshot, stages.Snapshot())

    @request
    def load(self, step: int, partials: Mapping[int, np.ndarray]) -> None:
        """Hold ``partials`` (a saved :meth:`snapshot`) as the committed state of ``step``."""
        return self._run(stages.handle_load, stages.Load(step, partials))

    # ------------------------------------------------------------------ one round
    @request
    def announce(self, round_: int, session_id, asked, drop, private_keys=None) -> dict:
        """Start round ``round_`` as the current committee: the asked seats not in ``drop``
        answer with a fresh channel key (b'' when ``session_id`` is None)."""
        message = stages.Announce(round_, session_id, asked, drop, private_keys)
        return self._run(stages.handle_announce, message)

    @request
    def announce_handoff(
        self, round_, session_id, role, step, asked, drop, private_keys=None
    ) -> dict:
        """Enter RESHARE of round ``round_`` (mechanism step ``step``) as the ``role`` ('old':
        the releasing committee, only seats still online; 'new': the next committee, which
        must hold nothing yet and will hold the state of step + 1)."""
        message = stages.AnnounceHandoff(round_, session_id, role, step, asked, drop, private_keys)
        return self._run(stages.handle_announce_handoff, message)

    def key_proofs(self) -> dict[int, bytes]:
        """Seat -> the enrolment proof of the channel key it announced this stage (seats
        without an identity give none)."""
        return self._run(stages.handle_key_proofs, stages.KeyProofs())

    @request
    def connect(
        self, peers: Mapping[int, bytes], proofs: Mapping[int, bytes] | None = None
    ) -> list[int]:
        """Every online seat opens a channel with each ``party -> public key``; returns the
        parties whose key is unusable (they are refused, nobody else is affected). With the
        enrolment authority, a peer that is a seat of another committee (the handoff's old or
        new side) must come with its ``proofs[party]``, signed by a distinct enrolled party for
        this session and seat; one without is refused and never dealt to."""
        return self._run(stages.handle_connect, stages.Connect(peers, proofs))

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
        return self._run(stages.handle_share, stages.Share(deliveries, pads))

    @request
    def combine(self, step: int, clients, drop, tamper, seed: int, weights=None) -> list[int]:
        """COMBINE of ``step`` over the agreed ``clients`` (channel party ids). ``weights``:
        party -> the clients whose inputs it folded (a worker batch; default 1 each). Returns
        the seats still online."""
        message = stages.Combine(step, clients, drop, tamper, seed, weights)
        return self._run(stages.handle_combine, message)

    @request
    def release(self, round_: int, drop, late, tamper, seed: int) -> dict:
        """RELEASE: each online seat sends its shares of the released rows (sealed to the
        server); ``late`` lists those whose answer misses the deadline."""
        return self._run(stages.handle_release, stages.Release(round_, drop, late, tamper, seed))


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
