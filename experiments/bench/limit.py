"""Benchmark: one DDGauss full-mode client's secure round against its limit, in one run.

The **limit** of an exchange is the sum of the kernels the client cannot avoid in it, each
timed on this machine at the sizes the protocol uses (D = the padded dimension of ``--dims``,
the SecAgg+ degree ``--degree``, masks in Z_2^``--ring-bits``, the sum budget ``--bits``,
one point per cohort of ``--cohorts`` clients: the cohort sets sigma and gamma):

* ``train``: the randomised Hadamard rotation of the clipped update (D values,
  :func:`protocols.encoding.rotate`), the randomised rounding (one draw of D and the norm
  check, :func:`protocols.encoding.conditional_round`), D exact discrete Gaussian draws
  (:func:`fedsim.privacy.discrete_gaussian.discrete_gaussian`, the fastest exact sampler in
  the tree), the two X25519 public keys, one Ed25519 signature (the key proof of an enrolled
  client) and the AEAD seal of the state it stores;
* ``share_keys``: two Ed25519 verifications, one key proof and one certificate (a worker
  checks each cohort member's certificate, and each relayed key proof, once for all its
  clients, so it verifies one of each per client it hosts), ``2 degree`` X25519 agreements
  with their HKDF (a channel and a mask seed per neighbour: the neighbours' keys arrive
  here), the Shamir sharing of the two 32-byte secrets, ``degree`` ChaCha20-Poly1305 seals
  of a share row, and the AEAD open and seal of the state;
* ``masked_input``: ``degree`` AEAD opens of the share rows, ``(degree + 1) * D`` keystream
  words at the measured throughput of the mask PRG ``--prg`` (ChaCha20 or AES-256-CTR,
  :class:`protocols.secagg.prg.MaskPRG`, written into a buffer), ``degree + 1`` in-place
  additions of D words, and the state's AEAD open and seal;
* ``unmask``: the state's AEAD open and seal.

The state seals are counted at the sizes the client really stores (read off its context), so
a state kept wider than needed shows in the kernel, not in the ratio.

The **message floor** of an exchange is what any Flower ClientApp pays to answer that
exchange's message with that reply, whatever it computes: an echo ClientApp (the same
``train`` / ``query.secagg_*`` handlers, each returning a new ``RecordDict`` of the real
reply's records) is called on every message right after the real client, in the same
context. It is reported beside the limit, not in it: ``floor_s`` and
``ratio_over_floor = client_s / (limit_s + floor_s)``, so that what is above the kernels
splits into the message handling every ClientApp has and the client's own Python.

The **client** is the real one: :func:`strategies.methods.ddgauss.client.ddgauss_client_app` (its
inner app the synthetic update of experiments/bench/secure_scale.py, whose seconds are subtracted)
for ``degree + 1`` enrolled clients with sealed state (the engine's node_config: a secret and an
enrolment from a fresh root each round), driven by the real strategy
(:class:`strategies.methods.ddgauss.strategy.DDGauss`, ``mode = "full"``) through an in-process grid
that times each ClientApp call as fedsim's worker does. Every client then has ``degree`` neighbours,
as in a cohort of any size at that degree; the survivor list of UNMASK is lengthened to
``--cohorts`` ids, as every client of such a cohort gets it. Every round of the clients is
followed by ``--repeats`` timings of every kernel, so that both see the same spells of a
shared machine.
Reported per exchange: the median client seconds over all calls of ``--rounds`` rounds, the
limit (the sum of the kernels' medians) and ``ratio = client_s / limit_s``, in this process's
CPU seconds (``time.process_time``: other jobs on the machine do not count) and, with the
suffix ``_wall``, in wall seconds.
Both run with ``--blas-threads`` BLAS threads (default 1, as in an engine worker: an actor of one
CPU, whose OMP_NUM_THREADS Ray sets to 1), so a threaded norm does not inflate both sides, and
with an engine worker's heap (:func:`fedsim.engine.allocator.keep_freed_memory`; ``worker_heap``
in the file says whether it applied).

Writes ``--out`` (default experiments/bench/limit.json) under ``--label`` (other labels in
the file are kept: "before" / "after" a change; ``--merge`` also keeps the label's points of
other sizes, so that runs of two trees can alternate point by point); ``--table-only``
prints the markdown table of the stored file (docs/benchmarks.md). Run it under ``nice``:

    nice -n 10 .venv/bin/python experiments/bench/limit.py --label after
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import numpy as np  # noqa: E402
from cryptography.hazmat.primitives import hashes  # noqa: E402
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey  # noqa: E402
from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey  # noqa: E402
from cryptography.hazmat.primitives.ciphers.aead import ChaCha20Poly1305  # noqa: E402
from cryptography.hazmat.primitives.kdf.hkdf import HKDF  # noqa: E402

from fedsim.engine.allocator import keep_freed_memory  # noqa: E402

EXCHANGES = ("train", "share_keys", "masked_input", "unmask")
MESSAGE_EXCHANGE = {
    "train": "train",
    "query.secagg_share_keys": "share_keys",
    "query.secagg_masked_input": "masked_input",
    "query.secagg_unmask": "unmask",
}
STAGE_OF_EXCHANGE = {"train": 1, "share_keys": 2, "masked_input": 3, "unmask": 4}


CLOCKS = ("cpu", "wall")
"""``cpu``: this process's CPU seconds (``time.process_time``: a shared machine's other jobs
do not count), ``wall``: wall seconds; the ratios are quoted in CPU seconds."""


def now() -> tuple[float, float]:
    return time.process_time(), time.perf_counter()


def since(start: tuple[float, float]) -> tuple[float, float]:
    cpu, wall = now()
    return cpu - start[0], wall - start[1]


def samples(call: Callable[[], Any], repeats: int) -> list[tuple[float, float]]:
    """``repeats`` (cpu, wall) seconds of one call of ``call``, each the mean of a batch long
    enough (about a millisecond) for the clocks' resolution (after one warm-up call)."""
    start = now()
    call()
    once = max(since(start)[1], 1e-7)
    number = max(1, min(1000, int(1e-3 / once)))
    out = []
    for _ in range(repeats):
        start = now()
        for _ in range(number):
            call()
        cpu, wall = since(start)
        out.append((cpu / number, wall / number))
    return out


