"""Private Evolution from a run config: ``[strategy] name = "private-evolution"`` (Lin et
al., ICLR 2024, Alg. 1, in PrE-Text's federated form;
:mod:`strategies.methods.private_evolution.strategy`).

``strategy.options`` is :class:`PEOptions` (errors name ``strategy.options.<key>``). The
federation is ``[data] source = "text"``; the clients run
:func:`fedsim.workloads.pe_votes.make_vote_client_app` over their texts' embeddings (the
server's embedder). The initial population ``S_1`` is the generator's samples from
``num_prompts`` prompts of public examples (drawn with ``SeedSequence([seed, 0, 5])``; no
private data); the examples and generation seeds of later rounds come from
``SeedSequence([seed, 5])`` (post-processing). The cohorts are the engine's (drawn from the
server's secret), each round's noisy histogram goes to the ledger with the run's sampling
model (``noise_multiplier``, or ``target_epsilon`` calibrated over the run's rounds), and
every round's record and summary.json carry the strategy's privacy report. The rounds carry
the population's embeddings.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
from flwr.clientapp import ClientApp

from fedsim.config import ConfigError, require
from fedsim.data.text import TextSourceSpec
from fedsim.privacy.calibration import calibrate_noise
from fedsim.privacy.sampling import FullParticipation, relation_for
from fedsim.workloads.pe_votes import make_vote_client_app
from fedsim.workloads.popri_feedback import EmbedderSpec, client_embeddings
from strategies.methods.private_evolution.strategy import PEConfig, PrivateEvolution
from strategies.plumbing.text_method import (
    StrippedModels,
    TextOptions,
    TextRun,
    embedder_spec,
    load_generator,
    prompt_examples,
    server_embedder,
)
from strategies.spec import Accounting, StrategySpec

NAME = "private-evolution"
WHERE = "strategy.options"


@dataclass(frozen=True, kw_only=True)
class PEOptions(TextOptions):
    """Private Evolution's ``strategy.options``: a text method's
    (:class:`~strategies.plumbing.text_method.TextOptions`: the generation keys of POPri's
    prompts, ``num_prompts`` K, ``samples_per_prompt`` J, ..., and the noise), and ``keep`` and
    ``threshold`` of :class:`~strategies.methods.private_evolution.strategy.PEConfig`."""

    keep: int = 0
    threshold: float = 2.0

    def __post_init__(self) -> None:
        self.check_noise(NAME, WHERE)
        require(self.target_epsilon is None or self.target_epsilon > 0,
                f"{WHERE}.target_epsilon", self.target_epsilon, "a number > 0")
        require(self.delta is None or 0 < self.delta < 1, f"{WHERE}.delta", self.delta,
                "a number in (0, 1) (or unset: min(1e-5, 1 / clients))")
        for key in ("max_new_tokens", "max_tokens", "generation_batch_size"):
            value = getattr(self, key)
            require(value >= 1, f"{WHERE}.{key}", value, "an integer >= 1")
        require(self.temperature > 0, f"{WHERE}.temperature", self.temperature, "a number > 0")
        require(0 < self.top_p <= 1, f"{WHERE}.top_p", self.top_p, "a number in (0, 1]")
        require(self.max_example_words >= 0, f"{WHERE}.max_example_words",
                self.max_example_words, "an integer >= 0 (0: all)")
        _pe_config(self, self.noise_multiplier or 0.0, self.delta or 1e-5)  # its checks


@dataclass
class Variation(StrippedModels):
    """PE's ``vary``: the generator's samples of the prompts built from example lists."""

    model: Any
    tokenizer: Any
    options: PEOptions
    _MODELS = ("model", "tokenizer")

    def __call__(self, example_lists: list[list[str]], samples: int, seed: int) -> list[list[str]]:
        from fedsim.workloads.text_models import build_prompt, generate  # noqa: PLC0415

        o = self.options
        prompts = [build_prompt(examples) for examples in example_lists]
        return generate(self.model, self.tokenizer, prompts, samples, o.max_new_tokens,
                        o.temperature, o.top_p, seed=seed, max_tokens=o.max_tokens,
                        batch_size=o.generation_batch_size)  # fmt: skip


class PrivateEvolutionRun(StrippedModels, PrivateEvolution):
    """Private Evolution under ``fedsim run`` (checkpoints without its models)."""

    _MODELS = ("embedder", "vary")


def _config(options: PEOptions, run: TextRun, sampling: Any) -> PEConfig:
    """The strategy's settings, ``target_epsilon`` calibrated over the run's rounds."""
    delta = run.delta(options.delta)
    z = options.noise_multiplier
    if z is None:
        rounds = run.facts.required("rounds", f"the planned rounds of {NAME}")
        model = FullParticipation() if sampling is None else sampling
        z = calibrate_noise(float(options.target_epsilon), delta, model, rounds,
                            options.accountant, relation_for(model))  # fmt: skip
    return _pe_config(options, float(z), delta)


def _pe_config(options: PEOptions, z: float, delta: float) -> PEConfig:
    try:
        return PEConfig(
            num_prompts=options.num_prompts, samples_per_prompt=options.samples_per_prompt,
            examples_per_prompt=options.examples_per_prompt, keep=options.keep,
            threshold=options.threshold, noise_multiplier=z, delta=delta,
            accountant=options.accountant,
        )  # fmt: skip
    except ConfigError as err:  # PEConfig names its own keys
        raise ConfigError(f"{WHERE}.{err.key}", err.value, err.allowed) from None


def initial_population(options: PEOptions, run: TextRun, vary: Variation) -> list[str]:
    """``S_1``: samples from ``num_prompts`` prompts of public examples (no private data)."""
    public = prompt_examples(run.federation, options.max_example_words)
    per = min(options.examples_per_prompt, len(public))
    require(per >= 1, "data.text", run.source.kind, "a federation with public texts")
    rng = np.random.default_rng(np.random.SeedSequence([run.facts.seed, 0, 5]))
    lists = [[public[int(i)] for i in rng.choice(len(public), per, replace=False)]
             for _ in range(options.num_prompts)]  # fmt: skip
    samples = vary(lists, options.samples_per_prompt, int(rng.integers(0, 2**31 - 1)))
    texts = [t for row in samples for t in row if t.strip()]
    if not texts:
        raise RuntimeError("the generator returned only empty samples for PE's population")
    return texts


def build(options: PEOptions, run: TextRun) -> PrivateEvolutionRun:
    """Private Evolution over the run's text federation and cohorts."""
    sampling = run.sampling(NAME)
    config = _config(options, run, sampling)
    vary = Variation(*load_generator(options), options)
    population = initial_population(options, run, vary)
    rng = np.random.default_rng(np.random.SeedSequence([run.facts.seed, 5]))
    return PrivateEvolutionRun(
        population, server_embedder(options), vary, config, rng, sampling=sampling
    )


def client_app(options: PEOptions, source: TextSourceSpec) -> ClientApp:
    """Each client's normalised nearest-neighbour votes."""
    return make_vote_client_app(ClientEmbeddings(source, embedder_spec(options)))


@dataclass(frozen=True)
class ClientEmbeddings:
    """``partition -> embeddings`` through popri_feedback's per-process cache (picklable)."""

    source: TextSourceSpec
    embedder: EmbedderSpec

    def __call__(self, partition: int) -> np.ndarray:
        return client_embeddings(self.source, self.embedder, partition)


SPEC = StrategySpec(
    name=NAME,
    build=build,
    options=PEOptions,
    accounting=Accounting(ledger="one Gaussian event on the sum of clipped votes per round"),
    amplified_by_sampling=True,
    text_app=client_app,
)
