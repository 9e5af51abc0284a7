"""Which secret root a run uses, its run nonce, and how ``--resume`` finds both again.

A run's base root (:class:`~fedsim.randomness.RunSecret`) is either *given* (``fedsim run
--secrets FILE``, or ``run_experiment(..., secrets=...)``) or *kept*: a fresh root from OS
randomness, written (mode 0600) to :func:`~fedsim.randomness.user_secrets_dir` under a random run
id. Either way it lies outside the run directory.

**A root serves one run.** Every new run draws a fresh public nonce (:func:`new_nonce`) and every
party secret of the run derives from ``base.for_run(nonce)``: two runs of one root file (two
sweep points, two values of a noise multiplier) draw independent noise, so no difference of
their releases cancels it. ``--resume`` reads the nonce back and repeats the same streams; a
*replay* (``fedsim run --replay EARLIER_RUN``) deliberately takes an earlier run's nonce, and its
``run.json`` and ``summary.json`` say that its releases are a copy of that run's, not new ones.

The run directory holds ``run.json``: the root's kind, the run id (for a kept root), the base
root's public fingerprint, the nonce, the replayed run (if any) and ``config_mac``, an
HMAC-SHA256 (RFC 2104) of ``config.json`` under the run's file key
(:meth:`~fedsim.randomness.RunSecret.mac_key`). :func:`authenticated_config` checks that MAC
before anything parses ``config.json`` -- which names modules to import (``[model] factory``,
``python_path``), so an edited one would otherwise run code -- and refuses it naming the file.

**The driver reads no root.** :func:`start_root` and :func:`resume_root` get what the server
side may hold (:class:`~fedsim.randomness.RunKeys`: the file key, the server's secret, the state
stores' sub-roots) and the base root's fingerprint from a short-lived child process that reads
the root file -- and writes a fresh one, mode 0600 -- and hands back only those
(:mod:`fedsim.frontend.root_keys`); the clients' and committee members' secrets are derived where
the root is opened: on the engine's workers and the committee hosts' member actors
(:class:`~fedsim.randomness.RootSource`). A root handed over as an object
(``run_experiment(..., secrets=RunSecret)``) is the caller's, already in the driver's process.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from fedsim.config import ConfigError
from fedsim.frontend.root_keys import derive_keys, root_fingerprint
from fedsim.randomness import (
    RootSource,
    RunKeys,
    RunSecret,
    checked_nonce,
    kept_root_path,
    new_nonce,
    new_run_id,
    user_secrets_dir,
)
from fedsim.runfiles import CONFIG_FILE, RunFileError

RUN_FILE = "run.json"
KEPT, GIVEN, FRESH = "kept", "given", "fresh"
FRESH_NOTE = (
    "a fresh root of OS randomness, written by a worker for this run alone and removed when "
    "it ended: its streams cannot be repeated"
)
REPLAY_NOTE = (
    "a replay: this run repeats the noise streams of an earlier run (same root, same nonce); "
    "its releases are a copy of that run's releases, not new ones, and add no privacy cost "
    "only if they are never published beside the original"
)


@dataclass(frozen=True)
class RunRoot:
    """The secrets of one run as the driver holds them: never the root itself.

    Attributes:
        keys: what the server side may hold (:class:`~fedsim.randomness.RunKeys`: the file key,
            the server's secret, the state stores' sub-roots), derived by a child process
            that reads the root file (:mod:`fedsim.frontend.root_keys`).
        source: where the engine's workers and the committee hosts' member actors open the
            root themselves (a file and the nonce), or None when the root was handed over as
            an object (the engine then writes it to a private file for them).
        nonce: the run's public nonce (None: a run started before nonces, unmixed).
        record: ``run.json`` as written.
        given: the base root when it was handed over as an object: its caller holds it in
            this process, which then gives no isolation (a root *file* does).
    """

    keys: RunKeys
    source: RootSource | None
    nonce: str | None
    record: dict[str, Any]
    given: RunSecret | None = None

    def open_root(self) -> RunSecret:
        """The run's root, opened now for a caller that plays the parties (an audit, a test);
        the driver of a run never calls it."""
        if self.source is not None:
            return self.source.open()
        assert self.given is not None
        return self.given if self.nonce is None else self.given.for_run(self.nonce)

    def workers_source(self, engine: Any) -> RootSource:
        """Where the engine's workers and member actors open the root: the file, or (a root
        given as an object) a private file ``engine`` writes and removes when it closes."""
        if self.source is not None:
            return self.source
        return engine.root_source(self.open_root())

    @property
    def replay_of(self) -> dict[str, Any] | None:
        return self.record.get("replay_of")


def _keys_of(base: RunSecret, nonce: str | None) -> RunKeys:
    """The keys of the run ``base`` mixed with ``nonce``, for a root the caller handed over
    as an object (and so holds in this process already)."""
    root = base if nonce is None else base.for_run(nonce)
    return RunKeys.of(root, base.fingerprint())


def config_mac(keys: RunKeys | RunSecret, data: bytes) -> str:
    """HMAC-SHA256 of ``config.json``'s bytes under the run's file key (hex)."""
    return hmac.new(keys.mac_key(), b"config.json\x00" + data, hashlib.sha256).hexdigest()


def _root(
    given: RunSecret | str | Path | None, run_dir: Path, nonce: str | None, *, create: bool
) -> tuple[RunKeys, Path | None, dict[str, Any]]:
    """The run's keys, the file its base root lies in (None: an object) and run.json's root
    fields. A root file -- ``given``, or without it a fresh one kept under a new run id -- is
    read (and created) by a child process (:func:`~fedsim.frontend.root_keys.derive_keys`): the
    driver never holds its bytes. A root object is the caller's, already in this process."""
    if isinstance(given, RunSecret):
        return _keys_of(given, nonce), None, {"root": GIVEN}
    if given is not None:
        path = Path(given).expanduser().resolve()
        return derive_keys(path, nonce, create=create, run_dir=run_dir), path, {"root": GIVEN}
    run_id = new_run_id()
    path = kept_root_path(run_id)
    keys = derive_keys(path, nonce, create=True, run_dir=run_dir)
    return keys, path, {"root": KEPT, "run_id": run_id}


