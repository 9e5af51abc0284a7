"""Opened is released: the server and one colluding member against a DMM round that aborts at
RELEASE after the members' release shares reached the server.

Full mode, committee n = 11, t = 2, k = 1 (t + k = 3). In round 2 seven members drop at RELEASE
and one colluder (seat 7) sends a wrong share: 4 shares arrive, one redundant, radius 0, and the
round aborts with TamperingDetected ("no release decoded, nobody named, the state is kept"). The
server opens the 4 envelopes with its own channel key, leaves out the share its colluder spoiled
and interpolates the 3 honest ones: it holds round 2's noisy release exactly (with zero updates
it is the noise itself, a few noise deviations wide; a wrong decoding is a field element ~2^60).
Before the fix that round recorded nothing and the kept state was released again in round 3
with fresh noise: epsilon reported for two releases while the server held three. Now the round
is accounted as the release of its step (the same epsilon as a clean run that released it),
says so in its metrics and the report's ``aborted_releases``, and the mechanism halts: the
opened state is never released again.

The server opens nothing before its quorum: with 2 = t shares arriving nothing is determined,
nothing opened and nothing accounted.
"""

from __future__ import annotations

import numpy as np
import pytest
from dmm_support import digits_setup, make_dmm, run_dmm

from attacks.test_dmm import _unchanged_model_app
from fedsim.engine.dmm_committee import CommitteeHost
from protocols.channels import SERVER_ID, Endpoint
from protocols.dmm.common import DMMFaults, DMMStage
from protocols.dmm.server import DMMServer
from protocols.kit import SEAT_ID_BASE
from protocols.shamir import PackedShamir

CLIENTS, ROUNDS, COLLUDER = 12, 3, 7


class Spy:
    """What the server of the run holds: per round, the release shares that reached it and the
    channel key that opens them (:meth:`held`), whether its own code opened them or not."""

    def __init__(self, monkeypatch) -> None:
        self.opened: dict[int, dict[int, np.ndarray]] = {}
        self.arrived: dict[int, tuple[Endpoint, list]] = {}
        open_array, open_release = Endpoint.open_array, DMMServer._open_release
        spy = self

        def record(endpoint, envelope, *, round_, stage, sender=None, decode=None):
            row = open_array(
                endpoint, envelope, round_=round_, stage=stage, sender=sender, decode=decode
            )
            if stage is DMMStage.RELEASE and endpoint.party_id == SERVER_ID:
                seat = int(envelope.sender) - SEAT_ID_BASE
                spy.opened.setdefault(int(round_), {})[seat] = np.array(row)
            return row

        def arrive(server, answered, live, keys, *args):
            spy.arrived[int(keys.round)] = (server._server, list(answered))
            return open_release(server, answered, live, keys, *args)

        monkeypatch.setattr(Endpoint, "open_array", record)
        monkeypatch.setattr(DMMServer, "_open_release", arrive)

    def held(self, round_: int) -> dict[int, np.ndarray]:
        """seat -> the release share of ``round_`` the server opens with its own key (all that
        reached it, the late ones too; those its code opened already, as it opened them)."""
        endpoint, answered = self.arrived[round_]
        out = dict(self.opened.get(round_, {}))
        for answer in answered:
            for seat, item in zip(answer.get("seats", []), answer.get("rows", [])):
                if int(seat) not in out:
                    out[int(seat)] = endpoint.open_array(
                        item, round_=round_, stage=DMMStage.RELEASE,
                        sender=SEAT_ID_BASE + int(seat),
                    )  # fmt: skip
        return out


def _faulted(host: CommitteeHost, plans: dict[int, DMMFaults]) -> CommitteeHost:
    host.member_faults = lambda r, committee, following=(): plans.get(r, DMMFaults())
    return host


def _run(local_engine, plans, **options):
    from dmm_support import SECRETS  # noqa: PLC0415

    data, dataset, model, _ = digits_setup(CLIENTS)
    setup = (data, dataset, model, _unchanged_model_app())
    host = _faulted(CommitteeHost(SECRETS), plans)
    strategy = make_dmm("full", CLIENTS, ROUNDS, **options)
    return run_dmm(local_engine, setup, strategy, ROUNDS, host=host)


TAMPER = DMMFaults(
    member={
        **{(j, DMMStage.RELEASE): "drop" for j in range(7)},
        (COLLUDER, DMMStage.RELEASE): "tamper",
    },
    seed=3,
)


