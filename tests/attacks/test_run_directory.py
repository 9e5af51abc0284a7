"""Whoever holds a run directory, and whatever kills a run, cannot make ``--resume`` lie.

The resume matrix (issue 17, item 6): a run is killed (SIGKILL, in its own forked process) at
every phase of a round, with and without a power loss (everything the database had not synced
is lost), and a checkpointed run directory gets every damaged, swapped or crafted file we could
think of, for the checkpoint, the state database and config.json. Every cell must end in "same"
(the final model is bit-identical to the uninterrupted run's and rounds.jsonl carries the same
numbers) or in "refused" (an error naming the file; nothing was run). "crashed" (any other
exception) and "silent" (a different result without a word) are failures. Crafted pickles must
never run: each one would create a marker file when unpickled, and the marker must not exist
afterwards.

Run with ``-s`` to see the tally (cells tried / same / refused / crashed / silent).

A kill cell's run is a child forked from the test process (it starts with this process's
imports, so no interpreter start per cell): it runs the config into its directory and
SIGKILLs itself at the cell's point; nothing of it returns to the test process but the files.
"""

from __future__ import annotations

import hashlib
import json
import os
import pickle
import shutil
import signal
import sqlite3
import struct
import sys
import time
import traceback
from collections import Counter
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest

from fedsim.checkpoint import STATE_FILE, checkpoint_path
from fedsim.config import ConfigError, to_mapping
from fedsim.engine import NODE_ID_OFFSET
from fedsim.frontend.experiment import load_run_config, run_experiment
from fedsim.frontend.results import read_rounds
from fedsim.frontend.run_config import ExperimentConfig
from fedsim.frontend.run_root import resume_root
from fedsim.frontend.rundir import RunDirectory
from fedsim.randomness import RunSecret

PASSPHRASE = "tests"
ROUNDS = 4
KILL_ROUND = 3
CONFIG = """
seed = 11
rounds = 4
checkpoint_every = 1
state_memory_mb = 0

[data]
source = "digits"
partition = "dirichlet"
alpha = 0.5
num_clients = 24

[model]
kind = "mlp"
hidden = [16]

[client]
epochs = 1
batch_size = 8
lr = 0.1
momentum = 0.9
keep_momentum = true

[strategy]
name = "dp-fedavg"
clients_per_round = 6
sampling = "poisson"
options = { clipping_norm = 1.0, noise_multiplier = 0.3 }

[evaluation]
clients = 3
every = 1

[faults]
dropout = 0.15

[engine]
backend = "local"
"""
TIMING = ("seconds", "time_s", "clients_per_s", "compute_s")
TALLY: Counter[str] = Counter()


def secrets() -> RunSecret:
    return RunSecret.from_passphrase(PASSPHRASE)


def strip_times(record):
    if isinstance(record, dict):
        return {k: strip_times(v) for k, v in record.items() if k not in TIMING}
    return record


def result_of(out: Path) -> tuple[list, dict[str, np.ndarray]]:
    with np.load(out / "model.npz") as model:
        arrays = {k: model[k] for k in model.files}
    return [strip_times(r) for r in read_rounds(out / "rounds.jsonl")], arrays


def same_result(out: Path, reference: tuple[list, dict[str, np.ndarray]]) -> bool:
    rounds, arrays = result_of(out)
    expected_rounds, expected = reference
    return (
        rounds == expected_rounds
        and arrays.keys() == expected.keys()
        and all(
            arrays[k].dtype == expected[k].dtype and arrays[k].tobytes() == expected[k].tobytes()
            for k in expected
        )
    )


def resume(out: Path, root: RunSecret | None = None) -> None:
    """What ``fedsim run --resume OUT`` does: the config comes from the directory."""
    root = root or secrets()
    config = load_run_config(out, None, root)  # authenticated under the run's root first
    run_experiment(config, out, resume=True, progress=False, secrets=root)


def outcome(out: Path, names: tuple[str, ...], reference) -> tuple[str, str]:
    """("same" | "refused" | "crashed" | "silent", what was said) for resuming ``out``."""
    try:
        resume(out)
    except ConfigError as err:  # RunFileError is one
        said = str(err)
        if any(name in said for name in names):
            return "refused", said
        return "crashed", f"refused without naming {names}: {said}"
    except Exception as err:  # noqa: BLE001  (the point is to classify it)
        return "crashed", f"{type(err).__name__}: {err}"
    return ("same" if same_result(out, reference) else "silent"), ""


