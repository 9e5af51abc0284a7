"""pFedHB: the global posterior of a hierarchical Bayesian personalised FL model.

Thapa & Li, "Harnessing Heterogeneous Statistical Strength for Personalized
Federated Learning via Hierarchical Bayesian Inference", ICML 2025. Clients hold
personal mean-field posteriors ``q_i = N(mu_i, sigma_i^2)`` (per coordinate)
trained against the global posterior ``q_g = N(mu_g, sigma_g^2)`` as their
prior; the server computes ``q_g`` from the reporting clients' posteriors,
separately for the head and the body, in closed form, coordinate by coordinate:

L2 hyper-prior (the reference code's objective, weights ``w_i = n_i / n_S``)::

    min  sum_i w_i KL(q_i || q_g) + lam_mu mu_g^2 + lam_sigma sigma_g^2

whose stationary point satisfies, with ``V = sum_i w_i (sigma_i^2 + (mu_i - mu_g)^2)``,

    mu_g      = sum_i w_i mu_i / (1 + 2 lam_mu sigma_g^2)                  (HB-1)
    sigma_g^2 = (sqrt(1 + 8 lam_sigma V) - 1) / (4 lam_sigma)
              = 2 V / (1 + sqrt(1 + 8 lam_sigma V))                         (HB-2)

(from d/dmu_g and d/dsigma_g: ``2 lam_sigma s^2 + s - V = 0``, ``s = sigma_g^2``),
iterated to a fixed point from the previous global mean. ``lam = 0`` gives
moment matching: ``mu_g`` the weighted mean, ``sigma_g^2 = V``.

Conjugate hyper-prior: a Normal-Inverse-Gamma ``mu_g | s ~ N(m0, s / kappa0)``,
``s ~ IG(a0, b0)``, with the reports as ``tau = |S|`` pseudo-observations:
``min tau sum_i w_i KL(q_i || q_g) - log NIG(mu_g, s)``, whose MAP is explicit::

    mu_g = (tau mu_bar + kappa0 m0) / (tau + kappa0)                          (NIG-1)
    s    = (tau V(mu_g) + kappa0 (mu_g - m0)^2 + 2 b0) / (tau + 2 a0 + 3)     (NIG-2)

``kappa0 = 0, a0 = -3/2, b0 = 0`` (the flat limit) is again moment matching.

Special cases (``tests/test_pfedhb_server.py`` checks each on the same inputs):

* pFedVEM (Zhu et al., NeurIPS 2023): ``head_variance = "per-client"``,
  ``head_weighting = "uniform"``, ``lam_mu = 0``, ``iterations = 1``: the prior
  of client i is ``N(mu_g, rho_i^2 I)`` with one scalar per client,
  ``rho_i^2 = mean_d(sigma_id^2 + (mu_id - mu_gd)^2)`` (its M-step against the
  previous ``mu_g``), and ``mu_g = sum_i (mu_i / rho_i^2) / sum_i (1 / rho_i^2)``;
  the body is FedAvg of the means (``lam_mu = 0``, momentum 0).
* pFedBayes (Zhang et al., NeurIPS 2022): ``head_variance = body_variance =
  "rho-average"``, ``lam_mu = 0``: ``mu_g`` and ``rho_g`` are the sample-weighted
  means of ``mu_i`` and ``rho_i``, the heuristic the hierarchical model replaces.
  The mean update alone agrees with pFedHB's for ``lam_mu = 0`` and any variance rule.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import numpy as np

from fedsim.config import require
from fedsim.workloads.bayesian import MU, RHO, check_split, softplus, softplus_inverse, split_names
from strategies.personalised import Cohorts, PersonalisedStrategy, Report

Variance = Literal["shared", "per-client", "rho-average"]


# --------------------------------------------------------------------------- closed forms


def l2_global_update(
    mu: np.ndarray,
    sigma2: np.ndarray,
    weights: np.ndarray,
    lam_mu: float,
    lam_sigma: float,
    *,
    start: np.ndarray | None = None,
    iterations: int = 200,
    tol: float = 1e-12,
) -> tuple[np.ndarray, np.ndarray]:
    """Fixed point of (HB-1)/(HB-2): ``(mu_g, sigma_g^2)`` per coordinate.

    Args:
        mu, sigma2: client means and variances, shape (m, D).
        weights: (m,) non-negative, normalised here to sum to 1.
        lam_mu, lam_sigma: the L2 penalties (>= 0).
        start: initial ``mu_g`` (default: the weighted mean).
        iterations, tol: at most ``iterations`` sweeps, stopping when no
            coordinate moves by more than ``tol``.
    """
    _check_lambda(lam_mu, lam_sigma)
    w = _weights(weights, len(mu))
    mean = w @ mu
    mu_g = mean.copy() if start is None else np.array(start, dtype=np.float64)
    s = np.zeros_like(mean)
    for _ in range(max(1, iterations)):
        v = w @ (sigma2 + (mu - mu_g) ** 2)
        s = 2.0 * v / (1.0 + np.sqrt(1.0 + 8.0 * lam_sigma * v))
        new = mean / (1.0 + 2.0 * lam_mu * s)
        moved = np.max(np.abs(new - mu_g)) if new.size else 0.0
        mu_g = new
        if moved <= tol:
            break
    v = w @ (sigma2 + (mu - mu_g) ** 2)
    s = 2.0 * v / (1.0 + np.sqrt(1.0 + 8.0 * lam_sigma * v))
    return mu_g, s


def l2_objective(
    mu_g: np.ndarray,
    sigma2_g: np.ndarray,
    mu: np.ndarray,
    sigma2: np.ndarray,
    weights: np.ndarray,
    lam_mu: float,
    lam_sigma: float,
) -> float:
    """``sum_i w_i KL(q_i || q_g) + lam_mu ||mu_g||^2 + lam_sigma ||sigma_g||^2`` (nats)."""
    w = _weights(weights, len(mu))
    kl = 0.5 * (np.log(sigma2_g / sigma2) + (sigma2 + (mu - mu_g) ** 2) / sigma2_g - 1.0)
    return float((w @ kl).sum() + lam_mu * np.sum(mu_g**2) + lam_sigma * np.sum(sigma2_g))


@dataclass(frozen=True, kw_only=True)
class NormalInverseGamma:
    """The conjugate hyper-prior ``mu_g | s ~ N(m0, s / kappa0)``, ``s ~ IG(a0, b0)``.

    ``kappa0 = 0, a0 = -1.5, b0 = 0`` is the flat limit (moment matching).
    """

    m0: float = 0.0
    kappa0: float = 0.0
    a0: float = -1.5
    b0: float = 0.0

    def __post_init__(self) -> None:
        require(self.kappa0 >= 0, "pfedhb.kappa0", self.kappa0, "a number >= 0")
        require(self.a0 >= -1.5, "pfedhb.a0", self.a0, "a number >= -1.5 (-1.5: flat limit)")
        require(self.b0 >= 0, "pfedhb.b0", self.b0, "a number >= 0")
        require(np.isfinite(self.m0), "pfedhb.m0", self.m0, "a finite number")


def conjugate_global_update(
    mu: np.ndarray,
    sigma2: np.ndarray,
    weights: np.ndarray,
    prior: NormalInverseGamma,
    tau: float,
) -> tuple[np.ndarray, np.ndarray]:
    """MAP (NIG-1)/(NIG-2) of ``(mu_g, sigma_g^2)`` under the Normal-Inverse-Gamma hyper-prior."""
    require(tau > 0, "tau", tau, "a number > 0 (pseudo-observations of the reports)")
    w = _weights(weights, len(mu))
    mean = w @ mu
    mu_g = (tau * mean + prior.kappa0 * prior.m0) / (tau + prior.kappa0)
    v = w @ (sigma2 + (mu - mu_g) ** 2)
    s = (tau * v + prior.kappa0 * (mu_g - prior.m0) ** 2 + 2.0 * prior.b0) / (
        tau + 2.0 * prior.a0 + 3.0
    )
    return mu_g, s


def per_client_global_update(
    mu: np.ndarray, sigma2: np.ndarray, start: np.ndarray, iterations: int = 1
) -> tuple[np.ndarray, np.ndarray]:
    """Per-client scalar prior variances (pFedVEM's model), ``iterations`` EM sweeps.

    Minimises ``sum_i KL(q_i || N(mu_g, rho_i^2 I))`` over ``mu_g`` and the
    ``rho_i^2`` by alternating ``rho_i^2 = mean_d(sigma_i^2 + (mu_i - mu_g)^2)``
    and the precision-weighted mean; returns ``mu_g`` and ``rho^2`` (m,).
    """
    mu_g = np.array(start, dtype=np.float64)
    rho2 = np.ones(len(mu))
    for _ in range(max(1, iterations)):
        rho2 = (sigma2 + (mu - mu_g) ** 2).reshape(len(mu), -1).mean(axis=1)
        p = 1.0 / rho2
        mu_g = np.tensordot(p, mu, axes=1) / p.sum()
    return mu_g, rho2


def _weights(weights: np.ndarray, m: int) -> np.ndarray:
    w = np.asarray(weights, dtype=np.float64)
    if w.shape != (m,) or np.any(w < 0) or w.sum() <= 0:
        raise ValueError(
            f"weights = {w!r} is not allowed: {m} non-negative numbers with a positive sum"
        )
    return w / w.sum()


def _check_lambda(lam_mu: float, lam_sigma: float) -> None:
    require(np.isfinite(lam_mu) and lam_mu >= 0, "pfedhb.lam_mu", lam_mu, "a finite number >= 0")
    require(
        np.isfinite(lam_sigma) and lam_sigma >= 0,
        "pfedhb.lam_sigma",
        lam_sigma,
        "a finite number >= 0",
    )


def stack_part(reports: list[Report], bases: list[str]) -> tuple[np.ndarray, np.ndarray]:
    """Clients' (mu, sigma^2) over the named parameters, flattened: two (m, D) arrays."""
    mu = np.stack([np.concatenate([r.arrays[b + MU].ravel() for b in bases]) for r in reports])
    rho = np.stack([np.concatenate([r.arrays[b + RHO].ravel() for b in bases]) for r in reports])
    return mu, softplus(rho) ** 2


def unstack_part(
    flat: np.ndarray, bases: list[str], like: dict[str, np.ndarray], suffix: str
) -> dict[str, np.ndarray]:
    """Split a flat vector back into ``<base><suffix>`` arrays shaped like ``like``."""
    out, at = {}, 0
    for b in bases:
        shape = like[b + suffix].shape
        size = int(np.prod(shape))
        out[b + suffix] = flat[at : at + size].reshape(shape)
        at += size
    return out


# --------------------------------------------------------------------------- strategy


@dataclass(frozen=True, kw_only=True)
class HBConfig:
    """The server's global-posterior update.

    Attributes:
        hyperprior: "l2" (the reference code's penalty) or "conjugate" (NIG).
        lam_mu, lam_sigma: L2 penalties (the reference uses 5 for both).
        nig: the conjugate hyper-prior (with ``hyperprior = "conjugate"``).
        head_variance, body_variance: "shared" (one sigma_g per coordinate, the
            hierarchical model), "per-client" (a scalar prior variance per
            client, pFedVEM; head only) or "rho-average" (pFedBayes's heuristic).
        head_weighting: "samples" (w_i = n_i / n_S) or "uniform" for the head.
        iterations: fixed-point sweeps (1 with "per-client": pFedVEM's one EM step).
        head_layers: head layers the arrays must hold (the model's split).
        body_bayesian: False keeps the body deterministic (means only; pFedVEM).
    """

    hyperprior: Literal["l2", "conjugate"] = "l2"
    lam_mu: float = 5.0
    lam_sigma: float = 5.0
    nig: NormalInverseGamma = NormalInverseGamma()
    head_variance: Variance = "shared"
    body_variance: Variance = "shared"
    head_weighting: Literal["samples", "uniform"] = "samples"
    iterations: int = 200
    head_layers: int = 1
    body_bayesian: bool = True

    def __post_init__(self) -> None:
        require(
            self.hyperprior in ("l2", "conjugate"),
            "pfedhb.hyperprior",
            self.hyperprior,
            "'l2' or 'conjugate'",
        )
        _check_lambda(self.lam_mu, self.lam_sigma)
        for key in ("head_variance", "body_variance"):
            value = getattr(self, key)
            require(
                value in ("shared", "per-client", "rho-average"),
                f"pfedhb.{key}",
                value,
                "'shared', 'per-client' or 'rho-average'",
            )
        require(
            self.body_variance != "per-client",
            "pfedhb.body_variance",
            self.body_variance,
            "'shared' or 'rho-average' ('per-client' is a head prior)",
        )
        require(
            self.head_weighting in ("samples", "uniform"),
            "pfedhb.head_weighting",
            self.head_weighting,
            "'samples' or 'uniform'",
        )
        require(self.iterations >= 1, "pfedhb.iterations", self.iterations, "an integer >= 1")
        require(self.head_layers >= 1, "pfedhb.head_layers", self.head_layers, "an integer >= 1")


def hb_part_update(
    config: HBConfig,
    part: str,
    previous: dict[str, np.ndarray],
    reports: list[Report],
) -> dict[str, np.ndarray]:
    """The new ``<part>.*_mu`` / ``_rho`` arrays from the reports (one closed form per config)."""
    bases = split_names(list(previous), part)
    mu, sigma2 = stack_part(reports, bases)
    start = np.concatenate([previous[b + MU].ravel() for b in bases])
    n = np.array([r.num_examples for r in reports], dtype=np.float64)
    uniform = part == "head" and config.head_weighting == "uniform"
    weights = np.ones(len(reports)) if uniform else n
    variance = config.head_variance if part == "head" else config.body_variance
    if variance == "per-client":
        mu_g, rho2 = per_client_global_update(mu, sigma2, start, config.iterations)
        sigma2_g = np.full_like(mu_g, 1.0 / np.mean(1.0 / rho2))
    elif config.hyperprior == "conjugate":
        mu_g, sigma2_g = conjugate_global_update(mu, sigma2, weights, config.nig, len(reports))
    else:
        mu_g, sigma2_g = l2_global_update(
            mu,
            sigma2,
            weights,
            config.lam_mu,
            config.lam_sigma,
            start=start,
            iterations=config.iterations,
        )
    if variance == "rho-average":
        w = weights / weights.sum()
        rho = w @ np.stack(
            [np.concatenate([r.arrays[b + RHO].ravel() for b in bases]) for r in reports]
        )
        sigma2_g = softplus(rho) ** 2
        # the mean's penalty sees this variance: mu_g = mean / (1 + 2 lam_mu sigma_g^2)
        if config.hyperprior == "l2":
            mu_g = (w @ mu) / (1.0 + 2.0 * config.lam_mu * sigma2_g)
        rho_g = rho
    else:
        rho_g = softplus_inverse(np.sqrt(np.maximum(sigma2_g, 1e-30)))
    if part == "body" and not config.body_bayesian:
        rho_g = np.concatenate([previous[b + RHO].ravel() for b in bases])
    return {
        **unstack_part(mu_g, bases, previous, MU),
        **unstack_part(rho_g, bases, previous, RHO),
    }


class PFedHB(PersonalisedStrategy):
    """pFedHB's server: closed-form global posterior of head and body each round."""

    method = "pfedhb"

    def __init__(self, config: HBConfig | None = None, cohorts: Cohorts | None = None) -> None:
        super().__init__(cohorts)
        self.config = config or HBConfig()

    def client_config(self, server_round: int) -> dict[str, int | float | str]:
        return {
            "head-prior": "per-client" if self.config.head_variance == "per-client" else "global",
            "body-bayesian": int(self.config.body_bayesian),
        }

    def global_update(
        self, server_round: int, previous: dict[str, np.ndarray], reports: list[Report]
    ) -> dict[str, np.ndarray]:
        check_split(list(previous), self.config.head_layers)
        out = dict(previous)
        for part in ("head", "body"):
            out.update(hb_part_update(self.config, part, previous, reports))
        return out
