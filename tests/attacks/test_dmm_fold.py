"""DMM's worker-side fold (strategies/secure/dmm/fold.py) against the server: a client's sharing
inputs never leave a worker unsealed -- not when the fold fails, not under a runtime whose workers
do not fold -- and a folded reply cannot claim clients it does not hold."""

from __future__ import annotations

import pickle
from pathlib import Path

import numpy as np
import pytest
from dmm_support import SECRETS, digits_setup, make_dmm, run_dmm
from flwr.app import ArrayRecord, ConfigRecord, Context, Message, MetricRecord, RecordDict
from flwr.clientapp import ClientApp
from flwr.supercore.task_identity import TaskIdentity

from fedsim.engine import ClientAppSource, ClientWorker
from fedsim.engine.client_registry import NODE_ID_OFFSET
from fedsim.engine.dmm_committee import CommitteeHost
from fedsim.engine.worker import ClientBatch, Content, RunSpec
from fedsim.randomness import NODE_SECRET_KEY
from fedsim.record_codec import to_record
from fedsim.worker_reduce import FOLDS_KEY, Accumulator, Reducer, ReductionError, attach_reducer
from protocols.dmm.common import DMMKeys
from strategies.methods.dmm import dmm_client_app


class _Unfoldable(Reducer):
    """A confidential reducer whose fold fails (at ``add`` or at ``result``)."""

    confidential = True
    params = ("stage",)

    def __init__(self, stage: str = "add") -> None:
        self.stage = stage

    def accumulator(self, instruction: RecordDict) -> Accumulator:
        stage = self.stage

        class Failing(Accumulator):
            def add(self, reply: Message) -> None:
                if stage == "add":
                    raise ReductionError("cannot fold")

            def result(self) -> Message:
                raise ReductionError("cannot fold")

        return Failing()


@pytest.mark.parametrize("stage", ["add", "result"])
def test_a_worker_withholds_replies_a_confidential_fold_cannot_take(stage):
    TaskIdentity.run_id, TaskIdentity.node_id, TaskIdentity.task_id = 1, 1, 1
    worker = ClientWorker()
    tests = str(Path(__file__).resolve().parents[2])
    source = ClientAppSource("toy_app:app", tests)
    spec = RunSpec(run_id=1, num_clients=10, run_config={}, app=source)
    assert spec.node_config(NODE_ID_OFFSET + 1, None)[FOLDS_KEY] is True
    worker.start_run(spec)
    content = RecordDict(
        {"arrays": to_record({"w": np.zeros(3, np.float32)}), "config": ConfigRecord({"step": 1.0})}
    )
    messages = attach_reducer(
        [Message(content, NODE_ID_OFFSET + p, "train") for p in range(3)], _Unfoldable(stage)
    )
    for i, m in enumerate(messages):
        m.metadata.__dict__["_message_id"] = f"m{i}"
    result = worker.run_batch(
        ClientBatch(
            batch_id=0,
            metadata=[m.metadata for m in messages],
            content_index=[0, 0, 0],
            contents=[Content(1, pickle.dumps(content))],
            states={},
            reducer=_Unfoldable(stage),
        )
    )
    assert len(result.replies) == 3 and all(r.has_error() for r in result.replies)
    assert "withheld" in result.replies[0].error.reason
    assert result.succeeded == 0 and result.bytes_up == 0
    assert result.states == {}  # failed clients keep no state, as any failed client


def _instruction(local_engine):
    """A folded round's shared instruction, as the strategy builds it."""
    strategy = make_dmm("full", 12, 3, worker_fold=True)
    strategy.bind_committee_host(CommitteeHost(SECRETS))
    grid = local_engine.open_run(ClientApp(), 12)
    arrays = ArrayRecord({"w": to_record({"w": np.zeros(8)})["w"]})
    messages = list(strategy.configure_train(1, arrays, ConfigRecord(), grid))
    assert len({id(m.content) for m in messages}) == 1  # one content: batches can fold
    return messages[0]


def test_a_client_outside_a_folding_worker_seals_its_own_shares(local_engine):
    message = _instruction(local_engine)
    inner = ClientApp()

    @inner.train()
    def train(msg: Message, context: Context) -> Message:
        arrays = msg.content["arrays"]
        metrics = MetricRecord({"num-examples": 1})
        return Message(RecordDict({"arrays": arrays, "metrics": metrics}), reply_to=msg)

    app = dmm_client_app(inner)

    def reply(node_config):
        node = message.metadata.dst_node_id
        config = {"partition-id": node - NODE_ID_OFFSET, NODE_SECRET_KEY: SECRETS.client(0).token()}
        context = Context(1, node, {**config, **node_config}, RecordDict(), {})
        return app(message, context)

    assert set(reply({}).content.keys()) == {DMMKeys.SEALED}  # e.g. Flower's runtime
    assert set(reply({FOLDS_KEY: "yes"}).content.keys()) == {DMMKeys.SEALED}  # only True counts
    assert set(reply({FOLDS_KEY: True}).content.keys()) == {DMMKeys.FOLD, DMMKeys.PADS}


