"""The driver's keys of a run, derived in a child process: the driver never reads the root.

``fedsim run`` (and ``--resume``, ``--replay``, ``fedsim audit``) needs what the server side may
hold of a run's root -- :class:`~fedsim.randomness.RunKeys`: the file key, the server's own
secret, the state stores' sub-roots -- and the base root's public fingerprint. Deriving them
means reading the root file, which also derives every client's secret; so
:func:`derive_keys` starts a short-lived child (this module's :func:`main` in an isolated
interpreter, which imports neither torch nor Ray) that opens the file -- creating it first,
with OS randomness and mode 0600, when asked to -- mixes in the run nonce
(:meth:`~fedsim.randomness.RunSecret.for_run`), and writes back through a pipe only the keys
and the fingerprint. The root's bytes never enter the driver's memory; the clients' secrets are
derived where the engine's workers open the file (:class:`~fedsim.randomness.RootSource`).

Request (stdin, JSON): ``{"path", "nonce", "create", "run_dir", "what"}``. Reply (stdout,
JSON): :meth:`~fedsim.randomness.RunKeys.tokens` (``what`` "keys"), only the fingerprint
(``what`` "fingerprint": :func:`root_fingerprint`, for ``fedsim flwr-run``), or
``{"error": {"key", "value", "allowed"}}`` for a refused file, raised again in the driver as
the same :class:`~fedsim.config.ConfigError`.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

from fedsim.config import ConfigError
from fedsim.randomness import RunKeys, RunSecret, checked_nonce

#: seconds the child may take (it reads one small file and computes a few HMACs)
CHILD_TIMEOUT_S = 120.0
#: the child: isolated mode (-I: no PYTHON* variables, no user site, not the working
#: directory), importing this very fedsim
_PACKAGE_ROOT = str(Path(__file__).resolve().parents[2])
_CHILD = (
    f"import sys; sys.path.insert(0, {_PACKAGE_ROOT!r}); "
    "from fedsim.frontend.root_keys import main; "
    "sys.exit(main())"
)


def derive_keys(
    path: str | Path,
    nonce: str | None,
    *,
    create: bool,
    run_dir: str | Path | None = None,
) -> RunKeys:
    """The driver's keys of the run whose base root lies in ``path``, mixed with ``nonce``
    (None: unmixed), read -- and with ``create``, first written if missing -- by a child
    process. ``path`` must lie outside ``run_dir``. A file that is not a root raises the
    :class:`~fedsim.config.ConfigError` that names it."""
    if nonce is not None:
        checked_nonce(nonce)
    return RunKeys.from_tokens(_ask(path, nonce, create, run_dir, "keys"))


def root_fingerprint(
    path: str | Path, *, create: bool, run_dir: str | Path | None = None
) -> str:
    """The public fingerprint of the base root in ``path``, read -- and with ``create``, first
    written if missing -- by a child process, which hands back nothing else (what ``fedsim
    flwr-run``, whose driver needs no key, records)."""
    return str(_ask(path, None, create, run_dir, "fingerprint")["fingerprint"])


def _ask(path, nonce, create, run_dir, what: str) -> dict[str, Any]:
    """The child's reply to one request; its refusal raised as the ConfigError it names."""
    request = {
        "path": str(path),
        "nonce": nonce,
        "create": bool(create),
        "run_dir": None if run_dir is None else str(run_dir),
        "what": what,
    }
    try:
        done = subprocess.run(
            [sys.executable, "-I", "-c", _CHILD],
            input=json.dumps(request),
            capture_output=True,
            text=True,
            timeout=CHILD_TIMEOUT_S,
            check=False,
        )
    except subprocess.TimeoutExpired:
        raise RuntimeError(
            f"the process reading the root file {path} did not answer in {CHILD_TIMEOUT_S:g} s"
        ) from None
    try:
        reply = json.loads(done.stdout)
    except ValueError:
        reply = None
    if done.returncode != 0 or not isinstance(reply, dict):
        raise RuntimeError(
            f"the process reading the root file {path} failed (exit {done.returncode}): "
            f"{done.stderr.strip()[-2000:]}"
        )
    if "error" in reply:
        err = reply["error"]
        raise ConfigError(str(err["key"]), err["value"], str(err["allowed"]))
    return reply


def _answer(request: dict[str, Any]) -> dict[str, Any]:
    """The child's side: the keys of the root in ``request["path"]``, or the refusal."""
    path = request["path"]
    try:
        base = RunSecret.load_or_create(path, request["run_dir"], create=request["create"])
    except OSError as err:
        raise ConfigError(
            "secrets", str(path), f"a readable file holding this run's root ({err.strerror})"
        ) from None
    if request.get("what") == "fingerprint":
        return {"fingerprint": base.fingerprint()}
    nonce = request["nonce"]
    root = base if nonce is None else base.for_run(nonce)
    return RunKeys.of(root, base.fingerprint()).tokens()


def main() -> int:
    request = json.loads(sys.stdin.read())
    try:
        reply = _answer(request)
    except ConfigError as err:
        reply = {"error": {"key": err.key, "value": err.value, "allowed": err.allowed}}
    sys.stdout.write(json.dumps(reply, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
