"""The client-state store: round trips, spilling past the memory budget, checkpoints."""

import pickle
import sqlite3

import pytest
from flwr.app import MetricRecord, RecordDict

from fedsim.config import ConfigError
from fedsim.engine import NODE_ID_OFFSET, ClientStateStore
from fedsim.randomness import RunSecret
from fedsim.runfiles import RunFileError

SECRETS = RunSecret.from_passphrase("tests")


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
    store = ClientStateStore(tmp_path / "s.sqlite", memory_budget=0, secrets=SECRETS)
    store.put_many({1: state(10), 2: state(20)}, version=1)
    store.checkpoint(1)
    store.put_many({1: state(11), 3: state(30)}, version=2)
    store.put_many({2: None}, version=2)
    assert {k: value(v) for k, v in store.get_many([1, 2, 3]).items()} == {1: 11, 3: 30}
    store.rollback(1)
    assert {k: value(v) for k, v in store.get_many([1, 2, 3]).items()} == {1: 10, 2: 20}
    store.close()
    reopened = ClientStateStore(tmp_path / "s.sqlite", secrets=SECRETS)  # a resumed run
    assert {k: value(v) for k, v in reopened.get_many([1, 2, 3]).items()} == {1: 10, 2: 20}


def test_checkpoints_drop_versions_neither_of_the_last_two_needs(tmp_path):
    store = ClientStateStore(tmp_path / "s.sqlite")
    for version in range(1, 6):
        store.put_many({7: state(version), 8: state(100 + version)}, version=version)
        store.put_many({7: state(50 + version)}, version=version)  # rewritten in the round
        store.checkpoint(version)
    rows = store._db.execute("SELECT COUNT(*) FROM states").fetchone()[0]
    assert rows == 4  # rounds 4 and 5 of both clients
    assert value(store.get_many([7])[7]) == 55
    store.rollback(4)  # the checkpoint before the newest can still be restored exactly
    assert {k: value(v) for k, v in store.get_many([7, 8]).items()} == {7: 54, 8: 104}


def test_rollback_to_either_of_the_last_two_checkpoints_is_exact(tmp_path):
    store = ClientStateStore(tmp_path / "s.sqlite", memory_budget=0, secrets=SECRETS)
    marks = {}
    for version in range(1, 5):
        written = {NODE_ID_OFFSET + k: state(10 * version + k) for k in range(version)}
        store.put_many(written, version)
        if version == 3:
            store.put_many({NODE_ID_OFFSET: None}, version)  # a client clears its state
        marks[version] = store.mark(version)
        store.checkpoint(version)
    store.put_many({NODE_ID_OFFSET + 9: state(9)}, version=5)  # a round never checkpointed
    for version in (4, 3):
        store.verify(marks[version], "checkpoint")
    store.rollback(3)
    assert store.checksum(3, verify=True) == marks[3].checksum
    got = store.get_many(range(NODE_ID_OFFSET, NODE_ID_OFFSET + 10))
    assert {k - NODE_ID_OFFSET: value(v) for k, v in got.items()} == {1: 31, 2: 32}
    with pytest.raises(RunFileError, match="does not hold the client states"):
        store.verify(marks[4], "checkpoint-000004.ckpt")  # round 4 is gone now


def test_states_in_the_file_are_sealed_per_client(tmp_path):
    path = tmp_path / "s.sqlite"
    store = ClientStateStore(path, memory_budget=0, secrets=SECRETS)
    store.put_many({NODE_ID_OFFSET + 3: state(3)}, version=1)
    store.mark(1)
    store.close()
    with sqlite3.connect(path) as db:
        (blob,) = db.execute("SELECT blob FROM states").fetchone()
    assert state(3) not in blob and b"RecordDict" not in blob  # ciphertext, not a pickle
    assert SECRETS.client(3).open(blob, _label(path, 3, 1)) == state(3)
    with pytest.raises(ValueError, match="failed authentication"):
        SECRETS.client(4).open(blob, _label(path, 3, 1))  # another client's secret opens nothing


