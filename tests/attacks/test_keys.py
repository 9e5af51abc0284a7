"""The server that relays public keys substitutes its own (an active key relay).

Committee mode (DDGauss), DMM (SHARE and the RESHARE hand-off) and SecAgg+ all relay the
parties' X25519 keys through the server. A server that hands a client its own keys in place of
t + k members' (or of ``threshold`` neighbours') opens the client's sealed rows and reconstructs
its input, then re-seals to the real members so that the round completes. Keys bound at
enrolment (:mod:`protocols.channels`, "Authenticated keys") make the client refuse before it
seals anything, naming the member whose key was substituted. Each test first plays the attack
against a client that takes keys as relayed, and shows the server recovers the input.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey

from fedsim.engine.client_registry import (
    NODE_ID_OFFSET,
    Enrolment,
    client_name,
    identity_seed,
    member_name,
)
from fedsim.engine.committee import Committee
from fedsim.randomness import RunSecret
from protocols.channels import SERVER_ID, Endpoint, KeySubstitution
from protocols.committee.client import seal_input
from protocols.committee.common import CHANNEL_PROTOCOL, CommitteeStage
from protocols.dmm import common as dmm
from protocols.dmm.client import seal_client_shares
from protocols.dmm.common import DMMKeys, DMMStage, Schedule
from protocols.dmm.member import MemberPool
from protocols.dmm.server import DMMServer
from protocols.field import DEFAULT_FIELD
from protocols.kit import MEMBER_ID_BASE, NEW_ID_BASE, SEAT_ID_BASE
from protocols.secagg import common as secagg
from protocols.secagg.client import SecAggClient
from protocols.secagg.common import (
    CHUNKS_PER_SECRET,
    SecAggConfig,
    Stage,
    elements_to_secret,
    raw_public_key,
    shamir_scheme,
)
from protocols.secagg.server import SecAggServer, run_secagg
from protocols.shamir import PackedShamir


@pytest.fixture
def root() -> RunSecret:
    return RunSecret.fresh()


def _identity(enrolment: Enrolment, root: RunSecret, client: int):
    return enrolment.identity(client_name(client), root.client(client))


# ------------------------------------------------------------------------- committee mode
def _committee(root: RunSecret, n=7, t=2, k=2) -> Committee:
    secrets = {m: root.member(m) for m in range(n)}
    return Committee(n, t, k, shards=2, member_secrets=secrets, enrolment=Enrolment(root))


def _substituted(keys, count: int):
    """The server's own endpoints for members 0..count-1 and the keys it hands the client."""
    evil = {
        j: Endpoint(MEMBER_ID_BASE + j, keys.session_id, CHANNEL_PROTOCOL) for j in range(count)
    }
    member_keys = tuple(
        evil[j].public_key if j in evil else key for j, key in enumerate(keys.member_keys)
    )
    return evil, dataclasses.replace(keys, member_keys=member_keys)


def _open_rows(evil, sealed, party: int, round_: int, stage) -> dict[int, np.ndarray]:
    rows = {}
    for j, endpoint in evil.items():
        endpoint.connect(party, sealed.public_key)
        rows[j] = endpoint.open_array(sealed.envelopes[j], round_=round_, stage=stage)
    return rows


