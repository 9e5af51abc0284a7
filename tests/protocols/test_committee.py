"""Committee actors: packed Shamir sums of client-sealed shares under per-member, per-stage
faults."""

import itertools

import numpy as np
import pytest

from fedsim.engine.committee import Committee
from fedsim.randomness import PartySecret, RunSecret
from protocols.channels import SERVER_ID, Endpoint, new_session_id
from protocols.committee.client import seal_input
from protocols.committee.common import (
    ACTIVE_STAGES,
    CHANNEL_PROTOCOL,
    TRANSITIONS,
    CommitteeAbort,
    CommitteeFaults,
    CommitteeStage,
    StageFaults,
)
from protocols.committee.member import CommitteeShard
from protocols.field import DEFAULT_FIELD
from protocols.kit import Fault, StageError, TamperingDetected, TooManyDropoutsError

S = CommitteeStage


def inputs(rng, clients=6, length=23):
    return {c: DEFAULT_FIELD.random(rng, length) for c in range(100, 100 + clients)}


def expected(vectors):
    return DEFAULT_FIELD.sum(np.stack(list(vectors.values())), axis=0)


def run(committee, round_, vectors, rng, faults=None):
    """Each client shares and seals its own vector (share randomness from ``rng``), the
    committee sums the sealed inputs."""
    keys = committee.keys_for(round_)
    sealed = {c: seal_input(keys, c, v, rng) for c, v in vectors.items()}
    length = len(next(iter(vectors.values())))
    return committee.run_round_sealed(round_, sealed, length, faults)


def faults(**by_kind):
    plan = {}
    for kind, entries in by_kind.items():
        for member, stage in entries:
            plan[(member, stage)] = Fault[kind.upper()]
    return CommitteeFaults(plan, seed=3)


def test_every_stage_pair_is_checked():
    handlers = {
        S.SHARE: lambda shard: shard.share(0, {}, StageFaults()),
        S.COMBINE: lambda shard: shard.combine(0, [], StageFaults()),
        S.RELEASE: lambda shard: shard.release(0, StageFaults()),
    }
    order = [S.SETUP, *ACTIVE_STAGES]
    for current, target in itertools.product(order, ACTIVE_STAGES):
        session = new_session_id()
        shard = CommitteeShard([0, 1], 61, session)
        shard.connect(SERVER_ID, Endpoint(SERVER_ID, session, CHANNEL_PROTOCOL).public_key)
        for stage in order[1 : order.index(current) + 1]:
            handlers[stage](shard)
        if target in TRANSITIONS[current]:
            handlers[target](shard)
        else:
            with pytest.raises(StageError, match=target.name):
                handlers[target](shard)


def test_sum_without_faults_and_vectorised_shards():
    rng = np.random.default_rng(0)
    vectors = inputs(rng)
    for shards in (1, 3):
        committee = Committee(9, 3, 2, shards=shards)
        result = run(committee, 1, vectors, rng)
        np.testing.assert_array_equal(result.aggregate, expected(vectors))
        assert result.answered == tuple(range(9)) and result.clients == tuple(vectors)


def test_dropouts_up_to_the_limit_then_abort_keeps_earlier_rounds():
    rng = np.random.default_rng(1)
    committee = Committee(10, 3, 2, shards=2)  # needs t + k + 1 = 6
    assert committee.needed == 6
    first = run(committee, 1, inputs(rng), rng)
    ok = faults(drop=[(0, S.SHARE), (4, S.COMBINE), (7, S.RELEASE)], late=[(9, S.RELEASE)])
    vectors = inputs(rng)
    second = run(committee, 2, vectors, rng, ok)
    np.testing.assert_array_equal(second.aggregate, expected(vectors))
    assert second.late == (9,) and second.dropped == (0, 4, 7)
    too_many = faults(
        drop=[(0, S.SHARE), (1, S.COMBINE), (2, S.RELEASE), (3, S.RELEASE)],
        late=[(5, S.SHARE)],
    )
    with pytest.raises(CommitteeAbort, match="6 committee members needed.*5 answered") as info:
        run(committee, 3, inputs(rng), rng, too_many)
    assert (info.value.needed, info.value.answered) == (6, 5)
    assert isinstance(info.value, TooManyDropoutsError)
    # yet the rows of 6 > t members (member 5's late) reached the server: an opened release
    assert info.value.opened.members == (4, 5, 6, 7, 8, 9) == committee.opened[3].members
    assert committee.history[1] is first and committee.history[2] is second
    assert 3 not in committee.history and committee.stage(3) is S.ABORTED
    assert all(shard.stage(3) is S.ABORTED for shard in committee.shards)
    with pytest.raises(ValueError, match="round 3 was already run"):
        run(committee, 3, inputs(rng), rng)
    vectors = inputs(rng)  # the committee goes on after an abort
    np.testing.assert_array_equal(run(committee, 4, vectors, rng).aggregate, expected(vectors))
    assert committee.stage(4) is S.DONE


