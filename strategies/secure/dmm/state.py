"""One DMM round in flight on the server: what ``configure_train`` sent and what
``aggregate_train`` needs to check the replies against. It lives for one round only and is
never checkpointed (a resumed run starts its round again)."""

from __future__ import annotations

from dataclasses import dataclass, field

from protocols.dmm.common import DMMFaults, RoundKeys
from strategies.secure.dmm.fold import fold_party


@dataclass
class RoundState:
    """Server round ``round``: ``sent`` maps each instructed node to its channel party,
    ``faults`` the member faults injected, ``committee`` the seats' client ids and ``next``
    the committee the state is handed to; full mode adds the round's public ``keys``.
    Replies fill ``folded`` (node -> the worker reply that holds it) and ``batches`` (a
    folded reply's first node -> the nodes it holds)."""

    round: int
    sent: dict[int, int]
    faults: DMMFaults
    committee: list[int]
    next: list[int]
    keys: RoundKeys | None = None
    folded: dict[int, int] = field(default_factory=dict)
    batches: dict[int, list[int]] = field(default_factory=dict)

    def cohort(self) -> list[int]:
        """The instructed nodes in party order."""
        return sorted(self.sent, key=self.sent.get)

    def party(self, nodes) -> int:
        """The channel party of a folded batch of ``nodes``
        (:func:`strategies.secure.dmm.fold.fold_party`, as the fold seals)."""
        return fold_party(len(self.sent), (self.sent[n] for n in nodes))

    def party_of(self, node: int) -> int:
        """The channel party of the reply keyed by ``node`` (a folded batch's, or its own)."""
        return self.party(self.batches[node]) if node in self.batches else self.sent[node]

    def weight(self, node: int) -> int:
        """How many clients the reply keyed by ``node`` holds."""
        return len(self.batches.get(node, [node]))

    def seat_client(self, seat: int) -> int:
        """The client id of seat ``seat`` of this round's committee."""
        return int(self.committee[seat])
