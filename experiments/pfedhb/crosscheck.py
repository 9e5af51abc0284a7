"""One run of the pFedHB authors' published code on one of this study's splits.

``python experiments/pfedhb/crosscheck.py --reference PATH`` runs the reference
implementation (github.com/mahendrathapa/pFedHB, its ``hb/pfedhb.py``'s ``train`` loop, clients
and server, unmodified) on the federation and seed of one stored run of ours, and stores the
two curves side by side in ``crosscheck.json``. Only two of the reference's entry points are
replaced, both outside the algorithm: its data loader (``utils.load_dataloaders``, which
downloads FMNIST) by this split's rows, and TensorBoard's ``SummaryWriter`` by a recorder of the
scalars it logs; and its server's ``np.sum`` of a generator gets numpy 1.22's meaning (the
version it pins), which numpy 2 refuses. Its hyper-parameters are its
``experiment/configs/fmnist.json``, the values our ``[personal]`` settings copy; ``n_rounds``
and ``n_clients`` are the stored run's.

The split is the stored run's exactly: every client's training rows, the classes it holds, and
the held-out pool of rows per class that both codes test each personal model on (the reference's
``client_test_ind``: the client's classes' rows of the global test set). The two runs share the
data, not their random draws (initial weights, client sampling, Monte Carlo noise, minibatch
order), so their difference is one draw of run-to-run spread, to be read against the seeds'.
"""

from __future__ import annotations

import argparse
import builtins
import json
import sys
import time
import types
from pathlib import Path
from typing import Any

import numpy as np

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parents[1]))

from experiments.pfedhb import study  # noqa: E402

OUT = HERE / "crosscheck.json"
#: the stored run whose split (and settings) the reference runs on: pFedHB's server solver as
#: the authors' (5 Adam steps a round) at their head-KL weight 1
FEDERATION, METHOD, SEED = "femnist-pairs-300-validation", "pfedhb-adam-kl1", 100
#: the reference's experiment/configs/fmnist.json, with the stored run's rounds and clients
REFERENCE_ARGS: dict[str, Any] = {
    "dataset": "FMNIST",
    "model": "LinearFMNIST",
    "batch_size": 50,
    "local_lr_head": 0.001,
    "local_lr_base": 0.001,
    "local_head_epochs": 10,
    "local_base_epochs": 2,
    "global_lr_head": 0.01,
    "global_lr_base": 0.01,
    "global_head_epochs": 5,
    "global_base_epochs": 5,
    "sch_step_size": 60,
    "mu_regularizer": 5,
    "sigma_regularizer": 5,
    "kl_coeff_head": 1,
    "kl_coeff_base": 1e-6,
    "n_labels": 5,
    "sampling_rate": 0.1,
    "relabel": False,
    "n_mc": 5,
    "max_data": None,
    "head_init_type": "uniform",
    "path_to_data": "./data",
    "run_name": "crosscheck",
}


class Recorder:
    """Stands in for ``SummaryWriter``: keeps every logged scalar in :data:`SCALARS`."""

    SCALARS: dict[str, dict[int, float]] = {}

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        pass

    def add_scalar(self, tag: str, value: Any, step: int) -> None:
        self.SCALARS.setdefault(tag, {})[int(step)] = float(value)


class Numpy122(types.ModuleType):
    """numpy as the reference pins it (1.22): ``np.sum(generator)`` is the builtin ``sum``
    (numpy 2 raises on it; ``hb/server.py`` sums client sizes this way)."""

    def __init__(self) -> None:
        super().__init__("numpy")

    def __getattr__(self, name: str) -> Any:
        return getattr(np, name)

    @staticmethod
    def sum(a: Any, *args: Any, **kwargs: Any) -> Any:
        return builtins.sum(a) if isinstance(a, types.GeneratorType) else np.sum(a, *args, **kwargs)


