"""DDGauss as a Flower strategy: full mode (SecAgg+ as message exchanges) and committee mode
(clients share and seal to a committee) equal plaintext mode bit for bit, dropouts cost
epsilon, aborted rounds release nothing, and it runs under Flower's own runtime."""

import json
import math
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
from ddgauss_support import RUN
from flwr.serverapp.strategy import FedAvg

from fedsim.config import ConfigError
from fedsim.data import DatasetSpec, build_dataset
from fedsim.engine import FaultConfig
from fedsim.engine.client_registry import NODE_ID_OFFSET
from fedsim.engine.committee import Committee, CommitteeSpec
from fedsim.engine.rounds import run_rounds
from fedsim.models import ModelSpec, initial_arrays
from fedsim.privacy import ddgauss as ddgauss_privacy
from fedsim.privacy.mechanisms import discrete_gaussian
from fedsim.randomness import RunSecret
from fedsim.record_codec import to_numpy, to_record
from fedsim.workloads.supervised import LocalTraining, make_client_app
from protocols.field import DEFAULT_FIELD
from protocols.kit import TooManyDropoutsError
from protocols.secagg.common import Stage
from protocols.secagg.prg import MaskPRG
from strategies.methods.ddgauss.client import ddgauss_client_app
from strategies.methods.ddgauss.spec import from_options
from strategies.methods.ddgauss.strategy import DDGauss

CLIENTS, ROUNDS = 30, 3
ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def digits():
    data = DatasetSpec(source="digits", partition="iid", num_clients=CLIENTS, seed=0)
    dataset = build_dataset(data)
    model = ModelSpec(
        kind="logreg", input_shape=tuple(dataset.feature_shape), num_classes=dataset.num_classes
    )
    inner = make_client_app(model, data, LocalTraining(epochs=1, batch_size=16, lr=0.1, seed=0))
    return data, dataset, model, ddgauss_client_app(inner)


def run(engine, digits, client_secrets, mode, dropout=0.0, committee=None, **options):
    data, dataset, model, app = digits
    strategy = DDGauss(
        FedAvg(min_available_nodes=0, fraction_evaluate=0.0),
        clipping_norm=1.0,
        noise_multiplier=options.pop("noise_multiplier", 1.0),
        expected_clients=CLIENTS,
        seed=7,
        mode=mode,
        committee=committee,
        **options,
    )
    grid = engine.open_run(
        client_secrets(app),
        CLIENTS,
        run_config={"seed": 0},
        faults=FaultConfig(dropout=dropout, seed=3),
        datasets=((data, dataset),),
    )
    sums, survivors = [], []

    def on_round(outcome):
        sums.append(None if strategy.last_sum is None else strategy.last_sum.copy())
        survivors.append(strategy.last_survivors)

    initial = to_record(initial_arrays(model, 0))
    final = run_rounds(strategy, grid, initial, ROUNDS, on_round=on_round)
    grid.wait_idle()
    return strategy, to_numpy(final), sums, survivors


def test_full_mode_equals_plaintext_bit_for_bit_under_protocol_dropouts(
    local_engine, digits, client_secrets
):
    """The clients' secrets fix their rounding and noise, so SecAgg+ over messages (in the ring
    Z_2^32) and the plaintext sum give the same integers; dropouts inside SecAgg+ leave out
    exactly the clients lost before MASKED_INPUT."""
    options = dict(protocol_dropout=0.3)
    full, final_full, sums_full, survivors_full = run(
        local_engine, digits, client_secrets, "full", ring_bits=32, **options
    )
    plain, final_plain, sums_plain, survivors_plain = run(
        local_engine, digits, client_secrets, "plaintext", **options
    )
    assert survivors_full == survivors_plain
    assert any(len(s) < CLIENTS for s in survivors_full)  # some clients dropped inside SecAgg+
    nodes = [NODE_ID_OFFSET + p for p in range(CLIENTS)]
    for server_round, (a, b, kept) in enumerate(zip(sums_full, sums_plain, survivors_full), 1):
        np.testing.assert_array_equal(a, b)
        lost = full.protocol_dropouts(server_round, nodes)
        before_input = set().union(*(lost.get(s, set()) for s in list(Stage)[1:4]))
        assert set(kept) == set(nodes) - before_input
    for key in final_full:
        np.testing.assert_array_equal(final_full[key], final_plain[key])
    assert full.epsilon() == plain.epsilon() > 0
    assert full.privacy_report()["mode"] == "full"
    assert plain.privacy_report()["mode"] == "plaintext"


