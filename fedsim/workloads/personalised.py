"""Client side of the personalised methods: pFedHB, pFedVEM, pFedBayes, FedAvg(+FT), local-only.

:func:`make_personal_app` returns a Flower ClientApp. The instruction's config
names the ``method`` (set by the strategies in :mod:`strategies.plumbing.personalised`);
personal posteriors persist in ``context.state`` (``"fedsim.personal"``) from
one round to the next. A train instruction carries the global posterior
(``"global"``); a client with ``report = 1`` replies with its posterior
(``"posterior"``).

Client steps (``q_i`` personal posterior, ``q_g`` global posterior):

* pfedhb (reference code ``hb/hb_client.py``): the body is reset to the global
  body, the head is the client's own from its last round; ``head_steps`` full-batch
  Adam steps on the head's negative ELBO
  ``sum_n E_q[-log p(y_n | x_n)] + head_kl * KL(q_i,head || prior)`` (MC over
  ``mc_samples`` reparameterised draws), the prior being ``q_g,head`` or, with
  ``head-prior = "per-client"``, ``N(mu_g, rho_i^2 I)``; then ``body_epochs``
  minibatch Adam epochs on ``mean_n E_q[-log p] + body_kl * KL(q_i,body || q_g,body)``.
* pfedvem: the same with the per-client prior and a deterministic body (its
  means, no KL); the reply adds ``head-prior-var`` = ``rho_i^2``, pFedVEM's M-step
  against the received ``mu_g`` at the start of the round, the variance the head was
  trained against and the server weighs it by (``vem/vem_client.py``).
* pfedbayes: personal ``q_i`` (whole network) and the localised global ``w_i``
  (from ``q_g``); per minibatch one Adam step on
  ``sum_batch E_q[-log p] + (zeta / N_b) KL(q_i || w_i)`` and one on ``KL(q_i || w_i)``
  for ``w_i``; reports ``w_i``.
* fedavg / local: deterministic training of the means (SGD); local-only keeps its
  model in the client state and never reports.

Evaluation (every method) on the client's test rows: accuracy and NLL of the
posterior mean and of the MC predictive, and ECE bin sums of both. The personal model
of pfedhb / pfedvem is the head and the body the client trained in its last round (the
reference's clients test before the server overwrites their bodies), of pfedbayes and
local its own model; fedavg fine-tunes the global model (``finetune-epochs``) first.
"""

from __future__ import annotations

import contextlib
import functools
import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import numpy as np
import torch
from flwr.app import ConfigRecord, Context, Message, MetricRecord, RecordDict
from flwr.clientapp import ClientApp
from torch import nn

from fedsim.config import device_name, require
from fedsim.data import DatasetSpec, cached_dataset
from fedsim.models import model_device, place
from fedsim.record_codec import to_numpy, to_record
from fedsim.workloads.bayesian import (
    MU,
    RHO,
    BayesMLP,
    BayesSpec,
    calibration_bins,
    expected_calibration_error,
    kl_normal,
    kl_to,
    load_arrays,
    model_arrays,
    predict_proba,
    prior_tensors,
    split_names,
)
from fedsim.workloads.training import minibatches

PERSONAL = "fedsim.personal"
PRIOR_VAR = "head-prior-var"
METHODS = ("pfedhb", "pfedvem", "pfedbayes", "fedavg", "local")


