"""Each party answers a round once: a client's own record of the last round it answered.

A client whose rounding, noise and share randomness for round r are a function of its secret
and r (:meth:`fedsim.randomness.PartySecret.generator`) must never answer round r twice: a
server that sends round r again with another model would get the same noise on a different
update, and the difference of the two replies is noise-free. Before it draws anything for a
round the client claims the round (:func:`claim_round`); a round it already answered, or one
before it, is refused. Round numbers only grow, so one integer per protocol is the whole record.

The record is the client's own state (``context.state[ANSWERED_KEY]``): under fedsim's engine
the state store seals it with the client's secret and keeps it across rounds and restarts
(``--resume`` returns every state to the checkpoint it resumes from, and the run repeats the
rounds after it from that checkpoint); under Flower's runtime it is the node's own memory.
"""

from __future__ import annotations

from flwr.app import ConfigRecord, RecordDict

ANSWERED_KEY = "fedsim.answered"
"""``context.state`` record: protocol label -> the last server round the client answered."""


def last_answered(state: RecordDict, protocol: str) -> int | None:
    """The last round of ``protocol`` this client answered (None: none); ValueError when its
    record is not one this module wrote."""
    record = state.get(ANSWERED_KEY)
    if record is None:
        return None
    if not isinstance(record, ConfigRecord):
        raise ValueError(f"context.state[{ANSWERED_KEY!r}] is a {type(record).__name__}")
    value = record.get(protocol)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"context.state[{ANSWERED_KEY!r}][{protocol!r}] = {value!r}")
    return value


def claim_round(state: RecordDict, protocol: str, server_round: int) -> None:
    """Record that this client answers ``server_round`` of ``protocol``, or raise RuntimeError
    (before anything is drawn for the round) when it already answered that round or a later
    one: a round is answered once, never again with the same streams."""
    if isinstance(server_round, bool) or not isinstance(server_round, int):
        raise ValueError(f"server_round={server_round!r}; allowed: an integer")
    last = last_answered(state, protocol)
    if last is not None and server_round <= last:
        raise RuntimeError(
            f"this client already answered {protocol} round {last}; it refuses round "
            f"{server_round} (each round is answered once, never re-noised with the same "
            "streams)"
        )
    record = state.get(ANSWERED_KEY)
    record = ConfigRecord(dict(record)) if isinstance(record, ConfigRecord) else ConfigRecord()
    record[protocol] = server_round
    state[ANSWERED_KEY] = record
