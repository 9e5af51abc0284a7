"""Worker-side reducers: equal to Flower's own aggregation, associative, validated."""

import numpy as np
import pytest
from flwr.app import ConfigRecord, Message, MetricRecord, RecordDict
from flwr.serverapp.strategy.strategy_utils import aggregate_arrayrecords, aggregate_metricrecords
from flwr.supercore.task_identity import TaskIdentity

from fedsim.record_codec import to_numpy, to_record
from fedsim.worker_reduce import (
    REDUCER_KEY,
    Reducer,
    ReductionError,
    WeightedMean,
    attach_reducer,
    reducer_of,
)


@pytest.fixture(autouse=True)
def _identity():
    TaskIdentity.run_id, TaskIdentity.node_id, TaskIdentity.task_id = 1, 1, 1


def reply(rng, weight, shapes=((3, 4), (4,))):
    instruction = Message(RecordDict(), 5, "train")
    arrays = {f"w{i}": rng.normal(size=s).astype(np.float32) for i, s in enumerate(shapes)}
    metrics = MetricRecord({"num-examples": weight, "loss": float(rng.random()), "acc": [1.0, 2.0]})
    return Message(
        RecordDict({"arrays": to_record(arrays), "metrics": metrics}), reply_to=instruction
    )


def test_weighted_mean_equals_flower_fedavg():
    rng = np.random.default_rng(0)
    replies = [reply(rng, w) for w in (3, 10, 1, 7)]
    folded = WeightedMean().reduce(RecordDict(), replies)
    expected = aggregate_arrayrecords([r.content for r in replies], "num-examples")
    ours = to_numpy(folded.content["arrays"])
    for key, value in expected.items():
        np.testing.assert_allclose(ours[key], value.numpy(), rtol=1e-6, atol=1e-7)
    metrics = folded.content["metrics"]
    flower = aggregate_metricrecords([r.content for r in replies], "num-examples")
    assert metrics["num-examples"] == 21
    assert metrics["loss"] == pytest.approx(flower["loss"])
    assert metrics["acc"] == pytest.approx(flower["acc"])


@pytest.mark.parametrize("split", [1, 2, 3])
def test_partials_fold_to_the_same_mean(split):
    rng = np.random.default_rng(split)
    replies = [reply(rng, int(w)) for w in rng.integers(1, 50, size=6)]
    whole = WeightedMean().reduce(RecordDict(), replies)
    parts = [
        WeightedMean().reduce(RecordDict(), replies[:split]),
        WeightedMean().reduce(RecordDict(), replies[split:]),
    ]
    twice = WeightedMean().reduce(RecordDict(), parts)
    # and FedAvg over the partials is FedAvg over the replies
    fedavg = aggregate_arrayrecords([p.content for p in parts], "num-examples")
    for key, value in to_numpy(whole.content["arrays"]).items():
        np.testing.assert_allclose(
            to_numpy(twice.content["arrays"])[key], value, rtol=1e-5, atol=1e-6
        )
        np.testing.assert_allclose(fedavg[key].numpy(), value, rtol=1e-5, atol=1e-6)
    assert twice.content["metrics"]["num-examples"] == whole.content["metrics"]["num-examples"]
    assert twice.content["metrics"]["loss"] == pytest.approx(whole.content["metrics"]["loss"])


def test_partial_keeps_reply_metadata_of_first_reply():
    rng = np.random.default_rng(1)
    replies = [reply(rng, 2), reply(rng, 3)]
    folded = WeightedMean().reduce(RecordDict(), replies)
    assert folded.metadata.reply_to_message_id == replies[0].metadata.reply_to_message_id
    assert folded.metadata is not replies[0].metadata


def test_unfoldable_replies_raise_reduction_error():
    rng = np.random.default_rng(2)
    good = reply(rng, 2)
    no_weight = Message(
        RecordDict({"arrays": good.content["arrays"], "metrics": MetricRecord({"loss": 1.0})}),
        reply_to=Message(RecordDict(), 5, "train"),
    )
    with pytest.raises(ReductionError, match="weight"):
        WeightedMean().reduce(RecordDict(), [no_weight])
    other_shapes = reply(rng, 2, shapes=((3, 4), (5,)))
    with pytest.raises(ReductionError, match="shape"):
        WeightedMean().reduce(RecordDict(), [good, other_shapes])
    with pytest.raises(ReductionError, match="nothing"):
        WeightedMean().reduce(RecordDict(), [])


def test_reducer_travels_as_a_config_record():
    messages = [Message(RecordDict(), 5, "train")] * 3  # one shared content
    attach_reducer(messages, WeightedMean("weight"))
    rebuilt = reducer_of(messages[0].content)
    assert isinstance(rebuilt, WeightedMean) and rebuilt.weight_key == "weight"
    assert reducer_of(RecordDict()) is None


def test_only_reducer_classes_can_be_named():
    record = ConfigRecord({"class": "os:system"})
    with pytest.raises(ReductionError, match="not a fedsim Reducer"):
        Reducer.from_config(record)
    with pytest.raises(ReductionError, match="cannot import"):
        Reducer.from_config(ConfigRecord({"class": "no.such.module:Thing"}))
    assert REDUCER_KEY == "fedsim.reducer"
