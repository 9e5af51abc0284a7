"""The server, the network and whoever holds a run directory against the run's secrets.

Every party's secret derives from the run's secret root (:mod:`fedsim.randomness`); the root
stays outside the run directory and travels to the engine's workers only. The scan test runs
small private runs with a known root and searches everything the server sends and receives
(the Grid is wrapped to capture it), every file of the run directory and the clients' run
config for the root and every party's secret, raw and in hex. Another strategy is one more
entry in :data:`STRATEGIES`.
"""

from __future__ import annotations

import gc
import json
import pickle
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from flwr.app import ConfigRecord, Context, Message, RecordDict

from fedsim.engine import Engine, EngineConfig
from fedsim.frontend.experiment import run_experiment
from fedsim.frontend.results import read_rounds
from fedsim.frontend.run_config import ExperimentConfig
from fedsim.frontend.run_root import RUN_FILE, resume_root
from fedsim.models import ModelSpec, initial_arrays
from fedsim.randomness import NODE_SECRET_KEY, RunSecret
from fedsim.record_codec import to_numpy, to_record
from fedsim.workloads.supervised import LocalTraining, make_client_app

POPULATION = 12
BASE = {
    "seed": 5,
    "rounds": 2,
    "data": {"source": "digits", "partition": "iid", "num_clients": POPULATION},
    "model": {"kind": "logreg"},
    "client": {"lr": 0.2, "batch_size": 16},
    "evaluation": {"every": 1, "central_rows": 100},
    "engine": {"backend": "local"},
}
#: strategy tables of the private runs the scan covers: one line per strategy
STRATEGIES: dict[str, dict[str, Any]] = {
    "dp-fedavg": {"name": "dp-fedavg", "options": {"clipping_norm": 0.5, "noise_multiplier": 0.8}},
    "dp-fedavg-adaptive": {
        "name": "dp-fedavg",
        "options": {
            "clipping_norm": 0.5,
            "noise_multiplier": 0.8,
            "adaptive_clipping": True,
            "clipped_count_stddev": 1.0,
        },
    },
    "matrix-mechanism": {
        "name": "matrix-mechanism",
        "options": {"clipping_norm": 0.5, "noise_multiplier": 0.8},
    },
    **{
        f"dmm-{mode}": {
            "name": "dmm",
            "sampling": "min-separation",
            "options": {
                "clipping_norm": 1.0,
                "noise_multiplier": 0.5,
                "committee_size": 11,
                "threshold": 2,
                "packing": 1,
                "member_dropouts": 2,
                "mode": mode,
            },
        }
        for mode in ("ideal", "full")
    },
    "ddgauss": {
        "name": "ddgauss",
        "options": {"clipping_norm": 1.0, "noise_multiplier": 0.5, "mode": "full", "ring_bits": 32},
    },
    "ddgauss-committee": {
        "name": "ddgauss",
        "options": {
            "clipping_norm": 1.0,
            "noise_multiplier": 0.5,
            "mode": "committee",
            "committee_size": 7,
            "threshold": 2,
            "packing": 2,
        },
    },
}


def config(strategy: dict[str, Any], **top: Any) -> ExperimentConfig:
    table = {"clients_per_round": 6, **strategy}
    return ExperimentConfig.from_dict({**BASE, "strategy": table, **top})


# -- the server's view: everything it sends and receives ---------------------------------------


class CapturingGrid:
    """The engine's grid, recording every message the server sends and receives."""

    def __init__(self, grid: Any, seen: list[Message]) -> None:
        self._grid, self._seen = grid, seen

    def __getattr__(self, name: str) -> Any:
        return getattr(self._grid, name)

    def push_messages(self, messages):
        messages = list(messages)
        self._seen.extend(messages)
        return self._grid.push_messages(messages)

    def pull_messages(self, message_ids):
        replies = list(self._grid.pull_messages(message_ids))
        self._seen.extend(replies)
        return replies

    def send_and_receive(self, messages, *, timeout=None):
        messages = list(messages)
        self._seen.extend(messages)
        replies = list(self._grid.send_and_receive(messages, timeout=timeout))
        self._seen.extend(replies)
        return replies


@dataclass
class CapturingEngine(Engine):
    """An engine whose runs' grids capture the server's messages (and its run configs)."""

    messages: list[Message] = field(default_factory=list)
    run_configs: list[dict[str, Any]] = field(default_factory=list)

    def open_run(self, *args: Any, **kwargs: Any) -> Any:
        self.run_configs.append(dict(kwargs.get("run_config") or {}))
        return CapturingGrid(super().open_run(*args, **kwargs), self.messages)


