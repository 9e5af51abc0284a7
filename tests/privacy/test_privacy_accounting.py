"""Privacy accounting: reference values, relations, calibration, adaptive clipping, curves."""

import functools
import math

import dp_accounting as dpa
import pytest
from dp_accounting.rdp import RdpAccountant

from fedsim.config import ConfigError
from fedsim.privacy.accountant import for_accountant
from fedsim.privacy.calibration import calibrate_noise
from fedsim.privacy.epsilon import epsilon as _epsilon
from fedsim.privacy.epsilon import epsilon_curve
from fedsim.privacy.ledger import PrivacyLedger
from fedsim.privacy.participation import Participation
from fedsim.privacy.round_events import (
    Z_MAX,
    Z_MIN,
    adaptive_clipping_round_event,
    effective_noise_multiplier,
    round_event,
    run_event,
    split_noise_multiplier,
)
from fedsim.privacy.sampling import (
    FixedSizeSampling,
    FullParticipation,
    NeighbouringRelation,
    PoissonSampling,
)

DELTA = 1e-5
POISSON = PoissonSampling(0.01)

# dp_accounting is deterministic: a value asked for again (here or in another test) is reused.
# typed: 1, 1.0 and True stay separate calls, so a type check is never answered from the cache.
epsilon = functools.lru_cache(maxsize=None, typed=True)(_epsilon)


# ---------------------------------------------------------------- reference values


def test_reference_values_poisson_subsampled_gaussian():
    """Measured with dp-accounting 0.6.0 (shared/reference/flower-ray-anchors.md)."""
    assert round(epsilon(1.0, POISSON, 1000, DELTA, "rdp"), 4) == 2.1014
    assert round(epsilon(1.0, POISSON, 1000, DELTA, "pld"), 4) == 1.8282


def test_round_event_is_the_dp_accounting_event():
    assert round_event(1.0, POISSON) == dpa.PoissonSampledDpEvent(0.01, dpa.GaussianDpEvent(1.0))
    assert round_event(2.0, FixedSizeSampling(10, 100)) == dpa.SampledWithoutReplacementDpEvent(
        100, 10, dpa.GaussianDpEvent(2.0)
    )
    # Sampling everyone is full participation: a plain Gaussian, no amplification claimed.
    for full in (
        PoissonSampling(1.0),
        FixedSizeSampling(7, 7),
        FullParticipation(),
        Participation.separated(3, 2),
    ):
        assert round_event(1.5, full) == dpa.GaussianDpEvent(1.5)
    assert round_event(0.0, POISSON) == dpa.NonPrivateDpEvent()


def test_amplification_orders_the_sampling_models():
    full = epsilon(1.0, FullParticipation(), 100, DELTA)
    assert epsilon(1.0, PoissonSampling(1.0), 100, DELTA) == full
    assert epsilon(1.0, PoissonSampling(0.1), 100, DELTA) < full
    assert epsilon(1.0, PoissonSampling(0.01), 100, DELTA) < epsilon(
        1.0, PoissonSampling(0.1), 100, DELTA
    )


@pytest.mark.parametrize("accountant", ["rdp", "pld"])
def test_no_noise_is_infinite_and_no_rounds_is_zero(accountant):
    for sampling in (POISSON, FullParticipation(), Participation.separated(2, 3)):
        assert epsilon(0.0, sampling, 10, DELTA, accountant) == math.inf
        assert epsilon(1.0, sampling, 0, DELTA, accountant) == 0.0


def test_gaussians_compose_into_one_gaussian():
    """T full-participation rounds with z equal one round with z / sqrt(T) (both accountants)."""
    for accountant in ("rdp", "pld"):
        many = epsilon(2.0, FullParticipation(), 16, DELTA, accountant)
        one = epsilon(0.5, FullParticipation(), 1, DELTA, accountant)
        assert many == pytest.approx(one, rel=1e-3)


# ---------------------------------------------------------------- neighbouring relations


