"""Against the DDGauss committee (fedsim.engine.committee): a relay replaying an old round's
envelope, colluding members who try to choose the release or blame an honest member, tampering
with exactly t + k answers, and clients (their sealed inputs) and members sending garbage. Each
test fails if the attack works or if garbage gets anything but a clean rejection (a dropped
party with a reason, or a documented exception with the round left ABORTED)."""

from __future__ import annotations

import dataclasses
import functools
from collections import Counter

import numpy as np
import pytest

from fedsim.engine.committee import Committee
from protocols.channels import SERVER_ID, Endpoint, Envelope, new_session_id
from protocols.committee.client import seal_input
from protocols.committee.common import (
    CHANNEL_PROTOCOL,
    CommitteeAbort,
    CommitteeFaults,
    CommitteeStage,
    SealedInput,
    ShardSealedShares,
    StageFaults,
)
from protocols.committee.member import CommitteeShard
from protocols.field import DEFAULT_FIELD
from protocols.kit import MEMBER_ID_BASE, Fault, StageError, TamperingDetected

S = CommitteeStage
F = DEFAULT_FIELD


def inputs(rng, clients=5, length=12):
    return {c: F.random(rng, length) for c in range(100, 100 + clients)}


def total(vectors):
    return F.sum(np.stack(list(vectors.values())), axis=0)


def sealed(committee, round_, vectors, rng):
    """Each client's own SHARE message (share randomness from ``rng``)."""
    keys = committee.keys_for(round_)
    return {c: seal_input(keys, c, v, rng) for c, v in vectors.items()}


def run(committee, round_, vectors, rng, faults=None):
    length = len(next(iter(vectors.values())))
    return committee.run_round_sealed(
        round_, sealed(committee, round_, vectors, rng), length, faults
    )


class OffsetShard(CommitteeShard):
    """Members that add chosen offsets to the sums they release (colluders)."""

    offsets: dict[int, int] = {}

    def release(self, round_, faults):
        state = self.state(round_)
        total = state.total.copy()
        for index, member in enumerate(self.members.tolist()):
            if member in self.offsets:
                row = total[index]
                total[index] = F.add(row, np.full(row.size, self.offsets[member]))
        self.store(round_, dataclasses.replace(state, total=total))
        return super().release(round_, faults)


def framing(committee, colluders, framed, answering):
    """Offsets of a degree < t + k polynomial vanishing at every answering member's point but
    the colluders' and the framed honest ones' (miscorrect.py against the committee)."""
    points = committee.scheme.share_points
    g = {}
    for m in colluders:
        value = 1000
        for z in answering:
            if z not in colluders and z not in framed:
                value = value * (int(points[m]) - int(points[z])) % F.modulus
        g[m] = value
    return g


def test_a_round_1_envelope_replayed_in_round_3_is_refused():
    """../shared/attacks/replay.py: the relay substitutes a client's round-1 sealed share (and
    its key) for the real one in round 3; the member refuses it and the client is dropped."""
    session = new_session_id()
    shard = CommitteeShard([0], 61, session)
    member_key = shard.public_keys()[0]

    def sealed(round_, value):
        client = Endpoint(7, session, CHANNEL_PROTOCOL)  # a fresh key per round
        client.connect(MEMBER_ID_BASE, member_key)
        envelope = client.seal_array(MEMBER_ID_BASE, round_, S.SHARE, np.array([value]))
        return ShardSealedShares(client.public_key, (envelope,), 1)

    old = sealed(1, 111)
    assert shard.share(1, {7: old}, StageFaults(), 1)["refused"] == {}
    assert shard.share(2, {7: sealed(2, 222)}, StageFaults(), 1)["refused"] == {}
    assert shard.share(3, {7: old}, StageFaults(), 1)["refused"] == {7: [0]}
    relabelled = ShardSealedShares(
        old.public_key, (dataclasses.replace(old.envelopes[0], round=4),), 1
    )
    assert shard.share(4, {7: relabelled}, StageFaults(), 1)["refused"] == {7: [0]}
    assert shard.state(3).rows[7].tolist() == [[0]] and shard.state(4).rows[7].tolist() == [[0]]


