"""What the front end knows of a strategy: one :class:`StrategySpec` per method.

Each strategy module exposes its spec (``SPEC``, or ``SPECS`` for a module holding a family
such as Flower's own strategies) and :mod:`strategies.registry` lists them; nothing else
tests a strategy's name. A spec declares its ``strategy.options`` schema (a frozen
dataclass read by :func:`fedsim.config.from_mapping`: errors name ``strategy.options.<key>``,
its value and what is allowed), builds the strategy from it, says what its clients run,
whether worker-side sums apply and how its privacy is accounted.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from flwr.clientapp import ClientApp
from flwr.serverapp.strategy import Strategy

from fedsim.config import from_mapping, require
from fedsim.privacy.participation import Participation
from fedsim.privacy.sampling import Sampling


@dataclass(frozen=True, kw_only=True)
class RunFacts:
    """What a (non-personalised) strategy's builder is told about the run.

    Attributes:
        expected_clients: expected cohort size per round (DP noise divides by it).
        evaluate_fraction: share of each evaluation phase's clients that evaluate, <= 1.
        seed: the run seed (public streams only; a strategy's own noise comes from the
            server's secret, bound by the front end).
        worker_reduction: workers fold their clients' replies (the spec is summable and
            partial aggregation is not off).
        sampling: the accountant's model of the cohorts (None: full participation); a
            :class:`~fedsim.privacy.participation.Participation` for a schedule.
        population: registered clients (None: unknown).
        rounds: the run's rounds (None: unknown).
        metrics_in_clear: private strategies also release their clients' metrics.
    """

    expected_clients: float
    evaluate_fraction: float
    seed: int
    worker_reduction: bool
    sampling: Sampling | None = None
    population: int | None = None
    rounds: int | None = None
    metrics_in_clear: bool = False

    def required(self, name: str, allowed: str) -> Any:
        """The fact ``name`` (``rounds`` or ``population``); ``allowed`` says why it is needed."""
        value = getattr(self, name)
        require(value is not None, name, value, allowed)
        return value

    @property
    def participation(self) -> Participation | None:
        """The run's participation schedule (a b-min-separation cohort's), else None."""
        return self.sampling if isinstance(self.sampling, Participation) else None


@dataclass(frozen=True, kw_only=True)
class Accounting:
    """How a private strategy's epsilon is computed.

    Attributes:
        ledger: what each round records in the strategy's
            :class:`~fedsim.privacy.ledger.PrivacyLedger`.
        command: the ``fedsim account`` subcommand that recomputes the epsilon offline
            (None: none does).
    """

    ledger: str
    command: str | None = None


def raw_option(options: Mapping[str, Any], key: str, default: Any = None) -> Any:
    """``key`` of a config's (unread) ``strategy.options``, spelt with ``-`` or ``_`` as
    :func:`fedsim.config.from_mapping` reads it: for the spec's predicates, which the front
    end asks before the strategy is built."""
    for name, value in options.items():
        if str(name).replace("-", "_") == key:
            return value
    return default


def _no_proximal_term(options: Mapping[str, Any]) -> bool:
    """No, whatever the options (the default of the spec's option predicates)."""
    return False


@dataclass(frozen=True, kw_only=True)
class StrategySpec:
    """One method as a run config names it.

    Attributes:
        name: ``[strategy] name``.
        options: the frozen dataclass ``strategy.options`` is read into (its defaults are
            the method's; facts the run supplies, e.g. ``delta`` from the population, default
            to None and are resolved by ``build``).
        build: ``build(options, facts)`` -> the strategy, from an instance of
            :attr:`options` and the :class:`RunFacts`, or for a personalised method
            ``build(options, **cohort)`` as
            :func:`strategies.plumbing.personalised_config.from_options` takes the cohort.
        summable: its aggregation is a sum, so workers may fold their clients' replies.
        accounting: how its privacy is accounted (None: not a private strategy).
        client_app: wraps the training client app for this method's protocol
            (``client_app(inner, metrics_in_clear)``; None: the app is used as it is).
        personalised: its clients run
            :func:`fedsim.workloads.personalised.make_personal_app`, every client is
            reachable every round and the strategy draws its reporting clients itself.
        proximal: whether, with these options, its clients must add a proximal term
            (FedProx), which DP-SGD, LoRA, constrained and client-method training lack.
        amplified_by_sampling: its epsilon credits amplification by the cohorts' sampling, so
            under ``fedsim run`` its uniform and Poisson cohorts are the server's secret draw
            (a client that knows the seed cannot tell which rounds it was in).
        secure_replies: whether, with these options, its clients reply nothing
            data-dependent outside the mechanism, so that federated evaluation (each client's
            un-noised metrics, straight to the server) needs ``[privacy] metrics_in_clear``.
        client_app_for: ``client_app_for(options)`` -> the client app wrapper these options
            need (None: ``client_app``), e.g. a FedAvg-family strategy with ``secure_sum``.
        text_app: a synthetic-text method (``[data] source = "text"``): ``text_app(options,
            text_source)`` -> its clients' app, and ``build(options, text_run)`` with a
            :class:`strategies.plumbing.text_method.TextRun` (None: not a text method).
    """

    name: str
    build: Callable[..., Strategy]
    options: type
    summable: bool = False
    accounting: Accounting | None = None
    client_app: Callable[[ClientApp, bool], ClientApp] | None = None
    personalised: bool = False
    proximal: Callable[[Mapping[str, Any]], bool] = _no_proximal_term
    secure_replies: Callable[[Mapping[str, Any]], bool] = _no_proximal_term
    amplified_by_sampling: bool = False
    client_app_for: Callable[[Mapping[str, Any]], Callable | None] | None = None
    text_app: Callable[[Any, Any], ClientApp] | None = None

    def read_options(self, options: Mapping[str, Any]) -> Any:
        """``options`` (a config's ``strategy.options``) as an instance of :attr:`options`."""
        return from_mapping(self.options, options, "strategy.options")

    @property
    def text(self) -> bool:
        """A synthetic-text method: its data is a text federation, its clients run
        :attr:`text_app`."""
        return self.text_app is not None

    @property
    def private(self) -> bool:
        """A DP or secure-aggregation method: its clients' metrics stay private by default."""
        return self.accounting is not None

    def wrap_client_app(
        self,
        inner: ClientApp,
        metrics_in_clear: bool,
        options: Mapping[str, Any] | None = None,
    ) -> ClientApp:
        """The client app this method's clients run around the training app ``inner`` (with
        the strategy's ``options``, which may ask for another, :attr:`client_app_for`)."""
        wrap = self.client_app
        if self.client_app_for is not None and options is not None:
            wrap = self.client_app_for(options) or wrap
        return inner if wrap is None else wrap(inner, metrics_in_clear)
