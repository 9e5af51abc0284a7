"""Federated datasets: sources (bundled, synthetic, LEAF JSON, local Parquet/JSONL),
partitioners, a client-contiguous array layout and reproducible dataset specs."""

from fedsim.data.dataset import ClientArrays, FederatedDataset, from_partition
from fedsim.data.femnist import femnist_like
from fedsim.data.partition import (
    PARTITIONERS,
    dirichlet_partition,
    iid_partition,
    partition_stats,
    quantity_skew_partition,
    shard_partition,
    split_classes_partition,
)
from fedsim.data.sources import (
    load_digits,
    load_leaf,
    load_table,
    synthetic_fedprox,
)
from fedsim.data.spec import DatasetSpec, build_dataset, cached_dataset, register_dataset

__all__ = [
    "PARTITIONERS",
    "ClientArrays",
    "DatasetSpec",
    "FederatedDataset",
    "build_dataset",
    "cached_dataset",
    "dirichlet_partition",
    "femnist_like",
    "from_partition",
    "iid_partition",
    "load_digits",
    "load_leaf",
    "load_table",
    "partition_stats",
    "quantity_skew_partition",
    "register_dataset",
    "shard_partition",
    "split_classes_partition",
    "synthetic_fedprox",
]
