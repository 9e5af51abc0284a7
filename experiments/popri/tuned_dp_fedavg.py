"""DP-FedAvg for the POPri study, tuned on validation texts under POPri's privacy relation.

The study's DP-FedAvg row (:func:`experiments.popri.run.stage_dp_fedavg`) samples fixed-size
cohorts (replace-one) at one untuned server learning rate. Here DP-FedAvg runs as POPri and PE
are accounted: **Poisson sampling** of each client with probability q = k / N, cohorts the
server's secret draw, the **add/remove** relation and the same δ; a grid of **server learning
rates** (FedAvgM without momentum, x ← x − η·(x − mean); η = 0 in the grid returns the fully
private model) and **clipping norms**, every point under its own root and nonce
(:func:`experiments.popri.run.run_stage`). Every round's global model is evaluated on the
*validation* texts (the held-out private texts not in the evaluation set) and on the
evaluation texts, so one grid gives three reports, each named (:func:`selections`):

* ``fixed schedule``: η and C chosen on the last round's validation accuracy; its last round;
* ``best round (validation)``: η, C and the round chosen on validation accuracy;
* ``best epoch (paper)``: the best round on the evaluation texts themselves, as the paper
  reports its rows (optimistic: it selects on the texts it reports).

Each point's ε is that run's (RDP, Poisson, add/remove); choosing among the grid's points on
private validation texts is not accounted, here as in the paper.

    python experiments/popri/tuned_dp_fedavg.py experiments/popri/configs/cpu.toml [--seed S]
    python experiments/popri/tuned_dp_fedavg.py experiments/popri/configs/cpu.toml --table-only

Points are stored in ``OUT/tuned/<point>.json`` (``OUT`` as :mod:`experiments.popri.run`'s,
``runs/<config name>[-seed<S>]``) and skipped once stored; ``OUT/tuned/table.md`` and
``OUT/tuned/results.json`` are rebuilt from them; ``--replicates DIR...`` also averages over
other seeds' folders (``OUT/tuned/table_replicates.md``).
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parents[1]))

from experiments.popri.run import (  # noqa: E402
    STUDY,
    TUNED_DP_FEDAVG,
    Context,
    config_and_out,
    dp_fedavg_point,
    eps_key,
    gap_closed,
    run_stages,
)

LEARNING_RATES = (0.0, 0.01, 0.1, 1.0)
CLIPPING_NORMS = (0.1, 0.5)
REPORTS = ("fixed schedule", "best round (validation)", "best epoch (paper)")


def point_name(epsilon: float, lr: float, clip: float) -> str:
    return f"{TUNED_DP_FEDAVG}-eps{eps_key(epsilon)}-lr{lr:g}-clip{clip:g}"


def validation_sequences(ctx: Context) -> list:
    """The held-out private texts that are not evaluation texts (``ctx.validation_sequences``)."""
    return ctx.validation_sequences


def stage_tuned(ctx: Context, epsilon: float, lr: float, clip: float) -> dict[str, Any]:
    """One grid point: Poisson(q = k / N) cohorts, add/remove, FedAvgM at ``lr``, clip."""
    from flwr.serverapp.strategy import FedAvgM  # noqa: PLC0415

    from fedsim.engine import PoissonCohort  # noqa: PLC0415
    from fedsim.privacy.sampling import PoissonSampling  # noqa: PLC0415

    n = ctx.federation.num_clients
    rate = min(ctx.config.dp_fedavg.clients_per_round, n) / n
    inner = FedAvgM(
        fraction_train=1.0,
        fraction_evaluate=0.0,
        min_available_nodes=0,
        min_train_nodes=1,
        server_learning_rate=lr,
        server_momentum=0.0,
    )
    result = dp_fedavg_point(
        ctx,
        epsilon,
        inner,
        PoissonSampling(rate),
        PoissonCohort(n, rate, ctx.config.seed),  # drawn from the server's secret
        expected_clients=rate * n,
        clipping_norm=clip,
        evaluate_on={"validation": validation_sequences(ctx), "test": ctx.eval_sequences},
    )
    return {**result, "target_epsilon": epsilon, "server_learning_rate": lr, "sampling_rate": rate}


def grid_stages(config, learning_rates, clipping_norms) -> list[tuple[str, Any]]:
    return [
        (point_name(e, lr, c), lambda ctx, e=e, lr=lr, c=c: stage_tuned(ctx, e, lr, c))
        for e in config.epsilons
        for lr in learning_rates
        for c in clipping_norms
    ]


def selections(points: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """The three named reports of one epsilon's grid ``points``: for each, the chosen point's
    (learning rate, clip, round) and its evaluation accuracy."""

    def pick(key, rounds_of):
        best = max(
            ((key(p, r), p, r) for p in points for r in rounds_of(p)),
            key=lambda t: (t[0], -t[1]["server_learning_rate"], -t[1]["clipping_norm"]),
        )
        _, p, r = best
        return {
            "server_learning_rate": p["server_learning_rate"],
            "clipping_norm": p["clipping_norm"],
            "round": r["round"],
            "validation": r["accuracy"]["validation"],
            "accuracy": r["accuracy"]["test"],
            "epsilon_spent": p["epsilon_spent"],
        }

    def last(p):
        return p["rounds"][-1:]

    def every(p):
        return p["rounds"]

    return {
        REPORTS[0]: pick(lambda p, r: r["accuracy"]["validation"], last),
        REPORTS[1]: pick(lambda p, r: r["accuracy"]["validation"], every),
        REPORTS[2]: pick(lambda p, r: r["accuracy"]["test"], every),
    }


def build_table(config, out: Path) -> str:
    """The tuned rows from OUT/tuned/*.json, with the gap closed against OUT/stages' public
    and non-private rows; writes OUT/tuned/table.md and OUT/tuned/results.json."""
    tuned = out / "tuned"
    points = [json.loads(p.read_text()) for p in sorted(tuned.glob(f"{TUNED_DP_FEDAVG}-*.json"))]
    private = json.loads((out / "stages" / "public.json").read_text())["accuracy"]
    nonprivate = out / "stages" / "nonprivate.json"
    top = json.loads(nonprivate.read_text())["accuracy"] if nonprivate.is_file() else math.nan
    results: dict[str, Any] = {"fully_private_accuracy": private, "nonprivate_accuracy": top}
    lines = ["| report | ε | η | C | round | validation (%) | accuracy (%) | gap closed |"]
    lines.append("|---" * 8 + "|")
    for e in config.epsilons:
        mine = [p for p in points if p["target_epsilon"] == e]
        if not mine:
            continue
        chosen = selections(mine)
        results[eps_key(e)] = {"points": len(mine), **chosen}
        for report, c in chosen.items():
            gap = 100 * gap_closed(c["accuracy"], private, top)
            lines.append(
                f"| {report} | {eps_key(e)} | {c['server_learning_rate']:g} | "
                f"{c['clipping_norm']:g} | {c['round']} | {100 * c['validation']:.2f} | "
                f"{100 * c['accuracy']:.2f} | {gap:+.0f}% |"
            )
    table = "\n".join(lines)
    (tuned / "results.json").write_text(json.dumps(results, indent=1, default=float))
    (tuned / "table.md").write_text(
        "DP-FedAvg tuned on validation (Poisson sampling, add/remove), next-token top-1 "
        "accuracy on the evaluation texts.\n\n" + table + "\n"
    )
    return table


def combined_table(config, outs: list[Path]) -> str:
    """Each report's evaluation accuracy over the replicates ``outs`` (their
    tuned/results.json): mean ± sample sd (ddof = 1), the gap closed per replicate then
    averaged, and the (η, C, round) each replicate chose; written to
    ``outs[0]/tuned/table_replicates.md``."""
    results = [json.loads((o / "tuned" / "results.json").read_text()) for o in outs]
    lines = ["| report | ε | accuracy (%) | gap closed | η, C, round per replicate |"]
    lines.append("|---" * 5 + "|")
    for e in config.epsilons:
        key = eps_key(e)
        if not all(key in r for r in results):
            continue
        for report in REPORTS:
            chosen = [r[key][report] for r in results]
            accs = [100 * c["accuracy"] for c in chosen]
            gaps = [
                gap_closed(c["accuracy"], r["fully_private_accuracy"], r["nonprivate_accuracy"])
                for c, r in zip(chosen, results, strict=True)
            ]
            sd = statistics.stdev(accs) if len(accs) > 1 else math.nan
            picks = "; ".join(
                f"{c['server_learning_rate']:g}, {c['clipping_norm']:g}, {c['round']}"
                for c in chosen
            )
            lines.append(
                f"| {report} | {key} | {statistics.mean(accs):.2f} ± {sd:.2f} | "
                f"{100 * statistics.mean(gaps):+.0f}% | {picks} |"
            )
    table = "\n".join(lines)
    (outs[0] / "tuned" / "table_replicates.md").write_text(
        f"Tuned DP-FedAvg over {len(outs)} replicates ({', '.join(o.name for o in outs)}): "
        "evaluation accuracy, mean ± sample sd (ddof = 1).\n\n" + table + "\n"
    )
    return table


def main(argv: list[str] | None = None) -> str:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("config", type=Path)
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--seed", type=int, default=None, help="override the config's seed")
    parser.add_argument("--secrets", type=Path, help="study root (default ~/.fedsim/popri.key)")
    parser.add_argument("--learning-rates", type=float, nargs="+", default=LEARNING_RATES)
    parser.add_argument("--clipping-norms", type=float, nargs="+", default=CLIPPING_NORMS)
    parser.add_argument("--table-only", action="store_true")
    parser.add_argument(
        "--replicates", type=Path, nargs="*", default=[], help="further result folders to average"
    )
    args = parser.parse_args(argv)
    config, out = config_and_out(args)
    if not args.table_only:
        from experiments.roots import default_key, study_root  # noqa: PLC0415

        ctx = Context(config, out, study_root(args.secrets or default_key(STUDY), out))
        stages = grid_stages(config, args.learning_rates, args.clipping_norms)
        try:
            run_stages(ctx, (), stages=stages, stage_dir=out / "tuned")
        finally:
            if "engine" in ctx._cache:
                ctx._cache["engine"].close()
    table = build_table(config, out)
    print(table)
    if args.replicates:
        table = combined_table(config, [out, *args.replicates])
        print("\n" + table)
    return table


if __name__ == "__main__":
    main()
