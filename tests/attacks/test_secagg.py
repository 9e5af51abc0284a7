"""Hostile messages against SecAgg+: the server's and the clients' state machines, and the
message layer that carries them between Flower nodes.

First ``../shared/attacks/secagg_sm.py``'s trials, adapted: one bad message used to fail the
whole round with a ValueError and leave the server in MASKED_INPUT or UNMASK. Then fuzzing:
every handler gets random bytes, wrong types and lengths, out-of-range values, replays (from
another round, stage or session, or a second time), messages from non-members and
non-neighbours, and calls in the wrong stage. A case is *clean* when

* server: the round ends DONE with exactly the sum of the inputs it reports as survivors and
  the bad party named in ``rejected`` (or, when the server cannot see the fault -- a ciphertext
  of the right size that does not open --, its receiver refuses it and drops out), or the round
  ends ABORTED with :class:`RoundAborted`;
* client: the handler raises a protocol error and the client is left ABORTED (called in the
  wrong stage: StageError, and it stays where it was);
* message layer: a malformed record is :class:`MalformedReply`, and a client with a round in
  progress answers a bad stage message with a refusal and stores itself ABORTED.

Each fuzz test counts the cases it tried and asserts that all were clean (``-s`` prints the
figures). Well-formed lies that no party can check (a valid X25519 key the client does not
hold, an arbitrary masked input) are SecAgg+'s known limits against malicious clients: they can
spoil the sum, not learn an input, and are not fuzzed here.
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Callable

import numpy as np
import pytest
from flwr.app import ArrayRecord, ConfigRecord, Context, Message, RecordDict

from fedsim.record_codec import to_record
from protocols.channels import SERVER_ID, new_session_id
from protocols.field import DEFAULT_FIELD
from protocols.kit import RoundAborted, StageError
from protocols.secagg.client import SecAggClient
from protocols.secagg.common import (
    CHUNKS_PER_SECRET,
    SHARE_ROW_LENGTH,
    TRANSITIONS,
    SecAggConfig,
    SecAggKeys,
    Stage,
    UnmaskResponse,
)
from protocols.secagg.server import SecAggServer
from protocols.secagg.state import SecAggClientState

FIELD = DEFAULT_FIELD
LENGTH = 6
CLIENT_ERRORS = (ValueError, TypeError, RoundAborted)  # ChannelError is a ValueError
HANDLED = (Stage.ADVERTISE_KEYS, Stage.SHARE_KEYS, Stage.MASKED_INPUT, Stage.UNMASK)
LOW_ORDER = [
    bytes(32),
    (1).to_bytes(32, "little"),
    bytes.fromhex("e0eb7a7c3b41b8ae1656e3faf19fc46ada098deb9c32b1fd866205165f49b800"),
]
FUZZ = np.random.default_rng(20261201)  # the fuzzer's own, public, randomness


def junk() -> list:
    """Values of every wrong kind: random bytes of several lengths (never a well-formed key),
    numbers, text, containers, arrays."""
    values = [FUZZ.bytes(n) for n in (0, 1, 16, 31, 33, 64, 400)]
    values += [None, 0, -1, 2**70, 1.5, float("nan"), "x", True, [], {}, (), [1, 2], {1: 2}]
    values += [np.zeros(3), np.array(["a"]), np.zeros((2, 2), dtype=np.int64)]
    return values


def swap_first(change: Callable) -> Callable[[list], list]:
    """Replace the first envelope of a batch by ``change(envelope)``."""
    return lambda batch: [change(batch[0]), *batch[1:]]


def field_of(**changes) -> Callable:
    return lambda envelope: dataclasses.replace(envelope, **changes)


@dataclasses.dataclass
class Round:
    """An honest SecAgg+ round among clients 1..n; one stage's messages can be rewritten and
    some clients made silent. The graph and inputs depend on n only."""

    n: int = 10
    degree: int = 6
    threshold: int = 4
    round: int = 3

    def __post_init__(self) -> None:
        self.config = SecAggConfig(self.n, self.degree, self.threshold, LENGTH, round=self.round)
        self.session = new_session_id()
        rng = np.random.default_rng(self.n)
        self.inputs = {i: FIELD.random(rng, LENGTH) for i in range(1, self.n + 1)}
        self.server = SecAggServer(self.config, self.inputs, self.session, rng)
        self.clients = {i: SecAggClient(self.session) for i in self.inputs}
        self.refused: set[int] = set()
        self.seen: dict[Stage, dict] = {}

    def _ask(self, i: int, call: Callable, *args, **kwargs):
        """A client's answer, or None when it refuses (a dropout)."""
        try:
            return call(*args, **kwargs)
        except CLIENT_ERRORS:
            assert self.clients[i].stage is Stage.ABORTED
            self.refused.add(i)
            return None

    def run(self, stage=None, rewrite=None, silent=None, quiet=frozenset()) -> np.ndarray | None:
        """The aggregate (None: the round aborted), with ``rewrite`` applied to the messages
        of ``stage`` and the clients in ``quiet`` silent from stage ``silent`` on."""
        server, config, clients = self.server, self.config, self.clients

        def deliver(at: Stage, messages: dict) -> dict:
            if silent is not None and at.value >= silent.value:
                for i in quiet:
                    messages.pop(i, None)
            self.seen[at] = dict(messages)
            if at is stage:
                rewrite(messages)
            return messages

        try:
            keys = {i: c.advertise_keys() for i, c in clients.items()}
            routed = server.advertise_keys(deliver(Stage.ADVERTISE_KEYS, keys))
            shares = {}
            for i in routed:
                if i in keys and i not in server.rejected:
                    contribute = i not in server.excluded
                    out = self._ask(i, clients[i].share_keys, i, config, routed[i],
                                    contribute=contribute)
                    if out is not None:
                        shares[i] = out
            incoming = server.share_keys(deliver(Stage.SHARE_KEYS, shares))
            masked = {}
            for i in incoming:
                if i in shares and i not in server.rejected:
                    own = None if i in server.excluded else self.inputs[i]
                    out = self._ask(i, clients[i].masked_input, incoming[i], own)
                    if out is not None:
                        masked[i] = out
            survivors, dropped = server.masked_input(deliver(Stage.MASKED_INPUT, masked))
            responses = {}
            for i in incoming:
                if clients[i].stage is Stage.MASKED_INPUT and (
                    i in survivors or i in server.excluded
                ):
                    out = self._ask(i, clients[i].unmask, survivors, dropped)
                    if out is not None:
                        responses[i] = out
            return server.unmask(deliver(Stage.UNMASK, responses))
        except RoundAborted:
            assert server.stage is Stage.ABORTED
            return None

    def clean(self, total: np.ndarray | None, bad: object = None) -> bool:
        """The round ended ABORTED, or DONE with exactly its survivors' sum and ``bad`` (if
        given) named in ``rejected`` or among the clients that refused a message."""
        if total is None:
            return self.server.stage is Stage.ABORTED
        named = bad is None or bad in self.server.rejected or bad in self.refused
        expected = FIELD.sum(np.stack([self.inputs[i] for i in self.server.survivors]), 0)
        return named and bool(np.all(total == expected)) and self.server.stage is Stage.DONE


