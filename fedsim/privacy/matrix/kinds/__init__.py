"""The factorization kinds, one module each (:class:`fedsim.privacy.matrix.kind.Kind`):
``fedsim factorize --kind`` and ``strategy.options.kind`` name them, and a saved file's
kind picks its noise stream and its check.

A new kind is one module declaring its :class:`~fedsim.privacy.matrix.kind.Kind` and one
line in :data:`REGISTERED`; its Kind's flags (``banded``, ``zero_one_encoder``) are what makes
it known to DMM (:func:`named_with`, :func:`fedsim.privacy.dmm.kinds`). Modules load on
first use, so naming the kinds (``fedsim factorize --help``) imports no scipy.
"""

from __future__ import annotations

import functools
import importlib

from fedsim.privacy.matrix.kind import Kind

#: name -> ``module:attribute`` of its Kind (under this package), in the order --kind lists
REGISTERED: dict[str, str] = {
    "tree": "tree:TREE",
    "honaker": "tree:HONAKER",
    "tree_restart": "tree_restart:TREE_RESTART",
    "sqrt": "toeplitz:SQRT",
    "toeplitz": "toeplitz:TOEPLITZ",
    "banded": "banded:BANDED",
    "dense": "dense:DENSE",
    "blt": "blt:BLT",
}
NAMES: tuple[str, ...] = tuple(REGISTERED)


@functools.cache
def kind(name: str) -> Kind:
    """The registered kind ``name`` (KeyError: none; :class:`~fedsim.privacy.matrix.build.Spec`
    checks names first)."""
    module, attribute = REGISTERED[name].split(":")
    found = getattr(importlib.import_module(f"{__name__}.{module}"), attribute)
    if not isinstance(found, Kind) or found.name != name:
        raise TypeError(f"{REGISTERED[name]} is not the Kind named {name!r}")
    return found


def named_with(flag: str) -> tuple[str, ...]:
    """The registered kinds (in :data:`REGISTERED`'s order) whose Kind sets the boolean
    ``flag`` (``"banded"``, ``"zero_one_encoder"``, ``"closed_form"``)."""
    if not isinstance(getattr(Kind, flag, None), bool):
        raise ValueError(f"flag={flag!r}; allowed: a boolean field of Kind")
    return tuple(name for name in NAMES if getattr(kind(name), flag))


def saved_kind(saved: str) -> Kind | None:
    """The kind whose factorizations are saved as ``saved`` (None: no registered kind)."""
    for name in NAMES:
        if kind(name).saved_as == saved:
            return kind(name)
    return None
