"""DMM as a Flower strategy: full == ideal for the same RunSecret under client and member
dropouts, configuration checked up front, resume from the server's checkpoint and the members'
own sealed states, and ``fedsim run`` writing epsilon per round."""

from __future__ import annotations

import pickle

import cloudpickle
import numpy as np
import pytest
from dmm_support import SECRETS, digits_setup, make_dmm, run_dmm

from fedsim.engine import FaultConfig
from fedsim.engine.dmm_committee import CommitteeHost
from fedsim.privacy.matrix.build import Spec, build
from strategies.methods.dmm.calibration import committee_bound

CLIENTS, ROUNDS = 12, 4


@pytest.fixture(scope="module")
def digits():
    return digits_setup(CLIENTS)


@pytest.mark.parametrize("kind", ["banded", "tree"])
def test_full_equals_ideal_for_the_same_secrets_and_dropouts_cost_epsilon(
    local_engine, digits, kind
):
    faults = FaultConfig(dropout=0.25, seed=3)

    def run(mode, **kwargs):
        strategy = make_dmm(mode, CLIENTS, ROUNDS, kind)
        return run_dmm(local_engine, digits, strategy, ROUNDS, **kwargs)

    full_arrays, full = run("full", faults=faults)
    ideal_arrays, ideal = run("ideal", faults=faults)
    for key in full_arrays:
        np.testing.assert_array_equal(full_arrays[key], ideal_arrays[key])
    for a, b in zip(full.outputs, ideal.outputs):
        assert (a is None) == (b is None)
        if a is not None:
            np.testing.assert_array_equal(a.release, b.release)
            assert a.clients == b.clients and a.holders == b.holders
    assert full.eps == ideal.eps
    # members dropped too (their clients' availability), and clients: fewer noise shares
    assert any(m.get("dmm-member-dropouts", 0) for m in full.metrics)
    _, clean = run("ideal")
    assert full.inner.privacy_report()["fewest_noise_clients"] < CLIENTS
    assert clean.eps[-1] < full.eps[-1]
    assert all(m["rejected"] == [] for m in full.metrics)
    assert full.metrics[-1]["dmm-bytes-per-client"] > 0
    assert full.metrics[-1]["dmm-bytes-per-member-sent"] > 0


def test_the_tree_restarted_every_two_rounds_runs_as_dmm(local_engine, digits):
    """A kind DMM knows by its flag alone: M = C of the restarted trees, full == ideal."""
    from fedsim.privacy.matrix.kinds.tree_restart import tree_restart  # noqa: PLC0415

    f = tree_restart(ROUNDS, 2)

    def run(mode):
        strategy = make_dmm(mode, CLIENTS, ROUNDS, factorization=f)
        return run_dmm(local_engine, digits, strategy, ROUNDS)

    full_arrays, full = run("full")
    ideal_arrays, ideal = run("ideal")
    assert full.inner.mechanism.is_tree and full.inner.mechanism.fractional_bits == 0
    for key in full_arrays:
        np.testing.assert_array_equal(full_arrays[key], ideal_arrays[key])
    assert all(o is not None for o in full.outputs) and full.eps == ideal.eps
    assert 0 < full.eps[0] < full.eps[-1] < float("inf")


def test_full_mode_replies_carry_only_ciphertexts_and_a_public_key(local_engine, digits):
    _, full = run_dmm(local_engine, digits, make_dmm("full", CLIENTS, 2), 2)
    for replies in full.replies:
        for reply in replies:
            assert set(reply.content.keys()) == {"dmm.sealed"}
            record = reply.content["dmm.sealed"]
            assert set(record.keys()) == {"public-key", "members", "nonces", "ciphertexts"}
            assert len(record["public-key"]) == 32


