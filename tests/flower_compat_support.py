"""One Flower app project run two ways, for the compatibility suite
(tests/frontend/test_flower_compat.py): under ``fedsim flwr-run`` and under Flower's own
``flwr.simulation.run_simulation``.

``run_simulation`` takes no run config (``flwr run`` fuses it into the ``Run`` it makes), so
the Flower side hands the app's ServerApp and ClientApp the config ``flwr run`` would: the
project's ``[tool.flwr.app.config]`` with the overrides, the same one fedsim's run gets.
Each app writes what it computed to its ``output-path`` (JSON); both are returned.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

from fedsim.cli import main

ROOT = Path(__file__).resolve().parents[1]
APPS = ROOT / "tests" / "apps"

FLOWER_RUN = r"""
import json
import sys
from pathlib import Path

from flwr.app import Context
from flwr.clientapp import ClientApp
from flwr.common.config import flatten_dict, get_project_config
from flwr.serverapp import ServerApp
from flwr.simulation import run_simulation
from flwr.supercore.object_ref import load_app

app_dir, runs, nodes = Path(sys.argv[1]), json.loads(sys.argv[2]), int(sys.argv[3])
project = get_project_config(app_dir)
components = project["tool"]["flwr"]["app"]["components"]
defaults = flatten_dict(project["tool"]["flwr"]["app"]["config"])
configs = [{**defaults, **overrides} for overrides in runs]
inner_server = load_app(components["serverapp"], ValueError, str(app_dir))
inner_client = load_app(components["clientapp"], ValueError, str(app_dir))


def with_config(context, run_config):
    # the context `flwr run` would make: the same node, state (shared) and this run config
    return Context(run_id=context.run_id, node_id=context.node_id,
                   node_config=context.node_config, state=context.state,
                   run_config=dict(run_config))


class Configured(ClientApp):
    # the app's ClientApp, called with the run config `flwr run` would give it
    def __init__(self, inner, run_config):
        self.inner, self.run_config = inner, run_config

    def __call__(self, message, context):
        return self.inner(message, with_config(context, self.run_config))


server = ServerApp()


@server.main()
def main(grid, context):
    for config in configs:  # one ServerApp run per config, on the same nodes
        inner_server(grid, with_config(context, config))


run_simulation(
    server_app=server,
    client_app=Configured(inner_client, configs[0]),
    num_supernodes=nodes,
    # address "local": a Ray of its own, as `flwr run` starts on a machine without one (with
    # no address Ray joins whatever cluster a `ray start` here last left behind, and with
    # num_cpus given to it Flower's backend never starts: the run waits forever)
    backend_config={"client_resources": {"num_cpus": 1, "num_gpus": 0.0},
                    "init_args": {"address": "local", "num_cpus": 2,
                                  "logging_level": "WARNING"}},
)
"""

#: seconds one Flower process may take (below pytest's per-test 900: a hung Flower run fails
#: with its own output)
FLOWER_TIMEOUT_S = 600
#: the run config keys the ClientApps read must be the same in every run of one Flower process
CLIENT_KEYS = ("local-steps", "lr")


def flower_runs(
    app: str, runs: dict[str, dict[str, Any]], nodes: int, tmp: Path
) -> dict[str, dict[str, Any]]:
    """What the app wrote under Flower's ``run_simulation`` (its own Ray backend) for each
    named set of overrides: one Flower run whose ServerApp runs the app's ServerApp once per
    set, on the same nodes (a Ray start here costs about a minute; one serves them all)."""
    for key in CLIENT_KEYS:
        if len({repr(overrides.get(key)) for overrides in runs.values()}) > 1:
            raise ValueError(f"runs of one Flower process must agree on {key!r}")
    tmp.mkdir(parents=True, exist_ok=True)
    script = tmp / "flower_run.py"
    script.write_text(textwrap.dedent(FLOWER_RUN))
    outputs = {name: tmp / f"flower-{name}.json" for name in runs}
    given = [{**overrides, "output-path": str(outputs[n])} for n, overrides in runs.items()]
    app_dir = APPS / app
    env = dict(
        {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"},
        PYTHONPATH=os.pathsep.join([str(ROOT), str(app_dir)]),
        RAY_ACCEL_ENV_VAR_OVERRIDE_ON_ZERO="0",
        RAY_USAGE_STATS_ENABLED="0",
    )
    try:
        done = subprocess.run(
            [sys.executable, str(script), str(app_dir), json.dumps(given), str(nodes)],
            env=env, capture_output=True, text=True, timeout=FLOWER_TIMEOUT_S,
        )
    except subprocess.TimeoutExpired as err:  # Flower's output, not pytest's timeout
        raise AssertionError(
            f"Flower's run_simulation did not finish in {FLOWER_TIMEOUT_S} s",
            text_of(err.stdout)[-2000:], text_of(err.stderr)[-4000:],
        ) from err
    missing = [name for name, path in outputs.items() if not path.exists()]
    assert not missing, (missing, done.stdout[-2000:], done.stderr[-4000:])
    return {name: json.loads(path.read_text()) for name, path in outputs.items()}


def text_of(output: str | bytes | None) -> str:
    """A subprocess's output as text (a timed-out run's is bytes, whatever ``text`` said)."""
    if isinstance(output, bytes):
        return output.decode(errors="replace")
    return output or ""


def toml_value(value: Any) -> str:
    return json.dumps(value) if isinstance(value, str) else str(value).lower() if isinstance(
        value, bool) else repr(value)


def fedsim_run(
    app: str, overrides: dict[str, Any], nodes: int, tmp: Path, *extra: str
) -> dict[str, Any]:
    """What the app wrote under ``fedsim flwr-run`` (``extra``: more flags; default the
    in-process backend), with the run's rounds.jsonl lines and summary.json."""
    out, written = tmp / "fedsim-run", tmp / "fedsim.json"
    given = {**overrides, "output-path": str(written)}
    pairs = " ".join(f"{k}={toml_value(v)}" for k, v in given.items())
    flags = list(extra) or ["--backend", "local"]
    argv = ["flwr-run", str(APPS / app), "--num-supernodes", str(nodes), "--no-progress",
            "--out", str(out), "--run-config", pairs, *flags]
    assert main(argv) == 0
    result = json.loads(written.read_text())
    lines = (out / "rounds.jsonl").read_text().splitlines()
    result["_rounds"] = [json.loads(line) for line in lines]
    result["_summary"] = json.loads((out / "summary.json").read_text())
    return result