def test_committee_keys_substituted_by_the_server_are_refused_before_sealing(root):
    committee = _committee(root)
    scheme = committee.scheme
    enrolment = Enrolment(root)
    vector = np.arange(1, 11, dtype=np.int64)
    keys = committee.keys_for(1)
    evil, forged = _substituted(keys, scheme.threshold)  # t + k = 4 members' keys
    # the attack on a client that takes the keys as relayed: the server decodes its vector
    blind = seal_input(forged, 3, vector, np.random.default_rng(1))
    rows = _open_rows(evil, blind, 3, 1, CommitteeStage.SHARE)
    members = sorted(rows)
    recovered = scheme.reconstruct(np.stack([rows[j] for j in members]), members, vector.size)
    np.testing.assert_array_equal(recovered, vector)
    # an enrolled client checks the proofs first and seals nothing
    verifier = enrolment.verifier()
    names = [member_name(j) for j in range(scheme.n)]
    with pytest.raises(KeySubstitution, match="committee member 0's public key is not the one"):
        seal_input(forged, 3, vector, np.random.default_rng(1), verifier=verifier, names=names)
    # stripping the proofs, or moving one member's proof and key to another seat, is refused
    with pytest.raises(KeySubstitution, match="carry no enrolment proofs"):
        seal_input(
            dataclasses.replace(keys, member_proofs=()), 3, vector, np.random.default_rng(1),
            verifier=verifier,
        )
    swapped = dataclasses.replace(
        keys,
        member_keys=(keys.member_keys[1], keys.member_keys[0], *keys.member_keys[2:]),
        member_proofs=(keys.member_proofs[1], keys.member_proofs[0], *keys.member_proofs[2:]),
    )
    with pytest.raises(KeySubstitution, match="committee member 0's key is signed by 'member/1'"):
        seal_input(swapped, 3, vector, np.random.default_rng(1), verifier=verifier, names=names)
    # the honest keys pass and the round releases the sum
    sealed = {
        c: seal_input(keys, c, vector * (c + 1), np.random.default_rng(c), verifier=verifier,
                      names=names)
        for c in range(3)
    }
    result = committee.run_round_sealed(1, sealed, vector.size)
    np.testing.assert_array_equal(result.aggregate[: vector.size], vector * 6)


def test_a_certificate_the_registry_did_not_issue_is_refused(root):
    """A server that enrols its own identities under its own authority gets nowhere: the
    client pins the registry's authority key."""
    committee = _committee(root)
    keys = committee.keys_for(1)
    rogue = Enrolment(RunSecret.fresh())
    _, forged = _substituted(keys, keys.n)
    proofs = tuple(
        rogue.identity(member_name(j), root.member(j)).prove(
            CHANNEL_PROTOCOL, keys.session_id, MEMBER_ID_BASE + j, (forged.member_keys[j],)
        )
        for j in range(keys.n)
    )
    forged = dataclasses.replace(forged, member_proofs=proofs)
    with pytest.raises(KeySubstitution, match="did not sign"):
        seal_input(forged, 0, np.ones(4, np.int64), np.random.default_rng(0),
                   verifier=Enrolment(root).verifier())


# ------------------------------------------------------------------------- DMM
M = np.array([[1, 0, 0], [1, 1, 0], [0, 1, 1]], dtype=np.int64)  # banded: row 1 stays open
DIM = 6


def _dmm_pool(root, clients, scheme, server, checked=True):
    enrolment = Enrolment(root)
    identities = {
        s: (identity_seed(root.client(c)), _identity(enrolment, root, c).certificate.to_bytes())
        for s, c in enumerate(clients)
    }
    authority = enrolment.public_key if checked else None
    kwargs = dict(server.member_kwargs, identities=identities, authority=authority)
    groups = [g.tolist() for g in np.array_split(np.arange(scheme.n), 2)]
    return MemberPool(clients, groups, kwargs)


def _dmm(root, n=7, t=2, k=2, checked=True):
    scheme = PackedShamir(n, t, k)
    server = DMMServer(scheme, Schedule(M), DIM)
    server.attach(_dmm_pool(root, list(range(100, 100 + n)), scheme, server, checked))
    return server


