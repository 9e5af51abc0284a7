"""Benchmark: bytes and compute of one DMM round against committee size n.

For n in ``--sizes`` (10, 20, 40, 80) at model size D (``--dim``, 4096 padded coordinates),
packing k = n / 5 and threshold t = n / 10 (so t + k = 0.3 n and the committee bound
t + dropouts + k < n / 2 holds with n / 10 planned dropouts), one process runs two rounds of the
corrected DMM (:class:`protocols.dmm.server.DMMServer`, members in process, everything sealed)
with a banded M of ``--bands`` bands, so each committee hands on ``bands - 1`` partial sums
(``(bands - 1) x D`` secrets), and ``--clients`` clients per round. From the second round's
transcript:

* **client**: bytes one client sends (its public key and one envelope per seat: 1 + 1 segments of
  ceil(D / k) field elements) and the seconds it spends sharing and sealing;
* **member**: bytes a seat receives (the clients' envelopes) and sends (its release share, its
  deal);
* **handoff** (linear packed resharing, docs/dmm-design.md step 7): ``dealer_bytes_per_secret`` --
  the DEAL bytes of one dealer of the chosen set S / secrets handed on (n / k elements per
  secret: flat in n when k grows with n) and ``total_bytes_per_secret`` -- every dealer's DEAL
  (the t + k of S, and the others' check blocks) plus the VERIFY check shares / secrets (grows
  with n: (t + k) n / k elements per secret). The same with k = 1 (``naive``: unpacked linear
  resharing, n elements per secret from each of t + 1 dealers).

Fits (least squares over n): slopes of the per-dealer and total handoff bytes per secret.
Prints one JSON object and writes it to ``--out`` (default experiments/bench/dmm.json).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from fedsim.privacy.mechanisms import discrete_gaussian  # noqa: E402
from protocols.channels import SERVER_ID  # noqa: E402
from protocols.dmm.client import seal_client_shares  # noqa: E402
from protocols.dmm.common import Schedule  # noqa: E402
from protocols.dmm.member import MemberPool  # noqa: E402
from protocols.dmm.server import DMMServer  # noqa: E402
from protocols.kit import NEW_ID_BASE, OLD_ID_BASE, SEAT_ID_BASE  # noqa: E402
from protocols.shamir import PackedShamir  # noqa: E402


def banded_matrix(rounds: int, bands: int) -> np.ndarray:
    """An integer banded M with a dominant diagonal (the cost does not depend on its values)."""
    M = np.zeros((rounds, rounds), dtype=np.int64)
    for d in range(bands):
        M[np.arange(d, rounds), np.arange(rounds - d)] = 4096 >> d
    return M


def one_round(scheme: PackedShamir, dim: int, bands: int, clients: int) -> dict:
    """Two rounds of DMM; the second round's bytes and times."""
    schedule = Schedule(banded_matrix(3, bands))
    server = DMMServer(scheme, schedule, dim)
    groups = [list(range(scheme.n))]
    pools = [MemberPool(range(scheme.n), groups, server.member_kwargs) for _ in range(3)]
    server.attach(pools[0])
    rng = np.random.default_rng(0)
    for step in range(2):
        keys = server.open_round(step)
        start = time.perf_counter()
        sealed = {
            c: seal_client_shares(
                keys,
                c,
                rng.integers(-1000, 1000, dim),
                rng.integers(-1000, 1000, (keys.rows, dim)),
                np.random.default_rng([step, c]),
            )
            for c in range(clients)
        }
        client_s = (time.perf_counter() - start) / clients
        start = time.perf_counter()
        out = server.finish_round(sealed, pools[step + 1])
        members_s = time.perf_counter() - start
    t = out.transcript
    secrets = len(schedule.open_after(1)) * dim
    deal = {i: 0 for i in range(scheme.n)}
    verify = 0
    for row in t.rows():
        sender, receiver = row["sender"], row["receiver"]
        if OLD_ID_BASE <= sender < NEW_ID_BASE and NEW_ID_BASE <= receiver < SEAT_ID_BASE:
            deal[sender - OLD_ID_BASE] += row["bytes"]
        elif NEW_ID_BASE <= sender < SEAT_ID_BASE and receiver == SERVER_ID:
            verify += row["bytes"]
    dealers = [b for b in deal.values() if b]
    seats = range(scheme.n)
    return {
        "k": scheme.k,
        "t": scheme.t,
        "dealers_in_s": scheme.threshold,
        "client_bytes": t.nbytes(sender=0),
        "client_s": client_s,
        "member_received_bytes": float(
            np.mean([t.nbytes(receiver=SEAT_ID_BASE + j) for j in seats])
        ),
        "member_sent_bytes": float(
            np.mean([t.nbytes(sender=SEAT_ID_BASE + j) for j in seats])
            + np.mean([t.nbytes(sender=OLD_ID_BASE + j) for j in seats])
        ),
        "members_s_per_member": members_s / scheme.n,
        "secrets_handed": secrets,
        "dealer_bytes_per_secret": max(dealers) / secrets,
        "total_bytes_per_secret": (sum(dealers) + verify) / secrets,
        "attempts": out.reshare_attempts,
    }


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", type=int, nargs="+", default=[10, 20, 40, 80])
    parser.add_argument("--dim", type=int, default=4096)
    parser.add_argument("--bands", type=int, default=3)
    parser.add_argument("--clients", type=int, default=5)
    parser.add_argument("--out", default=str(Path(__file__).with_suffix(".json")))
    args = parser.parse_args(argv)
    start = time.perf_counter()
    discrete_gaussian(args.dim, 4000.0, np.random.default_rng(2))
    noise_s = time.perf_counter() - start
    rows = []
    for n in args.sizes:
        k, t = max(1, n // 5), max(1, n // 10)
        row = {
            "n": n,
            "packed": one_round(PackedShamir(n, t, k), args.dim, args.bands, args.clients),
            "naive": one_round(PackedShamir(n, t, 1), args.dim, args.bands, args.clients),
        }
        rows.append(row)
        print(json.dumps(row), file=sys.stderr)
    sizes = np.array(args.sizes, dtype=float)

    def slope(kind: str, key: str) -> float:
        values = np.array([r[kind][key] for r in rows], dtype=float)
        return float(np.polyfit(sizes, values, 1)[0])

    out = {
        "dim": args.dim,
        "bands": args.bands,
        "clients": args.clients,
        "noise_s": noise_s,
        "rows": rows,
        "fit": {
            f"{kind}_{key}_slope_per_member": slope(kind, key)
            for kind in ("packed", "naive")
            for key in ("dealer_bytes_per_secret", "total_bytes_per_secret")
        },
    }
    Path(args.out).write_text(json.dumps(out, indent=2) + "\n")
    print("n   per-dealer B/secret (packed, naive)   total B/secret (packed, naive)   client B")
    for r in rows:
        p, q = r["packed"], r["naive"]
        print(
            f"{r['n']:<4}{p['dealer_bytes_per_secret']:>10.1f}"
            f" {q['dealer_bytes_per_secret']:>10.1f}"
            f"{p['total_bytes_per_secret']:>20.1f} {q['total_bytes_per_secret']:>10.1f}"
            f"{p['client_bytes']:>16}"
        )
    print(json.dumps(out["fit"], indent=2))
    return out


if __name__ == "__main__":
    main()
