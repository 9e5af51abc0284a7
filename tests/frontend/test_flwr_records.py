"""fedsim's strategies inside a plain Flower app under `fedsim flwr-run`: the same records as
`fedsim run` (epsilon per round, noise, clipping norm, sampling), and the samplings that
cannot be accounted refused."""

import json
import logging
from pathlib import Path

import numpy as np
import pytest
from flwr.app import ConfigRecord, Message, MetricRecord, RecordDict
from flwr.app.message_type import MessageType
from flwr.serverapp.strategy import FedAvg
from flwr.supercore.task_identity import TaskIdentity

from fedsim.cli import main
from fedsim.config import ConfigError
from fedsim.engine import MinSeparationCohort, UniformCohort
from fedsim.engine.client_registry import ClientRegistry
from fedsim.privacy.sampling import FixedSizeSampling
from fedsim.record_codec import to_record
from strategies.methods.dp_fedavg.strategy import DPFedAvg

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "flower_app_dp"
ROUNDS, NODES, COHORT = 3, 20, 10
RUN_CONFIG = """
name = "flwr-twin"
seed = 1
rounds = {rounds}

[data]
source = "digits"
partition = "iid"
num_clients = {nodes}

[model]
kind = "logreg"

[client]
epochs = 1
batch_size = 8
lr = 0.1

[strategy]
name = "dp-fedavg"
clients_per_round = {cohort}
sampling = "{sampling}"
options = {{ clipping_norm = 1.0, noise_multiplier = 1.0, delta = 1e-5 }}

[evaluation]
clients = 0
every = 1

[engine]
backend = "local"
"""
#: what the mechanism releases each round (the rest depends on the model and the data)
MECHANISM = ("dp-clipping-norm", "dp-noise-multiplier", "dp-noise-std", "rejected")


def lines(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "rounds.jsonl").read_text().splitlines()]


def flwr_run(out: Path, *extra: str, run_config: str = "") -> int:
    overrides = f"num-server-rounds={ROUNDS} fraction-train=0.5 {run_config}".strip()
    argv = ["flwr-run", str(EXAMPLE), "--backend", "local", "--no-progress"]
    return main([*argv, "--run-config", overrides, *extra, "--out", str(out)])


def fedsim_run(tmp_path: Path, sampling: str, cohort: int) -> Path:
    config = tmp_path / f"{sampling}.toml"
    config.write_text(
        RUN_CONFIG.format(rounds=ROUNDS, nodes=NODES, cohort=cohort, sampling=sampling)
    )
    out = tmp_path / f"run-{sampling}"
    assert main(["run", str(config), "--out", str(out), "--no-progress"]) == 0
    return out


def assert_same_privacy_lines(
    flwr_out: Path, run_out: Path, mechanism: tuple[str, ...] = MECHANISM
) -> list[float]:
    """Every round's privacy report and the ``mechanism`` metrics are the same; returns the
    epsilons."""
    ours, theirs = lines(flwr_out), lines(run_out)
    assert [r["round"] for r in ours] == [r["round"] for r in theirs] == list(range(ROUNDS + 1))
    assert ours[0]["privacy"] == theirs[0]["privacy"]  # round 0: nothing released yet
    assert ours[0]["privacy"]["epsilon"] == 0 and set(ours[0]) == set(theirs[0])
    for mine, twin in zip(ours[1:], theirs[1:]):
        # the same sections, the clients' metrics left out; a round whose secret Poisson cohort
        # came out empty (probability 0.75^20 a round at 5 of 20) trains nobody, so it has no
        # train section, and its release (noise only) is accounted all the same
        for line in (mine, twin):
            trained = line["aggregated"].get("dp-clients", 1) > 0
            assert ("train" in line) == trained, line
            assert "metrics" not in line.get("train", {})
        assert set(mine) - {"train"} == set(twin) - {"train"}
        assert mine["privacy"] == twin["privacy"]
        assert {k: mine["aggregated"][k] for k in mechanism} == {
            k: twin["aggregated"][k] for k in mechanism
        }
    summaries = [json.loads((o / "summary.json").read_text()) for o in (flwr_out, run_out)]
    assert summaries[0]["privacy"] == summaries[1]["privacy"] == ours[-1]["privacy"]
    assert summaries[0]["stopped_reason"] is None and summaries[1]["stopped_reason"] is None
    return [r["privacy"]["epsilon"] for r in ours[1:]]


def test_dp_fedavg_in_a_flower_app_writes_the_privacy_lines_of_fedsim_run(tmp_path):
    """Flower's FedAvg samples fraction-train = 0.5 of 20 nodes uniformly: fixed-size
    sampling of 10 of 20, amplified exactly as `fedsim run` with 10 clients per round."""
    assert flwr_run(tmp_path / "flwr") == 0
    epsilons = assert_same_privacy_lines(tmp_path / "flwr", fedsim_run(tmp_path, "uniform", 10))
    first = lines(tmp_path / "flwr")[1]
    assert first["privacy"]["sampling"] == {
        "model": "FixedSizeSampling", "sample_size": COHORT, "population": NODES
    }
    assert first["train"]["messages"] == COHORT
    assert epsilons == sorted(epsilons) and epsilons[0] > 0
    print("flwr-run vs run, uniform 10 of 20, epsilon per round:", epsilons)


