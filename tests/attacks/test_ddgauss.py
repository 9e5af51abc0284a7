"""The server and hostile clients against DDGauss.

* The server replays a client's rounding and noise from everything it knows (the run seed, the
  round, the partition, every public stream, the instruction) and subtracts it: the attack of
  ``../shared/attacks/noise_seed.py``, which recovered the update to within gamma. It now fails.
* In full mode no message the server receives holds a client's encoding, rounded update, noise
  or secret: it sees two public keys, sealed shares, masked inputs and unmasking shares. In
  committee mode it sees one public key and sealed share rows per client (no share row, no
  member's secret) and the members' sealed releases. The same scan finds every encoding in
  plaintext mode.
* Hostile clients (``../shared/attacks/ddgauss_bad_client.py`` and more): a malformed reply at
  any stage drops that client, named in ``rejected``; the round goes on with the others and
  epsilon counts the noise actually in the sum; with too few left the round releases nothing.
"""

from __future__ import annotations

import numpy as np
import pytest
from flwr.app import ArrayRecord, ConfigRecord, Context, Message, MetricRecord, RecordDict
from flwr.clientapp import ClientApp
from flwr.serverapp.strategy import FedAvg

from fedsim.engine.client_registry import NODE_ID_OFFSET
from fedsim.engine.committee import Committee
from fedsim.engine.rounds import run_rounds
from fedsim.privacy import ddgauss as ddgauss_privacy
from fedsim.privacy.mechanisms import discrete_gaussian
from fedsim.randomness import NODE_SECRET_KEY, Purpose, RunSecret, Stream, public_generator
from fedsim.record_codec import to_numpy, to_record
from protocols.field import DEFAULT_FIELD
from protocols.kit import MEMBER_ID_BASE
from protocols.secagg.common import SecAggKeys
from strategies.methods.ddgauss.client import (
    COMMITTEE_PREFIX,
    ENCODED_KEY,
    PREFIX,
    SEALED_KEY,
    ddgauss_client_app,
)
from strategies.methods.ddgauss.strategy import DDGauss
from strategies.secure.secagg_client_stages import narrowest

D, CLIENTS, SEED, PHRASE = 12, 8, 7, "tests"
LOW_ORDER = bytes.fromhex("e0eb7a7c3b41b8ae1656e3faf19fc46ada098deb9c32b1fd866205165f49b800")


def secret_update(partition: int) -> np.ndarray:
    """Client ``partition``'s model update: unknown to the server."""
    return np.random.default_rng(1000 + partition).normal(size=D) * 0.05


inner = ClientApp()


@inner.train()
def _train(message: Message, context: Context) -> Message:
    arrays = to_numpy(message.content["arrays"])
    trained = arrays["w"] + secret_update(int(context.node_config["partition-id"]))
    content = RecordDict(
        {"arrays": to_record({"w": trained}), "metrics": MetricRecord({"num-examples": 5})}
    )
    return Message(content, reply_to=message)


def strategy(mode: str, **options) -> DDGauss:
    if mode == "committee":  # members' keys from their own secrets under the run's root
        root = RunSecret.from_passphrase(PHRASE)
        secrets = {m: root.member(m) for m in range(7)}
        options.setdefault("committee", Committee(7, 2, 2, shards=2, member_secrets=secrets))
    out = DDGauss(
        FedAvg(min_available_nodes=0, fraction_evaluate=0.0),
        clipping_norm=1.0,
        noise_multiplier=1.0,
        expected_clients=CLIENTS,
        seed=SEED,
        mode=mode,
        **options,
    )
    out.encoder_for(D)
    return out


def oracle(encoder, partition: int, server_round: int = 1) -> dict[str, np.ndarray]:
    """What only client ``partition`` knows in round 1: its rounded update, noise and encoding
    (computed from its own secret, as the test plays every party)."""
    secret = RunSecret.from_passphrase(PHRASE).client(partition)
    rotation = int(public_generator(SEED, server_round, Stream.ROTATION).integers(2**63))
    rounding = secret.generator(server_round, Purpose.ROUNDING, PREFIX)
    rounded, _, _ = encoder.quantise(secret_update(partition), rotation, rounding)
    noise = discrete_gaussian(
        encoder.padded_dim,
        encoder.scaled_noise_std,
        secret.generator(server_round, Purpose.NOISE, PREFIX),
    )
    return {
        "rounded": rounded,
        "noise": noise,
        "encoding": DEFAULT_FIELD.encode_signed(rounded + noise),
        "update": secret_update(partition),
    }


