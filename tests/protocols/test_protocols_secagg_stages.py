"""protocols.secagg.stages and .state: the typed codecs of SecAgg+'s parameters and of a
client's stored state (round trip, errors naming key, value and what is allowed), and the client
as stage handlers (state, message) -> (state, reply): a round run through the handler table
sums, and a handler called out of order raises StageError and leaves the state as it was."""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from protocols.channels import new_session_id
from protocols.field import DEFAULT_FIELD, MersenneField
from protocols.kit import StageError
from protocols.secagg.common import SecAggConfig, SecAggKeys, Stage
from protocols.secagg.server import SecAggServer
from protocols.secagg.stages import (
    HANDLERS,
    AdvertiseKeys,
    MaskedInput,
    ShareKeys,
    StageRefused,
    Unmask,
    begin,
    handle,
)
from protocols.secagg.state import ClientState, SecAggClientState

LENGTH = 12
COUNT = 5


def _same(a: dict[str, np.ndarray], b: dict[str, np.ndarray]) -> bool:
    return a.keys() == b.keys() and all(
        a[k].dtype == b[k].dtype and np.array_equal(a[k], b[k]) for k in a
    )


@pytest.mark.parametrize(
    "config",
    [
        SecAggConfig(10, 4, 3, 7),
        SecAggConfig(9, 8, 5, 3, round=11, min_survivors=6, ring_bits=20),
        SecAggConfig(3, 2, 2, 1, field=MersenneField(31)),
        SecAggConfig(5, 4, 3, 2, prg="aes-ctr"),
        SecAggConfig(5, 4, 3, 2, ring_bits=32, prg="aes-ctr"),
    ],
)
def test_config_record_round_trips_by_name(config):
    record = config.to_record()
    # a parameter at its default is left out, so a default round's record is as before
    at_default = SecAggKeys.DEFAULTED if config.prg.code == 0 else ()
    assert tuple(record) == tuple(k for k in SecAggKeys.CONFIG if k not in at_default)
    assert SecAggConfig.from_record(record) == config
    # read by name, not by place: another order of the same entries is the same config
    assert SecAggConfig.from_record(dict(reversed(record.items()))) == config
    prefixed = {"config." + k: np.array(v) for k, v in record.items()}
    assert SecAggConfig.from_record(prefixed, "config.") == config


def test_a_kept_config_is_never_served_for_other_integers():
    first = SecAggConfig(9, 8, 5, 3, round=11, ring_bits=20)
    assert SecAggConfig.from_record(first.to_record()) == first
    for change in ({SecAggKeys.ROUND: 12}, {SecAggKeys.THRESHOLD: 6}, {SecAggKeys.PRG: 1}):
        record = {**first.to_record(), **change}
        read = SecAggConfig.from_record(record)
        assert read != first and read.to_record() == {**first.to_record(), **change}
        assert SecAggConfig.from_record(record) == read  # the second time from the kept one
    bad = {**first.to_record(), SecAggKeys.THRESHOLD: 2}  # not a majority of 8
    for _ in range(2):  # an invalid config raises every time (nothing kept)
        with pytest.raises(ValueError, match="threshold=2"):
            SecAggConfig.from_record(bad)


@pytest.mark.parametrize(
    "key, value, shown",
    [
        (SecAggKeys.THRESHOLD, "3", "'3'"),
        (SecAggKeys.RING_BITS, True, "True"),
        (SecAggKeys.DEGREE, 4.0, "4.0"),
        (SecAggKeys.FIELD_EXPONENT, None, "missing"),
    ],
)
def test_config_decode_error_names_key_value_and_allowed(key, value, shown):
    record = SecAggConfig(10, 4, 3, 7).to_record()
    if value is None:
        del record[key]
    else:
        record[key] = value
    with pytest.raises(ValueError) as caught:
        SecAggConfig.from_record(record)
    message = str(caught.value)
    assert repr(key) in message and shown in message and "allowed: an integer" in message


def _round():
    """COUNT clients through ADVERTISE_KEYS and a server that routed their keys."""
    session = new_session_id()
    config = SecAggConfig(COUNT, 4, 3, LENGTH, round=2)
    rng = np.random.default_rng(7)
    values = {i: rng.integers(-50, 50, LENGTH) for i in range(1, COUNT + 1)}
    states, keys = {}, {}
    for i, x in values.items():
        state = begin(2, session, bytes([i]) * 32, x)
        states[i], reply = handle(Stage.ADVERTISE_KEYS, state, AdvertiseKeys())
        keys[i] = (reply.channel, reply.agreement)
    server = SecAggServer(config, list(values), session, np.random.default_rng(8))
    return config, server, server.advertise_keys(keys), states, values


