"""Data sources: bundled, synthetic and local files, each as centralised or per-client arrays.

* :func:`load_digits` — scikit-learn's bundled 8x8 digits (centralised).
* :func:`synthetic_fedprox` — synthetic(alpha, beta) of Li et al. (FedProx, MLSys 2020),
  also in LEAF (Caldas et al., 2018); one part per device.
* :func:`~fedsim.data.femnist.femnist_like` — a generated stand-in for FEMNIST: 62 glyph
  classes rendered with per-writer style; one part per writer (:mod:`fedsim.data.femnist`).
* :func:`load_leaf` — LEAF JSON files, one part per user.
* :func:`load_table` — a local Parquet / CSV / JSON Lines file, with or without client ids.

Per-client sources return ``list[(x_k, y_k)]`` with ``y_k`` int64; the arrays of all
parts are views of one pooled array where possible.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np

from fedsim.config import ConfigError, require

ClientData = list[tuple[np.ndarray, np.ndarray]]

#: labels are class indices below this (the model's output layer has one unit per class)
MAX_CLASSES = 2**20


def label_problem(y: np.ndarray) -> str | None:
    """None when every label is an integer class index in ``[0, MAX_CLASSES)``; else the
    first offending label and its row (0-based), in words."""
    y = np.asarray(y)
    if y.size == 0:
        return None
    bad = np.flatnonzero((y < 0) | (y >= MAX_CLASSES))
    if bad.size == 0:
        return None
    row = int(bad[0])
    return (
        f"label {int(y[row])} at row {row}: labels must be >= 0 and below {MAX_CLASSES} "
        "(the model gets one output per class up to the largest)"
    )


def non_finite_problem(x: np.ndarray, columns: tuple[str, ...] | None = None) -> str | None:
    """None when ``x`` (rows first) is finite; else where the first NaN or infinity is: its
    row (0-based) and, with ``columns`` naming x's columns, its column."""
    flat = np.asarray(x).reshape(len(x), -1)
    bad = ~np.isfinite(flat)
    if not bad.any():
        return None
    row, col = (int(i) for i in np.argwhere(bad)[0])
    kind = "NaN" if np.isnan(flat[row, col]) else "an infinity"
    where = (
        f"column {columns[col]!r}"
        if columns and len(columns) == flat.shape[1]
        else (f"feature {col}")
    )
    return f"{kind} in {where} at row {row} (features must be finite numbers)"


def check_count(value: int, key: str, minimum: int = 1) -> None:
    ok = isinstance(value, (int, np.integer)) and not isinstance(value, bool)
    require(ok and value >= minimum, key, value, f"an integer >= {minimum}")


def split_rows(x: np.ndarray, y: np.ndarray, sizes: np.ndarray) -> ClientData:
    """Views ``(x[a:b], y[a:b])`` for consecutive blocks of the given sizes."""
    ends = np.cumsum(sizes)
    starts = ends - sizes
    return [(x[a:b], y[a:b]) for a, b in zip(starts.tolist(), ends.tolist())]


# --------------------------------------------------------------------------- digits


def load_digits() -> tuple[np.ndarray, np.ndarray]:
    """scikit-learn's bundled handwritten digits (no download).

    Returns x: (1797, 1, 8, 8) float32 in [0, 1] (pixel counts 0..16 divided by 16)
    and y: (1797,) int64 in 0..9.
    """
    from sklearn.datasets import load_digits as _sk_load_digits

    bunch = _sk_load_digits()
    x = (np.asarray(bunch.images, dtype=np.float32) / 16.0).reshape(-1, 1, 8, 8)
    return x, np.asarray(bunch.target, dtype=np.int64)


# --------------------------------------------------------------------------- synthetic(α, β)

#: Per-device sample counts follow the FedProx/LEAF generator,
#: ``int(LogNormal(4, 2)) + 50``, capped here at this many samples (the heavy tail
#: otherwise reaches 10^5 samples on a single device).
SYNTHETIC_MAX_SAMPLES = 1000


