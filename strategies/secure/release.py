"""The secure-summation interface: what every way of summing the cohort's inputs provides.

A :class:`SecureSum` sums vectors of field elements (F_p, p = 2^61 - 1,
:data:`protocols.field.DEFAULT_FIELD`) that the clients of one round hold, and tells the
strategy above it what the server learned: a :class:`Release`. The strategy (DDGauss's KLS21
encoder and ledger, FedAvg with secure aggregation, ...) encodes, accounts and decodes; the
secure sum only instructs the cohort, checks the clients' first replies and finishes the sum.

**Opened is released.** A :class:`Release` exists whenever the server held enough to determine
a sum -- also when the round then aborts (a SecAgg+ round that aborts in UNMASK after every
secret's shares arrived, a committee round whose rows reached the server beyond the threshold).
Its ``opened`` nodes are then the clients whose inputs that sum holds, and a ledger reading the
release accounts them all the same (:attr:`Release.accounted`).

One round, seen from the strategy:

1. :meth:`SecureSum.instruct` adds the round's public protocol entries to the train config
   (a SecAgg+ session id, ...); :meth:`SecureSum.address` adds what each client needs of its
   own (a committee's keys and the client's channel id);
2. each client's first reply holds one record under :attr:`SecureSum.reply_key`, which
   :meth:`SecureSum.payload` checks and parses (ValueError: the client is rejected);
3. :meth:`SecureSum.finish` runs the rest of the protocol over the accepted payloads (by node
   id) and returns the round's :class:`Release`.

On the client, the implementation's :meth:`SecureSum.contribute` turns the client's elements
into that first reply's content (:data:`strategies.secure.CONTRIBUTE` by name), and
:meth:`SecureSum.register_client_stages` adds the handlers of the exchanges after it.

Each implementation builds itself from the :class:`SumArguments` every secure sum is given
(:meth:`SecureSum.from_arguments`) and names the dataclass of the ``strategy.options`` it takes
under a FedAvg-family strategy (:attr:`SecureSum.options_type`, a :class:`SumOptions`): a new one is
its module and its entry in :data:`strategies.secure.CLASSES`.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar

import numpy as np
from flwr.app import ConfigRecord, Context, Message, RecordDict
from flwr.clientapp import ClientApp
from flwr.serverapp import Grid

from fedsim.randomness import PartySecret
from protocols.field import DEFAULT_FIELD

if TYPE_CHECKING:
    from fedsim.engine.committee import Committee, CommitteeSpec
    from strategies.secure.secagg_plan import SecAggPlan


@dataclass
class Release:
    """What one round's secure sum gave the server.

    Attributes:
        total: the sum in F_p (None: no sum was decoded; the round updates no model).
        contributors: the nodes whose inputs ``total`` sums.
        rejected: nodes rejected for a bad reply, with the reasons.
        aborted: why the round aborted (None: it completed).
        stage: the protocol's final stage (SecAgg+: the server state machine's), if it has one.
        refused: nodes that refused a stage (dropouts), with their reasons.
        counts: the protocol's own round metrics (a committee's ``member-dropouts``, ...;
            the strategy names them in its round record).
        opened: when the round aborted after the server held enough to determine the sum, the
            nodes whose inputs that sum holds -- a release all the same.
        transcript: the protocol's own record of the round, for the strategy that reads it
            (``dmm``: its :class:`protocols.dmm.release.RoundOutput`, or the abort that ended
            the round); None for the others.
    """

    total: np.ndarray | None
    contributors: tuple[int, ...] = ()
    rejected: dict[int, str] = field(default_factory=dict)
    aborted: str | None = None
    stage: str | None = None
    refused: dict[int, str] = field(default_factory=dict)
    counts: dict[str, int] = field(default_factory=dict)
    opened: tuple[int, ...] = ()
    transcript: Any = None

    @property
    def accounted(self) -> tuple[int, ...]:
        """The nodes whose inputs the server can determine the sum of: the contributors of a
        released sum, the opened nodes of an aborted one, none when nothing was determined."""
        return self.contributors if self.total is not None else self.opened


@dataclass(frozen=True)
class SumArguments:
    """What every secure sum is built from (:func:`strategies.secure.build`): ``prefix`` names
    its entries, ``plan`` holds SecAgg+'s public parameters (``plaintext`` simulates them; the
    run seed for the others' public schedules), ``stage_timeout`` the seconds each exchange
    after the first reply waits, ``committee`` the Committee or CommitteeSpec of a sum that
    takes one (:attr:`SecureSum.takes_committee`) and ``member_dropout`` its members' drop
    probability per stage."""

    prefix: str
    plan: SecAggPlan
    stage_timeout: float | None = None
    committee: Committee | CommitteeSpec | None = None
    member_dropout: float = 0.0


@dataclass(frozen=True)
class SumOptions:
    """Base of a secure sum's own ``strategy.options`` under a FedAvg-family strategy
    (:class:`strategies.plumbing.secure_aggregation.SecureSumOptions` composes them): flat keys,
    None when unset. Its methods run on the composed options (``self.secure_sum`` is the
    secure sum they name)."""

    #: the secure sum these keys are for, refused with any other ("only with secure_sum =
    #: '<name>'"); None: every secure sum takes them (SecAgg+'s plan is every sum's argument)
    only_with: ClassVar[str | None] = None

    def check(self, where: str) -> None:
        """A ConfigError naming ``<where>.<key>`` for a set key out of its range (every
        value is in range by default)."""
        return None

    def arguments(self) -> dict[str, Any]:
        """The keyword arguments of the secure aggregation wrapper
        (:class:`strategies.plumbing.secure_aggregation.SecureAggregation`) that these options
        set; an unset key takes the wrapper's default."""
        return {}


