"""Reproducible dataset descriptions and a per-process dataset cache.

A :class:`DatasetSpec` (the ``[data]`` section of a config) names a source and a
partition; :func:`build_dataset` turns it into a :class:`FederatedDataset`,
identically for the same spec. Workers call :func:`cached_dataset` so a
dataset is built (or registered, after being shipped) once per process.
"""

from __future__ import annotations

import dataclasses
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import numpy as np

from fedsim.config import ConfigError, frozen, import_reference, python_path, require
from fedsim.data.class_pool import CLIENT_TESTS, ClientTest, from_class_pool, hold_out_pools
from fedsim.data.dataset import FederatedDataset, concat_clients, from_partition, release_pages
from fedsim.data.femnist import femnist_like
from fedsim.data.partition import PARTITIONERS
from fedsim.data.python_source import load_python
from fedsim.data.sources import (
    ClientData,
    load_digits,
    load_leaf,
    load_table,
    synthetic_fedprox,
)
from fedsim.data.text import TextSourceSpec

Source = Literal["digits", "synthetic", "femnist", "leaf", "table", "npy", "python", "text"]
PartitionName = Literal["iid", "dirichlet", "shards", "quantity", "split-classes", "natural"]

#: Sources whose samples come with a writer / user / device (a natural partition).
NATURAL_SOURCES = ("synthetic", "femnist", "leaf", "table", "npy", "python", "text")
#: Sources read from ``path``.
FILE_SOURCES = ("leaf", "table", "npy")

_SYNTHETIC_CLASSES = 10
_FEMNIST_CLASSES = 62


