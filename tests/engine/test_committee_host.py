"""The engine's one committee host (fedsim.engine.committee_host): any protocol's members by
typed calls, in process or on Ray actors, silent where the protocol says so, and no method
names of its own."""

from __future__ import annotations

import ast
from pathlib import Path

import numpy as np
import pytest
from dmm_support import SECRETS, inputs, seal_all
from engine.test_dmm_actors import _server, committee

from fedsim.engine.committee import Committee
from fedsim.engine.dmm_committee import CommitteeHost, CustodyCall
from protocols.committee.common import CommitteeCall, StageFaults
from protocols.dmm.common import MEMBERS, MemberCall
from protocols.dmm.member import MemberPool
from protocols.kit import StageError

ROOT = Path(__file__).resolve().parents[2]


def test_the_host_imports_no_protocol_but_the_kit():
    """The host knows no protocol: of protocols/ it imports the kit (the typed interface) only,
    and it names no member call."""
    source = (ROOT / "fedsim" / "engine" / "committee_host.py").read_text()
    imported = {
        node.module
        for node in ast.walk(ast.parse(source))
        if isinstance(node, ast.ImportFrom) and node.module
    }
    assert {m for m in imported if m.startswith("protocols")} == {"protocols.kit"}
    calls = {c.value for enum in (CommitteeCall, MemberCall, CustodyCall) for c in enum}
    strings = {
        node.value
        for node in ast.walk(ast.parse(source))
        if isinstance(node, ast.Constant) and isinstance(node.value, str)
    }
    assert not calls & strings


def test_a_call_of_another_protocol_or_a_bare_name_is_refused():
    sums = Committee(5, 1, 1, shards=2)
    try:
        for wrong in ("public_keys", MemberCall.KEY_PROOFS):
            with pytest.raises(TypeError, match="not a member call"):
                sums.pool.call(wrong, [(), ()])
    finally:
        sums.close()
    host = CommitteeHost(SECRETS, shards=2)
    pool = host.pool(committee(0), _server()[0].member_kwargs)
    with pytest.raises(TypeError, match="not a member call"):
        pool.broadcast(CommitteeCall.PUBLIC_KEYS)
    host.close()


def test_a_committee_members_error_reaches_the_server():
    """The sum committee declares no silent answer: a shard asked out of order raises."""
    sums = Committee(5, 1, 1, shards=2)
    try:
        with pytest.raises(StageError, match="cannot move to COMBINE"):
            sums.pool.call(CommitteeCall.COMBINE, [(0, [], StageFaults())] * 2)
    finally:
        sums.close()


@pytest.mark.parametrize("hosted", [False, True], ids=["kit pool", "engine host"])
def test_a_refusing_dmm_group_is_silent_and_its_reason_kept(hosted):
    server = _server()[0]
    host = CommitteeHost(SECRETS, shards=3) if hosted else None
    members = committee(0)
    groups = [[s for s in range(9) if s % 3 == g] for g in range(3)]
    if host is not None:
        pool = host.pool(members, server.member_kwargs)
    else:
        pool = MemberPool(members, groups, server.member_kwargs)
    answers = pool.broadcast(MemberCall.COMBINE, 0, [1, 2], [], [], 0)
    assert answers == [MEMBERS.silent[MemberCall.COMBINE]] * 3
    assert [(g, call) for g, call, _ in pool.refusals] == [
        (g, MemberCall.COMBINE) for g in range(3)
    ]
    assert all("stage SETUP" in reason for _, _, reason in pool.refusals)
    if host is not None:
        host.close()


def test_hosted_dmm_members_keep_their_state_to_themselves_and_loading_is_never_silent():
    server = _server()[0]
    host = CommitteeHost(SECRETS, shards=3)
    pool = host.pool(committee(0), server.member_kwargs)
    with pytest.raises(AttributeError, match="not a member request"):
        pool.broadcast(MemberCall.SNAPSHOT)
    sealed = pool.seal_states(range(9))
    assert len(sealed) == 9
    with pytest.raises(ValueError, match="stored state is for step"):
        pool.call(CustodyCall.LOAD_STATES, [(sealed, 4)] * 3)
    host.close()


def test_in_process_and_actor_hosts_give_the_same_release(ray_session):
    """The same rounds on both backends of the host release the same sums, handing over to
    the next committee each round."""
    releases = []
    for actors in (False, True):
        server = _server()[0]
        host = CommitteeHost(SECRETS, actors=actors, shards=3, ray_module=ray_session)
        server.attach(host.pool(committee(0), server.member_kwargs))
        out = []
        for step in range(2):
            updates, noises = inputs(server.schedule, step, 5, 8, 5)
            keys = server.open_round(step)
            next_pool = host.pool(committee(step + 1), server.member_kwargs)
            out.append(server.finish_round(seal_all(keys, updates, noises, step), next_pool))
            assert out[-1].handed_over
        releases.append([o.release for o in out])
        assert host.cpu_seconds() is None or host.cpu_seconds() > 0
        host.close()
    for local, remote in zip(*releases, strict=True):
        np.testing.assert_array_equal(local, remote)
