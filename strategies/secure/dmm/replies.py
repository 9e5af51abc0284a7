"""Every DMM train reply is validated at the server's boundary (docs/dmm-design.md, steps 3, 9):
its sender was sampled this round and answers once, it carries exactly the protocol's records,
and its sealed shares / plaintext integers are well formed and in range. A bad reply drops that
client; ``rejected`` maps each such node to why, and the round's metrics name them."""

from __future__ import annotations

import contextlib
import logging
import math
from collections.abc import Iterable, Mapping

import numpy as np
from flwr.app import ConfigRecord, Message, RecordDict

from fedsim.engine.boundary import ClaimRefused, ReleaseBoundary
from fedsim.record_codec import to_numpy
from fedsim.worker_reduce import is_partial
from protocols.channels import KeySubstitution
from protocols.dmm.common import DMMKeys, DMMSealedShares, RoundKeys
from strategies.secure.dmm.fold import folded_client
from strategies.secure.dmm.state import RoundState
from strategies.secure.dmm.wire import (
    sealed_from_record,
)

log = logging.getLogger(__name__)


def key_refusals(replies: Iterable[Message]) -> dict[int, str]:
    """node -> why it refused the keys the server relayed (its error reply says
    ``KeySubstitution``: a seat key no enrolled member signed)."""
    out = {}
    for reply in replies:
        reason = str(getattr(reply.error, "reason", "")) if reply.has_error() else ""
        if reason.startswith(KeySubstitution.__name__):
            out[int(reply.metadata.src_node_id)] = reason.splitlines()[0][:500]
    return out


def _batch(
    state: RoundState, reply: Message, node: int, rejected: dict[int, str]
) -> list[int] | None:
    """The nodes a worker's folded reply holds (each sampled, none seen before), or None
    (then ``rejected[node]`` says why); the nodes its fold refused are rejected."""
    for refused in reply.rejected:
        rejected[int(refused)] = "its reply was refused by its worker's fold"
    record = reply.content.get(DMMKeys.BATCH)
    nodes_key = DMMKeys.BATCH_ENTRIES[0]
    nodes = record.get(nodes_key) if isinstance(record, ConfigRecord) else None
    if not isinstance(nodes, list) or not nodes:
        rejected[node] = f"a folded reply without its {DMMKeys.BATCH} {nodes_key}"
        return None
    nodes = [int(n) for n in nodes]
    if len(set(nodes)) != len(nodes) or any(
        n not in state.sent or n in state.folded for n in nodes
    ):
        rejected[node] = f"a folded reply for nodes {nodes}: unsampled or repeated"
        return None
    state.folded.update({n: node for n in nodes})
    return nodes


def validate(
    state: RoundState, replies: Iterable[Message], full: bool, worker_fold: bool
) -> tuple[dict[int, Message], dict[int, str]]:
    """Contract 3: the replies that pass (node -> reply) and node -> why the others failed.
    A worker's folded reply is keyed by its first node (``state.batches``: its nodes)."""
    allowed = {DMMKeys.SEALED} if full else {DMMKeys.UPDATE, DMMKeys.NOISE}
    valid, rejected = {}, {}
    for reply in replies:
        node = int(reply.metadata.src_node_id)
        if reply.has_error():
            continue  # a client that failed or dropped: not a protocol violation
        if is_partial(reply) and worker_fold and full:
            nodes = _batch(state, reply, node, rejected)
            if nodes is not None and set(reply.content.keys()) - {"metrics"} == {
                DMMKeys.SEALED,
                DMMKeys.BATCH,
            }:
                valid[node], state.batches[node] = reply, nodes
            elif nodes is not None:
                rejected[node] = f"records {sorted(reply.content.keys())} in a folded reply"
            continue
        keys = set(reply.content.keys()) - {"metrics"}
        if node not in state.sent:
            rejected[node] = "not sampled this round"
        elif node in valid or node in rejected:
            rejected[node] = "more than one reply"
            valid.pop(node, None)
        elif keys != allowed:
            got = sorted(reply.content.keys())
            rejected[node] = f"records {got}, allowed {sorted(allowed)}"
        else:
            valid[node] = reply
    return valid, rejected


