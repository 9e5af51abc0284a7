"""Shared pieces of the DMM tests: the plaintext reference, simulated clients, a secret-giving
client app and a small digits federation."""

from __future__ import annotations

import functools

import numpy as np
from flwr.clientapp import ClientApp

from fedsim.randomness import NODE_SECRET_KEY, RunSecret
from protocols.dmm.client import seal_client_shares
from protocols.dmm.common import DMMAbort, DMMFaults, Schedule
from protocols.dmm.member import MemberPool
from protocols.dmm.server import DMMServer
from protocols.shamir import PackedShamir

SECRETS = RunSecret.from_passphrase("dmm tests")


def with_secrets(app: ClientApp, secrets: RunSecret = SECRETS) -> ClientApp:
    """``app`` with each client's own secret in its node_config, as the engine gives it when a
    run has a RunSecret (``setdefault``: an engine that already did keeps its own)."""
    out = ClientApp()

    def give(context) -> None:
        partition = int(context.node_config["partition-id"])
        context.node_config.setdefault(NODE_SECRET_KEY, secrets.client(partition).token())

    @out.train()
    def train(message, context):
        give(context)
        return app(message, context)

    @out.evaluate()
    def evaluate(message, context):
        give(context)
        return app(message, context)

    return out


class Reference:
    """The plain integers of the corrected mechanism: y_i = sum_s M[i, s] X_s + z_i."""

    def __init__(self, M: np.ndarray) -> None:
        self.schedule = Schedule(M)
        self.X: list[np.ndarray] = []

    def release(self, updates, noises, clients) -> np.ndarray:
        t = len(self.X)
        self.X.append(sum(np.asarray(updates[c], dtype=object) for c in clients))
        Z = sum(np.asarray(noises[c], dtype=object) for c in clients)
        M = self.schedule.matrix
        rows = [
            sum(int(M[i, s]) * self.X[s] for s in range(t + 1)) + Z[a]
            for a, i in enumerate(self.schedule.released_at(t))
        ]
        return np.array(rows, dtype=np.int64)

    def partial_sums(self) -> dict[int, np.ndarray]:
        """What a committee should hold after the last round: data only."""
        t, M = len(self.X) - 1, self.schedule.matrix
        return {
            j: np.array(sum(int(M[j, s]) * self.X[s] for s in range(t + 1)), dtype=np.int64)
            for j in self.schedule.open_after(t)
        }


def seal_all(keys, updates, noises, round_: int = 0) -> dict:
    """Every simulated client's SHARE message (client c's share stream: (round, c))."""
    return {
        c: seal_client_shares(keys, c, updates[c], noises[c], np.random.default_rng([round_, c]))
        for c in sorted(updates)
    }


def inputs(schedule: Schedule, step: int, clients: int, dim: int, seed: int):
    """Random updates and noise rows of ``clients`` for ``step``."""
    rng = np.random.default_rng([seed, step])
    rows = len(schedule.released_at(step))
    updates = {c: rng.integers(-100, 100, dim) for c in range(clients)}
    noises = {c: rng.integers(-30, 30, (rows, dim)) for c in range(clients)}
    return updates, noises


class Committees:
    """Runs the same rounds on a full-mode server (in-process member pools, simulated
    clients) and an ideal-mode one."""

    def __init__(
        self, M, dim, n=10, t=2, k=3, groups=2, encrypt=True, min_clients=1, decoding=None
    ):
        scheme = PackedShamir(n, t, k)
        schedule = Schedule(M)
        self.full = DMMServer(
            scheme, schedule, dim, encrypt=encrypt, min_clients=min_clients, decoding=decoding
        )
        self.ideal = DMMServer(
            scheme, schedule, dim, mode="ideal", min_clients=min_clients, decoding=decoding
        )
        self.groups = [g.tolist() for g in np.array_split(np.arange(n), groups)]
        self.pools: list[MemberPool] = []
        self.full.attach(self.new_pool())

    def new_pool(self) -> MemberPool:
        pool = MemberPool(
            [1000 + len(self.pools) * 100 + s for s in range(self.full.scheme.n)],
            self.groups,
            self.full.member_kwargs,
        )
        self.pools.append(pool)
        return pool

    def full_round(self, round_, updates, noises, faults=None):
        keys = self.full.open_round(round_, faults or DMMFaults())
        return self.full.finish_round(seal_all(keys, updates, noises, round_), self.new_pool())

    def both(self, round_, updates, noises, faults=None):
        """(full outcome, ideal outcome): a RoundOutput or the exception raised."""
        out = []
        for run in (
            lambda: self.full_round(round_, updates, noises, faults),
            lambda: self.ideal.run_plain_round(round_, updates, noises, faults),
        ):
            try:
                out.append(run())
            except DMMAbort as error:
                out.append(error)
        return out


