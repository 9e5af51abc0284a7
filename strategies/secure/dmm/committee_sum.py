"""``dmm``: the DMM committees' sum (Bienstock, Kumar & Polychroniadou, ICML 2025;
docs/dmm-design.md, steps 3-8) as a :class:`SecureSum`.

Each client's input is its integer vector u_c (field elements, signed); with it the client
draws one fresh noise row N_Z(0, s^2)^D from its own secret for every row of the integer
strategy matrix M released at the round's step (``dmm.noise-std``, ``dmm.rows``), and in
``mode="full"`` packed-Shamir-shares both and seals each share to its seat of the round's
committee (:func:`protocols.dmm.client.seal_client_shares`; with ``worker_fold`` the clients
of a fedsim worker batch hand their sharing inputs to the worker, which seals one row per seat:
:mod:`strategies.secure.dmm.fold`). The committee -- n clients drawn publicly and hosted by the
engine's :class:`fedsim.engine.dmm_committee.CommitteeHost` (:mod:`strategies.secure.dmm.custody`)
-- combines the agreed clients' shares with the partial sums it holds, releases
y_i = sum_s M[i, s] X_s + z_i and hands the partial sums of the rows still open to the next
round's committee (:class:`protocols.dmm.server.DMMServer`). ``mode="ideal"`` is the
no-cryptography reference: the same rules on plaintext integers.

The release's ``total`` is the released rows y_i in F_p (row-major); its ``transcript`` the
protocol's :class:`protocols.dmm.release.RoundOutput` (or the abort that ended the round: its
``opened`` says whether the release shares reached the server beyond the threshold, which the
ledger accounts as a release all the same). With noise s = 0 and M = I the release is the field
sum of the inputs, which the SecureSum contract suite checks.

A DMM reply is checked whole (:meth:`DMMSum.first_replies`: a worker's fold holds several
clients, ideal mode two records); :meth:`DMMSum.payload` checks full mode's single sealed
record. The wire names are DMM's own (:mod:`strategies.secure.dmm.wire`). It runs only inside the
DMM strategy, which owns the mechanism (:attr:`standalone` is False).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

import numpy as np
from flwr.app import ArrayRecord, ConfigRecord, Context, Message, RecordDict
from flwr.serverapp import Grid

from fedsim.engine.boundary import ReleaseBoundary
from fedsim.engine.client_registry import (
    NUM_PARTITIONS_KEY,
    client_name,
    enrolled,
    public_committee,
)
from fedsim.privacy.mechanisms import discrete_gaussian
from fedsim.randomness import PartySecret, Purpose, RunSecret
from fedsim.record_codec import array_to_fill, to_record
from fedsim.worker_reduce import FOLDS_KEY, attach_reducer
from protocols.channels import KeySubstitution
from protocols.dmm.client import check_seat_keys, mask_client_shares, seal_client_shares
from protocols.dmm.common import DMMAbort, DMMKeys, DMMSealedShares, RoundKeys, Schedule
from protocols.dmm.release import RoundOutput
from protocols.dmm.server import DMMServer
from protocols.field import DEFAULT_FIELD
from protocols.kit import TamperingDetected
from protocols.shamir import PackedShamir
from strategies.secure.dmm import replies as checks
from strategies.secure.dmm.custody import Custody
from strategies.secure.dmm.fold import ShareFoldReducer
from strategies.secure.dmm.state import RoundState
from strategies.secure.dmm.wire import (
    cohort_config,
    round_keys_config,
    round_keys_from_config,
    sealed_from_record,
    sealed_to_record,
    with_share_config,
)
from strategies.secure.release import Release, SecureSum, SumArguments

MODES = ("full", "ideal")


def contribute(
    context: Context,
    secret: PartySecret,
    config: ConfigRecord,
    elements: np.ndarray,
    server_round: int,
    prefix: str,
) -> RecordDict:
    """The client's input ``elements`` (signed integers in F_p) and its fresh noise rows
    (``dmm.rows`` of std ``dmm.noise-std``, from its own secret): shared and sealed to the seats
    (full mode; or masked for its worker's fold), or in the clear (ideal mode). DMM's wire
    names are its own: ``prefix`` is not used."""
    rounded = DEFAULT_FIELD.decode_signed(elements).astype(np.int64)
    noise = discrete_gaussian(
        (int(config[DMMKeys.PREFIX + DMMKeys.ROWS]), rounded.size),
        float(config[DMMKeys.PREFIX + DMMKeys.NOISE_STD]),
        secret.generator(server_round, Purpose.NOISE, "dmm"),
    ).astype(np.int64)
    mode = str(config[DMMKeys.PREFIX + DMMKeys.MODE])
    if mode == "full":
        return shared_reply(config, context, secret, server_round, rounded, noise, rounded.size)
    if mode == "ideal":
        return RecordDict(
            {
                DMMKeys.UPDATE: to_record({DMMKeys.UPDATE: rounded}),
                DMMKeys.NOISE: to_record({DMMKeys.NOISE: noise}),
            }
        )
    raise ValueError(f"{DMMKeys.PREFIX}{DMMKeys.MODE}={mode!r}; allowed: 'full', 'ideal'")


class DMMSum(SecureSum):
    """The DMM committees' sum over ``scheme`` (n, t, k of every committee), drawn publicly
    from ``population`` clients with ``seed``; ``min_clients``: fewest agreed clients a
    release may carry; ``reshare_checks``: dealers beyond t + k a handoff needs. Before the
    first round :meth:`start` sets the integer matrix and the vectors' length, and the front
    end binds the committee host (:meth:`bind_host`)."""

    name = "dmm"
    standalone = False
    reply_kind = ConfigRecord

    def __init__(
        self,
        scheme: PackedShamir,
        *,
        seed: int,
        population: int,
        mode: str = "full",
        worker_fold: bool = False,
        min_clients: int = 1,
        reshare_checks: int = 1,
    ) -> None:
        if mode not in MODES:
            raise ValueError(f"mode={mode!r}; allowed: 'full', 'ideal'")
        super().__init__(DMMKeys.PREFIX)
        self.scheme, self.mode = scheme, mode
        self.custody = Custody(seed, population, scheme.n)
        self.worker_fold, self.min_clients = worker_fold, int(min_clients)
        self.reshare_checks = reshare_checks
        self.server: DMMServer | None = None
        self.noise_std = 0.0
        self.l2_bound = float("inf")
        self.round: RoundState | None = None

    @classmethod
    def from_arguments(cls, arguments: SumArguments) -> DMMSum:
        """Refused: the DMM strategy builds its sum, which owns its integer matrix."""
        raise ValueError(
            "secure sum 'dmm' is built by the DMM strategy, which owns its integer matrix "
            "(strategies.secure.dmm.committee_sum.DMMSum)"
        )

    contribute = staticmethod(contribute)

    def __getstate__(self) -> dict[str, Any]:
        """Never a round in flight (nor, through :class:`Custody` and the server, the host
        or a pool)."""
        state = super().__getstate__()
        state["round"] = None
        return state

    @property
    def full(self) -> bool:
        return self.mode == "full"

    @property
    def reply_key(self) -> str:
        return DMMKeys.SEALED

    def bind_host(self, host: Any) -> None:
        """The engine-side committee host (it holds the members' secrets; never pickled)."""
        self.custody.host = host

    def start(
        self,
        dim: int,
        matrix: np.ndarray,
        *,
        noise_std: float = 0.0,
        decoding: np.ndarray | None = None,
        l2_bound: float = float("inf"),
    ) -> None:
        """Sum vectors of ``dim`` entries through the integer ``matrix`` M (``decoding``: D
        with D M = I, None: forward substitution), each client adding noise rows of std
        ``noise_std``; ideal mode refuses an update beyond ``l2_bound``."""
        self.noise_std, self.l2_bound = float(noise_std), float(l2_bound)
        self.server = DMMServer(
            self.scheme,
            Schedule(matrix),
            dim,
            mode=self.mode,
            min_clients=self.min_clients,
            decoding=decoding,
            reshare_checks=self.reshare_checks,
        )

    def rows(self) -> int:
        """How many rows of M the next round releases."""
        return len(self.server.schedule.released_at(self.server.step))

    def instruct(self, server_round: int, config: ConfigRecord, grid: Grid | None) -> None:
        """Host the committee holding the state (full mode), seat the first one, and add the
        noise std, the rows released and the mode to the train ``config``."""
        super().instruct(server_round, config, grid)
        if self.full:
            self.custody.ensure_pool(self.server, server_round)
        if not self.custody.committee:
            self.custody.seat(server_round)
        config[DMMKeys.PREFIX + DMMKeys.NOISE_STD] = self.noise_std
        config[DMMKeys.PREFIX + DMMKeys.ROWS] = self.rows()
        config[DMMKeys.PREFIX + DMMKeys.MODE] = self.mode

    def address(self, server_round: int, messages: list[Message]) -> None:
        """The round's state (each instructed node's channel party, the member faults, the
        committee and the next one); full mode opens the round and gives each client its
        ``dmm.share.*`` entries (one shared instruction for the cohort under ``worker_fold``)."""
        custody = self.custody
        following = custody.draw(server_round + 1)
        self.round = state = RoundState(
            round=server_round,
            sent={int(m.metadata.dst_node_id): p for p, m in enumerate(messages)},
            faults=custody.faults(server_round, following),
            committee=list(custody.committee),
            next=following,
        )
        if not self.full:
            return
        state.keys = keys = self.server.open_round(server_round, state.faults)
        claim = custody.claim(server_round)
        if not self.worker_fold:
            for message in messages:
                node = int(message.metadata.dst_node_id)
                message.content = with_share_config(
                    message.content, round_keys_config(keys, state.sent[node], claim)
                )
        elif messages:
            cohort = state.cohort()
            content = with_share_config(messages[0].content, cohort_config(keys, cohort, claim))
            for message in messages:
                message.content = content
            attach_reducer(messages, ShareFoldReducer.for_round(keys, cohort))

    def payload(self, record: Any, length: int) -> RecordDict:
        """Full mode's sealed record, checked (its channel party is the round's, set in
        :meth:`finish`); ideal mode's two records come through :meth:`first_replies`."""
        if not self.full:
            raise ValueError("ideal mode's replies hold two records: see first_replies")
        sealed_from_record(record, 0, 0)
        return RecordDict({DMMKeys.SEALED: record})

    def first_replies(
        self, replies: list[Message], boundary: ReleaseBoundary | None, claimant: Any
    ) -> tuple[dict[int, RecordDict], dict[int, str]]:
        """(node -> the content the sum takes, node -> why a reply was rejected): each reply
        checked whole (:func:`strategies.secure.dmm.replies.validate`) and the accepted ones claimed
        for ``claimant`` at the release ``boundary``; a fold is keyed by its first node."""
        valid, rejected = checks.validate(self.round, replies, self.full, self.worker_fold)
        checks.at_boundary(boundary, claimant, self.round, replies, valid, rejected)
        return {node: reply.content for node, reply in valid.items()}, rejected

    def finish(self, server_round: int, payloads: Mapping[int, Any], length: int) -> Release:
        """Run the round's release over the accepted contents (by node), hand the state to the
        committee that holds it next, and say what the server learned. An abort after the
        release shares reached the server (``error.opened``) names as ``opened`` the nodes
        whose shares entered the round; the count of noise contributors the members verified
        is the transcript's (:class:`protocols.dmm.common.OpenedRelease`), which the ledger
        reads."""
        state, rejected = self.round, {}
        try:
            output = self._release(payloads, rejected)
        except (DMMAbort, TamperingDetected) as error:
            opened = () if error.opened is None else self._nodes(payloads)
            return Release(None, rejected=rejected, aborted=str(error), opened=opened,
                           transcript=error)  # fmt: skip
        rejected.update(output.rejected)
        self.custody.persist(self.server, output, server_round, state.next, self.full)
        total = self.scheme.field.encode_signed(output.release).ravel()
        return Release(total, self._nodes(output.clients), rejected, transcript=output)

    def _nodes(self, keys: Iterable[int]) -> tuple[int, ...]:
        """The nodes behind reply keys (a fold's first node stands for its batch)."""
        batches = self.round.batches
        return tuple(sorted(n for key in keys for n in batches.get(key, [key])))

    def _release(self, payloads: Mapping[int, RecordDict], rejected: dict) -> RoundOutput:
        state = self.round
        if self.full:
            sealed = checks.sealed(state, payloads, rejected)
            next_pool = self.custody.host.pool(state.next, self.server.member_kwargs)
            weights = {node: state.weight(node) for node in sealed}
            try:
                return self.server.finish_round(sealed, next_pool, weights)
            except BaseException:
                next_pool.close()
                raise
        updates, noises = checks.plain(
            payloads, rejected, self.rows(), self.server.dim, self.l2_bound, self.noise_std
        )
        return self.server.run_plain_round(state.round, updates, noises, state.faults)


def committee_names(
    config: ConfigRecord, keys: RoundKeys, seed: Any, population: Any
) -> dict[int, str]:
    """Seat -> the enrolled name (``client/c``) its key must be signed by: the instruction's
    ``committee`` must be the public draw (:func:`public_committee`, from the run's ``seed``
    and ``population``, both the client's own) of a round no later than this one, so a
    server cannot seat enrolled clients the draw did not choose. A committee that is not the
    draw is a :class:`KeySubstitution`."""
    for what, value in (("run_config seed", seed), ("node_config num-partitions", population)):
        if isinstance(value, bool) or not isinstance(value, int | np.integer):
            raise ValueError(
                f"{what}={value!r}; allowed: an integer (an enrolled DMM client recomputes "
                "the public committee draw from the run's seed and population)"
            )
    drawn_key = DMMKeys.SHARE_PREFIX + DMMKeys.COMMITTEE_ROUND
    drawn_at = config.get(drawn_key)
    clients = [int(c) for c in config.get(DMMKeys.SHARE_PREFIX + DMMKeys.COMMITTEE, ())]
    if (
        isinstance(drawn_at, bool)
        or not isinstance(drawn_at, int)
        or not 0 <= drawn_at <= keys.round
    ):
        raise KeySubstitution(
            f"round {keys.round}: {drawn_key}={drawn_at!r} names no public committee draw "
            f"(allowed: a round in [0, {keys.round}]); this client seals only to the public "
            "committee"
        )
    drawn = public_committee(int(seed), drawn_at, int(population), keys.n)
    if clients != drawn:
        raise KeySubstitution(
            f"round {keys.round}: the seats' clients {clients[:8]} are not round {drawn_at}'s "
            f"public committee {drawn[:8]} (seed {int(seed)}, population {int(population)}); "
            "this client seals only to the public committee"
        )
    return {j: client_name(clients[j]) for j in range(keys.n)}


def shared_reply(
    config: ConfigRecord,
    context: Context,
    secret: RunSecret,
    round_: int,
    rounded: np.ndarray,
    noise: np.ndarray,
    padded_dim: int,
) -> RecordDict:
    """Full mode's reply: the client's shares of ``rounded`` and ``noise`` sealed to the seats
    (or masked for its worker's fold), after checking the seats' keys when enrolled."""
    keys, party = round_keys_from_config(config, len(noise), context.node_id)
    if keys.dim != padded_dim:
        name = DMMKeys.SHARE_PREFIX + DMMKeys.DIM
        raise ValueError(f"{name}={keys.dim} but the encoder pads to {padded_dim}")
    shares = secret.generator(round_, Purpose.SHARES, "dmm")
    enrolment = enrolled(context.node_config, secret)
    if enrolment is not None:  # a substituted seat key: refuse before anything leaves
        names = committee_names(
            config,
            keys,
            context.run_config.get("seed"),
            context.node_config.get(NUM_PARTITIONS_KEY),
        )
        check_seat_keys(keys, enrolment[1], names)
    key_seed = secret.seed_bytes(round_, Purpose.KEYS, "dmm", "client")
    folded = DMMKeys.SHARE_PREFIX + DMMKeys.COHORT in config
    if folded and context.node_config.get(FOLDS_KEY) is True:
        # the padded rows are dealt straight into the reply's payload: the worker's fold
        # reads them in this process, so they are never copied into bytes
        array, rows = array_to_fill(np.int64, (keys.n, keys.width))
        client = mask_client_shares(keys, party, rounded, noise, shares, key_seed, rows).client
        pads = DMMSealedShares(client.party, client.public_key, client.pads)
        fold = ArrayRecord()  # item assignment keeps the Array (the constructor copies it)
        fold[DMMKeys.MASKED] = array
        return RecordDict({DMMKeys.FOLD: fold, DMMKeys.PADS: sealed_to_record(pads)})
    sealed = seal_client_shares(keys, party, rounded, noise, shares, key_seed)
    return RecordDict({DMMKeys.SEALED: sealed_to_record(sealed)})
