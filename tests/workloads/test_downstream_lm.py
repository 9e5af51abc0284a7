"""Downstream LM evaluation: compact vocabulary, hand-counted accuracy, training, DP-FedAvg LM."""

import random

import numpy as np
import pytest
import torch
from flwr.serverapp.strategy import FedAvg
from torch import nn

from fedsim.engine.rounds import run_rounds
from fedsim.randomness import RunSecret
from fedsim.record_codec import to_numpy, to_record
from fedsim.workloads.downstream_lm import (
    BOS,
    UNK,
    LMSpec,
    LMTraining,
    Vocabulary,
    batch,
    lm_arrays,
    load_lm_arrays,
    next_token_accuracy,
    to_sequences,
    tokenize,
    torch_generator,
    train_and_evaluate,
    train_lm,
)
from fedsim.workloads.lm_client import make_lm_client_app
from fedsim.workloads.text_models import tiny_tokenizer
from strategies.methods.dp_fedavg.strategy import DPFedAvg


class BigramTable(nn.Module):
    """Logits depend only on the current token: ``table[input_ids]``."""

    def __init__(self, table):
        super().__init__()
        self.table = nn.Parameter(torch.as_tensor(table, dtype=torch.float32))

    def forward(self, input_ids, attention_mask=None):
        return self.table[input_ids]


def test_vocabulary_ranks_by_frequency_and_maps_the_rest_to_unk():
    vocab = Vocabulary.from_sequences([[7, 7, 9, 3], [9, 7, 5]], size=4)
    assert vocab.token_ids == (7, 9)  # 3 and 5 tie below the cut
    assert vocab.size == 4
    np.testing.assert_array_equal(vocab.encode([9, 7, 3, 11]), [3, 2, UNK, UNK])
    assert vocab.coverage([[7, 9, 3, 5]]) == 0.5
    with pytest.raises(ValueError, match="size"):
        Vocabulary.from_sequences([[1]], size=2)
    with pytest.raises(ValueError, match="duplicates"):
        Vocabulary([4, 4])


def test_tokenize_and_sequences_start_with_bos_and_are_cut():
    tokenizer = tiny_tokenizer()
    ids = tokenize(tokenizer, ["abcd", "", "ba"], max_tokens=3)
    assert [len(i) for i in ids] == [3, 0, 2]
    vocab = Vocabulary.from_sequences(ids, size=10)
    sequences = to_sequences(ids, vocab, max_tokens=2)
    assert len(sequences) == 2  # the empty text has nothing to predict
    assert [s[0] for s in sequences] == [BOS, BOS]
    np.testing.assert_array_equal(sequences[1][1:], vocab.encode(ids[2][:2]))
    with pytest.raises(ValueError, match="texts"):
        tokenize(tokenizer, ["ok", 3])


def test_accuracy_matches_a_hand_count():
    # argmax per current token: <bos> -> 2, 2 -> 3, 3 -> <unk>, 4 -> 4
    table = np.full((5, 5), -1.0)
    table[BOS, 2] = table[2, 3] = table[3, UNK] = table[4, 4] = 1.0
    model = BigramTable(table)
    sequences = [np.array([BOS, 2, 3, 2]), np.array([BOS, 3, UNK]), np.array([BOS, 4, 4])]
    # predictions: 2 ok, 3 ok, 2 (pred unk) miss | 3 (pred 2) miss, unk (pred unk) miss by rule
    #              | 4 (pred 2) miss, 4 (pred 4) ok  -> 3 correct of 7, one OOV target
    for size in (1, 2, 64):
        result = next_token_accuracy(model, sequences, batch_size=size)
        assert (result.correct, result.predictions, result.oov_targets) == (3, 7, 1)
        assert result.accuracy == pytest.approx(3 / 7)


def test_batch_shifts_labels_and_masks_padding():
    ids, mask, labels = batch([np.array([BOS, 5, 6]), np.array([BOS, 7])])
    assert ids.tolist() == [[BOS, 5, 6], [BOS, 7, UNK]]
    assert mask.tolist() == [[1, 1, 1], [1, 1, 0]]
    assert labels.tolist() == [[5, 6, -100], [7, -100, -100]]