def split_loaders(dataset: Any, batch_size: int, seed: int) -> tuple:
    """The reference's ``load_dataloaders`` outputs for our split: per-client shuffled train
    loaders, one test loader per class (the held-out pool), each client's classes."""
    import torch  # noqa: PLC0415
    from torch.utils.data import DataLoader, TensorDataset  # noqa: PLC0415

    def tensors(x: np.ndarray, y: np.ndarray) -> TensorDataset:
        return TensorDataset(
            torch.from_numpy(np.array(x, dtype=np.float32)).flatten(1),
            torch.from_numpy(np.array(y, dtype=np.int64)),
        )

    train, test = dataset.train, dataset.test
    generator = torch.Generator().manual_seed(seed)
    train_loaders, labels = [], []
    pools: dict[int, tuple[np.ndarray, np.ndarray]] = {}
    for k in range(dataset.num_clients):
        lo, hi = int(train.offsets[k]), int(train.offsets[k + 1])
        x, y = train.x[lo:hi], train.y[lo:hi]
        train_loaders.append(
            DataLoader(tensors(x, y), batch_size=batch_size, shuffle=True, generator=generator)
        )
        labels.append(sorted(int(c) for c in np.unique(y)))
        tlo, thi = int(test.offsets[k]), int(test.offsets[k + 1])
        for c in labels[-1]:  # a client's test rows are the pool's rows of its classes
            rows = test.y[tlo:thi] == c
            pools.setdefault(c, (test.x[tlo:thi][rows], test.y[tlo:thi][rows]))
    test_loaders = [
        DataLoader(tensors(*pools[c]), batch_size=1000) for c in range(dataset.num_classes)
    ]
    return train_loaders, test_loaders, dataset.num_classes, labels, None, labels, False


def run_reference(reference: Path, rounds: int) -> dict[str, Any]:
    """The reference's ``train`` on our split; its logged personal and global accuracies."""
    import torch  # noqa: PLC0415

    from fedsim.data.spec import build_dataset  # noqa: PLC0415
    from fedsim.frontend.run_config import ExperimentConfig  # noqa: PLC0415

    torch.set_num_threads(1)
    config = ExperimentConfig.from_dict(study.config_for(FEDERATION, METHOD, SEED, rounds))
    dataset = build_dataset(config.data)
    loaders = split_loaders(dataset, REFERENCE_ARGS["batch_size"], SEED)
    sys.path.insert(0, str(reference))
    board = types.ModuleType("torch.utils.tensorboard")
    board.SummaryWriter = Recorder  # type: ignore[attr-defined]
    data = types.ModuleType("utils.load_dataloaders")
    data.load_dataloaders = lambda **_: loaders  # type: ignore[attr-defined]
    sys.modules.update({"torch.utils.tensorboard": board, "utils.load_dataloaders": data})
    import hb.server  # noqa: PLC0415
    from hb.pfedhb import train  # noqa: PLC0415

    hb.server.np = Numpy122()  # type: ignore[assignment]

    args = {**REFERENCE_ARGS, "n_rounds": rounds, "n_clients": dataset.num_clients, "seed": SEED}
    cpu = time.process_time()
    train(args)
    return {
        "args": args,
        "cpu_seconds": time.process_time() - cpu,
        "personal_acc": Recorder.SCALARS["test/pm_acc"],
        "global_acc": Recorder.SCALARS["test/gm_acc"],
    }


def ours() -> dict[str, Any]:
    """The stored run's curve on the same split."""
    path = study.result_path(FEDERATION, METHOD, SEED)
    run = json.loads(path.read_text())
    return {
        "run": path.name,
        "rounds": run["rounds"],
        "cpu_seconds": run["cpu_seconds"],
        "personal_acc": {c["round"]: c["personal_acc_mean"] for c in run["curve"]},
        "global_acc": {c["round"]: c["global_acc"] for c in run["curve"]},
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reference", type=Path, required=True, help="a checkout of pFedHB")
    parser.add_argument("--commit", default="511aba1", help="the checkout's commit, recorded")
    args = parser.parse_args()
    mine = ours()
    theirs = run_reference(args.reference, mine["rounds"])
    final = mine["rounds"]
    stored = {
        "federation": FEDERATION,
        "method": METHOD,
        "seed": SEED,
        "reference": {"repository": "mahendrathapa/pFedHB", "commit": args.commit, **theirs},
        "ours": mine,
        "final_round": final,
        "final_personal_acc": {
            "ours": mine["personal_acc"][final],
            "reference": theirs["personal_acc"][final],
        },
        "final_global_acc": {
            "ours": mine["global_acc"][final],
            "reference": theirs["global_acc"][final],
        },
    }
    OUT.write_text(json.dumps(stored, indent=1) + "\n")
    print(json.dumps({k: stored[k] for k in ("final_personal_acc", "final_global_acc")}))


if __name__ == "__main__":
    main()
