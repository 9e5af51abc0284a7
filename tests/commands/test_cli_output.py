"""What the command line prints: each log line once, dependencies' chatter only with
--verbose, plain progress lines when stderr is not a terminal, --quiet, --version."""

import importlib.metadata
import io
import json
import logging
import os
import re
import subprocess
import sys
import warnings
from pathlib import Path

import pytest

from fedsim.commands.console import Verbosity, console, hush_ray
from fedsim.config import ConfigError
from fedsim.frontend.progress import Cadence, RunProgress

ROOT = Path(__file__).resolve().parents[2]
ROUNDS = 3
DP_CONFIG = f"""
name = "tiny-dp"
seed = 3
rounds = {ROUNDS}

[data]
source = "digits"
partition = "iid"
num_clients = 20

[model]
kind = "logreg"

[client]
epochs = 1
batch_size = 16
lr = 0.1

[strategy]
name = "dp-fedavg"
clients_per_round = 5
sampling = "poisson"

[strategy.options]
clipping_norm = 1.0
noise_multiplier = 1.0

[engine]
backend = "local"
"""


def fedsim(*args: str) -> subprocess.CompletedProcess:
    """``python -m fedsim ARGS`` with stdout and stderr as pipes (not terminals)."""
    env = {**os.environ, "PYTHONPATH": str(ROOT), "RAY_USAGE_STATS_ENABLED": "0"}
    return subprocess.run(
        [sys.executable, "-m", "fedsim", *args],
        capture_output=True,
        text=True,
        env=env,
        cwd=ROOT,
        timeout=600,
    )


@pytest.fixture(scope="module")
def dp_runs(tmp_path_factory):
    """The same 3-round DP-FedAvg run (Poisson sampling: dp_accounting's absl warnings) at
    each verbosity."""
    base = tmp_path_factory.mktemp("dp")
    config = base / "dp.toml"
    config.write_text(DP_CONFIG)
    runs = {}
    for name, flags in {"normal": [], "verbose": ["--verbose"], "quiet": ["--quiet"]}.items():
        runs[name] = fedsim("run", str(config), "--out", str(base / name), *flags)
        assert runs[name].returncode == 0, runs[name].stderr
    return runs


def lines(text: str) -> list[str]:
    return text.splitlines()


def test_each_flower_line_is_printed_once(dp_runs):
    err = lines(dp_runs["verbose"].stderr)
    sampled = [line for line in err if "configure_train: Sampled" in line]
    assert len(sampled) == ROUNDS, err  # once per round, not twice
    assert all(line.startswith("INFO flwr: ") for line in sampled)
    assert "\x1b[" not in dp_runs["verbose"].stderr  # no colour codes on a pipe


def test_fraction_evaluate_advisory_only_with_verbose_and_once(dp_runs):
    def advisories(run):
        return [line for line in lines(run.stderr) if "fraction_evaluate is set to 0.0" in line]

    assert advisories(dp_runs["normal"]) == []
    assert len(advisories(dp_runs["verbose"])) == 1
    assert advisories(dp_runs["verbose"])[0].startswith("DEBUG flwr: ")


def test_absl_warnings_only_with_verbose(dp_runs):
    assert not [line for line in lines(dp_runs["normal"].stderr) if "absl" in line]
    absl = [line for line in lines(dp_runs["verbose"].stderr) if line.startswith("WARNING absl:")]
    assert absl and all("failed to converge" in line for line in absl)


def test_plain_progress_lines_per_round_when_stderr_is_a_pipe(dp_runs):
    err = dp_runs["normal"].stderr
    progress = [line for line in lines(err) if line.startswith("fedsim: round ")]
    assert [re.match(r"fedsim: round (\d+)/3, ", p).group(1) for p in progress] == ["1", "2", "3"]
    for line in progress:  # whole lines: the rate and the metrics at the end, nothing cut
        assert re.fullmatch(
            r"fedsim: round \d/3, [\d.]+ s, \d+ clients/s, (?:ε|epsilon)=[\d.e+-]+ "
            r"\((?:δ|delta)=1e-05\), central\.accuracy=[\d.e-]+ central\.loss=[\d.e+-]+",
            line,
        ), line
    assert "\r" not in err and "\x1b[" not in err  # no cursor control
    assert err.strip() == "\n".join(progress)  # nothing else without --verbose
    assert "results in" in dp_runs["normal"].stdout


def test_each_progress_line_shows_the_epsilon_of_its_round(dp_runs, tmp_path_factory):
    err = dp_runs["normal"].stderr
    shown = [
        float(m.group(1))
        for m in re.finditer(r"^fedsim: round \d/3, .*?(?:ε|epsilon)=([\d.e+-]+) ", err, re.M)
    ]
    out = Path(re.search(r"results in (\S+)/rounds\.jsonl", dp_runs["normal"].stdout).group(1))
    written = [json.loads(x)["privacy"]["epsilon"] for x in (out / "rounds.jsonl").open()]
    assert shown == pytest.approx(written[1:], rel=1e-3) and len(shown) == ROUNDS
    assert shown[0] < shown[1] < shown[2]


