"""DMM's wire names (:class:`DMMKeys`) and codecs: the records of an instruction and of a
reply, and the ``dmm.share.*`` entries that carry a round's public
:class:`protocols.dmm.common.RoundKeys` (:class:`ShareConfig`; docs/dmm-design.md, step 3).
Nothing here is secret."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
from flwr.app import ArrayRecord, ConfigRecord, RecordDict

from protocols.channels import Envelope, stage_label
from protocols.dmm.common import DMMKeys, DMMSealedShares, DMMStage, RoundKeys
from protocols.kit import SEAT_ID_BASE

K = DMMKeys


def _integer(config: Mapping[str, Any], name: str) -> int:
    value = config[K.SHARE_PREFIX + name]
    if not isinstance(value, int | np.integer) or isinstance(value, bool):
        raise ValueError(f"{K.SHARE_PREFIX}{name}={value!r}; allowed: an integer")
    return int(value)


def _integers(config: Mapping[str, Any], name: str) -> tuple[int, ...]:
    """The list of integers at ``name`` (checked by the types it holds: a cohort's list is
    long and every client reads it)."""
    values = config[K.SHARE_PREFIX + name]
    if not isinstance(values, list | tuple) or not all(
        issubclass(kind, int | np.integer) and not issubclass(kind, bool | np.bool_)
        for kind in set(map(type, values))
    ):
        raise ValueError(f"{K.SHARE_PREFIX}{name}={values!r:.200}; allowed: a list of integers")
    return tuple(map(int, values))


def _byte_strings(config: Mapping[str, Any], name: str) -> list[bytes]:
    values = config.get(K.SHARE_PREFIX + name, ())
    if not isinstance(values, list | tuple) or not all(isinstance(v, bytes) for v in values):
        raise ValueError(f"{K.SHARE_PREFIX}{name}: {values!r}; allowed: a list of byte strings")
    return list(values)


@dataclass(frozen=True)
class ShareConfig:
    """The ``dmm.share.*`` entries of a full-mode instruction, typed: the round's public
    :class:`~protocols.dmm.common.RoundKeys`, the client's channel ``party`` or, in a folded
    round's one shared instruction, the ``cohort`` (node ids in party order), and ``committee``
    (the server round whose public draw holds the state, its client ids in seat order), which
    an enrolled client recomputes and checks every seat's certificate against. Nothing secret."""

    keys: RoundKeys
    party: int | None = None
    cohort: tuple[int, ...] | None = None
    committee: tuple[int, tuple[int, ...]] | None = None

    def to_record(self) -> dict[str, Any]:
        """The entries, each under ``dmm.share.``."""
        keys = self.keys
        if keys.session_id is None:
            raise ValueError("keys.session_id=None; clients share only over encrypted channels")
        seats = sorted(keys.member_keys)
        out: dict[str, Any] = dict(
            zip(
                K.SHARE[:7],
                (keys.round, keys.step, keys.n, keys.t, keys.k, keys.field_exponent, keys.dim),
            )
        )
        out[K.SESSION] = keys.session_id
        out[K.MEMBERS] = seats
        out[K.MEMBER_KEYS] = [keys.member_keys[j] for j in seats]
        if self.party is not None:
            out[K.PARTY] = int(self.party)
        if seats and set(seats) <= set(keys.member_proofs):  # relayed; the clients check them
            out[K.MEMBER_PROOFS] = [keys.member_proofs[j] for j in seats]
        if self.committee is not None:
            out[K.COMMITTEE_ROUND] = int(self.committee[0])
            out[K.COMMITTEE] = [int(c) for c in self.committee[1]]
        if self.cohort is not None:
            out[K.COHORT] = [int(node) for node in self.cohort]
        return {K.SHARE_PREFIX + k: v for k, v in out.items()}

    @classmethod
    def from_record(cls, config: Mapping[str, Any], rows: int) -> ShareConfig:
        """The entries :meth:`to_record` wrote (``rows``: the noise rows released this step);
        ValueError naming the key, the value and what is allowed."""
        folded = K.SHARE_PREFIX + K.COHORT in config
        required = [k for k in K.SHARE if k != K.PARTY or not folded]
        missing = [K.SHARE_PREFIX + k for k in required if K.SHARE_PREFIX + k not in config]
        if missing:
            raise ValueError(f"the full-mode instruction's config lacks {missing}")
        seats = _integers(config, K.MEMBERS)
        member_keys = _byte_strings(config, K.MEMBER_KEYS)
        if len(seats) != len(member_keys):
            raise ValueError(
                f"{K.SHARE_PREFIX}{K.MEMBERS} has {len(seats)} entries but "
                f"{K.SHARE_PREFIX}{K.MEMBER_KEYS} "
                f"has {len(member_keys)}; allowed: one key per seat"
            )
        session = config[K.SHARE_PREFIX + K.SESSION]
        if not isinstance(session, bytes):
            raise ValueError(f"{K.SHARE_PREFIX}{K.SESSION}={session!r}; allowed: bytes")
        scalars = {name: _integer(config, name) for name in K.SHARE[:7]}
        keys = RoundKeys(
            round=scalars[K.ROUND],
            step=scalars[K.STEP],
            rows=int(rows),
            n=scalars[K.N],
            t=scalars[K.T],
            k=scalars[K.K],
            field_exponent=scalars[K.FIELD_EXPONENT],
            dim=scalars[K.DIM],
            session_id=session,
            member_keys=dict(zip(seats, member_keys)),
            member_proofs=dict(zip(seats, _byte_strings(config, K.MEMBER_PROOFS))),
        )
        committee = None
        if K.SHARE_PREFIX + K.COMMITTEE_ROUND in config:
            drawn = _integer(config, K.COMMITTEE_ROUND)
            committee = (drawn, _integers(config, K.COMMITTEE))
        party = _integer(config, K.PARTY) if K.SHARE_PREFIX + K.PARTY in config else None
        cohort = _integers(config, K.COHORT) if party is None else None
        return cls(keys, party, cohort, committee)


