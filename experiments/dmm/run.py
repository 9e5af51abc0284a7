"""The DMM study: DMM (banded, tree) against DDGauss, central BandMF, the central tree,
DP-FedAvg and non-private training, each at its own server learning rate chosen on validation.

Sources (``--source``; rounds and local training per source in :data:`ROUNDS`, :data:`LOCAL`,
chosen so that non-private FedAvg plateaus):

* ``digits``: scikit-learn digits split iid over 750 clients (150 per round), multinomial
  logistic regression (650 parameters, D = 1024 after padding);
* ``femnist-like``: the generated FEMNIST-like writers (500 writers, 100 per round, natural
  partition), images average-pooled 4 x 4 (7 x 7), logistic regression (3,100 parameters,
  D = 4096). The pooled dataset is saved once under ``--cache`` and read back as an ``npy``
  source.

Validation: the dataset's test rows are split once by a fixed public permutation
(:func:`split_rows`, :data:`SPLIT_SEED`) into a validation half, which only chooses server
learning rates (:mod:`experiments.dmm.tune`) and is never reported, and a test half, which is
reported and never chooses. Every run records both accuracies after every round (the curve).

Schedule: 5-min-separation (5 groups, each client trains every 5th round, k = ceil(rounds / 5)
times), clipping norm 1, delta 1e-5. Every private method is calibrated to the target epsilon
under that participation (:mod:`experiments.dmm.methods`): DP-FedAvg (Gaussian noise each
round), central BandMF / tree (:class:`strategies.methods.matrix_mechanism.MatrixMechanism`,
5-banded BandMF C / Honaker's tree), DDGauss (20-bit sum, ``mode="plaintext"``: the same sum
and accounting as its full SecAgg+ mode), DMM banded / tree (:class:`strategies.methods.dmm.DMM`
in ``mode="ideal"``, M = round(2^12 C) / the 0/1 tree, z bisected on
:func:`fedsim.privacy.dmm.zcdp_epsilon` of that integer M). The accuracy rows report DMM's ideal
mode; ``--check-identical N`` replays N sampled DMM points in full mode (committees of 20 on 4
Ray actors, every share sealed) and ``--check-ddgauss-full N`` N DDGauss points with SecAgg+,
each with its point's root and nonce, storing whether the final models are bit-identical: full
mode is what is checked, ideal mode is what is reported. The server learning rate of every
(method, epsilon) comes from ``lr_choice.json`` (:mod:`experiments.dmm.tune`); it is applied
after each release (post-processing), so it changes no noise multiplier and no epsilon.

Secrets: one study root (``--secrets FILE``, kept outside the results; created with OS randomness
if missing) gives each seed its own root (:mod:`experiments.roots`), and every point of the study
(method, ε, seed) mixes a fresh public nonce into it (:meth:`RunSecret.for_run`), stored in the
point's file as ``run_nonce``: no two points share a noise stream. The engine gives client i its
own secret from the point's root (``Engine.open_run(..., secrets=...)``), the server's noise
secret and DMM's committee host are bound with
:func:`strategies.plumbing.server_secret.bind_parties`; the stored results carry only the roots'
fingerprints and the nonces. A mode check replays its point's nonce (``replay_of``).

Every run is stored as one JSON file
``{results}/{source}-{clients}-r{rounds}-v2/{method}_eps{e}_seed{s}.json``
(``non-private_seed{s}.json``) as soon as it ends, seed by seed; a point whose file holds its
nonce is skipped, so the study resumes where it stopped. :mod:`experiments.dmm.table` turns
the stored results into tables.

    python experiments/dmm/tune.py --source digits
    python experiments/dmm/run.py --source digits [--epsilons 1 2 4 8] [--seeds 0 ... 9]
        [--methods ...] [--rounds R] [--results DIR] [--secrets FILE]
        [--check-identical N] [--check-ddgauss-full N]
"""

from __future__ import annotations

