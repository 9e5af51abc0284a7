"""Benchmark: per-client compute and bytes of one DMM round against committee size n.

For n in ``--sizes`` (10, 20, 40, 80) at fixed model size d (``--dim``, 4096 padded
coordinates), packing k = n / 5 and threshold t = n / 4 (so t + k = 0.45 n: 55 % of a committee
may drop), one process:

* **client step** (reference/dmm.md step 2): share the rounded update and one noise row
  (2 x d field elements) with :class:`protocols.shamir.PackedShamir` (OS randomness) and seal
  one envelope per member (X25519 / HKDF / ChaCha20-Poly1305); ``client_s`` is the mean wall time
  over ``--clients`` clients, ``client_bytes`` what one client sends (envelopes with headers);
  the local noise draw (d exact discrete Gaussians) is timed once as ``noise_s``;
* **secure transfer** (step 6): :class:`protocols.resharing.Resharing` of a state of
  ``--state-rows`` noise rows (``rows x d`` secrets) from one committee to the next, sealed, with
  the parity check; ``reshare_bytes_per_secret`` = all DEAL bytes / secrets,
  ``dealer_bytes_per_secret`` = one dealer's DEAL bytes / secrets, ``member_s`` = the
  resharing's wall time (all members, one process) divided by n. The same with k = 1
  (``naive``: unpacked linear resharing, one element per secret per new member from every
  dealer).

Fits (least squares over n): slope of ``dealer_bytes_per_secret`` against n for packed (near 0:
constant overhead) and naive (about 8 bytes per member), and of ``client_bytes / d``.
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
from protocols.channels import Endpoint, Relay, new_session_id  # noqa: E402
from protocols.resharing import ReshareStage, Resharing  # noqa: E402
from protocols.shamir import PackedShamir  # noqa: E402


def client_step(scheme: PackedShamir, dim: int, clients: int) -> tuple[float, int]:
    """Mean seconds and bytes for one client to share update + one noise row with n members."""
    session = new_session_id()
    members = [Endpoint(2**62 + j, session) for j in range(scheme.n)]
    relay = Relay()
    rng = np.random.default_rng(0)
    elapsed = 0.0
    for c in range(clients):
        client = Endpoint(c, session)
        for m in members:
            client.connect(m.party_id, m.public_key)
        vector = rng.integers(0, scheme.field.modulus, size=2 * dim, dtype=np.int64)
        start = time.perf_counter()
        shares = scheme.share(vector, secure=True)
        for j, m in enumerate(members):
            relay.post(client.seal_array(m.party_id, 0, "SHARE", shares[j]))
        elapsed += time.perf_counter() - start
    return elapsed / clients, relay.transcript.nbytes() // clients


def reshare(scheme: PackedShamir, secrets: int) -> dict:
    rng = np.random.default_rng(1)
    state = scheme.share(scheme.field.random(rng, secrets), secure=True)
    start = time.perf_counter()
    result = Resharing(scheme, scheme).run({j: state[j] for j in range(scheme.n)}, secure=True)
    wall = time.perf_counter() - start
    return {
        "k": scheme.k,
        "t": scheme.t,
        "dealers": len(result.dealers),
        "reshare_bytes_per_secret": result.bytes_per_secret(),
        "dealer_bytes_per_secret": result.bytes_per_dealer_per_secret(),
        "verify_bytes": result.transcript.nbytes(stage=ReshareStage.VERIFY),
        "member_s": wall / scheme.n,
        "wall_s": wall,
    }


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", type=int, nargs="+", default=[10, 20, 40, 80])
    parser.add_argument("--dim", type=int, default=4096)
    parser.add_argument("--state-rows", type=int, default=2)
    parser.add_argument("--clients", type=int, default=5)
    parser.add_argument("--out", default=str(Path(__file__).with_suffix(".json")))
    args = parser.parse_args(argv)
    start = time.perf_counter()
    discrete_gaussian(args.dim, 40.0, np.random.default_rng(2))
    noise_s = time.perf_counter() - start
    secrets = args.state_rows * args.dim
    rows = []
    for n in args.sizes:
        k, t = max(1, n // 5), max(1, n // 4)
        packed = PackedShamir(n, t, k)
        client_s, client_bytes = client_step(packed, args.dim, args.clients)
        row = {
            "n": n,
            "client_s": client_s,
            "client_bytes": client_bytes,
            "client_bytes_per_coordinate": client_bytes / args.dim,
            "packed": reshare(packed, secrets),
            "naive": reshare(PackedShamir(n, t, 1), secrets),
        }
        rows.append(row)
        print(json.dumps(row), file=sys.stderr)
    sizes = np.array(args.sizes, dtype=float)

    def slope(values):
        return float(np.polyfit(sizes, np.array(values, dtype=float), 1)[0])

    packed_b = [r["packed"]["dealer_bytes_per_secret"] for r in rows]
    naive_b = [r["naive"]["dealer_bytes_per_secret"] for r in rows]
    out = {
        "dim": args.dim,
        "secrets_reshared": secrets,
        "noise_s": noise_s,
        "rows": rows,
        "fit": {
            "packed_dealer_bytes_per_secret_slope_per_member": slope(packed_b),
            "naive_dealer_bytes_per_secret_slope_per_member": slope(naive_b),
            "packed_total_bytes_per_secret_slope": slope(
                [r["packed"]["reshare_bytes_per_secret"] for r in rows]
            ),
            "naive_total_bytes_per_secret_slope": slope(
                [r["naive"]["reshare_bytes_per_secret"] for r in rows]
            ),
            "client_bytes_per_coordinate_slope": slope(
                [r["client_bytes_per_coordinate"] for r in rows]
            ),
        },
        "naive_over_packed_dealer_bytes": [b / a for a, b in zip(packed_b, naive_b)],
    }
    Path(args.out).write_text(json.dumps(out, indent=2) + "\n")
    print(json.dumps(out["fit"], indent=2))
    return out


if __name__ == "__main__":
    main()
