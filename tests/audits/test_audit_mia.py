"""Membership-inference attacks: exact ROC metrics on hand-computed cases, the scores, the tiny
LM's log-probabilities, and canary leakage (none without the canaries, minority > random)."""

import copy

import numpy as np
import pytest
import torch
from sklearn.metrics import roc_auc_score

from fedsim.audits import canaries, lm, mia, unlearn
from fedsim.audits import dataset_inference as di


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    """Tiny models train fastest on one thread (and do not fight other tests for cores)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


# --------------------------------------------------------------------------- metrics


def test_auc_and_tpr_on_a_hand_computed_case():
    members, non = [0.9, 0.8, 0.4, 0.3], [0.7, 0.5, 0.2, 0.1]
    # Pairs won by the member: 4 + 4 + 2 + 2 of 16.
    assert mia.roc_auc(members, non) == 0.75
    # Thresholds 0.9, 0.8 catch two members before the first non-member (0.7).
    assert mia.tpr_at_fpr(members, non, 0.05) == 0.5
    assert mia.tpr_at_fpr(members, non, 0.25) == 0.5  # 0.7 adds a false positive, no member
    assert mia.tpr_at_fpr(members, non, 0.5) == 1.0  # down to 0.3: fp {0.7, 0.5}
    curve = mia.roc_curve(members, non)
    assert curve.fpr.tolist() == [0, 0, 0, 0.25, 0.5, 0.5, 0.5, 0.75, 1.0]
    assert curve.tpr.tolist() == [0, 0.25, 0.5, 0.5, 0.5, 0.75, 1.0, 1.0, 1.0]


def test_ties_count_half_and_the_curve_goes_diagonally_through_them():
    members, non = [1.0, 2.0, 3.0], [2.0, 0.0]
    # 1 beats 0; 2 ties 2 (half) and beats 0; 3 beats both: 4.5 of 6 pairs.
    assert mia.roc_auc(members, non) == 0.75
    curve = mia.roc_curve(members, non)
    assert np.trapezoid(curve.tpr, curve.fpr) == pytest.approx(0.75)
    assert mia.roc_auc([1.0, 1.0], [1.0, 1.0]) == 0.5
    assert mia.tpr_at_fpr([1.0, 1.0], [1.0, 1.0], 0.05) == 0.0  # no threshold separates them


def test_tpr_at_five_percent_fpr_allows_one_false_positive_in_twenty():
    non = np.arange(20.0)
    members = [19.5, 18.5, 10.0, 5.0]
    # score >= 18.5 flags non-member 19 only (fpr 1/20) and two members.
    assert mia.tpr_at_fpr(members, non, 0.05) == 0.5
    assert mia.tpr_at_fpr(members, non, 0.0) == 0.25


def test_auc_matches_sklearn_on_random_scores_with_ties():
    rng = np.random.default_rng(0)
    members = rng.integers(0, 8, 57).astype(float)
    non = rng.integers(0, 6, 43).astype(float)
    labels = np.r_[np.ones(57), np.zeros(43)]
    assert mia.roc_auc(members, non) == pytest.approx(roc_auc_score(labels, np.r_[members, non]))
    curve = mia.roc_curve(members, non)
    assert np.trapezoid(curve.tpr, curve.fpr) == pytest.approx(mia.roc_auc(members, non))


def test_metric_inputs_are_checked():
    with pytest.raises(ValueError, match="member_scores"):
        mia.roc_auc([], [1.0])
    with pytest.raises(ValueError, match="nonmember_scores"):
        mia.roc_auc([1.0], [np.nan])
    with pytest.raises(ValueError, match="max_fpr"):
        mia.tpr_at_fpr([1.0], [0.0], 1.5)


# --------------------------------------------------------------------------- scores


def test_min_k_keeps_the_least_likely_tokens():
    log_probs = [-1.0, -5.0, -2.0, -4.0, -3.0]
    assert mia.mink_score(log_probs, 40) == -4.5  # the two lowest: -5, -4
    assert mia.mink_score(log_probs, 20) == -5.0
    assert mia.mink_score(log_probs, 100) == mia.loss_score(log_probs) == -3.0
    assert mia.mink_score(log_probs, 1) == -5.0  # at least one token
    with pytest.raises(ValueError, match="k = 0"):
        mia.mink_score(log_probs, 0)
    with pytest.raises(ValueError, match="log-probabilities"):
        mia.loss_score([0.5])


def test_zlib_score_discounts_compressible_text():
    log_probs = [-2.0, -2.0, -2.0]
    plain = "aaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaa"
    random_text = "q8#Zk2!vPw9@Lm4$Xr7&Tn1^Bc6*Hs3(Fd0)Gj5"
    assert mia.zlib_length(plain) < mia.zlib_length(random_text)
    # Equal likelihood: the text a compressor finds easy looks less like a member.
    assert mia.zlib_score(log_probs, plain) < mia.zlib_score(log_probs, random_text) < 0
    scores = mia.sequence_scores("zlib", [log_probs, log_probs], [plain, random_text])
    assert scores[0] < scores[1]
    with pytest.raises(ValueError, match="texts"):
        mia.sequence_scores("zlib", [log_probs], None)
    with pytest.raises(ValueError, match="attack"):
        mia.sequence_scores("ratio", [log_probs])


# --------------------------------------------------------------------------- the tiny LM


@pytest.mark.parametrize("arch", ["gpt2", "llama"])
def test_token_log_probs_are_per_byte_and_unaffected_by_padding(arch):
    model = lm.build_lm(lm.TinyLMConfig(arch=arch, width=16, heads=2, max_len=64), seed=0)
    texts = ["short", "a longer line of text, ünïcode"]
    together = lm.token_log_probs(model, texts)
    alone = [lm.token_log_probs(model, [t])[0] for t in texts]
    for t, a, b in zip(texts, together, alone, strict=True):
        assert len(a) == len(t.encode("utf-8")) + 1  # every byte, then EOS
        assert np.all(a < 0)
        np.testing.assert_allclose(a, b, atol=1e-5)
    assert lm.decode(lm.encode("ünïcode", 64)) == "ünïcode"


def test_federated_training_lowers_the_loss_and_repeats_itself():
    rng = np.random.default_rng(1)
    corpus = canaries.base_corpus(2, 8, rng)
    losses = []
    for _ in range(2):
        model = lm.build_lm(lm.TinyLMConfig(width=16, heads=2, max_len=128), seed=3)
        losses.append(
            lm.federated_train(model, corpus, rounds=3, local_steps=4, batch_size=8, seed=5)
        )
    assert losses[0] == losses[1]
    assert losses[0][-1] < losses[0][0]


# --------------------------------------------------------------------------- canaries


def test_canary_records_and_insertion():
    rng = np.random.default_rng(0)
    minority = canaries.minority_records(30, rng)
    assert {r.origin for r in minority} == {canaries.rarest("origin")} == {"hawaiian"}
    assert {r.phone_format for r in minority} == {"iceland"}
    assert len({r.name for r in minority}) == 30  # rare names are (nearly always) unique
    population = canaries.sample_records(400, np.random.default_rng(1))
    assert sum(r.origin == "english" for r in population) > 150
    assert sum(r.origin == "hawaiian" for r in population) < 10
    again = canaries.sample_records(400, np.random.default_rng(1))
    assert [r.text() for r in again] == [r.text() for r in population]
    texts = canaries.insert_canaries([["a"], ["b"], ["c"]], ["X", "Y", "Z"], [0, 2], 3, rng)
    assert sorted(texts[0]) == ["X"] * 3 + ["Z"] * 3 + ["a"]
    assert texts[1] == ["b"] and sorted(texts[2]) == ["Y"] * 3 + ["c"]
    with pytest.raises(ValueError, match="clients"):
        canaries.insert_canaries([["a"]], ["X"], [3], 1, rng)
    with pytest.raises(ValueError, match="forced"):
        canaries.sample_record(rng, {"origin": "martian"})


@pytest.fixture(scope="module")
def canary_study():
    """One federation trained twice (with and without canaries), seeded and small: 2 clients
    with 30 PII records each, 20 minority + 20 random canaries repeated 3 times, 40 unseen
    canaries of each kind as non-members."""
    rng = np.random.default_rng(9)
    corpus = canaries.base_corpus(2, 30, rng)
    minority = [r.text() for r in canaries.minority_records(60, rng)]
    random_ = [r.text() for r in canaries.sample_records(60, rng)]
    sets = {"minority": (minority[:20], minority[20:]), "random": (random_[:20], random_[20:])}
    inserted = canaries.insert_canaries(corpus, minority[:20] + random_[:20], [0, 1], 3, rng)
    results = {"sets": sets}
    for name, texts in (("with", inserted), ("without", corpus)):
        model = lm.build_lm(lm.TinyLMConfig(width=32, heads=4, max_len=128), seed=0)
        lm.federated_train(model, texts, rounds=4, local_steps=40, batch_size=16, lr=5e-3, seed=0)
        results[name] = model
        for kind, (members, non) in sets.items():
            lp_in, lp_out = lm.token_log_probs(model, members), lm.token_log_probs(model, non)
            results[name, kind] = {
                "auc": {
                    a: mia.roc_auc(
                        mia.sequence_scores(a, lp_in, members),
                        mia.sequence_scores(a, lp_out, non),
                    )
                    for a in mia.ATTACKS
                },
                "gap": float(
                    np.mean([-x.mean() for x in lp_out]) - np.mean([-x.mean() for x in lp_in])
                ),
            }
    return results


def test_canaries_leak_only_when_trained_on(canary_study):
    for kind in ("minority", "random"):
        with_, without = canary_study["with", kind], canary_study["without", kind]
        for attack in mia.ATTACKS:
            assert with_["auc"][attack] > 0.85, (kind, attack, with_)
            # 20 vs 40 scores: the AUC's standard deviation under no leak is about 0.08.
            assert abs(without["auc"][attack] - 0.5) < 0.15, (kind, attack, without)


def test_minority_canaries_leak_more_than_random_ones(canary_study):
    minority, random_ = canary_study["with", "minority"], canary_study["with", "random"]
    for attack in mia.ATTACKS:
        assert minority["auc"][attack] > random_["auc"][attack], (attack, minority, random_)
    # Members' mean NLL drops further below the non-members' for rare PII.
    assert minority["gap"] > 1.2 * random_["gap"] > 0, (minority, random_)


def test_dataset_inference_on_the_canary_federation(canary_study):
    """Post-hoc dataset inference: the 40 inserted canaries as the suspect set give a small
    p-value, 40 unseen ones of the same kinds do not (digit-perturbed synthetic held-out)."""
    sets = canary_study["sets"]
    members = sets["minority"][0] + sets["random"][0]
    fresh = sets["minority"][1][:20] + sets["random"][1][:20]
    model = canary_study["with"]
    member = di.run_dataset_inference(model, members, np.random.default_rng(0), splits=5)
    unseen = di.run_dataset_inference(model, fresh, np.random.default_rng(0), splits=5)
    assert member.p_value < 0.02, member
    assert unseen.p_value > 0.05, unseen


@pytest.mark.parametrize("method", ["gradient_ascent", "ascent_descent", "random_label"])
def test_unlearning_lowers_the_canaries_leak(canary_study, method):
    sets = canary_study["sets"]
    forget = sets["minority"][0] + sets["random"][0]
    unseen = sets["minority"][1] + sets["random"][1]
    model = copy.deepcopy(canary_study["with"])
    retain = canaries.base_corpus(2, 10, np.random.default_rng(1))
    retain = [t for client in retain for t in client]

    def auc():
        lp_in, lp_out = lm.token_log_probs(model, forget), lm.token_log_probs(model, unseen)
        return mia.roc_auc(mia.sequence_scores("loss", lp_in), mia.sequence_scores("loss", lp_out))

    before = auc()
    losses = unlearn.unlearn(
        model,
        forget,
        method=method,
        steps=30,
        lr=1e-3,
        retain=retain,
        generator=torch.Generator().manual_seed(0),
    )
    assert losses[-1] > losses[0]  # the forget loss rises
    assert auc() < before - 0.1, (before, auc())
    # With a target (the loss on unseen canaries) it stops as soon as the forget set is there.
    stopped = copy.deepcopy(canary_study["with"])
    target = float(lm.mean_loss(stopped, unseen).detach())
    history = unlearn.unlearn(
        stopped,
        forget,
        method=method,
        steps=200,
        lr=1e-3,
        retain=retain,
        stop_at_loss=target,
        generator=torch.Generator().manual_seed(0),
    )
    assert len(history) < 200 and float(lm.mean_loss(stopped, forget).detach()) >= target
    with pytest.raises(ValueError, match="retain"):
        unlearn.unlearn(
            model, forget, method="ascent_descent", steps=1, generator=torch.Generator()
        )
    with pytest.raises(ValueError, match="method"):
        unlearn.unlearn(model, forget, method="scrub", steps=1, generator=torch.Generator())