def message_bytes(message: Message) -> bytes:
    content = message.error if message.has_error() else message.content
    return pickle.dumps(content) + repr(message.metadata).encode()


def secret_needles(
    root: RunSecret, population: int, base: RunSecret | None = None
) -> dict[str, bytes]:
    """The run's root (and ``base``, the file's root it derives from with the run nonce) and
    every party's secret (and the keys derived for sealing and files), raw and in hex."""
    keys = {"root": root._key, "file mac key": root.mac_key()}
    if base is not None:
        keys["base root"] = base._key
    parties = {"server": root.server()}
    parties.update({f"client {i}": root.client(i) for i in range(population)})
    parties.update({f"member {i}": root.member(i) for i in range(population)})
    for name, secret in parties.items():
        keys[name] = bytes.fromhex(secret.token())
        keys[f"{name} sealing key"] = secret.seed_bytes("seal")
    needles = {}
    for name, key in keys.items():
        needles[f"{name} (raw)"] = key
        needles[f"{name} (hex)"] = key.hex().encode()
        needles[f"{name} (HEX)"] = key.hex().upper().encode()
    return needles


def leaks(blob: bytes, needles: dict[str, bytes]) -> list[str]:
    return [name for name, needle in needles.items() if needle in blob]


@pytest.mark.parametrize("name", sorted(STRATEGIES))
def test_no_message_file_or_run_config_holds_a_secret(tmp_path, name):
    root = RunSecret.from_passphrase(f"scan {name}")
    engine = CapturingEngine(EngineConfig(backend="local"))
    out = tmp_path / "run"
    try:
        run_experiment(config(STRATEGIES[name]), out, progress=False, engine=engine, secrets=root)
    finally:
        engine.close()
    run_root = resume_root(out, root).open_root()
    needles = secret_needles(run_root, POPULATION, root)
    planted = Message(
        RecordDict({"c": ConfigRecord({"t": run_root.client(3).token()})}), 1, "train"
    )
    assert leaks(message_bytes(planted), needles) == ["client 3 (hex)"]  # the scan would see it
    assert len(engine.messages) > 2 * 6  # instructions and replies of two rounds were seen
    for message in engine.messages:
        assert leaks(message_bytes(message), needles) == []
    files = [p for p in out.rglob("*") if p.is_file()]
    assert {"config.json", "rounds.jsonl", "summary.json", RUN_FILE} <= {p.name for p in files}
    for path in files:
        assert leaks(path.read_bytes(), needles) == [], path.name
    assert engine.run_configs == [{"seed": 5}]  # the clients' run_config: public only
    record = json.loads((out / RUN_FILE).read_text())
    assert set(record) == {"root", "fingerprint", "nonce", "config_mac"}
    assert record["root"] == "given" and record["fingerprint"] == root.fingerprint()


def test_a_kept_root_stays_outside_the_run_directory(tmp_path, _secrets_dir):
    out = tmp_path / "run"
    run_experiment(config(STRATEGIES["dp-fedavg"]), out, progress=False)
    (kept,) = list(_secrets_dir.iterdir())
    root = RunSecret.load_or_create(kept)
    needles = secret_needles(resume_root(out, None).open_root(), POPULATION, root)
    for path in (p for p in out.rglob("*") if p.is_file()):
        assert leaks(path.read_bytes(), needles) == [], path.name
    record = json.loads((out / RUN_FILE).read_text())
    assert kept.name == f"{record['run_id']}.root" and record["root"] == "kept"


# -- reproducibility: the same root repeats a run, another root changes only the noise --------


TIMING = ("seconds", "time_s", "clients_per_s", "compute_s")


def strip_times(record: Any) -> Any:
    if isinstance(record, dict):
        return {k: strip_times(v) for k, v in record.items() if k not in TIMING}
    return record


def finished(out: Path) -> tuple[list[dict[str, Any]], dict[str, np.ndarray]]:
    rounds = [strip_times(r) for r in read_rounds(out / "rounds.jsonl")]
    return rounds, dict(np.load(out / "model.npz"))


