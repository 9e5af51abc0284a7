"""ε per round of the two samplings docs/fedsim-strategies-in-flower-apps.md quotes.

The settings of ``tests/frontend/test_flwr_records.py`` (20 nodes, clipping norm 1, noise multiplier
1, δ = 1e-5, RDP): fixed-size cohorts of 10 of 20 under replace-one neighbours (FedAvg
``fraction_train=0.5``, ``fedsim run`` uniform) and Poisson sampling at rate 0.25 under
add/remove neighbours (``flwr-run --sampling poisson --clients-per-round 5``), after rounds
1, 2 and 3, from :func:`fedsim.privacy.epsilon.epsilon`. Writes ``flwr_sampling.json``
next to this file.

    python experiments/accounting/flwr_sampling.py
"""

from __future__ import annotations

import json
from pathlib import Path

from fedsim.commands.account import quiet_dp_accounting
from fedsim.privacy.epsilon import epsilon
from fedsim.privacy.sampling import FixedSizeSampling, NeighbouringRelation, PoissonSampling

NODES, COHORT, RATE, NOISE, DELTA, ROUNDS = 20, 10, 0.25, 1.0, 1e-5, 3
OUT = Path(__file__).with_name("flwr_sampling.json")


def main() -> None:
    settings = {
        "uniform": (FixedSizeSampling(COHORT, NODES), NeighbouringRelation.REPLACE_ONE),
        "poisson": (PoissonSampling(RATE), NeighbouringRelation.ADD_REMOVE),
    }
    result: dict = {
        "setting": {
            "nodes": NODES,
            "cohort": COHORT,
            "poisson_rate": RATE,
            "noise_multiplier": NOISE,
            "delta": DELTA,
            "accountant": "rdp",
        }
    }
    with quiet_dp_accounting():
        for name, (sampling, relation) in settings.items():
            result[name] = {
                "relation": relation.value,
                "epsilon": [
                    epsilon(NOISE, sampling, t, DELTA, "rdp", relation)
                    for t in range(1, ROUNDS + 1)
                ],
            }
    OUT.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
