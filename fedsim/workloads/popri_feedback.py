"""POPri's client feedback as a Flower ClientApp: score the server's candidates.

Hou et al., "Private Federated Learning using Preference-Optimized Synthetic Data" (ICML
2025), Alg. 1, client step. The server embeds the round's ``K * J`` candidate samples once
and sends the same ``(K*J, d)`` matrix of unit-norm embeddings to every sampled client (one
shared content: fedsim's grid puts it in the object store once per round). Client ``i``, with
private texts embedded as unit rows ``e_1..e_m``, replies with

    s_i     = sum_t  C e_t                      (sum over its texts of cosine similarities)
    z_i     = (s_i - mean(s_i)) / std(s_i)      (z-score across the candidates; 0 if std = 0)
    v_i     = z_i * min(1, 1 / ||z_i||_2)       (clip to L2 norm <= 1)

so the sum ``sum_i v_i`` has L2 sensitivity 1 under adding or removing one client, which is
what the server's Gaussian noise is calibrated to (:mod:`strategies.methods.popri.strategy`). The
server applies the same clipping again when it sums (:class:`ClippedScoreSum`), so the bound holds
whatever a client sends. Workers may fold their clients' replies into one partial sum
(:mod:`fedsim.worker_reduce`).

Each worker process embeds a client's texts the first time it serves the client and keeps
the result (:func:`client_embeddings`); models and federations are built once per process
from hashable specs.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

import numpy as np
from flwr.app import ArrayRecord, ConfigRecord, Context, Message, MetricRecord, RecordDict
from flwr.clientapp import ClientApp

from fedsim.config import require
from fedsim.data.text import TextSourceSpec, cached_text_federation
from fedsim.record_codec import to_numpy, to_record
from fedsim.worker_reduce import (
    Accumulator,
    MetricSums,
    Reducer,
    ReductionError,
    folded_reply,
    is_partial,
    refuse,
    reserved_keys,
    single,
)

CANDIDATES_KEY = "candidates"
EMBEDDINGS_ARRAY = "embeddings"
SCORES_KEY = "scores"
SCORES_ARRAY = "scores"
CLIENTS_KEY = "fedsim.clients"
NUM_TEXTS_KEY = "num-texts"


def zscore(scores: np.ndarray) -> np.ndarray:
    """``(s - mean(s)) / std(s)`` (population std) in float64; zeros when ``std(s) == 0``."""
    s = np.asarray(scores, dtype=np.float64)
    std = float(s.std())
    if std == 0.0 or not np.isfinite(std):
        return np.zeros_like(s)
    return (s - s.mean()) / std


def clip_l2(vector: np.ndarray, bound: float = 1.0) -> np.ndarray:
    """``v * min(1, bound / ||v||_2)`` in float64 (non-finite entries count as 0)."""
    if not bound > 0:
        raise ValueError(f"bound = {bound!r} is not allowed: a number > 0")
    v = np.nan_to_num(np.asarray(vector, dtype=np.float64), nan=0.0, posinf=0.0, neginf=0.0)
    norm = float(np.linalg.norm(v))
    return v if norm <= bound else v * (bound / norm)


def client_feedback(candidates: np.ndarray, own: np.ndarray) -> np.ndarray:
    """One client's clipped feedback vector (module docstring) for ``candidates`` ``(n, d)``
    given its texts' embeddings ``own`` ``(m, d)``; both with unit-norm rows."""
    candidates, own = np.asarray(candidates), np.asarray(own)
    require(candidates.ndim == 2, "candidates", candidates.shape, "an (n, d) matrix")
    require(
        own.ndim == 2 and own.shape[1] == candidates.shape[1],
        "own",
        own.shape,
        f"an (m, {candidates.shape[1]}) matrix of the client's text embeddings",
    )
    sums = candidates.astype(np.float64) @ own.astype(np.float64).sum(axis=0)
    return clip_l2(zscore(sums), 1.0)


