"""POPri: DP synthetic text by preference-optimising the generator on private client feedback.

Hou, Wang, Zhu, Lazar & Fanti, "Private Federated Learning using Preference-Optimized
Synthetic Data", ICML 2025, Alg. 1. Each round ``t``:

1. **Generate** (server): ``K`` prompts, each with ``examples_per_prompt`` public texts drawn
   with the round's seed (:func:`~fedsim.workloads.text_models.build_prompt`); ``J`` samples
   per prompt from the current policy (the base generator plus the LoRA adapter).
2. **Embed** the ``K*J`` candidates once and send the same content to every sampled client.
3. **Client feedback** (:mod:`fedsim.workloads.popri_feedback`): summed cosine similarity to
   the client's texts, z-scored across candidates, clipped to L2 norm 1.
4. **DP aggregation**: ``s~ = (sum_i clip(v_i, 1) + N(0, sigma^2 I)) / m`` with
   ``sigma = z * 1`` (L2 sensitivity 1 under add/remove; fixed-size sampling is accounted
   under replace-one, where the ledger doubles it) and ``m`` the expected number of clients.
   One ``dp_accounting`` event per round goes to a
   :class:`~fedsim.privacy.ledger.PrivacyLedger` with the round's sampling; ``z`` is given
   or calibrated to a target epsilon over the planned rounds.
5. **Pairs**: for each prompt, its ``J`` samples sorted by ``s~``; chosen = rank 1,
   rejected = rank ``reject_rank`` (default the middle, ``ceil(J / 2)``: 5 of 10, the
   paper's choice).
6. **DPO** (:mod:`fedsim.workloads.dpo`): sigmoid loss, reference = the base model (adapter
   disabled), the adapter keeps training across rounds.
7. **Metrics**: the Fréchet distance between Gaussians fitted to the embeddings of the round's
   candidates and of the clients' held-out texts (FID computed on sentence embeddings), the
   L2 distance between their mean embeddings, and epsilon so far.

The public streams come from ``settings.seed``: prompts from ``SeedSequence([seed, t, 0])``,
sampling from ``[seed, t, 1]``, client sampling from ``[seed, t, 2]``, DPO batch order from
``[seed, t, 4]``. The DP noise is the server's own: ``server_secret.generator(t,
Purpose.NOISE, "scores")`` (:class:`~strategies.plumbing.server_secret.ServerNoise`), never the
seed. The strategy takes the generator, tokenizer and embedder as objects, so experiments pass the
real SmolLM2/MiniLM (:mod:`fedsim.workloads.text_models`) and tests tiny random models of the
same classes.

The arrays that flow between rounds (and that :func:`fedsim.engine.rounds.run_rounds`
returns) are the LoRA adapter's weights; passing them back in (e.g. from a checkpoint)
restores the adapter.
"""

from __future__ import annotations

import math
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import dp_accounting as dpa
import numpy as np
import torch
from flwr.app import ArrayRecord, ConfigRecord, Message, MetricRecord, RecordDict
from flwr.serverapp import Grid
from flwr.serverapp.strategy import Strategy
from torch import nn

from fedsim.config import require
from fedsim.privacy.calibration import calibrate_noise
from fedsim.privacy.ledger import PrivacyLedger
from fedsim.privacy.mechanisms import gaussian_noise
from fedsim.privacy.round_events import round_event
from fedsim.privacy.sampling import (
    FixedSizeSampling,
    FullParticipation,
    PoissonSampling,
    Sampling,
    relation_for,
)
from fedsim.record_codec import to_numpy, to_record
from fedsim.workloads.dpo import DPOSettings, PreferencePair, add_lora, train_dpo
from fedsim.workloads.popri_feedback import feedback_instruction, summed_scores
from fedsim.workloads.text_models import build_prompt, generate
from strategies.plumbing.server_secret import ServerNoise
from strategies.plumbing.wrapper import train_message

# --------------------------------------------------------------------------------------------
# Quality metrics on embeddings
# --------------------------------------------------------------------------------------------


