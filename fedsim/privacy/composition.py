"""The run's epsilon: every accounted mechanism of a run, composed.

A run may release through several mechanisms (two DP strategies started one after the other
in one ServerApp, a training and a query phase with their own ledgers). Each keeps a
:class:`~fedsim.privacy.accounting.PrivacyLedger`; the run's guarantee is their sequential
composition (Dwork & Roth 2014, Thm. 3.16 for (eps, delta); for RDP, Mironov 2017, Prop. 1:
Renyi divergences of independent mechanisms add). :func:`run_epsilon` composes the ledgers'
worst-case events in one ``dp_accounting`` accountant at the strictest delta of them, so the
run's number is as tight as the accountant makes it and never below any one mechanism's.

Ledgers under different neighbouring relations (add/remove and replace-one) do not compose
into one guarantee: the run's epsilon is then infinite, with the reason. A mechanism without
a ledger of events is composed by the basic theorem (epsilons and deltas add).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import dp_accounting as dpa

from fedsim.config import ConfigError
from fedsim.privacy.accountant import ACCOUNTANTS, event_epsilon
from fedsim.privacy.ledger import PrivacyLedger


@dataclass(frozen=True)
class Composed:
    """The run's epsilon (nats, at ``delta``) and how it was obtained."""

    epsilon: float
    delta: float | None
    how: str


def run_epsilon(mechanisms: Sequence[Any]) -> Composed:
    """Epsilon of every mechanism of ``mechanisms`` (objects with ``epsilon()`` and, for a
    tight composition, ``ledger`` and ``accountant``) run on the same clients."""
    if not mechanisms:
        return Composed(0.0, None, "no release")
    if len(mechanisms) == 1:
        only = mechanisms[0]
        ledger = getattr(only, "ledger", None)
        return Composed(float(only.epsilon()), getattr(ledger, "delta", None), "one mechanism")
    ledgers = [_ledger(m) for m in mechanisms]
    if not all(isinstance(ledger, PrivacyLedger) for ledger in ledgers):
        return _basic(mechanisms)
    relations = {ledger.relation for ledger in ledgers}
    if len(relations) > 1:
        names = ", ".join(sorted(r.value for r in relations))
        return Composed(
            math.inf,
            None,
            f"mechanisms under different neighbouring relations ({names}) do not compose",
        )
    relation = relations.pop()
    delta = min(ledger.delta for ledger in ledgers)
    event = dpa.ComposedDpEvent([ledger.worst_case_event() for ledger in ledgers])
    preferred = {str(getattr(m, "accountant", "rdp")) for m in mechanisms}
    order = [a for a in ACCOUNTANTS if a in preferred] + [
        a for a in ACCOUNTANTS if a not in preferred
    ]
    for accountant in order:
        try:
            eps = event_epsilon(event, accountant, relation, delta)
        except ConfigError:
            continue
        return Composed(eps, delta, f"{len(ledgers)} ledgers composed ({accountant})")
    return Composed(math.inf, delta, "no accountant supports the composed events")


def _ledger(mechanism: Any) -> Any:
    """The ledger a mechanism's epsilon is computed from (``accounted_ledger()`` when it has
    one, e.g. DP-FedAvg's public cohorts), else its ``ledger``."""
    accounted = getattr(mechanism, "accounted_ledger", None)
    return accounted() if callable(accounted) else getattr(mechanism, "ledger", None)


def _basic(mechanisms: Sequence[Any]) -> Composed:
    """Basic composition: epsilons add, deltas add."""
    eps = sum(float(m.epsilon()) for m in mechanisms)
    deltas = [getattr(getattr(m, "ledger", None), "delta", None) for m in mechanisms]
    delta = None if any(d is None for d in deltas) else float(sum(deltas))
    return Composed(eps, delta, f"basic composition of {len(mechanisms)} mechanisms")