@pytest.mark.parametrize("z", [0.7, 2.0, 8.0])
def test_replace_one_is_consistent_across_accountants(z):
    """PLD is the tighter bound, so RDP must not fall below it under either relation.

    dp_accounting's RdpAccountant ignores the relation for a GaussianDpEvent while its
    PLDAccountant doubles the sensitivity under REPLACE_ONE; without fedsim's correction the
    replace-one RDP epsilon comes out at less than half the PLD one.
    """
    for relation in NeighbouringRelation:
        rdp = epsilon(z, FullParticipation(), 4, DELTA, "rdp", relation)
        pld = epsilon(z, FullParticipation(), 4, DELTA, "pld", relation)
        assert pld <= rdp <= 1.3 * pld


def test_replace_one_costs_more_than_add_remove():
    for accountant in ("rdp", "pld"):
        add_remove = epsilon(2.0, FullParticipation(), 10, DELTA, accountant, "add_remove")
        replace = epsilon(2.0, FullParticipation(), 10, DELTA, accountant, "replace_one")
        assert replace > 1.5 * add_remove
    poisson_ar = epsilon(1.0, POISSON, 100, DELTA, "pld", "add_remove")
    poisson_r1 = epsilon(1.0, POISSON, 100, DELTA, "pld", "replace_one")
    assert poisson_r1 > poisson_ar


def test_fixed_size_sampling_is_sensitivity_2c_under_replace_one():
    """m of n without replacement amplifies, but replacing a sampled client moves the sum by 2C:
    the RDP event sees z / 2, so it must cost more than the same event read with z."""
    fixed = FixedSizeSampling(10, 1000)
    ours = epsilon(1.0, fixed, 100, DELTA, "rdp", "replace_one")
    assert ours < epsilon(1.0, FullParticipation(), 100, DELTA, "rdp", "replace_one")
    raw = RdpAccountant(neighboring_relation=dpa.NeighboringRelation.REPLACE_ONE)
    raw.compose(run_event(1.0, fixed, 100))
    assert ours > raw.get_epsilon(DELTA)
    assert for_accountant(round_event(1.0, fixed), "rdp", "replace_one") == (
        dpa.SampledWithoutReplacementDpEvent(1000, 10, dpa.GaussianDpEvent(0.5))
    )
    assert for_accountant(round_event(1.0, fixed), "pld", "replace_one") == round_event(1.0, fixed)


@pytest.mark.parametrize(
    ("sampling", "accountant", "relation", "key"),
    [
        (FixedSizeSampling(10, 1000), "rdp", "add_remove", "relation"),
        (FixedSizeSampling(10, 1000), "pld", "replace_one", "accountant"),
        (FixedSizeSampling(10, 1000), "pld", "add_remove", "accountant"),
        (PoissonSampling(0.01), "rdp", "replace_one", "relation"),
    ],
)
def test_unsupported_combinations_name_the_setting(sampling, accountant, relation, key):
    with pytest.raises(ConfigError) as err:
        epsilon(1.0, sampling, 10, DELTA, accountant, relation)
    assert err.value.key == key
    assert type(sampling).__name__ in err.value.allowed
    with pytest.raises(ConfigError):
        calibrate_noise(1.0, DELTA, sampling, 10, accountant, relation)
    with pytest.raises(ConfigError):
        epsilon_curve(1.0, sampling, [1, 2], DELTA, accountant, relation)


def test_supported_combinations_give_finite_epsilon():
    cases = [
        (POISSON, "rdp", "add_remove"),
        (POISSON, "pld", "add_remove"),
        (POISSON, "pld", "replace_one"),
        (FixedSizeSampling(10, 1000), "rdp", "replace_one"),
    ]
    for sampling in (FullParticipation(), Participation.separated(3, 2)):
        for acc in ("rdp", "pld"):
            for rel in ("add_remove", "replace_one"):
                cases.append((sampling, acc, rel))
    for sampling, acc, rel in cases:
        assert 0 < epsilon(1.0, sampling, 6, DELTA, acc, rel) < math.inf


# ---------------------------------------------------------------- min separation


def test_min_separation_counts_at_most_k_participations():
    sep = Participation.separated(10, 3)
    assert sep.participations(100) == 3
    assert sep.participations(15) == 2  # rounds 0 and 10 only
    assert sep.participations(0) == 0
    for acc in ("rdp", "pld"):
        three = epsilon(1.0, FullParticipation(), 3, DELTA, acc)
        assert epsilon(1.0, sep, 100, DELTA, acc) == three
        assert epsilon(1.0, sep, 10_000, DELTA, acc) == three  # no growth after k
        assert epsilon(1.0, sep, 15, DELTA, acc) == epsilon(1.0, FullParticipation(), 2, DELTA, acc)
    assert run_event(1.0, sep, 100) == dpa.SelfComposedDpEvent(dpa.GaussianDpEvent(1.0), 3)


