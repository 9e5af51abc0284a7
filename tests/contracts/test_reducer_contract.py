"""The contract every :class:`fedsim.worker_reduce.Reducer` passes (module docstring there):
any chunking of the replies folds to the same result (the same bits for an exact reducer --
for DMM's sealed fold, the sums its seats open; to float rounding, and the same bits for the
same chunks, for the others); a reply that cannot be
folded raises :class:`ReductionError` or is refused by name, never folded silently; the
reducer, and its partial replies, survive pickling (the worker-to-driver path) and its config
record; and where the method has an unfolded aggregation (Flower's FedAvg, Flower's clipping)
the fold gives its result.

The reducers are found in the source tree (:mod:`contracts.discovery`); each has one
:class:`Case` below (valid replies, malformed ones, the view compared), and a reducer without
one fails :func:`test_every_reducer_has_a_case`.
"""

from __future__ import annotations

import pickle
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
import pytest
from flwr.app import Message, MetricRecord, RecordDict
from flwr.serverapp.strategy.strategy_utils import aggregate_arrayrecords, aggregate_metricrecords
from flwr.supercore.differential_privacy import clip_inputs_inplace

from contracts.discovery import implementations
from fedsim.engine.client_registry import NODE_ID_OFFSET
from fedsim.record_codec import to_numpy, to_record
from fedsim.worker_reduce import ChunkedFold, Reducer, ReductionError, WeightedMean, is_partial
from fedsim.workloads.popri_feedback import (
    CANDIDATES_KEY,
    EMBEDDINGS_ARRAY,
    SCORES_ARRAY,
    SCORES_KEY,
    ClippedScoreSum,
)
from protocols.dmm.common import DMMKeys
from strategies.plumbing.clipped_sum import ClippedSum

COUNT = 9  # replies per fold: chunks of 1, 2, 4 and 9 cut it evenly and unevenly
CHUNKS = (1, 2, 4, COUNT)
SHAPES = {"w": (3, 4), "b": (4,)}


def node(index: int) -> int:
    return NODE_ID_OFFSET + index


def answer(index: int, content: RecordDict) -> Message:
    """Client ``index``'s reply carrying ``content``."""
    return Message(content, reply_to=Message(RecordDict(), node(index), "train"))


@dataclass
class Case:
    """How the contract drives one reducer.

    ``reply(rng, index)`` is client ``index``'s valid raw reply to ``instruction()``;
    ``bad`` maps a label to a reply that must not be folded with valid ones; ``view(result)``
    is what two results are compared by (name -> array); ``refolds``: partial replies fold
    again (else each chunk's partial is final, a sealed fold, and ``combine(views)`` is the
    view of them all); ``reference(instruction, replies)``: the unfolded aggregation the fold
    must equal."""

    make: Callable[[], Reducer]
    instruction: Callable[[], RecordDict]
    reply: Callable[[np.random.Generator, int], Message]
    view: Callable[[Message], dict[str, np.ndarray]]
    bad: dict[str, Callable[[np.random.Generator, int], Message]] = field(default_factory=dict)
    refolds: bool = True
    combine: Callable[[list[dict[str, np.ndarray]]], dict[str, np.ndarray]] | None = None
    reference: Callable[[RecordDict, list[Message]], dict[str, np.ndarray]] | None = None


# -------------------------------------------------------------------------- WeightedMean
GLOBAL = {key: np.zeros(shape, dtype=np.float32) for key, shape in SHAPES.items()}


def model_content(rng, weight, shapes=SHAPES, dtype=np.float32, metrics=None) -> RecordDict:
    arrays = {k: rng.normal(size=s).astype(dtype) for k, s in shapes.items()}
    metrics = metrics or {"num-examples": weight, "loss": float(rng.random()), "acc": [1.0, 2.0]}
    return RecordDict({"arrays": to_record(arrays), "metrics": MetricRecord(metrics)})


def model_reply(rng, index) -> Message:
    return answer(index, model_content(rng, int(rng.integers(1, 50))))


def model_view(message: Message) -> dict[str, np.ndarray]:
    arrays = to_numpy(message.content["arrays"])
    metrics = message.content["metrics"]
    scalars = {k: np.asarray(v, dtype=np.float64) for k, v in metrics.items()}
    return {**{f"arrays.{k}": v for k, v in arrays.items()}, **scalars}