class SecureSum(ABC):
    """One way of summing a round's inputs in F_p so that the server learns only the sum (or,
    for ``plaintext``, a simulation of that outcome with the inputs in the clear).

    ``prefix`` names the instruction and reply entries (``"ddgauss."`` for DDGauss, so that
    its wire names stay as they were) and the clients' share and key streams.
    """

    #: the implementation's name (``secure_sum`` / DDGauss's protocol)
    name: ClassVar[str]
    #: the server holds no client's input (False only for ``plaintext``)
    hides_inputs: ClassVar[bool] = True
    #: it sums any cohort's field elements by itself, with no mechanism around it, so a
    #: FedAvg-family strategy may take it with no DP when it also :attr:`hides_inputs`
    #: (:data:`strategies.secure.WITHOUT_DP`)
    standalone: ClassVar[bool] = True
    #: it sums through a Committee (or the CommitteeSpec the front end builds one from), given
    #: exactly to the sums that take one (:attr:`SumArguments.committee`)
    takes_committee: ClassVar[bool] = False
    #: the dataclass of its own ``strategy.options`` under a FedAvg-family strategy (None: it
    #: takes none there)
    options_type: ClassVar[type[SumOptions] | None] = None

    def __init__(self, prefix: str) -> None:
        self.prefix = prefix

    @classmethod
    @abstractmethod
    def from_arguments(cls, arguments: SumArguments) -> SecureSum:
        """The secure sum ``arguments`` describe (ValueError naming a bad one)."""

    @staticmethod
    @abstractmethod
    def contribute(
        context: Context,
        secret: PartySecret,
        config: ConfigRecord,
        elements: np.ndarray,
        server_round: int,
        prefix: str,
    ) -> RecordDict:
        """The client side: the content of the first reply that carries the client's
        ``elements`` (field elements) for ``server_round``, under the instruction ``config``
        (entries named by ``prefix``), from the client's own ``secret``."""

    @classmethod
    def contribute_signed(
        cls,
        context: Context,
        secret: PartySecret,
        config: ConfigRecord,
        signed: np.ndarray,
        server_round: int,
        prefix: str,
    ) -> RecordDict:
        """:meth:`contribute` of ``signed`` integers (|v| <= (p-1)/2): by default of their
        field elements; a sum that masks signed integers itself (SecAgg+) takes them as
        they are, with no round trip through the field."""
        elements = DEFAULT_FIELD.encode_signed(signed)
        return cls.contribute(context, secret, config, elements, server_round, prefix)

    @classmethod
    def register_client_stages(cls, app: ClientApp) -> None:
        """Add to ``app`` the client's handlers of the exchanges after the first reply (none
        by default)."""
        return None

    #: the record type under :attr:`reply_key` (ConfigRecord or ArrayRecord)
    reply_kind: ClassVar[type]

    @property
    @abstractmethod
    def reply_key(self) -> str:
        """The record of a client's first reply that :meth:`payload` reads."""

    def instruct(self, server_round: int, config: ConfigRecord, grid: Grid | None) -> None:
        """Add the round's public protocol entries to the train ``config`` (in place); the
        ``grid`` is the round's transport (the exchanges after the first reply use it)."""
        self._grid = grid

    def address(self, server_round: int, messages: list[Message]) -> None:
        """Add each client's own entries to its train instruction (in place); nothing by
        default."""
        return None

    @abstractmethod
    def payload(self, record: Any, length: int) -> Any:
        """A client's first-reply record (its inputs: ``length`` elements), checked and
        parsed; ValueError if it is not one."""

    @abstractmethod
    def finish(self, server_round: int, payloads: Mapping[int, Any], length: int) -> Release:
        """Sum the accepted clients' inputs (``payloads`` by node id, vectors of ``length``
        elements); never raises for a client's reply: a bad one is rejected in the release."""

    def __getstate__(self) -> dict[str, Any]:
        state = dict(self.__dict__)
        state.pop("_grid", None)  # the round's transport, never part of a checkpoint
        return state
