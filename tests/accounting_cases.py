"""The accounting cases of the differential check (tests/privacy/test_accounting_differential.py).

Each case is computed through the public API -- epsilon, epsilon curves, noise calibration,
ledgers of DP-FedAvg, DDGauss, DMM and the matrix mechanism, and ``fedsim account`` -- and
stored in ``tests/privacy/accounting_baseline.json``; refactors of the accounting code must keep
every value. ``python tests/accounting_cases.py`` rewrites that file.
"""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path
from types import SimpleNamespace

ROOT = Path(__file__).resolve().parent.parent
BASELINE = ROOT / "tests" / "privacy" / "accounting_baseline.json"
DELTA = 1e-5


def _samplings(acc):
    return {
        "poisson": (acc.PoissonSampling(0.02), "add_remove"),
        "fixed": (acc.FixedSizeSampling(20, 1000), "replace_one"),
        "full": (acc.FullParticipation(), "add_remove"),
        "full_replace": (acc.FullParticipation(), "replace_one"),
        "minsep": (acc.Participation.separated(5, 3), "add_remove"),
    }


def _fedavg_cases(acc) -> dict[str, float]:
    out: dict[str, float] = {}
    for name, (sampling, relation) in _samplings(acc).items():
        for accountant in ("rdp", "pld"):
            if name == "fixed" and accountant == "pld":
                continue  # no dp_accounting event (module docstring)
            for z in (0.7, 1.3):
                key = f"epsilon/{name}/{accountant}/z={z}"
                out[key] = acc.epsilon(z, sampling, 40, DELTA, accountant, relation)
            curve = acc.epsilon_curve(1.1, sampling, [1, 7, 30], DELTA, accountant, relation)
            for r, e in zip((1, 7, 30), curve, strict=True):
                out[f"curve/{name}/{accountant}/r={r}"] = e
            out[f"calibrate/{name}/{accountant}"] = acc.calibrate_noise(
                3.0, DELTA, sampling, 40, accountant, relation
            )
    out["epsilon/poisson_replace/pld"] = acc.epsilon(
        1.0, acc.PoissonSampling(0.05), 20, DELTA, "pld", "replace_one"
    )
    adaptive = acc.adaptive_clipping_round_event(1.0, 5.0, acc.PoissonSampling(0.03))
    ledger = acc.PrivacyLedger("add_remove", DELTA)
    for r in range(1, 11):
        ledger.record(r, adaptive)
    for accountant in ("rdp", "pld"):
        out[f"ledger/adaptive/{accountant}"] = ledger.epsilon(accountant=accountant)
    return out


def _ddgauss_dmm_cases(acc) -> dict[str, float]:
    from fedsim.privacy import ddgauss, dmm  # noqa: PLC0415

    out: dict[str, float] = {}
    for relation in ("add_remove", "replace_one"):
        ledger = acc.PrivacyLedger(relation, DELTA)
        for r in range(1, 6):
            ledger.record(r, ddgauss.round_event(50.0, 400.0, 20.0, 10 + r, 64))
        out[f"ledger/ddgauss/{relation}/rdp"] = ledger.epsilon(accountant="rdp")
        ledger = acc.PrivacyLedger(relation, DELTA)
        previous = 0.0
        for r, eps in enumerate((0.1, 0.15, 0.15, 0.22, 0.3), start=1):
            ledger.record(r, dmm.increment_event(previous, eps))
            previous = max(previous, eps)
        out[f"ledger/dmm/{relation}/rdp"] = ledger.epsilon(accountant="rdp")
        out[f"ledger/dmm/{relation}/rdp_if"] = ledger.epsilon_if(
            dmm.increment_event(previous, 0.4), accountant="rdp"
        )
    return out


