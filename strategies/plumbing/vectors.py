"""A model's arrays as one vector: what the strategies that encode a whole update share.

DDGauss, DMM and FedAvg over a secure sum (:mod:`strategies.plumbing.secure_aggregation`) encode
each client's update as one float64 vector in record order (:func:`flatten`), and give the decoded
mean back the global model's shapes (:func:`unflatten`); :func:`trained_update` is the client
side: train with the wrapped ClientApp and take ``trained - global`` as that vector.
"""

from __future__ import annotations

import numpy as np
from flwr.app import ArrayRecord, Context, Message, MetricRecord
from flwr.clientapp import ClientApp

from fedsim.record_codec import to_numpy
from fedsim.worker_reduce import single


def flatten(arrays: dict[str, np.ndarray]) -> np.ndarray:
    """The arrays' entries, in record order, as one float64 vector."""
    return np.concatenate([np.asarray(v, dtype=np.float64).ravel() for v in arrays.values()])


def unflatten(vector: np.ndarray, like: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """:func:`flatten` undone: ``vector`` split into arrays shaped like ``like``, in its order."""
    out, start = {}, 0
    for key, value in like.items():
        out[key] = vector[start : start + value.size].reshape(value.shape)
        start += value.size
    return out


def trained_update(
    inner: ClientApp, message: Message, context: Context, global_record: ArrayRecord
) -> Message | tuple[np.ndarray, MetricRecord]:
    """Train with ``inner``: its error reply, or the flattened update (trained minus global)
    and its metrics."""
    reply = inner(message, context)
    if reply.has_error():
        return reply
    _, trained = single(reply.content, ArrayRecord)
    _, metrics = single(reply.content, MetricRecord)
    return difference(to_numpy(trained), to_numpy(global_record)), metrics


def difference(trained: dict[str, np.ndarray], base: dict[str, np.ndarray]) -> np.ndarray:
    """``flatten(trained) - flatten(base)``, the same float64 values, in one pass per array
    (each pair cast to float64 and subtracted straight into the vector)."""
    if list(trained) != list(base):
        raise ValueError(f"the trained arrays {list(trained)} are not the global {list(base)}")
    sizes = [np.size(value) for value in trained.values()]
    out, start = np.empty(sum(sizes), dtype=np.float64), 0
    for (key, value), size in zip(trained.items(), sizes, strict=True):
        other = np.asarray(base[key])
        if other.size != size:
            raise ValueError(f"array {key!r}: trained has {size} entries, global {other.size}")
        np.subtract(
            np.asarray(value).ravel(), other.ravel(), out=out[start : start + size],
            dtype=np.float64,
        )
        start += size
    return out