@dataclass(frozen=True, kw_only=True)
class PersonalTraining:
    """Client hyper-parameters (defaults: the pFedHB reference code); a run config's
    ``[personal]`` table.

    Attributes:
        head_steps: full-batch Adam steps on the head per round.
        head_lr, body_lr: Adam learning rates of head and body.
        body_epochs: minibatch epochs on the body per round.
        batch_size: rows per body minibatch.
        mc_samples: reparameterised draws per loss evaluation.
        head_kl: weight of the head's ``KL(q_i,head || prior)`` (``kl_coeff_head``: 1 in
            the reference, the negative ELBO).
        body_kl: weight of ``KL(q_i,body || q_g,body)`` (1e-6 in the reference).
        zeta: pFedBayes's KL weight.
        personal_steps: pFedBayes's personal steps per local-global step (K).
        sgd_lr, sgd_epochs: FedAvg / local-only / fine-tuning SGD.
        eval_samples: MC draws of the predictive at evaluation.
        ece_bins: equal-width confidence bins of the ECE.
        seed: root of every client's draws, ``(seed, round, client, phase)``.
    """

    head_steps: int = 10
    head_lr: float = 1e-3
    body_lr: float = 1e-3
    body_epochs: int = 2
    batch_size: int = 50
    mc_samples: int = 5
    head_kl: float = 1.0
    body_kl: float = 1e-6
    zeta: float = 10.0
    personal_steps: int = 5
    sgd_lr: float = 0.05
    sgd_epochs: int = 2
    eval_samples: int = 10
    ece_bins: int = 10
    seed: int = 0

    def __post_init__(self) -> None:
        for key in (
            "head_steps",
            "body_epochs",
            "batch_size",
            "mc_samples",
            "sgd_epochs",
            "personal_steps",
        ):
            value = getattr(self, key)
            require(value >= 1, f"personal.{key}", value, "an integer >= 1")
        for key in ("head_lr", "body_lr", "sgd_lr", "zeta"):
            value = getattr(self, key)
            require(value > 0, f"personal.{key}", value, "a number > 0")
        require(self.body_kl >= 0, "personal.body_kl", self.body_kl, "a number >= 0")
        require(self.head_kl >= 0, "personal.head_kl", self.head_kl, "a number >= 0")
        require(
            self.eval_samples >= 0, "personal.eval_samples", self.eval_samples, "an integer >= 0"
        )
        require(self.ece_bins >= 1, "personal.ece_bins", self.ece_bins, "an integer >= 1")


@contextlib.contextmanager
def seeded(*words: int) -> Iterator[torch.Generator]:
    """Torch's RNG seeded from ``SeedSequence(words)`` inside the block (the CPU's restored
    after; on a GPU the block's weight draws come from its CUDA generator, which
    ``torch.manual_seed`` seeds too, so they repeat as well).

    Yields a generator from the same words for minibatch orders.
    """
    state = np.random.SeedSequence([int(w) for w in words]).generate_state(2, np.uint64)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(int(state[0] >> np.uint64(1)))
        yield torch.Generator().manual_seed(int(state[1] >> np.uint64(1)))


def _nll(
    model: BayesMLP, x: torch.Tensor, y: torch.Tensor, samples: int, body: bool
) -> torch.Tensor:
    """MC estimate of ``sum_n E_q[-log p(y_n | x_n)]`` over ``samples`` draws."""
    logits = model(x.expand(samples, *x.shape), sample=True, sample_body=body)
    return (
        nn.functional.cross_entropy(logits.flatten(0, 1), y.repeat(samples), reduction="sum")
        / samples
    )


def _params(model: BayesMLP, part: str, means_only: bool = False) -> list[nn.Parameter]:
    named = getattr(model, part).named_parameters()
    return [p for n, p in named if not (means_only and n.endswith(RHO))]


def _freeze(model: BayesMLP, trainable: list[nn.Parameter]) -> None:
    keep = {id(p) for p in trainable}
    for p in model.parameters():
        p.requires_grad_(id(p) in keep)


def prior_variance(arrays: dict[str, np.ndarray], global_arrays: dict[str, np.ndarray]) -> float:
    """pFedVEM's ``rho_i^2 = mean_d (sigma_id^2 + (mu_id - mu_gd)^2)`` over the head."""
    total, count = 0.0, 0
    for base in split_names(list(arrays), "head"):
        mu = np.asarray(arrays[base + MU], dtype=np.float64)
        sigma = np.logaddexp(0.0, np.asarray(arrays[base + RHO], dtype=np.float64))
        total += float(np.sum(sigma**2 + (mu - global_arrays[base + MU]) ** 2))
        count += mu.size
    return total / count


def hb_client_step(
    model: BayesMLP,
    global_arrays: dict[str, np.ndarray],
    x: torch.Tensor,
    y: torch.Tensor,
    cfg: PersonalTraining,
    generator: torch.Generator,
    *,
    head_prior: str,
    body_bayesian: bool,
    prior_var: float | None,
) -> float:
    """pFedHB's (and pFedVEM's) head ELBO steps then body steps, in place; mean body loss."""
    prior = prior_tensors(global_arrays, model_device(model))
    head = _params(model, "head")
    _freeze(model, head)
    opt = torch.optim.Adam(head, lr=cfg.head_lr)
    for _ in range(cfg.head_steps):
        opt.zero_grad(set_to_none=True)
        loss = _nll(model, x, y, cfg.mc_samples, body_bayesian)
        variance = prior_var if head_prior == "per-client" else None
        loss = loss + cfg.head_kl * kl_to(model, "head", prior, variance)
        loss.backward()
        opt.step()
    body = _params(model, "body", means_only=not body_bayesian)
    _freeze(model, body)
    opt = torch.optim.Adam(body, lr=cfg.body_lr)
    total, steps = 0.0, 0
    for idx in minibatches(len(y), cfg.batch_size, generator, epochs=cfg.body_epochs):
        opt.zero_grad(set_to_none=True)
        loss = _nll(model, x[idx], y[idx], cfg.mc_samples, body_bayesian) / len(idx)
        if body_bayesian and cfg.body_kl > 0:
            loss = loss + cfg.body_kl * kl_to(model, "body", prior)
        loss.backward()
        opt.step()
        total += float(loss.detach())
        steps += 1
    return total / max(steps, 1)


