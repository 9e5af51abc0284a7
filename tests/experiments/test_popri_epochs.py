"""experiments/popri/epochs.py and Context.finetune's per-epoch curves, on a tiny docstring
federation (real LM, real fine-tunes): the fixed schedule stays what it was, and the stored
stages' fine-tunes rerun to their stored accuracies."""

from __future__ import annotations

import json
from dataclasses import asdict

import numpy as np
import pytest

from experiments.popri import epochs as ep
from experiments.popri.run import (
    Context,
    _jsonable,
    load_config,
    run_stage,
    stage_base,
    stage_nonprivate,
    stage_public,
)
from experiments.roots import study_root
from fedsim.workloads.downstream_lm import next_token_accuracy, train_and_evaluate

TINY = """
name = "tiny"
epsilons = [1.0]
[data]
client_packages = ["numpy"]
max_clients = 8
held_out_fraction = 0.3
[downstream]
vocab_size = 256
hidden = 16
layers = 1
heads = 2
max_tokens = 32
pretrain_texts = 60
eval_texts = 20
[downstream.pretrain]
epochs = 1
batch_size = 16
[downstream.finetune]
epochs = 3
batch_size = 8
lr = 1e-3
max_steps = 10
"""


def _without_epochs(stage):
    return {k: v for k, v in stage.items() if k != "epochs"}


@pytest.fixture(scope="module")
def study(tmp_path_factory):
    """Stored stages as a run before per-epoch curves leaves them (no ``epochs``)."""
    out = tmp_path_factory.mktemp("epochs")
    path = out / "config.toml"
    path.write_text(TINY)
    config = load_config(path)
    (out / "config.json").write_text(json.dumps(_jsonable(asdict(config)), sort_keys=True))
    key = tmp_path_factory.mktemp("keys") / "popri.key"
    ctx = Context(config, out, study_root(key, out))
    stages = out / "stages"
    stages.mkdir()
    public = ctx.federation.public
    first = {"prompts": ["p"], "seed": 0, "samples": [list(public[:5]), list(public[5:9])]}
    (out / "cache").mkdir(exist_ok=True)
    (out / "cache" / "first_round.json").write_text(json.dumps(first))
    made = {"public": run_stage(ctx, "public", stage_public)}
    made["nonprivate"] = run_stage(ctx, "nonprivate", stage_nonprivate)
    made["base"] = run_stage(ctx, "base", stage_base)
    synthetic = list(public[20:44])  # stands in for POPri's texts: any stored texts will do
    made["popri-eps1"] = {**ctx.finetune(synthetic, purpose=10), "synthetic": synthetic}
    for name, stage in made.items():
        (stages / f"{name}.json").write_text(json.dumps(_without_epochs(stage), default=float))
    return out, path, ctx, made


def test_the_curves_leave_the_fixed_schedule_bit_identical(study):
    _, _, ctx, _ = study
    texts = ctx.federation.all_train()[:40]
    sequences = ctx.sequences(texts)
    seen = []

    def on_epoch(epoch, steps, model):
        seen.append((epoch, steps))
        next_token_accuracy(model, ctx.validation_sequences)

    args = (sequences, ctx.eval_sequences, ctx.spec, ctx.config.downstream.finetune)
    plain, plain_weights, plain_losses = train_and_evaluate(*args, seed=3, initial=ctx.pretrained())
    hooked, hooked_weights, hooked_losses = train_and_evaluate(
        *args, seed=3, initial=ctx.pretrained(), on_epoch=on_epoch
    )
    assert hooked == plain and hooked_losses == plain_losses
    assert all(np.array_equal(plain_weights[k], hooked_weights[k]) for k in plain_weights)
    assert seen == [(1, 5), (2, 10)]  # 40 texts / batch 8: 5 steps a pass, max_steps 10


def test_finetune_records_every_pass_and_its_last_is_the_fixed_schedule(study):
    _, _, ctx, made = study
    for name in ("nonprivate", "base", "popri-eps1"):
        stage = made[name]
        rows = stage["epochs"]
        assert [r["epoch"] for r in rows] == list(range(1, len(rows) + 1))
        assert rows[-1]["steps"] == stage["train_steps"]
        assert rows[-1]["accuracy"]["test"] == stage["accuracy"]
        assert all(set(r["accuracy"]) == {"validation", "test"} for r in rows)
    assert len(made["popri-eps1"]["epochs"]) == 3  # 24 texts: 3 steps a pass, 9 steps
    per_pass = -(-made["nonprivate"]["train_texts"] // 8)
    steps = min(3 * per_pass, 10)
    assert len(made["nonprivate"]["epochs"]) == -(-steps // per_pass)


def test_a_rerun_from_the_stored_stages_gives_their_accuracies_exactly(study):
    out, path, _, made = study
    (out / "cache" / "public_lm.npz").unlink()  # a fresh checkout: the public model retrained
    table = ep.main([str(path), "--out", str(out)])
    results = json.loads((out / "epochs" / "results.json").read_text())
    assert results["reproduced"] == {"nonprivate": True, "base": True, "popri-eps1": True}
    assert json.loads((out / "epochs" / "public.json").read_text())["reproduced"] is True
    for name in ("nonprivate", "base", "popri-eps1"):
        stored = json.loads((out / "epochs" / f"{name}.json").read_text())
        assert stored["rerun"] and stored["epochs"] == made[name]["epochs"]
        fixed = results["stages"][name]["fixed schedule"]
        assert fixed["test"] == made[name]["accuracy"]
        paper = results["stages"][name]["best epoch (paper)"]
        assert paper["test"] == max(r["accuracy"]["test"] for r in made[name]["epochs"])
    for report in ep.REPORTS:
        assert f"| POPri | {report} |" in table and f"| non-private | {report} |" in table


def test_a_stage_with_its_curves_is_read_not_rerun(study):
    _, _, ctx, made = study
    found = ep.curve(ctx, "popri-eps1", made["popri-eps1"])
    assert found["rerun"] is False and found["epochs"] == made["popri-eps1"]["epochs"]


def test_a_stage_without_its_texts_cannot_be_rerun(study):
    _, _, ctx, made = study
    with pytest.raises(KeyError, match="synthetic"):
        ep.stage_texts(ctx, "pe-eps1", _without_epochs(made["base"]))


def _row(epoch, validation, test):
    return {
        "epoch": epoch,
        "steps": 2 * epoch,
        "accuracy": {"validation": validation, "test": test},
    }


def test_the_three_reports_select_on_what_they_say():
    rows = [_row(1, 0.30, 0.20), _row(2, 0.10, 0.50), _row(3, 0.30, 0.10), _row(4, 0.2, 0.15)]
    chosen = ep.reports(rows)
    fixed, validation, paper = (chosen[r] for r in ep.REPORTS)
    assert (fixed["epoch"], fixed["test"]) == (4, 0.15)
    assert (validation["epoch"], validation["test"]) == (1, 0.20)  # a tie: the earlier epoch
    assert (paper["epoch"], paper["test"]) == (2, 0.50)
