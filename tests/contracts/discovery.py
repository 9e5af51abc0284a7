"""Every implementation of an interface, found in the source tree: a new one is held to its
contract suite as soon as it exists, with no list to update here.

The packages' sources are parsed (no import) for classes deriving, directly or through other
such classes, from the interface by name; their modules are imported and the concrete
subclasses (:func:`inspect.isabstract` false) defined in our packages are returned by
qualified name."""

from __future__ import annotations

import ast
import importlib
import inspect
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("fedsim", "protocols", "strategies")


def _base_names(node: ast.ClassDef) -> set[str]:
    names = set()
    for base in node.bases:
        if isinstance(base, ast.Name):
            names.add(base.id)
        elif isinstance(base, ast.Attribute):
            names.add(base.attr)
    return names


def _modules_deriving(interface: str) -> set[str]:
    """Modules that define a class deriving from ``interface`` (by name, transitively)."""
    classes: list[tuple[str, str, set[str]]] = []
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            tree = ast.parse(path.read_text(), filename=str(path))
            module = ".".join(path.relative_to(ROOT).with_suffix("").parts)
            module = module.removesuffix(".__init__")
            for node in ast.walk(tree):
                if isinstance(node, ast.ClassDef):
                    classes.append((module, node.name, _base_names(node)))
    derived, modules = {interface}, set()
    while True:
        found = {(m, name) for m, name, bases in classes if bases & derived}
        names = {name for _, name in found} | {interface}
        modules |= {m for m, _ in found}
        if names == derived:
            return modules
        derived = names


def implementations(interface: type) -> dict[str, type]:
    """``"module:QualName" -> class`` of every concrete subclass of ``interface`` in
    :data:`PACKAGES` (sorted by name)."""
    for module in sorted(_modules_deriving(interface.__name__)):
        importlib.import_module(module)
    found, stack = {}, list(interface.__subclasses__())
    while stack:
        cls = stack.pop()
        stack.extend(cls.__subclasses__())
        if cls.__module__.split(".")[0] in PACKAGES and not inspect.isabstract(cls):
            found[f"{cls.__module__}:{cls.__qualname__}"] = cls
    return dict(sorted(found.items()))
