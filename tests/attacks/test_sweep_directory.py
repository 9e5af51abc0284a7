"""Whoever holds a sweep's output directory (every point's run directory and ``index.json``)
must not find any point's secret root there: the roots that derive the clients' noise and
the checkpoints' key stay in ``--secrets-dir`` (or the user's secrets directory)."""

from fedsim.cli import main

CONFIG = """
name = "tiny"
seed = 0
rounds = 2

[data]
source = "digits"
partition = "iid"
num_clients = 20

[model]
kind = "logreg"

[client]
epochs = 1
batch_size = 16
lr = 0.1

[strategy]
name = "dp-fedavg"
clients_per_round = 5

[strategy.options]
clipping_norm = 1.0
noise_multiplier = 1.0

[engine]
backend = "local"
"""


def test_no_points_secret_root_is_in_the_sweep_directory(tmp_path):
    config, out, keys = tmp_path / "tiny.toml", tmp_path / "sweep", tmp_path / "keys"
    config.write_text(CONFIG)
    argv = ["sweep", str(config), "--out", str(out), "--seeds", "0,1", "--no-progress"]
    assert main([*argv, "--secrets-dir", str(keys)]) == 0
    roots = [bytes.fromhex(path.read_text().strip()) for path in keys.iterdir()]
    assert len(roots) == 2 and len(set(roots)) == 2  # one root per point
    files = [path for path in out.rglob("*") if path.is_file()]
    assert any(path.suffix == ".ckpt" for path in files)  # the checkpoints are searched too
    for path in files:
        data = path.read_bytes()
        for root in roots:
            for form in (root, root.hex().encode(), root.hex().upper().encode()):
                assert form not in data, f"a point's secret root is readable in {path}"
