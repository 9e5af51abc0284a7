"""Secure aggregation without DP: any FedAvg-family strategy over a :class:`SecureSum`.

``[strategy] name = "fedavg"`` (or fedprox, fedavgm, fedadam, fedyogi, fedadagrad) with
``[strategy.options] secure_sum = "secagg"`` (SecAgg+, Bell et al., CCS 2020, over the Grid) or
``"committee"`` (the committee host's sum of sealed inputs): the server learns the cohort's
weighted sum and nothing else about one client's update -- against an honest-but-curious
server (:mod:`strategies.secure.secagg`, :mod:`strategies.secure.committee`).

**Encoding** (client side, :func:`secure_client_app`): each client trains, takes its update
u = trained - global and its weight w (``num-examples``), and encodes the vector
``(w * u, w)`` in fixed point into F_p (p = 2^61 - 1): round(x * 2^f) with ``f =
fractional_bits`` (:meth:`protocols.field.MersenneField.encode_fixed`). No noise and no clipping:
an entry with |x| > ``value_bound`` is an error naming the option (the client's round fails,
and the error says nothing of the value), and the server checks that the sum of the planned
cohort's bounds fits the field (``clients * value_bound * 2^f <= (p-1)/2``). The server
decodes the sum, divides by the summed weight and hands ``global + mean update`` to the
wrapped strategy as one reply (its server optimiser applies as usual). The result equals
plain FedAvg's up to the quantisation: each entry of the mean is off by at most
``n * 2^-(f+1) / sum(w)``.

**Privacy**: no DP claim. The report says "secure aggregation without DP" and epsilon is
infinite: the released sum carries no noise, so one client's contribution can be inferred from
it (with the others' help). Clients reply nothing but their masked or sealed input unless
``metrics_in_clear``; federated evaluation is refused without it.
"""

from __future__ import annotations

import dataclasses
import logging
import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any, Literal

import numpy as np
from flwr.app import ArrayRecord, ConfigRecord, Context, Message, MetricRecord, RecordDict
from flwr.clientapp import ClientApp
from flwr.serverapp import Grid
from flwr.serverapp.strategy import Strategy

from fedsim.config import ConfigError, require
from fedsim.engine.committee import Committee, CommitteeSpec
from fedsim.randomness import client_secret
from fedsim.record_codec import to_numpy, to_record
from protocols.field import DEFAULT_FIELD
from strategies import secure
from strategies.plumbing.answered_rounds import claim_round
from strategies.plumbing.vectors import trained_update, unflatten
from strategies.plumbing.wrapper import (
    arrayrecord_key,
    fraction_evaluate,
    server_reply,
    weighted_by_key,
)
from strategies.secure import Release, SecAggPlan, SecureSum
from strategies.secure.clear import ClearMetricsGate, register_evaluate
from strategies.secure.replies import clear_train_loss, first_replies
from strategies.spec import raw_option

log = logging.getLogger(__name__)

PREFIX = "secure."
NAME = "secure-sum"
#: the secure sums a FedAvg-family strategy may take: the registry's
#: (:data:`strategies.secure.WITHOUT_DP`; ``plaintext`` hides nothing)
SECURE_SUMS = secure.WITHOUT_DP
_KEYS = ("sum", "dim", "fractional-bits", "value-bound")
MECHANISM = "secure aggregation without DP"
CLIENT_REFUSAL = (
    "a secure-sum client answers no federated evaluation: it would send its loss and accuracy "
    "to the server in the clear (metrics_in_clear allows it)"
)
_WHERE = "strategy.options"