def test_a_folded_reply_cannot_claim_unsampled_clients(local_engine):
    setup = digits_setup(12)
    forged = {}

    def claim(server_round, replies):
        if server_round == 2:
            good = [r for r in replies if not r.has_error()]
            assert len(good) >= 2
            victim = good[0]
            forged["node"] = int(victim.metadata.src_node_id)
            forged["held"] = list(victim.content[DMMKeys.BATCH]["nodes"])
            victim.content[DMMKeys.BATCH] = ConfigRecord({"nodes": [*forged["held"], 10**9]})
        return replies

    strategy = make_dmm("full", 12, 3, worker_fold=True)
    _, recorded = run_dmm(local_engine, setup, strategy, 3, alter=claim)
    assert recorded.metrics[1]["rejected"] == [forged["node"]]
    assert recorded.outputs[1].contributors == 12 - len(forged["held"])
    assert recorded.metrics[2]["rejected"] == [] and recorded.outputs[2].contributors == 12


def test_a_worker_cannot_count_a_client_whose_noise_it_left_out(local_engine, monkeypatch):
    """A compromised worker folds every client of its batch but one, and still lists that one:
    the ledger would count 12 clients' noise in a sum that holds 11. Each listed client's pad
    is removed by every seat, so the left-out client's pad stays in every honest seat's share:
    no release decodes, and the round aborts instead of releasing with a count it cannot prove
    (it is accounted as opened, for the clients the members verified, and the run halts)."""
    from strategies.secure.dmm import fold as dmm_fold  # noqa: PLC0415

    add, left_out = dmm_fold._ShareFoldAccumulator.add, {}

    def compromised(self, reply):
        node = int(reply.metadata.src_node_id)
        if self.keys.round != 2 or left_out or not self.nodes:
            return add(self, reply)
        left_out["node"], real = node, self.fold.add

        def list_only(*args):  # keep the client's proof (if any), drop its rows and noise
            client = getattr(args[0], "client", None) if args else None
            if client is not None:
                self.fold.clients.append(client)

        self.fold.add = list_only
        try:
            return add(self, reply)
        finally:
            self.fold.add = real

    monkeypatch.setattr(dmm_fold._ShareFoldAccumulator, "add", compromised)
    strategy = make_dmm("full", 12, 3, worker_fold=True)
    # no timeout: a worker folds batches of several clients (under one, each is its own batch)
    _, recorded = run_dmm(local_engine, digits_setup(12), strategy, 3, timeout=None)
    assert "node" in left_out
    released = recorded.outputs[1]
    assert released is None, (
        f"round 2 released with {released.contributors} clients counted while the fold left out "
        f"node {left_out['node']}'s noise"
    )
    assert recorded.metrics[1]["dmm-aborted"] == 1


def _fold(keys, parties, updates, noises, party):
    from protocols.dmm.client import MaskedFold, mask_client_shares  # noqa: PLC0415

    fold = MaskedFold(keys)
    for c in parties:
        rng = np.random.default_rng([7, c])
        fold.add(mask_client_shares(keys, c, updates[c], noises[c], rng))
    return fold.seal(party)


def test_the_server_rejects_malformed_fold_lists_and_the_round_counts_the_proved_ones():
    import dataclasses  # noqa: PLC0415

    from dmm_support import Committees, Reference, inputs, seal_all  # noqa: PLC0415

    from fedsim.privacy.dmm import IntegerMechanism  # noqa: PLC0415
    from fedsim.privacy.matrix.banded import banded  # noqa: PLC0415
    from protocols.channels import Envelope  # noqa: PLC0415

    mechanism = IntegerMechanism(banded(6, 3), 10)
    run = Committees(mechanism.integer_matrix, 8)
    updates, noises = inputs(run.full.schedule, 0, 60, 8, 13)
    keys = run.full.open_round(0)
    own = {c: updates[c] for c in range(4)}
    sealed = seal_all(keys, own, {c: noises[c] for c in range(4)})
    good = _fold(keys, (10, 11), updates, noises, 20)

    def bad(parties, party, change):
        fold = _fold(keys, parties, updates, noises, party)
        return dataclasses.replace(fold, folded=change(fold.folded))

    def restage(clients):
        first = clients[0]
        pads = {j: Envelope(e.sender, e.receiver, e.round, "SHARE", e.nonce, e.ciphertext)
                for j, e in first.pads.items()}  # fmt: skip
        return (dataclasses.replace(first, pads=pads), *clients[1:])

    hostile = {
        30: bad((30, 31), 32, lambda cs: (cs[0], cs[0])),  # one client listed twice
        33: bad((34,), 33, lambda cs: (dataclasses.replace(cs[0], party=33),)),  # the fold's own
        35: bad((36,), 35, restage),  # a pad seed sealed at another stage
        37: bad((38,), 37, lambda cs: (dataclasses.replace(cs[0], public_key=b"x"),)),
        39: bad((40,), 39, lambda cs: (dataclasses.replace(cs[0], pads={}),)),  # no seeds
        41: bad((10,), 41, lambda cs: cs),  # lists a client another fold already holds
    }
    out = run.full.finish_round({**sealed, 20: good, **hostile}, run.new_pool())
    assert set(out.rejected) == set(hostile)
    assert out.contributors == 6  # 4 own messages and the 2 clients the good fold proved
    expected = Reference(mechanism.integer_matrix).release(updates, noises, [0, 1, 2, 3, 10, 11])
    np.testing.assert_array_equal(out.release, expected)