# --------------------------------------------------------------------------------------------
# Embedders, built once per process
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class EmbedderSpec:
    """Which embedder clients and server use: ``"minilm"`` (all-MiniLM-L6-v2 from its
    package) or ``"tiny"`` (a random BERT of width ``dimension`` from ``seed``, for tests)."""

    kind: str = "minilm"
    seed: int = 0
    dimension: int = 384

    def __post_init__(self) -> None:
        require(self.kind in ("minilm", "tiny"), "embedder", self.kind, "'minilm' or 'tiny'")

    def build(self) -> Any:
        from fedsim.workloads import text_models

        if self.kind == "minilm":
            return text_models.load_embedder()
        return text_models.tiny_embedder(self.seed, dimension=self.dimension)


_EMBEDDERS: dict[EmbedderSpec, Any] = {}
_CLIENT_EMBEDDINGS: OrderedDict[tuple[TextSourceSpec, EmbedderSpec, int], np.ndarray] = (
    OrderedDict()
)
_LOCK = threading.Lock()
#: client embedding matrices a worker process keeps (least recently used dropped first)
CLIENT_CACHE = 10_000


def cached_embedder(spec: EmbedderSpec) -> Any:
    """The embedder for ``spec``, built at most once per process."""
    with _LOCK:
        found = _EMBEDDERS.get(spec)
        if found is None:
            found = _EMBEDDERS[spec] = spec.build()
        return found


def client_embeddings(text: TextSourceSpec, embedder: EmbedderSpec, client: int) -> np.ndarray:
    """Unit-norm embeddings ``(m, d)`` of client ``client``'s training texts (cached)."""
    key = (text, embedder, int(client))
    with _LOCK:
        if key in _CLIENT_EMBEDDINGS:
            _CLIENT_EMBEDDINGS.move_to_end(key)
            return _CLIENT_EMBEDDINGS[key]
    texts = list(cached_text_federation(text).client_texts(int(client)))
    vectors = cached_embedder(embedder).encode(texts)
    with _LOCK:
        _CLIENT_EMBEDDINGS[key] = vectors
        if len(_CLIENT_EMBEDDINGS) > CLIENT_CACHE:
            _CLIENT_EMBEDDINGS.popitem(last=False)
    return vectors


def feedback_instruction(candidates: np.ndarray, server_round: int) -> RecordDict:
    """The content every sampled client receives in a round (share one object)."""
    return RecordDict(
        {
            CANDIDATES_KEY: to_record({EMBEDDINGS_ARRAY: np.asarray(candidates, np.float32)}),
            "config": ConfigRecord({"server-round": int(server_round)}),
        }
    )


def make_feedback_app(text: TextSourceSpec, embedder: EmbedderSpec) -> ClientApp:
    """A ClientApp whose train handler returns the client's clipped feedback vector.

    The client is ``context.node_config["partition-id"]``, an index into ``text``'s
    federation; the reply holds the ``scores`` array (float64, L2 norm <= 1) and the
    metric ``num-texts``.
    """
    require(isinstance(text, TextSourceSpec), "text", type(text).__name__, "a TextSourceSpec")
    require(
        isinstance(embedder, EmbedderSpec), "embedder", type(embedder).__name__, "an EmbedderSpec"
    )
    app = ClientApp()

    @app.train()
    def feedback(message: Message, context: Context) -> Message:
        partition = int(context.node_config["partition-id"])
        record = message.content.get(CANDIDATES_KEY)
        if not isinstance(record, ArrayRecord) or EMBEDDINGS_ARRAY not in record:
            raise ValueError(
                f"the instruction has no {CANDIDATES_KEY!r} ArrayRecord with an "
                f"{EMBEDDINGS_ARRAY!r} array; send feedback_instruction(...) content"
            )
        candidates = to_numpy(record)[EMBEDDINGS_ARRAY]
        own = client_embeddings(text, embedder, partition)
        scores = client_feedback(candidates, own)
        content = RecordDict(
            {
                SCORES_KEY: to_record({SCORES_ARRAY: scores}),
                "metrics": MetricRecord({NUM_TEXTS_KEY: int(len(own))}),
            }
        )
        return Message(content=content, reply_to=message)

    return app


# --------------------------------------------------------------------------------------------
# The sum of clipped feedback (worker-side or on the server)
# --------------------------------------------------------------------------------------------


