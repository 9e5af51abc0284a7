"""Membership audit of a finished ``fedsim run`` directory (``fedsim audit RUN_DIR``).

The run's saved config (``config.json``) rebuilds its federated dataset and model exactly
(``build_dataset`` is deterministic in the spec; the run front end rebuilds them,
:func:`fedsim.frontend.experiment.load_finished_run`), ``model.npz`` holds the final global weights
and ``summary.json`` the number of rounds run and, for DP runs, the final epsilon. Members are
the training rows of the clients that the run's cohort model put in at least one training
round (every client, after enough rounds); non-members are the held-out test rows, which no
client trains on. Both sets are subsampled to the same size with a generator seeded from the
run's seed, and each row gets a membership score (higher = member):

* ``loss``: minus the row's cross-entropy (Yeom et al., CSF 2018);
* ``zlib``: minus the cross-entropy divided by the zlib-compressed length of the row's
  features (Carlini et al., USENIX Security 2021), a reference-free difficulty calibration.

``dataset-inference`` asks whether the member rows, as a set, were trained on: post-hoc
dataset inference (Zhao et al., ICML 2025; :mod:`fedsim.audits.dataset_inference`)
with synthetic held-out copies of the rows (:func:`resample_features`: each feature, with
probability ``SYNTHETIC_RATE``, taken from another row of the same set), the loss and zlib
scores as MIA features and logistic regression on the raw rows as the real-vs-synthetic
classifier. The same test on the held-out rows is reported as a control: copies further off
the data manifold raise every row's loss, member or not, and a linear classifier on the raw
rows cannot see that shift (the copies keep each feature's marginal), so a larger
``SYNTHETIC_RATE`` makes the control significant too (on a digits federation with loss AUC
0.61, 0.1 did for every seed tried; at 0.05 the members' and the control's p-values overlap
across seeds). Read the members' p-value only next to a non-significant control.

The ``[audit]`` table of an experiment config (:class:`AuditConfig`) runs these at the end of
``fedsim run`` (:func:`run_configured_audit`).

Min-k% prob needs a sequence of token predictions; a classifier gives one prediction per row,
so ``mink`` is refused for these runs (it applies to the audit's language models,
:mod:`fedsim.audits.lm`).
"""

from __future__ import annotations

import math
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from fedsim.audits.dataset_inference import (
    dataset_inference,
    resample_features,
    row_classifier,
)
from fedsim.audits.mia import attack_metrics
from fedsim.config import ConfigError, require
from fedsim.results_json import dumps, json_ready

RUN_ATTACKS = ("loss", "zlib")
DATASET_INFERENCE = "dataset-inference"
AUDIT_ATTACKS = (*RUN_ATTACKS, DATASET_INFERENCE)
MINK_REFUSAL = (
    "loss or zlib for a classifier run (min-k% needs per-token predictions of a language "
    "model; a classifier makes one prediction per row)"
)
SYNTHETIC_RATE = 0.05  # share of each synthetic copy's features resampled from other rows
MODEL_FILE = "model.npz"
SUMMARY_FILE = "summary.json"
AUDIT_FILE = "audit.json"


@dataclass(frozen=True)
class FinishedRun:
    """What ``fedsim run`` left in a directory, rebuilt by the run front end
    (:func:`fedsim.frontend.experiment.load_finished_run`): its config and summary, its final model,
    the federation it trained on and the clients of its training cohorts."""

    path: Path
    config: Any  # fedsim.frontend.experiment.ExperimentConfig
    arrays: dict[str, np.ndarray]
    summary: dict[str, Any]
    dataset: Any  # fedsim.data.FederatedDataset, rebuilt from the config
    model: nn.Module  # the config's model holding ``arrays``
    rounds: int  # rounds run
    clients: np.ndarray  # sorted indices of the clients in at least one training cohort


def _rows_of(offsets: np.ndarray, clients: np.ndarray) -> np.ndarray:
    if clients.size == 0:
        return np.zeros(0, dtype=np.int64)
    return np.concatenate([np.arange(offsets[k], offsets[k + 1]) for k in clients])