@pytest.mark.parametrize("name", ["dp-fedavg-adaptive", "matrix-mechanism", "ddgauss-committee"])
def test_resume_with_the_same_root_is_bit_identical(tmp_path, monkeypatch, name):
    from fedsim.frontend.rundir import RunDirectory

    root = RunSecret.from_passphrase("resume")
    run = config(STRATEGIES[name], rounds=4, faults={"dropout": 0.2})
    run_experiment(run, tmp_path / "whole", progress=False, secrets=root)

    save = RunDirectory.save

    def stop_after_round_2(self, checkpoint):
        save(self, checkpoint)
        if checkpoint.server_round == 2:
            raise KeyboardInterrupt  # the process dies right after round 2's checkpoint

    monkeypatch.setattr(RunDirectory, "save", stop_after_round_2)
    with pytest.raises(KeyboardInterrupt):  # a replay of the whole run: its streams
        run_experiment(
            run, tmp_path / "cut", progress=False, secrets=root, replay=tmp_path / "whole"
        )
    monkeypatch.setattr(RunDirectory, "save", save)
    run_experiment(run, tmp_path / "cut", resume=True, progress=False, secrets=root)
    (whole_rounds, whole_model), (cut_rounds, cut_model) = (
        finished(tmp_path / "whole"),
        finished(tmp_path / "cut"),
    )
    assert cut_rounds == whole_rounds
    assert whole_model.keys() == cut_model.keys()
    assert all(np.array_equal(whole_model[k], cut_model[k]) for k in whole_model)


def test_two_roots_change_the_noise_and_nothing_else(tmp_path):
    """Every client in every round (DP-FedAvg's sampled cohorts are the server's secret draw,
    so another root would also pick other clients): only the noise may differ."""

    def run(name, root, z):
        strategy = {
            "name": "dp-fedavg",
            "clients_per_round": POPULATION,
            "options": {"clipping_norm": 0.5, "noise_multiplier": z},
        }
        engine = CapturingEngine(EngineConfig(backend="local"))
        out = tmp_path / name
        try:
            run_experiment(
                config(strategy),
                out,
                progress=False,
                engine=engine,
                secrets=RunSecret.from_passphrase(root),
            )
        finally:
            engine.close()
        cohorts = sorted(
            (m.metadata.group_id, m.metadata.message_type, m.metadata.dst_node_id)
            for m in engine.messages
            if m.metadata.dst_node_id  # instructions (replies go to the server, node 0)
        )
        return cohorts, finished(out)[1]

    cohorts_a, model_a = run("a", "root a", 0.8)
    cohorts_b, model_b = run("b", "root b", 0.8)
    assert cohorts_a == cohorts_b  # the same clients in the same rounds
    assert all(not np.allclose(model_a[k], model_b[k]) for k in model_a)  # other noise
    _, quiet_a = run("quiet-a", "root a", 0.0)
    _, quiet_b = run("quiet-b", "root b", 0.0)
    assert all(np.array_equal(quiet_a[k], quiet_b[k]) for k in quiet_a)  # nothing else


# -- client-side DP: the client's noise is its own ----------------------------------------------


def test_dp_sgd_noise_is_the_clients_own_not_the_seeds():
    """A server that knows the seed, the global model and the instruction cannot replay a
    DP-SGD client's update: it depends on the secret in the client's node_config only."""
    spec = ModelSpec(kind="logreg", input_shape=(64,), num_classes=10)
    data = ExperimentConfig.from_dict({**BASE, "strategy": {"name": "fedavg"}}).data
    training = LocalTraining(
        batch_size=16, lr=0.2, dp_sgd={"noise_multiplier": 1.0, "max_grad_norm": 1.0}
    )
    app = make_client_app(spec, data, training)
    arrays = initial_arrays(spec, 0)

    def update(node_config):
        content = RecordDict(
            {"arrays": to_record(arrays), "config": ConfigRecord({"server-round": 1})}
        )
        context = Context(
            run_id=1,
            node_id=3,
            node_config={"partition-id": 3, **node_config},
            state=RecordDict(),
            run_config={"seed": 5},
        )
        reply = app(Message(content, 3, "train"), context)
        assert "train_loss" not in reply.content["metrics"]  # un-noised: it stays home
        return np.concatenate([v.ravel() for v in to_numpy(reply.content["arrays"]).values()])

    def token(root):
        return {NODE_SECRET_KEY: RunSecret.from_passphrase(root).client(3).token()}

    mine = update(token("a"))
    assert np.array_equal(mine, update(token("a")))  # the client's secret repeats it
    assert not np.array_equal(mine, update(token("b")))  # the seed alone does not
    assert not np.array_equal(update({}), update({}))  # no secret given: OS randomness