def test_dmm_seat_keys_substituted_by_the_server_are_refused_before_sharing(root):
    server = _dmm(root)
    scheme = server.scheme
    keys = server.open_round(0)
    evil = {
        j: Endpoint(SEAT_ID_BASE + j, keys.session_id, dmm.PROTOCOL)
        for j in range(scheme.threshold)
    }
    forged = dataclasses.replace(
        keys,
        member_keys={j: evil[j].public_key if j in evil else key
                     for j, key in keys.member_keys.items()},
    )
    update = np.arange(-3, 3, dtype=np.int64)
    noise = np.full((keys.rows, DIM), 7, dtype=np.int64)
    # a client taking the keys as relayed: the server opens t + k rows, decodes update and noise
    blind = seal_client_shares(forged, 5, update, noise, np.random.default_rng(2))
    rows = {}
    for j, endpoint in evil.items():
        endpoint.connect(5, blind.public_key)
        rows[j] = endpoint.open_array(blind.shares[j], round_=0, stage=DMMStage.SHARE)
    seats = sorted(rows)
    blocks = scheme.blocks_for(DIM)
    opened = scheme.reconstruct(np.stack([rows[j] for j in seats]), seats, keys.width * scheme.k)
    signed = scheme.field.decode_signed(opened)
    np.testing.assert_array_equal(signed[:DIM], update)
    np.testing.assert_array_equal(signed[blocks * scheme.k : blocks * scheme.k + DIM], noise[0])
    # an enrolled client refuses
    verifier = Enrolment(root).verifier()
    with pytest.raises(KeySubstitution, match="DMM seat 0's public key is not the one"):
        seal_client_shares(forged, 5, update, noise, np.random.default_rng(2), verifier=verifier)
    with pytest.raises(KeySubstitution, match="without enrolment proofs"):
        seal_client_shares(
            dataclasses.replace(keys, member_proofs={}), 5, update, noise,
            np.random.default_rng(2), verifier=verifier,
        )
    # honest keys: the round releases update + noise summed over the clients
    sealed = {
        c: seal_client_shares(keys, c, update, noise, np.random.default_rng(c), verifier=verifier)
        for c in range(3)
    }
    nxt = _dmm_pool(root, list(range(200, 200 + scheme.n)), scheme, server)
    output = server.finish_round(sealed, nxt)
    np.testing.assert_array_equal(output.release[0], 3 * update + 3 * noise[0])
    assert output.handed_over


class _SubstitutingPool:
    """The old committee as the server reaches it: when it relays the next committee's keys
    it hands over its own instead (the proofs relayed as they came)."""

    def __init__(self, pool, evil) -> None:
        self.pool, self.evil = pool, evil
        self.groups = pool.groups

        self.dealers: dict[int, bytes] = {}
        self.deals: dict[int, list] = {}

    def broadcast(self, method, *args):
        if method == "connect" and args and any(p >= NEW_ID_BASE for p in args[0]):
            peers = {p: (self.evil[p - NEW_ID_BASE].public_key if p - NEW_ID_BASE in self.evil
                         else key) for p, key in args[0].items()}
            args = (peers, *args[1:])
        answers = self.pool.broadcast(method, *args)
        if method == "announce_handoff":
            for answer in answers:
                self.dealers.update(answer or {})
        return answers

    def call(self, method, args_per_group):
        answers = self.pool.call(method, args_per_group)
        if method == "deal":
            for answer in answers:
                self.deals.update(answer or {})
        return answers

    def opened(self, round_) -> dict[int, set[int]]:
        """new seat -> the dealers whose deal to it the server opened with its own key."""
        out: dict[int, set[int]] = {}
        for dealer, rows in self.deals.items():
            for j, envelope in enumerate(rows):
                if j not in self.evil:
                    continue
                endpoint = self.evil[j]
                endpoint.connect(envelope.sender, self.dealers[dealer])
                endpoint.open_array(envelope, round_=round_, stage=DMMStage.RESHARE)
                out.setdefault(j, set()).add(dealer)
        return out

    def close(self):
        self.pool.close()

    def __getattr__(self, name):
        return getattr(self.pool, name)


@pytest.mark.parametrize("checked", [False, True])
def test_dmm_handoff_keys_substituted_by_the_server_get_no_deal(root, monkeypatch, checked):
    """RESHARE: the server hands the old committee its own keys for t + k seats of the next
    one. Dealers that take keys as relayed deal to them: the server opens t + k seats' shares
    of every open row's partial sum (the data, no noise). Enrolled dealers refuse, the
    hand-off fails naming the cause, the old committee keeps the state and nothing is sealed
    to the server's keys."""
    server = _dmm(root, checked=checked)
    scheme = server.scheme
    update = np.arange(DIM, dtype=np.int64)
    noise = np.zeros((1, DIM), dtype=np.int64)
    verifier = Enrolment(root).verifier()
    keys = server.open_round(0)
    sealed = {
        c: seal_client_shares(keys, c, update, noise, np.random.default_rng(c), verifier=verifier)
        for c in range(3)
    }
    nxt = _dmm_pool(root, list(range(200, 200 + scheme.n)), scheme, server, checked)
    sessions = []
    original = DMMServer._announce_handoff

    def announce(self, round_, t, dealers, faults, transcript, new, session):
        sessions.append(session)
        return original(self, round_, t, dealers, faults, transcript, new, session)

    monkeypatch.setattr(DMMServer, "_announce_handoff", announce)
    server.pool = relay = _SubstitutingPool(server.pool, _LazyEvil(sessions, scheme.threshold))
    output = server.finish_round(sealed, nxt)
    np.testing.assert_array_equal(output.release[0], 3 * update)  # the release stands
    if not checked:
        opened = relay.opened(0)
        assert len(opened) == scheme.threshold
        assert all(len(dealers) >= scheme.threshold for dealers in opened.values())
        return
    assert not relay.deals and not output.handed_over
    assert "a dealer refused: seat" in output.handoff_error
    assert "not the one 'client/20" in output.handoff_error
    assert server.holders  # the old committee keeps the state


