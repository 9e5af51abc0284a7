"""The server's own secret: where strategies that add noise draw it from.

A strategy that releases its own noise (DP-FedAvg, adaptive clipping's count, the central
matrix mechanism, POPri, Private Evolution) mixes in :class:`ServerNoise` and draws round
``t``'s noise from ``server_secret.generator(t, Purpose.NOISE, *words)``
(:mod:`fedsim.randomness`): a stateless stream, so a resumed run redraws exactly the noise an
uninterrupted one would, and nothing about the noise is ever stored. The secret is never the
run seed and never anything a client can see.

The front end binds the run's :meth:`~fedsim.randomness.RunSecret.server` secret with
:func:`bind_parties`, which walks the wrapper chain (:func:`fedsim.engine.hooks.layers`)
and binds every layer that declares it takes the secret (or the committee host, the
committee: :mod:`fedsim.engine.hooks`). A strategy used on its own, unbound, binds a fresh OS
secret the first time it needs one (never a seeded fallback). Pickling (checkpoints) drops
the bound secret; the front end binds again after ``--resume``.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from fedsim.engine.hooks import CommitteeBound, CommitteeHostBound, ServerSecretBound, layers
from fedsim.randomness import PartySecret, Purpose


class ServerNoise:
    """Mixin: the strategy's noise comes from the server's :class:`PartySecret`."""

    _server_secret: PartySecret | None = None

    def bind_server_secret(self, secret: PartySecret) -> None:
        """Draw this strategy's noise from ``secret`` (the run's server secret)."""
        if not isinstance(secret, PartySecret):
            raise TypeError(f"secret is a {type(secret).__name__}, not a fedsim PartySecret")
        self._server_secret = secret

    def server_secret(self) -> PartySecret:
        """The bound secret; a fresh one from the OS when none was bound."""
        secret = self.__dict__.get("_server_secret")
        if secret is None:
            secret = self._server_secret = PartySecret.fresh("server")
        return secret

    def noise_generator(self, server_round: int, *words: Any) -> np.random.Generator:
        """Round ``server_round``'s noise stream for ``words`` (e.g. ``"update"``)."""
        return self.server_secret().generator(int(server_round), Purpose.NOISE, *words)

    def __getstate__(self) -> dict[str, Any]:
        state = dict(self.__dict__)
        state.pop("_server_secret", None)  # secrets stay with their party, out of checkpoints
        return state


def bind_parties(
    strategy: Any, server: PartySecret, committee_host: Any = None, committee: Any = None
) -> None:
    """Bind ``server`` (and ``committee_host`` -- DMM's -- and ``committee`` -- DDGauss's --
    when given) to every layer of ``strategy``'s wrapper chain
    (:func:`fedsim.engine.hooks.layers`) that declares it takes it (the protocols
    ``ServerSecretBound``, ``CommitteeHostBound``, ``CommitteeBound`` of
    :mod:`fedsim.engine.hooks`)."""
    for layer in layers(strategy):
        if isinstance(layer, ServerSecretBound):
            layer.bind_server_secret(server)
        if committee_host is not None and isinstance(layer, CommitteeHostBound):
            layer.bind_committee_host(committee_host)
        if committee is not None and isinstance(layer, CommitteeBound):
            layer.bind_committee(committee)
