"""experiments/popri/run.py: every point of the study (method, epsilon) runs under its own root.

The seed's root (experiments/roots.py) mixed with a fresh public nonce per point
(RunSecret.for_run), recorded as the stage's ``run_nonce``; a point stored without one ran
under the root every point shared and is stale. DP-FedAvg's cohorts are the point's server's
secret draw. The stages' heavy work (generation, training) is replaced by a probe here.
"""

from __future__ import annotations

import json

import numpy as np
import pytest

from experiments.popri.run import (
    Config,
    Context,
    finished_stage,
    is_point,
    run_stage,
    run_stages,
    stage_list,
)
from experiments.roots import seed_root, study_root
from fedsim.engine import UniformCohort
from fedsim.engine.participation import TRAIN
from fedsim.randomness import Purpose


@pytest.fixture
def ctx(tmp_path):
    root = study_root(tmp_path / "keys" / "popri.key", tmp_path / "out")
    return Context(Config(name="roots-test"), tmp_path / "out", root)


def probe(seen: list):
    """A stage that records the root it runs under and the server's first noise draw."""

    def run(c: Context) -> dict:
        secrets = c.secrets
        noise = secrets.server().generator(1, Purpose.NOISE).normal(size=8)
        seen.append((secrets.fingerprint(), noise))
        return {"accuracy": 0.0}

    return run


def test_points_are_the_private_methods_at_one_epsilon():
    names = [name for name, _ in stage_list(Config(name="x"), ())]
    points = [n for n in names if is_point(n)]
    assert points and all(n.split("-eps")[0] in ("popri", "pe", "dp-fedavg") for n in points)
    assert {"public", "nonprivate", "base", "spread"} == set(names) - set(points)


def test_two_points_draw_independent_streams(ctx):
    seen: list = []
    results = [run_stage(ctx, name, probe(seen)) for name in ("popri-eps1", "pe-eps1")]
    again = run_stage(ctx, "popri-eps1", probe(seen))  # the same point run a second time
    (fp_a, noise_a), (fp_b, noise_b), (fp_c, noise_c) = seen
    assert len({fp_a, fp_b, fp_c}) == 3
    assert not np.array_equal(noise_a, noise_b) and not np.array_equal(noise_a, noise_c)
    nonces = [r["run_nonce"] for r in (*results, again)]
    assert len(set(nonces)) == 3
    shared = seed_root(ctx.root, "popri", ctx.config.seed)
    assert shared.fingerprint() not in {fp_a, fp_b, fp_c}
    # the stored nonce names the point's root: a replay of it would repeat the stream
    assert shared.for_run(nonces[0]).fingerprint() == results[0]["point_fingerprint"] == fp_a
    assert results[0]["secrets_fingerprint"] == ctx.root.fingerprint()
    assert ctx.nonce is None  # no stream outside a point
    with pytest.raises(RuntimeError, match="needs its point's nonce"):
        ctx.secrets  # noqa: B018


def test_a_stage_that_is_not_a_point_gets_no_nonce(ctx):
    result = run_stage(ctx, "nonprivate", lambda c: {"accuracy": 0.5})
    assert "run_nonce" not in result and result["accuracy"] == 0.5


def test_a_point_without_its_nonce_is_stale_and_runs_again(ctx):
    stages = ctx.out / "stages"
    stages.mkdir(parents=True)
    old = {"accuracy": 0.1, "secrets_fingerprint": ctx.root.fingerprint()}
    for name in ("public", "popri-eps1"):
        (stages / f"{name}.json").write_text(json.dumps(old))
    assert finished_stage(stages / "public.json", "public")
    assert not finished_stage(stages / "popri-eps1.json", "popri-eps1")
    seen: list = []
    ran = []

    def fake_list(config, only):
        def named(name):
            def run(c):
                ran.append(name)
                return probe(seen)(c) if is_point(name) else {"accuracy": 0.2}

            return run

        return [(n, named(n)) for n in ("public", "popri-eps1")]

    import experiments.popri.run as popri_run

    real, popri_run.stage_list = popri_run.stage_list, fake_list
    try:
        run_stages(ctx, ())
        run_stages(ctx, ())  # finished now: nothing runs again
    finally:
        popri_run.stage_list = real
    assert ran == ["popri-eps1"]
    stored = json.loads((stages / "popri-eps1.json").read_text())
    assert stored["point_fingerprint"] == seen[0][0]
    assert finished_stage(stages / "popri-eps1.json", "popri-eps1")


class _Engine:
    """Records what a stage hands the engine."""

    def __init__(self) -> None:
        self.opened: list[dict] = []

    def open_run(self, app, num_clients, **options):
        self.opened.append(options)
        return object()


class _Strategy:
    def __init__(self) -> None:
        self.server = None

    def bind_server_secret(self, server) -> None:
        self.server = server


def test_dp_fedavg_cohorts_are_the_points_secret_draw(ctx):
    engine = _Engine()
    ctx._cache["engine"] = engine
    public = UniformCohort(100, 20, ctx.config.seed)
    strategies = []

    def stage(c):
        strategies.append(_Strategy())
        c.open_run(None, 100, strategies[-1], participation=public, secret_cohorts=True)
        return {}

    for _ in range(2):
        run_stage(ctx, "dp-fedavg-eps1", stage)
    drawn = [o["participation"] for o in engine.opened]
    assert all(p.secret is not None for p in drawn)
    # bound to the same server secret as the strategy's noise
    assert all(p.secret is s.server for p, s in zip(drawn, strategies, strict=True))
    rounds = range(1, 6)
    cohorts = [[p.cohort(r, TRAIN).tolist() for r in rounds] for p in drawn]
    assert cohorts[0] != [public.cohort(r, TRAIN).tolist() for r in rounds]
    assert cohorts[0] != cohorts[1]  # two points: two independent draws
    assert all(o["secrets"].fingerprint() != ctx.root.fingerprint() for o in engine.opened)
