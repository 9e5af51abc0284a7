"""Every number the README, docs/ and experiments/*/README.md quote comes from a stored file
(experiments/numbers.toml, experiments/quote_numbers.py), and the stored sds are sample sds."""

from __future__ import annotations

import json
import math
import shutil
import statistics
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "experiments"))

import quote_numbers as qn  # noqa: E402

PAGES = [str(p.relative_to(ROOT)) for p in qn.pages()]


@pytest.fixture(scope="module")
def problems() -> list[qn.Problem]:
    return qn.check()


@pytest.mark.parametrize("page", PAGES)
def test_every_quoted_number_matches_its_source_or_is_an_input(problems, page):
    found = [str(p) for p in problems if p.page == page]
    assert not found, "\n".join(found)


def test_the_manifest_names_only_quoted_values_and_stamped_regions(problems):
    found = [str(p) for p in problems if p.page not in PAGES]
    assert not found, "\n".join(found)


def test_the_pages_scanned_are_the_readme_docs_and_study_readmes():
    assert "README.md" in PAGES and "docs/methods.md" in PAGES
    assert "experiments/dmm/README.md" in PAGES and "experiments/popri/README.md" in PAGES
    assert len(PAGES) >= 20


# -- the checker against pages written to fail it --------------------------------------------


@pytest.fixture
def tree(tmp_path):
    """A repository with one page, one stored result and a manifest."""
    (tmp_path / "docs").mkdir()
    (tmp_path / "experiments" / "study").mkdir(parents=True)
    (tmp_path / "experiments" / "study" / "results.json").write_text(
        json.dumps({"runs": [{"acc": 0.5}, {"acc": 0.7}], "name with space": {"x": -0.123}})
    )
    (tmp_path / "experiments" / "numbers.toml").write_text(
        """
[value.mean_acc]
source = "experiments/study/results.json"
key = "runs[*].acc"
expr = "100 * mean(x)"
format = ".1f"

[value.sd_acc]
source = "experiments/study/results.json"
key = "runs[*].acc"
expr = "sample_sd(x)"
format = ".3f"

[value.odd]
source = "experiments/study/results.json"
key = ["name with space", "x"]
format = "+.2f"
minus = "−"

[[generated]]
file = "docs/page.md"
begin = "<!-- t:begin -->"
end = "<!-- t:end -->"
command = "python make_table.py"
sources = ["experiments/study/*.json"]
"""
    )
    return tmp_path


def write_page(tree: Path, body: str) -> Path:
    page = tree / "docs" / "page.md"
    page.write_text(body + "\n<!-- t:begin -->\n| a | 1.5 |\n<!-- t:end -->\n")
    return page


def messages(tree: Path) -> list[str]:
    return [p.message for p in qn.check(tree)]


GOOD = (
    "# Results in 2 tables\n\nAccuracy <!--n:mean_acc-->60.0<!--/n--> % ± "
    "<!--n:sd_acc-->0.141<!--/n--> (sample sd, ddof = 1) over <!--in-->2<!--/in--> seeds, "
    "shift <!--n:odd-->−0.12<!--/n-->; `--rounds 20` and\n\n```\nfedsim run --seed 3\n```\n\n"
    "1. a step, quoted as `<!--n:NAME-->12.5<!--/n-->` in code\n\n"
    "<!-- inputs: the settings -->\nlr 0.1, batch 16, 5 clients.\n"
)


def test_a_page_whose_numbers_all_have_sources_passes(tree):
    write_page(tree, GOOD)
    qn.stamp(tree)
    assert messages(tree) == []


def test_a_number_without_a_source_fails(tree):
    write_page(tree, GOOD + "\nIt is 3.5× faster.\n")
    qn.stamp(tree)
    found = messages(tree)
    assert len(found) == 1 and "'3.5' has no source" in found[0]


def test_a_number_after_an_inputs_block_ends_is_not_an_input(tree):
    write_page(tree, GOOD.replace("5 clients.\n", "5 clients.\n\nWe reach 0.93.\n"))
    qn.stamp(tree)
    assert any("'0.93' has no source" in m for m in messages(tree))