def report(what: str, tried: int, clean: int) -> None:
    print(f"\n{what}: {tried} cases tried, {clean} handled cleanly, {tried - clean} not")


# ----------------------------------------------------------------------- secagg_sm.py, adapted
def test_secagg_sm_trials_now_fail_cleanly():
    # 1: a client asked to advertise twice refuses and keeps its stage
    trial = Round()
    client = trial.clients[1]
    client.advertise_keys()
    with pytest.raises(StageError):
        client.advertise_keys()
    assert client.stage is Stage.ADVERTISE_KEYS
    # 2: a public key from non-member 99 is rejected, and the round goes on
    trial = Round()
    total = trial.run(Stage.ADVERTISE_KEYS, lambda m: m.update({99: m[1]}))
    assert total is not None and trial.clean(total, bad=99)
    # 3: client 1 sends an extra envelope to a neighbour: it is dropped, the round goes on
    trial = Round()
    total = trial.run(Stage.SHARE_KEYS, lambda m: m[1].append(m[1][0]))
    assert total is not None and trial.clean(total, bad=1) and 1 not in trial.server.survivors
    # 4: client 2 gets its neighbour's envelope sealed for round 2, in round 3: it refuses
    trial = Round()

    def replay(shares):
        envelope = shares[1][0]
        sender = trial.clients[1]._endpoint  # client 1 is the attacker: it has its own keys
        row = np.zeros(SHARE_ROW_LENGTH, dtype=np.int64)
        shares[1][0] = sender.seal_array(envelope.receiver, 2, Stage.SHARE_KEYS, row)
        shares[1][0] = dataclasses.replace(shares[1][0], round=3)  # passes the server's check
        trial.victim = envelope.receiver

    total = trial.run(Stage.SHARE_KEYS, replay)
    assert trial.victim in trial.refused and trial.clients[trial.victim].stage is Stage.ABORTED
    assert total is not None and trial.clean(total, bad=trial.victim)
    # 5: one masked input of the wrong length: that client counts as dropped
    trial = Round()
    total = trial.run(Stage.MASKED_INPUT, lambda m: m.update({2: np.zeros(7, dtype=np.int64)}))
    assert total is not None and trial.clean(total, bad=2) and 2 in trial.server.dropped
    # 6: a responder returns a share of a non-neighbour's seed: its response is dropped
    trial = Round(n=7, degree=4, threshold=3)
    outsider = next(j for j in trial.inputs if j != 1 and j not in trial.server.graph[1])

    def forge(responses):
        good = responses[1]
        extra = {outsider: np.zeros(CHUNKS_PER_SECRET, dtype=np.int64)}
        responses[1] = UnmaskResponse({**good.self_mask_shares, **extra}, good.secret_key_shares)

    total = trial.run(Stage.UNMASK, forge)
    assert total is not None and trial.clean(total, bad=1) and 1 in trial.server.survivors


