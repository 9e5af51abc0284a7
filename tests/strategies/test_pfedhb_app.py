"""The personalised methods as ClientApps on fedsim's engine: schedules, state, Ray."""

from __future__ import annotations

import numpy as np
import pytest
from flwr.app import ConfigRecord, Context, Message, RecordDict
from flwr.app.message_type import MessageType
from flwr.supercore.task_identity import TaskIdentity

from fedsim.data import DatasetSpec
from fedsim.engine.rounds import run_rounds
from fedsim.record_codec import to_numpy, to_record
from fedsim.workloads.bayesian import BayesSpec, build_bayes_model, model_arrays
from fedsim.workloads.personalised import PersonalTraining, make_personal_app, prior_variance
from strategies.methods.pfedbayes import PFedBayes
from strategies.methods.pfedhb import HBConfig, PFedHB
from strategies.methods.pfedvem import PFedVEM
from strategies.plumbing.personalised import Cohorts, FedAvgReference, LocalOnly

CLIENTS = 8
DATA = DatasetSpec(
    source="digits", partition="shards", classes_per_client=5, num_clients=CLIENTS, seed=0
)
SPEC = BayesSpec(in_features=64, hidden=(16,), num_classes=10)
TRAINING = PersonalTraining(head_steps=3, body_epochs=1, mc_samples=2, eval_samples=3, zeta=0.01)


def _run(engine, strategy, rounds=2):
    grid = engine.open_run(make_personal_app(SPEC, DATA, TRAINING), CLIENTS)
    outcomes = []
    arrays = run_rounds(
        strategy,
        grid,
        to_record(model_arrays(build_bayes_model(SPEC, 0))),
        rounds,
        on_round=outcomes.append,
    )
    return to_numpy(arrays), outcomes


@pytest.mark.parametrize(
    ("strategy", "trained_per_round"),
    [
        (lambda c: PFedHB(HBConfig(), Cohorts(schedule="all", **c)), CLIENTS),
        (lambda c: PFedHB(HBConfig(), Cohorts(schedule="sampled", **c)), None),
        (lambda c: PFedVEM(Cohorts(**c)), CLIENTS),
        (lambda c: PFedBayes(Cohorts(**c)), CLIENTS),
        (lambda c: FedAvgReference(Cohorts(schedule="sampled", **c), finetune_epochs=1), None),
        (lambda c: LocalOnly(Cohorts(**c)), CLIENTS),
    ],
)
def test_methods_run_and_evaluate_every_client(local_engine, strategy, trained_per_round):
    cohorts = dict(fraction=0.25, min_clients=2, evaluate_every=2, num_rounds=2, seed=3)
    arrays, outcomes = _run(local_engine, strategy(cohorts))
    for outcome in outcomes:
        m = outcome.train_metrics
        expected = m["reporting"] if trained_per_round is None else trained_per_round
        assert m["trained"] == expected
    final = outcomes[-1].evaluate_metrics
    assert final["clients"] == CLIENTS
    assert 0.0 <= final["personal_acc_mc"] <= 1.0 and 0.0 <= final["personal_ece_mc"] <= 1.0
    assert np.all(np.isfinite(np.concatenate([v.ravel() for v in arrays.values()])))


def _instruction(arrays, server_round, method="pfedhb", kind=MessageType.TRAIN, **extra):
    config = ConfigRecord(
        {
            "method": method,
            "server-round": server_round,
            "report": 1,
            "head-prior": "global",
            **extra,
        }
    )
    content = RecordDict({"global": to_record(arrays), "config": config})
    message = Message(content=content, dst_node_id=1, message_type=kind)
    message.metadata.__dict__["_message_id"] = f"m{server_round}{kind}"
    return message


def _context():
    TaskIdentity.run_id, TaskIdentity.node_id, TaskIdentity.task_id = 1, 1, 1
    return Context(
        run_id=1, node_id=1, node_config={"partition-id": 0}, state=RecordDict(), run_config={}
    )


