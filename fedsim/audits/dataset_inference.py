"""Post-hoc dataset inference with a synthetic held-out set (Zhao, Maini, Boenisch & Dziedzic,
"Unlocking Post-hoc Dataset Inference with Synthetic Data", ICML 2025).

Question: was the *suspect set* (a data owner's texts) in the model's training data? Dataset
inference (Maini et al., 2024) compares MIA features of the suspect set with those of an
in-distribution held-out set; the post-hoc variant needs no such set:

1. **Synthetic held-out set**, one synthetic text per suspect text (paired):
   :func:`perturb_characters` resamples characters of chosen classes uniformly within their
   class (by default every digit: phone and ID numbers, the secrets of PII records, are
   i.i.d. digits, so the copy is in-distribution for a model that did not memorise the
   original), or :func:`markov_completions` keeps each text's prefix and samples the suffix
   from a character n-gram model fitted to the suspect set (the paper's suffix-completion
   generator, with an n-gram model in place of a fine-tuned LLM).
2. **MIA features** of every text under the audited model (:func:`mia_features`): the loss,
   zlib and min-k% (several k) scores of :mod:`fedsim.audits.mia`.
3. **Real-vs-synthetic text classifier** (post-hoc calibration): logistic regression on
   character 1-4-gram TF-IDF features, fitted on split A; its probability that a text is
   synthetic captures the generator's distribution shift, which is not membership.
4. **Combined linear classifier**, fitted on split B: logistic regression on
   [text-classifier probability, standardised MIA features], against the same regression on
   the text-classifier probability alone.
   For tabular rows (a classifier's audit, :func:`row_classifier`) the same role is played
   by logistic regression on the standardised raw rows; ``dataset_inference`` takes either.
5. **One-sided t-test** on split C (paired by suspect text): the combined model's separation
   ``p(synthetic | synthetic copy) - p(synthetic | suspect text)`` exceeds the text
   classifier's. Only membership can add separation beyond the distribution shift. The test
   is repeated over ``splits`` random A/B/C splits and the p-values combined as in the
   reference code, ``1 - prod(1 - p_i)``: at least every ``p_i``, so it is conservative,
   small only when every split is significant.
"""

from __future__ import annotations

from collections import Counter, defaultdict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np
from scipy import stats

from fedsim.audits import mia

CHARACTER_CLASSES = {
    "digit": "0123456789",
    "lower": "abcdefghijklmnopqrstuvwxyz",
    "upper": "ABCDEFGHIJKLMNOPQRSTUVWXYZ",
}
MINK_PERCENTS = (10.0, 20.0, 30.0, 50.0)


def perturb_characters(
    texts: Sequence[str],
    rng: np.random.Generator,
    rate: float = 1.0,
    classes: Sequence[str] = ("digit",),
) -> list[str]:
    """Each character of a class in ``classes`` is, with probability ``rate``, replaced by a
    uniform draw from its class (``CHARACTER_CLASSES``); other characters are kept."""
    if not 0.0 < rate <= 1.0:
        raise ValueError(f"rate = {rate!r} is not allowed: a probability in (0, 1]")
    bad = [c for c in classes if c not in CHARACTER_CLASSES]
    if bad or not classes:
        raise ValueError(
            f"classes = {list(classes)} is not allowed: a non-empty subset of "
            f"{', '.join(CHARACTER_CLASSES)}"
        )
    lookup = {ch: CHARACTER_CLASSES[c] for c in classes for ch in CHARACTER_CLASSES[c]}
    out = []
    for text in texts:
        chars = list(text)
        for i, ch in enumerate(chars):
            pool = lookup.get(ch)
            if pool is not None and rng.random() < rate:
                chars[i] = pool[int(rng.integers(len(pool)))]
        out.append("".join(chars))
    return out


