"""Every number the README, docs/ and the studies' READMEs quote, from a stored file.

``experiments/numbers.toml`` names each quoted value (its stored source file, its key there or an
arithmetic expression of keys, and its format) and each generated region (the command that
writes it from stored files, and those files). The markdown says which is which:

    <!--n:NAME-->TEXT<!--/n-->      TEXT is value NAME, formatted (``fill`` rewrites it)
    <!--in-->TEXT<!--/in-->         the numbers in TEXT are inputs: settings, sizes, versions
    <!-- inputs: WHY -->            alone on a line: the next block (to a blank line) is inputs
    <!-- inputs:begin WHY -->       ... the lines up to ``<!-- inputs:end -->`` are inputs

(no spaces inside the inline markers, so they add no words to a page). A generated region is
written by its command, or, for a command that prints tables, filled with the one it names
(``stdout_table``). Its text and its sources are stamped (sha256) in
``experiments/numbers.lock.json`` once its command has written it, so a hand edit of the
region or a changed source without a rerun fails ``check``.
Any other number in prose or tables, outside code, is a quoted number without a source.

    python experiments/quote_numbers.py check          # what the quoted-numbers test asserts
    python experiments/quote_numbers.py fill           # rewrite every value marker from its source
    python experiments/quote_numbers.py tables         # rerun every generator (needs .venv), stamp
    python experiments/quote_numbers.py stamp          # stamp the regions as they stand
    python experiments/quote_numbers.py uncovered [PAGE...]  # numbers without a source, in context

Standard library only: the check runs without the project's dependencies.
"""

from __future__ import annotations

import argparse
import ast
import glob
import hashlib
import json
import math
import re
import statistics
import subprocess
import sys
import tomllib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
MANIFEST = ROOT / "experiments" / "numbers.toml"
LOCK = ROOT / "experiments" / "numbers.lock.json"

VALUE = re.compile(r"<!--n:([\w.-]+)-->(.*?)<!--/n-->", re.S)
INLINE_INPUT = re.compile(r"<!--in-->.*?<!--/in-->", re.S)
BLOCK_INPUT = re.compile(r"^[ \t]*<!-- inputs: [^\n]*?-->[ \t]*\n(?:[^\n]*\S[^\n]*(?:\n|$))*", re.M)
REGION_INPUT = re.compile(r"^[ \t]*<!-- inputs:begin\b.*?<!-- inputs:end -->", re.M | re.S)
FENCE = re.compile(r"^[ \t]*(```|~~~).*?^[ \t]*\1[^\n]*$", re.M | re.S)
INDENTED_CODE = re.compile(r"(?:\A|\n[ \t]*\n)((?:(?: {4}|\t)[^\n]*(?:\n|\Z))+)")
COMMENT = re.compile(r"<!--.*?-->", re.S)
CODE_SPAN = re.compile(r"(`+)(?!`).+?(?<!`)\1", re.S)
LINK_TARGET = re.compile(r"\]\([^)\s]*(?:\s+\"[^\"]*\")?\)|<https?://[^>]+>|https?://\S+")
LIST_ORDINAL = re.compile(r"^[ \t]*\d+\.[ \t]", re.M)
#: notation that names a statistic, not a quoted value: "sample sd (ddof = 1)"
NOTATION = re.compile(r"\bddof\s*=\s*[01]\b")
#: a citation's year: "(Kairouz, Liu & Steinke, ICML 2021)", "Hou et al., 2025"
CITATION_YEAR = re.compile(r"(?:\b[A-Z][A-Za-z&]*[A-Z]|et al\.,?)\s+(?:19|20)\d\d\b")
HEADING = re.compile(r"^#{1,6} .*$", re.M)  # a heading names its section (and its anchor)
#: a number: not glued to a word on its left (KLS21, LeNet-5, x_1), nor an ordinal (2nd)
NUMBER = re.compile(
    r"(?<![\w.^])(?<![A-Za-z]-)(?<![A-Za-z]−)[−-]?\d+(?:[.,]\d+)*(?:e[−-]?\d+)?(?!\d)(?!st\b|nd\b|rd\b|th\b)"
)


