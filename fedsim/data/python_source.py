"""The user's own data: ``[data] source = "python"`` calls ``loader = "package.module:function"``.

The loader is called with ``[data.options]`` as keyword arguments and returns one of

1. ``(x, y)``: all rows pooled; ``[data] partition`` (iid, dirichlet, shards, quantity,
   split-classes) splits them among ``num_clients`` clients;
2. ``{client: (x, y), ...}``: one entry per client, in the mapping's order; ``partition =
   "natural"`` keeps these clients (the first ``num_clients``), another partition pools
   the rows and re-splits them;
3. ``({client: (x, y)}, {client: (x_test, y_test)})``: each client's training rows and its
   own test rows (natural partition only; a client missing from the second mapping has no
   test rows, and ``test_fraction`` is not used).

Arrays: ``x`` numeric, shape (n, *feature_shape) (stored as float32); ``y`` integer class
labels >= 0, shape (n,) (int64); the same feature shape for every client. Each failure is a
:class:`~fedsim.config.ConfigError` naming ``data.loader``, the loader and what was wrong
(the client, the array, its shape or dtype).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from fedsim.config import ConfigError, import_reference, require
from fedsim.data.sources import ClientData, label_problem, non_finite_problem

_CONTRACT = (
    "a loader returning (x, y), {client: (x, y)}, or ({client: (x, y)}, {client: (x, y)}) "
    "for separate test rows"
)


@dataclass(frozen=True)
class LoadedData:
    """What a loader returned, checked: pooled rows, or per-client rows (and test rows).

    ``pooled`` is ``(x, y)`` for form 1 (``train`` and ``test`` are then None); ``train``
    holds one ``(x_k, y_k)`` per client for forms 2 and 3 (in the loader's order), ``test``
    the same clients' test rows for form 3 (empty arrays for a client without test rows).
    """

    pooled: tuple[np.ndarray, np.ndarray] | None
    train: ClientData | None
    test: ClientData | None


def _arrays(pair: Any, where: str, loader: str, empty_ok: bool) -> tuple[np.ndarray, np.ndarray]:
    """``pair`` as checked (x float32, y int64) arrays; ``where`` names them in errors."""

    def fail(what: str) -> ConfigError:
        return ConfigError("data.loader", loader, f"{_CONTRACT}; {where}: {what}")

    if not (isinstance(pair, (tuple, list)) and len(pair) == 2):
        raise fail(f"expected a pair (x, y), got a {type(pair).__name__}")
    try:
        x, y = np.asarray(pair[0]), np.asarray(pair[1])
    except (TypeError, ValueError) as err:
        raise fail(f"x and y must be arrays ({err})") from err
    if x.dtype.kind not in "biuf":
        raise fail(f"x must be numeric, it has dtype {x.dtype}")
    if x.ndim < 2:
        raise fail(f"x must have shape (n, *feature_shape), it has shape {x.shape}")
    if y.ndim != 1:
        raise fail(f"y must have shape (n,), it has shape {y.shape}")
    if len(y) and y.dtype.kind not in "iu":
        raise fail(f"y must hold integer class labels, it has dtype {y.dtype}")
    if len(x) != len(y):
        raise fail(f"x has {len(x)} rows and y {len(y)} labels (they must match)")
    if not empty_ok and len(y) == 0:
        raise fail("no rows (every client needs at least one training row)")
    problem = label_problem(y) if len(y) else None
    if problem is not None:
        raise fail(problem)
    problem = non_finite_problem(x) if len(x) else None
    if problem is not None:
        raise fail(f"x holds {problem}")
    return x.astype(np.float32, copy=False), y.astype(np.int64, copy=False)


def _clients(
    mapping: Mapping[Any, Any], loader: str, what: str, empty_ok: bool
) -> tuple[tuple[str, ...], ClientData]:
    require(len(mapping) > 0, "data.loader", loader, f"{_CONTRACT}; {what} has no clients")
    ids, parts = [], []
    for client, pair in mapping.items():
        ids.append(str(client))
        parts.append(_arrays(pair, f"{what} client {client!r}", loader, empty_ok))
    return tuple(ids), parts


def _same_features(parts: ClientData, clients: tuple[str, ...], loader: str) -> None:
    shape = parts[0][0].shape[1:]
    for client, (x, _) in zip(clients, parts, strict=True):
        require(
            x.shape[1:] == shape,
            "data.loader",
            loader,
            f"{_CONTRACT}; client {client!r} has features of shape {x.shape[1:]}, the first "
            f"client {shape} (every client needs the same feature shape)",
        )


def check_loaded(value: Any, loader: str) -> LoadedData:
    """Check what the loader returned against the contract (module docstring)."""
    if isinstance(value, Mapping):
        clients, train = _clients(value, loader, "the mapping", empty_ok=False)
        _same_features(train, clients, loader)
        return LoadedData(None, train, None)
    if isinstance(value, (tuple, list)) and len(value) == 2:
        first, second = value
        if isinstance(first, Mapping) and isinstance(second, Mapping):
            clients, train = _clients(first, loader, "the training mapping", empty_ok=False)
            unknown = sorted(str(k) for k in second if str(k) not in clients)
            require(
                not unknown,
                "data.loader",
                loader,
                f"{_CONTRACT}; the test mapping has clients the training mapping lacks: "
                f"{unknown[:5]}",
            )
            tests = {str(k): v for k, v in second.items()}
            shape = train[0][0].shape[1:]
            empty = (np.zeros((0, *shape), np.float32), np.zeros(0, np.int64))
            test = [
                _arrays(tests[c], f"test client {c!r}", loader, empty_ok=True)
                if c in tests
                else empty
                for c in clients
            ]
            _same_features(train + test, clients + clients, loader)
            return LoadedData(None, train, test)
        pooled = _arrays(value, "the pooled rows", loader, empty_ok=False)
        return LoadedData(pooled, None, None)
    raise ConfigError("data.loader", loader, f"{_CONTRACT}; it returned a {type(value).__name__}")


def load_python(
    loader: str, options: Mapping[str, Any], search: tuple[str, ...] = ()
) -> LoadedData:
    """Import ``loader`` (with ``search`` first on ``sys.path``), call it with ``options`` and
    check what it returns."""
    function = import_reference(loader, "data.loader", search)
    try:
        value = function(**dict(options))
    except TypeError as err:
        raise ConfigError(
            "data.loader",
            loader,
            f"a function accepting the keyword arguments {sorted(options)} of [data.options] "
            f"({err})",
        ) from err
    return check_loaded(value, loader)