class Recording:
    """The server's Grid, keeping every message it sends and every reply it receives."""

    def __init__(self, grid) -> None:
        self.grid, self.sent, self.received = grid, [], []

    def __getattr__(self, name):
        return getattr(self.grid, name)

    def send_and_receive(self, messages, *, timeout=None):
        messages = list(messages)
        self.sent.extend(messages)
        replies = list(self.grid.send_and_receive(messages, timeout=timeout))
        self.received.extend(replies)
        return replies


class Hostile(ClientApp):
    """``app`` whose clients in ``targets`` rewrite their reply to messages of ``kind``."""

    def __init__(self, app: ClientApp, targets: set[int], kind: str, tamper) -> None:
        super().__init__()
        self.app, self.targets, self.kind, self.tamper = app, targets, kind, tamper

    def __call__(self, message: Message, context: Context) -> Message:
        reply = self.app(message, context)
        partition = int(context.node_config["partition-id"])
        if partition in self.targets and message.metadata.message_type == self.kind:
            assert not reply.has_error(), reply.error
            content = RecordDict(dict(reply.content))
            self.tamper(content, partition)
            reply = Message(content, reply_to=message)
        return reply


def one_round(engine, client_secrets, server: DDGauss, app: ClientApp | None = None):
    """Round 1 with every client sampled; returns (grid, final arrays, round metrics)."""
    app = app if app is not None else client_secrets(ddgauss_client_app(inner), PHRASE)
    grid = Recording(engine.open_run(app, CLIENTS, run_config={"seed": 0}))
    outcomes = []
    final = run_rounds(server, grid, to_record({"w": np.zeros(D)}), 1, on_round=outcomes.append)
    grid.wait_idle()
    return grid, to_numpy(final)["w"], outcomes[-1].train_metrics


def node(partition: int) -> int:
    return NODE_ID_OFFSET + partition


@pytest.fixture
def task_identity(monkeypatch):
    """Messages built outside a runtime need the process's task identity (Flower)."""
    from flwr.supercore.task_identity import TaskIdentity

    for name in ("_run_id", "_task_id", "_node_id"):
        monkeypatch.setattr(TaskIdentity, name, 1)


