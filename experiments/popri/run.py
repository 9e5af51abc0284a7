"""POPri vs Private Evolution vs DP-FedAvg: next-token accuracy of a downstream LM.

The comparison of Hou et al., "Private Federated Learning using Preference-Optimized Synthetic
Data" (ICML 2025), Table 2 / Fig. 3, on the offline docstring federation
(:mod:`fedsim.data.text`):

* **fully private**: the downstream LM pretrained on public text only (the paper's
  "no fine-tuning" evaluation of its C4-pretrained DistilGPT2): no private information;
* **non-private**: that model fine-tuned on the clients' private training text itself;
* **POPri** (:mod:`strategies.methods.popri.strategy`), **PE**
(:mod:`strategies.methods.private_evolution.strategy`): that
  model fine-tuned on ``synthetic_texts`` synthetic texts made with the same generator
  (SmolLM2-135M-Instruct), prompts, sampling settings and generation budget per round;
* **DP-FedAvg** (:mod:`strategies.methods.dp_fedavg.strategy` + :mod:`fedsim.workloads.lm_client`):
that
  model fine-tuned federatedly on the clients' text with client-level DP;
* **base generator** (extra row): fine-tuned on the generator's samples from public prompts
  before any private feedback (PE's initial population).

Each method runs at every epsilon of the config (``inf`` = no noise), on fedsim's engine.
Gap closed = (acc_method - acc_fully_private) / (acc_nonprivate - acc_fully_private).

    python experiments/popri/run.py experiments/popri/configs/cpu.toml
    python experiments/popri/run.py experiments/popri/configs/cpu.toml --only popri
    python experiments/popri/run.py experiments/popri/configs/cpu.toml --table-only

Every finished stage is stored in ``OUT/stages/<stage>.json`` (``OUT`` defaults to
``experiments/popri/runs/<config name>``) and skipped when the command runs again, so a
run can be resumed or split over several processes (``--only``); the table
(``OUT/table.md``, ``OUT/results.json``) is rebuilt from the stages at the end.

Secrets: the study root in ``--secrets`` (default ``~/.fedsim/popri.key``, kept outside the
results) gives the config's seed its own root (:mod:`experiments.roots`), and every *point* of
the study -- a stage that opens a run on the engine: POPri, PE or DP-FedAvg at one epsilon --
mixes its own fresh public nonce into it (:meth:`~fedsim.randomness.RunSecret.for_run`), stored
in the stage as ``run_nonce``: no two points (two methods, two epsilons, two invocations) share
a noise stream, so no difference of their releases cancels the noise. The server's noise
(bound with :func:`strategies.plumbing.server_secret.bind_parties`), DP-FedAvg's cohorts (the
server's secret draw, :func:`fedsim.engine.participation.secret_cohorts`: its epsilon credits
amplification by sampling) and the clients' secrets (given by the engine) come from the
point's root. A stage records the study root's fingerprint (``secrets_fingerprint``) and a
point also its own root's (``point_fingerprint``). A point's stage without ``run_nonce`` (from
before points had their own roots) is stale and runs again. Nothing here replays a point; a
replay would reuse the stored nonce and say so (``replay_of``).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parents[1]))
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("RAY_ACCEL_ENV_VAR_OVERRIDE_ON_ZERO", "0")
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")

import numpy as np  # noqa: E402

from fedsim.config import ConfigError, InfFloat, from_mapping, load_toml, require  # noqa: E402
from fedsim.data.text import TextSourceSpec  # noqa: E402
from fedsim.workloads.downstream_lm import LMTraining  # noqa: E402
from fedsim.workloads.dpo import DPOSettings  # noqa: E402

METHODS = ("nonprivate", "base", "popri", "pe", "dp-fedavg", "spread")
STUDY = "popri"  # its roots: experiments/roots.py
PRIVATE_METHODS = ("popri", "pe", "dp-fedavg")
#: the stage prefix of the points of :mod:`experiments.popri.tuned_dp_fedavg`
TUNED_DP_FEDAVG = "dp-fedavg-tuned"
SPREAD_SEEDS = 3


# --------------------------------------------------------------------------------------------
# Configuration
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True, kw_only=True)
class Generation:
    """Synthetic-data settings shared by POPri and PE (POPri App. C defaults).

    ``max_example_words``: only public texts of at most this many words serve as prompt
    examples (0: all); shorter prompts make generation cheaper on a CPU.
    """

    num_prompts: int = 1800
    samples_per_prompt: int = 10
    examples_per_prompt: int = 3
    max_new_tokens: int = 85
    max_tokens: int = 64
    temperature: float = 1.0
    top_p: float = 1.0
    batch_size: int = 32
    rounds: int = 31
    synthetic_texts: int = 2000
    max_example_words: int = 0


@dataclass(frozen=True, kw_only=True)
class POPriSection:
    reject_rank: int | None = None
    clients_per_round: int | None = None
    dpo: DPOSettings = field(default_factory=DPOSettings)


@dataclass(frozen=True, kw_only=True)
class PESection:
    keep: int = 0
    threshold: float = 2.0


@dataclass(frozen=True, kw_only=True)
class DPFedAvgSection:
    rounds: int = 10
    clients_per_round: int = 20
    clipping_norm: float = 0.5
    local: LMTraining = field(default_factory=lambda: LMTraining(epochs=1, batch_size=8))


@dataclass(frozen=True, kw_only=True)
class Downstream:
    vocab_size: int = 4096
    hidden: int = 64
    layers: int = 2
    heads: int = 4
    max_tokens: int = 64
    pretrain_texts: int = 2000
    eval_texts: int = 0
    private_train_texts: int = 0
    pretrain: LMTraining = field(default_factory=lambda: LMTraining(epochs=2))
    finetune: LMTraining = field(default_factory=lambda: LMTraining(epochs=4, lr=1e-3))


@dataclass(frozen=True, kw_only=True)
class Config:
    name: str
    seed: int = 0
    epsilons: tuple[InfFloat, ...] = (1.0, 4.0, math.inf)
    delta: float = 0.0
    backend: str = "local"
    workers: int = 0
    device: str = "cpu"  # where the generator samples and trains (e.g. "cuda")
    data: TextSourceSpec = field(default_factory=TextSourceSpec)
    generation: Generation = field(default_factory=Generation)
    popri: POPriSection = field(default_factory=POPriSection)
    pe: PESection = field(default_factory=PESection)
    dp_fedavg: DPFedAvgSection = field(default_factory=DPFedAvgSection)
    downstream: Downstream = field(default_factory=Downstream)

    def __post_init__(self) -> None:
        require(
            len(self.epsilons) > 0 and all(e > 0 for e in self.epsilons),
            "epsilons",
            self.epsilons,
            "a non-empty list of numbers > 0 (inf: no noise)",
        )
        require(self.backend in ("local", "ray"), "backend", self.backend, "'local' or 'ray'")
        require(
            self.device == "cpu" or self.device.startswith("cuda"),
            "device",
            self.device,
            "'cpu' or a CUDA device such as 'cuda' or 'cuda:0'",
        )
        require(0 <= self.delta < 1, "delta", self.delta, "a number in [0, 1) (0: automatic)")


def load_config(path: Path) -> Config:
    raw = load_toml(path)
    return from_mapping(Config, raw)


def eps_key(epsilon: float) -> str:
    return "inf" if math.isinf(epsilon) else f"{epsilon:g}"


# --------------------------------------------------------------------------------------------
# Shared pieces (built once per process)
# --------------------------------------------------------------------------------------------


class Context:
    """The federation, tokenised data and models one process needs, built on first use."""

    def __init__(self, config: Config, out: Path, root=None) -> None:
        from fedsim.randomness import RunSecret  # noqa: PLC0415

        self.config = config
        self.out = out
        # the study's RunSecret (None: a fresh root from OS randomness, not repeatable)
        self.root = RunSecret.fresh() if root is None else root
        self.nonce: str | None = None  # the running point's public nonce (:func:`run_stages`)
        self._cache: dict[str, Any] = {}

    @property
    def secrets(self):
        """The running point's root: this seed's root (:mod:`experiments.roots`) mixed with
        the point's nonce, so that no two points of the study share a stream."""
        from experiments.roots import seed_root  # noqa: PLC0415

        if self.nonce is None:
            raise RuntimeError(
                "a stage that opens a run needs its point's nonce: run it through run_stages "
                f"(stages that are points: {', '.join(PRIVATE_METHODS)})"
            )
        return seed_root(self.root, STUDY, self.config.seed).for_run(self.nonce)

    def open_run(self, app, num_clients: int, strategy, *, secret_cohorts=False, **options):
        """A run on the engine whose clients get their secrets from :attr:`secrets`, with
        ``strategy``'s server noise bound to the point root's server secret; with
        ``secret_cohorts`` the ``participation`` draws from that secret too (a strategy whose
        epsilon credits amplification by sampling: cohorts from the public seed would tell
        every client which rounds it was in)."""
        from fedsim.engine.participation import secret_cohorts as secret_draw  # noqa: PLC0415
        from strategies.plumbing.server_secret import bind_parties  # noqa: PLC0415

        secrets = self.secrets
        server = secrets.server()
        bind_parties(strategy, server)
        if secret_cohorts:
            options["participation"] = secret_draw(options["participation"], server)
        return self.engine().open_run(
            app, num_clients, raise_errors=True, secrets=secrets, **options
        )

    def get(self, key: str, build: Any) -> Any:
        if key not in self._cache:
            self._cache[key] = build()
        return self._cache[key]

    @property
    def federation(self):
        from fedsim.data.text import cached_text_federation  # noqa: PLC0415

        return self.get("federation", lambda: cached_text_federation(self.config.data))

    @property
    def delta(self) -> float:
        n = self.federation.num_clients
        return self.config.delta or min(1e-5, 1.0 / n)

    @property
    def tokenizer(self):
        from fedsim.workloads.text_models import load_tokenizer  # noqa: PLC0415

        return self.get("tokenizer", load_tokenizer)

    @property
    def embedder(self):
        from fedsim.workloads.popri_feedback import EmbedderSpec, cached_embedder  # noqa: PLC0415

        return self.get("embedder", lambda: cached_embedder(EmbedderSpec("minilm")))

    @property
    def prompt_examples(self) -> list[str]:
        limit = self.config.generation.max_example_words
        public = list(self.federation.public)
        return [t for t in public if len(t.split()) <= limit] if limit else public

    def rng(self, *words: int) -> np.random.Generator:
        return np.random.default_rng(np.random.SeedSequence([self.config.seed, *words]))

    def subset(self, texts: list[str], count: int, purpose: int) -> list[str]:
        if count <= 0 or count >= len(texts):
            return list(texts)
        picks = np.sort(self.rng(90, purpose).choice(len(texts), count, replace=False))
        return [texts[int(i)] for i in picks]

    # downstream data -------------------------------------------------------------------------
    def sequences(self, texts: list[str]) -> list[np.ndarray]:
        from fedsim.workloads.downstream_lm import to_sequences, tokenize  # noqa: PLC0415

        d = self.config.downstream
        return to_sequences(tokenize(self.tokenizer, texts, d.max_tokens), self.vocab, d.max_tokens)

    @property
    def vocab(self):
        from fedsim.workloads.downstream_lm import Vocabulary, tokenize  # noqa: PLC0415

        def build():
            ids = tokenize(self.tokenizer, list(self.federation.public), None)
            return Vocabulary.from_sequences(ids, self.config.downstream.vocab_size)

        return self.get("vocab", build)

    @property
    def spec(self):
        from fedsim.workloads.downstream_lm import LMSpec  # noqa: PLC0415

        d = self.config.downstream
        return LMSpec(
            vocab_size=self.vocab.size,
            hidden=d.hidden,
            layers=d.layers,
            heads=d.heads,
            max_positions=d.max_tokens + 1,
        )

    @property
    def eval_sequences(self) -> list[np.ndarray]:
        def build():
            held = self.subset(self.federation.all_held_out(), self.config.downstream.eval_texts, 1)
            return self.sequences(held)

        return self.get("eval", build)

    def pretrained(self) -> dict[str, np.ndarray]:
        """The public-text model's weights (stored in OUT/cache, which is not committed;
        retrained from the seed if the file is missing)."""
        path = self.out / "cache" / "public_lm.npz"
        if not path.exists():
            train_public(self)
        with np.load(path) as data:
            return {k: data[k] for k in data.files}

    @property
    def validation_sequences(self) -> list[np.ndarray]:
        """The held-out private texts that are not evaluation texts (disjoint from them)."""

        def build():
            held = self.federation.all_held_out()
            evaluation = set(self.subset(held, self.config.downstream.eval_texts, 1))
            return self.sequences([t for t in held if t not in evaluation])

        return self.get("validation", build)

    def finetune(self, texts: list[str], purpose: int) -> dict[str, Any]:
        """The pretrained model fine-tuned on ``texts``, evaluated on the evaluation texts
        after its last epoch (the fixed schedule); ``epochs`` holds every epoch's accuracy on
        the validation and the evaluation (``test``) texts, which leaves the training as it is."""
        from fedsim.workloads.downstream_lm import next_token_accuracy, train_and_evaluate  # noqa: PLC0415

        sequences = self.sequences(texts)
        epochs: list[dict[str, Any]] = []

        def on_epoch(epoch: int, steps: int, model) -> None:
            accuracy = {
                "validation": next_token_accuracy(model, self.validation_sequences).accuracy,
                "test": next_token_accuracy(model, self.eval_sequences).accuracy,
            }
            epochs.append({"epoch": epoch, "steps": steps, "accuracy": accuracy})

        evaluation, _, losses = train_and_evaluate(
            sequences,
            self.eval_sequences,
            self.spec,
            self.config.downstream.finetune,
            seed=self.config.seed * 1000 + purpose,
            initial=self.pretrained(),
            on_epoch=on_epoch,
        )
        return {
            **evaluation.as_dict(),
            "train_texts": len(sequences),
            "train_steps": len(losses),
            "final_train_loss": losses[-1] if losses else math.nan,
            "epochs": epochs,
        }

    def engine(self):
        from fedsim.engine import Engine, EngineConfig  # noqa: PLC0415

        def build():
            config = EngineConfig(backend=self.config.backend, workers=self.config.workers)
            return Engine(config).start()

        return self.get("engine", build)

    def generate(self, model, example_lists: list[list[str]], samples: int, seed: int):
        from fedsim.workloads.text_models import build_prompt  # noqa: PLC0415

        prompts = [build_prompt(examples) for examples in example_lists]
        return self.generate_prompts(model, prompts, samples, seed)

    def generate_prompts(self, model, prompts: list[str], samples: int, seed: int):
        from fedsim.workloads.text_models import generate  # noqa: PLC0415

        g = self.config.generation
        return generate(
            model,
            self.tokenizer,
            prompts,
            samples,
            g.max_new_tokens,
            g.temperature,
            g.top_p,
            seed=seed,
            max_tokens=g.max_tokens,
            batch_size=g.batch_size,
        )


