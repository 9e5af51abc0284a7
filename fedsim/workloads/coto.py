"""CoTo: progressive activation of LoRA adapters, and adapter merging.

CoTo ("Come Together, But Not Right Now", ICML 2025) trains LoRA adapters
(Hu et al. 2022: ``W x + (alpha / r) B A x``) with stochastic layer-wise
activation. At step ``t`` of ``T``, each layer group draws ``u ~ U(0, 1)`` (all
groups are redrawn until at least one is active) and its adapters are active iff
``u <= p(t)`` with

    p(t) = min(1, p0 + (1 - p0) * t / ceil(ramp * T)),   p0 = 0.1, ramp = 0.75.

An inactive group returns its base layers' output exactly (no rescaling of the
active ones) and its LoRA parameters take no part in the step: they get no
gradient and the optimiser skips them. Early training thus spreads the
adaptation over the layers instead of a few of them, which the paper finds makes
adapters more robust to pruning and to linear merging/interpolation.

The adapters are peft's LoRA on the project's models (:mod:`fedsim.models`,
peft "custom models": every ``nn.Linear`` or the named ``targets``). Layer groups
are transformer blocks (modules under ``...layers.<i>.`` / ``h.<i>`` /
``blocks.<i>``) or, for models without blocks (the MLP and CNN here), each
LoRA-wrapped module on its own. Activation is switched per module with peft's
``BaseTunerLayer.enable_adapters``.

:class:`LoRATraining` is the ``[client.lora]`` table; federated LoRA
fine-tuning (the ClientApp) is :mod:`fedsim.workloads.lora_client`.
"""

from __future__ import annotations

import copy
import math
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import torch
from torch import nn

from fedsim.config import require
from fedsim.extras import require_extra
from fedsim.models import ModelSpec, build_model, copy_into, initial_arrays, load_arrays

if TYPE_CHECKING:
    import peft
    from peft.tuners.tuners_utils import BaseTunerLayer


@dataclass(frozen=True, kw_only=True)
class LoRATraining:
    """Federated LoRA fine-tuning, optionally with CoTo (``[client.lora]``).

    Attributes:
        rank: LoRA rank r (>= 1).
        alpha: LoRA alpha; the update is scaled by alpha / rank.
        targets: names of the modules that get adapters (peft ``target_modules``:
            a full name or a suffix, e.g. ``"layers.0"``); empty: every ``nn.Linear``.
        dropout: LoRA dropout on the adapters' input, in [0, 1).
        coto: train with CoTo's progressive activation; false: plain LoRA.
        coto_p0: CoTo's initial activation probability p0, in (0, 1] (1 is plain LoRA).
        coto_ramp: fraction of the steps over which p(t) rises to 1, in (0, 1].
        rounds: rounds of the whole run; CoTo's T is rounds x the client's local
            steps per round and t counts from round 1 (0: the experiment's ``rounds``).
        base: a ``.npz`` file with the base model's weights (the ``model.npz`` a
            fedsim run writes), read by every worker process (on a cluster: a
            shared path); empty: the model initialised from ``base_seed``.
        base_seed: seed of the base weights when ``base`` is empty.
    """

    rank: int = 4
    alpha: float = 8.0
    targets: tuple[str, ...] = ()
    dropout: float = 0.0
    coto: bool = True
    coto_p0: float = 0.1
    coto_ramp: float = 0.75
    rounds: int = 0
    base: str = ""
    base_seed: int = 0

    def __post_init__(self) -> None:
        require(self.rank >= 1, "client.lora.rank", self.rank, "an integer >= 1")
        require(
            math.isfinite(self.alpha) and self.alpha > 0,
            "client.lora.alpha",
            self.alpha,
            "a number > 0",
        )
        require(
            all(isinstance(t, str) and t for t in self.targets),
            "client.lora.targets",
            self.targets,
            "a list of module names (empty: every Linear layer)",
        )
        require(0 <= self.dropout < 1, "client.lora.dropout", self.dropout, "a number in [0, 1)")
        require(0 < self.coto_p0 <= 1, "client.lora.coto_p0", self.coto_p0, "a number in (0, 1]")
        require(
            0 < self.coto_ramp <= 1, "client.lora.coto_ramp", self.coto_ramp, "a number in (0, 1]"
        )
        require(
            self.rounds >= 0,
            "client.lora.rounds",
            self.rounds,
            "an integer >= 0 (0: the experiment's rounds)",
        )
        require(
            not self.base or Path(self.base).is_file(),
            "client.lora.base",
            self.base,
            "a path to an existing .npz of base weights, or empty",
        )


