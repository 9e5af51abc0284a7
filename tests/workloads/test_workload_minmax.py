"""Quantized Optimistic Dual Averaging on monotone quadratic games."""

import json

import numpy as np
import pytest

from fedsim.cli import main
from fedsim.commands.minmax import GameConfig, MinmaxConfig
from fedsim.config import ConfigError
from fedsim.workloads.compression import Quantization, wire_bits
from fedsim.workloads.minmax import LinearGame, qoda


def distance(point, target):
    return float(np.sqrt(sum(np.sum((point[k] - target[k]) ** 2) for k in target)))


def setup(mu, seed=1, workers=4, n=6):
    game = LinearGame.random(np.random.default_rng(seed), n, n, workers, mu=mu)
    start = {"x": np.zeros(n), "y": np.zeros(n)}
    return game, [game.operator(k) for k in range(workers)], start, game.equilibrium()


def test_equilibrium_zeroes_the_mean_operator():
    game, operators, _, star = setup(0.3)
    values = [op(star) for op in operators]
    for name in ("x", "y"):
        np.testing.assert_allclose(np.mean([v[name] for v in values], axis=0), 0, atol=1e-12)


def test_exact_optimistic_dual_averaging_converges_on_a_bilinear_game_where_plain_da_does_not():
    _, operators, start, star = setup(0.0)
    d0 = distance(start, star)
    optimistic = qoda(
        operators, start, 1500, lr=1.0, quantization=None, rng=np.random.default_rng(0)
    )
    plain = qoda(
        operators,
        start,
        1500,
        lr=1.0,
        quantization=None,
        rng=np.random.default_rng(0),
        optimistic=False,
    )
    assert distance(optimistic.last, star) < 1e-6 * d0
    assert distance(plain.last, star) > d0


@pytest.mark.parametrize("mu", [0.0, 0.2])
def test_qoda_with_4_bit_layer_wise_uploads_converges(mu):
    _, operators, start, star = setup(mu)
    d0 = distance(start, star)
    result = qoda(
        operators,
        start,
        1000,
        lr=2.0,
        quantization=Quantization(bits=4),
        rng=np.random.default_rng(3),
    )
    assert distance(result.average, star) < 0.03 * d0
    if mu > 0:  # strongly monotone: the last iterate too
        assert distance(result.last, star) < 0.15 * d0


def test_qoda_counts_the_bits_each_worker_sends():
    _, operators, start, _ = setup(0.2)
    quantized = qoda(
        operators,
        start,
        10,
        lr=1.0,
        quantization=Quantization(bits=3),
        rng=np.random.default_rng(0),
    )
    exact = qoda(operators, start, 10, lr=1.0, quantization=None, rng=np.random.default_rng(0))
    assert quantized.bits_per_worker == 10 * 2 * (32 + 6 * 3)  # two blocks, a norm each
    assert exact.bits_per_worker == 10 * 12 * 32


def test_qoda_is_deterministic_given_the_generator_and_rejects_bad_arguments():
    _, operators, start, _ = setup(0.2)
    runs = [
        qoda(
            operators,
            start,
            50,
            lr=1.0,
            quantization=Quantization(bits=2),
            rng=np.random.default_rng(5),
        )
        for _ in range(2)
    ]
    np.testing.assert_array_equal(runs[0].last["x"], runs[1].last["x"])
    with pytest.raises(ValueError, match="steps"):
        qoda(operators, start, 0, lr=1.0, quantization=None, rng=np.random.default_rng(0))
    with pytest.raises(ValueError, match="lr"):
        qoda(operators, start, 5, lr=0.0, quantization=None, rng=np.random.default_rng(0))
    with pytest.raises(ValueError, match="mu"):
        LinearGame((np.eye(2),), (np.zeros(2),), (np.zeros(2),), mu=-1.0)


# ``fedsim minmax``: the config keys and the runner ------------------------------------------

TINY = """
[game]
kind = "linear"
x_dim = 3
y_dim = 2
workers = 3
mu = 0.1
seed = 4

[qoda]
steps = 300
lr = 2.0
"""


def write_config(tmp_path, text, name="tiny.toml"):
    path = tmp_path / name
    path.write_text(text)
    return path


def read_steps(out):
    return [json.loads(line) for line in (out / "steps.jsonl").read_text().splitlines()]