class _LazyEvil(dict):
    """The server's endpoints for the first ``count`` seats of the next committee, made for
    the hand-off's session once it is drawn."""

    def __init__(self, sessions, count) -> None:
        super().__init__()
        self.sessions, self.count = sessions, count

    def __contains__(self, j) -> bool:
        return 0 <= j < self.count

    def __getitem__(self, j):
        if not dict.__contains__(self, j):
            dict.__setitem__(self, j, Endpoint(NEW_ID_BASE + j, self.sessions[-1], dmm.PROTOCOL))
        return dict.__getitem__(self, j)


# ------------------------------------------------------------------------- DMM committee seats
SEED, POPULATION, ROUND, PARTITION = 3, 40, 4, 2


def _inner_app():
    from flwr.app import Message, MetricRecord, RecordDict  # noqa: PLC0415
    from flwr.clientapp import ClientApp  # noqa: PLC0415

    from fedsim.record_codec import to_numpy, to_record  # noqa: PLC0415

    app = ClientApp()

    @app.train()
    def train(message, context):
        arrays = to_numpy(message.content["arrays"])
        trained = {k: v + np.float32(0.01) * np.arange(v.size, dtype=np.float32) for k, v in
                   arrays.items()}
        content = RecordDict({"arrays": to_record(trained),
                              "metrics": MetricRecord({"num-examples": 1})})
        return Message(content, reply_to=message)

    return app


def _seat(enrolment, root, session, seat: int, client: int):
    """Seat ``seat``'s endpoint and the proof client ``client``'s enrolled identity signs."""
    endpoint = Endpoint(SEAT_ID_BASE + seat, session, dmm.PROTOCOL)
    proof = _identity(enrolment, root, client).prove(
        dmm.PROTOCOL, session, SEAT_ID_BASE + seat, (endpoint.public_key,)
    )
    return endpoint, proof


def _seat_keys(enrolment, root, seats: dict[int, int], dim: int):
    from protocols.channels import new_session_id  # noqa: PLC0415

    session = new_session_id()
    made = {j: _seat(enrolment, root, session, j, c) for j, c in seats.items()}
    keys = dmm.RoundKeys(
        round=ROUND, step=0, rows=1, n=7, t=2, k=2, field_exponent=61, dim=dim,
        session_id=session,
        member_keys={j: e.public_key for j, (e, _) in made.items()},
        member_proofs={j: p for j, (_, p) in made.items()},
    )
    return keys, {j: e for j, (e, _) in made.items()}


def _dmm_instruction(mode, keys=None, committee=None, *, padded: int):
    from flwr.app import ConfigRecord, Message, RecordDict  # noqa: PLC0415

    from fedsim.record_codec import to_record  # noqa: PLC0415
    from strategies.secure.dmm.wire import round_keys_config  # noqa: PLC0415

    config = {
        "server-round": ROUND, "dmm.dim": 6, "dmm.clip": 1.0, "dmm.gamma": 0.001,
        "dmm.beta": 0.0, "dmm.max-tries": 100, "dmm.rotation-seed": 11,
        "dmm.noise-std": 40.0, "dmm.rows": 1, "dmm.mode": mode,
    }
    if keys is not None:  # what the server relays: keys, proofs and the committee it names
        config.update(round_keys_config(keys, PARTITION))
    if committee is not None:
        config["dmm.share.committee-round"], config["dmm.share.committee"] = committee
    arrays = to_record({"w": np.zeros(6, dtype=np.float32)})
    content = RecordDict({"arrays": arrays, "config": ConfigRecord(config)})
    return Message(content, NODE_ID_OFFSET + PARTITION, "train")


