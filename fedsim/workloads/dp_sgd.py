"""Sample-level DP on clients: local DP-SGD with Opacus, accounted per client across rounds.

DP-SGD (Abadi et al., "Deep Learning with Differential Privacy", CCS 2016, Alg. 1): each local
step takes a Poisson sample of the client's rows (each row independently with probability
``q = 1 / ceil(n / batch_size)``, so the expected batch is about ``batch_size``), clips every
per-example gradient to L2 norm ``max_grad_norm`` (``C``), adds ``N(0, (z C)^2 I)`` to their
sum and divides by the expected batch size. Opacus's ``PrivacyEngine.make_private`` provides
all of it: per-example gradients (``GradSampleModule``), the Poisson ``DPDataLoader``, the
clipping and noising ``DPOptimizer``, and the accountant.

The guarantee is per client, for its own rows, under add/remove-one-example neighbours: ``(ε,
δ)`` of everything the client released so far. The accountant's history ``[(z, q, steps),
...]`` lives in the client's ``context.state`` (key :data:`STATE_KEY`), so a client's epsilon
composes over every round it trained in, whichever worker ran it; fedsim's engine persists
``context.state`` per client in its state store. No amplification by client sampling is
claimed (the client's epsilon holds whether or not the server samples it).

Each reply carries ``dp-sgd-epsilon`` (the client's epsilon after this round) and
``dp-sgd-steps``; the state also keeps the epsilon, which fedsim's runs read to report the worst
client (``max_client_epsilon``).

Randomness: the Poisson batches and the noise are the client's own secrets -- torch generators
seeded from its :class:`~fedsim.randomness.PartySecret` (``client_secret(context.node_config)``:
derived from the run's secret root in simulation, so a run repeats exactly with the same root;
fresh OS randomness where the runtime gives none), never from the run seed, which the server
and every other client know. ``secure_mode`` hands both to Opacus's secure mode instead, which
draws them from ``/dev/urandom`` through ``torchcsprng`` (and uses Opacus's noise sampling that
resists floating-point attacks); it needs that package installed.
"""

from __future__ import annotations

import functools
import importlib.util
import warnings
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

import numpy as np
import torch
from flwr.app import ConfigRecord, RecordDict
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from fedsim.config import require
from fedsim.models import ModelSpec, build_model, load_arrays, model_arrays, place
from fedsim.randomness import PartySecret, Purpose
from fedsim.workloads.sgd import final_buffers, load_momentum, sgd_optimizer, store_momentum
from fedsim.workloads.training import (
    ClientTraining,
    Exclusion,
    LocalSteps,
    TrainResult,
    TrainTask,
    cached_model,
)

if TYPE_CHECKING:
    from opacus.grad_sample import GradSampleModule

#: the client's context.state record with its accountant history and epsilon
STATE_KEY = "fedsim.dp_sgd"
ACCOUNTANTS = ("rdp", "prv")


def secure_rng_available() -> bool:
    """Whether Opacus's secure mode can run here (it needs ``torchcsprng``)."""
    return importlib.util.find_spec("torchcsprng") is not None