def test_colluders_cannot_choose_the_release_or_blame_an_honest_member():
    """miscorrect.py's committee case: n = 8, t = 3, k = 2, detect = 2, colluders 2, 5 and 7
    put the word one share (member 0's) from a codeword with other secrets. The round is
    refused as tampering, nobody is named, nothing is released, the round is ABORTED."""
    rng = np.random.default_rng(1)
    committee = Committee(8, 3, 2, detect=2, shard_class=OffsetShard)
    OffsetShard.offsets = framing(committee, {2, 5, 7}, {0}, range(8))
    try:
        with pytest.raises(TamperingDetected, match="cannot be singled out") as caught:
            run(committee, 1, inputs(rng), rng)
    finally:
        OffsetShard.offsets = {}
    assert caught.value.suspects == ()
    assert committee.history == {} and committee.stage(1) is S.ABORTED
    assert all(shard.stage(1) is S.ABORTED for shard in committee.shards)
    # the same word handed to the decoder directly (the script's call)
    scheme = committee.scheme
    rows = scheme.share(F.random(rng, 4), rng=rng)
    g = framing(committee, {2, 5, 7}, {0}, range(8))
    for m, value in g.items():
        rows[m] = F.add(rows[m], np.full(rows.shape[1], value))
    with pytest.raises(TamperingDetected):
        committee._reconstruct(rows, list(range(8)), 4, 0)


@pytest.mark.parametrize("colluders", [(3,), (1, 9)])
def test_tampering_members_within_the_sound_radius_are_corrected_and_exactly_named(colluders):
    rng = np.random.default_rng(2)
    committee = Committee(12, 2, 2, detect=1, shards=3, shard_class=OffsetShard)
    OffsetShard.offsets = {m: 17 + m for m in colluders}
    try:
        vectors = inputs(rng)
        result = run(committee, 1, vectors, rng)
    finally:
        OffsetShard.offsets = {}
    np.testing.assert_array_equal(result.aggregate, total(vectors))
    assert result.tampered == colluders and not set(colluders) & set(result.answered)
    assert result.verified


def test_tampering_with_exactly_t_plus_k_answers_is_reported_unverified():
    rng = np.random.default_rng(3)
    committee = Committee(7, 3, 2, detect=0)
    plan = CommitteeFaults(
        {
            (5, S.RELEASE): Fault.DROP,
            (6, S.RELEASE): Fault.DROP,
            (1, S.RELEASE): Fault.TAMPER,
        },
        seed=4,
    )
    vectors = inputs(rng)
    result = run(committee, 1, vectors, rng, plan)
    assert not result.verified and result.tampered == ()
    assert not np.array_equal(result.aggregate, total(vectors))  # nothing could tell
    one_spare = CommitteeFaults({(6, S.RELEASE): Fault.DROP})
    checked = run(committee, 2, vectors, rng, one_spare)
    assert checked.verified and np.array_equal(checked.aggregate, total(vectors))


LOW_ORDER = bytes.fromhex("e0eb7a7c3b41b8ae1656e3faf19fc46ada098deb9c32b1fd866205165f49b800")


