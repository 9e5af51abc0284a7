"""experiments/bench/engine.py with ``--warm-head``: the benchmark starts a warm head
(``fedsim up``, a private ``FEDSIM_WARM_DIR``), times runs that attach to it next to the cold
ones, and stops it (``fedsim down``). Run at a tiny size; checks the JSON's structure, that the
warm-head runs really attached (the script refuses one that did not), that every median and
ratio is computed from the stored repetitions, and that no head is left up. No timing
assertions."""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "experiments" / "bench" / "engine.py"


def _bench(tmp_path: Path, *args: str) -> dict:
    env = dict(
        os.environ,
        PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),
        FEDSIM_WARM_DIR=str(tmp_path / "not-the-bench-s"),  # a caller's pool: never used
        RAY_USAGE_STATS_ENABLED="0",
        RAY_ACCEL_ENV_VAR_OVERRIDE_ON_ZERO="0",
    )
    done = subprocess.run(
        [sys.executable, str(SCRIPT), *args], capture_output=True, text=True, cwd=ROOT, env=env
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert not (tmp_path / "not-the-bench-s").exists()  # the bench kept its own warm dir
    result = json.loads(done.stdout)
    assert result["warm_head"]["stopped"] is True  # fedsim down stopped the head it started
    assert result["warm_head"]["up_s"] > 0
    return result


def _load_and_note(result: dict) -> None:
    assert len(result["load_average"]) == 2
    assert all(len(sample) == 3 for sample in result["load_average"])
    assert "load_average" in result["machine"]  # the note points at the measured load


def test_app_mode_times_a_warm_head_next_to_the_cold_runs(tmp_path):
    result = _bench(
        tmp_path,
        "--app",
        "--warm-head",
        "--supernodes",
        "2",
        "--app-rounds",
        "1",
        "--clients-per-round",
        "2",
        "--workers",
        "1",
        "--reps",
        "2",
    )
    times = result["all"]
    assert set(times) == {"fedsim_s", "fedsim_warm_head_s", "flower_s"}
    assert all(len(v) == 2 for v in times.values())
    for key, values in times.items():
        assert result[key] == pytest.approx(statistics.median(values))
    assert result["speedup_vs_flower"] == pytest.approx(result["flower_s"] / result["fedsim_s"])
    assert result["speedup_vs_flower_warm_head"] == pytest.approx(
        result["flower_s"] / result["fedsim_warm_head_s"]
    )
    assert result["speedup_vs_flower_warm_head_pairs"] == pytest.approx(
        statistics.median(
            f / s for f, s in zip(times["flower_s"], times["fedsim_warm_head_s"], strict=True)
        )
    )
    _load_and_note(result)


def test_engine_mode_times_a_fresh_process_first_run_on_the_warm_head(tmp_path):
    result = _bench(
        tmp_path,
        "--warm-head",
        "--skip-flower",
        "--rounds",
        "1",
        "--reps",
        "1",
        "--workers",
        "1",
        "--rows-per-client",
        "8",
    )
    (seconds,) = result["all"]["fedsim_warm_head_cold_s"]
    assert result["fedsim_warm_head_cold_s"] == seconds > 0
    (breakdown,) = result["warm_head_breakdown"]
    assert {"ray_init", "workers_spawn", "workers_ready", "call_to_first_round_end"} <= set(
        breakdown
    )
    assert result["fedsim_cold_s"] > 0  # the cold run is still there
    assert "speedup_vs_flower_warm_head" not in result  # no Flower run: no ratio
    _load_and_note(result)
