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
  (:mod:`strategies.secagg_messages`), and the server holds only public keys, sealed share rows
  it relays, masked inputs and its own protocol state. It learns the modular sum of the
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
(:mod:`strategies.answered_rounds`): a round number sent again, with any model, is refused
before anything is drawn for it.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any, Literal

import dp_accounting as dpa
import numpy as np
from flwr.app import ArrayRecord, ConfigRecord, Context, Message, MetricRecord, RecordDict
from flwr.clientapp import ClientApp
from flwr.serverapp import Grid
from flwr.serverapp.strategy import Strategy

from fedsim.config import from_mapping, require
from fedsim.engine.committee import Committee, CommitteeSpec
from fedsim.privacy import ddgauss as ddgauss_privacy
from fedsim.privacy.ledger import PrivacyLedger
from fedsim.privacy.mechanisms import SecureRandom, discrete_gaussian
from fedsim.privacy.sampling import NeighbouringRelation
from fedsim.randomness import PartySecret, Purpose, Stream, client_secret, public_generator
from fedsim.record_codec import to_numpy, to_record
from protocols.channels import KeySubstitution
from protocols.encoding import DEFAULT_BETA, DDGaussEncoder, EncodedUpdate, choose_gamma
from protocols.secagg.common import SecAggConfig, Stage
from strategies import secure
from strategies.answered_rounds import claim_round
from strategies.dp_shell import LedgerShell
from strategies.secagg_messages import register_client_stages
from strategies.secure import Release, SecAggPlan, SecureSum
from strategies.secure.committee import COMMITTEE_OPTIONS, sealed_key, spec_from_options
from strategies.secure.plaintext import encoded_key
from strategies.secure.replies import clear_train_loss, first_replies
from strategies.spec import Accounting, RunFacts, StrategySpec
from strategies.vectors import trained_update, unflatten
from strategies.wrapper import arrayrecord_key, fraction_evaluate, server_reply

log = logging.getLogger(__name__)

PREFIX = "ddgauss."
ENCODED_KEY = encoded_key(PREFIX)
SEALED_KEY = sealed_key(PREFIX)
"""Committee mode's reply: ConfigRecord of the client's ``public-key`` and its envelopes."""
COMMITTEE_PREFIX = PREFIX + "committee."
#: DDGauss's ``mode`` -> the secure sum it runs (:mod:`strategies.secure`)
SECURE_SUMS = {"full": "secagg", "plaintext": "plaintext", "committee": "committee"}
MODES = tuple(SECURE_SUMS)
_KEYS = ("dim", "clip", "gamma", "noise-std", "beta", "max-tries", "rotation-seed", "mode")
_EVALUATION = (
    "{} with DDGauss: federated evaluation sends each evaluating client's un-noised loss and "
    "accuracy to the server; set fraction_evaluate = 0 ([evaluation] clients = 0), or pass "
    "metrics_in_clear=True ([privacy] metrics_in_clear = true), which makes epsilon infinite"
)
_RENAMED = (
    "mode='ideal' is now mode='plaintext': the clients' encodings reach the server in the "
    "clear (only the sum's arithmetic matches full mode); use 'full' for SecAgg+"
)


def encoder_from_config(config: ConfigRecord) -> DDGaussEncoder:
    """The encoder a train instruction describes (keys ``ddgauss.*``)."""
    missing = [PREFIX + k for k in _KEYS if PREFIX + k not in config]
    if "server-round" not in config:
        missing.append("server-round")
    if missing:
        raise ValueError(f"the instruction's config lacks {missing}; is the server DDGauss?")
    return DDGaussEncoder(
        dim=int(config[PREFIX + "dim"]),
        clip=float(config[PREFIX + "clip"]),
        gamma=float(config[PREFIX + "gamma"]),
        noise_std=float(config[PREFIX + "noise-std"]),
        beta=float(config[PREFIX + "beta"]),
        max_tries=int(config[PREFIX + "max-tries"]),
    )