def example_losses(
    model: nn.Module, x: np.ndarray, y: np.ndarray, batch_size: int = 1024
) -> np.ndarray:
    """Per-row cross-entropy of ``model`` (natural log)."""
    model.eval()
    out = []
    with torch.no_grad():
        for start in range(0, len(y), batch_size):
            xb = torch.from_numpy(np.array(x[start : start + batch_size], dtype=np.float32))
            yb = torch.from_numpy(np.array(y[start : start + batch_size], dtype=np.int64))
            out.append(nn.functional.cross_entropy(model(xb), yb, reduction="none").numpy())
    return np.concatenate(out).astype(np.float64) if out else np.zeros(0)


def row_zlib_lengths(x: np.ndarray) -> np.ndarray:
    """zlib-compressed length (level 9) of each row's float32 feature bytes."""
    rows = np.ascontiguousarray(np.asarray(x, dtype=np.float32))
    return np.array([len(zlib.compress(r.tobytes(), 9)) for r in rows], dtype=np.float64)


def row_scores(attack: str, losses: np.ndarray, x: np.ndarray) -> np.ndarray:
    """Membership scores of rows with cross-entropies ``losses`` and features ``x``."""
    if attack == "loss":
        return -losses
    if attack == "zlib":
        return -losses / row_zlib_lengths(x)
    raise ConfigError("--attack", attack, MINK_REFUSAL)


@dataclass(frozen=True)
class AuditConfig:
    """The ``[audit]`` table of an experiment config: the audits ``run_experiment`` runs on
    the finished run directory (written to ``audit.json``, summarised in ``summary.json``).

    attacks: names from ``AUDIT_ATTACKS`` (``loss``, ``zlib``: membership inference;
        ``dataset-inference``: post-hoc dataset inference of the member rows);
    members: rows drawn from each side (0: as many as the smaller side holds);
    seed: the audit's seed (default: the run's ``seed``).
    """

    attacks: tuple[str, ...] = ("loss",)
    members: int = 0
    seed: int | None = None

    def __post_init__(self) -> None:
        allowed = ", ".join(AUDIT_ATTACKS)
        require(
            len(self.attacks) >= 1, "audit.attacks", list(self.attacks), f"one or more of {allowed}"
        )
        for attack in self.attacks:
            require(attack in AUDIT_ATTACKS, "audit.attacks", attack, f"one of {allowed}")
        require(
            len(set(self.attacks)) == len(self.attacks),
            "audit.attacks",
            list(self.attacks),
            f"distinct names from {allowed}",
        )
        require(
            self.members >= 0,
            "audit.members",
            self.members,
            "an integer >= 0 (0: as many rows as the smaller side holds)",
        )


@dataclass(frozen=True)
class _AuditRows:
    """A finished run's rebuilt model and its scored member / non-member rows."""

    run: FinishedRun
    model: nn.Module
    rounds: int
    clients: np.ndarray
    member_rows: np.ndarray
    nonmember_rows: np.ndarray
    x_in: np.ndarray
    y_in: np.ndarray
    x_out: np.ndarray
    y_out: np.ndarray
    loss_in: np.ndarray
    loss_out: np.ndarray
    seed: int


def _audit_rows(
    run: FinishedRun, members: int | None, seed: int | None, members_key: str
) -> _AuditRows:
    config, dataset, model, clients = run.config, run.dataset, run.model, run.clients
    run_dir = run.path
    member_rows = _rows_of(dataset.train.offsets, clients)
    nonmember_rows = np.arange(len(dataset.test.y))
    available = min(len(member_rows), len(nonmember_rows))
    if available == 0:
        raise ConfigError(
            "RUN_DIR",
            str(run_dir),
            f"a run with member and non-member rows (members {len(member_rows)}, "
            f"held-out rows {len(nonmember_rows)}; data.test_fraction = "
            f"{config.data.test_fraction})",
        )
    if members is None:
        members = available
    if not isinstance(members, int) or isinstance(members, bool) or not 1 <= members <= available:
        raise ConfigError(
            members_key,
            members,
            f"an integer in [1, {available}] (member rows {len(member_rows)}, "
            f"held-out rows {len(nonmember_rows)})",
        )
    seed = config.seed if seed is None else seed
    rng = np.random.default_rng([seed, 0xA0D17])
    pick_in = np.sort(rng.choice(member_rows, members, replace=False))
    pick_out = np.sort(rng.choice(nonmember_rows, members, replace=False))
    x_in, y_in = dataset.train.x[pick_in], dataset.train.y[pick_in]
    x_out, y_out = dataset.test.x[pick_out], dataset.test.y[pick_out]
    return _AuditRows(
        run=run,
        model=model,
        rounds=run.rounds,
        clients=clients,
        member_rows=member_rows,
        nonmember_rows=nonmember_rows,
        x_in=np.asarray(x_in),
        y_in=np.asarray(y_in),
        x_out=np.asarray(x_out),
        y_out=np.asarray(y_out),
        loss_in=example_losses(model, x_in, y_in),
        loss_out=example_losses(model, x_out, y_out),
        seed=seed,
    )


