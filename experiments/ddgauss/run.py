"""DDGauss over SecAgg+ on digits: accuracy and epsilon per round, with and without dropouts.

Workload: scikit-learn digits, 30 iid clients (all sampled every round), multinomial logistic
regression, one local epoch of SGD (batch 16, lr 0.1), FedAvg on the DDGauss mean update,
clipping norm 1, noise multiplier 1 (central noise std 1 when all 30 clients contribute), a
20-bit budget for the modular sum (gamma from ``choose_gamma``), delta 1e-5, local engine.

Settings: ``full`` mode (each client masks inside its ClientApp; SecAgg+ with real
cryptography runs as three more message exchanges per round) with client dropout 0 and 0.1
(``FaultConfig(dropout=...)``, drawn at every exchange, so a client can also drop out inside
SecAgg+), and ``plaintext`` mode (the same integers summed by the server in the clear) without
dropout, which must give full mode's model bit for bit: each client's rounding and noise come
from its own secret, which the engine gives it in its ``node_config`` from the run's root. The
study root is read from ``--secrets`` (default ``~/.fedsim/ddgauss.key``, created from OS
randomness, outside the repository; :mod:`experiments.roots`); each setting mixes its own fresh
nonce into it, so settings and invocations draw independent noise. The plaintext run replays
the full run without dropout (its nonce): a copy of that release, made only to check bit
identity. Epsilon follows the dropout rule: each round is accounted with the noise of the
clients that actually contributed (KLS21 Theorem 1, ``fedsim.privacy.ddgauss``).

Writes ``results.json`` next to this file and the README's table (``table.py``).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from flwr.serverapp.strategy import FedAvg  # noqa: E402

from experiments.ddgauss.table import table, write_readme  # noqa: E402
from experiments.roots import default_key, study_root  # noqa: E402
from fedsim.data import DatasetSpec, build_dataset  # noqa: E402
from fedsim.engine import Engine, EngineConfig, FaultConfig  # noqa: E402
from fedsim.engine.rounds import run_rounds  # noqa: E402
from fedsim.models import ModelSpec, build_model, initial_arrays, load_arrays  # noqa: E402
from fedsim.randomness import RunSecret, new_nonce  # noqa: E402
from fedsim.record_codec import to_numpy, to_record  # noqa: E402
from fedsim.workloads.supervised import LocalTraining, make_client_app  # noqa: E402
from fedsim.workloads.training import evaluate_model  # noqa: E402
from strategies.methods.ddgauss.client import ddgauss_client_app  # noqa: E402
from strategies.methods.ddgauss.strategy import DDGauss  # noqa: E402

CLIENTS, ROUNDS, SEED = 30, 10, 7


def run(engine, data, dataset, model, app, mode, dropout, root: RunSecret):
    strategy = DDGauss(
        FedAvg(min_available_nodes=0, fraction_evaluate=0.0),
        clipping_norm=1.0,
        noise_multiplier=1.0,
        expected_clients=CLIENTS,
        seed=SEED,
        mode=mode,
        bits=20,
    )
    grid = engine.open_run(
        app,
        CLIENTS,
        run_config={"seed": 0},
        faults=FaultConfig(dropout=dropout, seed=3),
        datasets=((data, dataset),),
        secrets=root,  # each client finds root.client(i) in its node_config
    )
    test_x = torch.as_tensor(dataset.test.x, dtype=torch.float32)
    test_y = torch.as_tensor(dataset.test.y, dtype=torch.int64)
    rows = []

    def on_round(outcome):
        net = build_model(model)
        load_arrays(net, to_numpy(outcome.arrays))
        metrics = dict(outcome.train_metrics or {})
        rows.append(
            {
                "round": outcome.server_round,
                "survivors": int(metrics.get("ddgauss-survivors", 0)),
                "aborted": int(metrics.get("ddgauss-aborted", 0)),
                "epsilon": float(metrics.get("epsilon", 0.0)),
                "accuracy": float(evaluate_model(net, test_x, test_y)["accuracy"]),
            }
        )

    final = run_rounds(
        strategy, grid, to_record(initial_arrays(model, 0)), ROUNDS, on_round=on_round
    )
    grid.wait_idle()
    return strategy, {k: np.asarray(v) for k, v in to_numpy(final).items()}, rows


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--secrets",
        default=str(default_key("ddgauss")),
        help="the study root, outside the repository (created if missing)",
    )
    args = parser.parse_args(argv)
    here = Path(__file__).parent
    study = study_root(args.secrets, here)
    nonces = {"full_dropout0.0": new_nonce(), "full_dropout0.1": new_nonce()}
    nonces["plaintext_dropout0.0"] = nonces["full_dropout0.0"]  # a replay, to check identity
    data = DatasetSpec(source="digits", partition="iid", num_clients=CLIENTS, seed=0)
    dataset = build_dataset(data)
    model = ModelSpec(
        kind="logreg", input_shape=tuple(dataset.feature_shape), num_classes=dataset.num_classes
    )
    inner = make_client_app(model, data, LocalTraining(epochs=1, batch_size=16, lr=0.1, seed=0))
    app = ddgauss_client_app(inner)
    results = {}
    with Engine(EngineConfig(backend="local")) as engine:
        finals = {}
        for mode, dropout in (("full", 0.0), ("full", 0.1), ("plaintext", 0.0)):
            name = f"{mode}_dropout{dropout}"
            root = study.for_run(nonces[name])
            strategy, final, rows = run(engine, data, dataset, model, app, mode, dropout, root)
            finals[(mode, dropout)] = final
            results[name] = {
                "nonce": nonces[name],
                "gamma": strategy.encoder.gamma,
                "delta_2": strategy.encoder.l2_bound,
                "client_noise_std": strategy.client_noise_std,
                "rounds": rows,
            }
        same = all(
            np.array_equal(finals[("full", 0.0)][k], finals[("plaintext", 0.0)][k])
            for k in finals[("full", 0.0)]
        )
        results["plaintext_equals_full_bit_for_bit"] = same
        results["plaintext_is_a_replay_of"] = "full_dropout0.0"
        results["secrets_fingerprint"] = study.fingerprint()
    (here / "results.json").write_text(json.dumps(results, indent=2))
    write_readme(results)
    print(table(results))
    print(f"plaintext == full bit for bit: {same}")
    return results


if __name__ == "__main__":
    main()
