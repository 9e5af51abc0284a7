"""Clipped sums and the fixed-clipping DP-FedAvg wrapper."""

import numpy as np
import pytest
from flwr.app import ArrayRecord, ConfigRecord, Message, MetricRecord, RecordDict
from flwr.serverapp.strategy import FedAvg
from flwr.supercore.task_identity import TaskIdentity

from fedsim.engine import ClientRegistry
from fedsim.randomness import RunSecret
from fedsim.record_codec import to_numpy, to_record
from strategies.methods.dp_fedavg.strategy import DPFedAvg
from strategies.plumbing.clipped_sum import CLIENTS_KEY, CLIPPED_KEY, ClippedSum


@pytest.fixture(autouse=True)
def _identity():
    TaskIdentity.run_id, TaskIdentity.node_id, TaskIdentity.task_id = 1, 1, 1


GLOBAL = {"a": np.full((2, 3), 0.5, dtype=np.float32), "b": np.zeros(4, dtype=np.float32)}


def client_reply(update: dict[str, np.ndarray], weight: int = 5) -> Message:
    arrays = {k: (GLOBAL[k] + update[k]).astype(np.float32) for k in GLOBAL}
    metrics = MetricRecord({"num-examples": weight, "loss": 1.0})
    return Message(
        RecordDict({"arrays": to_record(arrays), "metrics": metrics}),
        reply_to=Message(RecordDict(), 9, "train"),
    )


def flat(arrays):
    return np.concatenate([np.asarray(arrays[k], dtype=np.float64).ravel() for k in GLOBAL])


def updates(rng, n, scale):
    return [
        {k: (scale * rng.normal(size=v.shape)).astype(np.float32) for k, v in GLOBAL.items()}
        for _ in range(n)
    ]


def instruction():
    return RecordDict({"arrays": to_record(GLOBAL)})


def test_clip_bounds_norm_and_keeps_direction():
    rng = np.random.default_rng(0)
    big, small = updates(rng, 1, 10.0)[0], updates(rng, 1, 1e-3)[0]
    zero = {k: np.zeros_like(v) for k, v in GLOBAL.items()}
    for update, clipped in ((big, 1), (small, 0), (zero, 0)):
        out = ClippedSum(1.0).reduce(instruction(), [client_reply(update)])
        total = flat(to_numpy(out.content["arrays"]))
        assert np.linalg.norm(total) <= 1.0 + 1e-6
        assert out.content["metrics"][CLIPPED_KEY] == clipped
        if clipped:  # same direction as the raw update
            raw = flat(update)
            assert np.dot(total, raw) / (np.linalg.norm(total) * np.linalg.norm(raw)) > 0.999999


def test_clipped_sum_is_associative_with_partials():
    rng = np.random.default_rng(1)
    replies = [client_reply(u, w) for u, w in zip(updates(rng, 7, 0.8), range(1, 8))]
    reducer = ClippedSum(1.0)
    whole = reducer.reduce(instruction(), replies)
    partials = [
        reducer.reduce(instruction(), replies[:3]),
        reducer.reduce(instruction(), replies[3:]),
    ]
    # a mix of partial and raw replies folds the same way
    mixed = reducer.reduce(instruction(), [partials[0], *replies[3:]])
    for other in (reducer.reduce(instruction(), partials), mixed):
        np.testing.assert_allclose(
            flat(to_numpy(other.content["arrays"])),
            flat(to_numpy(whole.content["arrays"])),
            atol=1e-12,
        )
        assert other.content["metrics"][CLIENTS_KEY] == 7
        assert other.content["metrics"][CLIPPED_KEY] == whole.content["metrics"][CLIPPED_KEY]
        assert other.content["metrics"]["num-examples"] == 28


def test_clipping_norm_must_be_positive():
    with pytest.raises(ValueError, match="clipping_norm"):
        ClippedSum(0.0)


class _Grid:
    """Just enough of a Grid for FedAvg.configure_train."""

    def __init__(self, n):
        self.registry = ClientRegistry(n)

    def get_node_ids(self):
        return self.registry.node_ids()


def dp_fedavg(clipping_norm, noise_multiplier, expected_clients, root="0", **kwargs):
    strategy = DPFedAvg(
        FedAvg(min_available_nodes=0),
        clipping_norm=clipping_norm,
        noise_multiplier=noise_multiplier,
        expected_clients=expected_clients,
        **kwargs,
    )
    strategy.bind_server_secret(RunSecret.from_passphrase(root).server())
    return strategy


def answering(messages, replies):
    """``replies``' contents as the answers of the first ``len(replies)`` instructions."""
    messages = list(messages)
    assert len(replies) <= len(messages), (len(replies), len(messages))
    return [Message(r.content, reply_to=m) for m, r in zip(messages, replies)]