@dataclass(frozen=True, kw_only=True)
class DatasetSpec:
    """Everything needed to rebuild a federated dataset (the ``[data]`` config section).

    source: digits (bundled, centralised), synthetic (synthetic(alpha, beta) of
    FedProx, one device per client), femnist (generated FEMNIST-like writers),
    leaf (LEAF JSON under ``path``), table (Parquet / CSV / JSONL file at ``path``:
    ``label_column``, ``client_column`` (a natural partition's clients; a file without it is
    re-split by ``partition``), ``feature_columns`` (default: a list column ``x`` or
    ``features``, else every other column)), npy (a directory written by
    ``FederatedDataset.save``), python (the user's ``loader = "package.module:function"``,
    called with ``options``, imported with ``python_path`` first on ``sys.path``; what it
    may return: :mod:`fedsim.data.python_source`), text (the ``[data.text]`` table, a
    :class:`~fedsim.data.text.TextSourceSpec`: a text federation for the synthetic-text
    methods, its first ``num_clients`` clients, split with ``seed``; natural partition only;
    :meth:`text_source`).

    partition: iid / dirichlet (``alpha``) / shards (``classes_per_client``;
    ``shard_sigma > 0`` also skews client sizes, lognormal) / quantity
    (``quantity_sigma``) / split-classes (``classes_per_client``: groups of
    C / k clients split the C classes, pairs for k = C / 2, each class cut into
    random unequal chunks: the pFedVEM / pFedHB reference split) re-split the pooled samples among
    ``num_clients`` clients; natural keeps the source's own writers: the first
    ``num_clients`` of them (sorted ids for leaf/table, saved order for npy; for
    synthetic and femnist exactly ``num_clients`` are generated). Generated
    sources also generate ``num_clients`` writers before a re-split.

    test_fraction: share of each client's rows held out for testing (not used
    by leaf/npy with the natural partition, which bring their own test split).
    client_test: ``own`` (each client's rows split by ``test_fraction``), ``class-pool``
    or ``class-pool-validation`` (split-classes only: ``test_fraction`` of every class held
    out as a test pool and as much again as a validation pool before the partition, each
    client tested on the pool's rows of its classes; :mod:`fedsim.data.class_pool`).
    samples_per_client: femnist only; 0 draws per-writer sizes from a lognormal.
    femnist_classes: femnist only; classes generated (62, FEMNIST's; 10: its digits).
    """

    source: Source
    partition: PartitionName
    num_clients: int
    seed: int = 0
    test_fraction: float = 0.2
    client_test: ClientTest = "own"
    alpha: float = 0.5
    classes_per_client: int = 2
    quantity_sigma: float = 1.0
    shard_sigma: float = 0.0
    synthetic_alpha: float = 1.0
    synthetic_beta: float = 1.0
    samples_per_client: int = 0
    femnist_classes: int = _FEMNIST_CLASSES
    path: str = ""
    client_column: str = "client_id"
    label_column: str = "label"
    feature_columns: tuple[str, ...] = ()
    loader: str = ""
    options: dict[str, Any] = field(default_factory=dict)
    python_path: tuple[str, ...] = ()
    text: TextSourceSpec | None = None

    def __hash__(self) -> int:  # options is a table: hash its frozen copy
        values = [getattr(self, f) for f in self.__dataclass_fields__ if f != "options"]
        return hash((*values, frozen(self.options)))

    def __post_init__(self) -> None:
        require(
            self.source in ("digits", *NATURAL_SOURCES),
            "data.source",
            self.source,
            "one of digits, synthetic, femnist, leaf, table, npy, python",
        )
        self._check_python()
        require(
            (self.text is not None) == (self.source == "text"),
            "data.text",
            self.text,
            "a [data.text] table with source 'text' (the federation's texts), else unset",
        )
        require(
            self.partition in ("natural", *PARTITIONERS),
            "data.partition",
            self.partition,
            "one of iid, dirichlet, shards, quantity, split-classes, natural",
        )
        require(
            self.partition != "natural" or self.source in NATURAL_SOURCES,
            "data.partition",
            self.partition,
            f"a partitioner (iid, dirichlet, shards, quantity, split-classes) for the "
            f"centralised source {self.source!r}; natural needs one of "
            f"{', '.join(NATURAL_SOURCES)}",
        )
        self._check_numbers()
        self._check_client_test()
        self._check_files()

    def _check_client_test(self) -> None:
        require(
            self.client_test in CLIENT_TESTS,
            "data.client_test",
            self.client_test,
            f"one of {', '.join(CLIENT_TESTS)}",
        )
        if self.client_test == "own":
            return
        require(
            self.partition == "split-classes",
            "data.partition",
            self.partition,
            f"'split-classes' with data.client_test = {self.client_test!r} (every class held "
            "by one member of each group, so the pooled test rows weigh the pool evenly)",
        )
        require(
            0.0 < self.test_fraction < 0.5,
            "data.test_fraction",
            self.test_fraction,
            f"a number in (0, 0.5) with data.client_test = {self.client_test!r} (a test and "
            "a validation pool of that share each)",
        )

    def _check_numbers(self) -> None:
        """The counts, fractions and rates of ``[data]`` and its column names."""
        _int(self.num_clients, "data.num_clients", 1)
        _int(self.seed, "data.seed", 0)
        _int(self.classes_per_client, "data.classes_per_client", 1)
        _int(self.samples_per_client, "data.samples_per_client", 0)
        _int(self.femnist_classes, "data.femnist_classes", 2)
        _number(
            self.test_fraction,
            "data.test_fraction",
            0.0,
            1.0,
            "a number in [0, 1)",
            upper_open=True,
        )
        _number(self.alpha, "data.alpha", 0.0, np.inf, "a finite number > 0", lower_open=True)
        _number(self.quantity_sigma, "data.quantity_sigma", 0.0, np.inf, "a finite number >= 0")
        _number(self.shard_sigma, "data.shard_sigma", 0.0, np.inf, "a finite number >= 0")
        _number(self.synthetic_alpha, "data.synthetic_alpha", 0.0, np.inf, "a finite number >= 0")
        _number(self.synthetic_beta, "data.synthetic_beta", 0.0, np.inf, "a finite number >= 0")
        for key in ("path", "client_column", "label_column"):
            require(
                isinstance(getattr(self, key), str), f"data.{key}", getattr(self, key), "a string"
            )
        require(
            isinstance(self.feature_columns, tuple)
            and all(isinstance(c, str) and c for c in self.feature_columns),
            "data.feature_columns",
            self.feature_columns,
            "a tuple of column names",
        )

    def _check_files(self) -> None:
        """A file source's ``path``: given, and an existing file or directory of its kind."""
        if self.source not in FILE_SOURCES:
            return
        want = {
            "leaf": "a directory with train/ and test/ folders of LEAF JSON",
            "table": "a .parquet, .csv or .jsonl file",
            "npy": "a directory written by FederatedDataset.save",
        }[self.source]
        require(
            bool(self.path),
            "data.path",
            self.path,
            f"{want} (required for source {self.source!r})",
        )
        exists = Path(self.path).is_file() if self.source == "table" else Path(self.path).is_dir()
        require(exists, "data.path", self.path, f"an existing path: {want}")

    def _check_python(self) -> None:
        """``loader`` (importable and callable), ``options`` and ``python_path``: set with
        source python only."""
        object.__setattr__(self, "python_path", python_path(self.python_path, "data.python_path"))
        require(isinstance(self.options, dict), "data.options", self.options, "a table")
        if self.source != "python":
            for key in ("loader", "options", "python_path"):
                value = getattr(self, key)
                require(not value, f"data.{key}", value, "unset unless data.source = 'python'")
            return
        require(
            bool(self.loader),
            "data.loader",
            self.loader,
            "a 'package.module:function' reference returning the clients' arrays "
            "(required for source 'python')",
        )
        import_reference(self.loader, "data.loader", self.python_path)