def _run_facts(rows: _AuditRows) -> dict[str, Any]:
    """The keys every audit result shares: the run, its members and its epsilon."""
    run = rows.run
    privacy = run.summary.get("privacy") or {}
    epsilon = privacy.get("epsilon")  # results files write an unbounded epsilon as 1e999 (inf)
    if epsilon is None and privacy.get("rounds_accounted"):
        epsilon = math.inf  # files written before that wrote it as null
    finite = epsilon is not None and math.isfinite(epsilon)
    return json_ready({
        "run_dir": str(run.path),
        "members": int(len(rows.y_in)),
        "non_members": int(len(rows.y_out)),
        "member_rows_available": int(len(rows.member_rows)),
        "non_member_rows_available": int(len(rows.nonmember_rows)),
        "clients_trained": int(len(rows.clients)),
        "member_mean_loss": float(rows.loss_in.mean()),
        "non_member_mean_loss": float(rows.loss_out.mean()),
        "rounds": rows.rounds,
        "strategy": run.config.strategy.name,
        # a DP run without noise: epsilon inf (audit.json writes 1e999 and epsilon_infinite)
        "epsilon": None if epsilon is None else float(epsilon),
        "epsilon_text": None if epsilon is None else (f"{epsilon:.6g}" if finite else "inf"),
        "delta": privacy.get("delta"),
        "max_client_epsilon": run.summary.get("max_client_epsilon"),
    })


def _membership_inference(rows: _AuditRows, attack: str) -> dict[str, Any]:
    metrics = attack_metrics(
        row_scores(attack, rows.loss_in, rows.x_in),
        row_scores(attack, rows.loss_out, rows.x_out),
        0.05,
    )
    return {
        "attack": attack,
        "auc": metrics["auc"],
        "tpr_at_5pct_fpr": metrics["tpr_at_fpr"],
        **_run_facts(rows),
    }


def _row_features(model: nn.Module, x: np.ndarray, y: np.ndarray) -> np.ndarray:
    losses = example_losses(model, x, y)
    return np.stack([row_scores(a, losses, x) for a in RUN_ATTACKS], axis=1)


def _dataset_inference_of(
    rows: _AuditRows, x: np.ndarray, y: np.ndarray, rng: np.random.Generator, splits: int
) -> dict[str, Any]:
    synthetic = resample_features(x, rng, SYNTHETIC_RATE)
    result = dataset_inference(
        x,
        synthetic,
        _row_features(rows.model, x, y),
        _row_features(rows.model, synthetic, y),
        rng,
        splits,
        classifier=row_classifier,
    )
    return {
        "p_value": result.p_value,
        "split_p_values": result.split_p_values,
        "auc_real_vs_synthetic": float(np.mean(result.auc_text)),
        "auc_combined": float(np.mean(result.auc_combined)),
    }


def _dataset_inference(rows: _AuditRows, splits: int, members_key: str) -> dict[str, Any]:
    """Post-hoc dataset inference (Zhao et al., ICML 2025) of the member rows, and the same
    test on as many held-out rows as a control (its p-value should not be small)."""
    if len(rows.y_in) < 14:
        raise ConfigError(
            members_key,
            len(rows.y_in),
            "at least 14 rows for dataset inference (three splits of >= 4 rows)",
        )
    rng = np.random.default_rng([rows.seed, 0xD15E7])
    members = _dataset_inference_of(rows, rows.x_in, rows.y_in, rng, splits)
    control = _dataset_inference_of(rows, rows.x_out, rows.y_out, rng, splits)
    return {
        "attack": DATASET_INFERENCE,
        **members,
        "non_member_control": control,
        "splits": splits,
        "synthetic": f"resample_features(rate={SYNTHETIC_RATE})",
        "features": list(RUN_ATTACKS),
        **_run_facts(rows),
    }


