"""The DMM study's methods: every private method calibrated to a target epsilon under the
study's participation, each applying its release with a server learning rate.

The server learning rate ``lr`` is applied after the release (FedAvgM without momentum,
x <- x + lr * (released mean update), or MatrixMechanism's own ``server_learning_rate``): it is
post-processing, so no noise multiplier and no epsilon depends on it. ``lr = 1`` is plain FedAvg,
the same arrays bit for bit as before the option existed.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import dp_accounting as dpa
from flwr.serverapp.strategy import FedAvg, FedAvgM

from fedsim.privacy import ddgauss as ddgauss_privacy
from fedsim.privacy import dmm as dmm_privacy
from fedsim.privacy.calibration import calibrate_noise
from fedsim.privacy.ledger import PrivacyLedger
from fedsim.privacy.matrix.banded import banded
from fedsim.privacy.matrix.tree import honaker_tree
from fedsim.privacy.participation import Participation
from fedsim.privacy.sampling import FullParticipation
from strategies.methods.ddgauss.strategy import DDGauss
from strategies.methods.dmm import DMM
from strategies.methods.dp_fedavg.strategy import DPFedAvg
from strategies.methods.matrix_mechanism import MatrixMechanism

SEP, DELTA, CLIP = 5, 1e-5, 1.0
COMMITTEE = {"committee_size": 20, "threshold": 3, "packing": 3, "member_dropouts": 3}
ACTOR_SHARDS = 4


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


def server_optimizer(lr: float = 1.0) -> FedAvg:
    """The wrapped strategy: FedAvg at ``lr = 1``, FedAvgM (no momentum) at learning rate ``lr``."""
    if not (math.isfinite(lr) and lr > 0):
        raise ValueError(f"server learning rate lr = {lr!r}: need a finite number > 0")
    options = dict(fraction_train=1.0, fraction_evaluate=0.0, min_available_nodes=0)
    if lr == 1.0:
        return FedAvg(**options)
    return FedAvgM(**options, server_learning_rate=lr, server_momentum=0.0)


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


def dmm_strategy(method, epsilon, seed, dim, st: Setting, mode: str, lr: float = 1.0):
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
    inner = server_optimizer(lr)
    probe = DMM(server_optimizer(), noise_multiplier=1.0, **options)
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


def make_strategy(method, epsilon, seed, dim, st: Setting, mode, lr: float = 1.0):
    """``method``'s strategy calibrated to ``epsilon`` and its noise multiplier; ``mode`` is
    DDGauss's ("plaintext" or "full") or DMM's ("full" or "ideal"), unused otherwise; ``lr`` the
    server learning rate (post-processing: z does not depend on it)."""
    rounds, per_round, k = st.rounds, st.per_round, st.k
    inner = server_optimizer(lr)
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
            server_optimizer(),  # it applies ``lr`` itself
            factorization=fac,
            clipping_norm=CLIP,
            noise_multiplier=z,
            expected_clients=per_round,
            participation=Participation.separated(SEP, k),
            delta=DELTA,
            server_learning_rate=lr,
        ), z
    if method == "ddgauss":
        probe = DDGauss(
            server_optimizer(),
            clipping_norm=CLIP,
            noise_multiplier=1.0,
            expected_clients=per_round,
            seed=seed,
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
    return dmm_strategy(method, epsilon, seed, dim, st, mode, lr)


def as_gaussian(event: dpa.DpEvent) -> dpa.DpEvent:
    """A round's ``ZCDpEvent(rho)`` as the Gaussian of the same RDP curve (z = 1/sqrt(2 rho)),
    the event the calibration composes; other events unchanged."""
    if isinstance(event, dpa.ZCDpEvent) and event.rho > 0:
        return dpa.GaussianDpEvent(1 / math.sqrt(2 * event.rho))
    return event


def reported_epsilon(method: str, strategy, st: Setting) -> float | None:
    if method == "non-private":
        return None
    if method == "ddgauss":  # its ledger composes every round; a client is in k of them
        ledger = PrivacyLedger("add_remove", DELTA, Participation.separated(SEP, st.k))
        for r, event in strategy.ledger.entries:
            ledger.record(r, as_gaussian(event))
        return ledger.epsilon()
    return float(strategy.privacy_report()["epsilon"])
