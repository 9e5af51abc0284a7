"""DP-FedAvg's privacy side: adaptive clipping, the ledger, max_epsilon, server optimisers, runs."""

import functools
import json
import logging
import math

import dp_accounting as dpa
import numpy as np
import pytest
from dp_accounting.rdp import RdpAccountant
from flwr.app import ConfigRecord, Message, MetricRecord, RecordDict
from flwr.serverapp.strategy import FedAdam, FedAvg, FedAvgM
from flwr.supercore.task_identity import TaskIdentity

from fedsim.cli import main
from fedsim.config import ConfigError
from fedsim.engine import ClientRegistry
from fedsim.privacy import calibration
from fedsim.privacy.epsilon import epsilon, epsilon_curve
from fedsim.privacy.participation import Participation
from fedsim.privacy.round_events import split_noise_multiplier
from fedsim.privacy.sampling import FixedSizeSampling, PoissonSampling, relation_for
from fedsim.randomness import RunSecret
from fedsim.record_codec import to_numpy, to_record
from strategies.methods.dp_fedavg import config as dp_fedavg_config
from strategies.methods.dp_fedavg.strategy import AdaptiveClipping, DPFedAvg
from strategies.registry import build_strategy

GLOBAL = {"w": np.zeros((3, 4), dtype=np.float32), "b": np.zeros(5, dtype=np.float32)}
SIZE = sum(v.size for v in GLOBAL.values())


@pytest.fixture(autouse=True)
def _identity():
    TaskIdentity.run_id, TaskIdentity.node_id, TaskIdentity.task_id = 1, 1, 1


@pytest.fixture(autouse=True)
def _quiet_dp_accounting():
    # dp_accounting logs each fractional RDP order it drops (which only raises epsilon)
    logging.getLogger("absl").setLevel(logging.ERROR)


@pytest.fixture(scope="module")
def calibrate_noise():
    """``calibrate_noise`` memoised for this module, also where DP-FedAvg and the PLD
    calibration's RDP guess call it: a calibration the strategy ran is not run again to check
    it (dp_accounting is deterministic; typed, so 1, 1.0 and True are separate calls)."""
    cached = functools.lru_cache(maxsize=None, typed=True)(calibration.calibrate_noise)
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(calibration, "calibrate_noise", cached)
        patch.setattr(dp_fedavg_config, "calibrate_noise", cached)
        yield cached


class _Grid:
    def __init__(self, n):
        self.registry = ClientRegistry(n)

    def get_node_ids(self):
        return self.registry.node_ids()


def reply(update: np.ndarray, base=None) -> Message:
    """A client reply whose model is ``base`` (default: GLOBAL) plus ``update``."""
    base = GLOBAL if base is None else base
    arrays, start = {}, 0
    for k, v in base.items():
        arrays[k] = (v + update[start : start + v.size].reshape(v.shape)).astype(np.float32)
        start += v.size
    content = RecordDict(
        {"arrays": to_record(arrays), "metrics": MetricRecord({"num-examples": 1})}
    )
    return Message(content, reply_to=Message(RecordDict(), 9, "train"))


def flat(arrays) -> np.ndarray:
    return np.concatenate([np.asarray(arrays[k], dtype=np.float64).ravel() for k in GLOBAL])


def with_norms(rng, norms) -> list[np.ndarray]:
    directions = rng.normal(size=(len(norms), SIZE))
    directions /= np.linalg.norm(directions, axis=1, keepdims=True)
    return [n * d for n, d in zip(norms, directions)]


def answering(messages, replies):
    """``replies``' contents as the answers of the first ``len(replies)`` instructions."""
    messages = list(messages)
    assert len(replies) <= len(messages), (len(replies), len(messages))
    return [Message(r.content, reply_to=m) for m, r in zip(messages, replies)]