def test_the_server_cannot_replay_a_clients_noise_or_recover_its_update(task_identity):
    """noise_seed.py (DDGauss part), adapted: in plaintext mode the server sees the encoding
    and replays every stream it can compute; the noise it subtracts is never the client's, so
    its estimate of the update stays off by the noise. In full and committee modes the reply
    holds no encoding at all: public keys, and in committee mode ciphertexts."""
    plain = strategy("plaintext")
    encoder = plain.encoder
    app = ddgauss_client_app(inner)
    partition, server_round = 5, 3
    for mode in ("plaintext", "full", "committee"):
        server = strategy(mode)
        messages = list(
            server.configure_train(
                server_round, to_record({"w": np.zeros(D)}), ConfigRecord(), _Nodes()
            )
        )
        config = messages[0].content["config"]
        assert not [k for k in config if "seed" in k and k != PREFIX + "rotation-seed"]
        context = Context(
            run_id=1,
            node_id=node(partition),
            node_config={
                "partition-id": partition,
                "num-partitions": CLIENTS,
                NODE_SECRET_KEY: RunSecret.from_passphrase(PHRASE).client(partition).token(),
            },
            state=RecordDict(),
            run_config={},
        )
        reply = app(Message(messages[0].content, node(partition), "train"), context)
        if mode == "full":
            assert set(reply.content.keys()) == {SecAggKeys.KEYS}
            keys = reply.content[SecAggKeys.KEYS]
            assert sorted(keys) == ["agreement", "channel"]
            assert all(isinstance(v, bytes) and len(v) == 32 for v in keys.values())
            continue
        if mode == "committee":
            assert set(reply.content.keys()) == {SEALED_KEY}
            sealed = reply.content[SEALED_KEY]
            assert len(sealed["public-key"]) == 32 and len(sealed["ciphertexts"]) == 7
            assert sealed["receivers"] == [MEMBER_ID_BASE + j for j in range(7)]
            assert sealed["senders"] == [config[COMMITTEE_PREFIX + "party"]] * 7
            continue
        assert set(reply.content.keys()) == {ENCODED_KEY}  # no metrics next to it
        encoded = to_numpy(reply.content[ENCODED_KEY])[ENCODED_KEY]
        truth = oracle(encoder, partition, server_round)
        rotation = int(config[PREFIX + "rotation-seed"])
        guesses = [
            np.random.default_rng([SEED, server_round, partition]),  # the old derivation
            *(public_generator(SEED, server_round, s) for s in Stream),
            *(public_generator(SEED, server_round, s, partition) for s in Stream),
            np.random.default_rng(rotation),
        ]
        signed = DEFAULT_FIELD.decode_signed(encoded)
        for rng in guesses:
            state = rng.bit_generator.state
            rounded, _, _ = encoder.quantise(truth["update"], rotation, rng)
            rng.bit_generator.state = state
            for noise_rng in (rng, np.random.default_rng(rng.integers(2**63))):
                noise = discrete_gaussian(encoder.padded_dim, encoder.scaled_noise_std, noise_rng)
                assert not np.array_equal(noise, truth["noise"])
            # the server subtracts its replayed noise and decodes: off by the client's noise
            recovered = encoder.decode(DEFAULT_FIELD.encode_signed(signed - noise), rotation)
            error = np.sqrt(np.mean((recovered - truth["update"]) ** 2))
            assert error > 0.5 * encoder.noise_std  # not within gamma as before
        np.testing.assert_array_equal(encoded, truth["encoding"])  # what the client did send


class _Nodes:
    def get_node_ids(self):
        return [node(p) for p in range(CLIENTS)]


def _arrays_in(content: RecordDict) -> list[np.ndarray]:
    out = []
    for record in content.values():
        if isinstance(record, ArrayRecord):
            out.extend(np.asarray(a) for a in to_numpy(record).values())
    return out


def _bytes_in(content: RecordDict) -> list[bytes]:
    out = []
    for record in content.values():
        if isinstance(record, ConfigRecord):
            for value in record.values():
                values = value if isinstance(value, list) else [value]
                out.extend(v for v in values if isinstance(v, bytes))
        if isinstance(record, ArrayRecord):
            out.extend(a.tobytes() for a in to_numpy(record).values())
    return out


def share_rows(server: DDGauss, partition: int) -> np.ndarray:
    """Committee mode: client ``partition``'s packed shares of its round-1 encoding, one row
    per member (from its own share stream, as the test plays every party)."""
    secret = RunSecret.from_passphrase(PHRASE).client(partition)
    encoding = oracle(server.encoder, partition)["encoding"]
    rng = secret.generator(1, Purpose.SHARES, PREFIX)
    return server.committee.scheme.share(encoding, rng=rng)


def _party_needles(server: DDGauss, session: bytes) -> dict[str, tuple[list, list]]:
    """Per party, (arrays, byte strings) that only it may know: a client's encoding, signed
    sum, rounded update and noise (as int64, field or ring elements), its secret and derived
    keys, in committee mode its share rows; a committee member's secret and channel key."""
    root = RunSecret.from_passphrase(PHRASE)
    needles = {}
    for p in range(CLIENTS):
        secret, truth = root.client(p), oracle(server.encoder, p)
        signed = truth["rounded"] + truth["noise"]
        forms = [truth["encoding"], signed, truth["rounded"], truth["noise"]]
        forms += [DEFAULT_FIELD.encode_signed(truth["rounded"]), signed % 2**32]
        keys = [secret.token().encode(), bytes.fromhex(secret.token())]
        keys += [secret.seed_bytes(1, Purpose.KEYS, session.hex())]
        keys += [secret.seed_bytes(1, Purpose.KEYS, PREFIX, session.hex())]
        keys += [f.astype(np.int64).tobytes() for f in forms[:2]]
        if server.mode == "committee":
            rows = list(share_rows(server, p))
            forms += rows
            keys += [row.astype(np.int64).tobytes() for row in rows]
        needles[f"client {p}"] = (forms, keys)
    if server.mode == "committee":
        for m in range(server.committee.scheme.n):
            secret = root.member(m)
            channel = secret.seed_bytes(Purpose.KEYS, "committee-channel", session.hex())
            needles[f"member {m}"] = ([], [bytes.fromhex(secret.token()), channel])
    return needles


