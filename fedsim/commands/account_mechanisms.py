"""The mechanisms ``fedsim account`` accounts (:data:`MECHANISMS`: dp-fedavg, dp-sgd): their
flags, the checks of the inputs every subcommand shares (noise multiplier, delta,
accountant), and the accounted setting -- sampling model, neighbouring relation, rounds or
steps -- each invocation describes. Bad input raises :class:`~fedsim.config.ConfigError`
whose key is the flag."""

from __future__ import annotations

import argparse
import math
from collections.abc import Callable
from dataclasses import dataclass
from fractions import Fraction
from typing import TYPE_CHECKING, Any

from fedsim.config import require

if TYPE_CHECKING:  # dp_accounting (and scipy) load when a subcommand runs, not for --help
    from fedsim.privacy.sampling import NeighbouringRelation, Sampling


_FEDAVG_FLAGS = {
    "noise_multiplier": "--noise-multiplier",
    "rate": "--sampling-rate",
    "sample_size": "--sampling-rate",
    "population": "--population",
    "rounds": "--rounds",
    "delta": "--delta",
    "accountant": "--accountant",
    "relation": "--relation",
    "target_epsilon": "--target-epsilon",
}


_SGD_FLAGS = {**_FEDAVG_FLAGS, "rate": "--batch-size", "rounds": "--epochs"}


#: one accounted setting: (sampling, neighbouring relation, echoed inputs, rounds or steps)
Setting = tuple["Sampling", "NeighbouringRelation", dict[str, Any], int]


def common_args(parser: argparse.ArgumentParser, *, relation: bool, prv: bool = False) -> None:
    parser.add_argument("--delta", type=float, required=True, help="target delta, in (0, 1)")
    parser.add_argument(
        "--accountant",
        default="rdp",
        help="rdp (default) or pld, both from dp_accounting"
        + ("; or prv (Opacus's PRV accountant, epsilon only)" if prv else ""),
    )
    if relation:
        parser.add_argument(
            "--relation",
            default=None,
            help="add_remove or replace_one neighbours (default: replace_one "
            "for --sampling fixed, else add_remove)",
        )
    parser.add_argument("--json", action="store_true", help="print the result as JSON")


def _fedavg_args(parser: argparse.ArgumentParser, *, many: bool) -> None:
    nargs = "+" if many else None
    parser.add_argument(
        "--sampling-rate",
        type=float,
        nargs=nargs,
        default=None,
        help="client sampling rate q in (0, 1] (Poisson) or cohort fraction",
    )
    parser.add_argument("--rounds", type=int, required=True, help="number of rounds T")
    parser.add_argument(
        "--sampling",
        default="poisson",
        help="poisson (default), fixed (round(q N) of N without replacement) "
        "or full (every client, every round)",
    )
    parser.add_argument(
        "--population",
        type=int,
        default=None,
        help="number of clients N (needed by --sampling fixed)",
    )
    common_args(parser, relation=True)


def _sgd_args(parser: argparse.ArgumentParser, *, many: bool) -> None:
    nargs = "+" if many else None
    parser.add_argument(
        "--batch-size",
        type=int,
        nargs=nargs,
        required=True,
        help="expected batch size B (Poisson sampling q = B / N)",
    )
    parser.add_argument("--dataset-size", type=int, required=True, help="examples N")
    parser.add_argument(
        "--epochs", type=float, required=True, help="epochs E; steps = ceil(E N / B)"
    )
    common_args(parser, relation=False, prv=not many)


#: the smallest noise multiplier the PLD accountant is asked about: its grid grows as 1/z^2
#: (z = 0.05 over 1000 Poisson rounds takes minutes and over 4 GB)
PLD_MIN_NOISE = 0.1


#: the same for Opacus's PRV accountant, whose domain also widens as z falls (z = 0.1 over 100
#: steps at q = 0.01 takes about two minutes, z = 0.5 over 1000 steps a few seconds)
PRV_MIN_NOISE = 0.5


#: what ``--accountant prv`` accounts: ``fedsim account dp-sgd`` (epsilon) only
PRV_COMMANDS = ("dp-sgd",)