def one_round(strategy, server_round, updates, arrays=None):
    arrays = to_record(GLOBAL) if arrays is None else arrays
    # the grid offers as many nodes as the accounted fixed-size sampling draws (50 otherwise)
    offered = getattr(strategy.sampling, "sample_size", 50)
    messages = list(strategy.configure_train(server_round, arrays, ConfigRecord(), _Grid(offered)))
    if not messages:
        return None, None
    base = to_numpy(arrays)
    return strategy.aggregate_train(
        server_round, answering(messages, [reply(u, base) for u in updates])
    )


def dp(z=1.0, *, clipping_norm=1.0, m=20, seed=0, **kwargs):
    strategy = DPFedAvg(
        FedAvg(min_available_nodes=0),
        clipping_norm=clipping_norm,
        noise_multiplier=z,
        expected_clients=m,
        **kwargs,
    )
    strategy.bind_server_secret(RunSecret.from_passphrase(str(seed)).server())
    return strategy


# -- adaptive clipping ------------------------------------------------------------------------


@pytest.mark.parametrize(("gamma", "start"), [(0.5, 0.05), (0.5, 20.0), (0.9, 0.05)])
def test_adaptive_clipping_tracks_the_target_quantile(gamma, start):
    rng = np.random.default_rng(7)
    m = 50
    strategy = dp(
        0.5,
        clipping_norm=start,
        m=m,
        adaptive=AdaptiveClipping(
            target_unclipped_quantile=gamma, learning_rate=0.3, count_stddev=2.0
        ),
    )
    norms_seen, history = [], []
    for r in range(1, 81):
        norms = rng.uniform(1.0, 3.0, size=m)  # quantile gamma of the norms: 1 + 2 gamma
        norms_seen.append(norms)
        one_round(strategy, r, with_norms(rng, norms))
        history.append(strategy.clipping_norm)
    target = np.quantile(np.concatenate(norms_seen), gamma)
    late = np.array(history[-20:])
    assert abs(np.log(np.exp(np.log(late).mean()) / target)) < 0.1
    assert abs(np.log(history[4] / start)) > 0.3  # it moved, and from far away
    assert abs(np.log(history[0] / start)) <= 0.3 * max(gamma, 1 - gamma) + 0.3 * 3 * 2 / m


def test_adaptive_noise_has_the_split_scale_and_composes_to_the_configured_z():
    z, sigma_b, m, c = 0.8, 1.5, 10, 2.0
    z_update = split_noise_multiplier(z, sigma_b)
    assert z_update > z
    # the two releases of a round are, for dp_accounting, one Gaussian of multiplier z
    both = RdpAccountant().compose(
        dpa.ComposedDpEvent([dpa.GaussianDpEvent(z_update), dpa.GaussianDpEvent(2 * sigma_b)])
    )
    single = RdpAccountant().compose(dpa.GaussianDpEvent(z))
    assert both.get_epsilon(1e-5) == pytest.approx(single.get_epsilon(1e-5), rel=1e-9)

    strategy = dp(
        z,
        clipping_norm=c,
        m=m,
        seed=5,
        adaptive=AdaptiveClipping(learning_rate=1e-12, count_stddev=sigma_b),  # C stays put
    )
    samples = []
    for r in range(1, 301):
        norm_now = strategy.clipping_norm
        arrays, metrics = one_round(strategy, r, [np.zeros(SIZE)] * 4)  # zero updates
        samples.append(flat(to_numpy(arrays)))
        assert metrics["dp-noise-std"] == pytest.approx(z_update * norm_now / m, rel=1e-12)
        assert metrics["dp-noise-multiplier"] == z_update
    noise = np.concatenate(samples)
    assert noise.std() == pytest.approx(z_update * c / m, rel=0.03)
    assert abs(noise.mean()) < 4 * noise.std() / math.sqrt(noise.size)


def test_adaptive_clipping_counts_dropouts_as_absent_not_as_noise_free():
    m = 10
    strategy = dp(
        1.0, clipping_norm=1.0, m=m, adaptive=AdaptiveClipping(learning_rate=0.2, count_stddev=1.0)
    )
    rng = np.random.default_rng(3)
    _, metrics = one_round(strategy, 1, with_norms(rng, [0.1] * 3))  # 3 of 10 replied
    # the estimate divides by the expected 10, not by the 3 that replied
    assert metrics["dp-unclipped-estimate"] == pytest.approx(0.5 + 1.5 / m, abs=4 * 1.0 / m)
    assert metrics["dp-clients"] == 3