import argparse
import hashlib
import json
import shutil
import sys
import tempfile
import time
from dataclasses import asdict
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from experiments.dmm.methods import (  # noqa: E402
    ACTOR_SHARDS,
    CLIP,
    COMMITTEE,
    DELTA,
    SEP,
    Setting,
    make_strategy,
    reported_epsilon,
)
from experiments.dmm.table import CHOICE_FILE, VERSION, choice_of, study_roots  # noqa: E402
from experiments.roots import default_key, seed_root, study_root  # noqa: E402
from fedsim.data import DatasetSpec, build_dataset  # noqa: E402
from fedsim.data.dataset import FederatedDataset  # noqa: E402
from fedsim.engine import Engine, EngineConfig  # noqa: E402
from fedsim.engine.cluster import ensure_ray  # noqa: E402
from fedsim.engine.dmm_committee import CommitteeHost  # noqa: E402
from fedsim.engine.participation import MinSeparationCohort  # noqa: E402
from fedsim.engine.rounds import run_rounds  # noqa: E402
from fedsim.models import ModelSpec, build_model, initial_arrays, load_arrays  # noqa: E402
from fedsim.randomness import RunSecret, new_nonce  # noqa: E402
from fedsim.record_codec import to_numpy, to_record  # noqa: E402
from fedsim.workloads.supervised import LocalTraining, make_client_app  # noqa: E402
from fedsim.workloads.training import evaluate_model  # noqa: E402
from strategies.methods.ddgauss.client import ddgauss_client_app  # noqa: E402
from strategies.methods.dmm import dmm_client_app  # noqa: E402
from strategies.plumbing.server_secret import bind_parties  # noqa: E402

HERE = Path(__file__).resolve().parent
STUDY = "dmm-study"  # its roots: experiments/roots.py
METHODS = (
    "non-private",
    "dp-fedavg",
    "ddgauss",
    "central-tree",
    "central-bandmf",
    "dmm-tree",
    "dmm-banded",
)
#: Registered clients per source (one fifth train each round).
CLIENTS = {"digits": 750, "femnist-like": 500}
#: Rounds per source (the schedule under which non-private training plateaus).
ROUNDS = {"digits": 40, "femnist-like": 50}
#: Local training per source.
LOCAL = {
    "digits": LocalTraining(epochs=1, batch_size=16, lr=0.5, seed=0),
    "femnist-like": LocalTraining(epochs=1, batch_size=32, lr=3.0, seed=0),
}
#: The public seed of the fixed split of the dataset's test rows into validation and test.
SPLIT_SEED = 20261203


def pooled_femnist(clients: int, pool: int, cache: Path) -> DatasetSpec:
    """The FEMNIST-like writers (natural partition, data seed 0) average-pooled ``pool`` x
    ``pool``, saved once under ``cache`` and described as an ``npy`` source."""
    side = 28 // pool
    directory = cache / f"femnist_like_{clients}_pool{pool}"
    cache.mkdir(parents=True, exist_ok=True)
    if not (directory / "meta.json").is_file():
        raw = build_dataset(
            DatasetSpec(source="femnist", partition="natural", num_clients=clients, seed=0)
        )
        arrays = dict(raw.to_arrays())
        for split in ("train_x", "test_x"):
            x = np.asarray(arrays[split], dtype=np.float32)
            arrays[split] = x.reshape(len(x), 1, side, pool, side, pool).mean(axis=(3, 5))
        pooled = FederatedDataset.from_arrays(arrays, raw.num_classes, f"{raw.name}-pool{pool}")
        staging = Path(tempfile.mkdtemp(prefix=directory.name, dir=cache))
        pooled.save(staging)
        try:  # atomic, so that concurrent runs never read a half-written copy
            staging.rename(directory)
        except OSError:  # another run got there first; its copy is identical
            shutil.rmtree(staging)
    return DatasetSpec(source="npy", partition="natural", num_clients=clients, path=str(directory))


def model_digest(arrays: dict[str, np.ndarray]) -> str:
    """sha256 of the final model's bytes (name, dtype, shape and data of every array)."""
    digest = hashlib.sha256()
    for name in sorted(arrays):
        value = np.ascontiguousarray(arrays[name])
        digest.update(f"{name}:{value.dtype.str}:{value.shape}".encode())
        digest.update(value.tobytes())
    return digest.hexdigest()


COST_KEYS = (
    "dmm-bytes",
    "dmm-bytes-per-client",
    "dmm-bytes-per-member-sent",
    "dmm-bytes-per-member-received",
    "dmm-bytes-per-next-member-received",
    "dmm-clients",
    "dmm-member-dropouts",
    "dmm-verified",
)


#: Each secure method's mode in the accuracy rows, and the mode its sampled runs are checked
#: against (the same integers, so the same model bit for bit with the same RunSecret).
MODES = {"ddgauss": ("plaintext", "full"), "dmm": ("ideal", "full")}


def evaluate_on(net, splits: dict[str, tuple]) -> dict[str, float]:
    """Accuracy of ``net`` on each named split (validation, test)."""
    return {name: float(evaluate_model(net, *xy)["accuracy"]) for name, xy in splits.items()}


