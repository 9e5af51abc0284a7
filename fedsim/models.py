"""Standard small torch models for federated benchmarks, and the user's own.

A :class:`ModelSpec` names a model and its shapes; :func:`build_model` makes
it. Specs are small, hashable and picklable, so a ClientApp can carry one and
each worker process builds (and then reuses) its model once.

``kind = "factory"`` is any ``torch.nn.Module`` the user's function returns: the spec
carries the function's import string (``"package.module:function"``), its keyword options
and the directories to import it from, and each process resolves it again
(:func:`fedsim.config.import_reference`). The function gets ``input_shape`` and
``num_classes`` when its signature names them (or takes ``**kwargs``).

Devices: a spec's ``device`` says where a worker trains (``cpu``, ``cuda``, ``cuda:N``,
``mps``); :func:`build_model` always builds on the CPU (so initial weights do not depend on
the device) and :func:`place` moves a model; :func:`load_arrays` and :func:`model_arrays`
copy weights across devices.
"""

from __future__ import annotations

import inspect
import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

import numpy as np
import torch
from torch import nn

from fedsim.config import ConfigError, device_name, frozen, import_reference, require

#: keyword arguments a model factory gets from the data (when its signature names them)
DATA_ARGUMENTS = ("input_shape", "num_classes")


@dataclass(frozen=True, kw_only=True)
class ModelSpec:
    """Which model, for which inputs.

    Attributes:
        kind: "logreg" (multinomial logistic regression), "mlp" (one hidden
            layer per entry of ``hidden``, ReLU), "cnn" (LeNet-5 style: two
            5x5 conv + 2x2 max-pool blocks, then ``hidden`` fully connected layers)
            or "factory" (the module ``factory`` returns).
        input_shape: shape of one example, e.g. (1, 28, 28) or (60,).
        num_classes: output logits.
        hidden: widths of the hidden fully connected layers (mlp, cnn).
        channels: conv channels (cnn).
        factory: "package.module:function" returning a ``torch.nn.Module`` (kind "factory").
        options: the factory's keyword arguments.
        python_path: directories put first on ``sys.path`` to import the factory.
        device: where workers train the model: "cpu", "cuda", "cuda:N" or "mps".
    """

    kind: Literal["logreg", "mlp", "cnn", "factory"]
    input_shape: tuple[int, ...]
    num_classes: int
    hidden: tuple[int, ...] = (64,)
    channels: tuple[int, ...] = (6, 16)
    factory: str = ""
    options: Mapping[str, Any] = field(default_factory=dict)
    python_path: tuple[str, ...] = ()
    device: str = "cpu"

    def __hash__(self) -> int:  # options is a table: hash its frozen copy
        return hash(
            (
                self.kind,
                self.input_shape,
                self.num_classes,
                self.hidden,
                self.channels,
                self.factory,
                frozen(self.options),
                self.python_path,
                self.device,
            )
        )

    def __post_init__(self) -> None:
        device_name(self.device, "model.device")
        require(
            (self.kind == "factory") == bool(self.factory),
            "model.factory",
            self.factory,
            "a 'package.module:function' reference exactly when kind is 'factory'",
        )
        require(
            self.kind == "factory" or not self.options,
            "model.options",
            dict(self.options),
            "no options unless the model comes from a factory",
        )
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


def factory_arguments(function: Any, spec: ModelSpec) -> dict[str, Any]:
    """The keyword arguments ``function`` gets: the spec's options, plus ``input_shape`` and
    ``num_classes`` when its signature names them or takes ``**kwargs``."""
    for name in DATA_ARGUMENTS:
        require(
            name not in spec.options,
            f"model.{name}",
            spec.options.get(name),
            "no such option: the factory gets it from the data",
        )
    try:
        parameters = inspect.signature(function).parameters
    except (TypeError, ValueError):  # a builtin without a signature: options only
        parameters = {}
    open_ended = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters.values())
    data = {"input_shape": tuple(spec.input_shape), "num_classes": spec.num_classes}
    chosen = {k: v for k, v in data.items() if open_ended or k in parameters}
    return {**chosen, **dict(spec.options)}


def factory_model(spec: ModelSpec) -> nn.Module:
    """The module ``spec.factory`` returns (on the CPU), called with
    :func:`factory_arguments`; failures name ``model.factory``."""
    function = import_reference(spec.factory, "model.factory", spec.python_path)
    arguments = factory_arguments(function, spec)
    try:
        model = function(**arguments)
    except TypeError as err:
        raise ConfigError(
            "model.factory",
            spec.factory,
            f"a function accepting the keyword arguments {sorted(arguments)} ({err})",
        ) from err
    require(
        isinstance(model, nn.Module),
        "model.factory",
        spec.factory,
        f"a function returning a torch.nn.Module (it returned a {type(model).__name__})",
    )
    return model.to("cpu")