def fedavg(instruction: RecordDict, replies: list[Message]) -> dict[str, np.ndarray]:
    """Flower's own FedAvg aggregation of the unfolded replies."""
    contents = [r.content for r in replies]
    arrays = aggregate_arrayrecords(contents, "num-examples")
    metrics = aggregate_metricrecords(contents, "num-examples")
    out = {f"arrays.{k}": v.numpy() for k, v in arrays.items()}
    out.update({k: np.asarray(v, dtype=np.float64) for k, v in metrics.items()})
    out["num-examples"] = np.asarray(sum(r.content["metrics"]["num-examples"] for r in replies))
    return out


MODEL_BAD = {
    "other array shapes": lambda rng, i: answer(i, model_content(rng, 3, {"w": (3, 5), "b": (4,)})),
    "other array keys": lambda rng, i: answer(i, model_content(rng, 3, {"v": (3, 4), "b": (4,)})),
    "no weight": lambda rng, i: answer(i, model_content(rng, 3, metrics={"loss": 1.0})),
    "two array records": lambda rng, i: answer(
        i, RecordDict({**model_content(rng, 3), "more": to_record({"x": np.zeros(2)})})
    ),
}


# -------------------------------------------------------------------------- ClippedSum
CLIP = 1.5


def clipped_instruction() -> RecordDict:
    return RecordDict({"arrays": to_record(GLOBAL)})


def clipped_reply(rng, index) -> Message:
    scale = float(rng.choice([0.05, 3.0]))  # some updates under the bound, some clipped
    arrays = {k: (scale * rng.normal(size=s)).astype(np.float32) for k, s in SHAPES.items()}
    metrics = MetricRecord({"num-examples": int(rng.integers(1, 50)), "loss": float(rng.random())})
    return answer(index, RecordDict({"arrays": to_record(arrays), "metrics": metrics}))


def flower_clipped_sum(instruction: RecordDict, replies: list[Message]) -> dict[str, np.ndarray]:
    """Flower's FlatClip (``clip_inputs_inplace``) of each update, summed in float64."""
    reference = to_numpy(instruction["arrays"])
    total = {k: np.zeros(v.shape) for k, v in reference.items()}
    for reply in replies:
        values = to_numpy(reply.content["arrays"])
        deltas = [values[k].astype(np.float64) - reference[k] for k in total]
        clip_inputs_inplace(deltas, CLIP)
        for key, delta in zip(total, deltas, strict=True):
            total[key] += delta
    return {f"arrays.{k}": v for k, v in total.items()}


def clipped_view(message: Message) -> dict[str, np.ndarray]:
    arrays = to_numpy(message.content["arrays"])
    metrics = message.content["metrics"]
    return {
        **{f"arrays.{k}": v for k, v in arrays.items()},
        **{k: np.asarray(v, dtype=np.float64) for k, v in metrics.items()},
    }


def clipped_content(rng, arrays=None, metrics=None) -> RecordDict:
    arrays = arrays if arrays is not None else {k: rng.normal(size=s) for k, s in SHAPES.items()}
    return RecordDict(
        {"arrays": to_record(arrays), "metrics": MetricRecord(metrics or {"num-examples": 3})}
    )


CLIPPED_BAD = {
    "other array shapes": lambda rng, i: answer(
        i, clipped_content(rng, {"w": np.zeros((3, 5)), "b": np.zeros(4)})
    ),
    "other array keys": lambda rng, i: answer(
        i, clipped_content(rng, {"v": np.zeros((3, 4)), "b": np.zeros(4)})
    ),
    "not finite": lambda rng, i: answer(
        i, clipped_content(rng, {"w": np.full((3, 4), np.nan), "b": np.zeros(4)})
    ),
    "reserved metric": lambda rng, i: answer(
        i, clipped_content(rng, metrics={"num-examples": 3, "fedsim.clients": 0})
    ),
    "negative weight": lambda rng, i: answer(i, clipped_content(rng, metrics={"num-examples": -1})),
}


# -------------------------------------------------------------------------- ClippedScoreSum
SCORES = 6


def score_instruction() -> RecordDict:
    embeddings = np.arange(SCORES * 3, dtype=np.float32).reshape(SCORES, 3)
    return RecordDict({CANDIDATES_KEY: to_record({EMBEDDINGS_ARRAY: embeddings})})


def score_content(scores, metrics=None) -> RecordDict:
    metrics = MetricRecord(metrics or {"num-texts": 4})
    return RecordDict({SCORES_KEY: to_record({SCORES_ARRAY: scores}), "metrics": metrics})


def score_reply(rng, index) -> Message:
    scale = float(rng.choice([0.1, 4.0]))  # some under the unit bound, some clipped
    return answer(index, score_content(scale * rng.normal(size=SCORES)))


