"""Federated text: a real corpus that installs offline, and LargeFedBench-style local files.

POPri and Private Evolution (Hou et al., ICML 2025; Xie et al., ICML 2024) need clients that
each hold a few short private texts, a held-out part of every client's text to measure the
synthetic data against, and a *public* set of texts (from outside the federation) for the
generator's few-shot prompts.

Docstring federation (:func:`docstring_federation`)
    The docstrings of the scientific Python packages installed next to fedsim (by default
    numpy, scipy, scikit-learn, pandas and sympy as clients; networkx and matplotlib as the
    public set). Source files are parsed with :mod:`ast` (nothing is imported), in sorted path
    order. Every module, class, function and method docstring is cleaned
    (:func:`docstring_paragraphs`): numpydoc/Google sections other than the summary and
    "Notes" (Parameters, Returns, Examples, See Also, ...) are dropped, as are doctest, code,
    directive and table paragraphs; reST markup (``roles``, ``literals``) is stripped and
    whitespace collapsed; a paragraph must have ``min_words`` words and mostly letters, and is
    cut to ``max_words`` words (48; at a sentence end where possible): the median text is 17
    SmolLM2 tokens and 98 % are within 64. Identical texts are kept once, where they first
    appear. **One client is one source file** (module) with at least
    ``min_texts`` texts, named by its dotted module path (``scipy.optimize._minimize``);
    test modules are skipped; ``max_clients`` keeps the first modules in that order.
    Texts of the public packages form the public split, so the public and private texts come
    from disjoint packages.

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

import ast
import hashlib
import json
import os
import re
import threading
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path
from typing import Any

import numpy as np

from fedsim.config import ConfigError, require

#: Client packages of the default docstring federation, and its public packages.
DEFAULT_CLIENT_PACKAGES = ("numpy", "scipy", "sklearn", "pandas", "sympy")
DEFAULT_PUBLIC_PACKAGES = ("networkx", "matplotlib")

#: Distribution names of import packages whose names differ (for the cache key).
_DISTRIBUTIONS = {"sklearn": "scikit-learn"}

#: numpydoc / Google-style section titles; only "Notes" is kept after the summary.
_SECTIONS = {
    "parameters",
    "other parameters",
    "returns",
    "return",
    "yields",
    "receives",
    "raises",
    "warns",
    "warnings",
    "see also",
    "examples",
    "example",
    "references",
    "attributes",
    "methods",
    "args",
    "arguments",
    "keyword arguments",
    "kwargs",
    "note",
    "notes",
    "todo",
    "versionadded",
}
_KEPT_SECTIONS = {"notes", "note"}
_ROLE = re.compile(r":[\w:.-]+:`~?([^`<]*?)(?:\s*<[^>]*>)?`")
_LITERAL = re.compile(r"`{1,2}([^`]*)`{1,2}_?")
_WORD = re.compile(r"[A-Za-z]{2,}")


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


# --------------------------------------------------------------------------------------------
# Docstring cleaning
# --------------------------------------------------------------------------------------------


def _section_title(paragraph: str) -> str | None:
    """The section a paragraph opens ("Parameters\\n----------" or "Args:"), else None."""
    lines = paragraph.split("\n")
    first = lines[0].strip().rstrip(":").lower()
    underlined = len(lines) >= 2 and set(lines[1].strip()) <= set("-=~^") and lines[1].strip()
    if underlined or (lines[0].strip().endswith(":") and first in _SECTIONS):
        return first
    if first in _SECTIONS and len(lines) == 1:
        return first
    if first.startswith(".. versionadded") or first.startswith(".. deprecated"):
        return "versionadded"
    return None


def _clean(paragraph: str) -> str:
    text = _ROLE.sub(r"\1", paragraph)
    text = _LITERAL.sub(r"\1", text)
    text = text.replace("**", "").replace("\\", "")
    return " ".join(text.split())


def _is_prose(paragraph: str, text: str, min_words: int) -> bool:
    stripped = paragraph.lstrip()
    if stripped.startswith((">>>", "..", "|", "+-", "=", "-", "*", ":", "#", "[", "{", "(")):
        return False
    if paragraph.startswith((" ", "\t")):  # an indented block: code, a definition list
        return False
    if text.endswith(":") or len(text.split()) < min_words or "$" in text or "http" in text:
        return False
    letters = sum(c.isalpha() or c.isspace() for c in text)
    return letters >= 0.85 * len(text) and len(_WORD.findall(text)) >= min_words


def docstring_paragraphs(docstring: str, min_words: int = 6, max_words: int = 48) -> list[str]:
    """The prose paragraphs of one docstring, cleaned (see the module docstring).

    Keeps the paragraphs before the first section and those of a "Notes" section; each is
    cut to ``max_words`` words.
    """
    require(min_words >= 1, "min_words", min_words, "an integer >= 1")
    require(max_words >= min_words, "max_words", max_words, f"an integer >= {min_words}")
    import inspect

    paragraphs = re.split(r"\n\s*\n", inspect.cleandoc(docstring))
    kept: list[str] = []
    keep = True
    for paragraph in paragraphs:
        title = _section_title(paragraph)
        if title is not None:
            keep = title in _KEPT_SECTIONS
            body = paragraph.split("\n", 2)[2:] if "\n" in paragraph else []
            paragraph = body[0] if body and keep else ""
        if not keep or not paragraph.strip():
            continue
        text = _clean(paragraph)
        if _is_prose(paragraph, text, min_words):
            kept.append(_truncate(text, min_words, max_words))
    return kept


def _truncate(text: str, min_words: int, max_words: int) -> str:
    """``text`` cut to ``max_words`` words, at the last sentence end when that keeps
    ``min_words`` words."""
    words = text.split()
    if len(words) <= max_words:
        return text
    head = " ".join(words[:max_words])
    end = max(head.rfind(". "), head.rfind("? "), head.rfind("! "))
    if end != -1 and len(head[: end + 1].split()) >= min_words:
        return head[: end + 1]
    return head


def module_docstrings(source: str) -> list[str]:
    """Docstrings of a module's source, in source order (module, classes, functions), read
    with :mod:`ast`; empty if the source does not parse."""
    try:
        tree = ast.parse(source)
    except (SyntaxError, ValueError):
        return []
    found = []
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            doc = ast.get_docstring(node, clean=False)
            if doc:
                found.append((getattr(node, "lineno", 0), doc))
    return [doc for _, doc in sorted(found, key=lambda item: item[0])]


# --------------------------------------------------------------------------------------------
# Installed packages -> modules -> texts
# --------------------------------------------------------------------------------------------


def _package_root(package: str) -> Path:
    import importlib.util

    spec = importlib.util.find_spec(package)
    locations = None if spec is None else spec.submodule_search_locations
    require(bool(locations), "packages", package, "the import name of an installed Python package")
    return Path(list(locations)[0])


def _version(package: str) -> str:
    try:
        return metadata.version(_DISTRIBUTIONS.get(package, package))
    except metadata.PackageNotFoundError:
        return "unknown"


def _cache_dir() -> Path:
    base = os.environ.get("FEDSIM_CACHE") or os.environ.get("XDG_CACHE_HOME")
    return (Path(base) / "fedsim" if base else Path.home() / ".cache" / "fedsim") / "text"


_RULES_VERSION = "2"
_PACKAGE_LOCK = threading.Lock()
_PACKAGE_TEXTS: dict[tuple[str, int, int], list[tuple[str, list[str]]]] = {}


def package_modules(
    package: str, min_words: int = 6, max_words: int = 48
) -> list[tuple[str, list[str]]]:
    """``(module name, cleaned texts)`` for every non-test source file of ``package``,
    sorted by path. Cached per process and on disk (``$FEDSIM_CACHE/text``, keyed by the
    package's version, location and the cleaning settings)."""
    key = (package, min_words, max_words)
    with _PACKAGE_LOCK:
        if key in _PACKAGE_TEXTS:
            return _PACKAGE_TEXTS[key]
    root = _package_root(package)
    digest = hashlib.sha256(
        f"{_RULES_VERSION}:{root}:{_version(package)}:{min_words}:{max_words}".encode()
    ).hexdigest()[:16]
    cache = _cache_dir() / f"{package}-{digest}.json"
    modules: list[tuple[str, list[str]]] | None = None
    if cache.is_file():
        try:
            modules = [(m, list(t)) for m, t in json.loads(cache.read_text())]
        except (OSError, ValueError):
            modules = None
    if modules is None:
        modules = []
        for path in sorted(root.rglob("*.py")):
            relative = path.relative_to(root.parent)
            parts = relative.with_suffix("").parts
            if any(p in ("tests", "test", "testing", "conftest") for p in parts):
                continue
            try:
                source = path.read_text(encoding="utf-8")
            except (OSError, UnicodeDecodeError):
                continue
            texts = [
                text
                for doc in module_docstrings(source)
                for text in docstring_paragraphs(doc, min_words, max_words)
            ]
            name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
            modules.append((name, texts))
        try:
            cache.parent.mkdir(parents=True, exist_ok=True)
            scratch = cache.with_suffix(f".{os.getpid()}.tmp")
            scratch.write_text(json.dumps(modules))
            os.replace(scratch, cache)
        except OSError:
            pass  # the cache only saves time
    with _PACKAGE_LOCK:
        _PACKAGE_TEXTS[key] = modules
    return modules


def _split_clients(
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


def docstring_federation(
    client_packages: Sequence[str] = DEFAULT_CLIENT_PACKAGES,
    public_packages: Sequence[str] = DEFAULT_PUBLIC_PACKAGES,
    *,
    min_texts: int = 4,
    max_clients: int | None = None,
    held_out_fraction: float = 0.2,
    min_words: int = 6,
    max_words: int = 48,
    seed: int = 0,
) -> TextFederation:
    """The docstring federation (module docstring): one client per source file of
    ``client_packages`` with at least ``min_texts`` distinct texts, the first ``max_clients``
    of them in package and path order; public texts from ``public_packages``."""
    require(len(client_packages) > 0, "client_packages", client_packages, "at least one package")
    overlap = set(client_packages) & set(public_packages)
    require(not overlap, "public_packages", sorted(overlap), "packages not used as clients")
    require(min_texts >= 2, "min_texts", min_texts, "an integer >= 2")
    require(
        max_clients is None or max_clients >= 1,
        "max_clients",
        max_clients,
        "an integer >= 1 (or none)",
    )
    seen: set[str] = set()

    def fresh(texts: Iterable[str]) -> list[str]:
        out = []
        for text in texts:
            if text not in seen:
                seen.add(text)
                out.append(text)
        return out

    clients: list[tuple[str, list[str]]] = []
    for package in client_packages:
        for module, texts in package_modules(package, min_words, max_words):
            kept = fresh(texts)
            if len(kept) >= min_texts and (max_clients is None or len(clients) < max_clients):
                clients.append((module, kept))
    public = [
        text
        for package in public_packages
        for _, texts in package_modules(package, min_words, max_words)
        for text in fresh(texts)
    ]
    require(
        len(clients) > 0,
        "client_packages",
        tuple(client_packages),
        f"packages with at least one module of {min_texts} or more docstring texts",
    )
    name = f"docstrings({'+'.join(client_packages)}; public {'+'.join(public_packages)})"
    return _split_clients(name, clients, public, held_out_fraction, seed)


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
    public: list[str] = []
    if public_path is not None:
        public_file = Path(public_path)
        table = _read_table(public_file, "public_path")
        public = [
            t
            for t in _text_column(table, public_file, "public_text_column", public_text_column)
            if t.strip()
        ]
    else:
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
        clients = [c for i, c in enumerate(clients) if i not in chosen]
    require(
        len(clients) > 0,
        "path",
        str(path),
        f"a table with at least one client of {min_texts} or more texts",
    )
    return _split_clients(f"table({Path(path).name})", clients, public, held_out_fraction, seed)


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
    return _split_clients(name, list(clients), list(public), held_out_fraction, seed)
