"""Epsilon of the (Poisson-)subsampled Gaussian from fedsim, Flower and Opacus, side by side.

    .venv/bin/python experiments/accounting/compare.py            # writes README.md, results.json
    .venv/bin/python experiments/accounting/compare.py --quick    # a few rows, prints only

Every accountant gets the same mechanism: ``T`` rounds (or steps) of a Gaussian with noise
multiplier ``z`` (noise std / clipping norm) on a Poisson sample with rate ``q``, add/remove
neighbours, epsilon at ``delta = 1e-5``. The accountants:

- fedsim RDP / PLD: :func:`fedsim.privacy.accounting.epsilon` (dp_accounting 0.6.0);
- Flower 1.42 ``flwr.serverapp.RdpAccountant`` configured for Poisson sampling (population
  100 000, ``q * 100 000`` expected clients per round), and the same accountant with
  ``sampling_method="no-amplification"``, the only setting Flower's
  ``DifferentialPrivacyServerSideFixedClipping`` accepts with an accountant;
- Opacus 1.6 ``RDPAccountant``, ``PRVAccountant`` (its default ``eps_error = 0.01``; the upper
  bound it returns) and ``GaussianAccountant`` (GDP, central-limit approximation).

It also measures the throughput of fedsim's noise samplers, which
``fedsim/privacy/mechanisms.py`` quotes. The README's prose is in this file; the numbers come
from the run.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import itertools
import json
import logging
import math
import os
import platform
import sys
import time
import warnings
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parents[1]))

from fedsim.privacy import accounting as acc  # noqa: E402
from fedsim.privacy import mechanisms as mech  # noqa: E402

DELTA = 1e-5
POPULATION = 100_000
RATES = (0.001, 0.01, 0.1)
NOISES = (0.8, 1.0, 1.5)
ROUNDS = (100, 1000)
#: (label, dataset size N, batch size B, noise multiplier, epochs); steps = ceil(E N / B)
#: The ``fedsim account`` sweep whose plot the README shows.
SWEEP = (
    "sweep dp-fedavg --noise-multiplier 0.8 1.0 1.5 --sampling-rate 0.01 0.05 --rounds 1000 "
    "--delta 1e-5"
).split()
SGD = (
    ("MNIST, Abadi et al. 2016", 60_000, 600, 1.1, 60),
    ("MNIST, B = 256", 60_000, 256, 1.1, 60),
    ("CIFAR-10, large batch", 50_000, 4096, 3.0, 200),
)
COLUMNS = ("fedsim_rdp", "fedsim_pld", "flower_rdp", "flower_noamp", "opacus_rdp", "opacus_prv")
COLUMNS += ("opacus_gdp",)
LABELS = {
    "fedsim_rdp": "fedsim RDP",
    "fedsim_pld": "fedsim PLD",
    "flower_rdp": "Flower RDP",
    "flower_noamp": "Flower no-amplification",
    "opacus_rdp": "Opacus RDP",
    "opacus_prv": "Opacus PRV",
    "opacus_gdp": "Opacus GDP",
}


def flower_epsilon(
    z: float, sample_size: int, population: int, steps: int, amplified: bool
) -> float:
    """Flower 1.42's RdpAccountant (a wrapper of dp_accounting's RdpAccountant); under Poisson
    sampling ``sample_size`` is the expected sample, ``q = sample_size / population``."""
    from flwr.serverapp import RdpAccountant  # noqa: PLC0415
    from flwr.supercore.privacy_accounting import (  # noqa: PLC0415
        GaussianPrivacyEvent,
        NeighboringRelation,
        PrivacyConfig,
        SamplingMethod,
    )

    config = PrivacyConfig(
        target_delta=DELTA,
        population_size=population,
        neighboring_relation=NeighboringRelation.ADD_OR_REMOVE_ONE,
        sampling_method=SamplingMethod.POISSON if amplified else SamplingMethod.NO_AMPLIFICATION,
    )
    accountant = RdpAccountant(config)
    accountant.compose(GaussianPrivacyEvent(z, sample_size, population), count=steps)
    return accountant.get_epsilon(DELTA)


def best_orders(z: float, q: float, steps: int) -> tuple[float, float]:
    """The RDP order at which dp_accounting's and Opacus's epsilon is attained."""
    import dp_accounting as dpa  # noqa: PLC0415
    from dp_accounting.rdp import RdpAccountant  # noqa: PLC0415
    from opacus.accountants import RDPAccountant  # noqa: PLC0415

    ours = RdpAccountant().compose(dpa.PoissonSampledDpEvent(q, dpa.GaussianDpEvent(z)), steps)
    opacus = RDPAccountant()
    opacus.history = [(z, q, steps)]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        _, opacus_order = opacus.get_privacy_spent(delta=DELTA)
    return float(ours.get_epsilon_and_optimal_order(DELTA)[1]), float(opacus_order)


def opacus_epsilon(kind: str, z: float, q: float, steps: int) -> float:
    from opacus.accountants import GaussianAccountant, PRVAccountant, RDPAccountant  # noqa: PLC0415

    accountant = {"rdp": RDPAccountant, "prv": PRVAccountant, "gdp": GaussianAccountant}[kind]()
    accountant.history = [(z, q, steps)]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # GDP's "experimental" warning, RDP's order warnings
        return float(accountant.get_epsilon(DELTA))


def row(
    z: float, sample_size: int, population: int, steps: int, flower_noamp: bool
) -> dict[str, float | None]:
    """Epsilon from every accountant, and the seconds each took; q = sample_size / population."""
    q = sample_size / population
    poisson = acc.PoissonSampling(q)
    calls = {
        "fedsim_rdp": lambda: acc.epsilon(z, poisson, steps, DELTA, "rdp"),
        "fedsim_pld": lambda: acc.epsilon(z, poisson, steps, DELTA, "pld"),
        "flower_rdp": lambda: flower_epsilon(z, sample_size, population, steps, True),
        "flower_noamp": (lambda: flower_epsilon(z, sample_size, population, steps, False))
        if flower_noamp
        else None,
        "opacus_rdp": lambda: opacus_epsilon("rdp", z, q, steps),
        "opacus_prv": lambda: opacus_epsilon("prv", z, q, steps),
        "opacus_gdp": lambda: opacus_epsilon("gdp", z, q, steps),
    }
    out: dict[str, float | None] = {}
    for name, call in calls.items():
        if call is None:
            out[name], out[f"{name}_s"] = None, None
            continue
        started = time.perf_counter()
        out[name] = float(call())
        out[f"{name}_s"] = time.perf_counter() - started
    out["order_dp_accounting"], out["order_opacus"] = best_orders(z, q, steps)
    return out


def throughput() -> list[dict[str, object]]:
    """Samples per second of fedsim's samplers (one thread, best of three)."""
    cases = [
        ("gaussian_noise, sigma 10, Generator", lambda n, g: mech.gaussian_noise(n, 10.0, g)),
        ("discrete_gaussian, sigma 10, Generator", lambda n, g: mech.discrete_gaussian(n, 10, g)),
        (
            "discrete_gaussian, sigma 10, secure",
            lambda n, g: mech.discrete_gaussian(n, 10, mech.SecureRandom()),
        ),
        ("skellam_noise, mu 50, Generator", lambda n, g: mech.skellam_noise(n, 50, g)),
        (
            "skellam_noise, mu 50, secure (exact)",
            lambda n, g: mech.skellam_noise(n, 50, mech.SecureRandom()),
        ),
    ]
    results = []
    for label, draw in cases:
        n = 1_000_000 if "Generator" in label else 20_000
        best = math.inf
        for seed in range(3):
            g = np.random.default_rng(seed)
            started = time.perf_counter()
            draw(n, g)
            best = min(best, time.perf_counter() - started)
        results.append({"sampler": label, "samples": n, "per_second": n / best})
    return results