# ----------------------------------------------------------------------- server-side fuzzing
def _advertise_cases() -> list:
    def keys(value):
        return lambda m: m.update({1: value})

    def channel(value):
        return lambda m: m.update({1: (value, m[1][1])})

    def agreement(value):
        return lambda m: m.update({1: (m[1][0], value)})

    cases = []
    for index, value in enumerate(junk() + LOW_ORDER):
        cases += [(f"keys = junk {index}", keys(value), 1)]
        cases += [(f"channel key = junk {index}", channel(value), 1)]
        cases += [(f"agreement key = junk {index}", agreement(value), 1)]
    cases += [
        ("three keys", lambda m: m.update({1: (*m[1], m[1][0])}), 1),
        ("another client's keys", lambda m: m.update({1: m[2]}), 1),
        ("another client's agreement key", lambda m: m.update({1: (m[1][0], m[2][1])}), 1),
    ]
    for who in (99, -1, 0, 2**63, "1", 2.5, None, False):
        named = who if isinstance(who, int) and not isinstance(who, bool) else repr(who)
        cases += [(f"non-member {who!r}", lambda m, w=who: m.update({w: m[3]}), named)]
    return cases


def _share_cases() -> list:
    other = Round()  # another session with the same ids and graph, to replay from
    other.run()
    stale = other.seen[Stage.SHARE_KEYS][1][0]
    receiver = min(Round().server.graph[1])  # client 1's first envelope goes to it

    def batch(change, bad=1):
        return lambda m: m.update({1: change(list(m[1]))}), bad

    def sealed(change):
        return lambda e: dataclasses.replace(e, ciphertext=change(e.ciphertext))

    cases = [(f"envelopes = junk {i}", *batch(lambda b, v=v: v)) for i, v in enumerate(junk())]
    cases += [
        ("no envelopes", *batch(lambda b: [])),
        ("one missing", *batch(lambda b: b[1:])),
        ("one twice", *batch(lambda b: b + b[:1])),
        ("a non-envelope", *batch(lambda b: b[:-1] + ["x"])),
        ("sender forged", *batch(swap_first(field_of(sender=2)))),
        ("to a non-neighbour", *batch(swap_first(field_of(receiver=99)))),
        ("to itself", *batch(swap_first(field_of(receiver=1)))),
        ("another round", *batch(swap_first(field_of(round=2)))),
        ("round as text", *batch(swap_first(field_of(round="3")))),
        ("another stage", *batch(swap_first(field_of(stage="UNMASK")))),
        ("short nonce", *batch(swap_first(field_of(nonce=bytes(11))))),
        ("nonce as text", *batch(swap_first(field_of(nonce="0" * 12)))),
        ("short ciphertext", *batch(swap_first(sealed(lambda c: c[:-1])))),
        ("long ciphertext", *batch(swap_first(sealed(lambda c: c + b"x")))),
        ("ciphertext as list", *batch(swap_first(field_of(ciphertext=[1])))),
        # right size and header: the server cannot tell; the receiver refuses and drops out
        ("random ciphertext", *batch(swap_first(sealed(lambda c: FUZZ.bytes(len(c)))), receiver)),
        ("last session's envelope", *batch(swap_first(lambda e: stale), receiver)),
        ("from a non-member", lambda m: m.update({99: m[2]}), 99),
        ("from an id as text", lambda m: m.update({"1": m[2]}), "'1'"),
    ]
    return cases