def train(engine, setup, strategy, host, family: str, seed: int, st: Setting, secrets):
    """Run the rounds; returns (final arrays, per-round records, seconds). Every round records
    its wall seconds, DMM's costs and the global model's validation and test accuracy (the
    curve; evaluation time is not counted in the round's seconds)."""
    data, dataset, model, apps, splits, _ = setup
    grid = engine.open_run(
        apps.get(family, apps["plain"]),
        st.clients,
        run_config={"seed": seed},
        participation=MinSeparationCohort(st.clients, SEP, seed),
        datasets=((data, dataset),),
        secrets=secrets,  # client i's own secret in its node_config
    )
    per_round: list[dict] = []
    net = build_model(model)
    clock = [time.perf_counter(), 0.0]

    def on_round(outcome) -> None:
        now = time.perf_counter()
        metrics = dict(outcome.train_metrics or {})
        record = {"round": outcome.server_round, "seconds": now - clock[0]}
        record.update({k: metrics[k] for k in COST_KEYS if k in metrics})
        load_arrays(net, to_numpy(outcome.arrays))
        record.update(evaluate_on(net, splits))
        per_round.append(record)
        clock[0] = time.perf_counter()
        clock[1] += clock[0] - now

    start = time.perf_counter()
    try:
        final = run_rounds(
            strategy, grid, to_record(initial_arrays(model, seed)), st.rounds, on_round=on_round
        )
        grid.wait_idle()
    finally:
        if host is not None:
            strategy.close()
            host.close()
    return final, per_round, time.perf_counter() - start - clock[1]


def run_one(engine, setup, method, epsilon, seed, st: Setting, nonce, mode=None, lr=1.0) -> dict:
    """One run of ``method`` at ``epsilon`` with seed ``seed`` and server learning rate ``lr``,
    under the point's own root: the seed's root mixed with the public run ``nonce``
    (:meth:`RunSecret.for_run`), so no two points of the study share a noise stream; ``mode``
    None: the method's study mode (:data:`MODES`)."""
    model, splits, root = setup[2], setup[4], setup[5]
    family = method.split("-")[0]
    if mode is None and family in MODES:
        mode = MODES[family][0]
    secrets = seed_root(root, STUDY, seed).for_run(nonce)
    dim = sum(v.size for v in to_numpy(to_record(initial_arrays(model, 0))).values())
    strategy, z = make_strategy(method, epsilon, seed, dim, st, mode, lr)
    host = None
    if family == "dmm":
        host = CommitteeHost(
            secrets, actors=mode == "full", shards=ACTOR_SHARDS, draw=(seed, st.clients)
        )
    bind_parties(strategy, secrets.server(), host)  # the server's noise, DMM's committees
    final, per_round, seconds = train(engine, setup, strategy, host, family, seed, st, secrets)
    net = build_model(model)
    arrays = to_numpy(final)
    load_arrays(net, arrays)
    scores = evaluate_on(net, splits)
    out = {
        "method": method,
        "mode": mode,
        "secrets_fingerprint": secrets.fingerprint(),
        "study_root": root.fingerprint(),
        "run_nonce": nonce,
        "target_epsilon": epsilon,
        "epsilon": reported_epsilon(method, strategy, st),
        "noise_multiplier": z,
        "server_learning_rate": lr,
        "seed": seed,
        "accuracy": scores["test"],
        "validation_accuracy": scores["validation"],
        "seconds": seconds,
        "model_sha256": model_digest(arrays),
        "rounds": per_round,
    }
    if family == "dmm":
        out["cost_per_round"] = {
            key: float(np.mean([r[key] for r in per_round if key in r]))
            for key in ("seconds", *COST_KEYS[:5])
        }
        out["committee"] = {**COMMITTEE, "actors": ACTOR_SHARDS if mode == "full" else 0}
    return out


def result_path(results: Path, method: str, epsilon: float | None, seed: int, prefix="") -> Path:
    name = f"{method}_seed{seed}" if epsilon is None else f"{method}_eps{epsilon:g}_seed{seed}"
    return results / f"{prefix}{name}.json"


