"""``fedsim compare``: its numbers are the runs' summary.json and rounds.jsonl values, its
config section lists exactly the keys that differ, and it refuses what is not a run."""

import io
import json
import math
from pathlib import Path

import pytest
from rich.console import Console
from run_dir_support import expected, private, rounds, run, small_quickstart, summary

from fedsim.cli import main
from fedsim.commands.compare import compare_runs, render_rich
from fedsim.frontend.results import RunWriter
from fedsim.frontend.run_series import load_runs

SEEDS = {"seed", "data.seed", "client.seed"}  # no [faults] table: faults.seed stays 0


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """A FedAvg run, the same with another seed, and a DP-FedAvg run with a third seed."""
    root = tmp_path_factory.mktemp("runs")
    made = {
        "fedavg": small_quickstart(seed=0),
        "other-seed": small_quickstart(seed=1),
        "dp": private(seed=3, noise_multiplier=1.2),
    }
    for name, raw in made.items():
        run(raw, root / name)
    return {name: root / name for name in made}


def compare_json(capsys, *dirs, flags=()):
    assert main(["compare", *map(str, dirs), "--json", *flags]) == 0
    return json.loads(capsys.readouterr().out)


def test_totals_are_the_summaries(runs, capsys):
    result = compare_json(capsys, runs["fedavg"], runs["dp"])
    fedavg, dp = result["runs"]
    assert (fedavg["name"], dp["name"]) == ("fedavg", "dp")
    for facts, name in ((fedavg, "fedavg"), (dp, "dp")):
        done = summary(runs[name])
        assert facts["rounds"] == done["rounds"] == 3
        assert facts["bytes_up"] == done["bytes"]["up"]
        assert facts["bytes_down"] == done["bytes"]["down"]
        assert facts["seconds_total"] == done["seconds"]["total"]
        per_round = expected(rounds(runs[name]), "seconds")[1]
        assert facts["seconds_rounds"] == pytest.approx(sum(per_round))
    assert dp["epsilon"] == summary(runs["dp"])["privacy"]["epsilon"] > 0
    assert dp["delta"] == summary(runs["dp"])["privacy"]["delta"]
    assert fedavg["epsilon"] is None and fedavg["delta"] is None


def test_final_and_best_values_are_the_rounds_values(runs, capsys):
    result = compare_json(capsys, runs["fedavg"], runs["dp"])
    rows = {row["metric"]: row for row in result["metrics"]}
    assert rows["central/accuracy"]["best_is"] == "max"
    assert rows["central/loss"]["best_is"] == "min"
    assert rows["train/steps"]["best_is"] is None
    for i, name in enumerate(("fedavg", "dp")):
        records = rounds(runs[name])
        final = summary(runs[name])["final"]["central"]
        for metric, pick in (("central/accuracy", max), ("central/loss", min)):
            xs, ys = expected(records, metric)
            cell = rows[metric]["runs"][i]
            assert (cell["final_round"], cell["final"]) == (xs[-1], ys[-1])
            assert cell["final"] == final[metric.split("/")[1]]
            assert cell["best"] == pick(ys)
            assert cell["best_round"] == xs[ys.index(pick(ys))]
    train_loss = rows["train/train_loss"]["runs"]
    assert train_loss[0]["final"] == summary(runs["fedavg"])["final"]["train"]["train_loss"]
    assert train_loss[1] is None  # a private run writes no client metrics
    steps = rows["train/steps"]["runs"][0]
    assert steps["best"] is None
    assert steps["final"] == rounds(runs["fedavg"])[-1]["train"]["metrics"]["steps"]
    assert "bytes_up" not in rows and "privacy/epsilon" not in rows  # totals, not metrics


def test_config_differences_are_exactly_the_changed_keys(runs, capsys):
    # one column per run (without --per-seed: one group, tests/frontend/test_seed_groups.py)
    seeds = compare_json(capsys, runs["fedavg"], runs["other-seed"], flags=["--per-seed"])
    differences = {d["key"]: d["values"] for d in seeds["config_differences"]}
    assert set(differences) == SEEDS
    assert differences["data.seed"] == {"fedavg": 0, "other-seed": 1}

    dp = compare_json(capsys, runs["fedavg"], runs["dp"])
    differences = {d["key"]: d["values"] for d in dp["config_differences"]}
    changed = {
        "strategy.name",
        "strategy.options.clipping_norm",
        "strategy.options.noise_multiplier",
    }
    assert set(differences) == SEEDS | changed
    assert differences["strategy.options.noise_multiplier"] == {"dp": 1.2}  # fedavg has none
    assert differences["strategy.name"] == {"fedavg": "fedavg", "dp": "dp-fedavg"}


