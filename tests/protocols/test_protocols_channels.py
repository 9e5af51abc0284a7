"""protocols.channels: round trips, wrong key, tampering, replay, misbinding, transcript bytes."""

from __future__ import annotations

import dataclasses
from enum import Enum

import numpy as np
import pytest

from protocols.channels import (
    SERVER_ID,
    TAG_BYTES,
    ChannelError,
    Endpoint,
    Envelope,
    Relay,
    ReplayError,
    Transcript,
    connect_all,
    new_session_id,
)


class Stage(Enum):
    SHARE = 1
    UNMASK = 2


@pytest.fixture
def parties():
    relay = Relay()
    session = new_session_id()
    endpoints = [Endpoint(party_id, session) for party_id in (0, 1, 2)]
    connect_all(endpoints, relay)
    return relay, endpoints


def test_round_trip_through_relay(parties):
    relay, (alice, bob, _) = parties
    relay.post(alice.seal(1, 3, Stage.SHARE, b"hello bob"))
    relay.post(alice.seal_array(1, 3, "shares", np.arange(5, dtype=np.int64)))
    first, second = relay.deliver(1)
    assert bob.open(first, round_=3, stage=Stage.SHARE) == b"hello bob"
    assert bob.open_array(second, round_=3, stage="shares").tolist() == [0, 1, 2, 3, 4]
    assert relay.deliver(1) == []


def test_both_directions_use_distinct_keys_and_nonces(parties):
    _, (alice, bob, _) = parties
    to_bob = alice.seal(1, 0, "s", b"same")
    to_alice = bob.seal(0, 0, "s", b"same")
    again = alice.seal(1, 0, "s", b"same")
    assert to_bob.nonce != again.nonce
    assert len({to_bob.ciphertext, to_alice.ciphertext, again.ciphertext}) == 3
    assert alice.open(to_alice, round_=0, stage="s") == b"same"


def test_wrong_key_fails(parties):
    _, (alice, bob, _) = parties
    envelope = alice.seal(1, 0, "s", b"secret")
    impostor = Endpoint(1, new_session_id())  # same id, other key pair and session
    impostor.connect(0, alice.public_key)
    with pytest.raises(ChannelError, match="authentication failed"):
        impostor.open(envelope, round_=0, stage="s")
    assert bob.open(envelope, round_=0, stage="s") == b"secret"


def test_tampered_ciphertext_nonce_or_header_fails(parties):
    _, (alice, bob, _) = parties
    envelope = alice.seal(1, 4, Stage.SHARE, b"payload" * 10)
    flipped = bytearray(envelope.ciphertext)
    flipped[3] ^= 1
    cases = [
        dataclasses.replace(envelope, ciphertext=bytes(flipped)),
        dataclasses.replace(envelope, ciphertext=envelope.ciphertext[:-1]),
        dataclasses.replace(envelope, nonce=bytes(11) + b"\x07"),
        dataclasses.replace(envelope, round=5),
        dataclasses.replace(envelope, stage="UNMASK"),
    ]
    for forged in cases:
        with pytest.raises(ChannelError):
            bob.open(forged, round_=4, stage=Stage.SHARE)
    assert bob.open(envelope, round_=4, stage=Stage.SHARE) == b"payload" * 10


def test_replay_is_refused(parties):
    relay, (alice, bob, _) = parties
    envelope = alice.seal(1, 0, Stage.UNMASK, b"once")
    assert bob.open(envelope, round_=0, stage=Stage.UNMASK) == b"once"
    with pytest.raises(ReplayError, match="already opened"):
        bob.open(envelope, round_=0, stage=Stage.UNMASK)
    # the same ciphertext relabelled for a later round or another stage does not authenticate
    for forged, round_, stage in (
        (dataclasses.replace(envelope, round=1), 1, Stage.UNMASK),
        (dataclasses.replace(envelope, stage="SHARE"), 0, Stage.SHARE),
    ):
        with pytest.raises(ChannelError, match="authentication failed"):
            bob.open(forged, round_=round_, stage=stage)


def test_redirected_or_misdelivered_messages_fail(parties):
    _, (alice, bob, carol) = parties
    envelope = alice.seal(1, 0, "s", b"for bob")
    with pytest.raises(ChannelError, match="addressed to party 1 was delivered to party 2"):
        carol.open(envelope, round_=0, stage="s")
    redirected = dataclasses.replace(envelope, receiver=2)
    with pytest.raises(ChannelError, match="authentication failed"):
        carol.open(redirected, round_=0, stage="s")
    respoofed = dataclasses.replace(envelope, sender=2)  # claims to come from carol
    with pytest.raises(ChannelError, match="authentication failed"):
        bob.open(respoofed, round_=0, stage="s")
    with pytest.raises(ChannelError, match="expects sender=2"):
        bob.open(envelope, round_=0, stage="s", sender=2)


