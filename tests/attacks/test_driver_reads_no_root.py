"""The driver of ``fedsim run`` against the run's secret root: it never opens the root file.

The driver runs the ServerApp (the strategy); whatever it reads, the server side may hold. The
clients' secrets must come from a source it does not read: the engine's workers open the root
file themselves. Here the real ``fedsim`` CLI runs in this process with an audit hook
(PEP 578) that records every ``open`` of the ``--secrets`` file, or, for a fresh root, of any
file in the user's secrets directory. The local backend's worker (``fedsim/engine/worker.py``)
plays the clients in this same process -- the local backend isolates nothing, as its docstring
says -- so opens made under its frames are the clients' side; every other open is the
driver's. ``fedsim run``, ``--resume`` and ``fedsim audit`` make none: what the driver may hold
(:class:`~fedsim.randomness.RunKeys`) is derived in a short-lived child process. With the Ray
backend, where the workers are other processes, no open in this process is allowed at all.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import os
import stat
import sys
from pathlib import Path

import pytest

from fedsim.cli import main
from fedsim.config import ConfigError
from fedsim.frontend.experiment import run_experiment
from fedsim.frontend.run_config import ExperimentConfig
from fedsim.frontend.run_root import RUN_FILE, resume_root, start_root
from fedsim.randomness import RunKeys, RunSecret, kept_root_path

WORKER = os.sep + os.path.join("fedsim", "engine", "worker.py")
CONFIG = """\
seed = 3
rounds = 2
[data]
source = "digits"
partition = "iid"
num_clients = 8
[model]
kind = "logreg"
[client]
lr = 0.2
batch_size = 16
[evaluation]
every = 0
[strategy]
name = "dp-fedavg"
clients_per_round = 4
[strategy.options]
clipping_norm = 0.5
noise_multiplier = 1.0
[engine]
backend = "local"
"""

#: what the hook watches while a test runs: files (exact) and directories (anything in them)
_WATCH: dict[str, list] = {"files": [], "dirs": [], "driver": [], "clients": []}


def _hook(event: str, args: tuple) -> None:
    if event != "open" or not (_WATCH["files"] or _WATCH["dirs"]):
        return
    target = args[0]
    if isinstance(target, int):  # an open file descriptor
        return
    path = os.path.realpath(os.fsdecode(target))
    if path not in _WATCH["files"] and not any(
        path.startswith(d + os.sep) for d in _WATCH["dirs"]
    ):
        return
    frame, where = sys._getframe(1), []
    while frame is not None:
        where.append(f"{frame.f_code.co_filename}:{frame.f_lineno} {frame.f_code.co_name}")
        frame = frame.f_back
    side = "clients" if any(WORKER in w for w in where) else "driver"
    _WATCH[side].append((path, where[:6]))


sys.addaudithook(_hook)  # hooks stay for the process: inert unless a test sets _WATCH


class watching:
    """Within the block, record opens of ``files`` and of anything under ``dirs``."""

    def __init__(self, files=(), dirs=()) -> None:
        self.files = [os.path.realpath(f) for f in files]
        self.dirs = [os.path.realpath(d) for d in dirs]

    def __enter__(self) -> dict[str, list]:
        _WATCH.update(files=self.files, dirs=self.dirs, driver=[], clients=[])
        return _WATCH

    def __exit__(self, *exc) -> None:
        _WATCH.update(files=[], dirs=[])


def driver_opens(seen: dict[str, list]) -> list[str]:
    return [f"{path} from {' <- '.join(where)}" for path, where in seen["driver"]]


def config_file(tmp_path: Path) -> Path:
    path = tmp_path / "run.toml"
    path.write_text(CONFIG)
    return path


def expected_mac(root: RunSecret, out: Path) -> str:
    """config.json's MAC under the keys the root itself gives (derived here, in process)."""
    data = (out / "config.json").read_bytes()
    key = RunKeys.of(root.for_run(json.loads((out / RUN_FILE).read_text())["nonce"])).mac_key()
    return hmac.new(key, b"config.json\x00" + data, hashlib.sha256).hexdigest()


def test_fedsim_run_resume_and_audit_never_open_the_secrets_file(tmp_path, capsys):
    root_file = tmp_path / "keys" / "run.root"  # created by the run, as --secrets allows
    out = tmp_path / "run"
    cfg = config_file(tmp_path)
    with watching(files=[root_file]) as seen:
        assert main(["run", str(cfg), "--out", str(out), "--no-progress",
                     "--secrets", str(root_file)]) == 0
    assert driver_opens(seen) == [], "the driver opened the root"
    assert seen["clients"], "the clients' worker never opened the root (nothing was watched)"
    assert stat.S_IMODE(root_file.stat().st_mode) == 0o600
    root = RunSecret.load_or_create(root_file, create=False)  # the test's own read, unwatched
    record = json.loads((out / RUN_FILE).read_text())
    assert record["fingerprint"] == root.fingerprint()
    assert record["config_mac"] == expected_mac(root, out)  # the same keys as in process
    model = (out / "model.npz").read_bytes()
    (out / "model.npz").unlink()  # the resumed run writes it again from its last checkpoint
    for argv in (
        ["run", "--resume", str(out), "--no-progress", "--secrets", str(root_file)],
        ["audit", str(out), "--secrets", str(root_file)],
    ):
        with watching(files=[root_file]) as seen:
            assert main(argv) == 0, capsys.readouterr().err
        assert driver_opens(seen) == [], f"`fedsim {' '.join(argv[:2])}` opened the root"
    assert (out / "model.npz").read_bytes() == model  # the same checkpoint, bit for bit