def bayes_client_step(
    personal: BayesMLP,
    local_global: BayesMLP,
    x: torch.Tensor,
    y: torch.Tensor,
    cfg: PersonalTraining,
    generator: torch.Generator,
) -> float:
    """pFedBayes's alternating personal / local-global steps, in place; mean personal loss."""
    opt_q = torch.optim.Adam(personal.parameters(), lr=cfg.head_lr)
    opt_w = torch.optim.Adam(local_global.parameters(), lr=cfg.body_lr)
    batches = math.ceil(len(y) / cfg.batch_size)
    total, steps = 0.0, 0
    for p in (*personal.parameters(), *local_global.parameters()):
        p.requires_grad_(True)
    for idx in minibatches(len(y), cfg.batch_size, generator, epochs=cfg.body_epochs):
        w = {k: v.detach() for k, v in local_global.state_dict().items()}
        for _ in range(cfg.personal_steps):
            opt_q.zero_grad(set_to_none=True)
            kl = sum(kl_to(personal, part, w) for part in ("body", "head"))
            nll = _nll(personal, x[idx], y[idx], cfg.mc_samples, True)
            loss = nll + cfg.zeta / batches * kl
            loss.backward()
            opt_q.step()
        q = {k: v.detach() for k, v in personal.state_dict().items()}
        opt_w.zero_grad(set_to_none=True)
        kl_w = sum(_kl_from(q, local_global, part) for part in ("body", "head"))
        kl_w.backward()
        opt_w.step()
        total += float(loss.detach()) / len(idx)
        steps += 1
    return total / max(steps, 1)


def _kl_from(q: dict[str, torch.Tensor], model: BayesMLP, part: str) -> torch.Tensor:
    """``KL(q || model's part)`` with ``q`` fixed (gradients flow into the model)."""
    params = dict(getattr(model, part).named_parameters(prefix=part))
    total = torch.zeros(())
    for base in split_names(list(params), part):
        total = total + kl_normal(
            q[base + MU],
            nn.functional.softplus(q[base + RHO]),
            params[base + MU],
            nn.functional.softplus(params[base + RHO]),
        )
    return total


def sgd_step(
    model: BayesMLP,
    x: torch.Tensor,
    y: torch.Tensor,
    cfg: PersonalTraining,
    generator: torch.Generator,
) -> float:
    """Deterministic minibatch SGD on the means (FedAvg, local-only, fine-tuning)."""
    means = [p for n, p in model.named_parameters() if n.endswith(MU)]
    _freeze(model, means)
    opt = torch.optim.SGD(means, lr=cfg.sgd_lr)
    total, steps = 0.0, 0
    for idx in minibatches(len(y), cfg.batch_size, generator, epochs=cfg.sgd_epochs):
        opt.zero_grad(set_to_none=True)
        loss = nn.functional.cross_entropy(model(x[idx]), y[idx])
        loss.backward()
        opt.step()
        total += float(loss.detach())
        steps += 1
    return total / max(steps, 1)


def evaluate_personal(
    model: BayesMLP,
    x: torch.Tensor,
    y: torch.Tensor,
    cfg: PersonalTraining,
    generator: torch.Generator,
    bayesian: bool,
) -> dict[str, float | list[float]]:
    """Accuracy, NLL and ECE bin sums of the posterior mean and of the MC predictive."""
    out: dict[str, float | list[float]] = {"num-examples": int(len(y))}
    mean = predict_proba(model, x)
    mc = (
        predict_proba(model, x, cfg.eval_samples, generator)
        if bayesian and cfg.eval_samples
        else mean
    )
    for kind, probs in (("mean", mean), ("mc", mc)):
        p = probs.cpu().numpy().astype(np.float64)
        labels = y.cpu().numpy()
        if len(labels):
            out[f"acc-{kind}"] = float(np.mean(p.argmax(1) == labels))
            out[f"nll-{kind}"] = float(
                -np.mean(np.log(np.maximum(p[np.arange(len(labels)), labels], 1e-12)))
            )
        else:
            out[f"acc-{kind}"] = out[f"nll-{kind}"] = 0.0
        count, conf, correct = calibration_bins(p, labels, cfg.ece_bins)
        out[f"ece-{kind}-count"] = count.tolist()
        out[f"ece-{kind}-conf"] = conf.tolist()
        out[f"ece-{kind}-correct"] = correct.tolist()
    return out


