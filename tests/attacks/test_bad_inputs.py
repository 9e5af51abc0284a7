"""Bad inputs that once ran on, crashed or leaked: each must end in a refusal that names the
input, its value and what is allowed -- exit status 2, no traceback -- before anything is
written or allocated.

The attacker is a user or a script feeding an empty output path, a table that is a link to a
system file, a loader with an absurd label, damaged files to the readers of run files and
factorizations, and a factorization too large to build in reasonable time.
"""

from __future__ import annotations

import json
import sys
import textwrap
from pathlib import Path

import pytest

from attacks.test_inputs import assert_refused, call, case_config, to_toml
from fedsim.cli import main

# -- --out "" -----------------------------------------------------------------------------


def test_run_with_an_empty_out_is_refused_before_anything_is_written(tmp_path, monkeypatch):
    config = tmp_path / "cfg" / "config.toml"
    config.parent.mkdir()
    config.write_text(to_toml(case_config("rounds", 1)))
    work = tmp_path / "work"
    work.mkdir()
    monkeypatch.chdir(work)
    status, err = call(["run", str(config), "--out", "", "--no-progress"])
    assert_refused(status, err, "--out")
    assert "''" in err  # the value
    assert sorted(p.name for p in work.iterdir()) == [], "files were written in the cwd"


@pytest.mark.parametrize(
    "argv",
    [
        ["factorize", "--kind", "tree", "--rounds", "8"],
        ["plot", "RUN"],
        ["sweep", "CONFIG", "--grid", "seed=1,2"],
    ],
    ids=["factorize", "plot", "sweep"],
)
def test_every_command_refuses_an_empty_out(tmp_path, monkeypatch, argv):
    config = tmp_path / "config.toml"
    config.write_text(to_toml(case_config("rounds", 1)))
    run_dir = write_run(tmp_path / "run", [{"round": 1, "central": {"accuracy": 0.5}}])
    argv = [{"CONFIG": str(config), "RUN": str(run_dir)}.get(a, a) for a in argv]
    work = tmp_path / "work"
    work.mkdir()
    monkeypatch.chdir(work)
    status, err = call([*argv, "--out", ""])
    assert_refused(status, err, "--out")
    assert list(work.iterdir()) == []


# -- data sources -------------------------------------------------------------------------

SECRET = "root-SECRET-LINE:x:0:0:never-in-an-error-message"


def data_config(data: dict) -> dict:
    config = case_config("rounds", 1)
    config["data"] = data
    return config


def run_config(tmp_path: Path, config: dict) -> tuple[object, str]:
    path = tmp_path / "config.toml"
    path.write_text(to_toml(config))
    return call(["run", str(path), "--out", str(tmp_path / "out"), "--no-progress"])


def test_a_table_linked_to_a_system_file_is_refused_without_quoting_it(tmp_path):
    system = tmp_path / "etc" / "shadow"
    system.parent.mkdir()
    system.write_text("\n".join([SECRET, SECRET + ":more:fields:here", "x"]) + "\n")
    table = tmp_path / "clients.csv"
    table.symlink_to(system)
    status, err = run_config(
        tmp_path,
        data_config({"source": "table", "path": str(table), "partition": "iid", "num_clients": 6}),
    )
    assert_refused(status, err, "data.")
    assert "SECRET" not in err and "never-in" not in err, f"the file's contents leaked: {err}"
    assert str(table) in err and f"a link to {system}" in err


@pytest.mark.parametrize("suffix", [".csv", ".jsonl"])
def test_a_linked_table_that_does_not_parse_is_refused_without_quoting_it(tmp_path, suffix):
    system = tmp_path / "etc" / "passwd"
    system.parent.mkdir()
    system.write_text(f'{SECRET}\n{SECRET},a,b,c\n"{SECRET}\n')
    table = tmp_path / f"clients{suffix}"
    table.symlink_to(system)
    status, err = run_config(
        tmp_path,
        data_config({"source": "table", "path": str(table), "partition": "iid", "num_clients": 6}),
    )
    assert_refused(status, err, "data.")
    assert "SECRET" not in err and "never-in" not in err, f"the file's contents leaked: {err}"