@pytest.mark.parametrize(
    ("mapping", "key", "value"),
    [
        ({"game": {"kind": "quadratic"}}, "game.kind", "quadratic"),
        ({"game": {"workers": 0}}, "game.workers", 0),
        ({"game": {"mu": -0.5}}, "game.mu", -0.5),
        ({"game": {"dimension": 3}}, "game.dimension", 3),
        ({"qoda": {"steps": 0}}, "qoda.steps", 0),
        ({"qoda": {"lr": 0.0}}, "qoda.lr", 0.0),
        ({"qoda": {"optimistic": "yes"}}, "qoda.optimistic", "yes"),
        ({"qoda": {"compression": {"bits": 1}}}, "qoda.compression.bits", 1),
        ({"qoda": {"compression": {"levels": "adaptive"}}}, "qoda.compression.levels", "adaptive"),
        ({"qoda": {"compression": {"bitz": 4}}}, "qoda.compression.bitz", 4),
        ({"qoda": {"compression": 4}}, "qoda.compression", 4),
        ({"client": {}}, "client", {}),
    ],
)
def test_minmax_config_errors_name_the_key_and_value(mapping, key, value):
    with pytest.raises(ConfigError) as err:
        MinmaxConfig.from_mapping(mapping)
    assert err.value.key == key
    assert err.value.value == value
    assert f"{key} = {value!r} is not allowed" in str(err.value)


def test_minmax_config_defaults_and_compression_table():
    config = MinmaxConfig.from_mapping(
        {"game": {"x_dim": 2}, "qoda": {"compression": {"bits": 3, "seed": 7}}}
    )
    assert config.game == GameConfig(x_dim=2)
    assert config.qoda.compression == Quantization(bits=3, seed=7)
    assert MinmaxConfig.from_mapping({}).qoda.compression is None


def test_fedsim_minmax_writes_steps_whose_distance_falls_and_bits_match_the_wire(tmp_path, capsys):
    config = write_config(tmp_path, TINY + "\n[qoda.compression]\nbits = 4\nseed = 2\n")
    out = tmp_path / "run"
    assert main(["minmax", str(config), "--out", str(out)]) == 0
    assert "300 QODA steps (4-bit uploads" in capsys.readouterr().out
    rows = read_steps(out)
    assert [r["step"] for r in rows] == list(range(301))
    assert rows[-1]["distance"] < 0.5 * rows[0]["distance"]
    assert rows[-1]["operator_norm"] < rows[0]["operator_norm"]
    per_step = wire_bits({"x": 3, "y": 2}, {"x": 4, "y": 4})  # a norm + 4 bits a coordinate
    assert per_step == 2 * 32 + 5 * 4
    assert [r["bits_per_worker"] for r in rows] == [per_step * t for t in range(301)]
    assert all(r["bits_total"] == 3 * r["bits_per_worker"] for r in rows)
    summary = json.loads((out / "summary.json").read_text())
    assert summary["bits_per_worker"] == per_step * 300
    assert summary["last_distance"] == pytest.approx(rows[-1]["distance"])
    assert summary["config"]["qoda"]["compression"]["bits"] == 4


def test_fedsim_minmax_rejects_a_bad_config_before_running(tmp_path, capsys):
    config = write_config(tmp_path, TINY.replace("steps = 300", "steps = -1"))
    out = tmp_path / "run"
    assert main(["minmax", str(config), "--out", str(out)]) == 2
    assert "qoda.steps = -1 is not allowed" in capsys.readouterr().err
    assert not out.exists()


def test_fedsim_minmax_default_out_is_results_minmax_config_stem(tmp_path, monkeypatch):
    config = write_config(tmp_path, TINY.replace("steps = 300", "steps = 5"), "mine.toml")
    monkeypatch.chdir(tmp_path)
    assert main(["minmax", str(config)]) == 0
    assert len(read_steps(tmp_path / "results" / "minmax" / "mine")) == 6
    before = (tmp_path / "results" / "minmax" / "mine" / "summary.json").read_text()
    assert main(["minmax", str(config)]) == 2  # a second run keeps the first one's results
    assert (tmp_path / "results" / "minmax" / "mine" / "summary.json").read_text() == before


@pytest.mark.parametrize("bits", [None, 4])
def test_fedsim_minmax_reproduces_a_direct_qoda_call(tmp_path, bits):
    text = TINY if bits is None else TINY + f"\n[qoda.compression]\nbits = {bits}\nseed = 9\n"
    out = tmp_path / "run"
    assert main(["minmax", str(write_config(tmp_path, text)), "--out", str(out)]) == 0
    game = LinearGame.random(np.random.default_rng(4), 3, 2, 3, mu=0.1)
    direct = qoda(
        [game.operator(k) for k in range(3)],
        {"x": np.zeros(3), "y": np.zeros(2)},
        300,
        lr=2.0,
        quantization=None if bits is None else Quantization(bits=bits, seed=9),
        rng=np.random.default_rng(0 if bits is None else 9),
    )
    star = game.equilibrium()
    summary = json.loads((out / "summary.json").read_text())
    assert summary["last_distance"] == distance(direct.last, star)
    assert summary["average_distance"] == distance(direct.average, star)
    assert summary["bits_per_worker"] == direct.bits_per_worker
    assert read_steps(out)[-1]["distance"] == distance(direct.last, star)
