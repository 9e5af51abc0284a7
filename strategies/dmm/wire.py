"""DMM's wire names and codecs: the records of an instruction and of a reply, and the
``dmm.share.*`` entries that carry a round's public :class:`protocols.dmm.common.RoundKeys`
(docs/dmm-design.md, step 3). Nothing here is secret."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from flwr.app import ArrayRecord, ConfigRecord, RecordDict

from protocols.channels import Envelope, stage_label
from protocols.dmm.common import DMMSealedShares, DMMStage, RoundKeys
from protocols.kit import SEAT_ID_BASE

NAME = "dmm"
UPDATE_KEY = "dmm.update"
"""Ideal mode's reply: ArrayRecord of the rounded update (D int64)."""
NOISE_KEY = "dmm.noise"
"""Ideal mode's reply: ArrayRecord of the fresh noise rows (rows x D int64)."""
PREFIX = "dmm."
SHARE_PREFIX = "dmm.share."
FOLD_KEY = "dmm.fold"
"""A client's reply to its worker's fold: ArrayRecord ``masked``, its padded share rows."""
PADS_KEY = "dmm.pads"
"""A client's reply to its worker's fold: its public key and sealed pad seeds (ConfigRecord in
the form of :func:`sealed_to_record`)."""
BATCH_KEY = "dmm.batch"
"""A folded reply's ConfigRecord: ``nodes``, the node ids whose inputs it holds, and for each in
order its ``public-keys`` entry and, per announced seat in order, ``pad-nonces`` and
``pad-ciphertexts`` (:class:`protocols.dmm.common.FoldedClient`)."""
SEALED_KEY = "dmm.sealed"
"""A SHARE message's record (:func:`sealed_to_record`), a client's or a folded batch's."""

#: the ``dmm.*`` entries of every instruction (:func:`instruction`)
INSTRUCTION_KEYS = (
    "dim", "clip", "gamma", "beta", "max-tries", "rotation-seed", "noise-std", "rows", "mode"
)  # fmt: skip
#: the ``dmm.share.*`` entries of a full-mode instruction (:func:`round_keys_config`)
SHARE_KEYS = ("round", "step", "n", "t", "k", "field-exponent", "dim", "session")
SHARE_KEYS += ("members", "member-keys", "party")
#: the entries of a sealed-shares record (:func:`sealed_to_record`)
SEALED_ENTRIES = {"public-key", "members", "nonces", "ciphertexts"}


def round_keys_config(
    keys: RoundKeys, party: int, committee: tuple[int, Sequence[int]] | None = None
) -> dict[str, Any]:
    """The ``dmm.share.*`` entries of one client's full-mode instruction: the round's public
    :class:`protocols.dmm.common.RoundKeys`, the client's channel party id and ``committee``: (the
    server round whose public draw holds the state, its client ids in seat order), which an
    enrolled client recomputes and checks every seat's certificate against. Nothing secret."""
    if keys.session_id is None:
        raise ValueError("keys.session_id=None; clients share only over encrypted channels")
    seats = sorted(keys.member_keys)
    out: dict[str, Any] = {
        "round": keys.round,
        "step": keys.step,
        "n": keys.n,
        "t": keys.t,
        "k": keys.k,
        "field-exponent": keys.field_exponent,
        "dim": keys.dim,
        "session": keys.session_id,
        "members": seats,
        "member-keys": [keys.member_keys[j] for j in seats],
        "party": int(party),
    }
    if seats and set(seats) <= set(keys.member_proofs):  # relayed; the clients check them
        out["member-proofs"] = [keys.member_proofs[j] for j in seats]
    if committee is not None:
        out["committee-round"] = int(committee[0])
        out["committee"] = [int(c) for c in committee[1]]
    return {SHARE_PREFIX + k: v for k, v in out.items()}


def cohort_config(
    keys: RoundKeys, cohort: list[int], committee: tuple[int, Sequence[int]] | None = None
) -> dict[str, Any]:
    """The ``dmm.share.*`` entries of a folded round's one shared instruction: the round's
    public keys and committee and the cohort's node ids in order (client ``cohort[p]`` has
    channel party p)."""
    out = round_keys_config(keys, 0, committee)
    del out[SHARE_PREFIX + "party"]
    out[SHARE_PREFIX + "cohort"] = [int(node) for node in cohort]
    return out


def with_share_config(content: RecordDict, share: dict[str, Any]) -> RecordDict:
    """``content`` with ``share``'s entries added to each of its ConfigRecords."""
    return RecordDict(
        {
            name: ConfigRecord({**dict(record), **share})
            if isinstance(record, ConfigRecord)
            else record
            for name, record in content.items()
        }
    )


