"""``fedsim plot``: the PNG it writes draws exactly the values of the runs' rounds.jsonl, names
the runs by their config differences, and refuses what it cannot draw."""

import ast
import os
import subprocess
import sys
from pathlib import Path

import pytest
from run_dir_support import expected, private, rounds, run, small_quickstart

import fedsim.commands.plot as plot_command
from fedsim.cli import main

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Two FedAvg runs that differ only in their seed, and a DP-FedAvg run."""
    root = tmp_path_factory.mktemp("runs")
    made = {
        "seed0": small_quickstart(seed=0),
        "seed1": small_quickstart(seed=1),
        "dp": private(seed=3, noise_multiplier=1.2),
    }
    for name, raw in made.items():
        run(raw, root / name)
    return {name: root / name for name in made}


@pytest.fixture
def drawn(monkeypatch):
    """The figures ``fedsim plot`` saves (they are also written)."""
    figures = []
    real = plot_command.save_figure

    def keep(figure, path):
        figures.append(figure)
        real(figure, path)

    monkeypatch.setattr(plot_command, "save_figure", keep)
    return figures


def lines_of(ax):
    """label -> (x, y) of an axis' lines."""
    return {
        line.get_label(): (list(line.get_xdata()), list(line.get_ydata()))
        for line in ax.get_lines()
    }


def test_the_png_draws_each_runs_rounds(runs, drawn, tmp_path):
    out = tmp_path / "fig.png"
    assert main(["plot", str(runs["seed0"]), str(runs["dp"]), "--out", str(out)]) == 0
    assert out.read_bytes()[:8] == PNG_MAGIC
    (figure,) = drawn
    titles = [ax.get_title() for ax in figure.axes]
    assert titles == ["accuracy", "loss", "epsilon", "bytes per round", "seconds per round"]
    labels = [t.get_text() for t in figure.legends[0].get_texts()]
    panels = dict(zip(titles, figure.axes))
    checked = 0
    for title, metrics in {
        "accuracy": ["central/accuracy", "evaluate/accuracy"],
        "loss": ["central/loss", "evaluate/loss", "train/train_loss"],
        "epsilon": ["privacy/epsilon"],
        "bytes per round": ["bytes_up", "bytes_down"],
        "seconds per round": ["seconds"],
    }.items():
        lines = lines_of(panels[title])
        for label, name in zip(labels, ("seed0", "dp")):
            records = rounds(runs[name])
            for metric in metrics:
                xs, ys = expected(records, metric)
                key = f"{label}: {metric}"
                if not xs:  # the run recorded no such value: no line
                    assert key not in lines
                    continue
                assert lines[key] == (xs, ys), key
                checked += 1
    # the private run writes no client metrics, and the FedAvg run has no epsilon
    assert checked == 3 + 4 + 1 + 4 + 2
    assert len(panels["epsilon"].get_lines()) == 1


def test_the_legend_names_the_config_keys_that_differ(runs, drawn, tmp_path):
    out = tmp_path / "seeds.png"
    seeds = ["plot", str(runs["seed0"]), str(runs["seed1"]), "--out", str(out), "--per-seed"]
    assert main(seeds) == 0  # one line per seed (without --per-seed: their mean)
    (figure,) = drawn
    # seed, data.seed and client.seed follow one another: named once
    assert [t.get_text() for t in figure.legends[0].get_texts()] == ["seed=0", "seed=1"]

    assert main(["plot", str(runs["seed0"]), str(runs["dp"]), "--out", str(out)]) == 0
    fedavg, dp = [t.get_text() for t in drawn[1].legends[0].get_texts()]
    assert fedavg.startswith("seed=0, ") and dp.startswith("seed=3, ")
    assert "name=fedavg" in fedavg and "name=dp-fedavg" in dp
    assert "noise_multiplier=1.2" in dp and "noise_multiplier=(absent)" in fedavg


def test_metric_selects_the_panels(runs, drawn, tmp_path):
    out = tmp_path / "eps.png"
    args = ["plot", str(runs["seed0"]), str(runs["dp"]), "--out", str(out)]
    assert main([*args, "--metric", "privacy/epsilon", "train/steps"]) == 0
    (figure,) = drawn
    assert [ax.get_title() for ax in figure.axes] == ["epsilon", "train/steps"]
    epsilon, steps = (lines_of(ax) for ax in figure.axes)
    assert [label.split(": ")[1] for label in epsilon] == ["privacy/epsilon"]
    assert list(epsilon.values())[0] == expected(rounds(runs["dp"]), "privacy/epsilon")
    assert len(steps) == 1  # only the FedAvg run has its clients' steps
    assert figure.axes[0].get_ylabel() == "epsilon at delta = 1e-05"


def test_one_run_is_drawn_into_its_directory(runs, drawn):
    target = runs["seed1"] / "plot.png"
    assert main(["plot", str(runs["seed1"])]) == 0
    assert target.read_bytes()[:8] == PNG_MAGIC
    (figure,) = drawn
    assert not figure.legends  # one run: the panels' legends name the metrics
    accuracy = figure.axes[0]
    assert [t.get_text() for t in accuracy.get_legend().get_texts()] == [
        "central/accuracy",
        "evaluate/accuracy",
    ]
    target.unlink()


def test_an_unknown_metric_is_refused_with_the_available_ones(runs, capsys, tmp_path):
    out = tmp_path / "x.png"
    assert main(["plot", str(runs["seed0"]), "--metric", "central/f1", "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert "--metric = 'central/f1'" in err
    for name in ("central/accuracy", "train/train_loss", "bytes_up", "seconds"):
        assert name in err
    assert "privacy/epsilon" not in err  # the FedAvg run has none
    assert not out.exists()


def test_what_is_not_a_run_directory_is_refused(runs, capsys, tmp_path):
    assert main(["plot", str(tmp_path / "missing")]) == 2
    assert "no such directory" in capsys.readouterr().err
    assert main(["plot", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert f"RUN_DIR = '{tmp_path}'" in err and "it has no rounds.jsonl" in err
    (tmp_path / "rounds.jsonl").write_text("")
    assert main(["plot", str(tmp_path)]) == 2
    assert "rounds.jsonl is empty" in capsys.readouterr().err
    assert main(["plot", str(runs["seed0"]), "--out", str(tmp_path / "fig.pdf")]) == 2
    assert "--out" in capsys.readouterr().err


def imported_after(statement):
    """The heavy packages in sys.modules after ``statement``, in a fresh interpreter."""
    heavy = ("matplotlib", "flwr", "ray", "torch", "tensorboard")
    code = f"import sys; {statement}; print(sorted(set({heavy!r}) & set(sys.modules)))"
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])}
    shown = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env)
    assert shown.returncode == 0, shown.stderr
    return ast.literal_eval(shown.stdout)


def test_the_commands_import_no_heavy_package_until_they_draw():
    assert imported_after("import fedsim.commands.plot, fedsim.commands.compare") == []
    assert "matplotlib" not in imported_after("import fedsim.cli")
