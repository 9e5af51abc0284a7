"""The accounting functions ``docs/privacy-and-accounting.md`` names, under their documented
path: :func:`epsilon`, :func:`epsilon_curve`, :func:`calibrate_noise`, :class:`PrivacyLedger`,
and the sampling models and participation they take.

They live in :mod:`fedsim.privacy.epsilon`, :mod:`fedsim.privacy.calibration` and
:mod:`fedsim.privacy.ledger`; sampling models are in :mod:`fedsim.privacy.sampling`, the
participation type in :mod:`fedsim.privacy.participation`, events in
:mod:`fedsim.privacy.round_events`, accountants in :mod:`fedsim.privacy.accountant`.
"""

from fedsim.privacy.calibration import calibrate_noise
from fedsim.privacy.epsilon import epsilon, epsilon_curve
from fedsim.privacy.ledger import PrivacyLedger
from fedsim.privacy.participation import Participation
from fedsim.privacy.sampling import (
    FixedSizeSampling,
    FullParticipation,
    NeighbouringRelation,
    PoissonSampling,
)

__all__ = [
    "FixedSizeSampling",
    "FullParticipation",
    "NeighbouringRelation",
    "Participation",
    "PoissonSampling",
    "PrivacyLedger",
    "calibrate_noise",
    "epsilon",
    "epsilon_curve",
]
