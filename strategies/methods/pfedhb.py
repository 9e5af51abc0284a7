"""pFedHB: the global posterior of a hierarchical Bayesian personalised FL model.

Thapa & Li, "Harnessing Heterogeneous Statistical Strength for Personalized
Federated Learning via Hierarchical Bayesian Inference", ICML 2025. Clients hold
personal mean-field posteriors ``q_i = N(mu_i, sigma_i^2)`` (per coordinate)
trained against the global posterior ``q_g = N(mu_g, sigma_g^2)`` as their
prior; the server fits ``q_g`` to the reporting clients' posteriors, separately
for the head and the body, coordinate by coordinate:

L2 hyper-prior (the reference code's objective, weights ``w_i = n_i / n_S``)::

    min  sum_i w_i KL(q_i || q_g) + lam_mu mu_g^2 + lam_sigma sigma_g^2

whose stationary point satisfies, with ``V = sum_i w_i (sigma_i^2 + (mu_i - mu_g)^2)``,

    mu_g      = sum_i w_i mu_i / (1 + 2 lam_mu sigma_g^2)                  (HB-1)
    sigma_g^2 = (sqrt(1 + 8 lam_sigma V) - 1) / (4 lam_sigma)
              = 2 V / (1 + sqrt(1 + 8 lam_sigma V))                         (HB-2)

(from d/dmu_g and d/dsigma_g: ``2 lam_sigma s^2 + s - V = 0``, ``s = sigma_g^2``),
iterated to a fixed point from the previous global mean. ``lam = 0`` gives
moment matching: ``mu_g`` the weighted mean, ``sigma_g^2 = V``.

Two server solvers minimise that objective (``HBConfig.server_solver``):

* ``"adam"`` (the default): the reference code's dynamics (``hb/server.py``): a few Adam
  steps (5, lr 0.01, betas (0.9, 0.999), eps 1e-8) on ``(mu_g, rho_g)``, ``sigma_g =
  softplus(rho_g)``, per round from the previous global, with one optimiser per part whose
  moments persist across rounds and a MultiStepLR schedule (lr x 0.1 from round 61 and
  from round 81). Its gradients, with ``m = sum_i w_i mu_i`` and ``V`` as above::

      dL/dmu_g    = (mu_g - m) / sigma_g^2 + 2 lam_mu mu_g
      dL/dsigma_g = 1 / sigma_g - V / sigma_g^3 + 2 lam_sigma sigma_g,
      dL/drho_g   = dL/dsigma_g * sigmoid(rho_g)

* ``"exact"``: the stationary point (HB-1)/(HB-2) every round.

Why Adam is the default: the numbers the paper reports come from those dynamics, and they
are a different algorithm from the exact solve. With lr 0.01 and 5 steps, ``rho_g`` moves by
at most ~0.05 a round, so ``sigma_g`` stays near its initial softplus(-4) = 0.018 for tens of
rounds, the shrinkage ``1 / (1 + 2 lam_mu sigma_g^2)`` stays ~1 and the clients' priors stay
tight; the exact solve sets ``sigma_g^2`` to about the clients' spread ``V`` in the first
round and shrinks the body means by up to 1 / (1 + 2 lam_mu V) every round.

Conjugate hyper-prior: a Normal-Inverse-Gamma ``mu_g | s ~ N(m0, s / kappa0)``,
``s ~ IG(a0, b0)``, with the reports as ``tau = |S|`` pseudo-observations:
``min tau sum_i w_i KL(q_i || q_g) - log NIG(mu_g, s)``, whose MAP is explicit::

    mu_g = (tau mu_bar + kappa0 m0) / (tau + kappa0)                          (NIG-1)
    s    = (tau V(mu_g) + kappa0 (mu_g - m0)^2 + 2 b0) / (tau + 2 a0 + 3)     (NIG-2)

``kappa0 = 0, a0 = -3/2, b0 = 0`` (the flat limit) is again moment matching.

Special cases (``tests/strategies/test_pfedhb_server.py`` checks each on the same inputs):

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

import dataclasses
import typing
from dataclasses import dataclass
from typing import Any, Literal

import numpy as np

from fedsim.config import require
from fedsim.workloads.bayesian import MU, RHO, check_split, softplus, softplus_inverse, split_names
from strategies.plumbing.personalised import Cohorts, PersonalisedStrategy, Report, unstack_part
from strategies.plumbing.personalised_config import ScheduledOptions, personalised_spec

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


def l2_gradient(
    mu_g: np.ndarray,
    rho_g: np.ndarray,
    mu: np.ndarray,
    sigma2: np.ndarray,
    weights: np.ndarray,
    lam_mu: float,
    lam_sigma: float,
) -> tuple[np.ndarray, np.ndarray]:
    """Gradient of :func:`l2_objective` in ``(mu_g, rho_g)``, ``sigma_g = softplus(rho_g)``."""
    w = _weights(weights, len(mu))
    sigma = softplus(rho_g)
    v = w @ (sigma2 + (mu - mu_g) ** 2)
    d_mu = (mu_g - w @ mu) / sigma**2 + 2.0 * lam_mu * mu_g
    d_sigma = 1.0 / sigma - v / sigma**3 + 2.0 * lam_sigma * sigma
    return d_mu, d_sigma / (1.0 + np.exp(-np.asarray(rho_g, dtype=np.float64)))


@dataclass
class AdamState:
    """Adam's moments of one flat parameter vector (Kingma & Ba 2015, Alg. 1) and its step count."""

    first: np.ndarray
    second: np.ndarray
    steps: int = 0

    def step(
        self,
        params: np.ndarray,
        grad: np.ndarray,
        lr: float,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
    ) -> np.ndarray:
        """One Adam step as torch.optim.Adam takes it (no weight decay, not amsgrad)."""
        b1, b2 = betas
        self.steps += 1
        self.first = b1 * self.first + (1.0 - b1) * grad
        self.second = b2 * self.second + (1.0 - b2) * grad**2
        correction1 = 1.0 - b1**self.steps
        correction2 = 1.0 - b2**self.steps
        denominator = np.sqrt(self.second) / np.sqrt(correction2) + eps
        return params - (lr / correction1) * self.first / denominator