def _run_nonce(nonce: Any, where: Path) -> str | None:
    """The nonce a run.json holds, checked (None: a run from before nonces)."""
    if nonce is None:
        return None
    try:
        return checked_nonce(nonce)
    except ConfigError:
        raise RunFileError(where, f"holds a nonce fedsim did not write: {nonce!r}") from None


def _write(run_dir: Path, record: dict[str, Any]) -> None:
    run_dir.mkdir(parents=True, exist_ok=True)
    tmp = run_dir / (RUN_FILE + ".tmp")
    tmp.write_text(json.dumps(record, indent=2, sort_keys=True) + "\n")
    os.replace(tmp, run_dir / RUN_FILE)


def start_root(
    run_dir: str | Path,
    given: RunSecret | str | Path | None,
    config_data: bytes,
    replay: str | Path | None = None,
) -> RunRoot:
    """The root of a new run in ``run_dir``: ``given`` (an object or a root file), else a fresh
    kept one; a fresh nonce, or with ``replay`` the nonce (and kept root) of that earlier run.
    Writes ``run.json`` with the MAC of ``config_data`` (the bytes of ``config.json``)."""
    run_dir = Path(run_dir)
    if replay is not None:
        earlier = read_record(replay, "--replay")
        nonce = _run_nonce(earlier.get("nonce"), Path(replay) / RUN_FILE)
        kept = given is None and earlier.get("root") == KEPT
        if kept:
            given = _kept_file(earlier)
        keys, path, record = _root(given, run_dir, nonce, create=False)
        if kept:
            record = {"root": KEPT, "run_id": earlier["run_id"]}
        if keys.fingerprint() != str(earlier.get("fingerprint")):
            raise ConfigError(
                "--secrets",
                keys.fingerprint(),
                f"the root the replayed run {replay} used (fingerprint "
                f"{earlier.get('fingerprint')}): a replay repeats that run's streams",
            )
        record["replay_of"] = {"run_dir": str(Path(replay).resolve()), "nonce": nonce}
        record["note"] = REPLAY_NOTE
    else:
        nonce = new_nonce()
        keys, path, record = _root(given, run_dir, nonce, create=True)
    record.update(fingerprint=keys.fingerprint(), nonce=nonce)
    record["config_mac"] = config_mac(keys, config_data)
    _write(run_dir, record)
    source = None if path is None else RootSource(str(path), nonce)
    return RunRoot(keys, source, nonce, record, given if path is None else None)


