"""Bad values against the command line: `fedsim run` configs, `flwr-run --run-config` and
the `account` subcommands.

The attacker is a user (or a script) feeding wrong types, NaN, infinities, negative, zero and
huge numbers, empty strings, unknown keys and wrong tables. The claim: every case ends in a
clear refusal -- exit status 2 and a message naming the offending key or flag -- or, for a
value only the run itself can find out about (a learning rate so large that training
diverges), in exit status 1 with a message saying why the run stopped; never a traceback,
never exit 0 with the value silently changed or ignored, and nothing already written is lost.

``python tests/attacks/test_inputs.py`` prints the tally (tried / refused / stopped /
crashed / silent) over the whole table.
"""

from __future__ import annotations

import contextlib
import copy
import io
import json
import math
import sys
from pathlib import Path

import numpy as np
import pytest

from fedsim.cli import main

HERE = Path(__file__).resolve().parent
QUICKSTART = HERE.parent / "apps" / "quickstart"
DELETE = object()  # the key is removed

BASE = {
    "name": "inputs",
    "seed": 1,
    "rounds": 1,
    "data": {"source": "digits", "partition": "iid", "num_clients": 6},
    "model": {"kind": "logreg"},
    "client": {"epochs": 1, "batch_size": 16, "lr": 0.1},
    "strategy": {"name": "fedavg", "clients_per_round": 3},
    "evaluation": {"clients": 0, "every": 1, "central_rows": 50},
    "engine": {"backend": "local"},
}
DP = {"name": "dp-fedavg", "options": {"clipping_norm": 1.0, "noise_multiplier": 1.0}}
NAN, INF = float("nan"), float("inf")