def _attack_result(rows: _AuditRows, attack: str, splits: int, members_key: str) -> dict:
    if attack == DATASET_INFERENCE:
        return _dataset_inference(rows, splits, members_key)
    return _membership_inference(rows, attack)


def _check_attack(attack: str, key: str) -> None:
    if attack not in (*AUDIT_ATTACKS, "mink"):
        raise ConfigError(key, attack, "one of loss, zlib, mink, dataset-inference")
    if attack == "mink":
        raise ConfigError(key, attack, MINK_REFUSAL)


def audit_run(
    run: FinishedRun,
    attack: str = "loss",
    members: int | None = None,
    seed: int | None = None,
    splits: int = 10,
) -> dict[str, Any]:
    """One audit (``attack`` in ``AUDIT_ATTACKS``) of the final model of ``run``.

    ``members``: rows drawn from each side (default: as many as the smaller side holds);
    ``seed``: draws the rows and the synthetic copies (default: the run's seed); ``splits``:
    random splits of the dataset-inference test. Returns the JSON-ready result: for ``loss``
    and ``zlib`` the AUC and TPR at 5 % FPR, for ``dataset-inference`` the members' p-value and
    a non-member control's; both with counts, mean losses and the run's epsilon and delta.
    """
    _check_attack(attack, "--attack")
    rows = _audit_rows(run, members, seed, "--members")
    return _attack_result(rows, attack, splits, "--members")


def run_configured_audit(run: FinishedRun, audit: AuditConfig) -> dict[str, Any]:
    """Run the ``[audit]`` table's attacks on a finished run: writes ``RUN_DIR/audit.json``
    (``{"attacks": {name: result}}``) and returns the short summary that ``summary.json``
    keeps under ``audit``."""
    rows = _audit_rows(run, audit.members or None, audit.seed, "audit.members")
    results = {a: _attack_result(rows, a, 10, "audit.members") for a in audit.attacks}
    path = run.path / AUDIT_FILE
    path.write_text(dumps({"attacks": results}, indent=2, sort_keys=True))
    short: dict[str, Any] = {"file": AUDIT_FILE, "members": int(len(rows.y_in))}
    for name, result in results.items():
        if name == DATASET_INFERENCE:
            short[name] = {
                "p_value": result["p_value"],
                "non_member_p_value": result["non_member_control"]["p_value"],
            }
        else:
            short[name] = {"auc": result["auc"], "tpr_at_5pct_fpr": result["tpr_at_5pct_fpr"]}
    return short


def write_audit(result: dict[str, Any], out: str | Path | None = None) -> Path:
    """Write ``result`` as JSON to ``out`` (default ``RUN_DIR/audit.json``); returns the path."""
    path = Path(out) if out is not None else Path(result["run_dir"]) / AUDIT_FILE
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(dumps(result, indent=2, sort_keys=True))
    return path


def format_audit(result: dict[str, Any]) -> str:
    """A one-paragraph text summary of an audit result."""
    dp = (
        f"epsilon = {result['epsilon_text']} (delta = {result['delta']:.3g})"
        if result.get("epsilon_text") is not None
        else "no central DP"
    )
    if result["attack"] == DATASET_INFERENCE:
        return (
            f"dataset inference on {result['run_dir']} ({result['strategy']}, "
            f"{result['rounds']} rounds, {dp}): p-value {result['p_value']:.4g} for "
            f"{result['members']} member rows (small: trained on), control p-value "
            f"{result['non_member_control']['p_value']:.4g} for {result['non_members']} "
            f"held-out rows, over {result['splits']} splits"
        )
    return (
        f"{result['attack']} attack on {result['run_dir']} ({result['strategy']}, "
        f"{result['rounds']} rounds, {dp}): AUC {result['auc']:.4f}, "
        f"TPR at 5% FPR {result['tpr_at_5pct_fpr']:.4f} over {result['members']} member and "
        f"{result['non_members']} non-member rows (mean loss {result['member_mean_loss']:.4f} "
        f"vs {result['non_member_mean_loss']:.4f})"
    )