def _label(path, partition, version):
    with sqlite3.connect(path) as db:
        (store_id,) = db.execute("SELECT value FROM meta WHERE key = 'store'").fetchone()
    return (
        b"fedsim-client-state\x00"
        + store_id
        + (NODE_ID_OFFSET + partition).to_bytes(8, "big")
        + version.to_bytes(8, "big")
    )


def test_a_file_of_another_root_or_run_tag_is_refused_naming_it(tmp_path):
    path = tmp_path / "s.sqlite"
    ClientStateStore(path, secrets=SECRETS, run_tag="a").close()
    with pytest.raises(RunFileError, match="fails authentication") as err:
        ClientStateStore(path, secrets=RunSecret.from_passphrase("other"), run_tag="a")
    assert err.value.path == path and str(path) in str(err.value)
    with pytest.raises(RunFileError, match="belongs to another run"):
        ClientStateStore(path, secrets=SECRETS, run_tag="b")
    with pytest.raises(RunFileError, match="is missing"):
        ClientStateStore(tmp_path / "gone.sqlite", secrets=SECRETS, must_exist=True)


def test_memory_only_stores_cannot_roll_back_and_budgets_are_checked():
    with pytest.raises(RuntimeError, match="file-backed"):
        ClientStateStore().rollback(1)
    with pytest.raises(RuntimeError, match="file-backed"):
        ClientStateStore().mark(1)
    with pytest.raises(ConfigError, match="memory_budget"):
        ClientStateStore(memory_budget=-1)


def rows(path) -> list[tuple[int, int, bool]]:
    with sqlite3.connect(path) as db:
        found = db.execute("SELECT node_id, version, blob IS NOT NULL FROM states ORDER BY 1, 2")
        return [(n, v, bool(b)) for n, v, b in found]


def test_a_rounds_rewrites_reach_the_file_once_and_as_if_applied_at_once(tmp_path):
    """Writes within a round are held back: the file gets the round's newest state per
    client in one go (when the round changes or anything reads the file), a cleared state
    is never answered from an older row meanwhile, and the rows are those of writing every
    state at once."""
    path = tmp_path / "s.sqlite"
    store = ClientStateStore(path, secrets=SECRETS)
    store.put_many({1: state(10), 2: state(20)}, version=1)
    store.checkpoint(1)
    writes = []
    original = store._write
    store._write = lambda items, version: (writes.append(len(items)), original(items, version))
    for stage in range(4):  # four exchanges of round 2 rewrite both states
        store.put_many({1: state(100 + stage), 2: state(200 + stage)}, version=2)
    store.put_many({2: None}, version=2)  # client 2 cleared its state
    assert writes == [] and rows(path) == [(1, 1, True), (2, 1, True)]
    assert {k: value(v) for k, v in store.get_many([1, 2]).items()} == {1: 103}
    store.put_many({3: state(30)}, version=3)  # the round changed: round 2 goes to the file
    assert writes == [2] and rows(path) == [(1, 1, True), (1, 2, True), (2, 1, True), (2, 2, False)]
    assert len(store) == 2 and writes == [2, 1]  # reading the file writes round 3's first
    store.put_many({3: state(31)}, version=3)
    store.close()  # closing writes what is held back
    reopened = ClientStateStore(path, secrets=SECRETS)
    assert {k: value(v) for k, v in reopened.get_many([1, 2, 3]).items()} == {1: 103, 3: 31}


def test_a_held_back_state_leaves_memory_only_through_the_file(tmp_path):
    one = len(state(0))
    store = ClientStateStore(tmp_path / "s.sqlite", memory_budget=3 * one, secrets=SECRETS)
    store.put_many({node: state(node) for node in range(10)}, version=1)
    assert store._cached_bytes <= 3 * one and not store._pending
    assert {k: value(v) for k, v in store.get_many(range(10)).items()} == {k: k for k in range(10)}
