"""pFedHB's server update: closed forms against numerical minimisation, and its special cases."""

from __future__ import annotations

import numpy as np
import pytest
from flwr.app import Message, MetricRecord, RecordDict
from flwr.app.message_type import MessageType
from flwr.app.metadata import Metadata
from scipy.optimize import minimize

from fedsim.config import ConfigError
from fedsim.records import to_record
from fedsim.workloads.bayesian import BayesSpec, build_bayes_model, model_arrays, softplus
from strategies.personalised import Cohorts, reports_of
from strategies.pfedbayes import PFedBayes
from strategies.pfedhb import (
    HBConfig,
    NormalInverseGamma,
    PFedHB,
    conjugate_global_update,
    l2_global_update,
    l2_objective,
)
from strategies.pfedvem import PFedVEM


def _clients(rng: np.random.Generator, m: int = 5, d: int = 4):
    mu = rng.normal(0.0, 1.0, (m, d))
    sigma2 = rng.uniform(0.05, 0.5, (m, d))
    weights = rng.uniform(1.0, 5.0, m)
    return mu, sigma2, weights


@pytest.mark.parametrize("lam", [(5.0, 5.0), (0.3, 2.0), (0.0, 1.0), (2.0, 0.0)])
def test_l2_closed_form_minimises_the_objective(lam):
    mu, sigma2, weights = _clients(np.random.default_rng(1))
    lam_mu, lam_sigma = lam
    mu_g, s_g = l2_global_update(mu, sigma2, weights, lam_mu, lam_sigma)
    d = mu.shape[1]

    def f(z):  # optimise over (mu_g, log sigma_g^2)
        return l2_objective(z[:d], np.exp(z[d:]), mu, sigma2, weights, lam_mu, lam_sigma)

    best = minimize(f, np.zeros(2 * d), method="BFGS", options={"gtol": 1e-10})
    np.testing.assert_allclose(mu_g, best.x[:d], atol=1e-5)
    np.testing.assert_allclose(s_g, np.exp(best.x[d:]), rtol=1e-4)
    assert f(np.concatenate([mu_g, np.log(s_g)])) <= best.fun + 1e-9


def test_conjugate_closed_form_is_the_map():
    mu, sigma2, weights = _clients(np.random.default_rng(2), d=3)
    prior = NormalInverseGamma(m0=0.4, kappa0=2.0, a0=1.0, b0=0.3)
    tau = 5.0
    mu_g, s_g = conjugate_global_update(mu, sigma2, weights, prior, tau)
    w = weights / weights.sum()
    d = mu.shape[1]

    def neg_log_posterior(z):
        m, s = z[:d], np.exp(z[d:])
        kl = 0.5 * (np.log(s / sigma2) + (sigma2 + (mu - m) ** 2) / s - 1.0)
        log_nig = -(prior.a0 + 1.5) * np.log(s) - (
            2 * prior.b0 + prior.kappa0 * (m - prior.m0) ** 2
        ) / (2 * s)
        return tau * float((w @ kl).sum()) - float(log_nig.sum())

    best = minimize(neg_log_posterior, np.zeros(2 * d), method="BFGS", options={"gtol": 1e-10})
    np.testing.assert_allclose(mu_g, best.x[:d], atol=1e-5)
    np.testing.assert_allclose(s_g, np.exp(best.x[d:]), rtol=1e-4)


def test_zero_lambda_and_flat_prior_give_moment_matching():
    mu, sigma2, weights = _clients(np.random.default_rng(3))
    w = weights / weights.sum()
    mean = w @ mu
    second = w @ (sigma2 + mu**2) - mean**2  # the mixture's variance
    for mu_g, s_g in (
        l2_global_update(mu, sigma2, weights, 0.0, 0.0),
        conjugate_global_update(mu, sigma2, weights, NormalInverseGamma(), 7.0),
    ):
        np.testing.assert_allclose(mu_g, mean, atol=1e-12)
        np.testing.assert_allclose(s_g, second, rtol=1e-10)


def test_penalties_shrink_towards_zero():
    mu, sigma2, weights = _clients(np.random.default_rng(4))
    mu0, s0 = l2_global_update(mu, sigma2, weights, 0.0, 0.0)
    mu5, s5 = l2_global_update(mu, sigma2, weights, 5.0, 5.0)
    assert np.all(np.abs(mu5) < np.abs(mu0)) and np.all(s5 < s0)


# --------------------------------------------------------------------------- special cases

SPEC = BayesSpec(in_features=6, hidden=(5,), num_classes=3)


def _reply(arrays, n, metrics=None) -> Message:
    metadata = Metadata(
        run_id=0,
        message_id="",
        src_node_id=1,
        dst_node_id=0,
        reply_to_message_id="",
        group_id="1",
        created_at=0.0,
        ttl=0.0,
        message_type=MessageType.TRAIN,
    )
    content = RecordDict(
        {
            "posterior": to_record(arrays),
            "metrics": MetricRecord({"num-examples": n, "train_loss": 0.0, **(metrics or {})}),
        }
    )
    return Message(content=content, metadata=metadata)