def resample_features(x: np.ndarray, rng: np.random.Generator, rate: float = 0.25) -> np.ndarray:
    """Synthetic copies of tabular rows (``x[i]`` of any shape, e.g. an image): each feature of
    each row is, with probability ``rate``, replaced by the same feature of a uniformly drawn
    other row of ``x`` (the tabular counterpart of :func:`perturb_characters`: every copy keeps
    the rows' per-feature value sets and marginals, so it is in-distribution for a model that
    did not memorise the row)."""
    rows = np.asarray(x)
    if rows.ndim < 2 or len(rows) < 2:
        raise ValueError(f"x must hold at least two rows of features; got shape {rows.shape}")
    if not 0.0 < rate <= 1.0:
        raise ValueError(f"rate = {rate!r} is not allowed: a probability in (0, 1]")
    flat = rows.reshape(len(rows), -1)
    n, d = flat.shape
    # A uniform other row: shift the row index by 1..n-1 (mod n).
    donors = (np.arange(n)[:, None] + rng.integers(1, n, size=(n, d))) % n
    replace = rng.random((n, d)) < rate
    return np.where(replace, flat[donors, np.arange(d)[None, :]], flat).reshape(rows.shape)


def markov_completions(
    texts: Sequence[str],
    rng: np.random.Generator,
    order: int = 4,
    prefix_fraction: float = 0.5,
    fit_texts: Sequence[str] | None = None,
) -> list[str]:
    """Each text's first ``prefix_fraction`` of characters followed by a suffix sampled from a
    character n-gram model (``order`` characters of context, backing off to shorter contexts
    never seen) fitted to ``fit_texts`` (default: ``texts``), ending at an end-of-text draw or
    at twice the original suffix length."""
    if order < 1 or not 0.0 <= prefix_fraction < 1.0:
        raise ValueError(
            f"order = {order!r} (>= 1) and prefix_fraction = {prefix_fraction!r} (in [0, 1)) "
            "are not allowed"
        )
    end = "\x00"
    counts: list[dict[str, Counter[str]]] = [defaultdict(Counter) for _ in range(order + 1)]
    for text in fit_texts if fit_texts is not None else texts:
        padded = text + end
        for i, ch in enumerate(padded):
            for n in range(order + 1):
                if i >= n:
                    counts[n][padded[i - n : i]][ch] += 1
    out = []
    for text in texts:
        cut = int(len(text) * prefix_fraction)
        generated = text[:cut]
        for _ in range(2 * max(1, len(text) - cut)):
            for n in range(min(order, len(generated)), -1, -1):
                options = counts[n].get(generated[len(generated) - n :] if n else "")
                if options:
                    break
            chars = list(options)
            p = np.array([options[c] for c in chars], dtype=np.float64)
            ch = chars[int(rng.choice(len(chars), p=p / p.sum()))]
            if ch == end:
                break
            generated += ch
        out.append(generated)
    return out


def mia_features(
    log_probs: Sequence[Sequence[float]],
    texts: Sequence[str],
    mink_percents: Sequence[float] = MINK_PERCENTS,
) -> np.ndarray:
    """Rows of [loss, zlib, min-k% for each k] membership scores (higher = member)."""
    columns = [
        mia.sequence_scores("loss", log_probs),
        mia.sequence_scores("zlib", log_probs, texts),
        *(mia.sequence_scores("mink", log_probs, k=k) for k in mink_percents),
    ]
    return np.stack(columns, axis=1)


def text_classifier(real: Sequence[str], synthetic: Sequence[str], seed: int) -> object:
    """A fitted real (0) vs synthetic (1) classifier: character 1-4-gram TF-IDF + logistic
    regression; ``predict_proba(texts)[:, 1]`` is the probability of synthetic."""
    from sklearn.feature_extraction.text import TfidfVectorizer  # noqa: PLC0415
    from sklearn.linear_model import LogisticRegression  # noqa: PLC0415
    from sklearn.pipeline import make_pipeline  # noqa: PLC0415

    pipeline = make_pipeline(
        TfidfVectorizer(analyzer="char", ngram_range=(1, 4), sublinear_tf=True),
        LogisticRegression(C=1.0, max_iter=2000, random_state=seed),
    )
    pipeline.fit([*real, *synthetic], np.r_[np.zeros(len(real)), np.ones(len(synthetic))])
    return pipeline