def _betainc(a: float, b: float, x: float) -> float:
    """The regularized incomplete beta function I_x(a, b) (continued fraction, Lentz)."""
    if x <= 0.0:
        return 0.0
    if x >= 1.0:
        return 1.0
    if x > (a + 1.0) / (a + b + 2.0):  # the fraction converges fast on this side only
        return 1.0 - _betainc(b, a, 1.0 - x)
    tiny = 1e-300
    front = math.exp(
        math.lgamma(a + b) - math.lgamma(a) - math.lgamma(b) + a * math.log(x) + b * math.log1p(-x)
    )
    c, d = 1.0, 1.0 - (a + b) * x / (a + 1.0)
    d = 1.0 / (d if abs(d) > tiny else tiny)
    h = d
    for m in range(1, 1000):
        for numerator in (
            m * (b - m) * x / ((a + 2 * m - 1) * (a + 2 * m)),
            -(a + m) * (a + b + m) * x / ((a + 2 * m) * (a + 2 * m + 1)),
        ):
            d = 1.0 + numerator * d
            d = 1.0 / (d if abs(d) > tiny else tiny)
            c = 1.0 + numerator / c
            c = c if abs(c) > tiny else tiny
            h *= d * c
        if abs(d * c - 1.0) < 1e-15:
            break
    return front * h / a


def paired_t_p(differences: list[float]) -> float:
    """Two-sided p of the paired t-test whose per-pair differences are ``differences``: the
    one-sample t-test of their mean against 0, t = mean / (sample sd (ddof = 1) / sqrt(n)),
    n - 1 degrees of freedom (what scipy.stats.ttest_rel returns)."""
    n = len(differences)
    if n < 2:
        raise NumbersError(f"paired_t_p: needs at least 2 differences, got {n}")
    mean, sd = statistics.fmean(differences), statistics.stdev(differences)
    if sd == 0:
        raise NumbersError(f"paired_t_p: the {n} differences are all equal (sd 0)")
    t = mean / (sd / math.sqrt(n))
    df = n - 1
    return _betainc(df / 2.0, 0.5, df / (df + t * t))


FUNCTIONS = {
    "abs": abs,
    "min": min,
    "max": max,
    "len": len,
    "sum": sum,
    "round": round,
    "mean": statistics.fmean,
    "median": statistics.median,
    "sample_sd": statistics.stdev,  # ddof = 1
    "sqrt": math.sqrt,
    "count_below": lambda values, bound: sum(v < bound for v in values),
    "paired_t_p": paired_t_p,
}
ALLOWED_NODES = (
    ast.Expression,
    ast.BinOp,
    ast.UnaryOp,
    ast.Constant,
    ast.Name,
    ast.Load,
    ast.Call,
    ast.Add,
    ast.Sub,
    ast.Mult,
    ast.Div,
    ast.Pow,
    ast.USub,
    ast.UAdd,
    ast.List,
    ast.Tuple,
    ast.Subscript,
    ast.Slice,
)


class NumbersError(ValueError):
    """A manifest entry or a marker that cannot be resolved."""


@dataclass(frozen=True)
class Problem:
    page: str
    line: int
    message: str

    def __str__(self) -> str:
        return f"{self.page}:{self.line}: {self.message}"


def pages(root: Path = ROOT) -> list[Path]:
    """The pages whose numbers must come from stored files."""
    found = [root / "README.md", *sorted((root / "docs").glob("*.md"))]
    found += sorted((root / "experiments").glob("*/README.md"))
    return [p for p in found if p.exists()]


def load_manifest(path: Path = MANIFEST) -> dict[str, Any]:
    manifest = tomllib.loads(path.read_text())
    unknown = set(manifest) - {"value", "generated", "pending"}
    if unknown:
        raise NumbersError(
            f"{path.name}: unknown tables {sorted(unknown)}; allowed: value, generated, pending"
        )
    manifest.setdefault("value", {})
    manifest.setdefault("generated", [])
    manifest.setdefault("pending", {})
    return manifest


# -- values -----------------------------------------------------------------------------------


def split_key(key: str | list) -> list[str | int]:
    """``a.b[0]["c.d"][*][-1]`` -> ["a", "b", 0, "c.d", "*", -1]; a TOML list is taken as it is."""
    if isinstance(key, list):
        return key
    parts: list[str | int] = []
    for match in re.finditer(r'\[(-?\d+|\*|"[^"]*")\]|([^.\[\]]+)', key):
        index, name = match.groups()
        if name is not None:
            parts.append(name)
        elif index == "*":
            parts.append("*")
        elif index.startswith('"'):
            parts.append(index[1:-1])
        else:
            parts.append(int(index))
    return parts


