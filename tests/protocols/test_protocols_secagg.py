"""protocols.secagg: sums with and without dropouts at every stage, clean failure with too many,
the server's view, tampering, and every (stage, stage) pair of the state machines."""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from protocols.channels import new_session_id
from protocols.field import DEFAULT_FIELD
from protocols.kit import RoundAborted, StageError, TooManyDropoutsError
from protocols.secagg.client import SecAggClient
from protocols.secagg.common import (
    TRANSITIONS,
    SecAggConfig,
    Stage,
    check_transition,
    expand_mask,
    neighbour_graph,
    pairwise_seed,
)
from protocols.secagg.server import SecAggServer, run_secagg

FIELD = DEFAULT_FIELD
LENGTH = 300


def _inputs(count: int, seed: int) -> dict[int, np.ndarray]:
    rng = np.random.default_rng(seed)
    inputs = {100 + i: FIELD.random(rng, LENGTH) for i in range(count)}
    first = next(iter(inputs))
    inputs[first][:2] = [0, FIELD.modulus - 1]
    return inputs


def _sum_of(inputs, ids) -> np.ndarray:
    return FIELD.sum(np.stack([inputs[i] for i in ids]), axis=0)


def _share_keys(server, clients, config, routed):
    return server.share_keys({i: clients[i].share_keys(i, config, routed[i]) for i in routed})


def _through_masked_input(inputs, config, graph_seed: int = 0, silent=()):
    """A round run stage by stage up to MASKED_INPUT (``silent``: clients that send no masked
    input): (server, clients, survivors, dropped)."""
    session = new_session_id()
    server = SecAggServer(config, inputs, session, np.random.default_rng(graph_seed))
    clients = {i: SecAggClient(session) for i in inputs}
    routed = server.advertise_keys({i: c.advertise_keys() for i, c in clients.items()})
    incoming = _share_keys(server, clients, config, routed)
    live = [i for i in incoming if i not in silent]
    masked = {i: clients[i].masked_input(incoming[i], inputs[i]) for i in live}
    return (server, clients, *server.masked_input(masked))


def test_sum_without_dropouts_sparse_and_complete_graph():
    inputs = _inputs(10, seed=1)
    for degree, threshold in ((4, 3), (9, 5)):
        config = SecAggConfig(10, degree, threshold, LENGTH)
        result = run_secagg(config, inputs, np.random.default_rng(2))
        assert result.survivors == tuple(sorted(inputs)) and result.dropped == ()
        assert (result.aggregate == _sum_of(inputs, inputs)).all()


@pytest.mark.parametrize(
    "stage", [Stage.ADVERTISE_KEYS, Stage.SHARE_KEYS, Stage.MASKED_INPUT, Stage.UNMASK]
)
def test_sum_with_dropouts_at_each_stage(stage):
    inputs = _inputs(12, seed=3)
    config = SecAggConfig(12, 8, 5, LENGTH)
    dropped_ids = {101, 106, 110}  # at most 3 per neighbourhood of 8: 5 remain
    result = run_secagg(config, inputs, np.random.default_rng(4), {stage: dropped_ids})
    # clients that stop in UNMASK already sent their masked input: their input is summed
    expected = set(inputs) if stage is Stage.UNMASK else set(inputs) - dropped_ids
    assert set(result.survivors) == expected
    assert (result.aggregate == _sum_of(inputs, result.survivors)).all()
    if stage is Stage.MASKED_INPUT:
        assert set(result.dropped) == dropped_ids
        assert set(result.server.view.recovered_secret_keys) == dropped_ids


def test_sum_with_dropouts_spread_over_all_stages():
    inputs = _inputs(16, seed=5)
    config = SecAggConfig(16, 12, 7, LENGTH)  # any 5 neighbours may fail
    dropouts = {
        Stage.ADVERTISE_KEYS: {100},
        Stage.SHARE_KEYS: {105},
        Stage.MASKED_INPUT: {108, 111},
        Stage.UNMASK: {113},
    }
    result = run_secagg(config, inputs, np.random.default_rng(6), dropouts)
    # clients that dropped in UNMASK still sent their masked input: their input is summed
    assert set(result.survivors) == set(inputs) - {100, 105, 108, 111}
    assert (result.aggregate == _sum_of(inputs, result.survivors)).all()


