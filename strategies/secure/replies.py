"""The first train replies of a secure-sum round, checked at the release boundary.

Every reply is checked before it is used: it must come from a node asked this round, once, and
hold exactly the secure sum's record (:attr:`~strategies.secure.SecureSum.reply_key`, plus
``metrics`` when the client sends them in the clear); the secure sum parses the record
(:meth:`~strategies.secure.SecureSum.payload`). A bad reply rejects its client for the round,
with the reason. On a grid with a release boundary each accepted reply is claimed for the
mechanism (consumed once: a reply handed twice is refused). An error reply is a dropout; one
that says the client refused a relayed key (:class:`protocols.channels.KeySubstitution`) is
named.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from flwr.app import Message, MetricRecord, RecordDict
from flwr.serverapp import Grid

from fedsim.engine.boundary import boundary_of
from protocols.channels import KeySubstitution
from strategies.secure.release import SecureSum
from strategies.secure.secagg_messages import MALFORMED


@dataclass
class FirstReplies:
    """The round's first replies: node -> parsed payload, rejected node -> reason, the metric
    records clients sent in the clear, node -> why it refused a key the server relayed."""

    accepted: dict[int, Any] = field(default_factory=dict)
    rejected: dict[int, str] = field(default_factory=dict)
    clear: list[MetricRecord] = field(default_factory=list)
    key_refusals: dict[int, str] = field(default_factory=dict)


def reply_payload(content: RecordDict, secure: SecureSum, length: int) -> Any:
    """A train reply's payload for ``secure`` (``length`` elements); ValueError if it is not
    one."""
    key, kind = secure.reply_key, secure.reply_kind
    if set(content.keys()) - {"metrics"} != {key} or not isinstance(content[key], kind):
        raise ValueError(f"it must hold exactly {key!r} (and 'metrics')")
    if "metrics" in content and not isinstance(content["metrics"], MetricRecord):
        raise ValueError("'metrics' must be a MetricRecord")
    return secure.payload(content[key], length)


def first_replies(
    replies: Iterable[Message],
    secure: SecureSum,
    *,
    asked: set[int],
    grid: Grid | None,
    mechanism: Any,
    length: int,
) -> FirstReplies:
    """Check ``replies`` (answers to instructions sent to ``asked``), claiming each accepted
    one for ``mechanism`` at ``grid``'s release boundary."""
    out = FirstReplies()
    clear: dict[int, MetricRecord] = {}
    seen: set[int] = set()
    boundary = boundary_of(grid)
    for reply in replies:
        node = int(reply.metadata.src_node_id)
        if reply.has_error():  # the client failed: a dropout (or refused a relayed key)
            reason = str(getattr(reply.error, "reason", ""))
            if reason.startswith(KeySubstitution.__name__):
                out.key_refusals[node] = reason.splitlines()[0][:500]
            continue
        try:
            if node not in asked or node in seen:
                raise ValueError("a train reply from a node not asked, or a second one")
            if boundary is not None:  # the release boundary: each reply consumed once
                boundary.claim([reply], mechanism)
            seen.add(node)
            out.accepted[node] = reply_payload(reply.content, secure, length)
        except MALFORMED as error:
            out.rejected[node] = f"train reply: {error}"
            continue
        if "metrics" in reply.content:
            clear[node] = reply.content["metrics"]
    for node in out.rejected:
        out.accepted.pop(node, None)
        clear.pop(node, None)
    out.clear = list(clear.values())
    return out


def clear_train_loss(clear: Iterable[MetricRecord], default_weight: float | None) -> float | None:
    """The ``num-examples``-weighted mean ``train_loss`` of metrics clients sent in the clear
    (``default_weight`` for a record without ``num-examples``; records without a finite
    positive weight and a finite loss are left out); None when none is left."""
    pairs = [(m.get("num-examples", default_weight), m.get("train_loss")) for m in clear]
    pairs = [(w, v) for w, v in pairs if _number(w) and w > 0 and _number(v)]
    if not pairs:
        return None
    return sum(w * v for w, v in pairs) / sum(w for w, _ in pairs)


def _number(value: object) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)
