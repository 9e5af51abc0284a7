"""pFedHB's server update: closed forms against numerical minimisation, and its special cases."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from flwr.app import Message, MetricRecord, RecordDict
from flwr.app.message_type import MessageType
from flwr.app.metadata import Metadata
from scipy.optimize import minimize
from torch.distributions import Normal, kl_divergence

from fedsim.config import ConfigError
from fedsim.record_codec import to_record
from fedsim.workloads.bayesian import BayesSpec, build_bayes_model, model_arrays, softplus
from strategies.methods.pfedbayes import PFedBayes
from strategies.methods.pfedhb import (
    AdamState,
    HBConfig,
    NormalInverseGamma,
    PFedHB,
    conjugate_global_update,
    l2_adam_update,
    l2_global_update,
    l2_objective,
)
from strategies.methods.pfedvem import PFedVEM
from strategies.plumbing.personalised import Cohorts, reports_of


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


# --------------------------------------------------------------------------- Adam solver


def test_adam_round_matches_a_hand_computed_step():
    """Two Adam steps on one coordinate, the gradients by central differences of the
    objective and Adam's recursions written out (betas 0.9, 0.999; eps 1e-8; lr 0.01)."""
    mu, sigma2, n = np.array([[0.0], [1.0]]), np.array([[0.04], [0.09]]), np.array([1.0, 3.0])

    def grad(m: float, r: float) -> np.ndarray:
        def f(a: float, b: float) -> float:
            return l2_objective(np.array([a]), softplus(np.array([b])) ** 2, mu, sigma2, n, 5, 5)

        h = 1e-6
        return np.array([(f(m + h, r) - f(m - h, r)) / 2 / h, (f(m, r + h) - f(m, r - h)) / 2 / h])

    start = np.array([0.2, -1.0])
    g1 = grad(*start)
    assert g1[0] < 0 and g1[1] < 0  # mean pulled up to the clients', sigma up to their spread
    # step 1: the bias-corrected moments are g1 and g1^2, so each coordinate moves by lr
    p1 = start - 0.01 * g1 / (np.abs(g1) + 1e-8)
    np.testing.assert_allclose(p1, [0.21, -0.99], atol=1e-9)
    g2 = grad(*p1)
    m2 = 0.9 * (0.1 * g1) + 0.1 * g2
    v2 = 0.999 * (0.001 * g1**2) + 0.001 * g2**2
    p2 = p1 - 0.01 * (m2 / (1 - 0.9**2)) / (np.sqrt(v2 / (1 - 0.999**2)) + 1e-8)

    state = AdamState(np.zeros(2), np.zeros(2))
    mu_g, rho_g = l2_adam_update(
        mu,
        sigma2,
        n,
        5.0,
        5.0,
        start_mu=start[:1],
        start_rho=start[1:],
        state=state,
        lr=0.01,
        steps=2,
    )
    np.testing.assert_allclose([mu_g[0], rho_g[0]], p2, rtol=1e-7, atol=1e-10)
    assert state.steps == 2
    np.testing.assert_allclose(state.first, m2, rtol=1e-6)
    np.testing.assert_allclose(state.second, v2, rtol=1e-6)