# --------------------------------------------------------------------------------------------
# Stages
# --------------------------------------------------------------------------------------------


def train_public(ctx: Context):
    """Pretrain the downstream LM on public text and store it in OUT/cache."""
    from fedsim.workloads.downstream_lm import train_and_evaluate  # noqa: PLC0415

    d = ctx.config.downstream
    public = ctx.subset(list(ctx.federation.public), d.pretrain_texts, 2)
    sequences = ctx.sequences(public)
    evaluation, weights, losses = train_and_evaluate(
        sequences, ctx.eval_sequences, ctx.spec, d.pretrain, seed=ctx.config.seed
    )
    (ctx.out / "cache").mkdir(parents=True, exist_ok=True)
    tmp = ctx.out / "cache" / f"public_lm.{os.getpid()}.tmp.npz"
    np.savez(tmp, **weights)
    os.replace(tmp, ctx.out / "cache" / "public_lm.npz")
    return evaluation, sequences, losses


def stage_public(ctx: Context) -> dict[str, Any]:
    """The fully private baseline: the public-text model on the private held-out text."""
    from fedsim.workloads.downstream_lm import next_token_accuracy  # noqa: PLC0415

    evaluation, sequences, losses = train_public(ctx)
    untrained = next_token_accuracy(ctx.spec.build(ctx.config.seed), ctx.eval_sequences)
    return {
        **evaluation.as_dict(),
        "train_texts": len(sequences),
        "train_steps": len(losses),
        "untrained_accuracy": untrained.accuracy,
        "eval_texts": len(ctx.eval_sequences),
        "vocab_size": ctx.vocab.size,
        "eval_in_vocabulary": 1.0 - evaluation.oov_targets / max(evaluation.predictions, 1),
        "federation": ctx.federation.summary(),
    }


