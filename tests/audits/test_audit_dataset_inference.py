"""Post-hoc dataset inference: synthetic held-out generators and the calibrated test on given
features (small p for a membership shift, not for none)."""

import numpy as np
import pytest
import torch

from fedsim.audits import dataset_inference as di


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def test_perturbation_resamples_only_the_chosen_class():
    rng = np.random.default_rng(0)
    texts = ["Call 555-0123 now, Ana!"] * 50
    out = di.perturb_characters(texts, rng)
    for t in out:
        assert [c for c in t if not c.isdigit()] == [c for c in texts[0] if not c.isdigit()]
        assert sum(c.isdigit() for c in t) == 7
    assert len(set(out)) > 45  # 10^7 digit strings
    letters = di.perturb_characters(texts, rng, rate=1.0, classes=("lower",))
    for t in letters:  # capitals, digits and punctuation kept
        assert (t[0], t[5:13], t[-4], t[-1]) == ("C", "555-0123", "A", "!")
    with pytest.raises(ValueError, match="classes"):
        di.perturb_characters(texts, rng, classes=("emoji",))
    with pytest.raises(ValueError, match="rate"):
        di.perturb_characters(texts, rng, rate=0.0)


def test_markov_completion_keeps_the_prefix_and_follows_the_fitted_text():
    rng = np.random.default_rng(1)
    texts = ["abcabcabcabcabcabc", "abcabcabcabc"]
    out = di.markov_completions(texts, rng, order=2, prefix_fraction=0.5)
    for t, o in zip(texts, out, strict=True):
        assert o.startswith(t[: len(t) // 2])
        assert set(o) <= set("abc")
        assert "aa" not in o and "ba" not in o  # never seen transitions
    assert di.markov_completions(texts, np.random.default_rng(1), 2, 0.5) == out


def _features(rng, n, shift):
    return rng.normal(size=(n, 3)) + shift


def test_calibrated_test_needs_a_membership_shift_beyond_the_text_shift():
    rng = np.random.default_rng(2)
    n = 120
    suspect = [f"record {i} value {rng.integers(10**6)}" for i in range(n)]
    synthetic = di.perturb_characters(suspect, rng)
    # Members: their MIA features are higher than their synthetic copies'.
    member = di.dataset_inference(
        suspect, synthetic, _features(rng, n, 0.8), _features(rng, n, 0.0), rng, splits=5
    )
    non = di.dataset_inference(
        suspect, synthetic, _features(rng, n, 0.0), _features(rng, n, 0.0), rng, splits=5
    )
    assert member.p_value < 1e-3, member
    assert non.p_value > 0.05, non
    assert np.mean(member.auc_combined) > 0.65 > np.mean(non.auc_combined) - 0.1
    with pytest.raises(ValueError, match="paired"):
        di.dataset_inference(
            suspect[:-1], synthetic, _features(rng, n, 0), _features(rng, n, 0), rng
        )


# The end-to-end check on a trained tiny LM reuses the canary federation of test_audit_mia.py
# (test_dataset_inference_on_the_canary_federation).
