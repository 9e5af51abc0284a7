"""A federated round as ``dp_accounting`` events: the (sub)sampled Gaussian mechanism.

A round of DP-FedAvg (McMahan et al. 2018, Alg. 1) or DP-SGD (Abadi et al. 2016) is a Gaussian
release of a clipped sum, wrapped in its sampling model's amplification event. Noise multiplier
``z`` = noise std / ``C``, ``C`` the L2 bound of one participant's contribution; ``z = 0`` is
no noise (epsilon ``inf``). Adaptive clipping (Andrew et al. 2021) adds a noisy count.
"""

from __future__ import annotations

import math
from typing import Any

import dp_accounting as dpa

from fedsim.config import require
from fedsim.privacy.events import kind_of
from fedsim.privacy.participation import Participation
from fedsim.privacy.sampling import (
    FixedSizeSampling,
    PoissonSampling,
    Sampling,
    check_rounds,
    check_sampling,
    is_number,
)

#: Calibration searches noise multipliers in this range.
Z_MIN, Z_MAX = 2.0**-8, 2.0**20


def check_noise_multiplier(value: Any, key: str = "noise_multiplier") -> float:
    """0 (no noise: epsilon is infinite) or a number in [Z_MIN, Z_MAX]: below Z_MIN epsilon
    exceeds 1e5 and dp_accounting's RDP bound loses its precision (it reports 0 for
    z = 1e-154), so a smaller noise multiplier would be accounted optimistically."""
    require(
        is_number(value)
        and math.isfinite(value)
        and (value == 0 or Z_MIN <= value <= Z_MAX),
        key,
        value,
        f"0 (no noise, epsilon inf) or a number in [{Z_MIN:g}, {Z_MAX:g}] (noise std / "
        "clipping norm; below that dp_accounting's bound loses its precision)",
    )
    return float(value)



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
            ``GaussianDpEvent``. For a :class:`Participation` schedule this is the event of one
            participation (how many of them a client sees is :func:`run_event`'s business).
    """
    z = check_noise_multiplier(noise_multiplier)
    check_sampling(sampling)
    if z == 0:
        return dpa.NonPrivateDpEvent()
    return _sampled(dpa.GaussianDpEvent(z), sampling)


def run_event(noise_multiplier: float, sampling: Sampling, rounds: int) -> dpa.DpEvent:
    """``rounds`` rounds of :func:`round_event`, as seen by the worst-case client.

    That is ``rounds`` self-compositions, except under a :class:`Participation` schedule, where a
    client is in at most ``participations(rounds)`` rounds (b-min-separation:
    ``min(k, ceil(rounds / b))``) and the Gaussian is composed that many times.
    """
    rounds = check_rounds(rounds)
    event = round_event(noise_multiplier, sampling)
    count = sampling.participations(rounds) if isinstance(sampling, Participation) else rounds
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
        is_number(z) and math.isfinite(z) and z > 0,
        "total_noise_multiplier",
        z,
        "a finite number > 0",
    )
    sb = count_stddev
    require(
        is_number(sb) and math.isfinite(sb) and sb > 0, "count_stddev", sb, "a finite number > 0"
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
    check_sampling(sampling)
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