@dataclass(frozen=True, kw_only=True)
class DPSGD:
    """Settings of clients' DP-SGD (the ``[client.dp_sgd]`` table).

    Attributes:
        noise_multiplier: ``z > 0``, noise std / max_grad_norm on each step's sum.
        max_grad_norm: ``C > 0``, the per-example gradient clipping norm.
        delta: ``delta`` in (0, 1) of each client's reported epsilon; it should be well below
            1 / (a client's number of training rows).
        accountant: Opacus's "rdp" (Rényi DP, Mironov 2017) or "prv" (privacy random
            variables, Gopi et al. 2021; its upper bound is reported).
        secure_mode: Opacus's secure mode (noise and batches from ``/dev/urandom`` through
            ``torchcsprng``; refused when that package is not installed).
    """

    noise_multiplier: float
    max_grad_norm: float
    delta: float = 1e-5
    accountant: Literal["rdp", "prv"] = "rdp"
    secure_mode: bool = False

    def __post_init__(self) -> None:
        require(
            _finite(self.noise_multiplier) and self.noise_multiplier > 0,
            "client.dp_sgd.noise_multiplier",
            self.noise_multiplier,
            "a number > 0 (noise std / max_grad_norm)",
        )
        require(
            _finite(self.max_grad_norm) and self.max_grad_norm > 0,
            "client.dp_sgd.max_grad_norm",
            self.max_grad_norm,
            "a number > 0",
        )
        require(
            _finite(self.delta) and 0 < self.delta < 1,
            "client.dp_sgd.delta",
            self.delta,
            "a number in (0, 1)",
        )
        require(
            self.accountant in ACCOUNTANTS,
            "client.dp_sgd.accountant",
            self.accountant,
            "one of 'rdp', 'prv'",
        )
        require(
            not self.secure_mode or secure_rng_available(),
            "client.dp_sgd.secure_mode",
            self.secure_mode,
            "false here: Opacus's secure mode draws from /dev/urandom through the "
            "torchcsprng package, which is not installed",
        )


