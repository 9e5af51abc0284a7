"""Central DP-FTRL / BandMF strategy: the released model, the noise, the ledger, resuming."""

import logging
import math
import pickle

import cloudpickle
import dp_accounting as dpa
import numpy as np
import pytest
from dp_accounting.rdp import RdpAccountant
from flwr.app import ConfigRecord, Message, MetricRecord, RecordDict
from flwr.serverapp.strategy import FedAvg
from flwr.supercore.task_identity import TaskIdentity

from fedsim.config import ConfigError
from fedsim.engine import ClientRegistry
from fedsim.privacy.matrix import (
    Participation,
    banded,
    binary_tree,
    momentum,
    prefix_sum,
    sqrt_factorization,
)
from fedsim.privacy.matrix.sensitivity import brute_force
from fedsim.privacy.matrix.streaming import dense_fresh_noise
from fedsim.randomness import RunSecret
from fedsim.record_codec import to_numpy, to_record
from strategies.methods.matrix_mechanism import MatrixMechanism

GLOBAL = {"w": np.zeros((3, 4), dtype=np.float64), "b": np.zeros(5, dtype=np.float64)}
SIZE = sum(v.size for v in GLOBAL.values())
DELTA = 1e-5


@pytest.fixture(autouse=True)
def _identity():
    TaskIdentity.run_id, TaskIdentity.node_id, TaskIdentity.task_id = 1, 1, 1


@pytest.fixture(autouse=True)
def _quiet_dp_accounting():
    logging.getLogger("absl").setLevel(logging.ERROR)


class _Grid:
    """``n`` nodes (after the first ``offset``: fresh nodes, for a participation guard)."""

    def __init__(self, n, offset=0):
        self.registry, self.offset = ClientRegistry(n + offset), offset

    def get_node_ids(self):
        return self.registry.node_ids()[self.offset :]


def split(flat):
    out, start = {}, 0
    for k, v in GLOBAL.items():
        out[k] = flat[start : start + v.size].reshape(v.shape)
        start += v.size
    return out


def flat(arrays):
    return np.concatenate([np.asarray(arrays[k], dtype=np.float64).ravel() for k in GLOBAL])


def reply(base, update):
    arrays = {k: base[k] + u for k, u in split(update).items()}
    content = RecordDict(
        {"arrays": to_record(arrays), "metrics": MetricRecord({"num-examples": 1, "loss": 0.5})}
    )
    return Message(content, reply_to=Message(RecordDict(), 9, "train"))


def mechanism(f, z=1.0, clip=1.0, m=2.0, root="7", **kwargs):
    strategy = MatrixMechanism(
        FedAvg(fraction_train=1.0, min_available_nodes=0, min_train_nodes=0),
        factorization=f,
        clipping_norm=clip,
        noise_multiplier=z,
        expected_clients=m,
        **kwargs,
    )
    strategy.bind_server_secret(RunSecret.from_passphrase(root).server())
    return strategy


def answering(messages, replies):
    """``replies``' contents as the answers of the first ``len(replies)`` instructions."""
    messages = list(messages)
    assert len(replies) <= len(messages), (len(replies), len(messages))
    return [Message(r.content, reply_to=m) for m, r in zip(messages, replies)]


def run(strategy, updates, arrays=None, first=1):
    """Rounds first.. with one list of client updates each; the flat model after each."""
    arrays = to_record(GLOBAL) if arrays is None else arrays
    models = []
    for t, round_updates in enumerate(updates, start=first):
        base = to_numpy(arrays)
        grid = _Grid(len(round_updates), offset=t * len(round_updates))
        messages = strategy.configure_train(t, arrays, ConfigRecord(), grid)
        replies = answering(messages, [reply(base, u) for u in round_updates])
        arrays, metrics = strategy.aggregate_train(t, replies)
        models.append(flat(to_numpy(arrays)))
    return models, arrays, metrics


def small_updates(rng, rounds, clients):
    """Updates inside the clipping ball (norm 0.5), so the clipped sum is their plain sum."""
    out = []
    for _ in range(rounds):
        ups = [rng.normal(size=SIZE) for _ in range(clients)]
        out.append([0.5 * u / np.linalg.norm(u) for u in ups])
    return out


@pytest.mark.parametrize("beta", [0.0, 0.6])
def test_model_is_the_workload_applied_to_gradients_plus_streamed_noise(beta):
    n, m, z, clip, eta = 8, 2.0, 0.7, 1.0, 0.3
    f = banded(n, bands=2)
    strategy = mechanism(
        f,
        z,
        clip,
        m,
        participation=Participation.separated(4),
        server_learning_rate=eta,
        server_momentum=beta,
    )
    ups = small_updates(np.random.default_rng(0), n, 2)
    models, _, _ = run(strategy, ups)
    X = np.array([sum(u) for u in ups]) / m  # mean clipped updates, one row per round
    Z = dense_fresh_noise(strategy.stream)  # the fresh noise the rounds drew
    sigma = z * clip * f.sensitivity(Participation.separated(4)).value
    A = momentum(n, beta, eta)
    expected = A @ (X + sigma / m * f.apply_noising(Z))
    np.testing.assert_allclose(np.array(models), expected, atol=1e-10)
    if beta == 0:  # DP-FTRL's noisy prefix sums: eta * B (C X' + Z') with X' = X m / sigma
        release = f.B @ (f.C @ (X * m / sigma) + Z)
        np.testing.assert_allclose(np.array(models), eta * sigma / m * release, atol=1e-10)