def check(cell: str, got: tuple[str, str], expected: str) -> None:
    TALLY["tried"] += 1
    TALLY[got[0]] += 1
    print(f"\n[{cell}] {got[0]} {got[1]}")
    assert got[0] == expected, f"{cell}: {got}"


@pytest.fixture(scope="module", autouse=True)
def tally():
    TALLY.clear()
    yield TALLY
    print(
        f"\nrun-directory matrix: {TALLY['tried']} cells tried, {TALLY['same']} same, "
        f"{TALLY['refused']} refused, {TALLY['crashed']} crashed, {TALLY['silent']} silent"
    )


# -- runs ------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def base(tmp_path_factory):
    return tmp_path_factory.mktemp("run-directory")


@pytest.fixture(scope="module")
def config_file(base):
    path = base / "run.toml"
    path.write_text(CONFIG)
    return path


def stopped_run(
    config: ExperimentConfig,
    out: Path,
    root: RunSecret,
    after: int,
    snapshot: tuple[int, Path] | None = None,
    replay: Path | None = None,
) -> Path:
    """``config`` run into ``out`` and stopped right after round ``after``'s checkpoint;
    ``snapshot = (round, path)`` copies the state database to ``path`` after that round."""
    real = RunDirectory.save

    def save_then_stop(self, checkpoint):
        path = real(self, checkpoint)
        if snapshot is not None and checkpoint.server_round == snapshot[0]:
            with sqlite3.connect(snapshot[1]) as copy:
                self.store._db.backup(copy)
        if checkpoint.server_round == after:
            raise KeyboardInterrupt
        return path

    RunDirectory.save = save_then_stop
    try:
        with pytest.raises(KeyboardInterrupt):
            run_experiment(config, out, progress=False, secrets=root, replay=replay)
    finally:
        RunDirectory.save = real
    return out


@pytest.fixture(scope="module")
def reference(base, config_file):
    out = base / "uninterrupted"
    run_experiment(ExperimentConfig.load(config_file), out, progress=False, secrets=secrets())
    return result_of(out)


@pytest.fixture(scope="module")
def stopped(base, config_file, reference):
    """This run, checkpointed after round 3 (checkpoints of rounds 2 and 3 on disk); its
    state database as it was after round 1 is kept in ``stale.sqlite``. A replay of the
    uninterrupted run (its nonce), so that resuming it must give that run's results."""
    return stopped_run(
        ExperimentConfig.load(config_file),
        base / "stopped",
        secrets(),
        KILL_ROUND,
        snapshot=(KILL_ROUND - 2, base / "stale.sqlite"),
        replay=base / "uninterrupted",
    )


@pytest.fixture(scope="module")
def other_run(base, config_file):
    """Another run of the same user (same secret root), another seed, stopped at round 3."""
    loaded = to_mapping(ExperimentConfig.load(config_file))
    other = ExperimentConfig.from_dict({**loaded, "seed": 12})
    return stopped_run(other, base / "other-seed", secrets(), KILL_ROUND)


@pytest.fixture(scope="module")
def twin_run(base, config_file, reference):
    """The same config and root replayed again: the same results, but its own files."""
    return stopped_run(
        ExperimentConfig.load(config_file),
        base / "twin",
        secrets(),
        KILL_ROUND,
        replay=base / "uninterrupted",
    )


@pytest.fixture(scope="module")
def other_root_run(base, config_file):
    """The same config under another secret root."""
    config = ExperimentConfig.load(config_file)
    return stopped_run(config, base / "other-root", RunSecret.from_passphrase("other"), KILL_ROUND)


@pytest.fixture
def copy_of(tmp_path, stopped):
    def make(source: Path | None = None) -> Path:
        out = tmp_path / "run"
        shutil.copytree(source or stopped, out)
        return out

    return make


