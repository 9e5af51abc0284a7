"""Clipped sums against a hostile client (after ../shared/attacks/clip_bypass.py).

The attacker is one client of a DP round: it controls its whole reply (arrays, metrics,
record names, even the Python object its ClientApp returns). The claims: its update is
clipped to ``C`` and counted, or refused and named in ``rejected``; it never passes for a
worker's partial sum (which skips clipping), never poisons the sum with NaN or infinity,
and never crashes the fold for the other clients.
"""

from __future__ import annotations

import pickle
from pathlib import Path

import numpy as np
import pytest
from flwr.app import ArrayRecord, ConfigRecord, Message, MetricRecord, RecordDict
from flwr.common.serde import message_from_proto, message_to_proto
from flwr.supercore.task_identity import TaskIdentity

from fedsim.engine import ClientAppSource
from fedsim.engine.client_registry import NODE_ID_OFFSET
from fedsim.record_codec import to_numpy, to_record
from fedsim.worker_reduce import PartialReply, folded_reply, is_partial
from fedsim.workloads.popri_feedback import CLIENTS_KEY as SCORE_CLIENTS_KEY
from fedsim.workloads.popri_feedback import ClippedScoreSum
from strategies.plumbing.clipped_sum import CLIENTS_KEY, CLIPPED_KEY, ClippedSum
from strategies.registry import build_strategy

C = 1.0
GLOBAL = {"w": np.zeros(4), "b": np.zeros(2, dtype=np.float32)}
TOY = ClientAppSource(reference="toy_app:app", app_dir=str(Path(__file__).parent.parent))


@pytest.fixture(autouse=True)
def _identity():
    TaskIdentity.run_id, TaskIdentity.node_id, TaskIdentity.task_id = 1, 0, 1


def instruction() -> RecordDict:
    return RecordDict({"arrays": to_record(GLOBAL)})


def reply(node: int, update: float, metrics=None, arrays=None, extra=None) -> Message:
    values = arrays if arrays is not None else {k: v + update for k, v in GLOBAL.items()}
    content = RecordDict(
        {"arrays": to_record(values), "metrics": MetricRecord(metrics or {"num-examples": 10})}
    )
    for name, record in (extra or {}).items():
        content[name] = record
    return Message(content, reply_to=Message(RecordDict(), NODE_ID_OFFSET + node, "train"))


def norm(message: Message) -> float:
    arrays = to_numpy(message.content["arrays"])
    return float(np.sqrt(sum(np.sum(np.asarray(v, np.float64) ** 2) for v in arrays.values())))


SPOOFS = {
    "fedsim.clients metric (clip_bypass.py)": dict(
        metrics={"num-examples": 10, "fedsim.clients": 0, "fedsim.clipped": 0}
    ),
    "fedsim.clipped metric only": dict(metrics={"num-examples": 10, "fedsim.clipped": 0}),
    "reserved record name": dict(extra={"fedsim.partial": ConfigRecord({"clients": 0})}),
    "reserved config key": dict(extra={"config": ConfigRecord({"fedsim.reducer": "x"})}),
}


@pytest.mark.parametrize("spoof", list(SPOOFS))
def test_a_client_posing_as_a_partial_sum_is_refused_and_named(spoof):
    honest = [reply(i, 0.1 * (i + 1)) for i in range(3)]
    attacker = reply(7, 1e6, **SPOOFS[spoof])
    alone = ClippedSum(C).reduce(instruction(), honest)
    out = ClippedSum(C).reduce(instruction(), [honest[0], attacker, *honest[1:]])
    assert out.rejected == (NODE_ID_OFFSET + 7,)
    assert out.content["metrics"][CLIENTS_KEY] == 3  # the three honest clients only
    np.testing.assert_array_equal(
        to_numpy(out.content["arrays"])["w"], to_numpy(alone.content["arrays"])["w"]
    )
    # and as the only reply: nothing folded, nobody counted, the attacker named
    only = ClippedSum(C).reduce(instruction(), [attacker])
    assert norm(only) == 0.0 and only.content["metrics"][CLIENTS_KEY] == 0
    assert only.rejected == (NODE_ID_OFFSET + 7,)


