"""A federation of short texts (:class:`TextFederation`) and the seeded train / held-out split
every text source uses (:func:`split_clients`).

Splits. Each client's texts are shuffled with ``SeedSequence([seed, client index])`` and the
first ``max(1, round(held_out_fraction * n))`` go to its held-out split, the rest to its train
split (clients keep at least one training text).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from fedsim.config import require


@dataclass(frozen=True)
class TextFederation:
    """Clients' texts split into train and held-out, plus a public set.

    Attributes:
        name: where the texts come from.
        client_ids: one name per client (module path, or the file's client id).
        train: per client, its training (private) texts.
        held_out: per client, its held-out texts (evaluation only).
        public: texts from outside the federation (prompt examples).
    """

    name: str
    client_ids: tuple[str, ...]
    train: tuple[tuple[str, ...], ...]
    held_out: tuple[tuple[str, ...], ...]
    public: tuple[str, ...]

    def __post_init__(self) -> None:
        n = len(self.client_ids)
        require(
            len(self.train) == n and len(self.held_out) == n,
            "clients",
            (n, len(self.train), len(self.held_out)),
            "as many train and held-out splits as client ids",
        )

    @property
    def num_clients(self) -> int:
        return len(self.client_ids)

    def client_texts(self, client: int) -> tuple[str, ...]:
        """Client ``client``'s training texts (``client`` in ``[0, num_clients)``)."""
        require(
            isinstance(client, (int, np.integer)) and 0 <= client < self.num_clients,
            "client",
            client,
            f"an integer in [0, {self.num_clients})",
        )
        return self.train[int(client)]

    def all_train(self) -> list[str]:
        """Every client's training texts, client by client."""
        return [t for texts in self.train for t in texts]

    def all_held_out(self) -> list[str]:
        """Every client's held-out texts, client by client."""
        return [t for texts in self.held_out for t in texts]

    def stats(self) -> dict[str, Any]:
        """:meth:`summary` (what a run's summary.json says of its data, as
        :meth:`fedsim.data.dataset.FederatedDataset.stats`)."""
        return self.summary()

    def summary(self) -> dict[str, Any]:
        sizes = np.array([len(t) for t in self.train]) if self.train else np.zeros(1)
        return {
            "name": self.name,
            "clients": self.num_clients,
            "train_texts": int(sizes.sum()),
            "held_out_texts": len(self.all_held_out()),
            "public_texts": len(self.public),
            "texts_per_client_min": int(sizes.min()),
            "texts_per_client_median": float(np.median(sizes)),
            "texts_per_client_max": int(sizes.max()),
        }


def split_clients(
    name: str,
    clients: Sequence[tuple[str, Sequence[str]]],
    public: Sequence[str],
    held_out_fraction: float,
    seed: int,
) -> TextFederation:
    require(
        0 <= held_out_fraction < 1,
        "held_out_fraction",
        held_out_fraction,
        "a number in [0, 1)",
    )
    train, held = [], []
    for index, (_, texts) in enumerate(clients):
        order = np.random.default_rng(np.random.SeedSequence([seed, index])).permutation(len(texts))
        shuffled = [texts[i] for i in order]
        n_held = 0 if held_out_fraction == 0 else max(1, round(held_out_fraction * len(texts)))
        n_held = min(n_held, len(texts) - 1)
        held.append(tuple(shuffled[:n_held]))
        train.append(tuple(shuffled[n_held:]))
    return TextFederation(
        name=name,
        client_ids=tuple(c for c, _ in clients),
        train=tuple(train),
        held_out=tuple(held),
        public=tuple(public),
    )
