"""Sample-level DP-SGD on clients (Opacus): clipping, per-client accounting, runs on Ray."""

import logging
import math
import pickle

import numpy as np
import pytest
import torch
from flwr.app import RecordDict

from fedsim.config import ConfigError, from_mapping, to_mapping
from fedsim.data import build_dataset
from fedsim.engine import ClientRegistry
from fedsim.engine.participation import TRAIN
from fedsim.frontend.experiment import run_experiment
from fedsim.frontend.results import read_rounds
from fedsim.frontend.run_config import ExperimentConfig
from fedsim.frontend.run_root import resume_root
from fedsim.frontend.run_strategy import participation_for
from fedsim.frontend.rundir import RunDirectory
from fedsim.models import ModelSpec, initial_arrays
from fedsim.privacy.epsilon import epsilon
from fedsim.privacy.sampling import PoissonSampling
from fedsim.randomness import RunSecret
from fedsim.workloads import dp_sgd
from fedsim.workloads.dp_sgd import DPSGD, client_epsilon, epsilon_of, history_of
from fedsim.workloads.supervised import LocalTraining

SPEC = ModelSpec(kind="mlp", input_shape=(64,), num_classes=10, hidden=(16,))


@pytest.fixture(autouse=True)
def _quiet_dp_accounting():
    logging.getLogger("absl").setLevel(logging.ERROR)


def rows(n, seed=0):
    rng = np.random.default_rng(seed)
    x = torch.tensor(rng.normal(size=(n, 64)), dtype=torch.float32)
    return x, torch.tensor(rng.integers(0, 10, n))


def training(**dp):
    settings = {"noise_multiplier": 1.0, "max_grad_norm": 1.0, **dp}
    return LocalTraining(epochs=1, batch_size=5, lr=0.1, dp_sgd=DPSGD(**settings))


def train_client(spec, arrays, x, y, plan, state, **secret):
    """A client's DP-SGD round with ``plan``'s ``[client.dp_sgd]`` table."""
    return dp_sgd.train_client(spec, arrays, x, y, plan, state, dp=plan.dp_sgd, **secret)


def own(client=0, server_round=1, root="dp-sgd"):
    """Client ``client``'s own secret in round ``server_round`` (what its node_config holds)."""
    return {"secret": RunSecret.from_passphrase(root).client(client), "server_round": server_round}


def flat(model):
    return torch.cat([p.detach().flatten() for p in model.state_dict().values()]).numpy().copy()


def test_a_clients_epsilon_composes_over_its_rounds_in_its_state():
    x, y = rows(40)
    arrays = initial_arrays(SPEC, 0)
    state = RecordDict()
    reported = []
    for server_round in (1, 2, 3):
        result, metrics = train_client(
            SPEC, arrays, x, y, training(), state, **own(7, server_round)
        )
        reported.append(metrics["dp-sgd-epsilon"])
        assert metrics["dp-sgd-steps"] == 8  # ceil(40 / 5) Poisson steps per epoch
    assert reported[0] > 0 and reported[0] < reported[1] < reported[2]
    assert history_of(state) == [(1.0, 1 / 8, 24)] and epsilon_of(state) == reported[2]
    # what dp_accounting says of 24 Poisson-sampled Gaussian steps (its own RDP orders)
    ours = epsilon(1.0, PoissonSampling(1 / 8), 24, 1e-5)
    assert reported[2] == pytest.approx(ours, rel=0.01)
    # a fresh state starts the count again
    _, fresh = train_client(SPEC, arrays, x, y, training(), RecordDict(), **own(7))
    assert fresh["dp-sgd-epsilon"] == pytest.approx(reported[0])


def test_prv_accountant_agrees_with_rdp_within_its_slack():
    x, y = rows(40)
    _, rdp = train_client(
        SPEC, initial_arrays(SPEC, 0), x, y, training(), RecordDict(), **own(2)
    )
    _, prv = train_client(
        SPEC,
        initial_arrays(SPEC, 0),
        x,
        y,
        training(accountant="prv"),
        RecordDict(),
        **own(2),
    )
    assert 0 < prv["dp-sgd-epsilon"] < rdp["dp-sgd-epsilon"] * 1.05


