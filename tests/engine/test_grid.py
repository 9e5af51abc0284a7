"""SimulationGrid on the in-process backend: Flower's Grid contract and fedsim's additions."""

from pathlib import Path

import numpy as np
import pytest
from flwr.app import ConfigRecord, Message, RecordDict
from flwr.serverapp.strategy.strategy_utils import aggregate_arrayrecords

from fedsim.engine import NODE_ID_OFFSET, ClientAppSource, UniformCohort
from fedsim.record_codec import to_numpy, to_record
from fedsim.worker_reduce import WeightedMean, attach_reducer

HERE = str(Path(__file__).parents[1])
TOY = ClientAppSource(reference="toy_app:app", app_dir=HERE)


class Reports:
    def __init__(self):
        self.items = []

    def phase_finished(self, report):
        self.items.append(report)


def content(server_round=1):
    return RecordDict(
        {
            "arrays": to_record({"w": np.zeros(2, np.float32)}),
            "config": ConfigRecord({"server-round": server_round, "step": 1.0}),
        }
    )


def messages(partitions, kind="train", shared=None, server_round=1):
    body = shared if shared is not None else content(server_round)
    return [Message(body, NODE_ID_OFFSET + p, kind) for p in partitions]


def test_send_and_receive_returns_replies_in_node_order(local_engine):
    grid = local_engine.open_run(TOY, 8)
    replies = grid.send_and_receive(messages([5, 2, 7, 0]))
    assert [r.metadata.src_node_id - NODE_ID_OFFSET for r in replies] == [0, 2, 5, 7]
    assert all(r.metadata.reply_to_message_id for r in replies)
    assert grid.send_and_receive([]) == []


def test_push_then_pull(local_engine):
    grid = local_engine.open_run(TOY, 4)
    ids = grid.push_messages(messages([1, 3]))
    assert len(ids) == 2 and len(set(ids)) == 2
    replies = grid.pull_messages(ids)
    assert {r.metadata.reply_to_message_id for r in replies} == set(ids)
    assert grid.pull_messages(ids) == []  # pulled replies are gone


def test_bad_messages_are_refused_with_a_reason(local_engine):
    grid = local_engine.open_run(TOY, 4)
    with pytest.raises(ValueError, match="not a registered client"):
        grid.push_messages([Message(content(), NODE_ID_OFFSET + 4, "train")])
    with pytest.raises(ValueError, match="message type"):
        grid.push_messages([Message(content(), NODE_ID_OFFSET, "fit")])
    reply = grid.send_and_receive(messages([0]))[0]
    with pytest.raises(ValueError, match="reply"):
        grid.push_messages([reply])


def test_participation_decides_node_ids_per_phase(local_engine):
    cohort = UniformCohort(1000, 10, seed=5)
    grid = local_engine.open_run(TOY, 1000, participation=cohort)
    first = list(grid.get_node_ids())
    assert first == list(grid.get_node_ids())  # stable within a phase
    assert first == [NODE_ID_OFFSET + int(p) for p in cohort.cohort(0)]
    grid.send_and_receive(messages([p - NODE_ID_OFFSET for p in first]))
    second = list(grid.get_node_ids())
    assert second == [NODE_ID_OFFSET + int(p) for p in cohort.cohort(1)] and second != first


def test_client_state_follows_the_client_across_phases(local_engine):
    grid = local_engine.open_run(TOY, 4)
    for expected in (1, 2, 3):
        replies = grid.send_and_receive(messages([1, 2]))
        assert [r.content["metrics"]["calls"] for r in replies] == [expected, expected]
    assert len(grid.state_store) == 2


def test_phase_reports_count_clients_bytes_and_rounds(local_engine):
    reports = Reports()
    grid = local_engine.open_run(TOY, 6, observer=reports, run_config={"fail": "3"})
    grid.send_and_receive(messages(range(6), server_round=4))
    grid.send_and_receive(messages([0, 1], kind="evaluate", server_round=4))
    train, evaluate = reports.items
    assert (train.server_round, train.message_type, train.messages) == (4, "train", 6)
    assert (train.succeeded, train.failed, train.timed_out) == (5, 1, 0)
    assert train.bytes_down == 6 * (len(content()["arrays"]["w"].data) + 16)
    assert train.bytes_up > 0 and train.compute_s > 0
    assert train.client_metrics["pid"] == pytest.approx((0 + 1 * 2 + 2 * 3 + 4 * 5 + 5 * 6) / 17)
    assert evaluate.message_type == "evaluate" and evaluate.succeeded == 2