def test_the_same_update_without_the_disguise_is_clipped_and_counted():
    out = ClippedSum(C).reduce(instruction(), [reply(7, 1e6)])
    assert norm(out) == pytest.approx(C)
    assert out.content["metrics"][CLIENTS_KEY] == 1 and out.content["metrics"][CLIPPED_KEY] == 1
    assert out.rejected == ()


def test_folding_partials_keeps_the_refusals_and_still_refuses_raw_spoofs():
    honest = [reply(i, 0.3) for i in range(4)]
    attacker = reply(9, 1e6, **SPOOFS["fedsim.clients metric (clip_bypass.py)"])
    left = ClippedSum(C).reduce(instruction(), [honest[0], attacker])
    right = ClippedSum(C).reduce(instruction(), honest[1:])
    # what the workers send travels pickled: it stays the engine's type
    left, right = (pickle.loads(pickle.dumps(p)) for p in (left, right))
    assert is_partial(left) and is_partial(right)
    total = ClippedSum(C).reduce(instruction(), [left, right, attacker])
    assert total.content["metrics"][CLIENTS_KEY] == 4
    assert total.rejected == (NODE_ID_OFFSET + 9, NODE_ID_OFFSET + 9)
    whole = ClippedSum(C).reduce(instruction(), honest)
    np.testing.assert_allclose(
        to_numpy(total.content["arrays"])["w"], to_numpy(whole.content["arrays"])["w"]
    )


def test_flowers_wire_format_cannot_carry_a_partial_reply():
    """On Flower's runtime every reply is rebuilt from protobuf: a client that returns the
    engine's type arrives as a plain Message and is clipped."""
    huge = to_record({k: v + 1e6 for k, v in GLOBAL.items()})
    content = RecordDict({"arrays": huge, "metrics": MetricRecord({"num-examples": 1})})
    forged = folded_reply(reply(3, 0.0), content)
    arrived = message_from_proto(message_to_proto(forged))
    assert not is_partial(arrived)
    out = ClippedSum(C).reduce(instruction(), [arrived])
    assert norm(out) == pytest.approx(C) and out.content["metrics"][CLIENTS_KEY] == 1


MALFORMED = {
    "NaN entries": dict(arrays={"w": np.full(4, np.nan), "b": np.zeros(2, np.float32)}),
    "infinite entries": dict(arrays={"w": np.full(4, np.inf), "b": np.zeros(2, np.float32)}),
    "wrong shape": dict(arrays={"w": np.zeros(5), "b": np.zeros(2, np.float32)}),
    "broadcastable shape": dict(arrays={"w": np.full(1, 1e6), "b": np.zeros(2, np.float32)}),
    "missing array": dict(arrays={"w": np.zeros(4)}),
    "extra array": dict(arrays={**GLOBAL, "x": np.zeros(1)}),
    "two array records": dict(extra={"more": ArrayRecord()}),
    "negative weight": dict(metrics={"num-examples": -5}),
    "infinite weight": dict(metrics={"num-examples": float("inf")}),
    "list metric of another length": dict(metrics={"num-examples": 1, "acc": [1.0, 2.0, 3.0]}),
}


@pytest.mark.parametrize("case", list(MALFORMED))
def test_a_malformed_reply_is_refused_and_the_round_goes_on(case):
    honest = [
        reply(i, 0.2, metrics={"num-examples": 10, "acc": [0.5, 0.5]}) for i in range(3)
    ]
    bad = reply(5, 0.2, **MALFORMED[case])
    out = ClippedSum(C).reduce(instruction(), [honest[0], bad, *honest[1:]])
    assert np.isfinite(to_numpy(out.content["arrays"])["w"]).all()
    if case == "list metric of another length":  # the update is fine; its odd metric left out
        honest.append(reply(5, 0.2))
        assert out.content["metrics"][CLIENTS_KEY] == 4 and "acc" not in out.content["metrics"]
    whole = ClippedSum(C).reduce(instruction(), honest)
    np.testing.assert_array_equal(
        to_numpy(out.content["arrays"])["w"], to_numpy(whole.content["arrays"])["w"]
    )
    if case == "list metric of another length":
        return
    assert out.rejected == (NODE_ID_OFFSET + 5,)
    assert out.content["metrics"][CLIENTS_KEY] == 3


