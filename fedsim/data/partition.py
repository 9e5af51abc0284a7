"""Partitioners: split a centralised labelled dataset among simulated clients.

Every partitioner has the signature
``(labels, num_clients, rng, **params) -> list[np.ndarray]`` and returns one
sorted ``int64`` index array per client. Unless stated otherwise the arrays are
disjoint, cover every sample and no client is empty; when that is impossible a
:class:`~fedsim.config.ConfigError` names the parameter at fault.

Each partitioner first computes ``owner`` (the client of every sample) with a
constant number of vectorised numpy passes, O(n_samples + n_clients) memory,
and then cuts one stable sort of ``owner`` into per-client arrays.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from fedsim.config import require
from fedsim.data._summary import owner_stats

Partitioner = Callable[..., list[np.ndarray]]


def _check(labels: np.ndarray, num_clients: int) -> np.ndarray:
    """Validate labels (1-D, integer, >= 0) and ``1 <= num_clients <= n``."""
    labels = np.asarray(labels)
    require(
        labels.ndim == 1 and labels.size > 0,
        "labels",
        labels.shape,
        "a non-empty 1-D array of class labels",
    )
    require(
        np.issubdtype(labels.dtype, np.integer), "labels", str(labels.dtype), "an integer array"
    )
    require(int(labels.min()) >= 0, "labels", int(labels.min()), "non-negative class labels")
    ok = isinstance(num_clients, (int, np.integer)) and not isinstance(num_clients, bool)
    require(ok and num_clients >= 1, "num_clients", num_clients, "an integer >= 1")
    require(
        num_clients <= labels.size,
        "num_clients",
        num_clients,
        f"at most the number of samples ({labels.size}) so that no client is empty",
    )
    return labels.astype(np.int64, copy=False)


def _split_by_owner(owner: np.ndarray, num_clients: int) -> list[np.ndarray]:
    """Per-client sorted index arrays from ``owner`` (-1 = unassigned)."""
    order = np.argsort(owner, kind="stable")
    counts = np.bincount(owner[owner >= 0], minlength=num_clients)
    skip = int(np.count_nonzero(owner < 0))
    return np.split(order[skip:], np.cumsum(counts)[:-1])


def _class_sorted(labels: np.ndarray, rng: np.random.Generator) -> np.ndarray:
    """Sample indices sorted by label, in random order within each label."""
    return np.argsort(labels + rng.random(labels.size), kind="stable")


def _within_rank(owner: np.ndarray, num_clients: int) -> np.ndarray:
    """Position of each sample within its client's block (0-based, by index)."""
    order = np.argsort(owner, kind="stable")
    counts = np.bincount(owner, minlength=num_clients)
    starts = np.concatenate([[0], np.cumsum(counts)[:-1]])
    rank = np.empty(owner.size, dtype=np.int64)
    rank[order] = np.arange(owner.size) - np.repeat(starts, counts)
    return rank


