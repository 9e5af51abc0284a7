"""Privacy accounting for federated rounds; every epsilon comes from ``dp_accounting``.

A round of DP-FedAvg (McMahan et al. 2018, "Learning Differentially Private Recurrent Language
Models", Alg. 1) or DP-SGD (Abadi et al. 2016) is a (sub)sampled Gaussian mechanism. This module
describes it as immutable ``dp_accounting`` events, keeps them in a per-run
:class:`PrivacyLedger`, and turns them into ``(epsilon, delta)`` with ``dp_accounting``'s RDP
(``RdpAccountant``: Mironov 2017; Mironov, Talwar & Zhang 2019 for Poisson subsampling; Wang,
Balle & Kasiviswanathan 2019, Thm. 27 for sampling without replacement) or PLD
(``PLDAccountant``: Doroshenko et al. 2022, "Connect the Dots") accountant. Noise calibration
for a target epsilon uses ``dp_accounting.mechanism_calibration.calibrate_dp_mechanism``.

Conventions
-----------
Noise multiplier ``z`` = noise standard deviation / ``C``, where ``C`` bounds the L2 norm of one
participant's contribution (the clipping norm). ``C`` is the L2 sensitivity of a sum under
add/remove neighbours; under replace-one neighbours the sum moves by up to ``2C``, and the
accounting uses ``2C``. ``z = 0`` (no noise) is allowed and means no privacy: epsilon is
``inf``. ``delta`` is in ``(0, 1)``; epsilon is in nats (natural logarithm).

Neighbouring relations in dp_accounting 0.6.0. Its two accountants read a Gaussian event's
noise multiplier differently under ``REPLACE_ONE``: ``PLDAccountant`` takes it as ``std / C``
and doubles the sensitivity itself (its replace-one Gaussian equals the add/remove Gaussian with
``z/2``), while ``RdpAccountant`` ignores the relation for ``GaussianDpEvent`` and expects
``std / (replace-one sensitivity)`` inside ``SampledWithoutReplacementDpEvent``. Events in a
ledger always carry ``z = std / C`` (the ``GaussianDpEvent`` docstring's definition); before the
RDP accountant sees them under ``replace_one`` every Gaussian noise multiplier is halved, so both
accountants describe the same mechanism and neither number is optimistic.

Supported combinations (anything else raises :class:`~fedsim.config.ConfigError`):

======================  ==================  ==========================
sampling                rdp                 pld
======================  ==================  ==========================
PoissonSampling         add_remove          add_remove, replace_one
FixedSizeSampling       replace_one         (no dp_accounting event)
FullParticipation       both                both
MinSeparation           both                both
======================  ==================  ==========================
"""

from __future__ import annotations

import enum
import json
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

import dp_accounting as dpa
from dp_accounting import mechanism_calibration
from dp_accounting.pld import PLDAccountant
from dp_accounting.rdp import RdpAccountant
from dp_accounting.rdp import rdp_privacy_accountant as rdp_accountant

from fedsim.config import ConfigError, require
from fedsim.privacy.events import check_event, event_from_dict, event_to_dict, kind_of
from fedsim.privacy.matrix.sensitivity import Participation

Accountant = Literal["rdp", "pld"]
ACCOUNTANTS: tuple[str, ...] = ("rdp", "pld")

#: Calibration searches noise multipliers in this range.
Z_MIN, Z_MAX = 2.0**-8, 2.0**20


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


# --------------------------------------------------------------------------------------------
# Neighbouring relation and sampling models
# --------------------------------------------------------------------------------------------


class NeighbouringRelation(enum.StrEnum):
    """Which datasets are neighbours: one participant added/removed, or one replaced."""

    ADD_REMOVE = "add_remove"
    REPLACE_ONE = "replace_one"

    @property
    def dp_accounting(self) -> dpa.NeighboringRelation:
        """The matching ``dp_accounting.NeighboringRelation``."""
        if self is NeighbouringRelation.ADD_REMOVE:
            return dpa.NeighboringRelation.ADD_OR_REMOVE_ONE
        return dpa.NeighboringRelation.REPLACE_ONE

    @classmethod
    def parse(cls, value: Any, key: str = "relation") -> NeighbouringRelation:
        """``value`` as a relation (an instance or its string), else :class:`ConfigError`."""
        if isinstance(value, cls):
            return value
        for member in cls:
            if value == member.value:
                return member
        raise ConfigError(key, value, "one of 'add_remove', 'replace_one'")


