"""The user's own code and files for the tests of ``[model] factory`` and ``[data] source =
"python"`` / ``"table"``: a module written to a temporary directory (imported through
``python_path``, never from the tests' own path) and tables written as CSV and Parquet."""

from __future__ import annotations

import textwrap
from pathlib import Path

import numpy as np

#: the user's module: a model factory that records devices, loaders of each form, bad ones
USER_MODULE = textwrap.dedent(
    '''
    """A user's model and data, outside fedsim."""
    import os

    import numpy as np
    import torch
    from torch import nn


    class Recorder(nn.Module):
        """A small MLP that appends, per forward call, the device of its input batch, of its
        first parameter, the batch's shape and the process id to the file ``log`` (when
        given)."""

        def __init__(self, features, num_classes, width, log):
            super().__init__()
            self.hidden = nn.Linear(features, width)
            self.out = nn.Linear(width, num_classes)
            self.log = log

        def forward(self, x):
            if self.log:
                with open(self.log, "a") as fh:
                    fh.write(
                        f"{x.device} {self.hidden.weight.device} {os.getpid()} "
                        f"{tuple(x.shape)}\\n"
                    )
            return self.out(torch.relu(self.hidden(x.flatten(1))))


    def make(input_shape, num_classes, width=8, log=""):
        return Recorder(int(np.prod(input_shape)), num_classes, width, log)


    def make_without_data_arguments(width=4):
        return nn.Sequential(nn.Flatten(), nn.Linear(5, width), nn.ReLU(), nn.Linear(width, 3))


    def not_a_module(input_shape, num_classes):
        return "a model"


    def wrong_output(input_shape, num_classes):
        return nn.Linear(int(np.prod(input_shape)), num_classes + 1)


    def _client(rng, rows, shift):
        y = rng.integers(0, 3, rows)
        x = rng.normal(size=(rows, 5)) + 2.0 * y[:, None] + shift
        return x, y


    def clients(count=8, rows=30, seed=0):
        rng = np.random.default_rng(seed)
        return {f"user-{k}": _client(rng, rows, 0.1 * k) for k in range(count)}


    def pooled(rows=200, seed=0):
        return _client(np.random.default_rng(seed), rows, 0.0)


    def with_test(count=4, seed=0):
        rng = np.random.default_rng(seed)
        train = {f"user-{k}": _client(rng, 20, 0.0) for k in range(count)}
        test = {f"user-{k}": _client(rng, 5 + k, 0.0) for k in range(count - 1)}
        return train, test


    def mismatched_lengths():
        return {"a": (np.zeros((4, 5)), np.zeros(3, dtype=np.int64))}


    def empty_client():
        return {"a": (np.zeros((4, 5)), np.zeros(4, dtype=np.int64)),
                "b": (np.zeros((0, 5)), np.zeros(0, dtype=np.int64))}


    def float_labels():
        return {"a": (np.zeros((4, 5)), np.array([0.0, 1.0, 0.5, 1.0]))}


    def negative_labels():
        return {"a": (np.zeros((4, 5)), np.array([0, 1, -1, 1]))}


    def other_features():
        return {"a": (np.zeros((4, 5)), np.array([0, 1, 0, 1])),
                "b": (np.zeros((4, 6)), np.array([0, 1, 0, 1]))}


    def flat_x():
        return {"a": (np.zeros(4), np.array([0, 1, 0, 1]))}


    def one_class():
        return {"a": (np.zeros((4, 5)), np.zeros(4, dtype=np.int64))}


    def a_list():
        return [1, 2, 3]


    def unknown_test_client():
        train = {"a": (np.zeros((4, 5)), np.array([0, 1, 0, 1]))}
        return train, {"z": (np.zeros((2, 5)), np.array([0, 1]))}


    NOT_CALLABLE = 3
    '''
)


def write_user_module(directory: Path, name: str = "byo_user") -> Path:
    """Write the user's module into ``directory`` (created); returns the directory."""
    directory.mkdir(parents=True, exist_ok=True)
    (directory / f"{name}.py").write_text(USER_MODULE)
    return directory


def write_tables(directory: Path, clients: int = 8, rows: int = 30) -> dict[str, Path]:
    """A CSV table with a ``user`` client column and a Parquet table without one (both with
    a ``target`` label column and five numeric feature columns)."""
    import pyarrow as pa
    import pyarrow.csv as pacsv
    import pyarrow.parquet as pq

    rng = np.random.default_rng(5)
    n = clients * rows
    y = rng.integers(0, 3, n)
    x = rng.normal(size=(n, 5)) + 2.0 * y[:, None]
    columns = {f"f{j}": x[:, j] for j in range(5)}
    with_clients = pa.table({"user": np.repeat(np.arange(clients), rows), "target": y, **columns})
    without = pa.table({"target": y, **columns})
    directory.mkdir(parents=True, exist_ok=True)
    paths = {"csv": directory / "rows.csv", "parquet": directory / "rows.parquet"}
    pacsv.write_csv(with_clients, paths["csv"])
    pq.write_table(without, paths["parquet"])
    return paths
