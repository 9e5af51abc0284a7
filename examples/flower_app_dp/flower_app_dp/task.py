"""Model, data and training: softmax regression in numpy on generated data (no download)."""

import numpy as np

FEATURES, CLASSES = 8, 3
#: one centre per class; a row is its class's centre plus standard normal noise
CENTRES = np.array([[1.0] * FEATURES, [-1.0] * FEATURES, [1.0, -1.0] * (FEATURES // 2)])


def initial_model() -> dict[str, np.ndarray]:
    """Zero weights ``w`` (features x classes) and biases ``b`` (float32)."""
    return {
        "w": np.zeros((FEATURES, CLASSES), dtype=np.float32),
        "b": np.zeros(CLASSES, dtype=np.float32),
    }


def rows(seed: int, n: int) -> tuple[np.ndarray, np.ndarray]:
    """``n`` labelled rows drawn from ``seed``."""
    rng = np.random.default_rng(seed)
    y = rng.integers(0, CLASSES, size=n)
    x = CENTRES[y] + rng.normal(size=(n, FEATURES))
    return x.astype(np.float32), y


def load_partition(partition_id: int) -> tuple[np.ndarray, np.ndarray]:
    """A node's own rows (20 to 35 of them), generated from its partition id."""
    return rows(1000 + partition_id, 20 + 5 * (partition_id % 4))


def held_out() -> tuple[np.ndarray, np.ndarray]:
    """The server's own held-out rows."""
    return rows(7, 300)


def _probabilities(model: dict[str, np.ndarray], x: np.ndarray) -> np.ndarray:
    logits = x @ model["w"] + model["b"]
    logits -= logits.max(axis=1, keepdims=True)
    p = np.exp(logits)
    return p / p.sum(axis=1, keepdims=True)


def train(model, x, y, epochs: int, lr: float, seed: int) -> float:
    """Mini-batch SGD (batch 8) on the cross-entropy; returns the last loss."""
    rng = np.random.default_rng(seed)
    w, b = model["w"].astype(np.float64), model["b"].astype(np.float64)
    loss = 0.0
    for _ in range(epochs):
        order = rng.permutation(len(y))
        for start in range(0, len(y), 8):
            idx = order[start : start + 8]
            p = _probabilities({"w": w, "b": b}, x[idx])
            loss = float(-np.log(p[np.arange(len(idx)), y[idx]] + 1e-12).mean())
            p[np.arange(len(idx)), y[idx]] -= 1.0
            w -= lr * x[idx].T @ p / len(idx)
            b -= lr * p.mean(axis=0)
    model["w"], model["b"] = w.astype(np.float32), b.astype(np.float32)
    return loss


def evaluate(model, x, y) -> tuple[float, float]:
    """(cross-entropy loss, accuracy) of ``model`` on ``x, y``."""
    p = _probabilities(model, x)
    loss = float(-np.log(p[np.arange(len(y)), y] + 1e-12).mean())
    return loss, float((p.argmax(axis=1) == y).mean())
