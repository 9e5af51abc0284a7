"""Tables of the DMM study, from the results :mod:`experiments.dmm.run` stored.

For every setting directory under ``--results`` (default experiments/dmm/results; one per
source, population and rounds) it reads ``setup.json``, the runs (``{method}_eps{e}_seed{s}.json``)
and the mode checks (``check_*.json``) and builds:

* test accuracy, mean ± sample standard deviation (ddof = 1) over seeds, per method and epsilon;
* paired differences per epsilon (:data:`DIFFERENCES`: DMM − central BandMF, DMM − DDGauss,
  DDGauss − DP-FedAvg, BandMF − DP-FedAvg, and the tree's pair): the seeds pair the runs (the
  same cohorts and initial model, each its own noise), d_s = acc_a(s) − acc_b(s), reported as
  mean(d) with its 95 % interval mean(d) ± t_{0.975, n−1} · sd(d) / sqrt(n) (sd with ddof = 1);
* the full mode's cost per round (wall seconds, bytes per client, bytes per committee member
  sent and received, bytes per member of the next committee received, total protocol bytes),
  mean over the DMM runs;
* the findings: per pair, the epsilons at which the interval puts ``a`` ahead of, level with
  or behind ``b`` (:func:`findings`);
* the mode checks: DMM full against ideal, DDGauss plaintext against full, each a replay of
  its point (root and nonce).

It writes all of it to ``tables.md`` next to this script and into ``README.md`` here, and the
differences and costs of every source into the repository's docs/methods.md (the DMM
section), each between its markers (``--no-readme``: tables.md only).

    python experiments/dmm/table.py [--results DIR] [--out FILE] [--no-readme]
"""

from __future__ import annotations

import argparse
import json
import math
import re
import statistics
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parents[1]))

from experiments.paired import interval, verdict  # noqa: E402

METHODS = (
    "non-private",
    "dp-fedavg",
    "ddgauss",
    "central-tree",
    "central-bandmf",
    "dmm-tree",
    "dmm-banded",
)
DIFFERENCES = (
    ("dmm-banded", "central-bandmf"),
    ("dmm-banded", "ddgauss"),
    ("ddgauss", "dp-fedavg"),
    ("central-bandmf", "dp-fedavg"),
    ("dmm-tree", "central-tree"),
)
COSTS = (
    ("seconds", "s / round"),
    ("dmm-bytes-per-client", "B / client"),
    ("dmm-bytes-per-member-sent", "B sent / member"),
    ("dmm-bytes-per-member-received", "B received / member"),
    ("dmm-bytes-per-next-member-received", "B received / next member"),
    ("dmm-bytes", "protocol B / round"),
)
SOURCES = {"digits": "digits", "femnist-like": "FEMNIST-like"}
#: (file, begin marker, end marker) of the generated blocks.
STUDY_README = (HERE / "README.md", "<!-- dmm-tables:begin -->", "<!-- dmm-tables:end -->")
FINDINGS_README = (HERE / "README.md", "<!-- dmm-findings:begin -->", "<!-- dmm-findings:end -->")
METHODS_DOC = (
    HERE.parents[1] / "docs" / "methods.md",
    "<!-- dmm-study:begin -->",
    "<!-- dmm-study:end -->",
)
#: The tuning's choice of server learning rates, one per setting directory.
CHOICE_FILE = "lr_choice.json"
#: The study version whose settings the tables are made from (``{setting}-{VERSION}``).
VERSION = "v2"
#: Non-private training has converged when its mean curve (over seeds) moves by at most
#: PLATEAU_POINTS (accuracy, 1 point = 0.01) over the last PLATEAU_FRACTION of the rounds.
PLATEAU_FRACTION, PLATEAU_POINTS = 0.2, 0.01
SPREAD = (
    "paired by seed: mean difference of test accuracy [its 95 % interval, "
    "mean ± t₀.₉₇₅,ₙ₋₁ · sd/√n with sd the sample sd (ddof = 1) of the paired differences]"
)


def load(directory: Path) -> tuple[dict, list[dict], list[dict]]:
    """(setup, runs, checks) stored in one setting directory. Points stored before each point
    had its own root (no ``run_nonce``; checks without ``replay_of``) are left out, and counted
    in ``setup["stale"]``: :mod:`experiments.dmm.run` runs them again."""
    setup = json.loads((directory / "setup.json").read_text())
    runs, checks, stale = [], [], 0
    for path in sorted(directory.glob("*.json")):
        if path.name in ("setup.json", CHOICE_FILE):
            continue
        data = json.loads(path.read_text())
        check = path.name.startswith("check_")
        if ("replay_of" if check else "run_nonce") not in data:
            stale += 1
            continue
        (checks if check else runs).append(data)
    choice = directory / CHOICE_FILE
    if choice.is_file():
        setup["lr_choice"] = json.loads(choice.read_text())
    return {**setup, "stale": stale}, runs, checks