def _int(value: object, key: str, minimum: int) -> None:
    ok = isinstance(value, (int, np.integer)) and not isinstance(value, bool)
    require(ok and value >= minimum, key, value, f"an integer >= {minimum}")


def _number(
    value: object,
    key: str,
    lo: float,
    hi: float,
    allowed: str,
    lower_open: bool = False,
    upper_open: bool = False,
) -> None:
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and np.isfinite(value)
    if ok:
        ok = (value > lo if lower_open else value >= lo) and (
            value < hi if upper_open else value <= hi
        )
    require(ok, key, value, allowed)


# --------------------------------------------------------------------------- building


#: the source, partition and split generators of :func:`build_dataset`
Rngs = tuple[np.random.Generator, np.random.Generator, np.random.Generator]


def _stage_rngs(seed: int) -> Rngs:
    """Independent generators for the source, partition and train/test-split stages."""
    return tuple(np.random.default_rng(s) for s in np.random.SeedSequence(seed).spawn(3))


def _pool(parts: ClientData) -> tuple[np.ndarray, np.ndarray]:
    """Concatenate per-client ``(x_k, y_k)`` into one ``(x, y)``."""
    return (np.concatenate([x for x, _ in parts]), np.concatenate([y for _, y in parts]))


def _num_classes(*labels: np.ndarray) -> int:
    top = max((int(y.max()) for y in labels if y.size), default=0)
    return top + 1


def _first(parts: ClientData, spec: DatasetSpec, what: str) -> ClientData:
    require(
        spec.num_clients <= len(parts),
        "data.num_clients",
        spec.num_clients,
        f"at most the {len(parts)} {what}"
        + ("" if spec.source == "python" else f" in {spec.path or spec.source}"),
    )
    return parts[: spec.num_clients]


def _own_rows(train: ClientData, test: ClientData, num_classes: int, name: str) -> FederatedDataset:
    """Each client's own train and test rows (features as float32), kept as they came."""
    shape = train[0][0].shape[1:]
    return FederatedDataset(
        concat_clients(train, shape, np.float32),
        concat_clients(test, shape, np.float32),
        num_classes,
        name,
    )


def _resplit(
    x: np.ndarray,
    y: np.ndarray,
    spec: DatasetSpec,
    part_rng: np.random.Generator,
    split_rng: np.random.Generator,
    num_classes: int,
    name: str,
) -> FederatedDataset:
    if spec.client_test == "own":
        parts = _partition(y, spec, part_rng)
        return from_partition(x, y, parts, spec.test_fraction, split_rng, num_classes, name)
    kept, test_pool, validation_pool = hold_out_pools(y, spec.test_fraction, split_rng)
    parts = [kept[p] for p in _partition(y[kept], spec, part_rng)]
    pool = test_pool if spec.client_test == "class-pool" else validation_pool
    return from_class_pool(x, y, parts, pool, num_classes, name)


def _partition(y: np.ndarray, spec: DatasetSpec, part_rng: np.random.Generator):
    """``spec.partition``'s row indices per client (a ConfigError names the [data] key)."""
    params = {
        "iid": {},
        "dirichlet": {"alpha": spec.alpha},
        "shards": {"classes_per_client": spec.classes_per_client, "sigma": spec.shard_sigma},
        "quantity": {"sigma": spec.quantity_sigma},
        "split-classes": {"classes_per_client": spec.classes_per_client},
    }[spec.partition]
    try:
        parts = PARTITIONERS[spec.partition](y, spec.num_clients, part_rng, **params)
    except ConfigError as err:  # name the config key
        key = {
            "alpha": "alpha",
            "classes_per_client": "classes_per_client",
            "sigma": "shard_sigma" if spec.partition == "shards" else "quantity_sigma",
        }.get(err.key, err.key)
        raise ConfigError(f"data.{key}", err.value, err.allowed) from err
    return parts


