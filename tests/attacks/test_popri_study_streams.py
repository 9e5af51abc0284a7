"""Attacks on the POPri study's DP-FedAvg points (experiments/popri/run.py, issue 27, 5 and 6).

The real ``stage_dp_fedavg`` is run up to the moment it hands its run to the engine (the
federation and the language model are stand-ins: what is attacked is which secrets and
cohorts the stage uses, not the training).

* **Shared streams** (finding 5): the study's points (DP-FedAvg at epsilon 1 and 4 of one
  seed) are two releases y_i = S + sigma_i N_i of the same clipped sum S. If both points draw
  their server noise from one root, N_1 = N_2 and (sigma_2 y_1 - sigma_1 y_2) / (sigma_2 -
  sigma_1) gives S exactly. On the commit before the fix every point took the seed's root:
  ``assert 1.5543122344752192e-15 > 1.0`` (the recovered sum's error).
* **Public cohorts** (finding 6): the stage's epsilon credits amplification by sampling (20 of
  100 clients, FixedSizeSampling), so its cohorts must be a secret draw; a client who knows
  the config's seed recomputes a cohort drawn from it. On the commit before the fix every
  round's cohort was recomputed: ``assert 5 < 5``.
"""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest

import experiments.popri.run as popri_run
import strategies.plumbing.server_secret as server_secret
from experiments.roots import study_root
from fedsim.engine import UniformCohort
from fedsim.engine.participation import TRAIN

CLIENTS, ROUNDS = 100, 5


class _Handed(Exception):
    """The stage handed its run to the engine: what was handed is recorded."""


class _Engine:
    def __init__(self) -> None:
        self.opened: list[dict] = []

    def open_run(self, app, num_clients, **options):
        self.opened.append(options)
        raise _Handed


class _Federation:
    num_clients = CLIENTS

    def client_texts(self, client: int) -> tuple[str, ...]:
        return (f"text of client {client}",)


def _stage_context(tmp_path) -> tuple[popri_run.Context, _Engine]:
    root = study_root(tmp_path / "keys" / "popri.key", tmp_path / "out")
    ctx = popri_run.Context(popri_run.Config(name="attack", epsilons=(1.0, 4.0)), tmp_path, root)
    engine = _Engine()
    ctx._cache.update(
        engine=engine, federation=_Federation(), vocab=SimpleNamespace(size=16)
    )
    ctx.sequences = lambda texts: [np.arange(4, dtype=np.int64) for _ in texts]
    return ctx, engine


@pytest.fixture(scope="module")
def points(tmp_path_factory):
    """The study's DP-FedAvg points (epsilon 1, then 4) run up to the engine: the strategies
    they bound their server secrets to, and what they handed the engine."""
    ctx, engine = _stage_context(tmp_path_factory.mktemp("popri"))
    bound: list = []
    real = server_secret.bind_parties

    def recording(strategy, server, *args, **kwargs):
        bound.append(strategy)
        return real(strategy, server, *args, **kwargs)

    stages = [
        (name, run)
        for name, run in popri_run.stage_list(ctx.config, ("dp-fedavg",))
        if name.startswith("dp-fedavg")
    ]
    assert [name for name, _ in stages] == ["dp-fedavg-eps1", "dp-fedavg-eps4"]
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(server_secret, "bind_parties", recording)
        for stage in stages:
            patch.setattr(popri_run, "stage_list", lambda config, only, s=stage: [s])
            with pytest.raises(_Handed):
                popri_run.run_stages(ctx, ("dp-fedavg",))
    return ctx, bound, engine.opened


def test_two_points_noise_does_not_cancel(points):
    _, strategies, _ = points
    assert len(strategies) == 2
    rng = np.random.default_rng(0)
    clipped_sum = rng.normal(size=64)
    sigmas = [s.update_noise_multiplier * s.clipping_norm for s in strategies]
    assert sigmas[0] > sigmas[1] > 0
    releases = [
        clipped_sum + s.noise_generator(1, "update").normal(0.0, sigma, size=64)
        for s, sigma in zip(strategies, sigmas, strict=True)
    ]
    recovered = (sigmas[1] * releases[0] - sigmas[0] * releases[1]) / (sigmas[1] - sigmas[0])
    error = float(np.max(np.abs(recovered - clipped_sum)))
    assert error > 1.0


def test_cohorts_are_not_recomputable_from_the_seed(points):
    ctx, _, opened = points
    assert len(opened) == 2
    public = UniformCohort(CLIENTS, ctx.config.dp_fedavg.clients_per_round, ctx.config.seed)
    for options in opened:
        drawn = options["participation"]
        recomputed = sum(
            np.array_equal(drawn.cohort(r, TRAIN), public.cohort(r, TRAIN))
            for r in range(1, ROUNDS + 1)
        )
        assert recomputed < ROUNDS