# (dotted key, value, text the error must contain [default: the key]); a dotted key under
# "strategy.options." with the DP marker runs on dp-fedavg
NUMBERS = [NAN, INF, -INF, "abc", True, [1]]
RUN_CASES: list[tuple[str, object, str | None]] = [
    *[(key, v, None) for key in ("rounds", "client.epochs", "client.batch_size") for v in
      (*NUMBERS, -2, 0, 1.5, 2**70)],
    *[(key, v, None) for key in ("client.lr", "timeout") for v in (*NUMBERS, -1, 0)],
    ("seed", -1, "seed"),
    ("seed", "x", "seed"),
    ("checkpoint_every", 0, None),
    ("state_memory_mb", -1, None),
    ("state_memory_mb", 1e300, None),
    ("roundz", 3, "roundz"),
    ("data", 3, "data"),
    ("client", "fast", "client"),
    ("strategy", [1], "strategy"),
    ("engine", True, "engine"),
    ("faults", "none", "faults"),
    ("data", DELETE, "data"),
    ("rounds", DELETE, "rounds"),
    ("data.source", "", None),
    ("data.source", "nope", None),
    ("data.partition", "", None),
    ("data.num_clients", 0, None),
    ("data.num_clients", -5, None),
    ("data.num_clients", 10**9, None),
    ("data.alpha", 0, None),
    ("data.alpha", NAN, None),
    ("data.alpha", INF, None),
    ("data.test_fraction", 1.5, None),
    ("data.test_fraction", -0.1, None),
    ("data.seed", -1, None),
    ("data.colour", "red", None),
    ("model.kind", "", None),
    ("model.kind", "transformer", None),
    ("model.hidden", [0], None),
    ("model.hidden", [-3], None),
    ("model.hidden", "64", None),
    ("client.momentum", 1, None),
    ("client.momentum", NAN, None),
    ("client.weight_decay", -1, None),
    ("client.weight_decay", INF, None),
    ("client.max_steps", -1, None),
    ("client.keep_momentum", "yes", None),
    ("client.lrr", 0.1, None),
    ("client.dp_sgd", "on", None),
    ("client.dp_sgd.noise_multiplier", NAN, None),
    ("client.dp_sgd.noise_multiplier", -1, None),
    ("client.dp_sgd.max_grad_norm", 0, None),
    ("client.dp_sgd.max_grad_norm", INF, None),
    ("client.dp_sgd.delta", 1, None),
    ("client.dp_sgd.colour", 1, None),
    ("strategy.name", "", None),
    ("strategy.name", "fedfoo", None),
    ("strategy.clients_per_round", 0, None),
    ("strategy.clients_per_round", 7, None),
    ("strategy.sampling", "random", None),
    ("strategy.partial_aggregation", "maybe", None),
    ("strategy.options", "x", None),
    ("strategy.options.unknown_option", 1, None),
    ("strategy.options.fraction_train", 0.5, None),
    *[("DP strategy.options.noise_multiplier", v, "strategy.options.noise_multiplier")
      for v in (NAN, INF, -1, 1e-300, 1e-154, "1")],
    *[("DP strategy.options.clipping_norm", v, "strategy.options.clipping_norm")
      for v in (0, -1, NAN, INF)],
    ("DP strategy.options.delta", 0, "strategy.options.delta"),
    ("DP strategy.options.delta", 1.5, "strategy.options.delta"),
    ("DP strategy.options.max_epsilon", 0, "strategy.options.max_epsilon"),
    ("DP strategy.options.accountant", "xyz", "strategy.options.accountant"),
    ("evaluation.clients", -1, None),
    ("evaluation.clients", 10, None),
    ("evaluation.every", -1, None),
    ("evaluation.central_rows", 0, None),
    ("engine.backend", "gpu", None),
    ("engine.backend", "", None),
    ("engine.workers", -1, None),
    ("engine.cpus_per_worker", 0, None),
    ("engine.cpus_per_worker", INF, None),
    ("engine.cpus_per_worker", 1e300, None),
    ("engine.gpus_per_worker", -1, None),
    ("engine.gpus_per_worker", NAN, None),
    ("engine.gpus_per_worker", 1e300, None),
    ("engine.depth", 0, None),
    ("engine.object_store_mb", 10, None),
    ("engine.pin_workers", "sometimes", None),
    ("faults.dropout", 1.5, None),
    ("faults.dropout", NAN, None),
    ("faults.straggler_fraction", 2, None),
    ("faults.straggler_delay_s", -1, None),
    ("faults.straggler_delay_s", INF, None),
    ("faults.deadline_s", INF, None),
    ("faults.deadline_s", NAN, None),
    ("faults.crash_probability", 1.1, None),
]
#: values only the run finds out about: it stops with exit status 1 and says why
STOPPED_CASES = [
    ("client.lr", 1e300, "raised for all"),  # beyond float32: every client's step fails
    ("client.weight_decay", 1e300, "raised for all"),
    ("DP strategy.options.clipping_norm", 1e300, "NaN or infinite"),  # noise std 1e300
]

FLWR_CASES: list[tuple[str, str]] = [
    ("num-server-rounds", "has no '='"),
    ("num-server-rounds=-2", "num-server-rounds"),
    ("num-server-rounds=0", "num-server-rounds"),
    ("num-server-rounds='abc'", "num-server-rounds"),
    ("num-server-rounds=abc", "num-server-rounds"),
    ("num-server-rounds=1.5", "num-server-rounds"),
    ("num-server-rounds=true", "num-server-rounds"),
    ("num-server-rounds=99999999999999999999", "num-server-rounds"),
    ("lr=inf", "lr"),
    ("lr=nan", "lr"),
    ("lr='fast'", "lr"),
    ("lr=", "--run-config"),
    ("=3", "--run-config"),
    ("nokey=1", "nokey"),
    ("seed=1 lr", "'lr'"),
    ("output-path=3", "output-path"),
    ("fraction-train=true", "fraction-train"),
    ("local-epochs=2.5", "local-epochs"),
]
FLWR_ARG_CASES: list[tuple[list[str], str]] = [
    (["--num-supernodes", "0"], "--num-supernodes"),
    (["--num-supernodes", "-1"], "--num-supernodes"),
    (["--num-supernodes", "abc"], "--num-supernodes"),
    (["--num-supernodes", "2", "--workers", "0"], "--workers"),
    (["--num-supernodes", "2", "--backend", "gpu"], "--backend"),
    (["--federation-config", "num-supernodes=0"], "--federation-config num-supernodes"),
    (["--federation-config", "client-resources-num-cpus=nan"], "client-resources-num-cpus"),
    (["--federation-config", "num-clients=2"], "--federation-config num-clients"),
    (["nowhere"], "SUPERLINK (--federation) = 'nowhere'"),
]

