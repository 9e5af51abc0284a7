"""Federated text: a real corpus that installs offline, and LargeFedBench-style local files.

POPri and Private Evolution (Hou et al., ICML 2025; Xie et al., ICML 2024) need clients that
each hold a few short private texts, a held-out part of every client's text to measure the
synthetic data against, and a *public* set of texts (from outside the federation) for the
generator's few-shot prompts.

Docstring federation (:func:`~fedsim.data.docstrings.docstring_federation`)
    The docstrings of the scientific Python packages installed next to fedsim, one client
    per source file (:mod:`fedsim.data.docstrings`).

LargeFedBench-style files (:func:`load_text_table`, :func:`table_federation`)
    A local Parquet or JSON Lines file with one row per text, a client id column and a text
    column (LargeFedBench's Congressional Speeches and bioRxiv abstracts have this shape).
    Clients are the sorted distinct ids, texts in file order within a client. The public
    split comes from a second file (``public_path``) or from ``public_clients`` clients drawn
    with the seed and removed from the federation.

Splits. Each client's texts are shuffled with ``SeedSequence([seed, client index])`` and the
first ``max(1, round(held_out_fraction * n))`` go to its held-out split, the rest to its train
split (clients keep at least one training text). Everything is a deterministic function of
the source and the seed.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from fedsim.config import ConfigError, require
from fedsim.data.docstrings import (
    DEFAULT_CLIENT_PACKAGES,
    DEFAULT_PUBLIC_PACKAGES,
    docstring_federation,
)
from fedsim.data.text_federation import TextFederation, split_clients

# --------------------------------------------------------------------------------------------
# LargeFedBench-style files
# --------------------------------------------------------------------------------------------


def _read_table(path: Path, key: str) -> Any:
    import pyarrow as pa
    import pyarrow.json as pajson
    import pyarrow.parquet as pq

    require(path.is_file(), key, str(path), "an existing .parquet or .jsonl file")
    suffix = path.suffix.lower()
    require(suffix in (".parquet", ".jsonl"), key, str(path), "a file ending in .parquet or .jsonl")
    try:
        return pq.read_table(path) if suffix == ".parquet" else pajson.read_json(path)
    except (pa.ArrowInvalid, OSError) as err:
        raise ConfigError(key, str(path), f"a readable {suffix} file ({err})") from err


def _text_column(table: Any, path: Path, key: str, name: str) -> list[str]:
    import pyarrow as pa

    present = list(table.column_names)
    require(name in present, key, name, f"a column of {path.name}; columns present: {present}")
    column = table.column(name).combine_chunks()
    require(
        pa.types.is_string(column.type) or pa.types.is_large_string(column.type),
        key,
        name,
        f"a column of strings in {path.name} (it holds {column.type})",
    )
    require(
        column.null_count == 0,
        key,
        name,
        f"a column without missing values in {path.name} ({column.null_count} missing)",
    )
    return column.to_pylist()


def load_text_table(
    path: str | Path, client_column: str = "client_id", text_column: str = "text"
) -> list[tuple[str, list[str]]]:
    """``(client id, texts)`` from a local Parquet or JSON Lines file, one row per text.

    Clients are the sorted distinct values of ``client_column`` (any type; compared as
    strings); each client's texts keep file order. Empty texts are dropped. Errors name the
    file and the column.
    """
    path = Path(path)
    table = _read_table(path, "path")
    texts = _text_column(table, path, "text_column", text_column)
    present = list(table.column_names)
    require(
        client_column in present,
        "client_column",
        client_column,
        f"a column of {path.name}; columns present: {present}",
    )
    ids_column = table.column(client_column).combine_chunks()
    require(
        ids_column.null_count == 0,
        "client_column",
        client_column,
        f"a column without missing values in {path.name} ({ids_column.null_count} missing)",
    )
    grouped: dict[str, list[str]] = {}
    for client, text in zip(ids_column.to_pylist(), texts, strict=True):
        text = " ".join(text.split())
        if text:
            grouped.setdefault(str(client), []).append(text)
    return [(client, grouped[client]) for client in sorted(grouped)]


def _public_clients(
    clients: list[tuple[str, Any]], public_clients: int, min_texts: int, seed: int
) -> tuple[list[tuple[str, Any]], list[str]]:
    """``public_clients`` of ``clients`` drawn with ``seed``: the clients left, and the
    drawn clients' texts as the public split."""
    require(
        0 < public_clients < len(clients),
        "public_clients",
        public_clients,
        f"an integer in [1, {len(clients) - 1}] ({len(clients)} clients have "
        f">= {min_texts} texts)",
    )
    rng = np.random.default_rng(np.random.SeedSequence([seed, 1]))
    chosen = set(rng.choice(len(clients), size=public_clients, replace=False).tolist())
    public = [t for i, (_, texts) in enumerate(clients) if i in chosen for t in texts]
    return [c for i, c in enumerate(clients) if i not in chosen], public