def choose_rates(tuning: list[dict]) -> list[dict]:
    """Per (method, epsilon): the server learning rate with the highest mean final
    *validation* accuracy over the tuning seeds (ties: the smaller rate). Test accuracy is
    never read. Every rate of a cell must have the same seeds, else ``ValueError``."""
    cells: dict[tuple, dict[float, dict[int, float]]] = {}
    for run in tuning:
        key = (run["method"], run["target_epsilon"])
        by_rate = cells.setdefault(key, {}).setdefault(run["server_learning_rate"], {})
        by_rate[run["seed"]] = run["validation_accuracy"]
    choices = []
    for (method, eps), rates in sorted(cells.items(), key=lambda kv: (kv[0][0], kv[0][1] or 0)):
        seeds = {lr: sorted(by_seed) for lr, by_seed in rates.items()}
        if len({tuple(v) for v in seeds.values()}) != 1:
            raise ValueError(f"tuning of ({method}, {eps}): rates have different seeds {seeds}")
        means = {lr: statistics.mean(by_seed.values()) for lr, by_seed in sorted(rates.items())}
        best = max(means, key=lambda lr: (means[lr], -lr))
        choices.append(
            {
                "method": method,
                "target_epsilon": eps,
                "server_learning_rate": best,
                "seeds": next(iter(seeds.values())),
                "validation_mean": {f"{lr:g}": m for lr, m in means.items()},
            }
        )
    return choices


def choice_of(stored: dict) -> dict[tuple, float]:
    """{(method, epsilon): server learning rate} of a stored choice (``lr_choice.json``)."""
    return {
        (c["method"], c["target_epsilon"]): c["server_learning_rate"] for c in stored["choices"]
    }


def mean_curve(runs: list[dict], key: str) -> list[float]:
    """Round by round, the mean of ``key`` (validation or test accuracy) over ``runs``."""
    curves = [[r[key] for r in run["rounds"]] for run in runs]
    if not curves or len({len(c) for c in curves}) != 1:
        raise ValueError(f"curves of {key!r}: need runs of equal length, got {len(curves)} runs")
    return [statistics.mean(values) for values in zip(*curves)]


def plateau(curve: list[float], fraction: float = PLATEAU_FRACTION) -> tuple[float, int]:
    """(max − min of ``curve`` over its last ceil(fraction · rounds) rounds, that window)."""
    if not curve or not 0 < fraction <= 1:
        raise ValueError(f"plateau of {len(curve)} rounds at fraction = {fraction}")
    window = math.ceil(fraction * len(curve) - 1e-9)
    tail = curve[-window:]
    return max(tail) - min(tail), window


def curve_table(runs: list[dict], every: int = 5) -> str:
    """Non-private FedAvg's mean validation and test accuracy every ``every`` rounds, and
    whether it plateaus (within PLATEAU_POINTS over the last PLATEAU_FRACTION of rounds)."""
    mine = [r for r in runs if r["method"] == "non-private" and "validation" in r["rounds"][0]]
    if not mine:
        return "(no non-private curve stored)"
    val, test = mean_curve(mine, "validation"), mean_curve(mine, "test")
    shown = sorted({*range(every - 1, len(test), every), len(test) - 1})
    lines = ["| round | " + " | ".join(str(i + 1) for i in shown) + " |"]
    lines.append("|---" * (len(shown) + 1) + "|")
    for name, curve in (("validation", val), ("test", test)):
        lines.append(f"| {name} | " + " | ".join(f"{curve[i]:.3f}" for i in shown) + " |")
    spread, window = plateau(test)
    verdict = "plateaus" if spread <= PLATEAU_POINTS + 1e-12 else "does NOT plateau"
    note = (
        f"Mean over {len(mine)} seeds. Test accuracy moves by {100 * spread:.2f} points over "
        f"the last {window} rounds: non-private FedAvg {verdict} (criterion: "
        f"≤ {100 * PLATEAU_POINTS:g} point over the last {100 * PLATEAU_FRACTION:g} % of rounds)."
    )
    return "\n".join(lines) + "\n\n" + note


