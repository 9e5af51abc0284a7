"""Benchmark: what checking relayed keys against the enrolment costs a round.

Every protocol that relays X25519 keys through the server checks them before sealing
(:mod:`protocols.channels`, "Authenticated keys": an Ed25519 certificate of the signer and an
Ed25519 signature over the keys, per key set). This script times, in one run and on the same
inputs, each party's per-round work with the check and with the keys taken as relayed:

* ``committee``: a DDGauss committee-mode client sharing a ``--dim`` vector to ``--members``
  members (:func:`protocols.committee.client.seal_input`) -- checking every certificate, or
  with the certificates known from an earlier round (a worker keeps its verifier) -- and a
  whole committee round of ``--clients`` clients (members sign once per committee session);
* ``dmm``: a DMM client's SHARE message to ``--members`` seats
  (:func:`protocols.dmm.client.seal_client_shares`);
* ``secagg``: a SecAgg+ round of ``--clients`` clients on the complete graph
  (:func:`protocols.secagg.server.run_secagg`), every client checking every neighbour.

Prints one JSON object: per case the median seconds of ``--repeats`` interleaved runs with and
without the check, the median paired difference ``check_s`` and ``check_overhead = checked_s /
relayed_s`` (1.0: the check costs nothing).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import numpy as np

from fedsim.engine.client_registry import Enrolment, client_name, identity_seed, member_name
from fedsim.engine.committee import CommitteeSpec
from fedsim.randomness import RunSecret
from protocols.channels import new_session_id
from protocols.committee.client import seal_input
from protocols.dmm.client import seal_client_shares
from protocols.dmm.common import RoundKeys
from protocols.dmm.member import MemberGroup
from protocols.secagg.common import SecAggConfig
from protocols.secagg.server import run_secagg


def seconds(run) -> float:
    start = time.perf_counter()
    run()
    return time.perf_counter() - start


def case(name: str, checked, relayed, repeats: int) -> dict:
    """Medians of ``repeats`` runs of each, interleaved (relayed, checked, relayed, ...) so
    that a busy machine slows both alike."""
    relayed(), checked()  # warm up
    pairs = [(seconds(relayed), seconds(checked)) for _ in range(repeats)]
    relayed_s = statistics.median(p[0] for p in pairs)
    checked_s = statistics.median(p[1] for p in pairs)
    return {
        "case": name,
        "relayed_s": relayed_s,
        "checked_s": checked_s,
        "check_s": statistics.median(p[1] - p[0] for p in pairs),
        "check_overhead": checked_s / relayed_s,
    }


def committee_cases(root: RunSecret, args) -> list[dict]:
    n, dim = args.members, args.dim
    enrolment = Enrolment(root)
    names = [member_name(j) for j in range(n)]
    vector = np.arange(dim, dtype=np.int64)
    committee = CommitteeSpec(n, max(1, n // 4), 2).build(root)
    keys = committee.keys_for(1)

    def client(verifier):
        # a fresh verifier each time: a client checks every member certificate once a round
        return lambda: seal_input(
            keys, 0, vector, np.random.default_rng(0), verifier=verifier and verifier(),
            names=names,
        )

    rounds = iter(range(2, 10**6))

    def whole_round(verifier):
        def run():
            round_ = next(rounds)
            round_keys = committee.keys_for(round_)
            sealed = {
                c: seal_input(
                    round_keys, c, vector, np.random.default_rng(c),
                    verifier=verifier and verifier(), names=names,
                )
                for c in range(args.clients)
            }
            committee.run_round_sealed(round_, sealed, dim)

        return run

    kept = enrolment.verifier()
    out = [
        case("committee client", client(enrolment.verifier), client(None), args.repeats),
        case(
            "committee client, certificates known",
            client(lambda: kept),
            client(None),
            args.repeats,
        ),
        case(
            f"committee round, {args.clients} clients",
            whole_round(enrolment.verifier),
            whole_round(None),
            args.repeats,
        ),
    ]
    committee.close()
    return out


def dmm_case(root: RunSecret, args) -> dict:
    n, dim = args.members, args.dim
    enrolment = Enrolment(root)
    group = MemberGroup(
        list(range(n)), n=n, t=max(1, n // 4), k=2, field_exponent=61, dim=dim,
        matrix=np.eye(2, dtype=np.int64),
        identities={
            j: (
                identity_seed(root.client(j)),
                enrolment.identity(client_name(j), root.client(j)).certificate.to_bytes(),
            )
            for j in range(n)
        },
    )
    session = new_session_id()
    member_keys = group.announce(0, session, list(range(n)), [])
    keys = RoundKeys(0, 0, 1, n, group.scheme.t, 2, 61, dim, session, member_keys,
                     group.key_proofs())
    update = np.arange(dim, dtype=np.int64)
    noise = np.zeros((1, dim), dtype=np.int64)

    def client(verifier):
        return lambda: seal_client_shares(
            keys, 0, update, noise, np.random.default_rng(0), verifier=verifier and verifier()
        )

    return case("dmm client", client(enrolment.verifier), client(None), args.repeats)


def secagg_case(root: RunSecret, args) -> dict:
    enrolment = Enrolment(root)
    clients = args.clients
    identities = {i: enrolment.identity(client_name(i), root.client(i)) for i in range(clients)}
    config = SecAggConfig(clients, clients - 1, clients // 2 + 1, args.dim)
    inputs = {i: np.full(args.dim, i, dtype=np.int64) for i in range(clients)}

    def round_(checked: bool):
        return lambda: run_secagg(
            config, inputs, np.random.default_rng(0),
            identities=identities if checked else None,
            verifier=enrolment.verifier() if checked else None,
        )

    return case(f"secagg round, {clients} clients", round_(True), round_(False), args.repeats)


def table(result: dict) -> str:
    """The docs' table of ``result`` (keys.json): per case, milliseconds and the ratio."""
    lines = [
        "| case | relayed | checked | check (paired median) | checked / relayed |",
        "|---|---|---|---|---|",
    ]
    for row in result["cases"]:
        lines.append(
            f"| {row['case']} | {row['relayed_s'] * 1e3:.1f} ms | {row['checked_s'] * 1e3:.1f} ms "
            f"| {row['check_s'] * 1e3:.1f} ms | {row['check_overhead']:.2f} |"
        )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--members", type=int, default=10)
    parser.add_argument("--clients", type=int, default=20)
    parser.add_argument("--dim", type=int, default=10_000)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--out", type=Path, default=Path(__file__).with_name("keys.json"))
    parser.add_argument(
        "--table-only", action="store_true", help="print the table of --out; measure nothing"
    )
    args = parser.parse_args()
    if args.table_only:
        print(table(json.loads(args.out.read_text())))
        return
    # each case its own root from OS randomness: no two cases share a party's stream
    rows = [
        *committee_cases(RunSecret.fresh(), args),
        dmm_case(RunSecret.fresh(), args),
        secagg_case(RunSecret.fresh(), args),
    ]
    result = {"members": args.members, "clients": args.clients, "dim": args.dim,
              "repeats": args.repeats, "cases": rows}
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    print(table(result))


if __name__ == "__main__":
    main()