def medians(pairs: list[tuple[float, float]]) -> dict[str, float]:
    return {
        clock: statistics.median(p[index] for p in pairs) for index, clock in enumerate(CLOCKS)
    }


# ----------------------------------------------------------------------------- the client
class TimedInner:
    """The wrapped training ClientApp, timing each call so that its seconds (training, not
    secure work) are subtracted from the train exchange."""

    def __init__(self, app) -> None:
        self.app, self.last = app, (0.0, 0.0)

    def __call__(self, message, context):
        start = now()
        reply = self.app(message, context)
        self.last = since(start)
        return reply


class EchoApp:
    """A Flower ClientApp with the client's handlers (``train`` and ``query.secagg_*``) that
    computes nothing: each returns a new ``RecordDict`` of the records of the reply it is
    given. :meth:`time` is one call's (cpu, wall) seconds, the message floor."""

    def __init__(self) -> None:
        from flwr.app import Message, RecordDict  # noqa: PLC0415
        from flwr.clientapp import ClientApp  # noqa: PLC0415

        from strategies.secure.secagg_messages import ACTIONS  # noqa: PLC0415

        self.app, self.reply = ClientApp(), None

        def answer(message, context):
            return Message(content=RecordDict(dict(self.reply.content.items())), reply_to=message)

        self.app.train()(answer)
        for action in ACTIONS.values():
            self.app.query(action)(answer)

    def time(self, message, context, reply) -> tuple[float, float]:
        self.reply = reply
        start = now()
        self.app(message, context)
        return since(start)