def _instruction_parts(message: Message) -> tuple[str, ArrayRecord, ConfigRecord]:
    arrays = [(k, v) for k, v in message.content.items() if isinstance(v, ArrayRecord)]
    configs = [v for v in message.content.values() if isinstance(v, ConfigRecord)]
    if len(arrays) != 1 or not configs:
        raise ValueError("a DDGauss instruction needs one ArrayRecord and a ConfigRecord")
    return arrays[0][0], arrays[0][1], configs[0]


def _encode(
    encoder: DDGaussEncoder,
    update: np.ndarray,
    config: ConfigRecord,
    secret: PartySecret,
    server_round: int,
    secure_noise: bool,
) -> EncodedUpdate:
    """The client's encoding: rounding and noise from its own secret's round streams (the
    noise from the OS with ``secure_noise``)."""
    rng = secret.generator(server_round, Purpose.ROUNDING, PREFIX)
    noise_rng = secret.generator(server_round, Purpose.NOISE, PREFIX)
    if secure_noise:
        noise_rng = SecureRandom()
    return encoder.encode(
        update,
        int(config[PREFIX + "rotation-seed"]),
        rng,
        noise_rng=noise_rng,
        sampler=discrete_gaussian,
    )


def ddgauss_client_app(
    inner: ClientApp, metrics_in_clear: bool = False, secure_noise: bool = False
) -> ClientApp:
    """A ClientApp that runs ``inner`` and answers DDGauss's train instructions.

    In full mode its train reply holds only the client's two SecAgg+ public keys, and the app
    answers the SecAgg+ stage messages (``query.secagg_*``) with its state kept in
    ``context.state``; in committee mode it holds only the client's channel public key and one
    sealed share row per committee member (``ddgauss.sealed``); in plaintext mode it carries
    ``ddgauss.encoded`` (D field elements). Rounding, noise, share randomness and keys come
    from the client's own secret, or the noise from the OS (``secure_noise``).
    ``metrics_in_clear``: also reply the inner metrics plus ``ddgauss.tries`` and
    ``ddgauss.clipped`` un-noised, and answer federated evaluation (``inner``'s evaluate, un-noised
    too); without it a train reply carries nothing data-dependent but the (masked, sealed or, in
    plaintext mode, clear) encoding and an evaluate message is refused. A round already answered
    (or an earlier one) is refused before anything is drawn (:func:`claim_round`).
    """
    app = ClientApp()

    @app.train()
    def train(message: Message, context: Context) -> Message:
        _, global_record, config = _instruction_parts(message)
        encoder = encoder_from_config(config)
        mode = config[PREFIX + "mode"]
        if mode not in MODES:
            raise ValueError(f"ddgauss.mode={mode!r}; allowed: {MODES}")
        server_round = int(config["server-round"])
        claim_round(context.state, NAME, server_round)  # never the same streams twice
        local = trained_update(inner, message, context, global_record)
        if isinstance(local, Message):
            return local
        update, metrics = local
        secret = client_secret(context.node_config)
        encoded = _encode(encoder, update, config, secret, server_round, secure_noise)
        contribute = secure.CONTRIBUTE[SECURE_SUMS[mode]]
        content = contribute(context, secret, config, encoded.elements, server_round, PREFIX)
        if metrics_in_clear:
            out_metrics = MetricRecord(dict(metrics))
            out_metrics["ddgauss.tries"] = encoded.tries
            out_metrics["ddgauss.clipped"] = int(encoded.clipped)
            content["metrics"] = out_metrics
        return Message(content=content, reply_to=message)

    register_client_stages(app)

    @app.evaluate()
    def evaluate(message: Message, context: Context) -> Message:
        if not metrics_in_clear:
            raise RuntimeError(
                "a DDGauss client answers no federated evaluation: it would send its un-noised "
                "loss and accuracy to the server (build the client app with "
                "metrics_in_clear=True to allow it; epsilon is then infinite)"
            )
        return inner(message, context)

    return app


def _check_options(
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
) -> None:
    """A ConfigError (a ValueError) naming ``<where><key>`` on a :class:`DDGauss` option out
    of its range (``where``: ``"strategy.options."`` for a config's, ``""`` for arguments)."""
    require(mode != "ideal", f"{where}mode", mode, _RENAMED)
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