def _masked_cases() -> list:
    values = junk() + [
        np.zeros(LENGTH - 1, dtype=np.int64),
        np.zeros(LENGTH + 1, dtype=np.int64),
        np.full(LENGTH, FIELD.modulus, dtype=np.int64),
        np.full(LENGTH, -1, dtype=np.int64),
        np.full(LENGTH, 2**64 - 1, dtype=np.uint64),
        np.zeros(LENGTH, dtype=np.float64),
        np.zeros(LENGTH, dtype=bool),
        np.zeros((1, LENGTH), dtype=np.int64),
        np.array([object()] * LENGTH),
        list(range(LENGTH)),
    ]
    cases = [(f"masked {i}", lambda m, v=v: m.update({1: v}), 1) for i, v in enumerate(values)]
    cases += [
        ("from a non-member", lambda m: m.update({99: m[2]}), 99),
        ("from an id as text", lambda m: m.update({"2": m[2]}), "'2'"),
    ]
    return cases


def _unmask_cases() -> list:
    graph = Round().server.graph  # the same in every Round() of 10 clients
    outsider = next(j for j in range(2, 11) if j not in graph[1])
    neighbour = min(graph[1])

    def shares(kind: str, change: Callable[[dict], None]):
        def rewrite(m):
            parts = {"self": dict(m[1].self_mask_shares), "key": dict(m[1].secret_key_shares)}
            change(parts[kind])
            m[1] = UnmaskResponse(parts["self"], parts["key"])

        return rewrite

    def first(change: Callable[[np.ndarray], object]):
        return lambda d: d.update({min(d): change(d[min(d)])})

    zeros = np.zeros(CHUNKS_PER_SECRET, dtype=np.int64)
    cases = [
        (f"response = junk {i}", lambda m, v=v: m.update({1: v}), 1) for i, v in enumerate(junk())
    ]
    cases += [
        ("shares not in a dict", lambda m: m.update({1: UnmaskResponse([1], {})}), 1),
        ("share of non-member 99", shares("self", lambda d: d.update({99: zeros})), 1),
        ("owner as text", shares("self", lambda d: d.update({"2": zeros})), 1),
        ("share of a non-neighbour", shares("self", lambda d: d.update({outsider: zeros})), 1),
        ("key share of a survivor", shares("key", lambda d: d.update({neighbour: zeros})), 1),
        ("short share", shares("self", first(lambda r: r[:-1])), 1),
        ("long share", shares("self", first(lambda r: np.append(r, 1))), 1),
        ("share out of field", shares("self", first(lambda r: r * 0 + FIELD.modulus)), 1),
        ("negative share", shares("self", first(lambda r: r * 0 - 1)), 1),
        ("float share", shares("self", first(lambda r: r * 1.0)), 1),
        ("share as bytes", shares("self", first(lambda r: b"x" * 16)), 1),
        ("altered share", shares("self", first(lambda r: (r + 1) % FIELD.modulus)), 1),
        ("from a non-member", lambda m: m.update({99: m[2]}), 99),
        ("from a dropped client", lambda m: m.update({5: m[2]}), 5),  # 5 is silent from input
    ]
    return cases


