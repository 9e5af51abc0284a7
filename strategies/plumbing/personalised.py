"""The round protocol shared by the personalised strategies (pFedHB, pFedVEM, pFedBayes, FedAvg).

One round (Thapa & Li, ICML 2025, reference code ``hb/pfedhb.py``):

1. The server draws the *reporting* clients ``S`` (Binomial(p) with at least
   ``min_clients``, as the reference sampler, or a fixed ``round(p N)``).
2. ``configure_train`` sends the global arrays to every client (``schedule =
   "all"``: every client personalises each round, only ``S`` report) or only to
   ``S`` (``schedule = "sampled"``). The config record carries ``method``,
   ``server-round``, ``report`` (1 for clients in ``S``) and the method's keys.
3. Clients in ``S`` reply with their posterior (``"posterior"`` ArrayRecord)
   and ``num-examples``; ``aggregate_train`` hands them to
   :meth:`PersonalisedStrategy.global_update` (the method's server step).
4. Every ``evaluate_every`` rounds (and in round ``num_rounds``) every client
   evaluates its personal model on its own test rows; ``aggregate_evaluate``
   reports the unweighted mean over clients of the posterior-mean and
   MC-predictive accuracy, and the pooled ECE of both.

The messages are the ClientApp contract of :mod:`fedsim.workloads.personalised`.
"""

from __future__ import annotations

from abc import abstractmethod
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Literal

import numpy as np
from flwr.app import ArrayRecord, ConfigRecord, Message, MetricRecord, RecordDict
from flwr.app.message_type import MessageType
from flwr.serverapp import Grid
from flwr.serverapp.strategy import Strategy

from fedsim.config import require
from fedsim.randomness import Stream, public_generator
from fedsim.record_codec import to_numpy, to_record
from fedsim.workloads.bayesian import expected_calibration_error
from strategies.plumbing.wrapper import train_message

GLOBAL, POSTERIOR = "global", "posterior"


@dataclass(frozen=True, kw_only=True)
class Cohorts:
    """Who trains, who reports, and when everyone evaluates.

    Attributes:
        schedule: "all" (every client personalises each round, the sampled ones
            update the server: the reference schedule) or "sampled" (only the
            sampled clients train).
        fraction: sampling rate p in (0, 1].
        sampling: "binomial" (each client independently with probability p) or
            "fixed" (``round(p N)`` clients without replacement).
        min_clients: at least this many report (the reference redraws below 2).
        evaluate_every: rounds between evaluations (0: never).
        num_rounds: the last round, always evaluated (0: unknown).
        seed: the run seed; the reporting clients are the public stream
            ``public_generator(seed, round, Stream.COHORT)``.
    """

    schedule: Literal["all", "sampled"] = "all"
    fraction: float = 0.1
    sampling: Literal["binomial", "fixed"] = "binomial"
    min_clients: int = 2
    evaluate_every: int = 5
    num_rounds: int = 0
    seed: int = 0

    def __post_init__(self) -> None:
        require(
            self.schedule in ("all", "sampled"),
            "clients.schedule",
            self.schedule,
            "'all' or 'sampled'",
        )
        require(0 < self.fraction <= 1, "clients.fraction", self.fraction, "a number in (0, 1]")
        require(
            self.sampling in ("binomial", "fixed"),
            "clients.sampling",
            self.sampling,
            "'binomial' or 'fixed'",
        )
        require(self.min_clients >= 1, "clients.min_clients", self.min_clients, "an integer >= 1")
        require(
            self.evaluate_every >= 0,
            "clients.evaluate_every",
            self.evaluate_every,
            "an integer >= 0",
        )
        require(self.num_rounds >= 0, "clients.num_rounds", self.num_rounds, "an integer >= 0")

    def reporting(self, server_round: int, nodes: list[int]) -> list[int]:
        """The sorted node ids that update the server in ``server_round``."""
        rng = public_generator(self.seed, server_round, Stream.COHORT)
        n = len(nodes)
        want = min(self.min_clients, n)
        if self.sampling == "binomial":
            chosen = np.flatnonzero(rng.random(n) < self.fraction)
            if chosen.size < want:
                chosen = rng.choice(n, size=want, replace=False)
        else:
            chosen = rng.choice(n, size=max(want, round(self.fraction * n)), replace=False)
        return sorted(nodes[i] for i in chosen)

    def evaluates(self, server_round: int) -> bool:
        last = self.num_rounds > 0 and server_round == self.num_rounds
        every = self.evaluate_every > 0 and server_round % self.evaluate_every == 0
        return last or every