def run_round(strategy, replies, server_round=1):
    grid = _Grid(len(replies))
    messages = strategy.configure_train(server_round, to_record(GLOBAL), ConfigRecord(), grid)
    arrays, metrics = strategy.aggregate_train(server_round, answering(messages, replies))
    return flat(to_numpy(arrays)) - flat(GLOBAL), metrics


def test_noiseless_dp_fedavg_is_the_mean_of_clipped_updates():
    rng = np.random.default_rng(2)
    ups = updates(rng, 6, 1.0)
    replies = [client_reply(u) for u in ups]
    delta, metrics = run_round(dp_fedavg(0.5, 0.0, 8), replies)
    expected = sum(flat(u) * min(1.0, 0.5 / np.linalg.norm(flat(u))) for u in ups) / 8
    np.testing.assert_allclose(delta, expected, atol=1e-6)
    assert metrics["dp-clients"] == 6 and metrics["dp-noise-std"] == 0.0


def test_noise_has_the_calibrated_scale_and_follows_the_servers_secret():
    rng = np.random.default_rng(3)
    replies = [client_reply(u) for u in updates(rng, 4, 0.0)]  # zero updates: delta is pure noise

    def noise(root):
        dp = dp_fedavg(2.0, 1.5, 4, root)
        samples = [run_round(dp, replies, r)[0] for r in range(1, 401)]
        return np.concatenate(samples)

    first = noise("11")
    std = 1.5 * 2.0 / 4  # z C / m, in float32 arithmetic on the model
    assert abs(first.mean()) < 4 * std / np.sqrt(first.size)
    assert first.std() == pytest.approx(std, rel=0.03)
    assert np.array_equal(first, noise("11"))  # the same secret: the same noise, round by round
    assert not np.array_equal(first, noise("12"))
    # the same round always draws the same noise: a resumed round repeats it exactly
    dp = dp_fedavg(2.0, 1.5, 4, "11")
    assert np.array_equal(run_round(dp, replies, 7)[0], run_round(dp, replies, 7)[0])


def test_client_metrics_and_the_exact_clipped_fraction_are_released_only_in_clear():
    rng = np.random.default_rng(4)
    replies = [client_reply(u) for u in updates(rng, 5, 2.0)]  # each reply has "loss": 1.0
    _, hidden = run_round(dp_fedavg(1.0, 1.0, 5), replies)
    assert "loss" not in hidden and "dp-clipped-fraction" not in hidden
    assert hidden["dp-clients"] == 5 and hidden["dp-noise-std"] == 0.2
    _, shown = run_round(dp_fedavg(1.0, 1.0, 5, metrics_in_clear=True), replies)
    assert shown["loss"] == 1.0 and shown["dp-clipped-fraction"] == 1.0


def test_an_unbound_strategy_draws_fresh_os_noise_and_never_pickles_its_secret():
    import pickle

    rng = np.random.default_rng(5)
    replies = [client_reply(u) for u in updates(rng, 2, 0.0)]
    one = DPFedAvg(FedAvg(), clipping_norm=1.0, noise_multiplier=1.0, expected_clients=2)
    two = DPFedAvg(FedAvg(), clipping_norm=1.0, noise_multiplier=1.0, expected_clients=2)
    assert not np.array_equal(run_round(one, replies)[0], run_round(two, replies)[0])
    secret = one.server_secret()
    copy = pickle.loads(pickle.dumps(one))  # what a checkpoint holds
    assert "_server_secret" not in vars(copy) and copy.server_secret() != secret


def test_errors_are_skipped_and_a_round_without_replies_still_releases_noise():
    from flwr.app import Error

    failed = Message(Error(code=2, reason="boom"), reply_to=Message(RecordDict(), 9, "train"))
    quiet = dp_fedavg(1.0, 0.0, 2)
    quiet.configure_train(1, to_record(GLOBAL), ConfigRecord(), _Grid(2))
    arrays, metrics = quiet.aggregate_train(1, [failed])
    np.testing.assert_array_equal(flat(to_numpy(arrays)), flat(GLOBAL))  # no noise, no clients
    assert metrics["dp-clients"] == 0 and len(quiet.ledger) == 1

    noisy = dp_fedavg(1.0, 1.0, 2)
    noisy.configure_train(1, to_record(GLOBAL), ConfigRecord(), _Grid(2))
    arrays, metrics = noisy.aggregate_train(1, [failed])
    moved = flat(to_numpy(arrays)) - flat(GLOBAL)
    assert np.all(moved != 0) and metrics["dp-noise-std"] == 0.5  # dropouts remove no noise
    assert len(noisy.ledger) == 1  # and the release is accounted
    messages = noisy.configure_train(2, to_record(GLOBAL), ConfigRecord(), _Grid(2))
    replies = [failed, *answering(messages, [client_reply(GLOBAL)])]
    arrays, metrics = noisy.aggregate_train(2, replies)
    assert isinstance(arrays, ArrayRecord) and metrics["dp-clients"] == 1