def table_federation(
    path: str | Path,
    client_column: str = "client_id",
    text_column: str = "text",
    *,
    public_path: str | Path | None = None,
    public_text_column: str = "text",
    public_clients: int = 0,
    min_texts: int = 2,
    held_out_fraction: float = 0.2,
    seed: int = 0,
) -> TextFederation:
    """A federation from a LargeFedBench-style file (:func:`load_text_table`).

    Clients with fewer than ``min_texts`` texts are dropped. The public split is the
    ``public_text_column`` of ``public_path``, or the texts of ``public_clients`` clients
    drawn with ``seed`` (removed from the federation); one of the two must give public texts.
    """
    require(min_texts >= 2, "min_texts", min_texts, "an integer >= 2")
    clients = [(c, t) for c, t in load_text_table(path, client_column, text_column)]
    clients = [(c, t) for c, t in clients if len(t) >= min_texts]
    require(
        public_path is None or public_clients == 0,
        "public_clients",
        public_clients,
        "0 when public_path is given",
    )
    require(
        public_path is not None or public_clients >= 1,
        "public_path",
        public_path,
        "a file of public texts, or public_clients >= 1",
    )
    if public_path is not None:
        public_file = Path(public_path)
        table = _read_table(public_file, "public_path")
        public = [
            t
            for t in _text_column(table, public_file, "public_text_column", public_text_column)
            if t.strip()
        ]
    else:
        clients, public = _public_clients(clients, public_clients, min_texts, seed)
    require(
        len(clients) > 0,
        "path",
        str(path),
        f"a table with at least one client of {min_texts} or more texts",
    )
    return split_clients(f"table({Path(path).name})", clients, public, held_out_fraction, seed)


# --------------------------------------------------------------------------------------------
# Specs (hashable, for ClientApps that rebuild the federation in each worker)
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class TextSourceSpec:
    """Which federation to build: ``kind`` "docstrings" (:func:`docstring_federation`) or
    "table" (:func:`table_federation`); the other fields are those functions' arguments
    (for tables, ``max_clients`` keeps the first clients in sorted id order)."""

    kind: str = "docstrings"
    client_packages: tuple[str, ...] = DEFAULT_CLIENT_PACKAGES
    public_packages: tuple[str, ...] = DEFAULT_PUBLIC_PACKAGES
    path: str | None = None
    client_column: str = "client_id"
    text_column: str = "text"
    public_path: str | None = None
    public_clients: int = 0
    min_texts: int = 4
    max_clients: int | None = None
    held_out_fraction: float = 0.2
    seed: int = 0
    min_words: int = 6
    max_words: int = 48

    def __post_init__(self) -> None:
        require(self.kind in ("docstrings", "table"), "kind", self.kind, "'docstrings' or 'table'")
        require(
            self.kind != "table" or self.path is not None,
            "path",
            self.path,
            "a .parquet or .jsonl file when kind = 'table'",
        )
        object.__setattr__(self, "client_packages", tuple(self.client_packages))
        object.__setattr__(self, "public_packages", tuple(self.public_packages))

    def build(self) -> TextFederation:
        """The federation this spec describes (use :func:`cached_text_federation` to reuse)."""
        if self.kind == "docstrings":
            return docstring_federation(
                self.client_packages,
                self.public_packages,
                min_texts=self.min_texts,
                max_clients=self.max_clients,
                held_out_fraction=self.held_out_fraction,
                min_words=self.min_words,
                max_words=self.max_words,
                seed=self.seed,
            )
        federation = table_federation(
            str(self.path),
            self.client_column,
            self.text_column,
            public_path=self.public_path,
            public_clients=self.public_clients,
            min_texts=self.min_texts,
            held_out_fraction=self.held_out_fraction,
            seed=self.seed,
        )
        if self.max_clients is not None and federation.num_clients > self.max_clients:
            m = self.max_clients
            federation = TextFederation(
                federation.name,
                federation.client_ids[:m],
                federation.train[:m],
                federation.held_out[:m],
                federation.public,
            )
        return federation


_FEDERATIONS: dict[TextSourceSpec, TextFederation] = {}
_FEDERATION_LOCK = threading.Lock()


def cached_text_federation(spec: TextSourceSpec) -> TextFederation:
    """The federation for ``spec``, built at most once per process."""
    require(isinstance(spec, TextSourceSpec), "text", type(spec).__name__, "a TextSourceSpec")
    with _FEDERATION_LOCK:
        found = _FEDERATIONS.get(spec)
        if found is None:
            found = _FEDERATIONS[spec] = spec.build()
        return found


def register_text_federation(spec: TextSourceSpec, federation: TextFederation) -> None:
    """Make ``federation`` the cached value of ``spec`` in this process (e.g. one built
    from in-memory texts in a test)."""
    require(
        isinstance(federation, TextFederation),
        "federation",
        type(federation).__name__,
        "a TextFederation",
    )
    with _FEDERATION_LOCK:
        _FEDERATIONS[spec] = federation


def in_memory_federation(
    clients: Sequence[tuple[str, Sequence[str]]],
    public: Sequence[str],
    *,
    held_out_fraction: float = 0.2,
    seed: int = 0,
    name: str = "in-memory",
) -> TextFederation:
    """A federation from given ``(client id, texts)`` pairs and public texts, split as the
    other sources are."""
    for client, texts in clients:
        require(len(texts) >= 2, "clients", client, "clients with at least 2 texts")
    return split_clients(name, list(clients), list(public), held_out_fraction, seed)