def _hostile_inputs(committee, round_, rng, length, earlier):
    """Client 999's SHARE message, honest but for one thing (a list of (label, input));
    ``earlier``: its honest input of an earlier round, for the replay."""
    keys = committee.keys_for(round_)
    n, width = committee.scheme.n, committee.scheme.blocks_for(length)
    vector = F.random(rng, length)
    rows = committee.scheme.share(vector, rng=rng)
    client = Endpoint(999, keys.session_id, CHANNEL_PROTOCOL)
    for j, key in enumerate(keys.member_keys):
        client.connect(MEMBER_ID_BASE + j, key)

    def sealed_with(row=lambda j: rows[j], at=round_, stage=S.SHARE, to=lambda j: j, header=None):
        envelopes = {}
        for j in range(n):
            envelope = client.seal_array(MEMBER_ID_BASE + to(j), at, stage, row(j))
            header_j = {**(header or {}), "receiver": MEMBER_ID_BASE + j}
            envelopes[j] = dataclasses.replace(envelope, **header_j)
        return SealedInput(client.public_key, envelopes)

    honest = sealed_with()
    envelopes = dict(honest.envelopes)
    key = honest.public_key

    def each(**change):
        return SealedInput(key, {j: dataclasses.replace(e, **change) for j, e in envelopes.items()})

    flipped = dict(envelopes)
    body = envelopes[2].ciphertext
    flipped[2] = dataclasses.replace(envelopes[2], ciphertext=bytes([body[0] ^ 1]) + body[1:])
    swapped = {**envelopes, 0: envelopes[1], 1: envelopes[0]}
    return [
        ("the plaintext vector", vector),
        ("nothing", None),
        ("all-zero key", SealedInput(bytes(32), envelopes)),
        ("low-order key", SealedInput(LOW_ORDER, envelopes)),
        ("short key", SealedInput(b"k", envelopes)),
        ("text key", SealedInput("key", envelopes)),
        ("envelopes in a list", SealedInput(key, list(envelopes.values()))),
        ("one envelope missing", SealedInput(key, {j: e for j, e in envelopes.items() if j})),
        ("an envelope for a non-member", SealedInput(key, {**envelopes, n: envelopes[0]})),
        ("two members' envelopes swapped", SealedInput(key, swapped)),
        ("header of another round", each(round=round_ + 1)),
        ("header of another stage", each(stage="RELEASE")),
        ("header of another sender", each(sender=100)),
        ("sealed for another round", sealed_with(at=round_ + 1, header={"round": round_})),
        ("sealed for stage RELEASE", sealed_with(stage=S.RELEASE, header={"stage": "SHARE"})),
        ("sealed to the next member's key", sealed_with(to=lambda j: (j + 1) % n)),
        ("truncated ciphertexts", each(ciphertext=envelopes[0].ciphertext[:-1])),
        ("a longer share row", sealed_with(row=lambda j: np.append(rows[j], 1))),
        ("float shares", sealed_with(row=lambda j: rows[j].astype(np.float64))),
        ("out-of-field shares", sealed_with(row=lambda j: np.full(width, F.modulus))),
        ("a flipped bit", SealedInput(key, flipped)),
        ("a short nonce", each(nonce=bytes(8))),
        ("bytes for an envelope", SealedInput(key, {**envelopes, 3: b"envelope"})),
        ("last round's input replayed", earlier),
    ]


def test_malformed_sealed_inputs_drop_that_client_with_a_reason(capsys):
    """Every way a client's SHARE message can be wrong in form, binding or content -- unusable
    keys, missing, extra, swapped or misaddressed envelopes, headers or AAD of another round,
    stage or sender, wrong lengths, dtypes or field ranges, a flipped bit, a replay -- drops
    that client, named with a reason, and the round releases the others' sum."""
    rng = np.random.default_rng(5)
    committee = Committee(7, 2, 2, shards=2)
    earlier = sealed(committee, 0, {999: F.random(rng, 12)}, rng)[999]
    run(committee, 0, inputs(rng), rng)
    labels = [label for label, _ in _hostile_inputs(committee, 1, rng, 12, earlier)]
    dropped = 0
    for round_, label in enumerate(labels, start=1):  # each against its own round's keys
        bad = dict(_hostile_inputs(committee, round_, rng, 12, earlier))[label]
        vectors = inputs(rng)
        result = committee.run_round_sealed(
            round_, {**sealed(committee, round_, vectors, rng), 999: bad}, 12
        )
        assert result.excluded == (999,) and result.clients == tuple(vectors), label
        assert any(reason.startswith("client 999: ") for reason in result.reasons), label
        np.testing.assert_array_equal(result.aggregate, total(vectors))
        dropped += 1
    with capsys.disabled():
        print(f"\n[fuzz committee sealed inputs] tried {len(labels)}, dropped {dropped}")
    with pytest.raises(CommitteeAbort, match="no usable client input") as caught:
        committee.run_round_sealed(50, {1: None, 2: SealedInput(b"k", {})}, 12)
    assert sorted(caught.value.excluded) == [1, 2] and committee.stage(50) is S.ABORTED
    for bad_call, message in (
        (lambda: committee.run_round_sealed(51, {}, 12), "sealed is empty"),
        (lambda: committee.run_round_sealed(51, {2**62: None}, 12), "client id"),
        (lambda: committee.run_round_sealed(51, {1: None}, 0), "length"),
    ):
        with pytest.raises(ValueError, match=message):
            bad_call()
    assert committee.stage(51) is S.SETUP


