"""Results across seeds: ``fedsim plot`` draws runs that differ only in seed as their mean with
a band the legend names, ``fedsim compare`` gives mean ± sample sd per group and paired
differences with their t-interval, ``--per-seed`` keeps one line/column per run, a sweep's
directory is read through its index, and compare lists only the config keys that differ.

The run directories are written by the project's writers (RunWriter for rounds.jsonl and
summary.json, the config as ``fedsim run`` writes it, the sweep's index by ``fedsim sweep``'s
own functions) with numbers drawn here, so every expected value is computed from them with
numpy/scipy; one small real sweep checks the whole path."""

import io
import json
import math

import numpy as np
import pytest
from rich.console import Console
from scipy import stats

import fedsim.commands.plot as plot_command
from fedsim.cli import main
from fedsim.commands.compare import compare_groups, compare_runs, render_rich
from fedsim.commands.sweep import index_entry, plan, write_index
from fedsim.config import to_mapping
from fedsim.frontend.results import RunWriter
from fedsim.frontend.run_series import load_runs
from fedsim.frontend.seed_groups import group_runs, seed_of
from fedsim.results_json import dumps

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

[evaluation]
clients = 4
every = 1

[engine]
backend = "local"
workers = 1
"""
NOISE = "strategy.options.noise_multiplier"
NOISES = (0.8, 1.5)
SEEDS = (0, 1, 2)
ROUNDS = 4


def write_run(out, config, rng, rounds=ROUNDS, epsilon=1.0):
    """A run directory as ``fedsim run`` leaves it: config.json, rounds.jsonl (round 0: the
    initial model's central evaluation), summary.json; its metrics drawn from ``rng``."""
    writer = RunWriter(out)
    (out / "config.json").write_text(json.dumps(to_mapping(config), indent=2, sort_keys=True))
    last = {}
    for r in range(rounds + 1):
        last = {"accuracy": float(rng.uniform(0.1, 0.9)), "loss": float(rng.uniform(0.5, 2.5))}
        line = {"round": r, "central": last, "seconds": float(rng.uniform(0.1, 1.0))}
        if r:
            line.update(
                bytes_up=1000 * r,
                bytes_down=2000,
                privacy={
                    "epsilon": epsilon * r,
                    "delta": 1e-5,
                },
            )
        writer.write_round(line)
    writer.write_summary(
        {
            "rounds": rounds,
            "final": {"central": last},
            "privacy": {"epsilon": epsilon * rounds, "delta": 1e-5},
            "seconds": {"total": 5.0},
        }
    )
    writer.close()


def make_sweep(tmp_path, seeds=SEEDS, epsilon_of=None):
    """A sweep directory (``fedsim sweep``'s layout and index) over NOISES x ``seeds``."""
    toml = tmp_path / "tiny.toml"
    toml.write_text(CONFIG)
    grid = [f"strategy.options.noise_multiplier={','.join(map(str, NOISES))}"]
    points = plan(str(toml), [], grid, ",".join(map(str, seeds)))
    out = tmp_path / "sweep"
    out.mkdir()
    for i, point in enumerate(points):
        noise = point.values["strategy.options.noise_multiplier"]
        write_run(out / point.name, point.config, np.random.default_rng(100 + i), epsilon=noise)
    entries = [index_entry(p, out, "finished") for p in points]
    write_index(out, {"config": str(toml), "grid": grid, "set": [], "seeds": "x"}, entries)
    return out, points


@pytest.fixture
def drawn(monkeypatch):
    figures = []
    real = plot_command.save_figure

    def keep(figure, path):
        figures.append(figure)
        real(figure, path)

    monkeypatch.setattr(plot_command, "save_figure", keep)
    return figures


def central(out, metric):
    """(rounds, values) of central/<metric> in a run's rounds.jsonl, read as plain JSON."""
    lines = [json.loads(x) for x in (out / "rounds.jsonl").read_text().splitlines()]
    return [x["round"] for x in lines], [x["central"][metric] for x in lines]


def band_points(band):
    """{x: set of y} of a filled band's outline."""
    out = {}
    for x, y in band.get_paths()[0].vertices:
        out.setdefault(round(float(x), 9), set()).add(round(float(y), 9))
    return out


def test_runs_that_differ_only_in_seed_are_one_group(tmp_path):
    out, points = make_sweep(tmp_path)
    runs = load_runs([out / p.name for p in points])
    groups = group_runs(runs)
    assert [len(g.runs) for g in groups] == [3, 3]
    assert [[seed_of(r)["seed"] for r in g.runs] for g in groups] == [list(SEEDS)] * 2
    assert groups[0].seed_texts == ["0", "1", "2"]  # data.seed and client.seed follow seed
    noises = {r.config["strategy.options.noise_multiplier"] for r in groups[1].runs}
    assert noises == {1.5}


@pytest.mark.parametrize("band", ["sd", "ci95"])
def test_plot_draws_each_groups_mean_and_its_band(tmp_path, drawn, capsys, band):
    out, points = make_sweep(tmp_path)
    assert main(["plot", str(out), "--metric", "central/accuracy", "--band", band]) == 0
    assert (out / "plot.png").read_bytes()[:4] == b"\x89PNG"  # a sweep's plot goes in it
    (figure,) = drawn
    legend = figure.legends[0]
    title = legend.get_title().get_text()
    wanted = "± 1 sample sd (ddof=1)" if band == "sd" else "95 % t-interval of the mean"
    assert title == f"line: mean over seeds; band: {wanted}"
    labels = [t.get_text() for t in legend.get_texts()]
    assert labels == [f"noise_multiplier={n:g} (mean of 3 seeds)" for n in NOISES]
    (ax,) = figure.axes
    lines = {line.get_label(): line for line in ax.get_lines()}
    bands = ax.collections
    assert len(bands) == 2
    for i, noise in enumerate(NOISES):
        dirs = [
            out / p.name for p in points if p.values["strategy.options.noise_multiplier"] == noise
        ]
        table = np.array([central(d, "accuracy")[1] for d in dirs])
        mean = table.mean(axis=0)
        sd = table.std(axis=0, ddof=1)
        if band == "sd":
            low, high = mean - sd, mean + sd
        else:
            low, high = stats.t.interval(0.95, 2, loc=mean, scale=stats.sem(table, axis=0))
        line = lines[f"{labels[i]}: central/accuracy"]
        assert list(line.get_xdata()) == list(range(ROUNDS + 1))
        np.testing.assert_allclose(line.get_ydata(), mean, rtol=1e-12)
        outline = band_points(bands[i])
        for r in range(ROUNDS + 1):
            assert outline[r] == {round(low[r], 9), round(high[r], 9)}
    said = capsys.readouterr().out
    assert "6 run(s) in 2 seed group(s)" in said and wanted in said


def test_per_seed_keeps_one_line_per_run(tmp_path, drawn):
    out, points = make_sweep(tmp_path)
    png = tmp_path / "per-seed.png"
    assert (
        main(["plot", str(out), "--per-seed", "--metric", "central/accuracy", "--out", str(png)])
        == 0
    )
    (figure,) = drawn
    (ax,) = figure.axes
    assert not ax.collections  # no band
    labels = [t.get_text() for t in figure.legends[0].get_texts()]
    assert labels == [
        f"seed={p.values['seed']}, noise_multiplier={p.values[NOISE]:g}" for p in points
    ]
    assert figure.legends[0].get_title().get_text() == ""
    lines = {line.get_label(): line for line in ax.get_lines()}
    for label, point in zip(labels, points):
        xs, ys = central(out / point.name, "accuracy")
        line = lines[f"{label}: central/accuracy"]
        assert (list(line.get_xdata()), list(line.get_ydata())) == (xs, ys)


def test_a_groups_mean_is_drawn_at_the_rounds_all_its_runs_recorded(tmp_path, drawn):
    out, points = make_sweep(tmp_path, seeds=(0, 1))
    short = out / points[0].name  # noise 0.8, seed 0: it stopped after round 2
    lines = (short / "rounds.jsonl").read_text().splitlines()[:3]
    (short / "rounds.jsonl").write_text("\n".join(lines) + "\n")
    png = tmp_path / "x.png"
    assert main(["plot", str(out), "--metric", "central/loss", "--out", str(png)]) == 0
    (ax,) = drawn[0].axes
    first = ax.get_lines()[0]
    assert list(first.get_xdata()) == [0, 1, 2]
    both = np.array([central(out / p.name, "loss")[1][:3] for p in points[:2]])
    np.testing.assert_allclose(first.get_ydata(), both.mean(axis=0), rtol=1e-12)
    assert list(ax.get_lines()[1].get_xdata()) == list(range(ROUNDS + 1))


def compare_json(capsys, *args):
    assert main(["compare", *map(str, args), "--json"]) == 0
    return json.loads(capsys.readouterr().out)


def test_compare_gives_each_groups_mean_and_sample_sd(tmp_path, capsys):
    out, points = make_sweep(tmp_path)
    result = compare_json(capsys, out)
    assert result["view"] == "seed groups" and result["sd"] == "sample sd (ddof=1)"
    g1, g2 = result["groups"]
    assert (g1["n"], g1["seeds"], g2["seeds"]) == (3, ["0", "1", "2"], ["0", "1", "2"])
    assert g1["runs"] == [p.name for p in points[:3]]
    assert g1["label"] == "noise_multiplier=0.8 (mean of 3 seeds)"
    assert g2["epsilon"]["mean"] == pytest.approx(1.5 * ROUNDS) and g2["epsilon"]["sd"] == 0.0
    rows = {row["metric"]: row for row in result["metrics"]}
    for i, group in enumerate((points[:3], points[3:])):
        finals = [central(out / p.name, "accuracy")[1][-1] for p in group]
        bests = [max(central(out / p.name, "accuracy")[1]) for p in group]
        cell = rows["central/accuracy"]["groups"][i]
        assert cell["final"]["mean"] == pytest.approx(np.mean(finals), rel=1e-12)
        assert cell["final"]["sd"] == pytest.approx(np.std(finals, ddof=1), rel=1e-12)
        low, high = stats.t.interval(0.95, 2, loc=np.mean(finals), scale=stats.sem(finals))
        assert (cell["final"]["low"], cell["final"]["high"]) == (
            pytest.approx(low, rel=1e-12),
            pytest.approx(high, rel=1e-12),
        )
        assert cell["best"]["mean"] == pytest.approx(np.mean(bests), rel=1e-12)
        assert cell["final_rounds"] == [ROUNDS] * 3
    # between the groups only the noise differs (the seed keys are what groups them)
    assert result["config_differences"] == [
        {"key": "strategy.options.noise_multiplier", "values": {"g1": 0.8, "g2": 1.5}}
    ]
    assert len(result["runs"]) == 6  # each run's own facts too


def test_paired_differences_use_the_seeds_both_groups_ran(tmp_path, capsys):
    out, points = make_sweep(tmp_path, seeds=(0, 1, 2, 3))
    # group 1 ran seeds 0, 1, 3 (seed 2 is another directory's), group 2 all four
    dropped = next(
        p for p in points if p.values == {"strategy.options.noise_multiplier": 0.8, "seed": 2}
    )
    dirs = [out / p.name for p in points if p is not dropped]
    result = compare_json(capsys, *dirs)
    assert [g["seeds"] for g in result["groups"]] == [["0", "1", "3"], ["0", "1", "2", "3"]]
    pairs = {row["metric"]: row for row in result["paired"]}
    row = pairs["central/loss"]
    assert (row["a"], row["b"], row["seeds"], row["n"]) == ("g1", "g2", ["0", "1", "3"], 3)
    by_seed = {(p.values["strategy.options.noise_multiplier"], p.values["seed"]): p for p in points}
    diff = np.array(
        [
            central(out / by_seed[1.5, s].name, "loss")[1][-1]
            - central(out / by_seed[0.8, s].name, "loss")[1][-1]
            for s in (0, 1, 3)
        ]
    )
    np.testing.assert_allclose(row["differences"], diff, rtol=1e-12)
    assert row["mean"] == pytest.approx(diff.mean(), rel=1e-12)
    assert row["sd"] == pytest.approx(diff.std(ddof=1), rel=1e-12)
    low, high = stats.t.interval(0.95, len(diff) - 1, loc=diff.mean(), scale=stats.sem(diff))
    assert row["low"] == pytest.approx(low, rel=1e-12)
    assert row["high"] == pytest.approx(high, rel=1e-12)
    # the paired interval is scipy's one-sample t-interval of the differences, which a
    # paired t-test's p-value agrees with: 0 lies outside it exactly when p < 0.05
    p_value = stats.ttest_1samp(diff, 0.0).pvalue
    assert (low > 0 or high < 0) == (p_value < 0.05)
    assert pairs["central/accuracy"]["seeds"] == ["0", "1", "3"]
    assert "privacy/epsilon" not in pairs  # epsilon is a run's total, not a learning metric


def test_compare_tables_say_what_the_sd_and_interval_are(tmp_path, capsys):
    out, points = make_sweep(tmp_path)
    assert main(["compare", str(out)]) == 0
    text = capsys.readouterr().out
    titles = [block.split("\n")[0] for block in text.split("\n\n")]
    assert titles[:4] == [
        "seed groups (runs that differ only in seed)",
        "runs (mean ± sample sd (ddof=1) over each group's runs)",
        "metrics (final and best, mean ± sample sd (ddof=1))",
        "paired differences of final values (seed by seed, on the seeds both groups ran; "
        "95 % t-interval of the mean)",
    ]
    finals = [central(out / p.name, "accuracy")[1][-1] for p in points[:3]]
    row = next(line for line in text.splitlines() if line.startswith("central/accuracy"))
    assert f"{np.mean(finals):.4g} ± {np.std(finals, ddof=1):.2g}" in row
    paired = [line for line in text.splitlines() if line.startswith("central/accuracy")][1]
    assert "g2 - g1" in paired and "[" in paired


def test_per_seed_compare_is_one_column_per_run(tmp_path, capsys):
    out, points = make_sweep(tmp_path)
    result = compare_json(capsys, out, "--per-seed")
    assert "view" not in result and "groups" not in result
    expected = json.loads(dumps(compare_runs(load_runs([out / p.name for p in points]))))
    assert result == expected
    assert [r["name"] for r in result["runs"]] == [p.name for p in points]


def test_a_fedsim_run_next_to_a_flower_app_lists_only_what_differs(tmp_path, capsys):
    out, points = make_sweep(tmp_path, seeds=(0,))
    app = tmp_path / "app"  # what `fedsim flwr-run` leaves: the app's run config in summary.json
    writer = RunWriter(app)
    writer.write_round({"round": 1, "seconds": 0.5, "bytes_up": 10, "bytes_down": 20})
    writer.write_summary(
        {
            "app_dir": "apps/x",
            "num_supernodes": 4,
            "run_config": {"lr": 0.1, "num-server-rounds": 1},
        }
    )
    writer.close()
    fedsim_run = out / points[0].name
    config = load_runs([fedsim_run])[0].config
    unset = sum(value is None for value in config.values())
    keys = len(config) - unset
    assert unset > 0 and keys > 40
    result = compare_json(capsys, fedsim_run, app)
    assert result["config_differences"] == []
    assert result["config_hidden"] == {
        "only_in": {points[0].name: keys, "app": 4},
        "null_or_absent": unset,
    }
    assert main(["compare", str(fedsim_run), str(app)]) == 0
    text = capsys.readouterr().out
    assert "(absent)" not in text
    title = next(line for line in text.splitlines() if line.startswith("config differences"))
    assert "the configs share no key: " in title
    assert f"{keys} keys only in {points[0].name}" in title and "4 keys only in app" in title
    assert f"{unset} keys unset (null) in some runs, absent in the rest" in title
    assert title.endswith("; --all lists them)")
    every = compare_json(capsys, fedsim_run, app, "--all")
    assert len(every["config_differences"]) == len(config) + 4 and every["config_hidden"] == {}


def test_a_key_unset_in_one_run_and_absent_in_another_is_no_difference(tmp_path, capsys):
    out, points = make_sweep(tmp_path, seeds=(0,))
    older = out / points[1].name  # a config written before two keys existed (null in the other)
    config = json.loads((older / "config.json").read_text())
    assert config["client"]["lora"] is None and config["audit"] is None
    del config["client"]["lora"], config["audit"]
    (older / "config.json").write_text(json.dumps(config))
    result = compare_json(capsys, out)  # seeds (0,): two groups of one run, one column each
    assert "view" not in result
    assert [d["key"] for d in result["config_differences"]] == ["strategy.options.noise_multiplier"]
    assert result["config_hidden"] == {"null_or_absent": 2}
    every = compare_json(capsys, out, "--all")
    assert {d["key"] for d in every["config_differences"]} == {
        "audit",
        "client.lora",
        "strategy.options.noise_multiplier",
    }


def test_a_damaged_sweep_index_is_refused_by_name(tmp_path, capsys):
    out, points = make_sweep(tmp_path, seeds=(0,))
    index = out / "index.json"
    good = json.loads(index.read_text())
    for damage, needle in [
        ("{", "is not valid JSON"),
        ("[]", "is not a sweep index"),
        (
            {**good, "points": [{**good["points"][0], "run_dir": "../elsewhere"}]},
            "points[0].run_dir = '../elsewhere'",
        ),
        (
            {**good, "points": [{**good["points"][0], "status": "done"}]},
            "points[0].status = 'done'",
        ),
        ({**good, "points": [good["points"][0]] * 2}, "is listed twice"),
    ]:
        index.write_text(damage if isinstance(damage, str) else json.dumps(damage))
        for command in ("plot", "compare"):
            assert main([command, str(out)]) == 2
            err = capsys.readouterr().err
            assert f"{index}: " in err and needle in err, (command, err)
    # a point that has not run is left out and said
    pending = {**good["points"][1], "status": "pending"}
    (out / pending["run_dir"] / "rounds.jsonl").rename(out / "moved.jsonl")
    index.write_text(json.dumps({**good, "points": [good["points"][0], pending]}))
    assert main(["compare", str(out), "--json"]) == 0
    captured = capsys.readouterr()
    assert f"left out {out}/{pending['run_dir']} (pending)" in captured.err
    assert [r["name"] for r in json.loads(captured.out)["runs"]] == [good["points"][0]["run_dir"]]
    index.write_text(json.dumps({**good, "points": [pending]}))
    assert main(["plot", str(out)]) == 2
    assert "a sweep with at least one point that ran" in capsys.readouterr().err


def test_a_real_sweep_over_seeds_plots_and_compares(tmp_path, drawn, capsys):
    toml = tmp_path / "tiny.toml"
    toml.write_text(CONFIG)
    out = tmp_path / "sweep"
    flags = ["--seeds", "0..1", "--set", "rounds=1", "--out", str(out), "--no-progress"]
    assert main(["sweep", str(toml), *flags]) == 0
    capsys.readouterr()
    assert main(["plot", str(out)]) == 0
    assert (out / "plot.png").is_file()
    assert "2 run(s) in 1 seed group(s)" in capsys.readouterr().out
    (figure,) = drawn
    assert [t.get_text() for t in figure.legends[0].get_texts()] == ["mean of 2 seeds"]
    result = compare_json(capsys, out)
    (group,) = result["groups"]
    assert group["runs"] == ["seed=0", "seed=1"]
    summaries = [json.loads((out / n / "summary.json").read_text()) for n in group["runs"]]
    finals = [s["final"]["central"]["accuracy"] for s in summaries]
    row = next(r for r in result["metrics"] if r["metric"] == "central/accuracy")
    assert row["groups"][0]["final"]["mean"] == pytest.approx(np.mean(finals), rel=1e-12)
    sd = row["groups"][0]["final"]["sd"]
    assert sd == pytest.approx(np.std(finals, ddof=1), rel=1e-12) or (
        sd == 0 and finals[0] == finals[1]
    )
    epsilons = [s["privacy"]["epsilon"] for s in summaries]
    assert group["epsilon"]["mean"] == pytest.approx(np.mean(epsilons)) and math.isfinite(
        epsilons[0]
    )


def test_a_terminal_gets_the_group_tables_from_rich(tmp_path):
    out, points = make_sweep(tmp_path)
    console = Console(file=io.StringIO(), width=400, color_system=None)
    render_rich(compare_groups(load_runs([out / p.name for p in points])), console)
    text = console.file.getvalue()
    for title in ("seed groups", "mean ± sample sd (ddof=1)", "95 % t-interval of the mean"):
        assert title in text
    finals = [central(out / p.name, "loss")[1][-1] for p in points[3:]]
    assert f"{np.mean(finals):.4g} ± {np.std(finals, ddof=1):.2g}" in text
