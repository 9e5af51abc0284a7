"""Which secret root a run uses, and how ``--resume`` finds it again.

A run's :class:`~fedsim.randomness.RunSecret` is either *given* (``fedsim run --secrets FILE``,
or ``run_experiment(..., secrets=...)``) or *kept*: a fresh root from OS randomness, written
(mode 0600) to :func:`~fedsim.randomness.user_secrets_dir` under a random run id. Either way
the root lies outside the run directory. The run directory holds only ``run.json``: the run id
(for a kept root) and the root's public fingerprint, so that a resumed run picks up the same
root -- or refuses, with a message, when it cannot find it or is given another one.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from fedsim.config import ConfigError
from fedsim.randomness import RunSecret, kept_root_path, new_run_id, user_secrets_dir

RUN_FILE = "run.json"
KEPT, GIVEN = "kept", "given"


def start_root(run_dir: str | Path, given: RunSecret | None) -> RunSecret:
    """The root of a new run in ``run_dir``: ``given``, else a fresh kept one; writes
    ``run.json``."""
    run_dir = Path(run_dir)
    record: dict[str, Any]
    if given is not None:
        root, record = given, {"root": GIVEN}
    else:
        run_id = new_run_id()
        root = RunSecret.load_or_create(kept_root_path(run_id), run_dir)
        record = {"root": KEPT, "run_id": run_id}
    record["fingerprint"] = root.fingerprint()
    run_dir.mkdir(parents=True, exist_ok=True)
    tmp = run_dir / (RUN_FILE + ".tmp")
    tmp.write_text(json.dumps(record, indent=2, sort_keys=True) + "\n")
    os.replace(tmp, run_dir / RUN_FILE)
    return root


def resume_root(run_dir: str | Path, given: RunSecret | None) -> RunSecret:
    """The root of the run in ``run_dir`` being resumed: the kept one, or ``given``, which
    must be the root the run started with."""
    run_dir = Path(run_dir)
    path = run_dir / RUN_FILE
    try:
        record = json.loads(path.read_text())
        fingerprint = str(record["fingerprint"])
    except (OSError, ValueError, KeyError, TypeError):
        raise ConfigError(
            "--resume",
            str(run_dir),
            f"a run directory with the {RUN_FILE} fedsim writes (it records which secret "
            "root the run uses)",
        ) from None
    if given is None:
        if record.get("root") != KEPT:
            raise ConfigError(
                "--secrets",
                None,
                "the root file this run was started with (it was started with --secrets; "
                "fedsim did not keep its root)",
            )
        kept = kept_root_path(str(record.get("run_id")))
        if not kept.is_file():
            raise ConfigError(
                "--secrets",
                None,
                f"this run's root, which fedsim kept in {kept} and is no longer there "
                f"(it lives in {user_secrets_dir()}, set by $FEDSIM_SECRETS_DIR); without it "
                "the run cannot continue with the same secrets",
            )
        given = RunSecret.load_or_create(kept, run_dir, create=False)
    if given.fingerprint() != fingerprint:
        raise ConfigError(
            "--secrets",
            given.fingerprint(),
            f"the root this run was started with (fingerprint {fingerprint})",
        )
    return given
