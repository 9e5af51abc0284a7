"""Kinds ``tree`` and ``honaker``: the binary tree and Honaker's online tree
(:mod:`fedsim.privacy.matrix.tree`), closed forms streamed by
:class:`~fedsim.privacy.matrix.streaming.TreeStream`."""

from __future__ import annotations

from typing import Any

from fedsim.privacy.matrix.factorization import Factorization
from fedsim.privacy.matrix.kind import Kind
from fedsim.privacy.matrix.streaming import RoundNoise, TreeStream
from fedsim.privacy.matrix.tree import binary_tree, honaker_tree
from fedsim.privacy.matrix.verify import tree_mismatch


def tree_stream(f: Factorization, noise: RoundNoise, shape: Any) -> TreeStream:
    """The node noise of a (binary or Honaker) tree with its ``alphas``."""
    return TreeStream(f.n, f.params["alphas"], noise, shape)


TREE = Kind(
    name="tree",
    build=lambda spec, progress: binary_tree(spec.rounds),
    stream=tree_stream,
    mismatch=tree_mismatch,
    closed_form=True,
    zero_one_encoder=True,
)
HONAKER = Kind(
    name="honaker",
    build=lambda spec, progress: honaker_tree(spec.rounds),
    stream=tree_stream,
    mismatch=tree_mismatch,
    closed_form=True,
    zero_one_encoder=True,
)