def test_configuration_is_validated_before_the_run(local_engine, digits):
    with pytest.raises(ValueError, match=r"threshold \+ member_dropouts = 2 \+ 5.*committee_size"):
        committee_bound(10, 2, 3, 5)
    committee_bound(20, 3, 3, 3)  # the defaults meet the bound
    with pytest.raises(ValueError, match="not banded"):
        make_dmm("full", CLIENTS, ROUNDS, factorization=build(Spec(kind="sqrt", rounds=ROUNDS)))
    with pytest.raises(ValueError, match="committee_size=11 exceeds the population"):
        make_dmm("full", 10, ROUNDS)
    strategy = make_dmm("full", CLIENTS, ROUNDS, bits=40, fractional_bits=20)
    with pytest.raises(ValueError, match=r"bit budget: a released row can reach .* 2\^60"):
        strategy.check(650)
    unhosted = make_dmm("full", CLIENTS, ROUNDS)
    with pytest.raises(RuntimeError, match="needs a committee host"):
        from fedsim.engine.rounds import run_rounds  # noqa: PLC0415
        from fedsim.record_codec import to_record  # noqa: PLC0415

        grid = local_engine.open_run(digits[3], CLIENTS, datasets=((digits[0], digits[1]),))
        run_rounds(unhosted, grid, to_record({"w": np.zeros(650, dtype=np.float32)}), 1)


def test_resume_from_the_checkpoint_and_the_members_sealed_states(local_engine, digits, tmp_path):
    """Rounds 1-2, a checkpoint (the strategy pickled; the host dropped), then rounds 3-4 on a
    fresh host that re-hosts the committee from the sealed member states: the same model as an
    uninterrupted run."""
    straight, _ = run_dmm(local_engine, digits, make_dmm("full", CLIENTS, ROUNDS), ROUNDS)
    host = CommitteeHost(SECRETS, state_path=tmp_path / "dmm_members.sqlite")
    strategy = make_dmm("full", CLIENTS, ROUNDS)
    middle, _ = run_dmm(local_engine, digits, strategy, 2, host=host)
    host.checkpoint(2)
    blob = cloudpickle.dumps(strategy)
    host.close()
    restored = pickle.loads(blob)
    assert restored.secure.custody.host is None and restored.secure.server.pool is None
    again = CommitteeHost(SECRETS, state_path=tmp_path / "dmm_members.sqlite")
    again.rollback(2)
    resumed, _ = run_dmm(
        local_engine, digits, restored, ROUNDS, host=again, arrays=middle, first=3
    )
    for key in straight:
        np.testing.assert_array_equal(straight[key], resumed[key])
    again.close()


def dmm_run_config(rounds: int):
    from fedsim.frontend.run_config import ExperimentConfig  # noqa: PLC0415

    return ExperimentConfig.from_dict(
        {
            "rounds": rounds,
            "seed": 1,
            "data": {"source": "digits", "partition": "iid", "num_clients": 24},
            "model": {"kind": "logreg"},
            "client": {"epochs": 1, "batch_size": 16, "lr": 0.1},
            "engine": {"backend": "local"},
            "strategy": {
                "name": "dmm",
                "clients_per_round": 12,
                "sampling": "min-separation",
                "options": {
                    "clipping_norm": 1.0,
                    "noise_multiplier": 1.0,
                    "committee_size": 11,
                    "threshold": 2,
                    "packing": 1,
                    "member_dropouts": 2,
                },
            },
        }
    )


def test_fedsim_run_writes_epsilon_and_the_mode_per_round(tmp_path):
    from fedsim.frontend.experiment import run_experiment  # noqa: PLC0415
    from fedsim.frontend.results import read_rounds  # noqa: PLC0415

    summary = run_experiment(dmm_run_config(3), tmp_path, progress=False, secrets=SECRETS)
    rounds = [r for r in read_rounds(tmp_path / "rounds.jsonl") if r["round"] >= 1]
    eps = [r["privacy"]["epsilon"] for r in rounds]
    assert len(eps) == 3 and all(a < b for a, b in zip(eps, eps[1:]))
    assert all(r["privacy"]["mode"] == "full" for r in rounds)
    assert summary["privacy"]["epsilon"] == pytest.approx(eps[-1]) if "privacy" in summary else True
    assert (tmp_path / "dmm_members.sqlite").is_file()