def _hostile_shares(rng, shard, session, round_, width):
    """A client's delivery to a one-member shard: sealed under its real key but wrong in one
    way, or a forgery, or a replay (a sequence of (label, delivery))."""
    member = int(shard.members[0])
    client = Endpoint(42, session, CHANNEL_PROTOCOL)
    client.connect(MEMBER_ID_BASE + member, shard.public_keys()[member])

    def seal(payload, round_=round_, stage=S.SHARE, receiver=MEMBER_ID_BASE + member):
        if receiver != MEMBER_ID_BASE + member:
            client.connect(receiver, Endpoint(receiver, session, CHANNEL_PROTOCOL).public_key)
        return client.seal_array(receiver, round_, stage, payload)

    good = np.arange(width)
    key = client.public_key
    cases = [
        ("wrong length", seal(np.arange(width + 1))),
        ("float dtype", seal(good.astype(np.float64))),
        ("out of field", seal(np.full(width, F.modulus))),
        ("negative", seal(-good - 1)),
        ("2-D", seal(good[None, :])),
        ("bool", seal(np.ones(width, dtype=bool))),
        ("wrong stage", seal(good, stage=S.RELEASE)),
        ("wrong round", seal(good, round_=round_ + 1)),
        ("other receiver", seal(good, receiver=MEMBER_ID_BASE + member + 1)),
        ("random bytes", Envelope(42, MEMBER_ID_BASE + member, round_, "SHARE", bytes(12),
                                  rng.bytes(int(rng.integers(0, 80))))),
        ("typed garbage", Envelope("42", None, 1.5, 7, "nonce", 3)),
        ("not an envelope", rng.bytes(40)),
    ]
    deliveries = [(label, ShardSealedShares(key, (envelope,), width)) for label, envelope in cases]
    envelope = seal(good)
    deliveries += [
        ("bad key", ShardSealedShares(bytes(32), (envelope,), width)),
        ("short key", ShardSealedShares(b"k", (envelope,), width)),
        ("claims a wider share", ShardSealedShares(key, (envelope,), width + 3)),
        ("two envelopes for one member", ShardSealedShares(key, (envelope, envelope), width)),
        ("no envelope", ShardSealedShares(key, (), width)),
        ("envelopes not a sequence", ShardSealedShares(key, None, width)),
        ("width not a number", ShardSealedShares(key, (envelope,), "3")),
        ("plain rows to a sealed shard", np.zeros((1, width), dtype=np.int64)),
        ("a float", 3.5),
    ]
    return deliveries