def what_leaks(grid: Recording, server: DDGauss) -> list[str]:
    """Every place where a message the server received or sent holds what only a party may
    know (:func:`_party_needles`): as bytes anywhere, or as an array that agrees with a
    client's in more than a fifth of coordinates (a masked input that is no mask)."""
    config = grid.sent[0].content["config"]
    session = config.get(PREFIX + "session", config.get(COMMITTEE_PREFIX + "session", b""))
    found = []
    for party, (forms, keys) in _party_needles(server, session).items():
        for direction, messages in (("received", grid.received), ("sent", grid.sent)):
            for message in messages:
                where = f"{party}'s secret in a {message.metadata.message_type} {direction}"
                arrays = _arrays_in(message.content) if direction == "received" else []
                for array, form in ((a, f) for a in arrays for f in forms):
                    if array.shape == form.shape and np.mean(
                        array.astype(np.int64) == form.astype(np.int64)
                    ) > 0.2:
                        found.append(where + " (array)")
                for blob in _bytes_in(message.content):
                    found.extend(where + " (bytes)" for key in keys if key in blob)
    return found


@pytest.mark.parametrize(
    "mode,ring_bits", [("full", None), ("full", 32), ("committee", None)],
    ids=["full", "full-ring32", "committee"],
)
def test_no_message_the_server_receives_holds_an_encoding_noise_or_secret(
    local_engine, client_secrets, mode, ring_bits
):
    server = strategy(mode, ring_bits=ring_bits)
    grid, _, metrics = one_round(local_engine, client_secrets, server)
    assert metrics["ddgauss-survivors"] == CLIENTS and metrics["rejected"] == []
    types = {TRAIN, SHARE, MASKED, UNMASK} if mode == "full" else {TRAIN}
    assert {r.metadata.message_type for r in grid.received} == types
    assert not any(r.has_error() for r in grid.received)
    assert what_leaks(grid, server) == []
    # the released sum is every client's encoding, summed: their noise is in it
    encodings = [oracle(server.encoder, p)["encoding"] for p in range(CLIENTS)]
    np.testing.assert_array_equal(server.last_sum, DEFAULT_FIELD.sum(np.stack(encodings), 0))
    if mode == "committee":  # the scan would see one plaintext share row
        row = share_rows(server, 5)[3].astype(np.int64).tobytes()
        grid.received.append(Message(RecordDict({"x": ConfigRecord({"r": row})}), 1, "train"))
        assert what_leaks(grid, server) == ["client 5's secret in a train received (bytes)"]


def test_the_same_scan_finds_every_encoding_in_plaintext_mode(local_engine, client_secrets):
    """Plaintext mode, which says so in its name, hands the server every encoding: the scan
    above sees them."""
    plain = strategy("plaintext")
    grid, _, _ = one_round(local_engine, client_secrets, plain)
    leaks = set(what_leaks(grid, plain))
    assert {f"client {p}'s secret in a train received (array)" for p in range(CLIENTS)} <= leaks


def test_the_client_keeps_its_secagg_state_sealed_and_answers_a_round_once(task_identity):
    server = strategy("full")
    model = to_record({"w": np.zeros(D)})
    messages = list(server.configure_train(1, model, ConfigRecord(), _Nodes()))
    secret = RunSecret.from_passphrase(PHRASE).client(2)
    context = Context(
        run_id=1,
        node_id=node(2),
        node_config={
            "partition-id": 2,
            "num-partitions": CLIENTS,
            NODE_SECRET_KEY: secret.token(),
        },
        state=RecordDict(),
        run_config={},
    )
    app = ddgauss_client_app(inner)
    app(Message(messages[0].content, node(2), "train"), context)
    stored = context.state[SecAggKeys.STATE]
    assert stored["sealed"] is True
    truth = oracle(server.encoder, 2)
    signed = (truth["rounded"] + truth["noise"]).astype(np.int64)
    session = messages[0].content["config"][PREFIX + "session"]
    assert signed.tobytes() not in stored["state"]
    assert narrowest(signed).tobytes() not in stored["state"]  # the form the state holds
    assert secret.seed_bytes(1, Purpose.KEYS, session.hex()) not in stored["state"]
    other = RunSecret.from_passphrase(PHRASE).client(3)
    with pytest.raises(ValueError, match="failed authentication"):
        other.open(stored["state"], b"fedsim/secagg/client-state/v2")
    with pytest.raises(RuntimeError, match="already answered ddgauss round 1"):
        app(Message(messages[0].content, node(2), "train"), context)


