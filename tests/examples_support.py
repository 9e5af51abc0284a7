"""Loading the scripts under examples/ (folders of scripts, not packages) in a test."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"


def load_example(relative: str) -> ModuleType:
    """The example script ``examples/<relative>`` as a module (registered in sys.modules,
    as an import would, so that its dataclasses resolve their annotations)."""
    path = EXAMPLES / relative
    name = "examples_" + path.parent.name
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module