@pytest.mark.parametrize("suffix", [".csv", ".parquet"])
def test_nan_features_in_a_table_are_refused_saying_nan_with_column_and_row(tmp_path, suffix):
    import pyarrow as pa
    import pyarrow.parquet as pq

    f0 = [float(i) for i in range(12)]
    f0[5] = float("nan")  # data row 5 (0-based), column f0
    columns = {
        "client_id": [i % 3 for i in range(12)],
        "label": [i % 2 for i in range(12)],
        "f0": f0,
        "f1": [1.0] * 12,
    }
    table = tmp_path / f"clients{suffix}"
    if suffix == ".csv":
        rows = ["client_id,label,f0,f1"]
        rows += [",".join(str(columns[c][i]) for c in columns) for i in range(12)]
        table.write_text("\n".join(rows) + "\n")
    else:
        pq.write_table(pa.table(columns), table)
    status, err = run_config(
        tmp_path,
        data_config(
            {"source": "table", "path": str(table), "partition": "natural", "num_clients": 3}
        ),
    )
    assert_refused(status, err, "data.")
    assert "NaN" in err and "f0" in err and "row 5" in err, err


def test_a_loader_label_of_a_billion_is_refused_before_the_model_is_sized(tmp_path, monkeypatch):
    (tmp_path / "huge_labels.py").write_text(
        textwrap.dedent(
            """
            import numpy as np

            def load():
                x = np.zeros((40, 4), dtype=np.float32)
                y = np.arange(40) % 2
                y[7] = 10**9
                return x, y
            """
        )
    )
    import torch

    def no_model(*args, **kwargs):
        raise AssertionError("a model was sized before the labels were checked")

    monkeypatch.setattr(torch.nn.Linear, "__init__", no_model)
    status, err = run_config(
        tmp_path,
        data_config(
            {
                "source": "python",
                "loader": "huge_labels:load",
                "python_path": [str(tmp_path)],
                "partition": "iid",
                "num_clients": 4,
            }
        ),
    )
    assert_refused(status, err, "data.loader")
    assert "1000000000" in err and "row 7" in err, err
    sys.modules.pop("huge_labels", None)


@pytest.mark.parametrize(
    "num_classes, text", [(10**9, "num_classes"), ("ten", "num_classes"), (None, "num_classes")]
)
def test_a_saved_dataset_claiming_a_billion_classes_is_refused(tmp_path, num_classes, text):
    import numpy as np

    from fedsim.data.dataset import FederatedDataset

    rng = np.random.default_rng(0)
    x, y = rng.random((40, 4)).astype(np.float32), np.arange(40) % 2
    offsets = np.array([0, 10, 20, 30, 40])
    arrays = {
        "train_x": x,
        "train_y": y,
        "train_offsets": offsets,
        "test_x": x[:0],
        "test_y": y[:0],
        "test_offsets": np.zeros(5, dtype=np.int64),
    }
    FederatedDataset.from_arrays(arrays, 2, "small").save(tmp_path / "ds")
    meta = json.loads((tmp_path / "ds" / "meta.json").read_text())
    meta["num_classes"] = num_classes
    (tmp_path / "ds" / "meta.json").write_text(json.dumps(meta))
    status, err = run_config(
        tmp_path,
        data_config(
            {
                "source": "npy",
                "path": str(tmp_path / "ds"),
                "partition": "natural",
                "num_clients": 4,
            }
        ),
    )
    assert_refused(status, err, text)


# -- factorizations -----------------------------------------------------------------------


@pytest.mark.parametrize(
    "content",
    [b"PK\x03\x04" + b"\x00garbage" * 20, b"PK\x05\x06" + b"\x00" * 18, b"\x93NUMPY garbage"],
    ids=["zip-header", "empty-zip-end", "npy-header"],
)
def test_account_matrix_refuses_a_garbage_npz_naming_it(tmp_path, content):
    garbage = tmp_path / "f.npz"
    garbage.write_bytes(content)
    status, err = call(
        [
            "account",
            "matrix",
            "--factorization",
            str(garbage),
            "--noise-multiplier",
            "1",
            "--delta",
            "1e-5",
        ]
    )
    assert_refused(status, err, "--factorization")
    assert str(garbage) in err


def test_a_dense_factorization_too_large_is_refused_with_its_cost(tmp_path, monkeypatch):
    def never(*args, **kwargs):
        raise AssertionError("the optimiser started without a word about its cost")

    import fedsim.privacy.matrix.kinds.dense as dense_kind

    monkeypatch.setattr(dense_kind, "dense", never)
    out = tmp_path / "dense.npz"
    status, err = call(["factorize", "--kind", "dense", "--rounds", "5000", "--out", str(out)])
    assert_refused(status, err, "--rounds")
    assert "5000" in err and "--force" in err and "GiB" in err and "iterations" in err, err
    assert not out.exists()


def test_a_long_factorization_says_its_cost_first_and_shows_progress(tmp_path, monkeypatch):
    import fedsim.commands.factorize as factorize_command

    monkeypatch.setattr(factorize_command, "ANNOUNCE_FLOPS", 0)  # as if it were large
    monkeypatch.setattr(factorize_command, "PROGRESS_EVERY_S", 0.0)
    out = tmp_path / "dense.npz"
    status, err = call(["factorize", "--kind", "dense", "--rounds", "32", "--out", str(out)])
    assert status == 0, err
    lines = err.splitlines()
    assert "up to 1000 iterations" in lines[0] and "GiB" in lines[0], err
    assert any("iteration 1/1000" in line for line in lines[1:]), err