CASES = {
    Stage.ADVERTISE_KEYS: _advertise_cases,
    Stage.SHARE_KEYS: _share_cases,
    Stage.MASKED_INPUT: _masked_cases,
    Stage.UNMASK: _unmask_cases,
}


@pytest.mark.parametrize("stage", HANDLED, ids=[s.name for s in HANDLED])
def test_fuzz_every_server_handler(stage):
    tried = clean = 0
    for name, rewrite, bad in CASES[stage]():
        trial = Round()
        quiet = frozenset({5}) if name == "from a dropped client" else frozenset()
        total = trial.run(stage, rewrite, silent=Stage.MASKED_INPUT, quiet=quiet)
        tried += 1
        ok = trial.clean(total, bad)
        clean += ok
        assert ok, (stage.name, name, trial.server.rejected, trial.server.stage)
    report(f"server {stage.name}", tried, clean)
    assert tried == clean >= 15


def test_every_server_handler_refuses_every_wrong_stage_and_keeps_its_stage():
    tried = clean = 0
    handlers = {
        Stage.ADVERTISE_KEYS: lambda s: s.advertise_keys({}),
        Stage.SHARE_KEYS: lambda s: s.share_keys({}),
        Stage.MASKED_INPUT: lambda s: s.masked_input({}),
        Stage.UNMASK: lambda s: s.unmask({}),
    }
    for reached, (target, call) in itertools.product(Stage, handlers.items()):
        if target in TRANSITIONS[reached]:
            continue
        server = Round().server
        server.stage = reached  # as if it had got there
        tried += 1
        with pytest.raises(StageError):
            call(server)
        clean += server.stage is reached
    report("server, wrong stage", tried, clean)
    assert tried == clean == 24


# ----------------------------------------------------------------------- client-side fuzzing
def _client_before(stage: Stage, trial: Round) -> tuple:
    """Client 1 of an honest round brought to just before ``stage``: that stage's arguments."""
    server, config, clients = trial.server, trial.config, trial.clients
    routed = server.advertise_keys({i: c.advertise_keys() for i, c in clients.items()})
    if stage is Stage.SHARE_KEYS:
        return (1, config, routed[1])
    incoming = server.share_keys({i: clients[i].share_keys(i, config, routed[i]) for i in routed})
    if stage is Stage.MASKED_INPUT:
        return (incoming[1], trial.inputs[1])
    masked = {i: clients[i].masked_input(incoming[i], trial.inputs[i]) for i in incoming}
    return server.masked_input(masked)


def _share_keys_cases() -> list:
    def keys(change):
        def rewrite(args):
            neighbours = dict(args[2])
            return (args[0], args[1], change(neighbours))

        return rewrite

    def first(change):
        return keys(lambda d: {**d, min(d): change(d[min(d)])})

    stranger = Round().clients[1].public_keys
    cases = [(f"neighbour keys = junk {i}", keys(lambda d, v=v: v)) for i, v in enumerate(junk())]
    cases += [(f"config = junk {i}", lambda a, v=v: (a[0], v, a[2])) for i, v in enumerate(junk())]
    cases += [(f"client id {v!r}", lambda a, v=v: (v, a[1], a[2])) for v in (-1, 2**63, "1", None)]
    for index, point in enumerate([*LOW_ORDER, b"x" * 31, "k" * 32]):
        cases += [(f"bad channel key {index}", first(lambda k, p=point: (p, k[1])))]
        cases += [(f"bad agreement key {index}", first(lambda k, p=point: (k[0], p)))]
    cases += [
        ("its own id as a neighbour", keys(lambda d: {**dict(list(d.items())[1:]), 1: d[min(d)]})),
        ("two neighbours with one key", keys(lambda d: {**d, max(d): d[min(d)]})),
        ("its own keys back", "own keys"),
        ("more neighbours than the degree", keys(lambda d: {**d, 99: stranger})),
        ("fewer than the threshold", keys(lambda d: dict(list(d.items())[:3]))),
        ("keys not a pair", first(lambda k: (k[0],))),
        ("neighbour id as text", keys(lambda d: {str(j): k for j, k in d.items()})),
    ]
    return cases