def synthetic_fedprox(
    num_clients: int,
    alpha: float,
    beta: float,
    rng: np.random.Generator,
    dim: int = 60,
    num_classes: int = 10,
    iid: bool = False,
) -> ClientData:
    """synthetic(alpha, beta): Li et al., "Federated Optimization in Heterogeneous
    Networks" (FedProx, MLSys 2020), Sec. 5.1; LEAF (Caldas et al., 2018).

    For device k: u_k ~ N(0, alpha), W_k ~ N(u_k, 1) of shape (dim, num_classes),
    b_k ~ N(u_k, 1); B_k ~ N(0, beta), v_k ~ N(B_k, 1) per feature; x ~ N(v_k, Sigma)
    with Sigma diagonal, Sigma_jj = j^(-1.2) (j = 1..dim); y = argmax softmax(W_k^T x + b_k).
    beta controls how much local inputs differ (and, through them, label skew).
    alpha is meant to control how much local models differ, but u_k adds the same
    amount to every class logit, which argmax ignores: for the same draws the labels
    do not depend on alpha (models differ through the unit-variance W_k, b_k draws
    alone). Kept as published. As in the reference code, alpha and beta are used as
    standard deviations.
    ``iid=True`` shares one W ~ N(0, 1), b ~ N(0, 1) and v = 0 across devices.
    Sample counts: ``min(int(LogNormal(4, 2)) + 50, SYNTHETIC_MAX_SAMPLES)``.

    Returns one ``(x_k (n_k, dim) float32, y_k (n_k,) int64)`` per device.
    """
    check_count(num_clients, "num_clients")
    check_count(dim, "dim")
    check_count(num_classes, "num_classes", 2)
    for key, val in (("alpha", alpha), ("beta", beta)):
        ok = isinstance(val, (int, float)) and val >= 0 and np.isfinite(val)
        require(ok, key, val, "a finite number >= 0")
    sizes = np.minimum(
        rng.lognormal(4.0, 2.0, size=num_clients).astype(np.int64) + 50, SYNTHETIC_MAX_SAMPLES
    )
    if iid:
        w_shared = rng.normal(0.0, 1.0, size=(dim, num_classes))
        b_shared = rng.normal(0.0, 1.0, size=num_classes)
        v = np.zeros((num_clients, dim))
    else:
        u = rng.normal(0.0, alpha, size=num_clients)
        big_b = rng.normal(0.0, beta, size=num_clients)
        v = rng.normal(big_b[:, None], 1.0, size=(num_clients, dim))
    std = np.arange(1, dim + 1, dtype=np.float64) ** (-1.2 / 2)  # sqrt(Sigma_jj)
    n = int(sizes.sum())
    owner = np.repeat(np.arange(num_clients), sizes)
    # labels are computed from the stored float32 features, so they are exact for them
    x = (v[owner] + rng.standard_normal((n, dim)) * std).astype(np.float32)
    y = np.empty(n, dtype=np.int64)
    ends = np.cumsum(sizes)
    for k in range(num_clients):  # one small matmul per device; W_k drawn when needed
        a, b = int(ends[k] - sizes[k]), int(ends[k])
        if iid:
            w_k, b_k = w_shared, b_shared
        else:
            w_k = rng.normal(u[k], 1.0, size=(dim, num_classes))
            b_k = rng.normal(u[k], 1.0, size=num_classes)
        y[a:b] = np.argmax(x[a:b].astype(np.float64) @ w_k + b_k, axis=1)  # softmax: monotone
    return split_rows(x, y, sizes)


# --------------------------------------------------------------------------- LEAF JSON


def _leaf_split(folder: Path) -> dict[str, tuple[list, list]]:
    """user -> (x rows, y values) merged over the ``*.json`` files of one split folder."""
    out: dict[str, tuple[list, list]] = {}
    for file in sorted(folder.glob("*.json")):
        try:
            blob = json.loads(file.read_text())
        except json.JSONDecodeError as err:
            raise ConfigError("path", str(file), f"valid JSON ({err})") from err
        ok = isinstance(blob, dict) and isinstance(blob.get("user_data"), dict)
        require(ok, "path", str(file), 'a LEAF JSON file with "users" and "user_data"')
        for user in blob.get("users", list(blob["user_data"])):
            data = blob["user_data"].get(user)
            require(
                isinstance(data, dict) and "x" in data and "y" in data,
                "path",
                str(file),
                f'user_data[{user!r}] with "x" and "y" lists',
            )
            xs, ys = out.setdefault(str(user), ([], []))
            xs.extend(data["x"])
            ys.extend(data["y"])
    return out


