"""Worker-side folding of DMM's client shares: one sealed message per worker batch.

Packed Shamir sharing is linear (Franklin & Yung, STOC 1992): the sum of the clients' share rows
for seat j is seat j's share of the sum of their inputs, and the sharing dealt from the summed
inputs -- segments and share randomness -- is exactly that sum of rows
(:class:`protocols.dmm_client.ShareFold`). So the clients a fedsim worker runs need not each
share and seal: each hands its rounded update, its fresh noise rows and its share randomness
(all drawn from its own secret, as in :func:`strategies.dmm.dmm_client_app`) to the worker's
:class:`ShareFoldReducer` accumulator, which deals the batch's sum once and seals one row per
seat, from a fresh channel key of the batch (OS CSPRNG), before anything leaves the worker.

Who sees what (README's threat model): the worker already runs those clients and holds their
inputs in a simulation; the server sees one sealed envelope per seat per batch and the batch's
public key and node list (instead of one per client); a seat, or any coalition of seats, sees a
share of the batch's sum instead of one share per client -- coarser, never finer, and uniform
for at most t seats. The noise in a release is still the sum of every folded client's own
noise, and the release counts them all (the server's ``weights``). The reducer is
:attr:`~fedsim.worker_reduce.Reducer.confidential`: a worker that cannot fold withholds the
replies (they come back as failures), and clients hand their inputs to it only where the
worker says it folds (``node_config[FOLDS_KEY]``); anywhere else, e.g. under Flower's own
runtime, each client seals its own shares as without folding. A batch is all-or-nothing: if a
seat refuses its envelope, its clients are all left out of the round.
"""

from __future__ import annotations

import numpy as np
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
from protocols.dmm import DMMSealedShares, RoundKeys
from protocols.dmm_client import ShareFold, keys_digest, seal_rows

FOLD_KEY = "dmm.fold"
"""A client's reply to its worker's fold: ArrayRecord ``update``, ``noise``, ``randomness``."""
BATCH_KEY = "dmm.batch"
"""A folded reply's ConfigRecord: ``nodes``, the node ids whose inputs it holds."""
SEALED_KEY = "dmm.sealed"
"""A SHARE message's record (:func:`sealed_to_record`), a client's or a folded batch's."""


def sealed_to_record(sealed: DMMSealedShares) -> ConfigRecord:
    """Sealed shares as a reply record: the sender's public key and, per seat, the envelope's
    nonce and ciphertext (the header is the server's to rebuild)."""
    seats = sorted(sealed.shares)
    envelopes = [sealed.shares[j] for j in seats]
    if not all(isinstance(e, Envelope) for e in envelopes):
        raise ValueError("sealed.shares must all be Envelopes; clients never send plain shares")
    return ConfigRecord(
        {
            "public-key": sealed.public_key,
            "members": seats,
            "nonces": [e.nonce for e in envelopes],
            "ciphertexts": [e.ciphertext for e in envelopes],
        }
    )


class ShareFoldReducer(Reducer):
    """Fold the clients of a worker batch into one sealed SHARE message (module docstring),
    for the round whose public :class:`protocols.dmm.RoundKeys` and cohort (node ids in
    channel-party order) it carries. Sealed folds are never folded again: on the server the
    batches reach the strategy one by one."""

    confidential = True
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
        self.digest = keys_digest(keys)
        self.fold = ShareFold(keys)
        self.nodes: list[int] = []
        self.rejected: list[int] = []
        self.metrics = MetricSums()
        self.template: Message | None = None

    def add(self, reply: Message) -> None:
        if is_partial(reply):
            raise ReductionError("a sealed DMM fold is not folded again")
        node = int(reply.metadata.src_node_id)
        names = set(reply.content.keys()) - {"metrics"}
        if node not in self.cohort or names != {FOLD_KEY}:
            refuse(self.rejected, reply, f"records {sorted(names)} from node {node}")
            return
        try:
            arrays = to_numpy(reply.content[FOLD_KEY])
            checked = arrays.get("keys-digest")
            if checked is not None and bytes(np.asarray(checked, np.uint8)) != self.digest:
                raise ValueError("the client checked other seat keys than this fold's")
            self.fold.add(arrays["update"], arrays["noise"], arrays["randomness"])
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
        party = min(self.cohort[node] for node in self.nodes)
        sealed = seal_rows(self.keys, party, self.fold.shares())
        content = RecordDict(
            {
                SEALED_KEY: sealed_to_record(sealed),
                BATCH_KEY: ConfigRecord({"nodes": list(self.nodes)}),
            }
        )
        if self.metrics.total:
            content["metrics"] = self.metrics.record("num-examples")
        return folded_reply(self.template, content, self.rejected)