# -- crafted pickles -------------------------------------------------------------------
class Plant:
    """A pickle that creates ``marker`` when it is loaded (stands for any code)."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return (Path.touch, (self.marker,))


def live_payload(marker: Path, scratch: Path) -> bytes:
    """The crafted pickle; the same pickle for a scratch marker is shown to run code."""
    control = scratch / "control-marker"
    pickle.loads(pickle.dumps(Plant(control)))
    assert control.exists()  # such a payload is live: loading it runs code
    return pickle.dumps(Plant(marker))


# -- damage -------------------------------------------------------------------------------
def newest(out: Path) -> Path:
    return checkpoint_path(out, KILL_ROUND)


def previous(out: Path) -> Path:
    return checkpoint_path(out, KILL_ROUND - 1)


def truncate(path: Path) -> None:
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])


def garbage(path: Path) -> None:
    path.write_bytes(np.random.default_rng(7).bytes(max(path.stat().st_size, 4096)))


def crafted_record(path: Path, payload: bytes) -> None:
    """A well-formed record (magic, kind, schema, lengths) around a crafted pickle, with a
    tag the attacker cannot compute."""
    from fedsim.runfiles import seal_record  # noqa: PLC0415

    data = path.read_bytes()
    _, _, schema, head_len, _ = struct.unpack(">8s8sIIQ", data[:32])
    header = json.loads(data[32 : 32 + head_len])  # the header is readable, only MACed
    path.write_bytes(seal_record("ckpt", schema, header, payload, b"\x00" * 32))


def db_rows(out: Path, sql: str, *args) -> None:
    with sqlite3.connect(out / STATE_FILE) as db:
        db.execute(sql, args)


def plant_state(out: Path, payload: bytes) -> None:
    """A client's newest state replaced by a crafted pickle, its recorded digest updated."""
    db_rows(
        out,
        "UPDATE states SET blob = ?, digest = ? WHERE node_id = (SELECT MIN(node_id) FROM states)",
        payload,
        hashlib.sha256(payload).digest(),
    )


def swap_two_states(out: Path) -> None:
    """The sealed states of two clients exchanged (each still authentic for its sealer)."""
    with sqlite3.connect(out / STATE_FILE) as db:
        rows = db.execute(
            "SELECT node_id, version, digest, blob FROM states WHERE blob IS NOT NULL"
            " ORDER BY node_id"
        ).fetchall()
        (a, va, da, ba), (b, vb, db_, bb) = rows[0], rows[-1]
        db.execute("UPDATE states SET digest = ?, blob = ? WHERE node_id = ? AND version = ?",
                   (db_, bb, a, va))
        db.execute("UPDATE states SET digest = ?, blob = ? WHERE node_id = ? AND version = ?",
                   (da, ba, b, vb))


CHECKPOINT_CELLS: dict[str, tuple[Callable[[Path, dict], None], str]] = {
    "newest empty": (lambda out, ctx: newest(out).write_bytes(b""), "same"),
    "newest truncated": (lambda out, ctx: truncate(newest(out)), "same"),
    "newest garbage": (lambda out, ctx: garbage(newest(out)), "same"),
    "newest one byte flipped": (
        lambda out, ctx: newest(out).write_bytes(
            (lambda b: b[:-100] + bytes([b[-100] ^ 1]) + b[-99:])(newest(out).read_bytes())
        ),
        "same",
    ),
    "newest swapped with another seed's": (
        lambda out, ctx: shutil.copy(newest(ctx["other_run"]), newest(out)),
        "same",
    ),
    "newest swapped with a twin run's": (
        lambda out, ctx: shutil.copy(newest(ctx["twin_run"]), newest(out)),
        "same",
    ),
    "newest from another secret root": (
        lambda out, ctx: shutil.copy(newest(ctx["other_root_run"]), newest(out)),
        "same",
    ),
    "newest is the previous one renamed": (
        lambda out, ctx: shutil.copy(previous(out), newest(out)),
        "same",
    ),
    "newest a crafted pickle": (
        lambda out, ctx: newest(out).write_bytes(ctx["payload"]),
        "same",
    ),
    "newest a crafted record": (
        lambda out, ctx: crafted_record(newest(out), ctx["payload"]),
        "same",
    ),
    "both garbage": (
        lambda out, ctx: (garbage(newest(out)), garbage(previous(out))),
        "refused",
    ),
    "newest garbage, previous swapped with a twin's": (
        lambda out, ctx: (
            garbage(newest(out)),
            shutil.copy(previous(ctx["twin_run"]), previous(out)),
        ),
        "refused",
    ),
    "newest garbage, states of the previous round altered": (
        lambda out, ctx: (
            garbage(newest(out)),
            db_rows(out, "DELETE FROM states WHERE version = ?", KILL_ROUND - 1),
        ),
        "refused",
    ),
    "a crafted legacy checkpoint.pkl": (
        lambda out, ctx: (out / "checkpoint.pkl").write_bytes(ctx["payload"]),
        "refused",
    ),
    "all checkpoints deleted": (
        lambda out, ctx: [p.unlink() for p in out.glob("checkpoint-*")],
        "same",
    ),
}


