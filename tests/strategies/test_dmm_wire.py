"""strategies.secure.dmm.wire: the typed codec of a full-mode instruction's ``dmm.share.*`` entries
(:class:`ShareConfig`): a round trip for one client's and for a folded cohort's instruction, the
entries named by :class:`DMMKeys`, and decode errors naming the key, the value and what is
allowed."""

from __future__ import annotations

import pytest
from flwr.app import ConfigRecord

from protocols.dmm.common import DMMKeys, RoundKeys
from strategies.secure.dmm.wire import (
    ShareConfig,
    cohort_config,
    round_keys_config,
    round_keys_from_config,
)

PREFIX = DMMKeys.SHARE_PREFIX


def _keys(proofs: bool = True) -> RoundKeys:
    seats = (0, 2, 3)
    return RoundKeys(
        round=4,
        step=2,
        rows=1,
        n=5,
        t=1,
        k=2,
        field_exponent=61,
        dim=8,
        session_id=bytes(range(16)),
        member_keys={j: bytes([j]) * 32 for j in seats},
        member_proofs={j: bytes([7, j]) for j in seats} if proofs else {},
    )


@pytest.mark.parametrize("proofs", [True, False])
def test_one_clients_share_config_round_trips(proofs):
    share = ShareConfig(_keys(proofs), party=3, committee=(2, (11, 12, 13, 14, 15)))
    record = share.to_record()
    assert all(k.startswith(PREFIX) for k in record)
    assert {PREFIX + k for k in DMMKeys.SHARE} <= set(record)
    assert (PREFIX + DMMKeys.MEMBER_PROOFS in record) is proofs
    back = ShareConfig.from_record(ConfigRecord(record), rows=1)
    assert back == share
    assert round_keys_config(_keys(proofs), 3, (2, [11, 12, 13, 14, 15])) == record


def test_a_folded_cohorts_share_config_round_trips_and_places_each_node():
    record = cohort_config(_keys(), [40, 41, 42])
    assert PREFIX + DMMKeys.PARTY not in record and list(record)[-1] == PREFIX + DMMKeys.COHORT
    share = ShareConfig.from_record(ConfigRecord(record), rows=1)
    assert share.cohort == (40, 41, 42) and share.party is None and share.committee is None
    assert round_keys_from_config(ConfigRecord(record), 1, node=42) == (_keys(), 2)
    with pytest.raises(ValueError, match="node 9 is not in the round's dmm.share.cohort"):
        round_keys_from_config(ConfigRecord(record), 1, node=9)


@pytest.mark.parametrize(
    "name, value, needle",
    [
        (DMMKeys.T, "1", "dmm.share.t='1'; allowed: an integer"),
        (DMMKeys.PARTY, True, "dmm.share.party=True; allowed: an integer"),
        (DMMKeys.MEMBERS, [0, "2", 3], "dmm.share.members=[0, '2', 3]; allowed: a list of int"),
        (DMMKeys.MEMBERS, [0, True, 3], "dmm.share.members=[0, True, 3]; allowed: a list of int"),
        (DMMKeys.MEMBERS, [0, 2.0, 3], "dmm.share.members=[0, 2.0, 3]; allowed: a list of int"),
        (DMMKeys.SESSION, "abc", "dmm.share.session='abc'; allowed: bytes"),
        (DMMKeys.MEMBER_KEYS, [b"a"], "has 1; allowed: one key per seat"),
        (DMMKeys.STEP, None, "lacks ['dmm.share.step']"),
    ],
)
def test_decode_errors_name_key_value_and_allowed(name, value, needle):
    record = round_keys_config(_keys(), 1)
    if value is None:
        del record[PREFIX + name]
    else:
        record[PREFIX + name] = value
    with pytest.raises(ValueError) as caught:
        ShareConfig.from_record(record, rows=1)
    assert needle in str(caught.value)