class InProcessGrid:
    """A Grid that runs each message through the ClientApp in this process, one persistent
    Context per node (its node_config as fedsim's worker builds it), and records each call's
    (cpu, wall) seconds by exchange, as the worker's ``compute_s`` does."""

    def __init__(self, app, inner: TimedInner, node_ids: list[int], cohort: int) -> None:
        self.app, self.inner, self.node_ids = app, inner, list(node_ids)
        self.cohort = cohort
        self.echo = EchoApp()
        self.contexts: dict[int, Any] = {}
        self.seconds: dict[str, list[tuple[float, float]]] = {e: [] for e in EXCHANGES}
        self.floor: dict[str, list[tuple[float, float]]] = {e: [] for e in EXCHANGES}
        self.state_bytes: dict[str, list[int]] = {e: [] for e in EXCHANGES}

    def open_round(self, root) -> None:
        """Fresh contexts: every client's secret and enrolment from ``root``."""
        from flwr.app import Context, RecordDict  # noqa: PLC0415
        from flwr.common.constant import NUM_PARTITIONS_KEY, PARTITION_ID_KEY  # noqa: PLC0415

        from fedsim.engine.client_registry import NODE_ID_OFFSET, Enrolment  # noqa: PLC0415
        from fedsim.randomness import NODE_SECRET_KEY  # noqa: PLC0415

        enrolment = Enrolment(root)
        self.contexts = {}
        for node in self.node_ids:
            partition = node - NODE_ID_OFFSET
            own = root.client(partition)
            config = {
                PARTITION_ID_KEY: partition,
                NUM_PARTITIONS_KEY: len(self.node_ids),
                NODE_SECRET_KEY: own.token(),
                **enrolment.node_entries(partition, own),
            }
            self.contexts[node] = Context(
                run_id=1, node_id=node, node_config=config, state=RecordDict(), run_config={}
            )

    def get_node_ids(self) -> list[int]:
        return list(self.node_ids)

    def _list_cohort(self, content) -> None:
        """UNMASK's survivor list at the size of a cohort of ``cohort``: the strategy's lists
        of its ``degree + 1`` clients, the survivors followed by ids of further clients (no
        neighbours of these, so no client answers for them), as every client of a cohort of
        that size gets them."""
        from flwr.app import ConfigRecord  # noqa: PLC0415

        from protocols.secagg.common import SecAggKeys  # noqa: PLC0415

        listing = content[SecAggKeys.SURVIVORS]
        survivors, dropped = (list(listing[k]) for k in SecAggKeys.SURVIVOR_ENTRIES)
        start = max(survivors + dropped) + 1
        survivors += range(start, start + self.cohort - len(survivors) - len(dropped))
        entries = dict(zip(SecAggKeys.SURVIVOR_ENTRIES, (survivors, dropped)))
        content[SecAggKeys.SURVIVORS] = ConfigRecord(entries)

    def send_and_receive(self, messages, *, timeout=None):
        from flwr.supercore.task_identity import TaskIdentity  # noqa: PLC0415

        from protocols.secagg.common import SecAggKeys  # noqa: PLC0415

        replies = []
        listed: set[int] = set()
        for message in messages:
            node = int(message.metadata.dst_node_id)
            exchange = MESSAGE_EXCHANGE[message.metadata.message_type]
            if exchange == "unmask" and id(message.content) not in listed:
                listed.add(id(message.content))
                self._list_cohort(message.content)
            context = self.contexts[node]
            TaskIdentity.node_id = node
            self.inner.last = (0.0, 0.0)
            start = now()
            reply = self.app(message, context)
            cpu, wall = since(start)
            TaskIdentity.node_id = 1
            if reply.has_error():
                raise RuntimeError(f"client {node} failed in {exchange}: {reply.error.reason}")
            self.seconds[exchange].append((cpu - self.inner.last[0], wall - self.inner.last[1]))
            self.floor[exchange].append(self.echo.time(message, context, reply))
            stored = context.state.get(SecAggKeys.STATE)
            blob = stored[SecAggKeys.STORED_BLOB] if stored else b""
            self.state_bytes[exchange].append(len(blob))
            replies.append(reply)
        return replies


