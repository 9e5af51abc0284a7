"""The distributed discrete Gaussian mechanism (DDGauss) over secure aggregation.

Kairouz, Liu & Steinke, ICML 2021 (KLS21). Each sampled client trains, clips its model update
to L2 <= c, rotates, scales by 1/gamma, rounds conditionally and adds its own discrete Gaussian
noise N_Z(0, (sigma/gamma)^2) (:mod:`protocols.encoding`, done by :func:`ddgauss_client_app`
around any training ClientApp). Rounding and noise come from the client's own secret
(:func:`fedsim.randomness.client_secret`; streams ``(round, Purpose.ROUNDING | NOISE,
"ddgauss.")``), never from the run seed or anything in a message. The modes:

* ``mode="full"``: the clients mask before anything leaves the ClientApp. The train reply holds
  only two public keys; the strategy then runs SecAgg+ (Bell et al., CCS 2020) as three more
  message exchanges through the Grid it was given in ``configure_train``
  (:mod:`strategies.secure.secagg_messages`), and the server holds only public keys, sealed share
  rows it relays, masked inputs and its own protocol state. It learns the modular sum of the
  survivors' encodings and nothing else about them, against an honest-but-curious server: the
  public keys it relays are taken as authentic.
* ``mode="plaintext"``: for fast studies. Each client's encoding (its rounded update plus its
  share of the noise, sigma/sqrt(n) per client) reaches the server in the clear, and the server
  sums them itself; it reproduces full mode's sum and accounting bit for bit on the complete
  graph (``secagg_degree=None``) with the same client secrets and dropouts. (The earlier name
  ``"ideal"`` is refused: nothing about the server's view is ideal.)
* ``mode="committee"``: the clients share and seal before anything leaves the ClientApp. The
  train instruction carries the round's public committee parameters (n, t, k, the field, the
  channel session id and the members' X25519 keys) and the client's channel id; each client
  packed-Shamir-shares its encoding with share randomness from its own secret (``(round,
  Purpose.SHARES, "ddgauss.")``) and seals row j for member j under its own X25519 key
  (``(round, Purpose.KEYS, "ddgauss.", session)``; :func:`protocols.committee.client.seal_input`),
  and its reply holds only that public key and the ciphertexts. A
  :class:`fedsim.engine.committee.Committee` (members' keys from their own secrets; built and
  bound by the run's front end from ``committee_spec()``, or passed in) checks each sealed input,
  sums the shares and releases only the sum. The server holds ciphertexts, public keys and
  the released sum; it and at most t colluding members learn nothing else about one client's
  encoding (the members' keys it relays are taken as authentic). ``member_dropout`` drops
  members from a public schedule.

Each mode is a :class:`strategies.secure.SecureSum` (:data:`SECURE_SUMS`: "full" runs
``secagg``, "plaintext" ``plaintext``, "committee" ``committee``), which instructs the cohort,
checks the clients' first replies and finishes into a :class:`strategies.secure.Release`;
DDGauss itself is the KLS21 encoder, the ledger that reads each release, and the decoding.

The server decodes the sum (signed, times gamma, inverse rotation), divides by the planned
cohort size ``expected_clients`` and hands ``g + mean update`` to the wrapped Flower strategy
(FedAvg, FedAvgM, FedAdam, ...) as a single reply.

Calibration: the central noise standard deviation is ``noise_multiplier * c`` when all
``expected_clients`` = n contribute, so each client adds sigma = noise_multiplier * c / sqrt(n);
gamma is the finest granularity for which the sum of n encodings fits ``bits`` signed bits
(:func:`protocols.encoding.choose_gamma`).

Accounting (:mod:`fedsim.privacy.ddgauss`): every released round records KLS21 Theorem 1's
bound as ``GaussianDpEvent(1/eps)`` in a :class:`~fedsim.privacy.ledger.PrivacyLedger`
(no amplification by sampling claimed), with sensitivities Delta_2, Delta_1 of the rounded
vector and **the number of clients whose noise is in the sum** (the survivors, after dropouts
and rejected replies; never the planned n). A round with dropouts therefore costs more privacy
than a full one. The neighbouring relation reported is the one proved, **zero-out** (one
client's update zeroed, its noise share still in the sum; ``ddgauss_privacy.RELATION``).

**Opened is released**: a round counts as released as soon as the server holds enough to
determine its sum, whatever the round is then called -- a committee round that aborts after more
than t members' rows reached the server (:class:`protocols.committee.common.OpenedRelease`), a
SecAgg+ round that aborts in UNMASK after the shares of every secret arrived
(:attr:`protocols.secagg.server.SecAggServer.opened`). Such a round updates no model but is
accounted for the noise of the clients in that sum; its metrics say ``ddgauss-aborted = 1``,
``ddgauss-opened = 1`` and the epsilon it cost (``ddgauss-epsilon-cost``), and the privacy
report lists it under ``aborted_releases`` (round, clients, epsilon cost). A round whose sum
the server cannot determine records nothing.

**Per-client metrics**: clients reply nothing data-dependent but their (masked, sealed or clear)
encoding unless their app has ``metrics_in_clear``; federated evaluation, which replies each
client's un-noised loss and accuracy, is refused (by the config, the strategy and the client
app) unless ``metrics_in_clear``, and any per-client metric that reaches the strategy makes
epsilon infinite for the protected unit (a ``NonPrivateDpEvent``; the report's
``unaccounted``).

Hostile replies: every reply is checked (form, types, lengths, field ranges, key validity,
membership, stage) before it is used; a bad one drops its client for the round, named in the
round metric ``rejected`` (node ids) with the reasons in the log, and the round goes on, or
releases nothing when too few clients remain. Each client answers a round once
(:mod:`strategies.plumbing.answered_rounds`): a round number sent again, with any model, is refused
before anything is drawn for it.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Iterable
from typing import Any, Literal

import numpy as np
from flwr.app import ArrayRecord, ConfigRecord, Message, MetricRecord, RecordDict
from flwr.serverapp import Grid
from flwr.serverapp.strategy import Strategy

from fedsim.engine.committee import Committee, CommitteeSpec
from fedsim.privacy import ddgauss as ddgauss_privacy
from fedsim.privacy.ledger import PrivacyLedger
from fedsim.privacy.sampling import NeighbouringRelation
from fedsim.randomness import Stream, public_generator
from fedsim.record_codec import to_numpy, to_record
from protocols.channels import KeySubstitution
from protocols.encoding import DDGaussEncoder, choose_gamma
from protocols.secagg.common import SecAggConfig, Stage
from strategies import secure
from strategies.methods.ddgauss.client import PREFIX
from strategies.methods.ddgauss.options import (
    SECURE_SUMS,
    DDGaussOptions,
    check_arguments,
    check_options,
)
from strategies.plumbing.vectors import unflatten
from strategies.plumbing.wrapper import arrayrecord_key, server_reply
from strategies.secure import Release, SecAggPlan, SecureSum
from strategies.secure.clear import SecureReplies
from strategies.secure.replies import clear_train_loss, first_replies

log = logging.getLogger(__name__)


class DDGauss(SecureReplies):
    """Wrap a FedAvg-family strategy with DDGauss over SecAgg+ and a privacy ledger.
    Evaluation and per-client metrics are refused, or accounted as infinite epsilon, by
    :class:`strategies.secure.clear.SecureReplies`.

    Args:
        strategy: samples clients and applies the mean update (FedAvg, FedAdam, ...).
        clipping_norm: c, the L2 bound of each client's update.
        noise_multiplier: central noise std / c when all ``expected_clients`` contribute.
        expected_clients: n, the planned clients per round (noise is split among them).
        seed: the run seed, root of the round's public streams only (rotation, neighbour graph,
            simulated protocol dropouts); never of a client's secret.
        mode: "full" (clients mask; SecAgg+ over the Grid), "plaintext" (encodings in the
            clear, summed by the server) or "committee" (clients share and seal to
            ``committee``, which sums).
        committee: ``mode="committee"`` only: a
            :class:`~fedsim.engine.committee.Committee`, or the
            :class:`~fedsim.engine.committee.CommitteeSpec` from which the run's front end
            builds one (members' secrets from the run's root) and binds it
            (:meth:`bind_committee`).
        member_dropout: ``mode="committee"`` only: probability that a member drops out at
            each of SHARE, COMBINE, RELEASE (a public schedule from ``seed`` and the round).
        bits: signed bits the modular sum of n encodings must fit (gamma is chosen from it).
        beta: conditional rounding parameter; max_tries: cap on rounding redraws.
        delta: the run's delta; secagg_degree: neighbours per client in SecAgg+ (None: all).
        ring_bits: in full mode, mask and sum in Z_{2^ring_bits} (>= ``bits``, so the sum cannot
            wrap) instead of F_p: half the bytes at 32 bits; None keeps the field.
        protocol_dropout: probability that a client whose train reply arrived stops answering
            inside SecAgg+, at a stage drawn uniformly from its four stages (a public schedule
            from ``seed`` and the round). Clients lost before MASKED_INPUT contribute no noise.
            Plaintext mode reproduces full mode's outcome exactly on the complete graph.
        stage_timeout: seconds each SecAgg+ exchange waits for replies (None: no limit).
        prg: full mode's mask PRG by its name (:class:`protocols.secagg.prg.MaskPRG`:
            ``"chacha20"`` or ``"aes-ctr"``); the masks cancel, so the sum is the same.
        metrics_in_clear: allow federated evaluation (``strategy``'s evaluate phase), which
            gives the server each evaluating client's un-noised metrics: epsilon becomes
            infinite once any arrive. Without it a ``strategy`` whose ``fraction_evaluate`` is
            > 0, or that sends evaluate messages, is refused.
    """

    method = "DDGauss"

    def __init__(
        self,
        strategy: Strategy,
        *,
        clipping_norm: float,
        noise_multiplier: float,
        expected_clients: int,
        seed: int,
        mode: Literal["full", "plaintext", "committee"] = DDGaussOptions.mode,
        bits: int = DDGaussOptions.bits,
        beta: float = DDGaussOptions.beta,
        max_tries: int = DDGaussOptions.max_tries,
        delta: float = DDGaussOptions.delta,
        secagg_degree: int | None = None,
        ring_bits: int | None = None,
        protocol_dropout: float = DDGaussOptions.protocol_dropout,
        committee: Committee | CommitteeSpec | None = None,
        stage_timeout: float | None = DDGaussOptions.stage_timeout,
        prg: str = DDGaussOptions.prg,
        member_dropout: float = 0.0,
        metrics_in_clear: bool = False,
    ) -> None:
        check_options(
            "",
            clipping_norm=clipping_norm,
            noise_multiplier=noise_multiplier,
            mode=mode,
            member_dropout=member_dropout,
            secagg_degree=secagg_degree,
            ring_bits=ring_bits,
            bits=bits,
            protocol_dropout=protocol_dropout,
            stage_timeout=stage_timeout,
            prg=prg,
        )
        check_arguments(expected_clients, mode, committee, strategy, metrics_in_clear)
        super().__init__(strategy)
        self.metrics_in_clear = bool(metrics_in_clear)
        self.ring_bits = ring_bits
        self.protocol_dropout = float(protocol_dropout)
        self.member_dropout = float(member_dropout)
        self.prg = prg
        #: the round's secure sum, chosen by ``mode`` (:data:`SECURE_SUMS`)
        self.secure: SecureSum = secure.build(
            SECURE_SUMS[mode],
            prefix=PREFIX,
            plan=SecAggPlan(int(seed), secagg_degree, ring_bits, float(protocol_dropout), prg),
            stage_timeout=stage_timeout,
            committee=committee,
            member_dropout=float(member_dropout),
        )
        self.clipping_norm, self.noise_multiplier = float(clipping_norm), float(noise_multiplier)
        self.expected_clients, self.seed, self.mode = expected_clients, int(seed), mode
        self.bits, self.beta, self.max_tries = bits, beta, max_tries
        self.secagg_degree = secagg_degree
        self.stage_timeout = stage_timeout
        self.ledger = PrivacyLedger(NeighbouringRelation.ADD_REMOVE, delta)
        self._start_state()

    def _start_state(self) -> None:
        """What the rounds fill in: the latest round's outcome and the run's releases."""
        self.encoder: DDGaussEncoder | None = None
        self.last_sum: np.ndarray | None = None
        self.last_survivors: tuple[int, ...] = ()
        self.last_rejected: dict[int, str] = {}
        self.last_abort: str | None = None
        #: node -> why it refused the keys the server relayed (this round's train replies)
        self.last_key_refusals: dict[int, str] = {}
        self.last_stage: str | None = None
        self.last_opened: tuple[int, ...] = ()
        #: rounds that aborted after the server held their sum (accounted): round, clients,
        #: the epsilon it cost
        self.aborted_releases: list[dict[str, float]] = []
        #: client content that reached the server outside the secure sum (epsilon = inf)
        self.unaccounted: list[str] = []
        self._global: tuple[str, ArrayRecord] | None = None
        self._grid: Grid | None = None
        self._asked: set[int] = set()

    def __getstate__(self) -> dict[str, Any]:
        state = dict(self.__dict__)
        state["_grid"] = None  # the round's transport, never part of a checkpoint
        return state  # the secure sum drops its committee: the members' keys are theirs

    @property
    def committee(self) -> Committee | None:
        """The bound committee (committee mode; None until the front end binds one)."""
        return getattr(self.secure, "committee", None)

    def committee_spec(self) -> CommitteeSpec | None:
        """The committee the front end should build and bind (None outside committee mode)."""
        return getattr(self.secure, "spec", None)

    def bind_committee(self, committee: Committee) -> None:
        """Sum through ``committee`` (engine-side: it holds the members' keys, this strategy
        never holds their secrets); the front end binds one again after ``--resume``."""
        if not isinstance(self.secure, secure.CommitteeSum):
            raise ValueError(f"bind_committee with mode={self.mode!r}; only mode='committee'")
        self.secure.bind(committee)

    @property
    def client_noise_std(self) -> float:
        """sigma: each client's noise std (real units), noise_multiplier * c / sqrt(n)."""
        return self.noise_multiplier * self.clipping_norm / math.sqrt(self.expected_clients)

    def encoder_for(self, dim: int) -> DDGaussEncoder:
        """The encoder for models of ``dim`` parameters (gamma from the bit budget), cached."""
        if self.encoder is None or self.encoder.dim != dim:
            gamma = choose_gamma(
                dim,
                self.expected_clients,
                self.clipping_norm,
                self.client_noise_std,
                self.bits,
                beta=self.beta,
            )
            encoder = DDGaussEncoder(
                dim, self.clipping_norm, gamma, self.client_noise_std, self.beta, self.max_tries
            )
            if encoder.scaled_noise_std < 0.5:
                raise ValueError(
                    f"each client's noise is {encoder.scaled_noise_std:.3g} integer steps "
                    f"(sigma/gamma with gamma={gamma:.3g}); KLS21's bound needs >= 1/2: raise "
                    f"bits (now {self.bits}) or noise_multiplier"
                )
            self.encoder = encoder
        return self.encoder

    def rotation_seed(self, server_round: int) -> int:
        """The round's public rotation seed, shared by every client."""
        return int(public_generator(self.seed, server_round, Stream.ROTATION).integers(2**63))

    def report_details(self) -> dict[str, Any]:
        """The bound epsilon rests on, the neighbouring relation it proves (zero-out; it
        overrides the ledger's add/remove, whose Gaussian arithmetic it shares), the protocol's
        mode, the rounds accounted though they aborted, and any client content that reached
        the server unaccounted (the count and the first)."""
        details: dict[str, Any] = {
            "bound": "KLS21 Theorem 1 (zCDP), noise of the clients in each opened sum only",
            "relation": ddgauss_privacy.RELATION,
            "mode": self.mode,
            "aborted_releases": list(self.aborted_releases),
        }
        details.update(self.unaccounted_details())
        return details

    def configure_train(
        self, server_round: int, arrays: ArrayRecord, config: ConfigRecord, grid: Grid
    ) -> Iterable[Message]:
        reference = to_numpy(arrays)
        encoder = self.encoder_for(int(sum(v.size for v in reference.values())))
        extended = ConfigRecord(dict(config))
        extended["server-round"] = server_round
        extended.update(
            {
                PREFIX + "dim": encoder.dim,
                PREFIX + "clip": encoder.clip,
                PREFIX + "gamma": encoder.gamma,
                PREFIX + "noise-std": encoder.noise_std,
                PREFIX + "beta": encoder.beta,
                PREFIX + "max-tries": encoder.max_tries,
                PREFIX + "rotation-seed": self.rotation_seed(server_round),
                PREFIX + "mode": self.mode,
            }
        )
        self.secure.instruct(server_round, extended, grid)  # a session id, a committee check
        self._global = (arrayrecord_key(self.strategy), arrays)
        self._grid = grid
        messages = list(self.strategy.configure_train(server_round, arrays, extended, grid))
        self._asked = {int(m.metadata.dst_node_id) for m in messages}
        self.secure.address(server_round, messages)  # committee mode: keys, channel ids
        return messages

    def protocol_dropouts(self, server_round: int, ids: list[int]) -> dict[Stage, set[int]]:
        """The clients that stop answering inside SecAgg+ this round, by stage."""
        return self.secure_plan.dropouts(server_round, ids)

    def secagg_config(self, server_round: int, count: int, length: int) -> SecAggConfig:
        """The SecAgg+ parameters for ``count`` clients: degree ``secagg_degree`` (None: the
        complete graph), threshold a majority of the neighbours."""
        return self.secure_plan.config(server_round, count, length)

    @property
    def secure_plan(self) -> SecAggPlan:
        """SecAgg+'s public parameters (full mode runs them; plaintext mode simulates them)."""
        return SecAggPlan(
            self.seed, self.secagg_degree, self.ring_bits, self.protocol_dropout, self.prg
        )

    def sum_in_clear(self, server_round: int, inputs: dict[int, np.ndarray]) -> np.ndarray:
        """sum_i inputs[i] mod p over the clients that contribute, in plaintext mode (the only
        one in which the server holds the encodings): the outcome SecAgg+ reaches on the
        complete graph under the round's protocol dropouts; sets ``last_survivors``. Raises
        :class:`protocols.kit.TooManyDropoutsError` when the round cannot complete."""
        if not isinstance(self.secure, secure.PlaintextSum):
            raise ValueError(
                f"in {self.mode} mode the server never holds the inputs; see aggregate_train"
            )
        total, self.last_survivors = self.secure.sum_in_clear(server_round, inputs)
        return total

    def _first_replies(self, replies: Iterable[Message]) -> tuple[dict, dict, list]:
        """The train replies checked (:func:`strategies.secure.replies.first_replies`): (node
        -> public keys, sealed input or encoding, rejected node -> reason, the metric records
        clients sent in the clear)."""
        checked = first_replies(
            replies,
            self.secure,
            asked=self._asked,
            grid=self._grid,
            mechanism=self,
            length=self.encoder.padded_dim,
        )
        self.last_key_refusals = checked.key_refusals
        return checked.accepted, checked.rejected, checked.clear

    def aggregate_train(
        self, server_round: int, replies: Iterable[Message]
    ) -> tuple[ArrayRecord | None, MetricRecord | None]:
        if self._global is None or self.encoder is None:
            raise RuntimeError("aggregate_train called before configure_train")
        payloads, rejected, clear = self._first_replies(replies)
        before = self.epsilon()
        if clear:
            what = f"train metrics of {len(clear)} clients in the clear"
            self.unaccounted_release(server_round, what)
        release = self.secure.finish(server_round, payloads, self.encoder.padded_dim)
        refusals = self._key_refusals(server_round, release)
        rejected.update(release.rejected)
        for node, reason in sorted(rejected.items()):
            log.warning("round %d: DDGauss rejected node %d: %s", server_round, node, reason)
        for node, reason in sorted(release.refused.items()):
            log.info("round %d: node %d refused a SecAgg+ stage: %s", server_round, node, reason)
        self.last_rejected, self.last_stage = rejected, release.stage
        metrics = MetricRecord(
            {
                "ddgauss-planned": self.expected_clients,
                "rejected": sorted(rejected),
                "ddgauss-rejected": len(rejected),
                "ddgauss-refused": len(release.refused),
                "ddgauss-key-refusals": len(refusals),
            }
        )
        self.last_opened = release.opened
        if release.total is None:  # no model update; accounted if the server holds the sum
            return None, self._aborted(server_round, release, metrics, before)
        self.last_sum, self.last_survivors = release.total, release.contributors
        self.last_abort = None
        arrays, aggregated = self._apply(server_round, release, clear)
        aggregated.update(dict(metrics))
        aggregated.update({"ddgauss-" + name: n for name, n in release.counts.items()})
        aggregated["ddgauss-survivors"] = len(release.contributors)
        aggregated["ddgauss-aborted"] = 0
        aggregated["ddgauss-gamma"] = self.encoder.gamma
        return arrays, self._with_epsilon(aggregated, before)

    def _key_refusals(self, server_round: int, release: Release) -> dict[int, str]:
        """The clients that refused keys the server relayed (named, never a silent dropout);
        an aborted release says so in ``aborted``."""
        refusals = dict(self.last_key_refusals)
        refusals.update(
            {n: r for n, r in release.refused.items() if KeySubstitution.__name__ in r}
        )
        if refusals:
            node, reason = sorted(refusals.items())[0]
            log.warning(
                "round %d: %d clients refused keys relayed by the server (node %d: %s)",
                server_round, len(refusals), node, reason,
            )
            if release.total is None:
                release.aborted = (
                    f"{release.aborted}; {len(refusals)} clients refused relayed keys "
                    f"(node {node}: {reason})"
                )
        return refusals

    def _aborted(
        self, server_round: int, release: Release, metrics: MetricRecord, before: float
    ) -> MetricRecord:
        """An aborted round's metrics; opened is released: accounted for the noise of the
        clients in the sum the server could determine, if any (``aborted_releases``)."""
        self.last_survivors, self.last_sum, self.last_abort = (), None, release.aborted
        metrics["ddgauss-survivors"] = len(release.opened)
        metrics["ddgauss-aborted"] = 1
        if not release.accounted:
            return self._with_epsilon(metrics, before)
        self._record(server_round, len(release.accounted))  # opened is released
        metrics["ddgauss-opened"] = 1
        metrics = self._with_epsilon(metrics, before)
        self.aborted_releases.append(
            {
                "round": server_round,
                "clients": len(release.accounted),
                "epsilon_cost": metrics["ddgauss-epsilon-cost"],
            }
        )
        return metrics

    def _with_epsilon(self, metrics: MetricRecord, before: float) -> MetricRecord:
        """``metrics`` with epsilon so far and what this round cost (``ddgauss-epsilon-cost``:
        the increase, infinite once epsilon is)."""
        now = self.epsilon()
        metrics["epsilon"] = now
        metrics["ddgauss-epsilon-cost"] = now - before if math.isfinite(before) else math.inf
        return metrics

    def _record(self, server_round: int, count: int) -> None:
        """Account one release of a sum holding the noise of ``count`` clients (KLS21)."""
        encoder = self.encoder
        event = ddgauss_privacy.round_event(
            encoder.l2_bound,
            encoder.l1_bound,
            encoder.scaled_noise_std,
            count,
            encoder.padded_dim,
        )
        self.ledger.record(server_round, event)

    def _apply(
        self, server_round: int, release: Release, clear: list[MetricRecord]
    ) -> tuple[ArrayRecord | None, MetricRecord]:
        """Account the release (survivors' noise only) and hand the mean update to the
        wrapped strategy; client metrics sent in the clear are averaged and marked."""
        encoder = self.encoder
        key, global_record = self._global
        self._record(server_round, len(release.contributors))
        reference = to_numpy(global_record)
        mean_update = encoder.decode(release.total, self.rotation_seed(server_round))
        mean_update /= self.expected_clients
        updates = unflatten(mean_update, reference)
        new = {k: (v.astype(np.float64) + updates[k]).astype(v.dtype) for k, v in reference.items()}
        client_metrics = MetricRecord({"num-examples": 1})
        loss = clear_train_loss(clear, default_weight=1)
        if loss is not None:
            client_metrics["train_loss"] = loss
        content = RecordDict({key: to_record(new), "metrics": client_metrics})
        arrays, aggregated = self.strategy.aggregate_train(
            server_round, [server_reply(content, server_round)]
        )
        aggregated = aggregated if aggregated is not None else MetricRecord()
        if clear:
            aggregated["metrics_in_clear"] = 1
            aggregated["ddgauss-clipped"] = sum(int(m.get("ddgauss.clipped", 0)) for m in clear)
        return arrays, aggregated

