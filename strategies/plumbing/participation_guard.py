"""The participation an accountant assumes, enforced where the instructions leave.

The matrix mechanism's sensitivity sens(C) (Choquette-Choo et al. 2023, Def. 2 and Thm. 2:
b-min-separation, at most k participations) and DP-FedAvg's min-separation accounting are
promises about *who trains when*. A cohort that breaks them (a Python caller who declared
single participation and then trains every client every round) makes the reported epsilon
optimistic. So the strategy checks every train instruction against the schema before it
leaves: a client whose participation would break it gets no instruction that round, and is
named under the round metric ``participation-refused``.

A client counts as having participated when it was *sent* an instruction (whether or not it
answered): the conservative reading, since a reply may arrive or not. Times are the
mechanism's row indices (0-based rounds of the factorization).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

from flwr.app import Message

from fedsim.privacy.participation import Participation


@dataclass
class ParticipationGuard:
    """Admits a client at row ``t`` only if its rows so far plus ``t`` fit ``schema``:

    * ``single``: no earlier row;
    * ``min_sep``: at least ``min_sep`` rows after its last, fewer than ``max_participations``
      (None: as many as fit in ``rounds``) so far;
    * ``fixed_epoch``: rows ``r, r + n/epochs, r + 2 n/epochs, ...`` only.
    """

    def __post_init__(self) -> None:
        open_ended = self.rounds is None
        if open_ended and (self.schema.kind == "fixed_epoch" or (
            self.schema.kind == "min_sep" and self.schema.max_participations is None
        )):
            raise ValueError(
                f"participation {self.schema!r} needs the number of rounds; allowed without "
                "one: single, or min_sep with max_participations"
            )

    schema: Participation
    #: the factorization's n (None: an open-ended run, where ``min_sep`` needs
    #: ``max_participations``)
    rounds: int | None = None
    #: node id -> (first row, last row, participations)
    history: dict[int, tuple[int, int, int]] = field(default_factory=dict)

    def refusal(self, node: int, row: int) -> str | None:
        """Why ``node`` may not train at ``row`` (None: it may)."""
        if node not in self.history:
            return None
        first, last, count = self.history[node]
        schema = self.schema
        if row <= last:
            return f"it was already sent row {last}"
        if schema.kind == "single":
            return f"single participation, and it trained at row {first}"
        if schema.kind == "fixed_epoch":
            period = self.rounds // schema.epochs
            if (row - first) % period:
                return f"fixed-epoch order: its rows are {first} + multiples of {period}"
            return None
        limit = (
            schema.max_participations if self.rounds is None else schema.participations(self.rounds)
        )
        if count >= limit:
            return f"it has trained {count} times, the most the accounting allows ({limit})"
        if row - last < schema.min_sep:
            return (
                f"{schema.min_sep}-min-separation, and it trained at row {last} "
                f"({row - last} rows before)"
            )
        return None

    def take(self, node: int, row: int) -> str | None:
        """Record that ``node`` trains at ``row`` if it may (None), else return why not."""
        refusal = self.refusal(node, row)
        if refusal is None:
            first, _, count = self.history.get(node, (row, row, 0))
            self.history[node] = (first, row, count + 1)
        return refusal

    def admit(self, row: int, messages: Iterable[Message]) -> tuple[list[Message], list[int]]:
        """(the instructions that may leave, the nodes refused); records the admitted ones."""
        admitted: list[Message] = []
        refused: list[int] = []
        for message in messages:
            node = int(message.metadata.dst_node_id)
            if self.take(node, row) is None:
                admitted.append(message)
            else:
                refused.append(node)
        return admitted, sorted(refused)