class CoToSchedule:
    """CoTo's activation probability p(t) = min(1, p0 + (1 - p0) t / ceil(ramp T))."""

    def __init__(self, p0: float, total_steps: int, ramp: float = 0.75) -> None:
        require(0 < p0 <= 1, "p0", p0, "a number in (0, 1]")
        require(total_steps >= 1, "total_steps", total_steps, "an integer >= 1")
        require(0 < ramp <= 1, "ramp", ramp, "a number in (0, 1]")
        self.p0, self.total_steps = p0, total_steps
        self.ramp_steps = math.ceil(ramp * total_steps)

    def probability(self, step: int) -> float:
        """p(t) at step ``step`` (0-based; 1 from ``ceil(ramp T)`` on)."""
        if step < 0:
            raise ValueError(f"step = {step} is not allowed: an integer >= 0")
        return min(1.0, self.p0 + (1 - self.p0) * step / self.ramp_steps)


_BLOCK = re.compile(r"^(.*?(?:^|\.)(?:layers|layer|h|blocks)\.\d+)\.")


def layer_group(module_name: str) -> str:
    """The layer group of a LoRA module: its transformer block, else the module itself."""
    match = _BLOCK.match(module_name)
    return match.group(1) if match else module_name


def lora_groups(model: nn.Module) -> dict[str, list[BaseTunerLayer]]:
    """LoRA-wrapped modules of ``model`` grouped by :func:`layer_group`, in model order."""
    from peft.tuners.tuners_utils import BaseTunerLayer  # noqa: PLC0415  (the text extra)

    groups: dict[str, list[BaseTunerLayer]] = {}
    for name, module in model.named_modules():
        if isinstance(module, BaseTunerLayer):
            groups.setdefault(layer_group(name), []).append(module)
    if not groups:
        raise ValueError("the model has no LoRA layers (wrap it with build_lora_model first)")
    return groups


class CoToController:
    """Draws each step's active layer groups and switches their adapters on or off.

    Args:
        model: a peft LoRA model.
        schedule: p(t).
        generator: source of the u ~ U(0, 1) draws (one per group and step).
    """

    def __init__(
        self, model: nn.Module, schedule: CoToSchedule, generator: torch.Generator
    ) -> None:
        self.groups = lora_groups(model)
        self.schedule, self.generator = schedule, generator
        self.steps, self.active_total = 0, 0

    def activate(self, step: int) -> list[bool]:
        """Draw and apply the active groups for step ``step``; returns one flag per group."""
        p = self.schedule.probability(step)
        while True:
            u = torch.rand(len(self.groups), generator=self.generator, dtype=torch.float64)
            active = (u <= p).tolist()
            if any(active):
                break
        for layers, on in zip(self.groups.values(), active, strict=True):
            for layer in layers:
                layer.enable_adapters(on)
        self.steps += 1
        self.active_total += sum(active)
        return active

    def enable_all(self) -> None:
        """Switch every adapter on (for evaluation, merging and upload)."""
        for layers in self.groups.values():
            for layer in layers:
                layer.enable_adapters(True)

    @property
    def active_fraction(self) -> float:
        """Mean fraction of groups active over the steps drawn so far."""
        return self.active_total / (self.steps * len(self.groups)) if self.steps else 0.0


def linear_module_names(model: nn.Module) -> list[str]:
    """Names of the ``nn.Linear`` modules of ``model`` (the default LoRA targets)."""
    return [name for name, m in model.named_modules() if isinstance(m, nn.Linear)]


def base_arrays(spec: ModelSpec, lora: LoRATraining) -> dict[str, np.ndarray]:
    """The frozen base weights: ``lora.base`` if set, else the model from ``lora.base_seed``."""
    if not lora.base:
        return initial_arrays(spec, lora.base_seed)
    with np.load(lora.base) as saved:
        return {k: saved[k] for k in saved.files}


def wrap_lora(model: nn.Module, lora: LoRATraining) -> peft.PeftModel:
    """``model`` with peft LoRA adapters on ``lora.targets``; the base is frozen."""
    require_extra("LoRA/CoTo ([client.lora])", modules=("peft",))
    import peft  # noqa: PLC0415  (the text extra, checked above)

    available = linear_module_names(model)
    targets = list(lora.targets) or available
    for target in targets:
        if not any(name == target or name.endswith(f".{target}") for name in available):
            raise ValueError(
                f"client.lora.targets = {list(lora.targets)!r} is not allowed: "
                f"{target!r} is not a Linear module of the model; Linear modules: {available}"
            )
    config = peft.LoraConfig(
        r=lora.rank,
        lora_alpha=lora.alpha,
        lora_dropout=lora.dropout,
        target_modules=targets,
        bias="none",
    )
    return peft.get_peft_model(model, config)