class _FlatRows:
    """Applies a fitted model to rows of any shape, flattened to feature vectors."""

    def __init__(self, model: object) -> None:
        self.model = model

    def predict_proba(self, rows: Sequence[np.ndarray]) -> np.ndarray:
        return self.model.predict_proba(_flat_rows(rows))


def _flat_rows(rows: Sequence[np.ndarray]) -> np.ndarray:
    arr = np.asarray(rows, dtype=np.float64)
    return arr.reshape(len(arr), -1)


def row_classifier(
    real: Sequence[np.ndarray], synthetic: Sequence[np.ndarray], seed: int
) -> _FlatRows:
    """A fitted real (0) vs synthetic (1) classifier of feature rows (any shape, flattened):
    logistic regression on the standardised raw features; ``predict_proba(rows)[:, 1]`` is
    the probability of synthetic."""
    model = _linear(
        np.r_[_flat_rows(real), _flat_rows(synthetic)],
        np.r_[np.zeros(len(real)), np.ones(len(synthetic))],
        seed,
    )
    return _FlatRows(model)


def _linear(features: np.ndarray, labels: np.ndarray, seed: int) -> object:
    from sklearn.linear_model import LogisticRegression  # noqa: PLC0415
    from sklearn.pipeline import make_pipeline  # noqa: PLC0415
    from sklearn.preprocessing import StandardScaler  # noqa: PLC0415

    model = make_pipeline(StandardScaler(), LogisticRegression(max_iter=2000, random_state=seed))
    return model.fit(features, labels)


@dataclass(frozen=True)
class DatasetInferenceResult:
    """The combined p-value (small: the suspect set was trained on), the per-split p-values,
    and the split-C AUCs (suspect vs synthetic) of the text classifier alone and combined."""

    p_value: float
    split_p_values: list[float]
    auc_text: list[float] = field(default_factory=list)
    auc_combined: list[float] = field(default_factory=list)

    def to_dict(self) -> dict[str, object]:
        return {
            "p_value": self.p_value,
            "split_p_values": self.split_p_values,
            "auc_text": self.auc_text,
            "auc_combined": self.auc_combined,
        }


def _split_sizes(
    lengths: tuple[int, int, int, int], splits: int, fractions: tuple[float, float, float]
) -> tuple[int, int]:
    """The sizes of splits A and B of ``lengths[0]`` paired items (C takes the rest); a
    ValueError when the inputs are not paired, ``splits`` < 1, ``fractions`` not three
    positive shares summing to 1, or a split would hold fewer than 4 items."""
    n, n_synthetic, n_suspect_f, n_synthetic_f = lengths
    if not (n_synthetic == n == n_suspect_f == n_synthetic_f):
        raise ValueError(
            "suspect_texts, synthetic_texts, suspect_features and synthetic_features must be "
            f"paired (lengths {n}, {n_synthetic}, {n_suspect_f}, {n_synthetic_f})"
        )
    if splits < 1:
        raise ValueError(f"splits = {splits!r} is not allowed: an integer >= 1")
    if len(fractions) != 3 or min(fractions) <= 0 or abs(sum(fractions) - 1) > 1e-9:
        raise ValueError(
            f"fractions = {fractions!r} is not allowed: three positive shares summing to 1"
        )
    size_a, size_b = int(fractions[0] * n), int(fractions[1] * n)
    if min(size_a, size_b, n - size_a - size_b) < 4:
        raise ValueError(f"suspect_texts holds {n} texts: too few for three splits of >= 4")
    return size_a, size_b


