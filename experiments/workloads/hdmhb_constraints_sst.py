"""HDM-HB, smoothed primal-dual under linear constraints, and SST on digits (3 seeds each).

0. HDM-HB vs gradient descent (step 1/L) on SPD quadratics (dimension 50, eigenvalues
   geometric in [1, 100], seeds 0, 1, 2): iterations to relative suboptimality 1e-6.

1. HDM-HB vs gradient descent (step 1/L) vs Adam on full-batch logistic-regression clients:
   digits, 10 clients (Dirichlet 0.5, partition seeds 0, 1, 2), the first 5 clients of each,
   multinomial logistic regression with an L2 term 1e-3/2 |w|^2 (strongly convex), from zero.
   f* per client from 500 L-BFGS iterations. Reported: steps (= gradient evaluations for GD
   and Adam; HDM-HB evaluates one trial per step) to relative suboptimality 1e-4, and the
   loss after 300 steps. L = 0.5 lambda_max(X^T X / n) + 1e-3 (X with a ones column), the
   softmax cross-entropy's smoothness bound; Adam at lr 0.05 (``adam_lr_sweep`` over 0.01,
   0.05, 0.2 on seed 0's clients is stored too: its smallest median gap is at 0.2).
2. Smoothed primal-dual clients with a fairness constraint: FedAvg on digits, 20 clients
   (Dirichlet 0.5), logistic regression, each client's constraint |mean logit(group 1) -
   mean logit(group 0)| <= 0.05 per class (group: pixel 21 > 0.5), one epoch of batch 16
   (or five) per round, c = 0.3, duals kept across rounds; against plain FedAvg-SGD at lr
   0.3 (one epoch). After
   every round: the global model's training objective (mean client cross-entropy), the
   largest and the mean violation of the clients' own constraints, and the clients'
   violation after their local steps.
3. SST vs full-rank vs LoRA on digits, an MLP 64-64-10 trained from scratch on the pooled
   training rows (Adam lr 3e-3, 20 epochs of batch 64): full rank, SST at rank 8 (period
   20 steps, re-SVD every period), LoRA at rank 8 on both Linear layers (peft, base frozen
   at its random initialisation). Test accuracy on the pooled test rows.

Writes ``hdmhb_constraints_sst.json`` next to this file and prints the README's tables (mean ±
sample std, ddof = 1, over the seeds); ``--tables`` prints them from
``hdmhb_constraints_sst.json`` only.
"""

from __future__ import annotations

import inspect
import json
import sys
import time
from pathlib import Path

import numpy as np
import torch
from torch import nn

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from fedsim.data import DatasetSpec, build_dataset  # noqa: E402
from fedsim.models import ModelSpec, build_model, initial_arrays, load_arrays  # noqa: E402
from fedsim.workloads.constrained import LinearConstraints, train_constrained  # noqa: E402
from fedsim.workloads.coto import LoRATraining, build_lora_model  # noqa: E402
from fedsim.workloads.optim import HDMHB  # noqa: E402
from fedsim.workloads.sgd import train_epochs  # noqa: E402
from fedsim.workloads.sst import SparseSpectral, SparseSpectralTraining  # noqa: E402
from fedsim.workloads.supervised import LocalTraining  # noqa: E402

SEEDS = (0, 1, 2)
L2 = 1e-3


def tensors(x, y):
    return (
        torch.from_numpy(np.array(x, dtype=np.float64)).reshape(len(x), -1),
        torch.from_numpy(np.array(y, dtype=np.int64)),
    )


# ---------------------------------------------------------------- 1. HDM-HB


def logreg_objective(x, y, w, b):
    return nn.functional.cross_entropy(x @ w + b, y) + 0.5 * L2 * ((w * w).sum() + (b * b).sum())


