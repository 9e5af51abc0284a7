"""Authenticated records and atomic writes of run-directory files."""

import sqlite3

import pytest

from fedsim.config import ConfigError
from fedsim.runfiles import RunFileError, open_record, seal_record, write_atomic

KEY = bytes(range(32))


def record(tmp_path, data: bytes):
    path = tmp_path / "file.rec"
    path.write_bytes(data)
    return path


def test_a_record_round_trips_and_is_written_atomically(tmp_path):
    path = tmp_path / "file.rec"
    write_atomic(path, seal_record("ckpt", 3, {"round": 7}, b"payload", KEY))
    assert open_record(path, "ckpt", 3, KEY, "a test record") == ({"round": 7}, b"payload")
    assert [p.name for p in tmp_path.iterdir()] == ["file.rec"]  # no temporary file left


@pytest.mark.parametrize(
    ("damage", "says"),
    [
        (lambda good: b"", "is empty"),
        (lambda good: good[:-1], "truncated"),
        (lambda good: good + b"\x00", "truncated"),
        (lambda good: good[:40], "truncated"),
        (lambda good: b"\x80\x05garbage" + good[10:], "is not a test record"),
        (lambda good: good[:-1] + bytes([good[-1] ^ 1]), "fails authentication"),
        (lambda good: good[:40] + bytes([good[40] ^ 1]) + good[41:], "fails authentication"),
        (lambda good: seal_record("ckpt", 3, {"round": 7}, b"payload", bytes(32)),
         "fails authentication"),
        (lambda good: seal_record("other", 3, {}, b"", KEY), "holds a fedsim 'other' record"),
        (lambda good: seal_record("ckpt", 4, {}, b"", KEY), "schema version 4"),
    ],
    ids=["empty", "one byte short", "one byte long", "cut in the header", "garbage",
         "tag flipped", "header flipped", "other key", "other kind", "other schema"],
)
def test_every_damaged_record_is_refused_naming_the_file(tmp_path, damage, says):
    good = seal_record("ckpt", 3, {"round": 7}, b"payload", KEY)
    path = record(tmp_path, damage(good))
    with pytest.raises(RunFileError, match=says) as err:
        open_record(path, "ckpt", 3, KEY, "a test record")
    assert err.value.path == path and str(err.value).startswith(str(path))


def test_a_missing_record_is_refused_naming_the_file(tmp_path):
    with pytest.raises(RunFileError, match="cannot be read") as err:
        open_record(tmp_path / "gone.rec", "ckpt", 3, KEY, "a test record")
    assert "gone.rec" in str(err.value)


def test_a_new_run_takes_over_only_what_an_unstarted_run_left(tmp_path):
    from fedsim.frontend.rundir import RunDirectory  # noqa: PLC0415
    from fedsim.randomness import RunSecret  # noqa: PLC0415

    root = RunSecret.from_passphrase("tests")
    unstarted = RunDirectory.create(tmp_path / "a", '{"a": 1}', root, 0)
    unstarted.close()  # refused before its first round: a config and an empty state store
    again = RunDirectory.create(tmp_path / "a", '{"a": 2}', root, 0)
    again.close()
    assert (tmp_path / "a" / "config.json").read_text() == '{"a": 2}'
    # someone else's files are never removed: a foreign database and a config beside it
    other = tmp_path / "b"
    other.mkdir()
    sqlite3.connect(other / "notes.sqlite").execute("CREATE TABLE t (x)").connection.close()
    (other / "config.json").write_text("mine")
    with pytest.raises(ConfigError, match="config.json"):
        RunDirectory.create(other, "{}", root, 0)
    assert (other / "config.json").read_text() == "mine" and (other / "notes.sqlite").exists()
