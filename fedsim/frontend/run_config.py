"""The run-config schema of ``fedsim run``: a TOML file in, a validated
:class:`ExperimentConfig` out.

A config file has top-level ``name``, ``seed`` and ``rounds`` and one table per
part of the pipeline::

    [data]        source, partition, num_clients, ...  (fedsim.data.DatasetSpec)
    [model]       kind = "logreg" | "mlp" | "cnn" | "bayes-mlp", hidden, channels, ...
                  or factory = "package.module:function" with its options, python_path
    [client]      epochs, batch_size, lr, ...          (LocalTraining)
    [personal]    head_steps, head_lr, mc_samples, ... (PersonalTraining; the clients of
                  the personalised strategies pfedhb, pfedvem, pfedbayes, fedavg-ft,
                  local-only: see fedsim.frontend.personalised_run)
    [strategy]    name, clients_per_round, sampling, partial_aggregation, [strategy.options]
    [evaluation]  clients (federated), every (central, rounds), central_rows
    [engine]      backend, workers, cpus_per_worker, gpus_per_worker, device, ray_address, ...
    [faults]      dropout, straggler_fraction, straggler_delay_s, deadline_s, crash_probability
    [audit]       attacks, members, seed: audits of the finished run (audit.json)
    [privacy]     metrics_in_clear: release private runs' client metrics un-noised
    [output]      tensorboard: also write TensorBoard event files (RUN_DIR/tensorboard/)

plus ``checkpoint_every`` (rounds) and ``state_memory_mb`` (client states kept
in memory before they spill to disk). The seeds of [data], [client], [personal]
and [faults] default to the top-level seed. Everything is validated before any work
starts (:mod:`fedsim.frontend.experiment` runs the config).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from importlib.util import find_spec
from pathlib import Path
from typing import Any, Literal

from fedsim.audits.run_audit import AuditConfig
from fedsim.config import (
    ConfigError,
    from_mapping,
    import_reference,
    load_toml,
    python_path,
    require,
    to_mapping,
)
from fedsim.data import DatasetSpec
from fedsim.engine import EngineConfig, FaultConfig
from fedsim.workloads.averaging import Averaging
from fedsim.workloads.bayesian import BayesSpec
from fedsim.workloads.conformal import OnlineConformal
from fedsim.workloads.personalised import PersonalTraining
from fedsim.workloads.supervised import LocalTraining, check_parts, server_methods
from strategies.registry import PERSONALISED, spec_for

#: the model of the personalised strategies (:mod:`fedsim.workloads.bayesian`)
BAYES_MLP = "bayes-mlp"


#: the [model] keys of a factory model that are not the factory's own options
FACTORY_KEYS = ("kind", "factory", "python_path", "options")


@dataclass(frozen=True, kw_only=True)
class ModelConfig:
    """The model; its input shape and classes come from the dataset.

    ``kind = "bayes-mlp"`` is the personalised strategies' mean-field Gaussian MLP
    (:class:`~fedsim.workloads.bayesian.BayesSpec`): ``hidden``, the last ``head_layers``
    linear layers as the personal head, every ``rho`` starting at ``rho_init``.

    ``factory = "package.module:function"`` is the user's own model (``kind`` is then
    "factory"): any ``torch.nn.Module`` the function returns, called with ``options`` as
    keyword arguments (in a TOML ``[model]`` table every key other than ``factory`` and
    ``python_path`` is an option) and with ``input_shape`` and ``num_classes`` when its
    signature names them; ``python_path`` directories are put first on ``sys.path`` of the
    driver and the workers to import it (see docs/your-model-and-data.md).
    """

    kind: Literal["logreg", "mlp", "cnn", "bayes-mlp", "factory"] = "mlp"
    hidden: tuple[int, ...] = (64,)
    channels: tuple[int, ...] = (6, 16)
    head_layers: int = 1
    rho_init: float = -4.0
    factory: str = ""
    python_path: tuple[str, ...] = ()
    options: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        object.__setattr__(self, "python_path", python_path(self.python_path, "model.python_path"))
        if not self.factory:
            require(
                self.kind != "factory",
                "model.factory",
                self.factory,
                "a 'package.module:function' reference returning a torch.nn.Module",
            )
            require(
                not self.options and not self.python_path,
                "model.options" if self.options else "model.python_path",
                self.options or list(self.python_path),
                "unset unless model.factory is set (the built-in models take hidden, channels)",
            )
            return
        require(
            self.kind == "factory",
            "model.kind",
            self.kind,
            "unset (or 'factory') with model.factory: the factory builds the model",
        )
        defaults = ModelConfig()
        for key in ("hidden", "channels", "head_layers", "rho_init"):
            require(
                getattr(self, key) == getattr(defaults, key),
                f"model.{key}",
                getattr(self, key),
                "a key of the built-in models: with kind = 'factory' give the factory's options "
                "in [model.options] (or next to factory, without kind)",
            )
        import_reference(self.factory, "model.factory", self.python_path)

    @classmethod
    def stored_table(cls, table: dict[str, Any]) -> dict[str, Any]:
        """A TOML ``[model]`` table in its stored form: with ``factory`` and no ``kind``,
        every key but ``factory``, ``python_path`` and ``options`` is one of the factory's
        options (moved into ``options``; a key given both ways is refused)."""
        if "factory" not in table or "kind" in table:
            return table
        options = table.get("options", {})
        require(isinstance(options, dict), "model.options", options, "a table")
        loose = {k: v for k, v in table.items() if k not in FACTORY_KEYS}
        for key in sorted(set(loose) & set(options)):
            raise ConfigError(
                f"model.{key}", loose[key], "given once: next to factory or in [model.options]"
            )
        kept = {k: v for k, v in table.items() if k in FACTORY_KEYS}
        return {**kept, "kind": "factory", "options": {**options, **loose}}


@dataclass(frozen=True, kw_only=True)
class StrategyConfig:
    """The server strategy and the cohort it trains each round.

    Attributes:
        name: a strategy of :mod:`strategies.registry`.
        clients_per_round: cohort size (uniform), expected size (Poisson, rate
            clients_per_round / population), or about the size of each group
            of the min-separation schedule (population / clients_per_round
            groups, rounded).
        sampling: "uniform" (fixed size, without replacement), "poisson", or
            "min-separation" (each client every b rounds, b = the number of groups).
        partial_aggregation: worker-side sums: "auto" (when the aggregation is
            a sum), "on" (required) or "off".
        options: the strategy's own arguments (e.g. proximal_mu, eta,
            clipping_norm, noise_multiplier).
        averaging: ``[strategy.averaging]`` LAWA/EMA of the global models over
            rounds (:class:`~fedsim.workloads.averaging.Averaging`, in rounds);
            evaluation scores the average, training continues from the raw model.
    """

    name: str = "fedavg"
    clients_per_round: int = 10
    sampling: Literal["uniform", "poisson", "min-separation"] = "uniform"
    partial_aggregation: Literal["auto", "on", "off"] = "auto"
    options: dict[str, Any] = field(default_factory=dict)
    averaging: Averaging | dict[str, Any] | None = None

    def __post_init__(self) -> None:
        if isinstance(self.averaging, dict):
            averaging = Averaging.from_table(self.averaging, "strategy.averaging")
            object.__setattr__(self, "averaging", averaging)
        spec_for(self.name)  # a known method
        require(
            self.clients_per_round >= 1,
            "strategy.clients_per_round",
            self.clients_per_round,
            "an integer >= 1",
        )


@dataclass(frozen=True, kw_only=True)
class EvaluationConfig:
    """How the global model is evaluated.

    Attributes:
        clients: clients per round that evaluate on their local test rows (0: none).
        every: evaluate on the central test set every this many rounds (0: never).
        central_rows: rows of the central test set used (a seeded subset).
        conformal: ``[evaluation.conformal]`` online conformal calibration of the
            evaluating clients' scores on the server, each client a group
            (:class:`~fedsim.workloads.conformal.OnlineConformal`: kind
            "multigroup" or "aci", alpha, eta, global_group); needs clients > 0.
    """

    clients: int = 0
    every: int = 1
    central_rows: int = 10_000
    conformal: OnlineConformal | dict[str, Any] | None = None

    def __post_init__(self) -> None:
        if isinstance(self.conformal, dict):
            made = from_mapping(OnlineConformal, self.conformal, "evaluation.conformal")
            object.__setattr__(self, "conformal", made)
        require(
            self.conformal is None or self.clients > 0,
            "evaluation.clients",
            self.clients,
            "an integer >= 1 with [evaluation.conformal] (it calibrates the clients' scores)",
        )
        require(self.clients >= 0, "evaluation.clients", self.clients, "an integer >= 0")
        require(self.every >= 0, "evaluation.every", self.every, "an integer >= 0 (0: never)")
        require(
            self.central_rows >= 1, "evaluation.central_rows", self.central_rows, "an integer >= 1"
        )


@dataclass(frozen=True, kw_only=True)
class PrivacyConfig:
    """What a private run (DP or secure strategies, DP-SGD clients) releases.

    Attributes:
        metrics_in_clear: write the clients' own metrics (train loss, federated
            evaluation, the exact clipped fraction) to rounds.jsonl and summary.json
            un-noised and outside the ledger; every line holding them is marked
            ``"metrics_in_clear": true``. Off: they are not released.
    """

    metrics_in_clear: bool = False


@dataclass(frozen=True, kw_only=True)
class OutputConfig:
    """What a run writes besides rounds.jsonl and summary.json.

    Attributes:
        tensorboard: also write every round's metrics, epsilon, bytes and seconds as
            TensorBoard scalars under ``RUN_DIR/tensorboard/``
            (:mod:`fedsim.frontend.tensorboard_events`); needs the ``tensorboard`` package (the
            extra ``fedsim[tensorboard]``).
    """

    tensorboard: bool = False

    def __post_init__(self) -> None:
        require(
            not self.tensorboard or find_spec("tensorboard") is not None,
            "output.tensorboard",
            self.tensorboard,
            "false: the tensorboard package is not installed "
            "(pip install 'fedsim[tensorboard]', or tensorboard==2.21.0)",
        )


@dataclass(frozen=True, kw_only=True)
class ExperimentConfig:
    """A whole run."""

    name: str = "experiment"
    seed: int = 0
    rounds: int
    timeout: float = 3600.0
    data: DatasetSpec
    model: ModelConfig = field(default_factory=ModelConfig)
    client: LocalTraining = field(default_factory=LocalTraining)
    personal: PersonalTraining | dict[str, Any] | None = None
    strategy: StrategyConfig = field(default_factory=StrategyConfig)
    evaluation: EvaluationConfig = field(default_factory=EvaluationConfig)
    engine: EngineConfig = field(default_factory=EngineConfig)
    faults: FaultConfig = field(default_factory=FaultConfig)
    audit: AuditConfig | dict[str, Any] | None = None
    privacy: PrivacyConfig = field(default_factory=PrivacyConfig)
    output: OutputConfig = field(default_factory=OutputConfig)
    checkpoint_every: int = 1
    state_memory_mb: int = 256

    def __post_init__(self) -> None:
        if isinstance(self.audit, dict):  # [audit]: errors name audit.<key>
            object.__setattr__(self, "audit", from_mapping(AuditConfig, self.audit, "audit"))
        if isinstance(self.personal, dict):  # [personal]: errors name personal.<key>
            personal = from_mapping(PersonalTraining, self.personal, "personal")
            object.__setattr__(self, "personal", personal)
        check_personalised(self)
        check_text(self)
        require(self.rounds >= 1, "rounds", self.rounds, "an integer >= 1")
        require(
            self.checkpoint_every >= 1,
            "checkpoint_every",
            self.checkpoint_every,
            "an integer >= 1 (rounds between checkpoints)",
        )
        require(
            self.state_memory_mb >= 0,
            "state_memory_mb",
            self.state_memory_mb,
            "MiB of client states kept in memory (>= 0)",
        )
        require(self.timeout > 0, "timeout", self.timeout, "a number of seconds > 0")
        self._check_cohorts()
        self._check_combinations()

    def _check_cohorts(self) -> None:
        """The cohorts fit: training within the population, evaluation within training."""
        population = self.data.num_clients
        require(
            self.strategy.clients_per_round <= population,
            "strategy.clients_per_round",
            self.strategy.clients_per_round,
            f"at most the population, data.num_clients = {population}",
        )
        require(
            self.evaluation.clients <= self.strategy.clients_per_round,
            "evaluation.clients",
            self.evaluation.clients,
            f"at most strategy.clients_per_round = {self.strategy.clients_per_round}",
        )

    def _check_combinations(self) -> None:
        """The client methods, the model and the strategy go together, and no un-noised
        client metric reaches a private strategy's server unless ``[privacy]`` allows it."""
        proximal = spec_for(self.strategy.name).proximal(self.strategy.options)
        check_parts(self.client, fedprox=proximal)
        require(
            self.client.constraints is None or self.model.kind == "logreg",
            "model.kind",
            self.model.kind,
            "'logreg' with client.constraints (linear constraints on a linear model)",
        )
        require(
            self.client.dp_sgd is None
            or self.evaluation.clients == 0
            or self.privacy.metrics_in_clear,
            "evaluation.clients",
            self.evaluation.clients,
            "0 with client.dp_sgd (federated evaluation sends each client's un-noised test "
            "loss and accuracy to the server), unless [privacy] metrics_in_clear = true",
        )
        require(
            not spec_for(self.strategy.name).secure_replies(self.strategy.options)
            or self.evaluation.clients == 0
            or self.privacy.metrics_in_clear,
            "evaluation.clients",
            self.evaluation.clients,
            f"0 with strategy.name = {self.strategy.name!r} (federated evaluation sends each "
            "client's un-noised test loss and accuracy to the server, outside the strategy's "
            "mechanism), unless [privacy] metrics_in_clear = true, which makes epsilon infinite",
        )
        require(
            self.client.compression is None or self.strategy.partial_aggregation != "on",
            "strategy.partial_aggregation",
            "on",
            "'auto' or 'off' with client.compression (packed uploads cannot be summed on workers)",
        )
        self._check_method_halves()

    def _check_method_halves(self) -> None:
        """A client method with a server half sends un-noised client records and is not
        folded on workers: only with a strategy that makes no privacy claim and sums in the
        clear, without ``partial_aggregation = "on"``."""
        spec = spec_for(self.strategy.name)
        for method, table in server_methods(self.client):
            require(
                spec.accounting is None
                and not spec.secure_replies(self.strategy.options)
                and not spec.personalised
                and not spec.text,
                f"client.{method.key}",
                to_mapping(table),
                f"unset with strategy.name = {self.strategy.name!r} (its server half reads "
                "each client's record in the clear: a strategy without privacy accounting or "
                "secure aggregation)",
            )
            require(
                self.strategy.partial_aggregation != "on",
                "strategy.partial_aggregation",
                "on",
                f"'auto' or 'off' with client.{method.key} (its reply records cannot be "
                "summed on workers)",
            )

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> ExperimentConfig:
        """Validate a parsed config; the seeds of [data], [client] and [faults]
        default to ``seed``."""
        raw = {k: (dict(v) if isinstance(v, dict) else v) for k, v in raw.items()}
        seed = raw.get("seed", 0)
        for section in ("data", "client", "personal", "faults"):
            table = raw.get(section)
            if isinstance(table, dict) and "seed" not in table:
                table["seed"] = seed
        if "client" not in raw:
            raw["client"] = {"seed": seed}
        lora = raw["client"].get("lora") if isinstance(raw["client"], dict) else None
        if isinstance(lora, dict):  # CoTo's horizon defaults to the run's rounds
            raw["client"]["lora"] = {"rounds": raw.get("rounds", 0), **lora}
        if "data" not in raw:
            raise ConfigError("data", None, "a [data] table (this section is required)")
        if isinstance(raw.get("model"), dict):
            raw["model"] = ModelConfig.stored_table(raw["model"])
        return from_mapping(cls, raw)

    @classmethod
    def load(cls, path: str | Path) -> ExperimentConfig:
        return cls.from_dict(load_toml(path))

    @property
    def private(self) -> bool:
        """Whether the run is private: a DP or secure strategy (a FedAvg-family strategy with
        a ``secure_sum`` too), or DP-SGD clients."""
        spec = spec_for(self.strategy.name)
        secure = spec.secure_replies(self.strategy.options)
        return spec.private or secure or self.client.dp_sgd is not None


