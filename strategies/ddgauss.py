"""The distributed discrete Gaussian mechanism (DDGauss) over secure aggregation.

Kairouz, Liu & Steinke, ICML 2021 (KLS21). Each sampled client trains, clips its model update
to L2 <= c, rotates, scales by 1/gamma, rounds conditionally and adds its own discrete Gaussian
noise N_Z(0, (sigma/gamma)^2), then sends field elements (:mod:`protocols.encoding`, done by
:func:`ddgauss_client_app` around any training ClientApp). The server learns only the modular
sum of the survivors' encodings:

* ``mode="full"``: the sum is computed by SecAgg+ (:func:`protocols.secagg.run_secagg`, real
  X25519 / HKDF / ChaCha20 keys and masks, Shamir-shared seeds, dropout recovery) run by the
  driver over the clients' state machines;
* ``mode="committee"``: the clients' encodings are packed-Shamir shared to a committee
  (:class:`fedsim.engine.committee.Committee`, members simulated by Ray actors or in process,
  shares over authenticated encrypted channels), which sums them and releases only the sum;
* ``mode="ideal"``: the same sum mod p without the cryptography. All give the same integers.

The server decodes the sum (signed, times gamma, inverse rotation), divides by the planned
cohort size ``expected_clients`` and hands ``g + mean update`` to the wrapped Flower strategy
(FedAvg, FedAvgM, FedAdam, ...) as a single reply.

Calibration: the central noise standard deviation is ``noise_multiplier * c`` when all
``expected_clients`` = n contribute, so each client adds sigma = noise_multiplier * c / sqrt(n);
gamma is the finest granularity for which the sum of n encodings fits ``bits`` signed bits
(:func:`protocols.encoding.choose_gamma`).

Accounting (:mod:`fedsim.privacy.ddgauss`): every released round records KLS21 Theorem 1's
bound as ``GaussianDpEvent(1/eps)`` in a :class:`~fedsim.privacy.accounting.PrivacyLedger`
(add/remove, no amplification by sampling claimed), with sensitivities Delta_2, Delta_1 of the
rounded vector and **the number of clients whose noise is in the sum** (the survivors, never
the planned n). A round with dropouts therefore costs more privacy than a full one.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import Any, Literal

import numpy as np
from flwr.app import ArrayRecord, ConfigRecord, Context, Message, MetricRecord, RecordDict
from flwr.clientapp import ClientApp
from flwr.serverapp import Grid
from flwr.serverapp.strategy import Strategy

from fedsim.engine.committee import Committee, TamperingDetected
from fedsim.engine.reduce import partial_reply, single
from fedsim.privacy import ddgauss as ddgauss_privacy
from fedsim.privacy.accounting import NeighbouringRelation, PrivacyLedger
from fedsim.privacy.mechanisms import SecureRandom
from fedsim.records import to_numpy, to_record
from protocols.encoding import DEFAULT_BETA, DDGaussEncoder, choose_gamma
from protocols.field import DEFAULT_FIELD
from protocols.secagg import SecAggConfig, Stage, TooManyDropoutsError, run_secagg
from strategies.wrapper import StrategyWrapper, server_reply

ENCODED_KEY = "ddgauss.encoded"
PREFIX = "ddgauss."
_KEYS = ("dim", "clip", "gamma", "noise-std", "beta", "max-tries", "rotation-seed", "seed")


def flatten(arrays: dict[str, np.ndarray]) -> np.ndarray:
    """The arrays' entries, in record order, as one float64 vector."""
    return np.concatenate([np.asarray(v, dtype=np.float64).ravel() for v in arrays.values()])