def at_boundary(
    boundary: ReleaseBoundary | None,
    claimant,
    state: RoundState,
    replies: list[Message],
    valid: dict[int, Message],
    rejected: dict[int, str],
) -> None:
    """Claim ``valid`` (the replies the secure sum takes) at the release boundary for
    ``claimant``'s ledger; one the boundary refuses leaves ``valid`` for ``rejected``. The
    other replies consumed here are withheld (see :class:`strategies.methods.dmm.DMM`)."""
    if boundary is None:
        return
    for node, reply in list(valid.items()):
        try:
            boundary.claim([reply], claimant)
        except ClaimRefused as refused:
            rejected[node] = f"refused at the release boundary: {refused}"
            del valid[node]
            state.batches.pop(node, None)
    summed = {id(reply) for reply in valid.values()}
    for reply in replies:
        if not reply.has_error() and id(reply) not in summed:
            with contextlib.suppress(ClaimRefused):
                boundary.withhold([reply], type(claimant).__name__)


def sealed(
    state: RoundState, valid: Mapping[int, RecordDict], rejected: dict[int, str]
) -> dict[int, DMMSealedShares]:
    """Full mode: each valid reply content's sealed shares (a fold's with its proof of who
    is in it); a malformed one moves to ``rejected``."""
    keys = state.keys
    out = {}
    for node, content in valid.items():
        try:
            party = state.party_of(node)
            out[node] = sealed_from_record(content[DMMKeys.SEALED], party, keys.round)
            if node in state.batches:
                out[node] = _folded(state, out[node], content, state.batches[node], keys)
        except (ValueError, TypeError, KeyError) as error:
            rejected[node] = f"malformed sealed shares: {error}"
    return out


def _folded(
    state: RoundState, shares: DMMSealedShares, content: RecordDict, nodes, keys: RoundKeys
):
    """``shares`` with the fold's proof of who is in it (:class:`FoldedClient` per node,
    from its :data:`DMMKeys.BATCH` record); ValueError when it does not list each node once
    with a key and a sealed pad seed per announced seat."""
    record, seats = content[DMMKeys.BATCH], sorted(keys.member_keys)
    public, nonces, bodies = (list(record.get(k, [])) for k in DMMKeys.BATCH_ENTRIES[1:])
    if len(public) != len(nodes) or not len(nonces) == len(bodies) == len(nodes) * len(seats):
        raise ValueError(
            f"a fold of {len(nodes)} nodes lists {len(public)} keys and {len(nonces)} pad "
            f"seeds; allowed: one key per node and one seed per node and seat"
        )
    sent, width = state.sent, len(seats)
    folded = tuple(
        folded_client(sent[n], public[i], keys.round, seats,
                      nonces[i * width:(i + 1) * width], bodies[i * width:(i + 1) * width])
        for i, n in enumerate(nodes)
    )  # fmt: skip
    return DMMSealedShares(shares.party, shares.public_key, shares.shares, folded)


def plain(
    valid: Mapping[int, RecordDict],
    rejected: dict[int, str],
    rows: int,
    dim: int,
    l2_bound: float,
    noise_std: float,
) -> tuple[dict[int, np.ndarray], dict[int, np.ndarray]]:
    """Ideal mode's plaintext integers (reply contents), each checked: ``dim`` integers with
    ||u||_2 <= ``l2_bound`` (Delta_2) and ``rows`` noise rows inside the tail bound (of std
    ``noise_std``) the bit budget assumes."""
    limit = noise_std * math.sqrt(2 * math.log(2 * dim * max(rows, 1) / 1e-12))
    updates, noises = {}, {}
    for node, content in valid.items():
        try:
            update = np.asarray(to_numpy(content[DMMKeys.UPDATE])[DMMKeys.UPDATE])
            noise = np.asarray(to_numpy(content[DMMKeys.NOISE])[DMMKeys.NOISE])
        except (KeyError, ValueError, TypeError) as error:
            rejected[node] = f"unreadable integers: {error}"
            continue
        if update.shape != (dim,) or noise.shape != (rows, dim):
            rejected[node] = (
                f"shapes {update.shape}, {noise.shape}; allowed ({dim},), ({rows}, {dim})"
            )
        elif update.dtype.kind not in "iu" or (noise.size and noise.dtype.kind not in "iu"):
            rejected[node] = "not integers"
        elif float(np.linalg.norm(update.astype(np.float64))) > l2_bound + 1e-9:
            rejected[node] = f"||update||_2 exceeds Delta_2 = {l2_bound:.6g}"
        elif noise.size and float(np.max(np.abs(noise))) > max(limit, 1.0):
            rejected[node] = f"noise beyond its tail bound {limit:.6g}"
        else:
            updates[node], noises[node] = update.astype(np.int64), noise.astype(np.int64)
    return updates, noises


def log_rejected(server_round: int, rejected: dict[int, str]) -> None:
    """One warning per rejected reply, in node order."""
    for node, reason in sorted(rejected.items()):
        log.warning("DMM round %s: reply of node %s rejected: %s", server_round, node, reason)