# --------------------------------------------------------------------------------------------
# README
# --------------------------------------------------------------------------------------------


def fmt(value: float | None) -> str:
    if value is None:
        return "—"
    if math.isinf(value):
        return "inf"
    return f"{value:.4f}" if value < 100 else f"{value:.1f}"


HEADER = (
    "| q | z | T | fedsim RDP | fedsim PLD | Flower RDP (Poisson) | Flower, no amplification "
    "| Opacus RDP | Opacus PRV | Opacus GDP |\n"
    "|---|---|---|---|---|---|---|---|---|---|\n"
)
SGD_HEADER = (
    "| setting | N | B | q | z | epochs | steps | fedsim RDP | fedsim PLD | Flower RDP (Poisson) "
    "| Opacus RDP | Opacus PRV | Opacus GDP |\n"
    "|---|---|---|---|---|---|---|---|---|---|---|---|---|\n"
)


def table(rows: list[dict]) -> str:
    lines = []
    for r in rows:
        cells = [f"{r['q']:g}", f"{r['z']:g}", str(r["steps"])]
        cells += [fmt(r[c]) for c in COLUMNS]
        lines.append("| " + " | ".join(cells) + " |")
    return HEADER + "\n".join(lines) + "\n"


def sgd_table(rows: list[dict]) -> str:
    lines = []
    for r in rows:
        cells = [r["label"], str(r["n"]), str(r["b"]), f"{r['q']:.6g}", f"{r['z']:g}"]
        cells += [f"{r['epochs']:g}", str(r["steps"])]
        cells += [fmt(r[c]) for c in COLUMNS if c != "flower_noamp"]
        lines.append("| " + " | ".join(cells) + " |")
    return SGD_HEADER + "\n".join(lines) + "\n"