def unflatten(vector: np.ndarray, like: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    out, start = {}, 0
    for key, value in like.items():
        out[key] = vector[start : start + value.size].reshape(value.shape)
        start += value.size
    return out


def encoder_from_config(config: ConfigRecord) -> DDGaussEncoder:
    """The encoder a train instruction describes (keys ``ddgauss.*``)."""
    missing = [PREFIX + k for k in _KEYS if PREFIX + k not in config]
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


def local_update(
    inner: ClientApp,
    message: Message,
    context: Context,
    global_record: ArrayRecord,
    config: ConfigRecord,
    prefix: str,
) -> Message | tuple[np.ndarray, MetricRecord, np.random.Generator]:
    """Train with ``inner``: its error reply, or the flattened update (trained minus
    global), its metrics and the client's generator of the round, seeded by
    ``([config[prefix + "seed"], server_round, partition_id])``."""
    reply = inner(message, context)
    if reply.has_error():
        return reply
    _, trained = single(reply.content, ArrayRecord)
    _, metrics = single(reply.content, MetricRecord)
    update = flatten(to_numpy(trained)) - flatten(to_numpy(global_record))
    partition = int(context.node_config.get("partition-id", 0))
    server_round = int(config.get("server-round", 0))
    rng = np.random.default_rng([int(config[prefix + "seed"]), server_round, partition])
    return update, metrics, rng


def ddgauss_client_app(inner: ClientApp, secure_noise: bool = False) -> ClientApp:
    """A ClientApp that runs ``inner`` and replies with its DDGauss-encoded model update.

    Train replies carry ``ddgauss.encoded`` (int64 field elements of length D) and the inner
    reply's metrics plus ``ddgauss.tries`` and ``ddgauss.clipped``. Rounding and noise draw from
    ``SeedSequence([seed, server_round, partition_id])`` (simulation), or the noise from the OS
    (``secure_noise``). Evaluate messages go to ``inner`` unchanged.
    """
    app = ClientApp()

    @app.train()
    def train(message: Message, context: Context) -> Message:
        key, global_record, config = _instruction_parts(message)
        encoder = encoder_from_config(config)
        local = local_update(inner, message, context, global_record, config, PREFIX)
        if isinstance(local, Message):
            return local
        update, metrics, rng = local
        encoded = encoder.encode(
            update,
            int(config[PREFIX + "rotation-seed"]),
            rng,
            noise_rng=SecureRandom() if secure_noise else None,
        )
        out_metrics = MetricRecord(dict(metrics))
        out_metrics["ddgauss.tries"] = encoded.tries
        out_metrics["ddgauss.clipped"] = int(encoded.clipped)
        content = RecordDict(
            {ENCODED_KEY: to_record({ENCODED_KEY: encoded.elements}), "metrics": out_metrics}
        )
        return Message(content=content, reply_to=message)

    @app.evaluate()
    def evaluate(message: Message, context: Context) -> Message:
        return inner(message, context)

    return app


class DDGauss(StrategyWrapper):
    """Wrap a FedAvg-family strategy with DDGauss over SecAgg+ and a privacy ledger.

    Args:
        strategy: samples clients and applies the mean update (FedAvg, FedAdam, ...).
        clipping_norm: c, the L2 bound of each client's update.
        noise_multiplier: central noise std / c when all ``expected_clients`` contribute.
        expected_clients: n, the planned clients per round (noise is split among them).
        seed: root of the round's rotation seed and of the clients' rounding/noise streams.
        mode: "full" (SecAgg+ with real cryptography), "committee" (sum by ``committee``) or
            "ideal" (sum mod p only).
        committee: the :class:`~fedsim.engine.committee.Committee` of ``mode="committee"``.
        bits: signed bits the modular sum of n encodings must fit (gamma is chosen from it).
        beta: conditional rounding parameter; max_tries: cap on rounding redraws.
        delta: the run's delta; secagg_degree: neighbours per client in SecAgg+ (None: all).
        ring_bits: in full mode, mask and sum in Z_{2^ring_bits} (>= ``bits``, so the sum cannot
            wrap) instead of F_p: half the bytes at 32 bits; None keeps the field.
        protocol_dropout: probability that a client whose encoding arrived stops answering
            inside SecAgg+, at a stage drawn uniformly from its four stages (seeded by
            ``seed`` and the round). Clients lost before MASKED_INPUT contribute no noise.
            ``ideal`` mode reproduces full mode's outcome exactly on the complete graph
            (``secagg_degree=None``).
    """

    def __init__(
        self,
        strategy: Strategy,
        *,
        clipping_norm: float,
        noise_multiplier: float,
        expected_clients: int,
        seed: int,
        mode: Literal["full", "committee", "ideal"] = "full",
        bits: int = 20,
        beta: float = DEFAULT_BETA,
        max_tries: int = 100,
        delta: float = 1e-5,
        secagg_degree: int | None = None,
        ring_bits: int | None = None,
        protocol_dropout: float = 0.0,
        committee: Committee | None = None,
    ) -> None:
        if not (math.isfinite(clipping_norm) and clipping_norm > 0):
            raise ValueError(f"clipping_norm={clipping_norm!r}; it must be finite and > 0")
        if not (math.isfinite(noise_multiplier) and noise_multiplier > 0):
            raise ValueError(f"noise_multiplier={noise_multiplier!r}; it must be finite and > 0")
        if not isinstance(expected_clients, int) or expected_clients < 2:
            raise ValueError(f"expected_clients={expected_clients!r}; it must be an integer >= 2")
        if mode not in ("full", "committee", "ideal"):
            raise ValueError(f"mode={mode!r}; allowed: 'full', 'committee', 'ideal'")
        if (mode == "committee") != (committee is not None):
            raise ValueError(
                f"committee={committee!r} with mode={mode!r}: pass a Committee exactly when "
                "mode='committee'"
            )
        if secagg_degree is not None and (secagg_degree < 2 or secagg_degree % 2):
            raise ValueError(f"secagg_degree={secagg_degree!r}; it must be an even integer >= 2")
        if ring_bits is not None and not (isinstance(ring_bits, int) and bits <= ring_bits <= 64):
            raise ValueError(
                f"ring_bits={ring_bits!r}; it must be an integer in [bits={bits}, 64] so that the "
                "planned sum cannot wrap"
            )
        if not 0.0 <= protocol_dropout <= 1.0:
            raise ValueError(f"protocol_dropout={protocol_dropout!r}; allowed: a probability")
        super().__init__(strategy)
        self.ring_bits = ring_bits
        self.protocol_dropout = float(protocol_dropout)
        self.committee = committee
        self.clipping_norm = float(clipping_norm)
        self.noise_multiplier = float(noise_multiplier)
        self.expected_clients = expected_clients
        self.seed = int(seed)
        self.mode = mode
        self.bits = bits
        self.beta = beta
        self.max_tries = max_tries
        self.secagg_degree = secagg_degree
        self.ledger = PrivacyLedger(NeighbouringRelation.ADD_REMOVE, delta)
        self.encoder: DDGaussEncoder | None = None
        self.last_sum: np.ndarray | None = None
        self.last_survivors: tuple[int, ...] = ()
        self.last_abort: str | None = None
        self._global: tuple[str, ArrayRecord] | None = None

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
        return int(np.random.SeedSequence([self.seed, server_round, 1]).generate_state(1)[0])

    def epsilon(self) -> float:
        return self.ledger.epsilon() if len(self.ledger) else 0.0

    def privacy_report(self) -> dict[str, Any]:
        return {
            "epsilon": self.epsilon(),
            "delta": self.ledger.delta,
            "accountant": "rdp",
            "relation": self.ledger.relation.value,
            "rounds_accounted": len(self.ledger),
            "bound": "KLS21 Theorem 1 (zCDP), noise of surviving clients only",
        }

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
                PREFIX + "seed": self.seed,
            }
        )
        self._global = (getattr(self.strategy, "arrayrecord_key", "arrays"), arrays)
        return self.strategy.configure_train(server_round, arrays, extended, grid)

    def protocol_dropouts(self, server_round: int, ids: list[int]) -> dict[Stage, set[int]]:
        """The clients that stop answering inside SecAgg+ this round, by stage."""
        rng = np.random.default_rng([self.seed, server_round, 3])
        lost = rng.random(len(ids)) < self.protocol_dropout
        stage_index = rng.integers(0, 4, size=len(ids))
        stages = (Stage.ADVERTISE_KEYS, Stage.SHARE_KEYS, Stage.MASKED_INPUT, Stage.UNMASK)
        out: dict[Stage, set[int]] = {}
        for client, is_lost, index in zip(ids, lost, stage_index):
            if is_lost:
                out.setdefault(stages[index], set()).add(client)
        return out

    def _secagg_config(self, server_round: int, count: int, length: int) -> SecAggConfig:
        degree = count - 1 if self.secagg_degree is None else min(self.secagg_degree, count - 1)
        if degree != count - 1 and degree % 2:
            degree -= 1
        return SecAggConfig(
            num_clients=count,
            degree=degree,
            threshold=degree // 2 + 1 if degree >= 2 else 2,
            vector_length=length,
            round=server_round,
            ring_bits=self.ring_bits,
        )

    def secure_sum(self, server_round: int, inputs: dict[int, np.ndarray]) -> np.ndarray:
        """sum_i inputs[i] mod p over the clients that contribute, by SecAgg+ (full) or directly
        (ideal); sets ``last_survivors`` to those clients. Raises
        :class:`protocols.secagg.TooManyDropoutsError` when the round cannot complete."""
        ids = sorted(inputs)
        if self.mode == "committee":
            try:
                result = self.committee.run_round(
                    server_round, inputs, np.random.default_rng([self.seed, server_round, 4])
                )
            except TamperingDetected as error:
                raise TooManyDropoutsError(f"round {server_round} withheld: {error}") from error
            self.last_survivors = result.clients
            return result.aggregate
        dropouts = self.protocol_dropouts(server_round, ids)
        config = self._secagg_config(server_round, len(ids), inputs[ids[0]].size)
        if self.mode == "ideal":
            # the outcome SecAgg+ reaches on the complete graph, without running it
            advertised = [i for i in ids if i not in dropouts.get(Stage.ADVERTISE_KEYS, ())]
            before_input = (Stage.ADVERTISE_KEYS, Stage.SHARE_KEYS, Stage.MASKED_INPUT)
            gone = set().union(*(dropouts.get(stage, set()) for stage in before_input))
            contributors = [i for i in ids if i not in gone]
            responders = [i for i in contributors if i not in dropouts.get(Stage.UNMASK, ())]
            if (
                len(advertised) - 1 < config.threshold
                or len(contributors) < config.survivors_needed
                or len(responders) < config.threshold
            ):
                raise TooManyDropoutsError(
                    f"round {server_round}: {len(contributors)} clients contributed and "
                    f"{len(responders)} answered in UNMASK; at least {config.threshold} needed"
                )
            self.last_survivors = tuple(contributors)
            return DEFAULT_FIELD.sum(np.stack([inputs[i] for i in contributors]), axis=0)
        space = config.masking
        if self.ring_bits is not None:  # signed integers travel in Z_{2^b}
            inputs = {
                i: space.encode_signed(DEFAULT_FIELD.decode_signed(v)) for i, v in inputs.items()
            }
        result = run_secagg(
            config, inputs, np.random.default_rng([self.seed, server_round, 2]), dropouts
        )
        self.last_survivors = tuple(result.survivors)
        if self.ring_bits is not None:
            return DEFAULT_FIELD.encode_signed(space.decode_signed(result.aggregate))
        return result.aggregate

    def aggregate_train(
        self, server_round: int, replies: Iterable[Message]
    ) -> tuple[ArrayRecord | None, MetricRecord | None]:
        if self._global is None or self.encoder is None:
            raise RuntimeError("aggregate_train called before configure_train")
        key, global_record = self._global
        reference = to_numpy(global_record)
        encoder = self.encoder
        valid = [r for r in replies if not r.has_error()]
        inputs = {}
        for reply in valid:
            record = reply.content[ENCODED_KEY]
            inputs[int(reply.metadata.src_node_id)] = np.asarray(to_numpy(record)[ENCODED_KEY])
        minimum = 2 if self.mode == "full" else 1
        metrics = MetricRecord({"ddgauss-planned": self.expected_clients})
        if len(inputs) < minimum:  # nothing is released, so nothing is accounted
            self.last_survivors = ()
            metrics["ddgauss-survivors"] = len(inputs)
            metrics["epsilon"] = self.epsilon()
            return None, metrics
        try:
            total = self.secure_sum(server_round, inputs)
        except TooManyDropoutsError as error:  # nothing released, so nothing accounted
            self.last_survivors, self.last_sum = (), None
            metrics["ddgauss-survivors"] = 0
            metrics["ddgauss-aborted"] = 1
            metrics["epsilon"] = self.epsilon()
            self.last_abort = str(error)
            return None, metrics
        self.last_sum = total
        survivors = len(self.last_survivors)
        self.ledger.record(
            server_round,
            ddgauss_privacy.round_event(
                encoder.l2_bound,
                encoder.l1_bound,
                encoder.scaled_noise_std,
                survivors,
                encoder.padded_dim,
            ),
        )
        mean_update = encoder.decode(total, self.rotation_seed(server_round))
        mean_update /= self.expected_clients
        updates = unflatten(mean_update, reference)
        new = {k: (v.astype(np.float64) + updates[k]).astype(v.dtype) for k, v in reference.items()}
        client_metrics = MetricRecord({"num-examples": 1})
        losses = [
            (
                float(r.content["metrics"].get("num-examples", 1)),
                r.content["metrics"].get("train_loss"),
            )
            for r in valid
            if "metrics" in r.content
        ]
        weighted = [(w, loss) for w, loss in losses if isinstance(loss, int | float)]
        if weighted:
            client_metrics["train_loss"] = sum(w * loss for w, loss in weighted) / sum(
                w for w, _ in weighted
            )
        content = RecordDict({key: to_record(new), "metrics": client_metrics})
        reply = partial_reply(valid[0], content) if valid else server_reply(content, server_round)
        arrays, aggregated = self.strategy.aggregate_train(server_round, [reply])
        aggregated = aggregated if aggregated is not None else MetricRecord()
        aggregated.update(dict(metrics))
        aggregated["ddgauss-survivors"] = survivors
        aggregated["ddgauss-gamma"] = encoder.gamma
        aggregated["ddgauss-clipped"] = sum(
            int(r.content["metrics"].get("ddgauss.clipped", 0)) for r in valid
        )
        aggregated["epsilon"] = self.epsilon()
        return arrays, aggregated


