"""Opened is released: the server against DDGauss rounds that abort after it holds their sum.

* **Committee mode** (``fedsim run`` with ``member_dropout``): a round where exactly t + k
  members' release rows reach the server aborts ("t + k + detect needed"), and one where
  t + k + 1 arrive but one member tampers aborts as TamperingDetected; in both the server opens
  the rows it holds with its own channel key and interpolates the round's noisy sum exactly
  (with the tampering member's help: it knows which row is wrong). That round must be accounted
  in rounds.jsonl like the one plaintext mode releases, and say it aborted after opening.
* The committee's server opens nothing before its quorum check, and asks no member to release
  when too few are left after COMBINE: then nothing reaches it and nothing is accounted.
* **Full mode** (SecAgg+): a neighbour that alters one share of a survivor's self-mask seed when
  exactly threshold + 1 shares arrive aborts the round in UNMASK, yet the server alone recovers
  the sum by trying every threshold-subset (a wrong one gives no 16-bit key or no small sum).
  The server says it holds the sum, and the strategy accounts it.
"""

from __future__ import annotations

import dataclasses
import itertools
import math

import numpy as np
import pytest
from ddgauss_support import RUN
from flwr.app import RecordDict

from attacks.test_ddgauss import CLIENTS, PHRASE, Hostile, inner, one_round, strategy
from fedsim.cli import main
from fedsim.engine.committee import Committee
from fedsim.engine.committee_host import HostedGroups
from fedsim.frontend.results import read_rounds
from fedsim.record_codec import to_numpy, to_record
from protocols.channels import associated_data, decode_array, new_session_id, stage_label
from protocols.committee.client import seal_input
from protocols.committee.common import (
    CommitteeAbort,
    CommitteeCall,
    CommitteeFaults,
    CommitteeStage,
)
from protocols.committee.member import CommitteeShard
from protocols.committee.server import CommitteeServer
from protocols.field import DEFAULT_FIELD
from protocols.kit import Fault, RoundAborted, TamperingDetected
from protocols.secagg.client import SecAggClient
from protocols.secagg.common import (
    CHUNKS_PER_SECRET,
    SecAggConfig,
    UnmaskResponse,
    elements_to_secret,
    prg,
    shamir_scheme,
    sum_vectors,
)
from protocols.secagg.server import SecAggServer
from strategies.methods.ddgauss.client import ddgauss_client_app
from strategies.methods.ddgauss.strategy import DDGauss

S = CommitteeStage
COMMITTEE = "committee_size = 8\nthreshold = 2\npacking = 2\nmember_dropout = 0.1\n"
TAMPERER = 3


class Server:
    """What the server of a ``fedsim run`` holds, recorded as it runs: the committee servers
    (their channel key opens what members seal for them), every RELEASE reply the members sent
    them (round -> replies), and, per (mode, round), the sum DDGauss decoded."""

    def __init__(self, monkeypatch) -> None:
        self.committees: list[CommitteeServer] = []
        self.released: dict[int, list] = {}
        self.sums: dict[tuple[str, int], np.ndarray | None] = {}
        built, aggregate = CommitteeServer.__init__, DDGauss.aggregate_train
        called = HostedGroups.call
        server = self

        def init(self, *args, **kwargs):
            built(self, *args, **kwargs)
            server.committees.append(self)

        def call(self, call, args_per_shard):
            answers = called(self, call, args_per_shard)
            if call is CommitteeCall.RELEASE:
                server.released[int(args_per_shard[0][0])] = answers
            return answers

        def aggregate_train(self, server_round, replies):
            out = aggregate(self, server_round, replies)
            last = self.last_sum
            server.sums[(self.mode, server_round)] = None if last is None else last.copy()
            return out

        monkeypatch.setattr(CommitteeServer, "__init__", init)
        monkeypatch.setattr(HostedGroups, "call", call)
        monkeypatch.setattr(DDGauss, "aggregate_train", aggregate_train)

    def decodes(self, round_: int, truth: np.ndarray) -> list[int]:
        """The members of a t + k subset of the rows the server holds for ``round_`` (opened
        with its own key) that interpolate to ``truth``; [] if none does."""
        committee = self.committees[-1]
        scheme, rows = committee.scheme, {}
        for reply in self.released.get(round_, []):
            for member, envelope in zip(reply["members"], reply["rows"]):
                rows[member] = _decrypt(committee._server, envelope)
        for subset in itertools.combinations(sorted(rows), scheme.threshold):
            shares = np.stack([rows[m] for m in subset])
            value = scheme.reconstruct(shares, list(subset), truth.size, check=False)
            if np.array_equal(value, truth):
                return list(subset)
        return []


