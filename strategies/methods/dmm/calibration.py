"""DMM's calibration, checked before any client trains (docs/dmm-design.md, steps 1, 2, 8):
the committee bound the thresholds assume, the ranges of the mechanism's arguments, gamma for
``bits`` (KLS21), each client's share of the noise and the worst released row, which must fit
the field F_p, p = 2^e - 1."""

from __future__ import annotations

import math
from dataclasses import dataclass

from fedsim.privacy import dmm as dmm_privacy
from fedsim.privacy.matrix.factorization import Factorization
from fedsim.privacy.participation import Participation
from protocols.encoding import DDGaussEncoder, choose_gamma
from protocols.field import MersenneField
from strategies.secure.clear import check_evaluation, evaluation_refusal

#: the refusal of federated evaluation without ``metrics_in_clear``
EVALUATION = evaluation_refusal("DMM")


def committee_bound(n: int, t: int, k: int, dropouts: int) -> None:
    """Refuse a committee that cannot meet t_corrupt + t_dropout < (1/2 - mu) n, mu = k / n
    (Bienstock et al.): honest online members must outnumber the corrupt and the dropped by
    more than the packing, so that the released shares decode uniquely with t wrong ones."""
    for name, value, low in (
        ("committee_size", n, 1),
        ("threshold", t, 1),
        ("packing", k, 1),
        ("member_dropouts", dropouts, 0),
    ):
        if isinstance(value, bool) or not isinstance(value, int) or value < low:
            raise ValueError(f"{name}={value!r}; allowed: an integer >= {low}")
    if not t + dropouts < (0.5 - k / n) * n:
        raise ValueError(
            f"threshold + member_dropouts = {t} + {dropouts} is not below (1/2 - packing / "
            f"committee_size) * committee_size = (1/2 - {k}/{n}) * {n} = {n / 2 - k:g}: the "
            "committee cannot meet the corruption/dropout bound its thresholds assume "
            "(t_corrupt + t_dropout < (1/2 - mu) n); raise committee_size or lower threshold, "
            "packing or member_dropouts"
        )


def check_arguments(
    *,
    worker_fold: bool,
    clipping_norm: float,
    noise_multiplier: float,
    expected_clients: int,
    population: int,
    expected_client_dropout: float,
    mode: str,
    committee_actors: bool,
    committee_shards: int,
    committee: tuple[int, int, int, int],
    fraction_evaluate: float,
    metrics_in_clear: bool,
) -> None:
    """Raise ValueError on a :class:`strategies.methods.dmm.DMM` argument out of its range:
    ``committee`` is (n, t, k, member dropouts) (:func:`committee_bound`), and a
    ``fraction_evaluate`` > 0 needs ``metrics_in_clear``."""
    committee_size = committee[0]
    if not isinstance(worker_fold, bool):
        raise ValueError(f"worker_fold={worker_fold!r}; allowed: True or False")
    for name, value in (
        ("clipping_norm", clipping_norm),
        ("noise_multiplier", noise_multiplier),
    ):
        if not (math.isfinite(value) and value > 0):
            raise ValueError(f"{name}={value!r}; it must be finite and > 0")
    for name, value in (("expected_clients", expected_clients), ("population", population)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name}={value!r}; it must be an integer >= 1")
    if committee_size > population:
        raise ValueError(
            f"committee_size={committee_size} exceeds the population of {population} clients"
        )
    if not 0.0 <= expected_client_dropout < 1.0:
        raise ValueError(
            f"expected_client_dropout={expected_client_dropout!r}; allowed: [0, 1)"
        )
    if mode not in ("full", "ideal"):
        raise ValueError(f"mode={mode!r}; allowed: 'full', 'ideal'")
    if not isinstance(committee_actors, bool):
        raise ValueError(f"committee_actors={committee_actors!r}; allowed: True or False")
    if isinstance(committee_shards, bool) or not isinstance(committee_shards, int) or not (
        1 <= committee_shards <= committee_size
    ):
        raise ValueError(
            f"committee_shards={committee_shards!r}; allowed: an integer in "
            f"[1, committee_size={committee_size}]"
        )
    committee_bound(*committee)
    check_evaluation(fraction_evaluate, metrics_in_clear, EVALUATION)


def integer_mechanism(
    factorization: Factorization,
    fractional_bits: int | None,
    participation: Participation | None,
) -> dmm_privacy.IntegerMechanism:
    """M = round(2^f C) of ``factorization`` (f = ``fractional_bits``; None: 12 for banded C,
    0 for the tree) for the schema ``participation`` (None: single participation)."""
    tree = factorization.kind in dmm_privacy.tree_kinds()
    f = (0 if tree else 12) if fractional_bits is None else fractional_bits
    return dmm_privacy.IntegerMechanism(factorization, f, participation or Participation.single())


@dataclass(frozen=True)
class Plan:
    """What the noise and the bit budget are planned for: c, z, the planned cohort m and the
    fraction of it the noise may lose, ``bits`` of the sum of m rounded updates, KLS21's beta
    and tries, and the probability the worst-row bound may fail."""

    clipping_norm: float
    noise_multiplier: float
    expected_clients: int
    expected_client_dropout: float
    bits: int
    beta: float
    max_tries: int
    failure_probability: float


def calibrate(
    plan: Plan, mechanism: dmm_privacy.IntegerMechanism, field: MersenneField, dim: int
) -> tuple[DDGaussEncoder, float]:
    """(the encoder for models of ``dim`` parameters, each client's noise std in integer
    steps): z (c / gamma) sens(M) / sqrt(planned clients). Raises ``ValueError`` when that
    std is below 1/2 (KLS21) or, with the budget, when a released row could wrap mod p."""
    gamma = choose_gamma(
        dim, plan.expected_clients, plan.clipping_norm, 0.0, plan.bits, beta=plan.beta
    )
    encoder = DDGaussEncoder(dim, plan.clipping_norm, gamma, 0.0, plan.beta, plan.max_tries)
    planned = max(1.0, (1.0 - plan.expected_client_dropout) * plan.expected_clients)
    scaled = (
        plan.noise_multiplier * (plan.clipping_norm / gamma) * mechanism.sensitivity.value
    ) / math.sqrt(planned)
    if scaled < 0.5:
        raise ValueError(
            f"each client's noise is {scaled:.3g} integer steps (gamma={gamma:.3g}); KLS21 "
            f"needs >= 1/2: raise bits (now {plan.bits}) or noise_multiplier"
        )
    worst = dmm_privacy.worst_release(
        mechanism,
        plan.expected_clients,
        encoder.l2_bound,
        scaled,
        encoder.padded_dim,
        plan.failure_probability,
    )
    if worst > field.max_signed:
        raise ValueError(
            f"bit budget: a released row can reach {worst:.4g} = 2^{math.log2(worst):.1f} "
            f"(max row |M|_1 = {mechanism.max_row_l1}, expected_clients = "
            f"{plan.expected_clients}, bits = {plan.bits}, fractional_bits = "
            f"{mechanism.fractional_bits}, failure probability "
            f"{plan.failure_probability:g}) but F_p with p = 2^{field.exponent} - 1 holds "
            f"signed values below 2^{field.exponent - 1}; lower bits or fractional_bits"
        )
    return encoder, scaled