#: ``strategy.options`` keys of "ddgauss" (see :func:`from_options`)
OPTIONS = (
    "clipping_norm",
    "noise_multiplier",
    "mode",
    "bits",
    "beta",
    "max_tries",
    "delta",
    "secagg_degree",
    "ring_bits",
    "protocol_dropout",
)


def from_options(
    options: dict[str, Any], *, expected_clients: float, seed: int, evaluate_fraction: float = 0.0
) -> DDGauss:
    """ "ddgauss" from a config's ``strategy.options``: ``clipping_norm`` and
    ``noise_multiplier`` (required), ``mode`` ("full" or "ideal"; "committee" needs
    actors and is for Python use), and the other keyword arguments of :class:`DDGauss`."""
    from flwr.serverapp.strategy import FedAvg  # noqa: PLC0415

    for key in options:
        if key not in OPTIONS:
            raise ValueError(f"strategy.options.{key}={options[key]!r}; allowed: one of {OPTIONS}")
    for key in ("clipping_norm", "noise_multiplier"):
        if key not in options:
            raise ValueError(f"strategy.options.{key} is required (a number)")
    if options.get("mode", "full") not in ("full", "ideal"):
        raise ValueError(
            f"strategy.options.mode={options['mode']!r}; allowed: 'full' or 'ideal' from a config"
        )
    inner = FedAvg(
        fraction_train=1.0,
        fraction_evaluate=evaluate_fraction,
        min_train_nodes=0,
        min_evaluate_nodes=0,
        min_available_nodes=0,
    )
    kwargs = {k: v for k, v in options.items() if k not in ("clipping_norm", "noise_multiplier")}
    return DDGauss(
        inner,
        clipping_norm=float(options["clipping_norm"]),
        noise_multiplier=float(options["noise_multiplier"]),
        expected_clients=max(2, round(expected_clients)),
        seed=seed,
        **kwargs,
    )
