"""Profile: where one DMM full-mode round spends its time at large cohorts.

One process runs the protocol layer of a DMM round (:class:`protocols.dmm.server.DMMServer`,
members in process, everything sealed) with ``--clients`` clients per round and model size
``--dim``, committees of n = 20, t = 3, k = 3 (the strategy's defaults) and a banded M of 3 bands,
and times each phase of the second round: the clients' sharing and sealing (per client and in
total), the members' opening and summing, the release and its decoding, the resharing. With
``--fold B`` the clients of each simulated worker batch of B clients mask their share rows and
the batch folds them per seat before sealing (:class:`protocols.dmm.client.MaskedFold`): one
sealed message per batch, as the engine's workers send them. ``--profile`` prints the top
cProfile entries of the round.

    nice -n 10 .venv/bin/python experiments/bench/dmm_scale_profile.py --clients 100 --dim 10000
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import pstats
import resource
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from experiments.bench.dmm import banded_matrix  # noqa: E402
from protocols.dmm.client import MaskedFold, mask_client_shares, seal_client_shares  # noqa: E402
from protocols.dmm.common import Schedule  # noqa: E402
from protocols.dmm.member import MemberPool  # noqa: E402
from protocols.dmm.server import DMMServer  # noqa: E402
from protocols.kit import SEAT_ID_BASE  # noqa: E402
from protocols.shamir import PackedShamir  # noqa: E402


def client_messages(keys, clients: int, dim: int, fold: int, step: int) -> tuple[dict, dict, float]:
    """Sealed SHARE messages of ``clients`` clients (one per batch of ``fold`` clients when
    fold > 1: each client masks its shares, :func:`protocols.dmm.client.mask_client_shares`, and
    :class:`protocols.dmm.client.MaskedFold` sums and seals them), their weights (clients per
    message) and the seconds spent (the clients' integers are drawn outside the timing)."""
    rng = np.random.default_rng([step, 7])
    sealed, weights, seconds = {}, {}, 0.0
    for first in range(0, clients, max(fold, 1)):
        batch = range(first, min(clients, first + max(fold, 1)))
        inputs = [
            (rng.integers(-1000, 1000, dim), rng.integers(-1000, 1000, (keys.rows, dim)))
            for _ in batch
        ]
        start = time.perf_counter()
        if fold <= 1:
            (update, noise), c = inputs[0], first
            sealed[c] = seal_client_shares(keys, c, update, noise, np.random.default_rng([step, c]))
        else:
            folded = MaskedFold(keys)
            for c, (update, noise) in zip(batch, inputs):
                rng_c = np.random.default_rng([step, c])
                folded.add(mask_client_shares(keys, c, update, noise, rng_c))
            sealed[first] = folded.seal(clients + first)
        seconds += time.perf_counter() - start
        weights[first] = len(batch)
    return sealed, weights, seconds


def run(args: argparse.Namespace) -> dict:
    scheme = PackedShamir(args.n, args.t, args.k)
    schedule = Schedule(banded_matrix(3, 3))
    server = DMMServer(scheme, schedule, args.dim)
    groups = [list(range(g, scheme.n, args.groups)) for g in range(args.groups)]
    pools = [MemberPool(range(scheme.n), groups, server.member_kwargs) for _ in range(3)]
    server.attach(pools[0])
    out: dict = {}
    for step in range(2):
        keys = server.open_round(step)
        sealed, weights, client_s = client_messages(keys, args.clients, args.dim, args.fold, step)
        profiler = cProfile.Profile() if args.profile and step == 1 else None
        start = time.perf_counter()
        if profiler is not None:
            profiler.enable()
        if args.fold > 1:
            output = server.finish_round(sealed, pools[step + 1], weights=weights)
        else:
            output = server.finish_round(sealed, pools[step + 1])
        if profiler is not None:
            profiler.disable()
        server_s = time.perf_counter() - start
        if step == 1:
            t = output.transcript
            sent = [t.nbytes(sender=int(s.party)) for s in sealed.values()]
            out = {
                "clients": args.clients,
                "dim": args.dim,
                "fold": args.fold,
                "n": args.n,
                "t": args.t,
                "k": args.k,
                "clients_s": client_s,
                "client_s_each": client_s / args.clients,
                "committee_and_server_s": server_s,
                "round_s": client_s + server_s,
                "bytes_per_client": float(np.sum(sent)) / args.clients,
                "bytes_per_message": float(np.mean(sent)),
                "bytes_per_member_received": float(
                    np.mean([t.nbytes(receiver=SEAT_ID_BASE + j) for j in range(args.n)])
                ),
                "released_clients": int(sum(weights[c] for c in output.clients)),
                "peak_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
            }
            if profiler is not None:
                text = io.StringIO()
                pstats.Stats(profiler, stream=text).sort_stats("cumulative").print_stats(25)
                out["profile"] = text.getvalue()
    return out


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--clients", type=int, default=100)
    parser.add_argument("--dim", type=int, default=10_000)
    parser.add_argument("--fold", type=int, default=1, help="clients per sealed message")
    parser.add_argument("--n", type=int, default=20)
    parser.add_argument("--t", type=int, default=3)
    parser.add_argument("--k", type=int, default=3)
    parser.add_argument("--groups", type=int, default=2, help="member groups (actors)")
    parser.add_argument("--profile", action="store_true")
    args = parser.parse_args(argv)
    out = run(args)
    profile = out.pop("profile", None)
    print(json.dumps(out))
    if profile:
        print(profile)
    return out


if __name__ == "__main__":
    main()
