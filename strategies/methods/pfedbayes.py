"""pFedBayes: personalised FL via Bayesian inference (Zhang et al., NeurIPS 2022).

Each client keeps a personal posterior ``q_i`` over the whole network and a
localised copy ``w_i`` of the global model (both mean-field Gaussians). The
client alternates (:mod:`fedsim.workloads.personalised`)

    personal step:      min_q  -E_q[log p(D_i | theta)] + (zeta / N_b) KL(q_i || w_i)
    local-global step:  min_w  KL(q_i || w_i)

and reports ``w_i``. The server averages the reported parameters, means and
``rho`` alike, weighted by samples (the paper's aggregation, Alg. 1 line 14)::

    mu_g = sum_i (n_i / n_S) mu_i,   rho_g = sum_i (n_i / n_S) rho_i
"""

from __future__ import annotations

import numpy as np

from strategies.plumbing.personalised import Cohorts, PersonalisedStrategy, Report
from strategies.plumbing.personalised_config import ScheduledOptions, personalised_spec


class PFedBayes(PersonalisedStrategy):
    """pFedBayes's server: the sample-weighted average of ``(mu, rho)``."""

    method = "pfedbayes"

    def global_update(
        self, server_round: int, previous: dict[str, np.ndarray], reports: list[Report]
    ) -> dict[str, np.ndarray]:
        w = np.array([r.num_examples for r in reports], dtype=np.float64)
        w /= w.sum()
        return {
            k: sum(wi * r.arrays[k] for wi, r in zip(w, reports, strict=True)) for k in previous
        }


def _from_options(opts: ScheduledOptions, cohorts: Cohorts, head_layers: int) -> PFedBayes:
    return PFedBayes(cohorts)


SPEC = personalised_spec("pfedbayes", ScheduledOptions, _from_options)
