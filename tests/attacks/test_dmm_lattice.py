"""The lattice attack on DMM (../shared/attacks/dmm_lattice_attack.py, lattice.py, lattice2.py,
lattice3.py) against the corrected mechanism.

The first design released r = 2^f U + M~ z with integer noise z on the lattice M~ Z^m; then
frac(M~^{-1} r) = frac(C' U) was a noise-free function of the data, neighbouring datasets had
disjoint output supports and epsilon was infinite. The attacker here plays the server: it sees
every release and knows the public matrix. Each test fails if the corrected protocol leaks the
same way: the noise must sit on the full integer lattice of the released coordinates, so every
neighbour shift lies on it.
"""

from __future__ import annotations

from fractions import Fraction

import numpy as np
import pytest
from dmm_support import Committees
from sympy import Matrix
from sympy.matrices.normalforms import smith_normal_form

from fedsim.privacy.dmm import IntegerMechanism
from fedsim.privacy.matrix.banded import banded
from fedsim.privacy.matrix.build import Spec, build
from fedsim.privacy.matrix.toeplitz import banded_toeplitz
from fedsim.privacy.matrix.tree import binary_tree, honaker_tree
from fedsim.privacy.mechanisms import discrete_gaussian
from fedsim.privacy.participation import Participation
from protocols.dmm.common import Schedule
from protocols.dmm.server import DMMServer
from protocols.shamir import PackedShamir

T, F = 6, 12
KINDS = {
    "banded": lambda: IntegerMechanism(banded(T, 2), F),
    "toeplitz": lambda: IntegerMechanism(banded_toeplitz(T, 3), F),
    "tree": lambda: IntegerMechanism(binary_tree(T), 0),
    "honaker": lambda: IntegerMechanism(honaker_tree(T), 0),
}


def _run(mechanism, updates, noise, full=False):
    """Every release of a T-round run (rows x D, int64). ``updates[t][c]``: client c's update
    in round t; ``noise[t][c]``: its noise rows. ``full``: through the real protocol (shares,
    envelopes, resharing); otherwise the plaintext reference server."""
    if full:
        run = Committees(mechanism.integer_matrix, len(updates[0][0]), n=7, t=2, k=2,
                         decoding=mechanism.decoding)
        step = lambda t: run.full_round(t, updates[t], noise[t])  # noqa: E731
    else:
        server = DMMServer(PackedShamir(7, 2, 2), Schedule(mechanism.integer_matrix),
                           len(updates[0][0]), mode="ideal", decoding=mechanism.decoding)
        step = lambda t: server.run_plain_round(t, updates[t], noise[t])  # noqa: E731
    return np.concatenate([step(t).release for t in range(T)])


def _data(seed, D=4, clients=3):
    rng = np.random.default_rng(seed)
    return [{c: rng.integers(-50, 50, D) for c in range(clients)} for _ in range(T)]


def _noise(mechanism, seed, D=4, clients=3, sigma=50):
    rng = np.random.default_rng(seed)
    return [
        {
            c: discrete_gaussian((len(mechanism.released_at(t)), D), sigma, rng)
            for c in range(clients)
        }
        for t in range(T)
    ]


def _neighbour(data):
    """One client's coordinate changes by one unit in round 2."""
    other = [{c: u.copy() for c, u in row.items()} for row in data]
    other[2][0] = other[2][0] + np.array([1, 0, 0, 0])
    return other


def _statistic(mechanism, release):
    """The attack's statistic: frac(L y) for an exact rational left inverse L of M."""
    M = Matrix(mechanism.integer_matrix.tolist())
    L = (M.T * M).inv() * M.T
    W = L * Matrix(release.tolist())
    return tuple(W[i, j] - W[i, j].floor() for i in range(W.rows) for j in range(W.cols))


@pytest.mark.parametrize("kind", KINDS)
def test_the_fractional_part_statistic_carries_no_data(kind):
    """dmm_lattice_attack.py: the statistic was identical across noise draws and changed for a
    neighbour. Now, with the same noise it is the same for neighbours (no data in it); where
    M^{-1} is not integer it changes with every noise draw."""
    mechanism = KINDS[kind]()
    data = _data(1)
    full = kind == "banded"  # one factorization through the whole cryptographic protocol
    a = _statistic(mechanism, _run(mechanism, data, _noise(mechanism, 1), full))
    neighbour = _statistic(mechanism, _run(mechanism, _neighbour(data), _noise(mechanism, 1)))
    assert a == neighbour
    again = _statistic(mechanism, _run(mechanism, data, _noise(mechanism, 999)))
    if kind in ("banded", "toeplitz"):
        assert a != again