def score_view(message: Message) -> dict[str, np.ndarray]:
    metrics = message.content["metrics"]
    return {
        "scores": to_numpy(message.content[SCORES_KEY])[SCORES_ARRAY],
        **{k: np.asarray(v, dtype=np.float64) for k, v in metrics.items()},
    }


def flower_clipped_scores(instruction: RecordDict, replies: list[Message]) -> dict:
    """Flower's FlatClip of each feedback vector to norm 1, summed in float64."""
    total = np.zeros(SCORES)
    for reply in replies:
        vector = [score_view(reply)["scores"].astype(np.float64)]
        clip_inputs_inplace(vector, 1.0)
        total += vector[0]
    return {"scores": total}


SCORE_BAD = {
    "other length": lambda rng, i: answer(i, score_content(np.ones(SCORES + 1))),
    "not numbers": lambda rng, i: answer(i, score_content(np.array([b"x"] * SCORES))),
    "no scores": lambda rng, i: answer(i, RecordDict({"metrics": MetricRecord({"x": 1})})),
    "reserved metric": lambda rng, i: answer(
        i, score_content(np.ones(SCORES), {"fedsim.clients": 0})
    ),
}


# -------------------------------------------------------------------------- ShareFoldReducer
class DMMFold:
    """A DMM round's public keys (the seats' keys from fixed secrets) and its clients' masked
    shares, as :mod:`strategies.methods.dmm.client` makes them for a folding worker; a fold's view
    is what the seats open: each seat's row of the sum with every listed client's pad removed."""

    N, T, K, DIM, SESSION = 5, 1, 2, 6, b"contract-session-id-0123456789ab"

    def __init__(self) -> None:
        from protocols.dmm.common import RoundKeys

        self.cohort = [node(i) for i in range(COUNT + 2)]
        self.keys = RoundKeys(
            round=1, step=0, rows=1, n=self.N, t=self.T, k=self.K, field_exponent=61,
            dim=self.DIM, session_id=self.SESSION,
            member_keys={j: self.seat(j).public_key for j in range(self.N)},
        )  # fmt: skip

    def seat(self, j: int):
        """Seat ``j``'s channel endpoint (a fresh one: each opens an envelope once)."""
        from protocols.channels import Endpoint
        from protocols.dmm.common import PROTOCOL
        from protocols.kit import SEAT_ID_BASE

        return Endpoint(SEAT_ID_BASE + j, self.SESSION, PROTOCOL, private_key=bytes([j + 1]) * 32)

    def make(self) -> Reducer:
        from strategies.secure.dmm.fold import ShareFoldReducer

        return ShareFoldReducer.for_round(self.keys, self.cohort)

    def reply(self, rng, index) -> Message:
        from protocols.dmm.client import mask_client_shares
        from protocols.dmm.common import DMMSealedShares
        from strategies.secure.dmm.wire import sealed_to_record

        update = rng.integers(-50, 50, self.DIM)
        noise = rng.integers(-50, 50, (1, self.DIM))
        masked = mask_client_shares(self.keys, index, update, noise, rng, bytes([index + 7]) * 32)
        client = masked.client
        pads = DMMSealedShares(client.party, client.public_key, client.pads)
        return answer(
            index,
            RecordDict(
                {
                    DMMKeys.FOLD: to_record({DMMKeys.MASKED: masked.rows}),
                    DMMKeys.PADS: sealed_to_record(pads),
                }
            ),
        )

    def opened(self, message: Message) -> np.ndarray:
        """(n, width): each seat's row of the fold, opened, less the pads of its clients."""
        from protocols.channels import Envelope
        from protocols.dmm.client import fold_pad
        from protocols.dmm.common import FOLD_PAD, DMMStage
        from strategies.secure.dmm.fold import fold_party

        keys, field = self.keys, self.keys.scheme().field
        sealed, batch = message.content[DMMKeys.SEALED], message.content[DMMKeys.BATCH]
        parties = [self.cohort.index(int(n)) for n in batch["nodes"]]
        party, seats, rows = fold_party(len(self.cohort), parties), list(sealed["members"]), []
        for i, j in enumerate(seats):
            seat, receiver = self.seat(j), self.seat(j).party_id
            seat.connect(party, sealed["public-key"])
            share = DMMStage.SHARE
            envelope = Envelope(
                party,
                receiver,
                keys.round,
                share.name,
                sealed["nonces"][i],
                sealed["ciphertexts"][i],
            )
            row = field.asarray(seat.open_array(envelope, round_=keys.round, stage=share), "row")
            for c, (client, key) in enumerate(zip(parties, batch["public-keys"], strict=True)):
                seat.connect(client, key)
                at = c * len(seats) + i
                pad = Envelope(
                    client, receiver, keys.round, FOLD_PAD,
                    batch["pad-nonces"][at], batch["pad-ciphertexts"][at],
                )  # fmt: skip
                seed = seat.open(pad, round_=keys.round, stage=FOLD_PAD, sender=client)
                row = field.sub(row, fold_pad(field, seed, keys.width))
            rows.append(row)
        return np.stack(rows)

    def view(self, message: Message) -> dict[str, np.ndarray]:
        """The clients the fold lists, their public keys, and the sum the seats open."""

        batch = message.content[DMMKeys.BATCH]
        return {
            "nodes": np.asarray(batch["nodes"]),
            "keys": np.asarray(batch["public-keys"]),
            "opened": self.opened(message),
        }

    def combine(self, views: list[dict[str, np.ndarray]]) -> dict[str, np.ndarray]:
        """The view of several folds: their clients in order, their opened sums added."""
        total = views[0]["opened"]
        for view in views[1:]:
            total = self.keys.scheme().field.add(total, view["opened"])
        return {
            "nodes": np.concatenate([v["nodes"] for v in views]),
            "keys": np.concatenate([v["keys"] for v in views]),
            "opened": total,
        }

    def bad(self) -> dict[str, Callable]:

        def without_pads(rng, index):
            content = self.reply(rng, index).content
            return answer(index, RecordDict({DMMKeys.FOLD: content[DMMKeys.FOLD]}))

        def short_rows(rng, index):
            content = self.reply(rng, index).content
            rows = to_numpy(content[DMMKeys.FOLD])[DMMKeys.MASKED][:, :-1]
            content[DMMKeys.FOLD] = to_record({DMMKeys.MASKED: rows})
            return answer(index, RecordDict(dict(content)))

        def other_seats(rng, index):
            content = self.reply(rng, index).content
            record = content[DMMKeys.PADS]
            record["members"] = list(record["members"])[:-1]
            return answer(index, RecordDict(dict(content)))

        def outside_the_cohort(rng, index):
            return answer(COUNT + 40, self.reply(rng, index).content)

        return {
            "no pads": without_pads,
            "short rows": short_rows,
            "pads for other seats": other_seats,
            "a node outside the cohort": outside_the_cohort,
        }