# -- the ledger -------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("sampling", "accountant", "relation"),
    [
        (PoissonSampling(0.05), "rdp", "add_remove"),
        (PoissonSampling(0.05), "pld", "add_remove"),
        (FixedSizeSampling(20, 400), "rdp", "replace_one"),
    ],
)
def test_ledger_epsilon_equals_the_accounting_library(sampling, accountant, relation):
    z, delta, rounds = 1.1, 1e-6, 6
    rng = np.random.default_rng(1)
    plain = dp(z, sampling=sampling, delta=delta, accountant=accountant)
    adaptive = dp(
        z,
        sampling=sampling,
        delta=delta,
        accountant=accountant,
        adaptive=AdaptiveClipping(count_stddev=1.0),
    )
    for r in range(1, rounds + 1):
        for strategy in (plain, adaptive):
            one_round(strategy, r, with_norms(rng, rng.uniform(0.5, 2, size=5)))
    expected = epsilon(z, sampling, rounds, delta, accountant, relation)
    for strategy in (plain, adaptive):
        report = strategy.privacy_report()
        assert report["epsilon"] == pytest.approx(expected, rel=1e-6)
        assert report["delta"] == delta and report["accountant"] == accountant
        assert report["relation"] == relation and report["rounds_accounted"] == rounds


def test_min_separation_is_accounted_per_participation():
    z, delta = 2.0, 1e-5
    strategy = dp(z, sampling=Participation.separated(3, 2), delta=delta)
    for r in range(1, 7):
        one_round(strategy, r, [np.zeros(SIZE)])
    expected = epsilon(z, Participation.separated(3, 2), 6, delta)
    assert strategy.epsilon() == pytest.approx(expected, rel=1e-9)


def test_max_epsilon_stops_before_the_round_that_would_exceed_it():
    z, q, delta = 1.0, 0.1, 1e-5
    curve = epsilon_curve(z, PoissonSampling(q), [1, 2, 3, 4, 5, 6], delta)
    budget = (curve[3] + curve[4]) / 2  # four rounds fit, five do not
    strategy = dp(z, sampling=PoissonSampling(q), delta=delta, max_epsilon=budget)
    ran = 0
    for r in range(1, 9):
        if strategy.should_stop(r):
            break
        arrays, _ = one_round(strategy, r, [np.full(SIZE, 0.1)])
        assert arrays is not None
        ran += 1
    assert ran == 4 and len(strategy.ledger) == 4
    assert strategy.epsilon() == pytest.approx(curve[3], rel=1e-9) and strategy.epsilon() <= budget
    assert "max_epsilon" in strategy.stop_reason and "round 5" in strategy.stop_reason
    # a loop that does not ask (Flower's Strategy.start) gets no messages and spends nothing
    assert list(strategy.configure_train(6, to_record(GLOBAL), ConfigRecord(), _Grid(5))) == []
    assert strategy.aggregate_train(6, []) == (None, None)
    assert len(strategy.ledger) == 4


def test_flower_start_with_a_budget_spends_no_more_than_it():
    class Grid(_Grid):
        """Every addressed client replies with the global model plus 0.01."""

        def send_and_receive(self, messages, timeout=None):
            replies = []
            for message in messages:
                moved = {k: v + 0.01 for k, v in to_numpy(message.content["arrays"]).items()}
                content = RecordDict(
                    {"arrays": to_record(moved), "metrics": MetricRecord({"num-examples": 1})}
                )
                replies.append(Message(content, reply_to=message))
            return replies

    z, q, delta = 1.0, 0.1, 1e-5
    curve = epsilon_curve(z, PoissonSampling(q), [1, 2, 3], delta)
    strategy = DPFedAvg(
        FedAvg(fraction_evaluate=0.0, min_available_nodes=0),
        clipping_norm=1.0,
        noise_multiplier=z,
        expected_clients=3,
        sampling=PoissonSampling(q),
        delta=delta,
        max_epsilon=(curve[1] + curve[2]) / 2,
    )
    result = strategy.start(Grid(3), to_record(GLOBAL), num_rounds=6)
    assert len(strategy.ledger) == 2 and strategy.epsilon() == pytest.approx(curve[1])
    assert result.arrays is not None


