"""The client-state store: round trips, spilling past the memory budget, checkpoints."""

import pickle

import pytest
from flwr.app import MetricRecord, RecordDict

from fedsim.config import ConfigError
from fedsim.engine import ClientStateStore


def state(n: int) -> bytes:
    return pickle.dumps(RecordDict({"m": MetricRecord({"n": n, "pad": [0.0] * 100})}))


def value(blob: bytes) -> int:
    return pickle.loads(blob)["m"]["n"]


def test_round_trip_in_memory():
    store = ClientStateStore()
    store.put_many({1: state(1), 2: state(2)})
    assert {k: value(v) for k, v in store.get_many([1, 2, 3]).items()} == {1: 1, 2: 2}
    store.put_many({1: None})  # the client cleared its state
    assert list(store.get_many([1, 2])) == [2] and len(store) == 1
    assert not store.spilled


def test_spills_to_disk_past_the_budget_and_keeps_memory_flat():
    one = len(state(0))
    store = ClientStateStore(memory_budget=20 * one)
    for start in range(0, 1000, 100):
        store.put_many({node: state(node) for node in range(start, start + 100)}, version=start)
    assert store.spilled and len(store) == 1000
    assert store._cached_bytes <= 20 * one  # memory stays within the budget
    got = store.get_many(range(0, 1000, 7))
    assert {k: value(v) for k, v in got.items()} == {k: k for k in range(0, 1000, 7)}
    store.close()


def test_checkpoint_and_rollback_restore_a_round(tmp_path):
    store = ClientStateStore(tmp_path / "s.sqlite", memory_budget=0)
    store.put_many({1: state(10), 2: state(20)}, version=1)
    store.checkpoint(1)
    store.put_many({1: state(11), 3: state(30)}, version=2)
    store.put_many({2: None}, version=2)
    assert {k: value(v) for k, v in store.get_many([1, 2, 3]).items()} == {1: 11, 3: 30}
    store.rollback(1)
    assert {k: value(v) for k, v in store.get_many([1, 2, 3]).items()} == {1: 10, 2: 20}
    store.close()
    reopened = ClientStateStore(tmp_path / "s.sqlite")  # a resumed run opens the same file
    assert {k: value(v) for k, v in reopened.get_many([1, 2, 3]).items()} == {1: 10, 2: 20}


def test_checkpoints_drop_superseded_versions(tmp_path):
    store = ClientStateStore(tmp_path / "s.sqlite")
    for version in range(1, 6):
        store.put_many({7: state(version)}, version=version)
        store.checkpoint(version)
    rows = store._db.execute("SELECT COUNT(*) FROM states").fetchone()[0]
    assert rows == 1 and value(store.get_many([7])[7]) == 5


def test_memory_only_stores_cannot_roll_back_and_budgets_are_checked():
    with pytest.raises(RuntimeError, match="file-backed"):
        ClientStateStore().rollback(1)
    with pytest.raises(ConfigError, match="memory_budget"):
        ClientStateStore(memory_budget=-1)
