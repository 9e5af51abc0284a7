"""A warm Ray head with worker actors kept up between runs (``fedsim up`` / ``fedsim down``).

A cold run pays Ray's start and each worker's imports (torch, ``torch._dynamo``: several
seconds each, docs/start-up.md). A warm pool pays them once:

- **the head**: ``fedsim up`` (or the first run with ``[engine] warm = "on"``) starts
  ``ray start --head --block`` in its own session, on a free port of this machine, and records
  it in ``$FEDSIM_WARM_DIR/head.json`` (default ``~/.fedsim/warm``); on a cluster
  (``--ray-address``) the cluster itself is the head;
- **the pool**: a detached keeper actor (:class:`Keeper`, namespace :data:`NAMESPACE`)
  creates detached worker actors (:class:`~fedsim.engine.worker_reset.ResettableWorker`)
  that import torch and the common modules once, and leases them to runs;
- **a run** connects (``ray.init(address=...)``), leases its workers, resets each
  (:meth:`~fedsim.engine.worker_reset.ResettableWorker.reset`; one whose reset fails is
  killed and replaced) and, when it ends, resets them again and gives them back, so an idle
  worker holds no run's secret;
- **the idle timeout**: the keeper checks every few seconds; once no run has held a worker
  for ``idle_timeout_s`` it kills the workers, itself and (a local head) the head's process
  group. ``fedsim down`` does the same at once.

A run's results do not depend on whether its workers were warm: a worker's state after a
reset is its state after warm-up, which is where a cold worker starts too (tested).
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from fedsim.config import ConfigError
from fedsim.engine.cluster import INLINE_OBJECT_BYTES, PACKAGES, _packages, check_reachable

#: the Ray namespace of the keeper and the pool's workers
NAMESPACE = "fedsim"
KEEPER = "fedsim-keeper"
#: where the local head is recorded (default ``~/.fedsim/warm``)
WARM_DIR_ENV = "FEDSIM_WARM_DIR"
#: ``on``, ``auto`` or ``off``: overrides ``[engine] warm``
WARM_ENV = "FEDSIM_WARM"
WARM_MODES = ("auto", "on", "off")
#: seconds a pool with no run waits before it stops
IDLE_TIMEOUT_S = 900.0
#: seconds between the keeper's idle checks
CHECK_S = 2.0
#: seconds to wait for a head to start or stop
HEAD_WAIT_S = 120.0


def warm_dir() -> Path:
    return Path(os.environ.get(WARM_DIR_ENV) or Path.home() / ".fedsim" / "warm")


def head_temp_dir() -> Path:
    """The local head's Ray temporary directory: its own, not Ray's default ``/tmp/ray``,
    where ``ray start`` would record the head in ``ray_current_cluster`` and every later
    ``ray.init()`` without an address (Flower's ``run_simulation``, a user's script) would join
    it. Short, since Ray's socket paths under it must stay within the 107 bytes of a Unix
    socket address."""
    return Path(tempfile.gettempdir()) / f"fedsim-ray-{os.getuid()}"


def warm_mode(configured: str) -> str:
    """``$FEDSIM_WARM`` if set, else ``configured``; refused unless one of :data:`WARM_MODES`."""
    mode = os.environ.get(WARM_ENV) or configured
    key = f"${WARM_ENV}" if os.environ.get(WARM_ENV) else "engine.warm"
    if mode not in WARM_MODES:
        raise ConfigError(
            key,
            mode,
            "'auto' (attach to a warm pool if one is up), 'on' (start one if not) "
            "or 'off' (a cold start)",
        )
    return mode


@dataclass(frozen=True)
class Head:
    """A local head that ``fedsim up`` started: its address, its process (group) and the
    code its workers import."""

    address: str
    pid: int
    num_cpus: int
    packages: tuple[str, ...]
    idle_timeout_s: float

    @staticmethod
    def path() -> Path:
        return warm_dir() / "head.json"

    def save(self) -> None:
        self.path().parent.mkdir(parents=True, exist_ok=True)
        tmp = self.path().with_suffix(".tmp")
        tmp.write_text(json.dumps(asdict(self)))
        tmp.replace(self.path())

    @classmethod
    def load(cls) -> Head | None:
        """The recorded head if its process still lives and its port answers, else None
        (a stale record is removed)."""
        try:
            data = json.loads(cls.path().read_text())
            head = cls(**{**data, "packages": tuple(data["packages"])})
        except (OSError, ValueError, TypeError, KeyError):
            return None
        if not _alive(head.pid):
            cls.path().unlink(missing_ok=True)
            return None
        try:
            check_reachable(head.address, timeout=2.0)
        except ConfigError:
            return None
        return head


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _ray_cli() -> list[str]:
    beside = Path(sys.executable).parent / "ray"
    if beside.exists():
        return [str(beside)]
    return [
        sys.executable,
        "-c",
        "import sys; from ray.scripts.scripts import main; sys.exit(main())",
    ]


def _head_env(packages: tuple[str, ...]) -> dict[str, str]:
    """The head's environment: ours, with the packages' roots on ``PYTHONPATH`` and Ray's
    usage stats off."""
    env = dict(os.environ)
    roots = [str(Path(p).parent) for p in packages]
    env["PYTHONPATH"] = os.pathsep.join(
        dict.fromkeys(roots + env.get("PYTHONPATH", "").split(os.pathsep))
    )
    env.setdefault("RAY_ACCEL_ENV_VAR_OVERRIDE_ON_ZERO", "0")
    env["RAY_USAGE_STATS_ENABLED"] = "0"
    return env


def _wait_for_head(process: subprocess.Popen, address: str) -> None:
    """Wait (at most ``HEAD_WAIT_S``) until the head at ``address`` is reachable; a
    RuntimeError if its process exits first or it is not reachable in time (then stopped)."""
    deadline = time.monotonic() + HEAD_WAIT_S
    while True:
        if process.poll() is not None:
            raise RuntimeError(
                f"`ray start --head` exited with {process.returncode}; "
                f"see {warm_dir() / 'head.log'}"
            )
        try:
            check_reachable(address, timeout=1.0)
            break
        except ConfigError as err:
            if time.monotonic() > deadline:
                _stop_group(process.pid)
                raise RuntimeError(
                    f"the Ray head at {address} did not start in {HEAD_WAIT_S:g} s"
                ) from err
            time.sleep(0.2)


def start_head(
    num_cpus: int | None = None, idle_timeout_s: float = IDLE_TIMEOUT_S, object_store_mb: int = 512
) -> Head:
    """Start a local head (``ray start --head --block``) in its own process group."""
    if not idle_timeout_s > 0:
        raise ConfigError("--idle-timeout", idle_timeout_s, "a number of seconds > 0")
    packages = tuple(_packages())
    cpus = int(num_cpus or os.cpu_count() or 1)
    port = _free_port()
    system = {
        "max_direct_call_object_size": INLINE_OBJECT_BYTES,
        "task_rpc_inlined_bytes_limit": 2 * INLINE_OBJECT_BYTES,
    }
    command = _ray_cli() + [
        "start",
        "--head",
        "--block",
        f"--port={port}",
        "--node-ip-address=127.0.0.1",
        f"--num-cpus={cpus}",
        "--num-gpus=0",
        "--include-dashboard=false",
        "--disable-usage-stats",
        f"--object-store-memory={object_store_mb * 1024 * 1024}",
        f"--system-config={json.dumps(system)}",
        f"--temp-dir={head_temp_dir()}",
    ]
    env = _head_env(packages)
    warm_dir().mkdir(parents=True, exist_ok=True)
    log = open(warm_dir() / "head.log", "ab")  # noqa: SIM115 (the head's own output)
    process = subprocess.Popen(
        command,
        stdin=subprocess.DEVNULL,
        stdout=log,
        stderr=log,
        env=env,
        start_new_session=True,
    )
    log.close()
    address = f"127.0.0.1:{port}"
    _wait_for_head(process, address)
    head = Head(address, process.pid, cpus, packages, float(idle_timeout_s))
    head.save()
    return head


def _group_gone(pid: int) -> bool:
    """True once no process of ``pid``'s group is left. The head's own process is reaped
    first if this process started it (``up`` and ``down`` in one process): an unreaped
    child stays in its group as a zombie."""
    try:
        os.waitpid(pid, os.WNOHANG)
    except ChildProcessError:
        pass  # not our child: whoever is its parent (init, once `fedsim up` exited) reaps it
    try:
        os.killpg(pid, 0)
    except ProcessLookupError:
        return True
    return False


def _stop_group(pid: int, wait_s: float = 30.0) -> bool:
    """SIGTERM the head's process group (``ray start --block`` then stops what it started),
    SIGKILL what is left after ``wait_s`` and wait until the group is empty; True if
    something was stopped."""
    try:
        os.killpg(pid, signal.SIGTERM)
    except ProcessLookupError:
        return False
    deadline = time.monotonic() + wait_s
    while time.monotonic() < deadline:
        if _group_gone(pid):
            return True
        time.sleep(0.2)
    try:
        os.killpg(pid, signal.SIGKILL)
    except ProcessLookupError:
        return True
    deadline = time.monotonic() + 10.0  # killed processes leave the group once reaped
    while time.monotonic() < deadline and not _group_gone(pid):
        time.sleep(0.2)
    return True


class Keeper:
    """The pool's detached keeper: creates warm workers, leases them to runs, and stops the
    pool (and a local head) once it has been idle for ``idle_timeout_s``."""

    def __init__(self, idle_timeout_s: float, head_pid: int | None = None) -> None:
        import ray  # noqa: PLC0415

        from fedsim.engine.worker_reset import ResettableWorker  # noqa: PLC0415

        self._ray = ray
        self._cls = ray.remote(ResettableWorker)
        self.idle_timeout_s = float(idle_timeout_s)
        self.head_pid = head_pid
        self._free: dict[tuple[float, float], list[str]] = {}
        self._leased: dict[str, tuple[str, int, tuple[float, float]]] = {}
        self._made = 0
        self._last = time.monotonic()
        self._lock = threading.Lock()
        self._host = socket.gethostname()
        threading.Thread(target=self._watch, name="fedsim-keeper", daemon=True).start()

    def _new(self, shape: tuple[float, float]) -> str:
        self._made += 1
        name = f"fedsim-worker-{self._made}"
        cpus, gpus = shape
        threads = max(1, int(cpus)) if cpus >= 1 else 1
        actor = self._cls.options(
            name=name,
            namespace=NAMESPACE,
            lifetime="detached",
            num_cpus=cpus,
            num_gpus=gpus,
            max_restarts=0,
        ).remote(threads)
        self._ray.get(actor.warm_up.remote())
        return name

    def fill(self, count: int, cpus: float = 1.0, gpus: float = 0.0) -> list[str]:
        """Make sure ``count`` free warm workers of this shape exist (``fedsim up``)."""
        with self._lock:
            free = self._free.setdefault((cpus, gpus), [])
            while len(free) < count:
                free.append(self._new((cpus, gpus)))
            return list(free)

    def lease(self, count: int, host: str, pid: int, cpus: float, gpus: float) -> list[str]:
        """``count`` workers for the run of driver ``pid`` on ``host`` (warm ones first)."""
        with self._lock:
            self._last = time.monotonic()
            shape = (cpus, gpus)
            free = self._free.setdefault(shape, [])
            names = [free.pop(0) for _ in range(min(count, len(free)))]
            names += [self._new(shape) for _ in range(count - len(names))]
            for name in names:
                self._leased[name] = (host, pid, shape)
            return names

    def release(self, names: list[str], clean: list[bool]) -> None:
        """Workers back from a run: a clean one (reset) is kept, the others are killed."""
        with self._lock:
            self._last = time.monotonic()
            for name, ok in zip(names, clean, strict=True):
                held = self._leased.pop(name, None)
                if held is None:
                    continue
                if ok:
                    self._free.setdefault(held[2], []).append(name)
                else:
                    self._kill(name)

    def replace(self, name: str) -> str:
        """Kill leased worker ``name`` (its reset failed) and lease a fresh one instead."""
        with self._lock:
            self._last = time.monotonic()
            host, pid, shape = self._leased.pop(name)
            self._kill(name)
            fresh = self._new(shape)
            self._leased[fresh] = (host, pid, shape)
            return fresh

    def _kill(self, name: str) -> None:
        try:
            self._ray.kill(self._ray.get_actor(name, namespace=NAMESPACE), no_restart=True)
        except ValueError:
            pass

    def describe(self) -> dict[str, Any]:
        with self._lock:
            return {
                "free": sum(len(v) for v in self._free.values()),
                "leased": len(self._leased),
                "idle_s": time.monotonic() - self._last,
                "idle_timeout_s": self.idle_timeout_s,
                "head_pid": self.head_pid,
            }

    def _watch(self) -> None:
        while True:
            time.sleep(CHECK_S)
            with self._lock:
                for name, (host, pid, _) in list(self._leased.items()):
                    if host == self._host and not _alive(pid):  # its run died: never reused
                        del self._leased[name]
                        self._kill(name)
                        self._last = time.monotonic()
                idle = not self._leased and time.monotonic() - self._last > self.idle_timeout_s
            if idle:
                self.stop()
                return

    def stop(self) -> None:
        """Kill every worker, then (a local head) the head's process group, else itself."""
        with self._lock:
            for names in self._free.values():
                for name in names:
                    self._kill(name)
            for name in list(self._leased):
                self._kill(name)
            self._free.clear()
            self._leased.clear()
        if self.head_pid is not None:
            Head.path().unlink(missing_ok=True)
            os.killpg(self.head_pid, signal.SIGTERM)
        else:
            self._ray.actor.exit_actor()