def run_optimizer(kind, x, y, steps, f_star=None, tol=1e-4, lr=0.05):
    w = torch.zeros(x.shape[1], 10, dtype=torch.float64, requires_grad=True)
    b = torch.zeros(10, dtype=torch.float64, requires_grad=True)
    if kind == "lbfgs":
        optimizer = torch.optim.LBFGS(
            [w, b],
            lr=1.0,
            max_iter=steps,
            tolerance_grad=1e-12,
            tolerance_change=1e-15,
            history_size=20,
            line_search_fn="strong_wolfe",
        )
    elif kind == "hdm-hb":
        optimizer = HDMHB([w, b])
    elif kind == "adam":
        optimizer = torch.optim.Adam([w, b], lr=lr)
    else:
        ones = torch.cat([x, torch.ones(len(x), 1, dtype=x.dtype)], 1)
        lipschitz = 0.5 * float(torch.linalg.eigvalsh(ones.T @ ones / len(x)).max()) + L2
        optimizer = torch.optim.SGD([w, b], lr=1.0 / lipschitz)

    def closure():
        optimizer.zero_grad()
        loss = logreg_objective(x, y, w, b)
        loss.backward()
        return loss

    if kind == "lbfgs":
        optimizer.step(closure)
        return float(logreg_objective(x, y, w, b).detach()), None
    f_start = float(logreg_objective(x, y, w, b).detach())
    reached = None
    for step in range(1, steps + 1):
        if kind == "hdm-hb":
            optimizer.step(closure)
        else:
            closure()
            optimizer.step()
        value = float(logreg_objective(x, y, w, b).detach())
        if reached is None and (value - f_star) <= tol * (f_start - f_star):
            reached = step
    return value, reached


def hdm_study(steps=300):
    rows = []
    for seed in SEEDS:
        spec = DatasetSpec(
            source="digits", partition="dirichlet", alpha=0.5, num_clients=10, seed=seed
        )
        dataset = build_dataset(spec)
        for client in range(5):
            x, y = tensors(*dataset.train.client(client))
            f_star, _ = run_optimizer("lbfgs", x, y, 500)
            for kind in ("gd", "adam", "hdm-hb"):
                final, reached = run_optimizer(kind, x, y, steps, f_star)
                rows.append(
                    {
                        "seed": seed,
                        "client": client,
                        "method": kind,
                        "steps_to_1e-4": reached,
                        "suboptimality_at_300": final - f_star,
                        "final_loss": final,
                    }
                )
    return rows


def quadratic_study(dim=50, condition=100.0, tol=1e-6):
    """Iterations to relative suboptimality ``tol`` on SPD quadratics: GD (1/L) vs HDM-HB."""
    rows = []
    for seed in SEEDS:
        g = torch.Generator().manual_seed(seed)
        q, _ = torch.linalg.qr(torch.randn(dim, dim, generator=g, dtype=torch.float64))
        eigenvalues = torch.logspace(0, float(np.log10(condition)), dim, dtype=torch.float64)
        a = q @ torch.diag(eigenvalues) @ q.T
        b = torch.randn(dim, generator=g, dtype=torch.float64)
        solution = torch.linalg.solve(a, b)
        f_star = float(0.5 * solution @ a @ solution - b @ solution)
        x = torch.zeros(dim, dtype=torch.float64)
        gd = 0
        while (float(0.5 * x @ a @ x - b @ x) - f_star) / -f_star > tol:
            x = x - (a @ x - b) / float(eigenvalues.max())
            gd += 1
        w = torch.zeros(dim, dtype=torch.float64, requires_grad=True)
        optimizer = HDMHB([w])

        def closure(w=w, a=a, b=b, optimizer=optimizer):
            optimizer.zero_grad()
            loss = 0.5 * w @ a @ w - b @ w
            loss.backward()
            return loss

        hdm, value = 0, 0.0
        while hdm == 0 or (value - f_star) / -f_star > tol:
            value = float(optimizer.step(closure))
            hdm += 1
        rows.append({"seed": seed, "gd": gd, "hdm-hb": hdm})
    return rows


