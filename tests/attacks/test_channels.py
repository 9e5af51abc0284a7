"""The relay (an active server) against the authenticated channels: replays across rounds and
stages, nonce reuse through key switching, bad public keys, other protocols and sessions."""

from __future__ import annotations

import dataclasses
import io
from collections import Counter

import numpy as np
import pytest

from protocols.channels import ChannelError, Endpoint, ReplayError, new_session_id

LOW_ORDER_KEYS = [
    bytes(32),  # the all-zero point
    (1).to_bytes(32, "little"),  # order 1
    bytes.fromhex("e0eb7a7c3b41b8ae1656e3faf19fc46ada098deb9c32b1fd866205165f49b800"),  # order 8
]


def test_an_envelope_from_an_earlier_round_is_refused_in_a_later_round():
    session = new_session_id()
    member = Endpoint(100, session)
    old_client = Endpoint(7, session)
    old_client.connect(100, member.public_key)
    member.connect(7, old_client.public_key)
    old = old_client.seal_array(100, 1, "SHARE", np.array([111]))
    assert member.open_array(old, round_=1, stage="SHARE").tolist() == [111]
    # round 2: the client connects with a fresh key; round 3: the relay substitutes the
    # round-1 envelope and key for the client's real ones
    member.connect(7, Endpoint(7, session).public_key)
    member.connect(7, old_client.public_key)
    with pytest.raises(ChannelError, match="expects round 3"):
        member.open_array(old, round_=3, stage="SHARE")
    relabelled = dataclasses.replace(old, round=3)
    with pytest.raises(ChannelError, match="authentication failed"):
        member.open_array(relabelled, round_=3, stage="SHARE")
    with pytest.raises(ReplayError):  # and the exact replay in its own round is refused too
        member.open_array(old, round_=1, stage="SHARE")


def test_switching_a_peer_key_back_and_forth_never_reuses_a_nonce():
    session = new_session_id()
    alice, bob = Endpoint(1, session), Endpoint(2, session)
    alice.connect(2, bob.public_key)
    first = alice.seal(2, 0, "X", b"attack at dawn!!")
    alice.connect(2, Endpoint(2, session).public_key)  # a key the relay made up
    alice.connect(2, bob.public_key)  # and back
    second = alice.seal(2, 0, "X", b"retreat at noon!")
    assert first.nonce != second.nonce
    keystream = bytes(a ^ b for a, b in zip(first.ciphertext[:16], second.ciphertext[:16]))
    assert keystream != bytes(a ^ b for a, b in zip(b"attack at dawn!!", b"retreat at noon!"))
    bob.connect(1, alice.public_key)
    assert bob.open(first, round_=0, stage="X") == b"attack at dawn!!"
    assert bob.open(second, round_=0, stage="X") == b"retreat at noon!"


@pytest.mark.parametrize("key", LOW_ORDER_KEYS + [b"short", "not-bytes"])
def test_an_unusable_public_key_is_a_channel_error_naming_the_peer(key):
    endpoint = Endpoint(1, new_session_id())
    with pytest.raises(ChannelError, match="party 9's public key is unusable"):
        endpoint.connect(9, key)
    assert endpoint.peers == []


def test_envelopes_are_bound_to_their_protocol_and_session():
    session = new_session_id()
    sender = Endpoint(1, session, protocol=b"dmm")
    for other in (Endpoint(2, session, protocol=b"secagg"), Endpoint(2, new_session_id(), b"dmm")):
        sender.connect(2, other.public_key)
        other.connect(1, sender.public_key)
        envelope = sender.seal(2, 0, "SHARE", b"x")
        with pytest.raises(ChannelError, match="authentication failed"):
            other.open(envelope, round_=0, stage="SHARE")


def test_garbage_envelopes_are_channel_errors():
    session = new_session_id()
    alice, bob = Endpoint(1, session), Endpoint(2, session)
    alice.connect(2, bob.public_key)
    bob.connect(1, alice.public_key)
    good = alice.seal_array(2, 0, "S", np.arange(3))
    rng = np.random.default_rng(0)
    for forged in (
        "not an envelope",
        dataclasses.replace(good, nonce=b""),
        dataclasses.replace(good, nonce=None),
        dataclasses.replace(good, ciphertext=rng.bytes(40)),
        dataclasses.replace(good, ciphertext=None),
        dataclasses.replace(good, sender=3),
    ):
        with pytest.raises(ChannelError):
            bob.open_array(forged, round_=0, stage="S")
    not_an_array = alice.seal(2, 0, "S", b"\x93NUMPY garbage")
    with pytest.raises(ChannelError, match="not a numeric array"):
        bob.open_array(not_an_array, round_=0, stage="S")