def test_a_quoted_value_that_disagrees_with_its_source_fails(tree):
    write_page(tree, GOOD.replace("60.0<!--/n-->", "61.0<!--/n-->"))
    qn.stamp(tree)
    assert messages(tree) == ["n:mean_acc quotes '61.0', its source gives '60.0'"]


def test_a_population_sd_is_not_the_sample_sd(tree):
    pop = f"{statistics.pstdev([0.5, 0.7]):.3f}"
    write_page(tree, GOOD.replace("0.141<!--/n-->", f"{pop}<!--/n-->"))
    qn.stamp(tree)
    assert messages(tree) == [f"n:sd_acc quotes '{pop}', its source gives '0.141'"]


def test_a_changed_source_fails_until_the_value_is_filled_again(tree):
    write_page(tree, GOOD)
    qn.stamp(tree)
    data = tree / "experiments" / "study" / "results.json"
    data.write_text(data.read_text().replace("0.7", "0.9"))
    found = messages(tree)
    assert "n:mean_acc quotes '60.0', its source gives '70.0'" in found
    assert any("its sources changed since it was generated" in m for m in found)
    assert qn.fill(tree) == 2
    qn.stamp(tree)
    assert messages(tree) == []


def test_a_generated_region_edited_by_hand_fails(tree):
    page = write_page(tree, GOOD)
    qn.stamp(tree)
    page.write_text(page.read_text().replace("| a | 1.5 |", "| a | 1.6 |"))
    assert any("edited by hand" in m for m in messages(tree))


def test_a_marker_naming_no_value_and_an_unquoted_value_fail(tree):
    write_page(tree, GOOD.replace("n:odd-->", "n:nothing-->").replace("<!--/n-->;", "<!--/n-->;"))
    qn.stamp(tree)
    found = messages(tree)
    assert "marker n:nothing names no value in numbers.toml" in found
    assert "value odd is quoted nowhere" in found


def test_a_missing_source_key_is_named(tree):
    toml = tree / "experiments" / "numbers.toml"
    toml.write_text(toml.read_text().replace('key = ["name with space", "x"]', 'key = "nope.x"'))
    write_page(tree, GOOD)
    qn.stamp(tree)
    assert any("no key 'nope'" in m for m in messages(tree))


def test_an_expression_may_only_call_the_listed_functions(tree):
    with pytest.raises(qn.NumbersError, match="only .* may be called"):
        qn.resolve(
            "x",
            {"source": "experiments/study/results.json", "key": "runs", "expr": "__import__('os')"},
            tree,
        )
    with pytest.raises(qn.NumbersError, match="Attribute not allowed"):
        qn.resolve(
            "x",
            {"source": "experiments/study/results.json", "key": "runs", "expr": "x.__class__"},
            tree,
        )


def test_paired_t_p_is_the_two_sided_paired_t_test(tree):
    """Against the t distribution's closed forms for 1 and 2 degrees of freedom (two-sided:
    1 - (2/pi) atan|t| and 1 - |t| / sqrt(2 + t^2)), through a manifest expression too."""
    t1 = 2.0 / (statistics.stdev([1.0, 3.0]) / math.sqrt(2))
    assert qn.paired_t_p([1.0, 3.0]) == pytest.approx(1 - 2 / math.pi * math.atan(t1), rel=1e-12)
    d = [0.5, 1.0, 3.0]
    t2 = statistics.fmean(d) / (statistics.stdev(d) / math.sqrt(3))
    assert qn.paired_t_p(d) == pytest.approx(1 - t2 / math.sqrt(2 + t2 * t2), rel=1e-12)
    assert qn.paired_t_p([-x for x in d]) == pytest.approx(qn.paired_t_p(d), rel=1e-12)
    tight = [10.0, 10.1, 9.9, 10.05, 9.95]  # t ~ 280: a p far in the tail, not 0
    assert 0 < qn.paired_t_p(tight) < 1e-8
    spec = {"source": "experiments/study/results.json", "key": "runs[*].acc"}
    t = 0.6 / (statistics.stdev([0.5, 0.7]) / math.sqrt(2))
    assert qn.resolve("p", {**spec, "expr": "paired_t_p(x)"}, tree) == pytest.approx(
        1 - 2 / math.pi * math.atan(t), rel=1e-12
    )
    with pytest.raises(qn.NumbersError, match="at least 2"):
        qn.paired_t_p([1.0])
    with pytest.raises(qn.NumbersError, match="all equal"):
        qn.paired_t_p([2.0, 2.0])


