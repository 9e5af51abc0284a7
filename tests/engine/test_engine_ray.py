"""The engine on real Ray actors: Flower apps unchanged, exact results, crashes, timeouts."""

import random
from pathlib import Path

import numpy as np
import pytest
import torch
from flwr.app import ConfigRecord, Message, RecordDict
from flwr.serverapp.strategy import FedAvg

from fedsim.data import DatasetSpec, build_dataset
from fedsim.engine import NODE_ID_OFFSET, ClientAppSource
from fedsim.engine.rounds import run_rounds
from fedsim.models import ModelSpec, initial_arrays
from fedsim.randomness import NODE_SECRET_KEY, Purpose, RunSecret, server_secret
from fedsim.record_codec import to_numpy, to_record
from fedsim.workloads.supervised import LocalTraining, make_client_app
from strategies.methods.dp_fedavg.strategy import DPFedAvg
from strategies.plumbing.worker_reduced import WorkerReduced

QUICKSTART = Path(__file__).parents[1] / "apps" / "quickstart"

pytestmark = pytest.mark.ray
HERE = str(Path(__file__).parents[1])
TOY = ClientAppSource(reference="toy_app:app", app_dir=HERE)
QUICK_CONFIG = {
    "num-server-rounds": 3,
    "fraction-train": 1.0,
    "local-epochs": 2,
    "lr": 0.1,
    "seed": 7,
}


def quickstart(engine, out: Path, clients=10):
    from quickstart_app.server_app import app as server_app

    source = ClientAppSource(reference="quickstart_app.client_app:app", app_dir=str(QUICKSTART))
    engine.run_server_app(
        server_app, source, clients, run_config={**QUICK_CONFIG, "output-path": str(out)}
    )
    return dict(np.load(out))


def sequential_quickstart(clients=10):
    """The same federation computed by hand: one client after another, FedAvg in numpy."""
    from quickstart_app.task import Net, load_data, train

    cfg = QUICK_CONFIG
    torch.manual_seed(cfg["seed"])
    weights = {k: v.numpy().copy() for k, v in Net().state_dict().items()}
    for server_round in range(1, cfg["num-server-rounds"] + 1):
        results = []
        for pid in range(clients):
            net = Net()
            net.load_state_dict({k: torch.from_numpy(v.copy()) for k, v in weights.items()})
            x, y = load_data(pid, clients)
            train(
                net,
                x,
                y,
                cfg["local-epochs"],
                cfg["lr"],
                cfg["seed"] * 100003 + server_round * 1009 + pid,
            )
            results.append(({k: v.numpy() for k, v in net.state_dict().items()}, len(y)))
        total = sum(n for _, n in results)
        weights = {k: sum(w[k] * (n / total) for w, n in results) for k in weights}
    return weights


def test_flower_quickstart_matches_sequential_recomputation(ray_engine, local_engine, tmp_path):
    on_ray = quickstart(ray_engine, tmp_path / "ray.npz")
    in_process = quickstart(local_engine, tmp_path / "local.npz")
    by_hand = sequential_quickstart()
    for key, value in by_hand.items():
        assert np.array_equal(on_ray[key], in_process[key])  # the backend changes nothing
        np.testing.assert_allclose(on_ray[key], value, rtol=1e-5, atol=1e-6)


def test_crashed_worker_is_replaced_and_the_result_is_unchanged(ray_engine, tmp_path):
    def run(crash: bool):
        marker = tmp_path / "crash-once"
        if crash:
            marker.write_text("x")
        grid = ray_engine.open_run(
            TOY, 12, run_config={"crash-file": str(marker), "crash-partition": 5}
        )
        body = RecordDict(
            {
                "arrays": to_record({"w": np.zeros(3, np.float32)}),
                "config": ConfigRecord({"step": 0.5}),
            }
        )
        outcome = []
        for _ in range(2):
            replies = grid.send_and_receive(
                [Message(body, NODE_ID_OFFSET + p, "train") for p in range(12)]
            )
            outcome.append(
                [
                    (
                        r.content["metrics"]["pid"],
                        r.content["metrics"]["calls"],
                        to_numpy(r.content["arrays"])["w"].tolist(),
                    )
                    for r in replies
                ]
            )
        assert not marker.exists() or not crash
        return outcome

    assert run(crash=True) == run(crash=False)


