"""Quantised client uploads: the wire format, and a Flower mod that applies it.

A client's upload is its model update ``delta = local - global``, layer by
layer quantised with :mod:`fedsim.workloads.compression` and packed into bytes,
so the reply's ArrayRecord holds what a deployment would ship and the engine's
``bytes_up`` (rounds.jsonl) measures it. The reply also carries the exact count
as the metric ``upload-bits`` (codes + norms + adapted levels; no headers).

Reply layout (under the instruction's ArrayRecord key)::

    ArrayRecord   {layer name: packed codes (uint8), "fedsim.norms": float32[layers]}
    ConfigRecord  "fedsim.quantized": {"layers": [...], "bits": [...], "kinds": [...],
                                       "levels.<kind>": [...] per layer type,
                                       adapted levels only}

:func:`dequantize_reply` restores ``global + Q(delta)`` on the server
(``strategies.methods.quantized.DequantizedUploads`` does it for any strategy).
Draws come from ``(base seed, config seed, server round, partition id)``.
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np
from flwr.app import ArrayRecord, ConfigRecord, Context, Message, MetricRecord, RecordDict
from flwr.clientapp.typing import ClientAppCallable, Mod

from fedsim.record_codec import records_of, to_numpy, to_record
from fedsim.workloads.compression import (
    Quantization,
    decode,
    encode,
    intervals_for_bits,
    layer_levels,
    layer_type,
    quantize,
    uniform_levels,
    wire_bits,
)

QUANTIZED = "fedsim.quantized"
NORMS = "fedsim.norms"
UPLOAD_BITS = "upload-bits"


def quantize_update(
    global_arrays: Mapping[str, np.ndarray],
    local_arrays: Mapping[str, np.ndarray],
    config: Quantization,
    rng: np.random.Generator,
) -> tuple[ArrayRecord, ConfigRecord, int]:
    """Pack ``Q(local - global)`` layer by layer; returns (arrays, layout, bits on the wire)."""
    if set(global_arrays) != set(local_arrays):
        raise ValueError(
            f"local layers {sorted(local_arrays)} differ from global {sorted(global_arrays)}"
        )
    names = list(local_arrays)
    deltas = {
        n: np.asarray(local_arrays[n], np.float64) - np.asarray(global_arrays[n], np.float64)
        for n in names
    }
    levels = layer_levels(deltas, config)
    kinds = {n: layer_type(n, np.shape(deltas[n])) for n in names}
    bits = {n: config.bits_of(kinds[n]) for n in names}
    packed: dict[str, np.ndarray] = {}
    norms = np.zeros(len(names), np.float32)
    for i, name in enumerate(names):
        layer = quantize(deltas[name], levels[kinds[name]], rng)
        packed[name] = encode(layer, bits[name])
        norms[i] = layer.norm
    packed[NORMS] = norms
    layout = ConfigRecord(
        {
            "layers": names,
            "bits": [bits[n] for n in names],
            "kinds": [kinds[n] for n in names],
        }
    )
    if config.levels == "adaptive":  # uniform levels follow from the bits
        for kind, values in levels.items():
            layout[f"levels.{kind}"] = [float(x) for x in values]
    adapted = sum(len(v) - 2 for v in levels.values()) if config.levels == "adaptive" else 0
    total = wire_bits({n: int(np.size(deltas[n])) for n in names}, bits, adapted)
    return to_record(packed), layout, total


def dequantize_update(
    global_arrays: Mapping[str, np.ndarray], packed: ArrayRecord, layout: ConfigRecord
) -> dict[str, np.ndarray]:
    """``global + Q(delta)`` from a packed upload (float32, in the global arrays' dtypes)."""
    arrays = to_numpy(packed)
    names = [str(n) for n in layout["layers"]]
    if set(names) != set(global_arrays):
        raise ValueError(
            f"upload layers {sorted(names)} differ from global {sorted(global_arrays)}"
        )
    norms = arrays[NORMS]
    result = {}
    for i, (name, bits, kind) in enumerate(
        zip(names, layout["bits"], layout["kinds"], strict=True)
    ):
        base = np.asarray(global_arrays[name])
        key = f"levels.{kind}"
        levels = (
            np.asarray(layout[key], np.float64)
            if key in layout
            else uniform_levels(intervals_for_bits(int(bits)))
        )
        delta = decode(arrays[name], float(norms[i]), levels, int(bits), base.shape)
        result[name] = (base + delta).astype(base.dtype)
    return result


def _round_of(message: Message) -> int:
    for _, record in records_of(message.content, ConfigRecord):
        if "server-round" in record:
            return int(record["server-round"])
    return 0


def _single_arrays(content: RecordDict) -> tuple[str, ArrayRecord]:
    records = records_of(content, ArrayRecord)
    if len(records) != 1:
        raise ValueError(f"expected one ArrayRecord in the message, found {len(records)}")
    return records[0]


def quantized_upload(config: Quantization, base_seed: int = 0) -> Mod:
    """A ClientApp mod that replaces a train reply's arrays by their packed quantised update.

    Draws come from ``SeedSequence([base_seed, config.seed, server_round, partition_id, 0x51])``.
    """

    def mod(message: Message, context: Context, call_next: ClientAppCallable) -> Message:
        reply = call_next(message, context)
        if not message.metadata.message_type.startswith("train") or reply.has_error():
            return reply
        key, sent = _single_arrays(message.content)
        reply_key, trained = _single_arrays(reply.content)
        partition = int(context.node_config.get("partition-id", 0))
        words = [base_seed, config.seed, _round_of(message), partition, 0x51]
        rng = np.random.default_rng(np.random.SeedSequence(words))
        packed, layout, bits = quantize_update(to_numpy(sent), to_numpy(trained), config, rng)
        content = RecordDict()
        for name, record in reply.content.items():
            if name == reply_key:
                content[name] = packed
            elif isinstance(record, MetricRecord):
                content[name] = MetricRecord({**dict(record.items()), UPLOAD_BITS: bits})
            else:
                content[name] = record
        content[QUANTIZED] = layout
        reply.content = content
        return reply

    return mod


def dequantize_reply(reply: Message, global_arrays: Mapping[str, np.ndarray]) -> Message:
    """``reply`` with its packed upload replaced by the full arrays (others unchanged)."""
    if reply.has_error() or QUANTIZED not in reply.content:
        return reply
    layout = reply.content[QUANTIZED]
    key, packed = _single_arrays(reply.content)
    content = RecordDict()
    for name, record in reply.content.items():
        if name == key:
            content[name] = to_record(dequantize_update(global_arrays, packed, layout))
        elif name != QUANTIZED:
            content[name] = record
    reply.content = content
    return reply
