"""Which client optimiser to use: the ``[client.optimizer]`` table and its builder."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any, Literal

import torch

from fedsim.config import require
from fedsim.workloads.optim.hdm_hb import HDMHB
from fedsim.workloads.optim.mars import MARS
from fedsim.workloads.optim.zeroth_order import RAdaZO, ZOAdaMM

NAMES = ("sgd", "mars-adamw", "mars-lion", "r-adazo", "zo-adamm", "hdm-hb")


@dataclass(frozen=True, kw_only=True)
class ClientOptimizer:
    """A client optimiser and its hyper-parameters (paper defaults where 0/None).

    Attributes:
        name: "sgd" (torch.optim.SGD with the client's momentum), "mars-adamw",
            "mars-lion" (:class:`~fedsim.workloads.optim.mars.MARS`), "r-adazo",
            "zo-adamm" (:mod:`fedsim.workloads.optim.zeroth_order`, forward-only),
            "hdm-hb" (:class:`~fedsim.workloads.optim.hdm_hb.HDMHB`, full batch: each
            local step is one closure over all the client's rows; ``lr`` is the
            AdaGrad rate of its diagonal step sizes, default 0.1).
        lr: learning rate; None: the method's default (3e-3 MARS, 1e-3 ZO) or,
            for sgd, the client's ``lr``.
        betas: None: the method's default.
        weight_decay: decoupled weight decay (MARS).
        gamma: MARS's correction scale.
        mu, q: zeroth-order smoothing radius and directions per step.
    """

    name: Literal["sgd", "mars-adamw", "mars-lion", "r-adazo", "zo-adamm", "hdm-hb"] = "sgd"
    lr: float | None = None
    betas: tuple[float, float] | None = None
    weight_decay: float = 0.0
    gamma: float = 0.025
    mu: float = 5e-3
    q: int = 2

    def __post_init__(self) -> None:
        require(self.name in NAMES, "client.optimizer.name", self.name, f"one of {NAMES}")
        require(self.lr is None or self.lr > 0, "client.optimizer.lr", self.lr, "a number > 0")
        if self.betas is not None:
            object.__setattr__(self, "betas", tuple(self.betas))
            require(
                len(self.betas) == 2 and all(0 <= b < 1 for b in self.betas),
                "client.optimizer.betas",
                self.betas,
                "two numbers in [0, 1)",
            )
        require(self.weight_decay >= 0, "client.optimizer.weight_decay", self.weight_decay, ">= 0")
        require(self.gamma >= 0, "client.optimizer.gamma", self.gamma, "a number >= 0")
        require(self.mu > 0, "client.optimizer.mu", self.mu, "a number > 0")
        require(self.q >= 1, "client.optimizer.q", self.q, "an integer >= 1")
        require(
            self.name != "hdm-hb" or self.weight_decay == 0,
            "client.optimizer.weight_decay",
            self.weight_decay,
            "0 with hdm-hb (it minimises the loss as given)",
        )

    @property
    def zeroth_order(self) -> bool:
        return self.name in ("r-adazo", "zo-adamm")

    @property
    def full_batch(self) -> bool:
        """Whether each step takes a closure over the client's whole data (HDM-HB)."""
        return self.name == "hdm-hb"


def build_optimizer(
    config: ClientOptimizer,
    params: Iterable[Any],
    *,
    generator: torch.Generator,
    sgd_lr: float = 0.05,
    momentum: float = 0.0,
) -> torch.optim.Optimizer:
    """The optimiser ``config`` names over ``params`` (``generator`` feeds ZO directions)."""
    extra: dict[str, Any] = {} if config.betas is None else {"betas": config.betas}
    if config.name == "sgd":
        return torch.optim.SGD(
            params,
            lr=config.lr or sgd_lr,
            momentum=momentum,
            weight_decay=config.weight_decay,
        )
    if config.name in ("mars-adamw", "mars-lion"):
        return MARS(
            params,
            lr=config.lr or 3e-3,
            weight_decay=config.weight_decay,
            gamma=config.gamma,
            variant=config.name,
            **extra,
        )
    if config.name == "hdm-hb":
        return HDMHB(params, lr=config.lr or 0.1)
    cls = RAdaZO if config.name == "r-adazo" else ZOAdaMM
    return cls(params, generator=generator, lr=config.lr or 1e-3, mu=config.mu, q=config.q, **extra)