class ClientRounds:
    """The real DDGauss full-mode strategy and ClientApp on ``degree + 1`` enrolled clients
    (every client has ``degree`` neighbours), one fresh root per round."""

    def __init__(
        self, dim: int, cohort: int, degree: int, ring_bits: int, bits: int, prg: str,
        seed: int = 0,
    ) -> None:
        from flwr.supercore.task_identity import TaskIdentity  # noqa: PLC0415

        from experiments.bench.secure_scale import synthetic_client_app  # noqa: PLC0415
        from fedsim.engine.client_registry import NODE_ID_OFFSET  # noqa: PLC0415
        from fedsim.record_codec import to_record  # noqa: PLC0415
        from strategies.methods.ddgauss.client import ddgauss_client_app  # noqa: PLC0415
        from strategies.methods.ddgauss.spec import from_options  # noqa: PLC0415

        TaskIdentity.run_id = TaskIdentity.task_id = TaskIdentity.node_id = 1
        options = {
            "clipping_norm": 1.0,
            "noise_multiplier": 1.0,
            "mode": "full",
            "secagg_degree": degree,
            "ring_bits": ring_bits,
            "bits": bits,
            "prg": prg,
        }
        self.strategy = from_options(options, expected_clients=cohort, seed=seed)
        inner = TimedInner(synthetic_client_app(dim, seed))
        nodes = [NODE_ID_OFFSET + p for p in range(degree + 1)]
        self.grid = InProcessGrid(ddgauss_client_app(inner), inner, nodes, cohort)
        self.arrays = to_record({"w": np.zeros(dim, dtype=np.float32)})

    def run_round(self, server_round: int) -> None:
        from flwr.app import ConfigRecord  # noqa: PLC0415

        from fedsim.randomness import RunSecret  # noqa: PLC0415

        strategy, grid = self.strategy, self.grid
        grid.open_round(RunSecret.fresh())
        messages = strategy.configure_train(server_round, self.arrays, ConfigRecord(), grid)
        replies = grid.send_and_receive(list(messages))
        strategy.aggregate_train(server_round, replies)
        if strategy.last_abort is not None or len(strategy.last_survivors) != len(grid.node_ids):
            raise RuntimeError(f"round {server_round} did not complete: {strategy.last_abort}")

    def state_sizes(self) -> dict[str, int]:
        return {e: int(statistics.median(v)) for e, v in self.grid.state_bytes.items()}


# ----------------------------------------------------------------------------- the kernels
def _hkdf(shared: bytes) -> bytes:
    return HKDF(algorithm=hashes.SHA256(), length=32, salt=bytes(16), info=b"limit").derive(shared)