FEDAVG = ["account", "dp-fedavg", "--noise-multiplier", "1", "--sampling-rate", "0.01",
          "--rounds", "10", "--delta", "1e-5"]
SGD = ["account", "dp-sgd", "--noise-multiplier", "1", "--batch-size", "64",
       "--dataset-size", "6000", "--epochs", "2", "--delta", "1e-5"]
CALIBRATE = ["account", "calibrate", "dp-fedavg", "--target-epsilon", "2", "--sampling-rate",
             "0.01", "--rounds", "10", "--delta", "1e-5"]
SWEEP = ["account", "sweep", "dp-fedavg", "--noise-multiplier", "1", "--sampling-rate", "0.01",
         "--rounds", "10", "--delta", "1e-5", "--plot", "PLOT"]


def with_flag(argv: list[str], flag: str, *values: str) -> list[str]:
    """``argv`` with ``flag``'s value(s) replaced (or the flag added)."""
    out = list(argv)
    if flag in out:
        i = out.index(flag)
        j = i + 1
        while j < len(out) and not out[j].startswith("--"):
            j += 1
        out[i + 1 : j] = list(values)
    else:
        out += [flag, *values]
    return out


ACCOUNT_CASES: list[tuple[list[str], str]] = [
    *[(with_flag(FEDAVG, "--noise-multiplier", v), "--noise-multiplier")
      for v in ("1e-300", "1e-154", "0", "-1", "nan", "inf", "abc", "")],
    (with_flag(FEDAVG, "--noise-multiplier", "0.05") + ["--accountant", "pld"],
     "--noise-multiplier"),
    *[(with_flag(FEDAVG, "--sampling-rate", v), "--sampling-rate")
      for v in ("0", "1.5", "nan", "-0.1", "inf")],
    *[(with_flag(FEDAVG, "--rounds", v), "--rounds") for v in ("-1", "abc", "1.5")],
    *[(with_flag(FEDAVG, "--delta", v), "--delta") for v in ("0", "1", "nan", "inf", "-1")],
    (with_flag(FEDAVG, "--accountant", "xyz"), "--accountant"),
    (with_flag(FEDAVG, "--accountant", ""), "--accountant"),
    (with_flag(FEDAVG, "--sampling", "weird"), "--sampling"),
    (with_flag(FEDAVG, "--sampling", "fixed"), "--population"),
    (with_flag(FEDAVG, "--sampling", "fixed") + ["--population", "0"], "--population"),
    (with_flag(FEDAVG, "--relation", "bogus"), "--relation"),
    *[(with_flag(SGD, "--batch-size", v), "--batch-size") for v in ("0", "7000", "-1")],
    (with_flag(SGD, "--dataset-size", "0"), "--dataset-size"),
    *[(with_flag(SGD, "--epochs", v), "--epochs") for v in ("0", "inf", "nan", "-1")],
    (with_flag(SGD, "--noise-multiplier", "1e-300"), "--noise-multiplier"),
    *[(with_flag(CALIBRATE, "--target-epsilon", v), "--target-epsilon")
      for v in ("0", "-1", "inf", "nan", "1e300")],
    (with_flag(CALIBRATE, "--target-epsilon", "500") + ["--accountant", "pld"],
     "--target-epsilon"),
    (with_flag(CALIBRATE, "--rounds", "0"), "--rounds"),
    (with_flag(SWEEP, "--points", "1"), "--points"),
    (with_flag(SWEEP, "--points", "1000000"), "--points"),
    (with_flag(SWEEP, "--plot", "curve.txt"), "--plot"),
    (with_flag(SWEEP, "--noise-multiplier", "1", "0"), "--noise-multiplier"),
    (with_flag(SWEEP, "--noise-multiplier", "1", "1e-300"), "--noise-multiplier"),
    (["account", "matrix", "--factorization", "missing.npz", "--noise-multiplier", "1",
      "--delta", "1e-5"], "--factorization"),
    (["account", "matrix", "--factorization", "GARBAGE", "--noise-multiplier", "1",
      "--delta", "1e-5"], "--factorization"),
]