def tiny_spec(vocab_size=12):
    return LMSpec(vocab_size=vocab_size, hidden=16, layers=1, heads=2, max_positions=40)


def test_training_on_a_repeated_text_raises_accuracy():
    pattern = np.array([BOS] + [2 + (i % 9) for i in range(30)])
    sequences = [pattern] * 8
    spec = tiny_spec()
    model = spec.build(seed=0)
    before = next_token_accuracy(model, sequences).accuracy
    losses = train_lm(
        model, sequences, LMTraining(epochs=40, batch_size=4, lr=1e-2), torch_generator(0)
    )
    after = next_token_accuracy(model, sequences)
    assert losses[-1] < 0.5 * losses[0]
    assert after.accuracy > 0.9 > before + 0.5
    assert after.predictions == 8 * 30


def test_train_and_evaluate_is_seeded_and_arrays_round_trip():
    sequences = [np.array([BOS, 2, 3, 4, 5, 3]), np.array([BOS, 4, 5, 6, 2])]
    spec, training = tiny_spec(), LMTraining(epochs=2, batch_size=1, lr=5e-3)
    first = train_and_evaluate(sequences, sequences, spec, training, seed=3)
    second = train_and_evaluate(sequences, sequences, spec, training, seed=3)
    assert first[0] == second[0] and first[2] == second[2]
    for key, value in first[1].items():
        np.testing.assert_array_equal(value, second[1][key])
    # tied input/output embeddings appear once
    assert sum("embed_tokens" in k or "lm_head" in k for k in first[1]) == 1
    model = spec.build(seed=9)
    load_lm_arrays(model, first[1])
    assert next_token_accuracy(model, sequences) == first[0]
    with pytest.raises(ValueError, match="differing keys"):
        load_lm_arrays(model, {"nope": np.zeros(1)})


def test_bad_settings_raise_naming_the_key():
    with pytest.raises(ValueError, match="heads"):
        LMSpec(vocab_size=10, hidden=10, heads=4)
    with pytest.raises(ValueError, match="lr"):
        LMTraining(lr=0)
    with pytest.raises(ValueError, match="sequences"):
        train_lm(tiny_spec().build(0), [], LMTraining(), torch_generator(0))


def federated_run(engine, rounds=2):
    spec = tiny_spec()
    rng = np.random.default_rng(0)
    clients = [
        [
            np.concatenate([[BOS], rng.integers(2, 12, size=int(rng.integers(4, 9)))])
            for _ in range(3)
        ]
        for _ in range(4)
    ]
    training = LMTraining(epochs=1, batch_size=2, lr=1e-2)
    app = make_lm_client_app(spec, clients, training, seed=5)
    random.seed(0)
    grid = engine.open_run(app, 4, raise_errors=True)
    strategy = DPFedAvg(
        FedAvg(fraction_evaluate=0.0, min_available_nodes=0),
        clipping_norm=0.5,
        noise_multiplier=0.8,
        expected_clients=4,
    )
    strategy.bind_server_secret(RunSecret.from_passphrase("lm").server())
    start = lm_arrays(spec.build(seed=5))
    final = run_rounds(strategy, grid, to_record(start), rounds)
    return start, to_numpy(final), strategy


@pytest.mark.ray
def test_dp_fedavg_trains_the_lm_on_the_ray_engine(ray_engine, local_engine):
    start, on_ray, strategy = federated_run(ray_engine)
    assert len(strategy.ledger) == 2 and 0 < strategy.epsilon() < np.inf
    moved = np.sqrt(sum(float(((on_ray[k] - start[k]) ** 2).sum()) for k in start))
    assert moved > 0 and all(np.all(np.isfinite(v)) for v in on_ray.values())
    _, in_process, _ = federated_run(local_engine)
    for key, value in on_ray.items():  # same seeds, same result on either backend
        np.testing.assert_allclose(value, in_process[key], rtol=1e-5, atol=1e-6)