# -- the server side holds no client's secret ------------------------------------------------

PROBE = Path(__file__).resolve().parent
HEX64 = re.compile(r"[0-9a-fA-F]{64}")


def reachable_values(grid: Any, context: Any) -> list[Any]:
    """Every str (holding 64 hex digits) and bytes object a ServerApp can reach: the grid, its
    attributes and properties recursively, the context, and every object of the driver's
    process that the garbage collector tracks (a superset of what the grid reaches)."""
    found: dict[int, Any] = {}

    def keep(value: Any) -> None:
        if isinstance(value, str) and len(value) >= 64 and HEX64.search(value):
            found[id(value)] = value
        elif isinstance(value, bytes | bytearray) and 32 <= len(value) <= 64 * 2**20:
            found[id(value)] = bytes(value)

    stack: list[Any] = []
    for top in (grid, context):  # what the interface offers: attributes and properties
        for name in dir(top):
            try:
                stack.append(getattr(top, name))
            except Exception:  # noqa: BLE001 -- a property that refuses is nothing reached
                continue
    stack += [grid, context]
    seen: set[int] = set()
    while stack:  # everything those reach (referents: no property is evaluated)
        obj = stack.pop()
        if id(obj) in seen:
            continue
        seen.add(id(obj))
        keep(obj)
        stack.extend(gc.get_referents(obj))
    gc.collect()
    for obj in gc.get_objects():
        for ref in gc.get_referents(obj):
            keep(ref)
    return list(found.values())


def probing_server_app(reached: list[Any]) -> Any:
    from flwr.serverapp import ServerApp

    app = ServerApp()

    @app.main()
    def main(grid, context):
        nodes = list(grid.get_node_ids())
        for server_round in (1, 2):
            messages = [
                Message(RecordDict(), node, "train", group_id=str(server_round)) for node in nodes
            ]
            replies = list(grid.send_and_receive(messages))
            assert len(replies) == len(nodes) and not any(r.has_error() for r in replies)
        assert not any(hasattr(grid, n) for n in ("backend", "state_store", "_run", "registry"))
        reached.extend(reachable_values(grid, context))

    return app


@pytest.mark.parametrize("given", [True, False], ids=["--secrets", "fresh root"])
@pytest.mark.parametrize("backend", ["local", "ray"])
def test_a_server_app_reaches_no_clients_secret(tmp_path, backend, given, request):
    from fedsim.engine import ClientAppSource
    from fedsim.randomness import RootSource, new_nonce, root_file

    engine = (
        request.getfixturevalue("ray_engine")
        if backend == "ray"
        else Engine(EngineConfig(backend="local")).start()
    )
    probe = tmp_path / "probe"
    probe.mkdir()
    # the root file is written without this process reading it
    keys = tmp_path / "keys" / "run.root"
    # without --secrets, a worker writes a fresh root (as `fedsim flwr-run` does)
    source = RootSource(str(root_file(keys)), new_nonce()) if given else engine.fresh_root()
    reached: list[Any] = []
    try:
        engine.run_server_app(
            probing_server_app(reached),
            ClientAppSource(reference="secret_probe_app:app", app_dir=str(PROBE)),
            6,
            run_config={"probe-dir": str(probe)},
            secrets=source,
        )
        roots = [RootSource(source.path).open()] if not given else []
    finally:
        if backend == "local":
            engine.close()
    if given:
        roots = [RunSecret.load_or_create(source.path, create=False), source.open()]
    tokens = {int(p.stem): p.read_text() for p in probe.glob("*.hex")}
    assert sorted(tokens) == list(range(6))  # every client used its secret
    needles = {f"client {i} (hex)": t.encode() for i, t in tokens.items()}
    needles.update({f"client {i} (raw)": bytes.fromhex(t) for i, t in tokens.items()})
    for k, root in enumerate(roots):
        needles[f"root {k} (raw)"] = root._key
        needles[f"root {k} (hex)"] = root._key.hex().encode()
    assert roots and len(reached) > 100
    found = sorted(
        {
            name
            for value in reached
            for name, needle in needles.items()
            if (needle in value.encode() if isinstance(value, str) else needle in value)
        }
    )
    assert found == [], f"the ServerApp reached {found}"


# -- under `fedsim run`, the strategy reaches no client's or member's secret -----------------