def test_full_mode_with_the_aes_prg_equals_plaintext(local_engine, digits, client_secrets):
    """``prg = "aes-ctr"`` masks with AES-256-CTR (the config the clients get says so); the
    masks cancel, so the sums are plaintext's to the bit."""
    full, final_full, sums_full, _ = run(
        local_engine, digits, client_secrets, "full", ring_bits=32, prg="aes-ctr"
    )
    _, final_plain, sums_plain, _ = run(local_engine, digits, client_secrets, "plaintext")
    assert full.secagg_config(1, CLIENTS, 8).prg is MaskPRG.AES_CTR
    for a, b in zip(sums_full, sums_plain, strict=True):
        np.testing.assert_array_equal(a, b)
    for key in final_full:
        np.testing.assert_array_equal(final_full[key], final_plain[key])


def test_dropouts_at_every_exchange_cost_epsilon_for_the_noise_present(
    local_engine, digits, client_secrets
):
    """With the engine's faults each exchange loses clients; epsilon is that of the survivors'
    noise, round by round, never the planned cohort's."""
    lossy, _, _, survivors = run(local_engine, digits, client_secrets, "full", dropout=0.1)
    assert any(len(s) < CLIENTS for s in survivors)
    encoder = lossy.encoder
    expected = DDGauss(
        FedAvg(fraction_evaluate=0.0),
        clipping_norm=1.0,
        noise_multiplier=1.0,
        expected_clients=CLIENTS,
        seed=7,
    )
    for server_round, kept in enumerate(survivors, 1):
        expected.ledger.record(
            server_round,
            ddgauss_privacy.round_event(
                encoder.l2_bound,
                encoder.l1_bound,
                encoder.scaled_noise_std,
                len(kept),
                encoder.padded_dim,
            ),
        )
    assert lossy.epsilon() == expected.epsilon()
    complete, _, _, everyone = run(local_engine, digits, client_secrets, "full")
    assert all(len(s) == CLIENTS for s in everyone)
    assert math.isfinite(lossy.epsilon()) and lossy.epsilon() > complete.epsilon() > 0


def test_an_aborted_round_releases_nothing_and_accounts_nothing(
    local_engine, digits, client_secrets
):
    strategy, final, sums, survivors = run(
        local_engine, digits, client_secrets, "full", protocol_dropout=1.0
    )
    _, _, model, _ = digits
    initial = initial_arrays(model, 0)
    for key in final:
        np.testing.assert_array_equal(final[key], initial[key])
    assert sums == [None] * ROUNDS and survivors == [()] * ROUNDS
    assert len(strategy.ledger) == 0 and strategy.epsilon() == 0.0
    assert strategy.last_stage == "ABORTED" and "needed" in strategy.last_abort


def members(phrase: str = "tests", n: int = 8) -> dict:
    root = RunSecret.from_passphrase(phrase)
    return {m: root.member(m) for m in range(n)}


def assert_same_run(a, b):
    """Two runs of :func:`run` released the same integers from the same clients, ended with
    the same model and the same epsilon."""
    (first, final_a, sums_a, survivors_a), (second, final_b, sums_b, survivors_b) = a, b
    assert survivors_a == survivors_b
    for x, y in zip(sums_a, sums_b):
        np.testing.assert_array_equal(x, y)
    for key in final_a:
        np.testing.assert_array_equal(final_a[key], final_b[key])
    assert first.epsilon() == second.epsilon() > 0