def stage_nonprivate(ctx: Context) -> dict[str, Any]:
    texts = ctx.subset(ctx.federation.all_train(), ctx.config.downstream.private_train_texts, 3)
    return ctx.finetune(texts, purpose=3)


def popri_settings(ctx: Context, epsilon: float):
    from strategies.methods.popri.strategy import POPriSettings  # noqa: PLC0415

    g, p = ctx.config.generation, ctx.config.popri
    return POPriSettings(
        num_prompts=g.num_prompts,
        samples_per_prompt=g.samples_per_prompt,
        examples_per_prompt=g.examples_per_prompt,
        reject_rank=p.reject_rank,
        max_new_tokens=g.max_new_tokens,
        max_tokens=g.max_tokens,
        temperature=g.temperature,
        top_p=g.top_p,
        generation_batch_size=g.batch_size,
        noise_multiplier=0.0 if math.isinf(epsilon) else None,
        target_epsilon=None if math.isinf(epsilon) else float(epsilon),
        rounds=g.rounds,
        delta=ctx.delta,
        clients_per_round=p.clients_per_round,
        dpo=p.dpo,
        seed=ctx.config.seed,
    )


def device_generator(ctx: Context):
    """SmolLM2 (model, tokenizer) on the config's ``device``."""
    from fedsim.workloads.text_models import load_generator  # noqa: PLC0415

    model, tokenizer = load_generator()
    return model.to(ctx.config.device), tokenizer