_MODELS: dict[tuple[BayesSpec, int, str], BayesMLP] = {}


def cached_model(spec: BayesSpec, slot: int = 0, device: str = "cpu") -> BayesMLP:
    """This process's model number ``slot`` for ``spec`` on ``device`` (weights overwritten
    per client)."""
    key = (spec, slot, device)
    if key not in _MODELS:
        _MODELS[key] = place(BayesMLP(spec), device)
    return _MODELS[key]


def _tensors(
    x: np.ndarray, y: np.ndarray, device: str = "cpu"
) -> tuple[torch.Tensor, torch.Tensor]:
    return (
        torch.from_numpy(np.array(x, dtype=np.float32)).flatten(1).to(device),
        torch.from_numpy(np.array(y, dtype=np.int64)).to(device),
    )


def _personal(context: Context) -> dict[str, np.ndarray] | None:
    if PERSONAL not in context.state:
        return None
    return {k: np.array(v) for k, v in to_numpy(context.state[PERSONAL]).items()}


@dataclass
class ClientRound:
    """What a personalised method's client step gets: the client's model ``net`` (loaded by
    the step), the global arrays ``g``, its personal arrays (None: none yet), its train rows,
    the round's config, the training settings, the round's generator and its state."""

    net: BayesMLP
    g: dict[str, np.ndarray]
    personal: dict[str, np.ndarray] | None
    x: torch.Tensor
    y: torch.Tensor
    config: ConfigRecord
    training: PersonalTraining
    gen: torch.Generator
    context: Context
    second: Callable[[], BayesMLP]  # the process's second model (pFedBayes' local global)
    metrics: dict[str, float | int]


def _hb_train(r: ClientRound) -> tuple[float, dict[str, np.ndarray]]:
    """pFedHB / pFedVEM: the hierarchical-Bayes client step from the global body and the
    client's own head; the personal head and body are kept (the reference's clients test
    with both before the server overwrites their bodies)."""
    load_arrays(r.net, r.g)
    if r.personal is not None:
        load_arrays(r.net, r.personal, only="head.")
    head_prior = str(r.config.get("head-prior", "global"))
    prior_var = None
    if head_prior == "per-client":
        prior_var = prior_variance(r.personal if r.personal is not None else r.g, r.g)
    loss = hb_client_step(
        r.net,
        r.g,
        r.x,
        r.y,
        r.training,
        r.gen,
        head_prior=head_prior,
        body_bayesian=bool(int(r.config.get("body-bayesian", 1))),
        prior_var=prior_var,
    )
    reply = model_arrays(r.net)
    r.context.state[PERSONAL] = to_record(reply)
    if prior_var is not None:  # the variance its head was trained against
        r.metrics[PRIOR_VAR] = prior_var
    return loss, reply


def _bayes_train(r: ClientRound) -> tuple[float, dict[str, np.ndarray]]:
    """pFedBayes: the personal posterior trained against the local copy of the global one,
    which is the reply."""
    load_arrays(r.net, r.personal if r.personal is not None else r.g)
    local_global = r.second()
    load_arrays(local_global, r.g)
    loss = bayes_client_step(r.net, local_global, r.x, r.y, r.training, r.gen)
    r.context.state[PERSONAL] = to_record(model_arrays(r.net))
    return loss, model_arrays(local_global)


def _sgd_train(r: ClientRound) -> tuple[float, dict[str, np.ndarray]]:
    """FedAvg: SGD from the global model."""
    load_arrays(r.net, r.g)
    loss = sgd_step(r.net, r.x, r.y, r.training, r.gen)
    return loss, model_arrays(r.net)


def _local_train(r: ClientRound) -> tuple[float, dict[str, np.ndarray]]:
    """Local only: SGD from the client's own model, which it keeps."""
    load_arrays(r.net, r.personal if r.personal is not None else r.g)
    loss = sgd_step(r.net, r.x, r.y, r.training, r.gen)
    reply = model_arrays(r.net)
    r.context.state[PERSONAL] = to_record(reply)
    return loss, reply