def test_a_pending_page_may_not_gain_unsourced_numbers(tree):
    toml = tree / "experiments" / "numbers.toml"
    toml.write_text(toml.read_text() + '\n[pending]\n"docs/page.md" = 1\n')
    write_page(tree, GOOD + "\nIt is 3.5× faster.\n")
    qn.stamp(tree)
    assert messages(tree) == []
    write_page(tree, GOOD + "\nIt is 3.5× faster, 4.5× cheaper.\n")
    qn.stamp(tree)
    assert any("2 numbers without a source, pending allows 1" in m for m in messages(tree))
    write_page(tree, GOOD)
    qn.stamp(tree)
    assert any("set [pending] to 0" in m for m in messages(tree))


def test_fill_rewrites_a_stale_marker(tree):
    write_page(tree, GOOD.replace("60.0<!--/n-->", "1<!--/n-->"))
    assert qn.fill(tree) == 1
    assert "<!--n:mean_acc-->60.0<!--/n-->" in (tree / "docs" / "page.md").read_text()


def test_the_shipped_manifest_checks_against_a_copy(tmp_path):
    """quote_numbers.py reads only what the repository holds: a copy checks the same."""
    for part in ("README.md", "docs", "experiments"):
        src = ROOT / part
        if src.is_dir():
            shutil.copytree(src, tmp_path / part, ignore=shutil.ignore_patterns("*.png", "cache"))
        else:
            shutil.copy(src, tmp_path / part)
    assert [str(p) for p in qn.check(tmp_path)] == [str(p) for p in qn.check()]


# -- sample sds ------------------------------------------------------------------------------


def stored_sds(data, path=""):
    """(path, stored sd, per-run values) of every ``<key>_std`` beside a ``runs`` list whose
    rows hold ``<key>``."""
    if isinstance(data, dict):
        runs = data.get("runs")
        if isinstance(runs, list) and runs and all(isinstance(r, dict) for r in runs):
            for key, value in data.items():
                values = [r.get(key[:-4]) for r in runs]
                if key.endswith("_std") and all(isinstance(v, int | float) for v in values):
                    yield f"{path}.{key}", value, values
        for key, value in data.items():
            yield from stored_sds(value, f"{path}.{key}")
    elif isinstance(data, list):
        for i, value in enumerate(data):
            yield from stored_sds(value, f"{path}[{i}]")


def test_every_stored_sd_beside_its_runs_is_the_sample_sd():
    """A ``*_std`` stored next to its per-seed runs is the sample sd (ddof = 1) of them."""
    checked, wrong = 0, []
    for file in sorted((ROOT / "experiments").glob("**/*.json")):
        for path, stored, values in stored_sds(json.loads(file.read_text())):
            if len(values) > 1:
                checked += 1
                if stored != pytest.approx(statistics.stdev(values), rel=1e-9, abs=1e-15):
                    wrong.append(f"{file.relative_to(ROOT)}{path}: {stored}")
    assert checked >= 50
    assert not wrong, wrong


def test_the_workloads_results_store_sample_sds_of_their_runs():
    results = json.loads((ROOT / "experiments" / "workloads" / "results.json").read_text())
    rows = [row for table in ("table1", "table1b", "table2") for row in results[table].values()]
    assert rows
    for row in rows:
        accuracies = [run["accuracy"] for run in row["runs"]]
        assert row["accuracy_std_ddof"] == 1
        assert row["accuracy_std"] == pytest.approx(statistics.stdev(accuracies), rel=1e-12)