def test_plain_tables_when_not_a_terminal(runs, capsys):
    assert main(["compare", str(runs["fedavg"]), str(runs["other-seed"]), "--per-seed"]) == 0
    text = capsys.readouterr().out.rstrip("\n")
    blocks = {block.split("\n")[0]: block.split("\n")[1:] for block in text.split("\n\n")}
    assert set(blocks) == {"runs", "metrics (final and best, @round)", "config differences"}
    header, rule, *rows = blocks["config differences"]
    assert header.split() == ["key", "fedavg", "other-seed"]
    assert {row.split()[0] for row in rows} == SEEDS
    assert all(row.split()[1:] == ["0", "1"] for row in rows)
    metrics = blocks["metrics (final and best, @round)"]
    accuracy = next(r for r in metrics if r.startswith("central/accuracy"))
    assert accuracy.split()[1] == "max"
    result = compare_runs(load_runs([runs["fedavg"], runs["other-seed"]]))
    cell = next(r for r in result["metrics"] if r["metric"] == "central/accuracy")["runs"][0]
    assert f"{cell['final']:.4g} @{cell['final_round']}" in accuracy
    assert "epsilon" not in "\n".join(blocks["runs"])  # neither run is private


def test_rich_tables(runs):
    console = Console(file=io.StringIO(), width=240, color_system=None)
    result = compare_runs(load_runs([runs["fedavg"], runs["dp"]]))
    render_rich(result, console)
    text = console.file.getvalue()
    for title in ("runs", "metrics (final and best, @round)", "config differences"):
        assert title in text
    dp = result["runs"][1]
    assert f"{dp['epsilon']:.4g}" in text
    assert "strategy.options.noise_multiplier" in text and "(absent)" in text


def test_what_is_not_a_run_directory_is_refused(runs, capsys, tmp_path):
    assert main(["compare", str(runs["fedavg"]), str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert f"RUN_DIR = '{tmp_path}'" in err and "it has no rounds.jsonl" in err
    (tmp_path / "rounds.jsonl").write_text('{"round": 0}\n[1, 2]\n')
    assert main(["compare", str(tmp_path)]) == 2
    assert "rounds.jsonl: line 2 is not a round record" in capsys.readouterr().err


def test_flower_app_runs_differ_by_their_run_config(tmp_path, capsys):
    app = Path(__file__).parents[1] / "apps" / "quickstart"
    for name, lr in (("lr-0.1", "0.1"), ("lr-0.05", "0.05")):
        args = ["flwr-run", str(app), "--num-supernodes", "4", "--backend", "local"]
        flags = ["--run-config", f"num-server-rounds=1 local-epochs=1 lr={lr}", "--no-progress"]
        assert main([*args, *flags, "--out", str(tmp_path / name)]) == 0
    capsys.readouterr()
    result = compare_json(capsys, tmp_path / "lr-0.1", tmp_path / "lr-0.05")
    assert result["config_differences"] == [
        {"key": "run_config.lr", "values": {"lr-0.1": 0.1, "lr-0.05": 0.05}}
    ]
    assert [r["label"] for r in result["runs"]] == ["lr=0.1", "lr=0.05"]
    rows = {row["metric"]: row for row in result["metrics"]}
    for i, name in enumerate(("lr-0.1", "lr-0.05")):
        (line,) = rounds(tmp_path / name)  # a Flower app's run has no round 0
        final = rows["train/train_loss"]["runs"][i]["final"]
        assert final == line["train"]["metrics"]["train_loss"]
        assert result["runs"][i]["bytes_up"] == line["bytes_up"]


def test_an_infinite_epsilon_reads_back_as_infinite(tmp_path, capsys):
    writer = RunWriter(tmp_path)  # the writer of every run: epsilon inf as 1e999 and a flag
    for r in (1, 2):
        privacy = {"epsilon": math.inf, "delta": 1e-5}
        writer.write_round({"round": r, "seconds": 0.5, "bytes_up": 8, "privacy": privacy})
    writer.close()
    assert "1e999" in (tmp_path / "rounds.jsonl").read_text()
    (facts,) = compare_json(capsys, tmp_path)["runs"]
    assert facts["epsilon"] == math.inf and facts["epsilon_infinite"] is True
    assert (facts["rounds"], facts["bytes_up"], facts["seconds_total"]) == (2, 16, None)
    assert main(["compare", str(tmp_path)]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert next(line for line in lines if line.startswith("epsilon")).split() == ["epsilon", "inf"]