def keeper(create: bool, idle_timeout_s: float = IDLE_TIMEOUT_S, head_pid: int | None = None):
    """The connected cluster's keeper; created (detached) when missing and ``create``."""
    import ray  # noqa: PLC0415

    try:
        return ray.get_actor(KEEPER, namespace=NAMESPACE)
    except ValueError:
        if not create:
            return None
    env = {"env_vars": {WARM_DIR_ENV: str(warm_dir())}}
    return (
        ray.remote(Keeper)
        .options(
            name=KEEPER,
            namespace=NAMESPACE,
            lifetime="detached",
            num_cpus=0,
            get_if_exists=True,
            max_concurrency=8,
            runtime_env=env,
        )
        .remote(idle_timeout_s, head_pid)
    )


def connect(address: str, extra_modules: tuple[str, ...] = ()) -> None:
    """``ray.init`` on a warm head (local: its record's address; else a cluster's)."""
    import ray  # noqa: PLC0415

    os.environ.setdefault("RAY_ACCEL_ENV_VAR_OVERRIDE_ON_ZERO", "0")
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    kwargs: dict[str, Any] = {"address": address, "logging_level": "WARNING"}
    if extra_modules:
        kwargs["runtime_env"] = {"py_modules": list(extra_modules)}
    ray.init(**kwargs)


