"""The DMM strategy (Bienstock, Kumar & Polychroniadou, ICML 2025; docs/dmm-design.md): it
wraps a FedAvg and is the integer mechanism, its bit budget, the zCDP ledger and the decoding,
as the package docstring (:mod:`strategies.methods.dmm`) sets out. It composes
:mod:`strategies.methods.dmm.calibration` (checked before round 1), the committees' sum
(:class:`strategies.secure.dmm.committee_sum.DMMSum`, through the
:class:`~strategies.secure.SecureSum`
interface: the committee holding the state, the replies checked at the boundary, worker
folds), :mod:`strategies.methods.dmm.accounting` (the zCDP ledger) and
:mod:`strategies.methods.dmm.metrics` (bytes and costs); evaluation and clear metrics are refused or
accounted by :class:`strategies.secure.clear.SecureReplies`."""

from __future__ import annotations

import logging
import math
from collections.abc import Iterable
from typing import Any, Literal

import numpy as np
from flwr.app import ArrayRecord, ConfigRecord, Message, MetricRecord, RecordDict
from flwr.serverapp import Grid
from flwr.serverapp.strategy import FedAvg

from fedsim.engine.boundary import ReleaseBoundary, boundary_of
from fedsim.privacy import dmm as dmm_privacy
from fedsim.privacy.ledger import PrivacyLedger
from fedsim.privacy.matrix.factorization import Factorization
from fedsim.privacy.participation import Participation
from fedsim.privacy.sampling import NeighbouringRelation
from fedsim.randomness import Stream, public_generator
from fedsim.record_codec import to_numpy, to_record
from protocols.dmm.common import DMMKeys, StateLost
from protocols.dmm.release import RoundOutput
from protocols.encoding import DEFAULT_BETA, DEFAULT_FAILURE_PROBABILITY, DDGaussEncoder, unrotate
from protocols.field import MersenneField
from protocols.shamir import PackedShamir
from strategies.methods.dmm import accounting
from strategies.methods.dmm.calibration import Plan, calibrate, check_arguments, integer_mechanism
from strategies.methods.dmm.metrics import clear_metrics, round_metrics
from strategies.methods.dmm.options import DMMOptions as OPTIONS
from strategies.plumbing.participation_guard import ParticipationGuard
from strategies.plumbing.vectors import unflatten
from strategies.plumbing.wrapper import server_reply
from strategies.secure.clear import SecureReplies
from strategies.secure.dmm import (
    committee_sum as dmm_sum,  # the module: it imports this package's parts
)
from strategies.secure.dmm import replies as checks

log = logging.getLogger(__name__)