class ClippedScoreSum(Reducer):
    """``sum_i clip(v_i, 1)`` over raw replies plus the sums carried by partial replies
    (:class:`~fedsim.worker_reduce.PartialReply`, whose metric ``fedsim.clients`` counts
    the clients folded). A raw reply with a reserved ``fedsim.*`` key, or scores that are
    not ``size`` numbers, is refused (listed in the fold's ``rejected``); non-finite
    entries count as 0 (:func:`clip_l2`). Client metrics are averaged."""

    params = ()

    def accumulator(self, instruction: RecordDict) -> Accumulator:
        return _ScoreSumAccumulator(instruction)


class _ScoreSumAccumulator(Accumulator):
    def __init__(self, instruction: RecordDict) -> None:
        candidates = instruction.get(CANDIDATES_KEY)
        if not isinstance(candidates, ArrayRecord):
            raise ReductionError(f"the instruction has no {CANDIDATES_KEY!r} ArrayRecord")
        self.size = int(to_numpy(candidates)[EMBEDDINGS_ARRAY].shape[0])
        self.total = np.zeros(self.size, dtype=np.float64)
        self.clients = 0
        self.rejected: list[int] = []
        self.metrics = MetricSums()
        self.template: Message | None = None

    def add(self, reply: Message) -> None:
        if self.template is None:
            self.template = reply
        if is_partial(reply):  # already a clipped partial sum
            self.total += to_numpy(reply.content[SCORES_KEY])[SCORES_ARRAY]
            _, metrics = single(reply.content, MetricRecord)
            folded = int(metrics[CLIENTS_KEY])
            self.rejected.extend(reply.rejected)
        else:
            checked = self._check_raw(reply)
            if isinstance(checked, str):
                refuse(self.rejected, reply, checked)
                return
            scores, metrics = checked
            self.total += clip_l2(scores, 1.0)
            folded = 1
        self.clients += folded
        self.metrics.add(metrics, weight=float(folded), skip=(CLIENTS_KEY,))

    def _check_raw(self, reply: Message) -> tuple[np.ndarray, MetricRecord] | str:
        """A client's feedback vector and metrics, or why the reply is refused."""
        reserved = reserved_keys(reply.content)
        if reserved:
            return f"it carries keys reserved for the engine: {', '.join(reserved)}"
        record = reply.content.get(SCORES_KEY)
        if not isinstance(record, ArrayRecord) or SCORES_ARRAY not in record:
            return f"it has no {SCORES_KEY!r} array"
        try:
            scores = to_numpy(record)[SCORES_ARRAY]
            _, metrics = single(reply.content, MetricRecord)
        except (ReductionError, ValueError, TypeError) as err:
            return str(err)
        if scores.shape != (self.size,) or scores.dtype.kind not in "iuf":
            return f"scores are {scores.dtype}{list(scores.shape)}, expected {self.size} numbers"
        return scores, metrics

    def result(self) -> Message:
        if self.template is None:
            raise ReductionError("nothing to reduce")
        folded = self.metrics.record("fedsim.weight")
        folded.pop("fedsim.weight", None)
        folded[CLIENTS_KEY] = self.clients
        content = RecordDict({SCORES_KEY: to_record({SCORES_ARRAY: self.total}), "metrics": folded})
        return folded_reply(self.template, content, self.rejected)


def summed_scores(instruction: RecordDict, replies: list[Message]) -> tuple[np.ndarray, int]:
    """``(sum of clipped feedback vectors, clients counted)`` over raw or partial replies."""
    valid = [r for r in replies if not r.has_error()]
    if not valid:
        size = int(to_numpy(instruction[CANDIDATES_KEY])[EMBEDDINGS_ARRAY].shape[0])
        return np.zeros(size, dtype=np.float64), 0
    reply = ClippedScoreSum().reduce(instruction, valid)
    _, metrics = single(reply.content, MetricRecord)
    return to_numpy(reply.content[SCORES_KEY])[SCORES_ARRAY].copy(), int(metrics[CLIENTS_KEY])