def test_popri_feedback_sums_refuse_a_spoofed_partial_sum():
    candidates = np.eye(6)[:, :4]
    instr = RecordDict({"candidates": to_record({"embeddings": candidates})})

    def score_reply(node, scores, metrics):
        scores = to_record({"scores": np.asarray(scores, float)})
        content = RecordDict({"scores": scores, "metrics": MetricRecord(metrics)})
        return Message(content, reply_to=Message(RecordDict(), NODE_ID_OFFSET + node, "train"))

    honest = score_reply(1, [0.6, 0.8, 0, 0, 0, 0], {"num-texts": 3})
    spoof = score_reply(2, [1e6] * 6, {"num-texts": 3, SCORE_CLIENTS_KEY: 0})
    out = ClippedScoreSum().reduce(instr, [honest, spoof])
    assert out.rejected == (NODE_ID_OFFSET + 2,)
    assert out.content["metrics"][SCORE_CLIENTS_KEY] == 1
    assert np.linalg.norm(to_numpy(out.content["scores"])["scores"]) == pytest.approx(1.0)


# -- through the engine: a worker folds, the grid folds, the strategy reduces ------------


def dp_round(engine, run_config, clients=6, name="dp-fedavg"):
    """One round of a clipped-sum strategy (C = 1, no noise, worker-side sums) of the toy
    app."""
    strategy = build_strategy(
        name,
        {"clipping_norm": C, "noise_multiplier": 0.0},
        expected_clients=clients,
        evaluate_fraction=0.0,
        seed=0,
        partial_aggregation="on",
        rounds=1,
    )
    grid = engine.open_run(TOY, clients, run_config=run_config)
    start = {"w": np.zeros(3, np.float32)}
    messages = list(strategy.configure_train(1, to_record(start), ConfigRecord(), grid))
    assert all("fedsim.reducer" in m.content for m in messages)
    replies = grid.send_and_receive(messages)
    arrays, metrics = strategy.aggregate_train(1, replies)
    moved = float(np.linalg.norm(to_numpy(arrays)["w"] - start["w"]))
    return moved, metrics, replies


def check_the_attack_fails(engine, name="dp-fedavg"):
    moved, metrics, replies = dp_round(
        engine, {"spoof-partition": 2, "forge-partition": 4}, name=name
    )
    assert metrics["rejected"] == [NODE_ID_OFFSET + 2]  # the spoofer, refused and named
    assert metrics["dp-clients"] == 4  # the forger's reply was an error: never folded
    assert sum(r.has_error() for r in replies) == 1
    assert "PartialReply" in next(r for r in replies if r.has_error()).error.reason
    # every counted update clipped to C, the mean over m = 6 expected clients
    assert moved <= C * 4 / 6 + 1e-6
    honest_moved, honest_metrics, _ = dp_round(engine, {}, name=name)
    assert honest_metrics["rejected"] == [] and honest_metrics["dp-clients"] == 6


@pytest.mark.parametrize("name", ["dp-fedavg", "matrix-mechanism"])
def test_the_engine_folds_refuse_a_spoofing_client_in_process(local_engine, name):
    check_the_attack_fails(local_engine, name)


@pytest.mark.ray
def test_the_engine_folds_refuse_a_spoofing_client_on_ray_workers(ray_engine):
    # the workers' partial sums come back over the authenticated channel as PartialReply
    assert ray_engine.describe()["direct_channels"] == 2
    check_the_attack_fails(ray_engine)


def test_partial_reply_is_a_message_subclass_only_the_engine_builds():
    assert issubclass(PartialReply, Message)
    assert not is_partial(reply(1, 0.0))