# -- running one case ---------------------------------------------------------------------


def toml_value(value: object) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, float):
        if math.isnan(value):
            return "nan"
        if math.isinf(value):
            return "inf" if value > 0 else "-inf"
        return repr(value)
    if isinstance(value, int):
        return str(value)
    if isinstance(value, str):
        return json.dumps(value)
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(toml_value(v) for v in value) + "]"
    raise TypeError(value)


def to_toml(config: dict) -> str:
    lines = [f"{k} = {toml_value(v)}" for k, v in config.items() if not isinstance(v, dict)]

    def table(prefix: str, body: dict) -> None:
        lines.append(f"[{prefix}]")
        lines.extend(f"{k} = {toml_value(v)}" for k, v in body.items() if not isinstance(v, dict))
        for k, v in body.items():
            if isinstance(v, dict):
                table(f"{prefix}.{k}", v)

    for key, value in config.items():
        if isinstance(value, dict):
            table(key, value)
    return "\n".join(lines) + "\n"


def case_config(path: str, value: object) -> dict:
    config = copy.deepcopy(BASE)
    if path.startswith("DP "):
        path = path[3:]
        config["strategy"].update(copy.deepcopy(DP))
    *tables, last = path.split(".")
    where = config
    for name in tables:
        if not isinstance(where.get(name), dict):
            where[name] = {}
        where = where[name]
    if value is DELETE:
        where.pop(last, None)
    else:
        where[last] = value
    if path.startswith("client.dp_sgd.") and last != "noise_multiplier":
        where.setdefault("noise_multiplier", 1.0)
    if path.startswith("client.dp_sgd.") and last != "max_grad_norm":
        where.setdefault("max_grad_norm", 1.0)
    return config


class Hung(BaseException):
    """A case that ran past the tally's time limit."""


def call(argv: list[str]) -> tuple[object, str]:
    """``(exit status, stderr)``, or ``("crash", traceback text)`` if an exception escaped."""
    err, out = io.StringIO(), io.StringIO()
    try:
        with contextlib.redirect_stderr(err), contextlib.redirect_stdout(out):
            status = main(argv)
    except SystemExit as ex:  # argparse's usage errors
        status = ex.code
    except Hung:
        return "hung", ""
    except Exception as ex:  # noqa: BLE001  (a crash is what the table looks for)
        return "crash", f"{type(ex).__name__}: {ex}"
    return status, err.getvalue()


def run_case(tmp: Path, path: str, value: object) -> tuple[object, str, Path]:
    config = tmp / "config.toml"
    config.write_text(to_toml(case_config(path, value)))
    out = tmp / "out"
    status, err = call(["run", str(config), "--out", str(out), "--no-progress"])
    return status, err, out


def account_argv(argv: list[str], tmp: Path) -> list[str]:
    garbage = tmp / "garbage.npz"
    garbage.write_bytes(b"not an npz file")
    replace = {"PLOT": str(tmp / "plot.png"), "GARBAGE": str(garbage)}
    return [replace.get(a, a) for a in argv]


def classify(status: object, err: str, text: str) -> str:
    if status == "hung":
        return "hung"
    if status == "crash" or "Traceback" in err:
        return "crashed"
    if status == 0:
        return "silent"
    if status == 2 and text in err:
        return "refused"
    if status == 1 and text in err:
        return "stopped"
    return "unclear"


