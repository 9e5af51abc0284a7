"""DP-FedAvg from a run config: ``strategy.options`` as :class:`DPFedAvgOptions` (a frozen
dataclass read by :func:`fedsim.config.from_mapping`; errors name ``strategy.options.<key>``),
the noise multiplier calibrated to ``target_epsilon`` when asked, and the method's spec."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from fedsim.config import ConfigError, require
from fedsim.privacy.accountant import ACCOUNTANTS
from fedsim.privacy.calibration import calibrate_noise
from fedsim.privacy.participation import Participation
from fedsim.privacy.round_events import Z_MAX, Z_MIN
from fedsim.privacy.sampling import FullParticipation, Sampling, relation_for
from strategies.methods.dp_fedavg.strategy import AdaptiveClipping, DPFedAvg, check_accountant
from strategies.plumbing import flower
from strategies.spec import Accounting, RunFacts, StrategySpec, raw_option

NAME = "dp-fedavg"
_NOISE = ("noise_multiplier", "target_epsilon")
_ADAPTIVE = ("target_unclipped_quantile", "clip_learning_rate", "clipped_count_stddev")
_WHERE = "strategy.options"


@dataclass(frozen=True, kw_only=True)
class DPFedAvgOptions(flower.ServerOptimizerOptions):
    """``strategy.options`` of "dp-fedavg" (see :func:`from_options`); None: unset (the
    default comes from the run's facts or :class:`AdaptiveClipping`)."""

    clipping_norm: float
    noise_multiplier: float | None = None
    target_epsilon: float | None = None
    adaptive_clipping: bool = False
    target_unclipped_quantile: float | None = None
    clip_learning_rate: float | None = None
    clipped_count_stddev: float | None = None
    delta: float | None = None
    accountant: str = "rdp"
    max_epsilon: float | None = None

    def __post_init__(self) -> None:
        given = [key for key in _NOISE if getattr(self, key) is not None]
        if len(given) != 1:
            raise ConfigError(
                f"{_WHERE}.{given[-1] if given else 'noise_multiplier'}",
                getattr(self, given[-1]) if given else None,
                f"exactly one of noise_multiplier, target_epsilon (required by {NAME})",
            )
        require(
            self.clipping_norm > 0, f"{_WHERE}.clipping_norm", self.clipping_norm, "a number > 0"
        )
        _check_optional(self.delta, "delta", lambda v: 0 < v < 1, "a number in (0, 1)")
        _check_optional(
            self.max_epsilon,
            "max_epsilon",
            lambda v: v > 0,
            "a number > 0 (epsilon at which the run stops)",
        )
        _check_optional(
            self.target_epsilon,
            "target_epsilon",
            lambda v: v > 0,
            "a finite number > 0 (the epsilon the run may reach)",
        )
        _check_optional(
            self.noise_multiplier,
            "noise_multiplier",
            lambda v: v == 0 or Z_MIN <= v <= Z_MAX,
            f"0 (no noise) or a number in [{Z_MIN:g}, {Z_MAX:g}] (noise std / "
            "clipping norm; below, dp_accounting's epsilon loses its precision)",
        )
        require(
            self.accountant in ACCOUNTANTS,
            f"{_WHERE}.accountant",
            self.accountant,
            "one of 'rdp', 'pld'",
        )
        self._check_adaptive()
        super().__post_init__()

    def _check_adaptive(self) -> None:
        """The adaptive-clipping keys only with ``adaptive_clipping = true``, in range."""
        if not self.adaptive_clipping:
            for key in _ADAPTIVE:
                if getattr(self, key) is not None:
                    raise ConfigError(
                        f"{_WHERE}.{key}",
                        getattr(self, key),
                        f"nothing unless {_WHERE}.adaptive_clipping = true",
                    )
            return
        _check_optional(
            self.target_unclipped_quantile,
            "target_unclipped_quantile",
            lambda v: 0 <= v <= 1,
            "a number in [0, 1]",
        )
        _check_optional(
            self.clip_learning_rate, "clip_learning_rate", lambda v: v > 0, "a number > 0"
        )


def _check_optional(value: float | None, key: str, ok: Any, allowed: str) -> None:
    """``strategy.options.key`` unset or passing ``ok``."""
    require(value is None or ok(value), f"{_WHERE}.{key}", value, allowed)


def from_options(options: DPFedAvgOptions, facts: RunFacts) -> DPFedAvg:
    """DP-FedAvg from ``strategy.options``.

    Options: ``clipping_norm`` (required) and either ``noise_multiplier`` or
    ``target_epsilon`` (the noise multiplier dp_accounting calibrates so that the run's
    ``rounds`` under its sampling reach at most that epsilon at ``delta``, with the run's
    accountant; :func:`~fedsim.privacy.calibration.calibrate_noise`);
    ``adaptive_clipping`` (false) with ``target_unclipped_quantile`` (0.5),
    ``clip_learning_rate`` (0.2) and ``clipped_count_stddev`` (clients per
    round / 20, Andrew et al. 2021's choice); ``delta`` (min(1e-5, 1 / population));
    ``accountant`` ("rdp" or "pld"); ``max_epsilon`` (none); ``server_optimizer``
    (a weighted-mean strategy of :mod:`strategies.plumbing.flower`, default "fedavg") and its
    options (e.g. ``server_momentum``, ``eta``).
    """
    population = facts.population
    default_delta = 1e-5 if population is None else min(1e-5, 1.0 / population)
    delta = default_delta if options.delta is None else options.delta
    sampling = FullParticipation() if facts.sampling is None else facts.sampling
    event_sampling = FullParticipation() if isinstance(sampling, Participation) else sampling
    check_accountant(options.accountant, event_sampling, delta, f"{_WHERE}.accountant")
    if options.target_epsilon is not None:
        z = _calibrated(options.target_epsilon, delta, options.accountant, sampling, facts)
    else:
        z = options.noise_multiplier
    return DPFedAvg(
        options.strategy(facts.evaluate_fraction),
        clipping_norm=options.clipping_norm,
        noise_multiplier=z,
        expected_clients=facts.expected_clients,
        worker_reduction=facts.worker_reduction,
        adaptive=_adaptive_from(options, z, facts.expected_clients),
        sampling=sampling,
        delta=delta,
        accountant=options.accountant,
        max_epsilon=options.max_epsilon,
        metrics_in_clear=facts.metrics_in_clear,
    )


def _calibrated(
    target: Any, delta: float, accountant: str, sampling: Sampling, facts: RunFacts
) -> float:
    """The noise multiplier dp_accounting calibrates to ``target`` (epsilon after the run's
    rounds under ``sampling`` at ``delta``), else a ConfigError naming
    ``strategy.options.target_epsilon``.

    The round is accounted as one Gaussian with this ``z`` also under adaptive clipping (its
    two noises are split from ``z``), so the calibrated run's epsilon is at most ``target``.
    """
    key = "strategy.options.target_epsilon"
    rounds = facts.required("rounds", f"the run's rounds (required by {key})")
    # the ledger's relation: a schedule's rounds are recorded unsampled (DPFedAvg.__init__)
    unsampled = isinstance(sampling, Participation)
    relation = relation_for(FullParticipation() if unsampled else sampling)
    try:
        return calibrate_noise(float(target), delta, sampling, rounds, accountant, relation)
    except ConfigError as err:
        raise ConfigError(
            key,
            target,
            f"an epsilon {accountant} reaches for {rounds} rounds of {type(sampling).__name__} "
            f"at delta = {delta:g} ({err.allowed})",
        ) from err


def _adaptive_from(
    options: DPFedAvgOptions, z: float, expected_clients: float
) -> AdaptiveClipping | None:
    """The adaptive-clipping settings when ``adaptive_clipping`` is true (defaults:
    :class:`AdaptiveClipping`'s, ``clipped_count_stddev`` clients per round / 20)."""
    if not options.adaptive_clipping:
        return None
    require(
        z > 0,
        "strategy.options.noise_multiplier",
        z,
        "a number > 0 with adaptive_clipping = true (the clipped count is noised too)",
    )
    sigma_b = options.clipped_count_stddev
    sigma_b = expected_clients / 20 if sigma_b is None else sigma_b
    require(
        2 * sigma_b > z,
        "strategy.options.clipped_count_stddev",
        sigma_b,
        f"a number > noise_multiplier / 2 = {z / 2:g} (the default is "
        f"clients_per_round / 20 = {expected_clients / 20:g}; at or below z / 2 the "
        "clipped count alone would use the whole privacy budget)",
    )
    given = {
        "target_unclipped_quantile": options.target_unclipped_quantile,
        "learning_rate": options.clip_learning_rate,
    }
    return AdaptiveClipping(
        count_stddev=sigma_b, **{k: v for k, v in given.items() if v is not None}
    )


def _proximal(options: Mapping[str, Any]) -> bool:
    """Whether the config's ``server_optimizer`` is FedProx (its clients add the term)."""
    cls = flower.server_optimizer(raw_option(options, "server_optimizer", "fedavg"))
    return cls is not None and issubclass(cls, flower.FedProx)


SPEC = StrategySpec(
    name=NAME,
    options=DPFedAvgOptions,
    build=from_options,
    summable=True,
    accounting=Accounting(
        ledger="one sampled Gaussian per released round (with adaptive clipping: composed "
        "with the clipped count's Gaussian), under the cohorts' sampling",
        command="dp-fedavg",
    ),
    proximal=_proximal,
    amplified_by_sampling=True,
)