def first_round_samples(ctx: Context) -> tuple[list[str], list[list[str]]]:
    """POPri's round-1 prompts and the base generator's samples for them.

    Before its first DPO step POPri's policy is the base model (a fresh LoRA adapter is
    zero), so round 1 is the same at every epsilon; it is generated once, stored in
    ``OUT/cache``, and also serves as PE's initial population and the 'base generator' row.
    Another process generating it at the same time is waited for.
    """
    from types import SimpleNamespace  # noqa: PLC0415

    from strategies.methods.popri.strategy import POPri, int_seed, round_stream  # noqa: PLC0415

    path = ctx.out / "cache" / "first_round.json"
    lock = path.with_suffix(".lock")
    path.parent.mkdir(parents=True, exist_ok=True)
    while not path.exists():
        try:
            fd = os.open(lock, os.O_CREAT | os.O_EXCL | os.O_WRONLY)
        except FileExistsError:
            time.sleep(5)
            continue
        os.close(fd)
        try:
            settings = popri_settings(ctx, math.inf)
            view = SimpleNamespace(settings=settings, public_texts=ctx.prompt_examples)
            prompts = POPri.make_prompts(view, 1)
            seed = int_seed(round_stream(settings.seed, 1, 1))
            model, _ = ctx.get("base_generator", lambda: device_generator(ctx))
            g = ctx.config.generation
            samples = ctx.generate_prompts(model, prompts, g.samples_per_prompt, seed)
            tmp = path.with_suffix(f".{os.getpid()}.tmp")
            tmp.write_text(json.dumps({"prompts": prompts, "seed": seed, "samples": samples}))
            os.replace(tmp, path)
        finally:
            lock.unlink(missing_ok=True)
    data = json.loads(path.read_text())
    return data["prompts"], data["samples"]


def initial_population(ctx: Context) -> list[str]:
    """The base generator's samples from prompts of public examples (no private data)."""
    _, samples = first_round_samples(ctx)
    return [t for row in samples for t in row if t.strip()]


def stage_base(ctx: Context) -> dict[str, Any]:
    texts = initial_population(ctx)
    return {**ctx.finetune(texts, purpose=4), "sample": texts[:3]}


def stage_spread(ctx: Context) -> dict[str, Any]:
    """The seed spread of the downstream measurement: the base generator's texts and the
    private text fine-tuned with ``SPREAD_SEEDS`` further fine-tuning seeds."""
    base = initial_population(ctx)
    private = ctx.subset(ctx.federation.all_train(), ctx.config.downstream.private_train_texts, 3)
    out: dict[str, Any] = {}
    for name, texts in (("base", base), ("nonprivate", private)):
        accs = [ctx.finetune(texts, purpose=100 + k)["accuracy"] for k in range(SPREAD_SEEDS)]
        std = float(np.std(accs, ddof=1))  # sample standard deviation
        out[name] = {"accuracies": accs, "mean": float(np.mean(accs)), "std": std}
    return out