def check_noise(z: Any, accountant: str) -> float:
    """A noise multiplier the accountant handles soundly, else a ConfigError.

    The range is the one noise calibration searches, ``[Z_MIN, Z_MAX]``: below ``Z_MIN``
    epsilon exceeds 1e5 per round and dp_accounting's RDP bound loses its precision (it
    reports epsilon = 0 for Poisson sampling at z = 1e-154 and divides by zero at 1e-300),
    so the command refuses rather than print a meaningless or optimistic number. ``z = 0``
    (no noise, epsilon infinite) is what a run reports; here it is refused too."""
    from fedsim.privacy.round_events import Z_MAX, Z_MIN  # noqa: PLC0415

    require(
        isinstance(z, (int, float))
        and not isinstance(z, bool)
        and math.isfinite(z)
        and Z_MIN <= z <= Z_MAX,
        "--noise-multiplier",
        z,
        f"a number in [{Z_MIN:g}, {Z_MAX:g}] (noise std / clipping norm; below "
        f"{Z_MIN:g} epsilon exceeds 1e5 and dp_accounting's bound loses its precision)",
    )
    require(
        accountant != "pld" or z >= PLD_MIN_NOISE,
        "--noise-multiplier",
        z,
        f"a number >= {PLD_MIN_NOISE:g} with --accountant pld (its grid grows as 1/z^2; "
        "--accountant rdp takes smaller ones)",
    )
    require(
        accountant != "prv" or z >= PRV_MIN_NOISE,
        "--noise-multiplier",
        z,
        f"a number >= {PRV_MIN_NOISE:g} with --accountant prv (its domain widens as z "
        "falls; --accountant rdp or pld take smaller ones)",
    )
    return float(z)


def check_common(args: argparse.Namespace) -> tuple[float, str]:
    from fedsim.privacy.accountant import ACCOUNTANTS  # noqa: PLC0415

    delta = args.delta
    require(
        isinstance(delta, (int, float)) and 0 < delta < 1, "--delta", delta, "a number in (0, 1)"
    )
    if args.accountant == "prv":
        require(
            getattr(args, "account_command", None) in PRV_COMMANDS,
            "--accountant",
            args.accountant,
            "rdp or pld here (prv, Opacus's PRV accountant, accounts fedsim account dp-sgd "
            "only; dp_accounting ships no PRV accountant)",
        )
        return float(delta), args.accountant
    prv = getattr(args, "account_command", None) in PRV_COMMANDS
    allowed = "one of rdp, pld" + (", prv" if prv else "")
    require(args.accountant in ACCOUNTANTS, "--accountant", args.accountant, allowed)
    return float(delta), args.accountant


def _fedavg_setting(args: argparse.Namespace, rate: float | None) -> Setting:
    """The sampling model, relation, echoed inputs and rounds of a dp-fedavg invocation."""
    from fedsim.privacy.sampling import FullParticipation, NeighbouringRelation  # noqa: PLC0415

    kind = args.sampling
    require(kind in ("poisson", "fixed", "full"), "--sampling", kind, "one of poisson, fixed, full")
    require(
        isinstance(args.rounds, int) and args.rounds >= 0,
        "--rounds",
        args.rounds,
        "an integer >= 0",
    )
    echo: dict[str, Any] = {"sampling": kind, "rounds": args.rounds}
    if kind == "full":
        require(
            rate is None or rate == 1, "--sampling-rate", rate, "1 or nothing with --sampling full"
        )
        sampling: Sampling = FullParticipation()
        echo["sampling_rate"] = 1.0
    else:
        sampling = _sampled(args, kind, rate, echo)
    default = "replace_one" if kind == "fixed" else "add_remove"
    relation = NeighbouringRelation.parse(args.relation or default, "--relation")
    echo["relation"] = relation.value
    return sampling, relation, echo, args.rounds