def lookup(data: Any, parts: list[str | int], where: str) -> Any:
    for i, part in enumerate(parts):
        if part == "*":
            if not isinstance(data, list | dict):
                raise NumbersError(f"{where}: [*] on a {type(data).__name__}")
            items = data if isinstance(data, list) else list(data.values())
            return [lookup(item, parts[i + 1 :], where) for item in items]
        try:
            data = data[part]
        except (KeyError, IndexError, TypeError):
            raise NumbersError(f"{where}: no key {part!r} (path {parts[: i + 1]})") from None
    return data


_files: dict[Path, Any] = {}


def read_source(path: str, root: Path) -> Any:
    file = root / path
    if file not in _files:
        if not file.exists():
            raise NumbersError(f"source {path} does not exist")
        text = file.read_text()
        if file.suffix == ".jsonl":
            _files[file] = [json.loads(line) for line in text.splitlines() if line.strip()]
        else:
            _files[file] = json.loads(text)
    return _files[file]


def resolve(name: str, spec: dict[str, Any], root: Path = ROOT) -> Any:
    """The value ``spec`` names: its ``key`` in ``source``, or ``expr`` over its ``keys``."""
    where = f"value {name}"
    allowed = {"source", "key", "keys", "expr", "format", "minus", "note"}
    if set(spec) - allowed:
        raise NumbersError(
            f"{where}: unknown fields {sorted(set(spec) - allowed)}; allowed {sorted(allowed)}"
        )

    def one(key: str | list) -> Any:
        source = spec.get("source")
        if isinstance(key, str) and "::" in key:
            source, key = key.split("::", 1)
        if source is None:
            raise NumbersError(f"{where}: no source for key {key!r}")
        return lookup(read_source(source, root), split_key(key), f"{where} ({source})")

    if "expr" not in spec:
        if "key" not in spec:
            raise NumbersError(f"{where}: needs key, or expr with keys")
        return one(spec["key"])
    names = {k: one(v) for k, v in spec.get("keys", {}).items()}
    if "key" in spec:
        names["x"] = one(spec["key"])
    tree = ast.parse(spec["expr"], mode="eval")
    for node in ast.walk(tree):
        if not isinstance(node, ALLOWED_NODES):
            raise NumbersError(f"{where}: {type(node).__name__} not allowed in expr")
        if isinstance(node, ast.Call) and not (
            isinstance(node.func, ast.Name) and node.func.id in FUNCTIONS
        ):
            raise NumbersError(f"{where}: only {sorted(FUNCTIONS)} may be called")
    return eval(compile(tree, where, "eval"), {"__builtins__": {}}, {**FUNCTIONS, **names})  # noqa: S307


def formatted(name: str, spec: dict[str, Any], root: Path = ROOT) -> str:
    value = resolve(name, spec, root)
    text = format(value, spec.get("format", ""))
    if "minus" in spec:
        text = text.replace("-", spec["minus"])
    return text


# -- regions ----------------------------------------------------------------------------------


def region_span(text: str, entry: dict[str, Any]) -> tuple[int, int] | None:
    """(start, end) of the generated region's text, between its begin and end strings."""
    begin, end = entry.get("begin"), entry.get("end")
    if begin is None and end is None:
        return 0, len(text)
    i = text.find(begin)
    if i < 0:
        return None
    j = text.find(end, i + len(begin))
    if j < 0:
        return None
    return i + len(begin), j


def region_id(entry: dict[str, Any]) -> str:
    return f"{entry['file']}#{entry.get('begin') or 'whole'}"


def source_files(entry: dict[str, Any], root: Path) -> list[Path]:
    files: set[Path] = set()
    for pattern in entry.get("sources", []):
        matched = glob.glob(str(root / pattern), recursive=True)
        if not matched:
            raise NumbersError(f"{region_id(entry)}: no file matches source {pattern!r}")
        files.update(Path(m) for m in matched if Path(m).is_file())
    return sorted(files)


def digest(entry: dict[str, Any], root: Path) -> dict[str, str]:
    text = (root / entry["file"]).read_text()
    span = region_span(text, entry)
    if span is None:
        raise NumbersError(f"{region_id(entry)}: begin/end markers not found in {entry['file']}")
    sources = hashlib.sha256()
    for file in source_files(entry, root):
        sources.update(str(file.relative_to(root)).encode() + b"\0")
        sources.update(hashlib.sha256(file.read_bytes()).digest())
    return {
        "region": hashlib.sha256(text[span[0] : span[1]].encode()).hexdigest(),
        "sources": sources.hexdigest(),
        "command": entry["command"],
    }


