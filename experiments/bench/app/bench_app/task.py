"""Model, data and training of the benchmark app: plain torch, generated data."""

import numpy as np
import torch
from torch import nn

FEATURES, CLASSES = 16, 4


class Net(nn.Module):
    """A small MLP: 16 features, 32 hidden units, 4 classes."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(FEATURES, 32)
        self.fc2 = nn.Linear(32, CLASSES)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(torch.relu(self.fc1(x)))


def load_data(partition_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Partition ``partition_id``'s 32 rows: Gaussian clusters around one centre per class."""
    rng = np.random.default_rng(1000 + partition_id)
    centres = np.random.default_rng(0).normal(size=(CLASSES, FEATURES))
    y = rng.integers(0, CLASSES, size=32)
    x = centres[y] + rng.normal(scale=1.0, size=(32, FEATURES))
    return torch.tensor(x, dtype=torch.float32), torch.tensor(y, dtype=torch.int64)


def train(net: Net, x: torch.Tensor, y: torch.Tensor, epochs: int, lr: float, seed: int) -> float:
    """SGD with batch size 8 and shuffling from ``seed``; returns the mean batch loss."""
    generator = torch.Generator().manual_seed(seed)
    optimizer = torch.optim.SGD(net.parameters(), lr=lr)
    net.train()
    total, batches = 0.0, 0
    for _ in range(epochs):
        order = torch.randperm(len(y), generator=generator)
        for start in range(0, len(y), 8):
            index = order[start : start + 8]
            optimizer.zero_grad()
            loss = nn.functional.cross_entropy(net(x[index]), y[index])
            loss.backward()
            optimizer.step()
            total, batches = total + loss.item(), batches + 1
    return total / max(batches, 1)