# -- server optimisers ------------------------------------------------------------------------


def test_server_momentum_applies_to_the_noisy_mean():
    options = {
        "clipping_norm": 10.0,
        "noise_multiplier": 0.0,
        "server_optimizer": "fedavgm",
        "server_momentum": 0.5,
        "server_learning_rate": 1.0,
    }
    strategy = build_strategy(
        "dp-fedavg", options, expected_clients=2, evaluate_fraction=0.0, seed=0
    )
    assert isinstance(strategy.strategy, FedAvgM)
    first, second = np.full(SIZE, 0.2), np.full(SIZE, -0.1)
    arrays, _ = one_round(strategy, 1, [first, first])  # mean update 0.2
    np.testing.assert_allclose(flat(to_numpy(arrays)), 0.2, atol=1e-6)
    # FedAvgM: velocity 0.5 * 0.2 + (-0.1) = 0: the model stays where momentum holds it
    arrays, _ = one_round(strategy, 2, [second, second], arrays)
    np.testing.assert_allclose(flat(to_numpy(arrays)), 0.2, atol=1e-6)
    arrays, _ = one_round(strategy, 3, [second, second], arrays)  # 0.5 * 0 - 0.1
    np.testing.assert_allclose(flat(to_numpy(arrays)), 0.1, atol=1e-6)


def test_fedadam_server_optimiser_moves_along_the_private_update():
    options = {
        "clipping_norm": 1.0,
        "noise_multiplier": 0.0,
        "server_optimizer": "fedadam",
        "eta": 0.05,
    }
    strategy = build_strategy(
        "dp-fedavg", options, expected_clients=2, evaluate_fraction=0.0, seed=0
    )
    assert isinstance(strategy.strategy, FedAdam)
    update = np.linspace(-1, 1, SIZE) * 0.01
    arrays, _ = one_round(strategy, 1, [update, update])
    moved = flat(to_numpy(arrays))
    assert np.all(np.sign(moved[update != 0]) == np.sign(update[update != 0]))
    assert np.abs(moved).max() <= 0.05 + 1e-6  # Adam's first step is about eta per coordinate


# -- configuration ----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("options", "key"),
    [
        ({"noise_multiplier": 1.0}, "clipping_norm"),
        ({"clipping_norm": 0.0, "noise_multiplier": 1.0}, "clipping_norm"),
        ({"clipping_norm": 1.0, "noise_multiplier": -0.5}, "noise_multiplier"),
        ({"clipping_norm": 1.0, "noise_multiplier": 1.0, "delta": 1.0}, "delta"),
        ({"clipping_norm": 1.0, "noise_multiplier": 1.0, "accountant": "gdp"}, "accountant"),
        ({"clipping_norm": 1.0, "noise_multiplier": 1.0, "max_epsilon": 0}, "max_epsilon"),
        ({"clipping_norm": 1.0, "noise_multiplier": 1.0, "adaptive_clipping": 1}, "adaptive"),
        (
            {"clipping_norm": 1.0, "noise_multiplier": 1.0, "target_unclipped_quantile": 0.5},
            "target_unclipped_quantile",
        ),
        (
            {
                "clipping_norm": 1.0,
                "noise_multiplier": 1.0,
                "adaptive_clipping": True,
                "target_unclipped_quantile": 1.5,
            },
            "target_unclipped_quantile",
        ),
        (
            {
                "clipping_norm": 1.0,
                "noise_multiplier": 1.0,
                "adaptive_clipping": True,
                "clip_learning_rate": 0,
            },
            "clip_learning_rate",
        ),
        (
            {"clipping_norm": 1.0, "noise_multiplier": 1.0, "adaptive_clipping": True},
            "clipped_count_stddev",  # default m / 20 = 0.5: 2 sigma_b = z leaves nothing
        ),
        (
            {"clipping_norm": 1.0, "noise_multiplier": 1.0, "server_optimizer": "krum"},
            "server_optimizer",
        ),
        ({"clipping_norm": 1.0, "noise_multiplier": 1.0, "momentum": 0.9}, "momentum"),
    ],
)
def test_bad_options_are_refused_by_name(options, key):
    with pytest.raises(ConfigError) as err:
        build_strategy("dp-fedavg", options, expected_clients=10, evaluate_fraction=0.0, seed=0)
    assert err.value.key.startswith("strategy.options.") and key in err.value.key