def test_committee_mode_equals_plaintext_bit_for_bit_under_client_and_member_dropouts(
    local_engine, digits, client_secrets
):
    """With a fixed RunSecret the clients' rounding and noise are fixed, so the committee's
    sum of the clients' sealed shares is the plaintext sum of the same survivors, though some
    clients drop out (the engine's faults) and some members drop out (member_dropout), and
    the server never held an encoding."""
    committee = Committee(8, 2, 2, shards=2, member_secrets=members())
    sealed = run(  # the public schedule drops 0, 2 and 2 of the 8 members; 5 must answer
        local_engine, digits, client_secrets, "committee", 0.1, committee, member_dropout=0.03
    )
    plain = run(local_engine, digits, client_secrets, "plaintext", 0.1)
    assert_same_run(sealed, plain)
    assert any(len(kept) < CLIENTS for kept in sealed[3])  # clients dropped out
    results = [committee.history[r] for r in range(1, ROUNDS + 1)]
    assert any(result.dropped for result in results)  # and members did
    assert all(result.excluded == () for result in results)
    assert committee.relay.transcript.messages(stage="SHARE") == 8 * sum(map(len, sealed[3]))
    assert sealed[0].privacy_report()["mode"] == "committee"


@pytest.mark.ray
def test_committee_on_ray_actors_with_clients_on_ray_workers(
    ray_session, ray_engine, local_engine, digits, client_secrets
):
    committee = Committee(8, 3, 2, shards=2, ray_module=ray_session, member_secrets=members())
    try:
        on_ray = run(ray_engine, digits, client_secrets, "committee", 0.1, committee=committee)
    finally:
        committee.close()
    assert_same_run(on_ray, run(local_engine, digits, client_secrets, "plaintext", 0.1))
    assert sorted(committee.history) == list(range(1, ROUNDS + 1))


def test_a_committee_round_the_members_cannot_finish_releases_nothing(
    local_engine, digits, client_secrets
):
    committee = Committee(8, 2, 2, member_secrets=members())
    strategy, final, sums, survivors = run(
        local_engine, digits, client_secrets, "committee", committee=committee, member_dropout=1.0
    )
    _, _, model, _ = digits
    initial = initial_arrays(model, 0)
    for key in final:
        np.testing.assert_array_equal(final[key], initial[key])
    assert sums == [None] * ROUNDS and len(strategy.ledger) == 0
    assert "5 committee members needed" in strategy.last_abort
    assert all(committee.stage(r).name == "ABORTED" for r in range(1, ROUNDS + 1))


def test_decoded_sum_matches_the_clients_updates_without_noise():
    from protocols.encoding import DDGaussEncoder

    rng = np.random.default_rng(0)
    strategy = DDGauss(
        FedAvg(fraction_evaluate=0.0),
        clipping_norm=1.0,
        noise_multiplier=1.0,
        expected_clients=5,
        seed=1,
        mode="plaintext",
    )
    encoder = strategy.encoder_for(50)
    quiet = DDGaussEncoder(50, encoder.clip, encoder.gamma, 0.0, encoder.beta)
    updates = [rng.normal(size=50) * 0.05 for _ in range(5)]
    seed = strategy.rotation_seed(1)
    inputs = {10 + i: quiet.encode(u, seed, rng).elements for i, u in enumerate(updates)}
    total = strategy.sum_in_clear(1, inputs)
    np.testing.assert_array_equal(total, DEFAULT_FIELD.sum(np.stack(list(inputs.values())), 0))
    decoded = encoder.decode(total, seed)
    np.testing.assert_allclose(decoded, np.sum(updates, axis=0), atol=5 * encoder.gamma * 3)
    full = DDGauss(
        FedAvg(fraction_evaluate=0.0), clipping_norm=1, noise_multiplier=1, expected_clients=5,
        seed=1,
    )
    with pytest.raises(ValueError, match="never holds the inputs"):
        full.sum_in_clear(1, inputs)


