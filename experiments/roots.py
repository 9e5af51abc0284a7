"""The secret roots of the experiments' runs (:mod:`fedsim.randomness`).

Each experiment reads one *study root* from a file kept outside its results (``--secrets``;
created from OS randomness, mode 0600, when missing) and gives every seed its own root derived
from it, HMAC-SHA256(study root, "sub-root", "fedsim-<study>/seed/<seed>") (RFC 2104,
:meth:`~fedsim.randomness.RunSecret.derive`). A run started with ``run_experiment`` mixes a
fresh public nonce into its root (:mod:`fedsim.frontend.run_root`), so no two points of a study
share a noise stream; the nonce is in each run's ``run.json``. The study root lives outside the
repository (default ``~/.fedsim/<study>.key``), never in a source file.
"""

from __future__ import annotations

from pathlib import Path

from fedsim.randomness import RunSecret

#: Where the experiments keep their study roots by default (one file per study).
KEY_DIR = Path.home() / ".fedsim"


def default_key(study: str) -> Path:
    """The default ``--secrets`` file of ``study``."""
    return KEY_DIR / f"{study}.key"


def study_root(path: str | Path, results: str | Path) -> RunSecret:
    """The study root in ``path`` (created if missing), which must lie outside ``results``."""
    return RunSecret.load_or_create(path, run_dir=results)


def seed_root(root: RunSecret, study: str, seed: int) -> RunSecret:
    """The root of ``study``'s runs with seed ``seed``."""
    return root.derive(f"fedsim-{study}/seed/{int(seed)}")
