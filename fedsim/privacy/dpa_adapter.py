"""The one module that reads ``dp_accounting``'s private state (tested against 0.6.0).

dp_accounting recomputes an event's RDP curve or PLD (tenths of a second each) on every
``compose``. Two speed-ups read an accountant after it composed one round, never write it:

- ``RdpAccountant._orders`` / ``._rdp``: the orders and the composed RDP vector; ``count *
  rdp`` goes through ``rdp_privacy_accountant.compute_epsilon`` (what ``get_epsilon`` calls);
- ``PLDAccountant._pld`` / ``._contains_non_dp_event``: the composed PLD; ``self_compose(c)``
  is what ``PLDAccountant`` does for ``SelfComposedDpEvent``.

Both return None when the state is not there (another version); callers then compose.
:class:`CachedAccountant` overrides ``PrivacyAccountant._maybe_compose``, the hook
``supports`` and ``compose`` both call. ``tests/privacy/test_privacy_dpa_adapter.py`` pins all of
it.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import dp_accounting as dpa
from dp_accounting.rdp import rdp_privacy_accountant as rdp_accountant


def rdp_curve(
    one: dpa.PrivacyAccountant, translated: dpa.DpEvent, counts: Sequence[int], delta: float
) -> list[float] | None:
    """Epsilon at ``delta`` after each count of self-compositions of the round ``one`` (an
    ``RdpAccountant``) composed; None without ``_rdp`` / ``_orders``."""
    rdp, orders = getattr(one, "_rdp", None), getattr(one, "_orders", None)
    if rdp is None or orders is None:
        return None
    return [
        0.0 if c == 0 else float(rdp_accountant.compute_epsilon(orders, c * rdp, delta)[0])
        for c in counts
    ]


def pld_curve(
    one: dpa.PrivacyAccountant, translated: dpa.DpEvent, counts: Sequence[int], delta: float
) -> list[float] | None:
    """The same for a ``PLDAccountant`` that composed one Poisson-sampled round; None for other
    rounds, a non-DP round, or without ``_pld``."""
    pld = getattr(one, "_pld", None)
    if not isinstance(translated, dpa.PoissonSampledDpEvent) or pld is None:
        return None
    if getattr(one, "_contains_non_dp_event", True):
        return None
    return [
        0.0 if c == 0 else float(pld.self_compose(c).get_epsilon_for_delta(delta)) for c in counts
    ]


class CachedAccountant(dpa.PrivacyAccountant):
    """A calibration's accountant: epsilon of the composed events, looked up in a cache that
    all accountants of one calibration share (keyed by the events' repr and delta), else
    computed by a fresh accountant from ``fresh``.

    The bracket search, ``calibrate_dp_mechanism``'s evaluation of the bracket's endpoints and
    its final check then account each noise multiplier once (a Poisson-sampled PLD takes about
    half a second to build). Support checks go to the real accountant.
    """

    def __init__(
        self,
        fresh: Callable[[], dpa.PrivacyAccountant],
        relation: dpa.NeighboringRelation,
        cache: dict[tuple[str, float], float],
    ) -> None:
        super().__init__(relation)
        self._fresh = fresh
        self._cache = cache
        self._events: list[tuple[dpa.DpEvent, int]] = []

    def _maybe_compose(
        self, event: dpa.DpEvent, count: int, do_compose: bool
    ) -> dpa.PrivacyAccountant.CompositionErrorDetails | None:
        if not do_compose:
            return self._fresh()._maybe_compose(event, count, False)
        self._events.append((event, count))
        return None

    def get_epsilon(self, target_delta: float) -> float:
        key = (repr(self._events), float(target_delta))
        if key not in self._cache:
            real = self._fresh()
            for event, count in self._events:
                real.compose(event, count)
            self._cache[key] = float(real.get_epsilon(target_delta))
        return self._cache[key]