def test_every_participation_kind_is_accounted_as_its_most_participations():
    """single: one Gaussian; fixed_epoch: one per epoch; min_sep with k None: ceil(T / b)."""
    for acc in ("rdp", "pld"):
        def gaussians(count, acc=acc):
            return epsilon(1.0, FullParticipation(), count, DELTA, acc)

        assert epsilon(1.0, Participation.single(), 50, DELTA, acc) == gaussians(1)
        assert epsilon(1.0, Participation.fixed(4), 40, DELTA, acc) == gaussians(4)
        assert epsilon(1.0, Participation.separated(10), 35, DELTA, acc) == gaussians(4)


def test_a_min_separation_ledger_round_trips_through_json_with_its_keys():
    ledger = PrivacyLedger("add_remove", DELTA, Participation.separated(4, 3))
    for r in range(1, 9):
        ledger.record(r, round_event(1.0, FullParticipation()))
    data = ledger.to_dict()
    assert data["participation"] == {"min_separation": 4, "max_participations": 3}
    back = PrivacyLedger.from_dict(data)
    assert back.participation == Participation.separated(4, 3)
    assert back.epsilon() == ledger.epsilon()
    # rounds 1, 5 pickable 4 apart among 8: two, fewer than k = 3
    assert ledger.epsilon() == pytest.approx(epsilon(1.0, FullParticipation(), 2, DELTA), rel=1e-9)


@pytest.mark.parametrize("participation", [Participation.single(), Participation.fixed(2), (4, 3)])
def test_a_ledger_takes_only_a_min_separation_participation(participation):
    with pytest.raises(ConfigError) as err:
        PrivacyLedger("add_remove", DELTA, participation)
    assert err.value.key == "participation"


# ---------------------------------------------------------------- validation


@pytest.mark.parametrize(
    ("kwargs", "key"),
    [
        ({"delta": 0.0}, "delta"),
        ({"delta": 1.0}, "delta"),
        ({"delta": -1e-5}, "delta"),
        ({"delta": float("nan")}, "delta"),
        ({"delta": True}, "delta"),
        ({"noise_multiplier": -0.1}, "noise_multiplier"),
        ({"noise_multiplier": float("nan")}, "noise_multiplier"),
        ({"noise_multiplier": float("inf")}, "noise_multiplier"),
        ({"noise_multiplier": "1"}, "noise_multiplier"),
        ({"rounds": -1}, "rounds"),
        ({"rounds": 2.5}, "rounds"),
        ({"accountant": "prv"}, "accountant"),
        ({"relation": "add-or-remove"}, "relation"),
        ({"sampling": None}, "sampling"),
        ({"sampling": 0.01}, "sampling"),
    ],
)
def test_bad_inputs_name_their_key(kwargs, key):
    args = {
        "noise_multiplier": 1.0,
        "sampling": POISSON,
        "rounds": 10,
        "delta": DELTA,
        "accountant": "rdp",
        "relation": "add_remove",
        **kwargs,
    }
    with pytest.raises(ConfigError) as err:
        epsilon(**args)
    assert err.value.key == key


@pytest.mark.parametrize(
    ("make", "key"),
    [
        (lambda: PoissonSampling(0.0), "rate"),
        (lambda: PoissonSampling(1.01), "rate"),
        (lambda: PoissonSampling(float("nan")), "rate"),
        (lambda: FixedSizeSampling(0, 10), "sample_size"),
        (lambda: FixedSizeSampling(11, 10), "sample_size"),
        (lambda: FixedSizeSampling(1, 0), "population"),
        (lambda: FixedSizeSampling(1.5, 10), "sample_size"),
        (lambda: Participation.separated(0, 1), "min_separation"),
        (lambda: Participation.separated(1, 0), "max_participations"),
        (lambda: Participation.separated(1.5, 2), "min_separation"),
        (lambda: Participation.separated(True, 2), "min_separation"),
        (lambda: Participation.separated(2, 2.0), "max_participations"),
        (lambda: Participation.fixed(0), "epochs"),
        (lambda: Participation("weekly"), "kind"),
    ],
)
def test_sampling_models_check_their_fields(make, key):
    with pytest.raises(ConfigError) as err:
        make()
    assert err.value.key == key


