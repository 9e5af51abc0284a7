"""The import layers of the project, enforced (issue 19, point 1).

Every module under the packages in ``PACKAGES`` is parsed (nothing is imported); every
``import``/``from ... import`` statement, wherever it sits (module level, inside functions,
under ``if TYPE_CHECKING``), and every ``importlib.import_module("...")`` with a literal name
is an arrow from its file to the file it names. The test fails on

* an arrow that goes against the layers: ``LAYERS`` lists them bottom to top and
  ``MAY_IMPORT`` says which layers below it each one may import (the engine and the
  workloads are both above the base layers, and neither imports the other), and
* a cycle between files (a strongly connected component of the file graph with more than one
  file), in any layer.

There is no exceptions list: a file belongs to the layer of the longest prefix that matches
its path.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

#: the top-level packages whose modules are checked
PACKAGES = ("fedsim", "protocols", "strategies", "experiments", "examples")

#: layer name -> path prefixes (relative to the repository root), bottom layer first
LAYERS: dict[str, tuple[str, ...]] = {
    # numpy + cryptography only; a sampler or generator is passed in
    "protocols": ("protocols/",),
    # what strategies, workloads and the engine share for worker-side folding (flwr + numpy)
    "aggregation contract": ("fedsim/record_codec.py", "fedsim/worker_reduce.py"),
    # errors and checks of configuration, and the owners of randomness
    "foundation": (
        "fedsim/__init__.py",
        "fedsim/config.py",
        "fedsim/extras.py",
        "fedsim/randomness.py",
    ),
    # pure privacy math and dp_accounting
    "privacy": ("fedsim/privacy/",),
    # datasets, models and the files of a run directory
    "data and storage": (
        "fedsim/data/",
        "fedsim/models.py",
        "fedsim/runfiles.py",
        "fedsim/checkpoint.py",
        "fedsim/results_json.py",
    ),
    # Flower's Grid on Ray actors
    "engine": ("fedsim/engine/",),
    # client-side training and the server-side helpers strategies build on
    "workloads": ("fedsim/workloads/",),
    # Flower Message-API strategies
    "strategies": ("strategies/",),
    # privacy audits of finished runs (membership inference, canaries, dataset inference,
    # unlearning): they take the rebuilt run (FinishedRun) as an argument; the front end
    # rebuilds it (fedsim.frontend.experiment.load_finished_run) and runs the configured audit, and
    # ``fedsim audit`` (commands) does both, so every arrow points down
    "audits": ("fedsim/audits/",),
    # the run front end: run configs, the experiment runner, run directories, results
    "front end": ("fedsim/frontend/",),
    # the command-line entry point, its subcommands and the studies under experiments/
    "commands": (
        "fedsim/__main__.py",
        "fedsim/cli.py",
        "fedsim/commands/",
        "experiments/",
        "examples/",
    ),
}

_BASE = ("protocols", "aggregation contract", "foundation", "privacy", "data and storage")

#: layer -> the layers below it that its files may import (a file may import its own layer)
MAY_IMPORT: dict[str, tuple[str, ...]] = {
    "protocols": (),  # nothing of ours
    "aggregation contract": (),  # nothing of ours: flwr and numpy
    "foundation": (),
    "privacy": ("foundation",),
    "data and storage": ("foundation",),
    "engine": _BASE,  # never strategies, workloads, the front end or commands
    "workloads": _BASE,  # never the engine
    "strategies": (*_BASE, "engine", "workloads"),
    "audits": _BASE,  # nothing of the engine, workloads, strategies or front end
    "front end": (*_BASE, "engine", "workloads", "strategies", "audits"),
    "commands": (*_BASE, "engine", "workloads", "strategies", "audits", "front end"),
}


def layer_of(path: str) -> str:
    """The layer whose longest prefix matches ``path`` (ValueError if none does)."""
    matches = [
        (len(prefix), name)
        for name, prefixes in LAYERS.items()
        for prefix in prefixes
        if path.startswith(prefix)
    ]
    if not matches:
        raise ValueError(f"{path} is in no layer of LAYERS")
    return max(matches)[1]


def module_files() -> list[str]:
    """Every module of ``PACKAGES``, as a path relative to the repository root."""
    return sorted(
        str(p.relative_to(ROOT)) for name in PACKAGES for p in (ROOT / name).rglob("*.py")
    )


def file_of(module: str) -> str | None:
    """The file of dotted ``module`` in this repository, or None (not ours, or no such file)."""
    parts = module.split(".")
    if parts[0] not in PACKAGES:
        return None
    base = ROOT.joinpath(*parts)
    for candidate in (base.with_suffix(".py"), base / "__init__.py"):
        if candidate.is_file():
            return str(candidate.relative_to(ROOT))
    return None


def _package_of(path: str) -> list[str]:
    parts = list(Path(path).with_suffix("").parts)
    return parts[:-1]  # a package's __init__ and a module both resolve relative to their folder


def imported_names(tree: ast.AST, path: str) -> list[tuple[str, int]]:
    """``(dotted name, line)`` of every import in ``tree``, the imported attribute included
    (``from a import b`` gives ``a.b``; :func:`imported_file` falls back to ``a``)."""
    names: list[tuple[str, int]] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names += [(alias.name, node.lineno) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                package = _package_of(path)
                package = package[: len(package) - (node.level - 1)]
                base = ".".join([*package, base] if base else package)
            names += [(f"{base}.{alias.name}", node.lineno) for alias in node.names]
        elif (
            isinstance(node, ast.Call)
            and isinstance(node.func, (ast.Attribute, ast.Name))
            and (node.func.attr if isinstance(node.func, ast.Attribute) else node.func.id)
            == "import_module"
            and node.args
            and isinstance(node.args[0], ast.Constant)
            and isinstance(node.args[0].value, str)
        ):
            names.append((node.args[0].value, node.lineno))
    return names


def imported_file(name: str) -> str | None:
    """The file an import of dotted ``name`` loads: the longest prefix that is a file of ours."""
    parts = name.split(".")
    for end in range(len(parts), 0, -1):
        found = file_of(".".join(parts[:end]))
        if found is not None:
            return found
    return None


def import_graph() -> dict[str, dict[str, int]]:
    """file -> {imported file: first line importing it}, for every module file."""
    graph: dict[str, dict[str, int]] = {}
    for path in module_files():
        tree = ast.parse((ROOT / path).read_text(encoding="utf-8"), filename=path)
        arrows: dict[str, int] = {}
        for name, line in imported_names(tree, path):
            target = imported_file(name)
            if target is not None and target != path:
                arrows[target] = min(line, arrows.get(target, line))
        graph[path] = arrows
    return graph


def upward_arrows(graph: dict[str, dict[str, int]]) -> list[str]:
    """``file -> file (layer -> layer), line N`` for every arrow to a layer that
    :data:`MAY_IMPORT` does not allow its source's layer."""
    found = []
    for source, arrows in graph.items():
        low = layer_of(source)
        for target, line in sorted(arrows.items()):
            high = layer_of(target)
            if high != low and high not in MAY_IMPORT[low]:
                found.append(f"{source} -> {target} ({low} -> {high}), line {line}")
    return found