def _drawn(round_: int) -> list[int]:
    """The public committee draw of ``round_`` (as ``DMM.committee_for`` makes it)."""
    from fedsim.randomness import Stream, public_generator  # noqa: PLC0415

    rng = public_generator(SEED, round_, Stream.COMMITTEE)
    return [int(c) for c in rng.choice(POPULATION, size=7, replace=False)]


def _dmm_context(root, enrolled: bool):
    from flwr.app import Context, RecordDict  # noqa: PLC0415

    from fedsim.randomness import NODE_SECRET_KEY  # noqa: PLC0415

    own = root.client(PARTITION)
    node_config = {"partition-id": PARTITION, "num-partitions": POPULATION,
                   NODE_SECRET_KEY: own.token()}
    if enrolled:
        node_config.update(Enrolment(root).node_entries(PARTITION, own))
    return Context(run_id=1, node_id=NODE_ID_OFFSET + PARTITION, node_config=node_config,
                   state=RecordDict(), run_config={"seed": SEED})


def test_dmm_seats_held_by_enrolled_clients_the_draw_did_not_choose_are_refused(root):
    """The server seats t + k enrolled clients that colluded with it (not on the round's public
    committee) on seats 0..3, with their own valid proofs. A client that checks only that the
    signers are distinct enrolled parties seals to them and the server opens its update and
    noise; a client that recomputes the public committee draw refuses, naming the seat, and
    refuses a committee list the draw did not give, whatever the server names."""
    from flwr.supercore.task_identity import TaskIdentity  # noqa: PLC0415

    from fedsim.record_codec import to_numpy  # noqa: PLC0415
    from protocols.dmm.client import check_seat_keys  # noqa: PLC0415
    from protocols.encoding import padded_dimension  # noqa: PLC0415
    from strategies.methods.dmm import dmm_client_app  # noqa: PLC0415
    from strategies.secure.dmm.wire import sealed_from_record  # noqa: PLC0415

    TaskIdentity.run_id, TaskIdentity.node_id, TaskIdentity.task_id = 1, 1, 1
    enrolment, padded = Enrolment(root), padded_dimension(6)
    committee = _drawn(ROUND)
    colluders = [c for c in range(POPULATION) if c not in committee and c != PARTITION][:4]
    seated = {j: (colluders[j] if j < 4 else committee[j]) for j in range(7)}
    keys, endpoints = _seat_keys(enrolment, root, seated, padded)
    assert len(set(check_seat_keys(keys, enrolment.verifier()))) == 7  # distinct, all enrolled
    app = dmm_client_app(_inner_app())
    # the attack: the client seals, the colluders' four seats decode its update and noise
    reply = app(_dmm_instruction("full", keys, (ROUND, committee), padded=padded),
                _dmm_context(root, enrolled=False))
    sealed = sealed_from_record(reply.content[DMMKeys.SEALED], PARTITION, ROUND)
    rows = {}
    for j in range(4):
        endpoints[j].connect(PARTITION, sealed.public_key)
        rows[j] = endpoints[j].open_array(sealed.shares[j], round_=ROUND, stage=DMMStage.SHARE)
    scheme = keys.scheme()
    opened = scheme.reconstruct(np.stack([rows[j] for j in range(4)]), list(range(4)),
                                keys.width * scheme.k)
    signed = scheme.field.decode_signed(opened)
    ideal = app(_dmm_instruction("ideal", padded=padded), _dmm_context(root, enrolled=False))
    update = to_numpy(ideal.content[DMMKeys.UPDATE])[DMMKeys.UPDATE]
    noise = to_numpy(ideal.content[DMMKeys.NOISE])[DMMKeys.NOISE]
    assert np.any(update)
    np.testing.assert_array_equal(signed[:padded], update)
    blocks = scheme.blocks_for(padded)
    np.testing.assert_array_equal(signed[blocks * scheme.k : blocks * scheme.k + padded], noise[0])
    # an enrolled client recomputes the draw: seat 0's certificate names the wrong client
    # (a fresh context each time: a client answers a round once, refused or not)
    with pytest.raises(KeySubstitution, match=f"DMM seat 0's key is signed by "
                       f"'client/{colluders[0]}', not 'client/{committee[0]}'"):
        app(_dmm_instruction("full", keys, (ROUND, committee), padded=padded),
            _dmm_context(root, enrolled=True))
    # naming the colluders as the committee, a later round's draw, or none, is refused
    named = [seated[j] for j in range(7)]
    with pytest.raises(KeySubstitution, match=f"not round {ROUND}'s public committee"):
        app(_dmm_instruction("full", keys, (ROUND, named), padded=padded),
            _dmm_context(root, enrolled=True))
    with pytest.raises(KeySubstitution, match="committee-round=5 names no public"):
        app(_dmm_instruction("full", keys, (ROUND + 1, committee), padded=padded),
            _dmm_context(root, enrolled=True))
    with pytest.raises(KeySubstitution, match="committee-round=None"):
        app(_dmm_instruction("full", keys, None, padded=padded),
            _dmm_context(root, enrolled=True))
    # the public committee's own keys (an earlier round's draw still holding the state) pass
    earlier = _drawn(ROUND - 2)
    honest, _ = _seat_keys(enrolment, root, dict(enumerate(earlier)), padded)
    reply = app(_dmm_instruction("full", honest, (ROUND - 2, earlier), padded=padded),
            _dmm_context(root, enrolled=True))
    assert set(reply.content.keys()) == {DMMKeys.SEALED}


