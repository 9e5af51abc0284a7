"""Enrolment: the registry's authority, the parties' identities and what node_config carries."""

from __future__ import annotations

import pytest

from fedsim.engine.client_registry import (
    AUTHORITY_KEY,
    CERTIFICATE_KEY,
    Enrolment,
    client_name,
    enrolled,
    enrolled_name,
    identity_seed,
    member_name,
)
from fedsim.engine.committee import CommitteeSpec
from fedsim.randomness import RootSource, RunSecret
from protocols.channels import KeySubstitution
from protocols.committee.client import check_member_keys
from protocols.committee.common import CHANNEL_PROTOCOL
from protocols.enrolment import (
    Certificate,
    EnrolmentAuthority,
    Identity,
    KeyVerifier,
    key_statement,
)
from protocols.kit import MEMBER_ID_BASE

SESSION = b"s" * 32
KEY = bytes(range(32))


def test_the_authority_is_the_roots_and_the_same_wherever_the_root_is_read(tmp_path):
    root = RunSecret.fresh()
    again = RootSource(str(root.write(tmp_path / "root.hex")), None).open()  # a worker's read
    assert Enrolment(root).public_key == Enrolment(again).public_key
    assert Enrolment(RunSecret.fresh()).public_key != Enrolment(root).public_key
    with pytest.raises(ValueError, match="allowed: RunSecret"):
        Enrolment(root.client(0))


def test_node_config_entries_give_the_client_its_own_identity_and_the_pin():
    root = RunSecret.fresh()
    enrolment = Enrolment(root)
    entries = enrolment.node_entries(4, root.client(4))
    assert set(entries) == {AUTHORITY_KEY, CERTIFICATE_KEY}
    identity, verifier = enrolled(entries, root.client(4))
    assert identity.name == client_name(4) and verifier.authority == enrolment.public_key
    proof = identity.prove(b"p", SESSION, 9, (KEY,))
    assert verifier.check(
        proof, protocol=b"p", session_id=SESSION, party_id=9, keys=(KEY,), who="x"
    ) == "client/4"
    assert enrolled({}, root.client(4)) is None
    with pytest.raises(ValueError, match=CERTIFICATE_KEY):  # another client's certificate
        enrolled(entries, root.client(5))
    with pytest.raises(ValueError, match=AUTHORITY_KEY):
        enrolled({**entries, AUTHORITY_KEY: "zz"}, root.client(4))


def test_the_public_enrolment_is_read_again_for_other_bytes_never_served_stale():
    root = RunSecret.fresh()
    enrolment = Enrolment(root)
    four = enrolment.node_entries(4, root.client(4))
    five = enrolment.node_entries(5, root.client(5))
    for _ in range(2):  # the second time from the kept certificates
        assert enrolled_name(four)[0] == client_name(4)
        assert enrolled_name(five)[0] == client_name(5)
        assert enrolled(four, root.client(4))[0].name == client_name(4)
    other = Enrolment(RunSecret.fresh()).node_entries(4, root.client(4))
    name, verifier = enrolled_name(other)
    assert name == client_name(4) and verifier.authority == bytes.fromhex(other[AUTHORITY_KEY])
    assert verifier.authority != enrolled_name(four)[1].authority
    assert other[CERTIFICATE_KEY] != four[CERTIFICATE_KEY]
    assert enrolled_name({}) is None
    torn = {**four, CERTIFICATE_KEY: four[CERTIFICATE_KEY][:-2]}
    for _ in range(2):  # a malformed certificate raises every time (nothing kept)
        with pytest.raises(ValueError, match=CERTIFICATE_KEY):
            enrolled_name(torn)


def test_a_proof_binds_protocol_session_channel_and_every_key():
    authority = EnrolmentAuthority(bytes(32))
    identity = authority.identity("client/1", b"\x01" * 32)
    verifier = KeyVerifier(authority.public_key)
    proof = identity.prove(b"p", SESSION, 3, (KEY, KEY[::-1]))
    base = dict(protocol=b"p", session_id=SESSION, party_id=3, keys=(KEY, KEY[::-1]), who="w")
    assert verifier.check(proof, **base) == "client/1"
    for change in (
        {"protocol": b"q"},
        {"session_id": b"t" * 32},
        {"party_id": 4},
        {"keys": (KEY,)},
        {"keys": (KEY[::-1], KEY)},
    ):
        with pytest.raises(KeySubstitution, match="w's public key is not the one 'client/1'"):
            verifier.check(proof, **{**base, **change})
    with pytest.raises(KeySubstitution, match="signed by 'client/1', not 'client/2'"):
        verifier.check(proof, **base, name="client/2")
    with pytest.raises(KeySubstitution, match="carries no enrolment proof"):
        verifier.check(b"", **base)
    with pytest.raises(KeySubstitution, match="malformed"):
        verifier.check(b"\x00\x05" + bytes(70), **base)
    forged = Certificate("client/1", identity.certificate.identity, bytes(64))
    with pytest.raises(KeySubstitution, match="did not sign"):
        verifier.check(forged.to_bytes() + proof[-64:], **base)
    with pytest.raises(ValueError, match="for another key"):
        Identity.from_seed(b"\x02" * 32, identity.certificate)
    assert key_statement(b"p", SESSION, None, (KEY,)) != key_statement(b"p", SESSION, 0, (KEY,))


