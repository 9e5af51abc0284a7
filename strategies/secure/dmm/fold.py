"""Worker-side folding of DMM's client shares: one sealed message per worker batch.

Packed Shamir sharing is linear (Franklin & Yung, STOC 1992): the sum of the clients' share rows
for seat j is seat j's share of the sum of their inputs. So the clients a fedsim worker runs
need not each seal every row: each deals its own shares of its rounded update and fresh noise
rows, pads seat j's row with a pad only seat j can remove and seals that pad's 32-byte seed to
seat j (all from its own secret, :func:`protocols.dmm.client.mask_client_shares`), and hands
the padded rows and the sealed seeds to the worker's :class:`ShareFoldReducer` accumulator,
which sums the rows, seals one row per seat from a fresh channel key of the batch (OS CSPRNG)
and lists each client with its sealed seeds (:class:`protocols.dmm.common.FoldedClient`).

**Who is in the fold is proved, not claimed.** Seat j removes the pad of every client the fold
lists: the sum is exact when the fold holds each listed client's row, and carries a uniform pad
at every honest seat when the fold lists a client it left out (or a client of another worker,
whose sealed seeds it cannot make), so no release decodes and the round aborts; a member also
refuses a weight above the number of pads it removed. The count of noise contributors the
ledger uses is therefore one the members verified. (A worker runs its clients' code and holds
their secrets in a simulation: what it can do to its own clients it could do without folding.)

Who sees what (README's threat model): the worker already runs those clients and holds their
inputs in a simulation; the server sees one sealed envelope per seat per batch and the batch's
public key and node list (instead of one per client); a seat, or any coalition of seats, sees a
share of the batch's sum instead of one share per client -- coarser, never finer, and uniform
for at most t seats. The noise in a release is still the sum of every folded client's own
noise, and the release counts them all (the server's ``weights``, checked by the members). The
reducer is :attr:`~fedsim.worker_reduce.Reducer.confidential`: a worker that cannot fold
withholds the replies (they come back as failures), and clients hand their inputs to it only
where the worker says it folds (``node_config[FOLDS_KEY]``); anywhere else, e.g. under Flower's
own runtime, each client seals its own shares as without folding. A batch is all-or-nothing: if
a seat refuses its envelope, its clients are all left out of the round.
"""

from __future__ import annotations

from flwr.app import ConfigRecord, Message, MetricRecord, RecordDict

from fedsim.record_codec import to_numpy
from fedsim.worker_reduce import (
    Accumulator,
    MetricSums,
    Reducer,
    ReductionError,
    folded_reply,
    is_partial,
    refuse,
)
from protocols.channels import Envelope
from protocols.dmm.client import MaskedFold, MaskedShares
from protocols.dmm.common import FOLD_PAD, DMMKeys, FoldedClient, RoundKeys
from protocols.kit import SEAT_ID_BASE
from strategies.secure.dmm.wire import sealed_to_record


def fold_party(cohort_size: int, parties) -> int:
    """The channel party of a fold: past every client's (``cohort_size`` of them), by its
    smallest client's, so that it differs from each client's own and from every other fold's."""
    return int(cohort_size) + min(int(p) for p in parties)


def pads_from_record(record, party: int, round_: int, seats) -> FoldedClient:
    """A folded client's :data:`DMMKeys.PADS` record as its :class:`FoldedClient` (party
    ``party``, one sealed seed per seat in ``seats``); ValueError naming what is malformed."""
    if not isinstance(record, ConfigRecord):
        raise ValueError(f"{DMMKeys.PADS} is a {type(record).__name__}, not a ConfigRecord")
    if set(record.keys()) != set(DMMKeys.SEALED_ENTRIES):
        raise ValueError(f"{DMMKeys.PADS} has entries {sorted(record.keys())}")
    key, members, nonces, bodies = (record[name] for name in DMMKeys.SEALED_ENTRIES)
    if not isinstance(key, bytes) or list(members) != list(seats):
        raise ValueError(f"{DMMKeys.PADS}: a public key and one seed per announced seat needed")
    if not len(nonces) == len(bodies) == len(seats):
        raise ValueError(f"{DMMKeys.PADS}: {len(nonces)} nonces, {len(bodies)} ciphertexts")
    return folded_client(party, key, round_, seats, nonces, bodies)


def folded_client(party, key, round_, seats, nonces, bodies) -> FoldedClient:
    """A :class:`FoldedClient` from its key and per seat its sealed seed's nonce and body."""
    if not all(isinstance(b, bytes) for b in [key, *nonces, *bodies]):
        raise ValueError("a folded client's key, nonces and ciphertexts must be bytes")
    pads = {
        int(j): Envelope(int(party), SEAT_ID_BASE + int(j), int(round_), FOLD_PAD, nonce, body)
        for j, nonce, body in zip(seats, nonces, bodies)
    }
    return FoldedClient(int(party), key, pads)