def round_keys_config(
    keys: RoundKeys, party: int, committee: tuple[int, Sequence[int]] | None = None
) -> dict[str, Any]:
    """The ``dmm.share.*`` entries of one client's full-mode instruction
    (:meth:`ShareConfig.to_record` with its channel party id)."""
    drawn = None if committee is None else (int(committee[0]), tuple(committee[1]))
    return ShareConfig(keys, party=int(party), committee=drawn).to_record()


def cohort_config(
    keys: RoundKeys, cohort: list[int], committee: tuple[int, Sequence[int]] | None = None
) -> dict[str, Any]:
    """The ``dmm.share.*`` entries of a folded round's one shared instruction: the round's
    public keys and committee and the cohort's node ids in order (client ``cohort[p]`` has
    channel party p)."""
    drawn = None if committee is None else (int(committee[0]), tuple(committee[1]))
    return ShareConfig(keys, cohort=tuple(cohort), committee=drawn).to_record()


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
    share = ShareConfig.from_record(config, rows)
    if share.cohort is None:
        return share.keys, share.party
    if node is None or int(node) not in share.cohort:
        raise ValueError(f"node {node} is not in the round's {K.SHARE_PREFIX}{K.COHORT}")
    return share.keys, share.cohort.index(int(node))


def sealed_to_record(sealed: DMMSealedShares) -> ConfigRecord:
    """Sealed shares as a reply record: the sender's public key and, per seat, the envelope's
    nonce and ciphertext (the header is the server's to rebuild)."""
    seats = sorted(sealed.shares)
    envelopes = [sealed.shares[j] for j in seats]
    if not all(isinstance(e, Envelope) for e in envelopes):
        raise ValueError("sealed.shares must all be Envelopes; clients never send plain shares")
    columns = (
        sealed.public_key,
        seats,
        [e.nonce for e in envelopes],
        [e.ciphertext for e in envelopes],
    )
    return ConfigRecord(dict(zip(K.SEALED_ENTRIES, columns)))


def sealed_from_record(record: ConfigRecord, party: int, round_: int) -> DMMSealedShares:
    """The server's view of a reply: envelopes from the client's *assigned* ``party`` to each
    seat for ``round_`` at SHARE. Raises ``ValueError`` naming what is malformed."""
    if not isinstance(record, ConfigRecord):
        raise ValueError(f"{K.SEALED} is a {type(record).__name__}, not a ConfigRecord")
    if set(record.keys()) != set(K.SEALED_ENTRIES):
        raise ValueError(f"{K.SEALED} has entries {sorted(record.keys())}")
    key, seats, nonces, bodies = (record[name] for name in K.SEALED_ENTRIES)
    if not isinstance(key, bytes) or not all(isinstance(v, list) for v in (seats, nonces, bodies)):
        raise ValueError(f"{K.SEALED} entries have the wrong types")
    if not len(seats) == len(nonces) == len(bodies) or len(set(seats)) != len(seats):
        raise ValueError(
            f"{K.SEALED} needs distinct seats and one nonce and ciphertext each; got "
            f"{len(seats)}, {len(nonces)}, {len(bodies)}"
        )
    if not all(isinstance(j, int) and not isinstance(j, bool) for j in seats) or not all(
        isinstance(b, bytes) for b in [*nonces, *bodies]
    ):
        raise ValueError(f"{K.SEALED}: seats must be integers, nonces and ciphertexts bytes")
    label = stage_label(DMMStage.SHARE)
    shares = {
        j: Envelope(party, SEAT_ID_BASE + j, int(round_), label, nonce, body)
        for j, nonce, body in zip(seats, nonces, bodies)
    }
    return DMMSealedShares(int(party), key, shares)


def instruction(content: RecordDict) -> tuple[ArrayRecord, ConfigRecord]:
    """(the global model, the config) of a DMM train instruction; ValueError when it lacks
    one of them or an entry of :attr:`DMMKeys.INSTRUCTION` / ``server-round``."""
    arrays = [v for v in content.values() if isinstance(v, ArrayRecord)]
    configs = [v for v in content.values() if isinstance(v, ConfigRecord)]
    if len(arrays) != 1 or not configs:
        raise ValueError("a DMM instruction needs one ArrayRecord and a ConfigRecord")
    config = configs[0]
    missing = [K.PREFIX + k for k in K.INSTRUCTION if K.PREFIX + k not in config]
    if missing or "server-round" not in config:
        raise ValueError(f"the instruction's config lacks {missing or ['server-round']}")
    return arrays[0], config
