"""DMM's accounting (:mod:`fedsim.privacy.dmm`): the discrete Gaussian zCDP bound of the integer
matrix's rows released so far, counting only the noise actually present (KLS21), under the
participation schema in mechanism steps; the ledger gets each round's increase."""

from __future__ import annotations

import numpy as np

from fedsim.privacy import dmm as dmm_privacy
from fedsim.privacy.participation import Participation
from protocols.dmm.common import OpenedRelease
from protocols.encoding import DDGaussEncoder


def in_steps(participation: Participation, aborted_rounds: int) -> Participation:
    """The schema in mechanism steps: an aborted round shifts later rounds one step
    closer, so min separation shrinks by the aborted rounds (never below 1)."""
    if participation.kind != "min_sep" or not aborted_rounds:
        return participation
    return Participation.separated(
        max(1, int(participation.min_sep) - aborted_rounds), participation.max_participations
    )


def for_participation(
    cache: dict[Participation, dmm_privacy.IntegerMechanism],
    mechanism: dmm_privacy.IntegerMechanism,
    participation: Participation,
) -> dict[Participation, dmm_privacy.IntegerMechanism]:
    """``cache`` holding ``mechanism`` rebuilt for ``participation`` (the cache of one)."""
    if participation in cache:
        return cache
    if participation != mechanism.participation:
        mechanism = dmm_privacy.IntegerMechanism(
            mechanism.factorization, mechanism.fractional_bits, participation
        )
    return {participation: mechanism}


def released_epsilon(
    mechanism: dmm_privacy.IntegerMechanism,
    steps: int,
    counts: dict[int, int],
    encoder: DDGaussEncoder,
    noise_std: float,
    opened: OpenedRelease | None = None,
) -> float:
    """The zCDP bound of the rows released in ``steps`` steps (row -> noise contributors in
    ``counts``), and of ``opened``'s rows as released (an aborted round whose release
    shares reached the server)."""
    counts = dict(counts)
    if opened is not None:
        steps = opened.step + 1
        counts.update({int(i): int(opened.clients) for i in opened.rows})
    rows = np.flatnonzero(mechanism.rounds < steps)
    return dmm_privacy.zcdp_epsilon(
        mechanism,
        steps,
        encoder.l2_bound,
        encoder.l1_bound,
        noise_std,
        [counts.get(int(i), 0) for i in rows],
        encoder.padded_dim,
    )