def iid_partition(
    labels: np.ndarray, num_clients: int, rng: np.random.Generator
) -> list[np.ndarray]:
    """Uniformly random partition into near-equal sizes (``n // K`` or ``n // K + 1``)."""
    labels = _check(labels, num_clients)
    n = labels.size
    sizes = np.full(num_clients, n // num_clients, dtype=np.int64)
    sizes[: n % num_clients] += 1
    owner = np.empty(n, dtype=np.int64)
    owner[rng.permutation(n)] = np.repeat(np.arange(num_clients), sizes)
    return _split_by_owner(owner, num_clients)


def dirichlet_partition(
    labels: np.ndarray, num_clients: int, rng: np.random.Generator, alpha: float, min_size: int = 1
) -> list[np.ndarray]:
    """Label-skewed partition with per-class proportions ~ Dir(alpha).

    For every class c, the proportions ``p_c ~ Dir(alpha * 1_K)`` over the K
    clients are drawn and its n_c samples are dealt out with counts
    ``Multinomial(n_c, p_c)`` (the scheme popularised by Hsu et al., 2019,
    "Measuring the effects of non-identical data distribution", and Yurochkin
    et al., 2019). Small ``alpha`` gives each client few classes; large
    ``alpha`` approaches IID.

    Instead of redrawing until every client holds ``min_size`` samples (which
    almost never succeeds for small alpha and many clients), a vectorised
    repair moves the missing ``sum_k max(0, min_size - n_k)`` samples, chosen
    uniformly among the samples that donors can spare, to the short clients.
    Possible whenever ``n >= K * min_size``. Memory O(num_classes * K).
    """
    labels = _check(labels, num_clients)
    require(
        isinstance(alpha, (int, float)) and alpha > 0 and np.isfinite(alpha),
        "alpha",
        alpha,
        "a finite number > 0",
    )
    require(
        isinstance(min_size, (int, np.integer)) and min_size >= 1,
        "min_size",
        min_size,
        "an integer >= 1",
    )
    n = labels.size
    require(
        n >= num_clients * min_size,
        "min_size",
        min_size,
        f"at most n / num_clients = {n // num_clients} samples per client",
    )
    class_counts = np.bincount(labels)
    num_classes = class_counts.size
    props = rng.dirichlet(np.full(num_clients, float(alpha)), size=num_classes)
    props /= props.sum(axis=1, keepdims=True)
    counts = rng.multinomial(class_counts, props)  # (C, K), row c sums to n_c
    owner = np.empty(n, dtype=np.int64)
    owner[_class_sorted(labels, rng)] = np.repeat(
        np.tile(np.arange(num_clients), num_classes), counts.ravel()
    )
    sizes = counts.sum(axis=0)
    deficit = np.maximum(min_size - sizes, 0)
    need = int(deficit.sum())
    if need:
        # a sample can move if its client keeps min_size samples without it
        spare = np.flatnonzero(_within_rank(owner, num_clients) >= min_size)
        moved = rng.choice(spare, size=need, replace=False)
        owner[moved] = np.repeat(np.arange(num_clients), deficit)
    return _split_by_owner(owner, num_clients)


def shard_partition(
    labels: np.ndarray,
    num_clients: int,
    rng: np.random.Generator,
    classes_per_client: int,
    sigma: float = 0.0,
) -> list[np.ndarray]:
    """Pathological non-IID split with ``k = classes_per_client`` classes per client.

    Label-pure variant of the shards of McMahan et al. (2017, "Communication-
    efficient learning of deep networks from decentralized data"): the data is
    sorted by label, each client is given k distinct labels, and each label's
    block is cut into as many equal shards as clients holding it. Labels are
    dealt in blocks of C clients (C = number of classes present), each block
    with its own random cyclic order of the labels, so within a block every
    label is held by exactly k clients and label pairs vary across blocks.

    Each client sees exactly k classes whenever every label has at least as
    many samples as clients holding it (otherwise some see fewer). When
    ``K * k < C`` only ``K * k`` labels are used and the samples of the other
    labels are left out (not covering). Raises if a client would be empty.

    ``sigma > 0`` adds quantity skew: client weights ``w_k ~ LogNormal(0, sigma)``
    are drawn and each label's block is cut among its holders in proportion to
    their weights instead of equally (one sample per holder first when the label
    has enough, then largest-remainder rounding), so client sizes spread like
    in :func:`quantity_skew_partition` while each client keeps its k labels.
    ``sigma = 0`` (the default) is the equal-shard split above, draw for draw.
    """
    labels = _check(labels, num_clients)
    ok = isinstance(classes_per_client, (int, np.integer)) and classes_per_client >= 1
    require(ok, "classes_per_client", classes_per_client, "an integer >= 1")
    _check_sigma(sigma)
    class_counts = np.bincount(labels)
    present = np.flatnonzero(class_counts)
    num_present = present.size
    k = int(classes_per_client)
    require(
        k <= num_present,
        "classes_per_client",
        k,
        f"at most the number of classes present ({num_present})",
    )
    slot_class, slot_client = _cyclic_slots(present, num_clients, k, rng)
    holders = np.bincount(slot_class, minlength=class_counts.size)  # slots per class
    first = np.concatenate([[0], np.cumsum(holders)[:-1]])
    q = np.arange(slot_class.size) - first[slot_class]  # rank of the slot within its class
    n_c, m_c = class_counts[slot_class], holders[slot_class]
    if sigma > 0:
        shard = _weighted_shards(slot_class, slot_client, n_c, m_c, first, num_clients, rng, sigma)
    else:
        shard = n_c // m_c + (q < n_c % m_c)
    owner = np.full(labels.size, -1, dtype=np.int64)
    used = holders[labels] > 0
    order = _class_sorted(labels, rng)
    owner[order[used[order]]] = np.repeat(slot_client, shard)
    _require_no_empty(owner, num_clients, k)
    return _split_by_owner(owner, num_clients)


def _check_sigma(sigma: Any) -> None:
    require(
        isinstance(sigma, (int, float)) and sigma >= 0 and np.isfinite(sigma),
        "sigma",
        sigma,
        "a finite number >= 0",
    )


def _require_no_empty(owner: np.ndarray, num_clients: int, k: int) -> None:
    """Every client owns a row (else a ConfigError naming ``classes_per_client`` = ``k``)."""
    empty = int(np.count_nonzero(np.bincount(owner[owner >= 0], minlength=num_clients) == 0))
    require(
        empty == 0,
        "classes_per_client",
        k,
        f"a value for which every client gets data ({empty} clients would be empty; "
        "use more classes per client or fewer clients)",
    )


def _cyclic_slots(
    present: np.ndarray, num_clients: int, k: int, rng: np.random.Generator
) -> tuple[np.ndarray, np.ndarray]:
    """:func:`shard_partition`'s label slots, ``k`` per client: clients dealt in blocks of
    ``C`` (the classes ``present``), each block with its own random cyclic order of the
    labels; ``(slot class, slot client)`` sorted by class (stable)."""
    num_present = present.size
    num_blocks = -(-num_clients // num_present)
    cyclic = np.argsort(rng.random((num_blocks, num_present)), axis=1)  # per-block label order
    client = np.arange(num_clients)
    pos = (client[:, None] % num_present * k + np.arange(k)[None, :]) % num_present
    slot_class = present[cyclic[client[:, None] // num_present, pos]].ravel()  # (K*k,)
    return _by_class(slot_class, np.repeat(client, k))


def _by_class(slot_class: np.ndarray, slot_client: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The slots sorted by class, in their order within a class."""
    by_class = np.argsort(slot_class, kind="stable")
    return slot_class[by_class], slot_client[by_class]


def _weighted_shards(
    slot_class: np.ndarray,
    slot_client: np.ndarray,
    n_c: np.ndarray,
    m_c: np.ndarray,
    first: np.ndarray,
    num_clients: int,
    rng: np.random.Generator,
    sigma: float,
) -> np.ndarray:
    """Shard sizes per slot (slots sorted by class) proportional to lognormal client weights.

    Each label's ``n_c`` samples go to its ``m_c`` holders: one each when
    ``n_c >= m_c``, the rest in proportion to the holders' weights with
    largest-remainder rounding, so the sizes of a label sum to ``n_c``.
    """
    w = rng.lognormal(0.0, float(sigma), size=num_clients)[slot_client]
    base = (n_c >= m_c).astype(np.int64)
    spread = n_c - base * m_c
    w_class = np.bincount(slot_class, weights=w)[slot_class]
    share = spread * w / w_class
    shard = np.floor(share).astype(np.int64)
    rest = spread - np.bincount(slot_class, weights=shard)[slot_class].astype(np.int64)
    order = np.lexsort((-(share - shard), slot_class))  # by class, largest remainder first
    rank = np.empty(slot_class.size, dtype=np.int64)
    rank[order] = np.arange(slot_class.size) - first[slot_class[order]]
    return base + shard + (rank < rest)


def quantity_skew_partition(
    labels: np.ndarray, num_clients: int, rng: np.random.Generator, sigma: float
) -> list[np.ndarray]:
    """IID labels with client sizes proportional to ``w_k ~ LogNormal(0, sigma)``.

    Every client gets one sample, the other ``n - K`` are shared in proportion
    to ``w`` (largest-remainder rounding), then samples are dealt at random.
    ``sigma = 0`` gives equal sizes; the spread of sizes grows with sigma.
    """
    labels = _check(labels, num_clients)
    _check_sigma(sigma)
    n = labels.size
    w = rng.lognormal(0.0, float(sigma), size=num_clients)
    share = (n - num_clients) * w / w.sum()
    sizes = np.floor(share).astype(np.int64)
    rest = n - num_clients - int(sizes.sum())
    if rest > 0:
        sizes[np.argpartition(-(share - sizes), rest - 1)[:rest]] += 1
    sizes += 1
    owner = np.empty(n, dtype=np.int64)
    owner[rng.permutation(n)] = np.repeat(np.arange(num_clients), sizes)
    return _split_by_owner(owner, num_clients)


def split_classes_partition(
    labels: np.ndarray, num_clients: int, rng: np.random.Generator, classes_per_client: int
) -> list[np.ndarray]:
    """Groups of ``g = C / k`` clients, each group splitting the ``C`` classes among its members.

    The label skew of the pFedVEM / pFedHB reference code (``get_split_datasets`` and
    ``RandomDataSplit`` there): clients ``g j .. g j + g - 1`` form group ``j``, which shuffles
    the classes and gives each member ``k = classes_per_client`` of them, so the members'
    class sets are disjoint and together cover every class (``k = C / 2``: pairs of clients
    splitting the classes, 5 of 10 each in the reference). Every class's rows are then cut at
    ``m_c - 1`` distinct uniformly random points into one chunk per client holding it (``m_c``
    holders), so chunk sizes are unequal (a uniform random composition of ``n_c``): quantity
    skew on top of the label skew, as the reference's random clipper.

    ``k`` must divide the number of classes present. When ``num_clients`` is not a multiple
    of ``g`` the last group is incomplete and the classes no client holds are left out (not
    covering). Raises if a class has fewer rows than holders.
    """
    labels = _check(labels, num_clients)
    ok = isinstance(classes_per_client, (int, np.integer)) and classes_per_client >= 1
    require(ok, "classes_per_client", classes_per_client, "an integer >= 1")
    class_counts = np.bincount(labels)
    present = np.flatnonzero(class_counts)
    k = int(classes_per_client)
    require(
        present.size % k == 0,
        "classes_per_client",
        k,
        f"a divisor of the number of classes present ({present.size}), so that each group "
        "of clients splits the classes exactly",
    )
    g = present.size // k
    client = np.arange(num_clients)
    shuffled = np.argsort(rng.random((-(-num_clients // g), present.size)), axis=1)
    member = (client % g)[:, None] * k + np.arange(k)[None, :]
    slot_class = present[np.take_along_axis(shuffled[client // g], member, axis=1)].ravel()
    slot_class, slot_client = _by_class(slot_class, np.repeat(client, k))
    holders = np.bincount(slot_class, minlength=class_counts.size)
    short = np.flatnonzero((holders > 0) & (class_counts < holders))
    require(
        short.size == 0,
        "classes_per_client",
        k,
        f"a value for which every class has at least one row per holder (class "
        f"{int(short[0]) if short.size else -1} has fewer rows than clients holding it; "
        "use fewer clients)",
    )
    owner = _random_chunk_owners(labels, holders, slot_client, rng)
    return _split_by_owner(owner, num_clients)


def _random_chunk_owners(
    labels: np.ndarray, holders: np.ndarray, slot_client: np.ndarray, rng: np.random.Generator
) -> np.ndarray:
    """Each row's client (-1: a class no client holds) when every class's rows, in a random
    order, are cut at ``m_c - 1`` distinct uniformly random points into one chunk per holder
    (``holders``: the slots per class; ``slot_client``: the slots' clients, by class)."""
    first_slot = np.concatenate([[0], np.cumsum(holders)[:-1]])
    order = _class_sorted(labels, rng)
    label = labels[order]
    used = holders[label] > 0
    order, label = order[used], label[used]
    start = np.concatenate([[0], np.cumsum(np.bincount(label, minlength=holders.size))])
    position = np.arange(label.size) - start[label]  # within the class, 0 .. n_c - 1
    # cut before position p (p >= 1) if its random key is among the class's m_c - 1 smallest
    keys = np.where(position > 0, rng.random(label.size), np.inf)
    by_key = np.lexsort((keys, label))
    rank = np.empty(label.size, dtype=np.int64)
    rank[by_key] = np.arange(label.size) - start[label[by_key]]
    cuts = np.cumsum(rank < holders[label] - 1)  # position 0 of a class is never a cut
    chunk = cuts - cuts[start[label]]
    owner = np.full(labels.size, -1, dtype=np.int64)
    owner[order] = slot_client[first_slot[label] + chunk]
    return owner


def partition_stats(
    parts: Sequence[np.ndarray], labels: np.ndarray, num_classes: int
) -> dict[str, Any]:
    """JSON-ready statistics of a partition (see ``fedsim.data._summary.owner_stats``).

    Adds ``overlap`` (samples in more than one client) and ``unassigned``
    (samples in no client).
    """
    labels = np.asarray(labels, dtype=np.int64)
    sizes = np.array([np.size(p) for p in parts], dtype=np.int64)
    rows = (
        np.concatenate([np.asarray(p, dtype=np.int64).ravel() for p in parts])
        if sizes.sum()
        else np.zeros(0, dtype=np.int64)
    )
    owner = np.repeat(np.arange(len(parts), dtype=np.int64), sizes)
    stats = owner_stats(owner, labels[rows], len(parts), int(num_classes))
    hits = np.bincount(rows, minlength=labels.size)
    stats["overlap"] = int(np.count_nonzero(hits > 1))
    stats["unassigned"] = int(np.count_nonzero(hits == 0))
    return stats


PARTITIONERS: dict[str, Partitioner] = {
    "iid": iid_partition,
    "dirichlet": dirichlet_partition,
    "shards": shard_partition,
    "quantity": quantity_skew_partition,
    "split-classes": split_classes_partition,
}