def largest_gap(rows: list[dict], a: str, b: str) -> tuple[float, dict]:
    """The largest relative difference |a - b| / b over rows, and its row."""
    best = max(rows, key=lambda r: abs(r[a] - r[b]) / r[b])
    return abs(best[a] - best[b]) / best[b], best


def readme(results: dict) -> str:
    fl, sgd = results["dp_fedavg"], results["dp_sgd"]
    everything = fl + sgd
    rel = [(r["opacus_rdp"] - r["fedsim_rdp"]) / r["fedsim_rdp"] for r in everything]
    opacus_lower = sum(d < -1e-9 for d in rel)
    opacus_higher = sum(d > 1e-9 for d in rel)
    opacus_equal = len(rel) - opacus_lower - opacus_higher
    opacus_lower_gap = -min([0.0, *rel])
    opacus_higher_gap = max([0.0, *rel])
    higher = (
        f", and higher in {opacus_higher} (at most {opacus_higher_gap * 100:.2g} %, where the "
        "best order is one of 11 or the orders above 63 that its grid lacks)"
        if opacus_higher
        else ""
    )
    prv_over_pld = [r["opacus_prv"] - r["fedsim_pld"] for r in everything]
    gdp_below = [r for r in everything if r["opacus_gdp"] < r["fedsim_pld"]]
    gdp_gap = max([0.0, *(1 - r["opacus_gdp"] / r["fedsim_pld"] for r in gdp_below)])
    above = [r for r in everything if r["opacus_gdp"] >= r["fedsim_pld"]]
    gdp_above = "; ".join(f"q = {r['q']:g}, z = {r['z']:g}, T = {r['steps']}" for r in above)
    gdp_above = f"{len(above)} ({gdp_above})" if above else "none"
    flower_gap, _ = largest_gap(everything, "flower_rdp", "fedsim_rdp")
    flower_same = (
        "identical in every row"
        if flower_gap == 0
        else f"largest relative difference {flower_gap:.1e}"
    )
    orders = [r["order_dp_accounting"] for r in everything]
    order_lo, order_hi = min(orders), max(orders)
    lower_fractional = sum(
        (r["opacus_rdp"] - r["fedsim_rdp"]) / r["fedsim_rdp"] < -1e-9
        and not float(r["order_dp_accounting"]).is_integer()
        for r in everything
    )
    pld_gain = [1 - r["fedsim_pld"] / r["fedsim_rdp"] for r in everything]
    noamp_ratio = [r["flower_noamp"] / r["fedsim_rdp"] for r in fl]
    times = {c: sum(r[f"{c}_s"] for r in everything if r[f"{c}_s"] is not None) for c in COLUMNS}
    sampler_rows = "\n".join(
        f"| {t['sampler']} | {t['per_second'] / 1e6:.3g} M |" for t in results["throughput"]
    )
    env = results["environment"]
    return f"""# Accounting: fedsim against Flower and Opacus

Epsilon (nats) at delta = {DELTA:g} of the Poisson-subsampled Gaussian mechanism, add/remove
neighbours, from every accountant we could run on the same mechanism: T rounds (DP-FedAvg,
client level) or steps (DP-SGD, example level), noise multiplier z = noise std / clipping norm,
sampling rate q. Regenerate (about {results["seconds"]:.0f} s on this machine):

```
.venv/bin/python experiments/accounting/compare.py
```

It rewrites this file and `results.json` (every epsilon and the seconds each accountant took).
Versions: {env["versions"]}; {env["machine"]}.

## DP-FedAvg (client-level): every client is in each round with probability q

{table(fl)}
## DP-SGD (example-level): Poisson batches of expected size B from N examples

steps = ceil(epochs · N / B), the same for every accountant (Opacus's `make_private_with_epsilon`
counts epochs · ceil(N / B) steps, e.g. 14100 instead of 14063 for the second row: that is a
different step count, not a different accountant).

{sgd_table(sgd)}
## What the columns are, and why they differ

- **fedsim RDP** is `fedsim account dp-fedavg|dp-sgd --accountant rdp`: dp_accounting's
  `RdpAccountant` on `PoissonSampledDpEvent(q, GaussianDpEvent(z))` composed T times, with its
  default orders (1.1 to 10.9 in steps of 0.1, 11 to 63, 128, 256, 512, 1024) and the
  RDP-to-(epsilon, delta) conversion of Canonne, Kamath & Steinke 2020 / Balle et al. 2020,
  eps = min over alpha of rdp(alpha) + log((alpha-1)/alpha) - (log delta + log alpha)/(alpha-1).
- **fedsim PLD** is `--accountant pld`: dp_accounting's `PLDAccountant` (Doroshenko et al. 2022,
  pessimistic "connect the dots" discretisation of the privacy loss, interval 1e-4). It is a
  tighter valid bound: {min(pld_gain) * 100:.0f}–{max(pld_gain) * 100:.0f} % below RDP here. The
  ε = 2.1014 (RDP) and 1.8282 (PLD) reference row is q = 0.01, z = 1, T = 1000.
- **Flower RDP (Poisson)** is Flower 1.42's own `flwr.serverapp.RdpAccountant` with
  `sampling_method="poisson"`. It wraps the same dp_accounting `RdpAccountant` with the same
  default orders, so it equals fedsim RDP ({flower_same}). Flower 1.42 does ship an
  amplified accountant; what it does not do is use it in its DP strategies:
- **Flower, no amplification** is the same accountant with `sampling_method="no-amplification"`,
  which is what `DifferentialPrivacyServerSideFixedClipping` requires when an accountant is
  passed (it raises otherwise; the adaptive-clipping strategies and `LocalDpMod` take no
  accountant). Every round is then a full Gaussian release, whatever fraction of clients it
  samples, so epsilon no longer depends on q: {min(noamp_ratio):.1f}× to
  {max(noamp_ratio):.0f}× the amplified value here. This is the number a Flower DP-FedAvg run
  reports; fedsim's DP-FedAvg records the sampled event and reports the amplified one.
- **Opacus RDP** (`opacus.accountants.RDPAccountant`) uses the same conversion formula, its
  own copy of the subsampled-Gaussian RDP code (Mironov, Talwar & Zhang 2019) and a coarser
  order grid: 1.1 to 10.9, 12 to 63 (no 11, nothing above 63). At integer orders both compute
  the same finite sum and agree to the last digit. At fractional orders the RDP is an infinite
  series whose terms change sign; Opacus adds and subtracts them by sign (the series itself),
  dp_accounting 0.6 adds their absolute values (`_log_comb` is log |binomial|), a larger and
  still valid bound. Opacus is lower in {opacus_lower} of {len(rel)} rows (at most
  {opacus_lower_gap * 100:.2g} %; the best order is fractional in {lower_fractional} of them)
  and equal (to a relative 1e-9) in {opacus_equal}{higher}. The best order here is
  {order_lo:g} to {order_hi:g}, inside both grids; where it lies above 63 (large z with a small
  q T) Opacus warns that the optimum is at the edge of its grid and its bound is looser.
- **Opacus PRV** (`PRVAccountant`, Gopi, Lee & Wutschitz 2021) discretises the privacy loss
  random variable on a grid sized for `eps_error = 0.01`, `delta_error = delta/1000`, and
  returns the upper end of its error interval. It bounds the same quantity as the PLD
  accountant with a different discretisation; it lies {min(prv_over_pld):+.4f} to
  {max(prv_over_pld):+.4f} from fedsim PLD here, i.e. within its stated error of 0.01.
- **Opacus GDP** (`GaussianAccountant`, Bu et al. 2020) is a central-limit approximation
  (mu-GDP), not an upper bound: Opacus itself warns that it can underestimate. Here it is below
  the PLD bound in {len(gdp_below)} of {len(everything)} rows, by up to {gdp_gap * 100:.0f} %.
  Gaps that large are far beyond the 0.01 or so by which two independent discretisations of
  the exact privacy loss (PLD, PRV) differ: GDP understates epsilon there. It is above PLD in
  {gdp_above}.
  fedsim does not offer it.

Seconds each accountant took for all {len(everything)} rows (one thread, shared machine):
{", ".join(f"{LABELS[c]} {t:.1f}" for c, t in times.items())}.

## The sweep plot

`sweep.png`, written by the same run with
`fedsim account {" ".join(SWEEP)} --plot experiments/accounting/sweep.png`:

![epsilon against rounds](sweep.png)

## Noise samplers

Samples per second of `fedsim.privacy.mechanisms` (one thread, best of three runs). The
discrete Gaussian is the exact sampler of Canonne, Kamath & Steinke 2020: with a Generator it
runs over numpy arrays (float64 acceptance tests, with the rare near-ties settled in exact
arithmetic); secure mode reads `os.urandom` and runs one sample at a time in integer
arithmetic. The exact Skellam (secure mode) draws two exact Poisson variates of about
sqrt(mu) uniform integers each; with a Generator it uses numpy's Poisson.

| sampler | samples / s |
|---|---|
{sampler_rows}
"""


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="three rows, print, write nothing")
    args = parser.parse_args()
    logging.getLogger("absl").setLevel(logging.ERROR)
    started = time.perf_counter()
    settings = list(itertools.product(RATES, NOISES, ROUNDS))
    if args.quick:
        settings = [(0.01, 1.0, 1000), (0.001, 1.5, 100), (0.1, 0.8, 100)]
    fl = []
    for q, z, steps in settings:
        with contextlib.redirect_stderr(io.StringIO()):
            r = row(z, round(q * POPULATION), POPULATION, steps, flower_noamp=True)
        fl.append({"q": q, "z": z, "steps": steps, **r})
        print(" ".join(f"{c}={fmt(r[c])}" for c in COLUMNS), f"q={q} z={z} T={steps}", flush=True)
    sgd = []
    for label, n, b, z, epochs in SGD if not args.quick else SGD[:1]:
        steps, q = math.ceil(epochs * n / b), b / n
        with contextlib.redirect_stderr(io.StringIO()):
            r = row(z, b, n, steps, flower_noamp=False)
        sgd.append({"label": label, "n": n, "b": b, "z": z, "epochs": epochs, "q": q})
        sgd[-1].update(steps=steps, **r)
        print(" ".join(f"{c}={fmt(r[c])}" for c in COLUMNS), label, flush=True)
    if args.quick:
        return 0
    from fedsim.cli import main as fedsim  # noqa: PLC0415

    if fedsim(["account", *SWEEP, "--plot", str(HERE / "sweep.png")]) != 0:
        raise RuntimeError("fedsim account sweep failed")
    speeds = throughput()
    for t in speeds:
        print(f"{t['sampler']}: {t['per_second']:.3g} samples/s")
    from importlib.metadata import version  # noqa: PLC0415

    results = {
        "delta": DELTA,
        "dp_fedavg": fl,
        "dp_sgd": sgd,
        "throughput": speeds,
        "seconds": time.perf_counter() - started,
        "environment": {
            "versions": ", ".join(
                f"{p} {version(p)}" for p in ("dp-accounting", "flwr", "opacus", "numpy")
            )
            + f", Python {platform.python_version()}",
            "machine": f"{os.cpu_count()}-CPU {platform.machine()} {platform.system()}",
        },
    }
    (HERE / "results.json").write_text(json.dumps(results, indent=2) + "\n")
    (HERE / "README.md").write_text(readme(results))
    print(f"wrote {HERE / 'README.md'} and results.json in {results['seconds']:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