def _leaf_user(
    directory: Path, user: str, xs: list, ys: list, length: int
) -> tuple[np.ndarray, np.ndarray]:
    """User ``user``'s rows of one LEAF split (``xs``, ``ys``; none: an empty part), checked:
    numeric features of ``length`` each (784 reshaped to (1, 28, 28)), integer labels."""
    feature_shape = (1, 28, 28) if length == 784 else (length,)
    if not xs and not ys:
        return np.zeros((0, *feature_shape), np.float32), np.zeros(0, np.int64)
    try:
        x = np.asarray(xs, dtype=np.float32).reshape(len(xs), -1)
        y = np.asarray(ys)
    except ValueError as err:
        raise ConfigError(
            "path", str(directory), f"numeric features of equal length for user {user!r}"
        ) from err
    require(
        x.shape[1] == length or len(ys) == 0,
        "path",
        str(directory),
        f"{length} features per sample (user {user!r} has {x.shape[1]})",
    )
    require(
        len(xs) == len(ys),
        "path",
        str(directory),
        f"as many x as y entries (user {user!r})",
    )
    require(
        y.size == 0 or np.issubdtype(y.dtype, np.integer),
        "path",
        str(directory),
        f"integer labels (user {user!r} has {y.dtype})",
    )
    problem = label_problem(y) or non_finite_problem(x)
    require(problem is None, "path", str(directory), f"usable rows: user {user!r}: {problem}")
    return x.reshape(-1, *feature_shape), y.astype(np.int64).reshape(-1)


def load_leaf(directory: str | Path) -> tuple[ClientData, ClientData]:
    """Read a LEAF dataset (Caldas et al., 2018) with its natural per-user partition.

    Reads every ``*.json`` under ``directory/train/`` and ``directory/test/``
    (``{"users": [...], "num_samples": [...], "user_data": {user: {"x": [...], "y": [...]}}}``).
    Users are sorted by name; part k of both splits belongs to the same user, and a
    user present in only one split has an empty part in the other. Features are
    lists of numbers: length 784 is reshaped to (1, 28, 28), anything else kept
    flat; float32. Labels must be integers (int64).

    Returns ``(train_parts, test_parts)``, each a list of ``(x_k, y_k)``.
    """
    directory = Path(directory)
    for split in ("train", "test"):
        require(
            (directory / split).is_dir(),
            "path",
            str(directory),
            f"a LEAF directory with a {split}/ folder of *.json files",
        )
    train, test = _leaf_split(directory / "train"), _leaf_split(directory / "test")
    users = sorted(set(train) | set(test))
    require(bool(users), "path", str(directory), "LEAF JSON files with at least one user")
    sample = next((xs[0] for xs, _ in (*train.values(), *test.values()) if xs), None)
    require(sample is not None, "path", str(directory), "LEAF JSON files with at least one sample")
    length = int(np.size(sample))

    def parts(split: dict[str, tuple[list, list]]) -> ClientData:
        return [_leaf_user(directory, user, *split.get(user, ([], [])), length) for user in users]

    return parts(train), parts(test)


# --------------------------------------------------------------------------- Parquet / JSONL


def _read_table(path: Path) -> tuple[Any, str, bool]:
    """The pyarrow table of ``path`` (by its suffix), how errors show the path, and whether
    it is a link: a link (the file or a folder above it) may point anywhere, so errors then
    quote nothing read from the file (not even its header), only the path and where it
    leads."""
    import pyarrow as pa
    import pyarrow.csv as pacsv
    import pyarrow.json as pajson
    import pyarrow.parquet as pq

    require(path.is_file(), "path", str(path), "an existing .parquet, .csv or .jsonl file")
    suffix = path.suffix.lower()
    readers = {".parquet": pq.read_table, ".csv": pacsv.read_csv, ".jsonl": pajson.read_json}
    require(suffix in readers, "path", str(path), "a file ending in .parquet, .csv or .jsonl")
    target = path.resolve()
    linked = target != path.absolute()
    shown = f"{path} (a link to {target})" if linked else str(path)
    try:
        return readers[suffix](path), shown, linked
    except (pa.ArrowInvalid, OSError) as err:
        detail = type(err).__name__ if linked else _arrow_problem(err)
        raise ConfigError("path", shown, f"a readable {suffix} table ({detail})") from None