@pytest.mark.parametrize("stage", ACTIVE_STAGES)
def test_tampering_is_caught_and_removed_when_identifiable(stage):
    rng = np.random.default_rng(2)
    committee = Committee(10, 3, 2, shards=3)
    vectors = inputs(rng)
    result = run(committee, 1, vectors, rng, faults(tamper=[(6, stage)]))
    np.testing.assert_array_equal(result.aggregate, expected(vectors))
    assert result.tampered == (6,) and 6 not in result.answered


def test_tampering_that_cannot_be_singled_out_aborts_loudly():
    rng = np.random.default_rng(3)
    committee = Committee(8, 3, 2, shards=2)  # needs 6; with 2 dropped exactly 6 answer
    plan = faults(drop=[(0, S.SHARE), (1, S.RELEASE)], tamper=[(5, S.RELEASE)])
    with pytest.raises(TamperingDetected, match="cannot be singled out"):
        run(committee, 1, inputs(rng), rng, plan)
    assert committee.history == {}


def test_random_faults_never_give_a_silently_wrong_sum():
    rng = np.random.default_rng(4)
    committee = Committee(12, 3, 3, shards=4)
    outcomes = {"ok": 0, "abort": 0, "tamper": 0}
    for round_ in range(40):
        vectors = inputs(rng, clients=3, length=7)
        plan = CommitteeFaults.random(12, rng, drop=0.08, late=0.04, tamper=0.04)
        try:
            result = run(committee, round_, vectors, rng, plan)
        except CommitteeAbort:
            outcomes["abort"] += 1
            continue
        except TamperingDetected:
            outcomes["tamper"] += 1
            continue
        np.testing.assert_array_equal(result.aggregate, expected(vectors))
        outcomes["ok"] += 1
    assert outcomes["ok"] > 0 and outcomes["abort"] + outcomes["tamper"] > 0


def test_arguments_are_checked():
    with pytest.raises(ValueError, match="detect"):
        Committee(5, 2, 2, detect=2)
    with pytest.raises(ValueError, match="shards"):
        Committee(5, 2, 1, shards=6)
    with pytest.raises(ValueError, match="stage"):
        CommitteeFaults({(0, S.DONE): Fault.DROP})


@pytest.mark.ray
def test_committee_on_ray_actors(ray_session):
    rng = np.random.default_rng(5)
    committee = Committee(10, 3, 2, shards=3, ray_module=ray_session)
    try:
        vectors = inputs(rng, length=1000)
        result = run(committee, 1, vectors, rng, faults(drop=[(2, S.COMBINE)]))
        np.testing.assert_array_equal(result.aggregate, expected(vectors))
        result = run(committee, 2, vectors, rng, faults(tamper=[(8, S.RELEASE)]))
        np.testing.assert_array_equal(result.aggregate, expected(vectors))
        assert result.tampered == (8,)
        many = faults(drop=[(m, S.SHARE) for m in range(5)])
        with pytest.raises(CommitteeAbort, match="6 committee members needed.*5 answered"):
            run(committee, 3, vectors, rng, many)
        assert sorted(committee.history) == [1, 2]
    finally:
        committee.close()


def test_shares_travel_encrypted_and_a_corrupted_one_excludes_its_client():
    rng = np.random.default_rng(6)
    committee = Committee(7, 2, 2, shards=2)
    vectors = inputs(rng, clients=4, length=40)
    plan = CommitteeFaults(corrupt_in_transit=frozenset({(101, 3)}))
    result = run(committee, 1, vectors, rng, plan)
    assert result.excluded == (101,) and 101 not in result.clients
    kept = {c: v for c, v in vectors.items() if c != 101}
    np.testing.assert_array_equal(result.aggregate, expected(kept))
    transcript = committee.relay.transcript
    blocks = committee.scheme.blocks_for(40)
    share_bytes = transcript.nbytes(sender=100, stage=S.SHARE)
    assert transcript.messages(sender=100, stage=S.SHARE) == 7
    assert 7 * blocks * 8 < share_bytes < 7 * (blocks * 8 + 300)
    assert transcript.messages(stage=S.RELEASE) == 7
    vectors = inputs(rng, clients=4, length=40)  # fresh client keys next round
    np.testing.assert_array_equal(run(committee, 2, vectors, rng).aggregate, expected(vectors))