def _masked_input_cases() -> list:
    def batch(change):
        return lambda args: (change(list(args[0])), args[1])

    bad_batches = [v for v in junk() if not isinstance(v, list | dict | tuple) or v]
    cases = [(f"envelopes = junk {i}", batch(lambda b, v=v: v)) for i, v in enumerate(bad_batches)]
    def flipped(envelope):
        ciphertext = envelope.ciphertext
        return dataclasses.replace(envelope, ciphertext=bytes([ciphertext[0] ^ 1]) + ciphertext[1:])

    cases += [
        ("a non-envelope", batch(lambda b: b + ["x"])),
        ("one twice", batch(lambda b: b + b[:1])),
        ("from a non-neighbour", batch(swap_first(field_of(sender=99)))),
        ("sender forged as another", batch(lambda b: [field_of(sender=b[1].sender)(b[0]), *b[1:]])),
        ("tampered ciphertext", batch(swap_first(flipped))),
        ("another round", batch(swap_first(field_of(round=2)))),
        ("another stage", batch(swap_first(field_of(stage="UNMASK")))),
        ("addressed to another", batch(swap_first(field_of(receiver=2)))),
        ("a short share row", "short"),
        ("a share row out of field", "out of field"),
        ("a float share row", "float"),
        ("own input too short", lambda a: (a[0], a[1][:-1])),
        ("own input out of field", lambda a: (a[0], a[1] * 0 - 1)),
        ("own input missing", lambda a: (a[0], None)),
    ]
    return cases


def _unmask_client_cases() -> list:
    scalars = [v for v in junk() if not isinstance(v, list | dict | tuple | np.ndarray)]
    cases = [(f"survivors = junk {i}", lambda a, v=v: (v, a[1])) for i, v in enumerate(scalars)]
    cases += [
        ("a survivor also dropped", lambda a: (a[0], (a[0][0],))),
        ("too few survivors", lambda a: (a[0][:2], a[1])),
        ("an id as text", lambda a: ((*a[0], "3"), a[1])),
        ("a negative id", lambda a: ((*a[0], -4), a[1])),
        # a cohort's list is checked by its types and extremes: every way to slip past them
        ("an id as a bool", lambda a: ((*a[0], True), a[1])),
        ("an id as a float", lambda a: ((*a[0], 7.0), a[1])),
        ("an id past the server's", lambda a: ((*a[0], SERVER_ID), a[1])),
        ("a dropped id past int64", lambda a: (a[0], (2**64,))),
        ("survivors as a float array", lambda a: (np.array(a[0], dtype=float), a[1])),
        ("a negative id in an int array", lambda a: (np.array([*a[0], -1]), a[1])),
    ]
    return cases


def _sealed_as_neighbour(trial: Round, envelopes: list, kind: str) -> list:
    """Client 1's deliveries with the first share row replaced by one its real sender (a
    malicious neighbour, which has its own keys) sealed: it opens, and is the wrong row."""
    first = envelopes[0]
    row = {
        "short": np.zeros(SHARE_ROW_LENGTH - 1, dtype=np.int64),
        "out of field": np.full(SHARE_ROW_LENGTH, FIELD.modulus, dtype=np.int64),
        "float": np.zeros(SHARE_ROW_LENGTH),
    }[kind]
    sender = trial.clients[first.sender]._endpoint
    return [sender.seal_array(1, trial.config.round, Stage.SHARE_KEYS, row), *envelopes[1:]]


CLIENT_CASES = {
    Stage.SHARE_KEYS: _share_keys_cases,
    Stage.MASKED_INPUT: _masked_input_cases,
    Stage.UNMASK: _unmask_client_cases,
}


