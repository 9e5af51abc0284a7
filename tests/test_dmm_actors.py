"""DMM committee members as Ray actors: the same releases, aborts and tampering verdicts as the
in-process committee, and members that hold their own shares of the noise state."""

from __future__ import annotations

import itertools
import pickle

import cloudpickle
import numpy as np
import pytest
from flwr.serverapp.strategy import FedAvg
from test_dmm_strategy import CLIENTS as STRATEGY_CLIENTS
from test_dmm_strategy import run as run_strategy

from fedsim.data import DatasetSpec, build_dataset
from fedsim.engine.dmm_committee import ActorPool, actor_committee
from fedsim.models import ModelSpec
from fedsim.privacy.dmm import IntegerNoising
from fedsim.privacy.matrix.tree import honaker_tree
from fedsim.workloads.supervised import LocalTraining, make_client_app
from protocols.dmm import (
    MEMBER_ID_BASE,
    TRANSITIONS,
    DMMCommitteeProtocol,
    DMMFaults,
    DMMMembers,
    DMMStage,
    ReleaseTampering,
    RoundAborted,
    StateLost,
)
from protocols.resharing import ReshareAbort
from protocols.secagg import StageError
from protocols.shamir import PackedShamir
from strategies.dmm import DMM, dmm_client_app, from_options

D, CLIENTS, ROUNDS, F = 10, 5, 8, 10
N, T, K = 7, 2, 3  # t + k = 5: two members may drop per stage
S = DMMStage


@pytest.fixture(scope="module")
def noising():
    return IntegerNoising(honaker_tree(ROUNDS), F)


def _inputs(noising, step, seed):
    rng = np.random.default_rng([seed, step])
    rows = noising.rows_drawn_at(step).size
    updates = {i: rng.integers(-100, 100, D) for i in range(CLIENTS)}
    noises = {i: rng.integers(-30, 30, (rows, D)) for i in range(CLIENTS)}
    return updates, noises


class ReusedPools:
    """A pool factory handing out the same two actor pools (wiped) to every new protocol, so
    the tests spawn actors once."""

    def __init__(self, ray_module):
        self.ray, self.pools, self.calls = ray_module, {}, 0

    def __call__(self, groups, member_kwargs):
        key = (str(groups), str(sorted(member_kwargs.items())), self.calls % 2)
        self.calls += 1
        if key not in self.pools:
            self.pools[key] = ActorPool(groups, member_kwargs, self.ray)
        pool = self.pools[key]
        pool.broadcast("reset")
        return pool

    def close(self):
        for pool in self.pools.values():
            pool.close()


@pytest.fixture(scope="module")
def reused():
    holder = {}
    yield holder
    if "pools" in holder:
        holder["pools"].close()


@pytest.fixture
def actors(ray_session, reused):
    """Builds actor protocols (two groups of members per committee) on reused actor pools."""
    if "pools" not in reused:
        reused["pools"] = ReusedPools(ray_session)

    def build(noising):
        return DMMCommitteeProtocol(
            PackedShamir(N, T, K),
            noising,
            D,
            rng=np.random.default_rng(0),
            shards=2,
            pool_factory=reused["pools"],
        )

    return build


def _in_process(noising, mode="full", shards=1):
    rng = np.random.default_rng(0) if mode == "full" else None
    return DMMCommitteeProtocol(
        PackedShamir(N, T, K), noising, D, mode=mode, rng=rng, shards=shards
    )


def _run_all(protocols, updates, noises, faults, round_):
    """Run one round on every protocol; return each one's output or exception."""
    results = []
    for protocol in protocols:
        try:
            results.append(protocol.run_round(updates, noises, faults, round_))
        except (RoundAborted, ReshareAbort, ReleaseTampering) as error:
            results.append(error)
    return results


def _assert_same(results):
    first = results[0]
    for other in results[1:]:
        if isinstance(first, Exception):
            assert type(other) is type(first) and str(other) == str(first)
            continue
        np.testing.assert_array_equal(other.release, first.release)
        assert (other.clients, other.excluded, other.faulty) == (
            first.clients,
            first.excluded,
            first.faulty,
        )


