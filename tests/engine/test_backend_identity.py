"""The same run gives the same bits on the local backend and on Ray with any number of
workers: worker-side folds follow fixed chunks of the cohort, metric sums are exact."""

from __future__ import annotations

import json
import math
import random
from pathlib import Path

import numpy as np
import pytest
from flwr.app import Message, MetricRecord, RecordDict
from flwr.clientapp import ClientApp
from flwr.supercore.task_identity import TaskIdentity

from fedsim.config import load_toml
from fedsim.engine import NODE_ID_OFFSET, ClientAppSource, Engine, EngineConfig
from fedsim.engine.backend import LocalBackend
from fedsim.engine.dispatch import batch_sizes
from fedsim.frontend.experiment import run_experiment
from fedsim.frontend.results import read_rounds
from fedsim.frontend.run_config import ExperimentConfig
from fedsim.randomness import RunSecret
from fedsim.record_codec import to_numpy, to_record
from fedsim.worker_reduce import (
    ChunkedFold,
    ExactSum,
    MetricSums,
    WeightedMean,
    attach_reducer,
    fold_chunk_size,
)
from strategies.plumbing.clipped_sum import ClippedSum

QUICKSTART = Path(__file__).resolve().parents[2] / "experiments" / "quickstart" / "config.toml"
SHAPES = {"w": (7, 5), "b": (5,)}

# -- the fold of any split ------------------------------------------------------------------


def client_reply(pid: int) -> Message:
    """A reply with float32 arrays whose sums round differently in different orders."""
    rng = np.random.default_rng(pid)
    arrays = {
        k: (rng.normal(size=s) * 10.0 ** rng.integers(-3, 3)).astype(np.float32)
        for k, s in SHAPES.items()
    }
    metrics = MetricRecord(
        {
            "num-examples": int(rng.integers(1, 90)),
            "loss": float(rng.random() * 10.0 ** rng.integers(-4, 4)),
            "per-class": [float(x) for x in rng.random(3)],
        }
    )
    instruction = Message(RecordDict(), NODE_ID_OFFSET + pid, "train")
    return Message(
        RecordDict({"arrays": to_record(arrays), "metrics": metrics}), reply_to=instruction
    )


def instruction() -> RecordDict:
    return RecordDict(
        {"arrays": to_record({k: np.zeros(s, np.float32) for k, s in SHAPES.items()})}
    )


def bits(reply: Message) -> tuple[dict[str, bytes], dict[str, object]]:
    arrays = {k: v.tobytes() for k, v in to_numpy(reply.content["arrays"]).items()}
    return arrays, dict(reply.content["metrics"])


def split_fold(reducer, replies: list[Message], cuts: list[int], chunk: int) -> Message:
    """Workers fold batches ``replies[cuts[i]:cuts[i+1]]`` chunk by chunk; the grid folds the
    chunk partials in order."""
    grid = reducer.accumulator(instruction())
    for start, end in zip(cuts, cuts[1:], strict=False):
        worker = ChunkedFold(reducer, instruction(), chunk)
        for position, reply in enumerate(replies[start:end]):
            worker.add(position, reply)
        for partial in worker.results():
            grid.add(partial)
    return grid.result()


@pytest.fixture(autouse=True)
def _identity():
    TaskIdentity.run_id, TaskIdentity.node_id, TaskIdentity.task_id = 1, 1, 1


@pytest.mark.parametrize("reducer", [WeightedMean(), ClippedSum(clipping_norm=3.0)])
def test_the_fold_of_any_split_into_whole_chunks_gives_the_same_bits(reducer):
    replies = [client_reply(pid) for pid in range(157)]
    chunk = fold_chunk_size(len(replies))
    assert chunk == 3
    rng = random.Random(5)
    expected = bits(split_fold(reducer, replies, [0, len(replies)], chunk))
    chunks = math.ceil(len(replies) / chunk)
    for _ in range(12):
        inner = sorted(rng.sample(range(1, chunks), rng.randint(1, 20)))
        cuts = [0, *(c * chunk for c in inner), len(replies)]
        assert bits(split_fold(reducer, replies, cuts, chunk)) == expected
    for workers in (1, 2, 3, 8):  # the grid's own batches
        sizes = batch_sizes(len(replies), workers, chunk)
        assert all(size % chunk == 0 for size in sizes[:-1]) and sum(sizes) == len(replies)
        cuts = [0, *np.cumsum(sizes).tolist()]
        assert bits(split_fold(reducer, replies, cuts, chunk)) == expected


def test_metric_sums_of_any_split_merge_to_the_same_bits():
    rng = np.random.default_rng(3)
    records = [
        MetricRecord({"m": float(rng.normal() * 10.0 ** rng.integers(-8, 8)), "v": [1.1, 2.2]})
        for _ in range(200)
    ]
    weights = rng.integers(1, 100, size=len(records)).tolist()
    whole = MetricSums()
    for record, weight in zip(records, weights, strict=True):
        whole.add(record, weight=weight)
    order = list(range(len(records)))
    for seed in range(6):
        random.Random(seed).shuffle(order)
        parts = [MetricSums() for _ in range(seed + 2)]
        for i, index in enumerate(order):
            parts[i % len(parts)].add(records[index], weight=weights[index])
        merged = MetricSums()
        for part in reversed(parts):
            merged.merge(part)
        assert merged.means() == whole.means() and merged.total == whole.total
    exact = math.fsum(w * float(r["m"]) for r, w in zip(records, weights, strict=True))
    assert whole.means()["m"] == exact / math.fsum(weights)