def test_tree_factorization_streams_its_noise_too():
    n, m = 8, 3.0
    f = binary_tree(n)
    strategy = mechanism(f, 1.3, 1.0, m)
    ups = small_updates(np.random.default_rng(1), n, 3)
    models, _, _ = run(strategy, ups)
    Z = dense_fresh_noise(strategy.stream)
    sigma = 1.3 * f.sensitivity().value
    expected = prefix_sum(n) @ (np.array([sum(u) for u in ups]) / m) + sigma / m * (f.B @ Z)
    np.testing.assert_allclose(np.array(models), expected, atol=1e-10)


def test_tree_restart_streams_its_noise_too():
    from fedsim.privacy.matrix.kinds.tree_restart import tree_restart  # noqa: PLC0415

    n, m = 10, 3.0
    f = tree_restart(n, 4)
    strategy = mechanism(f, 1.3, 1.0, m)
    ups = small_updates(np.random.default_rng(1), n, 3)
    models, _, _ = run(strategy, ups)
    Z = dense_fresh_noise(strategy.stream)
    assert Z.shape[0] == f.C.shape[0]
    sigma = 1.3 * f.sensitivity().value
    expected = prefix_sum(n) @ (np.array([sum(u) for u in ups]) / m) + sigma / m * (f.B @ Z)
    np.testing.assert_allclose(np.array(models), expected, atol=1e-10)


def test_noise_has_the_calibrated_scale():
    n, m, z, clip = 4, 5.0, 2.0, 0.5
    f = banded(n, bands=2)
    strategy = mechanism(f, z, clip, m, participation=Participation.separated(2))
    assert strategy.sensitivity == pytest.approx(math.sqrt(2))  # k = 2 columns of norm 1
    assert strategy.noise_std == pytest.approx(z * clip * math.sqrt(2))
    global_big = {"w": np.zeros(200_000)}
    arrays = to_record(global_big)
    G = f.noising_matrix()
    for t in range(1, n + 1):
        strategy.configure_train(t, arrays, ConfigRecord(), _Grid(1))
        out, metrics = strategy.aggregate_train(t, [])
        noise = to_numpy(out)["w"] - to_numpy(arrays)["w"]
        arrays = out
        expected = strategy.noise_std / m * np.linalg.norm(G[t - 1])
        assert np.std(noise) == pytest.approx(expected, rel=0.01)
        assert metrics["dp-clients"] == 0 and metrics["dp-noise-std"] == pytest.approx(
            strategy.noise_std / m
        )


def gaussian_epsilon(z):
    return RdpAccountant().compose(dpa.GaussianDpEvent(z)).get_epsilon(DELTA)


def epsilons(strategy, n):
    out = []
    for t in range(1, n + 1):
        strategy.configure_train(t, to_record(GLOBAL), ConfigRecord(), _Grid(1))
        strategy.aggregate_train(t, [])
        out.append(strategy.privacy_report()["epsilon"])
    return out


def test_epsilon_per_round_is_the_gaussian_of_the_released_rows():
    n, b, z = 9, 3, 1.5
    f = sqrt_factorization(n)  # C >= 0, so enumerating patterns gives the exact sensitivity
    participation = Participation.separated(b)
    eps = epsilons(mechanism(f, z, participation=Participation.separated(b), delta=DELTA), n)
    full = brute_force(f.C, participation)
    for t, e in enumerate(eps, start=1):
        released = brute_force(f.C[:t, :t], participation)  # rows 0..t-1 are out
        assert e == pytest.approx(gaussian_epsilon(z * full / released), rel=1e-6)
    assert eps[-1] == pytest.approx(gaussian_epsilon(z), rel=1e-6)  # the whole run: z
    assert all(later >= earlier for earlier, later in zip(eps, eps[1:]))


def test_banded_epsilon_is_z_after_the_last_round():
    n, b, z = 12, 4, 1.5
    f = banded(n, bands=b)
    strategy = mechanism(f, z, participation=Participation.separated(b), delta=DELTA)
    eps = epsilons(strategy, n)
    for t in range(1, b + 1):  # one participation so far: the largest released column norm
        norm = np.linalg.norm(f.C[:t, :t], axis=0).max()
        assert eps[t - 1] == pytest.approx(gaussian_epsilon(z * math.sqrt(3) / norm), rel=1e-6)
    assert eps[-1] == pytest.approx(gaussian_epsilon(z), rel=1e-6)  # sens^2 = ceil(12 / 4)
    report = strategy.privacy_report()
    assert report["sensitivity_exact"] and report["released_sensitivity_exact"]
    assert report["sensitivity"] == pytest.approx(math.sqrt(3))
    assert report["effective_noise_multiplier"] == pytest.approx(z)


