"""Noise calibration: the smallest noise multiplier whose epsilon meets a target.

Uses ``dp_accounting.mechanism_calibration.calibrate_dp_mechanism`` (a bisection that returns
a value whose epsilon does not exceed the target) on an explicit bracket found here.
"""

from __future__ import annotations

import math
from typing import Any

import dp_accounting as dpa
from dp_accounting import mechanism_calibration

from fedsim.config import ConfigError, require
from fedsim.privacy.accountant import Accountant, accountant_kind, for_accountant, supports
from fedsim.privacy.dpa_adapter import CachedAccountant
from fedsim.privacy.epsilon import check_combination
from fedsim.privacy.round_events import Z_MAX, Z_MIN, round_event, run_event
from fedsim.privacy.sampling import (
    NeighbouringRelation,
    Sampling,
    check_delta,
    check_rounds,
    check_sampling,
    is_number,
)


def calibrate_noise(
    target_epsilon: float,
    delta: float,
    sampling: Sampling,
    rounds: int,
    accountant: Accountant = "rdp",
    relation: NeighbouringRelation | str = "add_remove",
) -> float:
    """The smallest noise multiplier (to a relative 1e-4) whose epsilon is ``<= target``.

    Uses ``calibrate_dp_mechanism`` on an explicit bracket ``[lo, hi]`` with
    ``epsilon(lo) > target >= epsilon(hi)``, found by doubling/halving from a guess (for PLD,
    the RDP answer when RDP supports the setting -- PLD is the tighter bound, so its answer
    lies below -- else 1); the tolerance is ``1e-4 * lo``. ``calibrate_dp_mechanism`` returns a
    value whose epsilon does not exceed the target.

    Raises:
        ConfigError: bad values, unsupported combination, ``rounds < 1``, or a target outside
            what noise multipliers in ``[Z_MIN, Z_MAX]`` reach.
    """
    relation = NeighbouringRelation.parse(relation)
    accountant = accountant_kind(accountant).name
    delta = check_delta(delta)
    require(
        is_number(target_epsilon) and math.isfinite(target_epsilon) and target_epsilon > 0,
        "target_epsilon",
        target_epsilon,
        "a finite number > 0",
    )
    check_sampling(sampling)
    check_rounds(rounds, minimum=1)
    check_combination(sampling, accountant, relation)

    def make_event(z: float) -> dpa.DpEvent:
        return for_accountant(run_event(float(z), sampling, rounds), accountant, relation)

    cache: dict[tuple[str, float], float] = {}

    kind = accountant_kind(accountant)

    def make_accountant() -> CachedAccountant:
        return CachedAccountant(lambda: kind.fresh(relation), relation.dp_accounting, cache)

    def eps(z: float) -> float:
        return make_accountant().compose(make_event(z)).get_epsilon(delta)

    guess = 1.0
    looser = kind.looser
    if looser is not None and supports(round_event(1.0, sampling), looser, relation):
        guess = calibrate_noise(target_epsilon, delta, sampling, rounds, looser, relation)
    lo, hi = _bracket(eps, guess, float(target_epsilon))
    z = mechanism_calibration.calibrate_dp_mechanism(
        make_accountant,
        make_event,
        float(target_epsilon),
        delta,
        mechanism_calibration.ExplicitBracketInterval(lo, hi),
        tol=lo * 1e-4,
    )
    return float(z)


def _bracket(eps: Any, guess: float, target: float) -> tuple[float, float]:
    """``(lo, hi)`` with ``eps(lo) > target >= eps(hi)``: a 25% step from ``guess``, then
    doubling or halving (epsilon decreases in the noise multiplier)."""

    def out_of_range(z: float) -> ConfigError:
        return ConfigError(
            "target_epsilon",
            target,
            f"a target reached by a noise multiplier in [{Z_MIN}, {Z_MAX}] (epsilon is "
            f"{eps(z):.6g} at z = {z})",
        )

    if eps(guess) > target:
        lo, hi = guess, 1.25 * guess
        while eps(hi) > target:
            if hi >= Z_MAX:
                raise out_of_range(Z_MAX)
            lo, hi = hi, min(2 * hi, Z_MAX)
    else:
        lo, hi = 0.8 * guess, guess
        while eps(lo) <= target:
            if lo <= Z_MIN:
                raise out_of_range(Z_MIN)
            lo, hi = max(lo / 2, Z_MIN), lo
    return lo, hi


