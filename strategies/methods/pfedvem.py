"""pFedVEM: confidence-aware personalised FL via variational expectation maximisation.

Zhu, Ma & Blaschko, "Confidence-aware Personalized Federated Learning via
Variational Expectation Maximization", CVPR 2023 (code: JunyiZhu-AI/confidence_aware_PFL).
The personal head of client i has the prior ``N(mu_g, rho_i^2 I)`` with one
scalar variance per client; the body is a deterministic network shared by FedAvg.

* Client (E-step, :mod:`fedsim.workloads.personalised`): train the head on
  summed NLL + ``KL(q_i || N(mu_g, rho_i^2 I))``, the body on the mean NLL;
  report ``mu_i``, ``sigma_i`` and ``rho_i^2 = (sum_d sigma_id^2 + sum_d (mu_id - mu_gd)^2) / D``,
  its M-step against the ``mu_g`` it received, taken at the start of the round with the
  head it kept from its last round (the reference's ``client.rho``).
* Server (M-step for ``mu_g``): the precision-weighted mean
  ``mu_g = sum_i (mu_i / rho_i^2) / sum_i (1 / rho_i^2)``; the body is FedAvg of
  the reported body weights with server momentum ``beta``:
  ``v <- beta v + (sum_i w_i theta_i - theta_g)``, ``theta_g <- theta_g + v``.

The head's global variance (unused by pFedVEM's clients) is the harmonic mean of
the ``rho_i^2``, as pFedHB's per-client mode reports it.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from fedsim.config import require
from fedsim.workloads.bayesian import MU, RHO, check_split, softplus_inverse, split_names
from fedsim.workloads.personalised import PRIOR_VAR
from strategies.plumbing.personalised import Cohorts, PersonalisedStrategy, Report, unstack_part
from strategies.plumbing.personalised_config import ScheduledOptions, personalised_spec


def vem_head_mean(mu: np.ndarray, rho2: np.ndarray) -> np.ndarray:
    """``sum_i (mu_i / rho_i^2) / sum_i (1 / rho_i^2)`` for (m, D) means and (m,) variances."""
    p = 1.0 / np.asarray(rho2, dtype=np.float64)
    return np.tensordot(p, mu, axes=1) / p.sum()


class PFedVEM(PersonalisedStrategy):
    """pFedVEM's server: precision-weighted head mean, FedAvg(M) body."""

    method = "pfedvem"

    def __init__(
        self, cohorts: Cohorts | None = None, beta: float = 0.0, head_layers: int = 1
    ) -> None:
        require(0 <= beta < 1, "pfedvem.beta", beta, "a number in [0, 1)")
        super().__init__(cohorts)
        self.beta = beta
        self.head_layers = head_layers
        self.velocity: dict[str, np.ndarray] = {}

    def client_config(self, server_round: int) -> dict[str, int | float | str]:
        return {"head-prior": "per-client", "body-bayesian": 0}

    def global_update(
        self, server_round: int, previous: dict[str, np.ndarray], reports: list[Report]
    ) -> dict[str, np.ndarray]:
        check_split(list(previous), self.head_layers)
        for r in reports:
            if PRIOR_VAR not in r.metrics:
                raise ValueError(f"a pFedVEM reply lacks the metric {PRIOR_VAR!r}")
        out = dict(previous)
        heads = split_names(list(previous), "head")
        mu = np.stack([np.concatenate([r.arrays[b + MU].ravel() for b in heads]) for r in reports])
        rho2 = np.array([r.metrics[PRIOR_VAR] for r in reports])
        mu_g = vem_head_mean(mu, rho2)
        sigma_g = np.sqrt(1.0 / np.mean(1.0 / rho2))
        out.update(unstack_part(mu_g, heads, previous, MU))
        rho_g = np.full_like(mu_g, float(softplus_inverse(sigma_g)))
        out.update(unstack_part(rho_g, heads, previous, RHO))
        w = np.array([r.num_examples for r in reports], dtype=np.float64)
        w /= w.sum()
        for base in split_names(list(previous), "body"):
            key = base + MU
            delta = (
                sum(wi * r.arrays[key] for wi, r in zip(w, reports, strict=True)) - previous[key]
            )
            v = self.beta * self.velocity.get(key, 0.0) + delta
            self.velocity[key] = v
            out[key] = previous[key] + v
        return out


@dataclass(frozen=True)
class PFedVEMOptions(ScheduledOptions):
    """pfedvem: ``min_clients``, ``schedule`` and ``beta`` (server momentum of the body, in
    [0, 1), checked by :class:`PFedVEM`)."""

    beta: float = 0.0


def _from_options(opts: PFedVEMOptions, cohorts: Cohorts, head_layers: int) -> PFedVEM:
    return PFedVEM(cohorts, beta=opts.beta, head_layers=head_layers)


SPEC = personalised_spec("pfedvem", PFedVEMOptions, _from_options)