def rates_table(choice: dict | None) -> str:
    """The chosen server learning rate per method and epsilon, with the validation means."""
    if not choice:
        return "(no learning-rate choice stored)"
    grid = choice["grid"]
    head = " | ".join(f"val. at lr {lr:g}" for lr in grid)
    lines = [f"| method | ε | chosen lr | {head} |", "|---" * (len(grid) + 3) + "|"]
    for c in choice["choices"]:
        eps = "-" if c["target_epsilon"] is None else f"{c['target_epsilon']:g}"
        means = [c["validation_mean"].get(f"{lr:g}") for lr in grid]
        cells = " | ".join("-" if m is None else f"{m:.3f}" for m in means)
        lines.append(f"| {c['method']} | {eps} | {c['server_learning_rate']:g} | {cells} |")
    seeds = ", ".join(str(s) for s in choice["seeds"])
    top, n = max(grid), len(choice["choices"])
    at_top = sum(c["server_learning_rate"] == top for c in choice["choices"])
    edge = f" {at_top} of {n} choices are the grid's largest rate ({top:g})."
    tail = f"Tuning seeds {seeds} (never reported); {choice['criterion']}{edge}"
    return "\n".join(lines) + "\n\n" + tail


def _accuracies(runs, method, eps) -> list[float]:
    return [
        r["accuracy"]
        for r in runs
        if r["method"] == method and (eps is None or r["target_epsilon"] == eps)
    ]


def _epsilons(runs: list[dict]) -> list[float]:
    return sorted({r["target_epsilon"] for r in runs if r["target_epsilon"] is not None})


