"""The server against FedAvg with secure aggregation (no DP): everything the Grid hands it.

The server records every reply the Grid gives it in a round of FedAvg over ``secure_sum =
"secagg"`` (SecAgg+) or ``"committee"`` and looks there for any client's update: its
fixed-point encoding (as field elements, signed integers or bytes), or any array that agrees
with it in more than a fifth of its coordinates or decodes to within 10% of the weighted update.
It finds masked inputs (SecAgg+) or ciphertexts (committee) only -- and yet the model it
publishes is FedAvg's, so the sum is all it learned.
"""

from __future__ import annotations

import numpy as np
import pytest
from flwr.app import ArrayRecord, ConfigRecord, Context, Message, MetricRecord, RecordDict
from flwr.clientapp import ClientApp
from flwr.serverapp.strategy import FedAvg

from fedsim.engine.committee import Committee
from fedsim.engine.rounds import run_rounds
from fedsim.randomness import RunSecret
from fedsim.record_codec import to_numpy, to_record
from protocols.field import DEFAULT_FIELD
from protocols.secagg.common import SecAggKeys
from strategies.plumbing.secure_aggregation import FixedPoint, SecureAggregation, secure_client_app

D, CLIENTS, WEIGHT, PHRASE = 16, 8, 5, "tests"
CODEC = FixedPoint(16, 100.0)


def secret_update(partition: int) -> np.ndarray:
    """Client ``partition``'s model update: unknown to the server."""
    return np.random.default_rng(2000 + partition).normal(size=D) * 0.3


inner = ClientApp()


@inner.train()
def _train(message: Message, context: Context) -> Message:
    arrays = to_numpy(message.content["arrays"])
    trained = arrays["w"] + secret_update(int(context.node_config["partition-id"]))
    content = RecordDict(
        {"arrays": to_record({"w": trained}), "metrics": MetricRecord({"num-examples": WEIGHT})}
    )
    return Message(content, reply_to=message)


class Recording:
    """The server's Grid, keeping every reply it receives."""

    def __init__(self, grid) -> None:
        self.grid, self.received = grid, []

    def __getattr__(self, name):
        return getattr(self.grid, name)

    def send_and_receive(self, messages, *, timeout=None):
        replies = list(self.grid.send_and_receive(list(messages), timeout=timeout))
        self.received.extend(replies)
        return replies


def server(secure_sum: str) -> SecureAggregation:
    committee = None
    if secure_sum == "committee":
        root = RunSecret.from_passphrase(PHRASE)
        committee = Committee(5, 1, 2, member_secrets={m: root.member(m) for m in range(5)})
    return SecureAggregation(
        FedAvg(min_available_nodes=0, fraction_evaluate=0.0),
        secure_sum=secure_sum,
        seed=3,
        expected_clients=CLIENTS,
        codec=CODEC,
        committee=committee,
    )


def arrays_in(content: RecordDict) -> list[tuple[str, np.ndarray]]:
    out = []
    for name, record in content.items():
        if isinstance(record, ArrayRecord):
            out += [(name, np.asarray(a).ravel()) for a in to_numpy(record).values()]
        if isinstance(record, ConfigRecord):
            for value in record.values():
                for item in value if isinstance(value, list) else [value]:
                    if isinstance(item, bytes) and len(item) % 8 == 0 and item:
                        out.append((name, np.frombuffer(item, dtype=np.int64)))
    return out


def leaks(received: list[Message]) -> list[str]:
    """Where a reply holds (or nearly holds) a client's encoded or weighted update: any
    integer array (or byte string read as int64) of the encoding's length."""
    found = []
    for p in range(CLIENTS):
        weighted = np.append(WEIGHT * secret_update(p), WEIGHT)
        encoding = CODEC.encode(weighted)
        forms = [encoding, DEFAULT_FIELD.decode_signed(encoding)]
        for reply in received:
            for name, array in arrays_in(reply.content):
                if array.size != encoding.size or array.dtype.kind not in "iu":
                    continue
                if any(np.mean(array == form) > 0.2 for form in forms):
                    found.append(f"client {p}: {name} agrees with its encoding")
                    continue
                residues = np.mod(array.astype(np.int64), DEFAULT_FIELD.modulus)
                decoded = DEFAULT_FIELD.decode_signed(residues)
                decoded = decoded.astype(np.float64) / 2.0**CODEC.fractional_bits
                if np.linalg.norm(decoded - weighted) < 0.1 * np.linalg.norm(weighted):
                    found.append(f"client {p}: {name} decodes to its weighted update")
    return found


@pytest.mark.parametrize("secure_sum", ["secagg", "committee"])
def test_the_server_holds_only_masked_or_sealed_inputs(local_engine, client_secrets, secure_sum):
    strategy = server(secure_sum)
    app = client_secrets(secure_client_app(inner), PHRASE)
    grid = Recording(local_engine.open_run(app, CLIENTS, run_config={"seed": 0}))
    final = run_rounds(strategy, grid, to_record({"w": np.zeros(D)}), 1)
    grid.wait_idle()
    release = strategy.last_release
    assert release is not None and release.total is not None, release and release.aborted
    assert len(release.contributors) == CLIENTS
    # what it publishes is FedAvg's mean update (within the quantisation) ...
    mean = np.mean([secret_update(p) for p in range(CLIENTS)], axis=0)
    bound = CODEC.error_bound(CLIENTS, CLIENTS * WEIGHT)
    np.testing.assert_allclose(to_numpy(final)["w"], mean, atol=bound + 1e-12, rtol=0)
    # ... and what it was handed holds no client's update
    train = [r for r in grid.received if r.metadata.message_type == "train"]
    assert len(train) == CLIENTS
    if secure_sum == "secagg":
        masked = [r for r in grid.received if SecAggKeys.MASKED in r.content]
        assert len(masked) == CLIENTS  # the masked inputs did reach it
    assert leaks(grid.received) == []


def test_the_scan_finds_an_update_sent_in_the_clear():
    """The scan is no blind spot: a reply holding a client's encoding is found."""
    encoding = CODEC.encode(np.append(WEIGHT * secret_update(3), WEIGHT))
    content = RecordDict({"secagg.masked": to_record({"masked": encoding})})

    class Reply:
        def __init__(self, content):
            self.content = content

    assert leaks([Reply(content)]) == ["client 3: secagg.masked agrees with its encoding"]