#: method -> its client train step: (loss, the arrays it replies)
PERSONAL_TRAINING: dict[str, Callable[[ClientRound], tuple[float, dict[str, np.ndarray]]]] = {
    "pfedhb": _hb_train,
    "pfedvem": _hb_train,
    "pfedbayes": _bayes_train,
    "fedavg": _sgd_train,
    "local": _local_train,
}


def _method(config: ConfigRecord) -> str:
    method = str(config["method"])
    require(method in METHODS, "method", method, f"one of {', '.join(METHODS)}")
    return method


def make_personal_app(
    model: BayesSpec, data: DatasetSpec, training: PersonalTraining, device: str = "cpu"
) -> ClientApp:
    """A ClientApp running every personalised method on ``data``'s clients, training
    (:data:`PERSONAL_TRAINING`) and evaluating on ``device`` (the model once per process,
    each client's rows per call)."""
    device_name(device, "device")
    app = ClientApp()

    @app.train()
    def train(message: Message, context: Context) -> Message:
        partition = int(context.node_config["partition-id"])
        config: ConfigRecord = message.content["config"]
        step = PERSONAL_TRAINING[_method(config)]
        g = {k: np.asarray(v) for k, v in to_numpy(message.content["global"]).items()}
        x, y = _tensors(*cached_dataset(data).train.client(partition), device)
        net, personal = cached_model(model, device=device), _personal(context)
        metrics: dict[str, float | int] = {"num-examples": int(len(y))}
        second = functools.partial(cached_model, model, slot=1, device=device)
        with seeded(training.seed, int(config["server-round"]), partition, 0) as gen:
            loss, reply = step(
                ClientRound(
                    net, g, personal, x, y, config, training, gen, context, second, metrics
                )
            )
        metrics["train_loss"] = loss
        content = RecordDict({"metrics": MetricRecord(metrics)})
        if bool(int(config.get("report", 0))):
            content["posterior"] = to_record(reply)
        return Message(content=content, reply_to=message)

    @app.evaluate()
    def evaluate(message: Message, context: Context) -> Message:
        return _evaluate(model, data, training, device, message, context)

    return app


def _evaluate(
    model: BayesSpec,
    data: DatasetSpec,
    training: PersonalTraining,
    device: str,
    message: Message,
    context: Context,
) -> Message:
    """A client's evaluation: its personal model where it keeps one (FedAvg: the global
    model, fine-tuned first with ``finetune-epochs``)."""
    partition = int(context.node_config["partition-id"])
    config: ConfigRecord = message.content["config"]
    method = _method(config)
    dataset = cached_dataset(data)
    x, y = _tensors(*dataset.test.client(partition), device)
    g = {k: np.asarray(v) for k, v in to_numpy(message.content["global"]).items()}
    personal = _personal(context)
    net = cached_model(model, device=device)
    load_arrays(net, g)
    bayesian = method in ("pfedhb", "pfedvem", "pfedbayes")
    with seeded(training.seed, int(config["server-round"]), partition, 1) as gen:
        if personal is not None and method in ("pfedhb", "pfedvem", "pfedbayes", "local"):
            load_arrays(net, personal)
        elif method == "fedavg" and int(config.get("finetune-epochs", 0)) > 0:
            xt, yt = _tensors(*dataset.train.client(partition), device)
            tune = PersonalTraining(
                **{**training.__dict__, "sgd_epochs": int(config["finetune-epochs"])}
            )
            sgd_step(net, xt, yt, tune, gen)
        result = evaluate_personal(net, x, y, training, gen, bayesian)
    return Message(content=RecordDict({"metrics": MetricRecord(result)}), reply_to=message)


def global_metrics(
    model: BayesMLP,
    arrays: dict[str, np.ndarray],
    x: np.ndarray,
    y: np.ndarray,
    ece_bins: int = 10,
) -> dict[str, float]:
    """Posterior-mean accuracy, NLL and ECE (``ece_bins`` bins) of the global model on (x, y)."""
    load_arrays(model, arrays)
    xt, yt = _tensors(x, y)
    p = predict_proba(model, xt).numpy().astype(np.float64)
    labels = yt.numpy()
    return {
        "global_acc": float(np.mean(p.argmax(1) == labels)),
        "global_nll": float(-np.mean(np.log(np.maximum(p[np.arange(len(labels)), labels], 1e-12)))),
        "global_ece": expected_calibration_error(*calibration_bins(p, labels, ece_bins)),
    }