def stage_popri(ctx: Context, epsilon: float) -> dict[str, Any]:
    from fedsim.engine.rounds import run_rounds  # noqa: PLC0415
    from fedsim.workloads.popri_feedback import EmbedderSpec, make_feedback_app  # noqa: PLC0415
    from strategies.methods.popri.strategy import POPri  # noqa: PLC0415

    class SharedFirstRound(POPri):
        """POPri whose round-1 samples come from :func:`first_round_samples` (identical to
        what it would generate: same prompts, same seed, policy = base model)."""

        def sample(self, prompts: list[str], seed: int) -> list[list[str]]:
            if not self.history:
                cached_prompts, samples = first_round_samples(ctx)
                if cached_prompts == prompts:
                    return samples
            return super().sample(prompts, seed)

    g = ctx.config.generation
    fed = ctx.federation
    first_round_samples(ctx)  # before the generator below is loaded: one model in memory
    generator, tokenizer = device_generator(ctx)  # fresh: POPri adds its adapter in place
    held_out = ctx.subset(fed.all_held_out(), 100, 7)  # for POPri's FID metric only
    strategy = SharedFirstRound(
        generator,
        tokenizer,
        ctx.embedder,
        ctx.prompt_examples,
        held_out,
        population=fed.num_clients,
        settings=popri_settings(ctx, epsilon),
    )
    app = make_feedback_app(ctx.config.data, EmbedderSpec("minilm"))
    grid = ctx.open_run(app, fed.num_clients, strategy)
    rounds: list[dict[str, Any]] = []

    def on_round(outcome) -> None:
        row = {"round": outcome.server_round, **dict(outcome.train_metrics or {})}
        rounds.append(row)
        print(f"  popri eps={eps_key(epsilon)} round {row['round']}: {row}", flush=True)

    run_rounds(strategy, grid, strategy.adapter_arrays(), g.rounds, on_round=on_round)
    texts = strategy.synthesize(
        g.synthetic_texts, seed=ctx.config.seed + 17, samples_per_prompt=g.samples_per_prompt
    )
    result = ctx.finetune(texts, purpose=10)
    return {
        **result,
        "epsilon_spent": strategy.epsilon(),
        "noise_multiplier": strategy.noise_multiplier,
        "delta": ctx.delta,
        "rounds": rounds,
        "sample": texts[:3],
        "synthetic": texts,
    }


def stage_pe(ctx: Context, epsilon: float, index: int) -> dict[str, Any]:
    from fedsim.engine.rounds import run_rounds  # noqa: PLC0415
    from fedsim.privacy.calibration import calibrate_noise  # noqa: PLC0415
    from fedsim.privacy.sampling import FullParticipation  # noqa: PLC0415
    from fedsim.workloads.pe_votes import make_vote_client_app  # noqa: PLC0415
    from fedsim.workloads.popri_feedback import EmbedderSpec, client_embeddings  # noqa: PLC0415
    from strategies.methods.private_evolution.strategy import PEConfig, PrivateEvolution  # noqa: PLC0415

    g, pe = ctx.config.generation, ctx.config.pe
    fed = ctx.federation
    population = initial_population(ctx)
    z = (
        0.0
        if math.isinf(epsilon)
        else calibrate_noise(float(epsilon), ctx.delta, FullParticipation(), g.rounds)
    )
    model, _ = ctx.get("base_generator", lambda: device_generator(ctx))

    def vary(example_lists, samples_per_prompt, seed):
        return ctx.generate(model, example_lists, samples_per_prompt, seed)

    config = PEConfig(
        num_prompts=g.num_prompts,
        samples_per_prompt=g.samples_per_prompt,
        examples_per_prompt=g.examples_per_prompt,
        keep=pe.keep,
        threshold=pe.threshold,
        noise_multiplier=z,
        delta=ctx.delta,
    )
    strategy = PrivateEvolution(population, ctx.embedder, vary, config, ctx.rng(5, index))
    embeddings_of = _ClientEmbeddings(ctx.config.data, EmbedderSpec("minilm"), client_embeddings)
    app = make_vote_client_app(embeddings_of)
    grid = ctx.open_run(app, fed.num_clients, strategy)
    rounds: list[dict[str, Any]] = []

    def on_round(outcome) -> None:
        row = {"round": outcome.server_round, **dict(outcome.train_metrics or {})}
        rounds.append(row)
        print(f"  pe eps={eps_key(epsilon)} round {row['round']}: {row}", flush=True)

    run_rounds(strategy, grid, strategy.initial_arrays(), g.rounds, on_round=on_round)
    texts = strategy.synthesize(g.synthetic_texts)
    result = ctx.finetune(texts, purpose=20)
    return {
        **result,
        "epsilon_spent": strategy.epsilon(),
        "noise_multiplier": z,
        "delta": ctx.delta,
        "rounds": rounds,
        "sample": texts[:3],
        "synthetic": texts,
    }


@dataclass(frozen=True)
class _ClientEmbeddings:
    """``partition -> embeddings`` through popri_feedback's per-process cache (picklable)."""

    text: TextSourceSpec
    embedder: Any
    function: Any

    def __call__(self, partition: int) -> np.ndarray:
        return self.function(self.text, self.embedder, partition)