def test_a_verified_signature_is_checked_once_and_nothing_else_rides_on_it():
    """The neighbours of a client on one worker check its relayed keys once; a changed
    signature, statement or certificate is still checked, and fails."""
    authority = EnrolmentAuthority(bytes(32))
    identity = authority.identity("client/1", b"\x01" * 32)
    verifier = KeyVerifier(authority.public_key)
    proof = identity.prove(b"p", SESSION, 3, (KEY,))
    base = dict(protocol=b"p", session_id=SESSION, party_id=3, keys=(KEY,), who="w")
    assert verifier.check(proof, **base) == "client/1"
    calls = []

    class Counting:
        def __init__(self, key):
            self.key = key

        def verify(self, signature, statement):
            calls.append(statement)
            self.key.verify(signature, statement)

    encoded = proof[:-64]
    name, key = verifier._known[encoded]
    verifier._known[encoded] = (name, Counting(key))
    for _ in range(3):
        assert verifier.check(proof, **base) == "client/1"
    assert calls == []  # the same triple: no second Ed25519 verification
    flipped = proof[:-1] + bytes([proof[-1] ^ 1])
    with pytest.raises(KeySubstitution, match="not the one 'client/1' signed"):
        verifier.check(flipped, **base)
    with pytest.raises(KeySubstitution, match="not the one 'client/1' signed"):
        verifier.check(proof, **{**base, "party_id": 4})
    assert len(calls) == 2
    with pytest.raises(KeySubstitution, match="signed by 'client/1', not 'client/2'"):
        verifier.check(proof, **base, name="client/2")


def test_secrets_of_the_authority_and_the_identities_are_never_pickled():
    import pickle

    root = RunSecret.fresh()
    enrolment = Enrolment(root)
    for held in (enrolment, enrolment.authority, enrolment.identity("client/0", root.client(0))):
        with pytest.raises(TypeError, match="never pickled"):
            pickle.dumps(held)


def test_a_committee_built_from_the_root_signs_every_member_key():
    root = RunSecret.fresh()
    committee = CommitteeSpec(6, 2, 2).build(root)
    keys = committee.keys_for(3)
    verifier = Enrolment(root).verifier()
    names = check_member_keys(keys, verifier, [member_name(j) for j in range(6)])
    assert names == [member_name(j) for j in range(6)]
    assert all(
        verifier.check(
            keys.member_proofs[j],
            protocol=CHANNEL_PROTOCOL,
            session_id=keys.session_id,
            party_id=MEMBER_ID_BASE + j,
            keys=(keys.member_keys[j],),
            who=f"member {j}",
        )
        == member_name(j)
        for j in range(6)
    )
    other = Enrolment(RunSecret.fresh()).verifier()  # another run's authority
    with pytest.raises(KeySubstitution, match="did not sign"):
        check_member_keys(keys, other)
    assert CommitteeSpec(6, 2, 2).build(None).keys_for(1).member_proofs == ()


def test_transcripts_count_each_relayed_proofs_bytes_with_its_key():
    """A key's enrolment proof travels with it: the transcript counts its bytes in the key's
    message (DMM members -> server; SecAgg+ clients -> server -> neighbours)."""
    import numpy as np  # noqa: PLC0415

    from protocols.dmm.common import DMMStage, Schedule  # noqa: PLC0415
    from protocols.dmm.member import MemberPool  # noqa: PLC0415
    from protocols.dmm.server import DMMServer  # noqa: PLC0415
    from protocols.kit import SEAT_ID_BASE as SEAT_BASE  # noqa: PLC0415
    from protocols.secagg.client import SecAggClient  # noqa: PLC0415
    from protocols.secagg.common import SecAggConfig, Stage  # noqa: PLC0415
    from protocols.secagg.server import SecAggServer  # noqa: PLC0415
    from protocols.shamir import PackedShamir  # noqa: PLC0415

    root = RunSecret.fresh()
    enrolment = Enrolment(root)
    server = DMMServer(PackedShamir(5, 1, 1), Schedule(np.eye(2, dtype=np.int64)), 4)
    identities = {
        s: (identity_seed(root.client(c)),
            enrolment.identity(client_name(c), root.client(c)).certificate.to_bytes())
        for s, c in enumerate(range(10, 15))
    }
    kwargs = dict(server.member_kwargs, identities=identities, authority=enrolment.public_key)
    server.attach(MemberPool(list(range(10, 15)), [[0, 1, 2], [3, 4]], kwargs))
    keys = server.open_round(0)
    transcript = server._open.transcript
    for j, proof in keys.member_proofs.items():
        assert 160 < len(proof) < 200  # certificate (name, key, signature) and a signature
        sender = SEAT_BASE + j
        assert transcript.messages(sender=sender, stage=DMMStage.SHARE) == 1
        assert transcript.nbytes(sender=sender, stage=DMMStage.SHARE) == 32 + 8 + len(proof)
    # SecAgg+: each client's keys and proof up, its neighbours' keys and proofs down
    config = SecAggConfig(num_clients=4, degree=3, threshold=2, vector_length=2)
    session = b"q" * 32
    clients = {i: SecAggClient(session) for i in range(1, 5)}
    mine = {i: enrolment.identity(client_name(i), root.client(i)) for i in clients}
    sec = SecAggServer(config, range(1, 5), session, np.random.default_rng(0))
    proofs = {i: c.key_proof(mine[i]) for i, c in clients.items()}
    routed = sec.advertise_keys({i: c.advertise_keys() for i, c in clients.items()}, proofs)
    for i in clients:
        up = sec.transcript.nbytes(sender=i, stage=Stage.ADVERTISE_KEYS)
        assert up == 72 + len(proofs[i])
        down = sec.transcript.nbytes(receiver=i, stage=Stage.ADVERTISE_KEYS)
        assert down == sum(72 + len(proofs[j]) for j in routed[i])