def test_same_secret_same_model_other_round_or_secret_other_noise():
    x, y = rows(30)
    arrays = initial_arrays(SPEC, 1)

    def run(**secret):
        result, _ = train_client(SPEC, arrays, x, y, training(), RecordDict(), **secret)
        return flat(result.model)

    first = run(**own(3))
    assert np.array_equal(first, run(**own(3)))
    assert not np.array_equal(first, run(**own(3, server_round=2)))
    assert not np.array_equal(first, run(**own(3, root="another root")))
    assert not np.array_equal(first, run(**own(4)))  # another client: its own noise


@pytest.mark.filterwarnings("ignore:Optimal order is the smallest alpha")
def test_per_example_gradients_are_clipped():
    x, y = rows(12, seed=4)
    x = x * 100  # large inputs: every example's gradient is far above the bound
    arrays = initial_arrays(SPEC, 2)
    start = np.concatenate([np.asarray(v).ravel() for v in arrays.values()])
    bound, lr = 1e-3, 1.0
    plan = LocalTraining(
        epochs=1,
        batch_size=12,  # q = 1: every row in the one step, expected batch 12
        lr=lr,
        max_steps=1,
        dp_sgd=DPSGD(noise_multiplier=1e-6, max_grad_norm=bound),
    )
    result, metrics = train_client(SPEC, arrays, x, y, plan, RecordDict(), **own(0))
    step = np.linalg.norm(flat(result.model) - start)
    assert metrics["dp-sgd-steps"] == 1
    assert 0.2 * lr * bound < step <= lr * bound * (1 + 1e-3)  # mean of clipped gradients


def test_every_step_is_accounted_even_an_empty_batch():
    x, y = rows(3)
    plan = LocalTraining(
        epochs=4, batch_size=1, lr=0.1, dp_sgd=DPSGD(noise_multiplier=2.0, max_grad_norm=1.0)
    )
    state = RecordDict()
    _, metrics = train_client(
        SPEC, initial_arrays(SPEC, 0), x, y, plan, state, **own(0)
    )
    assert metrics["dp-sgd-steps"] == 12 and history_of(state) == [(2.0, 1 / 3, 12)]
    assert math.isfinite(metrics["dp-sgd-epsilon"])
    assert metrics["dp-sgd-epsilon"] == pytest.approx(client_epsilon([(2.0, 1 / 3, 12)], 1e-5))


def test_a_failed_step_drops_the_cached_model():
    x, y = rows(10)
    train_client(SPEC, initial_arrays(SPEC, 0), x, y, training(), RecordDict(), **own(1))
    cached = dp_sgd.private_model(SPEC)
    bad = {k: v for k, v in initial_arrays(SPEC, 0).items()}
    bad.pop(next(iter(bad)))
    with pytest.raises(ValueError, match="do not match"):
        train_client(SPEC, bad, x, y, training(), RecordDict(), **own(1))
    x_bad = torch.zeros((10, 3))  # wrong width: fails inside the forward pass
    with pytest.raises(RuntimeError):
        train_client(
            SPEC, initial_arrays(SPEC, 0), x_bad, y, training(), RecordDict(), **own(1)
        )
    assert dp_sgd.private_model(SPEC) is not cached  # rebuilt after the failed step
    _, metrics = train_client(
        SPEC, initial_arrays(SPEC, 0), x, y, training(), RecordDict(), **own(1)
    )
    assert metrics["dp-sgd-epsilon"] > 0


@pytest.mark.parametrize(
    ("table", "key"),
    [
        ({"noise_multiplier": 0.0, "max_grad_norm": 1.0}, "client.dp_sgd.noise_multiplier"),
        ({"noise_multiplier": 1.0, "max_grad_norm": -1.0}, "client.dp_sgd.max_grad_norm"),
        ({"noise_multiplier": 1.0, "max_grad_norm": 1.0, "delta": 0.0}, "client.dp_sgd.delta"),
        (
            {"noise_multiplier": 1.0, "max_grad_norm": 1.0, "accountant": "gdp"},
            "client.dp_sgd.accountant",
        ),
        ({"noise_multiplier": 1.0, "max_grad_norm": 1.0, "sigma": 1}, "client.dp_sgd.sigma"),
        ({"max_grad_norm": 1.0}, "client.dp_sgd.noise_multiplier"),
    ],
)
def test_bad_dp_sgd_options_are_refused_by_name(table, key):
    with pytest.raises(ConfigError) as err:
        from_mapping(LocalTraining, {"dp_sgd": table}, "client")
    assert err.value.key == key


