"""Privacy accountants, built by a factory; every epsilon comes from ``dp_accounting``.

``dp_accounting``'s RDP (``RdpAccountant``: Mironov 2017; Mironov, Talwar & Zhang 2019 for
Poisson subsampling; Wang, Balle & Kasiviswanathan 2019, Thm. 27 for sampling without
replacement) or PLD (``PLDAccountant``: Doroshenko et al. 2022) accountant turns an event into
``(epsilon, delta)``; epsilon is in nats, ``delta`` in ``(0, 1)``. Each accountant is one row of
:data:`ACCOUNTANT_KINDS` (:class:`AccountantKind`): how it is built and how it reads events.

Neighbouring relations in dp_accounting 0.6.0. Its two accountants read a Gaussian event's
noise multiplier differently under ``REPLACE_ONE``: ``PLDAccountant`` takes it as ``std / C``
and doubles the sensitivity itself (its replace-one Gaussian equals the add/remove Gaussian with
``z/2``), while ``RdpAccountant`` ignores the relation for ``GaussianDpEvent`` and expects
``std / (replace-one sensitivity)`` inside ``SampledWithoutReplacementDpEvent``. Events in a
ledger always carry ``z = std / C`` (the ``GaussianDpEvent`` docstring's definition); before the
RDP accountant sees them under ``replace_one`` every Gaussian noise multiplier is halved, so both
accountants describe the same mechanism and neither number is optimistic. A
``ZCDpEvent`` (rho-zCDP) reaches the RDP accountant as the Gaussian with its
RDP curve and is refused by the PLD accountant (a Gaussian PLD would be optimistic for it).

Supported combinations (anything else raises :class:`~fedsim.config.ConfigError`):

======================  ==================  ==========================
sampling                rdp                 pld
======================  ==================  ==========================
PoissonSampling         add_remove          add_remove, replace_one
FixedSizeSampling       replace_one         (no dp_accounting event)
FullParticipation       both                both
Participation           both                both
======================  ==================  ==========================
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Literal

import dp_accounting as dpa
from dp_accounting.pld import PLDAccountant
from dp_accounting.rdp import RdpAccountant

from fedsim.config import ConfigError, require
from fedsim.privacy import dpa_adapter
from fedsim.privacy.events import kind_of
from fedsim.privacy.round_events import effective_noise_multiplier
from fedsim.privacy.sampling import NeighbouringRelation, check_delta

Accountant = Literal["rdp", "pld"]
#: ``(accountant that composed one round, translated round, counts, delta)`` -> epsilons or None
CurveFromOneRound = Callable[
    [dpa.PrivacyAccountant, dpa.DpEvent, Sequence[int], float], list[float] | None
]


@dataclass(frozen=True)
class AccountantKind:
    """One dp_accounting accountant: ``build`` makes a fresh one for a relation;
    ``halves_replace_one``: it reads a Gaussian's ``z`` as std / replace-one sensitivity;
    ``curve``: epsilon after many self-compositions of one composed round (or None);
    ``zcdp_as_gaussian``: it accounts a zCDP event by its RDP curve (else it refuses it);
    ``looser``: an accountant whose calibration is a good start for this one's."""

    name: str
    build: Callable[[dpa.NeighboringRelation], dpa.PrivacyAccountant]
    halves_replace_one: bool
    curve: CurveFromOneRound
    zcdp_as_gaussian: bool
    looser: str | None = None

    def fresh(self, relation: NeighbouringRelation) -> dpa.PrivacyAccountant:
        """A new accountant with nothing composed."""
        return self.build(relation.dp_accounting)


def _rdp(relation: dpa.NeighboringRelation) -> dpa.PrivacyAccountant:
    return RdpAccountant(neighboring_relation=relation)


ACCOUNTANT_KINDS: dict[str, AccountantKind] = {
    "rdp": AccountantKind("rdp", _rdp, True, dpa_adapter.rdp_curve, True),
    "pld": AccountantKind("pld", PLDAccountant, False, dpa_adapter.pld_curve, False, "rdp"),
}
ACCOUNTANTS: tuple[str, ...] = tuple(ACCOUNTANT_KINDS)


def accountant_kind(value: Any, key: str = "accountant") -> AccountantKind:
    """The accountant named ``value``, else :class:`ConfigError` naming ``key``."""
    require(value in ACCOUNTANT_KINDS, key, value, "one of 'rdp', 'pld'")
    return ACCOUNTANT_KINDS[value]