def stale_copy(out: Path, ctx: dict) -> None:
    """This run's state database as it was two rounds earlier (a restored backup)."""
    power_loss(out)
    shutil.copy(ctx["stale_db"], out / STATE_FILE)


STATE_CELLS: dict[str, tuple[Callable[[Path, dict], None], str]] = {
    "empty": (lambda out, ctx: (out / STATE_FILE).write_bytes(b""), "refused"),
    "truncated": (lambda out, ctx: truncate(out / STATE_FILE), "refused"),
    "garbage": (lambda out, ctx: garbage(out / STATE_FILE), "refused"),
    "bad SQLite header": (
        lambda out, ctx: (out / STATE_FILE).write_bytes(
            b"SQLite format 2\x00" + (out / STATE_FILE).read_bytes()[16:]
        ),
        "refused",
    ),
    "missing": (lambda out, ctx: (out / STATE_FILE).unlink(), "refused"),
    "swapped with another seed's": (
        lambda out, ctx: shutil.copy(ctx["other_run"] / STATE_FILE, out / STATE_FILE),
        "refused",
    ),
    "swapped with a twin run's": (
        lambda out, ctx: shutil.copy(ctx["twin_run"] / STATE_FILE, out / STATE_FILE),
        "refused",
    ),
    "from another secret root": (
        lambda out, ctx: shutil.copy(ctx["other_root_run"] / STATE_FILE, out / STATE_FILE),
        "refused",
    ),
    "a stale copy (two rounds old)": (stale_copy, "refused"),
    "a state replaced by a crafted pickle": (
        lambda out, ctx: plant_state(out, ctx["payload"]),
        "refused",
    ),
    "two clients' states swapped": (lambda out, ctx: swap_two_states(out), "refused"),
    "a client's state deleted": (
        lambda out, ctx: db_rows(
            out, "DELETE FROM states WHERE node_id = (SELECT MIN(node_id) FROM states)"
        ),
        "refused",
    ),
}


def rewrite_config(out: Path, change: Callable[[dict], dict]) -> None:
    path = out / "config.json"
    path.write_text(json.dumps(change(json.loads(path.read_text())), indent=2, sort_keys=True))


CONFIG_CELLS: dict[str, tuple[Callable[[Path, dict], None], str]] = {
    "empty": (lambda out, ctx: (out / "config.json").write_bytes(b""), "refused"),
    "truncated": (lambda out, ctx: truncate(out / "config.json"), "refused"),
    "garbage": (lambda out, ctx: garbage(out / "config.json"), "refused"),
    "missing": (lambda out, ctx: (out / "config.json").unlink(), "refused"),
    "swapped with another seed's": (
        lambda out, ctx: shutil.copy(ctx["other_run"] / "config.json", out / "config.json"),
        "refused",
    ),
    "edited (another learning rate)": (
        lambda out, ctx: rewrite_config(
            out, lambda c: {**c, "client": {**c["client"], "lr": 0.2}}
        ),
        "refused",
    ),
    "re-serialised (same values, other bytes)": (
        lambda out, ctx: (out / "config.json").write_text(
            json.dumps(json.loads((out / "config.json").read_text()))
        ),
        "refused",
    ),
}


@pytest.fixture
def context(tmp_path, stopped, other_run, twin_run, other_root_run, base):
    marker = tmp_path / "code-ran"
    return {
        "other_run": other_run,
        "twin_run": twin_run,
        "other_root_run": other_root_run,
        "stale_db": base / "stale.sqlite",
        "marker": marker,
        "payload": live_payload(marker, tmp_path),
    }


