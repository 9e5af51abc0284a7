"""A worker that can be reset between runs: nothing of one run reaches the next.

A worker process kept for more than one run (one :class:`~fedsim.engine.simulation.Engine`
serving several runs, or a warm pool's workers leased to one run after another; the Ray
backend resets its workers before every run but the first) must not carry a run's
modules, state or secrets into the next run. :meth:`ResettableWorker.warm_up` takes a
baseline of the process once its heavy imports are loaded; :meth:`ResettableWorker.reset`
brings the process back to it:

- the run's fields (ClientApp, root, enrolment, kept contents, channel) are dropped;
- every module imported after the baseline leaves ``sys.modules`` (the next run imports
  its ClientApp afresh);
- in every baseline module, names added after the baseline are deleted and names rebound
  are bound back; the same for the attributes of the classes those modules define;
- the worker's own attributes, ``sys.path``, ``os.environ``, the working directory, the
  global random states (``random``, numpy's, torch's CPU generator) and torch's thread
  count, default dtype and grad mode are restored;
- a thread started by the run that is still alive fails the reset.

A reset that fails (or raises) says why; the caller must then not reuse the worker (the
backend kills it and puts a fresh one in its place). What a reset cannot undo is a change
*inside* an object that the baseline already held (an item appended to a list of a baseline
module, say), or C-level state; a run that needs that isolation runs in fresh workers (a new
Engine).
"""

from __future__ import annotations

import gc
import os
import sys
import threading
import warnings
from dataclasses import dataclass, field
from types import ModuleType
from typing import Any

from fedsim.engine.allocator import keep_freed_memory
from fedsim.engine.worker import ClientWorker

#: what a warm worker imports ahead of any run: torch (and the compiler torch imports
#: when a process first builds an optimiser), numpy, Flower's client side and fedsim's
#: worker, so that a run pays none of it
WARM_MODULES = (
    "torch",
    "torch._dynamo",
    "numpy",
    "flwr.app",
    "flwr.clientapp",
    "fedsim.engine.worker",
    "fedsim.engine.channel",
    "fedsim.data",
    "fedsim.models",
)

_MISSING = object()


def _module_classes(module: ModuleType, namespace: dict[str, Any]) -> list[type]:
    name = module.__name__
    with warnings.catch_warnings():  # isinstance on deprecated aliases warns (torch)
        warnings.simplefilter("ignore")
        return [
            value
            for value in list(namespace.values())
            if isinstance(value, type) and getattr(value, "__module__", None) == name
        ]


def _thread_owner(thread: threading.Thread) -> str:
    """The module of a thread's target (or class), to tell Ray's own threads from a run's."""
    target = getattr(thread, "_target", None)
    where = getattr(target, "__module__", None) if target is not None else None
    return where or type(thread).__module__ or ""


#: threads these packages start for themselves are not a run's
_SYSTEM_THREADS = ("ray", "grpc", "concurrent", "fedsim.engine.channel", "torch")


@dataclass
class Baseline:
    """The process as a warm worker left it, before any run."""

    modules: dict[str, ModuleType]
    namespaces: dict[str, dict[str, Any]]
    classes: dict[int, tuple[type, dict[str, Any]]]
    path: list[str]
    environ: dict[str, str]
    cwd: str
    threads: set[int]
    attributes: dict[str, Any] = field(default_factory=dict)
    #: global random states (``random``, numpy's, torch's CPU generator) and torch's
    #: process settings: a cold worker starts with torch's fixed default seed, so a warm one
    #: must too for a run to give the same bits (tested)
    globals_: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def take(cls, owner: object) -> Baseline:
        modules = {k: m for k, m in list(sys.modules.items()) if isinstance(m, ModuleType)}
        namespaces: dict[str, dict[str, Any]] = {}
        classes: dict[int, tuple[type, dict[str, Any]]] = {}
        for name, module in modules.items():
            try:
                namespace = vars(module)
            except TypeError:
                continue
            namespaces[name] = dict(namespace)
            for klass in _module_classes(module, namespace):
                classes[id(klass)] = (klass, dict(vars(klass)))
        return cls(
            modules=modules,
            namespaces=namespaces,
            classes=classes,
            path=list(sys.path),
            environ=dict(os.environ),
            cwd=os.getcwd(),
            threads={t.ident for t in threading.enumerate() if t.ident is not None},
            attributes=dict(vars(owner)),
            globals_=_global_state(),
        )

    def restore(self, owner: object) -> list[str]:
        """Bring the process back to the baseline; what could not be restored."""
        problems: list[str] = []
        for name in [k for k in list(sys.modules) if k not in self.modules]:
            sys.modules.pop(name, None)
        for name, module in self.modules.items():
            if sys.modules.get(name) is not module:
                sys.modules[name] = module
        for name, saved in self.namespaces.items():
            namespace = vars(self.modules[name])
            for key in [k for k in list(namespace) if k not in saved]:
                del namespace[key]
            for key, value in saved.items():
                if namespace.get(key, _MISSING) is not value:
                    namespace[key] = value
        for klass, saved in self.classes.values():
            current = vars(klass)
            for key in [k for k in list(current) if k not in saved]:
                try:
                    delattr(klass, key)
                except (AttributeError, TypeError) as err:
                    problems.append(f"class {klass.__qualname__}: {key} stays ({err})")
            for key, value in saved.items():
                if current.get(key, _MISSING) is not value and key not in ("__dict__", "__doc__"):
                    try:
                        setattr(klass, key, value)
                    except (AttributeError, TypeError) as err:
                        problems.append(f"class {klass.__qualname__}: {key} stays ({err})")
        sys.path[:] = self.path
        os.environ.clear()
        os.environ.update(self.environ)
        try:
            os.chdir(self.cwd)
        except OSError as err:
            problems.append(f"working directory {self.cwd}: {err}")
        _set_global_state(self.globals_)
        owned = vars(owner)
        for key in [k for k in list(owned) if k not in self.attributes]:
            del owned[key]
        owned.update(self.attributes)
        gc.collect()
        for thread in threading.enumerate():
            if thread.ident in self.threads or not thread.is_alive():
                continue
            owner_module = _thread_owner(thread)
            if not owner_module.startswith(_SYSTEM_THREADS):
                problems.append(f"thread {thread.name!r} ({owner_module}) is still running")
        return problems


