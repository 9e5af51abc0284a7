"""Benchmark: the SecAgg+ server's UNMASK recovery, owner by owner vs batched.

One SecAgg+ round of ``--clients`` (1000) clients in process (:mod:`protocols.secagg`,
``--degree`` 16 neighbours, ``--threshold`` 9 shares, vectors of ``--dim`` 64 field
elements), with ``--dropout`` (2 %) of the clients silent in MASKED_INPUT and as many again in
UNMASK (the engine's default fault rate per exchange), so the owners' answering neighbours
differ. After the server's UNMASK, its recovery of every survivor's self-mask seed and every
dropped client's mask-agreement key is timed both ways on the same responses:

* ``per_owner``: :meth:`protocols.secagg.server.SecAggServer._recover` for each owner, one
  Reed-Solomon decoding each (the server's path before batching, and still its path for an
  owner whose shares disagree);
* ``batched``: :meth:`protocols.secagg.server.SecAggServer._recover_all`, the owners whose
  answering neighbours sit at the same places decoded together
  (:meth:`protocols.shamir.PackedShamir.decode_agreeing`).

Both must give every owner the same secret (checked). ``cold``: the schemes' Lagrange caches
emptied before each run, as in a round whose dropouts are new; ``warm``: kept. Prints one
JSON object: medians of ``--repeats`` interleaved runs (CPU seconds) and ``speedup =
per_owner / batched``.

    .venv/bin/python experiments/bench/unmask_recovery.py \\
        --out experiments/bench/unmask_recovery.json
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from collections import Counter
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from protocols.channels import new_session_id  # noqa: E402
from protocols.field import DEFAULT_FIELD  # noqa: E402
from protocols.secagg.client import SecAggClient  # noqa: E402
from protocols.secagg.common import SecAggConfig, shamir_scheme  # noqa: E402
from protocols.secagg.server import SecAggServer  # noqa: E402

KINDS = ("self_mask_shares", "secret_key_shares")


def unmasked_round(clients: int, degree: int, threshold: int, dim: int, dropout: float, seed: int):
    """A SecAgg+ server after UNMASK, with its config and the owners of each kind."""
    rng = np.random.default_rng(seed)
    inputs = {i: DEFAULT_FIELD.random(rng, dim) for i in range(1, clients + 1)}
    config = SecAggConfig(clients, degree, threshold, dim)
    session = new_session_id()
    server = SecAggServer(config, inputs, session, np.random.default_rng(seed + 1))
    parties = {i: SecAggClient(session) for i in inputs}
    routed = server.advertise_keys({i: c.advertise_keys() for i, c in parties.items()})
    shares = {i: parties[i].share_keys(i, config, routed[i]) for i in routed}
    incoming = server.share_keys(shares)
    silent = int(round(dropout * clients))
    quiet = set(rng.choice(sorted(incoming), silent, replace=False).tolist())
    live = [i for i in incoming if i not in quiet]
    masked = {i: parties[i].masked_input(incoming[i], inputs[i]) for i in live}
    survivors, dropped = server.masked_input(masked)
    gone = set(rng.choice(list(survivors), silent, replace=False).tolist())
    responses = {i: parties[i].unmask(survivors, dropped) for i in survivors if i not in gone}
    server.unmask(responses)
    linked = [o for o in dropped if not server._alive.isdisjoint(server._recipients[o])]
    return server, config, {KINDS[0]: list(survivors), KINDS[1]: linked}


def timed(run, schemes, cold: bool) -> float:
    """CPU seconds of ``run()`` (``cold``: the ``schemes``' Lagrange caches emptied first)."""
    if cold:
        for scheme in schemes:
            scheme.__dict__.pop("_lagrange_cache", None)
    start = time.process_time()
    run()
    return time.process_time() - start


def measure(args: argparse.Namespace) -> dict:
    server, config, owners = unmasked_round(
        args.clients, args.degree, args.threshold, args.dim, args.dropout, args.seed
    )
    order = {responder: k for k, responder in enumerate(server.view.responses)}
    sizes = {len(server._recipients[o]) for kind in KINDS for o in owners[kind]}
    schemes = [shamir_scheme(config, size) for size in sorted(sizes)]

    def per_owner():
        return [server._recover(o, kind, order) for kind in KINDS for o in owners[kind]]

    def batched():
        return [s for kind in KINDS for _, s in server._recover_all(owners[kind], kind, order)]

    if per_owner() != batched():
        raise AssertionError("the batched recovery gave an owner another secret")
    answered = Counter(
        len(server._shares_of(o, KINDS[0], order)[0]) for o in owners[KINDS[0]]
    )
    result = {
        "benchmark": "SecAgg+ UNMASK recovery: owner by owner vs batched",
        "machine": f"{platform.machine()} {platform.system()}",
        "python": platform.python_version(),
        "numpy": np.__version__,
        "settings": {k: getattr(args, k) for k in ("clients", "degree", "threshold", "dim",
                                                     "dropout", "repeats", "seed")},
        "owners": {kind: len(owners[kind]) for kind in KINDS},
        "answers_per_survivor": {str(k): v for k, v in sorted(answered.items())},
    }  # fmt: skip
    for label, cold in (("cold", True), ("warm", False)):
        pairs = [
            (timed(per_owner, schemes, cold), timed(batched, schemes, cold))
            for _ in range(args.repeats)
        ]
        old = statistics.median(p[0] for p in pairs)
        new = statistics.median(p[1] for p in pairs)
        result[label] = {"per_owner_s": old, "batched_s": new, "speedup": old / new}
    return result


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--clients", type=int, default=1000)
    parser.add_argument("--degree", type=int, default=16)
    parser.add_argument("--threshold", type=int, default=9)
    parser.add_argument("--dim", type=int, default=64)
    parser.add_argument("--dropout", type=float, default=0.02)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args(argv)
    if not 0 <= args.dropout < 0.5:
        parser.error(f"--dropout={args.dropout}; allowed: a fraction in [0, 0.5)")
    result = measure(args)
    text = json.dumps(result, indent=2)
    print(text)
    if args.out is not None:
        args.out.write_text(text + "\n")
    return result


if __name__ == "__main__":
    main()