def test_an_engine_poisson_cohort_taken_whole_is_accounted_as_poisson(tmp_path):
    """`--sampling poisson`: the engine draws each node with probability 5/20 and the app's
    FedAvg (fraction-train = 1) takes the whole cohort: Poisson amplification, as `fedsim run`
    with sampling = "poisson"."""
    out = tmp_path / "flwr"
    extra = ("--sampling", "poisson", "--clients-per-round", "5", "--seed", "1")
    assert flwr_run(out, *extra, run_config="fraction-train=1.0") == 0
    # the app divides by the size of the first cohort it is offered (a secret Poisson draw),
    # `fedsim run` by the expected 5: the noise of the mean differs, the accounting does not
    same = tuple(k for k in MECHANISM if k != "dp-noise-std")
    epsilons = assert_same_privacy_lines(out, fedsim_run(tmp_path, "poisson", 5), same)
    assert lines(out)[1]["privacy"]["sampling"] == {"model": "PoissonSampling", "rate": 0.25}
    summary = json.loads((out / "summary.json").read_text())
    assert summary["participation"] == {"sampling": "poisson", "rate": 0.25, "cohorts": "secret"}
    print("flwr-run vs run, poisson 5/20, epsilon per round:", epsilons)


def test_a_fraction_of_an_engine_cohort_is_refused(tmp_path, capsys):
    extra = ("--sampling", "uniform", "--clients-per-round", "10")
    assert flwr_run(tmp_path / "o", *extra) == 2  # fraction-train = 0.5 of the cohort
    err = capsys.readouterr().err
    assert "fraction_train" in err and "engine" in err
    assert not (tmp_path / "o" / "summary.json").exists()


# -- what cannot be accounted is refused, before anything is released ------------------------


@pytest.fixture(autouse=True)
def _identity():
    """The server's task identity, which Flower's Message needs outside a ServerApp."""
    TaskIdentity.run_id = TaskIdentity.task_id = TaskIdentity.node_id = 1


class Grid:
    """The node ids a grid offers (and, optionally, the engine's cohort model)."""

    def __init__(self, n, participation=None):
        self.registry = ClientRegistry(n)
        self.participation = participation

    def get_node_ids(self):
        if self.participation is None:
            return self.registry.node_ids()
        return self.registry.node_ids_of(self.participation.cohort(1))


class LowestNodes(FedAvg):
    """Samples the nodes with the smallest ids: not uniform."""

    def configure_train(self, server_round, arrays, config, grid):
        nodes = sorted(grid.get_node_ids())[:2]
        record = RecordDict({"arrays": arrays, "config": config})
        return self._construct_messages(record, nodes, MessageType.TRAIN)


def dp(inner, **kwargs):
    return DPFedAvg(inner, clipping_norm=1.0, noise_multiplier=1.0, expected_clients=2, **kwargs)


def configure(strategy, grid, server_round=1):
    arrays = to_record({"w": np.zeros(3, dtype=np.float32)})
    return list(strategy.configure_train(server_round, arrays, ConfigRecord(), grid))


@pytest.mark.parametrize(
    ("inner", "grid", "needle"),
    [
        (LowestNodes(min_available_nodes=0), Grid(10), "LowestNodes's configure_train"),
        (FedAvg(fraction_train=0.0), Grid(10), "fraction_train"),
        (FedAvg(min_available_nodes=30), Grid(10), "wait for 30 forever"),
        (FedAvg(), Grid(10, UniformCohort(10, 4, 0)), "fraction_train / min_train_nodes"),
        (
            FedAvg(fraction_train=1.0, min_train_nodes=0, min_available_nodes=0),
            Grid(10, MinSeparationCohort(10, 2, 0)),
            "Participation.separated",
        ),
    ],
)
def test_a_sampling_that_cannot_be_accounted_is_refused(inner, grid, needle):
    strategy = dp(inner)
    with pytest.raises(ConfigError, match="sampling|fraction|min_") as err:
        configure(strategy, grid)
    assert needle in str(err.value)
    assert len(strategy.ledger) == 0


def test_a_population_that_changes_between_rounds_is_refused():
    strategy = dp(FedAvg(fraction_train=0.5, min_available_nodes=0))
    assert len(configure(strategy, Grid(10))) == 5
    assert strategy.sampling == FixedSizeSampling(5, 10)
    with pytest.raises(ConfigError, match=r"sampling \(round 2\)") as err:
        configure(strategy, Grid(12), server_round=2)
    assert "the 10 nodes of the first round" in str(err.value)


def test_an_explicit_fixed_size_sampling_that_sends_more_is_refused():
    strategy = dp(FedAvg(min_available_nodes=0), sampling=FixedSizeSampling(3, 10))
    with pytest.raises(ConfigError, match="at most the accounted sample size 3"):
        configure(strategy, Grid(10))


class ReplyingGrid(Grid):
    """A grid without fedsim's round log (as Flower's own runtime): every node replies."""

    def send_and_receive(self, messages, *, timeout=None):
        replies = []
        for message in messages:
            content = RecordDict(
                {"arrays": message.content["arrays"], "metrics": MetricRecord({"num-examples": 1})}
            )
            replies.append(Message(content, reply_to=message))
        return replies


def test_without_a_round_log_the_privacy_report_goes_to_flowers_log(caplog):
    strategy = dp(FedAvg(fraction_train=0.5, fraction_evaluate=0.0, min_available_nodes=0))
    arrays = to_record({"w": np.zeros(3, dtype=np.float32)})
    with caplog.at_level(logging.INFO, logger="flwr"):
        result = strategy.start(ReplyingGrid(10), arrays, num_rounds=2)
    reports = [r.getMessage() for r in caplog.records if "Privacy:" in r.getMessage()]
    assert len(reports) == 2 and f"'epsilon': {strategy.epsilon()!r}" in reports[-1]
    assert "'sample_size': 5, 'population': 10" in reports[-1]
    assert sorted(result.train_metrics_clientapp) == [1, 2]
