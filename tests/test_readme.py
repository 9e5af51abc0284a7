"""The README is a front page: short, its links and those of docs/ lead somewhere, and its
strategies table names every method a config can name."""

import re
from pathlib import Path

import pytest

from strategies.registry import SPECS

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
PAGES = [README, *sorted((ROOT / "docs").glob("*.md"))]
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")


def prose(text: str) -> str:
    """``text`` without its fenced code blocks (their ``#`` lines are not headings, their
    brackets not links)."""
    return re.sub(r"^```.*?^```", "", text, flags=re.M | re.S)


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def anchors(page: Path) -> set[str]:
    seen: dict[str, int] = {}
    found = set()
    for heading in re.findall(r"^#{1,6} (.+)$", prose(page.read_text()), flags=re.M):
        base = slug(heading)
        found.add(base if base not in seen else f"{base}-{seen[base]}")
        seen[base] = seen.get(base, 0) + 1
    return found


def test_readme_is_at_most_1200_words():
    words = len(README.read_text().split())  # what `wc -w README.md` counts
    assert words <= 1200, words


def test_docs_exist_and_the_readme_links_each_page():
    linked = {Path(t.split("#")[0]).name for t in LINK.findall(prose(README.read_text()))}
    pages = {page.name for page in PAGES[1:]}
    assert len(pages) >= 10
    assert pages <= linked, sorted(pages - linked)


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_relative_links_and_anchors_resolve(page):
    broken = []
    for target in LINK.findall(prose(page.read_text())):
        if re.match(r"[a-z]+:", target):  # http(s), mailto: not checked here
            continue
        path, _, anchor = target.partition("#")
        resolved = (page.parent / path).resolve() if path else page
        if not resolved.exists():
            broken.append(f"{target}: no {resolved.relative_to(ROOT)}")
        elif anchor and resolved.suffix == ".md" and anchor not in anchors(resolved):
            broken.append(f"{target}: no heading #{anchor} in {resolved.relative_to(ROOT)}")
    assert not broken, broken


def test_the_strategies_table_names_every_config_name():
    text = README.read_text()
    table = text[text.index("## Strategies") :]
    table = table[: table.index("\n## ", 1)]
    named = set(re.findall(r"`([a-z][a-z0-9-]*)`", table))
    missing = [spec.name for spec in SPECS if spec.name not in named]
    assert not missing, missing


def test_the_license_is_the_apache_license_2_0():
    text = (ROOT / "LICENSE").read_text()
    assert "Apache License\n                           Version 2.0, January 2004" in text
    assert "END OF TERMS AND CONDITIONS" in text and "APPENDIX" in text
    assert 'license = "Apache-2.0"' in (ROOT / "pyproject.toml").read_text()  # SPDX (PEP 639)