# ---------------------------------------------------------------------- without Ray
def test_member_groups_in_process_hold_shares_of_the_ideal_state(noising):
    """Grouping is invisible: 1, 3 or n groups give the same releases and the same member
    shares, and the shares the members hold reconstruct the ideal mode's noise rows."""
    protocols = [_in_process(noising, shards=s) for s in (1, 3, N)]
    ideal = _in_process(noising, "ideal")
    scheme = protocols[0].scheme
    for step in range(4):
        if step == 2:  # a checkpoint of an in-process committee resumes with its shares
            protocols[1] = pickle.loads(cloudpickle.dumps(protocols[1]))
        updates, noises = _inputs(noising, step, 1)
        faults = DMMFaults(member={(step % N, S.COMBINE): "drop"}, seed=step)
        _assert_same(_run_all([*protocols, ideal], updates, noises, faults, step))
        shares = [p.member_shares() for p in protocols]
        assert set(shares[0]) == set(ideal.held_rows) == set(ideal.plain_state)
        for r, rows in shares[0].items():
            for other in shares[1:]:
                np.testing.assert_array_equal(other[r], rows)
            holders = list(protocols[0].holders)
            opened = scheme.reconstruct(rows[holders], holders, D)
            np.testing.assert_array_equal(opened, ideal.plain_state[r])


def test_member_class_stages_and_silence():
    members = DMMMembers([2, 5], n=N, t=T, k=K, field_exponent=61, dim=D)
    session = b"s" * 32
    keys = members.announce([2, 5], {5}, session, MEMBER_ID_BASE, True)
    assert list(keys) == [2] and len(keys[2]) == 32
    # later in the same round a silent member stays silent; a fresh round revives it
    assert list(members.announce([2, 5], set(), session, 0, False)) == [2]
    assert list(members.announce([2, 5], set(), None, 0, True)) == [2, 5]
    # plain rows: member 5 lacks client 0's share -> client 0 is refused by member 5
    width = 2 * members.blocks
    rows = {2: np.ones(width, dtype=np.int64), 5: np.full(width, 2, dtype=np.int64)}
    answer = members.share({0: {2: np.ones(width, dtype=np.int64)}, 1: rows}, width)
    assert answer == {"online": [2, 5], "refused": {0: [5]}}
    assert members.combine([1], [4], {4: 3}, F, {2}, set(), 0, 0) == [5]
    sent = members.release(0, set(), {5}, set(), 0, 0)
    assert sent["members"] == [5] and sent["late"] == [5]
    # 2^f * 2 + 3 * 2 in every element of member 5's row
    np.testing.assert_array_equal(sent["rows"][0], np.full(members.blocks, 2 * 2**F + 6))
    members.commit([])
    restored = pickle.loads(pickle.dumps(members))
    assert restored.snapshot() == {} and restored.members == [2, 5]


def test_members_refuse_every_out_of_order_stage():
    handlers = {
        S.SHARE: lambda m: m.share({}, m.blocks),
        S.COMBINE: lambda m: m.combine([], [], {}, F, set(), set(), 0, 0),
        S.RELEASE: lambda m: m.release(0, set(), set(), set(), 0, 0),
        S.RESHARE: lambda m: m.deal(0, [], {}, np.zeros(0, np.int64), [], set(), 0, None, 0),
    }
    order = [S.SETUP, *handlers]
    for current, target in itertools.product(order, handlers):
        members = DMMMembers([0, 1], n=N, t=T, k=K, field_exponent=61, dim=D)
        for stage in order[1 : order.index(current) + 1]:
            handlers[stage](members)
        allowed = target in TRANSITIONS[current] or current is target is S.RESHARE
        if allowed:  # DEAL may run again after a failed dealer is removed
            handlers[target](members)
        else:
            with pytest.raises(StageError, match=target.name):
                handlers[target](members)


