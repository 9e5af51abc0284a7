"""Federated text: docstring cleaning, the docstring federation, LargeFedBench-style files."""

import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from fedsim.config import ConfigError
from fedsim.data.docstrings import docstring_federation, docstring_paragraphs, module_docstrings
from fedsim.data.text import (
    TextSourceSpec,
    cached_text_federation,
    in_memory_federation,
    load_text_table,
    table_federation,
)

NUMPYDOC = """Compute the weighted average of an array along the given axis.

    The average is taken over the flattened array by default, otherwise
    over the specified axis using :func:`numpy.sum` and ``weights``.

    Parameters
    ----------
    a : array_like
        Array containing data to be averaged and many more words here.

    Notes
    -----
    The weights are normalised so that their sum is one before they are used.

    Examples
    --------
    >>> np.average([1, 2, 3, 4], weights=[4, 3, 2, 1])
    2.0
    """


def test_docstring_cleaning_keeps_summary_and_notes_drops_sections_and_markup():
    texts = docstring_paragraphs(NUMPYDOC, min_words=6, max_words=48)
    assert texts == [
        "Compute the weighted average of an array along the given axis.",
        "The average is taken over the flattened array by default, otherwise over the "
        "specified axis using numpy.sum and weights.",
        "The weights are normalised so that their sum is one before they are used.",
    ]
    short = docstring_paragraphs("One two three four five six seven. Eight nine ten eleven.", 3, 9)
    assert short == ["One two three four five six seven."]  # cut at the sentence end
    assert docstring_paragraphs("Too short.", min_words=6) == []
    with pytest.raises(ConfigError, match="max_words"):
        docstring_paragraphs(NUMPYDOC, min_words=6, max_words=3)


def test_module_docstrings_reads_source_without_importing_it():
    source = (
        '"""Module summary text."""\n'
        "import this_module_does_not_exist\n"
        'class A:\n    """Class doc."""\n'
        '    def f(self):\n        """Method doc."""\n'
    )
    assert module_docstrings(source) == ["Module summary text.", "Class doc.", "Method doc."]
    assert module_docstrings("def broken(:\n") == []


def test_docstring_federation_forms_one_client_per_module_with_disjoint_public_texts(
    tmp_path, monkeypatch
):
    monkeypatch.setenv("FEDSIM_CACHE", str(tmp_path))
    federation = docstring_federation(
        ("dateutil",), ("click",), min_texts=3, held_out_fraction=0.25, seed=3
    )
    again = docstring_federation(
        ("dateutil",), ("click",), min_texts=3, held_out_fraction=0.25, seed=3
    )
    assert federation == again  # deterministic (the second build reads the disk cache)
    assert list(tmp_path.glob("fedsim/text/dateutil-*.json"))
    assert federation.num_clients >= 3
    assert all(c.startswith("dateutil") for c in federation.client_ids)
    assert len(set(federation.client_ids)) == federation.num_clients
    private = set(federation.all_train()) | set(federation.all_held_out())
    assert federation.public and private.isdisjoint(federation.public)
    for train, held in zip(federation.train, federation.held_out, strict=True):
        assert len(held) == max(1, round(0.25 * (len(train) + len(held))))
        assert train and set(train).isdisjoint(held)
    assert all(6 <= len(t.split()) <= 48 for t in private)
    reshuffled = docstring_federation(
        ("dateutil",), ("click",), min_texts=3, held_out_fraction=0.25, seed=4
    )
    assert reshuffled.client_ids == federation.client_ids
    assert reshuffled.held_out != federation.held_out
    capped = docstring_federation(("dateutil",), ("click",), min_texts=3, max_clients=2)
    assert capped.client_ids == federation.client_ids[:2]
    with pytest.raises(ConfigError, match="public_packages"):
        docstring_federation(("dateutil",), ("dateutil",))
    with pytest.raises(ConfigError, match="no_such_package_xyz"):
        docstring_federation(("no_such_package_xyz",), ("click",))


ROWS = [
    {"client_id": "b", "text": "second client first text", "year": 1},
    {"client_id": "a", "text": "first client first text", "year": 2},
    {"client_id": "b", "text": "second   client\nsecond text", "year": 3},
    {"client_id": "a", "text": "first client second text", "year": 4},
    {"client_id": "a", "text": "first client third text", "year": 5},
    {"client_id": "c", "text": "third client only text", "year": 6},
]
EXPECTED = [
    ("a", ["first client first text", "first client second text", "first client third text"]),
    ("b", ["second client first text", "second client second text"]),
    ("c", ["third client only text"]),
]


def write_jsonl(path, rows):
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    return path


def write_parquet(path, rows):
    pq.write_table(pa.Table.from_pylist(rows), path)
    return path


