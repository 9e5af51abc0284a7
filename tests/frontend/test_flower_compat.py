"""The compatibility suite: Flower's ServerApp surfaces, each run under ``fedsim flwr-run``
and under Flower's own ``run_simulation``, with the results compared.

One app project per API form (tests/apps/legacy: the legacy API with a NumPyClient
``client_fn`` behind a client mod; tests/apps/analytics: the Message API, federated analytics
with ``query`` messages and actions, and ``flwr.serverapp.strategy.FedAvg``); its ``surface``
run config picks the ServerApp. Deterministic apps must end with the same parameters and the
same central and federated losses (to float rounding: Flower sums the replies in arrival
order, fedsim in node-id order); the noisy one (server-side DP with z > 0) with the same
rounds and metric keys; SecAgg+ (stochastic quantization) with parameters within its
quantization error. What the strategy computed each round (Flower's ``History`` of the legacy
workflow, the Message API's ``Result``) must also be in fedsim's rounds.jsonl, in the sections
``aggregated``, ``aggregated_evaluate`` and ``central`` of that round's line, with Flower's
values for the deterministic apps. Flower's side runs every surface of one project in one
``run_simulation`` (its Ray start costs about a minute here).
"""

from __future__ import annotations

from collections import defaultdict

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


#: the Message-API surfaces (tests/apps/analytics), on 5 nodes
MESSAGE_API = {
    "analytics": {"surface": "analytics"},
    "fedavg": {"surface": "fedavg"},
    "dp-server": {"surface": "dp-server"},
    "dp-client": {"surface": "dp-client"},
}
#: sections of a round line that hold what the strategy computed
STRATEGY_SECTIONS = ("aggregated", "aggregated_evaluate", "central")


@pytest.fixture(scope="module")
def flower_legacy(tmp_path_factory):
    return flower_runs("legacy", LEGACY, NODES, tmp_path_factory.mktemp("flower-legacy"))


@pytest.fixture(scope="module")
def flower_message_api(tmp_path_factory):
    return flower_runs("analytics", MESSAGE_API, 5, tmp_path_factory.mktemp("flower-message"))


def close(a, b) -> None:
    np.testing.assert_allclose(np.asarray(a, dtype=float), np.asarray(b, dtype=float),
                               rtol=1e-12, atol=1e-14)


def rounds_of(series) -> list[int]:
    return [int(r) for r, _ in series]


def check_rounds(run: dict, surface: str) -> None:
    """fedsim's rounds.jsonl: one line per round (round 0: the initial model's central
    evaluation, and the node's initial parameters where a node gives them), every node in
    each train and evaluate."""
    lines = run["_rounds"]
    assert [line["round"] for line in lines] == [0, 1, 2]
    assert "train" not in lines[0] and "evaluate" not in lines[0] and "central" in lines[0]
    if surface in FROM_A_NODE:
        assert lines[0]["get_parameters"]["messages"] == 1
    else:
        assert "get_parameters" not in lines[0]
    stages = 4 if surface == "secagg" else 1  # SecAgg+: setup, keys, masked vectors, unmask
    for line in lines[1:]:
        assert line["evaluate"]["messages"] == NODES and line["evaluate"]["failed"] == 0
        if surface == "evaluate-only":
            assert "train" not in line
        else:
            assert line["train"]["messages"] == stages * NODES  # each node once a stage
            assert line["train"]["clients"] == NODES and line["train"]["failed"] == 0
    assert run["_summary"]["rounds"] == 2


def history_sections(history: dict) -> dict[int, dict[str, dict]]:
    """Flower's ``History`` (the legacy workflow's) as round -> section -> values: each loss
    as ``loss`` beside the metrics of its section."""
    out: dict[int, dict[str, dict]] = defaultdict(dict)
    for section, losses, metrics in (
        ("aggregated", None, "metrics_distributed_fit"),
        ("aggregated_evaluate", "losses_distributed", "metrics_distributed"),
        ("central", "losses_centralized", "metrics_centralized"),
    ):
        for server_round, loss in history.get(losses, []) if losses else []:
            out[server_round].setdefault(section, {})["loss"] = loss
        for name, series in history[metrics].items():
            for server_round, value in series:
                out[server_round].setdefault(section, {})[name] = value
    return dict(out)


def result_sections(result: dict) -> dict[int, dict[str, dict]]:
    """The Message API's ``Result`` (as the app wrote it) as round -> section -> values."""
    out: dict[int, dict[str, dict]] = defaultdict(dict)
    for section, field in (
        ("aggregated", "train_metrics_clientapp"),
        ("aggregated_evaluate", "evaluate_metrics_clientapp"),
        ("central", "evaluate_metrics_serverapp"),
    ):
        for server_round, values in result[field].items():
            out[int(server_round)][section] = values
    return dict(out)