@pytest.mark.parametrize("stage", list(CLIENT_CASES), ids=[s.name for s in CLIENT_CASES])
def test_fuzz_every_client_handler(stage):
    tried = clean = 0
    for name, change in CLIENT_CASES[stage]():
        trial = Round()
        args = _client_before(stage, trial)
        client = trial.clients[1]
        if change == "own keys":
            first = min(args[2])
            args = (args[0], args[1], {**args[2], first: client.public_keys})
        elif isinstance(change, str):
            args = (_sealed_as_neighbour(trial, args[0], change), args[1])
        else:
            args = change(args)
        handler = {
            Stage.SHARE_KEYS: client.share_keys,
            Stage.MASKED_INPUT: client.masked_input,
            Stage.UNMASK: client.unmask,
        }[stage]
        tried += 1
        try:
            handler(*args)
        except CLIENT_ERRORS:
            clean += client.stage is Stage.ABORTED
        else:
            pytest.fail(f"client 1 accepted {name!r} in {stage.name}")
    report(f"client {stage.name}", tried, clean)
    assert tried == clean >= 15


def test_every_client_handler_refuses_every_wrong_stage_and_keeps_its_stage():
    tried = clean = 0
    trial = Round()
    handlers = {
        Stage.ADVERTISE_KEYS: lambda c: c.advertise_keys(),
        Stage.SHARE_KEYS: lambda c: c.share_keys(1, trial.config, {}),
        Stage.MASKED_INPUT: lambda c: c.masked_input([], None),
        Stage.UNMASK: lambda c: c.unmask([], []),
    }
    for reached, (target, call) in itertools.product(Stage, handlers.items()):
        if target in TRANSITIONS[reached]:
            continue
        client = SecAggClient(trial.session)
        client.stage = reached
        tried += 1
        with pytest.raises(StageError):
            call(client)
        clean += client.stage is reached
    report("client, wrong stage", tried, clean)
    assert tried == clean == 24


def test_a_client_state_that_is_not_one_is_refused():
    """from_arrays reads the client's own (sealed) storage: anything malformed is a ValueError
    naming the client state, never another exception."""
    trial = Round()
    _client_before(Stage.MASKED_INPUT, trial)
    state = trial.clients[1].to_state().to_arrays()
    restored = SecAggClient.from_state(SecAggClientState.from_arrays(state))
    assert restored.to_state().to_arrays().keys() == state.keys()
    tried = clean = 0
    for key, value in itertools.product(state, junk()):
        broken = {**state, key: value}
        tried += 1
        try:
            SecAggClient.from_state(SecAggClientState.from_arrays(broken))
            clean += 1  # a value the state can hold (e.g. 0 for a count)
        except ValueError as error:
            clean += "not a SecAgg+ client state" in str(error)
    for key in state:
        tried += 1
        with pytest.raises(ValueError, match="not a SecAgg"):
            SecAggClientState.from_arrays({k: v for k, v in state.items() if k != key})
        clean += 1
    report("client state", tried, clean)
    assert tried == clean


def test_a_stored_state_pack_that_is_not_one_is_refused():
    """The bytes a client keeps between exchanges (sealed under fedsim, plain in Flower's own
    runtime) round-trip exactly, input in its narrowest type; truncated, extended or rewritten
    bytes are a ValueError naming the state, never another exception or a silent misread."""
    from strategies.secure.secagg_client_stages import narrowest, pack_arrays, unpack_arrays

    trial = Round()
    _client_before(Stage.MASKED_INPUT, trial)
    state = trial.clients[1].to_state().to_arrays()
    state["input"] = narrowest(np.array([-300, 5, 299]))
    assert state["input"].dtype == np.int16
    payload = pack_arrays(state)
    back = unpack_arrays(payload)
    assert back.keys() == state.keys()
    for key, value in state.items():
        assert back[key].dtype == value.dtype and np.array_equal(back[key], value)
    protocol = SecAggClientState.from_arrays({k: v for k, v in back.items() if k != "input"})
    assert SecAggClient.from_state(protocol).client_id == 1
    head = int.from_bytes(payload[:4], "little")
    broken = [
        payload[:-1],
        payload + b"\x00",
        payload[: 4 + head],
        (head + 7).to_bytes(4, "little") + payload[4:],
        payload.replace(b"<i8", b"<f8", 1),
        payload.replace(b'"input", "<i2", [3]', b'"input", "<i2", [99]', 1),
        b"",
    ]
    for junk_bytes in broken:
        with pytest.raises(ValueError, match="not a SecAgg\\+ client state"):
            unpack_arrays(junk_bytes)
    with pytest.raises(ValueError, match="integers only"):
        pack_arrays({"input": np.zeros(3)})


