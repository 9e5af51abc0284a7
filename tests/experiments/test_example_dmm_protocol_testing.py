"""examples/dmm_protocol_testing: DMM in full mode with committee dropouts and tampering
members at chosen stages; the outcomes it prints and returns are the protocol's."""

import pytest
from examples_support import load_example


def test_three_scenarios_release_correct_or_abort_with_the_reason(capsys):
    scenarios = load_example("dmm_protocol_testing/scenarios.py")
    names = ["tamperer at RELEASE + 2 dropouts", "9 dropouts at RELEASE", "5 tamperers at RELEASE"]
    argv = [arg for name in names for arg in ("--scenario", name)]
    corrected, lost, beyond = scenarios.main(argv)
    # every scenario replays the fault-free reference run's nonce, and says so
    assert len({o["replay_of"] for o in (corrected, lost, beyond)}) == 1
    assert len(corrected["replay_of"]) == 32
    # one tamperer and two dropouts (within the radius): corrected, named, the release exact
    assert corrected["status"] == "released" and corrected["verified"]
    assert corrected["corrected"] == [1] and corrected["member_dropouts"] == 2
    assert corrected["exact"] and corrected["handed_over"]
    assert [r["status"] for r in corrected["later"]] == ["released"]
    # 9 of 11 members silent at RELEASE: fewer than t + k = 3 answers, nothing released, and
    # they stay gone, so the state is lost in the next round
    assert lost["status"] == "aborted" and "t + k = 3 needed" in lost["reason"]
    assert not lost["opened"]  # 2 = t shares reached the server: they determine nothing
    assert "nothing released" in lost["reason"] and "exact" not in lost
    assert lost["later"][0]["status"] == "aborted" and "state is lost" in lost["later"][0]["reason"]
    # five tamperers are beyond the decoding radius (4 of 11 answers): abort, nobody named;
    # but all 11 shares reached the server: accounted as released, and the run halts
    assert beyond["status"] == "aborted" and "nobody named" in beyond["reason"]
    assert beyond["opened"] and "counts as released" in beyond["reason"]
    assert [r["status"] for r in beyond["later"]] == ["aborted"]  # never released again
    printed = capsys.readouterr().out
    assert "tamperer named: seat 1" in printed
    assert "final model equals the fault-free ideal run's: yes" in printed
    assert printed.count("ABORTED, nothing released") == 1
    assert printed.count("ABORTED after the release shares reached the server") == 1


def test_the_command_line_picks_stage_member_and_dropouts():
    scenarios = load_example("dmm_protocol_testing/scenarios.py")
    args = scenarios.parse_args(
        ["--stage", "combine", "--dropouts", "3", "--tamper", "2", "--tamper-stage", "reshare"]
    )
    (custom,) = scenarios.chosen_scenarios(args)
    faults = custom.faults(11)
    combine, reshare = scenarios.STAGES["combine"], scenarios.STAGES["reshare"]
    assert faults.members("drop", combine) == {8, 9, 10}
    assert faults.members("tamper", reshare) == {2}
    for bad in (["--tamper", "11"], ["--dropouts", "12"], ["--round", "4"], ["--clients", "5"]):
        with pytest.raises(SystemExit):
            scenarios.parse_args(bad)
    with pytest.raises(SystemExit, match="--scenario 'nope'"):
        scenarios.chosen_scenarios(scenarios.parse_args(["--scenario", "nope"]))