def test_a_killed_dmm_run_resumes_from_the_checkpoint_and_the_members_party_store(
    tmp_path, monkeypatch
):
    """``fedsim run`` of DMM killed after round 2's checkpoint resumes from the checkpoint and
    the members' sealed states (``dmm_members.sqlite``, a party store of the run directory)
    to the same rounds and model; a members' store of another moment is refused, naming it."""
    from fedsim.frontend.experiment import run_experiment  # noqa: PLC0415
    from fedsim.frontend.results import read_rounds  # noqa: PLC0415
    from fedsim.frontend.rundir import RunDirectory  # noqa: PLC0415
    from fedsim.runfiles import RunFileError  # noqa: PLC0415

    def untimed(record):
        if isinstance(record, dict):
            timing = ("seconds", "time_s", "clients_per_s", "compute_s")
            return {k: untimed(v) for k, v in record.items() if k not in timing}
        return record

    def finished(out):
        rounds = [untimed(r) for r in read_rounds(out / "rounds.jsonl")]
        return rounds, dict(np.load(out / "model.npz"))

    config = dmm_run_config(4)
    run_experiment(config, tmp_path / "whole", progress=False, secrets=SECRETS)
    save = RunDirectory.save

    def stop_after_round_2(self, checkpoint):
        save(self, checkpoint)
        if checkpoint.server_round == 2:
            raise KeyboardInterrupt  # the process dies right after round 2's checkpoint

    for cut in ("cut", "stale"):
        monkeypatch.setattr(RunDirectory, "save", stop_after_round_2)
        replay = tmp_path / "whole" if cut == "cut" else None  # "cut" repeats whole's streams
        with pytest.raises(KeyboardInterrupt):
            run_experiment(config, tmp_path / cut, progress=False, secrets=SECRETS, replay=replay)
        monkeypatch.setattr(RunDirectory, "save", save)
    members = "dmm_members.sqlite"
    (tmp_path / "stale" / members).write_bytes((tmp_path / "whole" / members).read_bytes())
    with pytest.raises(RunFileError, match=members):
        run_experiment(config, tmp_path / "stale", resume=True, progress=False, secrets=SECRETS)
    run_experiment(config, tmp_path / "cut", resume=True, progress=False, secrets=SECRETS)
    (whole_rounds, whole_model), (cut_rounds, cut_model) = (
        finished(tmp_path / "whole"),
        finished(tmp_path / "cut"),
    )
    assert cut_rounds == whole_rounds
    assert all(np.array_equal(whole_model[k], cut_model[k]) for k in whole_model)


def test_a_lost_committee_state_halts_the_run_cleanly(local_engine, digits):
    """Members' clients almost all unavailable: the state is lost (fewer than t + k holders),
    the round aborts cleanly and every later round reports the halt instead of failing."""
    faults = FaultConfig(dropout=0.95, seed=2)
    arrays, recorded = run_dmm(
        local_engine, digits, make_dmm("full", CLIENTS, ROUNDS), ROUNDS, faults=faults
    )
    halted = [m.get("dmm-halted", 0) for m in recorded.metrics]
    assert halted[-1] == 1 and recorded.inner.halted
    assert recorded.inner.secure.server.stage.name == "ABORTED"
    assert all(np.isfinite(v).all() for v in arrays.values())


def test_the_committee_claim_names_the_round_whose_public_draw_holds_the_state():
    """What the clients check seats against: (the round of the draw, its clients). A
    checkpoint that predates the recorded round gets it back by searching earlier draws."""
    from fedsim.engine.client_registry import public_committee  # noqa: PLC0415

    strategy = make_dmm("full", 30, 6)
    custody = strategy.secure.custody
    custody.seat(3)
    assert custody.claim(5) == (3, public_committee(7, 3, 30, 11))
    custody.committee_round = None  # an older checkpoint
    assert custody.claim(5) == (3, custody.draw(3))
    assert custody.committee_round == 3