def dataset_inference(
    suspect_texts: Sequence[str],
    synthetic_texts: Sequence[str],
    suspect_features: np.ndarray,
    synthetic_features: np.ndarray,
    rng: np.random.Generator,
    splits: int = 10,
    fractions: tuple[float, float, float] = (0.3, 0.3, 0.4),
    classifier: Callable[[list, list, int], object] | None = None,
) -> DatasetInferenceResult:
    """Steps 3-5 of the module docstring on paired suspect/synthetic items and features.

    ``classifier(real, synthetic, seed)`` fits the real-vs-synthetic model on lists of items
    and returns an object whose ``predict_proba(items)[:, 1]`` is the probability of
    synthetic: :func:`text_classifier` (the default) for texts, :func:`row_classifier` for
    the feature rows of a tabular dataset.
    """
    fit_classifier = text_classifier if classifier is None else classifier
    n = len(suspect_texts)
    size_a, size_b = _split_sizes(
        (n, len(synthetic_texts), len(suspect_features), len(synthetic_features)),
        splits,
        fractions,
    )
    susp_f, synth_f = np.asarray(suspect_features, float), np.asarray(synthetic_features, float)
    p_values, auc_text, auc_combined = [], [], []
    for _ in range(splits):
        seed = int(rng.integers(2**31))
        order = rng.permutation(n)
        a, b, c = order[:size_a], order[size_a : size_a + size_b], order[size_a + size_b :]
        texts = fit_classifier([suspect_texts[i] for i in a], [synthetic_texts[i] for i in a], seed)

        def p_synth(rows: np.ndarray, pipe=texts) -> tuple[np.ndarray, np.ndarray]:
            real = pipe.predict_proba([suspect_texts[i] for i in rows])[:, 1]
            synth = pipe.predict_proba([synthetic_texts[i] for i in rows])[:, 1]
            return real, synth

        (tb_real, tb_synth), (tc_real, tc_synth) = p_synth(b), p_synth(c)
        labels_b = np.r_[np.zeros(len(b)), np.ones(len(b))]
        base = _linear(np.r_[tb_real, tb_synth][:, None], labels_b, seed)
        combined = _linear(
            np.c_[np.r_[tb_real, tb_synth], np.r_[susp_f[b], synth_f[b]]], labels_b, seed
        )
        base_real = base.predict_proba(tc_real[:, None])[:, 1]
        base_synth = base.predict_proba(tc_synth[:, None])[:, 1]
        comb_real = combined.predict_proba(np.c_[tc_real, susp_f[c]])[:, 1]
        comb_synth = combined.predict_proba(np.c_[tc_synth, synth_f[c]])[:, 1]
        gain = (comb_synth - comb_real) - (base_synth - base_real)
        if np.allclose(gain, gain[0]):
            p = 0.0 if gain[0] > 0 else 1.0  # no spread: the t-test is undefined
        else:
            p = float(stats.ttest_1samp(gain, 0.0, alternative="greater").pvalue)
        p_values.append(p)
        auc_text.append(mia.roc_auc(tc_synth, tc_real))
        auc_combined.append(mia.roc_auc(comb_synth, comb_real))
    combined_p = float(1.0 - np.prod(1.0 - np.array(p_values, dtype=np.longdouble)))
    return DatasetInferenceResult(combined_p, p_values, auc_text, auc_combined)


def run_dataset_inference(
    model: object,
    suspect_texts: Sequence[str],
    rng: np.random.Generator,
    generator: str = "perturb",
    splits: int = 10,
) -> DatasetInferenceResult:
    """Generate the synthetic held-out set (``perturb`` or ``markov``), score both sets with
    the language ``model`` (:func:`fedsim.audits.lm.token_log_probs`) and test."""
    from fedsim.audits.lm import token_log_probs  # noqa: PLC0415

    if generator == "perturb":
        synthetic = perturb_characters(suspect_texts, rng)
    elif generator == "markov":
        synthetic = markov_completions(suspect_texts, rng)
    else:
        raise ValueError(f"generator = {generator!r} is not allowed: 'perturb' or 'markov'")
    suspect_features = mia_features(token_log_probs(model, suspect_texts), suspect_texts)
    synthetic_features = mia_features(token_log_probs(model, synthetic), synthetic)
    return dataset_inference(
        suspect_texts, synthetic, suspect_features, synthetic_features, rng, splits
    )
