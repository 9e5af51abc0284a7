"""DMM's ``[strategy.options]``: one frozen dataclass, read by
:func:`fedsim.config.from_mapping` (errors name ``strategy.options.<key>``, its value and what
is allowed), with every default written here once."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from fedsim.config import require
from fedsim.privacy import dmm as dmm_privacy

WHERE = "strategy.options"


@dataclass(frozen=True)
class DMMOptions:
    """The options of ``[strategy] name = "dmm"``.

    Attributes:
        clipping_norm, noise_multiplier: c and z (required; finite, > 0).
        kind: the factorization of the prefix-sum workload: banded C ("banded", "toeplitz")
            or the 0/1 tree ("tree", "honaker"), any registered kind that declares itself
            banded or 0/1 (:func:`fedsim.privacy.dmm.kinds`); ``bands``: its bands (None:
            the min separation, at most rounds - 1); ``kind_options``: the kind's own
            integer parameters (:attr:`fedsim.privacy.matrix.kind.Kind.options`).
        committee_size, threshold, packing, member_dropouts: n, t, k of every committee and
            the member dropouts it is planned for (t + dropouts < (1/2 - k/n) n,
            :func:`strategies.methods.dmm.calibration.committee_bound`).
        fractional_bits: f of M = round(2^f C) (None: 12 for banded C, 0 for the tree).
        mode: "full" (clients share and seal; members on the committee host) or "ideal".
        bits: signed bits of the sum of the planned rounded updates (sets gamma).
        delta: the run's delta; min_clients: fewest agreed clients a release may carry.
        expected_client_dropout: fraction of clients the noise is planned to lose, in [0, 1).
        committee_actors, committee_shards: members on Ray actors, and in how many shards
            (1 <= shards <= committee_size).
        worker_fold: full mode: fold each worker batch's sharing inputs into one sealed
            message (:mod:`strategies.secure.dmm.fold`).
        reshare_checks: dealers beyond t + k a committee handoff needs (1: a wrong dealing is
            caught).
    """

    clipping_norm: float
    noise_multiplier: float
    kind: str = "banded"
    bands: int | None = None
    kind_options: dict[str, int] | None = None
    committee_size: int = 20
    threshold: int = 3
    packing: int = 3
    member_dropouts: int = 3
    fractional_bits: int | None = None
    mode: Literal["full", "ideal"] = "full"
    bits: int = 20
    delta: float = 1e-5
    min_clients: int = 1
    expected_client_dropout: float = 0.0
    committee_actors: bool = False
    committee_shards: int = 4
    worker_fold: bool = False
    reshare_checks: int = 1

    def __post_init__(self) -> None:
        for key in ("clipping_norm", "noise_multiplier"):
            value = getattr(self, key)
            require(value > 0, f"{WHERE}.{key}", value, "a finite number > 0")
        kinds = dmm_privacy.kinds()
        require(self.kind in kinds, f"{WHERE}.kind", self.kind, f"one of {', '.join(kinds)}")
        require(
            self.bands is None or self.bands >= 1,
            f"{WHERE}.bands",
            self.bands,
            "an integer >= 1 (or absent: the min separation)",
        )
        for key, low in (("committee_size", 1), ("threshold", 1), ("packing", 1)):
            value = getattr(self, key)
            require(value >= low, f"{WHERE}.{key}", value, f"an integer >= {low}")
        require(
            self.member_dropouts >= 0,
            f"{WHERE}.member_dropouts",
            self.member_dropouts,
            "an integer >= 0",
        )
        require(
            0.0 <= self.expected_client_dropout < 1.0,
            f"{WHERE}.expected_client_dropout",
            self.expected_client_dropout,
            "a number in [0, 1)",
        )
        require(
            1 <= self.committee_shards <= self.committee_size,
            f"{WHERE}.committee_shards",
            self.committee_shards,
            f"an integer in [1, committee_size = {self.committee_size}]",
        )
