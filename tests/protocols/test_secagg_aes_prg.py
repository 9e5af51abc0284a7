"""SecAgg+ with the AES-256-CTR mask PRG (``strategy.options.prg = "aes-ctr"``): its keystream
is AES-CTR's (counter blocks from zero, checked against AES itself and FIPS-197), its field and
ring masks are uniform (chi-square on small moduli), the choice travels in the round's public
config so that masks cancel (in process and over the Grid, with dropouts), the default PRG's
records and masks are those of ChaCha20 as before, and a config runs ``fedsim run`` end to end
(a bad name is an error naming ``strategy.options.prg``)."""

from __future__ import annotations

import json

import numpy as np
import pytest
from cryptography.hazmat.primitives.ciphers import Cipher, algorithms, modes
from secure_support import one_round, random_inputs

from fedsim.config import ConfigError
from protocols.channels import new_session_id
from protocols.field import DEFAULT_FIELD, MersenneField
from protocols.secagg.client import SecAggClient
from protocols.secagg.common import RingZ2k, SecAggConfig, SecAggKeys, Stage, prg
from protocols.secagg.prg import KeyedField, MaskPRG, expand_mask
from protocols.secagg.server import SecAggServer, run_secagg
from strategies.registry import build_strategy
from strategies.secure import SecAggPlan

KEY = bytes(range(32))
AES = MaskPRG.AES_CTR


def _ecb(key: bytes, blocks: bytes) -> bytes:
    return Cipher(algorithms.AES(key), modes.ECB()).encryptor().update(blocks)


def test_aes_itself_matches_fips_197_aes_256():
    """FIPS-197 Appendix C.3: AES-256 under key 00..1f of 00112233..ff."""
    plain = bytes.fromhex("00112233445566778899aabbccddeeff")
    assert _ecb(KEY, plain).hex() == "8ea2b7ca516745bfeafc49904b496089"


def test_the_keystream_is_aes_ctr_from_a_zero_counter_block():
    stream = AES.keystream(KEY).update(bytes(16 * 5))
    direct = Cipher(algorithms.AES(KEY), modes.CTR(bytes(16))).encryptor().update(bytes(80))
    counters = b"".join(i.to_bytes(16, "big") for i in range(5))
    assert stream == direct == _ecb(KEY, counters)
    chacha = MaskPRG.CHACHA20.keystream(KEY).update(bytes(80))
    assert chacha == Cipher(algorithms.ChaCha20(KEY, bytes(16)), None).encryptor().update(bytes(80))
    assert stream != chacha
    with pytest.raises(ValueError, match="seed must be 32 bytes, got 16"):
        AES.keystream(KEY[:16])


def test_field_and_ring_masks_are_the_keystream_words():
    """F_p: 64-bit little-endian words masked to e bits, the value p dropped; Z_{2^k}: the
    words' low k bits."""
    words = np.frombuffer(AES.keystream(KEY).update(bytes(8 * 64)), dtype="<u8")
    field = MersenneField(13)
    low = words & np.uint64(field.modulus)
    expected = low[low != field.modulus][:40].astype(np.int64)
    np.testing.assert_array_equal(expand_mask(KEY, 40, field, AES), expected)
    np.testing.assert_array_equal(prg(KeyedField(13, AES), KEY, 40), expected)
    np.testing.assert_array_equal(
        RingZ2k(20, AES).expand(KEY, 40),
        (np.frombuffer(AES.keystream(KEY).update(bytes(160)), "<u4") & (2**20 - 1)),
    )
    np.testing.assert_array_equal(RingZ2k(64, "aes-ctr").expand(KEY, 20), words[:20])


def _chi_square(samples: np.ndarray, cells: int) -> float:
    counts = np.bincount(samples, minlength=cells)
    assert counts.size == cells  # nothing outside [0, cells)
    expected = samples.size / cells
    return float(((counts - expected) ** 2 / expected).sum())