def _finite(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and np.isfinite(value)


# -- the client's accountant state ------------------------------------------------------------


def history_of(state: RecordDict) -> list[tuple[float, float, int]]:
    """The Opacus accountant history ``[(z, q, steps), ...]`` kept in ``state`` (empty if none)."""
    record = state.get(STATE_KEY)
    if not isinstance(record, ConfigRecord):
        return []
    z, q, steps = record["noise_multiplier"], record["sample_rate"], record["steps"]
    return [(float(a), float(b), int(c)) for a, b, c in zip(z, q, steps, strict=True)]  # type: ignore[arg-type]


def epsilon_of(state: RecordDict) -> float | None:
    """The epsilon a client stored after its last DP-SGD round (None: it never trained)."""
    record = state.get(STATE_KEY)
    if not isinstance(record, ConfigRecord):
        return None
    return float(record["epsilon"])  # type: ignore[arg-type]


def _state_record(history: list[tuple[float, float, int]], epsilon: float, delta: float):
    return ConfigRecord(
        {
            "noise_multiplier": [float(h[0]) for h in history],
            "sample_rate": [float(h[1]) for h in history],
            "steps": [int(h[2]) for h in history],
            "epsilon": float(epsilon),
            "delta": float(delta),
        }
    )


def client_epsilon(
    history: list[tuple[float, float, int]], delta: float, accountant: str = "rdp"
) -> float:
    """Epsilon of an Opacus accountant ``history`` at ``delta`` (0 for no steps).

    Clients with the same number of rows share their history, so the answer is cached
    per process (Opacus's RDP takes about 0.1 s per call).
    """
    return _epsilon(tuple((float(z), float(q), int(n)) for z, q, n in history), delta, accountant)


@functools.lru_cache(maxsize=4096)
def _epsilon(history: tuple[tuple[float, float, int], ...], delta: float, accountant: str) -> float:
    if not history:
        return 0.0
    from opacus import PrivacyEngine  # noqa: PLC0415  (only DP-SGD runs import Opacus)

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        engine = PrivacyEngine(accountant=accountant)
    engine.accountant.history = list(history)
    return float(engine.accountant.get_epsilon(delta=delta))


# -- training ---------------------------------------------------------------------------------

_PRIVATE_MODELS: dict[ModelSpec, GradSampleModule] = {}


def private_model(spec: ModelSpec) -> GradSampleModule:
    """This process's per-example-gradient model for ``spec``, built once and reused.

    Reuse is safe because every client loads all weights first and the optimiser clears the
    per-example gradients when it finishes (a client that fails mid-step drops the cached
    model instead, so the next one starts clean).
    """
    from opacus.grad_sample import GradSampleModule  # noqa: PLC0415  (only DP-SGD runs)

    module = _PRIVATE_MODELS.get(spec)
    if module is None:
        module = GradSampleModule(place(build_model(spec), spec.device))
        _PRIVATE_MODELS[spec] = module
    return module


def secret_generator(secret: PartySecret, *words: Any, device: str = "cpu") -> torch.Generator:
    """A torch generator on ``device`` seeded with 63 bits of ``secret``'s stream for
    ``words`` (Opacus draws each step's noise on the parameters' device)."""
    seed = int.from_bytes(secret.seed_bytes(*words)[:8], "little") >> 1
    return torch.Generator(device=device).manual_seed(seed)


@dataclass(frozen=True)
class PrivateRound:
    """What one client's DP-SGD round produced."""

    model: nn.Module
    loss: float
    steps: int
    epsilon: float
    history: list[tuple[float, float, int]]

    def state_record(self, delta: float) -> ConfigRecord:
        return _state_record(self.history, self.epsilon, delta)


def _loader_and_engine(
    x: torch.Tensor,
    y: torch.Tensor,
    training: LocalSteps,
    dp: DPSGD,
    history: list[tuple[float, float, int]],
    secret: PartySecret,
    server_round: int,
) -> tuple[DataLoader, Any]:
    """The round's loader (its batches from the client's secret unless ``dp.secure_mode``)
    and an Opacus PrivacyEngine whose accountant continues from ``history``."""
    from opacus import PrivacyEngine  # noqa: PLC0415  (only DP-SGD runs import Opacus)

    secure = dp.secure_mode
    loader = DataLoader(
        TensorDataset(x, y),
        batch_size=min(training.batch_size, len(y)),
        generator=None if secure else secret_generator(secret, server_round, Purpose.TRAINING),
    )
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "secure RNG turned off": seeded on purpose
        engine = PrivacyEngine(accountant=dp.accountant, secure_mode=secure)
    engine.accountant.history = list(history)
    return loader, engine


def _private_steps(
    module: nn.Module, dp_optimizer: Any, dp_loader: Any, training: LocalSteps, device: str
) -> tuple[int, list[torch.Tensor]]:
    """The DP-SGD steps of ``training.epochs`` passes of ``dp_loader`` (at most
    ``training.max_steps``): the number taken and the losses of the non-empty batches."""
    steps, losses = 0, []
    for _ in range(training.epochs):
        for xb, yb in dp_loader:
            if training.max_steps and steps >= training.max_steps:
                break
            # the rows are on the model's device; an empty Poisson batch is built on the CPU
            xb, yb = xb.to(device), yb.to(device)
            dp_optimizer.zero_grad(set_to_none=True)
            out = module(xb)
            if len(yb):
                loss = nn.functional.cross_entropy(out, yb)
                losses.append(loss.detach())
            else:  # an empty Poisson batch: the step is pure noise, and still counted
                loss = out.sum()
            with warnings.catch_warnings():  # inputs need no gradient; Opacus's hooks know
                warnings.filterwarnings("ignore", "Full backward hook is firing")
                loss.backward()
            dp_optimizer.step()
            steps += 1
    return steps, losses


def train_private(
    spec: ModelSpec,
    arrays: dict[str, np.ndarray],
    x: torch.Tensor,
    y: torch.Tensor,
    training: LocalSteps,
    dp: DPSGD,
    *,
    history: list[tuple[float, float, int]],
    secret: PartySecret,
    server_round: int,
    lr: float | None = None,
    momentum_buffers: list[np.ndarray] | None = None,
) -> PrivateRound:
    """``training.epochs`` passes of DP-SGD over (x, y) from ``arrays``.

    An epoch is ``ceil(n / batch_size)`` Poisson-sampled steps (at most ``max_steps`` in all
    when that is set); every step, an empty batch included, is noised and accounted.
    ``history`` is the client's accountant history before this round; the returned one
    includes it. Batches and noise of round ``server_round`` come from the client's
    ``secret`` (unless ``dp.secure_mode``). ``momentum_buffers`` as in
    :func:`~fedsim.workloads.sgd.train_epochs`.
    """
    module = private_model(spec)
    load_arrays(module._module, arrays)
    module.train()
    params = list(module.parameters())
    optimizer = sgd_optimizer(params, training, lr, momentum_buffers)
    secure = dp.secure_mode
    loader, engine = _loader_and_engine(x, y, training, dp, history, secret, server_round)
    try:
        module, dp_optimizer, dp_loader = engine.make_private(
            module=module,
            optimizer=optimizer,
            data_loader=loader,
            noise_multiplier=dp.noise_multiplier,
            max_grad_norm=dp.max_grad_norm,
            poisson_sampling=True,
            noise_generator=(
                None
                if secure
                else secret_generator(secret, server_round, Purpose.NOISE, device=spec.device)
            ),
        )
        steps, losses = _private_steps(module, dp_optimizer, dp_loader, training, spec.device)
        dp_optimizer.zero_grad(set_to_none=True)
    except BaseException:
        _PRIVATE_MODELS.pop(spec, None)  # hooks may hold a half-done step
        raise
    if momentum_buffers is not None:
        momentum_buffers[:] = final_buffers(optimizer, params)
    new_history = [(float(z), float(q), int(s)) for z, q, s in engine.accountant.history]
    epsilon = client_epsilon(new_history, dp.delta, dp.accountant)
    loss_mean = float(torch.stack(losses).mean()) if losses else 0.0
    return PrivateRound(module._module, loss_mean, steps, epsilon, new_history)


EXCLUDES = {
    "dp_sgd": (
        Exclusion(
            "fedprox",
            "none with FedProx (DP-SGD's per-example gradients do not include its proximal term)",
        ),
    )
}
"""What ``[client.dp_sgd]`` cannot be combined with (checked by
:func:`fedsim.workloads.supervised.check_parts`)."""


class PrivateSGD(ClientTraining):
    """Sample-level DP-SGD (``[client.dp_sgd]``) with the client's accountant state.

    Batches and noise come from the client's own secret (:meth:`TrainTask.secret`), not from
    the public ``generator``; the new accountant history and epsilon go into ``state``
    (:data:`STATE_KEY`) and the reply carries ``dp-sgd-epsilon`` and ``dp-sgd-steps``. The
    un-noised train loss leaves the client only with ``metrics_in_clear``.
    """

    name = "client.dp_sgd"

    def __init__(
        self, spec: ModelSpec, steps: LocalSteps, dp: DPSGD, metrics_in_clear: bool = False
    ) -> None:
        super().__init__(spec, steps)
        self.dp, self.metrics_in_clear = dp, metrics_in_clear

    def model(self) -> nn.Module:
        return private_model(self.spec)._module

    def evaluation_model(self) -> nn.Module:
        return cached_model(self.spec)

    def train(
        self, model: nn.Module, task: TrainTask, generator: torch.Generator, state: RecordDict
    ) -> TrainResult:
        buffers = load_momentum(state) if self.steps.keep_momentum else None
        result, metrics = train_client(
            self.spec,
            model_arrays(model),
            task.x,
            task.y,
            self.steps,
            state,
            dp=self.dp,
            secret=task.secret(),
            server_round=task.server_round,
            lr=task.lr,
            momentum_buffers=buffers,
        )
        if buffers is not None:
            store_momentum(state, buffers)
        loss = result.loss if self.metrics_in_clear else None
        return TrainResult(loss, result.steps, metrics, upload=model_arrays(result.model))


def train_client(
    spec: ModelSpec,
    arrays: dict[str, np.ndarray],
    x: torch.Tensor,
    y: torch.Tensor,
    training: LocalSteps,
    state: RecordDict,
    *,
    dp: DPSGD,
    secret: PartySecret,
    server_round: int,
    lr: float | None = None,
    momentum_buffers: list[np.ndarray] | None = None,
) -> tuple[PrivateRound, dict[str, float | int]]:
    """A client's DP-SGD round with its accountant state: trains with its own ``secret``,
    stores the new history and epsilon in ``state``, and returns the round with the metrics
    its reply carries."""
    result = train_private(
        spec,
        arrays,
        x,
        y,
        training,
        dp,
        history=history_of(state),
        secret=secret,
        server_round=server_round,
        lr=lr,
        momentum_buffers=momentum_buffers,
    )
    state[STATE_KEY] = result.state_record(dp.delta)
    return result, {"dp-sgd-epsilon": result.epsilon, "dp-sgd-steps": result.steps}
