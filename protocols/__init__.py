"""Pure cryptographic protocols over numpy arrays (no Ray, no Flower).

Shared primitives at the top level (field, shamir, encoding, channels, enrolment) and the kit
every protocol uses (:mod:`protocols.kit`); one package per protocol -- :mod:`protocols.secagg`,
:mod:`protocols.committee`, :mod:`protocols.dmm` (with its resharing) -- each with ``common``
(stages, parameters, messages, errors), ``client``, ``member`` (where it has members) and
``server``."""