@dataclass(frozen=True)
class FixedPoint:
    """Reals to F_p: round(x * 2^fractional_bits), |x| <= ``value_bound``."""

    fractional_bits: int = 20
    value_bound: float = 2.0**20

    def __post_init__(self) -> None:
        bits = self.fractional_bits
        if isinstance(bits, bool) or not isinstance(bits, int) or not 0 <= bits <= 40:
            raise ValueError(f"fractional_bits={bits!r}; allowed: an integer in [0, 40]")
        bound = self.value_bound
        if isinstance(bound, bool) or not (isinstance(bound, int | float) and bound > 0):
            raise ValueError(f"value_bound={bound!r}; allowed: a number > 0")
        if not math.isfinite(bound) or bound * 2.0**bits >= DEFAULT_FIELD.max_signed:
            raise ValueError(
                f"value_bound={bound!r} with fractional_bits={bits}: one entry must fit the "
                f"field, value_bound * 2^fractional_bits < 2^{DEFAULT_FIELD.exponent - 1}"
            )

    def check_sum(self, clients: int) -> None:
        """ValueError unless the sum of ``clients`` encodings cannot wrap mod p."""
        worst = clients * self.value_bound * 2.0**self.fractional_bits
        if worst >= DEFAULT_FIELD.max_signed:
            room = DEFAULT_FIELD.max_signed / (clients * 2.0**self.fractional_bits)
            raise ValueError(
                f"value_bound={self.value_bound!r} with fractional_bits={self.fractional_bits} "
                f"and {clients} clients: their sum could wrap mod p; allowed value_bound < "
                f"{room:.6g} (or fewer fractional_bits)"
            )

    def encode(self, vector: np.ndarray) -> np.ndarray:
        """``vector`` in fixed point; ValueError naming the bound (never the value) when an
        entry is beyond it or not finite."""
        if not np.all(np.isfinite(vector)):
            raise ValueError("the weighted update has an entry that is NaN or infinite")
        if vector.size and float(np.max(np.abs(vector))) > self.value_bound:
            raise ValueError(
                f"an entry of the weighted update (num-examples * update) exceeds "
                f"strategy.options.value_bound = {self.value_bound!r}; raise value_bound (or "
                "lower fractional_bits to make room)"
            )
        return DEFAULT_FIELD.encode_fixed(vector, self.fractional_bits)

    def decode(self, total: np.ndarray) -> np.ndarray:
        return DEFAULT_FIELD.decode_fixed(total, self.fractional_bits)

    def error_bound(self, clients: int, weight: float) -> float:
        """The most an entry of the decoded mean can differ from the exact one."""
        return clients * 2.0 ** -(self.fractional_bits + 1) / weight


def _parts(message: Message) -> tuple[ArrayRecord, ConfigRecord]:
    arrays = [v for v in message.content.values() if isinstance(v, ArrayRecord)]
    configs = [v for v in message.content.values() if isinstance(v, ConfigRecord)]
    if len(arrays) != 1 or not configs:
        raise ValueError("a secure-sum instruction needs one ArrayRecord and a ConfigRecord")
    config = configs[0]
    missing = [PREFIX + k for k in _KEYS if PREFIX + k not in config]
    if missing or "server-round" not in config:
        raise ValueError(f"the instruction's config lacks {missing or ['server-round']}")
    return arrays[0], config


def _weight(metrics: MetricRecord, key: str) -> float:
    weight = metrics.get(key)
    if isinstance(weight, bool) or not isinstance(weight, int | float) or not weight > 0:
        raise ValueError(f"the training reply's {key!r} must be a number > 0, not {weight!r}")
    return float(weight)


def secure_client_app(inner: ClientApp, metrics_in_clear: bool = False) -> ClientApp:
    """A ClientApp that runs ``inner`` and answers secure-sum train instructions: its reply
    holds only its masked (``secagg``: two public keys, then SecAgg+'s stages) or sealed
    (``committee``) fixed-point encoding of ``(num-examples * update, num-examples)``, plus
    ``inner``'s metrics only with ``metrics_in_clear`` (which also allows evaluation). Each
    round is answered once (:func:`strategies.plumbing.answered_rounds.claim_round`)."""
    app = ClientApp()

    @app.train()
    def train(message: Message, context: Context) -> Message:
        global_record, config = _parts(message)
        name, server_round = config[PREFIX + "sum"], int(config["server-round"])
        if name not in SECURE_SUMS:
            raise ValueError(f"{PREFIX}sum={name!r}; allowed: {SECURE_SUMS}")
        claim_round(context.state, NAME, server_round)
        local = trained_update(inner, message, context, global_record)
        if isinstance(local, Message):
            return local
        update, metrics = local
        if update.size != int(config[PREFIX + "dim"]):
            raise ValueError(f"the update has {update.size} entries, not {PREFIX}dim")
        weight = _weight(metrics, str(config.get(PREFIX + "weight-key", "num-examples")))
        codec = FixedPoint(
            int(config[PREFIX + "fractional-bits"]), float(config[PREFIX + "value-bound"])
        )
        elements = codec.encode(np.append(weight * update, weight))
        secret = client_secret(context.node_config)
        content = secure.CONTRIBUTE[name](
            context, secret, config, elements, server_round, PREFIX
        )
        if metrics_in_clear:
            content["metrics"] = MetricRecord(dict(metrics))
        return Message(content=content, reply_to=message)

    secure.register_client_stages(app, SECURE_SUMS)

    register_evaluate(app, inner, metrics_in_clear, CLIENT_REFUSAL)
    return app