def is_personalised(config: ExperimentConfig) -> bool:
    return spec_for(config.strategy.name).personalised


def check_personalised(config: ExperimentConfig) -> None:
    """The config checks of a run with a personalised strategy (and of ``[personal]``)."""
    name = config.strategy.name
    if not is_personalised(config):
        require(
            config.personal is None,
            "personal",
            to_mapping(config.personal),
            f"no [personal] table with strategy.name = {name!r} (it configures the clients "
            f"of {', '.join(PERSONALISED)})",
        )
        require(
            config.model.kind != BAYES_MLP,
            "model.kind",
            BAYES_MLP,
            f"'logreg', 'mlp' or 'cnn' with strategy.name = {name!r} "
            f"('{BAYES_MLP}' is the model of {', '.join(PERSONALISED)})",
        )
        return
    require(
        config.model.kind == BAYES_MLP,
        "model.kind",
        config.model.kind,
        f"'{BAYES_MLP}' with strategy.name = {name!r} (a Bayesian body and personal head)",
    )
    BayesSpec(  # checks model.hidden / head_layers / rho_init before anything runs
        in_features=1,
        hidden=config.model.hidden,
        num_classes=2,
        head_layers=config.model.head_layers,
        rho_init=config.model.rho_init,
    )
    require(
        config.client == LocalTraining(seed=config.client.seed),
        "client",
        "set",
        f"unset with strategy.name = {name!r}: its clients are configured by [personal]",
    )
    require(
        config.evaluation.clients == 0,
        "evaluation.clients",
        config.evaluation.clients,
        f"0 with strategy.name = {name!r}: every client evaluates its personal model every "
        "evaluation.every rounds",
    )
    require(
        config.evaluation.conformal is None and config.strategy.averaging is None,
        "evaluation.conformal/strategy.averaging",
        "set",
        f"unset with strategy.name = {name!r}",
    )
    require(
        config.strategy.sampling in ("poisson", "uniform"),
        "strategy.sampling",
        config.strategy.sampling,
        f"'poisson' (Binomial, the reference sampler) or 'uniform' with strategy.name = {name!r}",
    )


def is_text(config: ExperimentConfig) -> bool:
    return spec_for(config.strategy.name).text


def check_text(config: ExperimentConfig) -> None:
    """A text method goes with ``[data] source = "text"`` and the other way round, has no
    federated evaluation (its quality is measured on the server), and its options are read
    here, before anything is written or loaded (errors name ``strategy.options.<key>``)."""
    name = config.strategy.name
    text = is_text(config)
    require(
        text == (config.data.source == "text"),
        "data.source",
        config.data.source,
        f"'text' with strategy.name = {name!r}" if text
        else f"an array source with strategy.name = {name!r} ('text' is for popri and "
        "private-evolution)",
    )
    if text:
        require(config.evaluation.clients == 0, "evaluation.clients", config.evaluation.clients,
                f"0 with strategy.name = {name!r} (it measures quality on the server)")
        spec_for(name).read_options(config.strategy.options)


def with_engine(config: ExperimentConfig, **overrides: Any) -> ExperimentConfig:
    """``config`` with [engine] keys replaced (command-line overrides)."""
    changes = {k: v for k, v in overrides.items() if v is not None}
    return dataclasses.replace(config, engine=dataclasses.replace(config.engine, **changes))