def test_too_many_dropouts_in_unmask_fail_cleanly():
    inputs = _inputs(8, seed=7)
    config = SecAggConfig(8, 4, 3, LENGTH)
    with pytest.raises(TooManyDropoutsError, match=r"needs 3 shares, \d neighbours answered"):
        run_secagg(config, inputs, np.random.default_rng(8), {Stage.UNMASK: {100, 101, 102, 103}})


def test_too_few_survivors_fail_cleanly_and_abort():
    inputs = _inputs(8, seed=9)
    config = SecAggConfig(8, 7, 4, LENGTH, min_survivors=6)
    session = new_session_id()
    server = SecAggServer(config, inputs, session, np.random.default_rng(0))
    clients = {i: SecAggClient(session) for i in inputs}
    routed = server.advertise_keys({i: c.advertise_keys() for i, c in clients.items()})
    incoming = _share_keys(server, clients, config, routed)
    masked = {i: clients[i].masked_input(incoming[i], inputs[i]) for i in list(incoming)[:5]}
    with pytest.raises(TooManyDropoutsError, match="masked inputs arrived from 5 clients"):
        server.masked_input(masked)
    assert server.stage is Stage.ABORTED
    with pytest.raises(StageError, match="ABORTED"):
        server.unmask({})


def test_clients_with_too_few_live_neighbours_are_excluded():
    inputs = _inputs(16, seed=10)
    config = SecAggConfig(16, 8, 5, LENGTH, min_survivors=3)
    graph = neighbour_graph(list(inputs), 8, np.random.default_rng(11))
    victim = 100
    away = set(graph[victim][::2])  # victim keeps 4 < 5 live neighbours
    result = run_secagg(config, inputs, np.random.default_rng(11), {Stage.ADVERTISE_KEYS: away})
    assert result.excluded == (victim,)  # its neighbours still have 5 or more live neighbours
    assert set(result.survivors) == set(inputs) - away - {victim}
    # the excluded client still held its neighbours' shares and answered in UNMASK
    assert victim in result.server.view.responses
    assert (result.aggregate == _sum_of(inputs, result.survivors)).all()


def test_server_never_sees_an_unmasked_input():
    inputs = {100 + i: np.zeros(LENGTH, dtype=np.int64) for i in range(8)}
    config = SecAggConfig(8, 4, 3, LENGTH)
    result = run_secagg(config, inputs, np.random.default_rng(12), {Stage.MASKED_INPUT: {103}})
    view = result.server.view
    assert not set(view.recovered_self_masks) & set(view.recovered_secret_keys)
    for client, masked in view.masked_inputs.items():
        assert np.count_nonzero(masked) >= LENGTH - 1  # zeros are hidden
        # even after removing the self-mask the server recovered, pairwise masks remain
        seed = view.recovered_self_masks[client]
        assert np.count_nonzero(FIELD.sub(masked, expand_mask(seed, LENGTH, FIELD))) >= LENGTH - 1
    assert result.server.relay.pending() == []  # every share was delivered, sealed
    assert (result.aggregate == 0).all()


def test_client_refuses_to_reveal_both_secrets_of_one_client():
    inputs = _inputs(5, seed=13)
    config = SecAggConfig(5, 4, 3, LENGTH)
    session = new_session_id()
    server = SecAggServer(config, inputs, session, np.random.default_rng(0))
    clients = {i: SecAggClient(session) for i in inputs}
    routed = server.advertise_keys({i: c.advertise_keys() for i, c in clients.items()})
    incoming = _share_keys(server, clients, config, routed)
    clients[100].masked_input(incoming[100], inputs[100])
    with pytest.raises(ValueError, match=r"clients \[101\] are listed as both"):
        clients[100].unmask([101, 102], [101])
    assert clients[100].stage is Stage.ABORTED


def test_late_masked_input_is_refused():
    inputs = _inputs(6, seed=14)
    config = SecAggConfig(6, 4, 3, LENGTH)
    session = new_session_id()
    server = SecAggServer(config, inputs, session, np.random.default_rng(0))
    clients = {i: SecAggClient(session) for i in inputs}
    routed = server.advertise_keys({i: c.advertise_keys() for i, c in clients.items()})
    incoming = _share_keys(server, clients, config, routed)
    masked = {i: clients[i].masked_input(incoming[i], inputs[i]) for i in incoming}
    late = masked.pop(105)
    server.masked_input(masked)
    with pytest.raises(StageError, match="server is in stage MASKED_INPUT"):
        server.masked_input({105: late})


