"""Secure summation as its own layer: one interface, four implementations.

* :mod:`strategies.secure.release`: the :class:`SecureSum` interface and the round's
  :class:`Release` (a release exists whenever values were opened, also on abort);
* :mod:`strategies.secure.plaintext`: SecAgg+'s outcome simulated with the inputs in the clear;
* :mod:`strategies.secure.secagg`: SecAgg+ (Bell et al., CCS 2020) over the Grid;
* :mod:`strategies.secure.committee`: the committee host's sum of sealed inputs;
* :mod:`strategies.secure.dmm.committee_sum`: the DMM committees' sum through an integer matrix, its
state
  handed from committee to committee (with worker folding), run by the DMM strategy.

:func:`build` makes one by name; :data:`CONTRIBUTE` holds each one's client side and
:data:`WITHOUT_DP` the names a FedAvg-family strategy may take with no DP
(:mod:`strategies.plumbing.secure_aggregation`): adding an implementation is its module and its
entry in :data:`CLASSES`.
"""

from __future__ import annotations

from collections.abc import Callable

from fedsim.engine.committee import Committee, CommitteeSpec
from strategies.secure import committee, plaintext, secagg
from strategies.secure.committee import CommitteeSum
from strategies.secure.dmm import committee_sum as dmm
from strategies.secure.dmm.committee_sum import DMMSum
from strategies.secure.plaintext import PlaintextSum
from strategies.secure.release import Release, SecureSum
from strategies.secure.secagg import SecAggPlan, SecAggSum

__all__ = [
    "CLASSES",
    "CONTRIBUTE",
    "NAMES",
    "CommitteeSum",
    "DMMSum",
    "PlaintextSum",
    "Release",
    "SecAggPlan",
    "SecAggSum",
    "SecureSum",
    "WITHOUT_DP",
    "build",
]

#: name -> the implementation
CLASSES: dict[str, type[SecureSum]] = {
    cls.name: cls for cls in (PlaintextSum, SecAggSum, CommitteeSum, DMMSum)
}

#: name -> the client side: ``contribute(context, secret, config, elements, round, prefix)``
CONTRIBUTE: dict[str, Callable] = {
    PlaintextSum.name: plaintext.contribute,
    SecAggSum.name: secagg.contribute,
    CommitteeSum.name: committee.contribute,
    DMMSum.name: dmm.contribute,
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
    """The secure sum ``name`` (one of :data:`NAMES` but ``dmm``): ``plan`` gives SecAgg+'s public
    parameters (``plaintext`` simulates them), ``stage_timeout`` its exchanges' limit, and
    ``committee`` (required exactly for ``committee``) the committee or its spec."""
    if name not in NAMES:
        raise ValueError(f"secure sum {name!r}; allowed: {', '.join(map(repr, NAMES))}")
    if name == DMMSum.name:
        raise ValueError(
            "secure sum 'dmm' is built by the DMM strategy, which owns its integer matrix "
            "(strategies.secure.dmm.committee_sum.DMMSum)"
        )
    if (name == CommitteeSum.name) != (committee is not None):
        raise ValueError(
            f"committee={committee!r} with secure sum {name!r}: a Committee or CommitteeSpec "
            "is given exactly for 'committee'"
        )
    if name == PlaintextSum.name:
        return PlaintextSum(prefix, plan)
    if name == SecAggSum.name:
        return SecAggSum(prefix, plan, stage_timeout)
    return CommitteeSum(prefix, committee, seed=plan.seed, member_dropout=member_dropout)
