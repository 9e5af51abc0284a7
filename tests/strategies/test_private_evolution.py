"""Private Evolution: the DP nearest-neighbour histogram, its accounting and its selection."""

import numpy as np
import pytest
from dp_accounting import GaussianDpEvent, SelfComposedDpEvent
from dp_accounting.rdp import RdpAccountant
from flwr.app import Context, Message, MetricRecord, RecordDict
from flwr.clientapp import ClientApp

from fedsim.engine.rounds import run_rounds
from fedsim.privacy.calibration import calibrate_noise
from fedsim.privacy.sampling import FullParticipation
from fedsim.randomness import RunSecret
from fedsim.record_codec import to_record
from fedsim.workloads.pe_votes import (
    VOTES,
    cached_text_embeddings,
    make_vote_client_app,
    nearest_candidates,
    nearest_neighbour_votes,
)
from fedsim.workloads.text_models import tiny_embedder
from strategies.methods.private_evolution.strategy import (
    PEConfig,
    PrivateEvolution,
    clip_votes,
    example_weights,
    select_survivors,
)

NAMES = [f"c{i}" for i in range(8)]


class LookupEmbedder:
    """Text ``c<i>`` -> the i-th unit vector of R^8 (a known geometry)."""

    def encode(self, texts):
        out = np.zeros((len(texts), 8), dtype=np.float32)
        for row, text in enumerate(texts):
            out[row, int(text[1:])] = 1.0
        return out


def copy_first_example(example_lists, samples_per_prompt, seed):
    """A stand-in generator: every sample repeats the prompt's first example."""
    return [[examples[0]] * samples_per_prompt for examples in example_lists]


def test_votes_count_nearest_candidates_and_have_unit_norm():
    candidates = np.eye(4)
    points = np.array([[0.9, 0.1, 0, 0], [0, 0, 1.0, 0.2], [1.0, 0, 0, 0.1]])
    np.testing.assert_array_equal(nearest_candidates(points, candidates), [0, 2, 0])
    votes = nearest_neighbour_votes(points, candidates)
    np.testing.assert_allclose(votes, np.array([2, 0, 1, 0]) / np.sqrt(5))
    assert nearest_neighbour_votes(np.zeros((0, 4)), candidates).tolist() == [0, 0, 0, 0]
    with pytest.raises(ValueError, match="columns"):
        nearest_candidates(points, np.eye(3))


def test_one_client_moves_the_sum_by_at_most_one():
    """Add/remove sensitivity of the clipped sum is 1 for any client, honest or not."""
    rng = np.random.default_rng(0)
    candidates = rng.normal(size=(30, 5))
    clients = [rng.normal(size=(int(rng.integers(1, 40)), 5)) for _ in range(20)]
    votes = [clip_votes(nearest_neighbour_votes(c, candidates)) for c in clients]
    votes.append(clip_votes(np.full(30, 7.0)))  # a client sending far too much
    total = np.sum(votes, axis=0)
    for v in votes:
        assert np.linalg.norm(total - (total - v)) <= 1.0 + 1e-12
    assert np.linalg.norm(votes[-1]) == pytest.approx(1.0)


def test_selection_keeps_the_best_voted_above_the_threshold():
    noisy = np.array([0.5, 3.0, -1.0, 2.5, 3.0, 0.1])
    np.testing.assert_array_equal(select_survivors(noisy, 3, 1.0), [1, 4, 3])
    np.testing.assert_array_equal(select_survivors(noisy, 5, 2.0), [1, 4, 3])
    np.testing.assert_array_equal(select_survivors(noisy, 2, 10.0), [1, 4])  # none above
    weights = example_weights(noisy, np.array([1, 4, 3]), 2.0)
    np.testing.assert_allclose(weights, [0.4, 0.4, 0.2])


def local_run(engine, strategy, client_texts, rounds, app=None):
    app = app or make_vote_client_app(cached_text_embeddings(client_texts, LookupEmbedder))
    grid = engine.open_run(app, len(client_texts), raise_errors=True)
    return run_rounds(strategy, grid, strategy.initial_arrays(), rounds)


