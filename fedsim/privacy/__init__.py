"""Privacy: accounting (dp_accounting events and ledgers) and noise mechanisms.

Modules:

- :mod:`fedsim.privacy.accounting` -- sampling models, neighbouring relations, per-round
  ``dp_accounting`` events, the run's :class:`~fedsim.privacy.ledger.PrivacyLedger`,
  epsilon and noise calibration;
- :mod:`fedsim.privacy.participation` -- :class:`~fedsim.privacy.participation.Participation`,
  the one participation type (single, b-min-separation with k participations, fixed epochs)
  that the accountant, the matrix sensitivity, the engine's schedule and the guard read;
- :mod:`fedsim.privacy.events` -- an explicit JSON (de)serialiser for the event classes used;
- :mod:`fedsim.privacy.mechanisms` -- Gaussian, exact discrete Gaussian and Skellam noise.

The ``fedsim account`` command over these is :mod:`fedsim.commands.account`.

Nothing here imports Ray or Flower.
"""
