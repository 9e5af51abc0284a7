"""experiments/bench/limit.py: a DDGauss full-mode client's secure seconds over the sum of its
kernels, per exchange. Run at a tiny size; checks the stored structure and that every ratio
is computed from the stored kernel times (never the times themselves)."""

from __future__ import annotations

import copy
import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "experiments" / "bench" / "limit.py"
EXCHANGES = ["train", "share_keys", "masked_input", "unmask"]


@pytest.fixture(scope="module")
def stored(tmp_path_factory):
    out = tmp_path_factory.mktemp("limit") / "limit.json"
    command = [sys.executable, str(SCRIPT), "--dims", "300", "--cohorts", "50", "--degree", "4"]
    command += ["--rounds", "1", "--repeats", "2", "--out", str(out)]
    subprocess.run([*command, "--label", "before"], check=True, capture_output=True, cwd=ROOT)
    after = [*command, "--label", "after", "--prg", "aes-ctr", "--blas-threads", "2"]
    subprocess.run(after, check=True, capture_output=True, cwd=ROOT)
    return out, json.loads(out.read_text())


def test_each_label_holds_one_point_per_size_with_every_exchange(stored):
    _, result = stored
    assert list(result["runs"]) == ["before", "after"]  # a second label keeps the first
    prgs = [run["points"][0]["prg"] for run in result["runs"].values()]
    assert prgs == ["chacha20", "aes-ctr"]  # the client and the keystream kernel use --prg
    # one BLAS thread unless asked: the core of a worker
    assert [run["blas_threads"] for run in result["runs"].values()] == [1, 2]
    for run in result["runs"].values():
        (point,) = run["points"]
        assert (point["dim"], point["padded_dim"], point["cohort"]) == (300, 512, 50)
        assert (point["degree"], point["ring_bits"], point["bits"]) == (4, 32, 20)
        assert list(point["exchanges"]) == EXCHANGES
        # degree + 1 clients, one round: every client answered every exchange
        assert {e["client_calls"] for e in point["exchanges"].values()} == {5}
        share_keys = point["exchanges"]["share_keys"]["kernels"]
        assert {"ed25519_verify x2", "x25519_agree x8", "aead_seal_row x4"} <= set(share_keys)
        assert "keystream_D x5" in point["exchanges"]["masked_input"]["kernels"]
        assert point["keystream_bytes_per_s"] == pytest.approx(
            512 * 4 / point["units"]["cpu"]["keystream_D"]
        )
        assert set(point["units"]) == {"cpu", "wall"}


def test_every_ratio_is_the_client_over_the_sum_of_its_stored_kernels(stored):
    _, result = stored
    for run in result["runs"].values():
        for point in run["points"]:
            for suffix in ("", "_wall"):
                for row in point["exchanges"].values():
                    kernels = row[f"kernels{suffix}"]
                    assert row[f"limit{suffix}_s"] == pytest.approx(sum(kernels.values()))
                    assert row[f"ratio{suffix}"] == pytest.approx(
                        row[f"client{suffix}_s"] / row[f"limit{suffix}_s"]
                    )
                    assert all(s > 0 for s in kernels.values())
                    # the message floor is reported beside the limit, never inside it
                    assert row[f"floor{suffix}_s"] > 0
                    above = row[f"limit{suffix}_s"] + row[f"floor{suffix}_s"]
                    assert row[f"ratio_over_floor{suffix}"] == pytest.approx(
                        row[f"client{suffix}_s"] / above
                    )
                rows = point["exchanges"].values()
                limit = sum(r[f"limit{suffix}_s"] for r in rows)
                assert point[f"limit{suffix}_s"] == pytest.approx(limit)
                client = sum(r[f"client{suffix}_s"] for r in rows)
                assert point[f"ratio{suffix}"] == pytest.approx(client / limit)
            # the rotation's unit time is the one its exchange counts
            rotation = point["exchanges"]["train"]["kernels"]["rotation"]
            assert rotation == point["units"]["cpu"]["rotation"]


def printed_table(path: Path) -> str:
    return subprocess.run(
        [sys.executable, str(SCRIPT), "--table-only", "--out", str(path)],
        check=True,
        capture_output=True,
        text=True,
    ).stdout


def test_the_table_is_printed_from_the_stored_file(stored):
    out, result = stored
    printed = printed_table(out)
    lines = printed.strip().splitlines()
    assert len(lines) == 2 + 2 * 5  # header, then 4 exchanges and the round per label
    row = result["runs"]["after"]["points"][0]["exchanges"]["masked_input"]
    assert (
        f"| after | 3e2 (512) | 50 | masked_input | {row['client_s'] * 1e3:.2f} ms | "
        f"{row['limit_s'] * 1e3:.2f} ms | {row['ratio']:.2f}× | {row['ratio_wall']:.2f}× | "
        f"{row['floor_s'] * 1e3:.2f} ms | {row['ratio_over_floor']:.2f}× |"
    ) in printed
    assert lines[0].endswith("| message floor | client / (limit + floor) |")


def test_a_file_without_floors_keeps_its_table(stored, tmp_path):
    result = copy.deepcopy(stored[1])
    for run in result["runs"].values():
        for point in run["points"]:
            for row in (point, *point["exchanges"].values()):
                for key in [k for k in row if k.startswith(("floor", "ratio_over_floor"))]:
                    del row[key]
    old = tmp_path / "old.json"
    old.write_text(json.dumps(result))
    header = printed_table(old).splitlines()[0]
    assert header.endswith("| client / limit | in wall time |")
