"""Sparse Spectral Training (SST; Zhao et al., arXiv 2405.15481) over a model's Linear layers.

Each ``nn.Linear`` weight ``W`` (out x in) is held in its spectral form
``W = U diag(sigma) V^T`` (``U``: out x k, ``V^T``: k x in, ``k = min(out, in)``), started
from the exact SVD of ``W`` (the paper's SVD initialisation). Training (Alg. 1):

* every step updates all singular values ``sigma`` with their gradient
  ``dL/dsigma_i = u_i^T (dL/dW) v_i``;
* only ``r`` singular-vector pairs ``(u_i, v_i)`` are updated, drawn once per *period*
  (``period`` steps) without replacement with probability
  ``p_i = (1/k + sigma_i / sum(sigma)) / 2`` (sec. 4.4: half uniform exploration, half
  exploitation of large singular values); they get the *enhanced gradient* (sec. 4.2)
  ``dL/dW v_i`` and ``u_i^T dL/dW``, without the factor ``sigma_i`` of the plain chain rule;
  the other pairs get zero gradient and are restored after each optimiser step, so neither
  momentum nor weight decay moves them;
* ``sigma`` is clamped at 0 after each step (singular values are non-negative);
* every ``resvd_every`` periods the effective weight ``U diag(sigma) V^T`` is decomposed again
  (re-SVD), which re-orthonormalises ``U`` and ``V`` without changing ``W``; the optimiser
  state of the spectral factors is reset then, since it refers to the old basis.

The number of trainable values per step and layer is ``r (out + in) + k`` (+ bias), against
``out * in`` for full-rank training. On a federated client the global model arrives dense;
:class:`SparseSpectralTraining` decomposes a copy of it, trains that, and
:meth:`~SparseSpectralTraining.export` writes the dense weights back, so uploads and the
server are unchanged. Biases and other parameters train as usual.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from fedsim.config import require


@dataclass(frozen=True, kw_only=True)
class SparseSpectral:
    """The ``[client.sst]`` table.

    Attributes:
        rank: singular-vector pairs ``r`` updated per period in each Linear layer (a layer
            with ``min(out, in) <= r`` updates all its pairs).
        period: optimiser steps between two draws of the sampled pairs.
        resvd_every: periods between two re-SVDs of the effective weights.
    """

    rank: int = 8
    period: int = 10
    resvd_every: int = 1

    def __post_init__(self) -> None:
        require(self.rank >= 1, "client.sst.rank", self.rank, "an integer >= 1")
        require(self.period >= 1, "client.sst.period", self.period, "an integer >= 1")
        require(
            self.resvd_every >= 1, "client.sst.resvd_every", self.resvd_every, "an integer >= 1"
        )


class _SpectralWeight(torch.autograd.Function):
    """``W = U diag(sigma) V^T`` with SST's gradients (full for sigma, enhanced and masked
    to the sampled pairs for U and V^T)."""

    @staticmethod
    def forward(ctx: Any, u: torch.Tensor, sigma: torch.Tensor, vh: torch.Tensor, active: Any):
        ctx.save_for_backward(u, vh, active)
        return (u * sigma) @ vh

    @staticmethod
    def backward(ctx: Any, grad_w: torch.Tensor):  # type: ignore[override]
        u, vh, active = ctx.saved_tensors
        mask = active.to(grad_w.dtype)
        projected = u.T @ grad_w  # k x in: u_i^T dL/dW
        grad_sigma = (projected * vh).sum(dim=1)
        grad_u = (grad_w @ vh.T) * mask  # out x k: dL/dW v_i for sampled i
        grad_vh = projected * mask[:, None]
        return grad_u, grad_sigma, grad_vh, None


class SpectralLinear(nn.Module):
    """A Linear layer whose weight is ``U diag(sigma) V^T`` (see the module docstring)."""

    def __init__(self, linear: nn.Linear) -> None:
        super().__init__()
        weight = linear.weight.detach()
        u, sigma, vh = torch.linalg.svd(weight, full_matrices=False)
        self.u = nn.Parameter(u.contiguous())
        self.sigma = nn.Parameter(sigma.contiguous())
        self.vh = nn.Parameter(vh.contiguous())
        self.bias = None if linear.bias is None else nn.Parameter(linear.bias.detach().clone())
        active = torch.ones(len(sigma), dtype=torch.bool, device=sigma.device)
        self.register_buffer("active", active)

    @property
    def pairs(self) -> int:
        """k = min(out, in), the number of singular-vector pairs."""
        return len(self.sigma)

    def weight(self) -> torch.Tensor:
        """The effective weight ``U diag(sigma) V^T`` (differentiable)."""
        return _SpectralWeight.apply(self.u, self.sigma, self.vh, self.active)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return nn.functional.linear(x, self.weight(), self.bias)

    @torch.no_grad()
    def resvd(self) -> None:
        """Decompose the effective weight again (exact up to floating point)."""
        u, sigma, vh = torch.linalg.svd((self.u * self.sigma) @ self.vh, full_matrices=False)
        self.u.copy_(u)
        self.sigma.copy_(sigma)
        self.vh.copy_(vh)


def sampling_probabilities(sigma: torch.Tensor) -> torch.Tensor:
    """SST's pair-sampling distribution ``(1/k + sigma_i / sum sigma) / 2`` (sec. 4.4)."""
    k = len(sigma)
    total = float(sigma.sum())
    share = sigma / total if total > 0 else torch.full_like(sigma, 1.0 / k)
    return 0.5 * (1.0 / k + share)