class DMM(SecureReplies):
    """Wrap a FedAvg-family strategy with the distributed matrix mechanism.

    At the release boundary (:mod:`fedsim.engine.boundary`) it claims the replies it consumes,
    by the instructions they answer, wherever the rounds run (fedsim's loop, Flower's
    ``Strategy.start``, an app's own loop): the train replies that enter the secure sum are
    claimed for this ledger; a reply the boundary refuses (never delivered, or consumed
    already) is rejected and never enters the sum; the other train replies it rejects are
    withheld (sealed to the committee in full mode, dropped by the ideal sum in ideal mode:
    nothing of them is released); evaluation replies are claimed, and the ledger makes epsilon
    infinite for them. A reply nobody claims counts as an unaccounted release.

    Args (the defaults are :class:`~strategies.methods.dmm.options.DMMOptions`'s, written there
    once):
        strategy: samples clients and applies the mean update.
        factorization: A = B C of the workload; C banded (BandMF, banded Toeplitz) or the 0/1
            tree (binary / Honaker); its n is the number of rounds.
        population: registered clients (committees are drawn from them).
        committee_size, threshold, packing, member_dropouts: n, t, k of every committee and
            the member dropouts it is planned for (:func:`committee_bound`).
        fractional_bits: f of M = round(2^f C) (None: 12 for banded C, 0 for the tree).
        clipping_norm, noise_multiplier: c and z: each released row carries central std
            z * (c / gamma) * sens(M) (integer units) when the planned clients contribute.
        expected_clients: m, the planned cohort (the mean's denominator).
        expected_client_dropout: fraction of clients the noise is planned to lose.
        participation: the schema sens(M) is computed for (single by default); enforced:
            an instruction that would break it does not leave (``participation-refused``).
        seed: the run's public seed (committees, rotation).
        mode: 'full' (clients share and seal; members on the committee host) or 'ideal'.
        min_clients: fewest agreed clients a release may carry.
        bits: signed bits of the sum of m rounded updates (sets gamma).
        field_exponent: p = 2^e - 1; delta: the run's delta.
        committee_actors, committee_shards: how the front end's committee host runs members
            (Ray actors, and how many).
        reshare_checks: dealers beyond t + k a committee handoff needs, so that a wrong
            dealing is caught (:class:`protocols.dmm.server.DMMServer`; 0 lets t + k deal
            unchecked and reports every later release of those rows unverified).
        worker_fold: full mode: the clients of a fedsim worker batch fold their sharing
            inputs and the worker seals one message per batch (:mod:`strategies.secure.dmm.fold`);
            elsewhere (Flower's runtime) each client still seals its own.
        metrics_in_clear: allow federated evaluation and per-client train metrics, which give
            the server each client's un-noised metrics: epsilon becomes infinite once any
            arrive. Without it a ``strategy`` whose ``fraction_evaluate`` is > 0, or that sends
            evaluate messages, is refused.
    """

    method = "DMM"
    #: the replies it consumes are claimed at the release boundary (fedsim.engine.boundary)
    claims_replies = True
    _boundary: ReleaseBoundary | None = None
    strategy: FedAvg
    #: the schema sens(M) assumes, enforced on every instruction (in server rounds, as the
    #: engine's cohort schedules them; aborted rounds are handled by the accounting)
    guard: ParticipationGuard

    def __init__(
        self,
        strategy: FedAvg,
        *,
        factorization: Factorization,
        population: int,
        clipping_norm: float,
        noise_multiplier: float,
        expected_clients: int,
        seed: int,
        committee_size: int = OPTIONS.committee_size,
        threshold: int = OPTIONS.threshold,
        packing: int = OPTIONS.packing,
        member_dropouts: int = OPTIONS.member_dropouts,
        fractional_bits: int | None = OPTIONS.fractional_bits,
        mode: Literal["full", "ideal"] = OPTIONS.mode,
        participation: Participation | None = None,
        expected_client_dropout: float = OPTIONS.expected_client_dropout,
        min_clients: int = OPTIONS.min_clients,
        bits: int = OPTIONS.bits,
        beta: float = DEFAULT_BETA,
        max_tries: int = 100,
        field_exponent: int = 61,
        delta: float = OPTIONS.delta,
        failure_probability: float = DEFAULT_FAILURE_PROBABILITY,
        committee_actors: bool = OPTIONS.committee_actors,
        committee_shards: int = OPTIONS.committee_shards,
        worker_fold: bool = OPTIONS.worker_fold,
        metrics_in_clear: bool = False,
        reshare_checks: int = OPTIONS.reshare_checks,
    ) -> None:
        check_arguments(
            worker_fold=worker_fold,
            clipping_norm=clipping_norm,
            noise_multiplier=noise_multiplier,
            expected_clients=expected_clients,
            population=population,
            expected_client_dropout=expected_client_dropout,
            mode=mode,
            committee_actors=committee_actors,
            committee_shards=committee_shards,
            committee=(committee_size, threshold, packing, member_dropouts),
            fraction_evaluate=strategy.fraction_evaluate,
            metrics_in_clear=metrics_in_clear,
        )
        super().__init__(strategy)
        self.mechanism = integer_mechanism(factorization, fractional_bits, participation)
        scheme = PackedShamir(committee_size, threshold, packing, MersenneField(field_exponent))
        self.secure = dmm_sum.DMMSum(  # the committees' sum: custody, its server, worker folds
            scheme, seed=int(seed), population=population, mode=mode, worker_fold=worker_fold,
            min_clients=min_clients, reshare_checks=reshare_checks,
        )  # fmt: skip
        self.population, self.member_dropouts = population, member_dropouts
        self.clipping_norm, self.noise_multiplier = float(clipping_norm), float(noise_multiplier)
        self.expected_clients, self.seed = expected_clients, int(seed)
        self.expected_client_dropout = float(expected_client_dropout)
        self.bits, self.beta, self.max_tries = bits, beta, max_tries
        self.metrics_in_clear = bool(metrics_in_clear)
        self.committee_actors, self.committee_shards = committee_actors, committee_shards
        self._start_bookkeeping(delta, failure_probability)

    def _start_bookkeeping(self, delta: float, failure_probability: float) -> None:
        """The ledger at ``delta`` (and the rounding's ``failure_probability``, which the
        calibration reads), the participation guard, and what the rounds record: none
        released, refused, aborted or unaccounted yet."""
        self.failure_probability = failure_probability
        self.ledger = PrivacyLedger(NeighbouringRelation.ADD_REMOVE, delta)
        self.guard = ParticipationGuard(self.mechanism.participation, self.mechanism.n)
        self.unaccounted: list[str] = []
        self.participation_refused: list[int] = []
        self.encoder: DDGaussEncoder | None = None
        self.aborted_rounds = 0
        #: rounds that aborted after their release shares reached the server (accounted):
        #: round, clients, the epsilon it cost
        self.aborted_releases: list[dict[str, float]] = []
        self.last_output: RoundOutput | None = None
        self.last_abort: str | None = None
        self.halted: str | None = None
        self._scaled_noise_std = 0.0
        self._zcdp = 0.0
        self._accounted: dict[Participation, dmm_privacy.IntegerMechanism] = {}
        self._global: ArrayRecord | None = None

    # ------------------------------------------------------------------ secrets and custody
    def bind_committee_host(self, host) -> None:
        """Contract 1: the front end hands the engine-side committee host (it holds the run's
        secrets; this strategy never does). After ``--resume`` it is bound again and the
        committee holding the state is re-hosted from its members' sealed states."""
        self.secure.bind_host(host)

    def committee_host_options(self) -> dict[str, Any]:
        """How the front end should build this run's committee host."""
        return {"actors": self.committee_actors, "shards": self.committee_shards}

    def __getstate__(self) -> dict:
        """Checkpoints keep only what the server may know: never the host
        (:class:`~strategies.secure.dmm.custody.Custody` drops it), a pool (the members' shares
        are theirs) or a round in flight (:class:`~strategies.secure.dmm.committee_sum.DMMSum`
        drops them)."""
        state = dict(self.__dict__)
        state.pop("_boundary", None)  # the run's, bound again by the next configure_train
        return state

    def __setstate__(self, state: dict) -> None:
        """A checkpoint written before the opened-release and metrics bookkeeping existed
        loads with none recorded and the defaults."""
        self.__dict__.update(aborted_releases=[], unaccounted=[], metrics_in_clear=False)
        self.__dict__.update(state)

    def close(self) -> None:
        """Forget the hosted committee (the host ends its actors)."""
        server = self.secure.server
        if server is not None and server.pool is not None:
            server.pool.close()
            server.pool = None

    # ------------------------------------------------------------------ configuration
    @property
    def sensitivity(self) -> float:
        """sens(M) of the implemented integer matrix over all n rounds."""
        return self.mechanism.sensitivity.value

    def rotation_seed(self) -> int:
        """The run's public rotation seed (one basis for every round: releases combine the
        round sums of several rounds)."""
        return int(public_generator(self.seed, 0, Stream.ROTATION).integers(2**31))

    def plan(self) -> Plan:
        """What the noise and the bit budget are planned for, from this strategy's settings."""
        return Plan(
            clipping_norm=self.clipping_norm,
            noise_multiplier=self.noise_multiplier,
            expected_clients=self.expected_clients,
            expected_client_dropout=self.expected_client_dropout,
            bits=self.bits,
            beta=self.beta,
            max_tries=self.max_tries,
            failure_probability=self.failure_probability,
        )

    def check(self, dim: int) -> DDGaussEncoder:
        """Validate the noise and the bit budget for models of ``dim`` parameters and build the
        encoder (:func:`strategies.methods.dmm.calibration.calibrate`); raises ``ValueError`` with
        the budget when a released row could wrap mod p."""
        encoder, self._scaled_noise_std = calibrate(
            self.plan(), self.mechanism, self.secure.scheme.field, dim
        )
        return encoder

    def _ensure(self, dim: int) -> DDGaussEncoder:
        if self.encoder is None or self.encoder.dim != dim:
            self.encoder = encoder = self.check(dim)
            self.secure.start(
                encoder.padded_dim,
                self.mechanism.integer_matrix,
                noise_std=self._scaled_noise_std,
                decoding=self.mechanism.decoding,
                l2_bound=encoder.l2_bound,
            )
        return self.encoder

    # ------------------------------------------------------------------ accounting
    def accounting_participation(self) -> Participation:
        """The schema in mechanism steps (:func:`strategies.methods.dmm.accounting.in_steps`)."""
        return accounting.in_steps(self.mechanism.participation, self.aborted_rounds)

    def _account(self, server_round: int, opened=None) -> None:
        """Record the increase of epsilon for the rows released so far, and for ``opened``'s
        rows (an aborted round whose release shares reached the server) as released."""
        participation = self.accounting_participation()
        self._accounted = accounting.for_participation(
            self._accounted, self.mechanism, participation
        )
        eps = accounting.released_epsilon(
            self._accounted[participation],
            self.secure.server.step,
            self.secure.server.counts,
            self.encoder,
            self._scaled_noise_std,
            opened,
        )
        self.ledger.record(server_round, dmm_privacy.increment_event(self._zcdp, eps))
        self._zcdp = max(self._zcdp, eps)

    def report_details(self) -> dict[str, Any]:
        """Steps, the integer matrix's sensitivity, the fewest noise contributors, the
        neighbouring relation the bound proves (zero-out; it overrides the ledger's add/remove,
        whose Gaussian arithmetic it shares), aborts (those accounted as opened releases with
        their cost), and any client content that reached the server unaccounted."""
        counts = self.secure.server.counts if self.secure.server else {}
        details: dict[str, Any] = {
            "steps": self.secure.server.step if self.secure.server else 0,
            "factorization": self.mechanism.factorization.kind,
            "fractional_bits": self.mechanism.fractional_bits,
            "sensitivity_implemented": self.sensitivity,
            "sensitivity_exact": self.mechanism.sensitivity.exact,
            "fewest_noise_clients": min(counts.values()) if counts else None,
            "mode": self.secure.mode,
            "aborted_rounds": self.aborted_rounds,
            "aborted_releases": list(self.aborted_releases),
            "bound": "discrete Gaussian on the integer query M X (KLS21 Thm 1), noise present",
            "relation": dmm_privacy.RELATION,
        }
        details.update(self.unaccounted_details())
        return details

    # ------------------------------------------------------------------ rounds
    def _instruction_config(
        self, server_round: int, config: ConfigRecord, encoder: DDGaussEncoder, step: int
    ) -> ConfigRecord:
        """``config`` with the round and the ``dmm.*`` entries every client needs."""
        extended = ConfigRecord(dict(config))
        extended["server-round"] = server_round
        extended.update(
            {
                DMMKeys.PREFIX + DMMKeys.DIM: encoder.dim,
                DMMKeys.PREFIX + DMMKeys.CLIP: encoder.clip,
                DMMKeys.PREFIX + DMMKeys.GAMMA: encoder.gamma,
                DMMKeys.PREFIX + DMMKeys.BETA: encoder.beta,
                DMMKeys.PREFIX + DMMKeys.MAX_TRIES: encoder.max_tries,
                DMMKeys.PREFIX + DMMKeys.ROTATION_SEED: self.rotation_seed(),
            }
        )
        return extended

    def configure_train(
        self, server_round: int, arrays: ArrayRecord, config: ConfigRecord, grid: Grid
    ) -> Iterable[Message]:
        boundary = boundary_of(grid)
        if boundary is not None:  # this ledger's releases are claimed there
            self._boundary = boundary
            boundary.register(self)
        reference = to_numpy(arrays)
        encoder = self._ensure(int(sum(v.size for v in reference.values())))
        if self.halted:
            return []
        step = self.secure.server.step
        if step >= self.mechanism.n:
            raise ValueError(
                f"server round {server_round} needs step {step} but the factorization has "
                f"n = {self.mechanism.n} rounds; build it for more rounds"
            )
        extended = self._instruction_config(server_round, config, encoder, step)
        self.secure.instruct(server_round, extended, grid)
        self._global = arrays
        messages, self.participation_refused = self.guard.admit(
            server_round - 1, self.strategy.configure_train(server_round, arrays, extended, grid)
        )
        self.secure.address(server_round, messages)
        return messages

    def _refusals(self, server_round: int, replies: list[Message], metrics) -> str | None:
        """Clients that refused relayed keys are named, never silent dropouts: the reason of
        the first (None: none refused)."""
        refusals = checks.key_refusals(replies)
        if not refusals:
            return None
        node, reason = sorted(refusals.items())[0]
        log.warning(
            "DMM round %s: %d clients refused keys relayed by the server (node %d: %s)",
            server_round, len(refusals), node, reason,
        )  # fmt: skip
        metrics["dmm-key-refusals"] = len(refusals)
        return f"{len(refusals)} clients refused relayed keys ({reason})"

    def aggregate_train(
        self, server_round: int, replies: Iterable[Message]
    ) -> tuple[ArrayRecord | None, MetricRecord | None]:
        metrics = MetricRecord(
            {
                "dmm-planned": self.expected_clients,
                "participation-refused": self.participation_refused,
            }
        )
        if self.halted:
            metrics["dmm-halted"] = 1
            metrics["epsilon"] = self.epsilon()
            return None, metrics
        if self._global is None or self.encoder is None or self.secure.round is None:
            raise RuntimeError("aggregate_train called before configure_train")
        replies = list(replies)
        clear = sum(not r.has_error() and "metrics" in r.content for r in replies)
        if clear:
            self.unaccounted_release(server_round, f"train metrics of {clear} clients in the clear")
        refused = self._refusals(server_round, replies, metrics)
        payloads, rejected = self.secure.first_replies(replies, self._boundary, self)
        release = self.secure.finish(server_round, payloads, self.encoder.padded_dim)
        rejected.update(release.rejected)
        if release.total is None:
            aborted = self._aborted(server_round, release.transcript, rejected, metrics)
            if refused:
                self.last_abort += f"; {refused}"
            return None, aborted
        output = release.transcript
        self.last_output, self.last_abort = output, None
        self._account(server_round)
        arrays, aggregated = self._apply(server_round, output)
        aggregated.update(dict(metrics))
        aggregated.update(self._round_metrics(output, rejected, replies))
        self.secure.round = None
        return arrays, aggregated

    def _aborted(self, server_round, error, rejected, metrics) -> MetricRecord:
        """An aborted round. One whose release shares reached the server (``error.opened``,
        :class:`protocols.dmm.common.OpenedRelease`) is accounted as the release of its step, and
        the mechanism halts: that state was opened, so it is never released again with fresh
        noise (and its decoding cannot go on without the rows)."""
        self.last_output, self.last_abort = None, str(error)
        before = self.epsilon()
        opened = error.opened
        log.warning("DMM round %s aborted: %s", server_round, error)
        metrics["dmm-aborted"] = 1
        if opened is not None:
            self._account(server_round, opened)
            metrics["dmm-opened"] = 1
            self.halted = f"round {server_round} aborted after its release was opened: {error}"
        else:
            self.aborted_rounds += 1  # no step spent: later rounds move one step closer
        if isinstance(error, StateLost) or opened is not None:  # no later round can run
            self.halted = self.halted or str(error)
            metrics["dmm-halted"] = 1
        checks.log_rejected(server_round, rejected)
        metrics["rejected"] = sorted(rejected)
        now = self.epsilon()
        metrics["epsilon"] = now
        metrics["dmm-epsilon-cost"] = now - before if math.isfinite(before) else math.inf
        if opened is not None:
            self.aborted_releases.append(
                {
                    "round": server_round,
                    "clients": opened.clients,
                    "epsilon_cost": metrics["dmm-epsilon-cost"],
                }
            )
        self.secure.round = None
        return metrics

    def _apply(self, server_round: int, output: RoundOutput):
        """g + gamma * unrotate(x_hat_t) / expected_clients through the wrapped strategy."""
        reference = to_numpy(self._global)
        signs = self.encoder.signs(self.rotation_seed())
        mean = unrotate(output.estimate * self.encoder.gamma, signs, self.encoder.dim)
        mean /= self.expected_clients
        tree = unflatten(mean, reference)
        new = {k: (v.astype(np.float64) + tree[k]).astype(v.dtype) for k, v in reference.items()}
        key = self.strategy.arrayrecord_key
        content = RecordDict({key: to_record(new), "metrics": MetricRecord({"num-examples": 1})})
        arrays, aggregated = self.strategy.aggregate_train(
            server_round, [server_reply(content, server_round)]
        )
        return arrays, aggregated if aggregated is not None else MetricRecord()

    def _round_metrics(self, output: RoundOutput, rejected, replies) -> dict[str, Any]:
        """The released round's metrics (:mod:`strategies.methods.dmm.metrics`), its rejected
        replies and epsilon so far."""
        out = round_metrics(
            self.secure.round,
            output,
            step=self.secure.server.step,
            seats=self.secure.scheme.n,
            member_dropouts=self.member_dropouts,
        )
        out["rejected"] = sorted(rejected)
        out["epsilon"] = self.epsilon()
        checks.log_rejected(self.secure.round.round, rejected)
        out.update(clear_metrics(replies))
        return out