def gaussian_stats(embeddings: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Mean and (unbiased, ``n - 1``) covariance of ``(n, d)`` embeddings, float64."""
    x = np.asarray(embeddings, dtype=np.float64)
    require(x.ndim == 2 and x.shape[0] >= 2, "embeddings", x.shape, "an (n, d) matrix, n >= 2")
    return x.mean(axis=0), np.cov(x, rowvar=False)


def frechet_distance(
    mean_a: np.ndarray, cov_a: np.ndarray, mean_b: np.ndarray, cov_b: np.ndarray
) -> float:
    """``||mu_a - mu_b||^2 + Tr(S_a + S_b - 2 (S_a S_b)^{1/2})`` (Heusel et al. 2017, FID).

    ``Tr((S_a S_b)^{1/2})`` is the sum of the square roots of the eigenvalues of the symmetric
    PSD ``S_a^{1/2} S_b S_a^{1/2}`` (same spectrum), so singular covariances (fewer samples
    than dimensions) are handled exactly.
    """
    vals, vecs = np.linalg.eigh(cov_a)
    root_a = (vecs * np.sqrt(np.clip(vals, 0.0, None))) @ vecs.T
    middle = root_a @ cov_b @ root_a
    trace_root = float(np.sqrt(np.clip(np.linalg.eigvalsh((middle + middle.T) / 2), 0, None)).sum())
    diff = np.asarray(mean_a) - np.asarray(mean_b)
    value = float(diff @ diff + np.trace(cov_a) + np.trace(cov_b) - 2.0 * trace_root)
    return max(value, 0.0)


# --------------------------------------------------------------------------------------------
# Settings
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True, kw_only=True)
class POPriSettings:
    """One POPri run (defaults: the paper's App. C where it has one).

    Attributes:
        num_prompts: ``K`` prompts per round (paper: 1800).
        samples_per_prompt: ``J`` candidates per prompt (paper: 10), >= 2.
        examples_per_prompt: public examples in each prompt (paper: 3).
        reject_rank: 1-based rank (by noisy score, best = 1) of the rejected sample;
            None: ``ceil(J / 2)``.
        max_new_tokens, max_tokens, temperature, top_p, generation_batch_size: sampling
            (:func:`~fedsim.workloads.text_models.generate`).
        noise_multiplier: ``z``, noise std over the sensitivity 1. Give this or
            ``target_epsilon``.
        target_epsilon: calibrate ``z`` so that ``rounds`` rounds spend this epsilon.
        rounds: the planned number of rounds (for calibration; the run may stop earlier).
        delta: the run's delta.
        accountant: "rdp" or "pld".
        clients_per_round: fixed-size sampling of this many clients per round (None: all,
            unless ``sampling_rate`` is set).
        sampling_rate: Poisson sampling with this rate (None: not Poisson).
        dpo: the DPO step.
        seed: root of every random stream of the run.
    """

    num_prompts: int = 1800
    samples_per_prompt: int = 10
    examples_per_prompt: int = 3
    reject_rank: int | None = None
    max_new_tokens: int = 85
    max_tokens: int = 64
    temperature: float = 1.0
    top_p: float = 1.0
    generation_batch_size: int = 32
    noise_multiplier: float | None = None
    target_epsilon: float | None = None
    rounds: int = 31
    delta: float = 1e-5
    accountant: str = "rdp"
    clients_per_round: int | None = None
    sampling_rate: float | None = None
    dpo: DPOSettings = field(default_factory=DPOSettings)
    seed: int = 0

    def __post_init__(self) -> None:
        def integer(key: str, minimum: int) -> None:
            value = getattr(self, key)
            require(
                isinstance(value, int) and not isinstance(value, bool) and value >= minimum,
                key,
                value,
                f"an integer >= {minimum}",
            )

        integer("num_prompts", 1)
        integer("samples_per_prompt", 2)
        integer("examples_per_prompt", 1)
        integer("max_new_tokens", 1)
        integer("max_tokens", 1)
        integer("generation_batch_size", 1)
        integer("rounds", 1)
        self._check_generation()
        self._check_privacy()

    def _check_generation(self) -> None:
        """The preference pairs' ranks and the sampler's settings."""
        require(
            self.reject_rank is None or 2 <= self.reject_rank <= self.samples_per_prompt,
            "reject_rank",
            self.reject_rank,
            f"an integer in [2, samples_per_prompt = {self.samples_per_prompt}] (or none)",
        )
        require(self.temperature > 0, "temperature", self.temperature, "a number > 0")
        require(0 < self.top_p <= 1, "top_p", self.top_p, "a number in (0, 1]")
        require(isinstance(self.dpo, DPOSettings), "dpo", self.dpo, "a DPOSettings")

    def _check_privacy(self) -> None:
        """The noise (or target epsilon), delta, accountant and the clients' sampling."""
        require(
            (self.noise_multiplier is None) != (self.target_epsilon is None),
            "noise_multiplier",
            self.noise_multiplier,
            "exactly one of noise_multiplier and target_epsilon",
        )
        require(
            self.noise_multiplier is None
            or (math.isfinite(self.noise_multiplier) and self.noise_multiplier >= 0),
            "noise_multiplier",
            self.noise_multiplier,
            "a finite number >= 0 (0: no privacy)",
        )
        require(
            self.target_epsilon is None or self.target_epsilon > 0,
            "target_epsilon",
            self.target_epsilon,
            "a number > 0",
        )
        require(0 < self.delta < 1, "delta", self.delta, "a number in (0, 1)")
        require(self.accountant in ("rdp", "pld"), "accountant", self.accountant, "'rdp' or 'pld'")
        require(
            self.clients_per_round is None or self.sampling_rate is None,
            "sampling_rate",
            self.sampling_rate,
            "unset when clients_per_round is set",
        )
        require(
            self.clients_per_round is None or self.clients_per_round >= 1,
            "clients_per_round",
            self.clients_per_round,
            "an integer >= 1 (or none: all clients)",
        )
        require(
            self.sampling_rate is None or 0 < self.sampling_rate <= 1,
            "sampling_rate",
            self.sampling_rate,
            "a number in (0, 1] (or none)",
        )

    @property
    def rejected_rank(self) -> int:
        """The rank of the rejected sample (1 = best)."""
        if self.reject_rank is not None:
            return self.reject_rank
        return max(2, -(-self.samples_per_prompt // 2))

    def sampling(self, population: int) -> Sampling:
        """The accounting model of a round among ``population`` clients."""
        if self.clients_per_round is not None:
            require(
                self.clients_per_round <= population,
                "clients_per_round",
                self.clients_per_round,
                f"at most the {population} clients",
            )
            return FixedSizeSampling(self.clients_per_round, population)
        if self.sampling_rate is not None and self.sampling_rate < 1:
            return PoissonSampling(self.sampling_rate)
        return FullParticipation()


def noisy_mean_scores(
    total: np.ndarray, noise_std: float, expected_clients: float, rng: np.random.Generator
) -> np.ndarray:
    """``(total + N(0, noise_std^2 I)) / expected_clients``: the Gaussian mechanism on the sum
    of clipped feedback vectors (sensitivity 1), divided by the expected cohort size ``m``
    (never the number that replied, which would itself leak)."""
    require(expected_clients > 0, "expected_clients", expected_clients, "a number > 0")
    return (np.asarray(total, np.float64) + gaussian_noise(total.shape, noise_std, rng)) / float(
        expected_clients
    )


def round_stream(seed: int, server_round: int, purpose: int) -> np.random.Generator:
    """POPri's public stream ``purpose`` of round ``server_round`` (0: the prompts' public
    examples, 1: the round's generation seed, 2: the cohort, 4: the DPO seed) from the
    strategy's ``seed``: ``default_rng(SeedSequence([seed, server_round, purpose]))``."""
    return np.random.default_rng(np.random.SeedSequence([seed, server_round, purpose]))


def int_seed(rng: np.random.Generator) -> int:
    """An integer seed in [0, 2^62) drawn from ``rng`` (for torch and the text generator)."""
    return int(rng.integers(0, 2**62))


def select_pairs(
    prompts: Sequence[str],
    samples: Sequence[Sequence[str]],
    scores: np.ndarray,
    rejected_rank: int,
) -> list[PreferencePair]:
    """Per prompt, (best sample, sample at ``rejected_rank``) by descending score.

    ``scores`` is flat, prompt-major (``len(prompts) * J``). Ties keep generation order
    (stable sort).
    """
    j = len(samples[0]) if samples else 0
    require(
        scores.shape == (len(prompts) * j,),
        "scores",
        scores.shape,
        f"a vector of {len(prompts)} x {j} candidate scores",
    )
    require(2 <= rejected_rank <= j, "reject_rank", rejected_rank, f"an integer in [2, {j}]")
    pairs = []
    for k, prompt in enumerate(prompts):
        order = np.argsort(-scores[k * j : (k + 1) * j], kind="stable")
        pairs.append(
            PreferencePair(
                prompt=prompt,
                chosen=samples[k][order[0]],
                rejected=samples[k][order[rejected_rank - 1]],
            )
        )
    return pairs


# --------------------------------------------------------------------------------------------
# The strategy
# --------------------------------------------------------------------------------------------


@dataclass
class _Round:
    server_round: int
    instruction: RecordDict
    prompts: list[str]
    samples: list[list[str]]
    embeddings: np.ndarray
    clients: int
    timings: dict[str, float]


class POPri(ServerNoise, Strategy):
    """POPri's server (module docstring) as a Flower Message-API strategy.

    Args:
        generator: a causal LM (``LlamaForCausalLM``); a LoRA adapter is added to it in
            place (peft) and trained by DPO; its base weights never change.
        tokenizer: the generator's tokenizer.
        embedder: an object with ``encode(list[str]) -> (n, d)`` unit rows, the same
            model the clients use.
        public_texts: the prompt examples (texts from outside the federation).
        held_out_texts: clients' held-out texts, for the quality metrics only.
        population: the number of clients ``N`` (for sampling and accounting).
        settings: :class:`POPriSettings`.
        sampling: the engine's cohorts (``fedsim run``): every node the grid reports is
            asked, accounted with this model; None: POPri draws ``settings``' cohorts.
    """

    def __init__(
        self,
        generator: nn.Module,
        tokenizer: Any,
        embedder: Any,
        public_texts: Sequence[str],
        held_out_texts: Sequence[str],
        *,
        population: int,
        settings: POPriSettings,
        sampling: Sampling | None = None,
    ) -> None:
        require(isinstance(settings, POPriSettings), "settings", settings, "a POPriSettings")
        require(
            len(public_texts) >= settings.examples_per_prompt,
            "public_texts",
            len(public_texts),
            f"at least examples_per_prompt = {settings.examples_per_prompt} texts",
        )
        require(len(held_out_texts) >= 2, "held_out_texts", len(held_out_texts), "at least 2 texts")
        require(population >= 1, "population", population, "an integer >= 1")
        self.settings = settings
        self.tokenizer = tokenizer
        self.embedder = embedder
        self.public_texts = list(public_texts)
        self.population = int(population)
        self.engine_cohorts = sampling is not None
        self.sampling = settings.sampling(self.population) if sampling is None else sampling
        self.ledger = PrivacyLedger(relation_for(self.sampling), settings.delta)
        if settings.noise_multiplier is not None:
            self.noise_multiplier = float(settings.noise_multiplier)
        else:
            self.noise_multiplier = calibrate_noise(
                float(settings.target_epsilon),  # type: ignore[arg-type]
                settings.delta,
                self.sampling,
                settings.rounds,
                accountant=settings.accountant,  # type: ignore[arg-type]
                relation=self.ledger.relation,
            )
        self.policy = add_lora(generator, settings.dpo, seed=settings.seed)
        held = self.embedder.encode(list(held_out_texts))
        self.held_out_mean, self.held_out_cov = gaussian_stats(held)
        self._round: _Round | None = None
        #: the last round's (sum of clipped feedback, noisy mean) over its candidates
        self.last_scores: tuple[np.ndarray, np.ndarray] | None = None
        self.history: list[dict[str, float]] = []

    # -- bookkeeping ---------------------------------------------------------------------------
    @property
    def noise_std(self) -> float:
        """Std of the Gaussian noise added to the sum of clipped scores (sensitivity 1)."""
        return self.noise_multiplier * 1.0

    @property
    def expected_clients(self) -> float:
        """``m``: the divisor of the noisy sum."""
        if isinstance(self.sampling, FixedSizeSampling):
            return float(self.sampling.sample_size)
        if isinstance(self.sampling, PoissonSampling):
            return self.sampling.rate * self.population
        return float(self.population)

    def round_event(self) -> dpa.DpEvent:
        """The ``dp_accounting`` event of one round."""
        return round_event(self.noise_multiplier, self.sampling)

    def epsilon(self) -> float:
        """Epsilon (nats) at the ledger's delta after the rounds released so far."""
        if len(self.ledger) == 0:
            return 0.0
        return self.ledger.epsilon(accountant=self.settings.accountant)  # type: ignore[arg-type]

    def adapter_arrays(self) -> ArrayRecord:
        """The LoRA adapter's weights (what the rounds carry)."""
        from peft import get_peft_model_state_dict

        state = get_peft_model_state_dict(self.policy)
        return to_record({k: v.detach().cpu().numpy() for k, v in state.items()})

    def _load_adapter(self, arrays: ArrayRecord) -> None:
        from peft import set_peft_model_state_dict

        values = to_numpy(arrays)
        if not values:
            return
        current = self.adapter_arrays().keys()
        require(
            set(values) == set(current),
            "arrays",
            sorted(values)[:3],
            "the LoRA adapter's weights (from adapter_arrays())",
        )
        set_peft_model_state_dict(
            self.policy, {k: torch.from_numpy(np.array(v)) for k, v in values.items()}
        )

    # -- generation ----------------------------------------------------------------------------
    def make_prompts(self, server_round: int) -> list[str]:
        """The round's ``K`` prompts, each with public examples drawn without replacement."""
        rng = round_stream(self.settings.seed, server_round, 0)
        n = len(self.public_texts)
        return [
            build_prompt(
                [
                    self.public_texts[i]
                    for i in rng.choice(n, self.settings.examples_per_prompt, replace=False)
                ]
            )
            for _ in range(self.settings.num_prompts)
        ]

    def sample(self, prompts: list[str], seed: int) -> list[list[str]]:
        """``J`` samples per prompt from the current policy: base plus adapter, applied as
        ``W x + B A x`` (equal to the merged model; never merged in place, so the base
        weights, which are also the DPO reference, stay bit-exact across rounds)."""
        s = self.settings
        return generate(
            self.policy,
            self.tokenizer,
            prompts,
            s.samples_per_prompt,
            s.max_new_tokens,
            s.temperature,
            s.top_p,
            seed=seed,
            max_tokens=s.max_tokens,
            batch_size=s.generation_batch_size,
        )

    def _sample_nodes(self, server_round: int, grid: Grid) -> list[int]:
        nodes = sorted(int(n) for n in grid.get_node_ids())
        if self.engine_cohorts:
            return nodes
        rng = round_stream(self.settings.seed, server_round, 2)
        if isinstance(self.sampling, FixedSizeSampling):
            require(
                len(nodes) >= self.sampling.sample_size,
                "clients_per_round",
                self.sampling.sample_size,
                f"at most the {len(nodes)} clients the grid reports",
            )
            picked = rng.choice(len(nodes), self.sampling.sample_size, replace=False)
            return sorted(nodes[i] for i in picked)
        if isinstance(self.sampling, PoissonSampling):
            keep = rng.random(len(nodes)) < self.sampling.rate
            return [n for n, k in zip(nodes, keep, strict=True) if k]
        return nodes

    # -- the Message-API hooks -----------------------------------------------------------------
    def configure_train(
        self, server_round: int, arrays: ArrayRecord, config: ConfigRecord, grid: Grid
    ) -> Iterable[Message]:
        self._load_adapter(arrays)
        timings: dict[str, float] = {}
        start = time.perf_counter()
        prompts = self.make_prompts(server_round)
        samples = self.sample(prompts, int_seed(round_stream(self.settings.seed, server_round, 1)))
        timings["generate_s"] = time.perf_counter() - start
        start = time.perf_counter()
        flat = [t for row in samples for t in row]
        embeddings = self.embedder.encode(flat)
        timings["embed_s"] = time.perf_counter() - start
        instruction = feedback_instruction(embeddings, server_round)
        nodes = self._sample_nodes(server_round, grid)
        self._round = _Round(
            server_round, instruction, prompts, samples, embeddings, len(nodes), timings
        )
        # one content object for every node: the grid ships it once
        return [train_message(instruction, node, server_round) for node in nodes]

    def aggregate_train(
        self, server_round: int, replies: Iterable[Message]
    ) -> tuple[ArrayRecord | None, MetricRecord | None]:
        current = self._round
        if current is None or current.server_round != server_round:
            raise RuntimeError(f"aggregate_train({server_round}) without its configure_train")
        total, clients = summed_scores(current.instruction, list(replies))
        noisy = noisy_mean_scores(
            total,
            self.noise_std,
            self.expected_clients,
            self.noise_generator(server_round, "scores"),
        )
        self.last_scores = (total, noisy)
        self.ledger.record(server_round, self.round_event())
        pairs = select_pairs(current.prompts, current.samples, noisy, self.settings.rejected_rank)
        start = time.perf_counter()
        dpo_metrics = train_dpo(
            self.policy,
            self.tokenizer,
            pairs,
            self.settings.dpo,
            seed=int_seed(round_stream(self.settings.seed, server_round, 4)),
        )
        dpo_s = time.perf_counter() - start
        mean, cov = gaussian_stats(current.embeddings)
        metrics = {
            "fid": frechet_distance(mean, cov, self.held_out_mean, self.held_out_cov),
            "mean_embedding_distance": float(np.linalg.norm(mean - self.held_out_mean)),
            "epsilon": self.epsilon(),
            "delta": self.settings.delta,
            "noise_multiplier": self.noise_multiplier,
            "noise_std": self.noise_std,
            "sampling_rate": _rate(self.sampling, self.population),
            "clients": float(clients),
            "clients_sampled": float(current.clients),
            "candidates": float(len(current.embeddings)),
            "pairs": float(len(pairs)),
            **dpo_metrics,
            **current.timings,
            "dpo_s": dpo_s,
        }
        self.history.append({"round": float(server_round), **metrics})
        self._round = None
        return self.adapter_arrays(), MetricRecord(metrics)

    def configure_evaluate(
        self, server_round: int, arrays: ArrayRecord, config: ConfigRecord, grid: Grid
    ) -> Iterable[Message]:
        return []  # quality is measured on the server, against held-out text

    def aggregate_evaluate(
        self, server_round: int, replies: Iterable[Message]
    ) -> MetricRecord | None:
        return None

    def summary(self) -> None:
        s = self.settings
        print(
            f"POPri: K={s.num_prompts} prompts x J={s.samples_per_prompt} samples, "
            f"z={self.noise_multiplier:.4g} ({type(self.sampling).__name__}), "
            f"rejected rank {s.rejected_rank}, DPO beta={s.dpo.beta}, LoRA r={s.dpo.lora_rank}"
        )

    # -- after the run --------------------------------------------------------------------------
    def synthesize(self, num_texts: int, seed: int, samples_per_prompt: int = 1) -> list[str]:
        """``num_texts`` synthetic texts from the current policy (for downstream training):
        fresh prompts from ``seed``, ``samples_per_prompt`` samples each."""
        require(num_texts >= 1, "num_texts", num_texts, "an integer >= 1")
        prompts_needed = -(-num_texts // samples_per_prompt)
        rng = np.random.default_rng(np.random.SeedSequence([seed, 0]))
        n = len(self.public_texts)
        prompts = [
            build_prompt(
                [
                    self.public_texts[i]
                    for i in rng.choice(n, self.settings.examples_per_prompt, replace=False)
                ]
            )
            for _ in range(prompts_needed)
        ]
        rows = self.sample(prompts, int_seed(rng))
        return [t for row in rows for t in row][:num_texts]


def _rate(sampling: Sampling, population: int) -> float:
    if isinstance(sampling, FixedSizeSampling):
        return sampling.sample_size / sampling.population
    if isinstance(sampling, PoissonSampling):
        return sampling.rate
    return 1.0
