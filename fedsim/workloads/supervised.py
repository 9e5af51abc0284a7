"""The ``[client]`` table of supervised runs and the ClientApp it selects.

:class:`LocalTraining` is the one config object of local training: the step schedule
(:class:`~fedsim.workloads.training.LocalSteps`) plus one optional table per part -- DP-SGD,
constraints, LoRA and the client methods (optimiser, averaging, compression, conformal, SST).
Each part's module declares what it cannot be combined with (its ``EXCLUDES``, a list of
:class:`~fedsim.workloads.training.Exclusion`); :func:`check_parts` is the one place that
checks them, both for the table alone and for a run whose server adds FedProx's proximal term.
:func:`client_training` picks the implementation and :func:`make_client_app` turns it into a
Flower ClientApp (:mod:`fedsim.workloads.client_app`).

Without any table clients train with plain SGD (:mod:`fedsim.workloads.sgd`). With
``dp_sgd`` they train with sample-level DP-SGD (:mod:`fedsim.workloads.dp_sgd`, Opacus),
drawing batches and noise from their own secret, and their replies carry
``dp-sgd-epsilon``; their ``train_loss`` (un-noised) leaves the client only with
``metrics_in_clear``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, is_dataclass
from typing import Any

from flwr.clientapp import ClientApp

from fedsim.config import ConfigError, from_mapping, to_mapping
from fedsim.data import DatasetSpec
from fedsim.models import ModelSpec
from fedsim.workloads import constrained, dp_sgd, lora_client, methods
from fedsim.workloads.averaging import Averaging
from fedsim.workloads.client_app import training_app
from fedsim.workloads.client_method import ClientMethod
from fedsim.workloads.compression import Quantization
from fedsim.workloads.conformal import ConformalTraining
from fedsim.workloads.constrained import ConstrainedTraining, LinearConstraints
from fedsim.workloads.coto import LoRATraining
from fedsim.workloads.dp_sgd import DPSGD, PrivateSGD
from fedsim.workloads.lora_client import AdapterTraining
from fedsim.workloads.methods import MethodsTraining
from fedsim.workloads.optim.choice import ClientOptimizer
from fedsim.workloads.scaffold import METHOD as SCAFFOLD
from fedsim.workloads.scaffold import Scaffold
from fedsim.workloads.sgd import SGDTraining
from fedsim.workloads.sst import SparseSpectral
from fedsim.workloads.training import ClientTraining, Exclusion, LocalSteps

#: the client methods with a training of their own (and a server half where they talk to
#: their clients): one :class:`~fedsim.workloads.client_method.ClientMethod` each, whose
#: ``key`` is a table field of :class:`LocalTraining`
CLIENT_METHODS: tuple[ClientMethod, ...] = (SCAFFOLD,)

#: the optional tables of ``[client]``: key -> (config class, what it cannot be combined with)
PARTS: dict[str, tuple[type, tuple[Exclusion, ...]]] = {
    **{method.key: (method.table, method.excludes) for method in CLIENT_METHODS},
    "dp_sgd": (DPSGD, dp_sgd.EXCLUDES["dp_sgd"]),
    "optimizer": (ClientOptimizer, methods.EXCLUDES["optimizer"]),
    "averaging": (Averaging, methods.EXCLUDES["averaging"]),
    "compression": (Quantization, methods.EXCLUDES["compression"]),
    "conformal": (ConformalTraining, methods.EXCLUDES["conformal"]),
    "sst": (SparseSpectral, methods.EXCLUDES["sst"]),
    "constraints": (LinearConstraints, constrained.EXCLUDES["constraints"]),
    "lora": (LoRATraining, lora_client.EXCLUDES["lora"]),
}
METHODS = ("optimizer", "averaging", "compression", "conformal", "sst")


@dataclass(frozen=True, kw_only=True)
class LocalTraining(LocalSteps):
    """The ``[client]`` table: the step schedule (:class:`LocalSteps`: epochs, batch_size,
    lr, momentum, weight_decay, max_steps, keep_momentum, seed) and the optional tables.

    Attributes:
        dp_sgd: ``[client.dp_sgd]`` sample-level DP-SGD
            (:class:`~fedsim.workloads.dp_sgd.DPSGD`: noise_multiplier, max_grad_norm, delta,
            accountant, secure_mode); None: plain SGD.
        optimizer: ``[client.optimizer]``
            (:class:`~fedsim.workloads.optim.ClientOptimizer`: MARS-AdamW/Lion, R-AdaZO,
            ZO-AdaMM, HDM-HB); None: SGD.
        averaging: ``[client.averaging]`` LAWA/EMA of the local iterates, whose average is
            uploaded (:class:`~fedsim.workloads.averaging.Averaging`).
        compression: ``[client.compression]`` layer-wise quantised uploads
            (:class:`~fedsim.workloads.compression.Quantization`).
        conformal: ``[client.conformal]`` conformal training objective (DPSM,
            :class:`~fedsim.workloads.conformal.ConformalTraining`).
        sst: ``[client.sst]`` sparse spectral training of the Linear layers
            (:class:`~fedsim.workloads.sst.SparseSpectral`: rank, period, resvd_every).
        constraints: ``[client.constraints]`` per-client linear inequality constraints on a
            logistic regression, trained with the smoothed primal-dual method
            (:class:`~fedsim.workloads.constrained.LinearConstraints`); replaces SGD and
            combines with no other client method.
        lora: ``[client.lora]`` federated LoRA fine-tuning with CoTo
            (:class:`~fedsim.workloads.coto.LoRATraining`): the global arrays are the
            adapters only (:mod:`fedsim.workloads.lora_client`); combines with a minibatch
            ``optimizer`` only.
        scaffold: ``[client.scaffold]`` SCAFFOLD's control variates
            (:class:`~fedsim.workloads.scaffold.Scaffold`: server_lr), with its server half.
    """

    dp_sgd: DPSGD | dict[str, Any] | None = None
    optimizer: ClientOptimizer | dict[str, Any] | None = None
    averaging: Averaging | dict[str, Any] | None = None
    compression: Quantization | dict[str, Any] | None = None
    conformal: ConformalTraining | dict[str, Any] | None = None
    sst: SparseSpectral | dict[str, Any] | None = None
    constraints: LinearConstraints | dict[str, Any] | None = None
    lora: LoRATraining | dict[str, Any] | None = None
    scaffold: Scaffold | dict[str, Any] | None = None

    def __post_init__(self) -> None:
        for key, (cls, _) in PARTS.items():
            table = getattr(self, key)
            if isinstance(table, dict):  # a table from a config: errors name client.<key>.<k>
                made = (
                    Averaging.from_table(table, f"client.{key}")
                    if cls is Averaging
                    else from_mapping(cls, table, f"client.{key}")
                )
                object.__setattr__(self, key, made)
        super().__post_init__()
        check_parts(self)

    @property
    def uses_methods(self) -> bool:
        """Whether an optimizer, averaging, compression, conformal or SST is configured."""
        return any(getattr(self, key) is not None for key in METHODS)


def _features(training: LocalTraining, fedprox: bool) -> set[str]:
    """The features an :class:`Exclusion` may name that ``training`` (and the server) has."""
    features = {key for key in PARTS if getattr(training, key) is not None}
    if training.keep_momentum:
        features.add("keep_momentum")
    if fedprox:
        features.add("fedprox")
    optimizer = training.optimizer
    if isinstance(optimizer, ClientOptimizer) and (optimizer.zeroth_order or optimizer.full_batch):
        features.add("whole-batch-optimizer")
    return features


def _value(training: LocalTraining, named: str) -> Any:
    """The value of ``client.<named>`` (a dotted key) for an error message."""
    value: Any = training
    for part in named.split("."):
        value = getattr(value, part)
    return to_mapping(value) if is_dataclass(value) else value


def check_parts(training: LocalTraining, *, fedprox: bool = False) -> None:
    """Raise :class:`ConfigError` for the first part of ``training`` set together with a
    feature it excludes (``fedprox``: the server adds FedProx's proximal term); the error
    names the key, its value and what is allowed."""
    features = _features(training, fedprox)
    for key, (_, exclusions) in PARTS.items():
        if getattr(training, key) is None:
            continue
        for exclusion in exclusions:
            if exclusion.feature in features:
                named = exclusion.named or key
                raise ConfigError(f"client.{named}", _value(training, named), exclusion.allowed)


@dataclass(frozen=True)
class TrainingChoice:
    """A client training a :class:`LocalTraining` may select: whether ``training`` selects
    it, and how it is built (``build(model, training, metrics_in_clear)``)."""

    selected: Callable[[LocalTraining], bool]
    build: Callable[[ModelSpec, LocalTraining, bool], ClientTraining]


def _adapters(model: ModelSpec, training: LocalTraining, _: bool) -> ClientTraining:
    optimizer = training.optimizer
    chosen = optimizer if isinstance(optimizer, ClientOptimizer) else None
    return AdapterTraining(model, training, training.lora, chosen)


def _method_choice(method: ClientMethod) -> TrainingChoice:
    """The training a registered client method selects when its table is set."""
    return TrainingChoice(
        lambda t: getattr(t, method.key) is not None,
        lambda model, t, _: method.training(model, t, getattr(t, method.key)),
    )


#: name -> client training, in the order they are tried (the first selected one is built;
#: none selected: plain SGD, :class:`~fedsim.workloads.sgd.SGDTraining`)
CLIENT_TRAININGS: dict[str, TrainingChoice] = {
    **{method.key: _method_choice(method) for method in CLIENT_METHODS},
    "lora": TrainingChoice(lambda t: isinstance(t.lora, LoRATraining), _adapters),
    "constraints": TrainingChoice(
        lambda t: isinstance(t.constraints, LinearConstraints),
        lambda model, t, _: ConstrainedTraining(model, t, t.constraints),
    ),
    "methods": TrainingChoice(
        lambda t: t.uses_methods,
        lambda model, t, _: MethodsTraining(model, t, **{k: getattr(t, k) for k in METHODS}),
    ),
    "dp_sgd": TrainingChoice(
        lambda t: isinstance(t.dp_sgd, DPSGD),
        lambda model, t, in_clear: PrivateSGD(model, t, t.dp_sgd, in_clear),
    ),
}


def client_training(
    model: ModelSpec, training: LocalTraining, metrics_in_clear: bool = False
) -> ClientTraining:
    """The implementation ``training`` selects (:data:`CLIENT_TRAININGS`; ``metrics_in_clear``:
    DP-SGD clients also reply their un-noised train loss)."""
    for choice in CLIENT_TRAININGS.values():
        if choice.selected(training):
            return choice.build(model, training, metrics_in_clear)
    return SGDTraining(model, training)


def server_methods(training: LocalTraining) -> list[tuple[ClientMethod, Any]]:
    """The configured client methods with a server half, with their tables."""
    return [
        (method, getattr(training, method.key))
        for method in CLIENT_METHODS
        if method.server is not None and getattr(training, method.key) is not None
    ]


def make_client_app(
    model: ModelSpec, data: DatasetSpec, training: LocalTraining, metrics_in_clear: bool = False
) -> ClientApp:
    """A ClientApp that trains ``model`` on ``data``'s clients as ``training`` says."""
    return training_app(client_training(model, training, metrics_in_clear), data)