def check_strategy_sections(run: dict, expected: dict[int, dict[str, dict]], values: bool) -> None:
    """Every round line holds exactly the strategy's sections Flower filed for that round,
    with the same keys, and (``values``) the same values."""
    lines = {line["round"]: line for line in run["_rounds"]}
    assert sorted(lines) == sorted(expected)
    for server_round, sections in expected.items():
        line = lines[server_round]
        assert sorted(s for s in STRATEGY_SECTIONS if s in line) == sorted(sections)
        for name, wanted in sections.items():
            assert sorted(line[name]) == sorted(wanted), (server_round, name)
            if values:
                close([line[name][k] for k in sorted(wanted)], [wanted[k] for k in sorted(wanted)])


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
        check_strategy_sections(ours, history_sections(flower["history"]), values=True)
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
    else:  # start_grid's History stays inside Flower's ServerApp: the app's own record
        lines = {line["round"]: line for line in ours["_rounds"]}
        for server_round, loss in flower["central"]:
            close([lines[server_round]["central"][k] for k in ("central-mse", "loss")],
                  [loss, loss])
        for server_round, (fit, ev) in enumerate(
                zip(flower["fit_metrics"], flower["evaluate_metrics"], strict=True), 1):
            assert sorted(lines[server_round]["aggregated"]) == sorted(fit)
            close([lines[server_round]["aggregated"][k] for k in sorted(fit)],
                  [fit[k] for k in sorted(fit)])
            assert sorted(lines[server_round]["aggregated_evaluate"]) == sorted({*ev, "loss"})
            close([lines[server_round]["aggregated_evaluate"][k] for k in sorted(ev)],
                  [ev[k] for k in sorted(ev)])
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
    check_strategy_sections(ours, history_sections(flower["history"]), values=False)
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


def test_query_actions_match_flower(tmp_path, flower_message_api):
    """``query`` and ``query.histogram`` (a Message-API ClientApp with a registered action)."""
    flower = flower_message_api["analytics"]
    ours = fedsim_run("analytics", MESSAGE_API["analytics"], 5, tmp_path)
    assert ours["nodes"] == flower["nodes"] == 5
    assert ours["count"] == flower["count"] and ours["histogram"] == flower["histogram"]
    assert sum(ours["histogram"]) <= ours["count"]
    close(ours["mean"], flower["mean"])
    (line,) = ours["_rounds"]
    assert line["query"]["messages"] == 10 and line["query"]["failed"] == 0


def test_message_api_fedavg_ends_where_flower_ends_with_its_results_per_round(
    tmp_path, flower_message_api
):
    """``flwr.serverapp.strategy.FedAvg.start`` with an ``evaluate_fn``: the same final arrays
    and Result; every aggregated train and evaluate MetricRecord and every central one
    (round 0: the initial arrays) is in that round's line of rounds.jsonl."""
    flower = flower_message_api["fedavg"]
    ours = fedsim_run("analytics", MESSAGE_API["fedavg"], 5, tmp_path)
    close(ours["final"], flower["final"])
    expected = result_sections(flower)
    assert sorted(expected) == [0, 1, 2] and sorted(expected[0]) == ["central"]
    assert sorted(expected[2]) == sorted(STRATEGY_SECTIONS)
    check_strategy_sections(ours, expected, values=True)
    for field in ("train_metrics_clientapp", "evaluate_metrics_clientapp",
                  "evaluate_metrics_serverapp"):
        assert sorted(ours[field]) == sorted(flower[field])
    lines = ours["_rounds"]
    assert lines[2]["central"]["central-mse"] < 0.1 * lines[0]["central"]["central-mse"]
    for line in lines[1:]:
        assert line["train"]["clients"] == 5 and line["evaluate"]["clients"] == 5
    assert ours["_summary"]["rounds"] == 2


@pytest.mark.parametrize("surface", ["dp-server", "dp-client"])
def test_message_api_dp_wrappers_and_client_mods_end_where_flower_ends(
    tmp_path, flower_message_api, surface
):
    """The Message API's ``DifferentialPrivacyServerSideFixedClipping`` and (with Flower's
    ``fixedclipping_mod`` behind the custom message type ``train.clipped``)
    ``DifferentialPrivacyClientSideFixedClipping``, z = 0: the same final arrays and Result
    as Flower's, the clipping moved them off plain FedAvg's, the app's own mod ran on every
    train and evaluate reply, and fedsim claims no epsilon for a mechanism it does not
    account."""
    flower = flower_message_api[surface]
    ours = fedsim_run("analytics", MESSAGE_API[surface], 5, tmp_path)
    close(ours["final"], flower["final"])
    check_strategy_sections(ours, result_sections(flower), values=True)
    assert not np.allclose(ours["final"], flower_message_api["fedavg"]["final"], atol=1e-6)
    for field in ("train_metrics_clientapp", "evaluate_metrics_clientapp"):
        assert [ours[field][r]["mod-calls"] for r in ("1", "2")] == pytest.approx([1.0, 1.0])
    for line in ours["_rounds"][1:]:
        assert line["train"]["clients"] == 5 and line["train"]["failed"] == 0
    assert "privacy" not in ours["_summary"]
    assert all("privacy" not in line for line in ours["_rounds"])


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
    # the train metrics SecAggPlusWorkflow aggregates (in clear, as Flower does) are kept
    check_strategy_sections(ours, history_sections(flower["history"]), values=False)
    assert all("train-mse" in line["aggregated"] for line in ours["_rounds"][1:])
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