def test_tampered_share_is_named_and_left_out():
    """8 shares, 5 needed: one wrong share is within the unique-decoding radius, so it is
    corrected and its sender named (SecAgg+ decodes to the radius: a lying neighbour can only
    spoil the sum, as a malicious masked input can)."""
    inputs = _inputs(9, seed=15)
    config = SecAggConfig(9, 8, 5, LENGTH)
    server, clients, survivors, dropped = _through_masked_input(inputs, config)
    responses = {i: clients[i].unmask(survivors, dropped) for i in survivors}
    row = responses[104].self_mask_shares[100]
    row[3] = (row[3] + 1) % FIELD.modulus
    assert (server.unmask(responses) == _sum_of(inputs, inputs)).all()
    assert list(server.rejected) == [104] and "degree check" in server.rejected[104]
    assert server.stage is Stage.DONE


def test_batched_recovery_gives_each_owner_what_its_own_decoding_gives():
    """UNMASK decodes the owners whose answering neighbours sit at the same places together:
    with dropouts in every stage (several such groups, survivors and dropped owners alike) and
    one tampered share (that owner decoded alone, its sender named), every recovered seed and
    key is the one a decoding of that owner alone gives, and the sum is exact."""
    inputs = _inputs(16, seed=31)
    config = SecAggConfig(16, 12, 7, LENGTH)
    server, clients, survivors, dropped = _through_masked_input(inputs, config, 1, {108})
    responses = {i: clients[i].unmask(survivors, dropped) for i in survivors if i not in (102, 113)}
    row = responses[104].self_mask_shares[100]
    row[3] = (row[3] + 1) % FIELD.modulus
    assert (server.unmask(responses) == _sum_of(inputs, survivors)).all()
    assert list(server.rejected) == [104] and dropped == (108,)
    view = server.view
    for owner in survivors:
        assert view.recovered_self_masks[owner] == server._recover(owner, "self_mask_shares")
    assert view.recovered_secret_keys[108] == server._recover(108, "secret_key_shares")
    places = set()
    for owner in survivors:
        recipients = server._recipients[owner]
        places.add(tuple(sorted(recipients.index(r) for r in view.responses if r in recipients)))
    assert len(places) > 1  # more than one group was decoded


def test_shares_wrong_beyond_the_radius_abort_cleanly_naming_nobody():
    inputs = _inputs(9, seed=15)
    config = SecAggConfig(9, 8, 5, LENGTH)
    server, clients, survivors, dropped = _through_masked_input(inputs, config)
    responses = {i: clients[i].unmask(survivors, dropped) for i in survivors}
    for liar in (104, 105):  # two wrong shares among 8, 5 needed: beyond the radius of 1
        row = responses[liar].self_mask_shares[100]
        row[3] = (row[3] + 1) % FIELD.modulus
    with pytest.raises(RoundAborted, match="cannot be named"):
        server.unmask(responses)
    assert server.rejected == {} and server.stage is Stage.ABORTED


def test_transition_table_every_pair():
    for current, target in itertools.product(Stage, Stage):
        if target in TRANSITIONS[current]:
            check_transition(current, target, "party")
        else:
            with pytest.raises(StageError, match=f"stage {current.name}; cannot move to"):
                check_transition(current, target, "party")


def _client_handlers(client, config, routed, incoming, values):
    return {
        Stage.ADVERTISE_KEYS: lambda: client.advertise_keys(),
        Stage.SHARE_KEYS: lambda: client.share_keys(100, config, routed),
        Stage.MASKED_INPUT: lambda: client.masked_input(incoming, values),
        Stage.UNMASK: lambda: client.unmask([], []),
    }


