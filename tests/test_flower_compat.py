"""The compatibility suite: Flower's ServerApp surfaces, each run under ``fedsim flwr-run``
and under Flower's own ``run_simulation``, with the results compared.

One app project per API form (tests/apps/legacy: the legacy API with a NumPyClient
``client_fn`` behind a client mod; tests/apps/analytics: federated analytics with ``query``
messages and actions); its ``surface`` run config picks the ServerApp. Deterministic apps
must end with the same parameters and the same central and federated losses (to float
rounding: Flower sums the replies in arrival order, fedsim in node-id order); the noisy one
(server-side DP with z > 0) with the same rounds and metric keys; SecAgg+ (stochastic
quantization) with parameters within its quantization error. Flower's side runs every
surface of one project in one ``run_simulation`` (its Ray start costs about a minute here).
"""

from __future__ import annotations

import numpy as np
import pytest
from flower_compat_support import fedsim_run, flower_runs

NODES = 4
#: surface -> run config overrides (every one runs 2 rounds of 5 local steps)
LEGACY = {
    "fedavg": {"surface": "fedavg"},
    "fedprox": {"surface": "fedprox", "proximal-mu": 0.5},
    "fedadam": {"surface": "fedadam"},
    "dp-server": {"surface": "dp-server", "noise-multiplier": 0.5},
    "dp-client": {"surface": "dp-client", "noise-multiplier": 0.0},
    "secagg": {"surface": "secagg"},
    "evaluate-only": {"surface": "evaluate-only"},
    "properties": {"surface": "properties"},
    "server-fn": {"surface": "server-fn"},
}
DETERMINISTIC = ("fedavg", "fedprox", "fedadam", "dp-client", "evaluate-only", "server-fn")
#: surfaces whose initial parameters come from a node (get_parameters, round 0)
FROM_A_NODE = ("fedavg", "server-fn")


@pytest.fixture(scope="module")
def flower_legacy(tmp_path_factory):
    return flower_runs("legacy", LEGACY, NODES, tmp_path_factory.mktemp("flower-legacy"))


def close(a, b) -> None:
    np.testing.assert_allclose(np.asarray(a, dtype=float), np.asarray(b, dtype=float),
                               rtol=1e-12, atol=1e-14)


def rounds_of(series) -> list[int]:
    return [int(r) for r, _ in series]


def check_rounds(run: dict, surface: str) -> None:
    """fedsim's rounds.jsonl: one line per round, every node in each train and evaluate."""
    lines = run["_rounds"]
    first = 0 if surface in FROM_A_NODE else 1
    assert [line["round"] for line in lines] == list(range(first, 3))
    if first == 0:
        assert lines[0]["get_parameters"]["messages"] == 1 and "train" not in lines[0]
    stages = 4 if surface == "secagg" else 1  # SecAgg+: setup, keys, masked vectors, unmask
    for line in lines[first == 0:]:
        assert line["evaluate"]["messages"] == NODES and line["evaluate"]["failed"] == 0
        if surface == "evaluate-only":
            assert "train" not in line
        else:
            assert line["train"]["messages"] == stages * NODES  # each node once a stage
            assert line["train"]["clients"] == NODES and line["train"]["failed"] == 0
    assert run["_summary"]["rounds"] == 2


@pytest.mark.parametrize("surface", DETERMINISTIC)
def test_a_deterministic_legacy_app_ends_where_flower_ends(tmp_path, flower_legacy, surface):
    ours, flower = fedsim_run("legacy", LEGACY[surface], NODES, tmp_path), flower_legacy[surface]
    assert len(ours["final"]) == 2 and len(ours["final"][0]) == 3
    for mine, theirs in zip(ours["final"], flower["final"], strict=True):
        close(mine, theirs)
    assert rounds_of(ours["central"]) == rounds_of(flower["central"]) == [0, 1, 2]
    close([v for _, v in ours["central"]], [v for _, v in flower["central"]])
    assert len(ours["fit_metrics"]) == (0 if surface == "evaluate-only" else 2)
    for key in ("fit_metrics", "evaluate_metrics"):
        assert [sorted(m) for m in ours[key]] == [sorted(m) for m in flower[key]]
        for mine, theirs in zip(ours[key], flower[key], strict=True):
            close([mine[k] for k in sorted(mine)], [theirs[k] for k in sorted(theirs)])
    if "history" in flower:  # LegacyContext + DefaultWorkflow: Flower's History
        for key, series in flower["history"].items():
            mine = ours["history"][key]
            if isinstance(series, dict):
                assert sorted(mine) == sorted(series)
                for name in series:
                    assert rounds_of(mine[name]) == rounds_of(series[name])
                    close([v for _, v in mine[name]], [v for _, v in series[name]])
            else:
                assert rounds_of(mine) == rounds_of(series)
                close([v for _, v in mine], [v for _, v in series])
    if surface == "evaluate-only":  # nothing trained: the given (zero) model throughout
        assert ours["final"] == [[0.0, 0.0, 0.0], [0.0]]
    else:  # training moved the model towards the data's
        assert ours["central"][-1][1] < 0.8 * ours["central"][0][1]
    check_rounds(ours, surface)


