"""DPO with LoRA on a tiny LLaMA: the loss by hand, the direction of an update, the adapter."""

import math

import pytest
import torch

from fedsim.config import ConfigError
from fedsim.workloads.dpo import (
    DPOSettings,
    PreferencePair,
    add_lora,
    dpo_loss,
    pair_logprobs,
    reference_logprobs,
    sequence_logprobs,
    train_dpo,
)
from fedsim.workloads.text_models import tiny_generator

PAIRS = [
    PreferencePair("List: Sample 1:", "a tidy one.", "zq"),
    PreferencePair("Sample 4:", "fit it", "x"),
]


def policy(seed=0, rank=4, perturb=True):
    model, tokenizer = tiny_generator(seed, hidden_size=32, layers=2)
    settings = DPOSettings(lora_rank=rank, lora_alpha=8.0, batch_size=2, lr=5e-3, beta=0.5)
    peft_model = add_lora(model, settings, seed=seed)
    if perturb:  # B = 0 at creation; give the adapter a non-zero delta
        gen = torch.Generator().manual_seed(seed + 1)
        with torch.no_grad():
            for name, param in peft_model.named_parameters():
                if "lora_B" in name:
                    param.copy_(0.2 * torch.randn(param.shape, generator=gen))
    return peft_model, tokenizer, settings


def logprob_by_hand(model, tokenizer, prompt, completion):
    """sum_t log p(y_t | x, y_<t), one full forward pass per completion token."""
    context = tokenizer(prompt, add_special_tokens=False)["input_ids"]
    target = tokenizer(" " + completion, add_special_tokens=False)["input_ids"]
    total = 0.0
    with torch.no_grad():
        for token in target:
            logits = model(input_ids=torch.tensor([context])).logits[0, -1].double()
            total += float(logits[token] - torch.logsumexp(logits, dim=0))
            context = [*context, token]
    return total


def test_dpo_loss_equals_a_hand_computed_value_on_a_tiny_model():
    model, tokenizer, settings = policy()
    beta = settings.beta
    expected_terms = []
    for pair in PAIRS:
        pol_w = logprob_by_hand(model, tokenizer, pair.prompt, pair.chosen)
        pol_l = logprob_by_hand(model, tokenizer, pair.prompt, pair.rejected)
        with model.disable_adapter():
            ref_w = logprob_by_hand(model, tokenizer, pair.prompt, pair.chosen)
            ref_l = logprob_by_hand(model, tokenizer, pair.prompt, pair.rejected)
        assert abs(pol_w - ref_w) > 1e-3  # the adapter does change the policy
        margin = beta * ((pol_w - ref_w) - (pol_l - ref_l))
        expected_terms.append(-math.log(1.0 / (1.0 + math.exp(-margin))))
    expected = sum(expected_terms) / len(expected_terms)

    chosen, rejected = pair_logprobs(model, tokenizer, PAIRS)  # batched, padded
    ref_chosen, ref_rejected = reference_logprobs(model, tokenizer, PAIRS)
    loss, margins = dpo_loss(chosen, rejected, ref_chosen, ref_rejected, beta)
    assert float(loss.detach()) == pytest.approx(expected, abs=1e-5)
    assert margins.shape == (2,)
    single = sequence_logprobs(model, tokenizer, [PAIRS[1].prompt], [PAIRS[1].chosen])
    assert float(single[0].detach()) == pytest.approx(
        float(chosen[1].detach()), abs=1e-4
    )  # padding-invariant


def test_dpo_on_a_toy_preference_raises_the_chosen_log_ratio_over_the_rejected():
    model, tokenizer, settings = policy(seed=3, perturb=False)
    pair = [PreferencePair("Original Sample 1: ok.\nSample 2:", "fit the model.", "qq zz xx")]
    ref_w, ref_l = reference_logprobs(model, tokenizer, pair)
    with torch.no_grad():
        pol_w, pol_l = pair_logprobs(model, tokenizer, pair)
    assert torch.allclose(pol_w, ref_w) and torch.allclose(pol_l, ref_l)  # B = 0: policy = base
    first = train_dpo(model, tokenizer, pair, settings, seed=0)
    assert first["dpo_loss"] == pytest.approx(math.log(2.0), abs=1e-5)
    for round_seed in range(1, 6):  # the adapter carries over between calls (rounds)
        train_dpo(model, tokenizer, pair, settings, seed=round_seed)
    with torch.no_grad():
        pol_w, pol_l = pair_logprobs(model, tokenizer, pair)
    ratio_w, ratio_l = float(pol_w - ref_w), float(pol_l - ref_l)
    assert ratio_w - ratio_l > 0.5
    last = train_dpo(model, tokenizer, pair, settings, seed=9)
    assert last["dpo_loss"] < math.log(2.0) and last["dpo_reward_accuracy"] == 1.0
    # the base weights are untouched: the reference is what it was
    assert torch.allclose(reference_logprobs(model, tokenizer, pair)[0], ref_w)


def test_train_dpo_is_reproducible_and_only_trains_the_adapter():
    runs = []
    for _ in range(2):
        model, tokenizer, settings = policy(seed=5)
        base = {n: p.detach().clone() for n, p in model.named_parameters() if "lora" not in n}
        metrics = train_dpo(model, tokenizer, PAIRS * 2, settings, seed=7)
        assert metrics["dpo_steps"] == 2.0
        for name, param in model.named_parameters():
            if "lora" not in name:
                assert torch.equal(param, base[name])
        runs.append({n: p.detach().clone() for n, p in model.named_parameters() if "lora" in n})
    assert runs[0].keys() and all(torch.equal(runs[0][k], runs[1][k]) for k in runs[0])


def test_dpo_settings_and_inputs_are_checked():
    with pytest.raises(ConfigError, match="dpo.beta"):
        DPOSettings(beta=0.0)
    with pytest.raises(ConfigError, match="dpo.lora_rank"):
        DPOSettings(lora_rank=0)
    with pytest.raises(ValueError, match="beta"):
        dpo_loss(torch.zeros(1), torch.zeros(1), torch.zeros(1), torch.zeros(1), beta=-1.0)
    model, tokenizer, settings = policy(perturb=False)
    with pytest.raises(ConfigError, match="pairs"):
        train_dpo(model, tokenizer, [], settings, seed=0)
    with pytest.raises(ValueError, match="completions"):
        sequence_logprobs(model, tokenizer, ["a", "b"], ["c"])