def write_json(path: Path, data: dict) -> None:
    """Atomically (a stopped study never leaves half a file)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(data, indent=2, default=str) + "\n")
    tmp.replace(path)


def split_rows(count: int, seed: int = SPLIT_SEED) -> tuple[np.ndarray, np.ndarray]:
    """(validation, test) row indices of a dataset's ``count`` test rows: a fixed public
    permutation (``seed``) cut in half, disjoint and together every row. Validation chooses
    the server learning rates and is never reported; test is reported and never chooses."""
    if count < 2:
        raise ValueError(f"test rows count = {count}: need >= 2 to split")
    order = np.random.default_rng(seed).permutation(count)
    return np.sort(order[: count // 2]), np.sort(order[count // 2 :])


def build_setup(source: str, st: Setting, local: LocalTraining, cache: Path, root: RunSecret):
    torch.set_num_threads(1)
    if source == "digits":
        data = DatasetSpec(source="digits", partition="iid", num_clients=st.clients, seed=0)
    else:
        data = pooled_femnist(st.clients, 4, cache)
    dataset = build_dataset(data)
    model = ModelSpec(
        kind="logreg", input_shape=tuple(dataset.feature_shape), num_classes=dataset.num_classes
    )
    inner = make_client_app(model, data, local)
    apps = {"plain": inner, "ddgauss": ddgauss_client_app(inner), "dmm": dmm_client_app(inner)}
    x = torch.as_tensor(np.array(dataset.test.x), dtype=torch.float32)
    y = torch.as_tensor(np.array(dataset.test.y), dtype=torch.int64)
    validation, test = split_rows(len(y))
    splits = {"validation": (x[validation], y[validation]), "test": (x[test], y[test])}
    return data, dataset, model, apps, splits, root


def plan(args) -> list[tuple[str, float | None, int]]:
    """(method, epsilon, seed) cells, seed first, so that a stopped study leaves whole seeds."""
    cells = []
    for seed in args.seeds:
        if "non-private" in args.methods:
            cells.append(("non-private", None, seed))
        cells += [(m, e, seed) for e in args.epsilons for m in args.methods if m != "non-private"]
    return cells


def sampled(cells: list[tuple[str, float | None, int]], family: str, count: int):
    """``count`` of ``family``'s cells for the mode checks, spread over seeds and epsilons:
    evenly spaced positions in each method's (seed-major) list, methods taken in turn."""
    by_method: dict[str, list] = {}
    for cell in cells:
        if cell[0].split("-")[0] == family:
            by_method.setdefault(cell[0], []).append(cell)
    chosen = []
    for i, method in enumerate(sorted(by_method)):
        mine = by_method[method]
        share = count // len(by_method) + (i < count % len(by_method))
        positions = np.linspace(0, len(mine) - 1, share) if share > 1 else [0] * share
        chosen += [mine[round(float(x))] for x in positions]
    return set(chosen)


def check_modes(engine, setup, cell, st: Setting, results: Path) -> dict:
    """Run ``cell`` again in its family's other mode and compare models: a replay of the
    stored point (its nonce, so its streams), a copy of that release made only to check that
    the two modes compute the same integers, never a new point of the study."""
    method, eps, seed = cell
    study_mode, other_mode = MODES[method.split("-")[0]]
    stored = json.loads(result_path(results, method, eps, seed).read_text())
    lr = stored.get("server_learning_rate", 1.0)
    other = run_one(engine, setup, method, eps, seed, st, stored["run_nonce"], other_mode, lr)
    return {
        "method": method,
        "target_epsilon": eps,
        "seed": seed,
        "replay_of": stored["run_nonce"],
        "modes": [study_mode, other_mode],
        "sha256": [stored["model_sha256"], other["model_sha256"]],
        "seconds": [stored["seconds"], other["seconds"]],
        "identical": stored["model_sha256"] == other["model_sha256"],
    }


def finished_point(path: Path, key: str = "run_nonce") -> bool:
    """Whether ``path`` holds a finished point of this study: one run under its own nonce
    (``key``); a file from before points had their own roots is run again."""
    return path.is_file() and key in json.loads(path.read_text())


def replayable(path: Path, root: RunSecret, first: str) -> bool:
    """Whether the point in ``path`` ran under ``root`` (points from before the study root
    was recorded per point ran under the study's ``first`` root), so a mode check can replay
    it; a point whose root is gone is run again under ``root`` before its check."""
    return json.loads(path.read_text()).get("study_root", first) == root.fingerprint()


def study_setup(st: Setting, dataset, roots: list[str]) -> dict:
    return {
        "source": st.source,
        "clients": st.clients,
        "rounds": st.rounds,
        "min_separation": SEP,
        "participations": st.k,
        "per_round": st.per_round,
        "model": f"logreg on {list(dataset.feature_shape)}",
        "local": asdict(LOCAL[st.source]),
        "split": {"seed": SPLIT_SEED, "validation": "half of the test rows", "test": "the rest"},
        "clip": CLIP,
        "delta": DELTA,
        "committee": COMMITTEE,
        "actors": ACTOR_SHARDS,
        "modes": {family: modes[0] for family, modes in MODES.items()},
        "study_roots": roots,
    }