# -- readers of run files -----------------------------------------------------------------


def write_run(
    path: Path, records: list, config: object = None, summary: object = None, raw: str | None = None
) -> Path:
    path.mkdir(parents=True)
    lines = raw if raw is not None else "".join(json.dumps(r) + "\n" for r in records)
    (path / "rounds.jsonl").write_text(lines)
    if config is not None:
        (path / "config.json").write_text(json.dumps(config))
    if summary is not None:
        (path / "summary.json").write_text(json.dumps(summary))
    return path


GOOD = [
    {"round": 0, "central": {"accuracy": 0.1}},
    {
        "round": 1,
        "central": {"accuracy": 0.5},
        "privacy": {"epsilon": 1.0, "delta": 1e-5},
        "seconds": 1.0,
        "bytes_up": 10,
        "bytes_down": 10,
    },
]


@pytest.mark.parametrize(
    "raw, where",
    [
        ("garbage\n" + json.dumps(GOOD[1]) + "\n", "line 1"),
        (json.dumps(GOOD[0]) + "\n\x00\x01 not json\n" + json.dumps(GOOD[1]) + "\n", "line 2"),
        (json.dumps(GOOD[0]) + "\n[1, 2, 3]\n", "line 2"),
        (json.dumps(GOOD[0]) + '\n{"round": 1, "central": "garbage"}\n', "line 2"),
        ('{"round": "one"}\n', "line 1"),
    ],
    ids=["first-line", "middle-line", "not-an-object", "section-not-a-mapping", "round-text"],
)
def test_plot_refuses_a_damaged_rounds_file_by_name_and_line(tmp_path, raw, where):
    run_dir = write_run(tmp_path / "run", [], raw=raw)
    status, err = call(["plot", str(run_dir), "--out", str(tmp_path / "p.png")])
    assert status == 2, f"exit {status}: {err}"
    assert "rounds.jsonl" in err and where in err and "Traceback" not in err, err
    assert not (tmp_path / "p.png").exists()


def test_a_torn_last_line_is_still_read(tmp_path):
    raw = "".join(json.dumps(r) + "\n" for r in GOOD) + '{"round": 2, "cent'
    run_dir = write_run(tmp_path / "run", [], raw=raw)
    status, err = call(["plot", str(run_dir), "--out", str(tmp_path / "p.png")])
    assert status == 0, err


@pytest.mark.parametrize(
    "change, text",
    [
        ({"round": 10**30}, "round"),
        ({"privacy": {"epsilon": float("nan"), "delta": 1e-5}}, "epsilon"),
        ({"privacy": {"epsilon": -1.0, "delta": 1e-5}}, "epsilon"),
        ({"privacy": {"epsilon": 1.0, "delta": 2.0}}, "delta"),
        ({"seconds": -5.0}, "seconds"),
    ],
    ids=["round-1e30", "epsilon-nan", "epsilon-negative", "delta-2", "seconds-negative"],
)
def test_compare_refuses_impossible_numbers_by_file_and_line(tmp_path, change, text):
    records = [GOOD[0], {**GOOD[1], **change}]
    a = write_run(tmp_path / "a", records, config={"seed": 1})
    b = write_run(tmp_path / "b", GOOD, config={"seed": 2})
    status, err = call(["compare", str(a), str(b)])
    assert status == 2, f"exit {status}: {err}"
    assert str(a / "rounds.jsonl") in err and "line 2" in err and text in err, err


@pytest.mark.parametrize("name", ["summary.json", "config.json"])
def test_compare_refuses_a_run_file_that_is_a_directory(tmp_path, name):
    a = write_run(tmp_path / "a", GOOD, config={"seed": 1})
    b = write_run(tmp_path / "b", GOOD, config={"seed": 2})
    (a / name).unlink(missing_ok=True)
    (a / name).mkdir()
    status, err = call(["compare", str(a), str(b)])
    assert status == 2, f"exit {status}: {err}"
    assert str(a / name) in err, err


def test_compare_does_not_claim_no_config_differences_when_it_cannot_read_them(tmp_path, capsys):
    a = write_run(tmp_path / "a", GOOD)  # no config.json at all
    b = write_run(tmp_path / "b", GOOD)
    assert main(["compare", str(a), str(b)]) == 0
    out = capsys.readouterr().out
    assert "config differences: none" not in out, out
    assert "config differences: unknown" in out and "no config" in out, out