def _federation(seed: int, m: int = 4):
    rng = np.random.default_rng(seed)
    previous = model_arrays(build_bayes_model(SPEC, seed))
    posts = []
    for _ in range(m):
        post = {
            k: (
                v + rng.normal(0, 0.3, v.shape)
                if k.endswith("_mu")
                else v + rng.normal(0, 0.5, v.shape)
            )
            for k, v in previous.items()
        }
        posts.append({k: v.astype(np.float32) for k, v in post.items()})
    sizes = rng.integers(5, 50, m)
    return {k: v.astype(np.float64) for k, v in previous.items()}, posts, sizes


def _prior_var(post, previous):
    total = count = 0
    for k in post:
        if k.startswith("head.") and k.endswith("_mu"):
            sigma = softplus(post[k[:-3] + "_rho"])
            total += np.sum(sigma**2 + (post[k] - previous[k]) ** 2)
            count += post[k].size
    return total / count


def test_pfedhb_reduces_to_pfedvem():
    previous, posts, sizes = _federation(5)
    replies = [
        _reply(p, int(n), {"head-prior-var": float(_prior_var(p, previous))})
        for p, n in zip(posts, sizes, strict=True)
    ]
    config = HBConfig(
        lam_mu=0.0,
        lam_sigma=0.0,
        head_variance="per-client",
        head_weighting="uniform",
        iterations=1,
    )
    hb = PFedHB(config).global_update(1, previous, reports_of(replies))
    vem = PFedVEM().global_update(1, previous, reports_of(replies))
    for key in hb:
        if key.endswith("_mu") or key.startswith("head."):
            np.testing.assert_allclose(hb[key], vem[key], rtol=1e-5, atol=1e-6, err_msg=key)


def test_pfedhb_reduces_to_pfedbayes():
    previous, posts, sizes = _federation(6)
    replies = [_reply(p, int(n)) for p, n in zip(posts, sizes, strict=True)]
    config = HBConfig(
        lam_mu=0.0, lam_sigma=3.0, head_variance="rho-average", body_variance="rho-average"
    )
    hb = PFedHB(config).global_update(1, previous, reports_of(replies))
    bayes = PFedBayes().global_update(1, previous, reports_of(replies))
    for key in hb:
        np.testing.assert_allclose(hb[key], bayes[key], rtol=1e-6, atol=1e-7, err_msg=key)
    # the means agree for lam_mu = 0 whatever the variance rule
    shared = PFedHB(HBConfig(lam_mu=0.0, lam_sigma=3.0)).global_update(
        1, previous, reports_of(replies)
    )
    for key in hb:
        if key.endswith("_mu"):
            np.testing.assert_allclose(shared[key], bayes[key], rtol=1e-6, atol=1e-7)


def test_strategy_round_trip_through_aggregate_train():
    previous, posts, sizes = _federation(7)
    strategy = PFedHB(HBConfig(), Cohorts())
    strategy.previous = previous
    replies = [_reply(p, int(n)) for p, n in zip(posts, sizes, strict=True)]
    arrays, metrics = strategy.aggregate_train(1, replies)
    assert metrics["reporting"] == len(posts)
    assert set(arrays.keys()) == set(previous)


# --------------------------------------------------------------------------- refusals


@pytest.mark.parametrize(
    ("kwargs", "key"),
    [
        ({"lam_mu": -1.0}, "pfedhb.lam_mu"),
        ({"lam_sigma": -0.5}, "pfedhb.lam_sigma"),
        ({"head_variance": "median"}, "pfedhb.head_variance"),
        ({"body_variance": "per-client"}, "pfedhb.body_variance"),
    ],
)
def test_bad_server_configs_are_refused(kwargs, key):
    with pytest.raises(ConfigError, match=key) as err:
        HBConfig(**kwargs)
    assert "allowed" in str(err.value)


def test_negative_lambda_refused_by_the_closed_form():
    mu, sigma2, weights = _clients(np.random.default_rng(8))
    with pytest.raises(ConfigError, match=r"pfedhb.lam_sigma = -1.0 .*>= 0"):
        l2_global_update(mu, sigma2, weights, 1.0, -1.0)


def test_head_split_not_matching_the_arrays_is_refused():
    previous, posts, sizes = _federation(9)
    replies = [_reply(p, int(n)) for p, n in zip(posts, sizes, strict=True)]
    with pytest.raises(ConfigError, match=r"model.head_layers = 2 .*1 head, 1 body"):
        PFedHB(HBConfig(head_layers=2)).global_update(1, previous, reports_of(replies))


def test_registry_names_resolve_to_strategies():
    import importlib

    from strategies.personalised import PersonalisedStrategy
    from strategies.registry import PERSONALISED

    for name, target in PERSONALISED.items():
        module, cls = target.split(":")
        assert issubclass(getattr(importlib.import_module(module), cls), PersonalisedStrategy), name