def _decrypt(endpoint, envelope) -> np.ndarray:
    """What the server's own channel key opens (the AEAD itself: no replay bookkeeping)."""
    _, cipher = endpoint._receive[envelope.sender]
    aad = associated_data(
        endpoint.protocol,
        endpoint.session_id,
        envelope.sender,
        endpoint.party_id,
        envelope.round,
        stage_label(envelope.stage),
    )
    return decode_array(cipher.decrypt(envelope.nonce, envelope.ciphertext, aad))


def _run(tmp_path, mode, seed, extra="", replay=None):
    """``fedsim run`` of test_ddgauss_strategy's config (10 of 30 clients a round, no client
    dropouts) with ``seed``, in ``mode`` with ``extra`` options (``replay``: the mode whose run
    this one repeats the streams of, as the same secrets); its rounds.jsonl lines."""
    config = tmp_path / f"{mode}.toml"
    text = RUN.format(mode=mode, dropout=0.0).replace("seed = 4\n", f"seed = {seed}\n")
    config.write_text(text.replace("ring_bits = 32\n", "ring_bits = 32\n" + extra))
    out = tmp_path / mode
    command = ["run", str(config), "--out", str(out), "--no-progress"]
    if replay is not None:
        command += ["--replay", str(tmp_path / replay)]
    assert main([*command, "--secrets", str(tmp_path / "root.hex")]) == 0
    return [r for r in read_rounds(out / "rounds.jsonl") if r["round"] >= 1]


@pytest.mark.parametrize(
    "case,seed,tampered",
    [("exactly t + k rows", 0, (2, 3)), ("t + k + 1 rows, one tampered", 37, (3,))],
)
def test_fedsim_run_accounts_the_committee_rounds_the_server_decoded(
    tmp_path, monkeypatch, case, seed, tampered
):
    """The public member schedule (seed 0) leaves exactly t + k = 4 members answering RELEASE in
    rounds 2 and 3; with seed 37, 5 answer in round 3 and member 3 adds an offset to its row.
    Those rounds abort. In the first of them the server interpolates plaintext mode's noisy sum
    (same secrets, same model until then) from rows it holds; later ones start from another
    model than plaintext's. Each is accounted as plaintext mode accounts its release."""
    if case.startswith("t + k + 1"):
        release = CommitteeShard.release

        def tampering(self, round_, faults):
            members = self.members.tolist()
            if round_ == 3 and TAMPERER in members:
                row = members.index(TAMPERER)
                state = self.state(round_)
                total = state.total.copy()
                total[row] = self.field.add(total[row], 12345)
                self.store(round_, dataclasses.replace(state, total=total))
            return release(self, round_, faults)

        monkeypatch.setattr(CommitteeShard, "release", tampering)
    server = Server(monkeypatch)
    sealed = _run(tmp_path, "committee", seed, COMMITTEE)
    plain = _run(tmp_path, "plaintext", seed, replay="committee")
    for round_ in tampered:
        record, released = sealed[round_ - 1], plain[round_ - 1]
        assert record["aggregated"]["ddgauss-aborted"] == 1, f"{case}: round {round_} released"
        if round_ == tampered[0]:
            subset = server.decodes(round_, server.sums[("plaintext", round_)])
            assert subset, f"{case}: the server holds no t + k rows of round {round_}'s sum"
            decoded = f"decoded round {round_}'s noisy sum from members {subset}'s rows"
        else:
            held = sum(len(reply["members"]) for reply in server.released[round_])
            decoded = f"holds {held} rows of round {round_}'s sum (t = 2)"
        reported, held = record["privacy"]["epsilon"], released["privacy"]["epsilon"]
        assert reported == held, (
            f"{case}: the server {decoded}, yet rounds.jsonl reports epsilon {reported:.4f}; "
            f"the releases it holds cost {held:.4f}"
        )
        assert record["aggregated"]["ddgauss-opened"] == 1
        assert record["aggregated"]["ddgauss-survivors"] == 10
        cost = record["aggregated"]["ddgauss-epsilon-cost"]
        assert cost == pytest.approx(held - plain[round_ - 2]["privacy"]["epsilon"]) and cost > 0
        listed = {e["round"]: e for e in record["privacy"]["aborted_releases"]}[round_]
        assert (listed["clients"], listed["epsilon_cost"]) == (10, cost)
    summary = (tmp_path / "committee" / "summary.json").read_text()
    assert '"aborted_releases"' in summary


