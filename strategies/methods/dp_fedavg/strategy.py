"""Client-level DP-FedAvg: clipping (fixed or adaptive), server noise, an accounted ledger.

DP-FedAvg (McMahan et al., "Learning Differentially Private Recurrent Language
Models", ICLR 2018, Alg. 1) replaces FedAvg's weighted mean by a noisy mean of
clipped client updates:

    Delta_i   = x_i - g                                   (client update)
    clip(v,C) = v * min(1, C / ||v||_2)                   (flattened L2 norm)
    Delta_bar = (sum_i clip(Delta_i, C) + N(0, (z_D C)^2 I)) / m

with ``z_D`` the update's noise multiplier and ``m`` the *expected* number of
clients per round (the cohort size for fixed-size sampling, ``q N`` for Poisson
sampling), never the number that replied, so that the sensitivity of the sum
is ``C``.

Adaptive clipping (Andrew, Thakkar, McMahan & Ramaswamy, "Differentially
Private Learning with Adaptive Clipping", NeurIPS 2021, Alg. 1): each client
also contributes the bit ``b_i = [||Delta_i|| <= C]``; the server releases the
centred count ``sum_i (b_i - 1/2) + N(0, sigma_b^2)`` (sensitivity 1/2 under
add/remove), estimates the unclipped fraction
``b~ = (sum_i (b_i - 1/2) + N(0, sigma_b^2)) / m + 1/2`` and moves the clipping
norm geometrically towards the target quantile ``gamma``:

    C <- C * exp(-eta_C (b~ - gamma))

The two Gaussian releases compose to one Gaussian of the configured noise
multiplier ``z``: ``z_D = (z^-2 - (2 sigma_b)^-2)^(-1/2)``
(:func:`fedsim.privacy.round_events.split_noise_multiplier`), so a round is
accounted as ``adaptive_clipping_round_event(z, sigma_b, sampling)``.

Accounting. The strategy holds a :class:`~fedsim.privacy.ledger.PrivacyLedger`
and records one event per round in which it released an update, with the
round's sampling model (Poisson rate ``q``, fixed-size ``m`` of ``N``, full
participation, or b-min-separation) and noise. Without an explicit sampling model (a
plain Flower app), the model is the sampling that happens, planned from the grid and the
wrapped strategy and checked on every round (:mod:`strategies.plumbing.observed_sampling`); the
cohort amplification credits is then the strategy's own draw from the server's secret
(``server_secret.generator(t, Purpose.COHORT, "train")``): the wrapped strategy's
instructions are addressed to it, so a patched ``random.sample`` decides nothing. Cohorts
that every client can recompute (an engine cohort drawn from the public seed) are accounted
without amplification: an unsampled Gaussian per round, composed over the rounds of the
client that was sent the most instructions. The
neighbouring relation follows the sampling: add/remove for Poisson sampling, full participation and
min-separation; replace-one for fixed-size sampling of fewer than ``N`` clients
(the only relation dp_accounting can amplify it under; the sum then moves by up
to ``2C``, which the ledger accounts for). With ``max_epsilon``, a round whose
event would bring epsilon above it is not run: :meth:`DPFedAvg.should_stop`
says so before the round (fedsim's round loop checks it), and
``configure_train`` then sends nothing, so under Flower's own ``Strategy.start``
the remaining rounds release nothing either.

Randomness. The update's noise and the count's noise of round ``t`` are the server's own:
``server_secret.generator(t, Purpose.NOISE, "update")`` and ``(..., "count")``
(:class:`~strategies.plumbing.server_secret.ServerNoise`), never the run seed, which every client
knows: a client that sees two consecutive global models must not be able to subtract the
noise (tests/attacks/test_dp_fedavg.py).

Released metrics. The round's aggregated metrics are the mechanism's own (clients that
replied, clipping norm, noise std, adaptive clipping's noisy estimate). The clients' own
metrics (train loss, ...) and the exact clipped fraction are not noised, so they are left out
unless ``metrics_in_clear`` releases them.

Dropouts, stragglers and failures. The noise is drawn by the server, and the
denominators (``m`` for the mean update and for ``b~``) stay the expected
cohort size whatever number of clients replied: a client that drops out
removes its (clipped) contribution, never noise. A round in which no client
replied still releases ``g + N(0, (z_D C)^2 I) / m`` and is accounted; a round
is never skipped because of who replied, as that would itself depend on the
participants.

The clipped sum is a :class:`~fedsim.worker_reduce.Reducer`: each worker can
fold its clients' replies into one partial sum (:class:`ClippedSum`, which
also counts the clipped updates, so the bits ``b_i`` need no extra message),
and the strategy applies the same reducer to whatever it receives, so the
result is the same with or without worker-side reduction, and on Flower's own
runtime.

The wrapped strategy (FedAvg, FedAvgM, FedAdam, ...) then receives a single
reply whose arrays are ``g + Delta_bar``: FedAvg returns it as the new model,
server optimisers apply their update to the pseudo-gradient ``Delta_bar``.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import dp_accounting as dpa
import numpy as np
from flwr.app import ArrayRecord, ConfigRecord, Message, MetricRecord, RecordDict
from flwr.serverapp import Grid
from flwr.serverapp.strategy import Strategy

from fedsim.config import ConfigError, require
from fedsim.privacy.epsilon import epsilon
from fedsim.privacy.ledger import PrivacyLedger
from fedsim.privacy.participation import Participation
from fedsim.privacy.round_events import (
    adaptive_clipping_round_event,
    round_event,
    split_noise_multiplier,
)
from fedsim.privacy.sampling import (
    FixedSizeSampling,
    FullParticipation,
    Sampling,
    relation_for,
)
from fedsim.randomness import Purpose
from fedsim.record_codec import to_record
from fedsim.worker_reduce import (
    partial_reply,
)
from strategies.plumbing.clipped_sum import ClippedSum
from strategies.plumbing.dp_shell import ClippedSumShell
from strategies.plumbing.observed_sampling import SamplingPlan, describe, planned_sampling
from strategies.plumbing.participation_guard import ParticipationGuard
from strategies.plumbing.wrapper import server_reply, weighted_by_key


@dataclass(frozen=True, slots=True)
class AdaptiveClipping:
    """Andrew et al. 2021's geometric clipping-norm update.

    Attributes:
        target_unclipped_quantile: ``gamma`` in [0, 1], the fraction of updates
            that should not be clipped.
        learning_rate: ``eta_C > 0``; ``C`` changes by at most ``exp(eta_C)`` per round.
        count_stddev: ``sigma_b > 0``, std of the noise on the centred count of
            unclipped updates (count units). It must exceed ``z / 2``.
    """

    target_unclipped_quantile: float = 0.5
    learning_rate: float = 0.2
    count_stddev: float = 1.0

    def __post_init__(self) -> None:
        require(
            0.0 <= self.target_unclipped_quantile <= 1.0,
            "target_unclipped_quantile",
            self.target_unclipped_quantile,
            "a number in [0, 1]",
        )
        require(self.learning_rate > 0, "clip_learning_rate", self.learning_rate, "a number > 0")
        require(self.count_stddev > 0, "clipped_count_stddev", self.count_stddev, "a number > 0")


class DPFedAvg(ClippedSumShell):
    """Wrap a FedAvg-family strategy with client-level DP and a privacy ledger.

    Args:
        strategy: the wrapped strategy (samples, configures, applies the server update).
        clipping_norm: ``C`` (the initial ``C`` with adaptive clipping), the L2
            bound on each client's update, in model-parameter units.
        noise_multiplier: ``z >= 0``, what a round is accounted as. Without
            adaptive clipping the sum's noise has std ``z C``; with it, ``z_D C``
            with ``z_D`` from :func:`~fedsim.privacy.round_events.split_noise_multiplier`.
        expected_clients: ``m``, the expected number of clients per round.
        worker_reduction: let workers fold clipped sums (same result, less traffic).
        adaptive: adaptive clipping settings; None keeps ``C`` fixed.
        sampling: how each round's clients are drawn. A b-min-separation
            :class:`~fedsim.privacy.participation.Participation` schedule is accounted by
            the ledger's worst-case participation (each round then records an unsampled
            event) and enforced on every instruction (``participation-refused``); a
            :class:`FixedSizeSampling` round that sends more than its sample size is
            refused. None (default): the sampling that
            happens, planned from the grid and the wrapped strategy before the first
            round and checked on every round (:mod:`strategies.plumbing.observed_sampling`:
            Flower's uniform draw of ``fraction_train`` of the nodes is fixed-size
            sampling, an engine cohort taken whole is the engine's model; anything
            else is refused).
        delta: the run's ``delta`` in (0, 1) for the epsilon it reports.
        accountant: "rdp" or "pld".
        max_epsilon: stop before a round that would bring epsilon above this (None: never).
        metrics_in_clear: also return the clients' metrics and the exact clipped fraction
            (un-noised, outside the ledger) in the round's aggregated metrics.

    The noise comes from the server's secret (:meth:`bind_server_secret`; a fresh OS secret
    when none is bound).
    """

    def __init__(
        self,
        strategy: Strategy,
        *,
        clipping_norm: float,
        noise_multiplier: float,
        expected_clients: float,
        worker_reduction: bool = True,
        adaptive: AdaptiveClipping | None = None,
        sampling: Sampling | None = None,
        delta: float = 1e-5,
        accountant: str = "rdp",
        max_epsilon: float | None = None,
        metrics_in_clear: bool = False,
    ) -> None:
        if noise_multiplier < 0:
            raise ValueError(f"noise_multiplier = {noise_multiplier!r}; it must be >= 0")
        if not expected_clients > 0:
            raise ValueError(f"expected_clients = {expected_clients!r}; it must be > 0")
        require(accountant in ("rdp", "pld"), "accountant", accountant, "one of 'rdp', 'pld'")
        require(
            max_epsilon is None or max_epsilon > 0,
            "max_epsilon",
            max_epsilon,
            "a number > 0 (or none)",
        )
        super().__init__(strategy)
        self.weight_key = weighted_by_key(strategy)
        self.reducer = ClippedSum(clipping_norm, self.weight_key)
        self.noise_multiplier = float(noise_multiplier)
        self.adaptive = adaptive
        if adaptive is not None:
            self.update_noise_multiplier = split_noise_multiplier(
                self.noise_multiplier, adaptive.count_stddev
            )
        else:
            self.update_noise_multiplier = self.noise_multiplier
        self.expected_clients = float(expected_clients)
        self.worker_reduction = worker_reduction
        self.metrics_in_clear = bool(metrics_in_clear)
        #: sampling=None: account the sampling that happens (planned at the first round)
        self.observe_sampling = sampling is None
        self._plan: SamplingPlan | None = None
        sampling = FullParticipation() if sampling is None else sampling
        schedule = sampling if isinstance(sampling, Participation) else None
        self.sampling: Sampling = FullParticipation() if schedule is not None else sampling
        self.ledger = PrivacyLedger(relation_for(self.sampling), delta, schedule)
        #: a min-separation schedule is enforced on every instruction, not assumed
        self.guard = None if schedule is None else ParticipationGuard(schedule)
        self.participation_refused: list[int] = []
        self.accountant = accountant
        self.max_epsilon = None if max_epsilon is None else float(max_epsilon)
        self.stop_reason: str | None = None
        self._stopped_at: int | None = None
        self._epsilons: dict[tuple[int, int], float] = {}  # (entries before, round) -> epsilon
        #: cohorts every client can recompute: no amplification (see the module docstring)
        self.public_cohorts = False
        #: node id -> train instructions sent (public cohorts: the worst client's rounds)
        self.instructions_per_node: dict[int, int] = {}

    # -- the sampling that happens (sampling=None) -------------------------------------
    def bind_grid(self, grid: Grid) -> SamplingPlan | None:
        """With ``sampling=None``: plan the accounting of the sampling the wrapped strategy
        does on ``grid`` (once, before the first round; :func:`recorded_start` calls this
        before the round loop, ``configure_train`` otherwise). Returns the plan (None with an
        explicit ``sampling``)."""
        if not self.observe_sampling or self._plan is not None:
            return self._plan
        plan = planned_sampling(self.strategy, grid)
        if len(self.ledger):
            raise RuntimeError(
                f"the sampling is planned before the first release; {len(self.ledger)} "
                "rounds were already recorded"
            )
        check_accountant(self.accountant, plan.sampling, self.ledger.delta)
        self.sampling = plan.sampling
        self.public_cohorts = plan.public_cohorts
        self.ledger = PrivacyLedger(relation_for(plan.sampling), self.ledger.delta)
        self._epsilons = {}
        self._stopped_at, self.stop_reason = None, None
        self._plan = plan
        return plan

    def configure_train(
        self, server_round: int, arrays: ArrayRecord, config: ConfigRecord, grid: Grid
    ) -> Iterable[Message]:
        if self.should_stop(server_round):
            return []
        plan = self.bind_grid(grid)
        offered = [int(n) for n in grid.get_node_ids()] if plan is not None else []
        messages = list(super().configure_train(server_round, arrays, config, grid))
        if plan is not None and not plan.engine_cohort:
            plan.check_round(server_round, offered, [int(m.metadata.dst_node_id) for m in messages])
            messages = self._secret_cohort(server_round, offered, messages)
            self.instructions_sent(server_round, messages, grid)
        sent = [int(m.metadata.dst_node_id) for m in messages]
        for node in sent if self.public_cohorts else ():  # the worst client's rounds
            self.instructions_per_node[node] = self.instructions_per_node.get(node, 0) + 1
        if plan is not None:
            plan.check_round(server_round, offered, sent)
        elif isinstance(self.sampling, FixedSizeSampling):
            require(
                len(sent) <= self.sampling.sample_size,
                f"sampling (round {server_round})",
                f"{len(sent)} nodes sent",
                f"at most the accounted sample size {self.sampling.sample_size}",
            )
        return messages

    def _secret_cohort(
        self, server_round: int, offered: list[int], messages: list[Message]
    ) -> list[Message]:
        """The wrapped strategy's instructions (one content for all) addressed to the
        strategy's own uniform draw of as many of the ``offered`` nodes, from the server's
        secret stream (reproducible under the run's root, unknown to every client)."""
        if not messages:
            return messages
        first = messages[0]
        if any(m.content is not first.content for m in messages):
            raise ConfigError(
                f"sampling (round {server_round})",
                f"{type(self.strategy).__name__}'s instructions",
                "one content for every node (the cohort is the server's own draw, so the "
                "instructions must not depend on the node)",
            )
        rng = self.server_secret().generator(int(server_round), Purpose.COHORT, "train")
        nodes = rng.choice(np.asarray(sorted(offered), dtype=np.int64), len(messages), False)
        meta = first.metadata
        return [
            Message(
                first.content,
                int(node),
                meta.message_type,
                ttl=meta.ttl,
                group_id=meta.group_id,
            )
            for node in sorted(int(n) for n in nodes)
        ]

    def accounted_ledger(self, ahead: int = 0) -> PrivacyLedger:
        """The ledger epsilon is computed from: with public cohorts, the recorded unsampled
        rounds composed for the client sent the most instructions (its rounds, not all;
        ``ahead``: rounds it may still be sent, for a check before a round)."""
        if not self.public_cohorts or not (len(self.ledger) or ahead):
            return self.ledger
        worst = max(self.instructions_per_node.values(), default=0) + ahead
        ledger = PrivacyLedger(
            self.ledger.relation, self.ledger.delta, Participation.separated(1, max(1, worst))
        )
        for round_, event in self.ledger.entries:
            ledger.record(round_, event)
        return ledger

    def report_details(self) -> dict[str, Any]:
        """The sampling model the ledger accounts (and whether the cohorts are public)."""
        details = {"sampling": describe(self.ledger.participation or self.sampling)}
        if self.public_cohorts:
            details["cohorts"] = "public"
            details["max_rounds_per_client"] = max(self.instructions_per_node.values(), default=0)
        return details

    def round_event(self) -> dpa.DpEvent:
        """The ``dp_accounting`` event of one round as this strategy releases it."""
        if self.adaptive is not None:
            return adaptive_clipping_round_event(
                self.noise_multiplier, self.adaptive.count_stddev, self.sampling
            )
        return round_event(self.noise_multiplier, self.sampling)

    # -- privacy budget --------------------------------------------------------------
    def _epsilon_with_round(self, server_round: int) -> float:
        key = (len(self.ledger), server_round)
        if key not in self._epsilons:
            eps = self.accounted_ledger(ahead=1).epsilon_if(
                self.round_event(), accountant=self.accountant, round=server_round
            )
            recent = list(self._epsilons.items())[-3:]  # the last few rounds suffice
            self._epsilons = {**dict(recent), key: eps}
        return self._epsilons[key]

    def should_stop(self, server_round: int) -> bool:
        """True when round ``server_round`` must not run: its release would bring
        epsilon above ``max_epsilon`` (or an earlier round already stopped the run)."""
        if self._stopped_at is not None:
            return server_round >= self._stopped_at
        if self.max_epsilon is None:
            return False
        eps = self._epsilon_with_round(server_round)
        if eps > self.max_epsilon:
            self._stopped_at = server_round
            self.stop_reason = (
                f"max_epsilon: round {server_round} would bring epsilon to {eps:.6g} "
                f"> max_epsilon = {self.max_epsilon:g} (delta = {self.ledger.delta:g}, "
                f"{self.accountant})"
            )
            return True
        return False

    def epsilon(self) -> float:
        """Epsilon (nats) at the ledger's delta of every round released so far."""
        entries = self.ledger.entries
        if entries and not self.public_cohorts:
            key = (len(entries) - 1, entries[-1][0])
            if key in self._epsilons:  # computed before the round by should_stop
                return self._epsilons[key]
        return self.accounted_ledger().epsilon(accountant=self.accountant)

    # -- the Message-API hooks ---------------------------------------------------------
    def aggregate_train(
        self, server_round: int, replies: Iterable[Message]
    ) -> tuple[ArrayRecord | None, MetricRecord | None]:
        if self._stopped_at is not None and server_round >= self._stopped_at:
            return None, None
        round_, valid = self.clipped_round(replies)
        clipping_norm = self.clipping_norm
        std = self.update_noise_multiplier * clipping_norm
        rng = self.noise_generator(server_round, "update")
        updated = {}
        for name, value in round_.reference.items():
            noise = rng.normal(0.0, std, size=value.shape) if std > 0 else 0.0
            mean_update = (round_.total[name] + noise) / self.expected_clients
            updated[name] = (value.astype(np.float64) + mean_update).astype(value.dtype)
        self.ledger.record(server_round, self.round_event())
        client_metrics = self.clients_metrics(round_)
        client_metrics[self.weight_key] = 1
        content = RecordDict({round_.key: to_record(updated), "metrics": client_metrics})
        synthetic = (
            partial_reply(valid[0], content) if valid else server_reply(content, server_round)
        )
        arrays, aggregated = self.strategy.aggregate_train(server_round, [synthetic])
        aggregated = aggregated if aggregated is not None else MetricRecord()
        self.add_round_metrics(aggregated, round_, clipping_norm, self.update_noise_multiplier, std)
        if self.adaptive is not None:
            estimate = self._adapt_clipping_norm(
                self.adaptive, server_round, round_.clients, round_.clipped
            )
            aggregated["dp-unclipped-estimate"] = estimate
        return arrays, aggregated

    def _adapt_clipping_norm(
        self, adaptive: AdaptiveClipping, server_round: int, clients: int, clipped: int
    ) -> float:
        """Release the noisy unclipped fraction and update ``C``; returns ``b~``."""
        centred = (clients - clipped) - 0.5 * clients  # sum_i (b_i - 1/2)
        rng = self.noise_generator(server_round, "count")
        noisy = centred + float(rng.normal(0.0, adaptive.count_stddev))
        estimate = noisy / self.expected_clients + 0.5
        factor = math.exp(-adaptive.learning_rate * (estimate - adaptive.target_unclipped_quantile))
        self.reducer = ClippedSum(self.clipping_norm * factor, self.weight_key)
        return estimate


def check_accountant(
    accountant: str, sampling: Sampling, delta: float, key: str = "accountant"
) -> None:
    """Refuse ``accountant`` (named ``key``) when it cannot account ``sampling``."""
    try:
        epsilon(1.0, sampling, 1, delta, accountant, relation_for(sampling))
    except ConfigError as err:
        raise ConfigError(
            key, accountant, f"an accountant for {type(sampling).__name__} ({err.allowed})"
        ) from err