def test_late_batches_are_dropped_at_the_timeout(ray_engine):
    class Reports:
        items: list = []

        def phase_finished(self, report):
            self.items.append(report)

    reports = Reports()
    grid = ray_engine.open_run(
        TOY, 8, observer=reports, run_config={"slow-partition": 7, "slow-seconds": 3.0}
    )
    body = RecordDict(
        {"arrays": to_record({"w": np.zeros(2, np.float32)}), "config": ConfigRecord()}
    )
    replies = grid.send_and_receive(
        [Message(body, NODE_ID_OFFSET + p, "train") for p in range(8)], timeout=1.5
    )
    partitions = {r.content["metrics"]["pid"] for r in replies}
    assert 7 not in partitions and len(partitions) >= 6
    assert reports.items[-1].timed_out == 8 - len(partitions)
    grid.wait_idle()  # the late client still ran: its state is kept, as on a real device
    assert len(grid.state_store) == 8


@pytest.fixture(scope="module")
def digits_federation():
    spec = DatasetSpec(source="digits", partition="dirichlet", alpha=0.5, num_clients=40, seed=1)
    dataset = build_dataset(spec)
    model = ModelSpec(kind="mlp", input_shape=dataset.feature_shape, num_classes=10, hidden=(32,))
    app = make_client_app(model, spec, LocalTraining(epochs=1, batch_size=8, lr=0.1, seed=3))
    return spec, dataset, model, app


def federated(engine, federation, strategy, rounds=3):
    spec, dataset, model, app = federation
    random.seed(0)
    grid = engine.open_run(app, dataset.num_clients, datasets=((spec, dataset),))
    final = run_rounds(strategy, grid, to_record(initial_arrays(model, 0)), rounds)
    return to_numpy(final)


def test_worker_side_sums_equal_per_client_aggregation_for_fedavg(ray_engine, digits_federation):
    plain = federated(ray_engine, digits_federation, FedAvg(fraction_evaluate=0.0))
    summed = federated(ray_engine, digits_federation, WorkerReduced(FedAvg(fraction_evaluate=0.0)))
    for key, value in plain.items():
        np.testing.assert_allclose(summed[key], value, rtol=1e-5, atol=1e-6)
        assert not np.array_equal(value, initial_arrays(digits_federation[2], 0)[key])


def test_worker_side_sums_equal_per_client_aggregation_for_dp_fedavg(ray_engine, digits_federation):
    def dp(worker_reduction):
        strategy = DPFedAvg(
            FedAvg(fraction_evaluate=0.0),
            clipping_norm=0.5,
            noise_multiplier=0.8,
            expected_clients=40,
            worker_reduction=worker_reduction,
        )
        strategy.bind_server_secret(RunSecret.from_passphrase("7").server())
        return strategy

    plain, summed = (
        federated(ray_engine, digits_federation, dp(False)),
        federated(ray_engine, digits_federation, dp(True)),
    )
    for key, value in plain.items():
        np.testing.assert_allclose(summed[key], value, rtol=1e-5, atol=1e-6)


def _secret_draws(engine, secrets):
    grid = engine.open_run(TOY, 6, secrets=secrets)
    queries = [Message(RecordDict(), node, "query") for node in grid.get_node_ids()]
    replies = grid.send_and_receive(queries)
    return {int(r.content["metrics"]["pid"]): r.content["metrics"]["secret-draw"] for r in replies}


@pytest.mark.parametrize("backend", ["ray_engine", "local_engine"])
def test_each_client_finds_its_own_secret_in_its_node_config(request, backend):
    engine = request.getfixturevalue(backend)
    root = RunSecret.from_passphrase("engine")
    draws = _secret_draws(engine, root)
    expected = {i: root.client(i).generator(0, Purpose.NOISE).random() for i in range(6)}
    assert draws == expected  # client i's secret, derived from the root on the worker
    fresh, again = _secret_draws(engine, None), _secret_draws(engine, None)
    assert all(fresh[i] not in (expected[i], again[i]) for i in range(6))  # OS randomness


def test_the_server_app_gets_the_servers_secret_and_no_run_config_entry(local_engine):
    from flwr.serverapp import ServerApp

    seen = {}
    server_app = ServerApp()

    @server_app.main()
    def main(grid, context):
        seen["secret"] = server_secret(context.node_config)
        seen["run_config"] = dict(context.run_config)

    root = RunSecret.from_passphrase("server app")
    context = local_engine.run_server_app(server_app, TOY, 3, run_config={"a": 1}, secrets=root)
    assert seen["secret"] == root.server() and seen["run_config"] == {"a": 1}
    assert context.node_config[NODE_SECRET_KEY] == root.server().token()


def test_more_workers_than_free_cpus_is_refused_not_awaited(ray_session):
    from fedsim.config import ConfigError
    from fedsim.engine import Engine, EngineConfig

    with pytest.raises(ConfigError) as err:
        Engine(EngineConfig(workers=3)).start()  # the session's Ray has 2 CPUs
    assert err.value.key == "engine.workers" and "2 of 2 CPUs free" in str(err.value)