def l2_adam_update(
    mu: np.ndarray,
    sigma2: np.ndarray,
    weights: np.ndarray,
    lam_mu: float,
    lam_sigma: float,
    *,
    start_mu: np.ndarray,
    start_rho: np.ndarray,
    state: AdamState,
    lr: float,
    steps: int,
) -> tuple[np.ndarray, np.ndarray]:
    """``steps`` Adam steps on :func:`l2_objective` from ``(start_mu, start_rho)``.

    ``state`` holds the moments of the concatenated ``(mu_g, rho_g)`` and is advanced in
    place (the reference keeps one optimiser per part for the whole run). Returns the new
    ``(mu_g, rho_g)``.
    """
    _check_lambda(lam_mu, lam_sigma)
    d = start_mu.size
    params = np.concatenate([start_mu, start_rho]).astype(np.float64)
    if state.first.shape != params.shape:
        raise ValueError(
            f"the Adam state holds {state.first.size} values, the global part {params.size}"
        )
    for _ in range(steps):
        d_mu, d_rho = l2_gradient(params[:d], params[d:], mu, sigma2, weights, lam_mu, lam_sigma)
        params = state.step(params, np.concatenate([d_mu, d_rho]), lr)
    return params[:d], params[d:]


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
        key = "strategy.options.nig."  # read nested in a config's options, named there
        require(self.kappa0 >= 0, key + "kappa0", self.kappa0, "a number >= 0")
        require(self.a0 >= -1.5, key + "a0", self.a0, "a number >= -1.5 (-1.5: flat limit)")
        require(self.b0 >= 0, key + "b0", self.b0, "a number >= 0")
        require(np.isfinite(self.m0), key + "m0", self.m0, "a finite number")


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


# --------------------------------------------------------------------------- strategy