def _matrix_cases(acc, tmp: Path) -> dict[str, float]:
    from fedsim.privacy.matrix.build import Spec, build  # noqa: PLC0415

    out: dict[str, float] = {}
    specs = {
        "tree": Spec("tree", 16),
        "bandmf": Spec("banded", 16, participations=2, min_sep=8),
    }
    for name, spec in specs.items():
        path = tmp / f"{name}.npz"
        build(spec).save(path)
        for accountant in ("rdp", "pld"):
            result = _cli(["account", "matrix", "--factorization", str(path),
                           "--noise-multiplier", "1.2", "--rounds", "10", "--delta", "1e-5",
                           "--accountant", accountant])
            out[f"cli/matrix/{name}/{accountant}"] = result["epsilon"]
    ledger = acc.PrivacyLedger("add_remove", DELTA, acc.Participation.separated(4, 3))
    for r in range(1, 13):
        ledger.record(r, acc.round_event(0.9 + 0.05 * (r % 3), acc.FullParticipation()))
    for accountant in ("rdp", "pld"):
        out[f"ledger/minsep/{accountant}"] = ledger.epsilon(accountant=accountant)
    return out


def _cli(argv: list[str]) -> dict:
    import contextlib  # noqa: PLC0415
    import io  # noqa: PLC0415

    from fedsim.cli import main  # noqa: PLC0415

    buffer = io.StringIO()
    with contextlib.redirect_stdout(buffer):
        code = main([*argv, "--json"])
    if code != 0:
        raise RuntimeError(f"fedsim {' '.join(argv)} exited {code}")
    return json.loads(buffer.getvalue())


def _cli_cases() -> dict[str, float]:
    common = ["--delta", "1e-5"]
    fedavg = ["--sampling-rate", "0.01", "--rounds", "300", *common]
    out: dict[str, float] = {}
    for accountant in ("rdp", "pld"):
        a = ["--accountant", accountant]
        out[f"cli/dp-fedavg/{accountant}"] = _cli(
            ["account", "dp-fedavg", "--noise-multiplier", "1", *fedavg, *a]
        )["epsilon"]
        out[f"cli/dp-sgd/{accountant}"] = _cli(
            ["account", "dp-sgd", "--noise-multiplier", "1.1", "--batch-size", "256",
             "--dataset-size", "60000", "--epochs", "2", *common, *a]
        )["epsilon"]
        out[f"cli/calibrate/dp-fedavg/{accountant}"] = _cli(
            ["account", "calibrate", "dp-fedavg", "--target-epsilon", "2", *fedavg, *a]
        )["noise_multiplier"]
    out["cli/dp-fedavg/fixed/rdp"] = _cli(
        ["account", "dp-fedavg", "--noise-multiplier", "1", "--sampling", "fixed",
         "--population", "1000", *fedavg]
    )["epsilon"]
    return out


def _api() -> SimpleNamespace:
    """The public accounting names, wherever they live."""
    from fedsim.privacy import (  # noqa: PLC0415
        calibration,
        epsilon,
        ledger,
        participation,
        round_events,
        sampling,
    )

    return SimpleNamespace(
        **{
            name: getattr(module, name)
            for module in (calibration, epsilon, ledger, participation, round_events, sampling)
            for name in dir(module)
            if not name.startswith("_")
        }
    )


def compute(tmp: Path) -> dict[str, float]:
    """Every case's value (epsilon in nats, or a calibrated noise multiplier)."""
    acc = _api()
    values = {
        **_fedavg_cases(acc),
        **_ddgauss_dmm_cases(acc),
        **_matrix_cases(acc, tmp),
        **_cli_cases(),
    }
    assert all(math.isfinite(v) for v in values.values()), values
    return values


if __name__ == "__main__":
    import tempfile

    sys.path.insert(0, str(ROOT))
    with tempfile.TemporaryDirectory() as tmp:
        values = compute(Path(tmp))
    BASELINE.write_text(json.dumps(values, indent=1, sort_keys=True) + "\n")
    print(f"{len(values)} values -> {BASELINE}")
