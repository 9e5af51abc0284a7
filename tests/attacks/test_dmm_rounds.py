"""The server re-sends a round to DMM clients with another model.

A DMM client's rounding, noise rows and share randomness for round r come from its own secret
and r. A server that sends round r again with another global model used to get the same noise
on a different update: in ideal mode the two replies carry the same noise rows next to two
updates; in full mode each seat's two share rows differ by a share of the noise-free
difference of the updates under the same randomness. Every client now answers a round once
(its record in its own state, :mod:`strategies.plumbing.answered_rounds`): a re-sent round, or an
earlier one, is refused before anything is drawn.
"""

from __future__ import annotations

import numpy as np
import pytest
from dmm_support import SECRETS, digits_setup, make_dmm
from flwr.app import ConfigRecord, Context, Message, RecordDict
from flwr.supercore.task_identity import TaskIdentity

from fedsim.engine.client_registry import NODE_ID_OFFSET
from fedsim.engine.dmm_committee import CommitteeHost
from fedsim.models import initial_arrays
from fedsim.randomness import NODE_SECRET_KEY
from fedsim.record_codec import to_numpy, to_record
from protocols.dmm.common import DMMKeys
from strategies.methods.dmm import dmm_client_app

CLIENTS = 12


@pytest.fixture(autouse=True)
def _identity():
    TaskIdentity.run_id, TaskIdentity.node_id, TaskIdentity.task_id = 1, 1, 1


def _instruction(local_engine, mode: str, server_round: int, shift: float) -> Message:
    """Round ``server_round``'s instruction to the first client, for the model shifted by
    ``shift`` (a fresh server each time: nothing it remembers stops it)."""
    data, dataset, model, inner = digits_setup(CLIENTS)
    strategy = make_dmm(mode, CLIENTS, 4)
    strategy.bind_committee_host(CommitteeHost(SECRETS))
    grid = local_engine.open_run(inner, CLIENTS, datasets=((data, dataset),))
    arrays = {k: v + shift for k, v in initial_arrays(model, 0).items()}
    messages = list(strategy.configure_train(server_round, to_record(arrays), ConfigRecord(), grid))
    first = min(messages, key=lambda m: m.metadata.dst_node_id)
    return Message(first.content, first.metadata.dst_node_id, "train")


@pytest.mark.parametrize("mode", ["ideal", "full"])
def test_a_round_sent_again_with_another_model_is_refused(local_engine, mode):
    _, _, _, inner = digits_setup(CLIENTS)
    app = dmm_client_app(inner)
    partition = 0
    node_config = {"partition-id": partition, "num-partitions": CLIENTS,
                   NODE_SECRET_KEY: SECRETS.client(partition).token()}  # fmt: skip
    context = Context(run_id=1, node_id=NODE_ID_OFFSET + partition, node_config=node_config,
                      state=RecordDict(), run_config={})  # fmt: skip
    first = app(_instruction(local_engine, mode, 3, 0.0), context)
    assert not first.has_error()
    for server_round in (3, 2):
        try:
            again = app(_instruction(local_engine, mode, server_round, 0.5), context)
        except RuntimeError as refusal:
            assert "already answered dmm round 3" in str(refusal)
            continue
        leak = "with the streams of a round it had answered"
        if mode == "ideal" and server_round == 3:
            same = np.array_equal(
                to_numpy(first.content[DMMKeys.NOISE])[DMMKeys.NOISE],
                to_numpy(again.content[DMMKeys.NOISE])[DMMKeys.NOISE],
            )
            leak = f"same noise rows on another update: {same}"
        pytest.fail(f"{mode}: the client answered round {server_round} again ({leak})")