def test_arguments_are_checked():
    with pytest.raises(ValueError, match="mode"):
        DDGauss(
            FedAvg(), clipping_norm=1, noise_multiplier=1, expected_clients=4, seed=0, mode="fast"
        )
    with pytest.raises(ValueError, match="mode='plaintext'"):
        DDGauss(
            FedAvg(), clipping_norm=1, noise_multiplier=1, expected_clients=4, seed=0, mode="ideal"
        )
    with pytest.raises(ValueError, match="'plaintext'"):
        from_options(
            {"clipping_norm": 1, "noise_multiplier": 1, "mode": "ideal"},
            expected_clients=4,
            seed=0,
        )
    base = {"clipping_norm": 1, "noise_multiplier": 1}
    committee = {**base, "mode": "committee", "committee_size": 5, "threshold": 2, "packing": 2}
    assert from_options(committee, expected_clients=4, seed=0).committee_spec() == CommitteeSpec(
        5, 2, 2
    )
    with pytest.raises(ConfigError, match="strategy.options.committee_size = None"):
        from_options({**base, "mode": "committee", "threshold": 2}, expected_clients=4, seed=0)
    with pytest.raises(ConfigError, match="strategy.options.threshold = 2 .* only with mode"):
        from_options({**base, "threshold": 2}, expected_clients=4, seed=0)
    with pytest.raises(ValueError, match=r"detect=2 .* detect = strategy.options.detect"):
        from_options({**committee, "detect": 2}, expected_clients=4, seed=0)
    with pytest.raises(ConfigError, match="strategy.options.prg = 'aes'.*'aes-ctr'"):
        from_options({**base, "prg": "aes"}, expected_clients=4, seed=0)
    with pytest.raises(ValueError, match="expected_clients"):
        DDGauss(FedAvg(), clipping_norm=1, noise_multiplier=1, expected_clients=1, seed=0)
    with pytest.raises(ValueError, match="stage_timeout"):
        DDGauss(
            FedAvg(), clipping_norm=1, noise_multiplier=1, expected_clients=4, seed=0,
            stage_timeout=0,
        )
    with pytest.raises(ValueError, match="ring_bits"):
        DDGauss(
            FedAvg(),
            clipping_norm=1,
            noise_multiplier=1,
            expected_clients=4,
            seed=0,
            bits=20,
            ring_bits=16,
        )


def _plaintext(**kwargs):
    strategy = DDGauss(
        FedAvg(fraction_evaluate=0.0),
        clipping_norm=1.0,
        noise_multiplier=1.0,
        expected_clients=12,
        seed=4,
        mode=kwargs.pop("mode", "plaintext"),
        **kwargs,
    )
    strategy.encoder_for(30)
    return strategy


def test_plaintext_protocol_dropouts_count_only_contributors():
    rng = np.random.default_rng(6)
    encoder = _plaintext().encoder
    inputs = {
        100 + i: encoder.encode(
            rng.normal(size=30) * 0.1, 1, rng, sampler=discrete_gaussian
        ).elements
        for i in range(12)
    }
    strategy = _plaintext(protocol_dropout=0.3)
    aborted = 0
    for server_round in range(1, 9):
        try:
            total = strategy.sum_in_clear(server_round, inputs)
        except TooManyDropoutsError:
            aborted += 1
            continue
        kept = strategy.last_survivors
        np.testing.assert_array_equal(
            total, DEFAULT_FIELD.sum(np.stack([inputs[i] for i in kept]), axis=0)
        )
        lost = strategy.protocol_dropouts(server_round, sorted(inputs))
        unmask_only = lost.get(Stage.UNMASK, set())
        assert set(inputs) - set(kept) == set().union(*lost.values()) - unmask_only
    assert aborted < 8


def test_a_committee_is_bound_by_the_front_end_and_never_checkpointed():
    """From a CommitteeSpec the strategy asks the front end for its committee; it accepts only
    a matching one, and pickling (checkpoints) drops it: the members' keys are theirs."""
    import pickle

    from strategies.plumbing.server_secret import bind_parties

    spec = CommitteeSpec(size=7, threshold=2, packing=2)
    strategy = _plaintext(mode="committee", committee=spec)
    assert strategy.committee_spec() == spec
    with pytest.raises(RuntimeError, match="needs a committee"):
        strategy.configure_train(1, to_record({"w": np.zeros(30)}), {}, None)
    with pytest.raises(ValueError, match=r"\(n, t, k\) = \(7, 3, 2\)"):
        strategy.bind_committee(Committee(7, 3, 2))
    committee = spec.build(RunSecret.from_passphrase("bound"))
    bind_parties(strategy, RunSecret.from_passphrase("bound").server(), None, committee)
    assert strategy.committee is committee
    restored = pickle.loads(pickle.dumps(strategy))
    assert restored.committee is None and restored.committee_spec() == spec
    with pytest.raises(ValueError, match="committee"):
        _plaintext(mode="committee")
    with pytest.raises(ValueError, match="member_dropout"):
        _plaintext(member_dropout=0.1)
    with pytest.raises(ValueError, match="in committee mode the server never holds"):
        strategy.sum_in_clear(1, {1: np.zeros(30, dtype=np.int64)})