def test_a_round_through_the_handler_table_sums_and_the_state_round_trips():
    config, server, routed, states, values = _round()
    envelopes = {}
    for i in states:
        message = ShareKeys(i, config, True, routed[i])
        states[i], envelopes[i] = HANDLERS[Stage.SHARE_KEYS](states[i], message)
    incoming = server.share_keys(envelopes)
    masked = {}
    for i in states:
        # what is stored between stages is the whole state: restore it from its arrays
        arrays = states[i].to_arrays()
        states[i] = ClientState.from_arrays(arrays)
        assert _same(states[i].to_arrays(), arrays)
        states[i], masked[i] = handle(Stage.MASKED_INPUT, states[i], MaskedInput(incoming[i]))
        assert states[i].values is None and states[i].stage is Stage.MASKED_INPUT
    survivors, dropped = server.masked_input(masked)
    responses = {}
    for i in survivors:
        states[i], responses[i] = handle(Stage.UNMASK, states[i], Unmask(survivors, dropped))
        assert states[i].stage is Stage.DONE
    total = config.masking.decode_signed(server.unmask(responses))
    assert np.array_equal(total, sum(values.values()))


def test_every_handler_called_out_of_order_raises_and_leaves_the_state():
    config, server, routed, states, _ = _round()
    after_keys = states[1]
    after_share, envelopes = handle(
        Stage.SHARE_KEYS, after_keys, ShareKeys(1, config, True, routed[1])
    )
    messages = {
        Stage.ADVERTISE_KEYS: AdvertiseKeys(),
        Stage.SHARE_KEYS: ShareKeys(1, config, True, routed[1]),
        Stage.MASKED_INPUT: MaskedInput(()),
        Stage.UNMASK: Unmask((1, 2, 3, 4, 5), ()),
    }
    fresh = begin(2, after_keys.protocol.session, bytes(32), np.zeros(LENGTH, np.int64))
    tried = 0
    for state, stage in itertools.product((fresh, after_keys, after_share), HANDLERS):
        allowed = {
            Stage.SETUP: Stage.ADVERTISE_KEYS,
            Stage.ADVERTISE_KEYS: Stage.SHARE_KEYS,
            Stage.SHARE_KEYS: Stage.MASKED_INPUT,
        }[state.stage]
        if stage is allowed:
            continue
        before = state.to_arrays()
        with pytest.raises(StageError, match=f"cannot move to {stage.name}"):
            handle(stage, state, messages[stage])
        assert _same(state.to_arrays(), before)
        tried += 1
    assert tried == 9
    with pytest.raises(StageError, match="no handler for"):
        handle(Stage.DONE, after_share, None)


def test_a_refused_message_gives_the_aborted_state_to_store():
    config, _, routed, states, _ = _round()
    wrong_round = SecAggConfig(COUNT, 4, 3, LENGTH, round=3)
    with pytest.raises(StageRefused) as caught:
        handle(Stage.SHARE_KEYS, states[1], ShareKeys(1, wrong_round, True, routed[1]))
    assert "round 3, not 2" in str(caught.value.cause)
    assert caught.value.state.stage is Stage.ABORTED and caught.value.state.values is None
    assert states[1].stage is Stage.ADVERTISE_KEYS  # the state passed in is unchanged


def test_state_decode_errors_name_the_key_value_and_allowed():
    _, _, _, states, _ = _round()
    arrays = states[1].protocol.to_arrays()
    assert _same(SecAggClientState.from_arrays(arrays).to_arrays(), arrays)
    cases = [
        ({**arrays, "stage": np.array(9)}, "'stage' = 9; allowed: an integer in [0, 6]"),
        ({**arrays, "extra": np.array(1)}, "unknown entry 'extra'; allowed:"),
        ({**arrays, "contributes": np.zeros(2, np.int64)}, "'contributes' = [0, 0]"),
        ({**arrays, "seed": np.zeros(3)}, "'seed' is float64; allowed: an integer array"),
        ({k: v for k, v in arrays.items() if k != "session"}, "'session' is missing"),
    ]
    for broken, needle in cases:
        with pytest.raises(ValueError, match="not a SecAgg\\+ client state") as caught:
            SecAggClientState.from_arrays(broken)
        assert needle in str(caught.value)
    config = SecAggConfig(COUNT, 4, 3, LENGTH).to_record()
    partial = {**arrays, "client_id": np.array(1), "config.degree": np.array(config["degree"])}
    with pytest.raises(ValueError, match="'config.num-clients': missing; allowed: an integer"):
        SecAggClientState.from_arrays(partial)
    assert DEFAULT_FIELD.exponent == SecAggConfig(COUNT, 4, 3, LENGTH).to_record()[
        SecAggKeys.FIELD_EXPONENT
    ]