def test_adam_rounds_match_torch_adam_on_the_reference_objective():
    """Three rounds of PFedHB against torch.optim.Adam + MultiStepLR on the reference
    server's loss (``hb/server.py``): sample-weighted KL(q_i || q_g) over the reports plus
    mu_regularizer * sum mu^2 + sigma_regularizer * sum softplus(rho)^2, per part, moments
    kept across rounds, the scheduler stepped once a round."""
    config = HBConfig(
        lam_mu=5.0,
        lam_sigma=3.0,
        server_steps=3,
        server_lr=0.05,
        server_milestones=(1, 2),
        server_gamma=0.5,
    )
    strategy = PFedHB(config)
    previous, _, _ = _federation(10)
    oracle = {
        k: torch.tensor(v, dtype=torch.float64, requires_grad=True) for k, v in previous.items()
    }
    parts = {p: [k for k in oracle if k.startswith(p + ".")] for p in ("head", "body")}
    optimisers = {
        p: torch.optim.Adam([oracle[k] for k in keys], lr=0.05) for p, keys in parts.items()
    }
    schedules = {
        p: torch.optim.lr_scheduler.MultiStepLR(o, milestones=[1, 2], gamma=0.5)
        for p, o in optimisers.items()
    }
    for server_round in (1, 2, 3):
        _, posts, sizes = _federation(20 + server_round)
        replies = [_reply(p, int(n)) for p, n in zip(posts, sizes, strict=True)]
        previous = strategy.global_update(server_round, previous, reports_of(replies))
        coeff = sizes / sizes.sum()
        for part, keys in parts.items():
            for _ in range(3):
                optimisers[part].zero_grad()
                loss = torch.zeros((), dtype=torch.float64)
                for k in keys:
                    if not k.endswith("_mu"):
                        continue
                    base = k[:-3]
                    q_g = Normal(oracle[k], torch.nn.functional.softplus(oracle[base + "_rho"]))
                    for c, post in zip(coeff, posts, strict=True):
                        q_i = Normal(
                            torch.tensor(post[k], dtype=torch.float64),
                            torch.nn.functional.softplus(
                                torch.tensor(post[base + "_rho"], dtype=torch.float64)
                            ),
                        )
                        loss = loss + float(c) * kl_divergence(q_i, q_g).sum()
                    sigma_g = torch.nn.functional.softplus(oracle[base + "_rho"])
                    loss = loss + 5.0 * oracle[k].square().sum() + 3.0 * sigma_g.square().sum()
                loss.backward()
                optimisers[part].step()
            schedules[part].step()
        for k, v in oracle.items():
            np.testing.assert_allclose(previous[k], v.detach().numpy(), rtol=1e-6, atol=1e-9)
    assert config.server_lr_at(1) == 0.05 and config.server_lr_at(3) == 0.0125


def test_adam_moves_sigma_slowly_where_the_exact_solve_jumps():
    """The point of the default: one Adam round moves rho_g by at most ~steps * lr, while
    the exact minimiser sets sigma_g to the reports' spread at once."""
    previous, posts, sizes = _federation(11)
    previous = {
        k: (np.full_like(v, -4.0) if k.endswith("_rho") else v) for k, v in previous.items()
    }
    replies = [_reply(p, int(n)) for p, n in zip(posts, sizes, strict=True)]
    adam = PFedHB(HBConfig()).global_update(1, previous, reports_of(replies))
    exact = PFedHB(HBConfig(server_solver="exact")).global_update(1, previous, reports_of(replies))
    for key in previous:
        if key.endswith("_rho"):
            assert np.max(np.abs(adam[key] - previous[key])) <= 5 * 0.01 + 1e-6
            assert np.median(softplus(exact[key])) > 5 * softplus(-4.0)


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
        server_solver="exact",
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
        server_solver="exact",
        lam_mu=0.0,
        lam_sigma=3.0,
        head_variance="rho-average",
        body_variance="rho-average",
    )
    hb = PFedHB(config).global_update(1, previous, reports_of(replies))
    bayes = PFedBayes().global_update(1, previous, reports_of(replies))
    for key in hb:
        np.testing.assert_allclose(hb[key], bayes[key], rtol=1e-6, atol=1e-7, err_msg=key)
    # the means agree for lam_mu = 0 whatever the variance rule
    shared = PFedHB(HBConfig(server_solver="exact", lam_mu=0.0, lam_sigma=3.0)).global_update(
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
        ({"server_solver": "sgd"}, "pfedhb.server_solver"),
        ({"hyperprior": "conjugate"}, "pfedhb.server_solver"),
        ({"server_steps": 0}, "pfedhb.server_steps"),
        ({"server_lr": 0.0}, "pfedhb.server_lr"),
        ({"server_milestones": (80, 60)}, "pfedhb.server_milestones"),
        ({"server_gamma": 1.5}, "pfedhb.server_gamma"),
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
    from strategies.plumbing.personalised import PersonalisedStrategy
    from strategies.registry import PERSONALISED, build_personalised_strategy

    cohort = {"clients_per_round": 2, "sampling": "poisson", "population": 4, "seed": 0}
    for name in PERSONALISED:
        strategy = build_personalised_strategy(
            name, {}, **cohort, rounds=2, evaluate_every=1, head_layers=1
        )
        assert isinstance(strategy, PersonalisedStrategy), name