def stage_dp_fedavg(ctx: Context, epsilon: float) -> dict[str, Any]:
    """DP-FedAvg as configured: fixed-size cohorts (replace-one), FedAvg's server step."""
    from flwr.serverapp.strategy import FedAvg  # noqa: PLC0415

    from fedsim.engine import UniformCohort  # noqa: PLC0415
    from fedsim.privacy.sampling import FixedSizeSampling  # noqa: PLC0415

    s = ctx.config.dp_fedavg
    n = ctx.federation.num_clients
    k = min(s.clients_per_round, n)
    inner = FedAvg(
        fraction_train=1.0, fraction_evaluate=0.0, min_available_nodes=0, min_train_nodes=1
    )
    return dp_fedavg_point(
        ctx,
        epsilon,
        inner,
        FixedSizeSampling(k, n),
        UniformCohort(n, k, ctx.config.seed),  # drawn from the server's secret
        expected_clients=k,
        clipping_norm=s.clipping_norm,
    )


def dp_fedavg_point(
    ctx: Context,
    epsilon: float,
    inner,
    sampling,
    participation,
    *,
    expected_clients: float,
    clipping_norm: float,
    evaluate_on: dict[str, list[np.ndarray]] | None = None,
) -> dict[str, Any]:
    """One DP-FedAvg point: ``inner``'s server step on the noisy mean of clipped updates, the
    cohorts ``participation`` drawn from the point's server secret and accounted as
    ``sampling`` under its own neighbouring relation (RDP, the config's rounds and delta), the
    noisy sum divided by ``expected_clients``.
    With ``evaluate_on`` (name -> sequences) every round's global model is evaluated on each
    set, in ``rounds[i]["accuracy"]``."""
    from fedsim.engine.rounds import run_rounds  # noqa: PLC0415
    from fedsim.privacy.calibration import calibrate_noise  # noqa: PLC0415
    from fedsim.privacy.sampling import relation_for  # noqa: PLC0415
    from fedsim.record_codec import to_numpy, to_record  # noqa: PLC0415
    from fedsim.workloads.downstream_lm import load_lm_arrays, next_token_accuracy  # noqa: PLC0415
    from fedsim.workloads.lm_client import make_lm_client_app  # noqa: PLC0415
    from strategies.methods.dp_fedavg.strategy import DPFedAvg  # noqa: PLC0415

    s, fed = ctx.config.dp_fedavg, ctx.federation
    relation = relation_for(sampling)
    z = (
        0.0
        if math.isinf(epsilon)
        else calibrate_noise(float(epsilon), ctx.delta, sampling, s.rounds, "rdp", relation)
    )
    clients = [ctx.sequences(list(fed.client_texts(i))) for i in range(fed.num_clients)]
    app = make_lm_client_app(ctx.spec, clients, s.local, seed=ctx.config.seed)
    strategy = DPFedAvg(
        inner,
        clipping_norm=clipping_norm,
        noise_multiplier=z,
        expected_clients=expected_clients,
        sampling=sampling,
        delta=ctx.delta,
    )
    grid = ctx.open_run(
        app, fed.num_clients, strategy, participation=participation, secret_cohorts=True
    )
    rounds: list[dict[str, Any]] = []

    def evaluate(arrays) -> dict[str, float]:
        model = ctx.spec.build(ctx.config.seed)
        load_lm_arrays(model, to_numpy(arrays))
        return {k: next_token_accuracy(model, v).accuracy for k, v in (evaluate_on or {}).items()}

    def on_round(outcome) -> None:
        row = {"round": outcome.server_round, **dict(outcome.train_metrics or {})}
        if evaluate_on:
            row["accuracy"] = evaluate(outcome.arrays)
        rounds.append(row)
        print(f"  dp-fedavg eps={eps_key(epsilon)} round {row['round']}: {row}", flush=True)

    final = run_rounds(strategy, grid, to_record(ctx.pretrained()), s.rounds, on_round=on_round)
    model = ctx.spec.build(ctx.config.seed)
    load_lm_arrays(model, to_numpy(final))
    evaluation = next_token_accuracy(model, ctx.eval_sequences)
    return {
        **evaluation.as_dict(),
        "epsilon_spent": strategy.epsilon(),
        "noise_multiplier": z,
        "delta": ctx.delta,
        "relation": str(relation),
        "clipping_norm": clipping_norm,
        "clients_per_round": expected_clients,
        "rounds": rounds,
    }


# --------------------------------------------------------------------------------------------
# Driver
# --------------------------------------------------------------------------------------------


def stage_list(config: Config, only: tuple[str, ...]) -> list[tuple[str, Any]]:
    stages: list[tuple[str, Any]] = [("public", stage_public)]
    wanted = set(only or METHODS)
    if "nonprivate" in wanted:
        stages.append(("nonprivate", stage_nonprivate))
    if "base" in wanted:
        stages.append(("base", stage_base))
    if "spread" in wanted:
        stages.append(("spread", stage_spread))
    for i, eps in enumerate(config.epsilons):
        if "pe" in wanted:
            stages.append((f"pe-eps{eps_key(eps)}", lambda c, e=eps, j=i: stage_pe(c, e, j)))
    for eps in config.epsilons:
        if "popri" in wanted:
            stages.append((f"popri-eps{eps_key(eps)}", lambda c, e=eps: stage_popri(c, e)))
    for eps in config.epsilons:
        if "dp-fedavg" in wanted:
            stages.append((f"dp-fedavg-eps{eps_key(eps)}", lambda c, e=eps: stage_dp_fedavg(c, e)))
    return stages