def test_progress_privacy_text_on_a_pipe_and_in_ascii():
    line = {
        "round": 1,
        "clients_per_s": 3.0,
        "privacy": {"epsilon": 1.23456, "delta": 1e-5},
        "client_privacy": {"max_epsilon": 7.5},
    }
    utf8 = io.TextIOWrapper(io.BytesIO(), encoding="utf-8")
    ascii_ = io.TextIOWrapper(io.BytesIO(), encoding="ascii")
    for stream in (utf8, ascii_):
        with RunProgress(2, enabled=Cadence(), stream=stream) as bar:
            bar(line)
        stream.flush()
    assert "3 clients/s, ε=1.235 (δ=1e-05) client ε<=7.5" in utf8.buffer.getvalue().decode()
    text = ascii_.buffer.getvalue().decode("ascii")
    assert "3 clients/s, epsilon=1.235 (delta=1e-05) client epsilon<=7.5" in text
    plain = io.TextIOWrapper(io.BytesIO(), encoding="utf-8")
    with RunProgress(2, enabled=Cadence(), stream=plain) as bar:
        bar(record(1))  # a run without privacy: no epsilon
    plain.flush()
    assert "ε" not in plain.buffer.getvalue().decode()


def test_quiet_prints_only_the_final_summary(dp_runs):
    quiet = dp_runs["quiet"]
    assert quiet.stderr == ""
    assert re.fullmatch(r"fedsim: 3 rounds in [\d.]+ s; results in \S+ and \S+\n", quiet.stdout)
    assert "INFO" in dp_runs["verbose"].stderr and "INFO" not in quiet.stdout + quiet.stderr


def test_version_is_the_package_version():
    result = fedsim("--version")
    assert result.returncode == 0
    assert result.stdout.strip() == f"fedsim {importlib.metadata.version('fedsim')}"


def test_quiet_and_verbose_exclude_each_other_and_go_after_the_command():
    result = fedsim(
        "account", "--quiet", "dp-fedavg", "--verbose", "--noise-multiplier", "1",
        "--sampling-rate", "0.01", "--rounds", "10", "--delta", "1e-5",
    )  # fmt: skip
    assert result.returncode == 2 and "--quiet and --verbose" in result.stderr


def test_console_logs_flower_records_once_and_restores_flowers_handler(capsys):
    from flwr.supercore.logger import FLOWER_LOGGER, console_handler  # noqa: PLC0415

    level = FLOWER_LOGGER.level
    FLOWER_LOGGER.setLevel(logging.WARNING)  # as when Flower was imported inside a quiet command
    with console(Verbosity.VERBOSE):
        FLOWER_LOGGER.info("one line")
        FLOWER_LOGGER.warning("fraction_evaluate is set to 0.0. Federated evaluation ...")
        FLOWER_LOGGER.warning("fraction_evaluate is set to 0.0. Federated evaluation ...")
    err = capsys.readouterr().err
    assert err.count("one line") == 1 and err.count("fraction_evaluate") == 1
    assert "DEBUG flwr: fraction_evaluate" in err
    assert console_handler in FLOWER_LOGGER.handlers  # put back after the command
    assert FLOWER_LOGGER.level == logging.WARNING
    FLOWER_LOGGER.setLevel(level)


WORKER = """
import logging
from flwr.supercore.logger import log
log(logging.INFO, "a worker's info")
log(logging.WARNING, "a worker's warning")
log(logging.ERROR, "a worker's error")
"""


@pytest.mark.parametrize(
    ("verbosity", "shown"),
    [
        (Verbosity.QUIET, ["error"]),
        (Verbosity.NORMAL, ["warning", "error"]),
        (Verbosity.VERBOSE, ["info", "warning", "error"]),
    ],
)
def test_processes_a_command_starts_log_flower_at_its_verbosity(monkeypatch, verbosity, shown):
    """A local Ray instance's workers inherit the environment, as this child process does."""
    monkeypatch.delenv("FLWR_LOG_LEVEL", raising=False)
    with console(verbosity):
        child = subprocess.run(
            [sys.executable, "-c", WORKER], capture_output=True, text=True, timeout=120
        )
    assert "FLWR_LOG_LEVEL" not in os.environ  # restored
    kinds = ("info", "warning", "error")
    printed = [kind for kind in kinds if f"a worker's {kind}" in child.stderr]
    assert printed == shown, child.stderr


def test_dp_accounting_python_warnings_go_to_debug(capsys):
    path = str(Path("site-packages") / "dp_accounting" / "rdp" / "rdp_privacy_accountant.py")
    for verbosity in (Verbosity.NORMAL, Verbosity.VERBOSE):
        with console(verbosity), warnings.catch_warnings():
            warnings.simplefilter("always")
            warnings.warn_explicit("overflow in exp", RuntimeWarning, path, 7)
            warnings.warn_explicit("a user's own warning", UserWarning, "mine.py", 3)
        err = capsys.readouterr().err
        assert "WARNING py.warnings: mine.py:3: UserWarning: a user's own warning" in err
        shown = "DEBUG py.warnings: " in err and "overflow in exp" in err
        assert shown == (verbosity is Verbosity.VERBOSE), err


