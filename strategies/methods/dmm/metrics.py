"""What a released DMM round reports (docs/dmm-design.md, steps 3-7): the bytes of its
transcript (in total, per client that sent, per member sent and received, per next member
received), who the decoding corrected or rejected, member dropouts against the planned bound,
and, with ``metrics_in_clear``, the clients' mean train loss."""

from __future__ import annotations

import logging
from typing import Any

import numpy as np
from flwr.app import Message

from protocols.dmm.release import RoundOutput
from protocols.kit import NEW_ID_BASE, OLD_ID_BASE, SEAT_ID_BASE
from strategies.secure.dmm.state import RoundState

log = logging.getLogger(__name__)


def _mean_over(transcript, ids, direction: str) -> float:
    """Mean bytes ``direction`` (sender / receiver) each of ``ids`` over those with any."""
    values = [transcript.nbytes(**{direction: i}) for i in ids]
    values = [v for v in values if v]
    return float(np.mean(values)) if values else 0.0


def bytes_per_client(state: RoundState, transcript) -> float:
    """SHARE bytes the clients (or their workers' folds) sent, per client that sent."""
    senders = {state.party(nodes): len(nodes) for nodes in state.batches.values()}
    folded = {n for nodes in state.batches.values() for n in nodes}
    senders.update({p: 1 for node, p in state.sent.items() if node not in folded})
    counted = {p: w for p, w in senders.items() if transcript.nbytes(sender=p)}
    total = sum(transcript.nbytes(sender=p) for p in counted)
    return float(total / sum(counted.values())) if counted else 0.0


def byte_metrics(state: RoundState, transcript, seats: int) -> dict[str, float]:
    """The round's ``dmm-bytes*`` metrics for a committee of ``seats`` members."""
    members = range(seats)
    return {
        "dmm-bytes": transcript.nbytes(),
        "dmm-bytes-per-client": bytes_per_client(state, transcript),
        "dmm-bytes-per-member-sent": float(
            np.mean([transcript.nbytes(sender=SEAT_ID_BASE + j) for j in members])
            + np.mean([transcript.nbytes(sender=OLD_ID_BASE + j) for j in members])
        ),
        "dmm-bytes-per-member-received": _mean_over(
            transcript, [SEAT_ID_BASE + j for j in members], "receiver"
        ),
        "dmm-bytes-per-next-member-received": _mean_over(
            transcript, [NEW_ID_BASE + j for j in members], "receiver"
        ),
    }


def clear_metrics(replies: list[Message]) -> dict[str, Any]:
    """``metrics_in_clear`` = 1 and the mean ``train_loss`` of the replies whose metrics
    reached the server in the clear (none: nothing)."""
    in_clear = [r for r in replies if not r.has_error() and "metrics" in r.content]
    if not in_clear:
        return {}
    out: dict[str, Any] = {"metrics_in_clear": 1}
    losses = [
        float(r.content["metrics"]["train_loss"])
        for r in in_clear
        if "train_loss" in r.content["metrics"]
    ]
    if losses:
        out["train_loss"] = float(np.mean(losses))
    return out


def round_metrics(
    state: RoundState,
    output: RoundOutput,
    *,
    step: int,
    seats: int,
    member_dropouts: int,
) -> dict[str, Any]:
    """A released round's protocol metrics: contributors, step, bytes, verification, the
    members corrected / rejected (as client ids), dropouts and the handoff."""
    out: dict[str, Any] = {
        "dmm-clients": output.contributors or len(output.clients),
        "dmm-step": step,
        **byte_metrics(state, output.transcript, seats),
        "dmm-verified": int(output.verified),
        "dmm-corrected-members": [state.seat_client(s) for s in output.corrected],
        "dmm-rejected-members": [state.seat_client(s) for s in sorted(output.rejected_members)],
        "dmm-member-dropouts": len(output.dropped),
        "dmm-beyond-bound": int(len(output.dropped) > member_dropouts),
        "dmm-handed-over": int(output.handed_over),
    }
    for seat, reason in output.rejected_members.items():
        log.warning("DMM round %s: member seat %s rejected: %s", output.step, seat, reason)
    return out