@dataclass(frozen=True, kw_only=True)
class HBConfig:
    """The server's global-posterior update.

    Attributes:
        server_solver: "adam" (the reference code's few Adam steps per round, the
            default; see the module docstring for why) or "exact" (the stationary point
            of the L2 objective every round). Only the L2 objective with shared variances
            has a solver to choose; the other rules are closed forms and need "exact".
        server_steps, server_lr: Adam steps per round and learning rate (reference: 5, 0.01).
        server_milestones, server_gamma: MultiStepLR: the learning rate is multiplied by
            ``server_gamma`` from the round after each milestone (reference: 60, 80; 0.1).
        hyperprior: "l2" (the reference code's penalty) or "conjugate" (NIG).
        lam_mu, lam_sigma: L2 penalties (the reference uses 5 for both).
        nig: the conjugate hyper-prior (with ``hyperprior = "conjugate"``).
        head_variance, body_variance: "shared" (one sigma_g per coordinate, the
            hierarchical model), "per-client" (a scalar prior variance per
            client, pFedVEM; head only) or "rho-average" (pFedBayes's heuristic).
        head_weighting: "samples" (w_i = n_i / n_S) or "uniform" for the head.
        iterations: fixed-point sweeps of the exact solver (1 with "per-client":
            pFedVEM's one EM step).
        head_layers: head layers the arrays must hold (the model's split).
        body_bayesian: False keeps the body deterministic (means only; pFedVEM).
    """

    server_solver: Literal["adam", "exact"] = "adam"
    server_steps: int = 5
    server_lr: float = 0.01
    server_milestones: tuple[int, ...] = (60, 80)
    server_gamma: float = 0.1
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
        self._check_solver()

    def _check_solver(self) -> None:
        """The server solver's settings: its kind, steps, learning rate and schedule."""
        require(
            self.server_solver in ("adam", "exact"),
            "pfedhb.server_solver",
            self.server_solver,
            "'adam' (the reference code's dynamics) or 'exact' (the fixed point)",
        )
        require(
            self.server_solver == "exact" or self.has_solver_choice,
            "pfedhb.server_solver",
            self.server_solver,
            "'exact' with hyperprior = 'conjugate' or a 'per-client' / 'rho-average' "
            "variance (closed forms); 'adam' minimises the L2 objective with shared variances",
        )
        require(self.server_steps >= 1, "pfedhb.server_steps", self.server_steps, "an integer >= 1")
        require(
            np.isfinite(self.server_lr) and self.server_lr > 0,
            "pfedhb.server_lr",
            self.server_lr,
            "a finite number > 0",
        )
        require(
            all(isinstance(m, int) and m >= 1 for m in self.server_milestones)
            and list(self.server_milestones) == sorted(set(self.server_milestones)),
            "pfedhb.server_milestones",
            self.server_milestones,
            "increasing round numbers >= 1",
        )
        require(
            0 < self.server_gamma <= 1,
            "pfedhb.server_gamma",
            self.server_gamma,
            "a number in (0, 1]",
        )

    @property
    def has_solver_choice(self) -> bool:
        """The L2 objective with shared variances: the one ``server_solver`` applies to."""
        return self.hyperprior == "l2" and self.head_variance == self.body_variance == "shared"

    def server_lr_at(self, server_round: int) -> float:
        """The Adam learning rate of round ``server_round`` (1-based): MultiStepLR stepped
        once after every round, as the reference's ``sch_global_*.step()``."""
        passed = sum(server_round - 1 >= m for m in self.server_milestones)
        return self.server_lr * self.server_gamma**passed


