"""POPri and Private Evolution through ``fedsim run`` (issue 28: the registry lists every
method, runnable from a config): ``[data] source = "text"``, the real SmolLM2 generator and
MiniLM embedder from their packages (offline), the engine's cohorts, and epsilon from the
strategy's ledger in every round record and in summary.json."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest

from fedsim.cli import main
from fedsim.config import ConfigError
from fedsim.frontend.run_config import ExperimentConfig

WORDS = ("the model returns an array of values computed from the input data along the "
         "given axis with optional weights and a default tolerance").split()  # fmt: skip


def _texts(tmp_path: Path) -> tuple[Path, Path]:
    rng = np.random.default_rng(0)
    private, public = tmp_path / "texts.jsonl", tmp_path / "public.jsonl"
    rows = [{"client_id": f"c{c}", "text": " ".join(rng.choice(WORDS, 10))}
            for c in range(6) for _ in range(5)]  # fmt: skip
    private.write_text("".join(json.dumps(r) + "\n" for r in rows))
    public.write_text("".join(
        json.dumps({"client_id": "p", "text": " ".join(rng.choice(WORDS, 8))}) + "\n"
        for _ in range(6)
    ))  # fmt: skip
    return private, public


def _config(tmp_path: Path, name: str, **options) -> dict:
    private, public = _texts(tmp_path)
    return {
        "name": f"{name}-tiny", "seed": 3, "rounds": 2,
        "data": {"source": "text", "partition": "natural", "num_clients": 6,
                 "test_fraction": 0.0,
                 "text": {"kind": "table", "path": str(private), "public_path": str(public)}},
        "strategy": {"name": name, "clients_per_round": 3, "options": {
            "num_prompts": 2, "samples_per_prompt": 2, "examples_per_prompt": 1,
            "max_new_tokens": 4, "max_tokens": 16, "noise_multiplier": 1.0, **options}},
        "engine": {"backend": "local"},
    }  # fmt: skip


def _toml(config: dict) -> str:
    import tomli_w  # noqa: PLC0415

    return tomli_w.dumps(config)


def _fedsim_run(tmp_path: Path, config: dict, capsys) -> tuple[list[dict], dict]:
    """``fedsim run`` in this process: the two runs share the process's loaded generator and
    embedder (each loaded once per process) instead of each loading them in its own."""
    path = tmp_path / "run.toml"
    path.write_text(_toml(config))
    out = tmp_path / "out"
    code = main(["run", str(path), "--out", str(out), "--secrets", str(tmp_path / "root.key"),
                 "--no-progress"])  # fmt: skip
    assert code == 0, capsys.readouterr().err[-3000:]
    rounds = [json.loads(line) for line in (out / "rounds.jsonl").read_text().splitlines()]
    return [r for r in rounds if r.get("round", 0) >= 1], json.loads(
        (out / "summary.json").read_text()
    )


def _check_privacy(rounds: list[dict], summary: dict) -> None:
    """Epsilon grows with the rounds, from the ledger with the run's sampling (3 of 6)."""
    eps = [r["privacy"]["epsilon"] for r in rounds]
    assert len(eps) == 2 and 0 < eps[0] < eps[1] and math.isfinite(eps[1])
    assert all(r["privacy"]["rounds_accounted"] == r["round"] for r in rounds)
    assert rounds[-1]["privacy"]["relation"] == "replace_one"  # fixed-size cohorts
    assert summary["privacy"]["epsilon"] == eps[-1]
    assert summary["unaccounted_releases"] == 0


def test_a_tiny_popri_run_through_fedsim_run(tmp_path, capsys):
    rounds, summary = _fedsim_run(
        tmp_path,
        _config(tmp_path, "popri", held_out_texts=8, dpo={"batch_size": 2, "lora_rank": 2}),
        capsys,
    )
    _check_privacy(rounds, summary)
    for r in rounds:
        assert r["aggregated"]["clients"] == 3 and r["aggregated"]["pairs"] == 2
        assert math.isfinite(r["aggregated"]["fid"])
    with np.load(tmp_path / "out" / "model.npz") as model:  # the final LoRA adapter
        assert model.files and all("lora" in k for k in model.files)


def test_a_tiny_private_evolution_run_through_fedsim_run(tmp_path, capsys):
    rounds, summary = _fedsim_run(tmp_path, _config(tmp_path, "private-evolution"), capsys)
    _check_privacy(rounds, summary)
    for r in rounds:
        assert r["aggregated"]["pe-clients"] == 3 and r["aggregated"]["pe-population"] >= 1
    with np.load(tmp_path / "out" / "model.npz") as model:  # the population's embeddings
        assert model.files


@pytest.mark.parametrize("name", ["popri", "private-evolution"])
def test_a_bad_option_is_refused_naming_its_key(tmp_path, name):
    config = _config(tmp_path, name)
    own = {"popri": [("samples_per_prompt", 1), ("reject_rank", 9), ("top_p", 0.0)],
           "private-evolution": [("keep", -1), ("threshold", -1.0), ("top_p", 0.0)]}[name]
    for key, value in (("generator", "gpt-4"), ("embedder", "bert"), ("delta", 2.0),
                       ("target_epsilon", 1.0), ("noise_multiplier", -1.0),
                       ("no_such_key", 1), *own):  # fmt: skip
        bad = {**config, "strategy": {**config["strategy"], "options": {
            **config["strategy"]["options"], key: value}}}  # fmt: skip
        with pytest.raises(ConfigError) as err:
            ExperimentConfig.from_dict(bad)
        expected = "noise_multiplier" if key == "target_epsilon" else key  # both given
        assert err.value.key == f"strategy.options.{expected}", key


def test_a_text_method_needs_a_text_source_and_the_other_way_round(tmp_path):
    config = _config(tmp_path, "popri")
    arrays = {**config, "data": {"source": "synthetic", "partition": "natural",
                                 "num_clients": 6}}  # fmt: skip
    with pytest.raises(ConfigError) as err:
        ExperimentConfig.from_dict(arrays)
    assert err.value.key == "data.source"
    fedavg = {**config, "strategy": {"name": "fedavg", "clients_per_round": 3}}
    with pytest.raises(ConfigError) as err:
        ExperimentConfig.from_dict(fedavg)
    assert err.value.key == "data.source"
    untexted = {**config, "data": {k: v for k, v in config["data"].items() if k != "text"}}
    with pytest.raises(ConfigError) as err:
        ExperimentConfig.from_dict(untexted)
    assert err.value.key == "data.text"