def dmm_case() -> Case:
    fold = DMMFold()
    return Case(
        fold.make, RecordDict, fold.reply, fold.view, bad=fold.bad(), refolds=False,
        combine=fold.combine,
    )  # fmt: skip


CASES: dict[str, Callable[[], Case]] = {
    "fedsim.worker_reduce:WeightedMean": lambda: Case(
        WeightedMean,
        RecordDict,
        model_reply,
        model_view,
        bad=MODEL_BAD,
        reference=fedavg,
    ),
    "strategies.plumbing.clipped_sum:ClippedSum": lambda: Case(
        lambda: ClippedSum(CLIP),
        clipped_instruction,
        clipped_reply,
        clipped_view,
        bad=CLIPPED_BAD,
        reference=flower_clipped_sum,
    ),
    "fedsim.workloads.popri_feedback:ClippedScoreSum": lambda: Case(
        ClippedScoreSum,
        score_instruction,
        score_reply,
        score_view,
        bad=SCORE_BAD,
        reference=flower_clipped_scores,
    ),
    "strategies.secure.dmm.fold:ShareFoldReducer": dmm_case,
}
FOUND = implementations(Reducer)
NAMES = sorted(FOUND)
BAD = [(name, label) for name in NAMES if name in CASES for label in CASES[name]().bad]


def test_every_reducer_has_a_case():
    """The reducers found in the tree (printed with -v) are the ones this suite drives."""
    print("reducers:", ", ".join(NAMES))
    assert NAMES, "no Reducer subclass found under fedsim/, strategies/, protocols/"
    missing = sorted(set(NAMES) - set(CASES))
    assert not missing, f"reducers without a contract Case: {missing}"
    stale = sorted(set(CASES) - set(NAMES))
    assert not stale, f"cases for reducers that no longer exist: {stale}"


def case_of(name: str) -> Case:
    if name not in CASES:
        pytest.fail(f"{name} has no contract Case (test_every_reducer_has_a_case)")
    return CASES[name]()


