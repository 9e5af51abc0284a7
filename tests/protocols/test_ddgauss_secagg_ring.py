"""SecAgg+ over the ring Z_{2^b}: the masking space DDGauss uses when its bit budget allows."""

import numpy as np
import pytest

from fedsim.privacy.mechanisms import discrete_gaussian
from protocols.encoding import DDGaussEncoder
from protocols.field import DEFAULT_FIELD
from protocols.secagg.common import RingZ2k, SecAggConfig, Stage
from protocols.secagg.server import run_secagg


@pytest.mark.parametrize("bits", [20, 32, 64])
def test_ring_sum_with_dropouts_at_every_stage(bits):
    ring = RingZ2k(bits)
    rng = np.random.default_rng(bits)
    clients = list(range(1, 11))
    signed = {c: rng.integers(-1000, 1000, size=37) for c in clients}
    inputs = {c: ring.encode_signed(v) for c, v in signed.items()}
    config = SecAggConfig(num_clients=10, degree=6, threshold=4, vector_length=37, ring_bits=bits)
    for dropouts, gone in (
        ({}, set()),
        ({Stage.SHARE_KEYS: {3}, Stage.MASKED_INPUT: {5}}, {3, 5}),
        ({Stage.UNMASK: {2, 7}}, set()),  # inputs arrived before they left
    ):
        result = run_secagg(config, inputs, np.random.default_rng(0), dropouts)
        assert result.aggregate.dtype == ring.dtype
        expected = sum(signed[c] for c in clients if c not in gone)
        np.testing.assert_array_equal(ring.decode_signed(result.aggregate), expected)


def test_ring_elements_are_sent_in_ceil_bits_over_8_bytes():
    config = SecAggConfig(num_clients=4, degree=3, threshold=2, vector_length=100, ring_bits=20)
    inputs = {c: np.zeros(100, dtype=np.uint32) for c in range(4)}
    result = run_secagg(config, inputs, np.random.default_rng(0))
    transcript = result.server.transcript
    for client in range(4):
        assert transcript.nbytes(sender=client, stage=Stage.MASKED_INPUT) == 300


def test_ring_encoding_refuses_values_that_would_wrap():
    ring = RingZ2k(16)
    with pytest.raises(ValueError, match="wrap"):
        ring.encode_signed(np.array([40000]))
    with pytest.raises(ValueError, match="outside"):
        ring.asarray(np.array([1 << 16]))
    with pytest.raises(ValueError, match="ring_bits"):
        SecAggConfig(num_clients=4, degree=3, threshold=2, vector_length=1, ring_bits=65)


def test_ddgauss_encodings_sum_the_same_in_the_ring_and_the_field():
    rng = np.random.default_rng(1)
    enc = DDGaussEncoder(dim=40, clip=1.0, gamma=1e-3, noise_std=0.01)
    enc.headroom_bits(8, bits=20)  # the budget holds, so Z_{2^20} cannot wrap
    ring = RingZ2k(20)
    fields = [
        enc.encode(rng.normal(size=40), 3, rng, sampler=discrete_gaussian).elements
        for _ in range(8)
    ]
    via_field = DEFAULT_FIELD.decode_signed(DEFAULT_FIELD.sum(np.stack(fields), axis=0))
    via_ring = ring.decode_signed(
        ring.sum_list([ring.encode_signed(DEFAULT_FIELD.decode_signed(f)) for f in fields])
    )
    np.testing.assert_array_equal(via_field, via_ring)


def test_benchmark_script_runs_both_protocols_correctly(capsys):
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[2] / "experiments" / "bench" / "secagg.py"
    spec = importlib.util.spec_from_file_location("bench_secagg", path)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    args = ["--dims", "64", "--clients", "6", "--degree", "4", "--threshold", "3"]
    result = bench.main([*args, "--field-dims", "64"])
    capsys.readouterr()
    (row,) = result["runs"]
    for side in ("ours", "ours_field", "flower_secaggplus"):
        assert row[side]["max_abs_error"] < 1e-5
    assert row["ours"]["bytes_per_client"] < row["ours_field"]["bytes_per_client"]
    assert {"speedup_vs_flower_secaggplus", "bytes_ratio_vs_flower_secaggplus"} <= set(result)
