"""DMM committees of clients on the engine's host: members on Ray actors keyed by client id,
the same releases as in process and ideal, killed actors are dropped members, member faults
follow the run's fault model."""

from __future__ import annotations

import numpy as np
import pytest
from dmm_support import SECRETS, Reference, digits_setup, inputs, make_dmm, run_dmm, seal_all

from fedsim.engine import FaultConfig
from fedsim.engine.dmm_committee import CommitteeHost, member_faults
from fedsim.privacy.dmm import IntegerMechanism
from fedsim.privacy.matrix.banded import banded
from protocols.dmm.common import ACTIVE, Schedule
from protocols.dmm.server import DMMServer
from protocols.shamir import PackedShamir

D, CLIENTS, ROUNDS = 8, 5, 6


@pytest.fixture
def actor_host(ray_session):
    host = CommitteeHost(SECRETS, actors=True, shards=3, ray_module=ray_session)
    yield host
    host.close()


def _server():
    mechanism = IntegerMechanism(banded(ROUNDS, 3), 10)
    schedule = Schedule(mechanism.integer_matrix)
    return DMMServer(PackedShamir(9, 2, 2), schedule, D), Reference(mechanism.integer_matrix)


def _round(server, host, step, committee):
    updates, noises = inputs(server.schedule, step, CLIENTS, D, 5)
    keys = server.open_round(step)
    next_pool = host.pool(committee(step + 1), server.member_kwargs)
    out = server.finish_round(seal_all(keys, updates, noises, step), next_pool)
    return out, updates, noises


def committee(step):
    return [100 * step + 7 * j for j in range(9)]


def test_actor_hosted_committees_release_the_reference_and_hold_their_own_shares(actor_host):
    server, ref = _server()
    server.attach(actor_host.pool(committee(0), server.member_kwargs))
    for step in range(ROUNDS):
        out, updates, noises = _round(server, actor_host, step, committee)
        np.testing.assert_array_equal(out.release, ref.release(updates, noises, range(CLIENTS)))
        assert out.handed_over and server.pool.members == committee(step + 1)
    # the holders are clients: each seals its own state under its own secret
    sealed = server.pool.seal_states(server.holders)
    assert set(sealed) == set(committee(ROUNDS)) and len(set(sealed.values())) == 9


def test_a_killed_actor_drops_its_members_and_later_committees_get_a_fresh_one(actor_host):
    server, ref = _server()
    server.attach(actor_host.pool(committee(0), server.member_kwargs))
    out, updates, noises = _round(server, actor_host, 0, committee)
    ref.release(updates, noises, range(CLIENTS))
    victim = server.pool.handles[1]
    actor_host.ray.kill(victim)
    out, updates, noises = _round(server, actor_host, 1, committee)  # seats 1, 4, 7 are gone
    np.testing.assert_array_equal(out.release, ref.release(updates, noises, range(CLIENTS)))
    assert out.dropped == (1, 4, 7) and out.verified
    assert server.pool.handles[1] is not victim  # the next committee runs on a fresh actor
    out, updates, noises = _round(server, actor_host, 2, committee)
    np.testing.assert_array_equal(out.release, ref.release(updates, noises, range(CLIENTS)))
    assert out.dropped == ()


def test_strategy_on_actors_matches_in_process_and_ideal(ray_session, local_engine):
    setup = digits_setup(12)
    faults = FaultConfig(dropout=0.2, seed=5)
    results = []
    for mode, actors in (("full", True), ("full", False), ("ideal", False)):
        host = CommitteeHost(SECRETS, faults, actors=actors, shards=2, ray_module=ray_session)
        strategy = make_dmm(mode, 12, 3)
        arrays, recorded = run_dmm(local_engine, setup, strategy, 3, faults=faults, host=host)
        strategy.close()
        host.close()
        results.append((arrays, recorded.eps))
    for arrays, eps in results[1:]:
        assert eps == results[0][1]
        for key in arrays:
            np.testing.assert_array_equal(arrays[key], results[0][0][key])


def test_member_faults_follow_the_clients_availability():
    config = FaultConfig(
        dropout=0.3, seed=1, straggler_fraction=0.5, straggler_delay_s=2.0, deadline_s=1.0
    )
    members = list(range(40))
    plan = member_faults(config, 4, members, members)
    assert plan == member_faults(config, 4, members, members)  # a public stream
    drops = [s for (s, stage), kind in plan.member.items() if kind == "drop"]
    assert 4 <= len(drops) <= 20 and {stage for (_, stage) in plan.member} <= set(ACTIVE)
    assert any(kind == "late" for kind in plan.member.values())
    assert plan.member != member_faults(config, 5, members, members).member
    assert member_faults(FaultConfig(), 4, members).member == {}
    # a client's fate is its own: the same client in another seat drops the same way
    moved = member_faults(config, 4, members[::-1])
    assert {members[s] for (s, st), k in plan.member.items() if k == "drop"} == {
        members[::-1][s] for (s, st), k in moved.member.items() if k == "drop"
    }


def test_host_options_are_checked(ray_session):
    with pytest.raises(ValueError, match="shards"):
        CommitteeHost(SECRETS, shards=0)
    with pytest.raises(ValueError, match="RunSecret"):
        CommitteeHost("not a secret")
    host = CommitteeHost(SECRETS)
    with pytest.raises(ValueError, match="distinct client ids"):
        host.pool([1, 1, 2], {})
    with pytest.raises(TypeError, match="never pickled"):
        import pickle  # noqa: PLC0415

        pickle.dumps(host)
    with pytest.raises(ValueError, match="needs the run's secrets"):
        CommitteeHost(None).restore([1, 2, 3], [0, 1, 2], {}, 1)