def assert_same(first, second) -> None:
    """Full and ideal agree: the same exception, or the same release, clients and holders."""
    if isinstance(first, Exception):
        assert type(second) is type(first) and str(second) == str(first)
        return
    np.testing.assert_array_equal(first.release, second.release)
    np.testing.assert_array_equal(first.estimate, second.estimate)
    assert (first.clients, first.excluded, first.holders, first.handed_over) == (
        second.clients,
        second.excluded,
        second.holders,
        second.handed_over,
    )


@functools.lru_cache(maxsize=4)
def digits_setup(clients: int):
    """(data spec, dataset, model spec, training ClientApp) of a digits federation."""
    from fedsim.data import DatasetSpec, build_dataset  # noqa: PLC0415
    from fedsim.models import ModelSpec  # noqa: PLC0415
    from fedsim.workloads.supervised import LocalTraining, make_client_app  # noqa: PLC0415

    data = DatasetSpec(source="digits", partition="iid", num_clients=clients, seed=0)
    dataset = build_dataset(data)
    model = ModelSpec(
        kind="logreg", input_shape=tuple(dataset.feature_shape), num_classes=dataset.num_classes
    )
    inner = make_client_app(model, data, LocalTraining(epochs=1, batch_size=16, lr=0.1, seed=0))
    return data, dataset, model, inner


def make_dmm(mode: str, clients: int, rounds: int, kind: str = "banded", **kwargs):
    """A DMM over FedAvg for ``clients`` clients (all of them each round, as its
    participation says)."""
    from flwr.serverapp.strategy import FedAvg  # noqa: PLC0415

    from fedsim.privacy.matrix.banded import banded  # noqa: PLC0415
    from fedsim.privacy.matrix.tree import honaker_tree  # noqa: PLC0415
    from fedsim.privacy.participation import Participation  # noqa: PLC0415
    from strategies.methods.dmm import DMM  # noqa: PLC0415

    options = dict(
        factorization=banded(rounds, 2) if kind == "banded" else honaker_tree(rounds),
        participation=Participation.separated(1),  # every client may train every round
        population=clients,
        committee_size=11,
        threshold=2,
        packing=1,
        member_dropouts=2,
        clipping_norm=1.0,
        noise_multiplier=1.0,
        expected_clients=clients,
        seed=7,
        mode=mode,
    )
    options.update(kwargs)
    return DMM(FedAvg(min_available_nodes=0, fraction_evaluate=0.0), **options)


class Recorded:
    """A strategy wrapper that records every round's replies, output and metrics; ``alter``
    may change the replies the DMM receives."""

    def __init__(self, strategy, alter=None) -> None:
        self.inner, self.alter = strategy, alter
        self.replies, self.outputs, self.metrics, self.eps = [], [], [], []

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def aggregate_train(self, server_round, replies):
        replies = list(replies)
        self.replies.append(replies)
        if self.alter is not None:
            replies = self.alter(server_round, replies)
        arrays, metrics = self.inner.aggregate_train(server_round, replies)
        self.outputs.append(self.inner.last_output)
        self.metrics.append(dict(metrics or {}))
        self.eps.append(self.inner.epsilon())
        return arrays, metrics


def run_dmm(
    engine,
    setup,
    strategy,
    rounds,
    *,
    faults=None,
    alter=None,
    host=None,
    arrays=None,
    first=1,
    timeout=3600,
):
    """Run rounds ``first..rounds`` of ``strategy`` from ``arrays`` (default: the initial
    model), with a fresh in-process committee host bound unless ``host`` is given, each
    exchange under ``timeout`` (Flower's default; ``None``: batches of several clients);
    returns (final arrays, the :class:`Recorded` strategy)."""
    from fedsim.engine.dmm_committee import CommitteeHost  # noqa: PLC0415
    from fedsim.engine.rounds import run_rounds  # noqa: PLC0415
    from fedsim.models import initial_arrays  # noqa: PLC0415
    from fedsim.record_codec import to_numpy, to_record  # noqa: PLC0415
    from strategies.methods.dmm import dmm_client_app  # noqa: PLC0415

    data, dataset, model, inner = setup
    if host is None:
        host = CommitteeHost(SECRETS, faults)
    strategy.bind_committee_host(host)
    grid = engine.open_run(
        with_secrets(dmm_client_app(inner)),
        data.num_clients,
        run_config={"seed": 0},
        faults=faults,
        datasets=((data, dataset),),
    )
    recorded = Recorded(strategy, alter)
    arrays = to_record(initial_arrays(model, 0) if arrays is None else arrays)
    final = run_rounds(recorded, grid, arrays, rounds, first_round=first, timeout=timeout)
    return to_numpy(final), recorded