# -- the scan ---------------------------------------------------------------------------------


def blank(text: str, start: int, end: int) -> str:
    """``text`` with [start, end) replaced by spaces, newlines kept (line numbers hold)."""
    return text[:start] + re.sub(r"[^\n]", " ", text[start:end]) + text[end:]


def blank_all(text: str, pattern: re.Pattern) -> str:
    for match in reversed(list(pattern.finditer(text))):
        text = blank(text, match.start(), match.end())
    return text


def line_of(text: str, index: int) -> int:
    return text.count("\n", 0, index) + 1


def blank_code(text: str) -> str:
    """``text`` with its fenced and indented code blocks blanked."""
    text = blank_all(text, FENCE)
    for match in reversed(list(INDENTED_CODE.finditer(text))):
        text = blank(text, match.start(1), match.end(1))
    return text


def check_page(
    page: Path, manifest: dict[str, Any], root: Path = ROOT, used: set[str] | None = None
) -> list[Problem]:
    """Value markers that disagree with their source, and numbers with no source at all."""
    rel = str(page.relative_to(root))
    text = page.read_text()
    problems: list[Problem] = []
    masked = text
    for entry in manifest["generated"]:
        if entry["file"] == rel:
            span = region_span(text, entry)
            if span is None:
                problems.append(
                    Problem(rel, 1, f"generated region {entry.get('begin')!r} not found")
                )
            else:
                masked = blank(masked, *span)
    masked = blank_code(masked)
    for match in VALUE.finditer(blank_all(masked, CODE_SPAN)):  # a marker in code is text
        name, quoted = match.groups()
        line = line_of(text, match.start())
        spec = manifest["value"].get(name)
        if used is not None:
            used.add(name)
        if spec is None:
            problems.append(Problem(rel, line, f"marker n:{name} names no value in numbers.toml"))
            continue
        try:
            expected = formatted(name, spec, root)
        except NumbersError as error:
            problems.append(Problem(rel, line, str(error)))
            continue
        if quoted != expected:
            problems.append(
                Problem(rel, line, f"n:{name} quotes {quoted!r}, its source gives {expected!r}")
            )
    for pattern in (VALUE, INLINE_INPUT, REGION_INPUT, BLOCK_INPUT, COMMENT, CODE_SPAN):
        masked = blank_all(masked, pattern)
    masked = blank_all(masked, LINK_TARGET)
    masked = blank_all(masked, LIST_ORDINAL)
    masked = blank_all(masked, HEADING)
    masked = blank_all(masked, NOTATION)
    masked = blank_all(masked, CITATION_YEAR)
    for match in NUMBER.finditer(masked):
        line = line_of(masked, match.start())
        context = text.splitlines()[line - 1].strip()
        problems.append(
            Problem(
                rel,
                line,
                f"{match.group()!r} has no source (mark it n:NAME or as input): {context[:120]}",
            )
        )
    return problems


def check(root: Path = ROOT, manifest_path: Path | None = None) -> list[Problem]:
    """Every problem of every page, of the manifest and of the stamps."""
    _files.clear()
    manifest = load_manifest(manifest_path or root / "experiments" / "numbers.toml")
    used: set[str] = set()
    problems = []
    for page in pages(root):
        found = check_page(page, manifest, root, used)
        rel = str(page.relative_to(root))
        if rel in manifest["pending"]:
            unsourced = [p for p in found if " has no source " in p.message]
            found = [p for p in found if " has no source " not in p.message]
            allowed = manifest["pending"][rel]
            if len(unsourced) != allowed:
                more = len(unsourced) > allowed
                found.append(
                    Problem(
                        rel,
                        unsourced[allowed].line if more else 1,
                        f"{len(unsourced)} numbers without a source, pending allows {allowed}: "
                        + (
                            "source or mark the new ones"
                            if more
                            else f"set [pending] to {len(unsourced)}"
                        )
                        + (f" (e.g. {unsourced[allowed].message})" if more else ""),
                    )
                )
        problems += found
    for rel in sorted(set(manifest["pending"]) - {str(p.relative_to(root)) for p in pages(root)}):
        problems.append(
            Problem("experiments/numbers.toml", 1, f"pending page {rel} does not exist")
        )
    for name in sorted(set(manifest["value"]) - used):
        problems.append(Problem("experiments/numbers.toml", 1, f"value {name} is quoted nowhere"))
    lock_path = root / "experiments" / "numbers.lock.json"
    lock = json.loads(lock_path.read_text()) if lock_path.exists() else {}
    for entry in manifest["generated"]:
        key = region_id(entry)
        try:
            now = digest(entry, root)
        except NumbersError as error:
            problems.append(Problem(entry["file"], 1, str(error)))
            continue
        stamped = lock.get(key)
        if stamped is None:
            problems.append(
                Problem(
                    entry["file"], 1, f"{key}: not stamped; run `{entry['command']}` then stamp"
                )
            )
        elif stamped["sources"] != now["sources"]:
            problems.append(
                Problem(
                    entry["file"],
                    1,
                    f"{key}: its sources changed since it was generated; "
                    f"run `{entry['command']}` then stamp",
                )
            )
        elif stamped["region"] != now["region"]:
            problems.append(
                Problem(
                    entry["file"], 1, f"{key}: edited by hand since `{entry['command']}` wrote it"
                )
            )
    return problems