def check_model(spec: ModelSpec) -> None:
    """Refuse a model whose output on a batch of 2 zero examples is not (2, num_classes)
    logits, or that has no parameters to train (the key named is ``model.factory`` for a
    factory model, else ``model.kind``)."""
    factory = spec.kind == "factory"
    key, value = ("model.factory", spec.factory) if factory else ("model.kind", spec.kind)
    model = build_model(spec)
    require(
        any(p.requires_grad for p in model.parameters()),
        key,
        value,
        "a model with trainable parameters",
    )
    model.eval()
    with torch.no_grad():
        try:
            out = model(torch.zeros((2, *spec.input_shape)))
        except Exception as err:  # the user's forward: report it under the key
            raise ConfigError(
                key,
                value,
                f"a model whose forward takes a float32 batch of shape (n, *{spec.input_shape}) "
                f"({type(err).__name__}: {err})",
            ) from err
    want = (2, spec.num_classes)
    got = tuple(out.shape) if isinstance(out, torch.Tensor) else type(out).__name__
    require(
        got == want,
        key,
        value,
        f"a model returning logits of shape (n, num_classes) = {want} for a batch of 2 "
        f"(it returned {got})",
    )


def build_model(spec: ModelSpec) -> nn.Module:
    """A fresh model for ``spec`` on the CPU (weights from torch's default initialisers, or
    the factory's)."""
    if spec.kind == "factory":
        return factory_model(spec)
    if spec.kind == "cnn":
        c, h, w = spec.input_shape
        return SmallCNN(
            (c, h, w), spec.num_classes, (spec.channels[0], spec.channels[1]), spec.hidden
        )
    in_features = math.prod(spec.input_shape)
    return MLP(in_features, spec.num_classes, () if spec.kind == "logreg" else spec.hidden)


def place(model: nn.Module, device: str) -> nn.Module:
    """``model`` moved to ``device`` (in place); a device this process lacks is a clear
    RuntimeError naming it."""
    try:
        return model.to(device)
    except (RuntimeError, AssertionError) as err:  # torch: no CUDA build / no such GPU
        raise RuntimeError(
            f"engine.device = {device!r}: this worker cannot use it ({err}); use 'cpu', or run "
            "where that device exists (a CUDA build of torch for 'cuda')"
        ) from err


def model_device(model: nn.Module) -> torch.device:
    """The device of ``model``'s parameters (input tensors are built there; CPU for a model
    without parameters)."""
    try:
        return next(model.parameters()).device
    except StopIteration:
        return torch.device("cpu")


def check_device_available(device: str, key: str = "engine.device") -> None:
    """Refuse, before anything runs, a device this machine does not have: ``cuda`` without
    ``torch.cuda.is_available()``, ``cuda:N`` beyond its GPUs, ``mps`` without Metal."""
    device_name(device, key)
    if device.startswith("cuda"):
        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
        index = int(device[5:]) if ":" in device else 0
        require(
            index < count,
            key,
            device,
            f"a device this machine has: torch {torch.__version__} sees {count} CUDA GPU(s)"
            + ("" if count else " (install a CUDA build of torch, or use 'cpu')"),
        )
    elif device == "mps":
        require(
            torch.backends.mps.is_available(),
            key,
            device,
            "a device this machine has: torch.backends.mps.is_available() is false",
        )


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
        copy_into(tensor, arrays[key], key)


def copy_into(tensor: torch.Tensor, array: np.ndarray, key: str) -> None:
    """Copy ``array`` into ``tensor`` in place (numpy's "same_kind" casting), on any device."""
    if tensor.device.type == "cpu":
        # Write through a numpy view of the tensor: no copy of the (possibly
        # read-only) source into an intermediate tensor.
        np.copyto(tensor.detach().numpy(), array, casting="same_kind")
        return
    source = np.asarray(array)
    target = torch.empty(0, dtype=tensor.dtype).numpy().dtype
    if not np.can_cast(source.dtype, target, "same_kind") or source.shape != tuple(tensor.shape):
        raise ValueError(f"array {key!r} {source.dtype}{source.shape} does not fit the model")
    with torch.no_grad():
        tensor.copy_(torch.from_numpy(np.array(source, dtype=target)))


def model_arrays(model: nn.Module) -> dict[str, np.ndarray]:
    """The model's weights as numpy arrays (views of the tensors on the CPU, no copy;
    copies from another device)."""
    return {k: v.detach().cpu().numpy() for k, v in model.state_dict().items()}
