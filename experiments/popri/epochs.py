"""Per-epoch reports of the POPri study's downstream fine-tunes, from the stored stages.

Every row of :mod:`experiments.popri.run` that fine-tunes the public model on texts (the
non-private row, the base generator, POPri and PE at each epsilon) trains for a fixed
schedule and is evaluated after its last epoch. The paper instead reports the best epoch on
the evaluation texts. A stage made before :meth:`~experiments.popri.run.Context.finetune`
recorded its ``epochs`` holds everything needed to rerun only its fine-tune: its texts (the
private training texts, ``cache/first_round.json``, a POPri/PE stage's ``synthetic``) and its
seed. This reruns each such fine-tune with every epoch evaluated on the validation texts
(the held-out private texts that are not evaluation texts, as
:mod:`experiments.popri.tuned_dp_fedavg` uses) and on the evaluation texts, and checks that
its last epoch gives the stored accuracy exactly (``reproduced``). Three reports, each named:

* ``fixed schedule``: the last epoch (the study's tables);
* ``best epoch (validation)``: the epoch with the best validation accuracy;
* ``best epoch (paper)``: the best epoch on the evaluation texts themselves (optimistic: it
  selects on the texts it reports).

The gap closed of a report uses the non-private row under the same report and the fully
private model (no fine-tune, so one value for every report).

    python experiments/popri/epochs.py experiments/popri/configs/cpu.toml [--seed S]
    python experiments/popri/epochs.py experiments/popri/configs/cpu.toml --table-only \\
        --replicates experiments/popri/runs/cpu-seed1

Curves are stored in ``OUT/epochs/<stage>.json`` (``OUT`` as :mod:`experiments.popri.run`'s)
and skipped once stored; a stage that already holds ``epochs`` is read as it is;
``OUT/epochs/results.json`` and ``OUT/epochs/table.md`` are rebuilt from them.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parents[1]))

from experiments.popri.run import (  # noqa: E402
    Context,
    _jsonable,
    config_and_out,
    eps_key,
    gap_closed,
    initial_population,
    train_public,
)
from fedsim.config import ConfigError  # noqa: E402

REPORTS = ("fixed schedule", "best epoch (validation)", "best epoch (paper)")
#: fine-tune purposes (the seed offsets of :mod:`experiments.popri.run`'s stages)
PURPOSES = {"nonprivate": 3, "base": 4, "popri": 10, "pe": 20}
NAMES = {
    "nonprivate": "non-private",
    "base": "base generator",
    "popri": "POPri",
    "pe": "Private Evolution",
}


def downstream_stages(config) -> list[str]:
    """The stages that fine-tune the public model on texts, in table order."""
    names = ["nonprivate", "base"]
    for method in ("popri", "pe"):
        names += [f"{method}-eps{eps_key(e)}" for e in config.epsilons]
    return names


def stage_texts(ctx: Context, name: str, stage: dict[str, Any]) -> list[str]:
    """The texts stage ``name`` fine-tuned on, from the stage itself or what it was made of."""
    if name == "nonprivate":
        d = ctx.config.downstream
        return ctx.subset(ctx.federation.all_train(), d.private_train_texts, 3)
    if name == "base":
        return initial_population(ctx)
    if "synthetic" not in stage:
        raise KeyError(f"stage {name} holds no 'synthetic' texts: its fine-tune cannot be rerun")
    return list(stage["synthetic"])


def curve(ctx: Context, name: str, stage: dict[str, Any]) -> dict[str, Any]:
    """Stage ``name``'s fine-tune with every epoch evaluated: the stage's own ``epochs`` if
    it holds them, else its fine-tune rerun from its texts (``reproduced``: the last epoch
    gives the stored accuracy exactly)."""
    if "epochs" in stage:
        return {
            "stage": name,
            "stored_accuracy": stage["accuracy"],
            "reproduced": True,
            "rerun": False,
            "epochs": stage["epochs"],
        }
    start = time.perf_counter()
    purpose = PURPOSES[name.partition("-eps")[0]]
    result = ctx.finetune(stage_texts(ctx, name, stage), purpose)
    same = result["accuracy"] == stage["accuracy"] and result["correct"] == stage["correct"]
    return {
        "stage": name,
        "stored_accuracy": stage["accuracy"],
        "accuracy": result["accuracy"],
        "reproduced": bool(same and result["train_steps"] == stage["train_steps"]),
        "rerun": True,
        "epochs": result["epochs"],
        "seconds": time.perf_counter() - start,
    }


def public_check(ctx: Context, stored: dict[str, Any]) -> dict[str, Any]:
    """Retrain the public model from the seed (the fine-tunes start from it) and compare its
    accuracy with the stored ``public`` stage's."""
    evaluation, _, _ = train_public(ctx)
    return {
        "stage": "public",
        "stored_accuracy": stored["accuracy"],
        "accuracy": evaluation.accuracy,
        "reproduced": evaluation.accuracy == stored["accuracy"],
    }


