"""Least squares on a node's own synthetic data: y = X w* + 0.1 noise, X of shape (n, 3).

Everything is float64 and drawn from the partition id alone, so a node's data, and every
update it computes, is the same under any runtime.
"""

import numpy as np

DIM = 3
TRUE_W = np.array([1.0, -2.0, 0.5])


def node_data(partition_id: int) -> tuple[np.ndarray, np.ndarray]:
    """Node ``partition_id``'s (X, y): 10 + 5 * partition_id rows."""
    rng = np.random.default_rng(1000 + partition_id)
    rows = 10 + 5 * partition_id
    x = rng.normal(loc=0.3 * partition_id, size=(rows, DIM))
    y = x @ TRUE_W + 0.7 + 0.1 * rng.normal(size=rows)
    return x, y


def initial_parameters() -> list[np.ndarray]:
    """The model every node starts from: weights (3,) and bias (1,), all zero."""
    return [np.zeros(DIM), np.zeros(1)]


def mse(params: list[np.ndarray], x: np.ndarray, y: np.ndarray) -> float:
    w, b = params
    return float(np.mean((x @ w + b[0] - y) ** 2))


def train(
    params: list[np.ndarray], x: np.ndarray, y: np.ndarray, steps: int, lr: float, mu: float
) -> list[np.ndarray]:
    """``steps`` of gradient descent on the MSE, plus FedProx's (mu / 2) ||w - w_global||^2."""
    w, b = (p.copy() for p in params)
    w0, b0 = (p.copy() for p in params)
    for _ in range(steps):
        residual = x @ w + b[0] - y
        grad_w = 2 * x.T @ residual / len(y) + mu * (w - w0)
        grad_b = np.array([2 * residual.mean()]) + mu * (b - b0)
        w, b = w - lr * grad_w, b - lr * grad_b
    return [w, b]