def _check_arguments(
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
    fraction = fraction_evaluate(strategy)
    if not metrics_in_clear and isinstance(fraction, int | float) and fraction > 0:
        raise ValueError(_EVALUATION.format(f"strategy.fraction_evaluate={fraction!r}"))


#: the committee's keys, only with ``mode = "committee"``
_COMMITTEE_ONLY = (*COMMITTEE_OPTIONS, "member_dropout")


@dataclass(frozen=True)
class DDGaussOptions:
    """``strategy.options`` of "ddgauss" (see :func:`from_options`); the committee's keys
    (None: unset, :class:`~fedsim.engine.committee.CommitteeSpec`'s defaults) only in
    committee mode."""

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
    committee_size: int | None = None
    threshold: int | None = None
    packing: int | None = None
    detect: int | None = None
    committee_shards: int | None = None
    committee_actors: bool | None = None
    member_dropout: float | None = None

    def __post_init__(self) -> None:
        require(self.mode != "ideal", f"{_WHERE}.mode", self.mode, _RENAMED)
        given = [k for k in _COMMITTEE_ONLY if getattr(self, k) is not None]
        require(
            self.mode == "committee" or not given,
            f"{_WHERE}.{given[0] if given else 'mode'}",
            getattr(self, given[0]) if given else self.mode,
            "only with mode = 'committee'",
        )
        self.committee()
        _check_options(
            f"{_WHERE}.",
            **{k: getattr(self, k) for k in _CHECKED},
            member_dropout=self.dropout,
        )

    @property
    def dropout(self) -> float:
        """Each committee member's drop probability per stage (unset: 0)."""
        return 0.0 if self.member_dropout is None else self.member_dropout

    def committee(self) -> CommitteeSpec | None:
        """The committee these options describe (None unless ``mode = "committee"``)."""
        if self.mode != "committee":
            return None
        return spec_from_options(
            {k: getattr(self, k) for k in COMMITTEE_OPTIONS if getattr(self, k) is not None}
        )


_WHERE = "strategy.options"
_CHECKED = (
    "clipping_norm",
    "noise_multiplier",
    "mode",
    "secagg_degree",
    "ring_bits",
    "bits",
    "protocol_dropout",
    "stage_timeout",
)


class DDGauss(LedgerShell):
    """Wrap a FedAvg-family strategy with DDGauss over SecAgg+ and a privacy ledger.

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
        metrics_in_clear: allow federated evaluation (``strategy``'s evaluate phase), which
            gives the server each evaluating client's un-noised metrics: epsilon becomes
            infinite once any arrive. Without it a ``strategy`` whose ``fraction_evaluate`` is
            > 0, or that sends evaluate messages, is refused.
    """

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
        member_dropout: float = 0.0,
        metrics_in_clear: bool = False,
    ) -> None:
        _check_options(
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
        )
        _check_arguments(expected_clients, mode, committee, strategy, metrics_in_clear)
        super().__init__(strategy)
        self.metrics_in_clear = bool(metrics_in_clear)
        self.ring_bits = ring_bits
        self.protocol_dropout = float(protocol_dropout)
        self.member_dropout = float(member_dropout)
        #: the round's secure sum, chosen by ``mode`` (:data:`SECURE_SUMS`)
        self.secure: SecureSum = secure.build(
            SECURE_SUMS[mode],
            prefix=PREFIX,
            plan=SecAggPlan(int(seed), secagg_degree, ring_bits, float(protocol_dropout)),
            stage_timeout=stage_timeout,
            committee=committee,
            member_dropout=float(member_dropout),
        )
        self.clipping_norm = float(clipping_norm)
        self.noise_multiplier = float(noise_multiplier)
        self.expected_clients = expected_clients
        self.seed = int(seed)
        self.mode = mode
        self.bits = bits
        self.beta = beta
        self.max_tries = max_tries
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
        if self.unaccounted:
            details["unaccounted"] = {
                "releases": len(self.unaccounted),
                "first": self.unaccounted[0],
            }
        return details

    def configure_evaluate(
        self, server_round: int, arrays: ArrayRecord, config: ConfigRecord, grid: Grid
    ) -> Iterable[Message]:
        messages = list(self.strategy.configure_evaluate(server_round, arrays, config, grid))
        if messages and not self.metrics_in_clear:
            raise RuntimeError(_EVALUATION.format(f"{len(messages)} evaluate messages"))
        return messages

    def aggregate_evaluate(
        self, server_round: int, replies: Iterable[Message]
    ) -> MetricRecord | None:
        replies = list(replies)
        answered = sum(not reply.has_error() for reply in replies)
        if answered:
            self._unaccounted(server_round, f"evaluation metrics of {answered} clients")
        return self.strategy.aggregate_evaluate(server_round, replies)

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
        return SecAggPlan(self.seed, self.secagg_degree, self.ring_bits, self.protocol_dropout)

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
            self._unaccounted(server_round, f"train metrics of {len(clear)} clients in the clear")
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

    def _unaccounted(self, server_round: int, what: str) -> None:
        """Client content reached the server outside the secure sum: epsilon is infinite."""
        self.ledger.record(server_round, dpa.NonPrivateDpEvent())
        self.unaccounted.append(f"round {server_round}: {what}")
        log.warning("round %d: DDGauss received %s: epsilon is now infinite", server_round, what)

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