def recompute(ctx: Context) -> None:
    """Write OUT/epochs/<stage>.json for every downstream stage stored in OUT/stages."""
    stages_dir, out = ctx.out / "stages", ctx.out / "epochs"
    out.mkdir(parents=True, exist_ok=True)
    public = json.loads((stages_dir / "public.json").read_text())
    if not (ctx.out / "cache" / "public_lm.npz").exists() or not (out / "public.json").exists():
        _write(out / "public.json", public_check(ctx, public))
    for name in downstream_stages(ctx.config):
        path, source = out / f"{name}.json", stages_dir / f"{name}.json"
        if path.exists() or not source.exists():
            continue
        found = curve(ctx, name, json.loads(source.read_text()))
        _write(path, found)
        print(
            f"{name}: last epoch {found['epochs'][-1]['accuracy']['test']:.4f}, "
            f"stored {found['stored_accuracy']:.4f}, reproduced {found['reproduced']}",
            flush=True,
        )


def _write(path: Path, data: dict[str, Any]) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(data, indent=1, default=float))
    tmp.replace(path)


def reports(epochs: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """The three named reports of one fine-tune's ``epochs``: the chosen epoch, its
    validation and evaluation accuracy (ties: the earlier epoch)."""

    def pick(rows, key):
        row = max(rows, key=lambda r: (key(r), -r["epoch"]))
        return {"epoch": row["epoch"], "steps": row["steps"], **row["accuracy"]}

    return {
        REPORTS[0]: pick(epochs[-1:], lambda r: 0),
        REPORTS[1]: pick(epochs, lambda r: r["accuracy"]["validation"]),
        REPORTS[2]: pick(epochs, lambda r: r["accuracy"]["test"]),
    }


def build_results(config, out: Path) -> dict[str, Any]:
    """OUT/epochs/results.json: each stage's reports with the gap closed, from OUT/epochs."""
    folder = out / "epochs"
    private = json.loads((out / "stages" / "public.json").read_text())["accuracy"]
    found = {
        name: json.loads((folder / f"{name}.json").read_text())
        for name in downstream_stages(config)
        if (folder / f"{name}.json").exists()
    }
    if "nonprivate" not in found:
        raise FileNotFoundError(f"{folder}/nonprivate.json: needed for the gap closed")
    chosen = {name: reports(c["epochs"]) for name, c in found.items()}
    for picks in chosen.values():
        for report, c in picks.items():
            top = chosen["nonprivate"][report]["test"]
            c["gap_closed"] = gap_closed(c["test"], private, top)
    results = {
        "fully_private_accuracy": private,
        "reproduced": {name: c["reproduced"] for name, c in found.items()},
        "stages": chosen,
    }
    _write(folder / "results.json", results)
    return results


def table(config, outs: list[Path]) -> str:
    """Every row and report over the replicates ``outs`` (their epochs/results.json):
    evaluation accuracy, mean ± sample sd (ddof = 1), and the gap closed per replicate then
    averaged; written to ``outs[0]/epochs/table.md``."""
    results = [build_results(config, o) for o in outs]
    cols = [eps_key(e) for e in config.epsilons]
    lines = ["| method | report | " + " | ".join(f"ε = {c}" for c in cols) + " |"]
    lines.append("|---" * (len(cols) + 2) + "|")
    for method in ("nonprivate", "base", "popri", "pe"):
        for report in REPORTS:
            cells = [
                _cell(
                    results,
                    method if method in ("nonprivate", "base") else f"{method}-eps{c}",
                    report,
                    gap=method != "nonprivate",
                )
                for c in cols
            ]
            lines.append(f"| {NAMES[method]} | {report} | " + " | ".join(cells) + " |")
    text = "\n".join(lines)
    (outs[0] / "epochs" / "table.md").write_text(
        f"Downstream fine-tunes over {len(outs)} replicates ({', '.join(o.name for o in outs)}): "
        "evaluation accuracy (%), mean ± sample sd (ddof = 1), in brackets the mean gap "
        "closed.\n\n" + text + "\n"
    )
    return text


def _cell(results: list[dict[str, Any]], stage: str, report: str, gap: bool) -> str:
    picks = [r["stages"][stage][report] for r in results if stage in r["stages"]]
    if not picks:
        return "–"
    accs = [100 * p["test"] for p in picks]
    sd = statistics.stdev(accs) if len(accs) > 1 else math.nan
    text = f"{statistics.mean(accs):.2f} ± {sd:.2f}"
    if gap:
        text += f" ({100 * statistics.mean(p['gap_closed'] for p in picks):+.0f}%)"
    return text


def main(argv: list[str] | None = None) -> str:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("config", type=Path)
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--seed", type=int, default=None, help="override the config's seed")
    parser.add_argument("--table-only", action="store_true")
    parser.add_argument(
        "--replicates", type=Path, nargs="*", default=[], help="further result folders"
    )
    args = parser.parse_args(argv)
    config, out = config_and_out(args)
    stamp = out / "config.json"
    if stamp.read_text() != json.dumps(_jsonable(asdict(config)), sort_keys=True):
        raise ConfigError("--out", str(out), "a folder whose stages were made with this config")
    if not args.table_only:
        recompute(Context(config, out))  # no point runs: no secrets are drawn
    text = table(config, [out, *args.replicates])
    print(text)
    return text


if __name__ == "__main__":
    main()