def test_secure_mode_needs_a_secure_generator():
    table = {"noise_multiplier": 1.0, "max_grad_norm": 1.0, "secure_mode": True}
    if dp_sgd.secure_rng_available():
        assert from_mapping(LocalTraining, {"dp_sgd": table}, "client").dp_sgd.secure_mode
    else:
        with pytest.raises(ConfigError) as err:
            from_mapping(LocalTraining, {"dp_sgd": table}, "client")
        assert err.value.key == "client.dp_sgd.secure_mode" and "torchcsprng" in err.value.allowed


def config(**strategy):
    return ExperimentConfig.from_dict(
        {
            "name": "dp-sgd",
            "seed": 5,
            "rounds": 3,
            "data": {"source": "digits", "partition": "iid", "num_clients": 12},
            "model": {"kind": "mlp", "hidden": [16]},
            "client": {
                "epochs": 1,
                "batch_size": 16,
                "lr": 0.1,
                "dp_sgd": {"noise_multiplier": 1.2, "max_grad_norm": 1.0, "delta": 1e-5},
            },
            "strategy": {"name": "fedavg", "clients_per_round": 6, **strategy},
            "evaluation": {"every": 3, "central_rows": 100},
            "engine": {"backend": "ray", "workers": 2},
        }
    )


def test_dp_sgd_with_federated_evaluation_needs_metrics_in_clear():
    with pytest.raises(ConfigError) as err:
        ExperimentConfig.from_dict({**to_mapping(config()), "evaluation": {"clients": 2}})
    assert err.value.key == "evaluation.clients" and "metrics_in_clear" in err.value.allowed
    clear = {"evaluation": {"clients": 2}, "privacy": {"metrics_in_clear": True}}
    assert ExperimentConfig.from_dict({**to_mapping(config()), **clear}).private


def test_dp_sgd_with_fedprox_is_refused():
    with pytest.raises(ConfigError) as err:
        config(name="fedprox", options={"proximal_mu": 0.1})
    assert err.value.key == "client.dp_sgd"


@pytest.mark.ray
def test_dp_sgd_clients_on_the_ray_engine_report_epsilon_and_the_worst_is_summarised(
    tmp_path, ray_session
):
    out = tmp_path / "run"
    # the run starts its own two Ray workers and releases their CPUs when it ends
    secrets = RunSecret.from_passphrase("tests")
    summary = run_experiment(config(), out, progress=False, secrets=secrets)
    records = [r for r in read_rounds(out / "rounds.jsonl") if r["round"] >= 1]
    assert len(records) == 3
    for r in records:
        assert r["train"]["clients"] == 6 and r["client_privacy"]["max_epsilon"] > 0
        # a private run: the clients' own numbers (train loss, ...) are not written
        assert "metrics" not in r["train"] and "metrics_in_clear" not in r
    # every client's own history, as its state holds it after the run
    run_config = config()
    # the states open only under the run's root (its nonce mixed in)
    store = RunDirectory.states(out, resume_root(out, secrets).keys)
    try:
        registry = ClientRegistry(12)
        blobs = store.get_many(registry.node_ids())
        states = {registry.partition_id(n): pickle.loads(b) for n, b in blobs.items()}
    finally:
        store.close()
    cohorts = participation_for(run_config, 12)
    sizes = build_dataset(run_config.data).train.sizes()
    own = {}
    for client in range(12):
        rounds_in = sum(client in cohorts.cohort(r, TRAIN) for r in (1, 2, 3))
        history = history_of(states[client]) if client in states else []
        steps = sum(h[2] for h in history)
        assert steps == rounds_in * math.ceil(sizes[client] / 16)  # every round it trained in
        if rounds_in:
            own[client] = epsilon_of(states[client])
            assert own[client] == pytest.approx(client_epsilon(history, 1e-5))
    assert max(len(history_of(states[c])) for c in own) == 1  # one (z, q) entry, steps summed
    assert summary["max_client_epsilon"] == pytest.approx(max(own.values()))
    assert summary["max_client_epsilon"] > records[0]["client_privacy"]["max_epsilon"] > 0
    assert summary["client_privacy"] == {"delta": 1e-5, "accountant": "rdp"}