def test_fedsim_run_records_the_mode_and_accounts_the_noise_present(tmp_path):
    """rounds.jsonl and summary.json name the mode; each round's epsilon composes the released
    rounds with the noise of their survivors (dropouts at every exchange in full mode; a round
    left with too few releases nothing and costs nothing)."""
    from fedsim.cli import main
    from fedsim.frontend.results import read_rounds

    def recorded(mode, dropout):
        config = tmp_path / f"{mode}-{dropout}.toml"
        config.write_text(RUN.format(mode=mode, dropout=dropout))
        out = tmp_path / f"{mode}-{dropout}"
        assert main(["run", str(config), "--out", str(out), "--no-progress"]) == 0
        rounds = [r for r in read_rounds(out / "rounds.jsonl") if r["round"] >= 1]
        assert len(rounds) == 3
        assert {r["privacy"]["mode"] for r in rounds} == {mode}
        assert all(r["aggregated"]["rejected"] == [] for r in rounds)
        assert json.loads((out / "summary.json").read_text())["privacy"]["mode"] == mode
        reference = from_options(
            {"clipping_norm": 1.0, "noise_multiplier": 0.5, "mode": mode, "ring_bits": 32},
            expected_clients=10,
            seed=4,
        )
        encoder = reference.encoder_for(64 * 10 + 10)  # logreg on digits
        for record in rounds:
            kept = record["aggregated"]["ddgauss-survivors"]
            if kept:
                event = ddgauss_privacy.round_event(
                    encoder.l2_bound, encoder.l1_bound, encoder.scaled_noise_std, kept, 1024
                )
                reference.ledger.record(record["round"], event)
            assert record["privacy"]["epsilon"] == pytest.approx(reference.epsilon(), rel=1e-12)
        return [r["aggregated"]["ddgauss-survivors"] for r in rounds]

    kept_full = recorded("full", 0.3)
    kept_plain = recorded("plaintext", 0.3)
    assert recorded("plaintext", 0.0) == [10, 10, 10] and max(kept_plain) < 10
    # full mode also loses clients inside SecAgg+'s exchanges (or the whole round)
    assert all(a <= b for a, b in zip(kept_full, kept_plain)) and kept_full != kept_plain


def test_fedsim_run_in_committee_mode_equals_plaintext(tmp_path):
    """``fedsim run`` with ``mode = "committee"``: the front end builds the committee (members'
    keys from the run's root), the clients share and seal, and with the same --secrets file
    the plaintext run replaying the committee run (its nonce: the same streams) releases exactly
    what committee mode released, under client and member dropouts."""
    from fedsim.cli import main
    from fedsim.frontend.results import read_rounds

    secrets = tmp_path / "root.hex"
    committee_options = "committee_size = 8\nthreshold = 2\npacking = 2\nmember_dropout = 0.05\n"

    def finished(mode, extra="", replay=()):
        config = tmp_path / f"{mode}.toml"
        text = RUN.format(mode=mode, dropout=0.3)
        config.write_text(text.replace("ring_bits = 32\n", "ring_bits = 32\n" + extra))
        out = tmp_path / mode
        command = ["run", str(config), "--out", str(out), "--no-progress"]
        assert main([*command, "--secrets", str(secrets), *replay]) == 0
        rounds = [r for r in read_rounds(out / "rounds.jsonl") if r["round"] >= 1]
        return rounds, dict(np.load(out / "model.npz"))

    sealed, sealed_model = finished("committee", committee_options)
    plain, plain_model = finished("plaintext", replay=("--replay", str(tmp_path / "committee")))
    assert {r["privacy"]["mode"] for r in sealed} == {"committee"}
    assert all(r["aggregated"]["rejected"] == [] for r in sealed)
    kept = [r["aggregated"]["ddgauss-survivors"] for r in sealed]
    assert kept == [r["aggregated"]["ddgauss-survivors"] for r in plain] and min(kept) < 10
    assert sum(r["aggregated"]["ddgauss-member-dropouts"] for r in sealed) > 0
    assert [r["privacy"]["epsilon"] for r in sealed] == [r["privacy"]["epsilon"] for r in plain]
    assert sealed_model.keys() == plain_model.keys()
    assert all(np.array_equal(sealed_model[k], plain_model[k]) for k in sealed_model)


