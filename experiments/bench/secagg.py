"""Benchmark: our SecAgg+ (protocols/secagg/common.py) vs Flower 1.42's SecAgg+, same vectors.

Workload: ``--clients`` (100) clients, each with a float32 vector of length d in [-1, 1]
(d in ``--dims``, default 10^5 and 10^6), every client ``--degree`` (16) neighbours and a
reconstruction threshold of ``--threshold`` (9) shares, no dropouts, one round, one process.

* **ours**: :class:`protocols.secagg.client.SecAggClient` and
  :class:`protocols.secagg.server.SecAggServer` driven stage by stage (as
  :func:`protocols.secagg.server.run_secagg` does), the server checking every message as it
  does in a run. Inputs are fixed-point integers (round(x * 2^q), q = ``--fraction-bits``)
  masked in the ring Z_{2^32}
  (``SecAggConfig.ring_bits=32``; the bit budget n * 2^q < 2^31 is checked first) with
  ChaCha20 masks; seeds and keys are Shamir-shared over F_p and sent over X25519 +
  ChaCha20-Poly1305 channels. ``--field-dims`` also runs the F_p variant (8-byte elements).
* **Flower**: the per-client stage functions of ``flwr.client.mod.secure_aggregation.
  secaggplus_mod`` (``_setup``, ``_share_keys``, ``_collect_masked_vectors``, ``_unmask``:
  key generation, Shamir shares of the seeds, encryption, quantisation, masks from
  ``pseudo_rand_gen``) called directly on the same vectors, with Flower's default ranges
  (clipping 8, quantisation 2^22, modulus 2^32, ``max_weight`` 1 and weight 1); the server
  side is the arithmetic of ``SecAggPlusWorkflow.collect_masked_vectors_stage`` and
  ``unmask_stage`` made with Flower's own primitives (``parameters_addition``,
  ``combine_shares``, ``pseudo_rand_gen``, ``parameters_mod``, ``factor_extract``,
  ``dequantize``), on the same Harary neighbour graph (``num_shares`` = degree + 1, itself
  included, as Flower counts).

Both sides serialise the masked vector (ours: raw little-endian words, Flower: ``.npy`` via
``ndarray_to_bytes``) and the server parses it back. Times are wall times (perf_counter) summed
over a role: ``client_s`` is the
mean per client over all clients, ``server_s`` the server's total. Flower releases the
weighted mean (its error is against the mean), ours the sum. ``bytes_per_client`` is what
one client sends (public keys, encrypted shares, masked vector, unmask shares; our count
includes message headers, Flower's is the payload only). Both aggregates are checked against
the true sum. Prints one JSON object; per d:
``speedup_vs_flower_secaggplus = (flower clients + server) / (ours clients + server)``
(total compute of the round) and ``bytes_ratio_vs_flower_secaggplus = ours / Flower``.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import time
from collections import defaultdict
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from protocols.channels import new_session_id  # noqa: E402
from protocols.field import DEFAULT_FIELD  # noqa: E402
from protocols.secagg.client import SecAggClient  # noqa: E402
from protocols.secagg.common import SecAggConfig  # noqa: E402
from protocols.secagg.server import SecAggServer  # noqa: E402

FLOWER_CLIPPING_RANGE = 8.0
FLOWER_QUANTIZATION_RANGE = 2**22
FLOWER_MODULUS_RANGE = 2**32


def client_vectors(clients: int, dim: int, seed: int) -> dict[int, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {i: rng.uniform(-1.0, 1.0, size=dim).astype(np.float32) for i in range(1, clients + 1)}


def run_ours(
    vectors: dict[int, np.ndarray], degree: int, threshold: int, fraction_bits: int, ring: bool
) -> dict:
    """One round of our SecAgg+, timing the clients' and the server's handlers apart."""
    ids = sorted(vectors)
    dim = vectors[ids[0]].size
    bits = 32 if ring else None
    if ring and len(ids) * 2**fraction_bits >= 2**31:
        raise ValueError(
            f"fraction_bits={fraction_bits}: {len(ids)} clients * 2^{fraction_bits} does not fit "
            "the 31 magnitude bits of Z_2^32"
        )
    config = SecAggConfig(
        num_clients=len(ids), degree=degree, threshold=threshold, vector_length=dim, ring_bits=bits
    )
    space = config.masking
    session = new_session_id()
    client_time: dict[int, float] = defaultdict(float)
    server_time = 0.0

    def as_client(i, fn, *args, **kwargs):
        start = time.perf_counter()
        out = fn(*args, **kwargs)
        client_time[i] += time.perf_counter() - start
        return out

    def as_server(fn, *args):
        nonlocal server_time
        start = time.perf_counter()
        out = fn(*args)
        server_time += time.perf_counter() - start
        return out

    def encode(x: np.ndarray) -> np.ndarray:
        integers = np.rint(x.astype(np.float64) * 2.0**fraction_bits).astype(np.int64)
        return space.encode_signed(integers)

    server = SecAggServer(config, ids, session, np.random.default_rng(0))
    clients = {i: SecAggClient(session) for i in ids}
    keys = {i: as_client(i, clients[i].advertise_keys) for i in ids}
    routed = as_server(server.advertise_keys, keys)
    outgoing = {i: as_client(i, clients[i].share_keys, i, config, routed[i]) for i in ids}
    incoming = as_server(server.share_keys, outgoing)
    wire = np.dtype(f"<u{space.bytes_per_element}") if ring else np.dtype("<i8")
    payloads = {
        i: as_client(
            i,
            lambda i=i: (
                clients[i]
                .masked_input(incoming[i], encode(vectors[i]))
                .astype(wire, copy=False)
                .tobytes()
            ),
        )
        for i in ids
    }
    masked = as_server(lambda: {i: np.frombuffer(b, dtype=wire) for i, b in payloads.items()})
    survivors, dropped = as_server(server.masked_input, masked)
    responses = {i: as_client(i, clients[i].unmask, survivors, dropped) for i in ids}
    total = as_server(server.unmask, responses)
    decoded = space.decode_signed(total).astype(np.float64) / 2.0**fraction_bits
    truth = np.sum([vectors[i].astype(np.float64) for i in ids], axis=0)
    sent = [server.transcript.nbytes(sender=i) for i in ids]
    received = [server.transcript.nbytes(receiver=i) for i in ids]
    return {
        "masking": "Z_2^32" if ring else f"F_p (p = 2^{DEFAULT_FIELD.exponent} - 1)",
        "client_s": float(np.mean(list(client_time.values()))),
        "server_s": server_time,
        "total_s": float(sum(client_time.values())) + server_time,
        "bytes_per_client": float(np.mean(sent)),
        "bytes_received_per_client": float(np.mean(received)),
        "max_abs_error": float(np.max(np.abs(decoded - truth))),
    }


def run_flower(vectors: dict[int, np.ndarray], degree: int, threshold: int) -> dict:
    """One round of Flower's SecAgg+ client stages and the workflow's server arithmetic."""
    import importlib  # noqa: PLC0415

    from flwr.common import bytes_to_ndarray, ndarrays_to_parameters  # noqa: PLC0415
    from flwr.common.secure_aggregation.crypto.shamir import combine_shares  # noqa: PLC0415
    from flwr.common.secure_aggregation.ndarrays_arithmetic import (  # noqa: PLC0415
        factor_extract,
        get_parameters_shape,
        parameters_addition,
        parameters_mod,
        parameters_subtraction,
    )
    from flwr.common.secure_aggregation.quantization import dequantize  # noqa: PLC0415
    from flwr.common.secure_aggregation.secaggplus_constants import Key  # noqa: PLC0415
    from flwr.common.secure_aggregation.secaggplus_utils import (  # noqa: PLC0415
        pseudo_rand_gen,
    )

    # the module (the package re-exports its mod function under the same name)
    mod = importlib.import_module("flwr.client.mod.secure_aggregation.secaggplus_mod")
    ids = sorted(vectors)
    count = len(ids)
    num_shares = degree + 1
    client_time: dict[int, float] = defaultdict(float)
    sent: dict[int, int] = defaultdict(int)
    server_time = 0.0

    def as_client(i, fn, *args):
        start = time.perf_counter()
        out = fn(*args)
        client_time[i] += time.perf_counter() - start
        return out

    # the workflow's graph: each client with num_shares // 2 on either side (itself included)
    order = list(ids)
    random.Random(0).shuffle(order)
    half = num_shares >> 1
    neighbours = {
        nid: {order[(idx + off) % count] for off in range(-half, half + 1)}
        for idx, nid in enumerate(order)
    }
    setup = {
        Key.SAMPLE_NUMBER: count,
        Key.SHARE_NUMBER: num_shares,
        Key.THRESHOLD: threshold,
        Key.CLIPPING_RANGE: FLOWER_CLIPPING_RANGE,
        Key.TARGET_RANGE: FLOWER_QUANTIZATION_RANGE,
        Key.MOD_RANGE: FLOWER_MODULUS_RANGE,
        Key.MAX_WEIGHT: 1.0,
    }
    states = {i: mod.SecAggPlusState(nid=i) for i in ids}
    public = {}
    for i in ids:
        out = as_client(i, mod._setup, states[i], setup)
        public[i] = (out[Key.PUBLIC_KEY_1], out[Key.PUBLIC_KEY_2])
        sent[i] += len(public[i][0]) + len(public[i][1])
    forward: dict[int, list[tuple[int, bytes]]] = defaultdict(list)
    for i in ids:
        keys = {str(j): public[j] for j in neighbours[i]}
        out = as_client(i, mod._share_keys, states[i], keys)
        for dst, ciphertext in zip(out[Key.DESTINATION_LIST], out[Key.CIPHERTEXT_LIST]):
            forward[dst].append((i, ciphertext))
            sent[i] += 8 + len(ciphertext)
    masked_bytes = {}
    for i in ids:
        configs = {
            Key.CIPHERTEXT_LIST: [c for _, c in forward[i]],
            Key.SOURCE_LIST: [s for s, _ in forward[i]],
        }
        parameters = ndarrays_to_parameters([vectors[i]])
        out = as_client(i, mod._collect_masked_vectors, states[i], configs, 1, parameters)
        masked_bytes[i] = out[Key.MASKED_PARAMETERS]
        sent[i] += sum(len(b) for b in masked_bytes[i])
    start = time.perf_counter()
    masked_vector = None
    for i in ids:
        vec = [bytes_to_ndarray(b) for b in masked_bytes[i]]
        masked_vector = vec if masked_vector is None else parameters_addition(masked_vector, vec)
    masked_vector = parameters_mod(masked_vector, FLOWER_MODULUS_RANGE)
    server_time += time.perf_counter() - start
    collected: dict[int, list[bytes]] = {i: [] for i in ids}
    for i in ids:
        configs = {Key.ACTIVE_NODE_ID_LIST: list(neighbours[i]), Key.DEAD_NODE_ID_LIST: []}
        out = as_client(i, mod._unmask, states[i], configs)
        for owner, share in zip(out[Key.NODE_ID_LIST], out[Key.SHARE_LIST]):
            collected[owner].append(share)
            sent[i] += 8 + len(share)
    start = time.perf_counter()
    for i in ids:
        secret = combine_shares(collected[i])
        private = pseudo_rand_gen(secret, FLOWER_MODULUS_RANGE, get_parameters_shape(masked_vector))
        masked_vector = parameters_subtraction(masked_vector, private)
    recon = parameters_mod(masked_vector, FLOWER_MODULUS_RANGE)
    q_total_ratio, recon = factor_extract(recon)
    inv_dq_total_ratio = FLOWER_QUANTIZATION_RANGE / q_total_ratio
    aggregated = dequantize(recon, FLOWER_CLIPPING_RANGE, FLOWER_QUANTIZATION_RANGE)
    offset = -(count - 1) * FLOWER_CLIPPING_RANGE
    for vec in aggregated:
        vec += offset
        vec *= inv_dq_total_ratio
    server_time += time.perf_counter() - start
    # the workflow divides by the total weight: it releases the (weighted) mean
    truth = np.mean([vectors[i].astype(np.float64) for i in ids], axis=0)
    return {
        "masking": "Z_2^32 (int64 on the wire)",
        "client_s": float(np.mean(list(client_time.values()))),
        "server_s": server_time,
        "total_s": float(sum(client_time.values())) + server_time,
        "bytes_per_client": float(np.mean([sent[i] for i in ids])),
        "max_abs_error": float(np.max(np.abs(aggregated[0] - truth))),
    }


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--dims", type=int, nargs="+", default=[10**5, 10**6])
    parser.add_argument("--clients", type=int, default=100)
    parser.add_argument("--degree", type=int, default=16)
    parser.add_argument("--threshold", type=int, default=9)
    parser.add_argument("--fraction-bits", type=int, default=24)
    parser.add_argument(
        "--field-dims", type=int, nargs="*", default=[10**5], help="dims to also run over F_p"
    )
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    results = {
        "clients": args.clients,
        "degree": args.degree,
        "threshold": args.threshold,
        "cpu_count": os.cpu_count(),
        "runs": [],
    }
    for dim in args.dims:
        vectors = client_vectors(args.clients, dim, args.seed)
        ours = run_ours(vectors, args.degree, args.threshold, args.fraction_bits, ring=True)
        flower = run_flower(vectors, args.degree, args.threshold)
        row = {
            "dim": dim,
            "ours": ours,
            "flower_secaggplus": flower,
            "speedup_vs_flower_secaggplus": flower["total_s"] / ours["total_s"],
            "client_speedup": flower["client_s"] / ours["client_s"],
            "server_speedup": flower["server_s"] / ours["server_s"],
            "bytes_ratio_vs_flower_secaggplus": ours["bytes_per_client"]
            / flower["bytes_per_client"],
        }
        if dim in args.field_dims:
            field = run_ours(vectors, args.degree, args.threshold, args.fraction_bits, ring=False)
            row["ours_field"] = field
            row["field_speedup_vs_flower_secaggplus"] = flower["total_s"] / field["total_s"]
            row["field_bytes_ratio_vs_flower_secaggplus"] = (
                field["bytes_per_client"] / flower["bytes_per_client"]
            )
        results["runs"].append(row)
        print(json.dumps(row), file=sys.stderr, flush=True)
    results["speedup_vs_flower_secaggplus"] = min(
        r["speedup_vs_flower_secaggplus"] for r in results["runs"]
    )
    results["bytes_ratio_vs_flower_secaggplus"] = max(
        r["bytes_ratio_vs_flower_secaggplus"] for r in results["runs"]
    )
    print(json.dumps(results, indent=2))
    return results


if __name__ == "__main__":
    main()
