"""Epsilon of ``rounds`` rounds of a sampled Gaussian, and epsilon curves over round counts.

A run of :func:`~fedsim.privacy.round_events.run_event` is accounted by the chosen accountant
(:mod:`fedsim.privacy.accountant`); a curve composes one round once and reads its RDP vector /
PLD for every count (:mod:`fedsim.privacy.dpa_adapter`), else composes each count afresh.
"""

from __future__ import annotations

from collections.abc import Sequence

from fedsim.config import require
from fedsim.privacy.accountant import (
    Accountant,
    account,
    accountant_kind,
    for_accountant,
    supports,
    unsupported,
)
from fedsim.privacy.participation import Participation
from fedsim.privacy.round_events import round_event, run_event
from fedsim.privacy.sampling import (
    NeighbouringRelation,
    Sampling,
    check_delta,
    check_rounds,
    check_sampling,
)


def _subject(sampling: Sampling) -> str:
    return type(sampling).__name__


def epsilon(
    noise_multiplier: float,
    sampling: Sampling,
    rounds: int,
    delta: float,
    accountant: Accountant = "rdp",
    relation: NeighbouringRelation | str = "add_remove",
) -> float:
    """Epsilon (nats) at ``delta`` after ``rounds`` rounds of :func:`round_event`.

    ``inf`` when ``noise_multiplier == 0``; ``0.0`` when ``rounds == 0``.

    Raises:
        ConfigError: on a bad value, or a sampling/accountant/relation combination
            dp_accounting does not support (the table in the module docstring).
    """
    relation = NeighbouringRelation.parse(relation)
    accountant = accountant_kind(accountant).name
    delta = check_delta(delta)
    event = run_event(noise_multiplier, check_sampling(sampling), rounds)
    check_combination(sampling, accountant, relation)
    return account(event, accountant, relation, delta, _subject(sampling))


def check_combination(sampling: Sampling, accountant: str, relation: NeighbouringRelation) -> None:
    """Raise if ``accountant`` cannot account ``sampling`` under ``relation`` (any z > 0)."""
    probe = round_event(1.0, sampling)
    if not supports(probe, accountant, relation):
        raise unsupported(probe, accountant, relation, _subject(sampling))


def epsilon_curve(
    noise_multiplier: float,
    sampling: Sampling,
    rounds: Sequence[int],
    delta: float,
    accountant: Accountant = "rdp",
    relation: NeighbouringRelation | str = "add_remove",
) -> list[float]:
    """Epsilon after each of ``rounds`` (strictly increasing round counts).

    Each value equals :func:`epsilon` for that round count (up to floating-point rounding);
    the round's RDP curve / Poisson-sampled PLD is computed once (see
    :mod:`fedsim.privacy.dpa_adapter`), so an RDP curve costs about one point.
    """
    relation = NeighbouringRelation.parse(relation)
    accountant = accountant_kind(accountant).name
    delta = check_delta(delta)
    event = round_event(noise_multiplier, check_sampling(sampling))
    counts = list(rounds)
    require(len(counts) > 0, "rounds", counts, "a non-empty list of round counts")
    for i, r in enumerate(counts):
        check_rounds(r, f"rounds[{i}]")
        if i:
            require(r > counts[i - 1], f"rounds[{i}]", r, f"an integer > {counts[i - 1]}")
    check_combination(sampling, accountant, relation)
    translated = for_accountant(event, accountant, relation)
    if isinstance(sampling, Participation):
        counts = [sampling.participations(r) for r in counts]
    kind = accountant_kind(accountant)
    one = kind.fresh(relation).compose(translated)
    fast = kind.curve(one, translated, counts, delta)
    if fast is not None:
        return fast
    return [
        float(kind.fresh(relation).compose(translated, c).get_epsilon(delta)) if c else 0.0
        for c in counts
    ]