def attach(
    mode: str,
    ray_address: str,
    num_cpus: int | None,
    object_store_mb: int,
    extra_modules: tuple[str, ...] = (),
) -> Any:
    """Connect this driver to a warm pool and return its keeper, or None (``mode`` "auto"
    and none is up, or "off"): then nothing was started or joined."""
    if mode == "off":
        return None
    address = ray_address or os.environ.get("RAY_ADDRESS", "")
    if address:
        from fedsim.engine.cluster import ensure_ray  # noqa: PLC0415

        ensure_ray(address, extra_modules=extra_modules)
        found = keeper(create=mode == "on")
        if found is None:
            return None
        return found
    head = Head.load()
    if head is None:
        if mode != "on":
            return None
        head = start_head(num_cpus, object_store_mb=object_store_mb)
    here = tuple(_packages())
    if head.packages != here:
        raise ConfigError(
            "engine.warm",
            mode,
            f"a warm head whose workers import fedsim from {head.packages[0]}, not {here[0]}: "
            "run `fedsim down` first (or set engine.warm = 'off')",
        )
    connect(head.address, extra_modules)
    return keeper(create=True, idle_timeout_s=head.idle_timeout_s, head_pid=head.pid)


def up(
    workers: int = 0,
    num_cpus: int | None = None,
    idle_timeout_s: float = IDLE_TIMEOUT_S,
    object_store_mb: int = 512,
    ray_address: str = "",
) -> dict[str, Any]:
    """Start (or find) the warm head and fill its pool with ``workers`` warm workers (0:
    one per CPU); returns what is up."""
    import ray  # noqa: PLC0415

    if not idle_timeout_s > 0:
        raise ConfigError("--idle-timeout", idle_timeout_s, "a number of seconds > 0")
    if workers < 0:
        raise ConfigError("--workers", workers, "an integer >= 0 (0: one per CPU)")
    address = ray_address or os.environ.get("RAY_ADDRESS", "")
    if address:
        from fedsim.engine.cluster import ensure_ray  # noqa: PLC0415

        ensure_ray(address)
        found = keeper(create=True, idle_timeout_s=idle_timeout_s)
    else:
        head = Head.load() or start_head(num_cpus, idle_timeout_s, object_store_mb)
        address = head.address
        connect(address)
        found = keeper(create=True, idle_timeout_s=head.idle_timeout_s, head_pid=head.pid)
    try:
        count = workers or max(1, int(ray.cluster_resources().get("CPU", 1.0)))
        names = ray.get(found.fill.remote(count))
        described = ray.get(found.describe.remote())
    finally:
        ray.shutdown()
    return {"address": address, "workers": names, **described}


def down(ray_address: str = "") -> bool:
    """Stop the warm pool (and a local head): True if one was up."""
    address = ray_address or os.environ.get("RAY_ADDRESS", "")
    if address:
        import ray  # noqa: PLC0415

        from fedsim.engine.cluster import ensure_ray  # noqa: PLC0415

        ensure_ray(address)
        try:
            found = keeper(create=False)
            if found is None:
                return False
            try:
                ray.get(found.stop.remote(), timeout=60)
            except ray.exceptions.RayActorError:
                pass  # it exited as it stopped
            return True
        finally:
            ray.shutdown()
    try:
        data = json.loads(Head.path().read_text())
    except (OSError, ValueError):
        return False
    Head.path().unlink(missing_ok=True)
    return _stop_group(int(data["pid"]))


__all__ = ["NAMESPACE", "PACKAGES", "Head", "Keeper", "attach", "down", "up", "warm_mode"]
