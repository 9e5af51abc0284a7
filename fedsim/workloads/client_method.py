"""A client method that talks to its clients: a ``[client.<key>]`` table, the training it
selects and, optionally, its server half (issue 28, point 5: registered, not an if-ladder).

The server half (:class:`ServerHalf`) puts one record of arrays into every train instruction
of a round under its :attr:`ServerHalf.key` and reads back the record each client's reply
carries under the same key; the client's training declares that key in
:attr:`~fedsim.workloads.training.ClientTraining.inputs`, finds the server's record in
:attr:`~fedsim.workloads.training.TrainTask.inputs` and returns its own in
:attr:`~fedsim.workloads.training.TrainResult.replies`
(:func:`fedsim.workloads.client_app.training_app` moves both). The front end wraps the run's
strategy in :class:`strategies.plumbing.client_method_halves.ServerHalfStrategy` for every
configured method with a server half; such replies are not folded on workers, and they carry
un-noised client content, so these methods run only with strategies that make no privacy claim.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from fedsim.models import ModelSpec
from fedsim.workloads.training import ClientTraining, Exclusion, LocalSteps

Arrays = dict[str, np.ndarray]


class ServerHalf(ABC):
    """The server side of a client method: per-round content for the clients, and what the
    round's replies change (a method's state lives in its instance, one per run)."""

    key: str  #: the record's key in the train instruction and in each reply

    @abstractmethod
    def instruction(self, server_round: int, arrays: Arrays) -> Arrays:
        """The record every client of ``server_round`` gets, given the global ``arrays``
        the round sends."""

    @abstractmethod
    def aggregate(self, server_round: int, replies: list[Arrays], new: Arrays) -> Arrays:
        """The round's global arrays: ``new`` (the wrapped strategy's aggregate), changed by
        the method given the records of the successful ``replies``."""


@dataclass(frozen=True)
class ClientMethod:
    """One registered client method (:data:`fedsim.workloads.supervised.CLIENT_METHODS`).

    Attributes:
        key: its table, ``[client.<key>]`` (a field of the ``[client]`` config class).
        table: the frozen dataclass the table is read into.
        excludes: what it cannot be combined with (:class:`Exclusion`).
        training: ``training(model, steps, table)`` -> the client training it selects.
        server: ``server(table, population)`` -> its :class:`ServerHalf` (None: none).
        example: the table of a tiny run (the differential check,
            ``experiments/differential/run.py``, runs it under FedAvg).
    """

    key: str
    table: type
    excludes: tuple[Exclusion, ...]
    training: Callable[[ModelSpec, LocalSteps, Any], ClientTraining]
    server: Callable[[Any, int], ServerHalf] | None = None
    example: Mapping[str, Any] = field(default_factory=dict)
