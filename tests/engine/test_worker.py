"""ClientWorker as a plain class: contexts, state, failures, reduction."""

import pickle

import numpy as np
import pytest
from flwr.app import ConfigRecord, Message, RecordDict
from flwr.common.constant import ErrorCode
from flwr.supercore.task_identity import TaskIdentity

from fedsim.engine import ClientAppSource, ClientWorker
from fedsim.engine.client_registry import NODE_ID_OFFSET
from fedsim.engine.worker import ClientBatch, Content, RunSpec
from fedsim.randomness import NODE_SECRET_KEY, RootSource, RunSecret
from fedsim.record_codec import to_numpy, to_record
from fedsim.worker_reduce import WeightedMean, attach_reducer


@pytest.fixture(autouse=True)
def _identity():
    TaskIdentity.run_id, TaskIdentity.node_id, TaskIdentity.task_id = 1, 1, 1


def make_worker(**run_config):
    worker = ClientWorker()
    source = ClientAppSource(
        reference="toy_app:app", app_dir=str(__import__("pathlib").Path(__file__).parents[1])
    )
    worker.start_run(RunSpec(run_id=1, num_clients=10, run_config=run_config, app=source))
    return worker


def batch(partitions, reducer=None, states=None, batch_id=0):
    content = RecordDict(
        {"arrays": to_record({"w": np.zeros(3, np.float32)}), "config": ConfigRecord({"step": 1.0})}
    )
    messages = [Message(content, NODE_ID_OFFSET + p, "train") for p in partitions]
    if reducer is not None:
        attach_reducer(messages, reducer)
    for i, m in enumerate(messages):
        m.metadata.__dict__["_message_id"] = f"m{i}"
    return ClientBatch(
        batch_id=batch_id,
        metadata=[m.metadata for m in messages],
        content_index=[0] * len(messages),
        contents=[Content(1, pickle.dumps(content))],
        states=states or {},
        reducer=reducer,
    )


def test_each_client_gets_its_partition_and_replies_in_order():
    result = make_worker().run_batch(batch([4, 1, 7]))
    assert [r.content["metrics"]["pid"] for r in result.replies] == [4, 1, 7]
    assert [to_numpy(r.content["arrays"])["w"][0] for r in result.replies] == [5.0, 2.0, 8.0]
    assert result.succeeded == 3 and result.failed == 0
    assert result.metrics.means()["pid"] == pytest.approx((4 * 5 + 1 * 2 + 7 * 8) / 15)


def test_the_run_spec_names_the_root_file_and_holds_no_secret(tmp_path):
    root = RunSecret.from_passphrase("worker")
    root.write(tmp_path / "run.root")
    source = ClientAppSource(reference="toy_app:app", app_dir="tests")
    where = RootSource(str(tmp_path / "run.root"))
    spec = RunSpec(run_id=1, num_clients=10, run_config={}, app=source, secret=where)
    blob = pickle.dumps(spec)  # what the driver keeps and ships: the path, never the key
    assert root._key not in blob and root._key.hex().encode() not in blob
    config = spec.node_config(NODE_ID_OFFSET + 4, spec.secret.open())
    assert config[NODE_SECRET_KEY] == root.client(4).token() and config["partition-id"] == 4
    assert NODE_SECRET_KEY not in spec.node_config(NODE_ID_OFFSET + 4, None)


def test_state_persists_only_for_clients_that_succeed():
    worker = make_worker(fail="1")
    first = worker.run_batch(batch([0, 1]))
    assert set(first.states) == {NODE_ID_OFFSET}  # the failed client's state is dropped
    error = first.replies[-1]
    assert error.has_error() and error.error.code == ErrorCode.CLIENT_APP_RAISED_EXCEPTION
    assert "fails on purpose" in error.error.reason
    second = worker.run_batch(batch([0], states=first.states))
    assert second.replies[0].content["metrics"]["calls"] == 2


def test_a_batch_with_a_reducer_returns_one_partial_plus_errors():
    worker = make_worker(fail="2")
    result = worker.run_batch(batch([0, 1, 2, 3], reducer=WeightedMean()))
    partial, error = result.replies
    assert error.has_error()
    # weights 1, 2, 4 (partition 2 failed): mean of 1, 2, 4 weighted by themselves
    assert to_numpy(partial.content["arrays"])["w"][0] == pytest.approx((1 + 4 + 16) / 7)
    assert partial.content["metrics"]["num-examples"] == 7
    assert result.succeeded == 3 and result.failed == 1


def test_raise_errors_surfaces_client_exceptions():
    worker = ClientWorker()
    source = ClientAppSource(
        reference="toy_app:app", app_dir=str(__import__("pathlib").Path(__file__).parents[1])
    )
    worker.start_run(
        RunSpec(run_id=1, num_clients=10, run_config={"fail": "0"}, app=source, raise_errors=True)
    )
    with pytest.raises(RuntimeError, match="fails on purpose"):
        worker.run_batch(batch([0]))


def test_batches_need_a_run_and_a_real_clientapp():
    with pytest.raises(RuntimeError, match="start_run"):
        ClientWorker().run_batch(batch([0]))
    with pytest.raises(ValueError, match="exactly one"):
        ClientAppSource()
    from flwr.clientapp.client_app import LoadClientAppError

    with pytest.raises(LoadClientAppError, match="not a flwr.clientapp.ClientApp"):
        ClientAppSource(
            reference="toy_app:train", app_dir=str(__import__("pathlib").Path(__file__).parents[1])
        ).load()


def test_clients_cannot_see_each_others_mutations():
    result = make_worker(mutate=True).run_batch(batch([0, 1, 2]))
    assert [to_numpy(r.content["arrays"])["w"][0] for r in result.replies] == [1.0, 2.0, 3.0]