def app_record(
    run_dir: str | Path, given: RootSource | RunSecret | None, source: RootSource
) -> dict[str, Any]:
    """Write ``run.json`` of a Flower app's run (``fedsim flwr-run``) and return it: the
    public record of its root, as :func:`start_root` writes one (there is no ``config.json``
    to authenticate and nothing to resume). ``given``: the root handed over (a file and the
    nonce mixed into it, or an object), recorded with the base root's fingerprint; None: the
    fresh root a worker wrote (``source``), kept nowhere. A root file is read for its
    fingerprint by a child process (:func:`~fedsim.frontend.root_keys.root_fingerprint`), never
    here."""
    if given is None:
        record: dict[str, Any] = {"root": FRESH, "nonce": source.nonce, "note": FRESH_NOTE}
    elif isinstance(given, RunSecret):
        record = {"root": GIVEN, "fingerprint": given.fingerprint(), "nonce": None}
    elif isinstance(given, RootSource):
        fingerprint = root_fingerprint(given.path, create=False, run_dir=run_dir)
        record = {"root": GIVEN, "fingerprint": fingerprint, "nonce": given.nonce}
    else:
        raise ValueError(
            f"secrets is a {type(given).__name__}; allowed: RootSource, RunSecret or None"
        )
    _write(Path(run_dir), record)
    return record


def read_record(run_dir: str | Path, key: str = "--resume") -> dict[str, Any]:
    """``run.json`` of the run in ``run_dir`` (public data: checked, never trusted)."""
    path = Path(run_dir) / RUN_FILE
    try:
        record = json.loads(path.read_text())
        str(record["fingerprint"])
    except (OSError, ValueError, KeyError, TypeError):
        raise ConfigError(
            key,
            str(run_dir),
            f"a run directory with the {RUN_FILE} fedsim writes (it records which secret "
            "root the run uses)",
        ) from None
    if not isinstance(record, dict):
        raise ConfigError(key, str(run_dir), f"a {RUN_FILE} holding a JSON object")
    return record


def _kept_file(record: dict[str, Any]) -> Path:
    kept = kept_root_path(str(record.get("run_id")))
    if not kept.is_file():
        raise ConfigError(
            "--secrets",
            None,
            f"this run's root, which fedsim kept in {kept} and is no longer there "
            f"(it lives in {user_secrets_dir()}, set by $FEDSIM_SECRETS_DIR); without it "
            "the run cannot continue with the same secrets",
        )
    return kept


def resume_root(run_dir: str | Path, given: RunSecret | str | Path | None) -> RunRoot:
    """The root of the run in ``run_dir``: the kept one, or ``given``, which must be the base
    root the run started with; its nonce read back from ``run.json``."""
    run_dir = Path(run_dir)
    record = read_record(run_dir)
    fingerprint = str(record["fingerprint"])
    if given is None:
        if record.get("root") != KEPT:
            raise ConfigError(
                "--secrets",
                None,
                "the root file this run was started with (it was started with --secrets; "
                "fedsim did not keep its root)",
            )
        given = _kept_file(record)
    nonce = _run_nonce(record.get("nonce"), run_dir / RUN_FILE)
    keys, path, _ = _root(given, run_dir, nonce, create=False)
    if keys.fingerprint() != fingerprint:
        raise ConfigError(
            "--secrets",
            keys.fingerprint(),
            f"the root this run was started with (fingerprint {fingerprint})",
        )
    source = None if path is None else RootSource(str(path), nonce)
    return RunRoot(keys, source, nonce, record, given if path is None else None)


def authenticated_config(
    run_dir: str | Path, given: RunSecret | str | Path | None
) -> tuple[RunRoot, bytes]:
    """The run's root and the bytes of its ``config.json``, after their MAC checked under the
    run's root; raises :class:`~fedsim.runfiles.RunFileError` naming ``config.json`` when it
    is missing its MAC, edited or of another run. Nothing is parsed before."""
    run_dir = Path(run_dir)
    path = run_dir / CONFIG_FILE
    if not path.is_file():
        raise ConfigError(
            "--resume", str(run_dir), f"a fedsim run directory (it has no {CONFIG_FILE})"
        )
    run = resume_root(run_dir, given)
    try:
        data = path.read_bytes()
    except OSError as err:
        raise RunFileError(path, f"cannot be read ({err.strerror})") from None
    expected = run.record.get("config_mac")
    if not isinstance(expected, str):
        raise RunFileError(
            path,
            f"has no MAC in {RUN_FILE} (a run from before configs were authenticated, or "
            f"{RUN_FILE} was edited); it is never imported unauthenticated",
        )
    if not hmac.compare_digest(expected, config_mac(run.keys, data)):
        raise RunFileError(
            path,
            "fails authentication under this run's root: edited, or of another run; it is "
            "never parsed (it names modules to import)",
        )
    return run, data
