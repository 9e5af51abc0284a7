"""Central DP-FTRL / BandMF: the matrix mechanism as a Flower Message-API strategy.

The server releases, over the whole run, ``C X + Z`` where row t of X is round t's sum of
clipped client updates and ``Z ~ N(0, sigma^2)`` with ``sigma = z * c * sens(C)`` (``z`` the
noise multiplier, ``c`` the clipping norm, ``sens(C)`` the sensitivity of the factorization
actually used under the run's participation). The model only ever sees the post-processed
``A^{-1} B (C X + Z) = X + G Z`` (``G = C^{-1}`` for square C), one row per round, streamed
with bounded state by :mod:`fedsim.privacy.matrix.streaming`. Round t (1-based; row t - 1):

    x_t   = sum_i clip(Delta_i, c) / m                    (ClippedSum, m expected clients)
    xhat_t = x_t + (sigma / m) (G z)_{t-1}                (correlated noise, unit-variance z)
    v_t   = beta v_{t-1} + xhat_t,   theta_t = theta_{t-1} + eta_t v_t

so that ``theta_t - theta_0 = (A (x + (sigma / m) G z))_t`` with ``A =
momentum(n, beta, eta)`` (:func:`fedsim.privacy.matrix.workload_matrices.momentum`; ``eta``
times the prefix sums for ``beta = 0``). This is the noisy-gradient form of DP-FTRL (Kairouz et al.
2021, "Practical and Private (Deep) Learning without Sampling or Shuffling", Alg. 1, which
keeps the noisy prefix sum instead: the same model for ``beta = 0``) and the BandMF update of
Choquette-Choo et al. 2023, "(Amplified) Banded Matrix Factorization: A unified approach to
private training", Alg. 1 (``x_t + (C^{-1} z)_t`` into SGD with momentum). Client updates
``Delta_i = x_i - g`` point downhill, hence the ``+``. A factorization is optimal for the
optimiser whose workload it was built for (``A`` above); any other is still private, since
the optimiser only post-processes ``C X + Z``.

Accounting. The n rounds are one Gaussian mechanism (Denisov et al. 2022, "Improved
Differential Privacy for SGD via Optimal Private Linear Operators on Adaptive Streams",
Thm. 2.1: adaptively chosen inputs do not change this). After T rounds what was released is
``C_T X + Z_T`` with ``C_T`` the rows of C released so far (:meth:`Factorization.
encoder_through`), so epsilon is that of a Gaussian with noise multiplier
``z sens(C) / sens_T``, ``sens_T`` the sensitivity of ``C_T`` under the participation
restricted to T rounds. Round t records ``GaussianDpEvent(z sens(C) / sqrt(sens_t^2 -
sens_{t-1}^2))`` in the run's :class:`~fedsim.privacy.ledger.PrivacyLedger` (a
``NoOpDpEvent`` if the sensitivity does not grow); Gaussian precisions add under composition,
so the ledger's epsilon after T rounds is exactly the Gaussian epsilon above, and
``z`` alone at T = n.

Participation: b-min-separation, at most ``max_participations`` (default ``ceil(n / b)``)
rounds ``b`` apart -- what :class:`fedsim.engine.participation.MinSeparationCohort` with
``min_separation = b`` guarantees (its ``accounting``) -- or single participation (the
default), one :class:`~fedsim.privacy.participation.Participation` either way. A
banded C with at most ``b`` bands then has the exact sensitivity ``sqrt(k)`` after column
normalisation. The schema is enforced, not assumed
(:class:`~strategies.plumbing.participation_guard.ParticipationGuard`): an instruction that would
break it does not leave, and its node is named under ``participation-refused``.

Dropouts contribute nothing but their update; the noise and the denominator ``m`` are fixed.
Round t's fresh noise is the server's own: ``server_secret.generator(t, Purpose.NOISE,
"matrix")`` (:class:`~strategies.plumbing.server_secret.ServerNoise`), never the run seed. The
stream's buffers hold past noise, so they are never pickled: a checkpoint keeps the momentum and the
ledger, and a resumed strategy redraws rows 0..t-2 from the secret (bound again by the front
end) and continues exactly. As with DP-FedAvg, the clients' own metrics and the exact clipped
fraction are released only with ``metrics_in_clear``.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import dp_accounting as dpa
import numpy as np
from flwr.app import ArrayRecord, Message, MetricRecord
from flwr.serverapp.strategy import FedAvg, Strategy

from fedsim.config import ConfigError, require
from fedsim.privacy.accountant import ACCOUNTANTS
from fedsim.privacy.ledger import PrivacyLedger
from fedsim.privacy.matrix import (
    Factorization,
    Participation,
    Sensitivity,
    momentum,
    noise_stream,
)
from fedsim.privacy.matrix.streaming import NoiseStream
from fedsim.privacy.sampling import NeighbouringRelation
from fedsim.record_codec import to_record
from strategies.plumbing.clipped_sum import ClippedSum
from strategies.plumbing.dp_shell import ClippedSumShell
from strategies.plumbing.participation_guard import ParticipationGuard
from strategies.plumbing.wrapper import weighted_by_key
from strategies.spec import Accounting, RunFacts, StrategySpec

#: the constructor's default: every client in at most one round
SINGLE = Participation.single()
#: a run without a schedule: every client may be in every round
EVERY_ROUND = Participation.separated(1)


def _learning_rates(value: float | Sequence[float], n: int) -> np.ndarray:
    eta = np.asarray(value, dtype=np.float64)
    if eta.ndim == 0:
        eta = np.full(n, float(eta))
    require(
        eta.shape == (n,) and bool(np.all(np.isfinite(eta)) and np.all(eta > 0)),
        "server_learning_rate",
        value,
        f"a number > 0 or {n} numbers > 0 (one per round of the factorization)",
    )
    return eta


def _check_arguments(
    factorization: Any,
    clipping_norm: float,
    noise_multiplier: float,
    expected_clients: float,
    server_momentum: float,
    accountant: str,
    participation: Any,
) -> None:
    """A ConfigError naming the :class:`MatrixMechanism` argument out of its range."""
    require(
        isinstance(factorization, Factorization),
        "factorization",
        type(factorization).__name__,
        "a fedsim.privacy.matrix.Factorization",
    )
    require(clipping_norm > 0, "clipping_norm", clipping_norm, "a number > 0")
    require(
        math.isfinite(noise_multiplier) and noise_multiplier >= 0,
        "noise_multiplier",
        noise_multiplier,
        "a finite number >= 0 (0: no noise, epsilon inf)",
    )
    require(expected_clients > 0, "expected_clients", expected_clients, "a number > 0")
    require(0.0 <= server_momentum < 1.0, "server_momentum", server_momentum, "a number in [0, 1)")
    require(accountant in ACCOUNTANTS, "accountant", accountant, "one of 'rdp', 'pld'")
    require(
        isinstance(participation, Participation),
        "participation",
        participation,
        "a fedsim.privacy.participation.Participation (e.g. Participation.separated(b, k))",
    )


class MatrixMechanism(ClippedSumShell):
    """Central matrix-mechanism DP (DP-FTRL, BandMF, BLT, trees) around a sampling strategy.

    Args:
        strategy: samples and configures each round's clients (e.g.
            ``FedAvg(fraction_train=1)`` over the engine's cohort) and runs evaluation; its
            ``aggregate_train`` is not used.
        factorization: ``A = B C`` for (at least) the run's rounds; row t - 1 noises round t.
        clipping_norm: ``c > 0``, the L2 bound on each client's update.
        noise_multiplier: ``z >= 0`` for the whole run: fresh noise std
            ``z * c * sens(C)``; epsilon after all n rounds is that of a Gaussian with ``z``.
        expected_clients: ``m > 0``, the sums are divided by it (never by who replied).
        participation: the participation schema sens(C) assumes and the guard enforces
            (:class:`~fedsim.privacy.participation.Participation`; default single
            participation).
        server_learning_rate: ``eta`` (one number, or one per round).
        server_momentum: ``beta`` in [0, 1).
        worker_reduction: let workers fold clipped sums (same result, less traffic).
        delta: the run's delta in (0, 1).
        accountant: "rdp" or "pld".
        relation: "add_remove" (default) or "replace_one" neighbours.
        metrics_in_clear: also return the clients' metrics and the exact clipped fraction
            (un-noised, outside the ledger).

    The fresh noise comes from the server's secret (:meth:`bind_server_secret`; a fresh OS
    secret when none is bound).
    """

    def __init__(
        self,
        strategy: Strategy,
        *,
        factorization: Factorization,
        clipping_norm: float,
        noise_multiplier: float,
        expected_clients: float,
        participation: Participation = SINGLE,
        server_learning_rate: float | Sequence[float] = 1.0,
        server_momentum: float = 0.0,
        worker_reduction: bool = True,
        delta: float = 1e-5,
        accountant: str = "rdp",
        relation: str = "add_remove",
        metrics_in_clear: bool = False,
    ) -> None:
        _check_arguments(
            factorization,
            clipping_norm,
            noise_multiplier,
            expected_clients,
            server_momentum,
            accountant,
            participation,
        )
        super().__init__(strategy)
        self.factorization = factorization
        self.participation = participation
        self.weight_key = weighted_by_key(strategy)
        self.reducer = ClippedSum(clipping_norm, self.weight_key)
        self.noise_multiplier = float(noise_multiplier)
        self.expected_clients = float(expected_clients)
        self.metrics_in_clear = bool(metrics_in_clear)
        self.learning_rates = _learning_rates(server_learning_rate, factorization.n)
        self.server_momentum = float(server_momentum)
        self.worker_reduction = worker_reduction
        self.accountant = accountant
        self.ledger = PrivacyLedger(NeighbouringRelation.parse(relation), delta)
        #: the schema sens(C) assumes, enforced on every instruction (refused: named per round)
        self.guard = ParticipationGuard(self.participation, factorization.n)
        self.participation_refused: list[int] = []
        full = factorization.sensitivity(self.participation)
        self.sensitivity = full.value
        self.sensitivity_exact = full.exact
        #: std of each fresh noise coordinate added to the clipped sum
        self.noise_std = self.noise_multiplier * float(clipping_norm) * self.sensitivity
        self.stream: NoiseStream | None = None
        self.momentum_buffer: dict[str, np.ndarray] | None = None
        self.released_sensitivity = 0.0  # sens_T of the rounds released so far
        self.released_exact = True
        self.stop_reason: str | None = None
        self._sens_cache: dict[int, Sensitivity] = {}

    @property
    def rounds(self) -> int:
        """The number of rounds the factorization covers."""
        return self.factorization.n

    def workload(self) -> np.ndarray:
        """``A = momentum(n, beta, eta)``: the workload this server optimiser applies."""
        return momentum(self.rounds, self.server_momentum, self.learning_rates)

    # -- privacy ------------------------------------------------------------------------
    def sensitivity_through(self, rounds: int) -> float:
        """``sens_T`` of the first ``rounds`` rounds (0 for none), cached."""
        if rounds == 0:
            return 0.0
        if rounds not in self._sens_cache:
            now = self.factorization.sensitivity_through(rounds, self.participation)
            self._sens_cache = {**dict(list(self._sens_cache.items())[-2:]), rounds: now}
        return self._sens_cache[rounds].value

    def round_event(self, server_round: int) -> dpa.DpEvent:
        """The ledger event of round ``server_round`` (1-based), see the module docstring."""
        if self.noise_multiplier == 0:
            return dpa.NonPrivateDpEvent()
        now = self.sensitivity_through(server_round)
        growth = now**2 - self.sensitivity_through(server_round - 1) ** 2
        if growth <= 1e-12 * max(now**2, 1.0):
            return dpa.NoOpDpEvent()
        return dpa.GaussianDpEvent(self.noise_multiplier * self.sensitivity / math.sqrt(growth))

    def effective_noise_multiplier(self) -> float:
        """``z sens(C) / sens_T`` for the rounds released so far (inf before any)."""
        if self.released_sensitivity == 0:
            return math.inf
        return self.noise_multiplier * self.sensitivity / self.released_sensitivity

    def report_details(self) -> dict[str, Any]:
        """The factorization and the sensitivities epsilon rests on."""
        return {
            "factorization": self.factorization.kind,
            "sensitivity": self.sensitivity,
            "sensitivity_exact": self.sensitivity_exact,
            "released_sensitivity": self.released_sensitivity,
            "released_sensitivity_exact": self.released_exact,
            "effective_noise_multiplier": self.effective_noise_multiplier(),
        }

    def should_stop(self, server_round: int) -> bool:
        """True past the factorization's last round (its noise is not defined there)."""
        if server_round > self.rounds:
            self.stop_reason = (
                f"factorization: round {server_round} is past the n = {self.rounds} rounds "
                "the factorization was built for"
            )
            return True
        return False

    # -- the Message-API hooks -------------------------------------------------------------
    def __getstate__(self) -> dict[str, Any]:
        state = super().__getstate__()
        state["stream"] = None  # its buffers hold past noise: redrawn from the secret instead
        return state

    def _round_noise(self, row: int) -> np.random.Generator:
        return self.noise_generator(row + 1, "matrix")

    def _noise(self, server_round: int, reference: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        """Round ``server_round``'s row of ``G z`` (unit fresh noise), split like the model."""
        size = sum(int(v.size) for v in reference.values())
        if self.stream is None:  # a new run, or a resumed one: redraw the rows released
            self.stream = noise_stream(self.factorization, self._round_noise, size)
            self.stream.advance_to(len(self.ledger))  # one entry per round aggregated
        require(
            self.stream.shape == (size,),
            "arrays",
            f"{size} parameters",
            f"the {self.stream.shape[0]} parameters the noise stream was started with",
        )
        if self.stream.round != server_round - 1:
            raise RuntimeError(
                f"round {server_round} needs noise row {server_round - 1}, but the stream is at "
                f"row {self.stream.round}: rounds must run in order (or resume from a "
                "checkpoint of this strategy)"
            )
        flat = self.stream.next()
        out, start = {}, 0
        for name, value in reference.items():
            out[name] = flat[start : start + value.size].reshape(value.shape)
            start += value.size
        return out

    def aggregate_train(
        self, server_round: int, replies: Iterable[Message]
    ) -> tuple[ArrayRecord | None, MetricRecord | None]:
        if server_round > self.rounds:
            return None, None
        round_, _ = self.clipped_round(replies)
        reference = round_.reference
        noise = self._noise(server_round, reference)
        if self.momentum_buffer is None:
            self.momentum_buffer = {
                k: np.zeros(v.shape, dtype=np.float64) for k, v in reference.items()
            }
        eta = float(self.learning_rates[server_round - 1])
        updated = {}
        for name, value in reference.items():
            noisy = (round_.total[name] + self.noise_std * noise[name]) / self.expected_clients
            buffer = self.server_momentum * self.momentum_buffer[name] + noisy
            self.momentum_buffer[name] = buffer
            updated[name] = (value.astype(np.float64) + eta * buffer).astype(value.dtype)
        self._account(server_round)
        aggregated = self.clients_metrics(round_)
        self.add_round_metrics(
            aggregated, round_, self.clipping_norm, self.noise_multiplier, self.noise_std
        )
        aggregated["mm-sensitivity"] = self.released_sensitivity
        return to_record(updated), aggregated

    def _account(self, server_round: int) -> None:
        self.ledger.record(server_round, self.round_event(server_round))
        self.released_sensitivity = self.sensitivity_through(server_round)
        self.released_exact = self.released_exact and self._sens_cache[server_round].exact


NAME = "matrix-mechanism"
_WHERE = "strategy.options"


@dataclass(frozen=True)
class MatrixOptions:
    """``strategy.options`` of "matrix-mechanism" (see :func:`from_options`); None: unset
    (``kind`` "banded", ``bands`` the min separation, ``buffers`` and ``delta`` as
    :class:`~fedsim.privacy.matrix.build.Spec` and the run's population set them)."""

    clipping_norm: float
    noise_multiplier: float
    factorization: str | None = None
    kind: str | None = None
    bands: int | None = None
    buffers: int | None = None
    kind_options: dict[str, int] | None = None
    server_learning_rate: float = 1.0
    server_momentum: float = 0.0
    delta: float | None = None
    accountant: str = "rdp"

    def __post_init__(self) -> None:
        """The file fixes the factorization (the other ranges are the mechanism's checks)."""
        if self.factorization is not None:
            for key in ("kind", "bands", "buffers", "kind_options"):
                require(
                    getattr(self, key) is None,
                    f"{_WHERE}.{key}",
                    getattr(self, key),
                    f"nothing with {_WHERE}.factorization (the file fixes it)",
                )


def from_options(options: MatrixOptions, facts: RunFacts) -> MatrixMechanism:
    """ "matrix-mechanism" from a config's ``strategy.options``.

    Options: ``clipping_norm`` and ``noise_multiplier`` (required, the whole run's ``z``);
    ``factorization`` (an ``.npz`` written by ``fedsim factorize``, for at least the run's
    rounds) or ``kind`` (default "banded"; see :mod:`fedsim.privacy.matrix.build`) with
    ``bands`` (default: the min separation), ``buffers`` and ``kind_options`` (the kind's own
    integer parameters, :attr:`fedsim.privacy.matrix.kind.Kind.options`);
    ``server_learning_rate`` (1.0), ``server_momentum`` (0.0), ``delta`` (min(1e-5,
    1 / population)), ``accountant`` ("rdp").
    The participation comes from the engine's schedule (``facts.participation``; none:
    every client may be in every round, ``Participation.separated(1)``).
    """
    rounds = facts.required("rounds", f"the run's rounds (required by {NAME})")
    participation = facts.participation or EVERY_ROUND
    require(
        participation.kind == "min_sep",
        "sampling",
        participation,
        "a b-min-separation schedule (or none: every client may be in every round)",
    )
    sep = int(participation.min_sep)
    k = participation.participations(rounds)
    f = _factorization_from(options, rounds, sep, k)
    population = facts.population
    default_delta = 1e-5 if population is None else min(1e-5, 1.0 / population)
    inner = FedAvg(
        fraction_train=1.0,
        fraction_evaluate=facts.evaluate_fraction,
        min_train_nodes=0,
        min_evaluate_nodes=0,
        min_available_nodes=0,
    )
    try:
        return MatrixMechanism(
            inner,
            factorization=f,
            clipping_norm=options.clipping_norm,
            noise_multiplier=options.noise_multiplier,
            expected_clients=facts.expected_clients,
            participation=Participation.separated(sep, k),
            server_learning_rate=options.server_learning_rate,
            server_momentum=options.server_momentum,
            worker_reduction=facts.worker_reduction,
            delta=default_delta if options.delta is None else options.delta,
            accountant=options.accountant,
            metrics_in_clear=facts.metrics_in_clear,
        )
    except ConfigError as err:  # the mechanism's own checks name its arguments
        key = err.key if err.key.startswith("strategy.") else f"{_WHERE}.{err.key}"
        raise ConfigError(key, err.value, err.allowed) from err


def _factorization_from(options: MatrixOptions, rounds: int, sep: int, k: int) -> Factorization:
    """The file ``strategy.options.factorization`` (for at least ``rounds`` rounds), or the
    ``kind`` built for ``rounds`` rounds, ``k`` participations ``sep`` apart."""
    from fedsim.privacy.matrix.build import Spec, build  # noqa: PLC0415

    path = options.factorization
    if path is None:
        given = {"buffers": options.buffers} if options.buffers is not None else {}
        if options.kind_options:
            given["options"] = tuple(options.kind_options.items())
        try:
            return build(
                Spec(
                    kind="banded" if options.kind is None else options.kind,
                    rounds=rounds,
                    bands=options.bands if options.bands is not None else min(sep, rounds),
                    participations=k,
                    min_sep=sep,
                    **given,
                )
            )
        except ConfigError as err:
            raise ConfigError(f"{_WHERE}.{err.key}", err.value, err.allowed) from err
    require(
        Path(path).is_file(),
        f"{_WHERE}.factorization",
        path,
        "the path of an .npz written by fedsim factorize",
    )
    f = Factorization.load(path)
    require(
        f.n >= rounds,
        f"{_WHERE}.factorization",
        path,
        f"a factorization for at least rounds = {rounds} rounds (it has n = {f.n})",
    )
    return f


SPEC = StrategySpec(
    name=NAME,
    options=MatrixOptions,
    build=from_options,
    summable=True,
    accounting=Accounting(
        ledger="per round, the Gaussian whose precision is the growth of the released rows' "
        "sensitivity under the run's participation (they compose to z over all rounds)",
        command="matrix",
    ),
)
