"""Differential check of a refactor: every registered strategy, run on a tiny config with a
fixed seed, secret root and run nonce, must give the same ``model.npz`` and ``rounds.jsonl``
(timings aside) before and after.

    python experiments/differential/run.py record BASE     # on the code before
    python experiments/differential/run.py compare BASE NEW  # on the code after (replays BASE)

``compare`` replays each BASE run's noise streams (``--replay``, the same root and nonce), so
the two runs differ only by the code; it prints one line per strategy and exits 1 on any
difference. The root is ``--secrets`` (default ~/.fedsim/differential.key, created with OS
randomness if missing), outside the repository.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

import numpy as np

from fedsim.config import load_toml
from fedsim.frontend.experiment import run_experiment
from fedsim.frontend.results import read_rounds
from fedsim.frontend.run_config import ExperimentConfig
from fedsim.randomness import RunSecret
from fedsim.workloads.supervised import CLIENT_METHODS
from strategies.registry import NAMES

ROOT = Path(__file__).resolve().parents[2]
QUICKSTART = ROOT / "experiments" / "quickstart" / "config.toml"
TIMING = {"seconds", "time_s", "clients_per_s", "compute_s", "wall_s", "started_at",
          "generate_s", "embed_s", "dpo_s"}  # POPri's own timings too
DP = {"clipping_norm": 0.5, "noise_multiplier": 0.7}
COMMITTEE = {"committee_size": 11, "threshold": 2, "packing": 1, "member_dropouts": 2}

#: strategy table of each run that needs more than the defaults (name, cohort, options);
#: personalised ones get PERSONAL
EXAMPLES: dict[str, dict[str, Any]] = {
    "fedavg": {},  # named here: its secure-sum runs below would otherwise cover the name
    "fedprox": {"options": {"proximal_mu": 0.1}},
    "fedavg+secagg": {"name": "fedavg", "options": {"secure_sum": "secagg"}},
    "fedavg+committee": {
        "name": "fedavg",
        "options": {"secure_sum": "committee", "committee_size": 7, "threshold": 2},
    },
    "dp-fedavg": {"options": DP},
    "dp-fedavg-adaptive": {
        "name": "dp-fedavg",
        "options": {**DP, "adaptive_clipping": True},
    },
    "matrix-mechanism": {
        "sampling": "min-separation",
        "options": {**DP, "kind": "banded", "bands": 2},
    },
    "dmm": {
        "sampling": "min-separation",
        "options": {"clipping_norm": 1.0, "noise_multiplier": 1.0, **COMMITTEE},
    },
    "ddgauss-full": {"name": "ddgauss", "options": {**DP, "mode": "full", "ring_bits": 32}},
    "ddgauss-plaintext": {
        "name": "ddgauss",
        "options": {**DP, "mode": "plaintext", "ring_bits": 32},
    },
    "ddgauss-committee": {
        "name": "ddgauss",
        "options": {
            **DP, "mode": "committee", "ring_bits": 32, "committee_size": 7, "threshold": 2,
        },
    },
    "pfedhb": {"options": {"server_solver": "adam"}},
    "pfedbayes": {"options": {"schedule": "sampled"}},
    "fedavg-ft": {"options": {"finetune_epochs": 1}},
    "popri": {"options": {"dpo": {"batch_size": 2, "lora_rank": 2}}},
}
#: every run: each registered strategy (its defaults unless EXAMPLES has it), and each
#: registered client method's example table under FedAvg (``client``: merged into [client])
STRATEGIES: dict[str, dict[str, Any]] = {
    **EXAMPLES,
    **{
        name: {}
        for name in NAMES
        if name not in {table.get("name", key) for key, table in EXAMPLES.items()}
    },
    **{
        f"client.{method.key}": {"name": "fedavg", "client": {method.key: dict(method.example)}}
        for method in CLIENT_METHODS
    },
}
#: the text methods' runs: numpy's docstrings, the tiny generator and embedder (the real
#: SmolLM2 run is tests/frontend/test_text_methods_run.py's), 2 rounds of 3 of 6 clients
TEXT = {
    "data": {"source": "text", "partition": "natural", "num_clients": 6, "test_fraction": 0.0,
             "text": {"kind": "docstrings", "client_packages": ["numpy"]}},
    "options": {"generator": "tiny", "embedder": "tiny", "num_prompts": 2,
                "samples_per_prompt": 2, "examples_per_prompt": 1, "max_new_tokens": 4,
                "max_tokens": 16, "noise_multiplier": 1.0},
}  # fmt: skip
PERSONAL = {
    "data": {
        "source": "digits",
        "partition": "split-classes",
        "classes_per_client": 5,
        "num_clients": 8,
        "test_fraction": 0.25,
    },
    "model": {"kind": "bayes-mlp", "hidden": [12]},
    "personal": {"head_steps": 2, "body_epochs": 1, "mc_samples": 2, "eval_samples": 2},
    "evaluation": {"every": 2},
    "rounds": 2,
}


def config(key: str) -> dict[str, Any]:
    """The tiny run of ``key``: the quickstart, 2 rounds of 12 of 40 clients."""
    raw = load_toml(QUICKSTART)
    raw.update(rounds=2, seed=4, name=key)
    raw["data"].update(num_clients=40)
    raw["client"].update(epochs=1)
    raw["model"].update(channels=[4, 4], hidden=[16])
    raw["evaluation"].update(clients=4, every=2)
    raw["engine"] = {"backend": "local"}
    table = dict(STRATEGIES[key])
    name = table.pop("name", key)
    raw["client"].update(table.pop("client", {}))
    raw["strategy"] = {"name": name, "clients_per_round": 12, "sampling": "uniform", **table}
    if name in ("pfedhb", "pfedvem", "pfedbayes", "fedavg-ft", "local-only"):
        raw.update(PERSONAL)
        del raw["client"]
        raw["strategy"].update(clients_per_round=2, sampling="poisson")
    if name in ("popri", "private-evolution"):
        raw.update(data=TEXT["data"])
        for key in ("client", "model"):
            del raw[key]
        options = {**TEXT["options"], **raw["strategy"].get("options", {})}
        raw["strategy"].update(clients_per_round=3, options=options)
        raw["evaluation"] = {"clients": 0, "every": 0}
    if raw["strategy"].get("options", {}).get("secure_sum") or name in ("ddgauss", "dmm"):
        raw["evaluation"]["clients"] = 0
    return raw


def without_timing(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: without_timing(v) for k, v in value.items() if k not in TIMING}
    if isinstance(value, list):
        return [without_timing(v) for v in value]
    return value


DEFAULT_SECRETS = Path.home() / ".fedsim" / "differential.key"


def run(key: str, out: Path, replay: Path | None, secrets: RunSecret) -> None:
    run_experiment(
        ExperimentConfig.from_dict(config(key)),
        out,
        progress=False,
        secrets=secrets,
        replay=replay,
    )


def outcome(out: Path) -> tuple[dict[str, bytes], str]:
    model = {k: v.tobytes() for k, v in np.load(out / "model.npz").items()}
    rounds = json.dumps(without_timing(read_rounds(out / "rounds.jsonl")), sort_keys=True)
    return model, rounds


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("action", choices=("record", "compare"))
    parser.add_argument("base", type=Path)
    parser.add_argument("new", type=Path, nargs="?")
    parser.add_argument("--only", nargs="*", default=None)
    parser.add_argument("--secrets", type=Path, default=DEFAULT_SECRETS)
    args = parser.parse_args(argv)
    args.secrets.parent.mkdir(parents=True, exist_ok=True)
    secrets = RunSecret.load_or_create(args.secrets)
    keys = args.only or list(STRATEGIES)
    failed = 0
    for key in keys:
        try:
            if args.action == "record":
                run(key, args.base / key, None, secrets)
                print(f"{key}: recorded", flush=True)
                continue
            run(key, args.new / key, args.base / key, secrets)
        except Exception as error:  # one failing strategy must not hide the others
            failed += 1
            print(f"{key}: FAILED {type(error).__name__}: {error}", flush=True)
            continue
        same_model = outcome(args.base / key)[0] == outcome(args.new / key)[0]
        same_rounds = outcome(args.base / key)[1] == outcome(args.new / key)[1]
        failed += not (same_model and same_rounds)
        print(f"{key}: model {'same' if same_model else 'DIFFERS'}, "
              f"rounds {'same' if same_rounds else 'DIFFER'}", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