def test_single_participation_epsilon_for_a_tree():
    f = binary_tree(8)
    assert f.max_column_norm() == pytest.approx(2.0)  # each leaf lies in log2(8) + 1 nodes
    eps = epsilons(mechanism(f, 2.0, delta=DELTA), 8)
    # after round 1 only leaf 0 is out (norm 1); after round 2 leaf 0 and node [0, 1]
    assert eps[0] == pytest.approx(gaussian_epsilon(2.0 * 2.0 / 1.0), rel=1e-6)
    assert eps[1] == pytest.approx(gaussian_epsilon(2.0 * 2.0 / math.sqrt(2)), rel=1e-6)
    assert eps[-1] == pytest.approx(gaussian_epsilon(2.0), rel=1e-6)


def test_pickled_strategy_resumes_to_the_same_models():
    n = 6
    f = banded(n, bands=3)
    ups = small_updates(np.random.default_rng(2), n, 2)
    three = Participation.separated(3)
    whole, _, _ = run(mechanism(f, participation=three, server_momentum=0.5), ups)
    first = mechanism(f, participation=three, server_momentum=0.5)
    head, arrays, _ = run(first, ups[:3])
    blob = cloudpickle.dumps(first)  # what a checkpoint holds: no secret, no past noise
    restored = pickle.loads(blob)
    assert restored.stream is None and "_server_secret" not in vars(restored)
    for row in first.stream.state()["history"]:
        assert row.tobytes() not in blob
    restored.bind_server_secret(RunSecret.from_passphrase("7").server())  # as --resume does
    tail, _, _ = run(restored, ups[3:], arrays=arrays, first=4)
    np.testing.assert_array_equal(np.array(head + tail), np.array(whole))
    assert len(restored.ledger) == n
    other = pickle.loads(blob)  # resumed with another root: other noise from round 4 on
    other.bind_server_secret(RunSecret.from_passphrase("8").server())
    assert not np.allclose(run(other, ups[3:], arrays=arrays, first=4)[0], tail)


def test_rounds_past_the_factorization_stop_the_run():
    strategy = mechanism(banded(2, bands=1))
    assert not strategy.should_stop(2)
    assert strategy.should_stop(3) and "n = 2" in strategy.stop_reason
    assert list(strategy.configure_train(3, to_record(GLOBAL), ConfigRecord(), _Grid(2))) == []


def test_rounds_out_of_order_are_refused():
    strategy = mechanism(banded(4, bands=1))
    strategy.configure_train(2, to_record(GLOBAL), ConfigRecord(), _Grid(1))
    with pytest.raises(RuntimeError, match="noise row 1"):
        strategy.aggregate_train(2, [])


def test_clipping_and_metrics():
    strategy = mechanism(banded(2, bands=1), z=0.0, clip=1.0, m=2.0)
    big = np.full(SIZE, 3.0)
    models, _, metrics = run(strategy, [[big, 0.1 * big / np.linalg.norm(big)]])
    assert np.linalg.norm(models[0]) == pytest.approx((1.0 + 0.1) / 2)
    assert metrics["dp-clients"] == 2 and strategy.epsilon() == math.inf
    assert "dp-clipped-fraction" not in metrics and "loss" not in metrics  # un-noised: held back
    clear = mechanism(banded(2, bands=1), z=0.0, clip=1.0, m=2.0, metrics_in_clear=True)
    _, _, metrics = run(clear, [[big, 0.1 * big / np.linalg.norm(big)]])
    assert metrics["dp-clipped-fraction"] == 0.5 and metrics["loss"] == pytest.approx(0.5)


@pytest.mark.parametrize(
    ("kwargs", "key"),
    [
        ({"factorization": "f.npz"}, "factorization"),
        ({"clipping_norm": 0.0}, "clipping_norm"),
        ({"noise_multiplier": -1.0}, "noise_multiplier"),
        ({"server_learning_rate": [1.0, 2.0]}, "server_learning_rate"),
        ({"server_momentum": 1.0}, "server_momentum"),
        ({"participation": (2, 2)}, "participation"),
        ({"participation": "min_sep"}, "participation"),
        ({"accountant": "moments"}, "accountant"),
    ],
)
def test_bad_arguments_name_the_argument(kwargs, key):
    args = {
        "factorization": banded(4, bands=1),
        "clipping_norm": 1.0,
        "noise_multiplier": 1.0,
        "expected_clients": 2.0,
        **kwargs,
    }
    with pytest.raises(ConfigError) as err:
        MatrixMechanism(FedAvg(), **args)
    assert err.value.key == key


def test_encoder_through_keeps_the_rows_released_by_then():
    tree = binary_tree(8)
    released = tree.encoder_through(2)  # leaves 0 and 1, and the node over both
    assert released.shape == (3, 2)
    np.testing.assert_array_equal(np.sort(released.sum(axis=1)), [1, 1, 2])
    square = banded(6, bands=2)
    np.testing.assert_array_equal(square.encoder_through(4), square.C[:4, :4])
    assert square.sensitivity_through(6).value == square.sensitivity().value
    with pytest.raises(ConfigError, match="rounds"):
        square.encoder_through(7)