def test_exact_sum_is_the_correctly_rounded_sum_in_any_order():
    terms = [1e16, 1.0, -1e16, 3.5e-300, 2.0**-60, 7.25] * 5
    forward, backward = ExactSum(), ExactSum()
    for x in terms:
        forward.add(x)
    for x in reversed(terms):
        backward.add(x)
    assert forward.value() == backward.value() == math.fsum(terms)
    assert sum(terms) != math.fsum(terms)  # plain summation would not do
    special = ExactSum()
    for x in (1.0, math.inf, 2.0):
        special.add(x)
    assert special.value() == math.inf


# -- the grid on pools of different sizes ---------------------------------------------------

app = ClientApp()


@app.train()
def _train(message: Message, context) -> Message:
    pid = int(context.node_config["partition-id"])
    if pid % 11 == 4:
        raise RuntimeError("fails on purpose")
    reply = client_reply(pid)
    return Message(reply.content, reply_to=message)


class Pool(LocalBackend):
    """The in-process backend posing as ``workers`` workers: the grid cuts its batches for
    that many (each runs in the driver)."""

    def __init__(self, workers: int) -> None:
        super().__init__(torch_threads=1)
        self.workers = workers

    @property
    def num_workers(self) -> int:
        return self.workers

    def submit(self, worker, batch):
        return super().submit(0, batch)


class Reports:
    def __init__(self):
        self.items = []

    def phase_finished(self, report):
        self.items.append(report)


@pytest.mark.parametrize("reducer", [WeightedMean(), ClippedSum(clipping_norm=3.0)])
def test_the_grid_folds_the_same_bits_for_any_number_of_workers(reducer):
    seen = []
    for workers in (1, 2, 3, 7):
        reports = Reports()
        engine = Engine(EngineConfig(backend="local"), backend=Pool(workers))
        grid = engine.open_run(ClientAppSource(app=app), 140, observer=reports)
        body = instruction()
        messages = [Message(body, NODE_ID_OFFSET + p, "train") for p in range(140)]
        replies = grid.send_and_receive(attach_reducer(messages, reducer))
        engine.close()
        folded = [r for r in replies if not r.has_error()]
        assert len(folded) == 1 and len(replies) == 1 + 13
        seen.append((bits(folded[0]), reports.items[0].client_metrics))
    assert all(s == seen[0] for s in seen[1:])


# -- whole runs: local, Ray with one and two workers ----------------------------------------

TIMING = {"seconds", "time_s", "clients_per_s", "compute_s", "wall_s"}


def tiny(strategy: dict) -> dict:
    raw = load_toml(QUICKSTART)
    raw.update(rounds=2, seed=4)
    raw["data"].update(num_clients=40)
    raw["client"].update(epochs=1)
    raw["model"].update(channels=[4, 4], hidden=[16])
    raw["strategy"] = {"clients_per_round": 12, "sampling": "uniform", **strategy}
    raw["evaluation"].update(clients=4, every=2)
    return raw


def without_timing(value):
    if isinstance(value, dict):
        return {k: without_timing(v) for k, v in value.items() if k not in TIMING}
    if isinstance(value, list):
        return [without_timing(v) for v in value]
    return value


def finished(raw: dict, engine: Engine, out: Path, replay: Path | None) -> tuple[dict, list]:
    run_experiment(
        ExperimentConfig.from_dict(raw),
        out,
        progress=False,
        engine=engine,
        secrets=RunSecret.from_passphrase("backend identity"),
        replay=replay,
    )
    model = dict(np.load(out / "model.npz"))
    return model, without_timing(read_rounds(out / "rounds.jsonl"))


STRATEGIES = {
    "fedavg": {"name": "fedavg"},
    "dp-fedavg": {
        "name": "dp-fedavg",
        "options": {"clipping_norm": 0.5, "noise_multiplier": 0.7},
    },
}


@pytest.fixture(scope="module")
def whole_runs(_ray, _shared_engine, tmp_path_factory):
    """Every strategy's run on the local backend, then replayed on Ray with one and with two
    workers: ``{name: (local, {workers: ray})}``. Each Ray pool is started once and runs every
    strategy (the shared engine's workers hold both CPUs, so it is closed first)."""
    if _shared_engine["engine"] is not None:
        _shared_engine["engine"].close()
        _shared_engine["engine"] = None
    out = tmp_path_factory.mktemp("backend_identity")
    local = Engine(EngineConfig(backend="local")).start()
    try:
        runs = {
            name: (finished(tiny(STRATEGIES[name]), local, out / name / "local", None), {})
            for name in STRATEGIES
        }
    finally:
        local.close()
    for workers in (1, 2):
        engine = Engine(EngineConfig(workers=workers)).start()
        try:
            for name in STRATEGIES:
                runs[name][1][workers] = finished(
                    tiny(STRATEGIES[name]), engine, out / name / f"ray{workers}",
                    out / name / "local",
                )  # fmt: skip
        finally:
            engine.close()
    return runs


@pytest.mark.ray
@pytest.mark.parametrize("name", sorted(STRATEGIES))
def test_local_and_ray_runs_are_bit_identical(name, whole_runs):
    expected, on_ray = whole_runs[name]
    assert any(r.get("aggregated") for r in expected[1])
    for workers in (1, 2):
        model, rounds = on_ray[workers]
        assert model.keys() == expected[0].keys()
        for key, value in expected[0].items():
            assert model[key].dtype == value.dtype and model[key].tobytes() == value.tobytes(), (
                f"{name}, {workers} Ray workers: {key} differs by "
                f"{np.abs(model[key] - value).max()}"
            )
        assert json.dumps(rounds, sort_keys=True) == json.dumps(expected[1], sort_keys=True)