def round_keys_from_config(
    config: ConfigRecord, rows: int, node: int | None = None
) -> tuple[RoundKeys, int]:
    """(keys, party) from an instruction's ``dmm.share.*`` entries; in a folded round (a
    ``cohort`` list instead of a ``party``) the party of ``node`` is its place in the cohort."""
    keys = _round_keys(config, rows)
    if SHARE_PREFIX + "party" in config:
        return keys, int(config[SHARE_PREFIX + "party"])
    cohort = [int(c) for c in config[SHARE_PREFIX + "cohort"]]
    if node is None or int(node) not in cohort:
        raise ValueError(f"node {node} is not in the round's {SHARE_PREFIX}cohort")
    return keys, cohort.index(int(node))


def _round_keys(config: ConfigRecord, rows: int) -> RoundKeys:
    required = [k for k in SHARE_KEYS if k != "party" or SHARE_PREFIX + "cohort" not in config]
    missing = [SHARE_PREFIX + k for k in required if SHARE_PREFIX + k not in config]
    if missing:
        raise ValueError(f"the full-mode instruction's config lacks {missing}")
    seats = [int(j) for j in config[SHARE_PREFIX + "members"]]
    member_keys = list(config[SHARE_PREFIX + "member-keys"])
    if len(seats) != len(member_keys):
        raise ValueError(
            f"{SHARE_PREFIX}members has {len(seats)} entries but {SHARE_PREFIX}member-keys "
            f"has {len(member_keys)}; allowed: one key per seat"
        )
    return RoundKeys(
        round=int(config[SHARE_PREFIX + "round"]),
        step=int(config[SHARE_PREFIX + "step"]),
        rows=int(rows),
        n=int(config[SHARE_PREFIX + "n"]),
        t=int(config[SHARE_PREFIX + "t"]),
        k=int(config[SHARE_PREFIX + "k"]),
        field_exponent=int(config[SHARE_PREFIX + "field-exponent"]),
        dim=int(config[SHARE_PREFIX + "dim"]),
        session_id=bytes(config[SHARE_PREFIX + "session"]),
        member_keys=dict(zip(seats, (bytes(key) for key in member_keys))),
        member_proofs=dict(zip(seats, map(bytes, config.get(SHARE_PREFIX + "member-proofs", ())))),
    )


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


def sealed_from_record(record: ConfigRecord, party: int, round_: int) -> DMMSealedShares:
    """The server's view of a reply: envelopes from the client's *assigned* ``party`` to each
    seat for ``round_`` at SHARE. Raises ``ValueError`` naming what is malformed."""
    if not isinstance(record, ConfigRecord):
        raise ValueError(f"{SEALED_KEY} is a {type(record).__name__}, not a ConfigRecord")
    if set(record.keys()) != SEALED_ENTRIES:
        raise ValueError(f"{SEALED_KEY} has entries {sorted(record.keys())}")
    seats, nonces, bodies = record["members"], record["nonces"], record["ciphertexts"]
    key = record["public-key"]
    if not isinstance(key, bytes) or not all(isinstance(v, list) for v in (seats, nonces, bodies)):
        raise ValueError(f"{SEALED_KEY} entries have the wrong types")
    if not len(seats) == len(nonces) == len(bodies) or len(set(seats)) != len(seats):
        raise ValueError(
            f"{SEALED_KEY} needs distinct seats and one nonce and ciphertext each; got "
            f"{len(seats)}, {len(nonces)}, {len(bodies)}"
        )
    if not all(isinstance(j, int) and not isinstance(j, bool) for j in seats) or not all(
        isinstance(b, bytes) for b in [*nonces, *bodies]
    ):
        raise ValueError(f"{SEALED_KEY}: seats must be integers, nonces and ciphertexts bytes")
    label = stage_label(DMMStage.SHARE)
    shares = {
        j: Envelope(party, SEAT_ID_BASE + j, int(round_), label, nonce, body)
        for j, nonce, body in zip(seats, nonces, bodies)
    }
    return DMMSealedShares(int(party), key, shares)


def instruction(content: RecordDict) -> tuple[ArrayRecord, ConfigRecord]:
    """(the global model, the config) of a DMM train instruction; ValueError when it lacks
    one of them or an entry of :data:`INSTRUCTION_KEYS` / ``server-round``."""
    arrays = [v for v in content.values() if isinstance(v, ArrayRecord)]
    configs = [v for v in content.values() if isinstance(v, ConfigRecord)]
    if len(arrays) != 1 or not configs:
        raise ValueError("a DMM instruction needs one ArrayRecord and a ConfigRecord")
    config = configs[0]
    missing = [PREFIX + k for k in INSTRUCTION_KEYS if PREFIX + k not in config]
    if missing or "server-round" not in config:
        raise ValueError(f"the instruction's config lacks {missing or ['server-round']}")
    return arrays[0], config
