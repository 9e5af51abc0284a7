"""``fedsim up`` / ``fedsim down`` from the command line: what they say when nothing is up and
how they refuse bad settings (the pool itself: tests/engine/test_warm_pool.py)."""

from __future__ import annotations

from fedsim.cli import main


def test_down_with_no_pool_up_says_so_and_succeeds(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("FEDSIM_WARM_DIR", str(tmp_path))
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    assert main(["down"]) == 0
    assert "no warm pool was up" in capsys.readouterr().out


def test_up_refuses_bad_settings_naming_the_flag_and_starts_nothing(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("FEDSIM_WARM_DIR", str(tmp_path))
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    for args, flag, value in (
        (["--idle-timeout", "0"], "--idle-timeout", "0"),
        (["--idle-timeout", "-5"], "--idle-timeout", "-5"),
        (["--workers", "-1"], "--workers", "-1"),
    ):
        assert main(["up", *args]) == 2, args
        err = capsys.readouterr().err
        assert flag in err and value in err, err
    assert not (tmp_path / "head.json").exists()  # no head was started