def _plan(seed: int, degree: int | None, fields: Mapping[str, Any]) -> SecAggPlan:
    """The run's SecAgg+ plan: ``seed``, ``degree`` and the further plan ``fields`` by name."""
    known = {f.name for f in dataclasses.fields(SecAggPlan)} - {"seed", "degree"}
    unknown = sorted(set(fields) - known)
    if unknown:
        raise ValueError(
            f"secagg_plan key {unknown[0]!r}; allowed: {', '.join(sorted(known))}"
        )
    return SecAggPlan(seed, degree, **fields)


class SecureAggregation(ClearMetricsGate):
    """Wrap a FedAvg-family strategy so that the cohort's weighted sum is computed by
    ``secure_sum`` ("secagg" or "committee"); see the module docstring.

    Args:
        strategy: samples clients and applies the mean update (FedAvg, FedAdam, ...).
        secure_sum: "secagg" (SecAgg+ over the Grid) or "committee".
        seed: the run seed (public streams only: the SecAgg+ neighbour graph, member dropouts).
        expected_clients: the planned cohort size (the field's headroom is checked for it).
        codec: the fixed-point encoding (fractional bits, value bound).
        secagg_degree: neighbours per client in SecAgg+ (None: all).
        stage_timeout: seconds each SecAgg+ exchange waits for replies.
        secagg_plan: further :class:`~strategies.secure.secagg_plan.SecAggPlan` fields by name
            (SecAgg+'s other public parameters; None: the plan's defaults).
        committee: for "committee": a Committee or the CommitteeSpec the front end builds.
        member_dropout: for "committee": each member's drop probability per stage.
        metrics_in_clear: clients also send their metrics (and evaluation) in the clear.
    """

    def __init__(
        self,
        strategy: Strategy,
        *,
        secure_sum: str,
        seed: int,
        expected_clients: int,
        codec: FixedPoint | None = None,
        secagg_degree: int | None = None,
        stage_timeout: float | None = 3600.0,
        secagg_plan: Mapping[str, Any] | None = None,
        committee: Committee | CommitteeSpec | None = None,
        member_dropout: float = 0.0,
        metrics_in_clear: bool = False,
    ) -> None:
        if secure_sum not in SECURE_SUMS:
            raise ValueError(f"secure_sum={secure_sum!r}; allowed: {SECURE_SUMS}")
        if secagg_degree is not None and (secagg_degree < 2 or secagg_degree % 2):
            raise ValueError(f"secagg_degree={secagg_degree!r}; it must be an even integer >= 2")
        if not 0.0 <= member_dropout <= 1.0:
            raise ValueError(f"member_dropout={member_dropout!r}; allowed: a probability")
        fraction = fraction_evaluate(strategy)
        if not metrics_in_clear and isinstance(fraction, int | float) and fraction > 0:
            raise ValueError(
                f"strategy.fraction_evaluate={fraction!r} with a secure sum: federated "
                "evaluation sends each client's metrics in the clear; set it to 0 or pass "
                "metrics_in_clear=True"
            )
        super().__init__(strategy)
        self.codec = codec if codec is not None else FixedPoint()
        self.codec.check_sum(max(2, int(expected_clients)))
        self.metrics_in_clear = bool(metrics_in_clear)
        self.secure: SecureSum = secure.build(
            secure_sum,
            prefix=PREFIX,
            plan=_plan(int(seed), secagg_degree, secagg_plan or {}),
            stage_timeout=stage_timeout,
            committee=committee,
            member_dropout=float(member_dropout),
        )
        self.last_release: Release | None = None
        self.opened_rounds: list[int] = []
        self._global: tuple[str, ArrayRecord, int] | None = None
        self._grid: Grid | None = None
        self._asked: set[int] = set()

    def __getstate__(self) -> dict[str, Any]:
        state = dict(self.__dict__)
        state["_grid"] = None
        return state

    # -- the committee, bound by the front end -------------------------------------------
    @property
    def committee(self) -> Committee | None:
        return getattr(self.secure, "committee", None)

    def committee_spec(self) -> CommitteeSpec | None:
        """The committee the front end should build and bind (None for "secagg")."""
        return getattr(self.secure, "spec", None)

    def bind_committee(self, committee: Committee) -> None:
        if not isinstance(self.secure, secure.CommitteeSum):
            raise ValueError(f"bind_committee with secure_sum={self.secure.name!r}")
        self.secure.bind(committee)

    # -- privacy: none claimed -----------------------------------------------------------
    def epsilon(self) -> float:
        """No DP: the sum is released without noise."""
        return math.inf

    def privacy_report(self) -> dict[str, Any]:
        return {
            "epsilon": math.inf,
            "delta": None,
            "mechanism": MECHANISM,
            "secure_sum": self.secure.name,
            "dp": False,
            "note": "the server learns only the cohort's sum, which carries no noise: no "
            "differential privacy is claimed",
            "opened_rounds": list(self.opened_rounds),
        }

    # -- rounds --------------------------------------------------------------------------
    def configure_train(
        self, server_round: int, arrays: ArrayRecord, config: ConfigRecord, grid: Grid
    ) -> Iterable[Message]:
        dim = int(sum(v.size for v in to_numpy(arrays).values()))
        extended = ConfigRecord(dict(config))
        extended["server-round"] = server_round
        extended[PREFIX + "sum"] = self.secure.name
        extended[PREFIX + "dim"] = dim
        extended[PREFIX + "fractional-bits"] = self.codec.fractional_bits
        extended[PREFIX + "value-bound"] = float(self.codec.value_bound)
        extended[PREFIX + "weight-key"] = weighted_by_key(self.strategy)
        if not extended[PREFIX + "weight-key"]:
            extended[PREFIX + "weight-key"] = "num-examples"
        self.secure.instruct(server_round, extended, grid)
        self._global = (arrayrecord_key(self.strategy), arrays, dim)
        self._grid = grid
        messages = list(self.strategy.configure_train(server_round, arrays, extended, grid))
        self._asked = {int(m.metadata.dst_node_id) for m in messages}
        self.secure.address(server_round, messages)
        return messages

    def evaluation_refused(self, what: str) -> str:
        return (
            f"{what} with a secure sum: federated evaluation sends each client's metrics in "
            "the clear (metrics_in_clear allows it)"
        )

    def aggregate_train(
        self, server_round: int, replies: Iterable[Message]
    ) -> tuple[ArrayRecord | None, MetricRecord | None]:
        if self._global is None:
            raise RuntimeError("aggregate_train called before configure_train")
        length = self._global[2] + 1
        checked = first_replies(
            replies, self.secure, asked=self._asked, grid=self._grid, mechanism=self,
            length=length,
        )
        for node, reason in sorted(checked.rejected.items()):
            log.warning("round %d: secure sum rejected node %d: %s", server_round, node, reason)
        try:
            self.codec.check_sum(max(1, len(checked.accepted)))
        except ValueError as error:
            release = Release(None, aborted=f"round {server_round} not run: {error}")
        else:
            release = self.secure.finish(server_round, checked.accepted, length)
        release.rejected = {**checked.rejected, **release.rejected}
        self.last_release = release
        metrics = MetricRecord(
            {
                "rejected": sorted(release.rejected),
                "secure-rejected": len(release.rejected),
                "secure-refused": len(release.refused),
                "secure-key-refusals": len(checked.key_refusals),
                "secure-contributors": len(release.accounted),
                "secure-aborted": int(release.total is None),
            }
        )
        metrics.update({"secure-" + k: v for k, v in release.counts.items()})
        if release.total is None:
            if release.opened:  # the server holds the sum all the same (no DP either way)
                self.opened_rounds.append(server_round)
                metrics["secure-opened"] = 1
            log.warning("round %d: the secure sum aborted: %s", server_round, release.aborted)
            return None, metrics
        return self._apply(server_round, release, checked.clear, metrics)

    def _apply(
        self,
        server_round: int,
        release: Release,
        clear: list[MetricRecord],
        metrics: MetricRecord,
    ) -> tuple[ArrayRecord | None, MetricRecord]:
        """Decode the weighted sum and hand ``global + mean update`` to the wrapped strategy
        as one reply."""
        key, global_record, dim = self._global
        decoded = self.codec.decode(release.total)
        weight = float(decoded[dim])
        if not weight > 0:
            log.warning("round %d: the summed weight is %r; no update", server_round, weight)
            metrics["secure-aborted"] = 1
            return None, metrics
        reference = to_numpy(global_record)
        updates = unflatten(decoded[:dim] / weight, reference)
        new = {k: (v.astype(np.float64) + updates[k]).astype(v.dtype) for k, v in reference.items()}
        client_metrics = MetricRecord({"num-examples": 1})
        loss = clear_train_loss(clear, default_weight=None)
        if loss is not None:
            client_metrics["train_loss"] = loss
        content = RecordDict({key: to_record(new), "metrics": client_metrics})
        arrays, aggregated = self.strategy.aggregate_train(
            server_round, [server_reply(content, server_round)]
        )
        aggregated = aggregated if aggregated is not None else MetricRecord()
        aggregated.update(dict(metrics))
        aggregated["secure-weight"] = weight
        aggregated["secure-error-bound"] = self.codec.error_bound(len(release.contributors), weight)
        if clear:
            aggregated["metrics_in_clear"] = 1
        return arrays, aggregated