def hb_part_update(
    config: HBConfig,
    part: str,
    previous: dict[str, np.ndarray],
    reports: list[Report],
    *,
    server_round: int = 1,
    adam: AdamState | None = None,
) -> dict[str, np.ndarray]:
    """The new ``<part>.*_mu`` / ``_rho`` arrays from the reports.

    One closed form per config, or (``server_solver = "adam"``) the round's Adam steps,
    which advance ``adam``, the part's optimiser state.
    """
    bases = split_names(list(previous), part)
    mu, sigma2 = stack_part(reports, bases)
    start_mu = np.concatenate([previous[b + MU].ravel() for b in bases])
    start_rho = np.concatenate([previous[b + RHO].ravel() for b in bases])
    n = np.array([r.num_examples for r in reports], dtype=np.float64)
    uniform = part == "head" and config.head_weighting == "uniform"
    weights = np.ones(len(reports)) if uniform else n
    variance = config.head_variance if part == "head" else config.body_variance
    if variance == "rho-average":
        mu_g, rho_g = _rho_average(config, mu, sigma2, weights, reports, bases)
    elif variance == "per-client":
        mu_g, rho2 = per_client_global_update(mu, sigma2, start_mu, config.iterations)
        rho_g = softplus_inverse(np.full_like(mu_g, np.sqrt(1.0 / np.mean(1.0 / rho2))))
    elif config.hyperprior == "conjugate":
        mu_g, s = conjugate_global_update(mu, sigma2, weights, config.nig, len(reports))
        rho_g = softplus_inverse(np.sqrt(np.maximum(s, 1e-30)))
    elif config.server_solver == "adam":
        if adam is None:
            raise ValueError("server_solver = 'adam' needs the part's Adam state")
        mu_g, rho_g = l2_adam_update(
            mu, sigma2, weights, config.lam_mu, config.lam_sigma, start_mu=start_mu,
            start_rho=start_rho, state=adam, lr=config.server_lr_at(server_round),
            steps=config.server_steps,
        )  # fmt: skip
    else:
        mu_g, s = l2_global_update(
            mu, sigma2, weights, config.lam_mu, config.lam_sigma, start=start_mu,
            iterations=config.iterations,
        )  # fmt: skip
        rho_g = softplus_inverse(np.sqrt(np.maximum(s, 1e-30)))
    if part == "body" and not config.body_bayesian:
        rho_g = start_rho
    return {
        **unstack_part(mu_g, bases, previous, MU),
        **unstack_part(rho_g, bases, previous, RHO),
    }


def _rho_average(
    config: HBConfig,
    mu: np.ndarray,
    sigma2: np.ndarray,
    weights: np.ndarray,
    reports: list[Report],
    bases: list[str],
) -> tuple[np.ndarray, np.ndarray]:
    """pFedBayes's heuristic: ``rho_g`` the weighted mean of the ``rho_i``. The mean is the
    hyper-prior's: (NIG-1), or with the L2 penalty (which sees this variance)
    ``mu_g = m / (1 + 2 lam_mu sigma_g^2)``."""
    w = weights / weights.sum()
    rho = w @ np.stack(
        [np.concatenate([r.arrays[b + RHO].ravel() for b in bases]) for r in reports]
    )
    if config.hyperprior == "conjugate":
        return conjugate_global_update(mu, sigma2, weights, config.nig, len(reports))[0], rho
    return (w @ mu) / (1.0 + 2.0 * config.lam_mu * softplus(rho) ** 2), rho


class PFedHB(PersonalisedStrategy):
    """pFedHB's server: the global posterior of head and body each round (Adam steps or
    the exact minimiser, see :class:`HBConfig`); the Adam moments persist across rounds."""

    method = "pfedhb"

    def __init__(self, config: HBConfig | None = None, cohorts: Cohorts | None = None) -> None:
        super().__init__(cohorts)
        self.config = config or HBConfig()
        self.adam: dict[str, AdamState] = {}

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
            adam = None
            if self.config.server_solver == "adam" and self.config.has_solver_choice:
                size = 2 * sum(previous[b + MU].size for b in split_names(list(previous), part))
                adam = self.adam.setdefault(part, AdamState(np.zeros(size), np.zeros(size)))
            out.update(
                hb_part_update(
                    self.config, part, previous, reports, server_round=server_round, adam=adam
                )
            )
        return out


_HB_TYPES = typing.get_type_hints(HBConfig, include_extras=True)
#: ``strategy.options`` of "pfedhb": ``min_clients``, ``schedule`` and the fields of
#: :class:`HBConfig` (its defaults) but ``head_layers``, which ``[model] head_layers`` sets
PFedHBOptions = dataclasses.make_dataclass(
    "PFedHBOptions",
    [
        (f.name, _HB_TYPES[f.name], dataclasses.field(default=f.default))
        for f in dataclasses.fields(HBConfig)
        if f.name != "head_layers"
    ],
    bases=(ScheduledOptions,),
    frozen=True,
)
PFedHBOptions.__module__ = __name__


def _from_options(opts: Any, cohorts: Cohorts, head_layers: int) -> PFedHB:
    fields = {f.name: getattr(opts, f.name) for f in dataclasses.fields(opts)}
    fields = {k: v for k, v in fields.items() if k in _HB_TYPES}
    return PFedHB(HBConfig(**fields, head_layers=head_layers), cohorts)


SPEC = personalised_spec("pfedhb", PFedHBOptions, _from_options)