def file_cycles(graph: dict[str, dict[str, int]]) -> list[list[str]]:
    """The strongly connected components with more than one file (Tarjan 1972), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components: list[list[str]] = []
    counter = 0
    for root in graph:
        if root in index:
            continue
        # iterative depth-first search: (node, iterator over its successors)
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = counter
        counter += 1
        stack.append(root)
        on_stack.add(root)
        while work:
            node, successors = work[-1]
            advanced = False
            for nxt in successors:
                if nxt not in index:
                    index[nxt] = low[nxt] = counter
                    counter += 1
                    stack.append(nxt)
                    on_stack.add(nxt)
                    work.append((nxt, iter(sorted(graph.get(nxt, {})))))
                    advanced = True
                    break
                if nxt in on_stack:
                    low[node] = min(low[node], index[nxt])
            if advanced:
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    components.append(sorted(component))
    return sorted(components)


def test_every_module_file_has_a_layer():
    unplaced = []
    for path in module_files():
        try:
            layer_of(path)
        except ValueError as err:
            unplaced.append(str(err))
    assert not unplaced, "\n".join(unplaced)


def test_layers_only_import_layers_below_them():
    """MAY_IMPORT names known layers, each only below the importing one (no cycle of layers)."""
    order = list(LAYERS)
    assert set(MAY_IMPORT) == set(LAYERS)
    for layer, allowed in MAY_IMPORT.items():
        for lower in allowed:
            assert order.index(lower) < order.index(layer), f"{layer} may import {lower}"


def test_no_import_goes_against_the_layers():
    arrows = upward_arrows(import_graph())
    assert not arrows, (
        f"{len(arrows)} imports go against the layers (MAY_IMPORT):\n"
        + "\n".join(arrows)
    )


def test_no_import_cycle_between_files():
    cycles = file_cycles(import_graph())
    assert not cycles, f"{len(cycles)} import cycles between files:\n" + "\n".join(
        " <-> ".join(cycle) for cycle in cycles
    )


def test_the_checks_see_function_level_imports_arrows_and_cycles():
    """The graph reads an import inside a function and an import_module literal, and the two
    checks flag a made-up upward arrow and a made-up two-file cycle."""
    source = (
        "def f():\n"
        "    from strategies.plumbing import wrapper\n"
        "    import importlib\n"
        "    importlib.import_module('fedsim.engine.grid')\n"
    )
    names = [n for n, _ in imported_names(ast.parse(source), "fedsim/engine/x.py")]
    assert [imported_file(n) for n in names if imported_file(n)] == [
        "strategies/plumbing/wrapper.py",
        "fedsim/engine/grid.py",
    ]
    graph = {
        "fedsim/engine/grid.py": {"strategies/plumbing/wrapper.py": 3},
        "strategies/plumbing/wrapper.py": {"fedsim/engine/grid.py": 5},
    }
    assert upward_arrows(graph) == [
        "fedsim/engine/grid.py -> strategies/plumbing/wrapper.py (engine -> strategies), line 3"
    ]
    assert file_cycles(graph) == [["fedsim/engine/grid.py", "strategies/plumbing/wrapper.py"]]


# --------------------------------------------------------------------------- methods
# strategies/ holds the methods (strategies/methods/: one module or package per method) and what
# they share (strategies/plumbing/, the secure-summation layer strategies/secure/, the registry
# and the spec type): a method may import plumbing and its own parts, never another method.

METHODS_DIR = "strategies/methods/"
#: what the methods share, by path prefix
PLUMBING: tuple[str, ...] = (
    "strategies/__init__.py",
    "strategies/registry.py",
    "strategies/spec.py",
    "strategies/plumbing/",
    "strategies/secure/",
)


def method_of(path: str) -> str | None:
    """The method whose module or package holds ``path`` (None: plumbing or not a method)."""
    if not path.startswith(METHODS_DIR) or path == METHODS_DIR + "__init__.py":
        return None
    return path[len(METHODS_DIR) :].split("/")[0].removesuffix(".py")


def methods_importing_methods(graph: dict[str, dict[str, int]]) -> list[str]:
    """``file -> file (method -> method), line N`` for every arrow from one method's file to
    another method's, and from plumbing to any method (the registry lists them all)."""
    found = []
    for source, arrows in sorted(graph.items()):
        mine = method_of(source)
        if not source.startswith("strategies/") or source == "strategies/registry.py":
            continue
        for target, line in sorted(arrows.items()):
            theirs = method_of(target)
            if theirs is not None and theirs != mine:
                who = f"{mine or 'plumbing'} -> {theirs}"
                found.append(f"{source} -> {target} ({who}), line {line}")
    return found