#: the secure sums' own options (:attr:`strategies.secure.SecureSum.options_type`), in the
#: registry's order
SUM_OPTIONS = tuple(
    dict.fromkeys(
        secure.CLASSES[name].options_type
        for name in SECURE_SUMS
        if secure.CLASSES[name].options_type is not None
    )
)


@dataclass(frozen=True)
class _Encoding:
    """The keys every secure sum takes: which one (``secure_sum``) and the fixed point."""

    secure_sum: Literal[SECURE_SUMS] | None = None
    fractional_bits: int | None = None
    value_bound: float | None = None


@dataclass(frozen=True)
class SecureSumOptions(*reversed(SUM_OPTIONS), _Encoding):
    """The ``strategy.options`` a FedAvg-family strategy takes for a secure sum: ``secure_sum``
    and the fixed point's keys, then each secure sum's own (:data:`SUM_OPTIONS`: SecAgg+'s
    ``secagg_degree`` and ``stage_timeout``, the committee's ``committee_size``, ``threshold``,
    ``packing``, ``detect``, ``committee_shards``, ``committee_actors`` and
    ``member_dropout``).

    ``secure_sum`` turns it on; every other key is refused without it, and a secure sum's own
    keys with another secure sum when they are only for it
    (:attr:`strategies.secure.SumOptions.only_with`). An unset key (None) takes the default of
    :class:`FixedPoint`, :class:`SecureAggregation` or
    :class:`~fedsim.engine.committee.CommitteeSpec`.
    """

    def __post_init__(self) -> None:
        given = [k for k in SECURE_SUM_KEYS[1:] if getattr(self, k) is not None]
        if self.secure_sum is None and given:
            key = sorted(given)[0]
            raise ConfigError(f"{_WHERE}.{key}", getattr(self, key), "set only with secure_sum")
        for part in SUM_OPTIONS:
            own = [f.name for f in dataclasses.fields(part) if getattr(self, f.name) is not None]
            require(
                part.only_with in (None, self.secure_sum) or not own,
                f"{_WHERE}.{own[0] if own else 'secure_sum'}",
                getattr(self, own[0]) if own else self.secure_sum,
                f"only with secure_sum = {part.only_with!r}",
            )
        for part in SUM_OPTIONS:
            part.check(self, _WHERE)
        if self.secure_sum is not None:
            self.codec()

    def codec(self) -> FixedPoint:
        """The fixed-point encoding these options set (a ConfigError naming the key)."""
        bits = self.fractional_bits
        bits = FixedPoint.fractional_bits if bits is None else bits
        require(0 <= bits <= 40, f"{_WHERE}.fractional_bits", bits, "an integer in [0, 40]")
        bound = FixedPoint.value_bound if self.value_bound is None else self.value_bound
        try:
            return FixedPoint(bits, bound)
        except ValueError as error:
            raise ConfigError(f"{_WHERE}.value_bound", bound, str(error)) from None

    def arguments(self) -> dict[str, Any]:
        """The :class:`SecureAggregation` keyword arguments the secure sums' own options set."""
        out: dict[str, Any] = {}
        for part in SUM_OPTIONS:
            out.update(part.arguments(self))
        return out