def test_every_client_handler_out_of_order_raises():
    """Drive clients to each stage; every handler but the next one raises StageError."""
    inputs = _inputs(5, seed=16)
    config = SecAggConfig(5, 4, 3, LENGTH)
    session = new_session_id()
    server = SecAggServer(config, inputs, session, np.random.default_rng(0))
    clients = {i: SecAggClient(session) for i in inputs}
    probe = 100
    checked = set()

    def probe_all():
        client = clients[probe]
        for target, call in _client_handlers(client, config, {}, [], inputs[probe]).items():
            if target not in TRANSITIONS[client.stage]:
                before = client.stage
                with pytest.raises(StageError):
                    call()
                assert client.stage is before
                checked.add((before, target))

    probe_all()
    routed = server.advertise_keys({i: c.advertise_keys() for i, c in clients.items()})
    probe_all()
    incoming = _share_keys(server, clients, config, routed)
    probe_all()
    masked = {i: clients[i].masked_input(incoming[i], inputs[i]) for i in incoming}
    probe_all()
    survivors, dropped = server.masked_input(masked)
    responses = {i: clients[i].unmask(survivors, dropped) for i in survivors}
    probe_all()  # DONE: every handler raises
    assert (server.unmask(responses) == _sum_of(inputs, inputs)).all()
    aborted = SecAggClient(session)
    aborted.abort()
    clients[probe] = aborted
    probe_all()
    handler_stages = {Stage.ADVERTISE_KEYS, Stage.SHARE_KEYS, Stage.MASKED_INPUT, Stage.UNMASK}
    expected = {
        (current, target)
        for current in Stage
        if current is not Stage.UNMASK  # a client passes through UNMASK inside one handler
        for target in handler_stages
        if target not in TRANSITIONS[current]
    }
    assert checked == expected


def test_every_server_handler_out_of_order_raises():
    inputs = _inputs(5, seed=17)
    config = SecAggConfig(5, 4, 3, LENGTH)
    session = new_session_id()
    server = SecAggServer(config, inputs, session, np.random.default_rng(0))
    clients = {i: SecAggClient(session) for i in inputs}
    handlers = {
        Stage.ADVERTISE_KEYS: lambda: server.advertise_keys({}),
        Stage.SHARE_KEYS: lambda: server.share_keys({}),
        Stage.MASKED_INPUT: lambda: server.masked_input({}),
        Stage.UNMASK: lambda: server.unmask({}),
    }
    seen = []

    def probe_all():
        seen.append(server.stage)
        for target, call in handlers.items():
            if target not in TRANSITIONS[server.stage]:
                with pytest.raises(StageError, match="server is in stage"):
                    call()

    probe_all()
    routed = server.advertise_keys({i: c.advertise_keys() for i, c in clients.items()})
    probe_all()
    incoming = _share_keys(server, clients, config, routed)
    probe_all()
    masked = {i: clients[i].masked_input(incoming[i], inputs[i]) for i in incoming}
    survivors, dropped = server.masked_input(masked)
    probe_all()
    server.unmask({i: clients[i].unmask(survivors, dropped) for i in survivors})
    probe_all()
    assert seen == [
        Stage.SETUP,
        Stage.ADVERTISE_KEYS,
        Stage.SHARE_KEYS,
        Stage.MASKED_INPUT,
        Stage.DONE,
    ]


def test_transcript_counts_shares_and_masked_inputs():
    inputs = _inputs(6, seed=18)
    config = SecAggConfig(6, 4, 3, LENGTH)
    result = run_secagg(config, inputs, np.random.default_rng(19))
    transcript = result.server.transcript
    assert transcript.messages(stage=Stage.SHARE_KEYS) == 6 * 4
    assert transcript.nbytes(sender=100, stage=Stage.MASKED_INPUT) == LENGTH * 8
    per_envelope = {row["bytes"] for row in transcript.rows() if row["stage"] == "SHARE_KEYS"}
    assert len(per_envelope) == 1  # every share row has the same size


def test_masks_and_seeds():
    seed = bytes(range(32))
    first = expand_mask(seed, 1000, FIELD)
    assert (first == expand_mask(seed, 1000, FIELD)).all()
    assert (expand_mask(seed, 10, FIELD) == first[:10]).all()
    assert first.min() >= 0 and first.max() < FIELD.modulus
    assert not (first == expand_mask(bytes(32), 1000, FIELD)).any()
    from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey
    from cryptography.hazmat.primitives.serialization import Encoding, PublicFormat

    a, b = X25519PrivateKey.generate(), X25519PrivateKey.generate()
    raw = {k: k.public_key().public_bytes(Encoding.Raw, PublicFormat.Raw) for k in (a, b)}
    session = new_session_id()
    assert pairwise_seed(a, raw[b], session, 3, 9) == pairwise_seed(b, raw[a], session, 9, 3)
    assert pairwise_seed(a, raw[b], session, 3, 9) != pairwise_seed(a, raw[b], session, 3, 8)


