"""Model, data and training for the quickstart app (plain torch, no fedsim)."""

import numpy as np
import torch
from torch import nn


class Net(nn.Module):
    """A small MLP classifier on 8 features, 3 classes."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(8, 16)
        self.fc2 = nn.Linear(16, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(torch.relu(self.fc1(x)))


def load_data(partition_id: int, num_partitions: int):
    """Each partition's data, generated from its id (no download)."""
    rng = np.random.default_rng(1000 + partition_id)
    n = 20 + 5 * (partition_id % 4)
    centers = np.array([[1.0] * 8, [-1.0] * 8, [1.0, -1.0] * 4])
    y = rng.integers(0, 3, size=n)
    x = centers[y] + rng.normal(scale=1.0, size=(n, 8))
    return torch.tensor(x, dtype=torch.float32), torch.tensor(y, dtype=torch.int64)


def train(net: Net, x, y, epochs: int, lr: float, seed: int) -> float:
    """Plain SGD with batch size 8; shuffling drawn from ``seed``."""
    gen = torch.Generator().manual_seed(seed)
    opt = torch.optim.SGD(net.parameters(), lr=lr)
    net.train()
    total = 0.0
    for _ in range(epochs):
        order = torch.randperm(len(y), generator=gen)
        for start in range(0, len(y), 8):
            idx = order[start : start + 8]
            opt.zero_grad()
            loss = nn.functional.cross_entropy(net(x[idx]), y[idx])
            loss.backward()
            opt.step()
            total += loss.item()
    return total


def test(net: Net, x, y) -> tuple[float, float]:
    net.eval()
    with torch.no_grad():
        out = net(x)
        loss = nn.functional.cross_entropy(out, y).item()
        acc = (out.argmax(1) == y).float().mean().item()
    return loss, acc