def test_a_fresh_root_is_created_and_kept_without_the_driver_opening_it(
    tmp_path, _secrets_dir, capsys
):
    out = tmp_path / "run"
    cfg = config_file(tmp_path)
    with watching(dirs=[_secrets_dir]) as seen:
        assert main(["run", str(cfg), "--out", str(out), "--no-progress"]) == 0
    assert driver_opens(seen) == [], "the driver opened the kept root"
    record = json.loads((out / RUN_FILE).read_text())
    kept = kept_root_path(record["run_id"])
    assert kept.parent == _secrets_dir and stat.S_IMODE(kept.stat().st_mode) == 0o600
    root = RunSecret.load_or_create(kept, create=False)
    assert root.reproducible and record["fingerprint"] == root.fingerprint()
    assert record["config_mac"] == expected_mac(root, out)
    for argv in (["run", "--resume", str(out), "--no-progress"], ["audit", str(out)]):
        with watching(dirs=[_secrets_dir]) as seen:
            assert main(argv) == 0, capsys.readouterr().err
        assert driver_opens(seen) == [], f"`fedsim {' '.join(argv[:2])}` opened the kept root"


def test_a_replay_takes_the_earlier_runs_root_without_opening_it(tmp_path):
    root_file = tmp_path / "keys" / "run.root"
    config = ExperimentConfig.from_dict({**_as_dict(), "rounds": 1})
    run_experiment(config, tmp_path / "first", progress=False, secrets=root_file)
    with watching(files=[root_file]) as seen:
        run_experiment(
            config, tmp_path / "copy", progress=False, secrets=root_file,
            replay=tmp_path / "first",
        )
    assert driver_opens(seen) == [], "the replay's driver opened the root"
    first = (tmp_path / "first" / "model.npz").read_bytes()
    assert (tmp_path / "copy" / "model.npz").read_bytes() == first


def test_the_driver_of_a_ray_run_opens_nothing_of_the_root(tmp_path, ray_engine):
    """Ray workers are other processes: no open of the root in this one at all."""
    root_file = tmp_path / "keys" / "run.root"
    config = ExperimentConfig.from_dict({**_as_dict(), "engine": {"backend": "ray"}})
    with watching(files=[root_file]) as seen:
        run_experiment(
            config, tmp_path / "run", progress=False, secrets=root_file, engine=ray_engine
        )
    assert seen["driver"] == [] and seen["clients"] == []
    assert root_file.is_file()


QUICKSTART = Path(__file__).resolve().parents[1] / "apps" / "quickstart"


def flwr_run(out: Path, *extra: str) -> int:
    return main(["flwr-run", str(QUICKSTART), "--backend", "local", "--num-supernodes", "3",
                 "--run-config", "num-server-rounds=1", "--no-progress", "--out", str(out),
                 *extra])


def test_flwr_run_records_its_root_in_run_json_without_opening_it(tmp_path):
    """``fedsim flwr-run --secrets FILE`` creates the file and records the root's public
    fingerprint and the run's nonce in run.json, as ``fedsim run`` does: all of it in a child
    process; a second run of the root gets a nonce of its own."""
    root_file = tmp_path / "keys" / "run.root"
    records = []
    for name in ("a", "b"):
        with watching(files=[root_file]) as seen:
            assert flwr_run(tmp_path / name, "--secrets", str(root_file)) == 0
        assert driver_opens(seen) == [], "flwr-run's driver opened the root"
        records.append(json.loads((tmp_path / name / RUN_FILE).read_text()))
        summary = json.loads((tmp_path / name / "summary.json").read_text())
        assert summary["run_nonce"] == records[-1]["nonce"]
    assert stat.S_IMODE(root_file.stat().st_mode) == 0o600
    fingerprint = RunSecret.load_or_create(root_file, create=False).fingerprint()
    for record in records:
        assert set(record) == {"root", "fingerprint", "nonce"}
        assert record["root"] == "given" and record["fingerprint"] == fingerprint
        assert len(record["nonce"]) == 32 and int(record["nonce"], 16) >= 0
    assert records[0]["nonce"] != records[1]["nonce"]


def test_flwr_run_with_a_fresh_root_says_it_cannot_be_repeated(tmp_path):
    assert flwr_run(tmp_path / "fresh") == 0
    record = json.loads((tmp_path / "fresh" / RUN_FILE).read_text())
    assert record["root"] == "fresh" and record["nonce"] is None
    assert "cannot be repeated" in record["note"] and "fingerprint" not in record


def test_a_bad_root_file_is_refused_naming_it(tmp_path):
    bad = tmp_path / "keys" / "bad.root"
    bad.parent.mkdir()
    bad.write_text("not a root\n")
    with pytest.raises(ConfigError, match="64 hex digits") as refused:
        start_root(tmp_path / "run", bad, b"{}")
    assert refused.value.key == "secrets" and refused.value.value == str(bad.resolve())
    good = tmp_path / "keys" / "good.root"
    start_root(tmp_path / "run", good, b"{}")  # created, mode 0600
    with pytest.raises(ConfigError, match="existing file") as refused:
        resume_root(tmp_path / "run", tmp_path / "keys" / "missing.root")
    assert refused.value.value == str((tmp_path / "keys" / "missing.root").resolve())


def _as_dict() -> dict:
    import tomllib

    return tomllib.loads(CONFIG)