def _set(record_key: str, name: str, value):
    def tamper(content: RecordDict, partition: int) -> None:
        record = content[record_key]
        if isinstance(record, ConfigRecord):
            record[name] = value(record[name]) if callable(value) else value
        else:
            arrays = to_numpy(record)
            arrays[name] = value(arrays[name])
            content[record_key] = to_record(arrays)

    return tamper


def _add(key: str, record):
    def tamper(content: RecordDict, partition: int) -> None:
        content[key] = record

    return tamper


SHARED_KEY = bytes(range(1, 33))
TRAIN, SHARE, MASKED, UNMASK = (
    "train",
    "query.secagg_share_keys",
    "query.secagg_masked_input",
    "query.secagg_unmask",
)
# (name, kind of message whose reply is rewritten, rewrite (None: below), mode)
_ENCODING = (ENCODED_KEY, ENCODED_KEY)
_MASKED = ("secagg.masked", "masked")
_PLAIN_NEXT = (ENCODED_KEY, to_record({ENCODED_KEY: np.zeros(16, dtype=np.int64)}))
BAD_REPLIES = [
    ("plaintext out of field", TRAIN, _set(*_ENCODING, lambda a: a * 0 + 2**62), "plaintext"),
    ("plaintext wrong length", TRAIN, _set(*_ENCODING, lambda a: a[:-1]), "plaintext"),
    ("plaintext float", TRAIN, _set(*_ENCODING, lambda a: a * 1.0), "plaintext"),
    ("plaintext extra record", TRAIN, _add("x", ConfigRecord({"a": 1})), "plaintext"),
    ("all-zero key", TRAIN, _set(SecAggKeys.KEYS, SecAggKeys.CHANNEL, bytes(32)), "full"),
    ("low-order key", TRAIN, _set(SecAggKeys.KEYS, SecAggKeys.AGREEMENT, LOW_ORDER), "full"),
    ("short key", TRAIN, _set(SecAggKeys.KEYS, SecAggKeys.CHANNEL, bytes(31)), "full"),
    ("text key", TRAIN, _set(SecAggKeys.KEYS, SecAggKeys.CHANNEL, "key"), "full"),
    ("encoding next to keys", TRAIN, _add(ENCODED_KEY, to_record({"x": np.zeros(2)})), "full"),
    ("one envelope missing", SHARE, None, "full"),
    ("two envelopes to one peer", SHARE, None, "full"),
    ("envelope for another stage", SHARE, None, "full"),
    ("truncated ciphertext", SHARE, None, "full"),
    ("masked input too short", MASKED, _set(*_MASKED, lambda a: a[:-1]), "full"),
    ("masked input out of field", MASKED, _set(*_MASKED, lambda a: a * 0 - 1), "full"),
    ("masked input float", MASKED, _set(*_MASKED, lambda a: a * 1.0), "full"),
    ("share of a stranger", UNMASK, None, "full"),
    ("short share", UNMASK, None, "full"),
    ("altered share", UNMASK, None, "full"),
    ("committee all-zero key", TRAIN, _set(SEALED_KEY, "public-key", bytes(32)), "committee"),
    ("committee low-order key", TRAIN, _set(SEALED_KEY, "public-key", LOW_ORDER), "committee"),
    ("committee short key", TRAIN, _set(SEALED_KEY, "public-key", bytes(31)), "committee"),
    ("committee text key", TRAIN, _set(SEALED_KEY, "public-key", "key"), "committee"),
    ("committee encoding next to the envelopes", TRAIN, _add(*_PLAIN_NEXT), "committee"),
    ("committee no envelopes", TRAIN, _add(SEALED_KEY, ConfigRecord({"public-key": LOW_ORDER})),
     "committee"),
    ("committee one envelope missing", TRAIN, None, "committee"),
    ("committee two envelopes to one member", TRAIN, None, "committee"),
    ("committee envelope for a non-member", TRAIN, None, "committee"),
    ("committee envelope for another stage", TRAIN, None, "committee"),
    ("committee envelope for another round", TRAIN, None, "committee"),
    ("committee envelope from another client", TRAIN, None, "committee"),
    ("committee truncated ciphertext", TRAIN, None, "committee"),
    ("committee flipped bit", TRAIN, None, "committee"),
]