@pytest.mark.parametrize("exponent, critical", [(5, 59.70), (7, 181.99)])
def test_field_masks_are_uniform_chi_square(exponent, critical):
    """F_31 and F_127 from AES words (rejection of p): the chi-square statistic of 400 draws
    per cell stays under the 0.999 quantile of chi2(p - 1); p itself never appears."""
    field = MersenneField(exponent)
    draws = np.concatenate(
        [expand_mask(bytes([s]) * 32, 400 * field.modulus // 4, field, AES) for s in range(4)]
    )
    assert draws.max() < field.modulus
    assert _chi_square(draws, field.modulus) < critical
    # the same statistic catches the bias of reducing 8-bit words mod p (a real defect)
    biased = np.frombuffer(AES.keystream(KEY).update(bytes(draws.size)), np.uint8)
    assert _chi_square(biased.astype(np.int64) % field.modulus, field.modulus) > critical


def test_ring_masks_are_uniform_chi_square():
    """Z_16 from AES words: chi-square under the 0.999 quantile of chi2(15)."""
    ring = RingZ2k(4, AES)
    draws = np.concatenate([ring.expand(bytes([s]) * 32, 4000) for s in range(4)])
    assert _chi_square(draws.astype(np.int64), 16) < 37.70


@pytest.mark.parametrize("ring_bits", [None, 32])
def test_config_carries_the_prg_in_its_record_and_a_restored_client(ring_bits):
    """The PRG's code travels in the record, and in a client's stored state: clients restored
    after SHARE_KEYS mask with AES, and the server's sum is exact."""
    config = SecAggConfig(5, 4, 3, 8, ring_bits=ring_bits, prg="aes-ctr")
    record = config.to_record()
    assert record[SecAggKeys.PRG] == 1 and SecAggConfig.from_record(record) == config
    assert config.masking.prg is AES and config.masking != SecAggConfig(5, 4, 3, 8).masking
    space = config.masking
    inputs = {i: space.asarray(np.arange(8) % 5 + i) for i in range(5)}
    session = new_session_id()
    server = SecAggServer(config, list(inputs), session, np.random.default_rng(3))
    clients = {i: SecAggClient(session) for i in inputs}
    routed = server.advertise_keys({i: c.advertise_keys() for i, c in clients.items()})
    incoming = server.share_keys({i: clients[i].share_keys(i, config, routed[i]) for i in routed})
    restored = {i: SecAggClient.from_state(c.to_state()) for i, c in clients.items()}
    assert all(c.config == config for c in restored.values())
    survivors, dropped = server.masked_input(
        {i: restored[i].masked_input(incoming[i], inputs[i]) for i in inputs}
    )
    total = server.unmask({i: restored[i].unmask(survivors, dropped) for i in survivors})
    np.testing.assert_array_equal(total, space.sum(np.stack(list(inputs.values())), axis=0))
    record[SecAggKeys.PRG] = 7
    with pytest.raises(ValueError, match="'prg': 7; allowed: 'chacha20', 'aes-ctr'"):
        SecAggConfig.from_record(record)
    with pytest.raises(ValueError, match="'prg': 'aes'"):
        SecAggConfig(5, 4, 3, 8, prg="aes")


@pytest.mark.parametrize("ring_bits", [None, 20])
@pytest.mark.parametrize("stage", [Stage.SHARE_KEYS, Stage.MASKED_INPUT, Stage.UNMASK])
def test_aes_masks_cancel_in_process_with_dropouts(ring_bits, stage):
    config = SecAggConfig(10, 6, 4, 64, ring_bits=ring_bits, prg=AES)
    space = config.masking
    rng = np.random.default_rng(7)
    inputs = {100 + i: space.asarray(rng.integers(0, 2**19, 64)) for i in range(10)}
    result = run_secagg(config, inputs, np.random.default_rng(8), dropouts={stage: {101, 105}})
    assert result.aggregate is not None and len(result.survivors) >= config.survivors_needed
    expected = space.sum(np.stack([inputs[i] for i in result.survivors]), axis=0)
    np.testing.assert_array_equal(result.aggregate, expected)


@pytest.fixture
def task_identity(monkeypatch):
    """Messages built outside a runtime need the process's task identity (Flower)."""
    from flwr.supercore.task_identity import TaskIdentity

    for name in ("_run_id", "_task_id", "_node_id"):
        monkeypatch.setattr(TaskIdentity, name, 1)


def test_aes_round_over_the_grid_with_dropouts_gives_the_exact_sum(task_identity):
    """The plan's ``prg`` reaches every client in ``secagg.setup``; the release is the field
    sum of the survivors (the clients' masks cancel only if they and the server agree)."""
    inputs = random_inputs(10, 16, seed=3)
    lost = 0
    for seed in range(4):
        release, grid, _ = one_round(
            "secagg", inputs, plan=SecAggPlan(seed, dropout=0.25, prg="aes-ctr")
        )
        setups = [m.content[SecAggKeys.SETUP] for m in grid.sent if SecAggKeys.SETUP in m.content]
        assert setups and all(s[SecAggKeys.PRG] == AES.code for s in setups)
        lost += len(inputs) - len(release.contributors)
        if release.total is not None:
            expected = DEFAULT_FIELD.sum(np.stack([inputs[n] for n in release.contributors]), 0)
            np.testing.assert_array_equal(release.total, expected)
    assert lost > 0  # some rounds lost clients
    release, grid, _ = one_round("secagg", inputs, plan=SecAggPlan(0))
    setups = [m.content[SecAggKeys.SETUP] for m in grid.sent if SecAggKeys.SETUP in m.content]
    assert setups and all(SecAggKeys.PRG not in s for s in setups)


RUN = """
seed = 5
rounds = 1

[data]
source = "digits"
partition = "iid"
num_clients = 12

[model]
kind = "logreg"

[client]
lr = 0.2

[strategy]
name = "fedavg"
clients_per_round = 6

[strategy.options]
secure_sum = "secagg"
fractional_bits = 16
{options}

[engine]
backend = "local"
"""


def _run(tmp_path, name: str, options: str) -> tuple[dict, dict]:
    from fedsim.cli import main
    from fedsim.frontend.results import read_rounds

    config = tmp_path / f"{name}.toml"
    config.write_text(RUN.format(options=options))
    out = tmp_path / name
    assert main(["run", str(config), "--out", str(out), "--no-progress"]) == 0
    (record,) = [r for r in read_rounds(out / "rounds.jsonl") if r["round"] >= 1]
    assert json.loads((out / "summary.json").read_text())["privacy"]["secure_sum"] == "secagg"
    return dict(np.load(out / "model.npz")), record["aggregated"]


def test_fedsim_run_with_the_aes_prg_gives_the_default_prgs_model(tmp_path):
    """The sum is exact under either PRG, so the model is the same to the bit."""
    aes, aggregated = _run(tmp_path, "aes", 'prg = "aes-ctr"')
    default, _ = _run(tmp_path, "default", "")
    assert aggregated["secure-contributors"] == 6 and aggregated["secure-aborted"] == 0
    assert aes.keys() == default.keys()
    for key in aes:
        np.testing.assert_array_equal(aes[key], default[key])


def test_a_bad_prg_is_an_error_naming_the_option():
    facts = dict(expected_clients=8, evaluate_fraction=0.0, seed=0)
    built = build_strategy("fedavg", {"secure_sum": "secagg", "prg": "aes-ctr"}, **facts)
    assert built.secure.plan.prg == "aes-ctr"
    assert built.secure.plan.config(1, 6, 3).prg is AES
    with pytest.raises(ConfigError, match="strategy.options.prg = 'aes'") as caught:
        build_strategy("fedavg", {"secure_sum": "secagg", "prg": "aes"}, **facts)
    assert "'chacha20' or 'aes-ctr'" in str(caught.value)
    with pytest.raises(ConfigError, match="strategy.options.prg = 1"):
        build_strategy("fedavg", {"secure_sum": "secagg", "prg": 1}, **facts)