@dataclass(frozen=True, slots=True)
class PoissonSampling:
    """Each client takes part in each round independently with probability ``rate`` in (0, 1].

    Privacy amplification by Poisson subsampling (Mironov, Talwar & Zhang 2019; Zhu & Wang
    2019) for add/remove neighbours. ``rate == 1`` is full participation.
    """

    rate: float

    def __post_init__(self) -> None:
        require(
            _is_number(self.rate) and 0 < self.rate <= 1,
            "rate",
            self.rate,
            "a sampling rate q in (0, 1]",
        )


@dataclass(frozen=True, slots=True)
class FixedSizeSampling:
    """Each round takes ``sample_size`` of ``population`` clients uniformly without replacement.

    Accounted with ``SampledWithoutReplacementDpEvent`` (Wang, Balle & Kasiviswanathan 2019,
    Thm. 27), which dp_accounting's RDP accountant supports only for replace-one neighbours
    (the population size is public). ``sample_size == population`` is full participation.
    """

    sample_size: int
    population: int

    def __post_init__(self) -> None:
        require(
            _is_int(self.population) and self.population >= 1,
            "population",
            self.population,
            "an integer >= 1",
        )
        require(
            _is_int(self.sample_size) and 1 <= self.sample_size <= self.population,
            "sample_size",
            self.sample_size,
            f"an integer in [1, {self.population}]",
        )


@dataclass(frozen=True, slots=True)
class FullParticipation:
    """Every client takes part in every round: no amplification."""