def _envelope_tamper(name):
    def tamper(content: RecordDict, partition: int) -> None:
        record = ConfigRecord(dict(content["secagg.envelopes"]))
        if name == "one envelope missing":
            for key in record:
                record[key] = record[key][1:]
        elif name == "two envelopes to one peer":
            receivers = list(record["receivers"])
            receivers[0] = receivers[1]
            record["receivers"] = receivers
        elif name == "envelope for another stage":
            record["stages"] = ["MASKED_INPUT"] + list(record["stages"][1:])
        else:
            record["ciphertexts"] = [c[:-1] for c in record["ciphertexts"]]
        content["secagg.envelopes"] = record

    return tamper


def _first(receiver: int, record: ConfigRecord) -> list[int]:
    """The record's receivers with the first one replaced by ``receiver``."""
    return [receiver, *record["receivers"][1:]]


def _sealed_tamper(name):
    """Rewrite one of a committee-mode reply's envelope fields (``name`` minus "committee ")."""
    change = {
        "one envelope missing": lambda r: {k: v[1:] for k, v in r.items() if isinstance(v, list)},
        "two envelopes to one member": lambda r: {"receivers": _first(r["receivers"][1], r)},
        "envelope for a non-member": lambda r: {"receivers": _first(MEMBER_ID_BASE + 7, r)},
        "envelope for another stage": lambda r: {"stages": ["RELEASE", *r["stages"][1:]]},
        "envelope for another round": lambda r: {"rounds": [2, *r["rounds"][1:]]},
        "envelope from another client": lambda r: {"senders": [s + 1 for s in r["senders"]]},
        "truncated ciphertext": lambda r: {"ciphertexts": [c[:-1] for c in r["ciphertexts"]]},
        "flipped bit": lambda r: {
            "ciphertexts": [bytes([r["ciphertexts"][0][0] ^ 1]) + r["ciphertexts"][0][1:],
                            *r["ciphertexts"][1:]]
        },
    }[name.removeprefix("committee ")]

    def tamper(content: RecordDict, partition: int) -> None:
        record = ConfigRecord(dict(content[SEALED_KEY]))
        record.update(change(record))
        content[SEALED_KEY] = record

    return tamper


def _unmask_tamper(name):
    def tamper(content: RecordDict, partition: int) -> None:
        arrays = {k: np.array(v) for k, v in to_numpy(content["secagg.unmask"]).items()}
        if name == "share of a stranger":
            arrays["self-mask-owners"][0] = 99
        elif name == "short share":
            arrays["self-mask-shares"] = arrays["self-mask-shares"][:, :-1]
        else:
            row = arrays["self-mask-shares"][0]
            row[3] = (row[3] + 1) % DEFAULT_FIELD.modulus
        content["secagg.unmask"] = to_record(arrays)

    return tamper


