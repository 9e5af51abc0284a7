"""The secret roots of the experiments' runs (:mod:`fedsim.randomness`).

Each experiment reads one *study root* from a file kept outside its results (``--secrets``;
created from OS randomness, mode 0600, when missing) and gives every seed its own root derived
from it, HMAC-SHA256(study root, "fedsim-<study>/seed/<seed>") (RFC 2104). With one root per
seed, the methods of a seed share their clients' and server's secrets, and seeds draw
independent ones (a single root for every seed would give every seed the same server noise).
The results record only the roots' public fingerprints; the same study root repeats every run
bit for bit.
"""

from __future__ import annotations

import hashlib
import hmac
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
    word = f"fedsim-{study}/seed/{int(seed)}".encode()
    return RunSecret(hmac.new(root.transport(), word, hashlib.sha256).digest())
