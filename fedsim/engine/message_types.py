"""The message types fedsim's grid runs: those Flower's ClientApps execute (``train``,
``evaluate``, ``query``, each optionally ``.<action>``, and the legacy ``get_parameters`` and
``get_properties``); any other is refused whole, naming it, before a client runs."""

from __future__ import annotations

from flwr.app.metadata import validate_message_type
from flwr.common.constant import MessageTypeLegacy

#: the legacy message types a ClientApp built from a ``client_fn`` executes
LEGACY_MESSAGE_TYPES = (MessageTypeLegacy.GET_PARAMETERS, MessageTypeLegacy.GET_PROPERTIES)
#: the categories of Flower's Message API a ClientApp executes (each optionally ``.<action>``)
MESSAGE_CATEGORIES = ("train", "evaluate", "query")


class UnsupportedMessage(ValueError):
    """A ServerApp pushed a message type that no ClientApp executes (``system``, ``reconnect``,
    or one outside Flower's format); nothing of the push was sent."""


def runnable_message_type(message_type: str) -> bool:
    """Whether a ClientApp executes ``message_type``: ``train``, ``evaluate`` or ``query``,
    optionally followed by ``.<action>`` (a Python identifier), as Flower's
    ``validate_message_type`` has it but without its runtime's own ``system``; or a legacy
    ``get_parameters`` / ``get_properties``."""
    if message_type in LEGACY_MESSAGE_TYPES:
        return True
    category, _, action = message_type.partition(".")
    return (
        category in MESSAGE_CATEGORIES
        and (not action or action.isidentifier())
        and validate_message_type(message_type)
    )


def unsupported(message_type: str, node_id: int) -> UnsupportedMessage:
    """The error for a message of ``message_type`` to ``node_id``."""
    why = {
        "system": "Flower's runtime keeps 'system' messages to itself; no ClientApp handles one",
        "reconnect": "Flower's deprecated 'reconnect' has no ClientApp handler",
    }.get(message_type, "not a type Flower's ClientApps execute")
    return UnsupportedMessage(
        f"message type {message_type!r} (to node {node_id}) cannot run on fedsim's grid: {why}; "
        "allowed: 'train', 'evaluate' or 'query', each optionally followed by '.<action>', "
        f"or the legacy {' or '.join(repr(t) for t in LEGACY_MESSAGE_TYPES)}"
    )