def test_fuzzed_client_deliveries_are_refused_by_the_member(capsys):
    """Every malformed delivery a client or the relay can make: the member refuses it (the
    client is reported in ``refused`` and contributes zeros), nothing raises; a replay of an
    accepted envelope is refused too. Out-of-order calls are StageErrors."""
    rng = np.random.default_rng(7)
    session = new_session_id()
    tally = Counter()
    width = 3
    for round_ in range(40):
        shard = CommitteeShard([2], 61, session)
        shard.connect(SERVER_ID, Endpoint(SERVER_ID, session, CHANNEL_PROTOCOL).public_key)
        deliveries = _hostile_shares(rng, shard, session, round_, width)
        honest = Endpoint(43, session, CHANNEL_PROTOCOL)
        honest.connect(MEMBER_ID_BASE + 2, shard.public_keys()[2])
        accepted = honest.seal_array(MEMBER_ID_BASE + 2, round_, S.SHARE, np.arange(width))
        batch = {1000 + i: d for i, (_, d) in enumerate(deliveries)}
        batch[43] = ShardSealedShares(honest.public_key, (accepted,), width)
        answer = shard.share(round_, batch, StageFaults(), width)
        tally["tried"] += len(deliveries)
        tally["refused"] += sum(1 for c in answer["refused"] if c != 43)
        assert set(answer["refused"]) == set(batch) - {43}
        assert shard.state(round_).rows[43].tolist() == [list(range(width))]
        assert all(not shard.state(round_).rows[c].any() for c in answer["refused"])
        shard.combine(round_, [43], StageFaults())
        shard.release(round_, StageFaults())
        # the relay replays the accepted envelope in a later round: refused
        again = shard.share(round_ + 1000, {43: batch[43]}, StageFaults(), width)
        tally["tried"] += 1
        tally["refused"] += again["refused"] == {43: [2]}
        for call in (shard.share, shard.combine):  # the round is DONE: out of order
            tally["tried"] += 1
            with pytest.raises(StageError):
                call(round_, {} if call == shard.share else [], StageFaults())
            tally["refused"] += 1
    with capsys.disabled():
        print(f"\n[fuzz committee SHARE deliveries, replays, stages] {dict(tally)}")
    assert tally["tried"] == tally["refused"]


PLAIN_GARBAGE = [
    np.arange(12, dtype=np.int64).reshape(3, 4),  # well-formed plain rows
    np.zeros((2, 4), dtype=np.int64),
    np.zeros((3, 3), dtype=np.float64),
    np.full((3, 4), F.modulus),
    -np.ones((3, 4), dtype=np.int64),
    np.zeros((3, 4, 1), dtype=np.int64),
    np.zeros(12, dtype=np.int64),
    np.array([["1"] * 4] * 3),
    [[0] * 4] * 3,
    [[0] * 4, [0] * 3, [0]],
    None,
    ShardSealedShares(bytes(32), (), 4),
]


def test_fuzzed_plain_rows_are_refused_by_every_member_of_the_shard(capsys):
    """Members take only sealed shares: plain rows (even well-formed ones) and malformed
    deliveries are refused by every member of the shard; the sealed client counts."""
    session = new_session_id()
    shard = CommitteeShard([0, 1, 2], 61, session)
    batch = {i: rows for i, rows in enumerate(PLAIN_GARBAGE)}
    client = Endpoint(99, session, CHANNEL_PROTOCOL)
    envelopes = []
    for member, key in shard.public_keys().items():
        client.connect(MEMBER_ID_BASE + member, key)
        envelopes.append(
            client.seal_array(MEMBER_ID_BASE + member, 0, S.SHARE, np.arange(4) + member)
        )
    batch[99] = ShardSealedShares(client.public_key, tuple(envelopes), 4)
    answer = shard.share(0, batch, StageFaults(), 4)
    assert set(answer["refused"]) == set(range(len(PLAIN_GARBAGE)))
    assert all(who == [0, 1, 2] for who in answer["refused"].values())
    assert shard.combine(0, [99], StageFaults()) == [0, 1, 2]
    with capsys.disabled():
        print(f"\n[fuzz committee plain rows] tried {len(PLAIN_GARBAGE)}, refused "
              f"{len(answer['refused'])}")


