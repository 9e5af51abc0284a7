"""Mean-field Gaussian layers: KL closed form, sampling, evaluation, ECE, refused configs."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from fedsim.config import ConfigError
from fedsim.workloads.bayesian import (
    BayesSpec,
    build_bayes_model,
    calibration_bins,
    check_split,
    expected_calibration_error,
    kl_normal,
    model_arrays,
    predict_proba,
    softplus,
    softplus_inverse,
)


def test_kl_closed_form_matches_monte_carlo():
    gen = torch.Generator().manual_seed(0)
    mu_q, mu_p = torch.randn(6, generator=gen), torch.randn(6, generator=gen)
    s_q, s_p = torch.rand(6, generator=gen) + 0.3, torch.rand(6, generator=gen) + 0.3
    exact = float(kl_normal(mu_q, s_q, mu_p, s_p))
    z = mu_q + s_q * torch.randn(200_000, 6, generator=gen, dtype=torch.float64)
    q = torch.distributions.Normal(mu_q.double(), s_q.double())
    p = torch.distributions.Normal(mu_p.double(), s_p.double())
    estimate = float((q.log_prob(z) - p.log_prob(z)).sum(1).mean())
    assert abs(exact - estimate) < 0.05 * max(1.0, exact)
    assert float(kl_normal(mu_q, s_q, mu_q, s_q)) == pytest.approx(0.0, abs=1e-6)


def test_softplus_inverse_round_trips():
    sigma = np.array([1e-6, 0.018, 1.0, 30.0])
    np.testing.assert_allclose(softplus(softplus_inverse(sigma)), sigma, rtol=1e-9)


def test_sampled_forward_spreads_around_the_mean():
    spec = BayesSpec(in_features=4, hidden=(8,), num_classes=3, rho_init=-1.0)
    model = build_bayes_model(spec, 0)
    x = torch.randn(5, 4, generator=torch.Generator().manual_seed(1))
    torch.manual_seed(0)
    draws = model(x.expand(4000, 5, 4), sample=True)
    assert draws.shape == (4000, 5, 3)
    assert float(draws.detach().std(0).min()) > 0.05
    mean_only = predict_proba(model, x)
    mc = predict_proba(model, x, 50, torch.Generator().manual_seed(2))
    assert mean_only.shape == mc.shape == (5, 3)
    np.testing.assert_allclose(mc.sum(1).numpy(), 1.0, atol=1e-5)


def test_expected_calibration_error():
    probs = np.array([[0.9, 0.1], [0.9, 0.1], [0.6, 0.4], [0.3, 0.7]])
    labels = np.array([0, 1, 0, 1])
    count, conf, correct = calibration_bins(probs, labels, num_bins=10)
    # bins: 0.9 (two rows, half right), 0.6 (right), 0.7 (right)
    expected = (2 * abs(0.5 - 0.9) + abs(1 - 0.6) + abs(1 - 0.7)) / 4
    assert expected_calibration_error(count, conf, correct) == pytest.approx(expected)


@pytest.mark.parametrize(
    ("kwargs", "key"),
    [
        ({"rho_init": -200.0}, "model.rho_init"),
        ({"rho_init": float("nan")}, "model.rho_init"),
        ({"head_layers": 2}, "model.head_layers"),
        ({"head_layers": 0}, "model.head_layers"),
        ({"hidden": ()}, "model.hidden"),
    ],
)
def test_bad_model_configs_are_refused(kwargs, key):
    with pytest.raises(ConfigError, match=key) as err:
        BayesSpec(in_features=4, **{"hidden": (8,), **kwargs})
    assert "allowed" in str(err.value)


def test_split_checks_the_arrays():
    arrays = model_arrays(build_bayes_model(BayesSpec(in_features=4, hidden=(8, 6)), 0))
    check_split(list(arrays), 1)
    with pytest.raises(ConfigError, match="model.head_layers = 2"):
        check_split(list(arrays), 2)
    del arrays["head.0.bias_rho"]
    with pytest.raises(ValueError, match="head.0.bias_rho"):
        check_split(list(arrays), 1)