# ---------------------------------------------------------------- calibration


@pytest.mark.parametrize(
    ("target", "sampling", "rounds"),
    [
        (2.0, PoissonSampling(0.01), 1000),
        (0.5, PoissonSampling(0.05), 300),
        (8.0, FullParticipation(), 50),
        (1.0, Participation.separated(10, 4), 100),
    ],
)
def test_calibrate_then_account_round_trips_rdp(target, sampling, rounds):
    z = calibrate_noise(target, DELTA, sampling, rounds)
    achieved = epsilon(z, sampling, rounds, DELTA)
    assert achieved <= target  # never over budget
    assert achieved == pytest.approx(target, rel=0.01)
    assert epsilon(0.99 * z, sampling, rounds, DELTA) > target  # and not wastefully noisy


@pytest.mark.parametrize(
    ("sampling", "acc", "rel"),
    [
        (PoissonSampling(0.02), "pld", "add_remove"),
        (PoissonSampling(0.02), "pld", "replace_one"),
        (FixedSizeSampling(20, 1000), "rdp", "replace_one"),
    ],
)
def test_calibrate_then_account_round_trips_pld_and_replace_one(sampling, acc, rel):
    z = calibrate_noise(3.0, DELTA, sampling, 100, acc, rel)
    achieved = epsilon(z, sampling, 100, DELTA, acc, rel)
    assert achieved <= 3.0
    assert achieved == pytest.approx(3.0, rel=0.01)
    if acc == "pld" and rel == "add_remove":
        # PLD is the tighter bound: it meets the same target with less noise than RDP.
        assert z < calibrate_noise(3.0, DELTA, sampling, 100, "rdp", rel)


@pytest.mark.parametrize(
    ("kwargs", "key"),
    [
        ({"target_epsilon": 0.0}, "target_epsilon"),
        ({"target_epsilon": float("inf")}, "target_epsilon"),
        (
            {"target_epsilon": 1e-9, "sampling": FullParticipation(), "rounds": 1000},
            "target_epsilon",
        ),
        ({"rounds": 0}, "rounds"),
        ({"delta": 1.0}, "delta"),
    ],
)
def test_calibration_rejects_what_it_cannot_meet(kwargs, key):
    args = {"target_epsilon": 1.0, "delta": DELTA, "sampling": POISSON, "rounds": 10, **kwargs}
    with pytest.raises(ConfigError) as err:
        calibrate_noise(**args)
    assert err.value.key == key


# ---------------------------------------------------------------- adaptive clipping


@pytest.mark.parametrize("z, sigma_b", [(1.0, 5.0), (0.8, 0.41), (2.0, 20.0)])
def test_split_noise_multiplier_keeps_the_rdp_epsilon(z, sigma_b):
    """Update noise z_delta plus count noise (multiplier 2 sigma_b) cost what one z costs."""
    z_update = split_noise_multiplier(z, sigma_b)
    assert z_update > z
    for sampling in (PoissonSampling(0.05), FullParticipation()):
        composed = dpa.ComposedDpEvent(
            [dpa.GaussianDpEvent(z_update), dpa.GaussianDpEvent(2 * sigma_b)]
        )
        if isinstance(sampling, PoissonSampling):
            composed = dpa.PoissonSampledDpEvent(sampling.rate, composed)
        raw = RdpAccountant().compose(dpa.SelfComposedDpEvent(composed, 100))
        assert raw.get_epsilon(DELTA) == pytest.approx(
            epsilon(z, sampling, 100, DELTA, "rdp"), rel=1e-9
        )


def test_adaptive_clipping_round_accounts_like_one_gaussian_in_both_accountants():
    for acc in ("rdp", "pld"):
        event = adaptive_clipping_round_event(1.0, 2.0, POISSON)
        assert isinstance(event, dpa.PoissonSampledDpEvent)
        ledger = PrivacyLedger("add_remove", DELTA)
        for r in range(50):
            ledger.record(r, event)
        assert ledger.epsilon(accountant=acc) == pytest.approx(
            epsilon(1.0, POISSON, 50, DELTA, acc), rel=1e-6
        )


