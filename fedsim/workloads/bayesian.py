"""Mean-field Gaussian Bayesian networks: a shared body and a personal head.

Every weight ``w`` has the variational posterior ``q(w) = N(mu, sigma^2)`` with
``sigma = softplus(rho)`` (Blundell et al., "Weight Uncertainty in Neural
Networks", ICML 2015, sec. 3.2); a forward pass either samples (reparameterised,
``w = mu + sigma * eps``, drawn as pre-activations by the local reparameterisation
trick, see :meth:`BayesLinear.forward`) or uses the posterior mean. The KL
divergence between two diagonal Gaussians is in closed form (:func:`kl_normal`)::

    KL(N(m1, s1^2) || N(m2, s2^2)) = log(s2 / s1) + (s1^2 + (m1 - m2)^2) / (2 s2^2) - 1/2

summed over coordinates. The network is ``body`` (the shared feature extractor,
all layers but the last ``head_layers``) followed by ``head`` (the personal
classifier), as in pFedVEM / pFedHB. Its arrays are named
``body.<i>.weight_mu``, ``body.<i>.weight_rho``, ``..._bias_mu``/``_rho`` and
``head.<i>...``; :func:`split_names` tells the head from the body.

Evaluation: :func:`predict_proba` gives the posterior-mean prediction
``softmax(f(x; mu))`` or the Monte Carlo predictive
``(1/S) sum_s softmax(f(x; w_s))``, ``w_s ~ q``; :func:`calibration_bins` and
:func:`expected_calibration_error` give the ECE (Guo et al., "On Calibration of
Modern Neural Networks", ICML 2017, eq. 3) with equal-width confidence bins.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch
from torch import nn

from fedsim.config import require

MU, RHO = "_mu", "_rho"


def softplus_inverse(sigma: np.ndarray | float) -> np.ndarray:
    """``rho`` with ``softplus(rho) = sigma`` (sigma > 0), stable for small and large sigma."""
    s = np.asarray(sigma, dtype=np.float64)
    return np.where(s > 20.0, s, np.log(np.expm1(np.minimum(s, 20.0))))


def softplus(rho: np.ndarray | float) -> np.ndarray:
    """``log(1 + exp(rho))`` in numpy (float64)."""
    return np.logaddexp(0.0, np.asarray(rho, dtype=np.float64))


@dataclass(frozen=True, kw_only=True)
class BayesSpec:
    """A Bayesian MLP: ``in_features -> hidden... -> num_classes`` with ReLU.

    Attributes:
        in_features: inputs (flattened).
        hidden: widths of the hidden layers (at least one, so a body exists).
        num_classes: output logits.
        head_layers: how many of the last linear layers form the personal head
            (1 <= head_layers < number of linear layers).
        rho_init: initial ``rho`` of every weight (sigma = softplus(rho_init);
            the reference code uses -4, sigma ~ 0.018).
        init_std: standard deviation of the initial means (0: torch's
            Kaiming-uniform default).
    """

    in_features: int
    hidden: tuple[int, ...] = (32,)
    num_classes: int = 10
    head_layers: int = 1
    rho_init: float = -4.0
    init_std: float = 0.0

    def __post_init__(self) -> None:
        require(self.in_features >= 1, "model.in_features", self.in_features, "an integer >= 1")
        require(
            len(self.hidden) >= 1 and all(h >= 1 for h in self.hidden),
            "model.hidden",
            self.hidden,
            "at least one positive width (the shared body needs a layer)",
        )
        require(self.num_classes >= 2, "model.num_classes", self.num_classes, "an integer >= 2")
        layers = len(self.hidden) + 1
        require(
            isinstance(self.head_layers, int) and 1 <= self.head_layers < layers,
            "model.head_layers",
            self.head_layers,
            f"an integer in [1, {layers - 1}] (the model has {layers} linear layers "
            "and the body keeps at least one)",
        )
        sigma = float(
            torch.nn.functional.softplus(torch.tensor(self.rho_init, dtype=torch.float32))
        )
        require(
            math.isfinite(self.rho_init) and sigma > 0.0 and math.isfinite(sigma),
            "model.rho_init",
            self.rho_init,
            "a finite number whose softplus is > 0 in float32 (rho >= -87; "
            "the reference uses -4, sigma = 0.018)",
        )
        require(self.init_std >= 0, "model.init_std", self.init_std, "a number >= 0")

    @property
    def widths(self) -> list[int]:
        return [self.in_features, *self.hidden, self.num_classes]


class BayesLinear(nn.Module):
    """A linear layer with a factorised Gaussian posterior over weight and bias."""

    def __init__(self, in_features: int, out_features: int, rho_init: float) -> None:
        super().__init__()
        bound = 1.0 / math.sqrt(in_features)
        self.weight_mu = nn.Parameter(
            torch.empty(out_features, in_features).uniform_(-bound, bound)
        )
        self.bias_mu = nn.Parameter(torch.empty(out_features).uniform_(-bound, bound))
        self.weight_rho = nn.Parameter(torch.full((out_features, in_features), float(rho_init)))
        self.bias_rho = nn.Parameter(torch.full((out_features,), float(rho_init)))

    def forward(self, x: torch.Tensor, sample: bool = False) -> torch.Tensor:
        """Outputs for ``x`` of shape (..., in); with ``sample``, one draw per row.

        Sampling uses the local reparameterisation trick (Kingma, Salimans &
        Welling, "Variational Dropout and the Local Reparameterization Trick",
        NeurIPS 2015, eq. 6): the pre-activation of a row is Gaussian with mean
        ``x mu^T + mu_b`` and variance ``x^2 (sigma^2)^T + sigma_b^2``, sampled
        directly, which is the same marginal per row as sampling the weights.
        For S independent draws pass ``x`` of shape (S, N, in). The noise comes
        from torch's generator, seeded per client and round by the caller
        (:func:`fedsim.workloads.personalised.seeded`).
        """
        mean = nn.functional.linear(x, self.weight_mu, self.bias_mu)
        if not sample:
            return mean
        var = nn.functional.linear(
            x * x,
            nn.functional.softplus(self.weight_rho) ** 2,
            nn.functional.softplus(self.bias_rho) ** 2,
        )
        return mean + torch.sqrt(var) * torch.randn_like(mean)


class BayesMLP(nn.Module):
    """Body (``body.0 .. body.{B-1}``, ReLU after each) then head (``head.0 ..``)."""

    def __init__(self, spec: BayesSpec) -> None:
        super().__init__()
        widths = spec.widths
        layers = [
            BayesLinear(a, b, spec.rho_init) for a, b in zip(widths[:-1], widths[1:], strict=True)
        ]
        cut = len(layers) - spec.head_layers
        self.body = nn.ModuleList(layers[:cut])
        self.head = nn.ModuleList(layers[cut:])
        if spec.init_std > 0:
            with torch.no_grad():
                for layer in layers:
                    layer.weight_mu.normal_(0.0, spec.init_std)
                    layer.bias_mu.normal_(0.0, spec.init_std)

    def features(self, x: torch.Tensor, sample: bool = False) -> torch.Tensor:
        h = x if x.dim() == 3 else x.flatten(1)
        for layer in self.body:
            h = torch.relu(layer(h, sample))
        return h

    def classify(self, h: torch.Tensor, sample: bool = False) -> torch.Tensor:
        for i, layer in enumerate(self.head):
            h = layer(h, sample)
            if i < len(self.head) - 1:
                h = torch.relu(h)
        return h

    def forward(
        self, x: torch.Tensor, sample: bool = False, sample_body: bool | None = None
    ) -> torch.Tensor:
        """Logits; ``sample_body`` (default: ``sample``) samples the body's weights.

        ``x`` of shape (S, N, features) gives (S, N, classes) with S weight draws.
        """
        body = sample if sample_body is None else sample_body
        return self.classify(self.features(x, body), sample)


def build_bayes_model(spec: BayesSpec, seed: int) -> BayesMLP:
    """A fresh model with means drawn from ``seed`` (torch's global RNG untouched)."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return BayesMLP(spec)


def model_arrays(model: nn.Module) -> dict[str, np.ndarray]:
    """The model's parameters as float32 numpy copies, keyed by name."""
    return {k: v.detach().cpu().numpy().copy() for k, v in model.state_dict().items()}


def load_arrays(model: nn.Module, arrays: dict[str, np.ndarray], only: str = "") -> None:
    """Copy ``arrays`` into the model (all keys, or only those starting with ``only``)."""
    state = model.state_dict(keep_vars=True)
    wanted = {k for k in state if k.startswith(only)}
    given = {k for k in arrays if k.startswith(only)}
    if wanted != given:
        differing = sorted(wanted ^ given)
        raise ValueError(
            f"arrays do not match the Bayesian model; differing keys: {differing[:6]} "
            f"(the model has {sorted(state)[:6]}...)"
        )
    with torch.no_grad():
        for key in wanted:
            state[key].copy_(torch.from_numpy(np.array(arrays[key], dtype=np.float32)))


def split_names(names: list[str] | tuple[str, ...], part: str) -> list[str]:
    """Parameter base names (without ``_mu``/``_rho``) of ``part`` ("body" or "head")."""
    if part not in ("body", "head"):
        raise ValueError(f"part = {part!r} is not allowed: 'body' or 'head'")
    return sorted({n[: -len(MU)] for n in names if n.startswith(part + ".") and n.endswith(MU)})


def check_split(names: list[str] | tuple[str, ...], head_layers: int) -> None:
    """Refuse arrays whose head/body split does not match ``head_layers``.

    Every ``_mu`` needs its ``_rho``, and the arrays must hold exactly
    ``head_layers`` head layers and at least one body layer.
    """
    names = list(names)
    for name in names:
        if name.endswith(MU) and name[: -len(MU)] + RHO not in names:
            raise ValueError(f"array {name!r} has no matching {name[: -len(MU)] + RHO!r}")
    head = {n.split(".")[1] for n in split_names(names, "head")}
    body = {n.split(".")[1] for n in split_names(names, "body")}
    require(
        len(head) == head_layers and len(body) >= 1,
        "model.head_layers",
        head_layers,
        f"the number of head layers in the arrays ({len(head)} head, {len(body)} body layers; "
        "the body needs at least one)",
    )


# --------------------------------------------------------------------------- KL


def kl_normal(
    mu_q: torch.Tensor, sigma_q: torch.Tensor, mu_p: torch.Tensor, sigma_p: torch.Tensor
) -> torch.Tensor:
    """``sum KL(N(mu_q, sigma_q^2) || N(mu_p, sigma_p^2))`` in closed form (nats)."""
    ratio = (sigma_q / sigma_p) ** 2
    return 0.5 * (ratio + ((mu_q - mu_p) / sigma_p) ** 2 - 1.0 - torch.log(ratio)).sum()


def kl_to(
    model: BayesMLP, part: str, prior: dict[str, torch.Tensor], prior_var: float | None = None
) -> torch.Tensor:
    """``KL(q_part || p)`` summed over the part's weights and biases.

    ``prior`` maps ``<name>_mu`` / ``<name>_rho`` to tensors (a Gaussian prior
    per coordinate); with ``prior_var`` the prior variance is that scalar for
    every coordinate instead (pFedVEM's ``N(mu_g, rho_i^2 I)``).
    """
    params = dict(getattr(model, part).named_parameters(prefix=part))
    total = torch.zeros(())
    for base in split_names(list(params), part):
        mu_p = prior[base + MU]
        if prior_var is None:
            sigma_p = nn.functional.softplus(prior[base + RHO])
        else:
            sigma_p = torch.full_like(mu_p, math.sqrt(prior_var))
        sigma_q = nn.functional.softplus(params[base + RHO])
        total = total + kl_normal(params[base + MU], sigma_q, mu_p, sigma_p)
    return total


def prior_tensors(
    arrays: dict[str, np.ndarray], device: str | torch.device = "cpu"
) -> dict[str, torch.Tensor]:
    """Numpy arrays as (detached, float32) tensors on ``device`` (the model's)."""
    return {
        k: torch.from_numpy(np.array(v, dtype=np.float32)).to(device) for k, v in arrays.items()
    }


# --------------------------------------------------------------------------- evaluation


def predict_proba(
    model: BayesMLP,
    x: torch.Tensor,
    num_samples: int = 0,
    generator: torch.Generator | None = None,
) -> torch.Tensor:
    """Class probabilities: posterior mean (``num_samples = 0``) or the MC predictive.

    The MC predictive averages ``softmax(f(x; w_s))`` over ``num_samples``
    draws ``w_s ~ q`` (body and head), sampled from ``generator``.
    """
    model.eval()
    with torch.no_grad():
        if num_samples <= 0:
            return torch.softmax(model(x), dim=1)
        if generator is None:
            raise ValueError("predict_proba needs a generator when num_samples > 0")
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(int(torch.randint(0, 2**62, (1,), generator=generator)))
            draws = x.flatten(1).expand(num_samples, *x.flatten(1).shape)
            return torch.softmax(model(draws, sample=True), dim=2).mean(0)


def calibration_bins(
    probs: np.ndarray, labels: np.ndarray, num_bins: int = 10
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Per equal-width confidence bin: (count, summed confidence, summed correctness).

    Sums (not means) so that bins from many clients add up before
    :func:`expected_calibration_error`.
    """
    probs = np.asarray(probs, dtype=np.float64)
    labels = np.asarray(labels)
    count = np.zeros(num_bins)
    conf_sum = np.zeros(num_bins)
    correct_sum = np.zeros(num_bins)
    if len(labels) == 0:
        return count, conf_sum, correct_sum
    confidence = probs.max(axis=1)
    correct = (probs.argmax(axis=1) == labels).astype(np.float64)
    index = np.minimum((confidence * num_bins).astype(np.int64), num_bins - 1)
    np.add.at(count, index, 1.0)
    np.add.at(conf_sum, index, confidence)
    np.add.at(correct_sum, index, correct)
    return count, conf_sum, correct_sum


def expected_calibration_error(
    count: np.ndarray, conf_sum: np.ndarray, correct_sum: np.ndarray
) -> float:
    """ECE = sum_b (n_b / n) |acc_b - conf_b| from :func:`calibration_bins`'s sums."""
    count = np.asarray(count, dtype=np.float64)
    n = count.sum()
    if n == 0:
        return float("nan")
    return float(np.abs(np.asarray(correct_sum) - np.asarray(conf_sum)).sum() / n)