def test_dmm_dealers_deal_only_to_the_next_public_committee(tmp_path, monkeypatch, caplog):
    """RESHARE through ``fedsim run``: the server names enrolled clients the draw did not choose
    (colluders, with their own valid proofs) as the next committee. Dealers that check only
    for distinct enrolled signers hand the state over to them; dealers that recompute the
    next round's public draw refuse, the state stays with the drawn committee, and every
    round still releases (a hand-off with no open row deals nothing; the clients of the next
    round then refuse the seats, as above)."""
    import logging  # noqa: PLC0415

    from fedsim.frontend.experiment import run_experiment  # noqa: PLC0415
    from fedsim.frontend.results import read_rounds  # noqa: PLC0415
    from fedsim.frontend.run_config import ExperimentConfig  # noqa: PLC0415
    from strategies.secure.dmm.custody import Custody  # noqa: PLC0415

    drawn = Custody.draw

    def seating(self, server_round):  # the next committee: clients the draw left out
        if server_round == 1:
            return drawn(self, server_round)
        chosen = drawn(self, server_round)
        return [c for c in range(self.population) if c not in chosen][: self.size]

    monkeypatch.setattr(Custody, "draw", seating)
    config = ExperimentConfig.from_dict({
        "rounds": 3, "seed": 1,  # bands = 2: each hand-off deals the open row
        "data": {"source": "digits", "partition": "iid", "num_clients": 24},
        "model": {"kind": "logreg"},
        "client": {"epochs": 1, "batch_size": 16, "lr": 0.1},
        "engine": {"backend": "local"},
        "strategy": {
            "name": "dmm", "clients_per_round": 12, "sampling": "min-separation",
            "options": {"clipping_norm": 1.0, "noise_multiplier": 1.0, "committee_size": 11,
                        "threshold": 2, "packing": 1, "member_dropouts": 2},
        },
    })
    with caplog.at_level(logging.WARNING, logger="strategies.methods.dmm"):
        run_experiment(config, tmp_path, progress=False, secrets=RunSecret.fresh())
    rounds = [r for r in read_rounds(tmp_path / "rounds.jsonl") if r["round"] >= 1]
    assert len(rounds) == 3
    assert [r["aggregated"]["dmm-handed-over"] for r in rounds[:2]] == [0, 0]
    assert all(r["aggregated"]["dmm-clients"] == 12 for r in rounds)  # each round released
    refusals = [m for m in caplog.messages if "refuses to deal" in m]
    assert refusals and "of the other committee's key is signed by 'client/" in refusals[0]