def is_point(name: str) -> bool:
    """Whether stage ``name`` is a point of the study: a run on the engine whose parties
    draw secret streams (POPri, PE, DP-FedAvg at one epsilon, a point of the tuned DP-FedAvg
    grid), under its own nonce."""
    method = name.rpartition("-eps")[0]
    return method in PRIVATE_METHODS or method == TUNED_DP_FEDAVG


def finished_stage(path: Path, name: str) -> bool:
    """Whether ``path`` holds stage ``name`` finished; a point must hold its ``run_nonce``
    (one without it ran under the seed's root shared by every point: stale, run again)."""
    if not path.is_file():
        return False
    return not is_point(name) or "run_nonce" in json.loads(path.read_text())


def run_stage(ctx: Context, name: str, run: Any) -> dict[str, Any]:
    """Run stage ``name``; a point under a fresh nonce, recorded with its result."""
    from fedsim.randomness import new_nonce  # noqa: PLC0415

    ctx.nonce = new_nonce() if is_point(name) else None
    try:
        start = time.perf_counter()
        result = run(ctx)
        result["seconds"] = time.perf_counter() - start
        result["secrets_fingerprint"] = ctx.root.fingerprint()
        if ctx.nonce is not None:
            result["run_nonce"] = ctx.nonce
            result["point_fingerprint"] = ctx.secrets.fingerprint()
    finally:
        ctx.nonce = None
    return result


def run_stages(ctx: Context, only: tuple[str, ...], stages=None, stage_dir=None) -> None:
    """Run ``stages`` ((name, run) pairs; default the config's, :func:`stage_list`) into
    ``stage_dir`` (default OUT/stages), each stored when it ends and skipped once stored."""
    stage_dir = stage_dir or ctx.out / "stages"
    stage_dir.mkdir(parents=True, exist_ok=True)
    for name, run in stages or stage_list(ctx.config, only):
        path = stage_dir / f"{name}.json"
        if finished_stage(path, name):
            print(f"{name}: done earlier ({path})", flush=True)
            continue
        if path.exists():
            print(f"{name}: stale, no run_nonce (from the shared seed root); again", flush=True)
        lock = stage_dir / f"{name}.lock"
        try:
            fd = os.open(lock, os.O_CREAT | os.O_EXCL | os.O_WRONLY)
        except FileExistsError:
            if name == "public":  # every later stage needs it: wait for the other process
                while not finished_stage(path, name):
                    time.sleep(5)
                continue
            print(f"{name}: another process is running it ({lock})", flush=True)
            continue
        os.close(fd)
        try:
            print(f"{name}: running", flush=True)
            result = run_stage(ctx, name, run)
            tmp = path.with_suffix(f".{os.getpid()}.tmp")
            tmp.write_text(json.dumps(result, indent=1, default=float))
            os.replace(tmp, path)
            print(
                f"{name}: accuracy {result.get('accuracy', float('nan')):.4f} "
                f"in {result['seconds']:.0f}s",
                flush=True,
            )
        finally:
            lock.unlink(missing_ok=True)


def gap_closed(acc: float, private: float, nonprivate: float) -> float:
    """(acc - acc_fully_private) / (acc_nonprivate - acc_fully_private), as in the paper."""
    span = nonprivate - private
    return (acc - private) / span if span != 0 else math.nan


def build_table(config: Config, out: Path) -> str:
    stages = {p.stem: json.loads(p.read_text()) for p in sorted((out / "stages").glob("*.json"))}
    if "public" not in stages or "nonprivate" not in stages:
        return "(the public and nonprivate stages are needed for the table)"
    private = stages["public"]["accuracy"]
    nonprivate = stages["nonprivate"]["accuracy"]
    eps_cols = [eps_key(e) for e in config.epsilons]
    lines = [
        "| method | " + " | ".join(f"ε = {e}" for e in eps_cols) + " |",
        "|---" * (len(eps_cols) + 1) + "|",
    ]

    def cell(acc: float) -> str:
        return f"{100 * acc:.2f} ({100 * gap_closed(acc, private, nonprivate):+.0f}%)"

    lines.append(
        "| fully private (public pretraining only) | "
        + " | ".join([f"{100 * private:.2f}"] * len(eps_cols))
        + " |"
    )
    lines.append(
        "| non-private (fine-tuned on private text) | "
        + " | ".join([f"{100 * nonprivate:.2f}"] * len(eps_cols))
        + " |"
    )
    if "base" in stages:
        lines.append(
            "| base generator, no private feedback | "
            + " | ".join([cell(stages["base"]["accuracy"])] * len(eps_cols))
            + " |"
        )
    names = {"popri": "POPri", "pe": "Private Evolution", "dp-fedavg": "DP-FedAvg"}
    for method in PRIVATE_METHODS:
        cells = []
        for e in eps_cols:
            found = stages.get(f"{method}-eps{e}")
            cells.append("–" if found is None else cell(found["accuracy"]))
        lines.append(f"| {names[method]} | " + " | ".join(cells) + " |")
    results = {
        "config": _jsonable(asdict(config)),
        "fully_private_accuracy": private,
        "nonprivate_accuracy": nonprivate,
        "stages": stages,
    }
    (out / "results.json").write_text(json.dumps(results, indent=1, default=float))
    table = "\n".join(lines)
    stale = [name for name in stages if is_point(name) and "run_nonce" not in stages[name]]
    note = (
        f"\n\nStale points (no run_nonce: run under the seed root every point shared; "
        f"they run again): {', '.join(stale)}."
        if stale
        else ""
    )
    (out / "table.md").write_text(
        "Next-token top-1 accuracy (%) on private held-out text; in brackets the gap closed "
        "between fully private and non-private.\n\n" + table + note + "\n"
    )
    return table + note