# ---------------------------------------------------------------------- on Ray
@pytest.mark.ray
def test_actors_release_what_in_process_and_ideal_release_under_dropouts(noising, actors):
    """Four rounds, each with member dropouts at another stage (within n - t - k = 2) and one
    with next-committee dropouts: identical releases, clients and noise counts."""
    on_actors = actors(noising)
    in_process, ideal = _in_process(noising), _in_process(noising, "ideal")
    plans = [
        DMMFaults(member={(0, S.SHARE): "drop", (6, S.SHARE): "drop"}),
        DMMFaults(member={(1, S.COMBINE): "drop", (2, S.RELEASE): "drop"}),
        DMMFaults(
            member={(3, S.RELEASE): "late", (4, S.RESHARE): "drop"}, next_drop=frozenset({5})
        ),
        DMMFaults(member={(0, S.RESHARE): "drop"}, client_drop={2: S.SHARE}),
    ]
    attempts = []
    for step, faults in enumerate(plans):
        updates, noises = _inputs(noising, step, 2)
        results = _run_all([on_actors, in_process, ideal], updates, noises, faults, step)
        assert not isinstance(results[0], Exception)
        _assert_same(results)
        assert results[0].reshare_attempts == results[1].reshare_attempts
        attempts.append(results[0].reshare_attempts)
        assert results[0].transcript.nbytes() == results[1].transcript.nbytes()
    assert max(attempts) >= 1  # the state was handed on by resharing
    assert on_actors.noise_counts == in_process.noise_counts == ideal.noise_counts
    assert on_actors.holders == in_process.holders == ideal.holders
    for r, rows in in_process.member_shares().items():
        np.testing.assert_array_equal(on_actors.member_shares()[r], rows)


@pytest.mark.ray
@pytest.mark.parametrize(
    ("stage", "error"),
    [
        (S.SHARE, StateLost),
        (S.COMBINE, StateLost),
        (S.RELEASE, RoundAborted),
        (S.RESHARE, ReshareAbort),
    ],
)
def test_below_t_plus_k_the_same_clean_abort(noising, actors, stage, error):
    on_actors, in_process = actors(noising), _in_process(noising)
    updates, noises = _inputs(noising, 0, 3)
    _assert_same(_run_all([on_actors, in_process], updates, noises, DMMFaults(), 0))
    updates, noises = _inputs(noising, 1, 3)
    faults = DMMFaults(member={(j, stage): "drop" for j in range(3)})  # 4 < t + k = 5 left
    results = _run_all([on_actors, in_process], updates, noises, faults, 1)
    assert isinstance(results[0], error)
    _assert_same(results)
    assert (results[0].needed, results[0].answered) == (5, 4)
    assert on_actors.stage is in_process.stage is S.ABORTED
    assert on_actors.step == in_process.step == (2 if stage is S.RESHARE else 1)
    if stage is S.RESHARE:  # released before the handoff failed; the state is gone
        np.testing.assert_array_equal(on_actors.last_output.release, in_process.last_output.release)
        assert on_actors.held_rows == () and on_actors.member_shares() == {}
    if stage is S.RELEASE:  # nothing released, the state is kept: the next round goes on
        _assert_same(_run_all([on_actors, in_process], updates, noises, DMMFaults(), 2))


@pytest.mark.ray
def test_tampering_actors_are_detected_as_in_process(noising, actors):
    on_actors, in_process = actors(noising), _in_process(noising)
    plans = [
        DMMFaults(member={(4, S.RELEASE): "tamper"}, seed=1),
        DMMFaults(member={(2, S.RESHARE): "tamper"}, seed=2),
        # two wrong shares among 7 answers: detected, not correctable; nothing released
        DMMFaults(member={(1, S.RELEASE): "tamper", (5, S.RELEASE): "tamper"}, seed=3),
    ]
    for step, faults in enumerate(plans):
        updates, noises = _inputs(noising, step, 4)
        results = _run_all([on_actors, in_process], updates, noises, faults, step)
        _assert_same(results)
        if step == 0:
            assert results[0].faulty == results[1].faulty == (4,)
        if step == 1:
            assert results[0].reshare_attempts == results[1].reshare_attempts == 2
    assert isinstance(results[0], ReleaseTampering) and on_actors.step == 2
    updates, noises = _inputs(noising, 2, 4)  # the state was kept
    _assert_same(_run_all([on_actors, in_process], updates, noises, DMMFaults(), 2))


@pytest.mark.ray
def test_dead_actors_are_dropped_members_and_checkpoints_resume_on_fresh_actors(
    noising, ray_session
):
    """An actor killed mid-run silences its members (2 of 7: still t + k); a checkpoint of
    the committee resumes on fresh actors with the members' shares; releases never change."""
    on_actors = actor_committee(
        PackedShamir(N, T, K), noising, D, shards=3, rng=np.random.default_rng(0)
    )
    in_process = _in_process(noising)
    resumed = None
    try:
        for step in range(5):
            if step == 2:  # the group holding members 5 and 6 of the current committee dies
                assert on_actors.pools[0].groups[2] == [5, 6]
                ray_session.kill(on_actors.pools[0].objects[2], no_restart=True)
            if step == 3:
                resumed = pickle.loads(cloudpickle.dumps(on_actors))
                on_actors.close()
                with pytest.raises(RuntimeError, match="closed"):
                    on_actors.member_shares()
                on_actors = resumed
            updates, noises = _inputs(noising, step, 5)
            _assert_same(_run_all([on_actors, in_process], updates, noises, DMMFaults(), step))
            if step == 3:  # the dead group was in the pool that took the handoff
                assert on_actors.holders == (0, 1, 2, 3, 4)
        assert on_actors.pools[1].dead == {2} and on_actors.holders == tuple(range(N))
    finally:
        on_actors.close()


