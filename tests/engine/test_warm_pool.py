"""The warm pool (issue 29, point 3): runs attach to a warm head's workers, results equal a
cold start's to the bit, ``fedsim down`` stops the head, bad settings are refused by name."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from fedsim.config import ConfigError

TESTS = Path(__file__).resolve().parents[1]


@pytest.mark.ray
def test_warm_runs_equal_a_cold_run_bit_for_bit_and_down_stops_the_head(tmp_path):
    env = dict(os.environ, FEDSIM_WARM_DIR=str(tmp_path / "warm"), FEDSIM_WARM="auto")
    env["PYTHONPATH"] = os.pathsep.join([str(TESTS.parent), env.get("PYTHONPATH", "")])
    done = subprocess.run(
        [sys.executable, str(TESTS / "warm_support.py"), "identical", str(tmp_path)],
        env=env,
        capture_output=True,
        text=True,
        timeout=1200,
        check=False,
    )
    lines = [line for line in done.stdout.splitlines() if line.startswith("RESULT ")]
    assert done.returncode == 0 and lines, done.stdout[-3000:] + done.stderr[-3000:]
    seen = json.loads(lines[-1].removeprefix("RESULT "))
    assert seen["head_recorded"] and seen["stopped"]
    # a plain ray.init() elsewhere (Flower's run_simulation) must not join the pool's head
    assert not seen["head_in_default_ray_record"]
    assert not seen["head_alive_after_down"]  # no Ray process of the head is left
    # the two warm runs ran on the pool, the cold one did not
    assert [bool(e.get("warm_pool")) for e in seen["engines"]] == [True, True, False], seen
    assert seen["warm"][0] == seen["warm"][1] == seen["cold"], seen  # final model.npz bytes
    assert not (tmp_path / "warm" / "head.json").exists()


def test_a_warm_mode_outside_the_allowed_ones_is_refused_by_name(monkeypatch):
    from fedsim.engine import EngineConfig
    from fedsim.engine.warm_pool import WARM_ENV, warm_mode

    with pytest.raises(ConfigError, match="engine.warm"):
        EngineConfig(warm="sometimes")
    monkeypatch.setenv(WARM_ENV, "yes")
    with pytest.raises(ConfigError, match=r"\$FEDSIM_WARM.*'yes'"):
        warm_mode("auto")
    monkeypatch.setenv(WARM_ENV, "off")
    assert warm_mode("on") == "off"


def test_no_head_recorded_means_nothing_to_attach_or_stop(tmp_path, monkeypatch):
    from fedsim.engine.warm_pool import WARM_DIR_ENV, Head, attach, down

    monkeypatch.setenv(WARM_DIR_ENV, str(tmp_path))
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    assert Head.load() is None
    assert attach("auto", "", 2, 256) is None  # auto: no head, a cold start as before
    assert down() is False
    # a record whose process is gone is stale: dropped, not attached to
    Head("127.0.0.1:1", 2**22 + 12345, 2, ("x",), 60.0).save()
    assert Head.load() is None and not Head.path().exists()


def test_up_refuses_a_bad_idle_timeout_by_name(tmp_path, monkeypatch):
    from fedsim.engine.warm_pool import WARM_DIR_ENV, up

    monkeypatch.setenv(WARM_DIR_ENV, str(tmp_path))
    with pytest.raises(ConfigError, match="--idle-timeout"):
        up(workers=1, num_cpus=1, idle_timeout_s=0)
    with pytest.raises(ConfigError, match="--workers"):
        up(workers=-1, num_cpus=1)
