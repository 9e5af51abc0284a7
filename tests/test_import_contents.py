"""What importing fedsim loads (issue 21, point 2): module *contents*, never time.

Each check runs in a fresh interpreter, so what another test imported does not count:

* ``import fedsim.cli`` and ``fedsim --help`` load neither the text extra (transformers,
  peft, sentence-transformers, gguf), Opacus, matplotlib, Ray, torch nor dp_accounting:
  a command that needs one of them imports it when it runs;
* a logistic-regression FedAvg run (config parsed, dataset, model, strategy, ClientApp and
  the engine built, one round trained in-process) loads neither the text extra nor Opacus;
* a worker process (``fedsim.engine.worker``) loads none of the driver's modules (grid,
  cohorts, privacy accounting, strategies), and ``fedsim flwr-run``'s driver
  (``fedsim.frontend.flwr_app``) neither dp_accounting nor the strategies;
* a method that needs the text extra says so when it is missing.
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from fedsim.extras import EXTRAS, MissingExtra, require_extra

ROOT = Path(__file__).resolve().parents[1]

TEXT_STACK = ("transformers", "peft", "sentence_transformers", "gguf")
HEAVY_FOR_CLI = (*TEXT_STACK, "opacus", "matplotlib", "ray", "torch", "dp_accounting", "scipy")

LOGREG_FEDAVG = """
name = "imports"
seed = 0
rounds = 1

[data]
source = "digits"
partition = "iid"
num_clients = 20
test_fraction = 0.2

[model]
kind = "logreg"

[client]
epochs = 1
batch_size = 8
lr = 0.1

[strategy]
name = "fedavg"
clients_per_round = 4