class GarbageShard(CommitteeShard):
    """Members whose release is garbage of the kind ``garbage[member]`` names; ``impostor``
    makes the shard also answer for a member of another group."""

    garbage: dict[int, str] = {}
    impostor: int | None = None
    earlier: dict[int, Envelope] = {}

    def release(self, round_, faults):
        width = self.state(round_).total.shape[1]
        answer = super().release(round_, faults)
        members, rows = list(answer["members"]), list(answer["rows"])
        rows = [self._garbage(round_, m, row, width) for m, row in zip(members, rows)]
        if self.impostor is not None and self.impostor not in self.members:
            members, rows = members + [self.impostor], rows + rows[:1]
        return {**answer, "members": members, "rows": rows}

    def _garbage(self, round_, member, row, width):
        kind = self.garbage.get(member)
        seal = functools.partial(self.context.endpoints[member].seal_array, SERVER_ID)
        zeros = np.zeros(width, dtype=np.int64)
        made = {
            None: lambda: row,
            "bytes": lambda: b"\x00" * 40,
            "none": lambda: None,
            "array instead of envelope": lambda: zeros,
            "wrong length": lambda: seal(round_, S.RELEASE, np.zeros(width + 2, dtype=np.int64)),
            "float": lambda: seal(round_, S.RELEASE, zeros.astype(np.float64)),
            "out of field": lambda: seal(round_, S.RELEASE, zeros + F.modulus),
            "2-D": lambda: seal(round_, S.RELEASE, zeros[None, :]),
            "wrong round": lambda: seal(round_ + 1, S.RELEASE, zeros),
            "wrong stage": lambda: seal(round_, S.SHARE, zeros),
            "random ciphertext": lambda: dataclasses.replace(row, ciphertext=bytes(48)),
            "typed garbage": lambda: dataclasses.replace(row, sender=str(row.sender)),
            "replayed": lambda: self.earlier.get(member, bytes(1)),
        }[kind]()
        self.earlier[member] = row
        return made


RELEASE_GARBAGE = [
    "bytes",
    "none",
    "array instead of envelope",
    "wrong length",
    "float",
    "out of field",
    "2-D",
    "wrong round",
    "wrong stage",
    "random ciphertext",
    "typed garbage",
    "replayed",
]


def test_fuzzed_member_releases_reject_that_member_and_the_round_goes_on(capsys):
    """Each kind of garbage from one member (and an impostor answering for a member of another
    group): the member is rejected with a reason, the sum is right from the others; too many
    garbage members abort the round cleanly (ABORTED, nothing released)."""
    rng = np.random.default_rng(11)
    committee = Committee(9, 2, 2, detect=1, shards=2, shard_class=GarbageShard)
    tally = Counter()
    try:
        GarbageShard.earlier = {}
        run(committee, 0, inputs(rng), rng)  # gives the replay something to replay
        for round_, kind in enumerate(RELEASE_GARBAGE, start=1):
            GarbageShard.garbage = {3: kind}
            vectors = inputs(rng)
            result = run(committee, round_, vectors, rng)
            tally["tried"] += 1
            tally["rejected"] += result.rejected == (3,)
            assert result.rejected == (3,) and 3 not in result.answered, kind
            assert any(reason.startswith("member 3") for reason in result.reasons)
            np.testing.assert_array_equal(result.aggregate, total(vectors))
        GarbageShard.garbage, GarbageShard.impostor = {}, 8  # shard 0 answers for member 8
        vectors = inputs(rng)
        dropped = CommitteeFaults({(8, S.RELEASE): Fault.DROP})
        result = run(committee, 50, vectors, rng, dropped)
        assert 8 not in result.answered and 8 in result.dropped
        np.testing.assert_array_equal(result.aggregate, total(vectors))
        GarbageShard.impostor = None
        GarbageShard.garbage = dict(zip(range(5), RELEASE_GARBAGE))  # 4 left < 5 needed
        with pytest.raises(CommitteeAbort, match="5 committee members needed.*4 answered"):
            run(committee, 51, inputs(rng), rng)
        tally["tried"] += 1
        tally["rejected"] += committee.stage(51) is S.ABORTED
    finally:
        GarbageShard.garbage, GarbageShard.impostor, GarbageShard.earlier = {}, None, {}
    assert 51 not in committee.history
    with capsys.disabled():
        print(f"\n[fuzz committee RELEASE rows] {dict(tally)}")
    assert tally["tried"] == tally["rejected"]
