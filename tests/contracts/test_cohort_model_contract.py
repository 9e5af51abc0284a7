"""The contract every :class:`fedsim.engine.participation.CohortModel` passes (module
docstring there): cohorts are sorted int64 ids inside the population, a function of
``(round, kind)`` and of the seed (or the server's secret) only; the accounting view is one the
ledger accepts and is never optimistic about the cohorts drawn (their sizes, the rate, the
participations of a client); secret draws do not follow from the public seed.

The models are found in the source tree (:mod:`contracts.discovery`); each has its examples in
:data:`EXAMPLES`, and a model without one fails :func:`test_every_cohort_model_has_examples`.
"""

from __future__ import annotations

import pickle
from dataclasses import replace

import numpy as np
import pytest

from contracts.discovery import implementations
from fedsim.engine.participation import (
    EVALUATE,
    TRAIN,
    CohortModel,
    FullCohort,
    MinSeparationCohort,
    PoissonCohort,
    UniformCohort,
    secret_cohorts,
)
from fedsim.privacy.participation import Participation
from fedsim.privacy.sampling import (
    FixedSizeSampling,
    FullParticipation,
    PoissonSampling,
    check_sampling,
    relation_for,
)
from fedsim.randomness import RunSecret

ROUNDS = 24  # rounds drawn by the per-round checks
#: a few models of each kind, small enough to draw hundreds of cohorts
EXAMPLES: dict[str, list[CohortModel]] = {
    "fedsim.engine.participation:FullCohort": [FullCohort(1), FullCohort(37)],
    "fedsim.engine.participation:UniformCohort": [
        UniformCohort(50, 7, seed=3),
        UniformCohort(12, 12, seed=0),
        UniformCohort(10**9, 40, seed=1),  # cost O(cohort), not O(population)
    ],
    "fedsim.engine.participation:PoissonCohort": [
        PoissonCohort(200, 0.1, seed=1),
        PoissonCohort(30, 1.0, seed=2),
    ],
    "fedsim.engine.participation:MinSeparationCohort": [
        MinSeparationCohort(50, 4, seed=2),
        MinSeparationCohort(13, 13, seed=5),
        MinSeparationCohort(9, 1, seed=0),
    ],
}
FOUND = implementations(CohortModel)
NAMES = sorted(FOUND)
CASES = [
    pytest.param(model, id=f"{name.split(':')[1]}-{i}")
    for name in NAMES
    for i, model in enumerate(EXAMPLES.get(name, []))
]


def server_secret(phrase: str = "cohort-contract"):
    return RunSecret.from_passphrase(phrase).server()


def with_secrets(cases):
    """Each example, and its secret-drawing version where the model has one."""
    out = []
    for case in cases:
        model = case.values[0]
        out.append(case)
        secret = secret_cohorts(model, server_secret())
        if secret is not model:
            out.append(pytest.param(secret, id=f"{case.id}-secret"))
    return out


ALL = with_secrets(CASES)


def test_every_cohort_model_has_examples():
    """The models found in the tree (printed with -v) are the ones this suite draws."""
    print("cohort models:", ", ".join(NAMES))
    assert NAMES, "no CohortModel subclass found under fedsim/, strategies/, protocols/"
    missing = sorted(set(NAMES) - set(EXAMPLES))
    assert not missing, f"cohort models without contract examples: {missing}"
    stale = sorted(set(EXAMPLES) - set(NAMES))
    assert not stale, f"examples for models that no longer exist: {stale}"
    assert any(m.secret_draws for m in (c.values[0] for c in ALL)), "no secret draw is tested"


@pytest.mark.parametrize("model", ALL)
def test_cohorts_are_sorted_ids_inside_the_population(model):
    for server_round in range(1, ROUNDS + 1):
        for kind in (TRAIN, EVALUATE):
            cohort = model.cohort(server_round, kind)
            assert isinstance(cohort, np.ndarray) and cohort.dtype == np.int64, cohort.dtype
            assert cohort.ndim == 1
            assert np.all(np.diff(cohort) > 0), "ids sorted and distinct"
            if cohort.size:
                assert 0 <= cohort[0] and cohort[-1] < model.num_clients


@pytest.mark.parametrize("model", ALL)
def test_a_cohort_is_a_function_of_round_and_kind_only(model):
    """A rebuilt model (same seed, same secret), asked in another order, draws the same."""
    phases = [(r, k) for r in range(1, 9) for k in (TRAIN, EVALUATE)]
    first = {phase: model.cohort(*phase) for phase in phases}
    rebuilt = replace(model)
    for phase in reversed(phases):
        np.testing.assert_array_equal(rebuilt.cohort(*phase), first[phase], err_msg=str(phase))
        np.testing.assert_array_equal(model.cohort(*phase), first[phase], err_msg=str(phase))
    if not model.secret_draws:  # what the grid ships to its actors
        restored = pickle.loads(pickle.dumps(model))
        for phase in phases:
            np.testing.assert_array_equal(restored.cohort(*phase), first[phase])