def test_neighbour_graph_is_regular_symmetric_and_seeded():
    ids = list(range(50, 70))
    graph = neighbour_graph(ids, 6, np.random.default_rng(20))
    assert all(len(graph[i]) == 6 and i not in graph[i] for i in ids)
    assert all(i in graph[j] for i in ids for j in graph[i])
    assert graph == neighbour_graph(ids, 6, np.random.default_rng(20))
    assert graph != neighbour_graph(ids, 6, np.random.default_rng(21))


def test_config_errors_name_the_argument():
    with pytest.raises(ValueError, match="degree=3 must be even"):
        SecAggConfig(10, 3, 2, 5)
    with pytest.raises(ValueError, match="threshold=2 must satisfy degree/2 < threshold"):
        SecAggConfig(10, 4, 2, 5)
    with pytest.raises(ValueError, match="vector_length"):
        SecAggConfig(10, 4, 3, 0)
    with pytest.raises(ValueError, match="min_survivors=11"):
        SecAggConfig(10, 4, 3, 5, min_survivors=11)


# -- the client's fast paths give the same bytes and the same masked input -------------------


def test_share_rows_are_encoded_byte_for_byte_as_encode_array():
    from protocols.channels import decode_array, encode_array
    from protocols.secagg.common import SHARE_ROW_LENGTH, decode_share_row, encode_share_row

    row = FIELD.random(np.random.default_rng(30), SHARE_ROW_LENGTH)
    assert encode_share_row(row) == encode_array(row)
    back = decode_share_row(encode_share_row(row))
    assert back.dtype == np.int64 and np.array_equal(back, row) and back.flags.writeable
    for other in (row[:-1], row.astype(np.int32), row.astype(">i8"), row.reshape(2, -1)):
        assert encode_share_row(other) == encode_array(other)
        payload = encode_array(other)
        assert np.array_equal(decode_share_row(payload), decode_array(payload))
    with pytest.raises(ValueError, match="header promises"):
        decode_share_row(encode_array(row)[:-8])


@pytest.mark.parametrize("bits", [20, 32, 64])
def test_ring_masked_sum_equals_adding_each_expanded_mask(bits):
    from protocols.secagg.common import RingZ2k

    ring = RingZ2k(bits)
    values = ring.encode_signed(np.random.default_rng(31).integers(-1000, 1000, LENGTH))
    kept = values.copy()
    seeds = [(bytes([s]) * 32, sign) for s, sign in ((1, 1), (2, -1), (3, 1), (4, -1))]
    expected = values
    for seed, sign in seeds:
        mask = ring.expand(seed, LENGTH)
        expected = ring.add(expected, mask) if sign > 0 else ring.sub(expected, mask)
    got = ring.masked_sum(values, seeds)
    assert got.dtype == expected.dtype and np.array_equal(got, expected)
    assert np.array_equal(values, kept)  # the input is left as it was


@pytest.mark.parametrize("ring_bits", [None, 32])
def test_a_restored_client_masks_as_before_without_any_x25519(ring_bits, monkeypatch):
    """SHARE_KEYS keeps the channel receive keys and the pairwise seeds in the client's state:
    after a restore, MASKED_INPUT opens the shares and masks with no X25519 agreement, and the
    round's sum is the same."""
    from protocols.channels import Endpoint
    from protocols.secagg import client as secagg_client

    count = 5
    config = SecAggConfig(count, 4, 3, LENGTH, ring_bits=ring_bits)
    space = config.masking
    inputs = {i: space.asarray(np.arange(LENGTH) % 7 + i) for i in range(count)}
    session = new_session_id()
    server = SecAggServer(config, list(inputs), session, np.random.default_rng(32))
    clients = {i: SecAggClient(session) for i in inputs}
    routed = server.advertise_keys({i: c.advertise_keys() for i, c in clients.items()})
    incoming = _share_keys(server, clients, config, routed)
    restored = {i: SecAggClient.from_state(c.to_state()) for i, c in clients.items()}

    def forbidden(*args, **kwargs):
        raise AssertionError("an X25519 agreement after the restore")

    monkeypatch.setattr(Endpoint, "connect", forbidden)
    monkeypatch.setattr(secagg_client, "pairwise_seed", forbidden)
    masked = {i: restored[i].masked_input(incoming[i], inputs[i]) for i in inputs}
    monkeypatch.undo()
    survivors, dropped = server.masked_input(masked)
    responses = {i: restored[i].unmask(survivors, dropped) for i in survivors}
    total = server.unmask(responses)
    expected = space.sum(np.stack([inputs[i] for i in inputs]), axis=0)
    assert np.array_equal(total, expected)