def adam_lr_sweep(steps=300):
    spec = DatasetSpec(source="digits", partition="dirichlet", alpha=0.5, num_clients=10, seed=0)
    dataset = build_dataset(spec)
    result = {}
    for lr in (0.01, 0.05, 0.2):
        gaps = []
        for client in range(5):
            x, y = tensors(*dataset.train.client(client))
            f_star, _ = run_optimizer("lbfgs", x, y, 500)
            final, _ = run_optimizer("adam", x, y, steps, f_star, lr=lr)
            gaps.append(final - f_star)
        result[lr] = float(np.median(gaps))
    return result


# ---------------------------------------------------------------- 2. constrained FedAvg


def flat(model):
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()]).to(torch.float64)


def constrained_study(rounds=15, clients=20):
    constraints = LinearConstraints(feature=21, threshold=0.5, epsilon=0.05, lr=0.3)
    runs = []
    for seed in SEEDS:
        spec = DatasetSpec(
            source="digits", partition="dirichlet", alpha=0.5, num_clients=clients, seed=seed
        )
        dataset = build_dataset(spec)
        model_spec = ModelSpec(kind="logreg", input_shape=dataset.feature_shape, num_classes=10)
        data = []
        net = build_model(model_spec)
        for k in range(clients):
            x, y = dataset.train.client(k)
            x = torch.from_numpy(np.array(x, dtype=np.float32))
            y = torch.from_numpy(np.array(y, dtype=np.int64))
            data.append((x, y, *constraints.matrices(net, x)))
        weights = np.array([len(d[1]) for d in data], dtype=np.float64)
        for method, epochs in (
            ("sgd", 1),
            ("smoothed primal-dual", 1),
            ("smoothed primal-dual", 5),
        ):
            global_arrays = initial_arrays(model_spec, seed)
            duals = [None] * clients
            curve = []
            for rnd in range(1, rounds + 1):
                updates, local_violation = [], []
                for k, (x, y, _, _) in enumerate(data):
                    load_arrays(net, global_arrays)
                    generator = torch.Generator().manual_seed(seed * 100_000 + rnd * 100 + k)
                    if method == "sgd":
                        train_epochs(
                            net,
                            x,
                            y,
                            LocalTraining(epochs=epochs, batch_size=16, lr=0.3),
                            generator,
                        )
                    else:
                        result = train_constrained(
                            net,
                            x,
                            y,
                            constraints,
                            epochs=epochs,
                            batch_size=16,
                            max_steps=0,
                            generator=generator,
                            dual=duals[k],
                        )
                        duals[k] = result["dual"]
                        local_violation.append(result["violation"])
                    updates.append(
                        {n: v.detach().numpy().copy() for n, v in net.state_dict().items()}
                    )
                global_arrays = {
                    n: np.average([u[n] for u in updates], axis=0, weights=weights)
                    for n in updates[0]
                }
                load_arrays(net, global_arrays)
                w = flat(net)
                violations = [
                    float((a @ w - b).clamp(min=0).max()) if len(b) else 0.0 for _, _, a, b in data
                ]
                with torch.no_grad():
                    losses = [float(nn.functional.cross_entropy(net(x), y)) for x, y, _, _ in data]
                curve.append(
                    {
                        "round": rnd,
                        "objective": float(np.average(losses, weights=weights)),
                        "max_violation": max(violations),
                        "mean_violation": float(np.mean(violations)),
                        "local_max_violation": max(local_violation) if local_violation else None,
                    }
                )
            x_test, y_test = tensors(dataset.test.x, dataset.test.y)
            with torch.no_grad():
                accuracy = float((net(x_test.float()).argmax(1) == y_test).float().mean())
            runs.append(
                {
                    "seed": seed,
                    "method": method,
                    "epochs": epochs,
                    "curve": curve,
                    "accuracy": accuracy,
                }
            )
    return runs