@pytest.mark.parametrize("name,kind,tamper,mode", BAD_REPLIES, ids=[b[0] for b in BAD_REPLIES])
def test_a_bad_reply_drops_its_client_and_the_round_goes_on(
    local_engine, client_secrets, name, kind, tamper, mode
):
    if tamper is None and mode == "committee":
        tamper = _sealed_tamper(name)
    elif tamper is None:
        tamper = _envelope_tamper(name) if kind == SHARE else _unmask_tamper(name)
    hostile = 3
    app = Hostile(client_secrets(ddgauss_client_app(inner), PHRASE), {hostile}, kind, tamper)
    server = strategy(mode)
    _, final, metrics = one_round(local_engine, client_secrets, server, app)
    assert metrics["rejected"] == [node(hostile)], server.last_rejected
    assert metrics["ddgauss-aborted"] == 0 and server.last_sum is not None
    # a client rejected in UNMASK had already masked its input: its input and noise are in
    kept = range(CLIENTS) if kind == UNMASK else [p for p in range(CLIENTS) if p != hostile]
    assert server.last_survivors == tuple(node(p) for p in kept)
    expected = DEFAULT_FIELD.sum(
        np.stack([oracle(server.encoder, p)["encoding"] for p in kept]), axis=0
    )
    np.testing.assert_array_equal(server.last_sum, expected)
    encoder = server.encoder
    eps = ddgauss_privacy.zcdp_epsilon(
        encoder.l2_bound, encoder.l1_bound, encoder.scaled_noise_std, len(kept), encoder.padded_dim
    )
    (event,) = [e for _, e in server.ledger.entries]
    # the survivors' noise only: KLS21's round is (eps^2 / 2)-zCDP
    assert event.rho == pytest.approx(eps**2 / 2, rel=1e-12) and event.xi == 0


def test_two_clients_with_one_key_are_both_dropped(local_engine, client_secrets):
    app = Hostile(
        client_secrets(ddgauss_client_app(inner), PHRASE),
        {1, 6},
        TRAIN,
        _set(SecAggKeys.KEYS, SecAggKeys.AGREEMENT, SHARED_KEY),
    )
    server = strategy("full")
    _, _, metrics = one_round(local_engine, client_secrets, server, app)
    assert metrics["rejected"] == [node(1), node(6)]
    assert server.last_survivors == tuple(node(p) for p in range(CLIENTS) if p not in (1, 6))


def test_a_sealed_share_altered_on_the_way_makes_its_receiver_drop_out(
    local_engine, client_secrets
):
    """The server cannot see a flipped bit in a ciphertext of the right size; its receiver
    refuses it and stays out of the round, and SecAgg+ recovers from that dropout."""

    def flip(content: RecordDict, partition: int) -> None:
        record = ConfigRecord(dict(content["secagg.envelopes"]))
        ciphertexts = list(record["ciphertexts"])
        ciphertexts[0] = bytes([ciphertexts[0][0] ^ 1]) + ciphertexts[0][1:]
        record["ciphertexts"] = ciphertexts
        content["secagg.envelopes"] = record

    app = Hostile(client_secrets(ddgauss_client_app(inner), PHRASE), {4}, SHARE, flip)
    server = strategy("full")
    _, _, metrics = one_round(local_engine, client_secrets, server, app)
    assert metrics["rejected"] == [] and metrics["ddgauss-refused"] == 1
    assert len(server.last_survivors) == CLIENTS - 1 and node(4) in server.last_survivors
    kept = [p for p in range(CLIENTS) if node(p) in server.last_survivors]
    encodings = [oracle(server.encoder, p)["encoding"] for p in kept]
    np.testing.assert_array_equal(server.last_sum, DEFAULT_FIELD.sum(np.stack(encodings), 0))


def test_too_many_bad_clients_abort_the_round_cleanly(local_engine, client_secrets):
    """Five of eight masked inputs are malformed: 3 < threshold 4 remain. The server's state
    machine ends ABORTED, nothing is released or accounted, no exception leaves the strategy."""
    app = Hostile(
        client_secrets(ddgauss_client_app(inner), PHRASE),
        {0, 2, 3, 5, 7},
        MASKED,
        _set("secagg.masked", "masked", lambda a: a[:3]),
    )
    server = strategy("full")
    _, final, metrics = one_round(local_engine, client_secrets, server, app)
    assert metrics["ddgauss-aborted"] == 1 and metrics["ddgauss-survivors"] == 0
    assert metrics["rejected"] == [node(p) for p in (0, 2, 3, 5, 7)]
    assert server.last_stage == "ABORTED" and "at least 4 needed" in server.last_abort
    assert server.last_sum is None and len(server.ledger) == 0 and metrics["epsilon"] == 0.0
    np.testing.assert_array_equal(final, np.zeros(D))  # the model did not move
