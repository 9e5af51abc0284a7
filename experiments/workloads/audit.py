"""Privacy audits: membership inference against DP-FedAvg at several epsilons, PII canaries
(minority vs random) in a federated byte-level LM, unlearning, and dataset inference.

Part ``dp`` (``fedsim run`` + ``fedsim audit`` in Python): scikit-learn digits split IID over
100 clients with 80 % of each client's rows held out (about 4 training rows per client, 397
in all, so the non-private model overfits), an MLP with 32 hidden units, DP-FedAvg with all
clients every round for 30 rounds, 10 local epochs (batch 8, lr 0.1), clipping norm 3, noise
multiplier calibrated (RDP, the run's own sampling model and relation, delta 1e-5) to epsilon
1, 4, 16, and 0 for epsilon = inf (clipping only). The loss and zlib attacks score the 397
member rows against 397 of the held-out rows (``fedsim.audits.run_audit``).

Part ``canary``: the byte-level GPT-2 of ``fedsim.audits.lm`` (1 layer, width 32),
FedAvg over 2 clients (4 rounds x 40 local AdamW steps, batch 16, lr 5e-3) on 30 synthetic PII
records per client, plus 20 minority canaries (rarest name origin, email, phone and ID
formats) and 20 random canaries (drawn like the population), each repeated 3 times in client
0 or 1. Non-members: 20 fresh canaries of each kind. The control trains the same federation
without canaries (the "retrained" model). Unlearning: gradient ascent, ascent+descent and
random labels (the last two with the base records as retain set) on all 40 inserted
canaries, AdamW at lr 1e-4 until the forget set's NLL reaches the trained model's NLL on 40
other unseen canaries (at most 200 steps); then the canaries' AUC is measured again.
Dataset inference: the 40 inserted canaries (members) and the 40 non-member canaries as
suspect sets, digit-perturbed synthetic held-out copies, 5 splits.

Secrets (part ``dp``): the study root in ``--secrets`` (default ``~/.fedsim/audit.key``, kept
outside the results) gives each seed its own root (:mod:`experiments.roots`), and every run
(epsilon, seed) mixes its own fresh public nonce into it
(:func:`fedsim.frontend.experiment.run_experiment`, :mod:`fedsim.frontend.run_root`), from which the
engine gives the clients their secrets and the server its noise: no two runs share a stream, and
each invocation draws new noise. ``audit.json`` records the root's fingerprint and each run's nonce
(``run_nonce``).

Usage: ``python experiments/workloads/audit.py [--part dp|canary|all] [--seeds 0 1 2]
[--secrets FILE] [--table-only]``; writes ``audit.json`` next to this file (parts merge into
it), prints the tables (mean ± sample std, ddof = 1, over the seeds) and puts the ``dp`` table
into README.md between its markers (``--table-only``: from the stored ``audit.json``, running
nothing).
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from experiments.roots import default_key, seed_root, study_root  # noqa: E402
from fedsim.audits import canaries, lm, mia  # noqa: E402
from fedsim.audits import dataset_inference as di  # noqa: E402
from fedsim.audits.run_audit import audit_run  # noqa: E402
from fedsim.audits.unlearn import unlearn  # noqa: E402
from fedsim.frontend.experiment import (  # noqa: E402
    load_finished_run,
    participation_for,
    run_experiment,
)
from fedsim.frontend.run_config import ExperimentConfig  # noqa: E402
from fedsim.frontend.run_root import RUN_FILE  # noqa: E402
from fedsim.privacy import accounting  # noqa: E402
from fedsim.privacy.sampling import relation_for  # noqa: E402
from fedsim.randomness import PartySecret  # noqa: E402

OUT = Path(__file__).with_name("audit.json")
README = Path(__file__).with_name("README.md")
BEGIN, END = "<!-- audit-dp:begin -->", "<!-- audit-dp:end -->"
STUDY = "audit"  # its roots: experiments/roots.py
EPSILONS = (math.inf, 16.0, 4.0, 1.0)  # run order: the non-private model first
CLIENTS, ROUNDS, CLIP, DELTA = 100, 30, 3.0, 1e-5


def dp_config(seed: int, noise_multiplier: float) -> ExperimentConfig:
    return ExperimentConfig.from_dict(
        {
            "name": f"audit-dp-z{noise_multiplier:.4g}-s{seed}",
            "seed": seed,
            "rounds": ROUNDS,
            "data": {
                "source": "digits",
                "partition": "iid",
                "num_clients": CLIENTS,
                "test_fraction": 0.8,
            },
            "model": {"kind": "mlp", "hidden": [32]},
            "client": {"epochs": 10, "batch_size": 8, "lr": 0.1},
            "strategy": {
                "name": "dp-fedavg",
                "clients_per_round": CLIENTS,
                "options": {
                    "clipping_norm": CLIP,
                    "noise_multiplier": noise_multiplier,
                    "delta": DELTA,
                },
            },
            "evaluation": {"every": ROUNDS},
            "engine": {"backend": "local"},
        }
    )


def noise_for(epsilon: float) -> float:
    """The noise multiplier that reaches ``epsilon`` after ROUNDS rounds of this setting."""
    if math.isinf(epsilon):
        return 0.0
    config = dp_config(0, 1.0)
    # the accounting of the cohorts, not a draw: any server secret gives the same model
    sampling = participation_for(config, CLIENTS, PartySecret.fresh("server")).accounting(ROUNDS)
    return accounting.calibrate_noise(
        epsilon, DELTA, sampling, ROUNDS, "rdp", relation_for(sampling)
    )


def dp_part(seeds: list[int], root) -> list[dict]:
    rows = []
    for epsilon in EPSILONS:
        z = noise_for(epsilon)
        for seed in seeds:
            started = time.perf_counter()
            with tempfile.TemporaryDirectory() as tmp:
                run_dir = Path(tmp) / "run"
                secrets = seed_root(root, STUDY, seed)
                summary = run_experiment(
                    dp_config(seed, z), run_dir, progress=False, secrets=secrets
                )
                finished = load_finished_run(run_dir, secrets)
                audits = {a: audit_run(finished, attack=a) for a in ("loss", "zlib")}
                nonce = json.loads((run_dir / RUN_FILE).read_text())["nonce"]
            row = {
                "target_epsilon": "inf" if math.isinf(epsilon) else epsilon,
                "noise_multiplier": z,
                "seed": seed,
                "epsilon": audits["loss"]["epsilon_text"],
                "accuracy": summary["final"]["central"]["accuracy"],
                "member_loss": audits["loss"]["member_mean_loss"],
                "non_member_loss": audits["loss"]["non_member_mean_loss"],
                "members": audits["loss"]["members"],
                **{f"{a}_auc": audits[a]["auc"] for a in audits},
                **{f"{a}_tpr_at_5pct_fpr": audits[a]["tpr_at_5pct_fpr"] for a in audits},
                "secrets_fingerprint": root.fingerprint(),
                "run_nonce": nonce,
                "seconds": time.perf_counter() - started,
            }
            print(json.dumps(row), flush=True)
            rows.append(row)
    return rows


def _aucs(model, members, non) -> dict[str, dict[str, float]]:
    lp_in, lp_out = lm.token_log_probs(model, members), lm.token_log_probs(model, non)
    out = {}
    for attack in mia.ATTACKS:
        s_in = mia.sequence_scores(attack, lp_in, members)
        s_out = mia.sequence_scores(attack, lp_out, non)
        out[attack] = {"auc": mia.roc_auc(s_in, s_out), "tpr": mia.tpr_at_fpr(s_in, s_out)}
    return out


def canary_part(seeds: list[int]) -> list[dict]:
    rows = []
    config = lm.TinyLMConfig(width=32, heads=4, max_len=128)
    train = {"rounds": 4, "local_steps": 40, "batch_size": 16, "lr": 5e-3}
    for seed in seeds:
        started = time.perf_counter()
        rng = np.random.default_rng(seed)
        corpus = canaries.base_corpus(2, 30, rng)
        minority = [r.text() for r in canaries.minority_records(60, rng)]
        random_ = [r.text() for r in canaries.sample_records(60, rng)]
        sets = {
            "minority": (minority[:20], minority[20:40]),
            "random": (random_[:20], random_[20:40]),
        }
        unlearn_steps: dict[str, int] = {}
        forget = minority[:20] + random_[:20]
        inserted = canaries.insert_canaries(corpus, forget, [0, 1], 3, rng)
        models = {}
        for name, texts in (("with canaries", inserted), ("retrained without", corpus)):
            models[name] = lm.build_lm(config, seed=seed)
            lm.federated_train(models[name], texts, seed=seed, **train)
        retain = [t for client in corpus for t in client]
        # Unlearn until the forget set's NLL reaches the trained model's NLL on 20 unseen
        # canaries of each kind (held apart from the non-members scored below).
        unseen = minority[40:] + random_[40:]
        target = float(lm.mean_loss(models["with canaries"], unseen).detach())
        for method in ("gradient_ascent", "ascent_descent", "random_label"):
            model = lm.build_lm(config, seed=seed)
            model.load_state_dict(models["with canaries"].state_dict())
            steps = unlearn(
                model,
                forget,
                method=method,
                steps=200,
                lr=1e-4,
                retain=retain,
                stop_at_loss=target,
                generator=torch.Generator().manual_seed(seed),
            )
            models[f"unlearned: {method}"] = model
            unlearn_steps[method] = len(steps)
        for name, model in models.items():
            retain_nll = float(lm.mean_loss(model, retain).detach())
            for kind, (members, non) in sets.items():
                row = {"seed": seed, "model": name, "canaries": kind, "retain_nll": retain_nll}
                if name.startswith("unlearned: "):
                    row["unlearn_steps"] = unlearn_steps[name.removeprefix("unlearned: ")]
                for attack, m in _aucs(model, members, non).items():
                    row[f"{attack}_auc"], row[f"{attack}_tpr"] = m["auc"], m["tpr"]
                rows.append(row)
                print(json.dumps(row), flush=True)
        fresh = minority[20:40] + random_[20:40]
        for suspect_name, suspect in (("members", forget), ("non-members", fresh)):
            result = di.run_dataset_inference(
                models["with canaries"], suspect, np.random.default_rng(seed), splits=5
            )
            row = {"seed": seed, "dataset_inference": suspect_name, **result.to_dict()}
            rows.append(row)
            print(json.dumps(row), flush=True)
        print(f"canary seed {seed}: {time.perf_counter() - started:.0f} s", flush=True)
    return rows


def _mean_std(values: list[float]) -> str:
    """Mean ± sample standard deviation (ddof = 1)."""
    return f"{np.mean(values):.3f} ± {np.std(values, ddof=1):.3f}"


def dp_table(rows: list[dict]) -> str:
    """The MIA table of part ``dp``: one line per target epsilon, mean ± std over seeds."""
    lines = [
        "| target ε | z | ε of the run | accuracy | loss AUC | loss TPR@5%FPR | zlib AUC |",
        "|---|---|---|---|---|---|---|",
    ]
    for eps in ("1.0", "4.0", "16.0", "inf"):
        sel = [r for r in rows if str(r["target_epsilon"]) == eps]
        if sel:
            label = "∞" if eps == "inf" else f"{float(eps):g}"
            measured = "∞" if sel[0]["epsilon"] == "inf" else sel[0]["epsilon"]
            z = sel[0]["noise_multiplier"]
            lines.append(
                f"| {label} | {f'{z:.3f}' if z else '0'} | {measured} | "
                f"{_mean_std([r['accuracy'] for r in sel])} | "
                f"{_mean_std([r['loss_auc'] for r in sel])} | "
                f"{_mean_std([r['loss_tpr_at_5pct_fpr'] for r in sel])} | "
                f"{_mean_std([r['zlib_auc'] for r in sel])} |"
            )
    return "\n".join(lines)


def write_readme_table(rows: list[dict]) -> None:
    text = README.read_text()
    head, found, rest = text.partition(BEGIN)
    if not found:
        raise SystemExit(f"{README}: no {BEGIN} marker for the dp table")
    _, _, tail = rest.partition(END)
    README.write_text(f"{head}{BEGIN}\n{dp_table(rows)}\n{END}{tail}")


def print_tables(results: dict) -> None:
    if "dp" in results:
        print("\n" + dp_table(results["dp"]))
    if "canary" in results:
        rows = [r for r in results["canary"] if "model" in r]
        print("\n| model | canaries | loss AUC | zlib AUC | min-k% AUC | loss TPR@5%FPR |")
        print("|---|---|---|---|---|---|")
        labels = {"gradient_ascent": "gradient ascent", "ascent_descent": "ascent+descent"}
        labels["random_label"] = "random labels"
        for name in dict.fromkeys(r["model"] for r in rows):
            shown = name
            for method, label in labels.items():
                shown = shown.replace(method, label)
            for kind in ("minority", "random"):
                sel = [r for r in rows if r["model"] == name and r["canaries"] == kind]
                print(
                    f"| {shown} | {kind} | {_mean_std([r['loss_auc'] for r in sel])} | "
                    f"{_mean_std([r['zlib_auc'] for r in sel])} | "
                    f"{_mean_std([r['mink_auc'] for r in sel])} | "
                    f"{_mean_std([r['loss_tpr'] for r in sel])} |"
                )
        inference = [r for r in results["canary"] if "dataset_inference" in r]
        if inference:
            print("\n| suspect set | seed | p-value | text-classifier AUC | combined AUC |")
            print("|---|---|---|---|---|")
            for r in inference:
                print(
                    f"| {r['dataset_inference']} | {r['seed']} | {r['p_value']:.2e} | "
                    f"{np.mean(r['auc_text']):.3f} | {np.mean(r['auc_combined']):.3f} |"
                )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--part", choices=("dp", "canary", "all"), default="all")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--out", type=Path, default=OUT, help="JSON file (parts merge into it)")
    parser.add_argument("--secrets", type=Path, default=default_key(STUDY), help="study root")
    parser.add_argument("--table-only", action="store_true", help="tables from --out only")
    args = parser.parse_args()
    if args.table_only:
        results = json.loads(args.out.read_text())
        print_tables(results)
        if "dp" in results:
            write_readme_table(results["dp"])
        return
    root = study_root(args.secrets, args.out.parent)
    torch.set_num_threads(1)
    logging.getLogger("flwr").setLevel(logging.WARNING)
    from flwr.supercore.logger import FLOWER_LOGGER  # noqa: PLC0415

    FLOWER_LOGGER.setLevel(logging.WARNING)
    parts = {"dp": lambda seeds: dp_part(seeds, root), "canary": canary_part}
    for name in parts if args.part == "all" else [args.part]:
        rows = parts[name](args.seeds)
        # Re-read before writing: another part may have finished meanwhile.
        results = json.loads(args.out.read_text()) if args.out.exists() else {}
        results[name] = rows
        args.out.write_text(json.dumps(results, indent=2))
    results = json.loads(args.out.read_text())
    print_tables(results)
    if "dp" in results and args.out == OUT:
        write_readme_table(results["dp"])


if __name__ == "__main__":
    main()
