"""Client registry and participation models: ids, cohorts, determinism, statistics."""

import numpy as np
import pytest

from fedsim.config import ConfigError
from fedsim.engine import NODE_ID_OFFSET, ClientRegistry, PoissonCohort, UniformCohort
from fedsim.engine.participation import FullCohort


def test_registry_maps_both_ways_and_rejects_strangers():
    registry = ClientRegistry(1_000_000)
    ids = registry.node_ids()
    assert len(ids) == 1_000_000 and ids[0] == NODE_ID_OFFSET and (NODE_ID_OFFSET + 999_999) in ids
    assert registry.partition_id(registry.node_id(123_456)) == 123_456
    assert registry.node_config(registry.node_id(7)) == {
        "partition-id": 7,
        "num-partitions": 1_000_000,
    }
    with pytest.raises(ValueError, match="not a registered client"):
        registry.partition_id(NODE_ID_OFFSET + 1_000_000)
    with pytest.raises(ValueError, match="outside the population"):
        registry.node_id(-1)
    with pytest.raises(ConfigError, match="num_clients"):
        ClientRegistry(0)


def test_node_ids_never_collide_with_server_ids():
    assert NODE_ID_OFFSET > 1  # 0: ServerApp context, 1: SuperLink


def test_uniform_cohort_is_seeded_per_phase():
    model = UniformCohort(10**9, 1000, seed=3)  # a billion clients costs nothing
    a, b = model.cohort(5), model.cohort(5)
    assert np.array_equal(a, b)
    assert len(np.unique(a)) == 1000 and np.all(np.diff(a) > 0)
    assert not np.array_equal(model.cohort(5), model.cohort(6))
    assert not np.array_equal(model.cohort(5), model.cohort(5, kind=1))
    assert not np.array_equal(model.cohort(5), UniformCohort(10**9, 1000, seed=4).cohort(5))


def test_uniform_cohort_is_uniform():
    model = UniformCohort(20, 5, seed=0)
    counts = np.bincount(np.concatenate([model.cohort(p) for p in range(4000)]), minlength=20)
    expected = 4000 * 5 / 20
    # Each client's count is Binomial(4000, 1/4): std ~ 27; allow 5 sigma.
    assert np.all(np.abs(counts - expected) < 5 * np.sqrt(4000 * 0.25 * 0.75))


def test_poisson_cohort_size_and_inclusion():
    model = PoissonCohort(200, 0.1, seed=1)
    cohorts = [model.cohort(p) for p in range(3000)]
    sizes = np.array([len(c) for c in cohorts])
    # Binomial(200, 0.1): mean 20, var 18; the mean over 3000 draws has std 0.077.
    assert abs(sizes.mean() - 20) < 0.4
    assert abs(sizes.var() - 18) < 2.5
    inclusion = np.bincount(np.concatenate(cohorts), minlength=200) / 3000
    assert np.all(np.abs(inclusion - 0.1) < 5 * np.sqrt(0.1 * 0.9 / 3000))


def test_bad_parameters_name_themselves():
    with pytest.raises(ConfigError, match="cohort_size"):
        UniformCohort(10, 11, seed=0)
    with pytest.raises(ConfigError, match="rate"):
        PoissonCohort(10, 0.0, seed=0)
    assert np.array_equal(FullCohort(4).cohort(9), np.arange(4))


@pytest.mark.parametrize("n,b", [(1000, 7), (12, 12), (1_000_000, 1000), (5, 1)])
def test_min_separation_schedule(n, b):
    from fedsim.engine.participation import MinSeparationCohort

    model = MinSeparationCohort(n, b, seed=2)
    groups = [model.cohort(r) for r in range(1, b + 1)]
    # the groups partition the population into near-equal parts...
    assert np.array_equal(np.sort(np.concatenate(groups)), np.arange(n))
    assert max(map(len, groups)) - min(map(len, groups)) <= 1
    # ...and repeat with period b, so a client's participations are exactly b rounds apart
    assert np.array_equal(model.cohort(1), model.cohort(1 + b))
    assert np.array_equal(model.cohort(2), model.cohort(2 + 3 * b))
    for r, group in enumerate(groups, start=1):
        assert all(model.group_of(int(k)) == r - 1 for k in group[:20])
    assert len(model.cohort(3, kind=1)) == model.group_size(0)


def test_each_cohort_model_gives_the_accounting_view_of_its_draws():
    """One sampling fact: the sampler the accountant is told about is the one that draws."""
    from fedsim.engine.participation import MinSeparationCohort
    from fedsim.privacy.participation import Participation
    from fedsim.privacy.sampling import (
        FixedSizeSampling,
        FullParticipation,
        PoissonSampling,
    )

    uniform = UniformCohort(50, 7, seed=1).accounting(rounds=9)
    assert uniform == FixedSizeSampling(7, 50)
    assert all(len(UniformCohort(50, 7, seed=1).cohort(r)) == uniform.sample_size for r in (1, 2))
    assert PoissonCohort(50, 0.2, seed=1).accounting(9) == PoissonSampling(0.2)
    assert FullCohort(50).accounting(9) == FullParticipation()
    # min-separation: b rounds apart, ceil(T / b) participations, as the schedule draws them
    model = MinSeparationCohort(40, 4, seed=3)
    view = model.accounting(rounds=10)
    assert view == Participation.separated(4, 3)
    rounds_of: dict[int, list[int]] = {}
    for r in range(1, 11):
        for k in model.cohort(r):
            rounds_of.setdefault(int(k), []).append(r)
    assert max(map(len, rounds_of.values())) == view.participations(10)
    assert min(b - a for rs in rounds_of.values() for a, b in zip(rs, rs[1:])) == 4


def test_the_min_separation_view_is_the_schema_the_guard_enforces():
    """The schedule's one Participation (what the accountant reads, and the matrix
    mechanism's sensitivity) admits, in the guard, every training cohort the engine draws, and
    nothing more: a client whose k participations are spent, or one asked back before b rounds
    have passed, is refused."""
    from fedsim.engine.participation import MinSeparationCohort
    from fedsim.privacy.participation import Participation
    from strategies.plumbing.participation_guard import ParticipationGuard

    model = MinSeparationCohort(30, 3, seed=5)
    schema = model.accounting(rounds=9)
    assert schema == Participation.separated(3, 3)
    guard = ParticipationGuard(schema, rounds=9)
    for row in range(9):  # round row + 1
        for k in map(int, model.cohort(row + 1)):
            assert guard.refusal(k, row) is None
            first, _, count = guard.history.get(k, (row, row, 0))
            guard.history[k] = (first, row, count + 1)
    spent = int(model.cohort(1)[0])  # trained at rows 0, 3 and 6
    assert "trained 3 times" in guard.refusal(spent, 9)
    early = ParticipationGuard(schema, rounds=9, history={spent: (0, 0, 1)})
    assert "min-separation" in early.refusal(spent, 2)