# ---------------------------------------------------------------- 3. SST


def train_model(model, parameters, x, y, generator, epochs=20, batch=64, after_step=None):
    optimizer = torch.optim.Adam(parameters, lr=3e-3)
    for _ in range(epochs):
        order = torch.randperm(len(y), generator=generator)
        for start in range(0, len(y), batch):
            idx = order[start : start + batch]
            optimizer.zero_grad()
            nn.functional.cross_entropy(model(x[idx]), y[idx]).backward()
            optimizer.step()
            if after_step is not None:
                after_step(optimizer)
    return optimizer


def accuracy(model, x, y):
    with torch.no_grad():
        return float((model(x).argmax(1) == y).float().mean())


def sst_study(rank=8):
    spec = DatasetSpec(source="digits", partition="iid", num_clients=1, seed=0)
    dataset = build_dataset(spec)
    x, y = dataset.train.x, dataset.train.y
    x = torch.from_numpy(np.array(x, dtype=np.float32))
    y = torch.from_numpy(np.array(y, dtype=np.int64))
    x_test = torch.from_numpy(np.array(dataset.test.x, dtype=np.float32))
    y_test = torch.from_numpy(np.array(dataset.test.y, dtype=np.int64))
    model_spec = ModelSpec(
        kind="mlp", input_shape=dataset.feature_shape, num_classes=10, hidden=(64,)
    )
    rows = []
    for seed in SEEDS:
        full = build_model(model_spec)
        load_arrays(full, initial_arrays(model_spec, seed))
        train_model(full, list(full.parameters()), x, y, torch.Generator().manual_seed(seed))
        rows.append(
            {
                "seed": seed,
                "method": "full rank",
                "accuracy": accuracy(full, x_test, y_test),
                "trainable": sum(p.numel() for p in full.parameters()),
            }
        )
        base = build_model(model_spec)
        load_arrays(base, initial_arrays(model_spec, seed))
        sst = SparseSpectralTraining(
            base, SparseSpectral(rank=rank, period=20), torch.Generator().manual_seed(seed)
        )
        trainable = sst.trainable_per_step()
        train_model(
            sst.model,
            list(sst.model.parameters()),
            x,
            y,
            torch.Generator().manual_seed(seed),
            after_step=sst.after_step,
        )
        sst.export(base)
        rows.append(
            {
                "seed": seed,
                "method": f"SST r={rank}",
                "accuracy": accuracy(base, x_test, y_test),
                "trainable": trainable,
            }
        )
        lora = build_lora_model(
            model_spec,
            LoRATraining(rank=rank, alpha=float(rank), coto=False, base_seed=seed),
            adapter_seed=seed,
        )
        params = [p for p in lora.parameters() if p.requires_grad]
        train_model(lora, params, x, y, torch.Generator().manual_seed(seed))
        rows.append(
            {
                "seed": seed,
                "method": f"LoRA r={rank}",
                "accuracy": accuracy(lora, x_test, y_test),
                "trainable": sum(p.numel() for p in params),
            }
        )
    return rows


def mean_std(values):
    """Mean and sample standard deviation (ddof = 1)."""
    values = np.asarray(values, dtype=np.float64)
    return float(values.mean()), float(values.std(ddof=1))


def main() -> None:
    torch.set_num_threads(1)
    started = time.time()
    out: dict = {}
    out["quadratic"] = quadratic_study()
    out["adam_lr_sweep"] = adam_lr_sweep()
    out["hdm"] = hdm_study()
    out["constrained"] = constrained_study()
    out["sst"] = sst_study()
    out["seconds"] = time.time() - started
    Path(__file__).with_name("hdmhb_constraints_sst.json").write_text(json.dumps(out, indent=1))
    print_tables(out)
    print(f"\n{out['seconds']:.0f} s")