def assert_refused(status: object, err: str, text: str) -> None:
    assert status != "crash", f"traceback: {err}"
    assert status == 2, f"exit status {status} (expected 2); stderr: {err[-500:]}"
    assert text in err, f"the message does not name {text!r}: {err[-500:]}"
    assert "Traceback" not in err


def _id(case) -> str:
    return f"{case[0]}={case[1]!r}"


# -- the table ----------------------------------------------------------------------------


@pytest.mark.parametrize("case", RUN_CASES, ids=[_id(c) for c in RUN_CASES])
def test_fedsim_run_refuses_a_bad_value_naming_its_key(case, tmp_path):
    path, value, text = case
    text = text or path
    status, err, out = run_case(tmp_path, path, value)
    assert_refused(status, err, text)
    # nothing was run, and the directory can take the corrected run
    assert not (out / "summary.json").exists()
    assert not (out / "rounds.jsonl").exists() or (out / "rounds.jsonl").stat().st_size == 0


@pytest.mark.parametrize("case", STOPPED_CASES, ids=[_id(c) for c in STOPPED_CASES])
def test_a_run_that_cannot_go_on_stops_and_says_why(case, tmp_path):
    path, value, text = case
    status, err, out = run_case(tmp_path, path, value)
    assert status == 1 and text in err and "Traceback" not in err, err[-500:]
    assert not (out / "summary.json").exists()  # no result is claimed
    rounds = [json.loads(line) for line in (out / "rounds.jsonl").read_text().splitlines()]
    assert [r["round"] for r in rounds] == [0]  # the initial model's evaluation is kept
    assert not (out / "model.npz").exists()


@pytest.mark.parametrize("case", FLWR_CASES, ids=[c[0] or "empty" for c in FLWR_CASES])
def test_flwr_run_refuses_a_bad_run_config_naming_its_key(case, tmp_path):
    overrides, text = case
    argv = ["flwr-run", str(QUICKSTART), "--num-supernodes", "2", "--backend", "local"]
    status, err = call([*argv, "--run-config", overrides, "--out", str(tmp_path / "o")])
    assert_refused(status, err, text)
    assert not (tmp_path / "o").exists()


@pytest.mark.parametrize("case", FLWR_ARG_CASES, ids=[" ".join(c[0]) for c in FLWR_ARG_CASES])
def test_flwr_run_refuses_bad_arguments(case, tmp_path):
    args, text = case
    argv = ["flwr-run", str(QUICKSTART), *args, "--backend", "local"]
    if "--backend" in args:
        argv = ["flwr-run", str(QUICKSTART), *args]
    status, err = call([*argv, "--out", str(tmp_path / "o"), "--no-progress"])
    assert_refused(status, err, text)


@pytest.mark.parametrize("case", ACCOUNT_CASES, ids=[" ".join(c[0][1:]) for c in ACCOUNT_CASES])
def test_account_refuses_a_bad_argument_naming_its_flag(case, tmp_path):
    argv, text = case
    status, err = call(account_argv(argv, tmp_path))
    assert_refused(status, err, text)


# -- nothing already written is lost ------------------------------------------------------


@pytest.fixture(scope="module")
def finished_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("finished") / "run"
    config = out.parent / "config.toml"
    config.write_text(to_toml(case_config("rounds", 2)))
    root = out.parent / "root.hex"  # a module's run: its root outside the per-test secrets dir
    assert call(["run", str(config), "--out", str(out), "--secrets", str(root),
                 "--no-progress"])[0] == 0
    return out


def snapshot(directory: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(directory.iterdir()) if p.is_file()}