def test_a_clients_shares_come_from_its_own_stream_and_only_ciphertext_leaves_it():
    """seal_input draws the share polynomials from the client's generator alone (the same
    stream gives the same shares, another stream other shares of the same vector) and what it
    returns holds the client's public key and one envelope per member, nothing in the clear."""
    committee = Committee(6, 2, 2, shards=3)
    keys = committee.keys_for(1)
    vector = DEFAULT_FIELD.random(np.random.default_rng(7), 9)
    mine = seal_input(keys, 4, vector, np.random.default_rng(1), bytes(range(32)))
    again = seal_input(keys, 4, vector, np.random.default_rng(1), bytes(range(32)))
    other = seal_input(keys, 4, vector, np.random.default_rng(2), bytes(range(32)))
    assert mine.public_key == again.public_key == other.public_key
    assert sorted(mine.envelopes) == list(range(6))
    for j in range(6):
        envelope = mine.envelopes[j]
        assert (envelope.sender, envelope.receiver, envelope.round, envelope.stage) == (
            4, 2**62 + j, 1, "SHARE"
        )
    assert mine.envelopes[0].ciphertext == again.envelopes[0].ciphertext  # nonce 0, one key
    assert mine.envelopes[0].ciphertext != other.envelopes[0].ciphertext
    blob = b"".join(e.ciphertext for e in mine.envelopes.values())
    assert vector.astype(np.int64).tobytes()[:16] not in blob
    result = committee.run_round_sealed(1, {4: mine}, 9)
    np.testing.assert_array_equal(result.aggregate, vector)
    with pytest.raises(ValueError, match="rng is a NoneType"):
        seal_input(keys, 4, vector, None)
    with pytest.raises(ValueError, match="client id"):
        seal_input(keys, 2**62, vector, np.random.default_rng(1))


def test_the_front_end_builds_the_committee_from_a_spec_with_member_secrets_from_the_root():
    """committee_for finds the strategy that asks for a committee (through wrappers) and builds
    it with member m's keys from RunSecret.member(m); the committee refuses pickling."""
    import pickle

    from fedsim.engine.committee import CommitteeSpec, committee_for

    class Asks:
        def __init__(self, spec):
            self.spec = spec

        def committee_spec(self):
            return self.spec

        def bind_committee(self, committee):
            self.committee = committee

    class Wrapper:
        def __init__(self, strategy):
            self.strategy = strategy

    root = RunSecret.from_passphrase("committee")
    spec = CommitteeSpec(size=6, threshold=2, packing=2, detect=1, shards=2)
    committee = committee_for(Wrapper(Asks(spec)), root)
    assert committee.spec() == spec and len(committee.shards) == 2
    derived = committee._member_keys({m: root.member(m) for m in range(6)})
    rebuilt = CommitteeShard([5], 61, committee.session_id, {5: derived[5]})
    assert rebuilt.public_keys()[5] == committee.member_keys[5]
    assert committee_for(Wrapper(Asks(None)), root) is None
    assert committee_for(Wrapper(object()), root) is None
    with pytest.raises(TypeError, match="never pickled"):
        pickle.dumps(committee)
    with pytest.raises(ValueError, match="detect"):
        CommitteeSpec(size=5, threshold=2, packing=2, detect=2)
    with pytest.raises(ValueError, match="actors"):
        CommitteeSpec(size=5, threshold=2, actors="yes")


def test_member_channel_keys_come_from_the_member_secrets():
    """With member secrets each member's channel key is its own, derived per session: the
    same secret and session give the same key wherever the member is hosted; other secrets
    give other keys; without secrets every committee draws fresh keys."""
    secrets = {m: PartySecret(bytes([m + 1]) * 32, "member") for m in range(5)}
    committee = Committee(5, 1, 2, shards=2, member_secrets=secrets)
    derived = committee._member_keys(secrets)
    rebuilt = CommitteeShard([3], 61, committee.session_id, {3: derived[3]})
    assert rebuilt.public_keys()[3] == committee.member_keys[3]
    other = {m: PartySecret(bytes([m + 9]) * 32, "member") for m in range(5)}
    assert Committee(5, 1, 2, member_secrets=other).member_keys[3] != committee.member_keys[3]
    assert Committee(5, 1, 2).member_keys[3] != Committee(5, 1, 2).member_keys[3]
    rng = np.random.default_rng(12)
    vectors = inputs(rng)
    np.testing.assert_array_equal(run(committee, 1, vectors, rng).aggregate, expected(vectors))
    with pytest.raises(ValueError, match=r"missing \[4\]"):
        Committee(5, 1, 2, member_secrets={m: secrets[m] for m in range(4)})
