"""examples/accounting_study: the CSV/JSON/PNG it writes, its curves monotone in rounds and
equal to what the accountants give when asked directly, point by point."""

import csv
import json
import math

import dp_accounting as dpa
import pytest
from examples_support import load_example

from fedsim.privacy import ddgauss as ddgauss_privacy
from fedsim.privacy.epsilon import epsilon
from fedsim.privacy.matrix import Factorization
from fedsim.privacy.participation import Participation
from fedsim.privacy.sampling import FullParticipation, PoissonSampling


@pytest.fixture(scope="module")
def study(tmp_path_factory):
    out = tmp_path_factory.mktemp("accounting")
    argv = ["--rounds", "12", "--points", "4", "--population", "200", "--cohort", "40"]
    argv += ["--dim", "100", "--dropout", "0.25", "--out", str(out)]
    return out, load_example("accounting_study/study.py").main(argv)


def test_it_writes_the_plot_and_the_numbers(study):
    out, report = study
    png = (out / "epsilon.png").read_bytes()
    assert png.startswith(b"\x89PNG\r\n\x1a\n") and len(png) > 10_000
    assert json.loads((out / "epsilon.json").read_text()) == report
    rows = list(csv.DictReader((out / "epsilon.csv").open()))
    assert [int(r["rounds"]) for r in rows] == report["rounds"] == [3, 6, 9, 12]
    for name, eps in report["epsilon"].items():
        assert [float(r[name]) for r in rows] == eps
        assert all(0 < a <= b for a, b in zip(eps, eps[1:])), name  # monotone in rounds
        assert all(math.isfinite(e) for e in eps)


def test_dp_fedavg_is_the_poisson_accountant(study):
    _, report = study
    q = 40 / 200
    for rounds, eps in zip(report["rounds"], report["epsilon"]["dp-fedavg-poisson"]):
        direct = epsilon(1.0, PoissonSampling(q), rounds, 1e-5)
        assert eps == pytest.approx(direct, rel=1e-9)


def test_the_matrix_mechanism_is_the_gaussian_on_the_released_rows(study):
    out, report = study
    details = report["details"]["matrix-bandmf"]
    assert (details["min_sep"], details["participations"]) == (5, 3)  # 200/40 groups, 12 rounds
    f = Factorization.load(out / details["factorization"])
    participation = Participation.separated(5, 3)
    sensitivity = f.sensitivity(participation).value
    for rounds, eps in zip(report["rounds"], report["epsilon"]["matrix-bandmf"]):
        released = f.sensitivity_through(rounds, participation).value
        direct = epsilon(sensitivity / released, FullParticipation(), 1, 1e-5)
        assert eps == pytest.approx(direct, rel=1e-9)


def test_ddgauss_is_kls21_for_the_surviving_clients_composed_by_dp_accounting(study):
    _, report = study
    d = report["details"]["ddgauss"]
    assert d["noise_clients"] == 30  # 25 % of 40 dropped out: their noise is not counted
    zcdp = ddgauss_privacy.zcdp_epsilon(
        d["l2_bound"], d["l1_bound"], d["scaled_noise_std"], 30, d["padded_dim"]
    )
    for rounds, eps in zip(report["rounds"], report["epsilon"]["ddgauss"]):
        accountant = dpa.rdp.RdpAccountant()
        accountant.compose(dpa.GaussianDpEvent(1 / zcdp), rounds)
        assert eps == pytest.approx(accountant.get_epsilon(1e-5), rel=1e-6)
    # fewer noise clients cost epsilon
    full = ddgauss_privacy.zcdp_epsilon(
        d["l2_bound"], d["l1_bound"], d["scaled_noise_std"], 40, d["padded_dim"]
    )
    assert full < zcdp