@dataclass(frozen=True, slots=True)
class MinSeparation:
    """Deterministic participation: at least ``min_separation`` (b) rounds between two
    participations of a client, and at most ``max_participations`` (k) in the whole run.

    This is the participation schema of the matrix-mechanism papers (Choquette-Choo et al.
    2023, "Multi-Epoch Matrix Factorization Mechanisms", b-min-separation). There is no
    subsampling, hence no amplification. For a plain Gaussian mechanism in each round (fresh
    noise per round) a client is seen by at most ``min(k, ceil(T / b))`` of ``T`` rounds, and is
    accounted as exactly that many Gaussian events -- the worst case over clients.
    """

    min_separation: int
    max_participations: int

    def __post_init__(self) -> None:
        require(
            _is_int(self.min_separation) and self.min_separation >= 1,
            "min_separation",
            self.min_separation,
            "an integer >= 1 (rounds between participations)",
        )
        require(
            _is_int(self.max_participations) and self.max_participations >= 1,
            "max_participations",
            self.max_participations,
            "an integer >= 1",
        )

    def participations(self, rounds: int) -> int:
        """The most rounds out of ``rounds`` consecutive ones that one client can be in."""
        return min(self.max_participations, -(-rounds // self.min_separation))

    def matrix_participation(self) -> Participation:
        """The same schedule as the matrix mechanism's participation schema (its sensitivity
        and the participation guard read this): ``min_sep`` = b, at most k participations."""
        return Participation.separated(self.min_separation, self.max_participations)


Sampling = PoissonSampling | FixedSizeSampling | FullParticipation | MinSeparation
_SAMPLINGS = (PoissonSampling, FixedSizeSampling, FullParticipation, MinSeparation)


# --------------------------------------------------------------------------------------------
# Validation helpers
# --------------------------------------------------------------------------------------------


def _check_noise_multiplier(value: Any, key: str = "noise_multiplier") -> float:
    """0 (no noise: epsilon is infinite) or a number in [Z_MIN, Z_MAX]: below Z_MIN epsilon
    exceeds 1e5 and dp_accounting's RDP bound loses its precision (it reports 0 for
    z = 1e-154), so a smaller noise multiplier would be accounted optimistically."""
    require(
        _is_number(value)
        and math.isfinite(value)
        and (value == 0 or Z_MIN <= value <= Z_MAX),
        key,
        value,
        f"0 (no noise, epsilon inf) or a number in [{Z_MIN:g}, {Z_MAX:g}] (noise std / "
        "clipping norm; below that dp_accounting's bound loses its precision)",
    )
    return float(value)


def _check_delta(value: Any, key: str = "delta") -> float:
    require(_is_number(value) and 0 < value < 1, key, value, "a number in (0, 1)")
    return float(value)


def _check_rounds(value: Any, key: str = "rounds", minimum: int = 0) -> int:
    require(_is_int(value) and value >= minimum, key, value, f"an integer >= {minimum}")
    return value


def _check_accountant(value: Any, key: str = "accountant") -> str:
    require(value in ACCOUNTANTS, key, value, "one of 'rdp', 'pld'")
    return value


def _check_sampling(value: Any, key: str = "sampling") -> Sampling:
    require(
        isinstance(value, _SAMPLINGS),
        key,
        value,
        "PoissonSampling, FixedSizeSampling, FullParticipation or MinSeparation",
    )
    return value


# --------------------------------------------------------------------------------------------
# Events
# --------------------------------------------------------------------------------------------


def _sampled(inner: dpa.DpEvent, sampling: Sampling) -> dpa.DpEvent:
    """Wrap a round's mechanism in the sampling model's amplification event."""
    if isinstance(sampling, PoissonSampling) and sampling.rate < 1:
        return dpa.PoissonSampledDpEvent(sampling.rate, inner)
    if isinstance(sampling, FixedSizeSampling) and sampling.sample_size < sampling.population:
        return dpa.SampledWithoutReplacementDpEvent(
            sampling.population, sampling.sample_size, inner
        )
    return inner  # full participation (also q = 1 or m = n), or deterministic participation


def round_event(noise_multiplier: float, sampling: Sampling) -> dpa.DpEvent:
    """One round of the (sub)sampled Gaussian mechanism.

    Args:
        noise_multiplier: ``z`` = noise std / clipping norm, ``>= 0``; ``0`` gives
            ``NonPrivateDpEvent`` (no noise, no amplification claimed).
        sampling: how the round's participants are chosen. Poisson with ``rate = 1`` and fixed
            size with ``sample_size == population`` are full participation, a plain
            ``GaussianDpEvent``. For :class:`MinSeparation` this is the event of one
            participation (how many of them a client sees is :func:`run_event`'s business).
    """
    z = _check_noise_multiplier(noise_multiplier)
    _check_sampling(sampling)
    if z == 0:
        return dpa.NonPrivateDpEvent()
    return _sampled(dpa.GaussianDpEvent(z), sampling)


def run_event(noise_multiplier: float, sampling: Sampling, rounds: int) -> dpa.DpEvent:
    """``rounds`` rounds of :func:`round_event`, as seen by the worst-case client.

    That is ``rounds`` self-compositions, except under :class:`MinSeparation`, where a client is
    in at most ``min(k, ceil(rounds / b))`` rounds and the Gaussian is composed that many times.
    """
    rounds = _check_rounds(rounds)
    event = round_event(noise_multiplier, sampling)
    count = sampling.participations(rounds) if isinstance(sampling, MinSeparation) else rounds
    if count == 0:
        return dpa.NoOpDpEvent()
    return dpa.SelfComposedDpEvent(event, count)


def split_noise_multiplier(total_noise_multiplier: float, count_stddev: float) -> float:
    """The update's noise multiplier when adaptive clipping also releases a noisy count.

    Andrew, Thakkar, McMahan & Ramaswamy 2021, "Differentially Private Learning with Adaptive
    Clipping", Sec. 3: each client sends the bit ``b_i = [||Δ_i|| <= C]``; the server releases
    ``sum_i (b_i - 1/2) + N(0, σ_b²)`` (sensitivity 1/2, so noise multiplier ``2σ_b``) together
    with the clipped sum of updates. Two Gaussian releases on the same participants compose to
    one Gaussian with ``z^-2 = z_Δ^-2 + (2σ_b)^-2``, so for a total budget of ``z`` the update
    gets ``z_Δ = (z^-2 - (2σ_b)^-2)^(-1/2)`` (``>= z``).

    Args:
        total_noise_multiplier: ``z > 0``, the noise multiplier the whole round is accounted as.
        count_stddev: ``σ_b > z/2``, std of the noise on the (centred) sum of clipped-count bits.

    Raises:
        ConfigError: when ``2σ_b <= z``: the count alone would use the whole budget.
    """
    z = total_noise_multiplier
    require(
        _is_number(z) and math.isfinite(z) and z > 0,
        "total_noise_multiplier",
        z,
        "a finite number > 0",
    )
    sb = count_stddev
    require(
        _is_number(sb) and math.isfinite(sb) and sb > 0, "count_stddev", sb, "a finite number > 0"
    )
    require(
        2 * sb > z,
        "count_stddev",
        sb,
        f"> total_noise_multiplier / 2 = {z / 2!r} (with 2·σ_b <= z the clipped-count "
        "release alone uses the whole privacy budget)",
    )
    return float((z**-2 - (2 * sb) ** -2) ** -0.5)


def adaptive_clipping_round_event(
    total_noise_multiplier: float, count_stddev: float, sampling: Sampling
) -> dpa.DpEvent:
    """A round of adaptive clipping as released: update and clipped count, both sampled.

    ``sampled(ComposedDpEvent([Gaussian(z_Δ), Gaussian(2σ_b)]))`` with ``z_Δ`` from
    :func:`split_noise_multiplier`; it accounts exactly like :func:`round_event` with ``z``.
    """
    _check_sampling(sampling)
    z_update = split_noise_multiplier(total_noise_multiplier, count_stddev)
    inner = dpa.ComposedDpEvent(
        [dpa.GaussianDpEvent(z_update), dpa.GaussianDpEvent(2.0 * float(count_stddev))]
    )
    return _sampled(inner, sampling)


def effective_noise_multiplier(event: dpa.DpEvent) -> float | None:
    """The one Gaussian noise multiplier equivalent to ``event``, if it is made of Gaussians.

    Gaussian releases on the same data compose to one Gaussian with ``z^-2 = sum_i z_i^-2``
    (``SelfComposedDpEvent(G(z), c)`` gives ``z / sqrt(c)``) -- the reduction dp_accounting's
    RDP accountant applies inside sampled events. ``NoOpDpEvent`` gives ``inf`` (no release);
    ``0`` means no noise. Returns ``None`` for events that are not such a composition.
    """
    kind = kind_of(event)
    if kind is None or kind.noise is None:
        return None
    return kind.noise(event, effective_noise_multiplier)


# --------------------------------------------------------------------------------------------
# Accounting
# --------------------------------------------------------------------------------------------


def _fresh_accountant(accountant: str, relation: NeighbouringRelation) -> dpa.PrivacyAccountant:
    if accountant == "rdp":
        return RdpAccountant(neighboring_relation=relation.dp_accounting)
    return PLDAccountant(relation.dp_accounting)


def _gaussian_for(z: float, halve: bool) -> dpa.DpEvent:
    if z == 0:
        return dpa.NonPrivateDpEvent()
    if math.isinf(z):
        return dpa.NoOpDpEvent()
    return dpa.GaussianDpEvent(z / 2 if halve else z)


def for_accountant(
    event: dpa.DpEvent, accountant: str, relation: NeighbouringRelation | str
) -> dpa.DpEvent:
    """``event`` as ``accountant`` must see it under ``relation`` (see the module docstring).

    Halves Gaussian noise multipliers for the RDP accountant under replace-one, and reduces the
    event inside a sampled event to one Gaussian (:func:`effective_noise_multiplier`; the PLD
    accountant takes only a plain Gaussian there). Anything else is left for the accountant to
    accept or reject.
    """
    relation = NeighbouringRelation.parse(relation)
    halve = accountant == "rdp" and relation is NeighbouringRelation.REPLACE_ONE

    def convert(e: dpa.DpEvent) -> dpa.DpEvent:
        kind = kind_of(e)
        if kind is None:
            return e
        if kind.cls is dpa.GaussianDpEvent:
            return _gaussian_for(e.noise_multiplier, halve)
        if kind.sampled:
            z = effective_noise_multiplier(e.event)
            if z is None:
                return e
            if z == 0 or math.isinf(z):
                return _gaussian_for(z, halve)  # no noise: no amplification; no release: no-op
            return kind.rebuild(e, lambda _: _gaussian_for(z, halve))
        return kind.rebuild(e, convert)

    return convert(event)


def _supports(event: dpa.DpEvent, accountant: str, relation: NeighbouringRelation) -> bool:
    return _fresh_accountant(accountant, relation).supports(
        for_accountant(event, accountant, relation)
    )


def _unsupported(
    event: dpa.DpEvent, accountant: str, relation: NeighbouringRelation, subject: str
) -> ConfigError:
    """The error for an event ``accountant`` cannot account under ``relation``, blaming the
    one setting whose change would make it work."""
    working = [
        (acc, rel)
        for acc in ACCOUNTANTS
        for rel in NeighbouringRelation
        if _supports(event, acc, rel)
    ]
    options = ", ".join(f"{acc} with {rel.value}" for acc, rel in working) or "none"
    detail = f"dp_accounting supports {subject} only as: {options}"
    other_relations = [rel.value for acc, rel in working if acc == accountant]
    if other_relations:
        return ConfigError(
            "relation",
            relation.value,
            f"{' or '.join(other_relations)} with the {accountant} accountant ({detail})",
        )
    other_accountants = [acc for acc, rel in working if rel is relation]
    if other_accountants:
        return ConfigError(
            "accountant",
            accountant,
            f"{' or '.join(other_accountants)} under {relation.value} neighbours ({detail})",
        )
    return ConfigError("accountant", accountant, f"a supported combination ({detail})")


def _account(
    event: dpa.DpEvent,
    accountant: str,
    relation: NeighbouringRelation,
    delta: float,
    subject: str = "this event",
) -> float:
    acc = _fresh_accountant(accountant, relation)
    translated = for_accountant(event, accountant, relation)
    if not acc.supports(translated):
        raise _unsupported(event, accountant, relation, subject)
    return float(acc.compose(translated).get_epsilon(delta))


def event_epsilon(
    event: dpa.DpEvent, accountant: Accountant, relation: NeighbouringRelation | str, delta: float
) -> float:
    """Epsilon (nats) at ``delta`` of ``event`` (its noise multipliers ``std / C``) under
    ``relation``, by ``accountant``; a ConfigError when that combination is unsupported."""
    return _account(
        event,
        _check_accountant(accountant),
        NeighbouringRelation.parse(relation),
        _check_delta(delta),
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
    accountant = _check_accountant(accountant)
    delta = _check_delta(delta)
    event = run_event(noise_multiplier, _check_sampling(sampling), rounds)
    _check_combination(sampling, accountant, relation)
    return _account(event, accountant, relation, delta, _subject(sampling))


def _check_combination(sampling: Sampling, accountant: str, relation: NeighbouringRelation) -> None:
    """Raise if ``accountant`` cannot account ``sampling`` under ``relation`` (any z > 0)."""
    probe = round_event(1.0, sampling)
    if not _supports(probe, accountant, relation):
        raise _unsupported(probe, accountant, relation, _subject(sampling))


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
    :func:`_curve_from_one_round`), so an RDP curve costs about one point.
    """
    relation = NeighbouringRelation.parse(relation)
    accountant = _check_accountant(accountant)
    delta = _check_delta(delta)
    event = round_event(noise_multiplier, _check_sampling(sampling))
    counts = list(rounds)
    require(len(counts) > 0, "rounds", counts, "a non-empty list of round counts")
    for i, r in enumerate(counts):
        _check_rounds(r, f"rounds[{i}]")
        if i:
            require(r > counts[i - 1], f"rounds[{i}]", r, f"an integer > {counts[i - 1]}")
    _check_combination(sampling, accountant, relation)
    translated = for_accountant(event, accountant, relation)
    if isinstance(sampling, MinSeparation):
        counts = [sampling.participations(r) for r in counts]
    fast = _curve_from_one_round(translated, counts, delta, accountant, relation)
    if fast is not None:
        return fast
    return [
        float(_fresh_accountant(accountant, relation).compose(translated, c).get_epsilon(delta))
        if c
        else 0.0
        for c in counts
    ]


def _curve_from_one_round(
    translated: dpa.DpEvent,
    counts: Sequence[int],
    delta: float,
    accountant: str,
    relation: NeighbouringRelation,
) -> list[float] | None:
    """Epsilon after ``counts`` self-compositions, computing the round's RDP vector / PLD once.

    dp_accounting recomputes an event's RDP curve or PLD (tenths of a second each) on every
    ``compose``; here one accountant composes one round, and its state is read (not written):
    RDP ``count * rdp`` goes through ``rdp_privacy_accountant.compute_epsilon`` (what
    ``get_epsilon`` calls), a Poisson-sampled PLD through ``self_compose(count)`` (what
    ``PLDAccountant`` does for ``SelfComposedDpEvent``). Returns None where that does not apply
    or the state is not there (another dp_accounting version); the caller then composes.
    Tests check this against fresh accountants.
    """
    one = _fresh_accountant(accountant, relation).compose(translated)
    if accountant == "rdp":
        rdp, orders = getattr(one, "_rdp", None), getattr(one, "_orders", None)
        if rdp is None or orders is None:
            return None
        return [
            0.0 if c == 0 else float(rdp_accountant.compute_epsilon(orders, c * rdp, delta)[0])
            for c in counts
        ]
    pld = getattr(one, "_pld", None)
    if not isinstance(translated, dpa.PoissonSampledDpEvent) or pld is None:
        return None
    if getattr(one, "_contains_non_dp_event", True):
        return None
    return [
        0.0 if c == 0 else float(pld.self_compose(c).get_epsilon_for_delta(delta)) for c in counts
    ]


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
    accountant = _check_accountant(accountant)
    delta = _check_delta(delta)
    require(
        _is_number(target_epsilon) and math.isfinite(target_epsilon) and target_epsilon > 0,
        "target_epsilon",
        target_epsilon,
        "a finite number > 0",
    )
    _check_sampling(sampling)
    _check_rounds(rounds, minimum=1)
    _check_combination(sampling, accountant, relation)

    def make_event(z: float) -> dpa.DpEvent:
        return for_accountant(run_event(float(z), sampling, rounds), accountant, relation)

    cache: dict[tuple[str, float], float] = {}

    def make_accountant() -> _CachedAccountant:
        return _CachedAccountant(accountant, relation, cache)

    def eps(z: float) -> float:
        return make_accountant().compose(make_event(z)).get_epsilon(delta)

    guess = 1.0
    if accountant == "pld" and _supports(round_event(1.0, sampling), "rdp", relation):
        guess = calibrate_noise(target_epsilon, delta, sampling, rounds, "rdp", relation)
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


class _CachedAccountant(dpa.PrivacyAccountant):
    """A calibration's accountant: epsilon of the composed events, looked up in a cache that
    all accountants of one calibration share (keyed by the events' repr and delta), else
    computed by a fresh dp_accounting accountant.

    The bracket search, ``calibrate_dp_mechanism``'s evaluation of the bracket's endpoints and
    its final check then account each noise multiplier once (a Poisson-sampled PLD takes about
    half a second to build). Support checks go to the real accountant.
    """

    def __init__(
        self, accountant: str, relation: NeighbouringRelation, cache: dict[tuple[str, float], float]
    ) -> None:
        super().__init__(relation.dp_accounting)
        self._accountant, self._relation = accountant, relation
        self._cache = cache
        self._events: list[tuple[dpa.DpEvent, int]] = []

    def _maybe_compose(
        self, event: dpa.DpEvent, count: int, do_compose: bool
    ) -> dpa.PrivacyAccountant.CompositionErrorDetails | None:
        if not do_compose:
            real = _fresh_accountant(self._accountant, self._relation)
            return real._maybe_compose(event, count, False)
        self._events.append((event, count))
        return None

    def get_epsilon(self, target_delta: float) -> float:
        key = (repr(self._events), float(target_delta))
        if key not in self._cache:
            real = _fresh_accountant(self._accountant, self._relation)
            for event, count in self._events:
                real.compose(event, count)
            self._cache[key] = float(real.get_epsilon(target_delta))
        return self._cache[key]


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


# --------------------------------------------------------------------------------------------
# Ledger
# --------------------------------------------------------------------------------------------

LEDGER_FORMAT = "fedsim.privacy_ledger/1"


def _grouped(events: Sequence[dpa.DpEvent]) -> dpa.DpEvent:
    """The composition of ``events`` with equal events merged into one ``SelfComposedDpEvent``.

    Composition is commutative, so this is the same mechanism; dp_accounting then computes each
    distinct event's RDP curve / PLD once instead of once per round (a 1000-round ledger would
    otherwise take tens of seconds).
    """
    counts: dict[str, list[Any]] = {}
    for event in events:
        key = json.dumps(event_to_dict(event), sort_keys=True)
        if key in counts:
            counts[key][1] += 1
        else:
            counts[key] = [event, 1]
    parts = [e if c == 1 else dpa.SelfComposedDpEvent(e, c) for e, c in counts.values()]
    return parts[0] if len(parts) == 1 else dpa.ComposedDpEvent(parts)


class PrivacyLedger:
    """The privacy events of one run, in round order; epsilon on demand.

    Entries are ``(round, event)`` with immutable ``dp_accounting`` events (a round may record
    several, or one composed event, e.g. an adaptive-clipping round's two Gaussians). Each
    event's noise multipliers are ``std / C`` (module docstring); ``relation`` says which
    neighbours the run's guarantee is for and is applied when accounting.

    ``participation``: ``None`` (default) composes every recorded event -- right for sampled
    rounds, where every client may be in every round. With :class:`MinSeparation`, rounds must
    record Gaussian events without sampling, and epsilon composes the worst set of rounds one
    client can be in: the ``m = min(k, most rounds pickable b apart)`` rounds with the smallest
    effective noise multipliers (a Gaussian with smaller ``z`` dominates one with larger ``z``;
    ignoring the spacing of those ``m`` rounds can only overstate epsilon).
    """

    __slots__ = ("_relation", "_delta", "_participation", "_entries")

    def __init__(
        self,
        relation: NeighbouringRelation | str,
        delta: float,
        participation: MinSeparation | None = None,
    ) -> None:
        self._relation = NeighbouringRelation.parse(relation)
        self._delta = _check_delta(delta)
        require(
            participation is None or isinstance(participation, MinSeparation),
            "participation",
            participation,
            "None or a MinSeparation",
        )
        self._participation = participation
        self._entries: list[tuple[int, dpa.DpEvent]] = []

    @property
    def relation(self) -> NeighbouringRelation:
        return self._relation

    @property
    def delta(self) -> float:
        """The run's target delta (default for :meth:`epsilon`)."""
        return self._delta

    @property
    def participation(self) -> MinSeparation | None:
        return self._participation

    @property
    def entries(self) -> tuple[tuple[int, dpa.DpEvent], ...]:
        return tuple(self._entries)

    def __len__(self) -> int:
        return len(self._entries)

    def __repr__(self) -> str:
        return (
            f"PrivacyLedger(relation={self._relation.value!r}, delta={self._delta!r}, "
            f"participation={self._participation!r}, entries={len(self._entries)})"
        )

    def _check_entry(self, round: int, event: dpa.DpEvent) -> None:  # noqa: A002
        last = self._entries[-1][0] if self._entries else 0
        require(
            _is_int(round) and round >= last,
            "round",
            round,
            f"an integer >= {last} (rounds are recorded in order)",
        )
        check_event(event)
        if self._participation is not None:
            require(
                effective_noise_multiplier(event) is not None
                or isinstance(event, dpa.NonPrivateDpEvent),
                "event",
                event,
                "Gaussian events without sampling (the ledger's participation is MinSeparation)",
            )
        if not any(_supports(event, acc, self._relation) for acc in ACCOUNTANTS):
            raise _unsupported(event, "rdp", self._relation, "this event")

    def record(self, round: int, event: dpa.DpEvent) -> None:  # noqa: A002
        """Append ``event`` for ``round`` (>= the last recorded round), after checking it."""
        self._check_entry(round, event)
        self._entries.append((round, event))

    def _worst_case(self, entries: Sequence[tuple[int, dpa.DpEvent]]) -> dpa.DpEvent:
        if not entries:
            return dpa.NoOpDpEvent()
        if self._participation is None:
            return _grouped([e for _, e in entries])
        precision: dict[int, float] = {}  # round -> sum of z^-2 (inf: no noise)
        for r, e in entries:
            z = 0.0 if isinstance(e, dpa.NonPrivateDpEvent) else effective_noise_multiplier(e)
            if z is None:  # unreachable: record() checks
                raise ConfigError("event", e, "a Gaussian event without sampling")
            if math.isinf(z):
                continue
            precision[r] = precision.get(r, 0.0) + (math.inf if z == 0 else z**-2)
        pickable, last = 0, None
        for r in sorted(precision):
            if last is None or r - last >= self._participation.min_separation:
                pickable, last = pickable + 1, r
        m = min(self._participation.max_participations, pickable)
        worst = sorted(precision.values(), reverse=True)[:m]
        return dpa.ComposedDpEvent(
            [
                dpa.NonPrivateDpEvent() if math.isinf(p) else dpa.GaussianDpEvent(p**-0.5)
                for p in worst
            ]
        )

    def worst_case_event(self) -> dpa.DpEvent:
        """One event that bounds everything recorded for the worst-placed participant (all
        entries composed, or, with a MinSeparation participation, its worst rounds)."""
        return self._worst_case(self._entries)

    def epsilon(self, delta: float | None = None, accountant: Accountant = "rdp") -> float:
        """Epsilon (nats) at ``delta`` (default: the ledger's) of everything recorded."""
        delta = self._delta if delta is None else _check_delta(delta)
        accountant = _check_accountant(accountant)
        return _account(
            self._worst_case(self._entries),
            accountant,
            self._relation,
            delta,
            "the recorded events",
        )

    def epsilon_if(
        self,
        event: dpa.DpEvent,
        delta: float | None = None,
        accountant: Accountant = "rdp",
        round: int | None = None,  # noqa: A002
    ) -> float:
        """Epsilon if ``event`` were recorded next (for ``round``, default last + 1).

        For stopping a run before a round would exceed its budget; records nothing.
        """
        if round is None:
            round = self._entries[-1][0] + 1 if self._entries else 0  # noqa: A001
        self._check_entry(round, event)
        delta = self._delta if delta is None else _check_delta(delta)
        accountant = _check_accountant(accountant)
        entries = [*self._entries, (round, event)]
        return _account(
            self._worst_case(entries), accountant, self._relation, delta, "the recorded events"
        )

    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready checkpoint of the ledger (events via :mod:`fedsim.privacy.events`)."""
        p = self._participation
        return {
            "format": LEDGER_FORMAT,
            "relation": self._relation.value,
            "delta": self._delta,
            "participation": None
            if p is None
            else {
                "min_separation": p.min_separation,
                "max_participations": p.max_participations,
            },
            "entries": [{"round": r, "event": event_to_dict(e)} for r, e in self._entries],
        }

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> PrivacyLedger:
        """Rebuild a ledger written by :meth:`to_dict`, checking every field."""
        require(isinstance(data, Mapping), "ledger", data, "a JSON object")
        require(
            data.get("format") == LEDGER_FORMAT,
            "ledger.format",
            data.get("format"),
            repr(LEDGER_FORMAT),
        )
        known = {"format", "relation", "delta", "participation", "entries"}
        for key in sorted(set(data) - known):
            raise ConfigError(f"ledger.{key}", data[key], f"a known key: {sorted(known)}")
        p = data.get("participation")
        participation = None
        if p is not None:
            require(
                isinstance(p, Mapping) and set(p) == {"min_separation", "max_participations"},
                "ledger.participation",
                p,
                "null or {min_separation, max_participations}",
            )
            participation = MinSeparation(p["min_separation"], p["max_participations"])
        ledger = cls(
            NeighbouringRelation.parse(data.get("relation"), "ledger.relation"),
            _check_delta(data.get("delta"), "ledger.delta"),
            participation,
        )
        entries = data.get("entries")
        require(isinstance(entries, list), "ledger.entries", entries, "a list")
        for i, item in enumerate(entries):
            key = f"ledger.entries[{i}]"
            require(
                isinstance(item, Mapping) and set(item) == {"round", "event"},
                key,
                item,
                "an object with keys round, event",
            )
            ledger.record(item["round"], event_from_dict(item["event"], f"{key}.event"))
        return ledger