def from_options(
    options: DDGaussOptions | Mapping[str, Any],
    *,
    expected_clients: float,
    seed: int,
    evaluate_fraction: float = 0.0,
    metrics_in_clear: bool = False,
) -> DDGauss:
    """ "ddgauss" from a config's ``strategy.options`` (a mapping is read as
    :class:`DDGaussOptions`): ``clipping_norm`` and ``noise_multiplier`` (required),
    ``mode`` ("full", "plaintext" or "committee"), the other keyword arguments of
    :class:`DDGauss` and, in committee mode, the committee's ``committee_size`` (required),
    ``threshold`` (required), ``packing`` (1), ``detect`` (1), ``committee_shards`` (1) and
    ``committee_actors`` (false; true hosts the members on Ray actors): a
    :class:`~fedsim.engine.committee.CommitteeSpec` the front end builds.
    ``evaluate_fraction`` > 0 (federated evaluation) needs ``metrics_in_clear``."""
    from flwr.serverapp.strategy import FedAvg  # noqa: PLC0415

    if not isinstance(options, DDGaussOptions):
        options = from_mapping(DDGaussOptions, options, _WHERE)
    inner = FedAvg(
        fraction_train=1.0,
        fraction_evaluate=evaluate_fraction,
        min_train_nodes=0,
        min_evaluate_nodes=0,
        min_available_nodes=0,
    )
    return DDGauss(
        inner,
        clipping_norm=options.clipping_norm,
        noise_multiplier=options.noise_multiplier,
        expected_clients=max(2, round(expected_clients)),
        seed=seed,
        mode=options.mode,
        bits=options.bits,
        beta=options.beta,
        max_tries=options.max_tries,
        delta=options.delta,
        secagg_degree=options.secagg_degree,
        ring_bits=options.ring_bits,
        protocol_dropout=options.protocol_dropout,
        committee=options.committee(),
        stage_timeout=options.stage_timeout,
        member_dropout=options.dropout,
        metrics_in_clear=metrics_in_clear,
    )


NAME = "ddgauss"


def _always(options: Mapping[str, Any]) -> bool:
    """DDGauss's clients reply only their encoding, in every mode."""
    return True


def _build(options: DDGaussOptions, facts: RunFacts) -> DDGauss:
    """:func:`from_options` with the run's facts."""
    return from_options(
        options,
        expected_clients=facts.expected_clients,
        seed=facts.seed,
        evaluate_fraction=facts.evaluate_fraction,
        metrics_in_clear=facts.metrics_in_clear,
    )


SPEC = StrategySpec(
    name=NAME,
    options=DDGaussOptions,
    build=_build,
    accounting=Accounting(
        ledger="per round whose sum the server can determine (released, or aborted after it "
        "was opened), the distributed discrete Gaussian's zCDP bound (KLS21 Thm. 1) for the "
        "noise of the clients in that sum; zero-out neighbours; any per-client metric the "
        "server receives is unaccounted (epsilon infinite)",
    ),
    client_app=ddgauss_client_app,
    secure_replies=_always,
)
