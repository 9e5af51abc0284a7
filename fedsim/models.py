"""Standard small torch models for federated benchmarks.

A :class:`ModelSpec` names a model and its shapes; :func:`build_model` makes
it. Specs are small, hashable and picklable, so a ClientApp can carry one and
each worker process builds (and then reuses) its model once.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

import numpy as np
import torch
from torch import nn

from fedsim.config import require


@dataclass(frozen=True, kw_only=True)
class ModelSpec:
    """Which model, for which inputs.

    Attributes:
        kind: "logreg" (multinomial logistic regression), "mlp" (one hidden
            layer per entry of ``hidden``, ReLU) or "cnn" (LeNet-5 style: two
            5x5 conv + 2x2 max-pool blocks, then ``hidden`` fully connected layers).
        input_shape: shape of one example, e.g. (1, 28, 28) or (60,).
        num_classes: output logits.
        hidden: widths of the hidden fully connected layers (mlp, cnn).
        channels: conv channels (cnn).
    """

    kind: Literal["logreg", "mlp", "cnn"]
    input_shape: tuple[int, ...]
    num_classes: int
    hidden: tuple[int, ...] = (64,)
    channels: tuple[int, ...] = (6, 16)

    def __post_init__(self) -> None:
        require(
            len(self.input_shape) >= 1 and all(s >= 1 for s in self.input_shape),
            "model.input_shape",
            self.input_shape,
            "positive dimensions",
        )
        require(self.num_classes >= 2, "model.num_classes", self.num_classes, "an integer >= 2")
        require(all(h >= 1 for h in self.hidden), "model.hidden", self.hidden, "positive widths")
        if self.kind == "cnn":
            require(
                len(self.input_shape) == 3,
                "model.input_shape",
                self.input_shape,
                "(channels, height, width) for a cnn",
            )
            require(
                len(self.channels) == 2 and all(c >= 1 for c in self.channels),
                "model.channels",
                self.channels,
                "two positive channel counts",
            )


def _dense(in_features: int, hidden: tuple[int, ...], out_features: int) -> nn.Sequential:
    """Linear layers of the given widths with ReLU between them."""
    widths = [in_features, *hidden, out_features]
    layers: list[nn.Module] = []
    for a, b in zip(widths[:-1], widths[1:], strict=True):
        layers += [nn.Linear(a, b), nn.ReLU()]
    return nn.Sequential(*layers[:-1])


class SmallCNN(nn.Module):
    """LeNet-5 style CNN (LeCun et al. 1998): conv5-pool2-conv5-pool2-fc...-fc.

    Convolutions are padded ('same') for inputs smaller than 16 pixels (e.g.
    8x8 digits) so that both pooling steps fit.
    """

    def __init__(
        self,
        input_shape: tuple[int, int, int],
        num_classes: int,
        channels: tuple[int, int],
        hidden: tuple[int, ...],
    ) -> None:
        super().__init__()
        c, h, w = input_shape
        pad = 2 if min(h, w) < 16 else 0
        self.conv1 = nn.Conv2d(c, channels[0], 5, padding=pad)
        self.conv2 = nn.Conv2d(channels[0], channels[1], 5, padding=pad)
        size_h, size_w = h, w
        for _ in range(2):
            size_h = (size_h + 2 * pad - 4) // 2
            size_w = (size_w + 2 * pad - 4) // 2
        if size_h < 1 or size_w < 1:
            raise ValueError(f"input {input_shape} is too small for the cnn")
        self.fc = _dense(channels[1] * size_h * size_w, hidden, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = nn.functional.max_pool2d(torch.relu(self.conv1(x)), 2)
        x = nn.functional.max_pool2d(torch.relu(self.conv2(x)), 2)
        return self.fc(x.flatten(1))


class MLP(nn.Module):
    """Fully connected network on flattened inputs; no hidden layer = logistic regression."""

    def __init__(self, in_features: int, num_classes: int, hidden: tuple[int, ...]) -> None:
        super().__init__()
        self.layers = _dense(in_features, hidden, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.layers(x.flatten(1))


def build_model(spec: ModelSpec) -> nn.Module:
    """A fresh model for ``spec`` (weights from torch's default initialisers)."""
    if spec.kind == "cnn":
        c, h, w = spec.input_shape
        return SmallCNN(
            (c, h, w), spec.num_classes, (spec.channels[0], spec.channels[1]), spec.hidden
        )
    in_features = math.prod(spec.input_shape)
    return MLP(in_features, spec.num_classes, () if spec.kind == "logreg" else spec.hidden)


def initial_arrays(spec: ModelSpec, seed: int) -> dict[str, np.ndarray]:
    """Initial global weights drawn from ``seed`` (torch's global RNG untouched)."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = build_model(spec)
    return {k: v.detach().numpy().copy() for k, v in model.state_dict().items()}


def load_arrays(model: nn.Module, arrays: dict[str, np.ndarray]) -> None:
    """Copy ``arrays`` into ``model``'s parameters and buffers in place."""
    state = model.state_dict(keep_vars=True)
    if state.keys() != arrays.keys():
        missing = sorted(set(state) ^ set(arrays))
        raise ValueError(f"arrays do not match the model; differing keys: {missing[:5]}")
    for key, tensor in state.items():
        # Write through a numpy view of the tensor: no copy of the (possibly
        # read-only) source into an intermediate tensor.
        np.copyto(tensor.detach().numpy(), arrays[key], casting="same_kind")


def model_arrays(model: nn.Module) -> dict[str, np.ndarray]:
    """The model's weights as numpy arrays (views of the tensors, no copy)."""
    return {k: v.detach().numpy() for k, v in model.state_dict().items()}