# ----------------------------------------------------------------------- message layer
def test_fuzz_the_message_layer(monkeypatch):
    from flwr.supercore.task_identity import TaskIdentity

    from strategies.secure import secagg_client_stages as client_stages
    from strategies.secure import secagg_messages as wire

    for name in ("_run_id", "_task_id", "_node_id"):
        monkeypatch.setattr(TaskIdentity, name, 1)
    tried = clean = 0
    # envelopes: a ConfigRecord of any shape is envelopes or MalformedReply
    for fields, value in itertools.product(
        [SecAggKeys.ENVELOPE_ENTRIES, SecAggKeys.ENVELOPE_ENTRIES[:-1], ("x",)], junk()
    ):
        try:
            record = ConfigRecord({f: value for f in fields})
        except (TypeError, ValueError):
            continue
        tried += 1
        try:
            clean += wire.envelopes_from(record) == [] and value == []  # empty lists only
        except wire.MalformedReply:
            clean += 1
    # unmask replies: arrays of every shape and dtype are a response or MalformedReply
    names = ["self-mask-owners", "self-mask-shares", "secret-key-owners", "secret-key-shares"]
    for shapes, dtype in itertools.product(
        [[(3,), (3, 16), (0,), (0, 16)], [(3,), (2, 16), (0,), (0, 16)], [(3,)] * 4, [(2, 2)] * 4],
        [np.int64, np.uint8, np.float64],
    ):
        arrays = {
            n: np.arange(int(np.prod(s)), dtype=dtype).reshape(s) for n, s in zip(names, shapes)
        }
        tried += 1
        try:
            wire._unmask_from(to_record(arrays))
            clean += shapes[1] == (3, 16) and dtype is not np.float64
        except wire.MALFORMED:
            clean += 1
    # a client with a round in progress refuses any bad stage message, and stays ABORTED
    session = new_session_id()
    started = Context(1, 5, {}, RecordDict(), {})
    client_stages.start_client(started, 3, session, np.zeros(LENGTH, dtype=np.int64))
    K = SecAggKeys
    records = [K.SETUP, K.NEIGHBOURS, K.ENVELOPES, K.SURVIVORS, "x"]
    for stage, key, value in itertools.product(wire.ACTIONS, records, junk()):
        header = ConfigRecord({"server-round": 3, "session": session, "stage": stage.name})
        try:
            record = ConfigRecord({"v": value})
        except (TypeError, ValueError):
            record = ArrayRecord()
        content = RecordDict({SecAggKeys.HEADER: header, key: record})
        context = Context(1, 5, {}, RecordDict(dict(started.state)), {})
        tried += 1
        message = Message(content, 5, wire.MESSAGE_TYPES[stage])
        reply = client_stages._answer(stage, message, context)
        restored = client_stages._load(context)
        clean += set(reply.keys()) == {SecAggKeys.REFUSED} and restored.stage is Stage.ABORTED
    # and a stage message for another round or session is no message for it at all
    for header in (
        ConfigRecord({"server-round": 2, "session": session, "stage": "UNMASK"}),
        ConfigRecord({"server-round": 3, "session": new_session_id(), "stage": "UNMASK"}),
        ConfigRecord({"server-round": 3, "session": session, "stage": "SHARE_KEYS"}),
        ConfigRecord({"server-round": "3"}),
    ):
        tried += 1
        content = RecordDict({SecAggKeys.HEADER: header})
        message = Message(content, 5, wire.MESSAGE_TYPES[Stage.UNMASK])
        with pytest.raises(RuntimeError, match="another round or session"):
            client_stages._answer(Stage.UNMASK, message, started)
        clean += 1
    report("message layer", tried, clean)
    assert tried == clean >= 150