#: secure runs through `fedsim run` with the Ray backend whose parties' secrets the strategy
#: must not reach: DMM full mode with committee actors, DDGauss committee mode, DP-FedAvg
DRIVER_RUNS: dict[str, dict[str, Any]] = {
    "dmm": {
        "name": "dmm",
        "clients_per_round": 6,
        "sampling": "min-separation",
        "options": {
            "clipping_norm": 1.0,
            "noise_multiplier": 1.0,
            "committee_size": 11,
            "threshold": 2,
            "packing": 1,
            "member_dropouts": 2,
            "committee_actors": True,
            "committee_shards": 2,
        },
    },
    "ddgauss-committee": {
        "name": "ddgauss",
        "clients_per_round": 6,
        "options": {
            "clipping_norm": 1.0,
            "noise_multiplier": 0.5,
            "ring_bits": 32,
            "mode": "committee",
            "committee_size": 6,
            "threshold": 2,
            "packing": 2,
            "committee_actors": True,
        },
    },
    "dp-fedavg": STRATEGIES["dp-fedavg"],
}
#: members that are not clients (DDGauss's committee): member m's secret is root.member(m)
MEMBERS = 8


def referents_of(*tops: Any) -> list[Any]:
    """Every str (holding 64 hex digits) and bytes object reachable from ``tops`` by
    gc.get_referents, transitively (attributes, closures, containers, modules they name)."""
    found: dict[int, Any] = {}
    stack, seen = list(tops), set()
    while stack:
        obj = stack.pop()
        if id(obj) in seen:
            continue
        seen.add(id(obj))
        kind = type(obj)  # not isinstance: a lazy module's proxy warns when asked
        if kind is str and len(obj) >= 64 and HEX64.search(obj):
            found[id(obj)] = obj
        elif kind in (bytes, bytearray) and 32 <= len(obj) <= 64 * 2**20:
            found[id(obj)] = bytes(obj)
        stack.extend(gc.get_referents(obj))
    return list(found.values())


@pytest.mark.parametrize("name", list(DRIVER_RUNS))
def test_a_strategy_under_fedsim_run_reaches_no_partys_secret(tmp_path, monkeypatch, name,
                                                              ray_engine):
    """The server plays the strategy of a ``fedsim run`` with the Ray backend (and committee
    actors): after a round, everything the strategy object and the Grid it is handed reach
    (gc referents, transitively) is searched for the root, every client's secret, every
    committee member's secret and the enrolment authority's key. None is there: the driver
    holds only the server's keys, the workers and member actors open the root themselves."""
    import fedsim.frontend.experiment as experiment
    from fedsim.engine.client_registry import AUTHORITY_SEAT
    from fedsim.randomness import root_file

    reached: list[Any] = []
    real = experiment.run_rounds

    def scanning(strategy, grid, *args, on_round, **kwargs):
        def after(outcome):
            on_round(outcome)
            if outcome.server_round == 1:
                reached.extend(referents_of(strategy, grid))

        return real(strategy, grid, *args, on_round=after, **kwargs)

    monkeypatch.setattr(experiment, "run_rounds", scanning)
    path = root_file(tmp_path / "keys" / "run.root")  # written without this process reading it
    config = ExperimentConfig.from_dict(
        {**BASE, "rounds": 1, "engine": {"backend": "ray"}, "strategy": DRIVER_RUNS[name]}
    )
    out = tmp_path / "run"
    run_experiment(config, out, secrets=path, engine=ray_engine, progress=False)
    assert len(reached) > 10
    base = RunSecret.load_or_create(path, create=False)  # only now: the needles
    root = base.for_run(json.loads((out / RUN_FILE).read_text())["nonce"])
    needles: dict[str, bytes] = {}
    for label, secret in (("base root", base), ("run root", root)):
        needles[label] = secret._key
        parties = {f"client {i}": secret.client(i) for i in range(POPULATION)}
        parties.update({f"member {m}": secret.member(m) for m in range(MEMBERS)})
        parties["authority"] = secret.member(AUTHORITY_SEAT)
        for party, own in parties.items():
            needles[f"{label}: {party}"] = own._key
        needles[f"{label}: authority key"] = parties["authority"].seed_bytes(
            "enrolment-authority"
        )
    needles.update({f"{k} (hex)": v.hex().encode() for k, v in list(needles.items())})
    found = sorted(
        {
            label
            for value in reached
            for label, needle in needles.items()
            if (needle in value.encode() if isinstance(value, str) else needle in value)
        }
    )
    assert found == [], f"the strategy reached {found}"