class ShareFoldReducer(Reducer):
    """Fold the clients of a worker batch into one sealed SHARE message (module docstring),
    for the round whose public :class:`protocols.dmm.common.RoundKeys` and cohort (node ids in
    channel-party order) it carries. Sealed folds are never folded again: on the server the
    batches reach the strategy one by one."""

    confidential = True
    exact = True  # sums in the protocol's field: any split folds to the same release
    params = ("round", "step", "rows", "n", "t", "k", "field_exponent", "dim", "session")
    params += ("members", "member_keys", "cohort")

    def __init__(self, **values) -> None:
        missing = [name for name in self.params if name not in values]
        if missing:
            raise ReductionError(f"the DMM fold lacks {missing}")
        for name in self.params:
            setattr(self, name, values[name])

    @classmethod
    def for_round(cls, keys: RoundKeys, cohort) -> ShareFoldReducer:
        if keys.session_id is None:
            raise ValueError("keys.session_id=None; folds are sealed over encrypted channels")
        seats = sorted(keys.member_keys)
        return cls(
            round=keys.round, step=keys.step, rows=keys.rows, n=keys.n, t=keys.t, k=keys.k,
            field_exponent=keys.field_exponent, dim=keys.dim, session=keys.session_id,
            members=seats, member_keys=[keys.member_keys[j] for j in seats],
            cohort=[int(node) for node in cohort],
        )  # fmt: skip

    def keys(self) -> RoundKeys:
        """The round's public keys."""
        return RoundKeys(
            round=int(self.round), step=int(self.step), rows=int(self.rows), n=int(self.n),
            t=int(self.t), k=int(self.k), field_exponent=int(self.field_exponent),
            dim=int(self.dim), session_id=bytes(self.session),
            member_keys={int(j): bytes(key) for j, key in zip(self.members, self.member_keys)},
        )  # fmt: skip

    def accumulator(self, instruction: RecordDict) -> Accumulator:
        cohort = {int(node): p for p, node in enumerate(self.cohort)}
        return _ShareFoldAccumulator(self.keys(), cohort)


class _ShareFoldAccumulator(Accumulator):
    def __init__(self, keys: RoundKeys, cohort: dict[int, int]) -> None:
        self.keys, self.cohort = keys, cohort
        self.fold = MaskedFold(keys)
        self.nodes: list[int] = []
        self.rejected: list[int] = []
        self.metrics = MetricSums()
        self.template: Message | None = None

    def add(self, reply: Message) -> None:
        if is_partial(reply):
            raise ReductionError("a sealed DMM fold is not folded again")
        node = int(reply.metadata.src_node_id)
        names = set(reply.content.keys()) - {"metrics"}
        if node not in self.cohort or names != {DMMKeys.FOLD, DMMKeys.PADS}:
            refuse(self.rejected, reply, f"records {sorted(names)} from node {node}")
            return
        try:
            rows = to_numpy(reply.content[DMMKeys.FOLD])[DMMKeys.MASKED]
            seats = sorted(self.keys.member_keys)
            client = pads_from_record(
                reply.content[DMMKeys.PADS], self.cohort[node], self.keys.round, seats
            )
            self.fold.add(MaskedShares(rows, client))
        except (KeyError, ValueError, TypeError) as error:
            refuse(self.rejected, reply, f"unusable sharing inputs: {error}")
            return
        metrics = reply.content.get("metrics")
        if isinstance(metrics, MetricRecord):
            self.metrics.add(metrics)
        self.nodes.append(node)
        self.template = self.template or reply

    def result(self) -> Message:
        if self.template is None:
            raise ReductionError("no client's inputs were folded")
        party = fold_party(len(self.cohort), (self.cohort[node] for node in self.nodes))
        sealed = self.fold.seal(party)
        seats = sorted(self.keys.member_keys)
        clients = sealed.folded
        columns = (
            list(self.nodes),
            [c.public_key for c in clients],
            [c.pads[j].nonce for c in clients for j in seats],
            [c.pads[j].ciphertext for c in clients for j in seats],
        )
        batch = dict(zip(DMMKeys.BATCH_ENTRIES, columns))
        content = RecordDict(
            {DMMKeys.SEALED: sealed_to_record(sealed), DMMKeys.BATCH: ConfigRecord(batch)}
        )
        if self.metrics.total:
            content["metrics"] = self.metrics.record("num-examples")
        return folded_reply(self.template, content, self.rejected)