[engine]
backend = "local"
"""


def loaded_after(code: str, watched: tuple[str, ...]) -> dict[str, bool]:
    """Run ``code`` in a fresh interpreter; which of ``watched`` are in sys.modules after."""
    script = textwrap.dedent(code) + textwrap.dedent(
        f"""
        import json, sys
        print(json.dumps({{m: m in sys.modules for m in {list(watched)!r}}}))
        """
    )
    done = subprocess.run(
        [sys.executable, "-c", script],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=False,
        env={**_env(), "PYTHONPATH": str(ROOT)},
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def _env() -> dict[str, str]:
    import os  # noqa: PLC0415

    return {**os.environ, "RAY_ACCEL_ENV_VAR_OVERRIDE_ON_ZERO": "0"}


def test_importing_the_cli_loads_no_heavy_package():
    loaded = loaded_after("import fedsim.cli", HEAVY_FOR_CLI)
    assert not any(loaded.values()), [m for m, yes in loaded.items() if yes]


def test_fedsim_help_loads_no_heavy_package():
    code = """
        import contextlib, io
        from fedsim.cli import main
        out = io.StringIO()
        with contextlib.redirect_stdout(out):
            try:
                main(["--help"])
            except SystemExit as exit:
                assert exit.code == 0, exit.code
        assert "flwr-run" in out.getvalue() and "account" in out.getvalue()
    """
    loaded = loaded_after(code, HEAVY_FOR_CLI)
    assert not any(loaded.values()), [m for m, yes in loaded.items() if yes]


def test_a_logreg_fedavg_run_loads_neither_the_text_extra_nor_opacus(tmp_path):
    config = tmp_path / "logreg.toml"
    config.write_text(LOGREG_FEDAVG)
    code = f"""
        import json
        from pathlib import Path
        from fedsim.frontend.experiment import run_experiment
        from fedsim.randomness import RunSecret
        from fedsim.frontend.run_config import ExperimentConfig
        config = ExperimentConfig.load({str(config)!r})
        summary = run_experiment(
            config, Path({str(tmp_path / "out")!r}), progress=False, secrets=RunSecret.fresh()
        )
        assert summary["rounds"] == 1 and summary["clients_trained"] == 4, summary
    """
    watched = (*TEXT_STACK, "opacus", "torch", "fedsim.engine.simulation")
    loaded = loaded_after(code, watched)
    # the run really ran: the engine and torch are loaded, the optional stacks are not
    assert loaded["torch"] and loaded["fedsim.engine.simulation"], loaded
    assert not any(loaded[m] for m in (*TEXT_STACK, "opacus")), loaded


def test_a_worker_process_loads_none_of_the_drivers_modules():
    driver_side = (
        "fedsim.engine.grid",
        "fedsim.engine.participation",
        "fedsim.engine.simulation",
        "fedsim.privacy.sampling",
        "dp_accounting",
        "strategies",
        "ray",
    )
    loaded = loaded_after("import fedsim.engine.worker", driver_side)
    assert not any(loaded.values()), [m for m, yes in loaded.items() if yes]
    # the package still exports the driver's names, loaded on first use
    loaded = loaded_after("from fedsim.engine import UniformCohort", driver_side)
    assert loaded["fedsim.engine.participation"] and not loaded["dp_accounting"]
    loaded = loaded_after(
        "from fedsim.engine import UniformCohort\nUniformCohort(10, 2, 0).accounting(1)",
        driver_side,
    )
    assert loaded["dp_accounting"]


def test_a_warmed_up_worker_loads_none_of_the_drivers_modules():
    """The Ray backend's worker (a resettable one) imports torch, Flower's client side and
    fedsim's data and models as it starts: still nothing of the driver's."""
    driver_side = (
        "fedsim.engine.grid",
        "fedsim.engine.participation",
        "fedsim.engine.simulation",
        "fedsim.privacy.accounting",
        "dp_accounting",
        "strategies",
        "torch",
    )
    code = "from fedsim.engine.worker_reset import ResettableWorker\nResettableWorker(1).warm_up()"
    loaded = loaded_after(code, driver_side)
    assert loaded.pop("torch"), "warm_up imported no torch"
    assert not any(loaded.values()), [m for m, yes in loaded.items() if yes]


def test_the_flower_app_driver_loads_no_accounting_and_no_text_stack():
    watched = (*TEXT_STACK, "opacus", "dp_accounting", "scipy", "strategies", "ray")
    loaded = loaded_after("import fedsim.frontend.flwr_app", watched)
    assert not any(loaded.values()), [m for m, yes in loaded.items() if yes]


def test_factorize_help_lists_every_kind():
    import argparse  # noqa: PLC0415

    from fedsim.commands import factorize  # noqa: PLC0415
    from fedsim.privacy.matrix.kinds import REGISTERED  # noqa: PLC0415

    parser = factorize.register(argparse.ArgumentParser().add_subparsers())
    help_text = " ".join(parser.format_help().split())
    assert "--kind KIND one of " + ", ".join(REGISTERED) in help_text, help_text


def test_a_missing_extra_names_the_method_and_the_install_command():
    with pytest.raises(MissingExtra) as err:
        require_extra("POPri", modules=("transformers", "fedsim_no_such_module"))
    message = str(err.value)
    assert message.startswith("POPri needs the text extra: pip install 'fedsim[text]'")
    assert "fedsim_no_such_module" in message and "transformers," not in message
    with pytest.raises(ValueError, match="extra = 'nope' is not allowed"):
        require_extra("POPri", extra="nope")
    require_extra("POPri")  # the extra is installed here: no error
    assert set(EXTRAS["text"]) >= set(TEXT_STACK)


def test_a_text_method_without_the_extra_fails_with_the_install_command(monkeypatch):
    import importlib.util  # noqa: PLC0415

    from fedsim.models import ModelSpec  # noqa: PLC0415
    from fedsim.workloads.coto import LoRATraining, build_lora_model  # noqa: PLC0415

    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == "peft" else real(name, *a)
    )
    spec = ModelSpec(kind="mlp", input_shape=(8,), num_classes=3, hidden=(4,))
    with pytest.raises(MissingExtra, match=r"needs the text extra: pip install 'fedsim\[text\]'"):
        build_lora_model(spec, LoRATraining())