def load_table(
    path: str | Path,
    client_column: str = "client_id",
    label_column: str = "label",
    feature_columns: tuple[str, ...] | None = None,
    require_clients: bool = True,
) -> ClientData:
    """Read a local Parquet (``.parquet``), CSV (``.csv``, with a header row) or JSON Lines
    (``.jsonl``) table, one part per client.

    Feature rule: with ``feature_columns`` the listed numeric columns are stacked
    into (n, F) features; otherwise a single list-valued column named ``"x"`` (or,
    if absent, ``"features"``) holds each row's feature vector (all of one length,
    kept flat); without either, every column other than the label and client columns
    is a feature (all must be numeric). Features are float32, labels (``label_column``,
    integers >= 0) int64. Clients are the sorted unique values of ``client_column``; each
    part is a view into the pooled arrays, rows kept in file order within a client. A table
    without ``client_column`` is one part holding every row, unless ``require_clients``.
    """

    path = Path(path)
    table, shown, linked = _read_table(path)
    present = list(table.column_names)

    def column(key: str, name: str):
        listed = f"{len(present)}, not named (the path is a link)" if linked else ", ".join(present)
        require(name in present, key, name, f"a column of {shown}; columns present: {listed}")
        return table.column(name).combine_chunks()

    has_clients = client_column in present or require_clients
    ids = column("client_column", client_column) if has_clients else None
    labels = column("label_column", label_column)
    y = _table_labels(labels, ids, path, (client_column, label_column))
    if not feature_columns and "x" not in present and "features" not in present:
        feature_columns = tuple(c for c in present if c not in (label_column, client_column))
        require(
            bool(feature_columns),
            "feature_columns",
            (),
            f"feature columns: {path.name} has only {', '.join(present)}",
        )
    x = _table_features(table, present, feature_columns, column, len(y))
    problem = non_finite_problem(x, tuple(feature_columns) if feature_columns else None)
    require(
        problem is None,
        "feature_columns",
        list(feature_columns) if feature_columns else ("x" if "x" in present else "features"),
        f"finite features: {problem} of {shown}",
    )
    if ids is None:
        return [(x, y)]
    unique, inverse = np.unique(ids.to_numpy(zero_copy_only=False), return_inverse=True)
    order = np.argsort(inverse, kind="stable")
    sizes = np.bincount(inverse.reshape(-1), minlength=unique.size)
    return split_rows(x[order], y[order], sizes)


def _table_labels(label_col: Any, ids: Any, path: Path, names: tuple[str, str]) -> np.ndarray:
    """The class labels of a table's label column (``names``: the client and label
    columns), int64; a ConfigError unless they are integers, none is missing (nor a client
    id) and they are class labels."""
    import pyarrow as pa

    client_column, label_column = names
    require(
        pa.types.is_integer(label_col.type),
        "label_column",
        label_column,
        f"a column of integer labels (it holds {label_col.type})",
    )
    require(
        label_col.null_count == 0 and (ids is None or ids.null_count == 0),
        "path",
        str(path),
        f"no missing values in {client_column!r} and {label_column!r}",
    )
    y = label_col.to_numpy().astype(np.int64)
    problem = label_problem(y)
    require(problem is None, "label_column", label_column, f"class labels: {problem}")
    return y


def _arrow_problem(err: Exception) -> str:
    """A reader's error without the file's contents: CSV errors quote the offending row,
    so they are cut to the row and column counts; others to their first line."""
    import re

    text = str(err).splitlines()[0] if str(err) else type(err).__name__
    csv = re.match(r"(CSV parse error: (Row #\d+: )?Expected \d+ columns, got \d+)", text)
    if csv:
        return csv.group(1)
    if "CSV" in text:
        return f"{type(err).__name__}: CSV parse error"
    return text[:200]


def _table_features(table, present, feature_columns, column, rows: int) -> np.ndarray:
    """The (rows, F) float32 features of :func:`load_table`'s feature rule."""
    import pyarrow as pa

    if feature_columns:
        cols = []
        for name in feature_columns:
            col = column("feature_columns", name)
            require(
                pa.types.is_integer(col.type)
                or pa.types.is_floating(col.type)
                or pa.types.is_boolean(col.type),
                "feature_columns",
                name,
                f"numeric columns ({name!r} holds {col.type})",
            )
            if col.null_count:
                row = int(np.flatnonzero(col.is_null().to_numpy(zero_copy_only=False))[0])
                raise ConfigError(
                    "feature_columns",
                    name,
                    f"a column without missing values: row {row} is empty, null or NaN "
                    "(CSV reads NaN as missing)",
                )
            cols.append(col.to_numpy(zero_copy_only=False).astype(np.float32))
        return np.stack(cols, axis=1)
    name = "x" if "x" in present else "features"
    col = table.column(name).combine_chunks()
    require(
        pa.types.is_list(col.type) or pa.types.is_large_list(col.type),
        "feature_columns",
        name,
        f"a list-valued column ({name!r} holds {col.type})",
    )
    lengths = np.diff(col.offsets.to_numpy())
    require(
        col.null_count == 0 and (lengths.size == 0 or np.all(lengths == lengths[0])),
        "feature_columns",
        name,
        "a column of equal-length feature lists",
    )
    width = int(lengths[0]) if lengths.size else 0
    values = col.flatten().to_numpy(zero_copy_only=False)
    return values.astype(np.float32).reshape(rows, width)