def _vectors(rng, clients=6, length=10):
    return {c: DEFAULT_FIELD.random(rng, length) for c in range(100, 100 + clients)}


def _round(committee, round_, vectors, rng, plan):
    """One committee round on ``vectors`` with ``plan`` = {"drop": [...], "tamper": [...]}
    (member, stage) faults."""
    keys = committee.keys_for(round_)
    sealed = {c: seal_input(keys, c, v, rng) for c, v in vectors.items()}
    faults = {key: Fault.DROP for key in plan.get("drop", ())}
    faults.update({key: Fault.TAMPER for key in plan.get("tamper", ())})
    return committee.run_round_sealed(round_, sealed, 10, CommitteeFaults(faults, seed=1))


def _opening(committee, monkeypatch) -> list[int]:
    """Count the rows the committee's server opens (its endpoint's opens), round by round."""
    opened: list[int] = []
    endpoint = committee._server
    original = type(endpoint).open

    def counting(self, envelope, **kwargs):
        if self is endpoint:
            opened.append(int(kwargs.get("round_", -1)))
        return original(self, envelope, **kwargs)

    monkeypatch.setattr(type(endpoint), "open", counting)
    return opened


def test_the_committee_opens_nothing_before_its_quorum_and_records_what_reached_it(monkeypatch):
    """n = 8, t = 2, k = 2, detect = 1: 5 answers needed. Round 1: two members drop at COMBINE
    (4 left): no member is asked to release, nothing reaches the server, nothing is opened.
    Round 2: one drops at SHARE, three at RELEASE (4 rows arrive): the server opens none of them,
    but they are an opened release of the round's clients (4 > t)."""
    rng = np.random.default_rng(11)
    committee = Committee(8, 2, 2, shards=2)
    opened = _opening(committee, monkeypatch)
    plan = {"drop": [(0, S.COMBINE), (1, S.COMBINE), (2, S.COMBINE), (3, S.COMBINE)]}
    with pytest.raises(CommitteeAbort, match="aborted in COMBINE") as first:
        _round(committee, 1, _vectors(rng), rng, plan)
    released = committee.relay.transcript.messages(stage="RELEASE")
    assert released == 0, f"{released} members released rows into a round that had to abort"
    assert first.value.opened is None and 1 not in committee.opened
    vectors = _vectors(rng)
    plan = {"drop": [(0, S.SHARE), (1, S.RELEASE), (2, S.RELEASE), (3, S.RELEASE)]}
    with pytest.raises(CommitteeAbort, match="aborted in RELEASE.*4 answered") as second:
        _round(committee, 2, vectors, rng, plan)
    assert 2 not in opened, f"the server opened rows of round 2 before its quorum: {opened}"
    record = second.value.opened
    assert record is not None and committee.opened[2] == record
    assert record.members == (4, 5, 6, 7) and record.clients == tuple(sorted(vectors))
    assert "aborted in RELEASE" in record.outcome
    result = _round(committee, 3, vectors, rng, {})  # a released round is an opened one too
    assert committee.opened[3].members == tuple(range(8)) and result.aggregate.size == 10


def test_tampering_detected_after_opening_carries_the_release(monkeypatch):
    rng = np.random.default_rng(12)
    committee = Committee(8, 2, 2, shards=2)
    plan = {"drop": [(0, S.SHARE), (1, S.RELEASE), (2, S.RELEASE)], "tamper": [(5, S.RELEASE)]}
    with pytest.raises(TamperingDetected) as caught:
        _round(committee, 1, _vectors(rng), rng, plan)
    assert caught.value.opened is not None and caught.value.opened.members == (3, 4, 5, 6, 7)


# ----------------------------------------------------------------------------- SecAgg+
def _secagg_round(altered: int, owner: int, silent: set[int]):
    """SecAgg+ among clients 1..8 (complete graph, threshold 4) with small signed inputs:
    ``silent`` clients stop before UNMASK and client ``altered`` adds 1 to its share of
    ``owner``'s self-mask seed. Returns the server, the true sum and the abort."""
    config = SecAggConfig(8, 7, 4, 16, round=1)
    session = new_session_id()
    rng = np.random.default_rng(3)
    inputs = {i: DEFAULT_FIELD.encode_signed(rng.integers(-50, 50, 16)) for i in range(1, 9)}
    server = SecAggServer(config, inputs, session, rng)
    clients = {i: SecAggClient(session) for i in inputs}
    routed = server.advertise_keys({i: c.advertise_keys() for i, c in clients.items()})
    shares = {i: clients[i].share_keys(i, config, routed[i]) for i in routed}
    incoming = server.share_keys(shares)
    masked = {i: clients[i].masked_input(incoming[i], inputs[i]) for i in incoming}
    survivors, dropped = server.masked_input(masked)
    responses = {
        i: clients[i].unmask(survivors, dropped) for i in survivors if i not in silent
    }
    lie = dict(responses[altered].self_mask_shares)
    lie[owner] = (lie[owner] + 1) % DEFAULT_FIELD.modulus
    responses[altered] = UnmaskResponse(lie, dict(responses[altered].secret_key_shares))
    with pytest.raises(RoundAborted, match="disagree") as caught:
        server.unmask(responses)
    return server, DEFAULT_FIELD.sum(np.stack(list(inputs.values())), 0), caught.value


