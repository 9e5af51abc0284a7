"""The docstring federation (:func:`docstring_federation`): a real corpus that installs
offline.

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
from disjoint packages. Clients are split as :func:`fedsim.data.text_federation.split_clients`
says.
"""

from __future__ import annotations

import ast
import hashlib
import json
import os
import re
import threading
from collections.abc import Iterable, Sequence
from importlib import metadata
from pathlib import Path

from fedsim.config import require
from fedsim.data.text_federation import TextFederation, split_clients

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
    return split_clients(name, clients, public, held_out_fraction, seed)