def add_study_arguments(parser: argparse.ArgumentParser, seeds: list[int]) -> None:
    """The options :mod:`experiments.dmm.run` and :mod:`experiments.dmm.tune` share."""
    parser.add_argument("--source", choices=tuple(CLIENTS), default="digits")
    parser.add_argument("--clients", type=int, help="registered clients (default 750 / 500)")
    parser.add_argument("--rounds", type=int, help="rounds (default: ROUNDS of the source)")
    parser.add_argument("--epsilons", type=float, nargs="+", default=[1.0, 2.0, 4.0, 8.0])
    parser.add_argument("--seeds", type=int, nargs="+", default=seeds)
    parser.add_argument("--methods", nargs="+", default=list(METHODS), choices=METHODS)
    parser.add_argument("--results", type=Path, default=HERE / "results")
    parser.add_argument("--secrets", type=Path, default=default_key(STUDY))
    parser.add_argument("--cache", type=Path, default=Path("/tmp/fedsim-dmm-data"))


def study_directory(results: Path, st: Setting) -> Path:
    """``{results}/{source}-{clients}-r{rounds}-{VERSION}``: one directory per setting."""
    return results / f"{st.source}-{st.clients}-r{st.rounds}-{VERSION}"


def open_study(parser: argparse.ArgumentParser, args) -> tuple[Setting, Path, list[str], tuple]:
    """(setting, its directory, the study roots so far, the setup of :func:`build_setup`);
    records ``setup.json``."""
    clients = args.clients or CLIENTS[args.source]
    if clients < 2 * SEP or clients % SEP:
        parser.error(f"--clients {clients}: need a multiple of {SEP} that is >= {2 * SEP}")
    st = Setting(args.source, clients, args.rounds or ROUNDS[args.source])
    results = study_directory(args.results, st)
    root = study_root(args.secrets, results)
    setup_path = results / "setup.json"
    roots = [root.fingerprint()]
    if setup_path.is_file():  # the study roots of the points stored so far, this one added
        roots = [*study_roots(json.loads(setup_path.read_text())), root.fingerprint()]
    roots = list(dict.fromkeys(roots))
    setup = build_setup(args.source, st, LOCAL[args.source], args.cache, root)
    write_json(setup_path, study_setup(st, setup[1], roots))
    return st, results, roots, setup


def chosen_rates(parser, results: Path, cells) -> dict:
    """The server learning rate of every cell's (method, epsilon), from the tuning's choice
    (``lr_choice.json``, chosen on validation by :mod:`experiments.dmm.tune`)."""
    path = results / CHOICE_FILE
    if not path.is_file():
        parser.error(f"{path}: no learning-rate choice; run experiments/dmm/tune.py first")
    rates = choice_of(json.loads(path.read_text()))
    missing = sorted({(m, e) for m, e, _ in cells} - rates.keys(), key=str)
    if missing:
        parser.error(f"{path}: no learning rate chosen for (method, epsilon) {missing}")
    return rates


def main(argv: list[str] | None = None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_study_arguments(parser, list(range(10)))
    parser.add_argument("--check-identical", type=int, default=0, metavar="N")
    parser.add_argument("--check-ddgauss-full", type=int, default=0, metavar="N")
    args = parser.parse_args(argv)
    st, results, roots, setup = open_study(parser, args)
    cells = plan(args)
    rates = chosen_rates(parser, results, cells)
    checks = sampled(cells, "dmm", args.check_identical) | sampled(
        cells, "ddgauss", args.check_ddgauss_full
    )
    if any(c[0].startswith("dmm") for c in checks):
        ensure_ray(num_cpus=2)  # full mode's committee actors (clients train in this process)
    done = []
    with Engine(EngineConfig(backend="local")) as engine:
        for cell in cells:
            path = result_path(results, *cell)
            check = result_path(results, *cell, prefix="check_")
            checked = cell not in checks or finished_point(check, "replay_of")
            if not finished_point(path) or not (checked or replayable(path, setup[5], roots[0])):
                row = run_one(engine, setup, *cell, st, new_nonce(), lr=rates[cell[:2]])
                write_json(path, row)
                keys = ("method", "target_epsilon", "seed", "accuracy", "seconds")
                print(json.dumps({k: row[k] for k in keys}), flush=True)
                done.append(row)
            if not checked:
                write_json(check, check_modes(engine, setup, cell, st, results))
                print(json.loads(check.read_text()), flush=True)
    return done


if __name__ == "__main__":
    main()
