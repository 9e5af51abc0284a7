"""Workload matrices: prefix sums and SGD with momentum and a learning-rate schedule."""

from __future__ import annotations

import numpy as np
import pytest

from fedsim.config import ConfigError
from fedsim.privacy.matrix.workload_matrices import momentum, prefix_sum


def test_prefix_sum_answers_running_totals():
    x = np.arange(1.0, 7.0)
    assert np.array_equal(prefix_sum(6) @ x, np.cumsum(x))


def test_momentum_without_momentum_and_unit_rate_is_prefix_sum():
    assert np.array_equal(momentum(9, 0.0, 1.0), prefix_sum(9))


@pytest.mark.parametrize("beta", [0.0, 0.5, 0.9])
def test_momentum_workload_reproduces_sgd_with_momentum(beta):
    n, rng = 12, np.random.default_rng(3)
    eta = rng.uniform(0.05, 1.0, n)
    grads = rng.standard_normal((n, 4))
    theta, m, moved = np.zeros(4), np.zeros(4), []
    for t in range(n):
        m = beta * m + grads[t]
        theta = theta - eta[t] * m
        moved.append(-theta)
    assert np.allclose(momentum(n, beta, eta) @ grads, np.array(moved), atol=1e-12)


def test_momentum_workload_is_lower_triangular_and_invertible():
    A = momentum(10, 0.9, np.linspace(1.0, 0.1, 10))
    assert np.array_equal(A, np.tril(A))
    assert np.all(np.diag(A) > 0)


@pytest.mark.parametrize(
    ("kwargs", "key"),
    [
        ({"momentum": 1.0}, "momentum"),
        ({"momentum": -0.1}, "momentum"),
        ({"learning_rates": [1.0, 2.0]}, "learning_rates"),
        ({"learning_rates": 0.0}, "learning_rates"),
    ],
)
def test_momentum_rejects_bad_arguments_by_name(kwargs, key):
    with pytest.raises(ConfigError, match=key):
        momentum(5, **kwargs)


def test_rounds_must_be_positive():
    with pytest.raises(ConfigError, match="n = 0"):
        prefix_sum(0)