def test_an_accountant_that_cannot_amplify_the_sampling_is_refused():
    with pytest.raises(ConfigError) as err:
        build_strategy(
            "dp-fedavg",
            {"clipping_norm": 1.0, "noise_multiplier": 1.0, "accountant": "pld"},
            expected_clients=5,
            evaluate_fraction=0.0,
            seed=0,
            sampling=FixedSizeSampling(5, 30),
        )
    assert err.value.key == "strategy.options.accountant" and "rdp" in err.value.allowed


@pytest.mark.parametrize(
    ("sampling", "accountant"),
    [
        (PoissonSampling(0.1), "rdp"),
        (PoissonSampling(0.1), "pld"),
        (FixedSizeSampling(5, 50), "rdp"),
        (Participation.separated(3, 4), "rdp"),
    ],
)
def test_target_epsilon_calibrates_the_noise_the_ledger_then_accounts(
    sampling, accountant, calibrate_noise
):
    """target_epsilon: dp_accounting's calibration for the run's rounds and sampling; the
    ledger of the whole run then reports at most the target (never more), and barely less."""
    rounds, target = 12, 2.0
    strategy = build_strategy(
        "dp-fedavg",
        {"clipping_norm": 1.0, "target_epsilon": target, "accountant": accountant},
        expected_clients=5, evaluate_fraction=0.0, seed=0, sampling=sampling,
        population=50, rounds=rounds,
    )
    z = strategy.noise_multiplier
    relation = relation_for(strategy.sampling)
    assert z == calibrate_noise(target, strategy.ledger.delta, sampling, rounds, accountant,
                                relation)
    for r in range(1, rounds + 1):
        strategy.ledger.record(r, strategy.round_event())
    spent = strategy.ledger.epsilon(accountant=accountant)
    assert target * 0.99 < spent <= target


@pytest.mark.parametrize(
    ("options", "rounds", "key", "needle"),
    [
        ({"target_epsilon": 1e6}, 10, "target_epsilon", "reaches for 10 rounds"),
        ({"target_epsilon": 0}, 10, "target_epsilon", "finite number > 0"),
        ({"target_epsilon": True}, 10, "target_epsilon", "a number (finite)"),
        ({"target_epsilon": 2.0}, None, "rounds", "target_epsilon"),
        ({"target_epsilon": 2.0, "noise_multiplier": 1.0}, 10, "target_epsilon", "exactly one"),
        ({}, 10, "noise_multiplier", "exactly one of noise_multiplier, target_epsilon"),
    ],
)
def test_an_unreachable_or_ambiguous_target_epsilon_is_refused_by_name(
    options, rounds, key, needle
):
    with pytest.raises(ConfigError) as err:
        build_strategy(
            "dp-fedavg", {"clipping_norm": 1.0, **options}, expected_clients=5,
            evaluate_fraction=0.0, seed=0, sampling=PoissonSampling(0.1), rounds=rounds,
        )
    assert key in err.value.key and needle in str(err.value)


# -- fedsim run -------------------------------------------------------------------------------

RUN = """
name = "dp"
seed = 4
rounds = {rounds}

[data]
source = "digits"
partition = "iid"
num_clients = 30

[model]
kind = "logreg"

[client]
epochs = 1
batch_size = 16
lr = 0.2

[strategy]
name = "dp-fedavg"
clients_per_round = 8
sampling = "{sampling}"
options = {{ {options} }}

[evaluation]
every = 1
central_rows = 200

[engine]
backend = "local"
"""