def _recover(server: SecAggServer, owner: int) -> np.ndarray | None:
    """The server alone, after the abort: every threshold-subset of ``owner``'s self-mask
    shares it holds gives a candidate seed; the one that is a 16-bit key and unmasks a sum of
    small integers is the sum."""
    config, space = server.config, server.config.masking
    recipients = server._recipients[owner]
    scheme = shamir_scheme(config, len(recipients))
    held = [(recipients.index(j), r.self_mask_shares[owner])
            for j, r in server.view.responses.items() if owner in r.self_mask_shares]
    others = [server._recover(o, "self_mask_shares") for o in server.survivors if o != owner]
    total = sum_vectors(space, [server.view.masked_inputs[i] for i in server.survivors])
    for seed in others:
        total = space.sub(total, prg(space, seed, config.vector_length))
    for subset in itertools.combinations(held, scheme.threshold):
        members, rows = zip(*subset)
        values = scheme.reconstruct(np.stack(rows), list(members), CHUNKS_PER_SECRET, check=False)
        try:
            seed = elements_to_secret(values)
        except ValueError:
            continue
        candidate = space.sub(total, prg(space, seed, config.vector_length))
        if np.all(np.abs(space.decode_signed(candidate)) < 2**20):
            return candidate
    return None


def test_secagg_says_it_holds_the_sum_it_recovers_after_an_abort():
    server, truth, _ = _secagg_round(altered=1, owner=6, silent={6, 7, 8})
    recovered = _recover(server, 6)
    assert recovered is not None and np.array_equal(recovered, truth)
    assert getattr(server, "opened", False) is True, (
        "the server aborted in UNMASK and then recovered the survivors' sum exactly from the "
        "shares it holds, yet nothing says the sum was released"
    )


def test_full_mode_accounts_a_secagg_round_aborted_after_the_shares_arrived(
    local_engine, client_secrets
):
    """Over the engine: clients 5, 6, 7 stop answering in UNMASK and client 0 alters its share
    of client 5's self-mask seed (exactly threshold + 1 = 5 shares of it arrive). The round
    aborts in UNMASK; the strategy accounts it as plaintext mode accounts the same 8 clients."""
    owner = 5 + 1  # protocol ids are 1..n in the order of the node ids

    def lie(content: RecordDict, partition: int) -> None:
        arrays = {k: np.array(v) for k, v in to_numpy(content["secagg.unmask"]).items()}
        row = list(arrays["self-mask-owners"]).index(owner)
        arrays["self-mask-shares"][row][0] += 1
        content["secagg.unmask"] = to_record(arrays)

    def silent(content: RecordDict, partition: int) -> None:
        if partition in (5, 6, 7):
            raise RuntimeError("silent in UNMASK")
        lie(content, partition)

    app = client_secrets(ddgauss_client_app(inner), PHRASE)
    hostile = Hostile(app, {0, 5, 6, 7}, "query.secagg_unmask", silent)
    full = strategy("full")
    _, _, metrics = one_round(local_engine, client_secrets, full, hostile)
    plain = strategy("plaintext")
    one_round(local_engine, client_secrets, plain)
    assert metrics["ddgauss-aborted"] == 1 and "disagree" in full.last_abort
    assert full.epsilon() == plain.epsilon() > 0, (
        f"the round aborted after every share the sum needs reached the server, yet epsilon "
        f"is {full.epsilon()}; the release it holds costs {plain.epsilon()}"
    )
    assert metrics["ddgauss-opened"] == 1 and metrics["ddgauss-survivors"] == CLIENTS
    cost = metrics["ddgauss-epsilon-cost"]
    assert cost == plain.epsilon() and math.isfinite(cost)
    entry = {"round": 1, "clients": CLIENTS, "epsilon_cost": cost}
    assert full.privacy_report()["aborted_releases"] == [entry]
