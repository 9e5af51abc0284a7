"""Pure cryptographic protocols over numpy arrays (no Ray, no Flower).

Shared primitives at the top level (field, shamir, encoding, channels, enrolment) and the kit
every protocol uses (:mod:`protocols.kit`); one package per protocol -- :mod:`protocols.secagg`,
:mod:`protocols.committee`, :mod:`protocols.dmm` (with its resharing) -- each with ``common``
(stages, parameters, messages, errors), ``client``, ``member`` (where it has members) and
``server``. A party's steps are stage handlers ``(state, message) -> (state, reply)`` in
``stages.py`` over the value it keeps between stages in ``state.py`` (the SecAgg+ client, the
committee and DMM members; DMM's resharing in ``reshare_stages.py``); ``client`` and ``member``
hold that state and run the handlers for the hosts."""