@dataclass(frozen=True)
class Report:
    """One reporting client's posterior arrays, sample count and scalar metrics."""

    arrays: dict[str, np.ndarray]
    num_examples: int
    metrics: dict[str, float]


def reports_of(replies: Iterable[Message]) -> list[Report]:
    """The error-free replies that carry a posterior."""
    out = []
    for reply in replies:
        if reply.has_error() or POSTERIOR not in reply.content:
            continue
        metrics = reply.content["metrics"]
        out.append(
            Report(
                arrays={
                    k: np.asarray(v, dtype=np.float64)
                    for k, v in to_numpy(reply.content[POSTERIOR]).items()
                },
                num_examples=int(metrics["num-examples"]),
                metrics={k: float(v) for k, v in metrics.items() if isinstance(v, (int, float))},
            )
        )
    return out


def unstack_part(
    flat: np.ndarray, bases: list[str], like: dict[str, np.ndarray], suffix: str
) -> dict[str, np.ndarray]:
    """Split a flat vector back into ``<base><suffix>`` arrays shaped like ``like``."""
    out, at = {}, 0
    for b in bases:
        shape = like[b + suffix].shape
        size = int(np.prod(shape))
        out[b + suffix] = flat[at : at + size].reshape(shape)
        at += size
    return out


class PersonalisedStrategy(Strategy):
    """Sampling, messaging and evaluation; subclasses supply :meth:`global_update`."""

    method: str = ""

    def __init__(self, cohorts: Cohorts | None = None) -> None:
        self.cohorts = cohorts or Cohorts()
        self.previous: dict[str, np.ndarray] = {}
        self.history: list[tuple[int, dict[str, float]]] = []

    # -- hooks
    @abstractmethod
    def global_update(
        self, server_round: int, previous: dict[str, np.ndarray], reports: list[Report]
    ) -> dict[str, np.ndarray]:
        """The new global arrays from the reporting clients' posteriors."""

    def client_config(self, server_round: int) -> dict[str, int | float | str]:
        """Method keys added to every train instruction's config."""
        return {}

    def evaluate_config(self, server_round: int) -> dict[str, int | float | str]:
        """Method keys added to every evaluate instruction's config."""
        return {}

    def reporting(self, server_round: int, nodes: list[int]) -> list[int]:
        return self.cohorts.reporting(server_round, nodes)

    # -- Strategy API
    def configure_train(
        self, server_round: int, arrays: ArrayRecord, config: ConfigRecord, grid: Grid
    ) -> Iterable[Message]:
        self.previous = {k: np.asarray(v, dtype=np.float64) for k, v in to_numpy(arrays).items()}
        nodes = sorted(int(n) for n in grid.get_node_ids())
        reporting = set(self.reporting(server_round, nodes))
        targets = nodes if self.cohorts.schedule == "all" else sorted(reporting)
        messages = []
        for node in targets:
            cfg = ConfigRecord(
                {
                    **dict(config),
                    "method": self.method,
                    "server-round": server_round,
                    "report": int(node in reporting),
                    **self.client_config(server_round),
                }
            )
            content = RecordDict({GLOBAL: arrays, "config": cfg})
            messages.append(train_message(content, node, server_round))
        return messages

    def aggregate_train(
        self, server_round: int, replies: Iterable[Message]
    ) -> tuple[ArrayRecord | None, MetricRecord | None]:
        replies = list(replies)
        reports = reports_of(replies)
        losses = [
            float(r.content["metrics"]["train_loss"])
            for r in replies
            if not r.has_error() and "metrics" in r.content
        ]
        metrics = MetricRecord(
            {
                "reporting": len(reports),
                "trained": len(losses),
                "train_loss": float(np.mean(losses)) if losses else float("nan"),
            }
        )
        if not reports:
            return None, metrics
        new = self.global_update(server_round, self.previous, reports)
        return to_record({k: np.asarray(v, dtype=np.float32) for k, v in new.items()}), metrics

    def configure_evaluate(
        self, server_round: int, arrays: ArrayRecord, config: ConfigRecord, grid: Grid
    ) -> Iterable[Message]:
        if not self.cohorts.evaluates(server_round):
            return []
        cfg = {
            **dict(config),
            "method": self.method,
            "server-round": server_round,
            **self.evaluate_config(server_round),
        }
        return [
            Message(
                content=RecordDict({GLOBAL: arrays, "config": ConfigRecord(cfg)}),
                dst_node_id=int(node),
                message_type=MessageType.EVALUATE,
                group_id=str(server_round),
            )
            for node in sorted(grid.get_node_ids())
        ]

    def aggregate_evaluate(
        self, server_round: int, replies: Iterable[Message]
    ) -> MetricRecord | None:
        """Unweighted mean over clients of accuracy and NLL; pooled ECE."""
        rows = [
            r.content["metrics"]
            for r in replies
            if not r.has_error() and int(r.content["metrics"]["num-examples"]) > 0
        ]
        if not rows:
            return None
        out: dict[str, float] = {"clients": float(len(rows))}
        for kind in ("mean", "mc"):
            out[f"personal_acc_{kind}"] = float(np.mean([m[f"acc-{kind}"] for m in rows]))
            out[f"personal_nll_{kind}"] = float(np.mean([m[f"nll-{kind}"] for m in rows]))
            sums = [
                np.sum([np.asarray(m[f"ece-{kind}-{part}"]) for m in rows], axis=0)
                for part in ("count", "conf", "correct")
            ]
            out[f"personal_ece_{kind}"] = expected_calibration_error(*sums)
        self.history.append((server_round, out))
        return MetricRecord(out)

    def summary(self) -> None:
        return None