@pytest.mark.parametrize("method", ["pfedhb", "pfedvem"])
def test_personal_model_is_evaluated_with_the_body_it_trained(method):
    """As the reference's clients, which test before the server overwrites their bodies:
    the global body in the evaluate message does not change the personal model's score."""
    app = make_personal_app(SPEC, DATA, TRAINING)
    g = model_arrays(build_bayes_model(SPEC, 0))
    context = _context()
    prior = "per-client" if method == "pfedvem" else "global"
    app(_instruction(g, 1, method, **{"head-prior": prior}), context)
    other = {k: v + 0.5 if k.startswith("body.") and k.endswith("_mu") else v for k, v in g.items()}
    scores = [
        dict(app(_instruction(a, 1, method, MessageType.EVALUATE), context).content["metrics"])
        for a in (g, other)
    ]
    assert scores[0]["acc-mean"] == scores[1]["acc-mean"]
    assert scores[0]["nll-mean"] == scores[1]["nll-mean"]


def test_head_kl_weighs_the_pull_of_the_global_head():
    """``head_kl`` scales KL(q_i,head || q_g,head) in the head's loss: without it the head
    strays further from the global head than with the reference's weight 1."""
    g = model_arrays(build_bayes_model(SPEC, 0))
    moved = {}
    for weight in (0.0, 1.0):
        training = PersonalTraining(**{**TRAINING.__dict__, "head_kl": weight, "head_lr": 0.05})
        context = _context()
        reply = make_personal_app(SPEC, DATA, training)(_instruction(g, 1), context)
        head = to_numpy(reply.content["posterior"])["head.0.weight_mu"]
        moved[weight] = float(np.abs(head - g["head.0.weight_mu"]).mean())
    assert moved[0.0] > 2 * moved[1.0]


def test_pfedvem_reports_the_prior_variance_its_head_was_trained_against():
    """pFedVEM's M-step runs at the start of the round (``vem/vem_client.py``): in round 1
    the head is the global one, so rho_i^2 is the mean of its sigma^2 = softplus(rho_init)^2."""
    app = make_personal_app(SPEC, DATA, TRAINING)
    g = model_arrays(build_bayes_model(SPEC, 0))
    context = _context()
    reply = app(_instruction(g, 1, "pfedvem", **{"head-prior": "per-client"}), context)
    sigma2 = float(np.logaddexp(0.0, np.float32(SPEC.rho_init))) ** 2
    assert reply.content["metrics"]["head-prior-var"] == pytest.approx(sigma2, rel=1e-6)
    trained = to_numpy(reply.content["posterior"])
    again = app(_instruction(g, 2, "pfedvem", **{"head-prior": "per-client"}), context)
    assert again.content["metrics"]["head-prior-var"] == pytest.approx(
        prior_variance(trained, g), rel=1e-6
    )


def test_personal_heads_persist_across_rounds():
    TaskIdentity.run_id, TaskIdentity.node_id, TaskIdentity.task_id = 1, 1, 1
    app = make_personal_app(SPEC, DATA, TRAINING)
    g = model_arrays(build_bayes_model(SPEC, 0))
    context = Context(
        run_id=1, node_id=1, node_config={"partition-id": 0}, state=RecordDict(), run_config={}
    )
    first = to_numpy(app(_instruction(g, 1), context).content["posterior"])
    kept = to_numpy(context.state["fedsim.personal"])
    assert set(kept) == set(g)  # the personal head and the body trained this round
    for key in kept:
        np.testing.assert_array_equal(kept[key], first[key])
    # round 2 starts the head from the kept one, not from the global head
    fresh = Context(
        run_id=1, node_id=1, node_config={"partition-id": 0}, state=RecordDict(), run_config={}
    )
    again = to_numpy(app(_instruction(g, 2), context).content["posterior"])
    other = to_numpy(app(_instruction(g, 2), fresh).content["posterior"])
    assert not np.allclose(again["head.0.weight_mu"], other["head.0.weight_mu"])
    np.testing.assert_allclose(again["body.0.weight_mu"], other["body.0.weight_mu"], atol=0.2)


@pytest.mark.ray
def test_pfedhb_on_the_ray_engine_matches_the_local_engine(ray_engine, local_engine):
    cohorts = dict(fraction=0.25, evaluate_every=2, num_rounds=2, seed=5)
    on_ray, ray_outcomes = _run(ray_engine, PFedHB(HBConfig(), Cohorts(**cohorts)))
    local, _ = _run(local_engine, PFedHB(HBConfig(), Cohorts(**cohorts)))
    for key in local:
        np.testing.assert_allclose(on_ray[key], local[key], rtol=1e-4, atol=1e-5, err_msg=key)
    assert ray_outcomes[-1].evaluate_metrics["clients"] == CLIENTS
