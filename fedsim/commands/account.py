"""The ``fedsim account`` command: epsilon, noise calibration and sweeps from the shell.

    fedsim account dp-fedavg --noise-multiplier Z --sampling-rate Q --rounds T --delta D
                             [--accountant rdp|pld] [--sampling poisson|fixed|full]
                             [--population N] [--relation add_remove|replace_one]
    fedsim account dp-sgd --noise-multiplier Z --batch-size B --dataset-size N --epochs E
                          --delta D [--accountant rdp|pld|prv]
    fedsim account calibrate {dp-fedavg|dp-sgd} --target-epsilon E ...  (the same flags minus
                          --noise-multiplier)
    fedsim account sweep {dp-fedavg|dp-sgd} --noise-multiplier Z1 Z2 ... --plot FILE.png
                          [--sampling-rate Q1 Q2 ... | --batch-size B1 B2 ...] [--points P] ...
    fedsim account matrix --factorization FILE.npz --noise-multiplier Z --delta D
                          [--participations K --min-sep S] [--rounds T] [--accountant rdp|pld]

The main CLI calls :func:`register` to add the subcommand and :func:`run` to execute it; every
leaf command has ``--json``: the main CLI prints :func:`run`'s dict as JSON when it is set,
else :func:`format_text`. Bad input raises :class:`~fedsim.config.ConfigError` whose key is the
flag (``--delta``, ``--sampling-rate``, ...).

``--sampling fixed`` takes ``round(Q * N)`` of ``N`` clients per round without replacement,
which dp_accounting accounts (RDP only) for replace-one neighbours, the default relation there;
``poisson`` and ``full`` default to add/remove. All epsilons come from dp_accounting
(:mod:`fedsim.privacy.epsilon`), except ``fedsim account dp-sgd --accountant prv``:
dp_accounting 0.6.0 ships RDP and PLD accountants only, so PRV (privacy random variables,
Gopi, Lee & Wutschitz 2021) is Opacus's ``PRVAccountant``, the one a ``[client.dp_sgd]``
client with ``accountant = "prv"`` reports (its upper bound, eps_error 0.01).
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import math
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from fedsim.commands.account_mechanisms import (
    MECHANISMS,
    PLD_MIN_NOISE,
    check_common,
    check_noise,
    common_args,
)
from fedsim.commands.flags import flags
from fedsim.config import ConfigError, require

if TYPE_CHECKING:  # dp_accounting (and scipy) load when a subcommand runs, not for --help
    from fedsim.privacy.sampling import NeighbouringRelation, Sampling


def register(subparsers: Any) -> argparse.ArgumentParser:
    """Add the ``account`` command (with its subcommands) to ``subparsers``."""
    account = subparsers.add_parser(
        "account",
        help="privacy accounting: epsilon, noise calibration, sweeps",
        description="Privacy accounting with dp_accounting's RDP and PLD accountants "
        "(and Opacus's PRV accountant for dp-sgd).",
    )
    commands = account.add_subparsers(dest="account_command", required=True)
    for name, mechanism in MECHANISMS.items():
        parser = commands.add_parser(name, help=f"epsilon of {name}")
        parser.add_argument(
            "--noise-multiplier",
            type=float,
            required=True,
            help="z = noise std / clipping norm, > 0",
        )
        mechanism.add_args(parser, many=False)
        parser.set_defaults(mechanism=name)

    calibrate = commands.add_parser("calibrate", help="noise multiplier for a target epsilon")
    mechanisms = calibrate.add_subparsers(dest="mechanism", required=True)
    for name, mechanism in MECHANISMS.items():
        parser = mechanisms.add_parser(name, help=f"calibrate {name}")
        parser.add_argument(
            "--target-epsilon", type=float, required=True, help="the epsilon to meet, > 0"
        )
        mechanism.add_args(parser, many=False)

    sweep = commands.add_parser("sweep", help="epsilon against rounds, as JSON and a PNG plot")
    mechanisms = sweep.add_subparsers(dest="mechanism", required=True)
    for name, mechanism in MECHANISMS.items():
        parser = mechanisms.add_parser(name, help=f"sweep {name}")
        parser.add_argument(
            "--noise-multiplier",
            type=float,
            nargs="+",
            required=True,
            help="one or more noise multipliers",
        )
        mechanism.add_args(parser, many=True)
        parser.add_argument("--plot", required=True, help="PNG file to write")
        parser.add_argument("--points", type=int, default=50, help="points per curve (default 50)")

    _add_matrix(commands)
    return account


def _add_matrix(commands: Any) -> None:
    """``fedsim account matrix``: epsilon and error of a factorization file."""
    matrix = commands.add_parser("matrix", help="epsilon and error of a matrix mechanism")
    matrix.add_argument(
        "--factorization", required=True, help="an .npz written by fedsim factorize"
    )
    matrix.add_argument(
        "--noise-multiplier",
        type=float,
        required=True,
        help="z = noise std / (clipping norm * sensitivity), > 0",
    )
    matrix.add_argument("--participations", type=int, default=None, help="k (default: the file's)")
    matrix.add_argument("--min-sep", type=int, default=None, help="b (default: the file's)")
    matrix.add_argument(
        "--rounds", type=int, default=None, help="epsilon after the first T rounds (default n)"
    )
    common_args(matrix, relation=True)


# --------------------------------------------------------------------------------------------
# Commands
# --------------------------------------------------------------------------------------------


def _epsilon(args: argparse.Namespace) -> dict[str, Any]:
    from fedsim.privacy.epsilon import epsilon  # noqa: PLC0415

    delta, accountant = check_common(args)
    z = check_noise(args.noise_multiplier, accountant)
    mechanism = MECHANISMS[args.mechanism]
    sampling, relation, echo, rounds = mechanism.setting(args, mechanism.value(args))
    if accountant == "prv":  # dp-sgd: Poisson sampling at q = B / N, add/remove
        eps = _prv_epsilon(z, echo["sampling_rate"], rounds, delta)
    else:
        with flags(mechanism.flags):
            eps = epsilon(z, sampling, rounds, delta, accountant, relation)
    return {
        "command": args.mechanism,
        "epsilon": eps,
        "delta": delta,
        "accountant": accountant,
        "noise_multiplier": z,
        **echo,
    }


def _prv_epsilon(z: float, q: float, steps: int, delta: float) -> float:
    """Opacus's PRV epsilon (upper bound) of ``steps`` Poisson-sampled Gaussian steps, the
    value a ``[client.dp_sgd]`` client with ``accountant = "prv"`` reports."""
    from fedsim.workloads.dp_sgd import client_epsilon  # noqa: PLC0415

    return client_epsilon([(z, q, steps)], delta, "prv")


def _calibrate(args: argparse.Namespace) -> dict[str, Any]:
    from fedsim.privacy.calibration import calibrate_noise  # noqa: PLC0415
    from fedsim.privacy.epsilon import epsilon  # noqa: PLC0415

    delta, accountant = check_common(args)
    target = args.target_epsilon
    require(
        isinstance(target, (int, float)) and math.isfinite(target) and target > 0,
        "--target-epsilon",
        target,
        "a finite number > 0",
    )
    mechanism = MECHANISMS[args.mechanism]
    sampling, relation, echo, rounds = mechanism.setting(args, mechanism.value(args))
    mechanism.check_length(args, "calibrate")
    with flags(mechanism.flags):
        if accountant == "pld":  # PLD's answer lies below RDP's: refuse before PLD sees tiny z
            z_rdp = _rdp_calibration(float(target), delta, sampling, rounds, relation)
            require(
                z_rdp is None or z_rdp >= PLD_MIN_NOISE,
                "--target-epsilon",
                target,
                f"a target that needs a noise multiplier >= {PLD_MIN_NOISE:g} with --accountant "
                f"pld (rdp calibrates it to {z_rdp:.4g}; use --accountant rdp)",
            )
        z = calibrate_noise(float(target), delta, sampling, rounds, accountant, relation)
        eps = epsilon(z, sampling, rounds, delta, accountant, relation)
    return {
        "command": "calibrate",
        "mechanism": args.mechanism,
        "target_epsilon": float(target),
        "noise_multiplier": z,
        "epsilon": eps,
        "delta": delta,
        "accountant": accountant,
        **echo,
    }


def _rdp_calibration(
    target: float,
    delta: float,
    sampling: Sampling,
    rounds: int,
    relation: NeighbouringRelation,
) -> float | None:
    """The RDP calibration of the setting, or None where RDP does not account it."""
    from fedsim.privacy.calibration import calibrate_noise  # noqa: PLC0415

    try:
        return calibrate_noise(target, delta, sampling, rounds, "rdp", relation)
    except ConfigError as err:
        if err.key == "target_epsilon":
            raise  # out of range for RDP: out of range for PLD too
        return None


def _factorization(args: argparse.Namespace) -> tuple[Path, Any, Any]:
    """``--factorization``'s path, its :class:`~fedsim.privacy.matrix.Factorization` and the
    spec it was built for (its participation, unless the flags say otherwise)."""
    from fedsim.privacy.matrix import Factorization  # noqa: PLC0415
    from fedsim.privacy.matrix.build import spec_of  # noqa: PLC0415

    path = Path(args.factorization)
    require(path.is_file(), "--factorization", args.factorization, "an existing .npz file")
    try:
        f = Factorization.load(path)
        return path, f, spec_of(f, str(path))
    except ConfigError as err:
        raise ConfigError("--factorization", args.factorization, err.allowed) from None


def _matrix_epsilon(
    f: Any,
    z: float,
    separation: tuple[int | None, int | None],
    rounds: int,
    delta: float,
    accountant: str,
    relation: Any,
) -> tuple[Any, Any, Any, float, float]:
    """The participation ``(k, b)`` describes (``(None, None)``: one), the sensitivity of
    ``f`` under it (all rows, and those released after ``rounds``), the effective noise
    multiplier and epsilon after ``rounds``."""
    from fedsim.privacy.epsilon import epsilon  # noqa: PLC0415
    from fedsim.privacy.participation import Participation  # noqa: PLC0415
    from fedsim.privacy.sampling import FullParticipation  # noqa: PLC0415

    k, b = separation
    with flags(
        {
            "participations": "--participations",
            "max_participations": "--participations",
            "min_sep": "--min-sep",
            "rounds": "--rounds",
            "relation": "--relation",
            "accountant": "--accountant",
        }
    ):
        if (k is None) != (b is None):
            missing = "--min-sep" if b is None else "--participations"
            raise ConfigError(
                missing, None, "an integer >= 1: --participations and --min-sep come together"
            )
        participation = Participation.single() if b is None else Participation.separated(b, k)
        sens = f.sensitivity(participation)
        released = f.sensitivity_through(rounds, participation)
        effective = z * sens.value / released.value
        eps = epsilon(effective, FullParticipation(), 1, delta, accountant, relation)
    return participation, sens, released, effective, eps


def _matrix(args: argparse.Namespace) -> dict[str, Any]:
    """The whole run is one Gaussian mechanism: fresh noise std ``z c sens(C)`` on ``C X``, so
    epsilon after all n rounds is the Gaussian's with ``z``; after T rounds the rows released
    so far have sensitivity ``sens_T`` and the multiplier is ``z sens(C) / sens_T``
    (:mod:`strategies.methods.matrix_mechanism`). RMSE per round is ``z sens(C) ||B[t]||`` in units
    of the clipping norm."""
    from fedsim.privacy.sampling import NeighbouringRelation  # noqa: PLC0415

    delta, accountant = check_common(args)
    z = check_noise(args.noise_multiplier, accountant)
    path, f, spec = _factorization(args)
    k = (
        args.participations
        if args.participations is not None
        else getattr(spec, "participations", None)
    )
    b = args.min_sep if args.min_sep is not None else getattr(spec, "min_sep", None)
    rounds = f.n if args.rounds is None else args.rounds
    relation = NeighbouringRelation.parse(args.relation or "add_remove", "--relation")
    participation, sens, released, effective, eps = _matrix_epsilon(
        f, z, (k, b), rounds, delta, accountant, relation
    )
    errors = z * sens.value * np.sqrt(f.squared_error_per_round())
    return {
        "command": "matrix",
        "factorization": str(path),
        "kind": f.kind,
        "n": f.n,
        "rounds": rounds,
        "noise_multiplier": z,
        "delta": delta,
        "accountant": accountant,
        "relation": relation.value,
        "participations": participation.participations(f.n),
        "min_sep": b,
        "sensitivity": sens.value,
        "sensitivity_exact": sens.exact,
        "sensitivity_method": sens.method,
        "released_sensitivity": released.value,
        "effective_noise_multiplier": effective,
        "epsilon": eps,
        "max_column_norm": f.max_column_norm(),
        "noise_std": z * sens.value,
        "rmse": float(np.sqrt(np.mean(errors**2))),
        "rmse_last": float(errors[-1]),
        "rmse_max": float(errors.max()),
    }


def _grid(total: int, points: int) -> list[int]:
    """Up to ``points`` distinct round counts in ``[1, total]``, evenly spread, ending at total."""
    return sorted({max(1, round(total * i / points)) for i in range(1, points + 1)})


def _sweep(args: argparse.Namespace) -> dict[str, Any]:
    from fedsim.privacy.epsilon import epsilon_curve  # noqa: PLC0415

    delta, accountant = check_common(args)
    points = args.points
    require(
        isinstance(points, int) and 2 <= points <= 1000,
        "--points",
        points,
        "an integer in [2, 1000]",
    )
    plot = Path(args.plot)
    require(plot.suffix.lower() == ".png", "--plot", args.plot, "a path ending in .png")
    zs = [check_noise(z, accountant) for z in args.noise_multiplier]
    curves: list[dict[str, Any]] = []
    mechanism = MECHANISMS[args.mechanism]
    mechanism.check_length(args, "sweep")
    settings = [mechanism.setting(args, value) for value in mechanism.value(args) or [None]]
    x_name, names = mechanism.length, mechanism.flags
    for z in zs:
        for sampling, relation, echo, total in settings:
            grid = _grid(total, points)
            with flags(names):
                eps = epsilon_curve(z, sampling, grid, delta, accountant, relation)
            label = f"z={z:g}, q={echo['sampling_rate']:g}"
            curves.append(
                {"label": label, "noise_multiplier": z, **echo, x_name: grid, "epsilon": eps}
            )
    _plot(curves, x_name, delta, accountant, plot)
    result: dict[str, Any] = {
        "command": "sweep",
        "mechanism": args.mechanism,
        "delta": delta,
        "accountant": accountant,
        "points": points,
        "plot": str(plot),
        "noise_multiplier": zs,
        "curves": curves,
    }
    result.update(mechanism.inputs(args))
    return result


def _plot(
    curves: list[dict[str, Any]], x_name: str, delta: float, accountant: str, path: Path
) -> None:
    """Write epsilon against rounds/steps as a PNG (Agg canvas; pyplot's state is not used)."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg  # noqa: PLC0415
    from matplotlib.figure import Figure  # noqa: PLC0415

    fig = Figure(figsize=(6.4, 4.4), dpi=100)
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    for curve in curves:
        ax.plot(curve[x_name], curve["epsilon"], label=curve["label"])
    ax.set_xlabel(x_name)
    ax.set_ylabel(f"epsilon at delta = {delta:g}")
    ax.set_title(f"{accountant.upper()} accountant (dp_accounting)")
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize="small")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, format="png")


