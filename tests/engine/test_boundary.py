"""The release boundary: replies consumed once, unaccounted content counted, the run's epsilon
composed over every mechanism."""

import math

import pytest
from flwr.app import Message, MetricRecord, RecordDict
from flwr.supercore.task_identity import TaskIdentity

from fedsim.engine.boundary import ClaimRefused, ReleaseBoundary, mechanism_of
from fedsim.privacy.composition import run_epsilon
from fedsim.privacy.epsilon import epsilon
from fedsim.privacy.ledger import PrivacyLedger
from fedsim.privacy.round_events import round_event
from fedsim.privacy.sampling import (
    FixedSizeSampling,
    FullParticipation,
    NeighbouringRelation,
    PoissonSampling,
)


@pytest.fixture(autouse=True)
def _identity():
    TaskIdentity.run_id = TaskIdentity.task_id = TaskIdentity.node_id = 1


def sent(boundary, nodes, message_type="train"):
    """Instructions to ``nodes`` (ids set, as a grid sets them) and one reply to each."""
    instructions = []
    for node in nodes:
        message = Message(RecordDict(), node, message_type)
        message.metadata.__dict__["_message_id"] = f"{message_type}-{node}"
        instructions.append(message)
    boundary.sent(instructions, 1)
    return [
        Message(RecordDict({"metrics": MetricRecord({"x": 1.0})}), reply_to=m)
        for m in instructions
    ]


SAMPLED = PoissonSampling(0.1)


class Mechanism:
    """A ledger of ``rounds`` sampled Gaussians, as a DP strategy keeps one."""

    claims_replies = True
    accountant = "rdp"

    def __init__(self, rounds, sampling=SAMPLED, relation="add_remove"):
        self.ledger = PrivacyLedger(relation, 1e-5)
        for r in range(1, rounds + 1):
            self.ledger.record(r, round_event(1.0, sampling))

    def epsilon(self):
        return self.ledger.epsilon()

    def privacy_report(self):
        return {"epsilon": self.epsilon()}


def test_a_reply_is_consumed_once_and_only_if_the_grid_delivered_it():
    boundary, mechanism = ReleaseBoundary(), Mechanism(1)
    replies = sent(boundary, [1, 2, 3])
    stranger = sent(ReleaseBoundary(), [4])[0]  # another grid's reply
    for reply in replies:
        boundary.delivered(reply)
    with pytest.raises(ClaimRefused, match="never delivered"):
        boundary.claim([stranger], mechanism)
    with pytest.raises(ClaimRefused, match="aggregated once"):
        boundary.claim([replies[0], replies[0]], mechanism)
    assert boundary.claim(replies[:2], mechanism) == 2
    with pytest.raises(ClaimRefused, match="already consumed by Mechanism"):
        boundary.claim(replies[1:], mechanism)
    assert boundary.unaccounted() == {"train": 1}  # the third reply: nobody consumed it
    report = boundary.report()
    assert report["unaccounted_releases"] == 1 and math.isinf(report["epsilon"])
    boundary.withhold(replies[2:], "evaluation")
    assert boundary.report() == {"epsilon": mechanism.epsilon(), "unaccounted_releases": 0}


def test_a_closed_round_keeps_its_unaccounted_count_and_forgets_its_ids():
    boundary, mechanism = ReleaseBoundary(), Mechanism(1)
    replies = sent(boundary, [1, 2])
    for reply in replies:
        boundary.delivered(reply)
    boundary.claim(replies[:1], mechanism)
    boundary.close_round()
    assert boundary.replies == {} and boundary.instructions == {}
    assert boundary.unaccounted() == {"train": 1}
    with pytest.raises(ClaimRefused, match="never delivered"):  # too late, and never twice
        boundary.claim(replies[:1], mechanism)


def test_a_worker_fold_counts_every_instruction_it_covers():
    boundary = ReleaseBoundary()
    replies = sent(boundary, [1, 2, 3, 4])
    boundary.delivered(replies[0], covers=[r.metadata.reply_to_message_id for r in replies])
    boundary.register(Mechanism(1))
    assert boundary.unaccounted() == {"train": 4}
    assert boundary.covers(replies[0]) == tuple(f"train-{n}" for n in (1, 2, 3, 4))


def test_a_mechanism_that_does_not_claim_consumes_what_its_scope_delivered():
    boundary, legacy, aware = ReleaseBoundary(), Mechanism(1), Mechanism(1)
    legacy.claims_replies = False
    replies = sent(boundary, [1, 2, 3])
    with boundary.scope(legacy):
        boundary.delivered(replies[0])
    with boundary.scope(aware):  # a mechanism that claims must claim
        boundary.delivered(replies[1])
    boundary.delivered(replies[2])  # outside any mechanism: the ServerApp's own phase
    assert boundary.unaccounted() == {"train": 2}


def test_the_runs_epsilon_composes_every_mechanism():
    first, second = Mechanism(3), Mechanism(5)
    assert run_epsilon([first]).epsilon == first.epsilon()
    both = run_epsilon([first, second])
    assert both.epsilon == pytest.approx(epsilon(1.0, PoissonSampling(0.1), 8, 1e-5), rel=1e-9)
    assert both.epsilon > max(first.epsilon(), second.epsilon())
    assert run_epsilon([]).epsilon == 0.0
    replace = Mechanism(2, FixedSizeSampling(2, 10), NeighbouringRelation.REPLACE_ONE)
    mixed = run_epsilon([first, replace])
    assert math.isinf(mixed.epsilon) and "different neighbouring relations" in mixed.how
    full = Mechanism(2, FullParticipation())
    assert run_epsilon([full, first]).epsilon > full.epsilon()


def test_the_mechanism_of_a_wrapper_chain_is_the_object_with_the_ledger():
    class Wrapper:
        def __init__(self, strategy):
            self.strategy = strategy

    inner = Mechanism(1)
    assert mechanism_of(Wrapper(Wrapper(inner))) is inner
    assert mechanism_of(Wrapper(object())) is None