def _gaussian_for(z: float, halve: bool) -> dpa.DpEvent:
    if z == 0:
        return dpa.NonPrivateDpEvent()
    if math.isinf(z):
        return dpa.NoOpDpEvent()
    return dpa.GaussianDpEvent(z / 2 if halve else z)


def for_accountant(
    event: dpa.DpEvent, accountant: str, relation: NeighbouringRelation | str
) -> dpa.DpEvent:
    """``event`` as ``accountant`` must see it under ``relation`` (see the module docstring).

    Halves Gaussian noise multipliers for the RDP accountant under replace-one, and reduces the
    event inside a sampled event to one Gaussian (:func:`effective_noise_multiplier`; the PLD
    accountant takes only a plain Gaussian there). A zCDP event becomes, for the RDP
    accountant, the Gaussian ``z = 1 / sqrt(2 rho)`` of equal RDP. Anything else is left for the
    accountant to accept or reject.
    """
    relation = NeighbouringRelation.parse(relation)
    kind = accountant_kind(accountant)
    halve = kind.halves_replace_one and relation is NeighbouringRelation.REPLACE_ONE

    def convert(e: dpa.DpEvent) -> dpa.DpEvent:
        event_kind = kind_of(e)
        if event_kind is None:
            return e
        if event_kind.cls is dpa.GaussianDpEvent:
            return _gaussian_for(e.noise_multiplier, halve)
        if event_kind.cls is dpa.ZCDpEvent:
            if not kind.zcdp_as_gaussian:
                return e
            return _gaussian_for(math.inf if e.rho == 0 else 1.0 / math.sqrt(2 * e.rho), halve)
        if event_kind.sampled:
            z = effective_noise_multiplier(e.event)
            if z is None:
                return e
            if z == 0 or math.isinf(z):
                return _gaussian_for(z, halve)  # no noise: no amplification; no release: no-op
            return event_kind.rebuild(e, lambda _: _gaussian_for(z, halve))
        return event_kind.rebuild(e, convert)

    return convert(event)


def supports(event: dpa.DpEvent, accountant: str, relation: NeighbouringRelation) -> bool:
    """Whether ``accountant`` can account ``event`` under ``relation``."""
    return (
        accountant_kind(accountant)
        .fresh(relation)
        .supports(for_accountant(event, accountant, relation))
    )


def unsupported(
    event: dpa.DpEvent, accountant: str, relation: NeighbouringRelation, subject: str
) -> ConfigError:
    """The error for an event ``accountant`` cannot account under ``relation``, blaming the
    one setting whose change would make it work."""
    working = [
        (acc, rel)
        for acc in ACCOUNTANTS
        for rel in NeighbouringRelation
        if supports(event, acc, rel)
    ]
    options = ", ".join(f"{acc} with {rel.value}" for acc, rel in working) or "none"
    detail = f"dp_accounting supports {subject} only as: {options}"
    other_relations = [rel.value for acc, rel in working if acc == accountant]
    if other_relations:
        return ConfigError(
            "relation",
            relation.value,
            f"{' or '.join(other_relations)} with the {accountant} accountant ({detail})",
        )
    other_accountants = [acc for acc, rel in working if rel is relation]
    if other_accountants:
        return ConfigError(
            "accountant",
            accountant,
            f"{' or '.join(other_accountants)} under {relation.value} neighbours ({detail})",
        )
    return ConfigError("accountant", accountant, f"a supported combination ({detail})")


def account(
    event: dpa.DpEvent,
    accountant: str,
    relation: NeighbouringRelation,
    delta: float,
    subject: str = "this event",
) -> float:
    """Epsilon of ``event`` (checked arguments), or :func:`unsupported`'s error."""
    acc = accountant_kind(accountant).fresh(relation)
    translated = for_accountant(event, accountant, relation)
    if not acc.supports(translated):
        raise unsupported(event, accountant, relation, subject)
    return float(acc.compose(translated).get_epsilon(delta))


def event_epsilon(
    event: dpa.DpEvent, accountant: Accountant, relation: NeighbouringRelation | str, delta: float
) -> float:
    """Epsilon (nats) at ``delta`` of ``event`` (its noise multipliers ``std / C``) under
    ``relation``, by ``accountant``; a ConfigError when that combination is unsupported."""
    return account(
        event,
        accountant_kind(accountant).name,
        NeighbouringRelation.parse(relation),
        check_delta(delta),
    )