# ------------------------------------------------------------------------- SecAgg+
def _secagg(root, n=6):
    enrolment = Enrolment(root)
    identities = {i: _identity(enrolment, root, i) for i in range(1, n + 1)}
    config = SecAggConfig(num_clients=n, degree=n - 1, threshold=3, vector_length=4)
    return enrolment, identities, config


def test_secagg_neighbour_keys_substituted_by_the_server_are_refused(root):
    enrolment, identities, config = _secagg(root)
    session = b"s" * 32
    server = SecAggServer(config, range(1, 7), session, np.random.default_rng(0))
    clients = {i: SecAggClient(session) for i in range(1, 7)}
    keys = {i: c.advertise_keys() for i, c in clients.items()}
    proofs = {i: clients[i].key_proof(identities[i]) for i in clients}
    routed = server.advertise_keys(keys, proofs)
    # for client 1 the server puts its own keys in place of `threshold` neighbours'
    target, neighbours = 1, sorted(routed[1])
    swapped = neighbours[: config.threshold]
    evil = {j: Endpoint(j, session, secagg.PROTOCOL) for j in swapped}
    agreement = {j: SecAggClient(session) for j in swapped}  # their agreement keys too
    forged = {
        j: (evil[j].public_key, agreement[j].public_keys[1]) if j in evil else keys_
        for j, keys_ in routed[target].items()
    }
    # a client taking keys as relayed shares its secrets to the server
    blind = SecAggClient(session, seed=clients[target]._seed)
    blind.advertise_keys()
    envelopes = blind.share_keys(target, config, forged)
    recipients = sorted(forged)
    rows, members = [], []
    for envelope in envelopes:
        if envelope.receiver in evil:
            endpoint = evil[envelope.receiver]
            endpoint.connect(target, clients[target].public_keys[0])
            rows.append(endpoint.open_array(envelope, round_=0, stage=Stage.SHARE_KEYS))
            members.append(recipients.index(envelope.receiver))
    scheme = shamir_scheme(config, len(recipients))
    secrets_ = scheme.reconstruct(np.stack(rows), members, 2 * CHUNKS_PER_SECRET)
    agreement_key = elements_to_secret(secrets_[CHUNKS_PER_SECRET:])
    rebuilt = X25519PrivateKey.from_private_bytes(agreement_key)
    assert raw_public_key(rebuilt) == keys[target][1]  # the server holds both secrets of 1
    # an enrolled client refuses, and nothing is sealed
    with pytest.raises(KeySubstitution, match="not the one 'client/"):
        clients[target].share_keys(
            target, config, forged, proofs=server.proofs_for(target),
            verifier=enrolment.verifier(), own=identities[target].name,
        )
    assert clients[target].stage is Stage.ABORTED
    # another client's proof with the server's keys, or its own proof echoed back, is refused
    echoed = {j: proofs[target] for j in routed[target]}
    client = SecAggClient(session, seed=clients[2]._seed)
    client.advertise_keys()
    with pytest.raises(KeySubstitution):
        client.share_keys(2, config, routed[2], proofs=echoed, verifier=enrolment.verifier(),
                          own=identities[2].name)


def test_secagg_round_with_enrolled_clients_sums_and_one_substitution_aborts_it(root):
    enrolment, identities, config = _secagg(root)
    inputs = {i: np.arange(4, dtype=np.int64) * i for i in range(1, 7)}
    result = run_secagg(
        config, inputs, np.random.default_rng(3), identities=identities,
        verifier=enrolment.verifier(),
    )
    np.testing.assert_array_equal(result.aggregate, sum(inputs.values()) % DEFAULT_FIELD.modulus)

    class Substituting(SecAggServer):
        def advertise_keys(self, public_keys, proofs=None):
            routed = super().advertise_keys(public_keys, proofs)
            mine = Endpoint(SERVER_ID - 1, self.session_id, secagg.PROTOCOL).public_key
            first = min(routed[1])
            routed[1] = {**routed[1], first: (mine, routed[1][first][1])}
            return routed

    with pytest.raises(KeySubstitution, match="neighbour .*'s public key is not the one"):
        run_secagg(
            config, inputs, np.random.default_rng(3), identities=identities,
            verifier=enrolment.verifier(), server_class=Substituting,
        )
