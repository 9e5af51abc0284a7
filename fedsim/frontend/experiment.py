"""fedsim's own experiments: a validated run config in (:mod:`fedsim.frontend.run_config`), results
on disk out.

:func:`run_experiment` opens a run (:func:`open_run`: its directory, rounds writer and secret
root), sets it up (:func:`set_up_run`: dataset, strategy, client app, engine and the parties'
secrets), runs its rounds (:func:`run_loop`: rounds.jsonl and checkpoints as it goes), finishes
it (:func:`finish_run`: model.npz, summary.json and the configured audit) and closes what it
opened (:func:`close_run`), whether it finished or failed.

Secrets: every party's secret derives from the run's secret root
(:class:`~fedsim.randomness.RunSecret`), which never enters the run directory
(:mod:`fedsim.frontend.run_root`). The driver keeps only the keys the server may hold
(:class:`~fedsim.randomness.RunKeys`), which a child process that reads the root file derives
(:mod:`fedsim.frontend.root_keys`): the driver never opens it. The engine's workers and the
committees' member actors open the root themselves (:class:`~fedsim.randomness.RootSource`),
so with the Ray backend and committee actors nothing the strategy reaches holds a client's or
a member's secret. The local backend and committees hosted in process give no such isolation.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import pickle
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from flwr.app import ArrayRecord, MetricRecord
from flwr.clientapp import ClientApp
from flwr.serverapp.strategy import Strategy

from fedsim.audits.run_audit import (
    MODEL_FILE,
    SUMMARY_FILE,
    FinishedRun,
    run_configured_audit,
)
from fedsim.checkpoint import CONFIG_FILE, Checkpoint
from fedsim.config import ConfigError, differing_keys, to_mapping
from fedsim.data import FederatedDataset, build_dataset
from fedsim.engine import (
    ClientStateStore,
    Engine,
    EngineConfig,
)
from fedsim.engine.app_grid import AppGrid
from fedsim.engine.client_registry import ClientRegistry
from fedsim.engine.committee import Committee, committee_for
from fedsim.engine.dmm_committee import CommitteeHost, committee_host_for
from fedsim.engine.hooks import Closable, PrivacyReporting, Stoppable, find
from fedsim.engine.participation import TRAIN, CohortModel
from fedsim.engine.rounds import RoundOutcome, run_rounds
from fedsim.frontend import interrupt
from fedsim.frontend.personalised_run import PersonalisedParts, personalised_parts
from fedsim.frontend.progress import Cadence, RunProgress
from fedsim.frontend.results import RoundRecorder, RunWriter, metrics_dict, read_rounds
from fedsim.frontend.run_config import ExperimentConfig, is_personalised, is_text
from fedsim.frontend.run_lock import locked
from fedsim.frontend.run_root import RunRoot, authenticated_config, start_root
from fedsim.frontend.run_strategy import (
    build_experiment_strategy,
    engine_participation,
    participation_for,
)
from fedsim.frontend.run_summary import privacy_summary, run_summary_record
from fedsim.frontend.rundir import RunDirectory
from fedsim.frontend.tensorboard_events import TensorBoardEvents
from fedsim.frontend.text_run import initial_text_arrays, text_parts
from fedsim.models import (
    ModelSpec,
    build_model,
    check_device_available,
    check_model,
    initial_arrays,
    load_arrays,
)
from fedsim.randomness import PartySecret, RootSource, RunSecret, outside_run_dir
from fedsim.record_codec import to_numpy, to_record
from fedsim.runfiles import RunFileError
from fedsim.workloads.coto import build_lora_model, initial_adapter_arrays, load_adapter_arrays
from fedsim.workloads.dp_sgd import DPSGD, epsilon_of
from fedsim.workloads.supervised import make_client_app
from fedsim.workloads.training import as_tensors, evaluate_model
from strategies.methods.averaging import averaged_evaluation
from strategies.plumbing.server_secret import bind_parties
from strategies.registry import spec_for


def model_spec(config: ExperimentConfig, dataset: FederatedDataset) -> ModelSpec:
    """The ``[model]`` table's model for ``dataset``'s features and classes, trained on
    ``[engine] device``."""
    return ModelSpec(
        kind=config.model.kind,
        input_shape=tuple(dataset.feature_shape),
        num_classes=dataset.num_classes,
        hidden=config.model.hidden,
        channels=config.model.channels,
        factory=config.model.factory,
        options=config.model.options,
        python_path=config.model.python_path,
        device=config.engine.device,
    )


def trained_clients(
    config: ExperimentConfig, population: int, rounds: int, server: PartySecret | None = None
) -> np.ndarray:
    """Sorted client indices in at least one training cohort of rounds ``1..rounds``
    (``server``: the run's server secret, which secret cohorts are drawn from)."""
    participation = participation_for(config, population, server)
    seen = np.zeros(population, dtype=bool)
    for r in range(1, rounds + 1):
        seen[participation.cohort(r, TRAIN)] = True
    return np.flatnonzero(seen)


def load_finished_run(
    run_dir: str | Path, secrets: RunSecret | str | Path | None = None
) -> FinishedRun:
    """Read a finished run and rebuild its model, federation and trained clients for its audit
    (:mod:`fedsim.audits.run_audit`); a missing directory or file, or weights that do
    not fit the saved config's model, raise ConfigError naming the path. ``config.json`` is
    authenticated under the run's root (``secrets``: the root it was started with; None: the
    one fedsim kept) before it is parsed: an edited one is refused, never imported."""
    path = Path(run_dir)
    if not path.is_dir():
        raise ConfigError("RUN_DIR", str(run_dir), "an existing directory written by `fedsim run`")
    missing = [n for n in (CONFIG_FILE, MODEL_FILE, SUMMARY_FILE) if not (path / n).is_file()]
    if missing:
        raise ConfigError(
            "RUN_DIR",
            str(run_dir),
            f"a finished `fedsim run` directory; it has no {', '.join(missing)} "
            f"(missing: {', '.join(str(path / n) for n in missing)})",
        )
    run_root, data = authenticated_config(path, secrets)
    try:
        config = ExperimentConfig.from_dict(json.loads(data))
        summary = json.loads((path / SUMMARY_FILE).read_text())
    except json.JSONDecodeError as err:
        raise ConfigError("RUN_DIR", str(run_dir), f"readable JSON files ({err})") from err
    with np.load(path / MODEL_FILE) as saved:
        arrays = {k: np.array(saved[k]) for k in saved.files}
    dataset = build_dataset(config.data)
    model = build_model(model_spec(config, dataset))
    try:
        load_arrays(model, arrays)
    except ValueError as err:
        raise ConfigError(
            "RUN_DIR", str(run_dir), f"a {MODEL_FILE} that fits the saved config's model ({err})"
        ) from err
    rounds = int(summary.get("rounds", config.rounds))
    clients = trained_clients(config, dataset.num_clients, rounds, run_root.keys.server())
    return FinishedRun(path, config, arrays, summary, dataset, model, rounds, clients)


def central_evaluator(config: ExperimentConfig, spec: ModelSpec, dataset: FederatedDataset):
    """The server-side ``evaluate_fn`` on a seeded subset of the central test set."""
    x_all, y_all = dataset.central_test
    every = config.evaluation.every
    if every == 0 or len(y_all) == 0:
        return None
    rows = min(config.evaluation.central_rows, len(y_all))
    pick = np.sort(np.random.default_rng([config.seed, 2]).choice(len(y_all), rows, replace=False))
    x, y = as_tensors(x_all[pick], y_all[pick])
    lora = config.client.lora  # federated LoRA: the global arrays are the adapters
    model = build_model(spec) if lora is None else build_lora_model(spec, lora)
    load = load_arrays if lora is None else load_adapter_arrays

    def evaluate(server_round: int, arrays: ArrayRecord) -> MetricRecord | None:
        if server_round % every and server_round != config.rounds:
            return None
        load(model, to_numpy(arrays))
        return MetricRecord(evaluate_model(model, x, y))

    return evaluate


def run_experiment(
    config: ExperimentConfig,
    out_dir: str | Path,
    *,
    resume: bool = False,
    progress: bool | Cadence = True,
    engine: Engine | None = None,
    secrets: RunSecret | str | Path | None = None,
    replay: str | Path | None = None,
) -> dict[str, Any]:
    """Run ``config``, writing rounds.jsonl as it goes and summary.json at the end.

    With ``resume``, continue the interrupted run in ``out_dir`` from its last
    checkpoint (see :mod:`fedsim.frontend.rundir`); the rounds it then writes are the
    ones an uninterrupted run would have written.

    ``secrets`` is the run's base root (an object, or the file holding it): every party's
    secret derives from it mixed with the run's fresh public nonce
    (:mod:`fedsim.frontend.run_root`), so two runs of one root draw independent noise; it also
    authenticates config.json and the checkpoints. None: a fresh root, kept in the user's secrets
    directory so that ``resume`` finds it; a resumed run needs the root it started with and repeats
    its streams. ``replay``: an earlier run directory whose nonce (and root) this new run takes,
    repeating its streams; the new run says it is a copy of that run's releases. ``engine``: a
    started engine to run on (left open); None: one of ``config.engine``, closed when the run
    finishes. ``progress``: False for none, else a bar on a terminal and plain lines elsewhere
    (at a :class:`~fedsim.frontend.progress.Cadence` when one is given). A device this machine lacks
    (``[engine] device``, when the workers run here) is refused before anything is written.
    """
    if _local_devices(config.engine):  # a cluster's workers check their own
        check_device_available(config.engine.device)
    # one writer per directory: a second run into it is refused naming the holder
    with locked(out_dir, "--resume" if resume else "--out", "fedsim run"):
        run = open_run(config, Path(out_dir), resume=resume, secrets=secrets, replay=replay)
        try:
            set_up_run(run, engine)
            final, ready = run_loop(run, progress)
            summary = finish_run(run, final, ready)
            if engine is None:
                run.engine.close()
            return summary
        finally:
            close_run(run)


@dataclass
class ExperimentRun:
    """A run of :func:`run_experiment` while it is open.

    :func:`open_run` makes its directory, writer and secret root; :func:`set_up_run` fills
    in the rest (each field None until built, so that :func:`close_run` closes exactly
    what was opened).
    """

    config: ExperimentConfig
    out: Path
    secrets: RunRoot
    run_dir: RunDirectory
    writer: RunWriter
    #: the checkpoint a resumed run continues from (None: a fresh run, or none written yet)
    checkpoint: Checkpoint | None
    #: the first round this invocation runs (1 for a fresh run)
    start_round: int
    resumed: bool
    #: time.perf_counter() when the directory was ready
    started: float
    dataset: FederatedDataset | None = None
    personal: PersonalisedParts | None = None
    spec: ModelSpec | None = None
    participation: CohortModel | None = None
    strategy: Strategy | None = None
    arrays: ArrayRecord | None = None
    client_app: ClientApp | None = None
    engine: Engine | None = None
    committee_host: CommitteeHost | None = None
    committee: Committee | None = None
    #: where the workers and the committees' member actors open the run's root
    root_source: RootSource | None = None


def open_run(
    config: ExperimentConfig,
    out: Path,
    *,
    resume: bool,
    secrets: RunSecret | str | Path | None,
    replay: str | Path | None = None,
) -> ExperimentRun:
    """The run directory (created, or reopened at its last checkpoint with ``resume``), its
    rounds writer and its secret root; a resumed run takes its config from the directory,
    after authenticating it."""
    budget = config.state_memory_mb * 2**20
    if resume:
        if replay is not None:
            raise ConfigError("--replay", str(replay), "unset with --resume (a resume repeats "
                              "its own run's streams)")
        # before anything in the directory changes or is parsed
        run_root, data = authenticated_config(out, secrets)
        config = _matching_config(out, _parse_config(out / CONFIG_FILE, data), config)
        run_dir, checkpoint = RunDirectory.reopen(out, run_root.keys, budget)
        resumed_after = checkpoint.server_round if checkpoint else -1
        start_round = max(resumed_after, 0) + 1
        writer = RunWriter(out, "--resume", resume_after=resumed_after)
    else:
        checkpoint, start_round = None, 1
        if isinstance(secrets, str | Path):  # refused before anything is written
            outside_run_dir(secrets, out)
        writer = RunWriter(out)
        config_text = json.dumps(to_mapping(config), indent=2, sort_keys=True)
        run_root = start_root(out, secrets, config_text.encode(), replay)
        run_dir = RunDirectory.create(out, config_text, run_root.keys, budget)
    return ExperimentRun(
        config, out, run_root, run_dir, writer, checkpoint, start_round, resume,
        time.perf_counter(),
    )


def set_up_run(run: ExperimentRun, engine: Engine | None) -> None:
    """Start the engine (``engine``, or one of ``[engine]``; its workers come up meanwhile),
    then build the dataset, the strategy and its starting arrays (from the checkpoint when
    resuming), the client app and the parties bound to their secrets."""
    config = run.config
    # the workers start and import while the driver builds the rest
    run.engine = (engine or Engine(config.engine)).start()
    if is_text(config):
        return _set_up_text_run(run)
    run.dataset = build_dataset(config.data)
    run.personal = personalised_parts(config, run.dataset) if is_personalised(config) else None
    run.spec = None if run.personal else model_spec(config, run.dataset)
    if run.spec is not None:
        check_model(run.spec)
    run.participation = participation_for(
        config, run.dataset.num_clients, run.secrets.keys.server()
    )
    if run.checkpoint is not None:
        run.strategy, run.arrays = run.checkpoint.strategy, to_record(run.checkpoint.arrays)
    else:
        run.strategy = build_experiment_strategy(config, run.participation)
        run.arrays = to_record(initial_model(config, run.spec, run.personal))
    in_clear = config.privacy.metrics_in_clear
    client_app = (
        run.personal.app
        if run.personal
        else make_client_app(run.spec, config.data, config.client, in_clear)
    )
    # the protocol's client wrapper (DMM, DDGauss) releases metrics only when told to
    run.client_app = spec_for(config.strategy.name).wrap_client_app(
        client_app, in_clear, config.strategy.options
    )
    # the server's secret and the committee hosts (DMM's, DDGauss's), bound again after a
    # resume (pickling drops them); the hosts get where the root lies, never the root: their
    # member actors open it (in process, where no isolation is possible, the host does)
    run.root_source = run.secrets.workers_source(run.engine)
    run.committee_host = committee_host_for(
        run.strategy,
        run.root_source,
        config.faults,
        run.run_dir.party_store,
        draw=(config.seed, run.participation.num_clients),
    )
    run.committee = committee_for(run.strategy, run.root_source)
    bind_parties(run.strategy, run.secrets.keys.server(), run.committee_host, run.committee)


def _set_up_text_run(run: ExperimentRun) -> None:
    """:func:`set_up_run` for a synthetic-text method (:mod:`fedsim.frontend.text_run`): no model,
    the method's own arrays, its clients' app and the server's secret bound."""
    config = run.config
    if run.checkpoint is not None:  # the checkpoint keeps the state, not the models
        raise ConfigError("--resume", str(run.out), f"a run of a method other than "
                          f"{config.strategy.name!r} (resuming a text method is not supported)")
    parts = text_parts(config)
    run.dataset = parts.federation
    run.participation = participation_for(config, parts.federation.num_clients,
                                          run.secrets.keys.server())  # fmt: skip
    run.strategy = build_experiment_strategy(config, run.participation)
    run.arrays = initial_text_arrays(run.strategy)
    run.client_app = parts.app
    run.root_source = run.secrets.workers_source(run.engine)
    bind_parties(run.strategy, run.secrets.keys.server())


def initial_model(
    config: ExperimentConfig, spec: ModelSpec | None, personal: PersonalisedParts | None
) -> dict[str, np.ndarray]:
    """A fresh run's global arrays: the personalised strategies' initial posterior, the
    initial model, or (federated LoRA) the initial adapters; each drawn from the run seed."""
    if personal:
        return personal.initial
    if config.client.lora is None:
        return initial_arrays(spec, config.seed)
    return initial_adapter_arrays(spec, config.client.lora, config.seed)


def run_loop(run: ExperimentRun, progress: bool | Cadence) -> tuple[ArrayRecord, float]:
    """Run the rounds from ``run.start_round`` on: rounds.jsonl gets a line per round (and
    ``tensorboard/`` its scalars, with ``[output] tensorboard``) and the directory a checkpoint
    every ``checkpoint_every`` rounds and after the last. Returns the final global arrays and
    the time.perf_counter() at which the grid was ready."""
    config = run.config
    events = (  # [output] tensorboard: the rounds kept so far, then each new one
        TensorBoardEvents(run.out, read_rounds(run.writer.rounds_path))
        if config.output.tensorboard
        else None
    )
    with (
        RunProgress(config.rounds, done=run.start_round - 1, enabled=progress) as bar,
        events or contextlib.nullcontext(),
    ):
        recorder = RoundRecorder(
            [run.writer.write_round, bar, *([events] if events else [])],
            infer_rounds=False,
            private=config.private,
            metrics_in_clear=config.privacy.metrics_in_clear,
        )
        grid = run.engine.open_run(
            run.client_app,
            run.dataset.num_clients,
            run_config={"seed": config.seed},
            participation=engine_participation(config, run.participation),
            observer=recorder,
            state_store=run.run_dir.store,
            faults=config.faults,
            # Memory-mapped files are opened by each worker, not copied to it.
            datasets=() if is_text(config) or _file_backed(run.dataset)
            else ((config.data, run.dataset),),
            secrets=run.root_source,
        )
        ready = time.perf_counter()
        evaluate = (
            run.personal.evaluate
            if run.personal
            else None  # a text method measures its quality on the server
            if is_text(config)
            else central_evaluator(config, run.spec, run.dataset)
        )
        final = run_rounds(
            run.strategy,
            AppGrid(grid),  # the strategy sees Flower's Grid, not the engine's internals
            run.arrays,
            config.rounds,
            timeout=config.timeout,
            evaluate_fn=averaged_evaluation(run.strategy, evaluate),
            on_round=_round_handler(run, recorder),
            first_round=run.start_round,
        )
        grid.wait_idle()
    return final, ready


def _round_handler(run: ExperimentRun, recorder: RoundRecorder) -> Callable[[RoundOutcome], None]:
    """What happens after each round: its line in rounds.jsonl, then a checkpoint when one
    is due (every ``checkpoint_every`` rounds, and at the last round, also when the
    strategy's privacy budget ends the run early). After a stop request (Ctrl-C, SIGTERM:
    :mod:`fedsim.frontend.interrupt`) the round is checkpointed and the run ends there."""
    config, strategy = run.config, run.strategy
    private, stoppable = find(strategy, PrivacyReporting), find(strategy, Stoppable)
    registry = ClientRegistry(run.dataset.num_clients)
    stops = interrupt.active()  # Ctrl-C / SIGTERM: stop after the round (fedsim.frontend.interrupt)
    if stops is not None:
        stops.install()  # again: ray.init sets its own SIGTERM handler

    def on_round(outcome: RoundOutcome) -> None:
        client_privacy = _client_privacy(
            config, run.participation, registry, run.run_dir.store, outcome.server_round
        )
        with interrupt.writing():
            recorder.end_round(
                outcome.server_round,
                aggregated=metrics_dict(outcome.train_metrics),
                aggregated_evaluate=metrics_dict(outcome.evaluate_metrics),
                central=metrics_dict(outcome.central_metrics),
                privacy=private.privacy_report() if private is not None else None,
                client_privacy=client_privacy,
            )
        last = outcome.server_round == config.rounds or (
            stoppable is not None
            and outcome.server_round >= 1
            and stoppable.should_stop(outcome.server_round + 1)  # the budget ends the run here
        )
        stopping = stops is not None and stops.requested and not last
        due = outcome.server_round % config.checkpoint_every == 0 or last or stopping
        if outcome.server_round and due:
            arrays_now = {k: np.array(v) for k, v in to_numpy(outcome.arrays).items()}
            with interrupt.writing():
                run.writer.sync()  # the checkpoint must never be ahead of rounds.jsonl
                run.run_dir.save(Checkpoint(outcome.server_round, arrays_now, strategy, {}))
        if stopping:
            stops.after_round(outcome.server_round)  # raises Interrupted

    return on_round


def finish_run(run: ExperimentRun, final: ArrayRecord, ready: float) -> dict[str, Any]:
    """Write model.npz and summary.json (then the configured audit's audit.json, whose
    result the summary also gets); returns the summary."""
    finished = time.perf_counter()
    np.savez(run.out / "model.npz", **to_numpy(final))
    records = read_rounds(run.writer.rounds_path)
    summary = run_summary_record(
        run.config, run.dataset, run.engine, records, run.started, ready, finished
    )
    summary["resumed_after_round"] = run.start_round - 1 if run.resumed else None
    summary.update(privacy_summary(run.strategy, records))
    summary["run_nonce"] = run.secrets.nonce
    if run.secrets.replay_of is not None:  # a copy of an earlier run's releases, said so
        summary["replay_of"] = {**run.secrets.replay_of, "note": run.secrets.record["note"]}
    run.writer.write_summary(summary)
    if run.config.audit is not None:  # reads the files just written; adds audit.json
        finished_run = load_finished_run(run.out, _base_of(run))
        summary["audit"] = run_configured_audit(finished_run, run.config.audit)
        run.writer.write_summary(summary)
    return summary


def close_run(run: ExperimentRun) -> None:
    """Close what the run opened, whether it finished or failed: the strategy's own actors
    (e.g. DMM's committee), the committee host and committee, the writer and the directory."""
    closable = find(run.strategy, Closable)  # e.g. DMM's committee actors
    if closable is not None:
        closable.close()
    if run.committee_host is not None:
        run.committee_host.close()
    if run.committee is not None:
        run.committee.close()
    run.writer.close()
    run.run_dir.close()


def _local_devices(engine: EngineConfig) -> bool:
    """Whether the workers run on this machine (in-process, or a Ray that fedsim starts)."""
    return engine.backend == "local" or not (engine.ray_address or os.environ.get("RAY_ADDRESS"))


def _file_backed(dataset: FederatedDataset) -> bool:
    return any(isinstance(a, np.memmap) for a in dataset.to_arrays().values())


def _client_privacy(
    config: ExperimentConfig,
    participation: CohortModel,
    registry: ClientRegistry,
    store: ClientStateStore,
    server_round: int,
) -> dict[str, Any] | None:
    """With client DP-SGD: the largest epsilon any client of this round's training cohort
    reports over all its rounds (read from the client states the round left behind)."""
    dp = config.client.dp_sgd
    if not isinstance(dp, DPSGD) or server_round < 1:
        return None
    cohort = participation.cohort(server_round, TRAIN)
    states = store.get_many(registry.node_ids_of(cohort))
    epsilons = [
        e for e in (epsilon_of(pickle.loads(blob)) for blob in states.values()) if e is not None
    ]
    return {
        "max_epsilon": max(epsilons, default=0.0),
        "clients": len(epsilons),
        "delta": dp.delta,
        "accountant": dp.accountant,
    }


def load_run_config(
    out_dir: str | Path,
    given: ExperimentConfig | None,
    secrets: RunSecret | str | Path | None = None,
) -> ExperimentConfig:
    """The config of the run in ``out_dir``, authenticated under its root (``secrets``: the
    root it was started with; None: the one fedsim kept) before it is parsed; a ``given`` one
    must match it (its [engine] table may differ: a run can resume on another machine)."""
    path = Path(out_dir) / CONFIG_FILE
    if not path.is_file():
        raise ConfigError(
            "--resume", str(out_dir), f"a fedsim run directory (it has no {CONFIG_FILE})"
        )
    _, data = authenticated_config(out_dir, secrets)
    return _matching_config(out_dir, _parse_config(path, data), given)


def _base_of(run: ExperimentRun) -> RunSecret | str | None:
    """What names the run's base root again (its file, or the object it was given as)."""
    if run.secrets.source is not None:
        return run.secrets.source.path
    return run.secrets.given


def _parse_config(path: Path, data: bytes) -> ExperimentConfig:
    """The config in ``data`` (the authenticated bytes of ``path``)."""
    try:
        return ExperimentConfig.from_dict(json.loads(data))
    except (ValueError, TypeError, AttributeError) as err:  # ConfigError is a ValueError
        raise RunFileError(
            path, f"is not a config fedsim wrote (truncated, damaged or edited: {err})"
        ) from None


def _matching_config(
    out_dir: str | Path, saved: ExperimentConfig, given: ExperimentConfig | None
) -> ExperimentConfig:
    path = Path(out_dir) / CONFIG_FILE
    if given is None:
        return saved
    ours, theirs = to_mapping(given), to_mapping(saved)
    differing = [
        k for k in differing_keys(ours, theirs) if k != "engine" and not k.startswith("engine.")
    ]
    if differing:
        raise ConfigError(
            "--resume",
            str(path),
            f"a run of the same config; these keys differ: {', '.join(differing)}",
        )
    return dataclasses.replace(saved, engine=given.engine)