#: ``strategy.options`` keys a FedAvg-family strategy takes with a secure sum
SECURE_SUM_KEYS = tuple(f.name for f in dataclasses.fields(SecureSumOptions))


def asks_secure_sum(options: Mapping[str, Any]) -> bool:
    """Whether a FedAvg-family strategy's options (a config's mapping) ask for a secure sum."""
    return raw_option(options, "secure_sum") is not None


def client_app_for(options: Mapping[str, Any]) -> Any:
    """The client app wrapper ``options`` need: :func:`secure_client_app` with a secure sum."""
    return secure_client_app if asks_secure_sum(options) else None


def from_options(
    strategy: Strategy, options: SecureSumOptions, facts: Any
) -> SecureAggregation:
    """``strategy`` (built from the other options) behind the secure sum ``options`` ask
    for; a bad option is a ConfigError naming ``strategy.options.<key>``."""
    try:
        return SecureAggregation(
            strategy,
            secure_sum=options.secure_sum,
            seed=facts.seed,
            expected_clients=max(2, round(facts.expected_clients)),
            codec=options.codec(),
            metrics_in_clear=facts.metrics_in_clear,
            **options.arguments(),
        )
    except ValueError as error:  # the cohort's sum (value_bound) or federated evaluation
        key = "value_bound" if "could wrap" in str(error) else "secure_sum"
        raise ConfigError(f"{_WHERE}.{key}", getattr(options, key), str(error)) from error
