"""The population of virtual clients: node ids, partition ids and node configs.

A federation of ``N`` registered clients is described by ``N`` alone: client
(partition) ``k`` has Flower node id ``NODE_ID_OFFSET + k``. Nothing is stored
per client, so registering 10^6 clients costs nothing and every lookup is O(1).
Node ids start at 2^32 so they never collide with the SuperLink's node id (1)
or the ServerApp context's node id (0).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from flwr.common.constant import NUM_PARTITIONS_KEY, PARTITION_ID_KEY

from fedsim.config import require

NODE_ID_OFFSET = 1 << 32


@dataclass(frozen=True, slots=True)
class ClientRegistry:
    """``num_clients`` virtual clients with node ids ``NODE_ID_OFFSET + k``."""

    num_clients: int

    def __post_init__(self) -> None:
        require(
            isinstance(self.num_clients, int) and self.num_clients >= 1,
            "num_clients",
            self.num_clients,
            "an integer >= 1",
        )

    def node_ids(self) -> range:
        """All node ids, as a ``range`` (O(1) memory, supports ``len`` and ``in``)."""
        return range(NODE_ID_OFFSET, NODE_ID_OFFSET + self.num_clients)

    def node_id(self, partition_id: int) -> int:
        """The node id of client ``partition_id``."""
        if not 0 <= partition_id < self.num_clients:
            raise ValueError(
                f"partition id {partition_id} is outside the population [0, {self.num_clients - 1}]"
            )
        return NODE_ID_OFFSET + int(partition_id)

    def node_ids_of(self, partition_ids: np.ndarray) -> list[int]:
        """Node ids of many partitions at once."""
        return (np.asarray(partition_ids, dtype=np.int64) + NODE_ID_OFFSET).tolist()

    def partition_id(self, node_id: int) -> int:
        """The partition (client index) behind ``node_id``; a clear error if unknown."""
        partition = node_id - NODE_ID_OFFSET
        if not 0 <= partition < self.num_clients:
            raise ValueError(
                f"message addressed to node id {node_id}, which is not a registered "
                f"client; node ids are {NODE_ID_OFFSET}..{NODE_ID_OFFSET + self.num_clients - 1}"
            )
        return partition

    def node_config(self, node_id: int) -> dict[str, int]:
        """The ``node_config`` Flower's simulation gives each node."""
        return {PARTITION_ID_KEY: self.partition_id(node_id), NUM_PARTITIONS_KEY: self.num_clients}