def test_absl_level_follows_the_verbosity_and_is_restored():
    absl = logging.getLogger("absl")
    before = absl.level
    with console(Verbosity.NORMAL):
        assert not absl.isEnabledFor(logging.WARNING)
    with console(Verbosity.VERBOSE):
        assert absl.isEnabledFor(logging.DEBUG)
    assert absl.level == before


class Pipe(io.StringIO):
    def isatty(self) -> bool:
        return False


def record(round_: int) -> dict:
    return {"round": round_, "clients_per_s": 10.0, "central": {"accuracy": 0.5, "loss": 1.0}}


def test_plain_progress_every_n_rounds_keeps_the_first_and_the_last():
    stream = Pipe()
    with RunProgress(10, enabled=Cadence(rounds=4), stream=stream) as bar:
        for r in range(11):
            bar(record(r))
    shown = [int(re.match(r"fedsim: round (\d+)/10", x).group(1)) for x in lines(stream.getvalue())]
    assert shown == [1, 5, 9, 10]


def test_plain_progress_every_s_seconds():
    times = iter([0.0, 1.0, 2.0, 40.0, 45.0, 75.0, 80.0])  # start, then one per round
    stream, every = Pipe(), Cadence(rounds=None, seconds=30)
    with RunProgress(None, enabled=every, stream=stream, clock=lambda: next(times)) as bar:
        for r in range(1, 7):
            bar(record(r))
    shown = [int(re.match(r"fedsim: round (\d+),", x).group(1)) for x in lines(stream.getvalue())]
    assert shown == [1, 3, 5]  # 1 first; 3 at 40 s (39 after 1); 5 at 75 s (35 after 3)


def test_progress_off_writes_nothing_and_a_terminal_gets_no_plain_lines():
    stream = Pipe()
    with RunProgress(3, enabled=False, stream=stream) as bar:
        bar(record(1))
    assert stream.getvalue() == ""

    class Terminal(Pipe):
        def isatty(self) -> bool:
            return True

    tty = Terminal()
    with RunProgress(3, stream=tty) as bar:
        bar(record(1))
    assert "fedsim: round" not in tty.getvalue()


@pytest.mark.parametrize(
    ("text", "cadence"),
    [("1", Cadence()), ("25", Cadence(rounds=25)), ("30s", Cadence(rounds=None, seconds=30.0))],
)
def test_progress_every_parses_rounds_or_seconds(text, cadence):
    assert Cadence.parse(text) == cadence


@pytest.mark.parametrize("text", ["0", "-3", "ten", "5m", "0s", ""])
def test_bad_progress_every_is_refused_by_name(text):
    with pytest.raises(ConfigError, match="--progress-every"):
        Cadence.parse(text)


RAYLET_TEXT = (
    "A worker died or was killed while executing a task by an unexpected system error. ... "
    "(1) the process was killed by the OOM killer due to high memory usage"
)


def test_quiet_keeps_rays_own_driver_text_in_the_debug_log(capsys):
    """What Ray's driver thread prints for a dead worker (on stdout, from a background
    thread) is hushed under --quiet, shown at DEBUG with --verbose, and Ray's own printer is
    back once the command ends."""
    import ray._private.worker as ray_worker

    original = ray_worker.print_to_stdstream
    message = {"lines": [RAYLET_TEXT], "pid": "raylet", "is_err": False}
    for verbosity in (Verbosity.QUIET, Verbosity.VERBOSE):
        with console(verbosity):
            hush_ray()
            hush_ray()  # once is enough: the second changes nothing
            ray_worker.print_to_stdstream(message, ignore_prefix=False)
        assert ray_worker.print_to_stdstream is original
        captured = capsys.readouterr()
        if verbosity is Verbosity.QUIET:
            assert captured.out == captured.err == ""
        else:
            assert captured.out == ""
            assert captured.err == f"DEBUG fedsim.ray_driver: (raylet) {RAYLET_TEXT}\n"


def test_quiet_prints_nothing_of_injected_worker_crashes_on_ray(tmp_path):
    """crash_probability = 1: the first attempt of every batch kills its Ray worker (a
    re-run never crashes), so Ray's driver has a dead worker to report in each phase."""
    config = tmp_path / "crashes.toml"
    config.write_text(
        DP_CONFIG.replace("rounds = 3", "rounds = 1").replace(
            'backend = "local"', 'backend = "ray"\nworkers = 1'
        )
        + "\n[faults]\ncrash_probability = 1.0\n"
    )
    quiet = fedsim("--quiet", "run", str(config), "--out", str(tmp_path / "out"))
    assert quiet.returncode == 0, quiet.stderr
    assert quiet.stderr == ""
    assert re.fullmatch(r"fedsim: 1 rounds in [\d.]+ s; results in \S+ and \S+\n", quiet.stdout)