def _replace_linears(module: nn.Module) -> list[tuple[str, SpectralLinear]]:
    made: list[tuple[str, SpectralLinear]] = []
    for name, child in module.named_children():
        if isinstance(child, nn.Linear):
            layer = SpectralLinear(child)
            setattr(module, name, layer)
            made.append((name, layer))
        else:
            made += [(f"{name}.{sub}", layer) for sub, layer in _replace_linears(child)]
    return made


class SparseSpectralTraining:
    """SST over a copy of ``model`` whose Linear layers are spectral.

    Train :attr:`model` with any gradient optimiser built over its parameters; call
    :meth:`after_step` after every ``optimizer.step()``; :meth:`export` writes the dense
    weights into a model of the original architecture.
    """

    def __init__(self, model: nn.Module, config: SparseSpectral, generator: torch.Generator):
        self.config = config
        self.generator = generator
        self.model = copy.deepcopy(model)
        self.layers = dict(_replace_linears(self.model))
        if not self.layers:
            raise ValueError(
                f"SST model={type(model).__name__}: expected at least one nn.Linear layer"
            )
        self.steps = 0
        self.periods = 0
        self._frozen: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = []
        self.sample()

    @torch.no_grad()
    def sample(self) -> None:
        """Draw each layer's ``r`` pairs for the next period and remember the others."""
        self._frozen = []
        for layer in self.layers.values():
            chosen = torch.multinomial(
                sampling_probabilities(layer.sigma.detach().clamp(min=0)),
                min(self.config.rank, layer.pairs),
                replacement=False,
                generator=self.generator,
            )
            layer.active.zero_()
            layer.active[chosen] = True
            frozen = ~layer.active
            self._frozen.append((layer.u[:, frozen].clone(), layer.vh[frozen].clone(), frozen))

    @torch.no_grad()
    def after_step(self, optimizer: torch.optim.Optimizer | None = None) -> None:
        """Restore unsampled pairs, clamp sigma at 0, and resample / re-SVD when due."""
        for layer, (u_kept, vh_kept, frozen) in zip(
            self.layers.values(), self._frozen, strict=True
        ):
            layer.u[:, frozen] = u_kept
            layer.vh[frozen] = vh_kept
            layer.sigma.clamp_(min=0.0)
        self.steps += 1
        if self.steps % self.config.period:
            return
        self.periods += 1
        if self.periods % self.config.resvd_every == 0:
            for layer in self.layers.values():
                layer.resvd()
                if optimizer is not None:
                    for p in (layer.u, layer.sigma, layer.vh):
                        optimizer.state.pop(p, None)
        self.sample()

    def trainable_per_step(self) -> int:
        """Values updated per step: ``r (out + in) + k`` per spectral layer, plus the rest."""
        spectral = {id(p) for layer in self.layers.values() for p in (layer.u, layer.vh)}
        total = sum(p.numel() for p in self.model.parameters() if id(p) not in spectral)
        for layer in self.layers.values():
            r = int(layer.active.sum())
            total += r * (layer.u.shape[0] + layer.vh.shape[1])
        return total

    @torch.no_grad()
    def export(self, target: nn.Module) -> None:
        """Write the dense weights (``U diag(sigma) V^T``) and other parameters into ``target``."""
        state = {}
        for name, tensor in self.model.state_dict().items():
            owner, _, leaf = name.rpartition(".")
            if owner in self.layers:
                if leaf == "u":
                    layer = self.layers[owner]
                    state[f"{owner}.weight"] = (layer.u * layer.sigma) @ layer.vh
                elif leaf == "bias":
                    state[name] = tensor
                continue
            state[name] = tensor
        target.load_state_dict(state)
