"""Private Evolution's client step: a nearest-neighbour vote over the server's candidates.

Private Evolution (Lin et al., "Differentially Private Synthetic Data via Foundation Model
APIs 1: Images", ICLR 2024, Alg. 1 "DP_NN_HISTOGRAM"), as used on federated text by PrE-Text
(Hou et al., "PrE-Text: Training Language Models on Private Federated Data in the Age of
LLMs", ICML 2024): the server sends the embeddings of its ``M`` candidate samples; each of a
client's texts votes for its nearest candidate (L2 distance between embeddings), giving a
count vector ``h_i`` in ``N^M``. The client sends ``h_i / ||h_i||_2``: **normalised** to unit L2
norm (a client with no text sends zeros), so one client moves the sum of votes by at most 1 in
L2 -- the add/remove sensitivity the server's Gaussian noise is calibrated to. (Clipping at 1
would be the same map: a non-empty count vector has norm >= 1.) The server clips every reply
to norm 1 again (:func:`strategies.methods.private_evolution.strategy.clip_votes`), so the bound
holds whatever a client sends.

:func:`make_vote_client_app` returns a Flower ClientApp whose train handler reads the
``"candidates"`` ArrayRecord (``"embeddings"``: ``(M, d)`` float32) and replies with a
``"votes"`` ArrayRecord (``"votes"``: ``(M,)`` float64) and ``num-examples``. The client's own
embeddings come from a callable, so a worker embeds a client's texts once and keeps them.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, Protocol

import numpy as np
from flwr.app import ArrayRecord, Context, Message, MetricRecord, RecordDict
from flwr.clientapp import ClientApp

from fedsim.record_codec import to_numpy, to_record

CANDIDATES, EMBEDDINGS, VOTES = "candidates", "embeddings", "votes"


class Embedder(Protocol):
    def encode(self, texts: list[str]) -> np.ndarray: ...


def nearest_candidates(points: np.ndarray, candidates: np.ndarray) -> np.ndarray:
    """Index of the nearest row of ``candidates`` (squared L2 distance) for each row of
    ``points``; ties go to the smaller index."""
    points = np.asarray(points, dtype=np.float64)
    candidates = np.asarray(candidates, dtype=np.float64)
    if points.ndim != 2 or candidates.ndim != 2 or points.shape[1] != candidates.shape[1]:
        raise ValueError(
            f"points {points.shape} and candidates {candidates.shape} must be 2-d with the "
            "same number of columns"
        )
    if len(candidates) == 0:
        raise ValueError("candidates is empty: at least one candidate to vote for")
    distances = (
        (points**2).sum(1)[:, None] - 2.0 * points @ candidates.T + (candidates**2).sum(1)[None, :]
    )
    return np.argmin(distances, axis=1)


def nearest_neighbour_votes(points: np.ndarray, candidates: np.ndarray) -> np.ndarray:
    """A client's vote vector: per-candidate counts of its nearest texts, L2-normalised.

    ``(M,)`` float64 with norm 1, or zeros when the client has no text.
    """
    counts = np.bincount(nearest_candidates(points, candidates), minlength=len(candidates)).astype(
        np.float64
    )
    norm = float(np.linalg.norm(counts))
    return counts / norm if norm > 0 else counts


def make_vote_client_app(embeddings_of: Callable[[int], np.ndarray]) -> ClientApp:
    """A ClientApp voting with the embeddings of client ``partition-id``'s texts.

    ``embeddings_of(partition)`` returns that client's ``(n, d)`` text embeddings, computed on
    the client (e.g. :func:`fedsim.workloads.popri_feedback.client_embeddings` with the
    federation's and embedder's specs, which embeds once per worker and caches; or
    :func:`cached_text_embeddings`).
    """
    app = ClientApp()

    @app.train()
    def vote(message: Message, context: Context) -> Message:
        partition = int(context.node_config["partition-id"])
        if CANDIDATES not in message.content:
            raise ValueError(f"the instruction has no {CANDIDATES!r} ArrayRecord")
        candidates = to_numpy(message.content[CANDIDATES])[EMBEDDINGS]
        points = np.asarray(embeddings_of(partition), dtype=np.float64)
        if len(points) == 0:
            votes = np.zeros(len(candidates), dtype=np.float64)
        else:
            votes = nearest_neighbour_votes(points, candidates)
        content = RecordDict(
            {
                VOTES: to_record({VOTES: votes}),
                "metrics": MetricRecord({"num-examples": len(points)}),
            }
        )
        return Message(content=content, reply_to=message)

    return app


def cached_text_embeddings(
    client_texts: Sequence[Sequence[str]], embedder_factory: Callable[[], Embedder]
) -> Callable[[int], np.ndarray]:
    """``embeddings_of(partition)`` over in-memory client texts: the embedder is built by
    ``embedder_factory()`` on first use in a process and each client is embedded once."""
    texts = [list(t) for t in client_texts]
    for i, group in enumerate(texts):
        if not all(isinstance(t, str) for t in group):
            raise ValueError(f"client_texts[{i}] holds a non-string; each client has a list of str")
    cache: dict[Any, Any] = {}

    def embeddings_of(partition: int) -> np.ndarray:
        if not 0 <= partition < len(texts):
            raise ValueError(
                f"partition-id = {partition} is not allowed: in [0, {len(texts)}) "
                "(one per client text list)"
            )
        if partition not in cache:
            if "embedder" not in cache:
                cache["embedder"] = embedder_factory()
            group = texts[partition]
            cache[partition] = (
                np.asarray(cache["embedder"].encode(group), dtype=np.float64)
                if group
                else np.zeros((0, 1))
            )
        return cache[partition]

    return embeddings_of


def votes_of(reply: Message) -> np.ndarray:
    """The vote vector in a client's reply."""
    record = reply.content[VOTES]
    if not isinstance(record, ArrayRecord):
        raise ValueError(f"reply[{VOTES!r}] is a {type(record).__name__}, not an ArrayRecord")
    return np.asarray(to_numpy(record)[VOTES], dtype=np.float64)