# -- commands ---------------------------------------------------------------------------------


def fill(root: Path = ROOT) -> int:
    """Rewrite every value marker with its source's value; returns the number changed."""
    _files.clear()
    manifest = load_manifest(root / "experiments" / "numbers.toml")
    changed = 0
    for page in pages(root):
        text = page.read_text()
        rel = page.relative_to(root)

        new_text = text
        for match in reversed(list(VALUE.finditer(blank_all(blank_code(text), CODE_SPAN)))):
            name = match.group(1)
            if name not in manifest["value"]:
                raise NumbersError(f"{rel}: marker n:{name} names no value")
            new = formatted(name, manifest["value"][name], root)
            changed += new != match.group(2)
            marker = f"<!--n:{name}-->{new}<!--/n-->"
            new_text = new_text[: match.start()] + marker + new_text[match.end() :]
        if new_text != text:
            page.write_text(new_text)
    return changed


def stamp(root: Path = ROOT) -> None:
    manifest = load_manifest(root / "experiments" / "numbers.toml")
    lock = {region_id(e): digest(e, root) for e in manifest["generated"]}
    (root / "experiments" / "numbers.lock.json").write_text(json.dumps(lock, indent=2) + "\n")


def markdown_tables(text: str) -> list[str]:
    """The markdown tables in ``text`` (runs of lines that start with ``|``), in order."""
    return [t.strip("\n") for t in re.findall(r"(?:^\|[^\n]*(?:\n|\Z))+", text, flags=re.M)]


def write_region(entry: dict[str, Any], content: str, root: Path) -> None:
    page = root / entry["file"]
    text = page.read_text()
    span = region_span(text, entry)
    if span is None:
        raise NumbersError(f"{region_id(entry)}: begin/end markers not found in {entry['file']}")
    page.write_text(text[: span[0]] + "\n" + content + "\n" + text[span[1] :])


def tables(root: Path = ROOT) -> None:
    """Rerun every generator; a command that prints tables (``stdout_table = N``) has its Nth
    table written into the region, the others write their regions themselves."""
    manifest = load_manifest(root / "experiments" / "numbers.toml")
    printed: dict[str, str] = {}
    for entry in manifest["generated"]:
        command = entry["command"]
        if command not in printed:
            print(f"$ {command}", flush=True)
            done = subprocess.run(  # noqa: S602
                command, shell=True, cwd=root, check=True, capture_output=True, text=True
            )
            printed[command] = done.stdout
        if "stdout_table" in entry:
            found = markdown_tables(printed[command])
            if entry["stdout_table"] >= len(found):
                raise NumbersError(
                    f"`{command}` printed {len(found)} tables, not table {entry['stdout_table']}"
                )
            write_region(entry, found[entry["stdout_table"]], root)
    stamp(root)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("command", choices=["check", "fill", "stamp", "tables", "uncovered"])
    parser.add_argument("pages", nargs="*")
    args = parser.parse_args(argv)
    if args.command == "fill":
        print(f"{fill()} markers changed")
        return 0
    if args.command == "stamp":
        stamp()
        return 0
    if args.command == "tables":
        tables()
        return 0
    if args.command == "uncovered":  # every page's own problems, pending or not
        manifest = load_manifest()
        chosen = [ROOT / p for p in args.pages] if args.pages else pages()
        problems = [p for page in chosen for p in check_page(page, manifest)]
    else:
        problems = check()
    for problem in problems:
        print(problem)
    print(f"{len(problems)} problems", file=sys.stderr)
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