def test_server_side_dp_has_flowers_rounds_and_keys(tmp_path, flower_legacy):
    """``DifferentialPrivacyServerSideFixedClipping`` with z = 0.5 (noise from numpy's global
    stream: not reproducible across runtimes): the same rounds and metric keys; the noise
    moved the result away from the noise-free clipped one."""
    ours, flower = fedsim_run("legacy", LEGACY["dp-server"], NODES, tmp_path), flower_legacy[
        "dp-server"]
    assert rounds_of(ours["central"]) == rounds_of(flower["central"]) == [0, 1, 2]
    for key in ("fit_metrics", "evaluate_metrics"):
        assert [sorted(m) for m in ours[key]] == [sorted(m) for m in flower[key]]
    for key, series in flower["history"].items():
        mine = ours["history"][key]
        if isinstance(series, dict):
            assert {k: rounds_of(v) for k, v in mine.items()} == {
                k: rounds_of(v) for k, v in series.items()}
        else:
            assert rounds_of(mine) == rounds_of(series)
    noise_free = flower_legacy["dp-client"]["final"]  # the same clipping, z = 0
    assert not np.allclose(np.concatenate(ours["final"]), np.concatenate(noise_free))
    check_rounds(ours, "dp-server")


def test_get_properties_analytics_match_flower(tmp_path, flower_legacy):
    ours = fedsim_run("legacy", LEGACY["properties"], NODES, tmp_path)
    theirs = flower_legacy["properties"]["analytics"]
    mine = ours["analytics"]
    assert mine["partitions"] == theirs["partitions"] == list(range(NODES))
    assert mine["num-examples"] == theirs["num-examples"] and mine["nodes"] == NODES
    close(mine["mean-y"], theirs["mean-y"])
    assert [line["get_properties"]["clients"] for line in ours["_rounds"]] == [NODES]


def test_query_actions_match_flower(tmp_path):
    """``query`` and ``query.histogram`` (a Message-API ClientApp with a registered action)."""
    flower = flower_runs("analytics", {"analytics": {}}, 5, tmp_path / "flower")["analytics"]
    ours = fedsim_run("analytics", {}, 5, tmp_path)
    assert ours["nodes"] == flower["nodes"] == 5
    assert ours["count"] == flower["count"] and ours["histogram"] == flower["histogram"]
    assert sum(ours["histogram"]) <= ours["count"]
    close(ours["mean"], flower["mean"])
    (line,) = ours["_rounds"]
    assert line["query"]["messages"] == 10 and line["query"]["failed"] == 0


@pytest.mark.parametrize("kind", ["reconnect", "system"])
def test_a_message_no_clientapp_runs_stops_the_run_with_one_line_naming_it(
    tmp_path, capsys, kind
):
    """Flower's deprecated ``reconnect`` and its runtime's own ``system``: refused when the
    ServerApp sends the first one, before any client runs, with one line, no traceback."""
    from flower_compat_support import APPS

    from fedsim.cli import main

    argv = ["flwr-run", str(APPS / "legacy"), "--backend", "local", "--no-progress",
            "--out", str(tmp_path / "run"), "--run-config", f'surface="{kind}"']
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert f"message type '{kind}'" in err and "cannot run on fedsim's grid" in err
    assert "allowed: 'train', 'evaluate' or 'query'" in err and "get_parameters" in err
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1


def test_secagg_plus_workflow_sums_what_flower_sums(tmp_path, flower_legacy):
    """``SecAggPlusWorkflow`` with ``secaggplus_mod``: the masks cancel, so both runtimes
    end at FedAvg's parameters up to the stochastic quantization (range 8, 2^22 levels)."""
    ours, flower = fedsim_run("legacy", LEGACY["secagg"], NODES, tmp_path), flower_legacy[
        "secagg"]
    plain = flower_legacy["fedavg"]["final"]  # the same FedAvg in clear
    for mine, theirs, clear in zip(ours["final"], flower["final"], plain, strict=True):
        np.testing.assert_allclose(mine, theirs, atol=1e-3)
        np.testing.assert_allclose(mine, clear, atol=1e-3)
    assert rounds_of(ours["central"]) == rounds_of(flower["central"]) == [0, 1, 2]
    assert {k: rounds_of(v) for k, v in ours["history"]["metrics_distributed"].items()} == {
        k: rounds_of(v) for k, v in flower["history"]["metrics_distributed"].items()}
    for key in ("fit_metrics", "evaluate_metrics"):
        assert [sorted(m) for m in ours[key]] == [sorted(m) for m in flower[key]]
    check_rounds(ours, "secagg")


@pytest.mark.ray
def test_start_grid_on_ray_workers_ends_where_flower_ends(tmp_path, ray_session, flower_legacy):
    """``ServerApp(server_fn=...)`` sends every node's message from its own thread; on Ray
    workers the replies still find their callers."""
    ours = fedsim_run("legacy", LEGACY["server-fn"], NODES, tmp_path, "--workers", "2")
    assert ours["_summary"]["engine"]["backend"] == "ray"
    for mine, theirs in zip(ours["final"], flower_legacy["server-fn"]["final"], strict=True):
        close(mine, theirs)
    check_rounds(ours, "server-fn")
