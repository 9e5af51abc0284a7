"""MARS (AdamW / Lion variants), R-AdaZO and ZO-AdaMM against their checks."""

import numpy as np
import pytest
import torch

from fedsim.config import ConfigError, from_mapping
from fedsim.workloads.optim import MARS, ClientOptimizer, RAdaZO, ZOAdaMM, build_optimizer


def gradient_stream(steps, shape, scale, seed):
    g = torch.Generator().manual_seed(seed)
    return [scale * torch.randn(shape, generator=g, dtype=torch.float64) for _ in range(steps)]


def run_with_gradients(optimizer_cls, grads, start, **kwargs):
    p = torch.nn.Parameter(start.clone())
    optimizer = optimizer_cls([p], **kwargs)
    for grad in grads:
        p.grad = grad.clone()
        optimizer.step()
    return p.detach()


def small(grads):
    """The same directions with every per-tensor norm at most 1."""
    return [g / max(1.0, 1.01 * float(torch.linalg.vector_norm(g))) for g in grads]


def test_mars_adamw_with_gamma_0_and_small_gradients_is_adamw():
    grads = small(gradient_stream(60, (6, 5), 1.0, 0))
    start = torch.randn(6, 5, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    common = dict(lr=3e-3, betas=(0.95, 0.99), eps=1e-8, weight_decay=0.01)
    mars = run_with_gradients(MARS, grads, start, gamma=0.0, **common)
    adamw = run_with_gradients(torch.optim.AdamW, grads, start, **common)
    assert float((mars - adamw).abs().max()) < 1e-12
    assert float((mars - start).abs().max()) > 0.05


def test_mars_clips_large_corrected_gradients_per_tensor():
    grads = gradient_stream(40, (6, 5), 10.0, 2)  # norms far above 1
    start = torch.zeros(6, 5, dtype=torch.float64)
    mars = run_with_gradients(MARS, grads, start, gamma=0.0)
    adamw_raw = run_with_gradients(
        torch.optim.AdamW, grads, start, lr=3e-3, betas=(0.95, 0.99), weight_decay=0.0
    )
    unit = [g / torch.linalg.vector_norm(g) for g in grads]
    adamw_unit = run_with_gradients(
        torch.optim.AdamW, unit, start, lr=3e-3, betas=(0.95, 0.99), weight_decay=0.0
    )
    assert float((mars - adamw_unit).abs().max()) < 1e-12
    assert float((mars - adamw_raw).abs().max()) > 1e-4


def test_mars_correction_vanishes_for_repeated_gradients_and_acts_otherwise():
    grad = gradient_stream(1, (4, 3), 0.1, 3)[0]
    start = torch.zeros(4, 3, dtype=torch.float64)
    constant = [grad] * 20
    with_gamma = run_with_gradients(MARS, constant, start, gamma=0.5)
    without = run_with_gradients(MARS, constant, start, gamma=0.0)
    assert float((with_gamma - without).abs().max()) < 1e-15
    varying = small(gradient_stream(20, (4, 3), 0.1, 4))
    assert not torch.allclose(
        run_with_gradients(MARS, varying, start, gamma=0.5),
        run_with_gradients(MARS, varying, start, gamma=0.0),
    )


def test_mars_vectors_fall_back_to_adamw_on_the_raw_gradient():
    grads = gradient_stream(30, (7,), 5.0, 5)  # large: MARS would clip, AdamW does not
    start = torch.ones(7, dtype=torch.float64)
    mars = run_with_gradients(
        MARS, grads, start, gamma=0.5, betas_1d=(0.9, 0.95), weight_decay_1d=0.1
    )
    adamw = run_with_gradients(
        torch.optim.AdamW, grads, start, lr=3e-3, betas=(0.9, 0.95), weight_decay=0.1
    )
    assert float((mars - adamw).abs().max()) < 1e-12


def test_mars_lion_steps_by_the_sign_of_the_momentum():
    grad = torch.tensor([[0.3, -0.2], [0.0, 5.0]], dtype=torch.float64)
    start = torch.zeros(2, 2, dtype=torch.float64)
    moved = run_with_gradients(MARS, [grad] * 3, start, lr=0.01, variant="mars-lion")
    np.testing.assert_allclose(moved.numpy(), [[-0.03, 0.03], [0.0, -0.03]], atol=1e-15)


@pytest.mark.parametrize("variant", ["mars-adamw", "mars-lion"])
def test_mars_minimises_a_noisy_least_squares_problem(variant):
    gen = torch.Generator().manual_seed(6)
    a = torch.randn(64, 10, generator=gen)
    w_true = torch.randn(10, 3, generator=gen)
    y = a @ w_true
    w = torch.nn.Parameter(torch.zeros(10, 3))
    optimizer = MARS([w], lr=0.02, variant=variant)
    for _ in range(400):
        rows = torch.randint(0, 64, (16,), generator=gen)
        optimizer.zero_grad()
        loss = ((a[rows] @ w - y[rows]) ** 2).mean()
        loss.backward()
        optimizer.step()
    assert float(((a @ w.detach() - y) ** 2).mean()) < 0.02 * float((y**2).mean())


def test_r_adazo_first_moment_reduces_the_estimate_variance_by_1_minus_beta_over_1_plus_beta():
    # On a linear loss the estimates are i.i.d. whatever x is.
    weights = torch.linspace(-1, 1, 20, dtype=torch.float64)
    x = torch.nn.Parameter(torch.zeros(20, dtype=torch.float64))
    beta1 = 0.9
    optimizer = RAdaZO([x], generator=torch.Generator().manual_seed(0), betas=(beta1, 0.999))
    moments, estimates = [], []
    for _ in range(4000):
        optimizer.step(lambda: (weights * x).sum())
        moments.append(optimizer.state[x]["exp_avg"].clone())
        estimates.append(optimizer.state[x]["grad_estimate"].clone())
    ratio = torch.stack(moments[200:]).var(0).mean() / torch.stack(estimates[200:]).var(0).mean()
    assert float(ratio) == pytest.approx((1 - beta1) / (1 + beta1), rel=0.1)


def test_zeroth_order_estimate_is_unbiased_for_a_linear_loss():
    weights = torch.tensor([1.0, -2.0, 0.5], dtype=torch.float64)
    x = torch.nn.Parameter(torch.zeros(3, dtype=torch.float64))
    optimizer = ZOAdaMM([x], generator=torch.Generator().manual_seed(1), q=4)
    estimates = []
    for _ in range(3000):
        optimizer.step(lambda: (weights * x).sum())
        estimates.append(optimizer.state[x]["grad_estimate"].clone())
    mean = torch.stack(estimates).mean(0)
    np.testing.assert_allclose(mean.numpy(), weights.numpy(), atol=0.1)


def quadratic_loss_after(cls, lr, seed, steps=300, dim=10):
    x = torch.nn.Parameter(torch.ones(dim, dtype=torch.float64))
    optimizer = cls([x], generator=torch.Generator().manual_seed(seed), lr=lr)
    for _ in range(steps):
        optimizer.step(lambda: 0.5 * (x * x).sum())
    return 0.5 * float((x.detach() ** 2).sum())


def test_r_adazo_is_faster_than_zo_adamm_at_a_small_matched_lr():
    refined = np.mean([quadratic_loss_after(RAdaZO, 1e-3, s) for s in range(4)])
    plain = np.mean([quadratic_loss_after(ZOAdaMM, 1e-3, s) for s in range(4)])
    assert refined < 0.5 * plain < 5.0  # both moved from 5.0


def test_zeroth_order_steps_never_call_backward_and_restore_the_point_before_updating():
    x = torch.nn.Parameter(torch.ones(4))
    optimizer = RAdaZO([x], generator=torch.Generator().manual_seed(2), lr=1e-2)
    calls = []

    def loss():
        calls.append(x.detach().clone())
        return (x * x).sum()

    optimizer.step(loss)
    assert len(calls) == 3 and x.grad is None  # f(x) and q = 2 perturbed points
    assert torch.equal(calls[0], torch.ones(4))


def test_same_generator_seed_gives_the_same_trajectory():
    runs = [quadratic_loss_after(RAdaZO, 1e-2, 9, steps=20) for _ in range(2)]
    assert runs[0] == runs[1]


def test_bad_arguments_name_themselves():
    p = [torch.nn.Parameter(torch.zeros(2, 2))]
    with pytest.raises(ValueError, match="variant"):
        MARS(p, variant="mars-sgd")
    with pytest.raises(ValueError, match="betas"):
        MARS(p, betas=(0.9, 1.0))
    with pytest.raises(ValueError, match="generator"):
        RAdaZO(p, generator=None)
    with pytest.raises(ValueError, match="closure"):
        ZOAdaMM(p, generator=torch.Generator()).step()
    with pytest.raises(ConfigError, match="client.optimizer.name"):
        from_mapping(ClientOptimizer, {"name": "adam"}, "client.optimizer")
    with pytest.raises(ConfigError, match="client.optimizer.q"):
        ClientOptimizer(name="r-adazo", q=0)


@pytest.mark.parametrize("name", ["sgd", "mars-adamw", "mars-lion", "r-adazo", "zo-adamm"])
def test_build_optimizer_uses_paper_defaults(name):
    p = [torch.nn.Parameter(torch.zeros(2, 2))]
    optimizer = build_optimizer(
        ClientOptimizer(name=name), p, generator=torch.Generator(), sgd_lr=0.1
    )
    expected = {
        "sgd": 0.1,
        "mars-adamw": 3e-3,
        "mars-lion": 3e-3,
        "r-adazo": 1e-3,
        "zo-adamm": 1e-3,
    }
    assert optimizer.param_groups[0]["lr"] == expected[name]
    if name.startswith("mars"):
        assert optimizer.param_groups[0]["betas"] == (0.95, 0.99)
        assert optimizer.param_groups[0]["gamma"] == 0.025