def fedsim_run(tmp_path, name, **fields):
    path = tmp_path / f"{name}.toml"
    path.write_text(RUN.format(**fields))
    out = tmp_path / name
    assert main(["run", str(path), "--out", str(out), "--no-progress"]) == 0
    lines = [json.loads(x) for x in (out / "rounds.jsonl").read_text().splitlines()]
    return lines, json.loads((out / "summary.json").read_text())


def test_fedsim_run_reports_epsilon_every_round_and_stops_at_max_epsilon(tmp_path, capsys):
    z, q, delta = 1.0, 8 / 30, 1e-5
    curve = epsilon_curve(z, PoissonSampling(q), [1, 2, 3], delta)
    budget = (curve[1] + curve[2]) / 2
    lines, summary = fedsim_run(
        tmp_path,
        "poisson",
        rounds=5,
        sampling="poisson",
        options=f"clipping_norm = 1.0, noise_multiplier = {z}, delta = {delta}, "
        f"max_epsilon = {budget}",
    )
    assert [r["round"] for r in lines] == [0, 1, 2]  # 2 of 5 rounds: the third would exceed
    assert all({"epsilon", "delta", "accountant"} <= set(r["privacy"]) for r in lines)
    assert lines[0]["privacy"]["epsilon"] == 0.0
    assert [r["privacy"]["epsilon"] for r in lines[1:]] == pytest.approx(curve[:2], rel=1e-9)
    assert lines[2]["privacy"]["relation"] == "add_remove"
    assert summary["rounds"] == 2 and "max_epsilon" in summary["stopped_reason"]
    assert summary["privacy"]["epsilon"] == pytest.approx(curve[1])
    assert summary["privacy"]["epsilon"] <= budget
    # said on the console, in one line with the epsilon it stopped at
    stopped = [x for x in capsys.readouterr().out.splitlines() if "STOPPED EARLY" in x]
    assert len(stopped) == 1
    assert stopped[0].startswith(
        f"fedsim: STOPPED EARLY by the privacy budget after round 2 of 5 at epsilon = "
        f"{summary['privacy']['epsilon']:.6g} (delta = 1e-05): max_epsilon: round 3 would "
    )


def test_fedsim_run_with_adaptive_clipping_uniform_sampling_and_fedadam(tmp_path):
    z, delta = 1.0, 1e-5
    lines, summary = fedsim_run(
        tmp_path,
        "adaptive",
        rounds=3,
        sampling="uniform",
        options=f"clipping_norm = 0.05, noise_multiplier = {z}, adaptive_clipping = true, "
        "clipped_count_stddev = 1.0, clip_learning_rate = 0.5, server_optimizer = 'fedadam', "
        "eta = 0.05",
    )
    assert [r["round"] for r in lines] == [0, 1, 2, 3] and summary["stopped_reason"] is None
    norms = [r["aggregated"]["dp-clipping-norm"] for r in lines[1:]]
    assert norms[0] == 0.05 and norms[2] > norms[1] > norms[0]  # updates are far above 0.05
    expected = epsilon_curve(
        z, FixedSizeSampling(8, 30), [1, 2, 3], delta, "rdp", "replace_one"
    )
    assert [r["privacy"]["epsilon"] for r in lines[1:]] == pytest.approx(expected, rel=1e-9)
    assert lines[3]["privacy"]["relation"] == "replace_one"
    assert summary["privacy"]["delta"] == pytest.approx(min(1e-5, 1 / 30))


def test_fedsim_run_refuses_a_bad_option_by_name(tmp_path, capsys):
    path = tmp_path / "bad.toml"
    path.write_text(
        RUN.format(
            rounds=2,
            sampling="poisson",
            options="clipping_norm = 1.0, noise_multiplier = 1.0, max_epsilon = -1",
        )
    )
    assert main(["run", str(path), "--out", str(tmp_path / "bad"), "--no-progress"]) == 2
    assert "strategy.options.max_epsilon" in capsys.readouterr().err