@pytest.mark.parametrize(
    ("z", "sigma_b", "key"),
    [
        (1.0, 0.5, "count_stddev"),  # 2 sigma_b == z: the count takes the whole budget
        (1.0, 0.3, "count_stddev"),
        (1.0, 0.0, "count_stddev"),
        (0.0, 1.0, "total_noise_multiplier"),
        (-1.0, 1.0, "total_noise_multiplier"),
    ],
)
def test_split_noise_multiplier_rejects_a_spent_budget(z, sigma_b, key):
    with pytest.raises(ConfigError) as err:
        split_noise_multiplier(z, sigma_b)
    assert err.value.key == key


def test_effective_noise_multiplier_matches_dp_accounting_reduction():
    """dp_accounting's RDP accountant reduces Gaussians inside a sampled event the same way."""
    inner = dpa.ComposedDpEvent(
        [dpa.GaussianDpEvent(1.3), dpa.SelfComposedDpEvent(dpa.GaussianDpEvent(4.0), 3)]
    )
    z = effective_noise_multiplier(inner)
    nested = RdpAccountant().compose(dpa.PoissonSampledDpEvent(0.1, inner), 20)
    reduced = RdpAccountant().compose(dpa.PoissonSampledDpEvent(0.1, dpa.GaussianDpEvent(z)), 20)
    assert nested.get_epsilon(DELTA) == pytest.approx(reduced.get_epsilon(DELTA), rel=1e-9)
    assert effective_noise_multiplier(dpa.NoOpDpEvent()) == math.inf
    assert effective_noise_multiplier(dpa.LaplaceDpEvent(1.0)) is None
    assert (
        effective_noise_multiplier(
            dpa.ComposedDpEvent([dpa.GaussianDpEvent(0.0), dpa.GaussianDpEvent(1.0)])
        )
        == 0.0
    )


# ---------------------------------------------------------------- curves


FULL_CURVE = [1, 2, 5, 9]  # composed afresh per point: a short curve (std z / sqrt(T) PLDs)


@pytest.mark.parametrize(
    ("accountant", "sampling", "rel", "rounds"),
    [
        ("rdp", PoissonSampling(0.02), 1e-9, [1, 5, 12, 40, 100]),
        ("pld", PoissonSampling(0.02), 1e-6, [1, 5, 12, 40, 100]),
        ("rdp", FixedSizeSampling(5, 100), 1e-9, [1, 5, 12, 40, 100]),
        ("pld", FullParticipation(), 1e-9, FULL_CURVE),
        ("rdp", Participation.separated(4, 3), 1e-9, [1, 5, 12, 40, 100]),
    ],
)
def test_epsilon_curve_matches_fresh_accountants(accountant, sampling, rel, rounds):
    relation = "replace_one" if isinstance(sampling, FixedSizeSampling) else "add_remove"
    curve = epsilon_curve(1.0, sampling, rounds, DELTA, accountant, relation)
    for r, value in zip(rounds, curve):
        assert value == pytest.approx(
            epsilon(1.0, sampling, r, DELTA, accountant, relation), rel=rel
        )
    assert curve == sorted(curve)


def test_epsilon_curve_checks_its_rounds():
    for rounds, key in (
        ([], "rounds"),
        ([5, 5], "rounds[1]"),
        ([3, 2], "rounds[1]"),
        ([-1], "rounds[0]"),
    ):
        with pytest.raises(ConfigError) as err:
            epsilon_curve(1.0, POISSON, rounds, DELTA)
        assert err.value.key == key


@pytest.mark.parametrize("z", [1e-300, 1e-154, 1e-3, Z_MIN / 2, Z_MAX * 2])
def test_noise_multipliers_dp_accounting_cannot_bound_are_refused_not_reported_as_small_epsilon(z):
    # dp_accounting returns epsilon 0.0 for z = 1e-154 (and divides by zero at 1e-300): such
    # a noise multiplier must be refused, never accounted optimistically
    with pytest.raises(ConfigError, match="noise_multiplier"):
        epsilon(z, POISSON, 10, DELTA)
    assert epsilon(Z_MIN, POISSON, 10, DELTA) > 100
    assert epsilon(0.0, POISSON, 10, DELTA) == math.inf