def _natural(
    parts: ClientData,
    spec: DatasetSpec,
    split_rng: np.random.Generator,
    num_classes: int,
    name: str,
) -> FederatedDataset:
    x, y = _pool(parts)
    sizes = np.array([len(p[1]) for p in parts], dtype=np.int64)
    ends = np.cumsum(sizes)
    index = [np.arange(e - s, e, dtype=np.int64) for s, e in zip(sizes, ends)]
    return from_partition(x, y, index, spec.test_fraction, split_rng, num_classes, name)


def text_source(spec: DatasetSpec) -> TextSourceSpec:
    """The text federation of ``[data] source = "text"``: ``[data.text]`` with its first
    ``num_clients`` clients, split with ``[data] seed``."""
    require(spec.text is not None, "data.source", spec.source, "'text' with a [data.text] table")
    return dataclasses.replace(spec.text, max_clients=spec.num_clients, seed=spec.seed)


def build_dataset(spec: DatasetSpec) -> FederatedDataset:
    """Build the federated dataset a spec describes (its source's builder in
    :data:`SOURCES`); the same spec gives identical arrays.

    Randomness: ``SeedSequence(spec.seed)`` spawns one generator each for the
    source, the partition and the train/test split. Source ``npy`` with the
    natural partition returns memory-mapped arrays (the first ``num_clients``
    clients as views).
    """
    require(isinstance(spec, DatasetSpec), "data", type(spec).__name__, "a DatasetSpec")
    require(
        spec.source != "text",
        "data.source",
        spec.source,
        "an array source (a text federation is built by text_source(spec).build())",
    )
    rngs = _stage_rngs(spec.seed)
    return SOURCES[spec.source](spec, rngs, f"{spec.source}-{spec.partition}")


def _digits(spec: DatasetSpec, rngs: Rngs, name: str) -> FederatedDataset:
    _, part_rng, split_rng = rngs
    x, y = load_digits()
    return _resplit(x, y, spec, part_rng, split_rng, 10, name)


def _generated(spec: DatasetSpec, rngs: Rngs, name: str) -> FederatedDataset:
    """Sources ``synthetic`` (FedProx's) and ``femnist`` (FEMNIST-like), drawn with the
    source generator."""
    src_rng, part_rng, split_rng = rngs
    if spec.source == "synthetic":
        parts = synthetic_fedprox(
            spec.num_clients, spec.synthetic_alpha, spec.synthetic_beta, src_rng
        )
        num_classes = _SYNTHETIC_CLASSES
    else:
        parts = femnist_like(
            spec.num_clients, src_rng, spec.samples_per_client or None, spec.femnist_classes
        )
        num_classes = spec.femnist_classes
    if spec.partition == "natural":
        return _natural(parts, spec, split_rng, num_classes, name)
    x, y = _pool(parts)
    return _resplit(x, y, spec, part_rng, split_rng, num_classes, name)


def _table(spec: DatasetSpec, rngs: Rngs, name: str) -> FederatedDataset:
    _, part_rng, split_rng = rngs
    natural = spec.partition == "natural"
    try:
        parts = load_table(
            spec.path,
            spec.client_column,
            spec.label_column,
            spec.feature_columns or None,
            require_clients=natural,
        )
    except ConfigError as err:  # name the [data] key
        raise ConfigError(f"data.{err.key}", err.value, err.allowed) from err
    num_classes = _num_classes(*(y for _, y in parts))
    if natural:
        return _natural(_first(parts, spec, "clients"), spec, split_rng, num_classes, name)
    x, y = _pool(parts)
    return _resplit(x, y, spec, part_rng, split_rng, num_classes, name)