def test_pe_keeps_the_candidates_the_clients_hold(local_engine):
    # 30 clients: most texts sit on candidates 2 and 5, a few on 6
    client_texts = [["c2"] * 3 + ["c5"] for _ in range(20)] + [["c5", "c6"] for _ in range(10)]
    seen = []

    def vary(example_lists, samples_per_prompt, seed):
        seen.extend(example_lists)
        return copy_first_example(example_lists, samples_per_prompt, seed)

    config = PEConfig(
        num_prompts=4, samples_per_prompt=2, keep=2, threshold=2.0, noise_multiplier=1.0
    )
    strategy = PrivateEvolution(NAMES, LookupEmbedder(), vary, config, np.random.default_rng(3))
    local_run(local_engine, strategy, client_texts, rounds=1)
    first = strategy.history[0]
    assert first.clients == 30
    assert first.survivors == ["c2", "c5"]  # best first; c6 has fewer votes
    assert all(e in ("c2", "c5") for examples in seen for e in examples)
    assert len(strategy.population) == 8 and set(strategy.population) <= {"c2", "c5"}


def test_noise_std_and_epsilon_match_the_ledger(local_engine):
    z = calibrate_noise(4.0, 1e-5, FullParticipation(), rounds=3)
    names = [f"c{i % 8}" for i in range(4000)]
    config = PEConfig(
        num_prompts=2, samples_per_prompt=2, noise_multiplier=z, delta=1e-5, threshold=0.0
    )
    strategy = PrivateEvolution(
        names, LookupEmbedder(), copy_first_example, config, np.random.default_rng(7)
    )
    silent = ClientApp()

    @silent.train()
    def no_text(message: Message, context: Context) -> Message:  # a client with no text
        content = RecordDict(
            {VOTES: to_record({VOTES: np.zeros(4000)}), "metrics": MetricRecord({})}
        )
        return Message(content=content, reply_to=message)

    local_run(local_engine, strategy, [[]] * 3, rounds=1, app=silent)
    noise = strategy.history[0].noisy_votes  # nobody voted: pure noise
    assert abs(noise.std() / z - 1) < 0.05 and abs(noise.mean()) < 4 * z / np.sqrt(4000)
    # three rounds of the same Gaussian, accounted independently of the ledger
    for r in (2, 3):
        strategy.ledger.record(r, strategy.round_event())
    reference = RdpAccountant().compose(SelfComposedDpEvent(GaussianDpEvent(z), 3))
    assert strategy.epsilon() == pytest.approx(reference.get_epsilon(1e-5), rel=1e-9)
    assert 3.9 < strategy.epsilon() <= 4.0


def test_pe_on_the_engine_with_a_tiny_embedder_and_bad_inputs(local_engine):
    embedder = tiny_embedder(0, dimension=16)
    client_texts = [["alpha beta", "gamma"], ["beta delta", "alpha"], ["epsilon zeta"]]
    population = ["alpha", "beta gamma", "delta", "zeta epsilon", "omega"]

    def vary(example_lists, samples_per_prompt, seed):
        rng = np.random.default_rng(seed)
        return [
            [f"{examples[0]} {rng.integers(100)}" for _ in range(samples_per_prompt)]
            for examples in example_lists
        ]

    config = PEConfig(num_prompts=3, samples_per_prompt=2, noise_multiplier=0.5)

    def run(seed):
        strategy = PrivateEvolution(population, embedder, vary, config, np.random.default_rng(seed))
        strategy.bind_server_secret(RunSecret.from_passphrase("pe").server())
        app = make_vote_client_app(
            cached_text_embeddings(client_texts, lambda: tiny_embedder(0, dimension=16))
        )
        local_run(local_engine, strategy, client_texts, rounds=2, app=app)
        return strategy

    first, second = run(1), run(1)
    assert [h.clients for h in first.history] == [3, 3] and len(first.ledger) == 2
    assert len(first.population) == 6 and first.population == second.population
    assert first.synthesize(5) == second.synthesize(5)
    assert 0 < first.epsilon() < np.inf
    with pytest.raises(ValueError, match="keep"):
        PEConfig(num_prompts=2, samples_per_prompt=2, noise_multiplier=1.0, keep=-1)
    with pytest.raises(ValueError, match="embeddings"):
        list(first.configure_train(3, to_record({"embeddings": np.zeros((2, 16))}), {}, None))
    with pytest.raises(RuntimeError, match="round"):
        PrivateEvolution(population, embedder, vary, config, np.random.default_rng(0)).synthesize(1)