def _global_state() -> dict[str, Any]:
    import random  # noqa: PLC0415

    state: dict[str, Any] = {"random": random.getstate()}
    numpy = sys.modules.get("numpy")
    if numpy is not None:
        state["numpy"] = numpy.random.get_state()
    torch = sys.modules.get("torch")
    if torch is not None:
        state["torch"] = (
            torch.get_rng_state(),
            torch.get_num_threads(),
            torch.get_default_dtype(),
            torch.is_grad_enabled(),
        )
    return state


def _set_global_state(state: dict[str, Any]) -> None:
    import random  # noqa: PLC0415

    random.setstate(state["random"])
    if "numpy" in state:
        sys.modules["numpy"].random.set_state(state["numpy"])
    if "torch" in state:
        torch = sys.modules["torch"]
        rng, threads, dtype, grad = state["torch"]
        torch.set_rng_state(rng)
        if torch.get_num_threads() != threads:
            torch.set_num_threads(threads)
        torch.set_default_dtype(dtype)
        torch.set_grad_enabled(grad)


class ResettableWorker(ClientWorker):
    """A :class:`ClientWorker` whose process a :meth:`reset` returns to its warm baseline."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        keep_freed_memory()  # an actor's own process: its clients reuse each other's blocks
        super().__init__(*args, **kwargs)

    def warm_up(self, modules: tuple[str, ...] = WARM_MODULES) -> int:
        pid = super().warm_up(modules)
        self.__dict__.pop("_baseline", None)
        self._runs = 0
        baseline = Baseline.take(self)
        self._baseline = baseline
        baseline.attributes["_baseline"] = baseline
        return pid

    def start_run(self, run: Any) -> int:
        runs = self._runs + 1
        pid = super().start_run(run)
        self._runs = runs  # run counting survives into the next reset's report
        return pid

    def add_paths(self, paths: list[str]) -> list[str]:
        """Put the driver's import paths after this process's own (a reset drops them)."""
        for path in paths:
            if path not in sys.path:
                sys.path.append(path)
        return list(sys.path)

    def reset(self) -> dict[str, Any]:
        """Drop everything of the runs since :meth:`warm_up`; ``{"ok", "problems", "pid",
        "runs"}`` (``ok`` False: do not reuse this worker)."""
        baseline = self.__dict__.get("_baseline")
        runs = self.__dict__.get("_runs", 0)
        if not isinstance(baseline, Baseline):
            return {"ok": False, "problems": ["no baseline: warm_up never ran"], "pid": os.getpid()}
        channel = self.__dict__.get("_channel")
        if channel is not None:
            channel.close()
        self._content_cache.clear()  # the baseline's own (emptied) dict is put back
        try:
            problems = baseline.restore(self)
        except Exception as err:  # a process the reset cannot vouch for is not reused
            problems = [f"{type(err).__name__}: {err}"]
        self._runs = 0
        return {"ok": not problems, "problems": problems, "pid": os.getpid(), "runs": runs}

    def probe(self, names: tuple[str, ...]) -> dict[str, bool]:
        """Which of ``names`` (modules, or ``module.attr``) this process holds (tests)."""
        found = {}
        for name in names:
            module, _, attr = name.partition(":")
            held = sys.modules.get(module)
            found[name] = held is not None and (not attr or hasattr(held, attr))
        return found