def print_tables(out: dict) -> None:
    """The README's tables from the per-seed rows in ``out`` (mean ± sample std, ddof = 1)."""
    print("SPD quadratics (dimension 50, condition 100): iterations to 1e-6")
    for row in out["quadratic"]:
        print(f"seed {row['seed']}: GD {row['gd']}, HDM-HB {row['hdm-hb']}")
    print("Adam learning rates (median f - f* at 300 steps, seed 0's clients)")
    for lr, gap in out["adam_lr_sweep"].items():
        print(f"lr {lr}: {gap:.2e}")
    print()
    print(
        "| method | median steps to f − f* ≤ 1e-4·(f₀ − f*) | clients reaching it in 300 steps "
        "| median f − f* after 300 |"
    )
    print("|---|---|---|---|")
    adam_lr = inspect.signature(run_optimizer).parameters["lr"].default  # what the rows ran
    names = {"gd": "GD, 1/L", "adam": f"Adam, lr {adam_lr}", "hdm-hb": "HDM-HB"}
    for kind in ("gd", "adam", "hdm-hb"):
        rows = [r for r in out["hdm"] if r["method"] == kind]
        reached = [r["steps_to_1e-4"] for r in rows if r["steps_to_1e-4"] is not None]
        median = f"{np.median(reached):.0f}" if reached else "—"
        gap = float(np.median([r["suboptimality_at_300"] for r in rows]))
        shown = f"≈ 0 ({gap:.1e})".replace("(-", "(−") if abs(gap) < 1e-12 else f"{gap:.2e}"
        print(f"| {names[kind]} | {median} | {len(reached)}/{len(rows)} | {shown} |")
    print()
    print(
        "| method | local epochs | round | objective | max violation | mean violation "
        "| clients' max violation after local steps |"
    )
    print("|---|---|---|---|---|---|---|")
    accuracies = []
    for method, epochs in (("sgd", 1), ("smoothed primal-dual", 1), ("smoothed primal-dual", 5)):
        runs = [r for r in out["constrained"] if r["method"] == method and r["epochs"] == epochs]
        label = "SGD" if method == "sgd" else method
        for rnd in (1, 5, 10, 15):
            pick = [r["curve"][rnd - 1] for r in runs]
            o = mean_std([p["objective"] for p in pick])
            mx = mean_std([p["max_violation"] for p in pick])
            mn = mean_std([p["mean_violation"] for p in pick])
            local = [p["local_max_violation"] for p in pick if p["local_max_violation"] is not None]
            lv = f"{mean_std(local)[0]:.3f} ± {mean_std(local)[1]:.3f}" if local else "—"
            print(
                f"| {label} | {epochs} | {rnd} | {o[0]:.3f} ± {o[1]:.3f} "
                f"| {mx[0]:.3f} ± {mx[1]:.3f} | {mn[0]:.3f} ± {mn[1]:.3f} | {lv} |"
            )
        acc = mean_std([r["accuracy"] for r in runs])
        accuracies.append(f"{label}, {epochs} local epochs: {acc[0]:.3f} ± {acc[1]:.3f}")
    print("\nTest accuracy after 15 rounds: " + "; ".join(accuracies))
    print()
    print("| method | trainable values per step | test accuracy (mean ± sample std, 3 seeds) |")
    print("|---|---|---|")
    for method in ("full rank", "SST r=8", "LoRA r=8"):
        rows = [r for r in out["sst"] if r["method"] == method]
        acc = mean_std([r["accuracy"] for r in rows])
        label = method.replace(" r=", ", r = ")
        print(f"| {label} | {rows[0]['trainable']:,} | {acc[0]:.3f} ± {acc[1]:.3f} |")


if __name__ == "__main__":
    if "--tables" in sys.argv[1:]:
        print_tables(json.loads(Path(__file__).with_name("hdmhb_constraints_sst.json").read_text()))
    else:
        main()