class FedAvgReference(PersonalisedStrategy):
    """FedAvg (McMahan et al. 2017, eq. 1): the sample-weighted mean of the reports.

    With ``finetune_epochs > 0`` every client fine-tunes the global model on its
    own training rows before evaluating (FedAvg + FT). Only sampled clients
    train (``Cohorts.schedule = "sampled"``).
    """

    method = "fedavg"

    def __init__(self, cohorts: Cohorts | None = None, finetune_epochs: int = 0) -> None:
        require(finetune_epochs >= 0, "finetune_epochs", finetune_epochs, "an integer >= 0")
        super().__init__(cohorts or Cohorts(schedule="sampled"))
        self.finetune_epochs = finetune_epochs

    def evaluate_config(self, server_round: int) -> dict[str, int | float | str]:
        return {"finetune-epochs": self.finetune_epochs}

    def global_update(
        self, server_round: int, previous: dict[str, np.ndarray], reports: list[Report]
    ) -> dict[str, np.ndarray]:
        w = np.array([r.num_examples for r in reports], dtype=np.float64)
        w /= w.sum()
        return {
            k: sum(wi * r.arrays[k] for wi, r in zip(w, reports, strict=True)) for k in previous
        }


class LocalOnly(PersonalisedStrategy):
    """Every client trains its own model on its own rows; nothing is aggregated."""

    method = "local"

    def __init__(self, cohorts: Cohorts | None = None) -> None:
        super().__init__(cohorts or Cohorts(schedule="all"))

    def reporting(self, server_round: int, nodes: list[int]) -> list[int]:
        return []

    def global_update(
        self, server_round: int, previous: dict[str, np.ndarray], reports: list[Report]
    ) -> dict[str, np.ndarray]:
        return previous