def kernel_samples(
    encoder, degree: int, ring_bits: int, prg: str, repeats: int
) -> dict[str, list[tuple[float, float]]]:
    """(cpu, wall) seconds of one unit of each kernel at the encoder's sizes."""
    from fedsim.privacy.discrete_gaussian import discrete_gaussian  # noqa: PLC0415
    from protocols.encoding import clip_l2, conditional_round, rotate, rotation_signs  # noqa: PLC0415
    from protocols.secagg.common import CHUNKS_PER_SECRET, SecAggConfig, shamir_scheme  # noqa: PLC0415
    from protocols.secagg.prg import MaskPRG  # noqa: PLC0415

    padded = encoder.padded_dim
    rng = np.random.default_rng(0)
    update = rng.standard_normal(encoder.dim)
    update *= 0.5 / np.linalg.norm(update)
    signs = rotation_signs(padded, 12345)
    scaled = rotate(clip_l2(update, encoder.clip), signs) / encoder.gamma
    sigma = encoder.scaled_noise_std
    private = X25519PrivateKey.from_private_bytes(bytes(range(32)))
    peer = X25519PrivateKey.from_private_bytes(bytes(range(1, 33))).public_key()
    signer = Ed25519PrivateKey.from_private_bytes(bytes(range(2, 34)))
    statement = bytes(200)
    signature = signer.sign(statement)
    verifier = signer.public_key()
    aead = ChaCha20Poly1305(bytes(32))
    row = np.arange(2 * CHUNKS_PER_SECRET, dtype=np.int64).tobytes()
    sealed_row = aead.encrypt(bytes(12), row, b"aad")
    config = SecAggConfig(degree + 1, degree, degree // 2 + 1, padded, ring_bits=ring_bits)
    scheme = shamir_scheme(config, degree)
    secrets = np.arange(2 * CHUNKS_PER_SECRET, dtype=np.int64)
    word = np.dtype(np.uint32 if ring_bits <= 32 else np.uint64)
    buffer = bytearray(padded * word.itemsize)
    zeros = bytes(len(buffer))
    total = np.zeros(padded, dtype=word)
    mask = np.ones(padded, dtype=word)

    def keystream() -> None:
        MaskPRG(prg).keystream(bytes(32)).update_into(zeros, buffer)

    return {
        "rotation": samples(lambda: rotate(clip_l2(update, encoder.clip), signs), repeats),
        "rounding": samples(
            lambda: conditional_round(scaled, encoder.l2_bound, rng, encoder.max_tries), repeats
        ),
        "noise": samples(lambda: discrete_gaussian(padded, sigma, rng), repeats),
        "x25519_keygen": samples(
            lambda: X25519PrivateKey.from_private_bytes(bytes(32)).public_key().public_bytes_raw(),
            repeats,
        ),
        "x25519_agree": samples(lambda: _hkdf(private.exchange(peer)), repeats),
        "ed25519_sign": samples(lambda: signer.sign(statement), repeats),
        "ed25519_verify": samples(lambda: verifier.verify(signature, statement), repeats),
        "shamir_share": samples(lambda: scheme.share(secrets, rng=rng), repeats),
        "aead_seal_row": samples(lambda: aead.encrypt(bytes(12), row, b"aad"), repeats),
        "aead_open_row": samples(
            lambda: aead.decrypt(bytes(12), sealed_row, b"aad"), repeats
        ),
        "keystream_D": samples(keystream, repeats),
        "mask_add_D": samples(lambda: np.add(total, mask, out=total), repeats),
    }


def state_samples(size: int, repeats: int) -> dict[str, list[tuple[float, float]]]:
    """(cpu, wall) seconds of the ChaCha20-Poly1305 seal and open of ``size`` bytes of state."""
    aead = ChaCha20Poly1305(bytes(32))
    data = bytes(max(size - 28, 0))
    sealed = aead.encrypt(bytes(12), data, b"state")
    return {
        "seal": samples(lambda: aead.encrypt(bytes(12), data, b"state"), repeats),
        "open": samples(lambda: aead.decrypt(bytes(12), sealed, b"state"), repeats),
    }


def exchange_kernels(
    units: dict[str, float], degree: int, state: dict[str, dict[str, float]]
) -> dict[str, dict[str, float]]:
    """Per exchange, each of its kernels' seconds (unit seconds times the count); ``state``:
    per exchange the seal and open seconds of the state it stores."""
    previous = {"share_keys": "train", "masked_input": "share_keys", "unmask": "masked_input"}
    out = {
        "train": {
            "rotation": units["rotation"],
            "rounding": units["rounding"],
            "noise": units["noise"],
            "x25519_keygen x2": 2 * units["x25519_keygen"],
            "ed25519_sign": units["ed25519_sign"],
        },
        "share_keys": {
            "ed25519_verify x2": 2 * units["ed25519_verify"],
            f"x25519_agree x{2 * degree}": 2 * degree * units["x25519_agree"],
            "shamir_share": units["shamir_share"],
            f"aead_seal_row x{degree}": degree * units["aead_seal_row"],
        },
        "masked_input": {
            f"aead_open_row x{degree}": degree * units["aead_open_row"],
            f"keystream_D x{degree + 1}": (degree + 1) * units["keystream_D"],
            f"mask_add_D x{degree + 1}": (degree + 1) * units["mask_add_D"],
        },
        "unmask": {},
    }
    for exchange in EXCHANGES:
        out[exchange]["state_seal"] = state[exchange]["seal"]
        if exchange in previous:
            out[exchange]["state_open"] = state[previous[exchange]]["open"]
    return out


# ----------------------------------------------------------------------------- the run
def measure_point(
    dim: int, cohort: int, degree: int, ring_bits: int, bits: int, rounds: int, repeats: int,
    prg: str, seed: int = 0,
) -> dict[str, Any]:
    """One (d, cohort) point in this process: each round of the real clients is followed by
    one timing of every kernel, so that both see the same spells of a shared machine."""
    clients = ClientRounds(dim, cohort, degree, ring_bits, bits, prg, seed)
    unit_samples: dict[str, list[tuple[float, float]]] = {}
    for server_round in range(1, rounds + 1):
        clients.run_round(server_round)
        encoder = clients.strategy.encoder
        for name, pairs in kernel_samples(encoder, degree, ring_bits, prg, repeats).items():
            unit_samples.setdefault(name, []).extend(pairs)
    sizes = clients.state_sizes()
    state_pairs = {e: state_samples(sizes[e], repeats * rounds) for e in EXCHANGES}
    units = {clock: {} for clock in CLOCKS}
    for name, pairs in unit_samples.items():
        for clock, value in medians(pairs).items():
            units[clock][name] = value
    word_bytes = (4 if ring_bits <= 32 else 8) * encoder.padded_dim
    exchanges: dict[str, dict[str, Any]] = {}
    for exchange in EXCHANGES:
        exchanges[exchange] = {"client_calls": len(clients.grid.seconds[exchange]),
                               "state_bytes": sizes[exchange]}
    for clock in CLOCKS:
        state = {
            e: {kind: medians(pairs)[clock] for kind, pairs in state_pairs[e].items()}
            for e in EXCHANGES
        }
        kernels = exchange_kernels(units[clock], degree, state)
        for exchange in EXCHANGES:
            row = exchanges[exchange]
            suffix = "" if clock == "cpu" else "_wall"
            client_s = medians(clients.grid.seconds[exchange])[clock]
            limit_s = sum(kernels[exchange].values())
            row[f"client{suffix}_s"] = client_s
            row[f"kernels{suffix}"] = kernels[exchange]
            floor_s = medians(clients.grid.floor[exchange])[clock]
            row[f"limit{suffix}_s"] = limit_s
            row[f"ratio{suffix}"] = client_s / limit_s
            row[f"floor{suffix}_s"] = floor_s
            row[f"ratio_over_floor{suffix}"] = client_s / (limit_s + floor_s)
    point = {
        "dim": dim,
        "padded_dim": encoder.padded_dim,
        "cohort": cohort,
        "degree": degree,
        "ring_bits": ring_bits,
        "bits": bits,
        "prg": prg,
        "scaled_noise_std": encoder.scaled_noise_std,
        "gamma": encoder.gamma,
        "units": units,
        "keystream_bytes_per_s": word_bytes / units["cpu"]["keystream_D"],
        "exchanges": exchanges,
    }
    for suffix in ("", "_wall"):
        client = sum(e[f"client{suffix}_s"] for e in exchanges.values())
        limit = sum(e[f"limit{suffix}_s"] for e in exchanges.values())
        floor = sum(e[f"floor{suffix}_s"] for e in exchanges.values())
        point[f"client{suffix}_s"], point[f"limit{suffix}_s"] = client, limit
        point[f"ratio{suffix}"] = client / limit
        point[f"floor{suffix}_s"] = floor
        point[f"ratio_over_floor{suffix}"] = client / (limit + floor)
    return point


def run(args: argparse.Namespace) -> dict[str, Any]:
    from threadpoolctl import threadpool_limits  # noqa: PLC0415

    points = []
    heap_kept = keep_freed_memory()  # the heap of an engine worker's process
    with threadpool_limits(limits=args.blas_threads):
        for dim in args.dims:
            for cohort in args.cohorts:
                point = measure_point(
                    dim, cohort, args.degree, args.ring_bits, args.bits, args.rounds,
                    args.repeats, args.prg,
                )
                points.append(point)
                ratios = " / ".join(f"{point['exchanges'][e]['ratio']:.2f}" for e in EXCHANGES)
                print(f"d={dim} C={cohort}: CPU ratio per exchange {ratios}, "
                      f"round {point['ratio']:.2f}", file=sys.stderr)
    return {
        "benchmark": "one DDGauss full-mode client's secure seconds over its kernels' sum",
        "machine": f"{os.cpu_count()}-CPU {platform.machine()} {platform.system()}",
        "python": platform.python_version(),
        "numpy": np.__version__,
        "load_average": list(os.getloadavg()),
        "rounds": args.rounds,
        "repeats": args.repeats,
        "blas_threads": args.blas_threads,
        "worker_heap": heap_kept,
        "points": points,
    }


D_NAMES = {16384: "2¹⁴", 65536: "2¹⁶", 131072: "2¹⁷", 1048576: "2²⁰"}


def table(stored: dict[str, Any]) -> str:
    """The docs' table: per label, point and exchange, client and limit in CPU ms, their
    ratio, the same ratio in wall seconds and, where the file has them, the message floor in
    CPU ms and the client over limit plus floor."""
    floors = all("floor_s" in p for r in stored["runs"].values() for p in r["points"])
    head = "| run | d (D) | C | exchange | client | limit | client / limit | in wall time |"
    lines = [head + (" message floor | client / (limit + floor) |" if floors else "")]
    lines.append("|---" * (8 + 2 * floors) + "|")
    for label, result in stored["runs"].items():
        for p in result["points"]:
            padded = D_NAMES.get(p["padded_dim"], p["padded_dim"])
            size = f"{p['dim']:.0e}".replace("e+0", "e") + f" ({padded})"
            rows = [(e, p["exchanges"][e]) for e in EXCHANGES] + [("round", p)]
            for exchange, row in rows:
                line = (
                    f"| {label} | {size} | {p['cohort']} | {exchange} | "
                    f"{row['client_s'] * 1e3:.2f} ms | {row['limit_s'] * 1e3:.2f} ms | "
                    f"{row['ratio']:.2f}× | {row['ratio_wall']:.2f}× |"
                )
                if floors:
                    line += f" {row['floor_s'] * 1e3:.2f} ms | {row['ratio_over_floor']:.2f}× |"
                lines.append(line)
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dims", type=int, nargs="+", default=[10_000, 100_000])
    parser.add_argument("--cohorts", type=int, nargs="+", default=[100, 1000])
    parser.add_argument("--degree", type=int, default=16)
    parser.add_argument("--ring-bits", type=int, default=32)
    parser.add_argument("--bits", type=int, default=20)
    parser.add_argument("--prg", choices=["chacha20", "aes-ctr"], default="chacha20")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument(
        "--blas-threads",
        type=int,
        default=1,
        help="BLAS threads of client and kernels (1: a worker's core; Ray sets an actor's "
        "OMP_NUM_THREADS to its num_cpus)",
    )
    parser.add_argument("--label", default="after")
    parser.add_argument(
        "--merge", action="store_true", help="keep the label's stored points of other sizes"
    )
    parser.add_argument("--out", type=Path, default=Path(__file__).with_name("limit.json"))
    parser.add_argument(
        "--table-only", action="store_true", help="print the table of --out; measure nothing"
    )
    args = parser.parse_args(argv)
    if args.degree < 2 or args.degree % 2:
        raise SystemExit(f"--degree={args.degree}; allowed: an even integer >= 2")
    if args.blas_threads < 1:
        raise SystemExit(f"--blas-threads={args.blas_threads}; allowed: an integer >= 1")
    if args.table_only:
        print(table(json.loads(args.out.read_text())))
        return
    result = run(args)
    stored = json.loads(args.out.read_text()) if args.out.exists() else {"runs": {}}
    kept = stored["runs"].get(args.label)
    if kept is not None and args.merge:  # points of other sizes measured earlier stay
        fresh = {(p["dim"], p["cohort"]) for p in result["points"]}
        result["points"] = [
            p for p in kept["points"] if (p["dim"], p["cohort"]) not in fresh
        ] + result["points"]
        result["points"].sort(key=lambda p: (p["dim"], p["cohort"]))
    stored["runs"][args.label] = result
    args.out.write_text(json.dumps(stored, indent=1) + "\n")
    print(table(stored))


if __name__ == "__main__":
    main()