def _damage_cell(copy_of, context, reference, damage, expected, names, cell):
    out = copy_of()
    damage(out, context)
    got = outcome(out, names, reference)
    assert not context["marker"].exists(), f"{cell}: the crafted pickle ran"
    check(cell, got, expected)
    return out, got


@pytest.mark.parametrize("cell", list(CHECKPOINT_CELLS))
def test_damaged_checkpoint(cell, copy_of, context, reference, caplog):
    damage, expected = CHECKPOINT_CELLS[cell]
    names = ("checkpoint-", "checkpoint.pkl", STATE_FILE)
    out, got = _damage_cell(copy_of, context, reference, damage, expected, names, cell)
    if expected == "same" and cell != "all checkpoints deleted":
        # it said so: the damaged newest checkpoint is named in the log and set aside
        assert newest(out).name in caplog.text
        assert newest(out).with_name(newest(out).name + ".damaged").exists()
    if cell.startswith("newest garbage, states"):
        assert STATE_FILE in got[1] and "cannot resume exactly" in got[1]


@pytest.mark.parametrize("cell", list(STATE_CELLS))
def test_damaged_state_database(cell, copy_of, context, reference):
    damage, expected = STATE_CELLS[cell]
    _damage_cell(copy_of, context, reference, damage, expected, (STATE_FILE,), cell)


@pytest.mark.parametrize("cell", list(CONFIG_CELLS))
def test_damaged_config(cell, copy_of, context, reference):
    damage, expected = CONFIG_CELLS[cell]
    _damage_cell(copy_of, context, reference, damage, expected, ("config.json",), cell)


def test_a_given_config_that_differs_from_config_json_is_refused_naming_it(
    copy_of, config_file, reference
):
    out = copy_of()
    loaded = to_mapping(ExperimentConfig.load(config_file))
    changed = ExperimentConfig.from_dict({**loaded, "seed": 3})
    with pytest.raises(ConfigError, match="config.json"):
        run_experiment(changed, out, resume=True, progress=False, secrets=secrets())
    check("given config differs", outcome(out, ("config.json",), reference), "same")


def test_resuming_under_another_secret_root_opens_nothing(copy_of, reference):
    out = copy_of()
    guess = RunSecret.from_passphrase("guess")
    with pytest.raises(ConfigError, match="the root this run was started with"):
        resume(out, guess)  # refused by the root's fingerprint before any file is opened
    with pytest.raises(ConfigError, match=STATE_FILE) as err:  # and the files open nothing
        RunDirectory.reopen(out, guess, 0)
    assert "fails authentication" in str(err.value)
    check("another root", outcome(out, (STATE_FILE,), reference), "same")  # nothing was touched


# -- custody of the clients' states -----------------------------------------------------------
def test_the_run_directory_alone_opens_no_client_state(copy_of):
    out = copy_of()
    # the run's root (its nonce mixed in) opens them
    store = RunDirectory.states(out, resume_root(out, secrets()).keys)
    try:
        plain = store.get_many(range(NODE_ID_OFFSET, NODE_ID_OFFSET + 24))
    finally:
        store.close()
    assert len(plain) >= 6 and all(pickle.loads(b) for b in plain.values())
    files = b"".join(p.read_bytes() for p in out.iterdir() if p.name.startswith(STATE_FILE))
    for blob in plain.values():  # no 64-byte run of any state (its momentum) is in the clear
        windows = [blob[i : i + 64] for i in range(0, len(blob) - 64, 64)]
        varied = [w for w in windows if len(set(w)) >= 40]  # float data, not padding
        assert varied and not any(w in files for w in varied)
    with sqlite3.connect(out / STATE_FILE) as db:
        sealed = db.execute("SELECT blob FROM states WHERE blob IS NOT NULL").fetchall()
    guess = RunSecret.from_passphrase("guess")
    for (blob,) in sealed:
        for partition in range(24):
            with pytest.raises(ValueError, match="failed authentication"):
                guess.client(partition).open(blob, b"")
    with pytest.raises(ConfigError, match="fails authentication"):
        RunDirectory.states(out, guess.for_run(resume_root(out, secrets()).nonce))


