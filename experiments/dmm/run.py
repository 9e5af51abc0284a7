"""The DMM study: DMM (banded, tree) in full mode on committee actors against DDGauss, central
BandMF, the central tree, DP-FedAvg and non-private training.

Sources (``--source``):

* ``digits``: scikit-learn digits split iid over 750 clients (150 per round), multinomial
  logistic regression (650 parameters, D = 1024 after padding), one local epoch of SGD
  (batch 16, lr 0.1);
* ``femnist-like``: the generated FEMNIST-like writers (500 writers, 100 per round, natural
  partition), images average-pooled 4 x 4 (7 x 7), logistic regression (3,100 parameters,
  D = 4096), one local epoch of SGD (batch 32, lr 1.0). The pooled dataset is saved once under
  ``--cache`` and read back as an ``npy`` source.

Schedule: ``--rounds`` rounds (20) under 5-min-separation (5 groups, each client trains every 5th
round, k = ceil(rounds / 5) times), clipping norm 1, delta 1e-5, server learning rate 1. Every
private method is calibrated to the target epsilon under that participation:

* ``dp-fedavg``: Gaussian noise each round, ``calibrate_noise`` over k compositions;
* ``central-bandmf`` / ``central-tree``:
:class:`strategies.methods.matrix_mechanism.MatrixMechanism` with
  a 5-banded BandMF C / Honaker's tree;
* ``ddgauss``: :class:`strategies.methods.ddgauss.strategy.DDGauss` (20-bit sum) in
``mode="plaintext"`` (the
  same sum and accounting as full mode's SecAgg+), z bisected on the KLS21 bound;
* ``dmm-banded`` / ``dmm-tree``: :class:`strategies.methods.dmm.DMM` in ``mode="full"``: committees
of 20
  clients (t = 3, k = 3, planned for 3 member dropouts) drawn from the population each round and
  hosted on 4 Ray actors, M = round(2^12 C) of the same BandMF / the 0/1 Honaker tree; z bisected
  on :func:`fedsim.privacy.dmm.zcdp_epsilon` of that integer M.

Secrets: one study root (``--secrets FILE``, kept outside the results; created with OS randomness
if missing) gives each seed its own root (:mod:`experiments.roots`), and every point of the study
(method, ε, seed) mixes a fresh public nonce into it (:meth:`RunSecret.for_run`), stored in the
point's file as ``run_nonce``: no two points share a noise stream. The engine gives client i its
own secret from the point's root (``Engine.open_run(..., secrets=...)``), the server's noise
secret and DMM's committee host are bound with
:func:`strategies.plumbing.server_secret.bind_parties`; the stored results carry only the roots'
fingerprints and the nonces. A mode check replays its point's nonce (``replay_of``): a copy of that
release, made only to compare the two modes.

Every run is stored as one JSON file ``{results}/{source}/{method}_eps{e}_seed{s}.json``
(``non-private_seed{s}.json``) as soon as it ends; a point whose file holds its nonce is
skipped, so the study resumes where it stopped. A DMM run records its wall time and, per
round, seconds, bytes per client, bytes per committee member (sent and received) and total
protocol bytes.
``--check-identical N`` reruns N DMM cells (spread over methods, seeds and epsilons) in ideal
mode, ``--check-ddgauss-full N`` N DDGauss cells in full mode (SecAgg+ in the ClientApp), with
the point's own root and nonce, and stores ``check_{method}_eps{e}_seed{s}.json`` saying
whether the two final models are bit-identical. :mod:`experiments.dmm.table` turns the stored
results into tables.

    python experiments/dmm/run.py --source digits [--epsilons 1 2 4 8] [--seeds 0 1 2]
        [--methods ...] [--rounds 20] [--results DIR] [--secrets FILE]
        [--check-identical N] [--check-ddgauss-full N]
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import shutil
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

import dp_accounting as dpa  # noqa: E402
from flwr.serverapp.strategy import FedAvg  # noqa: E402

from experiments.dmm.table import study_roots  # noqa: E402
from experiments.roots import default_key, seed_root, study_root  # noqa: E402
from fedsim.data import DatasetSpec, build_dataset  # noqa: E402
from fedsim.data.dataset import FederatedDataset  # noqa: E402
from fedsim.engine import Engine, EngineConfig  # noqa: E402
from fedsim.engine.cluster import ensure_ray  # noqa: E402
from fedsim.engine.dmm_committee import CommitteeHost  # noqa: E402
from fedsim.engine.participation import MinSeparationCohort  # noqa: E402
from fedsim.engine.rounds import run_rounds  # noqa: E402
from fedsim.models import ModelSpec, build_model, initial_arrays, load_arrays  # noqa: E402
from fedsim.privacy import ddgauss as ddgauss_privacy  # noqa: E402
from fedsim.privacy import dmm as dmm_privacy  # noqa: E402
from fedsim.privacy.calibration import calibrate_noise  # noqa: E402
from fedsim.privacy.ledger import PrivacyLedger  # noqa: E402
from fedsim.privacy.matrix.banded import banded  # noqa: E402
from fedsim.privacy.matrix.tree import honaker_tree  # noqa: E402
from fedsim.privacy.participation import Participation  # noqa: E402
from fedsim.privacy.sampling import FullParticipation  # noqa: E402
from fedsim.randomness import RunSecret, new_nonce  # noqa: E402
from fedsim.record_codec import to_numpy, to_record  # noqa: E402
from fedsim.workloads.supervised import LocalTraining, make_client_app  # noqa: E402
from fedsim.workloads.training import evaluate_model  # noqa: E402
from strategies.methods.ddgauss.client import ddgauss_client_app  # noqa: E402
from strategies.methods.ddgauss.strategy import DDGauss  # noqa: E402
from strategies.methods.dmm import DMM, dmm_client_app  # noqa: E402
from strategies.methods.dp_fedavg.strategy import DPFedAvg  # noqa: E402
from strategies.methods.matrix_mechanism import MatrixMechanism  # noqa: E402
from strategies.plumbing.server_secret import bind_parties  # noqa: E402

HERE = Path(__file__).resolve().parent
STUDY = "dmm-study"  # its roots: experiments/roots.py
SEP, DELTA, CLIP = 5, 1e-5, 1.0
METHODS = (
    "non-private",
    "dp-fedavg",
    "ddgauss",
    "central-tree",
    "central-bandmf",
    "dmm-tree",
    "dmm-banded",
)
COMMITTEE = {"committee_size": 20, "threshold": 3, "packing": 3, "member_dropouts": 3}
ACTOR_SHARDS = 4
#: Registered clients per source (one fifth train each round).
CLIENTS = {"digits": 750, "femnist-like": 500}
#: Local training per source (one epoch of SGD).
LOCAL = {
    "digits": LocalTraining(epochs=1, batch_size=16, lr=0.1, seed=0),
    "femnist-like": LocalTraining(epochs=1, batch_size=32, lr=1.0, seed=0),
}


def rdp_epsilon(event: dpa.DpEvent) -> float:
    accountant = dpa.rdp.RdpAccountant()
    accountant.compose(event)
    return accountant.get_epsilon(DELTA)


def bisect(eps_of, target: float) -> float:
    """Smallest z (relative 1e-3) with eps_of(z) <= target; eps_of decreasing in z."""
    lo, hi = 0.05, 1.0
    while eps_of(hi) > target:
        lo, hi = hi, hi * 2
    while hi / lo > 1.001:
        mid = math.sqrt(lo * hi)
        lo, hi = (lo, mid) if eps_of(mid) <= target else (mid, hi)
    return hi


@dataclass(frozen=True)
class Setting:
    """One study's population and schedule: ``clients`` registered, ``rounds`` rounds,
    ``per_round = clients / SEP`` trained per round, each client ``k`` times."""

    source: str
    clients: int
    rounds: int

    @property
    def per_round(self) -> int:
        return self.clients // SEP

    @property
    def k(self) -> int:
        return math.ceil(self.rounds / SEP)

    @property
    def participation(self) -> Participation:
        return Participation.separated(SEP, self.k)


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


def dmm_strategy(method: str, epsilon: float, seed: int, dim: int, st: Setting, mode: str):
    """DMM calibrated to ``epsilon`` on the accounting of its integer matrix."""
    factorization = honaker_tree(st.rounds) if method == "dmm-tree" else banded(st.rounds, SEP)
    options = dict(
        factorization=factorization,
        population=st.clients,
        clipping_norm=CLIP,
        expected_clients=st.per_round,
        seed=seed,
        mode=mode,
        participation=st.participation,
        delta=DELTA,
        committee_actors=mode == "full",
        committee_shards=ACTOR_SHARDS,
        **COMMITTEE,
    )
    inner = FedAvg(fraction_train=1.0, fraction_evaluate=0.0, min_available_nodes=0)
    probe = DMM(inner, noise_multiplier=1.0, **options)
    rows = probe.mechanism.integer_matrix.shape[0]

    def eps_of(z):
        probe.noise_multiplier = z
        enc = probe.check(dim)
        eps = dmm_privacy.zcdp_epsilon(
            probe.mechanism,
            st.rounds,
            enc.l2_bound,
            enc.l1_bound,
            probe._scaled_noise_std,
            [st.per_round] * rows,
            enc.padded_dim,
        )
        return rdp_epsilon(dpa.GaussianDpEvent(1 / eps))

    z = bisect(eps_of, epsilon)
    return DMM(inner, noise_multiplier=z, **options), z


def make_strategy(method: str, epsilon: float, seed: int, dim: int, st: Setting, mode: str):
    """``method``'s strategy calibrated to ``epsilon`` and its noise multiplier; ``mode`` is
    DDGauss's ("plaintext" or "full") or DMM's ("full" or "ideal"), unused otherwise."""
    rounds, per_round, k = st.rounds, st.per_round, st.k
    inner = FedAvg(fraction_train=1.0, fraction_evaluate=0.0, min_available_nodes=0)
    if method == "non-private":
        return inner, None
    if method == "dp-fedavg":
        z = calibrate_noise(epsilon, DELTA, Participation.separated(SEP, k), rounds)
        return DPFedAvg(
            inner,
            clipping_norm=CLIP,
            noise_multiplier=z,
            expected_clients=per_round,
            sampling=Participation.separated(SEP, k),
            delta=DELTA,
        ), z
    if method.startswith("central"):
        z = calibrate_noise(epsilon, DELTA, FullParticipation(), 1)
        fac = honaker_tree(rounds) if method.endswith("tree") else banded(rounds, SEP)
        return MatrixMechanism(
            inner,
            factorization=fac,
            clipping_norm=CLIP,
            noise_multiplier=z,
            expected_clients=per_round,
            participation=Participation.separated(SEP, k),
            delta=DELTA,
        ), z
    if method == "ddgauss":
        probe = DDGauss(
            inner, clipping_norm=CLIP, noise_multiplier=1.0, expected_clients=per_round, seed=seed
        )

        def eps_of(z):
            probe.noise_multiplier, probe.encoder = z, None
            enc = probe.encoder_for(dim)
            eps = ddgauss_privacy.zcdp_epsilon(
                enc.l2_bound, enc.l1_bound, enc.scaled_noise_std, per_round, enc.padded_dim
            )
            return rdp_epsilon(dpa.SelfComposedDpEvent(dpa.GaussianDpEvent(1 / eps), k))

        z = bisect(eps_of, epsilon)
        return DDGauss(
            inner,
            clipping_norm=CLIP,
            noise_multiplier=z,
            expected_clients=per_round,
            seed=seed,
            mode=mode,
            delta=DELTA,
        ), z
    return dmm_strategy(method, epsilon, seed, dim, st, mode)


def reported_epsilon(method: str, strategy, st: Setting) -> float | None:
    if method == "non-private":
        return None
    if method == "ddgauss":  # its ledger composes every round; a client is in k of them
        ledger = PrivacyLedger("add_remove", DELTA, Participation.separated(SEP, st.k))
        for r, event in strategy.ledger.entries:
            ledger.record(r, event)
        return ledger.epsilon()
    return float(strategy.privacy_report()["epsilon"])


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
MODES = {"ddgauss": ("plaintext", "full"), "dmm": ("full", "ideal")}


def run_one(engine, setup, method, epsilon, seed, st: Setting, nonce: str, mode=None) -> dict:
    """One run of ``method`` at ``epsilon`` with seed ``seed``, under the point's own root:
    the seed's root mixed with the public run ``nonce`` (:meth:`RunSecret.for_run`), so no two
    points of the study share a noise stream; ``mode`` None: the method's study mode
    (:data:`MODES`)."""
    data, dataset, model, apps, test, root = setup
    family = method.split("-")[0]
    if mode is None and family in MODES:
        mode = MODES[family][0]
    secrets = seed_root(root, STUDY, seed).for_run(nonce)
    dim = sum(v.size for v in to_numpy(to_record(initial_arrays(model, 0))).values())
    strategy, z = make_strategy(method, epsilon, seed, dim, st, mode)
    host = None
    if family == "dmm":
        host = CommitteeHost(
            secrets, actors=mode == "full", shards=ACTOR_SHARDS, draw=(seed, st.clients)
        )
    bind_parties(strategy, secrets.server(), host)  # the server's noise, DMM's committees
    grid = engine.open_run(
        apps.get(family, apps["plain"]),
        st.clients,
        run_config={"seed": seed},
        participation=MinSeparationCohort(st.clients, SEP, seed),
        datasets=((data, dataset),),
        secrets=secrets,  # client i's own secret in its node_config
    )
    per_round: list[dict] = []
    clock = [time.perf_counter()]

    def on_round(outcome) -> None:
        now = time.perf_counter()
        metrics = dict(outcome.train_metrics or {})
        record = {"round": outcome.server_round, "seconds": now - clock[0]}
        record.update({k: metrics[k] for k in COST_KEYS if k in metrics})
        per_round.append(record)
        clock[0] = now

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
    seconds = time.perf_counter() - start
    net = build_model(model)
    arrays = to_numpy(final)
    load_arrays(net, arrays)
    out = {
        "method": method,
        "mode": mode,
        "secrets_fingerprint": secrets.fingerprint(),
        "study_root": root.fingerprint(),
        "run_nonce": nonce,
        "target_epsilon": epsilon,
        "epsilon": reported_epsilon(method, strategy, st),
        "noise_multiplier": z,
        "seed": seed,
        "accuracy": float(evaluate_model(net, *test)["accuracy"]),
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
    test = (
        torch.as_tensor(np.array(dataset.test.x), dtype=torch.float32),
        torch.as_tensor(np.array(dataset.test.y), dtype=torch.int64),
    )
    return data, dataset, model, apps, test, root


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
    other = run_one(engine, setup, method, eps, seed, st, stored["run_nonce"], mode=other_mode)
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
        "clip": CLIP,
        "delta": DELTA,
        "committee": COMMITTEE,
        "actors": ACTOR_SHARDS,
        "modes": {family: modes[0] for family, modes in MODES.items()},
        "study_roots": roots,
    }


def main(argv: list[str] | None = None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--source", choices=tuple(CLIENTS), default="digits")
    parser.add_argument("--clients", type=int, help="registered clients (default 750 / 500)")
    parser.add_argument("--rounds", type=int, default=20)
    parser.add_argument("--epsilons", type=float, nargs="+", default=[1.0, 2.0, 4.0, 8.0])
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--methods", nargs="+", default=list(METHODS), choices=METHODS)
    parser.add_argument("--results", type=Path, default=HERE / "results")
    parser.add_argument("--check-identical", type=int, default=0, metavar="N")
    parser.add_argument("--check-ddgauss-full", type=int, default=0, metavar="N")
    parser.add_argument("--secrets", type=Path, default=default_key(STUDY))
    parser.add_argument("--cache", type=Path, default=Path("/tmp/fedsim-dmm-data"))
    args = parser.parse_args(argv)
    clients = args.clients or CLIENTS[args.source]
    if clients < 2 * SEP or clients % SEP:
        parser.error(f"--clients {clients}: need a multiple of {SEP} that is >= {2 * SEP}")
    st = Setting(args.source, clients, args.rounds)
    results = args.results / f"{args.source}-{clients}-r{args.rounds}"
    root = study_root(args.secrets, results)
    setup_path = results / "setup.json"
    roots = [root.fingerprint()]
    if setup_path.is_file():  # the study roots of the points stored so far, this one added
        roots = [*study_roots(json.loads(setup_path.read_text())), root.fingerprint()]
    setup = build_setup(args.source, st, LOCAL[args.source], args.cache, root)
    write_json(setup_path, study_setup(st, setup[1], list(dict.fromkeys(roots))))
    if any(m.startswith("dmm") for m in args.methods):
        ensure_ray(num_cpus=2)  # the committee actors (clients train in this process)
    cells = plan(args)
    checks = sampled(cells, "dmm", args.check_identical) | sampled(
        cells, "ddgauss", args.check_ddgauss_full
    )
    done = []
    with Engine(EngineConfig(backend="local")) as engine:
        for cell in cells:
            path = result_path(results, *cell)
            check = result_path(results, *cell, prefix="check_")
            checked = cell not in checks or finished_point(check, "replay_of")
            if not finished_point(path) or not (checked or replayable(path, root, roots[0])):
                row = run_one(engine, setup, *cell, st, new_nonce())
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
