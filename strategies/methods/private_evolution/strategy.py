"""Private Evolution (PE) for federated text, as a Flower Message-API strategy.

Private Evolution (Lin et al., "Differentially Private Synthetic Data via Foundation Model
APIs 1: Images", ICLR 2024, Alg. 1) in the federated form of PrE-Text (Hou et al., ICML 2024,
Sec. 3): the server holds a population ``S_t`` of ``M`` synthetic texts and never sees client
data. Each round

1. ``configure_train`` sends the embeddings of ``S_t`` (``(M, d)``; the strategy's global
   ArrayRecord) to every client the grid reports (the engine's cohort).
2. Each client votes (:mod:`fedsim.workloads.pe_votes`): every text of it votes for its nearest
   candidate and the count vector is L2-**normalised** to norm 1.
3. ``aggregate_train`` clips every reply to L2 norm 1 (so the bound holds whatever a client
   sends), sums them and adds ``N(0, sigma^2 I_M)`` with ``sigma = z`` (noise multiplier ``z``
   times the sensitivity 1): the DP nearest-neighbour histogram. One Gaussian event (with the
   round's sampling) goes to the run's :class:`~fedsim.privacy.ledger.PrivacyLedger`.
4. Selection (post-processing): the candidates whose noisy vote exceeds the threshold
   ``H = threshold * sigma`` are ranked by vote and the first ``keep`` survive; if none passes,
   the ``keep`` best-voted survive (their ranking is then mostly noise).
5. Variation: ``K`` prompts, each showing ``examples_per_prompt`` survivors drawn without
   replacement with probability proportional to their vote above ``H``, ask the generator for
   ``J`` samples each -- PrE-Text's in-context variation, with the prompt, generator and
   sampling settings POPri uses, so both methods spend ``K * J`` generations per round.
   The ``K * J`` new samples are ``S_{t+1}``.

After the last round :meth:`PrivateEvolution.synthesize` returns the final synthetic data set:
the last population (variations of the last survivors), topped up with further variations of
the same survivors if more texts are asked for. The histogram's noise is the server's own:
``server_secret.generator(t, Purpose.NOISE, "votes")``
(:class:`~strategies.plumbing.server_secret.ServerNoise`); the post-processing draws (examples,
generation seeds) come from the ``numpy.random.Generator`` passed in.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import dp_accounting as dpa
import numpy as np
from flwr.app import ArrayRecord, ConfigRecord, Message, MetricRecord, RecordDict
from flwr.serverapp import Grid
from flwr.serverapp.strategy import Strategy

from fedsim.config import positive_int, require
from fedsim.privacy.ledger import PrivacyLedger
from fedsim.privacy.mechanisms import gaussian_noise
from fedsim.privacy.round_events import round_event
from fedsim.privacy.sampling import FullParticipation, Sampling, relation_for
from fedsim.record_codec import to_numpy, to_record
from fedsim.workloads.pe_votes import CANDIDATES, EMBEDDINGS, Embedder, votes_of
from strategies.plumbing.server_secret import ServerNoise
from strategies.plumbing.wrapper import train_message

#: ``vary(example_lists, samples_per_prompt, seed)``: for the prompt built from each list of
#: examples, ``samples_per_prompt`` of the generator's samples.
Variation = Callable[[list[list[str]], int, int], list[list[str]]]


@dataclass(frozen=True, kw_only=True)
class PEConfig:
    """Private Evolution's settings.

    Attributes:
        num_prompts: ``K``, variation prompts per round.
        samples_per_prompt: ``J``, samples the generator draws per prompt.
        examples_per_prompt: survivors shown in one prompt (POPri's prompts show 3).
        keep: how many best-voted candidates survive a round (0: ``K``).
        threshold: ``H`` in units of the noise std: a candidate survives only if its noisy
            vote exceeds ``threshold * sigma`` (with ``sigma = 0`` any positive vote).
        noise_multiplier: ``z >= 0``; the noisy histogram's std is ``z`` (sensitivity 1).
        delta: the run's delta for the epsilon it reports.
        accountant: "rdp" or "pld".
    """

    num_prompts: int
    samples_per_prompt: int
    examples_per_prompt: int = 3
    keep: int = 0
    threshold: float = 2.0
    noise_multiplier: float
    delta: float = 1e-5
    accountant: str = "rdp"

    def __post_init__(self) -> None:
        positive_int(self.num_prompts, "num_prompts")
        positive_int(self.samples_per_prompt, "samples_per_prompt")
        positive_int(self.examples_per_prompt, "examples_per_prompt")
        require(
            isinstance(self.keep, int) and self.keep >= 0,
            "keep",
            self.keep,
            "an integer >= 0 (0: num_prompts)",
        )
        require(
            isinstance(self.threshold, (int, float)) and self.threshold >= 0,
            "threshold",
            self.threshold,
            "a number >= 0 (units of the noise std)",
        )
        require(
            isinstance(self.noise_multiplier, (int, float)) and self.noise_multiplier >= 0,
            "noise_multiplier",
            self.noise_multiplier,
            "a number >= 0",
        )
        require(0 < self.delta < 1, "delta", self.delta, "a number in (0, 1)")
        require(self.accountant in ("rdp", "pld"), "accountant", self.accountant, "'rdp' or 'pld'")

    @property
    def survivors(self) -> int:
        return self.keep or self.num_prompts


def clip_votes(votes: np.ndarray, bound: float = 1.0) -> np.ndarray:
    """``votes * min(1, bound / ||votes||_2)``."""
    norm = float(np.linalg.norm(votes))
    return votes if norm <= bound else votes * (bound / norm)


def select_survivors(noisy_votes: np.ndarray, keep: int, threshold: float) -> np.ndarray:
    """Indices of the (at most) ``keep`` candidates with the largest noisy votes among those
    above ``threshold`` (best first; ties to the smaller index); the ``keep`` best if none is
    above it."""
    noisy_votes = np.asarray(noisy_votes, dtype=np.float64)
    order = np.argsort(-noisy_votes, kind="stable")
    above = order[noisy_votes[order] > threshold]
    chosen = above if len(above) else order
    return chosen[:keep]


def example_weights(noisy_votes: np.ndarray, survivors: np.ndarray, threshold: float) -> np.ndarray:
    """Probabilities of drawing each survivor as a prompt example: proportional to its vote
    above the threshold, uniform when no survivor is above it."""
    excess = np.maximum(np.asarray(noisy_votes, dtype=np.float64)[survivors] - threshold, 0.0)
    total = float(excess.sum())
    if total <= 0:
        return np.full(len(survivors), 1.0 / len(survivors))
    return excess / total


@dataclass
class RoundRecord:
    """What one round released and selected: the survivors (best first) and their noisy
    votes, the clients that replied, epsilon after the round, and the whole noisy histogram."""

    server_round: int
    survivors: list[str]
    votes: list[float]
    clients: int
    epsilon: float
    noisy_votes: np.ndarray


@dataclass
class _State:
    population: list[str]
    embeddings: np.ndarray
    survivors: list[str] = field(default_factory=list)
    weights: np.ndarray = field(default_factory=lambda: np.zeros(0))


class PrivateEvolution(ServerNoise, Strategy):
    """Private Evolution over a population of synthetic texts.

    Args:
        population: the initial candidates ``S_1`` (e.g. the generator's samples from prompts
            with public examples).
        embedder: the server's embedding model (``encode(texts) -> (n, d)``), the one the
            clients use.
        vary: the generator: ``vary(example_lists, samples_per_prompt, seed)`` returns
            ``samples_per_prompt`` samples of the prompt built from each ``example_lists[k]``.
        config: the method's settings.
        rng: example draws and generation seeds (post-processing of the noisy votes; the
            noise itself comes from the server's secret, :meth:`bind_server_secret`).
        sampling: how the grid's cohort is drawn, for the ledger (default: every client in
            every round).
    """

    def __init__(
        self,
        population: Sequence[str],
        embedder: Embedder,
        vary: Variation,
        config: PEConfig,
        rng: np.random.Generator,
        sampling: Sampling | None = None,
    ) -> None:
        texts = [t for t in population]
        require(
            len(texts) > 0 and all(isinstance(t, str) for t in texts),
            "population",
            f"{len(texts)} items",
            "a non-empty list of str",
        )
        require(isinstance(rng, np.random.Generator), "rng", rng, "a numpy.random.Generator")
        self.embedder = embedder
        self.vary = vary
        self.config = config
        self.rng = rng
        self.sampling: Sampling = FullParticipation() if sampling is None else sampling
        self.ledger = PrivacyLedger(relation_for(self.sampling), config.delta)
        self.history: list[RoundRecord] = []
        self._state = _State(texts, self._embed(texts))

    # -- helpers ---------------------------------------------------------------------------
    def _embed(self, texts: list[str]) -> np.ndarray:
        embeddings = np.asarray(self.embedder.encode(texts), dtype=np.float32)
        if embeddings.ndim != 2 or len(embeddings) != len(texts):
            raise ValueError(
                f"embedder.encode returned shape {embeddings.shape}; expected ({len(texts)}, d)"
            )
        return embeddings

    @property
    def population(self) -> list[str]:
        """The current candidates ``S_t``."""
        return list(self._state.population)

    @property
    def survivors(self) -> list[str]:
        """The candidates that survived the last round (best first)."""
        return list(self._state.survivors)

    @property
    def noise_std(self) -> float:
        return float(self.config.noise_multiplier)

    def round_event(self) -> dpa.DpEvent:
        """One round's release: the Gaussian histogram with sensitivity 1, sampled."""
        return round_event(self.config.noise_multiplier, self.sampling)

    def epsilon(self) -> float:
        """Epsilon (nats) at the ledger's delta of every round released so far."""
        return self.ledger.epsilon(accountant=self.config.accountant)

    def privacy_report(self) -> dict[str, Any]:
        return {
            "epsilon": self.epsilon(),
            "delta": self.ledger.delta,
            "accountant": self.config.accountant,
            "relation": self.ledger.relation.value,
            "rounds_accounted": len(self.ledger),
        }

    def initial_arrays(self) -> ArrayRecord:
        """The global ArrayRecord of round 1: the initial population's embeddings."""
        return to_record({EMBEDDINGS: self._state.embeddings})

    def _prompts_from_survivors(self, prompts: int) -> list[list[str]]:
        survivors, weights = self._state.survivors, self._state.weights
        per = min(self.config.examples_per_prompt, len(survivors))
        lists = []
        for _ in range(prompts):
            picks = self.rng.choice(len(survivors), size=per, replace=False, p=weights)
            lists.append([survivors[int(i)] for i in picks])
        return lists

    def _generate(self, prompts: int) -> list[str]:
        example_lists = self._prompts_from_survivors(prompts)
        seed = int(self.rng.integers(0, 2**31 - 1))
        samples = self.vary(example_lists, self.config.samples_per_prompt, seed)
        if len(samples) != len(example_lists):
            raise ValueError(
                f"vary returned {len(samples)} sample lists for {len(example_lists)} prompts"
            )
        return [s for group in samples for s in group if s.strip()]

    # -- Message-API hooks -----------------------------------------------------------------
    def configure_train(
        self, server_round: int, arrays: ArrayRecord, config: ConfigRecord, grid: Grid
    ) -> Iterable[Message]:
        embeddings = to_numpy(arrays).get(EMBEDDINGS)
        expected = self._state.embeddings.shape
        if embeddings is None or embeddings.shape != expected:
            raise ValueError(
                f"arrays[{EMBEDDINGS!r}] has shape "
                f"{None if embeddings is None else embeddings.shape}; the population's "
                f"embeddings are {expected} (start from initial_arrays())"
            )
        content_config = ConfigRecord({**dict(config), "server-round": server_round})
        return [
            train_message(
                RecordDict({CANDIDATES: arrays, "config": content_config}), node, server_round
            )
            for node in sorted(int(n) for n in grid.get_node_ids())
        ]

    def aggregate_train(
        self, server_round: int, replies: Iterable[Message]
    ) -> tuple[ArrayRecord | None, MetricRecord | None]:
        size = len(self._state.population)
        total = np.zeros(size, dtype=np.float64)
        clients = 0
        for reply in replies:
            if reply.has_error():
                continue
            votes = votes_of(reply)
            if votes.shape != (size,):
                raise ValueError(f"a reply's votes have shape {votes.shape}; expected ({size},)")
            total += clip_votes(votes)
            clients += 1
        sigma = self.noise_std
        rng = self.noise_generator(server_round, "votes")
        noisy = total + (gaussian_noise(size, sigma, rng) if sigma > 0 else 0.0)
        self.ledger.record(server_round, self.round_event())
        threshold = self.config.threshold * sigma
        chosen = select_survivors(noisy, self.config.survivors, threshold)
        state = self._state
        state.survivors = [state.population[int(i)] for i in chosen]
        state.weights = example_weights(noisy, chosen, threshold)
        epsilon = self.epsilon()
        self.history.append(
            RoundRecord(
                server_round,
                list(state.survivors),
                noisy[chosen].tolist(),
                clients,
                epsilon,
                np.asarray(noisy, dtype=np.float64),
            )
        )
        new = self._generate(self.config.num_prompts)
        if not new:
            raise RuntimeError(f"round {server_round}: the generator returned only empty samples")
        self._state = _State(new, self._embed(new), state.survivors, state.weights)
        metrics = MetricRecord(
            {
                "pe-clients": clients,
                "pe-survivors": len(chosen),
                "pe-above-threshold": int((noisy > threshold).sum()),
                "pe-top-vote": float(noisy[chosen[0]]),
                "pe-noise-std": sigma,
                "pe-population": len(new),
                "epsilon": epsilon,
            }
        )
        return to_record({EMBEDDINGS: self._state.embeddings}), metrics

    def configure_evaluate(
        self, server_round: int, arrays: ArrayRecord, config: ConfigRecord, grid: Grid
    ) -> Iterable[Message]:
        return []  # PE has no client-side evaluation; the data set is judged downstream

    def aggregate_evaluate(
        self, server_round: int, replies: Iterable[Message]
    ) -> MetricRecord | None:
        return None

    def summary(self) -> None:
        print(
            f"PrivateEvolution: K={self.config.num_prompts} prompts x "
            f"J={self.config.samples_per_prompt} samples, z={self.config.noise_multiplier:g}, "
            f"{len(self.ledger)} rounds accounted"
        )

    # -- output ----------------------------------------------------------------------------
    def synthesize(self, count: int) -> list[str]:
        """``count`` synthetic texts: the current population (the last round's variations of
        its survivors), then as many further variations of those survivors as needed."""
        positive_int(count, "count")
        if not self._state.survivors:
            raise RuntimeError("synthesize needs at least one finished round (no survivors yet)")
        out = list(self._state.population[:count])
        while len(out) < count:
            missing = count - len(out)
            prompts = -(-missing // self.config.samples_per_prompt)
            new = self._generate(prompts)
            if not new:
                raise RuntimeError("the generator returned only empty samples")
            out += new
        return out[:count]
