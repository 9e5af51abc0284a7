"""POPri from a run config: ``[strategy] name = "popri"`` (Hou et al., ICML 2025, Alg. 1;
:mod:`strategies.methods.popri.strategy`).

``strategy.options`` is :class:`POPriOptions` (the paper's App. C defaults, as
:class:`~strategies.methods.popri.strategy.POPriSettings`; errors name ``strategy.options.<key>``).
The federation is ``[data] source = "text"``; the clients run
:func:`fedsim.workloads.popri_feedback.make_feedback_app` with the same embedder as the
server. The cohorts are the engine's (``[strategy] clients_per_round``, ``sampling``; drawn
from the server's secret, since the epsilon credits amplification by sampling), each round's
Gaussian release goes to the strategy's ledger with the run's sampling model, and every
round's record and summary.json carry its :meth:`POPriRun.privacy_report`. The rounds carry
the LoRA adapter's weights (model.npz holds the final adapter).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from flwr.app import ArrayRecord
from flwr.clientapp import ClientApp

from fedsim.config import ConfigError, require
from fedsim.data.text import TextSourceSpec
from fedsim.workloads.dpo import DPOSettings
from fedsim.workloads.popri_feedback import make_feedback_app
from strategies.methods.popri.strategy import POPri, POPriSettings
from strategies.plumbing.text_method import (
    StrippedModels,
    TextOptions,
    TextRun,
    embedder_spec,
    load_generator,
    prompt_examples,
    public_subset,
    server_embedder,
)
from strategies.spec import Accounting, StrategySpec

NAME = "popri"
WHERE = "strategy.options"


@dataclass(frozen=True, kw_only=True)
class POPriOptions(TextOptions):
    """POPri's ``strategy.options``: a text method's
    (:class:`~strategies.plumbing.text_method.TextOptions`; see
    :class:`~strategies.methods.popri.strategy.POPriSettings` for the generation and privacy
    keys), ``reject_rank`` and ``dpo`` of those settings, and ``held_out_texts``: clients'
    held-out texts the FID metric compares with (0: all)."""

    reject_rank: int | None = None
    dpo: DPOSettings = field(default_factory=DPOSettings)
    held_out_texts: int = 100

    def __post_init__(self) -> None:
        self.check_noise(NAME, WHERE)
        require(self.delta is None or 0 < self.delta < 1, f"{WHERE}.delta", self.delta,
                "a number in (0, 1) (or unset: min(1e-5, 1 / clients))")
        for key in ("held_out_texts", "max_example_words"):
            value = getattr(self, key)
            require(value >= 0, f"{WHERE}.{key}", value, "an integer >= 0 (0: all)")
        self.settings(rounds=1, delta=self.delta or 1e-5, seed=0)  # its checks, named here

    def settings(self, rounds: int, delta: float, seed: int) -> POPriSettings:
        """The strategy's settings (its errors named under ``strategy.options``)."""
        keys = ("num_prompts", "samples_per_prompt", "examples_per_prompt", "reject_rank",
                "max_new_tokens", "max_tokens", "temperature", "top_p",
                "generation_batch_size", "noise_multiplier", "target_epsilon", "accountant",
                "dpo")  # fmt: skip
        values = {key: getattr(self, key) for key in keys}
        try:
            return POPriSettings(**values, rounds=rounds, delta=delta, seed=seed)
        except ConfigError as err:  # POPriSettings names its own keys
            raise ConfigError(f"{WHERE}.{err.key}", err.value, err.allowed) from None


class POPriRun(StrippedModels, POPri):
    """POPri under ``fedsim run``: its privacy report for rounds.jsonl and summary.json, its
    starting arrays (the fresh adapter) and checkpoints without its models."""

    _MODELS = ("policy", "tokenizer", "embedder")

    def privacy_report(self) -> dict[str, Any]:
        """Epsilon so far (the ledger's, with the run's sampling model) and how it was
        computed."""
        return {
            "epsilon": self.epsilon(),
            "delta": self.ledger.delta,
            "accountant": self.settings.accountant,
            "relation": self.ledger.relation.value,
            "rounds_accounted": len(self.ledger),
            "noise_multiplier": self.noise_multiplier,
        }

    def initial_arrays(self) -> ArrayRecord:
        return self.adapter_arrays()


def build(options: POPriOptions, run: TextRun) -> POPriRun:
    """POPri over the run's text federation and cohorts."""
    facts, federation = run.facts, run.federation
    rounds = facts.required("rounds", f"the planned rounds of {NAME}")
    generator, tokenizer = load_generator(options)
    held_out = public_subset(federation.all_held_out(), options.held_out_texts, facts.seed, 7)
    return POPriRun(
        generator,
        tokenizer,
        server_embedder(options),
        prompt_examples(federation, options.max_example_words),
        held_out,
        population=federation.num_clients,
        settings=options.settings(rounds, run.delta(options.delta), facts.seed),
        sampling=run.sampling(NAME),
    )


def client_app(options: POPriOptions, source: TextSourceSpec) -> ClientApp:
    """Each client's clipped feedback on the round's candidates."""
    return make_feedback_app(source, embedder_spec(options))


SPEC = StrategySpec(
    name=NAME,
    build=build,
    options=POPriOptions,
    accounting=Accounting(ledger="one Gaussian event on the sum of clipped scores per round"),
    amplified_by_sampling=True,
    text_app=client_app,
)
