"""DDGauss's ``[strategy.options]``: :class:`DDGaussOptions` (read by ``config.from_mapping``)
and the argument checks the strategy and its options share."""

from __future__ import annotations

import dataclasses
import logging
import math
from dataclasses import dataclass
from typing import Any

from flwr.serverapp.strategy import Strategy

from fedsim.config import require
from fedsim.engine.committee import Committee, CommitteeSpec
from protocols.encoding import DEFAULT_BETA
from protocols.secagg.prg import PRG_ALLOWED, PRG_NAMES, MaskPRG
from strategies.plumbing.wrapper import fraction_evaluate
from strategies.secure import clear
from strategies.secure.committee import CommitteeOptions

log = logging.getLogger(__name__)

NAME = "ddgauss"
#: DDGauss's ``mode`` -> the secure sum it runs (:mod:`strategies.secure`)
SECURE_SUMS = {"full": "secagg", "plaintext": "plaintext", "committee": "committee"}
MODES = tuple(SECURE_SUMS)
#: the refusal of federated evaluation without ``metrics_in_clear``
EVALUATION_REFUSED = clear.evaluation_refusal("DDGauss")
_RENAMED = (
    "mode='ideal' is now mode='plaintext': the clients' encodings reach the server in the "
    "clear (only the sum's arithmetic matches full mode); use 'full' for SecAgg+"
)


def check_options(
    where: str,
    *,
    clipping_norm: float,
    noise_multiplier: float,
    mode: str,
    member_dropout: float,
    secagg_degree: int | None,
    ring_bits: int | None,
    bits: int,
    protocol_dropout: float,
    stage_timeout: float | None,
    prg: str = "chacha20",
) -> None:
    """A ConfigError (a ValueError) naming ``<where><key>`` on a :class:`DDGauss` option out
    of its range (``where``: ``"strategy.options."`` for a config's, ``""`` for arguments)."""
    require(mode != "ideal", f"{where}mode", mode, _RENAMED)
    require(prg in PRG_NAMES, f"{where}prg", prg, PRG_ALLOWED)
    require(mode in MODES, f"{where}mode", mode, f"one of {', '.join(map(repr, MODES))}")
    for key, value in (("clipping_norm", clipping_norm), ("noise_multiplier", noise_multiplier)):
        require(math.isfinite(value) and value > 0, where + key, value, "finite and > 0")
    require(
        0.0 <= member_dropout <= 1.0 and not (member_dropout and mode != "committee"),
        f"{where}member_dropout",
        member_dropout,
        f"a probability, non-zero only in mode='committee' (mode={mode!r})",
    )
    require(
        secagg_degree is None or (secagg_degree >= 2 and secagg_degree % 2 == 0),
        f"{where}secagg_degree",
        secagg_degree,
        "an even integer >= 2",
    )
    require(
        ring_bits is None or (isinstance(ring_bits, int) and bits <= ring_bits <= 64),
        f"{where}ring_bits",
        ring_bits,
        f"an integer in [bits={bits}, 64] so that the planned sum cannot wrap",
    )
    require(
        0.0 <= protocol_dropout <= 1.0, f"{where}protocol_dropout", protocol_dropout,
        "a probability",
    )
    require(
        stage_timeout is None or stage_timeout > 0,
        f"{where}stage_timeout",
        stage_timeout,
        "seconds > 0 or None",
    )


def check_arguments(
    expected_clients: int, mode: str, committee: Any, strategy: Strategy, metrics_in_clear: bool
) -> None:
    """Raise ValueError on a :class:`DDGauss` argument that no option sets, or on federated
    evaluation without ``metrics_in_clear``."""
    if not isinstance(expected_clients, int) or expected_clients < 2:
        raise ValueError(f"expected_clients={expected_clients!r}; it must be an integer >= 2")
    if (mode == "committee") != (committee is not None):
        raise ValueError(
            f"committee={committee!r} with mode={mode!r}: pass a Committee or CommitteeSpec "
            "exactly when mode='committee'"
        )
    if committee is not None and not isinstance(committee, Committee | CommitteeSpec):
        raise ValueError(
            f"committee is a {type(committee).__name__}; allowed: Committee or CommitteeSpec"
        )
    clear.check_evaluation(fraction_evaluate(strategy), metrics_in_clear, EVALUATION_REFUSED)


#: the committee's keys, only with ``mode = "committee"``
_COMMITTEE_ONLY = tuple(f.name for f in dataclasses.fields(CommitteeOptions))


@dataclass(frozen=True, kw_only=True)
class DDGaussOptions(CommitteeOptions):
    """``strategy.options`` of "ddgauss" (see :func:`from_options`); the committee's keys are
    :class:`~strategies.secure.committee.CommitteeOptions`' (None: unset,
    :class:`~fedsim.engine.committee.CommitteeSpec`'s defaults), only in committee mode."""

    clipping_norm: float
    noise_multiplier: float
    mode: str = "full"
    bits: int = 20
    beta: float = DEFAULT_BETA
    max_tries: int = 100
    delta: float = 1e-5
    secagg_degree: int | None = None
    ring_bits: int | None = None
    protocol_dropout: float = 0.0
    stage_timeout: float | None = 3600.0
    prg: str = MaskPRG.CHACHA20.value

    def __post_init__(self) -> None:
        require(self.mode != "ideal", f"{WHERE}.mode", self.mode, _RENAMED)
        given = [k for k in _COMMITTEE_ONLY if getattr(self, k) is not None]
        require(
            self.mode == "committee" or not given,
            f"{WHERE}.{given[0] if given else 'mode'}",
            getattr(self, given[0]) if given else self.mode,
            "only with mode = 'committee'",
        )
        self.committee()
        check_options(
            f"{WHERE}.",
            **{k: getattr(self, k) for k in _CHECKED},
            member_dropout=self.dropout,
        )

    @property
    def secure_sum(self) -> str | None:
        """The secure sum ``mode`` runs (:data:`SECURE_SUMS`; None for an unknown mode)."""
        return SECURE_SUMS.get(self.mode)

    @property
    def dropout(self) -> float:
        """Each committee member's drop probability per stage (unset: 0)."""
        return 0.0 if self.member_dropout is None else self.member_dropout


WHERE = "strategy.options"
_CHECKED = (
    "clipping_norm",
    "noise_multiplier",
    "mode",
    "secagg_degree",
    "ring_bits",
    "bits",
    "protocol_dropout",
    "stage_timeout",
    "prg",
)