@pytest.mark.parametrize("writer,suffix", [(write_jsonl, "jsonl"), (write_parquet, "parquet")])
def test_text_table_groups_texts_by_client_in_file_order(tmp_path, writer, suffix):
    path = writer(tmp_path / f"speeches.{suffix}", ROWS)
    assert load_text_table(path) == EXPECTED
    renamed = [{"speaker": r["client_id"], "body": r["text"]} for r in ROWS]
    other = writer(tmp_path / f"renamed.{suffix}", renamed)
    assert load_text_table(other, client_column="speaker", text_column="body") == EXPECTED


@pytest.mark.parametrize("writer,suffix", [(write_jsonl, "jsonl"), (write_parquet, "parquet")])
def test_text_table_errors_name_the_file_and_the_column(tmp_path, writer, suffix):
    path = writer(tmp_path / f"abstracts.{suffix}", ROWS)
    with pytest.raises(ConfigError, match=rf"text_column = 'abstract'.*abstracts\.{suffix}"):
        load_text_table(path, text_column="abstract")
    with pytest.raises(ConfigError, match=rf"client_column = 'author'.*abstracts\.{suffix}"):
        load_text_table(path, client_column="author")
    with pytest.raises(ConfigError, match=rf"text_column = 'year'.*strings in abstracts\.{suffix}"):
        load_text_table(path, text_column="year")
    with pytest.raises(ConfigError, match="missing.parquet"):
        load_text_table(tmp_path / "missing.parquet")
    bad = tmp_path / "table.csv"
    bad.write_text("client_id,text\n")
    with pytest.raises(ConfigError, match="table.csv.*ending in .parquet or .jsonl"):
        load_text_table(bad)
    broken = tmp_path / "broken.jsonl"
    broken.write_text('{"client_id": "a", "text": \n')
    with pytest.raises(ConfigError, match="broken.jsonl"):
        load_text_table(broken)


def test_table_federation_public_split_from_clients_or_from_a_file(tmp_path):
    rows = [
        {"client_id": f"c{c}", "text": f"client {c} text {t}"} for c in range(8) for t in range(4)
    ]
    path = write_jsonl(tmp_path / "clients.jsonl", rows)
    federation = table_federation(path, public_clients=2, held_out_fraction=0.25, seed=1)
    assert federation.num_clients == 6 and len(federation.public) == 8
    public_owners = {t.split()[1] for t in federation.public}
    assert len(public_owners) == 2
    assert not public_owners & {c[1:] for c in federation.client_ids}
    assert all(len(h) == 1 and len(t) == 3 for t, h in zip(federation.train, federation.held_out))
    assert federation == table_federation(path, public_clients=2, held_out_fraction=0.25, seed=1)

    public = write_parquet(tmp_path / "public.parquet", [{"text": "a public text"}] * 3)
    with_file = table_federation(path, public_path=public, min_texts=4)
    assert with_file.num_clients == 8 and with_file.public == ("a public text",) * 3
    with pytest.raises(ConfigError, match="public_path"):
        table_federation(path)
    with pytest.raises(ConfigError, match="public_clients"):
        table_federation(path, public_clients=8)
    with pytest.raises(ConfigError, match="public_clients"):
        table_federation(path, public_path=public, public_clients=1)


def test_text_source_spec_builds_and_caches_a_table_federation(tmp_path):
    rows = [{"client_id": c, "text": f"text {c} {t}"} for c in range(5) for t in range(3)]
    path = write_jsonl(tmp_path / "small.jsonl", rows)
    spec = TextSourceSpec(kind="table", path=str(path), public_clients=1, min_texts=2, seed=0)
    federation = cached_text_federation(spec)
    assert cached_text_federation(spec) is federation
    assert federation.num_clients == 4
    assert federation.client_texts(0) == federation.train[0]
    with pytest.raises(ConfigError, match="client"):
        federation.client_texts(4)
    capped = cached_text_federation(
        TextSourceSpec(
            kind="table", path=str(path), public_clients=1, min_texts=2, max_clients=2, seed=0
        )
    )
    assert capped.client_ids == federation.client_ids[:2]
    with pytest.raises(ConfigError, match="kind"):
        TextSourceSpec(kind="wiki")
    with pytest.raises(ConfigError, match="path"):
        TextSourceSpec(kind="table")


def test_in_memory_federation_splits_like_the_other_sources():
    federation = in_memory_federation(
        [("x", ["a", "b", "c", "d", "e"]), ("y", ["f", "g"])], ["p"], held_out_fraction=0.4
    )
    assert [len(h) for h in federation.held_out] == [2, 1]
    assert sorted(federation.train[0] + federation.held_out[0]) == ["a", "b", "c", "d", "e"]
    with pytest.raises(ConfigError, match="clients"):
        in_memory_federation([("z", ["only one"])], [])