@pytest.mark.parametrize("model", ALL)
def test_the_accounting_view_is_one_the_ledger_takes(model):
    for rounds in (1, 3, ROUNDS):
        sampling = model.accounting(rounds)
        assert check_sampling(sampling) is sampling
        relation_for(sampling)  # the neighbouring relation it is accounted under
        assert sampling == model.accounting(rounds), "the view is a value"


def training_cohorts(model: CohortModel, rounds: int) -> list[np.ndarray]:
    return [model.cohort(r, TRAIN) for r in range(1, rounds + 1)]


@pytest.mark.parametrize("model", ALL)
def test_the_accounting_is_never_optimistic_about_the_cohorts_drawn(model):
    """The sizes, rate and participations the accountant is told are those of the draws."""
    rounds = 400 if isinstance(model.accounting(1), PoissonSampling) else 3 * ROUNDS
    sampling = model.accounting(rounds)
    cohorts = training_cohorts(model, rounds)
    sizes = np.array([len(c) for c in cohorts])
    if isinstance(sampling, FullParticipation):
        for cohort in cohorts:
            np.testing.assert_array_equal(cohort, np.arange(model.num_clients))
    elif isinstance(sampling, FixedSizeSampling):
        assert sampling.population == model.num_clients
        assert np.all(sizes == sampling.sample_size), "a fixed size is exact"
    elif isinstance(sampling, PoissonSampling):
        n, q = model.num_clients, sampling.rate
        # the mean size of Binomial(n, q) over `rounds` draws: within 5 standard errors
        assert abs(sizes.mean() - n * q) <= 5 * np.sqrt(n * q * (1 - q) / rounds) + 1e-9
        inclusion = np.bincount(np.concatenate(cohorts), minlength=n) / rounds
        assert np.all(inclusion <= q + 5 * np.sqrt(q * (1 - q) / rounds) + 1e-9)
    elif isinstance(sampling, Participation):
        seen: dict[int, list[int]] = {}
        for server_round, cohort in enumerate(cohorts, start=1):
            for client in cohort.tolist():
                seen.setdefault(client, []).append(server_round)
        for client, taken in seen.items():
            assert len(taken) <= sampling.participations(rounds), client
            assert np.all(np.diff(taken) >= sampling.min_sep), (client, taken)
    else:
        pytest.fail(f"{type(model).__name__}.accounting gave {sampling!r}, unknown here")


@pytest.mark.parametrize("model", ALL)
def test_evaluation_is_its_own_phase(model):
    """Evaluation cohorts are drawn from the population as training's are, under their own
    key: random models draw them apart from the training cohort of the same round."""
    for server_round in range(1, 6):
        train, evaluate = model.cohort(server_round, TRAIN), model.cohort(server_round, EVALUATE)
        assert 0 < evaluate.size <= model.num_clients
        if isinstance(model.accounting(1), FullParticipation):
            np.testing.assert_array_equal(evaluate, train)
    random = [
        not np.array_equal(model.cohort(r, TRAIN), model.cohort(r, EVALUATE)) for r in range(1, 9)
    ]
    sizes = {len(model.cohort(r, TRAIN)) for r in range(1, 9)}
    if max(sizes) < model.num_clients and not isinstance(model, MinSeparationCohort):
        assert any(random), "the evaluation draw repeats the training draw"


@pytest.mark.parametrize("model", [c for c in ALL if c.values[0].secret_draws])
def test_secret_draws_do_not_follow_from_the_public_seed(model):
    public = replace(model, secret=None)
    assert not public.secret_draws
    phases = [(r, TRAIN) for r in range(1, 9)]
    ours = [model.cohort(*p) for p in phases]
    if max(len(c) for c in ours) == model.num_clients:
        return  # everyone is drawn: nothing to hide
    assert any(not np.array_equal(a, public.cohort(*p)) for a, p in zip(ours, phases))
    other_seed = replace(model, seed=model.seed + 1)
    for cohort, phase in zip(ours, phases):  # the seed plays no part in a secret draw
        np.testing.assert_array_equal(other_seed.cohort(*phase), cohort)
    other_secret = replace(model, secret=server_secret("another root"))
    assert any(not np.array_equal(other_secret.cohort(*p), a) for a, p in zip(ours, phases))


@pytest.mark.parametrize("model", CASES)
def test_a_model_draws_from_the_secret_it_is_given_or_is_kept_as_it_is(model):
    assert not model.secret_draws
    secret = secret_cohorts(model, server_secret())
    assert secret is model or secret.secret_draws