# ---------------------------------------------------------------------- the strategy
@pytest.fixture(scope="module")
def digits():
    data = DatasetSpec(source="digits", partition="iid", num_clients=STRATEGY_CLIENTS, seed=0)
    dataset = build_dataset(data)
    model = ModelSpec(
        kind="logreg", input_shape=tuple(dataset.feature_shape), num_classes=dataset.num_classes
    )
    inner = make_client_app(model, data, LocalTraining(epochs=1, batch_size=16, lr=0.1, seed=0))
    return data, dataset, model, dmm_client_app(inner)


def _strategy(mode, **kwargs):
    options = dict(
        factorization=honaker_tree(4),
        committee_size=10,
        threshold=2,
        packing=3,
        fractional_bits=10,
        clipping_norm=1.0,
        noise_multiplier=1.0,
        expected_clients=STRATEGY_CLIENTS,
        seed=7,
        mode=mode,
        member_dropout=0.05,
    )
    options.update(kwargs)
    return DMM(FedAvg(min_available_nodes=0), **options)


@pytest.mark.ray
def test_strategy_with_committee_actors_matches_in_process_and_ideal(
    ray_session, local_engine, digits
):
    on_actors = _strategy("full", committee_actors=True, committee_shards=1)
    try:
        final_actors, releases_actors, eps_actors = run_strategy(
            local_engine, digits, on_actors, 0.2
        )
        assert len(on_actors.protocol.pools[0].objects) == 1
    finally:
        on_actors.close()
    assert on_actors.protocol.pools[0].objects == []
    attempts = [o and o.reshare_attempts for o in on_actors.outputs]
    assert len(attempts) == 3 and max(a or 0 for a in attempts) >= 1  # state was reshared
    for other in (_strategy("full"), _strategy("ideal")):
        final, releases, eps = run_strategy(local_engine, digits, other, 0.2)
        assert eps == eps_actors
        if other.mode == "full":  # the clients sealed their own shares for the actors too
            assert [o and o.reshare_attempts for o in other.outputs] == attempts
        for (clients_a, a), (clients_b, b) in zip(releases_actors, releases):
            assert clients_a == clients_b
            np.testing.assert_array_equal(a, b)
        for key in final:
            np.testing.assert_array_equal(final_actors[key], final[key])
    assert on_actors.privacy_report()["steps"] == 3


def test_committee_actor_options_are_checked():
    with pytest.raises(ValueError, match="committee_actors=True with mode='ideal'"):
        _strategy("ideal", committee_actors=True)
    with pytest.raises(ValueError, match="committee_shards=11"):
        _strategy("full", committee_actors=True, committee_shards=11)
    common = dict(rounds=4, expected_clients=5, seed=0, min_separation=None)
    with pytest.raises(ValueError, match="committee_actors='yes'"):
        from_options(
            {"clipping_norm": 1.0, "noise_multiplier": 1.0, "committee_actors": "yes"},
            max_participations=None,
            **common,
        )
    with pytest.raises(ValueError, match="committee_shards=2.5"):
        from_options(
            {"clipping_norm": 1.0, "noise_multiplier": 1.0, "committee_shards": 2.5},
            max_participations=None,
            **common,
        )
    built = from_options(
        {
            "clipping_norm": 1.0,
            "noise_multiplier": 1.0,
            "committee_actors": True,
            "committee_shards": 3,
        },
        max_participations=None,
        **common,
    )
    assert built.committee_actors and built.committee_shards == 3


def test_actor_pool_needs_a_running_ray():
    class RayNotStarted:
        def is_initialized(self):
            return False

    kwargs = dict(n=N, t=T, k=K, field_exponent=61, dim=D)
    with pytest.raises(RuntimeError, match="need a running Ray"):
        ActorPool([[0, 1]], kwargs, RayNotStarted())