def _npy(header: dict, body: bytes) -> bytes:
    stream = io.BytesIO()
    np.lib.format.write_array_header_1_0(stream, header)
    return stream.getvalue() + body


HOSTILE_PAYLOADS = [
    _npy({"descr": "<i8", "fortran_order": False, "shape": (10**12,)}, bytes(8)),
    _npy({"descr": "<i8", "fortran_order": False, "shape": (2**62, 4)}, bytes(8)),
    _npy({"descr": "<i8", "fortran_order": False, "shape": (-3,)}, bytes(8)),
    _npy({"descr": "<i8", "fortran_order": False, "shape": (3,)}, bytes(16)),
    _npy({"descr": "<i8", "fortran_order": False, "shape": (3,)}, bytes(32)),
    _npy({"descr": "|O", "fortran_order": False, "shape": (1,)}, bytes(8)),
    _npy({"descr": [("a", "<i8")], "fortran_order": False, "shape": (1,)}, bytes(8)),
    _npy({"descr": "<c16", "fortran_order": False, "shape": (1,)}, bytes(16)),
    _npy({"descr": "<U3", "fortran_order": False, "shape": (1,)}, bytes(12)),
    b"\x93NUMPY\x03\x00" + bytes(20),
    b"\x93NUMPY\x01\x00\xff\xff" + b"{" * 65535,
    b"\x93NUMPY\x01\x00\x10\x00{'descr': 1, }\n",
    b"",
]


def test_fuzzed_envelopes_and_payloads_are_channel_errors(capsys):
    """Envelopes with random or mistyped fields, relabelled, redirected, replayed, truncated,
    and authentic envelopes whose payload is a hostile .npy (a header promising 10^12
    elements, negative or mismatched sizes, object, structured, complex or text dtypes, bad
    versions and headers): opening each raises ChannelError and allocates nothing big."""
    session = new_session_id()
    alice, bob = Endpoint(1, session), Endpoint(2, session)
    alice.connect(2, bob.public_key)
    bob.connect(1, alice.public_key)
    rng = np.random.default_rng(1)
    tally = Counter()
    values = [None, -1, 2**64, 1.5, "x", b"x", True, [1], np.int64(7)]
    for round_ in range(200):
        good = alice.seal_array(2, round_, "S", np.arange(4))
        field_name = ("sender", "receiver", "round", "stage", "nonce", "ciphertext")[round_ % 6]
        forged = [
            dataclasses.replace(good, **{field_name: values[int(rng.integers(len(values)))]}),
            dataclasses.replace(good, ciphertext=rng.bytes(int(rng.integers(0, 64)))),
            dataclasses.replace(good, ciphertext=good.ciphertext[: int(rng.integers(0, 40))]),
            dataclasses.replace(good, nonce=rng.bytes(12)),
            dataclasses.replace(good, round=round_ + 1),
            dataclasses.replace(good, stage="T"),
            dataclasses.replace(good, receiver=3),
            alice.seal(2, round_, "S", HOSTILE_PAYLOADS[round_ % len(HOSTILE_PAYLOADS)]),
            alice.seal(2, round_, "S", rng.bytes(int(rng.integers(0, 200)))),
        ]
        for envelope in forged:
            tally["tried"] += 1
            try:
                opened = bob.open_array(envelope, round_=round_, stage="S", sender=1)
            except ChannelError:
                tally["refused"] += 1
                continue
            assert opened.tolist() == [0, 1, 2, 3], envelope  # only the genuine message
            tally["opened genuine"] += 1
        assert bob.open_array(good, round_=round_, stage="S").tolist() == [0, 1, 2, 3]
        tally["tried"] += 1
        with pytest.raises(ReplayError):
            bob.open_array(good, round_=round_, stage="S")
        tally["refused"] += 1
    with capsys.disabled():
        print(f"\n[fuzz channels open/open_array] {dict(tally)}")
    assert tally["tried"] == tally["refused"] + tally["opened genuine"]