def test_a_crafted_state_never_reaches_pickle_when_states_are_read(copy_of, context):
    out = copy_of()
    plant_state(out, context["payload"])
    store = RunDirectory.states(out, resume_root(out, secrets()).keys)
    try:
        with pytest.raises(ConfigError, match="fails authentication") as err:
            store.get_many(range(NODE_ID_OFFSET, NODE_ID_OFFSET + 24))
    finally:
        store.close()
    assert str(out / STATE_FILE) in str(err.value)
    assert not context["marker"].exists()


# -- kills -------------------------------------------------------------------------------
KILL_POINTS = (
    "before training",
    "after replies",
    "after aggregation",
    "after the rounds.jsonl line",
    "after the state sync, before the checkpoint file",
    "mid checkpoint write",
    "after the checkpoint file, before the state prune",
    "after the state prune",
)
KILL_CELLS = [(point, KILL_ROUND) for point in KILL_POINTS] + [
    ("after replies", 1),  # no checkpoint yet: the run starts again
    ("mid checkpoint write", 1),  # the first checkpoint torn
]


def _die() -> None:
    os.kill(os.getpid(), signal.SIGKILL)


def install_kill(point: str, at: int) -> None:
    """Make this process SIGKILL itself at ``point`` of round ``at``."""
    import fedsim.checkpoint as checkpoint_module  # noqa: PLC0415
    import fedsim.frontend.rundir as rundir  # noqa: PLC0415
    from fedsim.engine.grid import SimulationGrid  # noqa: PLC0415
    from fedsim.engine.participation import EVALUATE, TRAIN  # noqa: PLC0415
    from fedsim.engine.state import ClientStateStore  # noqa: PLC0415
    from fedsim.frontend.results import RunWriter  # noqa: PLC0415

    begin, exchange = SimulationGrid.begin_phase, SimulationGrid.send_and_receive
    write_round, save = RunWriter.write_round, rundir.save_checkpoint
    write_atomic, prune = checkpoint_module.write_atomic, ClientStateStore.checkpoint

    def begin_phase(self, server_round, kind):
        if (point, server_round, kind) in (
            ("before training", at, TRAIN),
            ("after aggregation", at, EVALUATE),
        ):
            _die()
        self.phase_for_kill = (server_round, kind)
        return begin(self, server_round, kind)

    def send_and_receive(self, messages, **kwargs):
        replies = exchange(self, messages, **kwargs)
        if point == "after replies" and getattr(self, "phase_for_kill", None) == (at, TRAIN):
            _die()
        return replies

    def write(self, record):
        write_round(self, record)
        if point == "after the rounds.jsonl line" and record["round"] == at:
            _die()

    def save_checkpoint(directory, checkpoint, **kwargs):
        if point.startswith("after the state sync") and checkpoint.server_round == at:
            _die()
        return save(directory, checkpoint, **kwargs)

    def torn_write(path, data):
        if point == "mid checkpoint write" and path.name == checkpoint_path(".", at).name:
            with open(str(path) + ".tmp", "wb") as fh:
                fh.write(data[: len(data) // 2])
                fh.flush()
                os.fsync(fh.fileno())
            _die()
        return write_atomic(path, data)

    def checkpoint(self, version):
        if point.startswith("after the checkpoint file") and version == at:
            _die()
        prune(self, version)
        if point == "after the state prune" and version == at:
            _die()

    SimulationGrid.begin_phase = begin_phase
    SimulationGrid.send_and_receive = send_and_receive
    RunWriter.write_round = write
    rundir.save_checkpoint = save_checkpoint
    checkpoint_module.write_atomic = torn_write
    ClientStateStore.checkpoint = checkpoint


def power_loss(out: Path) -> None:
    """Lose everything the state database had not synced: its write-ahead log."""
    for suffix in ("-wal", "-shm"):
        Path(str(out / STATE_FILE) + suffix).unlink(missing_ok=True)


def killed_child(point: str, at: int, config_file: Path, out: Path, replay: Path) -> int:
    """Fork a child that replays ``config_file`` into ``out`` and SIGKILLs itself at ``point``
    of round ``at``; its wait status (the child is killed after 600 s)."""
    pid = os.fork()
    if pid == 0:  # the child: never returns into pytest
        try:
            install_kill(point, at)
            config = ExperimentConfig.load(config_file)
            run_experiment(config, out, progress=False, secrets=secrets(), replay=replay)
            print(f"the run reached its end without the kill at {point!r}", file=sys.stderr)
        except BaseException:  # noqa: BLE001  (reported by the exit status and stderr)
            traceback.print_exc()
        finally:
            os._exit(1)
    deadline = time.monotonic() + 600
    while True:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            return status
        if time.monotonic() > deadline:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
            raise AssertionError(f"the kill cell {point!r}, round {at} ran past 600 s")
        time.sleep(0.05)


@pytest.fixture(scope="module")
def killed(base, config_file, reference):
    """One killed run directory per kill cell (each child runs once per module), each a replay
    of the uninterrupted run."""
    done: dict[tuple[str, int], Path] = {}

    def get(point: str, at: int) -> Path:
        if (point, at) not in done:
            out = base / f"killed-{KILL_CELLS.index((point, at))}"
            status = killed_child(point, at, config_file, out, base / "uninterrupted")
            assert os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGKILL, status
            assert not (out / "summary.json").exists()
            done[point, at] = out
        return done[point, at]

    return get


@pytest.mark.parametrize("lost_power", [False, True], ids=["kill", "kill+power-loss"])
@pytest.mark.parametrize(("point", "at"), KILL_CELLS)
def test_killed_run_resumes_to_the_uninterrupted_result(
    point, at, lost_power, killed, tmp_path, reference
):
    out = tmp_path / "run"
    shutil.copytree(killed(point, at), out)
    if lost_power:
        power_loss(out)
    cell = f"{point}, round {at} ({'kill and power loss' if lost_power else 'kill'})"
    check(cell, outcome(out, (STATE_FILE, "checkpoint-"), reference), "same")


# -- DP-SGD clients: a lost state database no longer under-reports epsilon -------------------
def dp_sgd_config() -> ExperimentConfig:
    return ExperimentConfig.from_dict(
        {
            "name": "dp-sgd",
            "seed": 5,
            "rounds": 6,
            "state_memory_mb": 0,
            "data": {"source": "digits", "partition": "iid", "num_clients": 12},
            "model": {"kind": "mlp", "hidden": [16]},
            "client": {
                "epochs": 1,
                "batch_size": 16,
                "lr": 0.1,
                "dp_sgd": {"noise_multiplier": 1.2, "max_grad_norm": 1.0, "delta": 1e-5},
            },
            "strategy": {"name": "fedavg", "clients_per_round": 6},
            "evaluation": {"every": 3, "central_rows": 100},
            "engine": {"backend": "local"},
        }
    )


@pytest.fixture(scope="module")
def dp_sgd_runs(base):
    """An uninterrupted DP-SGD-client run's summary, and the same run stopped after round 3."""
    config = dp_sgd_config()
    full = run_experiment(config, base / "dp-sgd-full", progress=False, secrets=secrets())
    return full, stopped_run(config, base / "dp-sgd-cut", secrets(), 3)


def test_dp_sgd_clients_resume_with_their_whole_privacy_history(dp_sgd_runs, tmp_path):
    full, cut = dp_sgd_runs
    out = tmp_path / "run"
    shutil.copytree(cut, out)
    resumed = run_experiment(dp_sgd_config(), out, resume=True, progress=False, secrets=secrets())
    assert resumed["max_client_epsilon"] == full["max_client_epsilon"] > 0


@pytest.mark.parametrize("damage", ["empty", "truncated", "deleted"])
def test_dp_sgd_clients_histories_cannot_be_dropped_by_emptying_the_state_database(
    dp_sgd_runs, tmp_path, damage
):
    """Before: an emptied client_state.sqlite was accepted and every client restarted its Opacus
    history, so max_client_epsilon came out 3.85 instead of 4.72 on this config."""
    _, cut = dp_sgd_runs
    out = tmp_path / "run"
    shutil.copytree(cut, out)
    db = out / STATE_FILE
    if damage == "empty":
        db.write_bytes(b"")
    elif damage == "truncated":
        truncate(db)
    else:
        db.unlink()
    power_loss(out)
    with pytest.raises(ConfigError, match=STATE_FILE):
        run_experiment(dp_sgd_config(), out, resume=True, progress=False, secrets=secrets())
    assert not (out / "summary.json").exists()