def test_every_strategies_module_is_a_method_or_plumbing():
    files = [p for p in module_files() if p.startswith("strategies/")]
    unplaced = [
        p for p in files if method_of(p) is None and not p.startswith((*PLUMBING, METHODS_DIR))
    ]
    assert not unplaced, f"neither a method under {METHODS_DIR} nor plumbing: {unplaced}"


def test_every_registered_method_module_is_a_method():
    """Each spec's builder lives in a method's file, or in the plumbing that hosts Flower's own
    strategies and the personalised baselines."""
    import inspect  # noqa: PLC0415

    from strategies.registry import SPECS  # noqa: PLC0415

    hosts = ("strategies/plumbing/flower.py", "strategies/plumbing/personalised_config.py")
    for spec in SPECS:
        build = inspect.unwrap(spec.build)
        module = getattr(build, "__module__", None) or type(build).__module__
        path = file_of(module)
        assert path is not None, f"{spec.name}: its builder's module {module} is not ours"
        assert method_of(path) is not None or path in hosts, (
            f"{spec.name} is built in {path}, which is no method's module"
        )


def test_no_method_imports_another_method():
    arrows = methods_importing_methods(import_graph())
    assert not arrows, (
        f"{len(arrows)} imports from one method's module to another's (move what they share "
        "into a plumbing module):\n" + "\n".join(arrows)
    )


