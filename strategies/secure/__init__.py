"""Secure summation as its own layer: one interface, four implementations.

* :mod:`strategies.secure.release`: the :class:`SecureSum` interface and the round's
  :class:`Release` (a release exists whenever values were opened, also on abort);
* :mod:`strategies.secure.plaintext`: SecAgg+'s outcome simulated with the inputs in the clear;
* :mod:`strategies.secure.secagg`: SecAgg+ (Bell et al., CCS 2020) over the Grid;
* :mod:`strategies.secure.committee`: the committee host's sum of sealed inputs;
* :mod:`strategies.secure.dmm.committee_sum`: the DMM committees' sum through an integer matrix, its
state
  handed from committee to committee (with worker folding), run by the DMM strategy.

:func:`build` makes one by name (:meth:`SecureSum.from_arguments`); :data:`CONTRIBUTE` holds
each one's client side (:meth:`SecureSum.contribute`; of signed integers:
:data:`CONTRIBUTE_SIGNED`), :func:`register_client_stages` adds the
client handlers of their later exchanges, and :data:`WITHOUT_DP` names those a FedAvg-family
strategy may take with no DP (:mod:`strategies.plumbing.secure_aggregation`, which composes
their :attr:`SecureSum.options_type`): adding an implementation is its module and its entry in
:data:`CLASSES`.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

from flwr.clientapp import ClientApp

from fedsim.engine.committee import Committee, CommitteeSpec
from strategies.secure.committee import CommitteeSum
from strategies.secure.dmm.committee_sum import DMMSum
from strategies.secure.plaintext import PlaintextSum
from strategies.secure.release import Release, SecureSum, SumArguments, SumOptions
from strategies.secure.secagg import SecAggSum
from strategies.secure.secagg_plan import SecAggPlan

__all__ = [
    "CLASSES",
    "CONTRIBUTE",
    "CONTRIBUTE_SIGNED",
    "NAMES",
    "CommitteeSum",
    "DMMSum",
    "PlaintextSum",
    "Release",
    "SecAggPlan",
    "SecAggSum",
    "SecureSum",
    "SumArguments",
    "SumOptions",
    "WITHOUT_DP",
    "build",
    "register_client_stages",
]

#: name -> the implementation
CLASSES: dict[str, type[SecureSum]] = {
    cls.name: cls for cls in (PlaintextSum, SecAggSum, CommitteeSum, DMMSum)
}

#: name -> the client side: ``contribute(context, secret, config, elements, round, prefix)``
CONTRIBUTE: dict[str, Callable] = {name: cls.contribute for name, cls in CLASSES.items()}
#: name -> the client side of signed integers: ``contribute_signed(context, secret, config,
#: signed, round, prefix)`` (:meth:`SecureSum.contribute_signed`)
CONTRIBUTE_SIGNED: dict[str, Callable] = {
    name: cls.contribute_signed for name, cls in CLASSES.items()
}
NAMES = tuple(CLASSES)
#: the secure sums that hide every input and sum on their own: what ``secure_sum`` may name
#: under a FedAvg-family strategy with no DP
WITHOUT_DP = tuple(n for n, cls in CLASSES.items() if cls.hides_inputs and cls.standalone)


def build(
    name: str,
    *,
    prefix: str,
    plan: SecAggPlan,
    stage_timeout: float | None = None,
    committee: Committee | CommitteeSpec | None = None,
    member_dropout: float = 0.0,
) -> SecureSum:
    """The secure sum ``name`` (one of :data:`NAMES` but ``dmm``), built by its class from the
    :class:`SumArguments`: ``plan`` gives SecAgg+'s public parameters (``plaintext`` simulates
    them), ``stage_timeout`` its exchanges' limit, and ``committee`` (required exactly for the
    sums that take one) the committee or its spec."""
    if name not in NAMES:
        raise ValueError(f"secure sum {name!r}; allowed: {', '.join(map(repr, NAMES))}")
    cls = CLASSES[name]
    if cls.takes_committee != (committee is not None):
        takers = ", ".join(repr(n) for n, c in CLASSES.items() if c.takes_committee)
        raise ValueError(
            f"committee={committee!r} with secure sum {name!r}: a Committee or CommitteeSpec "
            f"is given exactly for {takers}"
        )
    arguments = SumArguments(prefix, plan, stage_timeout, committee, member_dropout)
    return cls.from_arguments(arguments)


def register_client_stages(app: ClientApp, names: Iterable[str] = NAMES) -> None:
    """Add to ``app`` the client handlers of the exchanges after the first reply of each
    secure sum in ``names`` (:meth:`SecureSum.register_client_stages`)."""
    for name in dict.fromkeys(names):
        if name not in CLASSES:
            raise ValueError(f"secure sum {name!r}; allowed: {', '.join(map(repr, NAMES))}")
        CLASSES[name].register_client_stages(app)