def test_an_abort_after_the_shares_reached_the_server_is_accounted_and_never_rerun(
    local_engine, monkeypatch
):
    spy = Spy(monkeypatch)
    _, recorded = _run(local_engine, {2: TAMPER})
    aborted = recorded.metrics[1]
    assert aborted.get("dmm-aborted") == 1
    # the colluding server decodes the release from the three honest shares it opened
    shares = spy.held(2)
    rounds_run = sorted(spy.arrived)
    assert sorted(shares) == [7, 8, 9, 10]
    _, clean = _run(local_engine, {})
    scheme = PackedShamir(11, 2, 1)
    honest = [8, 9, 10]
    dim = recorded.inner.secure.server.dim
    release = scheme.field.decode_signed(
        scheme.reconstruct(np.stack([shares[j] for j in honest]), honest, dim)
    )
    # the same secrets and zero updates: the clean run's release of step 1 is the same integers
    np.testing.assert_array_equal(release, clean.outputs[1].release[0])
    spoiled = scheme.field.decode_signed(
        scheme.reconstruct(np.stack([shares[j] for j in (7, 8, 9)]), [7, 8, 9], dim)
    )
    assert np.max(np.abs(spoiled)) > 1e6  # what an honest decoder could not tell apart
    # ... so round 2 costs what releasing step 1 costs: the clean run's epsilon after round 2
    assert aborted.get("dmm-opened") == 1, f"round 2 recorded {aborted}: no release accounted"
    assert recorded.eps[1] == pytest.approx(clean.eps[1], rel=1e-9)
    assert recorded.eps[1] > recorded.eps[0]
    assert aborted["dmm-epsilon-cost"] == pytest.approx(recorded.eps[1] - recorded.eps[0])
    report = recorded.inner.privacy_report()
    assert report["aborted_releases"] == [
        {"round": 2, "clients": CLIENTS, "epsilon_cost": aborted["dmm-epsilon-cost"]}
    ]
    # the opened state is never released again with fresh noise: the mechanism halts
    assert rounds_run == [1, 2]
    assert recorded.metrics[2].get("dmm-halted") == 1
    assert recorded.eps[2] == recorded.eps[1]


def test_with_at_most_t_shares_on_time_nothing_is_opened_nor_accounted(
    local_engine, monkeypatch
):
    spy = Spy(monkeypatch)
    few = DMMFaults(member={(j, DMMStage.RELEASE): "drop" for j in range(9)})  # 2 = t arrive
    _, recorded = _run(local_engine, {2: few})
    assert recorded.metrics[1].get("dmm-aborted") == 1
    assert "dmm-opened" not in recorded.metrics[1]
    assert recorded.eps[1] == recorded.eps[0]  # two shares determine nothing
    assert 1 not in getattr(recorded.inner.secure.server, "opened", {})  # round 2's step 1: none
    assert 2 not in spy.opened  # below the quorum the server's code opens no share
    # the 9 silent members no longer hold the state: round 3 finds it lost, opens nothing
    assert "dmm-opened" not in recorded.metrics[2] and recorded.eps[2] == recorded.eps[1]
    assert recorded.inner.privacy_report().get("aborted_releases", []) == []


def test_t_plus_one_shares_give_a_linear_combination_and_are_accounted(local_engine, monkeypatch):
    """Packing k = 2 (t + k = 4): 8 members drop at RELEASE and 3 = t + 1 shares arrive. Too few
    to decode, yet each block's shares lie on a polynomial of degree < 4 known at 3 points, so
    the server learns g(e_1) y_0 - g(e_0) y_1 per block (g vanishing at the 3 share points, e_i
    the secret points): a linear combination of the noisy release. The round is accounted as
    the release of its step."""
    spy = Spy(monkeypatch)
    options = {"packing": 2, "member_dropouts": 1}
    few = DMMFaults(member={(j, DMMStage.RELEASE): "drop" for j in range(8)})
    _, recorded = _run(local_engine, {2: few}, **options)
    shares = spy.held(2)
    assert sorted(shares) == [8, 9, 10]
    _, clean = _run(local_engine, {}, **options)
    scheme = PackedShamir(11, 2, 2)
    f = scheme.field
    seats = sorted(shares)
    points = scheme.share_points[seats]
    e = scheme.secret_points
    f0 = f.matmul(f.lagrange_coefficients(points, e), np.stack([shares[j] for j in seats]))
    g = [int(np.prod([(int(x) - int(p)) % f.modulus for p in points], dtype=object) % f.modulus)
         for x in e]  # fmt: skip
    held = f.sub(f.mul(f0[0], g[1]), f.mul(f0[1], g[0]))
    truth = f.encode_signed(clean.outputs[1].release[0])
    truth = np.concatenate([truth, np.zeros(-truth.size % 2, dtype=np.int64)]).reshape(-1, 2).T
    np.testing.assert_array_equal(held, f.sub(f.mul(truth[0], g[1]), f.mul(truth[1], g[0])))
    aborted = recorded.metrics[1]
    assert aborted.get("dmm-aborted") == 1
    assert aborted.get("dmm-opened") == 1, f"round 2 recorded {aborted}: no release accounted"
    assert recorded.eps[1] == pytest.approx(clean.eps[1], rel=1e-9)