def accuracy_table(runs: list[dict]) -> str:
    epsilons = _epsilons(runs)

    def cell(values):
        if not values:
            return "-"
        if len(values) == 1:
            return f"{values[0]:.3f} (n=1)"
        return f"{statistics.mean(values):.3f} ± {statistics.stdev(values):.3f} (n={len(values)})"

    lines = ["| method | " + " | ".join(f"ε = {e:g}" for e in epsilons) + " |"]
    lines.append("|---" * (len(epsilons) + 1) + "|")
    for method in METHODS:
        eps_of = (lambda e: None) if method == "non-private" else (lambda e: e)
        cells = [cell(_accuracies(runs, method, eps_of(e))) for e in epsilons]
        lines.append(f"| {method} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def paired(runs: list[dict], a: str, b: str, eps: float) -> list[float]:
    """acc_a(s) − acc_b(s) for every seed s stored for both methods at ``eps``."""
    by_seed = {m: {} for m in (a, b)}
    for r in runs:
        if r["method"] in by_seed and r["target_epsilon"] == eps:
            by_seed[r["method"]][r["seed"]] = r["accuracy"]
    return [by_seed[a][s] - by_seed[b][s] for s in sorted(by_seed[a].keys() & by_seed[b].keys())]


def difference(runs: list[dict], a: str, b: str, eps: float) -> str:
    """``a`` minus ``b`` at ``eps``, paired by seed: mean [95 % interval] (n pairs)."""
    differences = paired(runs, a, b, eps)
    if len(differences) < 2:
        return "-"
    mean, low, high = interval(differences)
    return f"{mean:+.3f} [{low:+.3f}, {high:+.3f}] (n={len(differences)})"


def findings(studies: list[tuple[dict, list[dict]]]) -> str:
    """One line per pair of :data:`DIFFERENCES`: per source, the epsilons at which ``a`` is
    ahead of, level with or behind ``b`` by the 95 % interval of the paired differences."""
    lines = []
    for a, b in DIFFERENCES:
        parts = []
        for setup, runs in studies:
            by_verdict: dict[str, list[str]] = {}
            for eps in _epsilons(runs):
                v = verdict(paired(runs, a, b, eps))
                if v is not None:
                    by_verdict.setdefault(v, []).append(f"{eps:g}")
            if by_verdict:
                said = "; ".join(
                    f"{v} at ε = {', '.join(e)}"
                    for v in ("ahead", "level", "behind")
                    if (e := by_verdict.get(v))
                )
                parts.append(f"{_source(setup)}: {said}")
        if parts:
            lines.append(f"- **{a} against {b}**: " + ". ".join(parts) + ".")
    return "\n".join(lines)


def difference_table(studies: list[tuple[dict, list[dict]]]) -> str:
    """One line per source and epsilon, one column per pair of :data:`DIFFERENCES`."""
    head = " | ".join(f"{a} − {b}" for a, b in DIFFERENCES)
    lines = [f"| source | ε | {head} |", "|---" * (len(DIFFERENCES) + 2) + "|"]
    for setup, runs in studies:
        for eps in _epsilons(runs):
            cells = [difference(runs, a, b, eps) for a, b in DIFFERENCES]
            lines.append(f"| {_source(setup)} | {eps:g} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


#: what the cost table says when no accuracy row ran in full mode (v2: the rows run ideal mode)
NO_FULL_RUNS = (
    "(no DMM accuracy row ran in full mode: the mode checks below give full mode's seconds)"
)


def cost_table(studies: list[tuple[dict, list[dict]]]) -> str:
    """Full mode's cost per round, mean over the DMM runs of each source and method (wall
    seconds also with the range of the runs' means)."""
    labels = " | ".join(label for _, label in COSTS)
    lines = [f"| source | method | runs | {labels} |", "|---" * (len(COSTS) + 3) + "|"]
    for setup, runs in studies:
        for method in ("dmm-banded", "dmm-tree"):
            mine = [r for r in runs if r["method"] == method and r.get("mode") == "full"]
            if not mine:
                continue
            cells = []
            for key, _ in COSTS:
                values = [r["cost_per_round"][key] for r in mine if key in r["cost_per_round"]]
                if not values:
                    cells.append("-")
                elif key == "seconds":
                    cells.append(
                        f"{statistics.mean(values):.1f} ({min(values):.1f}–{max(values):.1f})"
                    )
                else:
                    cells.append(f"{statistics.mean(values):,.0f}")
            lines.append(
                f"| {_source(setup)} | {method} | {len(mine)} | " + " | ".join(cells) + " |"
            )
    if len(lines) == 2:
        return NO_FULL_RUNS
    return "\n".join(lines)


def checks_table(checks: list[dict]) -> str:
    if not checks:
        return "(no mode checks stored)"
    lines = ["| method | ε | seed | modes | bit-identical | seconds |", "|---" * 6 + "|"]
    for c in checks:
        lines.append(
            f"| {c['method']} | {c['target_epsilon']:g} | {c['seed']} | "
            f"{' vs '.join(c['modes'])} | {c['identical']} | "
            f"{' / '.join(f'{x:.0f}' for x in c['seconds'])} |"
        )
    return "\n".join(lines)


def checks_sentence(studies_checks: list[tuple[dict, list[dict]]]) -> str:
    """How many sampled runs gave bit-identical models in both modes, per family."""
    parts = []
    for family, label in (("dmm", "DMM full vs ideal"), ("ddgauss", "DDGauss plaintext vs full")):
        mine = [c for _, cs in studies_checks for c in cs if c["method"].split("-")[0] == family]
        if mine:
            same = sum(bool(c["identical"]) for c in mine)
            parts.append(f"{label}: {same} of {len(mine)} sampled runs bit-identical")
    replays = " (each a replay of its point: root and nonce; final models compared by sha256)."
    return "; ".join(parts) + replays


def _source(setup: dict) -> str:
    return SOURCES.get(setup["source"], setup["source"])


def _hours(runs: list[dict], checks: list[dict]) -> float:
    seconds = sum(r["seconds"] for r in runs)
    return (seconds + sum(c["seconds"][1] for c in checks)) / 3600


def study_roots(setup: dict) -> list[str]:
    """The fingerprints of the study roots the stored points ran under (setup.json)."""
    if "study_roots" in setup:
        return list(setup["study_roots"])
    return [setup["secrets_fingerprint"]]


def point_roots(setup: dict, runs: list[dict]) -> list[str]:
    """The study roots the stored ``runs`` ran under, in order of first use."""
    first = study_roots(setup)[0]
    return list(dict.fromkeys(run.get("study_root", first) for run in runs))


def source_section(setup: dict, runs: list[dict], checks: list[dict]) -> str:
    title = (
        f"### {_source(setup)}: {setup['clients']} clients, {setup['per_round']} per round, "
        f"{setup['rounds']} rounds, {setup['min_separation']}-min-separation"
    )
    if "local" in setup:
        local = setup["local"]
        title += (
            f"; {setup['model']}, {local['epochs']} local epoch(s) of SGD "
            f"(batch {local['batch_size']}, lr {local['lr']:g})"
        )
    note = (
        f"{len(runs)} stored runs and {len(checks)} mode checks, "
        f"{_hours(runs, checks):.2f} h of wall time in all; study root fingerprint "
        f"{', '.join(f'`{r}`' for r in point_roots(setup, runs))}, each point with its own nonce."
    )
    if setup.get("stale"):
        note += (
            f" {setup['stale']} files stored before each point had its own root are left out"
            " until the study runs them again."
        )
    ideal = setup.get("modes", {}).get("dmm") == "ideal"
    modes = (
        "the accuracy rows report DMM's ideal mode, the checks replay it in full mode"
        if ideal
        else "the accuracy rows report DMM's full mode, the checks replay it in ideal mode"
    )
    return "\n\n".join(
        [
            title,
            note,
            *([schedule_section(setup, runs)] if "lr_choice" in setup or ideal else []),
            "Test accuracy (mean ± sample std over seeds, ddof = 1):",
            accuracy_table(runs),
            f"Differences ({SPREAD}):",
            difference_table([(setup, runs)]),
            "DMM full-mode cost per round (committee actors; wall seconds mean and range):",
            cost_table([(setup, runs)]),
            "Mode checks (the same point replayed in the other mode: its root and nonce; "
            f"{modes}):",
            checks_table(checks),
        ]
    )


def schedule_section(setup: dict, runs: list[dict]) -> str:
    """Non-private FedAvg's convergence curve and the chosen server learning rates."""
    return "\n\n".join(
        [
            f"Non-private FedAvg on {_source(setup)}, mean accuracy by round "
            f"(validation: half the test rows, never reported; test: the other half):",
            curve_table(runs),
            "Server learning rates, chosen per method and ε on validation "
            "(mean final validation accuracy of the tuning seeds):",
            rates_table(setup.get("lr_choice")),
        ]
    )


def summary(studies: list[tuple[dict, list[dict], list[dict]]]) -> str:
    """The block of docs/methods.md: differences and costs of every source."""
    pairs = [(s, r) for s, r, _ in studies]
    return "\n\n".join(
        [
            "Where the 95 % intervals of the paired differences put each method against the other:",
            findings(pairs),
            f"Differences ({SPREAD}):",
            difference_table(pairs),
            "Full-mode cost per round (wall seconds: mean and range over the runs):",
            cost_table(pairs),
            checks_sentence([(s, c) for s, _, c in studies]),
        ]
    )


def write_between(target: tuple[Path, str, str], text: str) -> None:
    path, begin, end = target
    content = path.read_text()
    head, found, rest = content.partition(begin)
    if not found or end not in rest:
        raise SystemExit(f"{path}: markers {begin} ... {end} not found")
    _, _, tail = rest.partition(end)
    path.write_text(f"{head}{begin}\n{text}\n{end}{tail}")


def stored_settings(results: Path, version: str | None) -> list[Path]:
    """The setting directories of ``version`` under ``results`` (``{setting}-{version}``;
    v1: no suffix); None: :data:`VERSION`'s, or v1's while none of those is stored."""

    def of(v: str) -> list[Path]:
        return sorted(
            p
            for p in results.iterdir()
            if (p / "setup.json").is_file()
            and (p.name.endswith(f"-{v}") if v != "v1" else not re.search(r"-v\d+$", p.name))
        )

    settings = of(version or VERSION) or ([] if version else of("v1"))
    if not settings:
        raise SystemExit(
            f"--results {results}: no stored study (setup.json) of version {version or VERSION}"
        )
    return settings


def main(argv: list[str] | None = None) -> str:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--results", type=Path, default=HERE / "results")
    parser.add_argument("--out", type=Path, default=HERE / "tables.md")
    parser.add_argument("--no-readme", action="store_true", help="write tables.md only")
    parser.add_argument(
        "--version",
        help=f"the study version to tabulate (default: {VERSION} where stored, else v1: "
        "the setting directories without a version suffix)",
    )
    args = parser.parse_args(argv)
    settings = stored_settings(args.results, args.version)
    studies = [load(p) for p in settings]
    sections = "\n\n".join(source_section(*study) for study in studies)
    text = "# DMM study tables (generated by experiments/dmm/table.py)\n\n" + sections + "\n"
    args.out.write_text(text)
    if not args.no_readme:
        write_between(STUDY_README, sections)
        write_between(FINDINGS_README, findings([(s, r) for s, r, _ in studies]))
        write_between(METHODS_DOC, summary(studies))
    print(text)
    return text


if __name__ == "__main__":
    main()