def test_the_method_check_flags_a_method_importing_a_method():
    graph = {
        "strategies/methods/dmm/strategy.py": {
            "strategies/methods/dmm/fold.py": 3,
            "strategies/plumbing/vectors.py": 4,
        },
        "strategies/methods/dmm/fold.py": {"strategies/methods/ddgauss/client.py": 7},
        "strategies/plumbing/secure_aggregation.py": {"strategies/methods/ddgauss/strategy.py": 9},
        "strategies/registry.py": {"strategies/methods/dmm/__init__.py": 1},
    }
    assert methods_importing_methods(graph) == [
        "strategies/methods/dmm/fold.py -> strategies/methods/ddgauss/client.py "
        "(dmm -> ddgauss), line 7",
        "strategies/plumbing/secure_aggregation.py -> strategies/methods/ddgauss/strategy.py "
        "(plumbing -> ddgauss), line 9",
    ]


# --------------------------------------------------------------------------- sizes

#: the packages whose modules and functions stay small enough to read whole
SIZED = ("fedsim", "protocols", "strategies")
MAX_MODULE_LINES = 600
MAX_FUNCTION_LINES = 60


def oversized(root: Path = ROOT) -> list[str]:
    """Every module over :data:`MAX_MODULE_LINES` lines and every function (or method) over
    :data:`MAX_FUNCTION_LINES`, as ``path: what (lines)``."""
    found = []
    for package in SIZED:
        for path in sorted((root / package).rglob("*.py")):
            text = path.read_text()
            name = path.relative_to(root).as_posix()
            if len(text.splitlines()) > MAX_MODULE_LINES:
                found.append(f"{name}: module ({len(text.splitlines())})")
            for node in ast.walk(ast.parse(text)):
                if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                    lines = node.end_lineno - node.lineno + 1
                    if lines > MAX_FUNCTION_LINES:
                        found.append(f"{name}: {node.name} ({lines})")
    return found


def test_no_module_over_600_lines_and_no_function_over_60():
    assert oversized() == []


def test_the_size_check_flags_a_long_function_and_a_long_module(tmp_path):
    body = "".join(f"    x{i} = {i}\n" for i in range(MAX_FUNCTION_LINES))
    (tmp_path / "fedsim").mkdir()
    (tmp_path / "fedsim" / "long.py").write_text("def f():\n" + body + "\n" * 600)
    for package in SIZED[1:]:
        (tmp_path / package).mkdir()
    assert oversized(tmp_path) == [
        "fedsim/long.py: module (661)",
        f"fedsim/long.py: f ({MAX_FUNCTION_LINES + 1})",
    ]