def test_reducer_gives_one_reply_equal_to_fedavg(local_engine):
    grid = local_engine.open_run(TOY, 20, run_config={"fail": "7"})
    raw = [r for r in grid.send_and_receive(messages(range(20))) if not r.has_error()]
    reduced_messages = attach_reducer(messages(range(20)), WeightedMean())
    replies = grid.send_and_receive(reduced_messages)
    folded = [r for r in replies if not r.has_error()]
    errors = [r for r in replies if r.has_error()]
    assert len(folded) == 1 and len(errors) == 1
    expected = aggregate_arrayrecords([r.content for r in raw], "num-examples")["w"].numpy()
    np.testing.assert_allclose(to_numpy(folded[0].content["arrays"])["w"], expected, rtol=1e-6)
    assert folded[0].content["metrics"]["num-examples"] == sum(range(1, 21)) - 8


def test_seeded_sampling_repeats_flower_fedavg_and_restores_random(local_engine):
    import random

    from flwr.serverapp.strategy import FedAvg

    from strategies.plumbing.seeded_sampling import SeededSampling, sampling_seed

    grid = local_engine.open_run(TOY, 100)
    strategy = SeededSampling(FedAvg(fraction_train=0.1, fraction_evaluate=0.05), seed=9)
    arrays = to_record({"w": np.zeros(2, np.float32)})

    def picked(server_round, evaluate=False):
        configure = strategy.configure_evaluate if evaluate else strategy.configure_train
        return sorted(
            m.metadata.dst_node_id for m in configure(server_round, arrays, ConfigRecord(), grid)
        )

    random.seed(123)
    expected_next = random.random()
    random.seed(123)
    first = picked(1)
    assert random.random() == expected_next  # the process-wide generator is untouched
    assert first == picked(1) and len(first) == 10
    assert picked(2) != first and picked(1, evaluate=True) != first[:5]
    # the draw is Flower's random.sample on an explicit generator seeded from (seed, round, phase)
    messages = strategy.configure_train(3, arrays, ConfigRecord(), grid)
    explicit = random.Random(sampling_seed(9, 3, 0)).sample(list(grid.get_node_ids()), 10)
    assert [m.metadata.dst_node_id for m in messages] == explicit


def test_legacy_and_action_types_reach_the_clientapp_and_system_types_are_refused(local_engine):
    """What Flower's ClientApps execute runs; a ClientApp without a handler answers with an
    error reply, as under Flower; ``system`` and ``reconnect`` (no ClientApp handles them)
    are refused whole, naming the type, before any client runs."""
    from fedsim.engine.message_types import UnsupportedMessage

    reports = Reports()
    grid = local_engine.open_run(TOY, 4, observer=reports)
    for kind in ("get_parameters", "get_properties", "query.no_such_action"):
        (reply,) = grid.send_and_receive(messages([2], kind=kind))
        assert reply.has_error() and reply.metadata.src_node_id == NODE_ID_OFFSET + 2
        assert reply.metadata.reply_to_message_id  # the instruction it answers
    assert [r.message_type for r in reports.items] == [
        "get_parameters", "get_properties", "query.no_such_action"]
    for kind in ("system", "reconnect"):
        with pytest.raises(UnsupportedMessage, match=f"message type '{kind}' .*to node"):
            grid.push_messages(messages([0, 1], kind=kind))
    assert len(reports.items) == 3  # nothing of the refused pushes ran


def test_concurrent_send_and_receive_calls_each_get_their_own_reply(local_engine):
    """``start_grid`` sends each node's message from its own thread."""
    from concurrent.futures import ThreadPoolExecutor

    grid = local_engine.open_run(TOY, 8)

    def one(partition):
        (message,) = messages([partition])
        (reply,) = grid.send_and_receive([message])
        return message.metadata.message_id, reply

    with ThreadPoolExecutor(max_workers=8) as pool:
        results = list(pool.map(one, range(8)))
    for partition, (sent, reply) in enumerate(results):
        assert reply.metadata.reply_to_message_id == sent
        assert reply.metadata.src_node_id == NODE_ID_OFFSET + partition
        assert reply.content["metrics"]["num-examples"] == partition + 1


def test_a_phase_whose_every_client_drops_out_returns_no_reply(local_engine):
    """Injected dropouts that take every client of a phase: no reply, one report counting
    them dropped (it raised an IndexError on an empty batch group before)."""
    from fedsim.engine import FaultConfig

    reports = Reports()
    grid = local_engine.open_run(TOY, 4, observer=reports, faults=FaultConfig(dropout=1.0))
    assert grid.send_and_receive(messages([0, 1, 2, 3])) == []
    (report,) = reports.items
    assert (report.messages, report.dropped, report.succeeded) == (4, 4, 0)