FLOWER_RUN = """
import json, sys
import numpy as np
from flwr.app import ArrayRecord, Context, Message, MetricRecord, RecordDict
from flwr.clientapp import ClientApp
from flwr.serverapp import ServerApp
from flwr.serverapp.strategy import FedAvg
from flwr.simulation import run_simulation
from fedsim.record_codec import to_numpy, to_record
from strategies.methods.ddgauss.strategy import DDGauss
from strategies.methods.ddgauss.client import ddgauss_client_app

CLIENTS, DIM = 6, 20
inner = ClientApp()

@inner.train()
def train(message, context):
    arrays = to_numpy(message.content["arrays"])
    step = np.full(DIM, 0.01 * (1 + int(context.node_config["partition-id"])))
    return Message(RecordDict({"arrays": to_record({"w": arrays["w"] + step}),
                               "metrics": MetricRecord({"num-examples": 1})}), reply_to=message)

server = ServerApp()
seen = []

class Recording:
    def __init__(self, grid):
        self.grid = grid
    def __getattr__(self, name):
        return getattr(self.grid, name)
    def send_and_receive(self, messages, *, timeout=None):
        replies = list(self.grid.send_and_receive(messages, timeout=timeout))
        seen.extend(replies)
        return replies

@server.main()
def main(grid, context):
    strategy = DDGauss(FedAvg(fraction_evaluate=0.0, min_available_nodes=CLIENTS,
                              min_train_nodes=CLIENTS),
                       clipping_norm=1.0, noise_multiplier=0.01, expected_clients=CLIENTS,
                       seed=3, bits=24)
    result = strategy.start(Recording(grid), to_record({"w": np.zeros(DIM)}), num_rounds=1)
    final = to_numpy(result.arrays)["w"]
    arrays = [a for r in seen if not r.has_error() for rec in r.content.array_records.values()
              for a in to_numpy(rec).values()]
    small = [float(np.mean(np.abs(strategy.encoder.field.decode_signed(a)) < 2**40))
             for a in arrays if a.ndim == 1 and a.size == strategy.encoder.padded_dim]
    json.dump({"survivors": list(strategy.last_survivors), "rejected": strategy.last_rejected,
               "types": sorted({r.metadata.message_type for r in seen}),
               "errors": sum(r.has_error() for r in seen), "masked": len(small),
               "max_small": max(small), "final": final.tolist(),
               "noise_std": strategy.noise_multiplier / CLIENTS}, open(sys.argv[1], "w"))

run_simulation(server_app=server, client_app=ddgauss_client_app(inner), num_supernodes=CLIENTS,
               backend_config={"client_resources": {"num_cpus": 1, "num_gpus": 0.0},
                               "init_args": {"num_cpus": 2, "logging_level": "WARNING"}})
"""


def test_full_mode_runs_under_flowers_own_runtime(tmp_path):
    """``flwr.simulation.run_simulation`` (its own Ray backend and node state): the SecAgg+
    exchanges complete, every client's input is in the sum, and the masked inputs the server
    received look uniform (no coordinate near the small encodings)."""
    script, out = tmp_path / "flower_run.py", tmp_path / "out.json"
    script.write_text(textwrap.dedent(FLOWER_RUN))
    env = dict(os.environ, PYTHONPATH=str(ROOT), RAY_ACCEL_ENV_VAR_OVERRIDE_ON_ZERO="0")
    done = subprocess.run(
        [sys.executable, str(script), str(out)], env=env, capture_output=True, text=True,
        timeout=600,
    )
    assert out.exists(), done.stderr[-3000:]
    result = json.loads(out.read_text())
    assert len(result["survivors"]) == 6 and result["rejected"] == {} and result["errors"] == 0
    assert result["types"] == [
        "query.secagg_masked_input",
        "query.secagg_share_keys",
        "query.secagg_unmask",
        "train",
    ]
    assert result["masked"] == 6 and result["max_small"] < 0.01
    truth = np.mean([0.01 * (1 + p) for p in range(6)])  # every client clipped below c = 1
    np.testing.assert_allclose(result["final"], truth, atol=6 * result["noise_std"] + 1e-3)
