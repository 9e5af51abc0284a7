"""What a SecAgg+ client stores between stages, as typed records with a named codec.

:class:`SecAggClientState` is the protocol state of :class:`protocols.secagg.client.SecAggClient`
(its seed included, so whoever stores it seals it); :class:`ClientState` adds the server round it
answers and its input, kept until MASKED_INPUT masks it. Both travel as named integer arrays
(:meth:`SecAggClientState.to_arrays`, names in :class:`protocols.secagg.common.SecAggKeys`), the
round's parameters as one ``config.<name>`` entry each -- no positional encoding. Decoding checks
every entry and raises a ``ValueError`` naming the key, the value and what is allowed.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np

from protocols.channels import PUBLIC_KEY_BYTES
from protocols.secagg.common import SEED_BYTES, SHARE_ROW_LENGTH, SecAggConfig, SecAggKeys, Stage


def _entry(arrays: Mapping[str, object], name: str) -> np.ndarray:
    """``arrays[name]`` as an integer array, or ValueError naming the key and what is allowed."""
    if name not in arrays:
        raise ValueError(f"not a SecAgg+ client state: {name!r} is missing; allowed: an array")
    value = arrays[name]
    if not isinstance(value, np.ndarray) or value.dtype.kind not in "iu":
        kind = getattr(getattr(value, "dtype", None), "name", type(value).__name__)
        raise ValueError(
            f"not a SecAgg+ client state: {name!r} is {kind}; allowed: an integer array"
        )
    return value


def _bytes_of(value: np.ndarray, name: str) -> bytes:
    if value.ndim == 1 and value.dtype == np.uint8:  # every value of the dtype is a byte
        return value.tobytes()
    if value.ndim != 1 or (value.size and (int(value.min()) < 0 or int(value.max()) > 255)):
        raise ValueError(
            f"not a SecAgg+ client state: {name!r} has shape {value.shape}; allowed: a vector "
            "of bytes (0..255)"
        )
    return value.astype(np.uint8).tobytes()


def _scalar(value: np.ndarray, name: str, allowed: range) -> int:
    if value.shape != () or int(value) not in allowed:
        shown = value.tolist()
        raise ValueError(
            f"not a SecAgg+ client state: {name!r} = {shown!r}; allowed: an integer in "
            f"[{allowed.start}, {allowed.stop - 1}]"
        )
    return int(value)


@dataclass(frozen=True, eq=False)
class SecAggClientState:
    """A SecAgg+ client's protocol state (:meth:`SecAggClient.to_state`). ``client_id`` None and
    ``config`` None until SHARE_KEYS; ``neighbours`` (ids) with one row each of
    ``neighbour_keys`` (channel || agreement public key), ``receive_keys`` and ``mask_seeds``
    (32 bytes; no rows until every neighbour is connected); ``share_owners`` with one row each
    of ``shares`` (SHARE_ROW_LENGTH field elements)."""

    seed: bytes
    session: bytes
    stage: Stage
    client_id: int | None
    contributes: bool
    config: SecAggConfig | None
    neighbours: np.ndarray
    neighbour_keys: np.ndarray
    receive_keys: np.ndarray
    mask_seeds: np.ndarray
    share_owners: np.ndarray
    shares: np.ndarray

    def to_arrays(self) -> dict[str, np.ndarray]:
        """The state as named integer arrays (:attr:`SecAggKeys.STATE_ARRAYS` and one
        ``config.<parameter>`` per parameter once the round's config is known)."""
        out = {
            "seed": np.frombuffer(self.seed, dtype=np.uint8).copy(),
            "session": np.frombuffer(self.session, dtype=np.uint8).copy(),
            "stage": np.array(self.stage.value, dtype=np.int64),
            "client_id": np.array(-1 if self.client_id is None else self.client_id, np.int64),
            "contributes": np.array(int(self.contributes), dtype=np.int64),
            "neighbours": self.neighbours,
            "neighbour_keys": self.neighbour_keys,
            "receive_keys": self.receive_keys,
            "mask_seeds": self.mask_seeds,
            "share_owners": self.share_owners,
            "shares": self.shares,
        }
        if self.config is not None:
            for name, value in self.config.to_record().items():
                out[SecAggKeys.STATE_CONFIG_PREFIX + name] = np.array(value, dtype=np.int64)
        return out

    @classmethod
    def from_arrays(cls, arrays: Mapping[str, object]) -> SecAggClientState:
        """The state :meth:`to_arrays` wrote; ValueError naming the key, the value and what is
        allowed for an entry that is missing, unknown or malformed."""
        prefix = SecAggKeys.STATE_CONFIG_PREFIX
        unknown = sorted(set(arrays) - _KNOWN)
        if unknown:
            raise ValueError(
                f"not a SecAgg+ client state: unknown entry {unknown[0]!r}; allowed: "
                f"{sorted(_KNOWN)}"
            )
        got = {name: _entry(arrays, name) for name in SecAggKeys.STATE_ARRAYS}
        client_id = _scalar(got["client_id"], "client_id", _CLIENT_IDS)
        config = None
        if not _CONFIG_KEYS.isdisjoint(arrays):
            try:
                config = SecAggConfig.from_record(arrays, prefix)
            except ValueError as error:
                raise ValueError(f"not a SecAgg+ client state: {error}") from None
        state = cls(
            seed=_bytes_of(got["seed"], "seed"),
            session=_bytes_of(got["session"], "session"),
            stage=Stage(_scalar(got["stage"], "stage", _STAGES)),
            client_id=None if client_id < 0 else client_id,
            contributes=bool(_scalar(got["contributes"], "contributes", range(2))),
            config=config,
            **{name: got[name] for name in _ROWS},
        )
        state.check()
        return state

    def check(self) -> None:
        """ValueError unless the rows agree in shape (one per neighbour / share owner) and a
        client with neighbours has its protocol id and the round's config."""
        count, owners = self.neighbours.size, self.share_owners.size
        shapes = {
            "neighbours": (self.neighbours.shape, {(count,)}),
            "neighbour_keys": (self.neighbour_keys.shape, {(count, 2 * PUBLIC_KEY_BYTES)}),
            "receive_keys": (self.receive_keys.shape, {(0, 32), (count, 32)}),
            "mask_seeds": (self.mask_seeds.shape, {(0, SEED_BYTES), (count, SEED_BYTES)}),
            "share_owners": (self.share_owners.shape, {(owners,)}),
            "shares": (self.shares.shape, {(owners, SHARE_ROW_LENGTH)}),
        }
        for name, (shape, allowed) in shapes.items():
            if shape not in allowed:
                raise ValueError(
                    f"not a SecAgg+ client state: {name!r} has shape {shape}; allowed: "
                    f"{sorted(allowed)}"
                )
        if (self.client_id is None) != (self.config is None):
            raise ValueError(
                "not a SecAgg+ client state: 'client_id' and the 'config.*' entries come "
                "together (both from SHARE_KEYS on)"
            )
        early = (Stage.SETUP, Stage.ADVERTISE_KEYS, Stage.ABORTED)
        if self.client_id is None and (count or owners or self.stage not in early):
            raise ValueError(
                f"not a SecAgg+ client state: stage {self.stage.name} without a protocol id; "
                f"allowed: {', '.join(s.name for s in early)}"
            )


_CONFIG_KEYS = frozenset(SecAggKeys.STATE_CONFIG_PREFIX + name for name in SecAggKeys.CONFIG)
_KNOWN = frozenset(SecAggKeys.STATE_ARRAYS) | _CONFIG_KEYS
"""Every entry a protocol state may have."""
_STAGES = range(min(s.value for s in Stage), max(s.value for s in Stage) + 1)
_CLIENT_IDS = range(-1, 2**63 - 1)
_ROWS = ("neighbours", "neighbour_keys", "receive_keys", "mask_seeds", "share_owners", "shares")


@dataclass(frozen=True, eq=False)
class ClientState:
    """What a SecAgg+ client stores between its stages: the server round it answers, its
    protocol state and its signed integer input (None once masked, or for a client that has
    none)."""

    server_round: int
    protocol: SecAggClientState
    values: np.ndarray | None = None

    @property
    def stage(self) -> Stage:
        return self.protocol.stage

    def to_arrays(self) -> dict[str, np.ndarray]:
        """Named integer arrays: the protocol state's, ``round`` and (while held) ``input``."""
        arrays = self.protocol.to_arrays()
        arrays[SecAggKeys.STATE_SERVER_ROUND] = np.array(self.server_round, dtype=np.int64)
        if self.values is not None:
            arrays[SecAggKeys.STATE_INPUT] = np.asarray(self.values)
        return arrays

    @classmethod
    def from_arrays(cls, arrays: Mapping[str, object]) -> ClientState:
        """The state :meth:`to_arrays` wrote; ValueError naming what is malformed."""
        arrays = dict(arrays)
        values = arrays.pop(SecAggKeys.STATE_INPUT, None)
        if values is not None:
            values = _entry({SecAggKeys.STATE_INPUT: values}, SecAggKeys.STATE_INPUT)
        name = SecAggKeys.STATE_SERVER_ROUND
        server_round = _scalar(_entry(arrays, name), name, range(2**63 - 1))
        del arrays[name]
        return cls(server_round, SecAggClientState.from_arrays(arrays), values)