def fold_in_chunks(case: Case, reducer: Reducer, instruction, replies, chunk):
    """The grid's fold: each chunk into a partial, the partials (in chunk order) into one."""
    chunked = ChunkedFold(reducer, instruction, chunk)
    for position, reply in enumerate(replies):
        chunked.add(position, reply)
    partials = chunked.results()
    assert len(partials) == -(-len(replies) // (chunk or len(replies)))
    if case.refolds:
        return [case.view(reducer.reduce(instruction, partials))]
    return [case.view(p) for p in partials]


def assert_views_equal(ours, theirs, exact: bool) -> None:
    assert ours.keys() == theirs.keys(), (sorted(ours), sorted(theirs))
    for key, value in theirs.items():
        if exact or value.dtype.kind not in "f":
            np.testing.assert_array_equal(ours[key], value, err_msg=key)
        else:
            np.testing.assert_allclose(ours[key], value, rtol=2e-6, atol=1e-6, err_msg=key)


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("chunk", CHUNKS)
def test_any_chunking_folds_to_the_same_result(name, chunk):
    case = case_of(name)
    reducer, instruction = case.make(), case.instruction()
    rng = np.random.default_rng(chunk)
    replies = [case.reply(rng, i) for i in range(COUNT)]
    whole = fold_in_chunks(case, reducer, instruction, replies, None)
    first = fold_in_chunks(case, reducer, instruction, replies, chunk)
    if case.refolds:
        assert_views_equal(first[0], whole[0], exact=reducer.exact)
        again = fold_in_chunks(case, reducer, instruction, replies, chunk)
        assert_views_equal(again[0], first[0], exact=True)  # fixed chunks: the same bits
    else:  # sealed partials: together they are the whole fold
        assert_views_equal(case.combine(first), whole[0], exact=True)


@pytest.mark.parametrize("name, label", BAD)
def test_a_reply_that_cannot_be_folded_is_refused(name, label):
    """Among valid replies, the bad one raises ReductionError or is named in ``rejected``
    with the others folded exactly as without it; never folded silently."""
    case = case_of(name)
    reducer, instruction = case.make(), case.instruction()
    rng = np.random.default_rng(7)
    good = [case.reply(rng, i) for i in range(4)]
    bad = case.bad[label](rng, 9)
    try:
        out = reducer.reduce(instruction, [*good[:2], bad, *good[2:]])
    except ReductionError:
        return
    assert is_partial(out), "a fold that refuses replies must name them (a PartialReply)"
    assert out.rejected == (int(bad.metadata.src_node_id),)
    alone = reducer.reduce(instruction, good)
    assert_views_equal(case.view(out), case.view(alone), exact=True)


@pytest.mark.parametrize("name", NAMES)
def test_nothing_to_fold_raises_reduction_error(name):
    case = case_of(name)
    with pytest.raises(ReductionError):
        case.make().reduce(case.instruction(), [])


@pytest.mark.parametrize("name", NAMES)
def test_the_reducer_and_its_partials_survive_pickle_and_its_config(name):
    """Workers get the reducer by its config record and ship partials to the driver by
    pickle: both give back what folds as before."""
    case = case_of(name)
    reducer, instruction = case.make(), case.instruction()
    rng = np.random.default_rng(3)
    replies = [case.reply(rng, i) for i in range(4)]
    for rebuilt in (pickle.loads(pickle.dumps(reducer)), Reducer.from_config(reducer.to_config())):
        assert type(rebuilt) is type(reducer)
        assert dict(rebuilt.to_config()) == dict(reducer.to_config())
        assert_views_equal(
            case.view(rebuilt.reduce(instruction, replies)),
            case.view(reducer.reduce(instruction, replies)),
            exact=True,
        )
    partial = reducer.reduce(instruction, replies[:2])
    shipped = pickle.loads(pickle.dumps(partial))
    assert type(shipped) is type(partial) and is_partial(shipped) == is_partial(partial)
    assert getattr(shipped, "rejected", ()) == getattr(partial, "rejected", ())
    assert_views_equal(case.view(shipped), case.view(partial), exact=True)
    if case.refolds:
        rest = reducer.reduce(instruction, replies[2:])
        assert_views_equal(
            case.view(reducer.reduce(instruction, [shipped, rest])),
            case.view(reducer.reduce(instruction, [partial, rest])),
            exact=True,
        )


REFERENCED = [name for name in NAMES if name in CASES and CASES[name]().reference is not None]


@pytest.mark.parametrize("name", REFERENCED)
@pytest.mark.parametrize("chunk", (2, COUNT))
def test_the_fold_equals_the_unfolded_aggregation(name, chunk):
    case = case_of(name)
    reducer, instruction = case.make(), case.instruction()
    rng = np.random.default_rng(11 + chunk)
    replies = [case.reply(rng, i) for i in range(COUNT)]
    (ours,) = fold_in_chunks(case, reducer, instruction, replies, chunk)
    expected = case.reference(instruction, replies)
    assert_views_equal({k: ours[k] for k in expected}, expected, exact=False)