def build_lora_model(spec: ModelSpec, lora: LoRATraining, adapter_seed: int = 0) -> peft.PeftModel:
    """The base model of ``spec`` with its base weights, wrapped with fresh adapters.

    Adapters start as peft initialises them (A Kaiming-uniform from ``adapter_seed``,
    B = 0, so the wrapped model computes the base model); torch's global RNG is untouched.
    """
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(adapter_seed)
        model = build_model(spec)
        load_arrays(model, base_arrays(spec, lora))
        return wrap_lora(model, lora)


def _is_adapter_key(key: str) -> bool:
    return ".lora_A." in key or ".lora_B." in key


def adapter_arrays(model: nn.Module) -> dict[str, np.ndarray]:
    """The LoRA matrices of ``model`` as numpy arrays (copies), keyed by state-dict name."""
    return {
        k: v.detach().cpu().numpy().copy()
        for k, v in model.state_dict().items()
        if _is_adapter_key(k)
    }


def load_adapter_arrays(model: nn.Module, arrays: Mapping[str, np.ndarray]) -> None:
    """Copy adapter ``arrays`` into ``model``'s LoRA matrices in place (base untouched)."""
    state = {k: v for k, v in model.state_dict(keep_vars=True).items() if _is_adapter_key(k)}
    if state.keys() != arrays.keys():
        differing = sorted(set(state) ^ set(arrays))
        raise ValueError(
            f"arrays do not match the model's adapters; differing keys: {differing[:5]}"
        )
    for key, tensor in state.items():
        copy_into(tensor, arrays[key], key)


def initial_adapter_arrays(spec: ModelSpec, lora: LoRATraining, seed: int) -> dict[str, np.ndarray]:
    """The initial global adapter (what a federated LoRA run sends in round 1)."""
    return adapter_arrays(build_lora_model(spec, lora, adapter_seed=seed))


def merged_arrays(model: peft.PeftModel) -> dict[str, np.ndarray]:
    """The base model's weights with the LoRA update merged in: W + (alpha / r) B A.

    peft's ``merge_and_unload`` on a copy (``model`` keeps its adapters); the result
    has the keys of the plain model, so :func:`fedsim.models.load_arrays` takes it.
    """
    merged = copy.deepcopy(model)
    for layers in lora_groups(merged).values():
        for layer in layers:
            layer.enable_adapters(True)
    plain = merged.merge_and_unload()
    return {k: v.detach().cpu().numpy().copy() for k, v in plain.state_dict().items()}


def interpolate_adapters(
    first: Mapping[str, np.ndarray], second: Mapping[str, np.ndarray], weight: float
) -> dict[str, np.ndarray]:
    """Linear interpolation (1 - weight) * first + weight * second of two adapters' A and B."""
    if first.keys() != second.keys():
        differing = sorted(set(first) ^ set(second))
        raise ValueError(f"the adapters have different keys: {differing[:5]}")
    if not math.isfinite(weight):
        raise ValueError(f"weight = {weight!r} is not allowed: a finite number")
    return {k: ((1 - weight) * first[k] + weight * second[k]).astype(first[k].dtype) for k in first}


def adapter_groups(arrays: Mapping[str, np.ndarray]) -> list[str]:
    """The layer groups of an adapter's arrays, in order of appearance."""
    groups: dict[str, None] = {}
    for key in arrays:
        if not _is_adapter_key(key):
            raise ValueError(f"{key!r} is not a LoRA matrix (expected .lora_A. or .lora_B.)")
        groups[layer_group(key.split(".lora_")[0])] = None
    return list(groups)


def prune_adapters(arrays: Mapping[str, np.ndarray], drop: Iterable[str]) -> dict[str, np.ndarray]:
    """Layer-wise pruning: the adapter with the groups in ``drop`` removed (their B set to 0,
    so those layers compute their base output)."""
    drop = set(drop)
    unknown = drop - set(adapter_groups(arrays))
    if unknown:
        raise ValueError(
            f"drop = {sorted(unknown)!r} is not allowed: layer groups of the adapter are "
            f"{adapter_groups(arrays)}"
        )
    return {
        k: np.zeros_like(v)
        if ".lora_B." in k and layer_group(k.split(".lora_")[0]) in drop
        else v.copy()
        for k, v in arrays.items()
    }