def test_relay_sees_only_ciphertext(parties):
    relay, (alice, _, carol) = parties
    secret = b"the plaintext share 0123456789abcdef"
    relay.post(alice.seal(1, 0, "s", secret))
    relay.post(carol.seal(1, 0, "s", secret))
    with pytest.raises(ValueError, match="only forwards Envelope"):
        relay.post(secret)
    for envelope in relay.pending():
        assert isinstance(envelope, Envelope)
        assert secret not in envelope.ciphertext
        assert len(envelope.ciphertext) == len(secret) + TAG_BYTES


def test_transcript_counts_every_message():
    transcript = Transcript()
    relay = Relay(transcript)
    session = new_session_id()
    endpoints = [Endpoint(party_id, session) for party_id in (10, 11, 12)]
    connect_all(endpoints, relay)
    assert transcript.messages(receiver=SERVER_ID) == 3
    assert transcript.nbytes(stage="keys") == 3 * (32 + 8)
    sizes = {}
    for sender in endpoints:
        for receiver in endpoints:
            if sender is receiver:
                continue
            payload = bytes(7 * (sender.party_id + receiver.party_id))
            envelope = sender.seal(receiver.party_id, 2, Stage.SHARE, payload)
            relay.post(envelope)
            # header 26 bytes + stage name + 12-byte nonce + payload + 16-byte tag
            sizes[(sender.party_id, receiver.party_id)] = 26 + 5 + 12 + len(payload) + 16
            assert envelope.nbytes == sizes[(sender.party_id, receiver.party_id)]
    assert transcript.messages(stage=Stage.SHARE) == 6
    assert transcript.nbytes(stage=Stage.SHARE) == sum(sizes.values())
    assert transcript.nbytes(sender=10, stage="SHARE") == sizes[(10, 11)] + sizes[(10, 12)]
    assert transcript.nbytes(sender=11, receiver=12) == sizes[(11, 12)]
    rows = [row for row in transcript.rows() if row["stage"] == "SHARE"]
    assert len(rows) == 6 and all(row["messages"] == 1 for row in rows)


def test_invalid_arguments_are_named(parties):
    _, (alice, _, _) = parties
    with pytest.raises(ValueError, match="session_id must be at least 16 bytes"):
        Endpoint(0, b"short")
    with pytest.raises(ValueError, match="receiver=9 is not connected"):
        alice.seal(9, 0, "s", b"x")
    with pytest.raises(ValueError, match="stage must be"):
        alice.seal(1, 0, "", b"x")
    with pytest.raises(ValueError, match="round must be"):
        alice.seal(1, -1, "s", b"x")
    with pytest.raises(ValueError, match="peer_public_key must be 32 raw bytes"):
        alice.connect(5, b"abc")
    with pytest.raises(ValueError, match="own id"):
        alice.connect(0, alice.public_key)
    with pytest.raises(ValueError, match="numeric dtype"):
        alice.seal_array(1, 0, "s", np.array(["a"]))


def test_an_endpoint_from_a_loaded_key_or_its_bytes_is_the_same_party():
    from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey

    session, secret = new_session_id(), bytes(range(32))
    from_bytes = Endpoint(0, session, private_key=secret)
    loaded = Endpoint(0, session, private_key=X25519PrivateKey.from_private_bytes(secret))
    assert from_bytes.public_key == loaded.public_key
    peer = Endpoint(1, session)
    for endpoint in (from_bytes, loaded):
        endpoint.connect(1, peer.public_key)
    peer.connect(0, loaded.public_key)
    sealed = peer.seal(0, 3, Stage.SHARE, b"row")
    assert from_bytes.open(sealed, round_=3, stage=Stage.SHARE) == b"row"
    assert loaded.open(sealed, round_=3, stage=Stage.SHARE) == b"row"
    assert from_bytes.receive_key(1) == loaded.receive_key(1)
    # restoring a receive key needs no X25519 key: the bytes are loaded only when used
    restored = Endpoint(0, session, private_key=secret)
    restored.accept_receive_key(1, peer.public_key, from_bytes.receive_key(1))
    assert restored._loaded_key is None
    assert restored.open(peer.seal(0, 3, Stage.SHARE, b"next"), round_=3, stage=Stage.SHARE)
    assert restored._loaded_key is None
    with pytest.raises(ValueError, match="X25519PrivateKey or 32 bytes"):
        Endpoint(0, session, private_key=b"short")