@contextlib.contextmanager
def quiet_dp_accounting() -> Iterator[None]:
    """Silence dp_accounting's per-order warnings while a command runs.

    Its RDP code logs (through absl) every fractional order whose series fails to converge and
    drops that order from the minimum over orders; the bound stays valid, and a calibration or
    sweep would print hundreds of such lines. Errors still show; a level set below WARNING
    (``fedsim --verbose``) is left as it is.
    """
    logger = logging.getLogger("absl")
    level = logger.level
    if logging.NOTSET < level < logging.WARNING:
        yield
        return
    logger.setLevel(logging.ERROR)
    try:
        yield
    finally:
        logger.setLevel(level)


def run(args: argparse.Namespace) -> dict[str, Any]:
    """Execute a parsed ``fedsim account ...`` command; returns a JSON-ready dict."""
    command = args.account_command
    handlers = {
        **dict.fromkeys(MECHANISMS, _epsilon),
        "calibrate": _calibrate,
        "sweep": _sweep,
        "matrix": _matrix,
    }
    require(command in handlers, "command", command, f"one of {', '.join(handlers)}")
    with quiet_dp_accounting():
        return handlers[command](args)


def format_text(result: dict[str, Any]) -> str:
    """A one-line human summary of :func:`run`'s result."""
    command = result["command"]
    where = f"at delta = {result['delta']:g} ({result['accountant']})"
    if command == "sweep":
        finals = "; ".join(f"{c['label']}: {c['epsilon'][-1]:.4f}" for c in result["curves"])
        return (
            f"sweep {result['mechanism']}: {len(result['curves'])} curves {where}, "
            f"final epsilon {finals}; plot in {result['plot']}"
        )
    if command == "matrix":
        return (
            f"matrix {result['kind']} n = {result['n']}: epsilon = {result['epsilon']:.4f} "
            f"{where} after {result['rounds']} rounds; sensitivity {result['sensitivity']:.6g} "
            f"(k = {result['participations']}), max column norm "
            f"{result['max_column_norm']:.6g}, rmse {result['rmse']:.6g} x clipping norm"
        )
    if command == "calibrate":
        return (
            f"calibrate {result['mechanism']}: noise multiplier "
            f"{result['noise_multiplier']:.4f} gives epsilon = {result['epsilon']:.4f} "
            f"<= {result['target_epsilon']:g} {where}"
        )
    unit = MECHANISMS[command].length
    length = f"{result[unit]} {unit}"
    return (
        f"{command}: epsilon = {result['epsilon']:.4f} {where}; noise multiplier "
        f"{result['noise_multiplier']:g}, sampling {result['sampling']} q = "
        f"{result['sampling_rate']:g}, {length}, {result['relation']} neighbours"
    )