def _probe(mechanism):
    """The protocol as a black box: K (data -> release) and L (noise -> release), from runs on
    unit inputs (one client, D = 1)."""
    rows = mechanism.integer_matrix.shape[0]
    zero_data = [{0: np.zeros(1, dtype=np.int64)} for _ in range(T)]

    def zero_noise():
        return [{0: np.zeros((len(mechanism.released_at(t)), 1), dtype=np.int64)} for t in range(T)]

    K = np.zeros((rows, T), dtype=np.int64)
    for s in range(T):
        data = [{0: np.array([int(t == s)])} for t in range(T)]
        K[:, s] = _run(mechanism, data, zero_noise())[:, 0]
    L = np.zeros((rows, rows), dtype=np.int64)
    for j in range(rows):
        noise = zero_noise()
        t = int(mechanism.rounds[j])
        noise[t][0][list(mechanism.released_at(t)).index(j), 0] = 1
        L[:, j] = _run(mechanism, zero_data, noise)[:, 0]
    return K, L


def _on_lattice(L: np.ndarray, shift) -> bool:
    """Whether ``shift`` lies in the lattice L Z^m (exactly, over the rationals)."""
    solution = Matrix(L.tolist()).solve(Matrix([Fraction(int(v)) for v in shift]))
    return all(x.is_integer for x in solution)


@pytest.mark.parametrize("kind", KINDS)
def test_every_neighbour_shift_lies_on_the_noise_lattice(kind):
    """lattice.py / lattice2.py / lattice3.py: for every participation pattern of one client
    (min separation 2 here), the release shift written in the noise's coordinates is an integer
    vector; the noise lattice is all of Z^m (Smith normal form all ones)."""
    mechanism = KINDS[kind]()
    K, L = _probe(mechanism)
    assert np.array_equal(K, mechanism.integer_matrix)  # the release is the integer query M X
    snf = smith_normal_form(Matrix(L.tolist()))
    assert [abs(snf[i, i]) for i in range(L.shape[0])] == [1] * L.shape[0]
    for pattern in Participation(kind="min_sep", min_sep=2).patterns(T):
        for sign in (1, -1):
            shift = sign * K[:, list(pattern)].sum(axis=1)
            assert _on_lattice(L, shift), (kind, pattern)


def test_the_lattice_check_catches_the_first_design():
    """The same check on the first design's noise lattice round(2^f C^{-1}) Z^m fails: it is
    the one the attack scripts broke (so the test above can fail)."""
    fac = banded(T, 2)
    old = np.rint(np.linalg.inv(fac.encoder) * 2**F).astype(np.int64)
    assert not all(_on_lattice(old, 2**F * np.eye(T, dtype=np.int64)[:, t]) for t in range(T))


def test_neighbouring_datasets_have_overlapping_release_supports():
    """Black box, two ways. (1) Every release sampled under a dataset is reachable under its
    neighbour: y - K X' lies in the noise lattice L Z^m probed from the protocol, and the sum
    of discrete Gaussians gives every point of it positive mass. (2) The attack's statistic
    frac((M^{-1} y)_0), whose values were disjoint for neighbours in the first design, takes
    overlapping values (coarse M, f = 3, so that its values repeat)."""
    mechanism = IntegerMechanism(banded(T, 2), 3)
    K, L = _probe(mechanism)
    data = _data(5, D=1)
    other = [{c: u.copy() for c, u in row.items()} for row in data]
    other[0][0] = other[0][0] + 1
    sums = [np.array([sum(row.values())[0] for row in d]) for d in (data, other)]
    observed: list[set] = [set(), set()]
    for which, dataset in enumerate((data, other)):
        for seed in range(60):
            y = _run(mechanism, dataset, _noise(mechanism, 100 * which + seed, D=1, sigma=3))[:, 0]
            assert _on_lattice(L, y - K @ sums[1 - which])  # reachable under the neighbour
            observed[which].add(Fraction(int(y[0]), int(mechanism.integer_matrix[0, 0])) % 1)
    assert observed[0] & observed[1]


@pytest.mark.parametrize("kind", ["sqrt", "dense", "blt"])
def test_factorizations_without_an_integer_banded_query_are_refused(kind):
    fac = build(Spec(kind=kind, rounds=T, participations=2, min_sep=3))
    with pytest.raises(ValueError, match="not banded"):
        IntegerMechanism(fac, F)
