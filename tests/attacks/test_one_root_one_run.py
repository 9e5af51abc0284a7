"""Whoever holds a run directory, or two runs of one root, against the parties' secrets.

* A root serves one run: two runs of one root that differ only in ``noise_multiplier`` publish
  g0 + (S + z1 C N) / m and g0 + (S + z2 C N) / m; with shared streams the two model files would
  give the clipped sum S exactly. Each run's fresh nonce makes the two noises independent.
* Nothing in a run directory is imported before it is authenticated: a ``config.json`` edited to
  name an attacker's module is refused by ``fedsim audit`` and ``--resume``, naming the file,
  and the module never runs.
* No study or example derives its parties' secrets from a phrase in the repository.
"""

from __future__ import annotations

import ast
import json
from pathlib import Path

import numpy as np

from fedsim.cli import main
from fedsim.frontend.experiment import run_experiment
from fedsim.frontend.run_config import ExperimentConfig
from fedsim.randomness import RunSecret

REPO = Path(__file__).resolve().parents[2]
BASE = {
    "seed": 5,
    "rounds": 1,
    "data": {"source": "digits", "partition": "iid", "num_clients": 8},
    "model": {"kind": "logreg"},
    "client": {"lr": 0.2, "batch_size": 16},
    "evaluation": {"every": 0},
    "engine": {"backend": "local"},
}


def dp_config(z: float) -> ExperimentConfig:
    strategy = {
        "name": "dp-fedavg",
        "clients_per_round": 8,
        "options": {"clipping_norm": 0.5, "noise_multiplier": z},
    }
    return ExperimentConfig.from_dict({**BASE, "strategy": strategy})


def model(out: Path) -> np.ndarray:
    with np.load(out / "model.npz") as saved:
        return np.concatenate([saved[k].ravel() for k in sorted(saved.files)])


def test_two_runs_of_one_root_do_not_cancel_their_noise(tmp_path):
    root = RunSecret.from_passphrase("one root, two runs")
    z1, z2 = 0.3, 0.6
    for name, z in (("a", z1), ("b", z2), ("clear", 0.0)):
        run_experiment(dp_config(z), tmp_path / name, progress=False, secrets=root)
    a, b, clear = model(tmp_path / "a"), model(tmp_path / "b"), model(tmp_path / "clear")
    # shared streams: a = g + z1 s N and b = g + z2 s N, so (z2 a - z1 b) / (z2 - z1) = g
    estimate = (z2 * a - z1 * b) / (z2 - z1)
    error = np.abs(estimate - clear).mean()
    noise = np.abs(a - clear).mean()  # the noise one release carries (std z1 C / m per entry)
    assert noise > 1e-3
    assert error > 0.5 * noise, f"the two releases gave the un-noised model to {error:.2e}"
    nonces = {json.loads((tmp_path / n / "run.json").read_text())["nonce"] for n in "ab"}
    assert len(nonces) == 2


def test_a_replay_repeats_the_streams_and_says_so(tmp_path):
    root = RunSecret.from_passphrase("replayed")
    run_experiment(dp_config(0.3), tmp_path / "first", progress=False, secrets=root)
    summary = run_experiment(
        dp_config(0.3), tmp_path / "copy", progress=False, secrets=root, replay=tmp_path / "first"
    )
    assert np.array_equal(model(tmp_path / "first"), model(tmp_path / "copy"))
    assert "copy" in summary["replay_of"]["note"]
    record = json.loads((tmp_path / "copy" / "run.json").read_text())
    assert record["replay_of"]["nonce"] == record["nonce"]


MARKER_MODULE = '''
from pathlib import Path
Path({marker!r}).write_text("attacker code ran")
import torch
def build(**kwargs):
    return torch.nn.Linear(64, 10)
'''


def test_an_edited_config_json_is_refused_before_it_is_imported(tmp_path, capsys):
    out = tmp_path / "run"
    root_file = tmp_path / "keys" / "root.hex"
    config = tmp_path / "run.toml"
    config.write_text(
        'seed = 1\nrounds = 1\n[data]\nsource = "digits"\npartition = "iid"\nnum_clients = 4\n'
        '[model]\nkind = "logreg"\n[strategy]\nname = "fedavg"\nclients_per_round = 4\n'
        '[engine]\nbackend = "local"\n'
    )
    assert main(["run", str(config), "--out", str(out), "--no-progress",
                 "--secrets", str(root_file)]) == 0
    marker = tmp_path / "marker"
    evil = tmp_path / "evil"
    evil.mkdir()
    (evil / "planted_model.py").write_text(MARKER_MODULE.format(marker=str(marker)))
    saved = json.loads((out / "config.json").read_text())
    saved["model"] = {
        "kind": "factory",
        "factory": "planted_model:build",
        "python_path": [str(evil)],
    }
    (out / "config.json").write_text(json.dumps(saved, indent=2, sort_keys=True))
    capsys.readouterr()
    assert main(["audit", str(out), "--secrets", str(root_file)]) == 2
    said = capsys.readouterr().err
    assert str(out / "config.json") in said and "authentication" in said
    assert main(["run", "--resume", str(out), "--secrets", str(root_file)]) == 2
    said = capsys.readouterr().err
    assert str(out / "config.json") in said and "authentication" in said
    assert not marker.exists()


def passphrase_calls(path: Path) -> list[int]:
    """Lines of ``path`` that call ``RunSecret.from_passphrase``."""
    tree = ast.parse(path.read_text())
    return [
        node.lineno
        for node in ast.walk(tree)
        if isinstance(node, ast.Call)
        and isinstance(node.func, ast.Attribute)
        and node.func.attr == "from_passphrase"
    ]


def test_no_study_or_example_derives_secrets_from_a_phrase_in_the_repository():
    sources = sorted((REPO / "experiments").rglob("*.py")) + sorted(
        (REPO / "examples").rglob("*.py")
    )
    assert len(sources) > 10
    found = {str(p.relative_to(REPO)): lines for p in sources if (lines := passphrase_calls(p))}
    assert found == {}, f"secrets from a phrase in the repository: {found}"
