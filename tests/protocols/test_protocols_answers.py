"""The typed codecs of the committee members' answers (protocols.committee.common.ShareAnswer,
ReleaseAnswer) and of a DMM group's RELEASE answer (protocols.dmm.common.ReleaseAnswer): the
record form round-trips under the names of the protocol's keys class, and an answer that lacks
an entry is refused naming it."""

from __future__ import annotations

import pytest

from protocols.committee.common import CommitteeWire, ReleaseAnswer, ShareAnswer
from protocols.dmm.common import DMMKeys
from protocols.dmm.common import ReleaseAnswer as DMMReleaseAnswer


def test_committee_answers_round_trip_by_name():
    share = ShareAnswer([1, 2, 4], {7: [3]})
    record = share.to_record()
    assert set(record) == {CommitteeWire.ONLINE, CommitteeWire.REFUSED}
    assert ShareAnswer.from_record(record) == share
    release = ReleaseAnswer([1, 2], [b"a", b"b"], [2])
    record = release.to_record()
    assert list(record) == [CommitteeWire.MEMBERS, CommitteeWire.ROWS, CommitteeWire.LATE]
    assert ReleaseAnswer.from_record(record) == release


@pytest.mark.parametrize("missing", [CommitteeWire.MEMBERS, CommitteeWire.ROWS, CommitteeWire.LATE])
def test_a_committee_release_answer_without_an_entry_names_it(missing):
    record = ReleaseAnswer([1], [b"a"], []).to_record()
    del record[missing]
    with pytest.raises(ValueError, match=f"a RELEASE answer \\(dict\\) lacks '{missing}'"):
        ReleaseAnswer.from_record(record)
    with pytest.raises(ValueError, match="a SHARE answer \\(NoneType\\) lacks 'online'"):
        ShareAnswer.from_record(None)


def test_dmm_release_answer_round_trips_and_reads_a_missing_entry_as_empty():
    answer = DMMReleaseAnswer([0, 3], [b"x", b"y"], [3])
    record = answer.to_record()
    assert tuple(record) == DMMKeys.RELEASE_ENTRIES
    assert DMMReleaseAnswer.from_record(record) == answer
    assert DMMReleaseAnswer.from_record({"seats": [1]}) == DMMReleaseAnswer([1], [], [])