def _sampled(
    args: argparse.Namespace, kind: str, rate: float | None, echo: dict[str, Any]
) -> Sampling:
    """dp-fedavg's sampling at ``--sampling-rate`` ``rate`` (``kind``: poisson or fixed, of
    ``--population`` clients); the inputs it used go to ``echo``."""
    from fedsim.privacy.sampling import FixedSizeSampling, PoissonSampling  # noqa: PLC0415

    require(
        rate is not None,
        "--sampling-rate",
        rate,
        f"a rate in (0, 1] (required with --sampling {kind})",
    )
    require(
        isinstance(rate, (int, float)) and 0 < rate <= 1,
        "--sampling-rate",
        rate,
        "a rate in (0, 1]",
    )
    echo["sampling_rate"] = float(rate)
    if kind == "poisson":
        return PoissonSampling(float(rate))
    n = args.population
    require(
        isinstance(n, int) and n >= 1,
        "--population",
        n,
        "an integer >= 1 (required with --sampling fixed)",
    )
    cohort = round(rate * n)
    require(
        1 <= cohort <= n,
        "--sampling-rate",
        rate,
        f"a rate giving a cohort round(q N) of at least 1 of N = {n} clients",
    )
    echo.update(population=n, cohort_size=cohort)
    return FixedSizeSampling(cohort, n)


def _sgd_setting(args: argparse.Namespace, batch_size: int) -> Setting:
    """Poisson sampling q = B/N (add/remove neighbours), the echoed inputs and the number of
    steps ceil(E N / B)."""
    from fedsim.privacy.sampling import NeighbouringRelation, PoissonSampling  # noqa: PLC0415

    n = args.dataset_size
    require(isinstance(n, int) and n >= 1, "--dataset-size", n, "an integer >= 1")
    require(
        isinstance(batch_size, int) and 1 <= batch_size <= n,
        "--batch-size",
        batch_size,
        f"an integer in [1, --dataset-size = {n}]",
    )
    epochs = args.epochs
    require(
        isinstance(epochs, (int, float)) and math.isfinite(epochs) and epochs > 0,
        "--epochs",
        epochs,
        "a finite number > 0",
    )
    steps = math.ceil(Fraction(repr(float(epochs))) * n / batch_size)
    q = batch_size / n
    echo = {
        "batch_size": batch_size,
        "dataset_size": n,
        "epochs": float(epochs),
        "sampling_rate": q,
        "steps": steps,
        "sampling": "poisson",
        "relation": "add_remove",
    }
    return PoissonSampling(q), NeighbouringRelation.ADD_REMOVE, echo, steps


def _fedavg_rounds(args: argparse.Namespace, verb: str) -> None:
    require(args.rounds >= 1, "--rounds", args.rounds, f"an integer >= 1 to {verb}")


def _any_steps(args: argparse.Namespace, verb: str) -> None:
    """Steps are ceil(E N / B) >= 1 for any valid --epochs: nothing to check."""


@dataclass(frozen=True)
class AccountedMechanism:
    """One mechanism the ``account`` command accounts, and everything it needs of it.

    Attributes:
        add_args: adds its flags to a parser (``many``: the sweep's lists).
        value: the flag its settings vary over (one value, or the sweep's list).
        setting: ``(sampling, relation, echoed inputs, length)`` for one value of it.
        length: what its releases are counted in ("rounds" or "steps").
        check_length: refuses a length that cannot be calibrated or swept (``verb``).
        flags: library keys -> the flags that set them, for error messages.
        inputs: the inputs a sweep's result echoes.
    """

    add_args: Callable[..., None]
    value: Callable[[argparse.Namespace], Any]
    setting: Callable[[argparse.Namespace, Any], Setting]
    length: str
    check_length: Callable[[argparse.Namespace, str], None]
    flags: dict[str, str]
    inputs: Callable[[argparse.Namespace], dict[str, Any]]


#: the mechanisms by subcommand name
MECHANISMS: dict[str, AccountedMechanism] = {
    "dp-fedavg": AccountedMechanism(
        add_args=_fedavg_args,
        value=lambda args: args.sampling_rate,
        setting=_fedavg_setting,
        length="rounds",
        check_length=_fedavg_rounds,
        flags=_FEDAVG_FLAGS,
        inputs=lambda args: {
            "rounds": args.rounds,
            "sampling": args.sampling,
            "sampling_rate": args.sampling_rate,
        },
    ),
    "dp-sgd": AccountedMechanism(
        add_args=_sgd_args,
        value=lambda args: args.batch_size,
        setting=_sgd_setting,
        length="steps",
        check_length=_any_steps,
        flags=_SGD_FLAGS,
        inputs=lambda args: {
            "batch_size": args.batch_size,
            "dataset_size": args.dataset_size,
            "epochs": float(args.epochs),
        },
    ),
}