@pytest.mark.parametrize(
    "argv, text",
    [
        (["run", "CONFIG_BAD", "--out", "RUN"], "client.lr"),
        (["run", "CONFIG_OK", "--out", "RUN"], "--out"),
        (["run", "--resume", "RUN", "--workers", "0"], "--workers"),
        (["run", "CONFIG_OTHER", "--resume", "RUN"], "--resume"),
    ],
)
def test_a_refused_command_leaves_an_earlier_run_untouched(finished_run, tmp_path, argv, text):
    before = snapshot(finished_run)
    files = {"CONFIG_BAD": ("client.lr", INF), "CONFIG_OK": ("rounds", 2),
             "CONFIG_OTHER": ("rounds", 3)}
    for name, (path, value) in files.items():
        (tmp_path / name).write_text(to_toml(case_config(path, value)))
    resolved = [str(tmp_path / a) if a in files else (str(finished_run) if a == "RUN" else a)
                for a in argv]
    if "--resume" in argv:  # the run's own root: the refusal must be for what the test names
        resolved += ["--secrets", str(finished_run.parent / "root.hex")]
    status, err = call([*resolved, "--no-progress"])
    assert_refused(status, err, text)
    assert snapshot(finished_run) == before


def test_an_empty_results_file_left_by_a_refused_run_does_not_block_the_next(tmp_path):
    status, err, out = run_case(tmp_path, "DP strategy.options.clipping_norm", 0)
    assert status == 2
    config = tmp_path / "good.toml"
    config.write_text(to_toml(case_config("rounds", 1)))
    assert call(["run", str(config), "--out", str(out), "--no-progress"])[0] == 0
    assert (out / "summary.json").exists()


def test_the_dispatch_loop_reads_no_environment_variable(monkeypatch):
    from fedsim.engine.dispatch import batch_sizes

    default = batch_sizes(10, 2)
    monkeypatch.setenv("FEDSIM_GSS", "0")  # once read inside the loop (ZeroDivisionError)
    assert batch_sizes(10, 2) == default == [3, 2, 2, 1, 1, 1]


# -- the tally ----------------------------------------------------------------------------


def tally(tmp: Path) -> dict[str, int]:
    """Run the whole table once; count each outcome."""
    counts = dict.fromkeys(
        ("tried", "refused", "stopped", "crashed", "silent", "hung", "unclear"), 0
    )
    outcomes: list[tuple[str, str]] = []
    for i, (path, value, text) in enumerate(RUN_CASES + STOPPED_CASES):
        case_dir = tmp / f"run{i}"
        case_dir.mkdir()
        status, err, _ = run_case(case_dir, path, value)
        outcomes.append((f"run {path}={value!r}", classify(status, err, text or path)))
    for i, (overrides, text) in enumerate(FLWR_CASES):
        argv = ["flwr-run", str(QUICKSTART), "--num-supernodes", "2", "--backend", "local"]
        status, err = call([*argv, "--run-config", overrides, "--out", str(tmp / f"f{i}")])
        outcomes.append((f"flwr-run {overrides!r}", classify(status, err, text)))
    for i, (args, text) in enumerate(FLWR_ARG_CASES):
        argv = ["flwr-run", str(QUICKSTART), *args, "--out", str(tmp / f"a{i}"), "--no-progress"]
        status, err = call(argv if "--backend" in args else [*argv, "--backend", "local"])
        outcomes.append((f"flwr-run {' '.join(args)}", classify(status, err, text)))
    for argv, text in ACCOUNT_CASES:
        status, err = call(account_argv(argv, tmp))
        outcomes.append((" ".join(argv[1:]), classify(status, err, text)))
    for name, outcome in outcomes:
        counts["tried"] += 1
        counts[outcome] += 1
        if outcome not in ("refused", "stopped"):
            print(f"{outcome}: {name}", file=sys.stderr)
    return counts


if __name__ == "__main__":
    import signal
    import tempfile

    def _hung(signum, frame):
        raise Hung

    signal.signal(signal.SIGALRM, _hung)  # each case gets 120 s (main() re-arms nothing)
    _call = call

    def call(argv: list[str]) -> tuple[object, str]:  # noqa: F811
        signal.alarm(120)
        try:
            return _call(argv)
        finally:
            signal.alarm(0)

    np.seterr(all="ignore")
    with tempfile.TemporaryDirectory() as tmp:
        print(json.dumps(tally(Path(tmp))))
