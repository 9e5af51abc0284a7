"""The README's "from a config" numbers: every ``configs/*.toml`` quoted there, run once.

Each config runs through ``fedsim run``'s own code
(:func:`fedsim.frontend.experiment.run_experiment`, the local engine and the seed written in the
config) from the repository root, so that ``configs/coto_lora.toml`` finds the base that
``configs/coto_base.toml`` writes to ``results/coto-base``. The rounds.jsonl lines the README quotes
(every evaluated round) and the run's seconds are stored in ``configs.json`` next to this file;
``--tables`` prints the README's values from that file without running anything::

    nice -n 19 python experiments/workloads/configs.py      # 380 s wall on 2 busy cores
    python experiments/workloads/configs.py --tables
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
sys.path.insert(0, str(ROOT))
OUT = HERE / "configs.json"

#: run name -> (config file, overrides of its tables, run directory under ROOT)
RUNS: dict[str, tuple[str, dict[str, Any], str]] = {
    "mars_qoda_lawa": ("mars_qoda_lawa.toml", {}, "results/workloads-configs/mars_qoda_lawa"),
    "conformal": ("conformal.toml", {}, "results/workloads-configs/conformal"),
    "hdm_hb": ("hdm_hb.toml", {}, "results/workloads-configs/hdm_hb"),
    "sst": ("sst.toml", {}, "results/workloads-configs/sst"),
    # the same SST run with the [client] table's plain SGD (lr 0.1) instead of MARS-AdamW
    "sst_sgd": ("sst.toml", {"client": {"optimizer": None}}, "results/workloads-configs/sst_sgd"),
    "constrained": ("constrained.toml", {}, "results/workloads-configs/constrained"),
    "coto_base": ("coto_base.toml", {}, "results/coto-base"),
    "coto_lora": ("coto_lora.toml", {}, "results/workloads-configs/coto_lora"),
}


def _merge(raw: dict[str, Any], overrides: dict[str, Any]) -> dict[str, Any]:
    out = dict(raw)
    for key, value in overrides.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = _merge(out[key], value)
        elif value is None:
            out.pop(key, None)
        else:
            out[key] = value
    return out


def run(name: str) -> dict[str, Any]:
    """Run one config into a fresh directory; its evaluated rounds and timings."""
    import shutil  # noqa: PLC0415

    import torch  # noqa: PLC0415

    from fedsim.config import load_toml  # noqa: PLC0415
    from fedsim.frontend.experiment import run_experiment  # noqa: PLC0415
    from fedsim.frontend.results import read_rounds  # noqa: PLC0415
    from fedsim.frontend.run_config import ExperimentConfig  # noqa: PLC0415

    torch.set_num_threads(1)
    logging.getLogger("flwr").setLevel(logging.WARNING)
    file, overrides, out = RUNS[name]
    config = ExperimentConfig.from_dict(_merge(load_toml(HERE / "configs" / file), overrides))
    out_dir = ROOT / out
    shutil.rmtree(out_dir, ignore_errors=True)
    cpu, wall = time.process_time(), time.perf_counter()
    summary = run_experiment(config, out_dir, progress=False)
    records = read_rounds(out_dir / "rounds.jsonl")
    return {
        "config": f"experiments/workloads/configs/{file}",
        "overrides": overrides,
        "out": out,
        "seconds": time.perf_counter() - wall,
        "cpu_seconds": time.process_time() - cpu,
        "rounds": summary["rounds"],
        "records": [r for r in records if "central" in r or "aggregated_evaluate" in r],
        "last": records[-1],
    }


def _at(result: dict[str, Any], server_round: int) -> dict[str, Any]:
    return next(r for r in result["records"] if r["round"] == server_round)


def tables(results: dict[str, Any]) -> str:
    """The values the README quotes, from the stored records."""
    lines = []
    if "mars_qoda_lawa" in results:
        last = results["mars_qoda_lawa"]["last"]
        lines.append(
            f"mars_qoda_lawa round {last['round']}: central accuracy "
            f"{last['central']['accuracy']:.3f}, bytes_up {last['bytes_up']:,}, bytes_down "
            f"{last['bytes_down']:,}, train.metrics.upload-bits "
            f"{last['train']['metrics']['upload-bits']:,.0f}, aggregated.upload-bits-total "
            f"{last['aggregated']['upload-bits-total']:,.0f} ({last['train']['clients']} clients)"
        )
    if "conformal" in results:
        last = results["conformal"]["last"]
        ev = last["aggregated_evaluate"]
        lines.append(
            f"conformal round {last['round']}: conformal-max-gap {ev['conformal-max-gap']:.4f}, "
            f"overall miss {ev['conformal-miss']:.3f}, online set size "
            f"{ev['conformal-set-size']:.2f}, clients' tau "
            f"{last['train']['metrics']['dpsm-tau']:.3f}"
        )
    for name in ("hdm_hb", "sst", "sst_sgd", "constrained", "coto_base"):
        if name in results:
            last = results[name]["last"]
            accuracy = last["central"]["accuracy"]
            text = f"{name} round {last['round']}: central accuracy {accuracy:.3f}"
            if name == "constrained":
                text += (
                    ", mean violation "
                    f"{last['evaluate']['metrics']['constraint-violation']:.3f}"
                )
            lines.append(text)
    if "coto_lora" in results:
        result = results["coto_lora"]
        last = result["last"]
        metrics = [_at(result, r)["train"]["metrics"] for r in (5, 10, 15, 20)]
        active = [m["coto-active-fraction"] for m in metrics]
        p = [m["coto-p"] for m in metrics]
        lines.append(
            f"coto_lora round {last['round']}: central accuracy "
            f"{last['central']['accuracy']:.3f}, "
            f"bytes_up {last['bytes_up']:,} per round, coto-active-fraction at rounds "
            f"5/10/15/20 {' / '.join(f'{a:.3f}' for a in active)}, coto-p "
            f"{' / '.join(f'{v:.3f}' for v in p)}"
        )
    for name, result in results.items():
        lines.append(f"{name}: {result['seconds']:.0f} s wall, {result['cpu_seconds']:.0f} s CPU")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", nargs="*", choices=list(RUNS), default=list(RUNS))
    parser.add_argument("--tables", action="store_true", help="print from configs.json only")
    args = parser.parse_args()
    results = json.loads(OUT.read_text()) if OUT.exists() else {}
    if not args.tables:
        os.chdir(ROOT)  # coto_lora.toml names its base relative to the repository root
        os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
        for name in args.only:
            results[name] = run(name)
            OUT.write_text(json.dumps(results, indent=1) + "\n")
            print(f"{name}: {results[name]['seconds']:.0f} s", flush=True)
    print(tables(results))


if __name__ == "__main__":
    main()
