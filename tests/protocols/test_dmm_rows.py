"""Fast row decoding and pad removal read exactly what the general paths read."""

import numpy as np
import pytest

from protocols.channels import decode_array, encode_array
from protocols.dmm.client import _add_in_place, fold_pad, pad_words
from protocols.dmm.rows import row_decoder
from protocols.dmm.stages import _remove_pad
from protocols.field import MersenneField
from protocols.limbs import MersenneSum


@pytest.mark.parametrize("width", [0, 1, 7, 4096])
def test_row_decoder_matches_decode_array(width):
    rng = np.random.default_rng(width)
    row = rng.integers(-(2**62), 2**62, width)
    payload = encode_array(row)
    decoded = row_decoder(width)(payload)
    assert decoded.dtype == np.int64 and decoded.flags.writeable
    np.testing.assert_array_equal(decoded, decode_array(payload))
    np.testing.assert_array_equal(decoded, row)


def test_row_decoder_falls_back_for_other_payloads():
    decode = row_decoder(4)
    assert decode(encode_array(np.arange(5))).shape == (5,)
    assert decode(encode_array(np.arange(4, dtype=np.int32))).dtype == np.int32
    assert decode(encode_array(np.zeros((2, 2), dtype=np.int64))).shape == (2, 2)
    with pytest.raises(ValueError, match="not a .npy array"):
        decode(b"x" * len(encode_array(np.arange(4))))
    with pytest.raises(ValueError, match="payload must be bytes"):
        decode("not bytes")


@pytest.mark.parametrize("exponent, count", [(61, 9), (61, 40), (31, 9), (13, 5)])
def test_removing_the_pads_sum_is_field_subtraction_of_each_pad(exponent, count):
    """MersenneSum folds only when uint64 could overflow (every 7 pads at e = 61): the row minus the
    sum equals the row minus each pad in turn, at p - 1, 0 and the raw word p (for 0)."""
    f = MersenneField(exponent)
    rng = np.random.default_rng(exponent + count)
    row = f.random(rng, 1000)
    row[:3] = [0, f.modulus - 1, 5]
    pads = [f.random(rng, 1000).view(np.uint64) for _ in range(count)]
    pads[0][:3] = [f.modulus - 1, 0, 5]
    for pad in pads[1:]:
        pad[:4] = [f.modulus] * 4  # raw pad words: p stands for 0
    pads[2][4:8] = f.modulus - 1
    expected = row
    total = MersenneSum(f.exponent, 1000)
    for pad in pads:
        expected = f.sub(expected, pad.view(np.int64) % f.modulus)
        total.add(pad)
    out = _remove_pad(row, total.value(), f.modulus)
    assert out.dtype == np.int64
    np.testing.assert_array_equal(out, expected)
    assert out.min() >= 0 and out.max() < f.modulus
    assert _remove_pad(row, None, f.modulus) is row


def test_pad_words_reduce_to_fold_pad_and_add_like_field_addition():
    f = MersenneField(61)
    seed = bytes(range(32))
    words = pad_words(f, seed, 500)
    assert words.dtype == np.uint64 and int(words.max()) <= f.modulus
    np.testing.assert_array_equal(words % np.uint64(f.modulus), fold_pad(f, seed, 500))
    row = f.random(np.random.default_rng(1), 500)
    row[:2] = [f.modulus - 1, 0]
    words[:2] = [f.modulus, f.modulus]
    expected = f.add(row, (words % np.uint64(f.modulus)).astype(np.int64))
    _add_in_place(row, words, f.modulus)
    np.testing.assert_array_equal(row, expected)
    with pytest.raises(ValueError, match="a pad seed is 32 bytes"):
        pad_words(f, b"short", 5)


def test_pad_words_into_a_buffer_are_the_same_words_and_allocate_nothing():
    """A party expanding many pads reuses one buffer: the words written into it are the
    allocated path's, every time (a reused buffer keeps nothing of the last pad), and a
    buffer of the wrong length, type or layout is refused by name."""
    f = MersenneField(61)
    buffer = np.full(500, np.iinfo(np.uint64).max, dtype=np.uint64)
    for seed in (bytes(range(32)), bytes(32), bytes([255]) * 32):
        got = pad_words(f, seed, 500, out=buffer)
        assert got is buffer
        np.testing.assert_array_equal(got, pad_words(f, seed, 500))
    strided = np.empty(1000, np.uint64)[::2]
    for wrong in (np.empty(499, np.uint64), np.empty(500, np.int64), strided):
        with pytest.raises(ValueError, match=r"out is a .*allowed: a contiguous little-endian"):
            pad_words(f, bytes(32), 500, out=wrong)
    row, pad = f.random(np.random.default_rng(2), 500), pad_words(f, bytes(32), 500)
    expected = f.add(row, (pad % np.uint64(f.modulus)).astype(np.int64))
    _add_in_place(row, pad, f.modulus, np.empty(500, np.uint64))
    np.testing.assert_array_equal(row, expected)