def _leaf(spec: DatasetSpec, rngs: Rngs, name: str) -> FederatedDataset:
    _, part_rng, split_rng = rngs
    train, test = load_leaf(spec.path)
    num_classes = _num_classes(*(y for _, y in train), *(y for _, y in test))
    if spec.partition == "natural":
        train, test = _first(train, spec, "users"), _first(test, spec, "users")
        return _own_rows(train, test, num_classes, name)
    x, y = _pool([*train, *test])
    return _resplit(x, y, spec, part_rng, split_rng, num_classes, name)


def _npy(spec: DatasetSpec, rngs: Rngs, name: str) -> FederatedDataset:
    """A saved FederatedDataset (natural: its first clients, memory-mapped)."""
    _, part_rng, split_rng = rngs
    saved = FederatedDataset.load(spec.path, mmap=True)
    if spec.partition == "natural":
        require(
            spec.num_clients <= saved.num_clients,
            "data.num_clients",
            spec.num_clients,
            f"at most the {saved.num_clients} clients saved in {spec.path}",
        )
        k = spec.num_clients
        head = FederatedDataset(
            saved.train.head(k), saved.test.head(k), saved.num_classes, saved.name
        )
        release_pages(head)
        return head
    x = np.concatenate([saved.train.x, saved.test.x])
    y = np.concatenate([saved.train.y, saved.test.y])
    return _resplit(x, y, spec, part_rng, split_rng, saved.num_classes, name)


def _python(
    spec: DatasetSpec, part_rng: np.random.Generator, split_rng: np.random.Generator, name: str
) -> FederatedDataset:
    """Source python: the loader's pooled rows re-split, or its clients (natural), or their
    pooled rows re-split; with the loader's own test rows, its clients as they are."""
    loaded = load_python(spec.loader, spec.options, spec.python_path)
    natural = spec.partition == "natural"
    labels = [loaded.pooled[1]] if loaded.pooled is not None else [y for _, y in loaded.train]
    labels += [y for _, y in loaded.test or ()]
    num_classes = _num_classes(*labels)
    require(
        num_classes >= 2,
        "data.loader",
        spec.loader,
        f"labels of at least 2 classes (the largest label is {num_classes - 1})",
    )
    if loaded.pooled is not None:
        require(
            not natural,
            "data.partition",
            spec.partition,
            "a partitioner (iid, dirichlet, shards, quantity, split-classes): the loader "
            "returned pooled (x, y) rows without clients",
        )
        return _resplit(*loaded.pooled, spec, part_rng, split_rng, num_classes, name)
    what = f"clients {spec.loader} returned"
    if loaded.test is not None:
        require(
            natural,
            "data.partition",
            spec.partition,
            "natural: the loader returned each client's own test rows",
        )
        train, test = _first(loaded.train, spec, what), _first(loaded.test, spec, what)
        return _own_rows(train, test, num_classes, name)
    if natural:
        return _natural(_first(loaded.train, spec, what), spec, split_rng, num_classes, name)
    x, y = _pool(loaded.train)
    return _resplit(x, y, spec, part_rng, split_rng, num_classes, name)


#: source name -> its builder (:func:`build_dataset`)
SOURCES: dict[str, Callable[[DatasetSpec, Rngs, str], FederatedDataset]] = {
    "digits": _digits,
    "synthetic": _generated,
    "femnist": _generated,
    "leaf": _leaf,
    "table": _table,
    "npy": _npy,
    "python": lambda spec, rngs, name: _python(spec, rngs[1], rngs[2], name),
}


# --------------------------------------------------------------------------- cache

_CACHE: dict[DatasetSpec, FederatedDataset] = {}
_LOCK = threading.Lock()


def cached_dataset(spec: DatasetSpec) -> FederatedDataset:
    """The dataset for ``spec``, built at most once per process (then reused).

    Keyed by the spec's value; files behind ``path`` are not re-read if they change.
    """
    with _LOCK:
        found = _CACHE.get(spec)
        if found is None:
            found = _CACHE[spec] = build_dataset(spec)
        return found


def register_dataset(spec: DatasetSpec, dataset: FederatedDataset) -> None:
    """Make ``dataset`` the cached value for ``spec`` (e.g. arrays shipped through Ray)."""
    require(isinstance(spec, DatasetSpec), "data", type(spec).__name__, "a DatasetSpec")
    require(
        isinstance(dataset, FederatedDataset),
        "dataset",
        type(dataset).__name__,
        "a FederatedDataset",
    )
    with _LOCK:
        _CACHE[spec] = dataset