def combined_table(config: Config, outs: list[Path]) -> str:
    """Mean (and spread over the replicates in ``outs``) of every row, with the gap closed
    computed per replicate and then averaged; written to ``outs[0]/table_replicates.md``."""
    runs = []
    for out in outs:
        stages = {p.stem: json.loads(p.read_text()) for p in (out / "stages").glob("*.json")}
        if "public" in stages and "nonprivate" in stages:
            runs.append(stages)
    if not runs:
        return "(no complete replicate)"
    eps_cols = [eps_key(e) for e in config.epsilons]

    def stat(values: list[float]) -> str:
        v = 100 * np.asarray(values)
        return f"{v.mean():.2f} ± {v.std(ddof=1) if len(v) > 1 else 0.0:.2f}"

    def cell(stage: str) -> str:
        accs, gaps = [], []
        for r in runs:
            if stage in r:
                acc = r[stage]["accuracy"]
                accs.append(acc)
                gaps.append(gap_closed(acc, r["public"]["accuracy"], r["nonprivate"]["accuracy"]))
        if not accs:
            return "–"
        return f"{stat(accs)} ({100 * float(np.mean(gaps)):+.0f}%)"

    lines = [
        "| method | " + " | ".join(f"ε = {e}" for e in eps_cols) + " |",
        "|---" * (len(eps_cols) + 1) + "|",
    ]
    for label, stage in (
        ("fully private (public pretraining only)", "public"),
        ("non-private (fine-tuned on private text)", "nonprivate"),
        ("base generator, no private feedback", "base"),
    ):
        value = stat([r[stage]["accuracy"] for r in runs if stage in r])
        if stage == "base":
            value = cell("base")
        lines.append(f"| {label} | " + " | ".join([value] * len(eps_cols)) + " |")
    names = {"popri": "POPri", "pe": "Private Evolution", "dp-fedavg": "DP-FedAvg"}
    for method in PRIVATE_METHODS:
        cells = [cell(f"{method}-eps{e}") for e in eps_cols]
        lines.append(f"| {names[method]} | " + " | ".join(cells) + " |")
    table = "\n".join(lines)
    header = (
        f"Next-token top-1 accuracy (%), mean ± std over {len(runs)} replicates "
        f"({', '.join(str(o.name) for o in outs)}); in brackets the mean gap closed.\n\n"
    )
    (outs[0] / "table_replicates.md").write_text(header + table + "\n")
    return table


def _jsonable(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: _jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    if isinstance(value, float) and math.isinf(value):
        return "inf"
    return value


def config_and_out(args: argparse.Namespace) -> tuple[Config, Path]:
    """The config of ``args.config`` and its result folder (``--out``, else ``runs/<name>``);
    ``--seed`` makes a replicate: everything but the federation's split reseeded."""
    config = load_config(args.config)
    if args.seed is not None:
        config = replace(config, seed=args.seed, name=f"{config.name}-seed{args.seed}")
    return config, args.out or HERE / "runs" / config.name


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("config", type=Path)
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--only", nargs="*", default=[], help=f"a subset of {METHODS}")
    parser.add_argument("--table-only", action="store_true")
    parser.add_argument("--seed", type=int, default=None, help="override the config's seed")
    parser.add_argument("--secrets", type=Path, help="study root (default ~/.fedsim/popri.key)")
    parser.add_argument(
        "--replicates",
        type=Path,
        nargs="*",
        default=[],
        help="further result folders (e.g. from --seed runs) to average with this one",
    )
    args = parser.parse_args()
    for method in args.only:
        if method not in METHODS:
            raise ConfigError("--only", method, f"one of {METHODS}")
    config, out = config_and_out(args)
    out.mkdir(parents=True, exist_ok=True)
    stamp, settings = out / "config.json", json.dumps(_jsonable(asdict(config)), sort_keys=True)
    if stamp.exists() and stamp.read_text() != settings:
        raise ConfigError(
            "--out", str(out), "a folder whose stages were made with this config (use a new --out)"
        )
    stamp.write_text(settings)
    if not args.table_only:
        from experiments.roots import default_key, study_root  # noqa: PLC0415

        ctx = Context(config, out, study_root(args.secrets or default_key(STUDY), out))
        start = time.perf_counter()
        try:
            if set(args.only or METHODS) & {"base", "pe", "popri"}:
                first_round_samples(ctx)  # needs no other stage: start generating at once
            run_stages(ctx, tuple(args.only))
        finally:
            if "engine" in ctx._cache:
                ctx._cache["engine"].close()
        print(f"all stages: {time.perf_counter() - start:.0f}s", flush=True)
    print(build_table(config, out))
    if args.replicates:
        print()
        print(combined_table(config, [out, *args.replicates]))


if __name__ == "__main__":
    main()
