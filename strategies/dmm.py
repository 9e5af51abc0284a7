"""The distributed matrix mechanism (DMM) as a Flower strategy.

Bienstock, Kumar & Polychroniadou, ICML 2025, as docs/dmm-design.md sets it out. Each round:

* the sampled clients (:func:`dmm_client_app` around any training ClientApp) clip, rotate, scale
  by 1/gamma and conditionally round their update to integers u_c (KLS21,
  :class:`protocols.encoding.DDGaussEncoder`) and draw one *fresh* noise row N_Z(0, s^2)^D for
  every row of the integer strategy matrix M released this round -- all from the client's own
  secret (``client_secret(node_config).generator(round, Purpose.X)``), never from anything the
  server knows; in ``mode="full"`` they packed-Shamir-share both and seal each share to its
  committee seat (:func:`protocols.dmm.client.seal_client_shares`): the reply carries only
  ciphertexts and the client's public key (with ``worker_fold`` the clients of a fedsim worker
  batch hand their sharing inputs to the worker, which deals their sum once and seals one row
  per seat: :mod:`strategies.dmm_fold`);
* the round's committee -- n clients drawn publicly from the population with
  ``public_generator(seed, round, Stream.COMMITTEE)`` and hosted by the engine's
  :class:`fedsim.engine.dmm_committee.CommitteeHost` (bound with :meth:`DMM.bind_committee_host`)
  -- combines the agreed clients' shares with the partial sums it holds, releases
  y_i = sum_s M[i, s] X_s + z_i and hands the partial sums of the rows still open to the next
  round's committee (:class:`protocols.dmm.server.DMMServer`);
* the server decodes x_hat_t = (D y)_t (D M = I: forward substitution for the banded M), and
  applies ``g + gamma * unrotate(x_hat_t) / expected_clients`` through the wrapped FedAvg: the
  matrix mechanism in its x + C^{-1} z form.

Privacy (:mod:`fedsim.privacy.dmm`): the discrete Gaussian mechanism on the integer query M X,
sensitivity of M's columns under the participation schema times KLS21's rounded-update bound,
the DDGauss bound for sums of the shares, and the count of clients whose noise each released row
actually carries. The ledger gets one ``dp_accounting`` event per round. ``mode="ideal"`` is the
no-cryptography reference (plaintext integers, the same agreement and dropout rules): both modes
release identical integers for the same RunSecret.

Configuration is checked before any client trains: M must be banded or the 0/1 tree
(:class:`fedsim.privacy.dmm.IntegerMechanism`), the worst-case released row must fit the field
(the *bit budget*, :meth:`DMM.check`), and the committee must meet the bound the thresholds
assume (Bienstock et al.): t_corrupt + t_dropout < (1/2 - mu) n with mu = k / n, i.e.
``threshold + member_dropouts + packing < committee_size / 2``.

Every reply is validated at this boundary (sender sampled this round, one reply each, exactly
the protocol's records, well-formed sealed shares / plaintext integers in range); a bad one
drops that client, and the round's metrics name it in ``rejected``.

**Opened is released**: a round whose release shares reached the server from more than t
members (:class:`protocols.dmm.common.OpenedRelease`) is accounted as the release of its step even
when it aborts (too few on time to decode, or tampering beyond the radius): its metrics say
``dmm-aborted = 1``, ``dmm-opened = 1`` and what it cost (``dmm-epsilon-cost``), the report lists
it under ``aborted_releases``, and the mechanism halts, since that state must not be released
again with fresh noise. A round aborted before that point records nothing. Neighbours are
zero-out (``fedsim.privacy.dmm.RELATION``). Clients reply nothing data-dependent outside their
shares: federated evaluation is refused (config, strategy, client app) unless
``metrics_in_clear``, and any per-client metric that reaches the strategy makes epsilon infinite
(a ``NonPrivateDpEvent``; the report's ``unaccounted``). Each client answers a round once
(:mod:`strategies.answered_rounds`).
"""

from __future__ import annotations

import contextlib
import logging
import math
from collections.abc import Iterable, Mapping, Sequence
from typing import Any, Literal

import dp_accounting as dpa
import numpy as np
from flwr.app import ArrayRecord, ConfigRecord, Context, Message, MetricRecord, RecordDict
from flwr.clientapp import ClientApp
from flwr.serverapp import Grid
from flwr.serverapp.strategy import Strategy

from fedsim.config import ConfigError
from fedsim.engine.boundary import ClaimRefused, ReleaseBoundary, boundary_of
from fedsim.engine.client_registry import (
    NUM_PARTITIONS_KEY,
    client_name,
    enrolled,
    public_committee,
)
from fedsim.privacy import dmm as dmm_privacy
from fedsim.privacy.ledger import PrivacyLedger
from fedsim.privacy.matrix.factorization import Factorization
from fedsim.privacy.mechanisms import discrete_gaussian
from fedsim.privacy.participation import Participation
from fedsim.privacy.sampling import NeighbouringRelation
from fedsim.randomness import Purpose, Stream, client_secret, public_generator
from fedsim.record_codec import to_numpy, to_record
from fedsim.worker_reduce import FOLDS_KEY, attach_reducer, is_partial, single
from protocols.channels import Envelope, KeySubstitution, stage_label
from protocols.dmm.client import check_seat_keys, mask_client_shares, seal_client_shares
from protocols.dmm.common import (
    DMMAbort,
    DMMFaults,
    DMMSealedShares,
    DMMStage,
    OpenedRelease,
    RoundKeys,
    Schedule,
    StateLost,
)
from protocols.dmm.release import RoundOutput
from protocols.dmm.server import DMMServer
from protocols.encoding import (
    DEFAULT_BETA,
    DEFAULT_FAILURE_PROBABILITY,
    DDGaussEncoder,
    choose_gamma,
    unrotate,
)
from protocols.field import MersenneField
from protocols.kit import SEAT_ID_BASE, TamperingDetected
from protocols.shamir import PackedShamir
from strategies.answered_rounds import claim_round
from strategies.dmm_fold import (
    BATCH_KEY,
    FOLD_KEY,
    PADS_KEY,
    SEALED_KEY,
    ShareFoldReducer,
    fold_party,
    folded_client,
    sealed_to_record,
)
from strategies.dp_shell import LedgerShell
from strategies.participation_guard import ParticipationGuard
from strategies.spec import Accounting, RunFacts, StrategySpec
from strategies.vectors import flatten, unflatten
from strategies.wrapper import server_reply

log = logging.getLogger(__name__)

UPDATE_KEY = "dmm.update"
NOISE_KEY = "dmm.noise"
PREFIX = "dmm."
SHARE_PREFIX = "dmm.share."
_KEYS = ("dim", "clip", "gamma", "beta", "max-tries", "rotation-seed", "noise-std", "rows", "mode")
_SHARE_KEYS = ("round", "step", "n", "t", "k", "field-exponent", "dim", "session")
_SHARE_KEYS += ("members", "member-keys", "party")
_EVALUATION = (
    "{} with DMM: federated evaluation sends each evaluating client's un-noised loss and "
    "accuracy to the server; set fraction_evaluate = 0 ([evaluation] clients = 0), or pass "
    "metrics_in_clear=True ([privacy] metrics_in_clear = true), which makes epsilon infinite"
)


def key_refusals(replies: Iterable[Message]) -> dict[int, str]:
    """node -> why it refused the keys the server relayed (its error reply says
    ``KeySubstitution``: a seat key no enrolled member signed)."""
    out = {}
    for reply in replies:
        reason = str(getattr(reply.error, "reason", "")) if reply.has_error() else ""
        if reason.startswith(KeySubstitution.__name__):
            out[int(reply.metadata.src_node_id)] = reason.splitlines()[0][:500]
    return out


def round_keys_config(
    keys: RoundKeys, party: int, committee: tuple[int, Sequence[int]] | None = None
) -> dict[str, Any]:
    """The ``dmm.share.*`` entries of one client's full-mode instruction: the round's public
    :class:`protocols.dmm.common.RoundKeys`, the client's channel party id and ``committee``: (the
    server round whose public draw holds the state, its client ids in seat order), which an
    enrolled client recomputes and checks every seat's certificate against. Nothing secret."""
    if keys.session_id is None:
        raise ValueError("keys.session_id=None; clients share only over encrypted channels")
    seats = sorted(keys.member_keys)
    out: dict[str, Any] = {
        "round": keys.round,
        "step": keys.step,
        "n": keys.n,
        "t": keys.t,
        "k": keys.k,
        "field-exponent": keys.field_exponent,
        "dim": keys.dim,
        "session": keys.session_id,
        "members": seats,
        "member-keys": [keys.member_keys[j] for j in seats],
        "party": int(party),
    }
    if seats and set(seats) <= set(keys.member_proofs):  # relayed; the clients check them
        out["member-proofs"] = [keys.member_proofs[j] for j in seats]
    if committee is not None:
        out["committee-round"] = int(committee[0])
        out["committee"] = [int(c) for c in committee[1]]
    return {SHARE_PREFIX + k: v for k, v in out.items()}


def committee_names(
    config: ConfigRecord, keys: RoundKeys, seed: Any, population: Any
) -> dict[int, str]:
    """Seat -> the enrolled name (``client/c``) its key must be signed by: the instruction's
    ``committee`` must be the public draw (:func:`public_committee`, from the run's ``seed``
    and ``population``, both the client's own) of a round no later than this one, so a
    server cannot seat enrolled clients the draw did not choose. A committee that is not the
    draw is a :class:`KeySubstitution`."""
    for what, value in (("run_config seed", seed), ("node_config num-partitions", population)):
        if isinstance(value, bool) or not isinstance(value, int | np.integer):
            raise ValueError(
                f"{what}={value!r}; allowed: an integer (an enrolled DMM client recomputes "
                "the public committee draw from the run's seed and population)"
            )
    drawn_at = config.get(SHARE_PREFIX + "committee-round")
    clients = [int(c) for c in config.get(SHARE_PREFIX + "committee", ())]
    if (
        isinstance(drawn_at, bool)
        or not isinstance(drawn_at, int)
        or not 0 <= drawn_at <= keys.round
    ):
        raise KeySubstitution(
            f"round {keys.round}: {SHARE_PREFIX}committee-round={drawn_at!r} names no public "
            f"committee draw (allowed: a round in [0, {keys.round}]); this client seals only to "
            "the public committee"
        )
    drawn = public_committee(int(seed), drawn_at, int(population), keys.n)
    if clients != drawn:
        raise KeySubstitution(
            f"round {keys.round}: the seats' clients {clients[:8]} are not round {drawn_at}'s "
            f"public committee {drawn[:8]} (seed {int(seed)}, population {int(population)}); "
            "this client seals only to the public committee"
        )
    return {j: client_name(clients[j]) for j in range(keys.n)}


def cohort_config(
    keys: RoundKeys, cohort: list[int], committee: tuple[int, Sequence[int]] | None = None
) -> dict[str, Any]:
    """The ``dmm.share.*`` entries of a folded round's one shared instruction: the round's
    public keys and committee and the cohort's node ids in order (client ``cohort[p]`` has
    channel party p)."""
    out = round_keys_config(keys, 0, committee)
    del out[SHARE_PREFIX + "party"]
    out[SHARE_PREFIX + "cohort"] = [int(node) for node in cohort]
    return out


def round_keys_from_config(
    config: ConfigRecord, rows: int, node: int | None = None
) -> tuple[RoundKeys, int]:
    """(keys, party) from an instruction's ``dmm.share.*`` entries; in a folded round (a
    ``cohort`` list instead of a ``party``) the party of ``node`` is its place in the cohort."""
    keys = _round_keys(config, rows)
    if SHARE_PREFIX + "party" in config:
        return keys, int(config[SHARE_PREFIX + "party"])
    cohort = [int(c) for c in config[SHARE_PREFIX + "cohort"]]
    if node is None or int(node) not in cohort:
        raise ValueError(f"node {node} is not in the round's {SHARE_PREFIX}cohort")
    return keys, cohort.index(int(node))


def _round_keys(config: ConfigRecord, rows: int) -> RoundKeys:
    required = [k for k in _SHARE_KEYS if k != "party" or SHARE_PREFIX + "cohort" not in config]
    missing = [SHARE_PREFIX + k for k in required if SHARE_PREFIX + k not in config]
    if missing:
        raise ValueError(f"the full-mode instruction's config lacks {missing}")
    seats = [int(j) for j in config[SHARE_PREFIX + "members"]]
    member_keys = list(config[SHARE_PREFIX + "member-keys"])
    if len(seats) != len(member_keys):
        raise ValueError(
            f"{SHARE_PREFIX}members has {len(seats)} entries but {SHARE_PREFIX}member-keys "
            f"has {len(member_keys)}; allowed: one key per seat"
        )
    return RoundKeys(
        round=int(config[SHARE_PREFIX + "round"]),
        step=int(config[SHARE_PREFIX + "step"]),
        rows=int(rows),
        n=int(config[SHARE_PREFIX + "n"]),
        t=int(config[SHARE_PREFIX + "t"]),
        k=int(config[SHARE_PREFIX + "k"]),
        field_exponent=int(config[SHARE_PREFIX + "field-exponent"]),
        dim=int(config[SHARE_PREFIX + "dim"]),
        session_id=bytes(config[SHARE_PREFIX + "session"]),
        member_keys=dict(zip(seats, (bytes(key) for key in member_keys))),
        member_proofs=dict(zip(seats, map(bytes, config.get(SHARE_PREFIX + "member-proofs", ())))),
    )


def sealed_from_record(record: ConfigRecord, party: int, round_: int) -> DMMSealedShares:
    """The server's view of a reply: envelopes from the client's *assigned* ``party`` to each
    seat for ``round_`` at SHARE. Raises ``ValueError`` naming what is malformed."""
    if not isinstance(record, ConfigRecord):
        raise ValueError(f"{SEALED_KEY} is a {type(record).__name__}, not a ConfigRecord")
    if set(record.keys()) != {"public-key", "members", "nonces", "ciphertexts"}:
        raise ValueError(f"{SEALED_KEY} has entries {sorted(record.keys())}")
    seats, nonces, bodies = record["members"], record["nonces"], record["ciphertexts"]
    key = record["public-key"]
    if not isinstance(key, bytes) or not all(isinstance(v, list) for v in (seats, nonces, bodies)):
        raise ValueError(f"{SEALED_KEY} entries have the wrong types")
    if not len(seats) == len(nonces) == len(bodies) or len(set(seats)) != len(seats):
        raise ValueError(
            f"{SEALED_KEY} needs distinct seats and one nonce and ciphertext each; got "
            f"{len(seats)}, {len(nonces)}, {len(bodies)}"
        )
    if not all(isinstance(j, int) and not isinstance(j, bool) for j in seats) or not all(
        isinstance(b, bytes) for b in [*nonces, *bodies]
    ):
        raise ValueError(f"{SEALED_KEY}: seats must be integers, nonces and ciphertexts bytes")
    label = stage_label(DMMStage.SHARE)
    shares = {
        j: Envelope(party, SEAT_ID_BASE + j, int(round_), label, nonce, body)
        for j, nonce, body in zip(seats, nonces, bodies)
    }
    return DMMSealedShares(int(party), key, shares)


def _instruction(content: RecordDict) -> tuple[ArrayRecord, ConfigRecord]:
    arrays = [v for v in content.values() if isinstance(v, ArrayRecord)]
    configs = [v for v in content.values() if isinstance(v, ConfigRecord)]
    if len(arrays) != 1 or not configs:
        raise ValueError("a DMM instruction needs one ArrayRecord and a ConfigRecord")
    config = configs[0]
    missing = [PREFIX + k for k in _KEYS if PREFIX + k not in config]
    if missing or "server-round" not in config:
        raise ValueError(f"the instruction's config lacks {missing or ['server-round']}")
    return arrays[0], config


def dmm_client_app(inner: ClientApp, metrics_in_clear: bool = False) -> ClientApp:
    """A ClientApp that runs ``inner``, rounds its update, draws its fresh noise rows and, in
    full mode, shares and seals both itself.

    All of the client's randomness is its own: rounding, noise, share polynomials and its X25519
    key come from ``client_secret(context.node_config)`` (round, ``Purpose.ROUNDING`` /
    ``NOISE`` / ``SHARES`` / ``KEYS``). Full mode replies ``dmm.sealed`` (its public key, one
    nonce and ciphertext per seat): nothing the server can open. Ideal mode (the no-cryptography
    reference) replies the plaintext ``dmm.update`` and ``dmm.noise``. The inner reply's metrics
    and the rounding's tries / clipping leave only with ``metrics_in_clear=True``, and so does
    an answer to federated evaluation (``inner``'s evaluate, un-noised): without it an evaluate
    message is refused. A round already answered (or an earlier one) is refused before
    anything is drawn (:func:`strategies.answered_rounds.claim_round`).
    """
    app = ClientApp()

    @app.train()
    def train(message: Message, context: Context) -> Message:
        global_record, config = _instruction(message.content)
        secret = client_secret(context.node_config)
        round_ = int(config["server-round"])
        claim_round(context.state, NAME, round_)  # never the same streams twice
        encoder = DDGaussEncoder(
            dim=int(config[PREFIX + "dim"]),
            clip=float(config[PREFIX + "clip"]),
            gamma=float(config[PREFIX + "gamma"]),
            noise_std=0.0,
            beta=float(config[PREFIX + "beta"]),
            max_tries=int(config[PREFIX + "max-tries"]),
        )
        reply = inner(message, context)
        if reply.has_error():
            return reply
        _, trained = single(reply.content, ArrayRecord)
        update = flatten(to_numpy(trained)) - flatten(to_numpy(global_record))
        rounded, tries, clipped = encoder.quantise(
            update,
            int(config[PREFIX + "rotation-seed"]),
            secret.generator(round_, Purpose.ROUNDING, "dmm"),
        )
        rows = int(config[PREFIX + "rows"])
        noise = discrete_gaussian(
            (rows, encoder.padded_dim),
            float(config[PREFIX + "noise-std"]),
            secret.generator(round_, Purpose.NOISE, "dmm"),
        )
        mode = str(config[PREFIX + "mode"])
        if mode == "full":
            keys, party = round_keys_from_config(config, rows, context.node_id)
            if keys.dim != encoder.padded_dim:
                raise ValueError(
                    f"{SHARE_PREFIX}dim={keys.dim} but the encoder pads to {encoder.padded_dim}"
                )
            segments = [rounded.astype(np.int64), *noise.astype(np.int64)]
            shares = secret.generator(round_, Purpose.SHARES, "dmm")
            enrolment = enrolled(context.node_config, secret)
            if enrolment is not None:  # a substituted seat key: refuse before anything leaves
                names = committee_names(
                    config,
                    keys,
                    context.run_config.get("seed"),
                    context.node_config.get(NUM_PARTITIONS_KEY),
                )
                check_seat_keys(keys, enrolment[1], names)
            if SHARE_PREFIX + "cohort" in config and context.node_config.get(FOLDS_KEY) is True:
                masked = mask_client_shares(
                    keys,
                    party,
                    segments[0],
                    noise.astype(np.int64),
                    shares,
                    secret.seed_bytes(round_, Purpose.KEYS, "dmm", "client"),
                )
                client = masked.client
                pads = DMMSealedShares(client.party, client.public_key, client.pads)
                content = RecordDict(
                    {
                        FOLD_KEY: to_record({"masked": masked.rows}),
                        PADS_KEY: sealed_to_record(pads),
                    }
                )
            else:
                sealed = seal_client_shares(
                    keys,
                    party,
                    segments[0],
                    noise.astype(np.int64),
                    shares,
                    secret.seed_bytes(round_, Purpose.KEYS, "dmm", "client"),
                )
                content = RecordDict({SEALED_KEY: sealed_to_record(sealed)})
        elif mode == "ideal":
            content = RecordDict(
                {
                    UPDATE_KEY: to_record({UPDATE_KEY: rounded.astype(np.int64)}),
                    NOISE_KEY: to_record({NOISE_KEY: noise.astype(np.int64)}),
                }
            )
        else:
            raise ValueError(f"{PREFIX}mode={mode!r}; allowed: 'full', 'ideal'")
        if metrics_in_clear:
            _, metrics = single(reply.content, MetricRecord)
            out = MetricRecord(dict(metrics))
            out["dmm.tries"] = tries
            out["dmm.clipped"] = int(clipped)
            content["metrics"] = out
        return Message(content=content, reply_to=message)

    @app.evaluate()
    def evaluate(message: Message, context: Context) -> Message:
        if not metrics_in_clear:
            raise RuntimeError(
                "a DMM client answers no federated evaluation: it would send its un-noised "
                "loss and accuracy to the server (build the client app with "
                "metrics_in_clear=True to allow it; epsilon is then infinite)"
            )
        return inner(message, context)

    return app


def committee_bound(n: int, t: int, k: int, dropouts: int) -> None:
    """Refuse a committee that cannot meet t_corrupt + t_dropout < (1/2 - mu) n, mu = k / n
    (Bienstock et al.): honest online members must outnumber the corrupt and the dropped by
    more than the packing, so that the released shares decode uniquely with t wrong ones."""
    for name, value, low in (
        ("committee_size", n, 1),
        ("threshold", t, 1),
        ("packing", k, 1),
        ("member_dropouts", dropouts, 0),
    ):
        if isinstance(value, bool) or not isinstance(value, int) or value < low:
            raise ValueError(f"{name}={value!r}; allowed: an integer >= {low}")
    if not t + dropouts < (0.5 - k / n) * n:
        raise ValueError(
            f"threshold + member_dropouts = {t} + {dropouts} is not below (1/2 - packing / "
            f"committee_size) * committee_size = (1/2 - {k}/{n}) * {n} = {n / 2 - k:g}: the "
            "committee cannot meet the corruption/dropout bound its thresholds assume "
            "(t_corrupt + t_dropout < (1/2 - mu) n); raise committee_size or lower threshold, "
            "packing or member_dropouts"
        )


def _check_arguments(
    *,
    clipping_norm: float,
    noise_multiplier: float,
    expected_clients: int,
    population: int,
    committee_size: int,
    expected_client_dropout: float,
    mode: str,
    committee_actors: bool,
    committee_shards: int,
) -> None:
    """Raise ValueError on a :class:`DMM` argument out of its range."""
    for name, value in (
        ("clipping_norm", clipping_norm),
        ("noise_multiplier", noise_multiplier),
    ):
        if not (math.isfinite(value) and value > 0):
            raise ValueError(f"{name}={value!r}; it must be finite and > 0")
    for name, value in (("expected_clients", expected_clients), ("population", population)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name}={value!r}; it must be an integer >= 1")
    if committee_size > population:
        raise ValueError(
            f"committee_size={committee_size} exceeds the population of {population} clients"
        )
    if not 0.0 <= expected_client_dropout < 1.0:
        raise ValueError(
            f"expected_client_dropout={expected_client_dropout!r}; allowed: [0, 1)"
        )
    if mode not in ("full", "ideal"):
        raise ValueError(f"mode={mode!r}; allowed: 'full', 'ideal'")
    if not isinstance(committee_actors, bool):
        raise ValueError(f"committee_actors={committee_actors!r}; allowed: True or False")
    if isinstance(committee_shards, bool) or not isinstance(committee_shards, int) or not (
        1 <= committee_shards <= committee_size
    ):
        raise ValueError(
            f"committee_shards={committee_shards!r}; allowed: an integer in "
            f"[1, committee_size={committee_size}]"
        )


class DMM(LedgerShell):
    """Wrap a FedAvg-family strategy with the distributed matrix mechanism.

    At the release boundary (:mod:`fedsim.engine.boundary`) it claims the replies it consumes,
    by the instructions they answer, wherever the rounds run (fedsim's loop, Flower's
    ``Strategy.start``, an app's own loop): the train replies that enter the secure sum are
    claimed for this ledger; a reply the boundary refuses (never delivered, or consumed
    already) is rejected and never enters the sum; the other train replies it rejects are
    withheld (sealed to the committee in full mode, dropped by the ideal sum in ideal mode:
    nothing of them is released); evaluation replies are claimed, and the ledger makes epsilon
    infinite for them. A reply nobody claims counts as an unaccounted release.

    Args:
        strategy: samples clients and applies the mean update.
        factorization: A = B C of the workload; C banded (BandMF, banded Toeplitz) or the 0/1
            tree (binary / Honaker); its n is the number of rounds.
        population: registered clients (committees are drawn from them).
        committee_size, threshold, packing, member_dropouts: n, t, k of every committee and
            the member dropouts it is planned for (:func:`committee_bound`).
        fractional_bits: f of M = round(2^f C) (None: 12 for banded C, 0 for the tree).
        clipping_norm, noise_multiplier: c and z: each released row carries central std
            z * (c / gamma) * sens(M) (integer units) when the planned clients contribute.
        expected_clients: m, the planned cohort (the mean's denominator).
        expected_client_dropout: fraction of clients the noise is planned to lose.
        participation: the schema sens(M) is computed for (single by default); enforced:
            an instruction that would break it does not leave (``participation-refused``).
        seed: the run's public seed (committees, rotation).
        mode: 'full' (clients share and seal; members on the committee host) or 'ideal'.
        min_clients: fewest agreed clients a release may carry.
        bits: signed bits of the sum of m rounded updates (sets gamma).
        field_exponent: p = 2^e - 1; delta: the run's delta.
        committee_actors, committee_shards: how the front end's committee host runs members
            (Ray actors, and how many).
        reshare_checks: dealers beyond t + k a committee handoff needs, so that a wrong
            dealing is caught (:class:`protocols.dmm.server.DMMServer`; 0 lets t + k deal
            unchecked and reports every later release of those rows unverified).
        worker_fold: full mode: the clients of a fedsim worker batch fold their sharing
            inputs and the worker seals one message per batch (:mod:`strategies.dmm_fold`);
            elsewhere (Flower's runtime) each client still seals its own.
        metrics_in_clear: allow federated evaluation and per-client train metrics, which give
            the server each client's un-noised metrics: epsilon becomes infinite once any
            arrive. Without it a ``strategy`` whose ``fraction_evaluate`` is > 0, or that sends
            evaluate messages, is refused.
    """

    #: the replies it consumes are claimed at the release boundary (fedsim.engine.boundary)
    claims_replies = True
    _boundary: ReleaseBoundary | None = None

    def __init__(
        self,
        strategy: Strategy,
        *,
        factorization: Factorization,
        population: int,
        clipping_norm: float,
        noise_multiplier: float,
        expected_clients: int,
        seed: int,
        committee_size: int = 20,
        threshold: int = 3,
        packing: int = 3,
        member_dropouts: int = 3,
        fractional_bits: int | None = None,
        mode: Literal["full", "ideal"] = "full",
        participation: Participation | None = None,
        expected_client_dropout: float = 0.0,
        min_clients: int = 1,
        bits: int = 20,
        beta: float = DEFAULT_BETA,
        max_tries: int = 100,
        field_exponent: int = 61,
        delta: float = 1e-5,
        failure_probability: float = DEFAULT_FAILURE_PROBABILITY,
        committee_actors: bool = False,
        committee_shards: int = 4,
        worker_fold: bool = False,
        metrics_in_clear: bool = False,
        reshare_checks: int = 1,
    ) -> None:
        if not isinstance(worker_fold, bool):
            raise ValueError(f"worker_fold={worker_fold!r}; allowed: True or False")
        _check_arguments(
            clipping_norm=clipping_norm,
            noise_multiplier=noise_multiplier,
            expected_clients=expected_clients,
            population=population,
            committee_size=committee_size,
            expected_client_dropout=expected_client_dropout,
            mode=mode,
            committee_actors=committee_actors,
            committee_shards=committee_shards,
        )
        committee_bound(committee_size, threshold, packing, member_dropouts)
        fraction = getattr(strategy, "fraction_evaluate", 0.0)
        if not metrics_in_clear and isinstance(fraction, int | float) and fraction > 0:
            raise ValueError(_EVALUATION.format(f"strategy.fraction_evaluate={fraction!r}"))
        super().__init__(strategy)
        self.metrics_in_clear = bool(metrics_in_clear)
        #: client content that reached the server outside the secure sum (epsilon = inf)
        self.unaccounted: list[str] = []
        tree = factorization.kind in dmm_privacy.TREE_KINDS
        f = (0 if tree else 12) if fractional_bits is None else fractional_bits
        self.mechanism = dmm_privacy.IntegerMechanism(
            factorization, f, participation or Participation.single()
        )
        #: the schema sens(M) assumes, enforced on every instruction (in server rounds, as the
        #: engine's cohort schedules them; aborted rounds are handled by the accounting)
        self.guard = ParticipationGuard(self.mechanism.participation, self.mechanism.n)
        self.participation_refused: list[int] = []
        self.scheme = PackedShamir(
            committee_size, threshold, packing, MersenneField(field_exponent)
        )
        self.population, self.member_dropouts = population, member_dropouts
        self.clipping_norm, self.noise_multiplier = float(clipping_norm), float(noise_multiplier)
        self.expected_clients = expected_clients
        self.expected_client_dropout = float(expected_client_dropout)
        self.seed, self.mode, self.min_clients = int(seed), mode, int(min_clients)
        self.bits, self.beta, self.max_tries = bits, beta, max_tries
        self.failure_probability = failure_probability
        self.committee_actors, self.committee_shards = committee_actors, committee_shards
        self.worker_fold = worker_fold
        self.reshare_checks = reshare_checks
        self.ledger = PrivacyLedger(NeighbouringRelation.ADD_REMOVE, delta)
        self.encoder: DDGaussEncoder | None = None
        self.server: DMMServer | None = None
        self.host = None
        self.committee: list[int] = []
        #: the server round whose public draw is ``committee``
        self.committee_round: int | None = None
        self.aborted_rounds = 0
        #: rounds that aborted after their release shares reached the server (accounted):
        #: round, clients, the epsilon it cost
        self.aborted_releases: list[dict[str, float]] = []
        self.last_output: RoundOutput | None = None
        self.last_abort: str | None = None
        self.halted: str | None = None
        self._scaled_noise_std = 0.0
        self._zcdp = 0.0
        self._accounted: dict[Participation, dmm_privacy.IntegerMechanism] = {}
        self._global: ArrayRecord | None = None
        self._round: dict[str, Any] = {}

    # ------------------------------------------------------------------ secrets and custody
    def bind_committee_host(self, host) -> None:
        """Contract 1: the front end hands the engine-side committee host (it holds the run's
        secrets; this strategy never does). After ``--resume`` it is bound again and the
        committee holding the state is re-hosted from its members' sealed states."""
        self.host = host

    def committee_host_options(self) -> dict[str, Any]:
        """How the front end should build this run's committee host."""
        return {"actors": self.committee_actors, "shards": self.committee_shards}

    def __getstate__(self) -> dict:
        """Checkpoints keep only what the server may know: never the host, a pool (the
        members' shares are theirs) or a round in flight."""
        state = dict(self.__dict__)
        state.update(host=None, _round={})
        state.pop("_boundary", None)  # the run's, bound again by the next configure_train
        return state

    def __setstate__(self, state: dict) -> None:
        """A checkpoint written before the opened-release and metrics bookkeeping existed
        loads with none recorded and the defaults."""
        self.__dict__.update(
            aborted_releases=[], unaccounted=[], metrics_in_clear=False, reshare_checks=1
        )
        self.__dict__.update(state)

    def close(self) -> None:
        """Forget the hosted committee (the host ends its actors)."""
        if self.server is not None and self.server.pool is not None:
            self.server.pool.close()
            self.server.pool = None

    # ------------------------------------------------------------------ configuration
    @property
    def sensitivity(self) -> float:
        """sens(M) of the implemented integer matrix over all n rounds."""
        return self.mechanism.sensitivity.value

    def committee_for(self, server_round: int) -> list[int]:
        """The committee of ``server_round``: n distinct clients drawn publicly."""
        return public_committee(self.seed, server_round, self.population, self.scheme.n)

    def _committee_claim(self, server_round: int) -> tuple[int, list[int]]:
        """(the round whose public draw is the committee now holding the state, its client
        ids): what the clients check the seats' certificates against."""
        drawn_at = self.__dict__.get("committee_round")
        if drawn_at is None or self.committee_for(drawn_at) != self.committee:
            drawn_at = next(  # a checkpoint from before the draw's round was kept
                (r for r in range(server_round, -1, -1) if self.committee_for(r) == self.committee),
                server_round,
            )
            self.committee_round = drawn_at
        return drawn_at, list(self.committee)

    def rotation_seed(self) -> int:
        """The run's public rotation seed (one basis for every round: releases combine the
        round sums of several rounds)."""
        return int(public_generator(self.seed, 0, Stream.ROTATION).integers(2**31))

    def check(self, dim: int) -> DDGaussEncoder:
        """Validate the noise and the bit budget for models of ``dim`` parameters and build the
        encoder; raises ``ValueError`` with the budget when a released row could wrap mod p."""
        gamma = choose_gamma(
            dim, self.expected_clients, self.clipping_norm, 0.0, self.bits, beta=self.beta
        )
        encoder = DDGaussEncoder(dim, self.clipping_norm, gamma, 0.0, self.beta, self.max_tries)
        planned = max(1.0, (1.0 - self.expected_client_dropout) * self.expected_clients)
        scaled = (
            self.noise_multiplier * (self.clipping_norm / gamma) * self.sensitivity
        ) / math.sqrt(planned)
        if scaled < 0.5:
            raise ValueError(
                f"each client's noise is {scaled:.3g} integer steps (gamma={gamma:.3g}); KLS21 "
                f"needs >= 1/2: raise bits (now {self.bits}) or noise_multiplier"
            )
        worst = dmm_privacy.worst_release(
            self.mechanism,
            self.expected_clients,
            encoder.l2_bound,
            scaled,
            encoder.padded_dim,
            self.failure_probability,
        )
        field = self.scheme.field
        if worst > field.max_signed:
            raise ValueError(
                f"bit budget: a released row can reach {worst:.4g} = 2^{math.log2(worst):.1f} "
                f"(max row |M|_1 = {self.mechanism.max_row_l1}, expected_clients = "
                f"{self.expected_clients}, bits = {self.bits}, fractional_bits = "
                f"{self.mechanism.fractional_bits}, failure probability "
                f"{self.failure_probability:g}) but F_p with p = 2^{field.exponent} - 1 holds "
                f"signed values below 2^{field.exponent - 1}; lower bits or fractional_bits"
            )
        self._scaled_noise_std = scaled
        return encoder

    def _ensure(self, dim: int) -> DDGaussEncoder:
        if self.encoder is None or self.encoder.dim != dim:
            self.encoder = self.check(dim)
            self.server = DMMServer(
                self.scheme,
                Schedule(self.mechanism.integer_matrix),
                self.encoder.padded_dim,
                mode=self.mode,
                min_clients=self.min_clients,
                decoding=self.mechanism.decoding,
                reshare_checks=self.reshare_checks,
            )
        return self.encoder

    def _ensure_pool(self, server_round: int) -> None:
        """Full mode: the committee holding the state is hosted (a fresh committee at step 0;
        after a resume, the holders re-hosted from their sealed states)."""
        if self.mode != "full" or self.server.pool is not None:
            return
        if self.host is None:
            raise RuntimeError(
                "mode='full' needs a committee host: the front end binds one with "
                "bind_committee_host (fedsim.engine.dmm_committee.CommitteeHost)"
            )
        kwargs = self.server.member_kwargs
        if self.server.step == 0:
            self.committee = self.committee_for(server_round)
            self.committee_round = server_round
            self.server.attach(self.host.pool(self.committee, kwargs), range(self.scheme.n))
        else:
            pool = self.host.restore(self.committee, self.server.holders, kwargs, self.server.step)
            self.server.attach(pool)

    # ------------------------------------------------------------------ accounting
    def accounting_participation(self) -> Participation:
        """The schema in mechanism steps: an aborted round shifts later rounds one step
        closer, so min separation shrinks by the aborted rounds (never below 1)."""
        p = self.mechanism.participation
        if p.kind != "min_sep" or not self.aborted_rounds:
            return p
        return Participation.separated(
            max(1, int(p.min_sep) - self.aborted_rounds), p.max_participations
        )

    def _account(self, server_round: int, opened: OpenedRelease | None = None) -> None:
        """Record the increase of epsilon for the rows released so far, and for ``opened``'s
        rows (an aborted round whose release shares reached the server) as released."""
        participation = self.accounting_participation()
        mechanism = self._accounted.get(participation)
        if mechanism is None:
            mechanism = self.mechanism
            if participation != mechanism.participation:
                mechanism = dmm_privacy.IntegerMechanism(
                    mechanism.factorization, mechanism.fractional_bits, participation
                )
            self._accounted = {participation: mechanism}
        steps, counts = self.server.step, dict(self.server.counts)
        if opened is not None:
            steps = opened.step + 1
            counts.update({int(i): int(opened.clients) for i in opened.rows})
        rows = np.flatnonzero(mechanism.rounds < steps)
        eps = dmm_privacy.zcdp_epsilon(
            mechanism,
            steps,
            self.encoder.l2_bound,
            self.encoder.l1_bound,
            self._scaled_noise_std,
            [counts.get(int(i), 0) for i in rows],
            self.encoder.padded_dim,
        )
        self.ledger.record(server_round, dmm_privacy.increment_event(self._zcdp, eps))
        self._zcdp = max(self._zcdp, eps)

    def report_details(self) -> dict[str, Any]:
        """Steps, the integer matrix's sensitivity, the fewest noise contributors, the
        neighbouring relation the bound proves (zero-out; it overrides the ledger's add/remove,
        whose Gaussian arithmetic it shares), aborts (those accounted as opened releases with
        their cost), and any client content that reached the server unaccounted."""
        counts = self.server.counts if self.server else {}
        details: dict[str, Any] = {
            "steps": self.server.step if self.server else 0,
            "factorization": self.mechanism.factorization.kind,
            "fractional_bits": self.mechanism.fractional_bits,
            "sensitivity_implemented": self.sensitivity,
            "sensitivity_exact": self.mechanism.sensitivity.exact,
            "fewest_noise_clients": min(counts.values()) if counts else None,
            "mode": self.mode,
            "aborted_rounds": self.aborted_rounds,
            "aborted_releases": list(self.aborted_releases),
            "bound": "discrete Gaussian on the integer query M X (KLS21 Thm 1), noise present",
            "relation": dmm_privacy.RELATION,
        }
        if self.unaccounted:
            details["unaccounted"] = {
                "releases": len(self.unaccounted),
                "first": self.unaccounted[0],
            }
        return details

    def _unaccounted(self, server_round: int, what: str) -> None:
        """Client content reached the server outside the secure sum: epsilon is infinite."""
        self.ledger.record(server_round, dpa.NonPrivateDpEvent())
        self.unaccounted.append(f"round {server_round}: {what}")
        log.warning("round %d: DMM received %s: epsilon is now infinite", server_round, what)

    def configure_evaluate(
        self, server_round: int, arrays: ArrayRecord, config: ConfigRecord, grid: Grid
    ) -> Iterable[Message]:
        messages = list(self.strategy.configure_evaluate(server_round, arrays, config, grid))
        if messages and not self.metrics_in_clear:
            raise RuntimeError(_EVALUATION.format(f"{len(messages)} evaluate messages"))
        return messages

    def aggregate_evaluate(
        self, server_round: int, replies: Iterable[Message]
    ) -> MetricRecord | None:
        replies = list(replies)
        answered = sum(not reply.has_error() for reply in replies)
        if self._boundary is not None:  # consumed here: the ledger makes epsilon infinite
            for reply in replies:
                with contextlib.suppress(ClaimRefused):
                    self._boundary.claim([reply], self)
        if answered:
            self._unaccounted(server_round, f"evaluation metrics of {answered} clients")
        return self.strategy.aggregate_evaluate(server_round, replies)

    # ------------------------------------------------------------------ rounds
    def configure_train(
        self, server_round: int, arrays: ArrayRecord, config: ConfigRecord, grid: Grid
    ) -> Iterable[Message]:
        boundary = boundary_of(grid)
        if boundary is not None:  # this ledger's releases are claimed there
            self._boundary = boundary
            boundary.register(self)
        reference = to_numpy(arrays)
        encoder = self._ensure(int(sum(v.size for v in reference.values())))
        if self.halted:
            return []
        step = self.server.step
        if step >= self.mechanism.n:
            raise ValueError(
                f"server round {server_round} needs step {step} but the factorization has "
                f"n = {self.mechanism.n} rounds; build it for more rounds"
            )
        self._ensure_pool(server_round)
        if not self.committee:
            self.committee = self.committee_for(server_round)
            self.committee_round = server_round
        extended = ConfigRecord(dict(config))
        extended["server-round"] = server_round
        extended.update(
            {
                PREFIX + "dim": encoder.dim,
                PREFIX + "clip": encoder.clip,
                PREFIX + "gamma": encoder.gamma,
                PREFIX + "beta": encoder.beta,
                PREFIX + "max-tries": encoder.max_tries,
                PREFIX + "rotation-seed": self.rotation_seed(),
                PREFIX + "noise-std": self._scaled_noise_std,
                PREFIX + "rows": len(self.mechanism.released_at(step)),
                PREFIX + "mode": self.mode,
            }
        )
        self._global = arrays
        messages, self.participation_refused = self.guard.admit(
            server_round - 1, self.strategy.configure_train(server_round, arrays, extended, grid)
        )
        following = self.committee_for(server_round + 1)
        faults = (
            self.host.member_faults(server_round, self.committee, following)
            if self.host is not None
            else DMMFaults()
        )
        sent = {int(m.metadata.dst_node_id): p for p, m in enumerate(messages)}
        self._round = {
            "round": server_round,
            "sent": sent,
            "faults": faults,
            "committee": list(self.committee),
            "next": following,
        }
        if self.mode != "full":
            return messages
        keys = self.server.open_round(server_round, faults)
        self._round["keys"] = keys
        if self.worker_fold:
            return self._folded_instructions(messages, keys)
        claim = self._committee_claim(server_round)
        for message in messages:
            share = round_keys_config(keys, sent[int(message.metadata.dst_node_id)], claim)
            message.content = RecordDict(
                {
                    name: ConfigRecord({**dict(record), **share})
                    if isinstance(record, ConfigRecord)
                    else record
                    for name, record in message.content.items()
                }
            )
        return messages

    def _folded_instructions(self, messages: list[Message], keys: RoundKeys) -> list[Message]:
        """One shared instruction for the whole cohort (so a worker's batch can fold): the
        round's keys, the cohort in party order and the :class:`ShareFoldReducer`."""
        if not messages:
            return messages
        cohort = sorted(self._round["sent"], key=self._round["sent"].get)
        share = cohort_config(keys, cohort, self._committee_claim(self._round["round"]))
        content = RecordDict(
            {
                name: ConfigRecord({**dict(record), **share})
                if isinstance(record, ConfigRecord)
                else record
                for name, record in messages[0].content.items()
            }
        )
        for message in messages:
            message.content = content
        return attach_reducer(messages, ShareFoldReducer.for_round(keys, cohort))

    def _batch(self, reply: Message, node: int, rejected: dict[int, str]) -> list[int] | None:
        """The nodes a worker's folded reply holds (each sampled, none seen before), or None
        (then ``rejected[node]`` says why); the nodes its fold refused are rejected."""
        for refused in reply.rejected:
            rejected[int(refused)] = "its reply was refused by its worker's fold"
        record = reply.content.get(BATCH_KEY)
        nodes = record.get("nodes") if isinstance(record, ConfigRecord) else None
        if not isinstance(nodes, list) or not nodes:
            rejected[node] = f"a folded reply without its {BATCH_KEY} nodes"
            return None
        seen = self._round.setdefault("folded", {})
        nodes = [int(n) for n in nodes]
        if len(set(nodes)) != len(nodes) or any(
            n not in self._round["sent"] or n in seen for n in nodes
        ):
            rejected[node] = f"a folded reply for nodes {nodes}: unsampled or repeated"
            return None
        seen.update({n: node for n in nodes})
        return nodes

    def _validate(self, replies: Iterable[Message]) -> tuple[dict[int, Message], dict[int, str]]:
        """Contract 3: the replies that pass (node -> reply) and node -> why the others failed.
        A worker's folded reply is keyed by its first node (``_round['batches']``: its nodes)."""
        sent = self._round.get("sent", {})
        allowed = {SEALED_KEY} if self.mode == "full" else {UPDATE_KEY, NOISE_KEY}
        valid, rejected = {}, {}
        batches = self._round.setdefault("batches", {})
        for reply in replies:
            node = int(reply.metadata.src_node_id)
            if reply.has_error():
                continue  # a client that failed or dropped: not a protocol violation
            if is_partial(reply) and self.worker_fold and self.mode == "full":
                nodes = self._batch(reply, node, rejected)
                if nodes is not None and set(reply.content.keys()) - {"metrics"} == {
                    SEALED_KEY,
                    BATCH_KEY,
                }:
                    valid[node], batches[node] = reply, nodes
                elif nodes is not None:
                    rejected[node] = f"records {sorted(reply.content.keys())} in a folded reply"
                continue
            keys = set(reply.content.keys()) - {"metrics"}
            if node not in sent:
                rejected[node] = "not sampled this round"
            elif node in valid or node in rejected:
                rejected[node] = "more than one reply"
                valid.pop(node, None)
            elif keys != allowed:
                got = sorted(reply.content.keys())
                rejected[node] = f"records {got}, allowed {sorted(allowed)}"
            else:
                valid[node] = reply
        return valid, rejected

    def _at_boundary(
        self, replies: list[Message], valid: dict[int, Message], rejected: dict[int, str]
    ) -> None:
        """Claim ``valid`` (the replies the secure sum takes) at the release boundary; one
        the boundary refuses leaves ``valid`` for ``rejected``. The other replies consumed
        here are withheld (see the class docstring)."""
        if self._boundary is None:
            return
        for node, reply in list(valid.items()):
            try:
                self._boundary.claim([reply], self)
            except ClaimRefused as refused:
                rejected[node] = f"refused at the release boundary: {refused}"
                del valid[node]
                self._round.get("batches", {}).pop(node, None)
        summed = {id(reply) for reply in valid.values()}
        for reply in replies:
            if not reply.has_error() and id(reply) not in summed:
                with contextlib.suppress(ClaimRefused):
                    self._boundary.withhold([reply], type(self).__name__)

    def _sealed(self, valid: dict[int, Message], rejected: dict[int, str]) -> dict:
        keys: RoundKeys = self._round["keys"]
        sealed = {}
        batches = self._round.get("batches", {})
        for node, reply in valid.items():
            party = self._party(batches[node]) if node in batches else self._round["sent"][node]
            try:
                sealed[node] = sealed_from_record(reply.content[SEALED_KEY], party, keys.round)
                if node in batches:
                    sealed[node] = self._folded(sealed[node], reply, batches[node], keys)
            except (ValueError, TypeError, KeyError) as error:
                rejected[node] = f"malformed sealed shares: {error}"
        return sealed

    def _folded(self, sealed: DMMSealedShares, reply: Message, nodes, keys: RoundKeys):
        """``sealed`` with the fold's proof of who is in it (:class:`FoldedClient` per node,
        from its :data:`BATCH_KEY` record); ValueError when it does not list each node once
        with a key and a sealed pad seed per announced seat."""
        record, seats = reply.content[BATCH_KEY], sorted(keys.member_keys)
        public, nonces, bodies = (
            list(record.get(k, [])) for k in ("public-keys", "pad-nonces", "pad-ciphertexts")
        )
        if len(public) != len(nodes) or not len(nonces) == len(bodies) == len(nodes) * len(seats):
            raise ValueError(
                f"a fold of {len(nodes)} nodes lists {len(public)} keys and {len(nonces)} pad "
                f"seeds; allowed: one key per node and one seed per node and seat"
            )
        sent, width = self._round["sent"], len(seats)
        folded = tuple(
            folded_client(sent[n], public[i], keys.round, seats,
                          nonces[i * width:(i + 1) * width], bodies[i * width:(i + 1) * width])
            for i, n in enumerate(nodes)
        )  # fmt: skip
        return DMMSealedShares(sealed.party, sealed.public_key, sealed.shares, folded)

    def _party(self, nodes) -> int:
        """The channel party of a folded batch of ``nodes``
        (:func:`strategies.dmm_fold.fold_party`, as :class:`ShareFoldReducer` seals)."""
        sent = self._round["sent"]
        return fold_party(len(sent), (sent[n] for n in nodes))

    def _plain(self, valid: dict[int, Message], rejected: dict[int, str]):
        """Ideal mode's plaintext integers, each checked: D integers with ||u||_2 <= Delta_2
        and noise rows inside the tail bound the bit budget assumes."""
        rows = len(self.mechanism.released_at(self.server.step))
        dim = self.encoder.padded_dim
        limit = self._scaled_noise_std * math.sqrt(2 * math.log(2 * dim * max(rows, 1) / 1e-12))
        updates, noises = {}, {}
        for node, reply in valid.items():
            try:
                update = np.asarray(to_numpy(reply.content[UPDATE_KEY])[UPDATE_KEY])
                noise = np.asarray(to_numpy(reply.content[NOISE_KEY])[NOISE_KEY])
            except (KeyError, ValueError, TypeError) as error:
                rejected[node] = f"unreadable integers: {error}"
                continue
            if update.shape != (dim,) or noise.shape != (rows, dim):
                rejected[node] = (
                    f"shapes {update.shape}, {noise.shape}; allowed ({dim},), ({rows}, {dim})"
                )
            elif update.dtype.kind not in "iu" or (noise.size and noise.dtype.kind not in "iu"):
                rejected[node] = "not integers"
            elif float(np.linalg.norm(update.astype(np.float64))) > self.encoder.l2_bound + 1e-9:
                rejected[node] = f"||update||_2 exceeds Delta_2 = {self.encoder.l2_bound:.6g}"
            elif noise.size and float(np.max(np.abs(noise))) > max(limit, 1.0):
                rejected[node] = f"noise beyond its tail bound {limit:.6g}"
            else:
                updates[node], noises[node] = update.astype(np.int64), noise.astype(np.int64)
        return updates, noises

    def _run_protocol(self, server_round: int, valid, rejected) -> RoundOutput:
        faults = self._round["faults"]
        if self.mode == "full":
            sealed = self._sealed(valid, rejected)
            next_pool = self.host.pool(self._round["next"], self.server.member_kwargs)
            batches = self._round.get("batches", {})
            weights = {node: len(batches.get(node, [node])) for node in sealed}
            try:
                return self.server.finish_round(sealed, next_pool, weights)
            except BaseException:
                next_pool.close()
                raise
        updates, noises = self._plain(valid, rejected)
        return self.server.run_plain_round(server_round, updates, noises, faults)

    def aggregate_train(
        self, server_round: int, replies: Iterable[Message]
    ) -> tuple[ArrayRecord | None, MetricRecord | None]:
        metrics = MetricRecord(
            {
                "dmm-planned": self.expected_clients,
                "participation-refused": self.participation_refused,
            }
        )
        if self.halted:
            metrics["dmm-halted"] = 1
            metrics["epsilon"] = self.epsilon()
            return None, metrics
        if self._global is None or self.encoder is None or not self._round:
            raise RuntimeError("aggregate_train called before configure_train")
        replies = list(replies)
        clear = sum(not r.has_error() and "metrics" in r.content for r in replies)
        if clear:
            self._unaccounted(server_round, f"train metrics of {clear} clients in the clear")
        refusals = key_refusals(replies)
        if refusals:  # clients that refused relayed keys are named, never silent dropouts
            node, reason = sorted(refusals.items())[0]
            log.warning(
                "DMM round %s: %d clients refused keys relayed by the server (node %d: %s)",
                server_round, len(refusals), node, reason,
            )
            metrics["dmm-key-refusals"] = len(refusals)
        valid, rejected = self._validate(replies)
        self._at_boundary(replies, valid, rejected)
        try:
            output = self._run_protocol(server_round, valid, rejected)
        except (DMMAbort, TamperingDetected) as error:
            aborted = self._aborted(server_round, error, rejected, metrics)
            if refusals:
                self.last_abort += f"; {len(refusals)} clients refused relayed keys ({reason})"
            return None, aborted
        rejected.update(output.rejected)
        self.last_output, self.last_abort = output, None
        self._account(server_round)
        self._persist(server_round, output)
        arrays, aggregated = self._apply(server_round, output)
        aggregated.update(dict(metrics))
        aggregated.update(self._round_metrics(output, rejected, replies))
        self._round = {}
        return arrays, aggregated

    def _aborted(self, server_round, error, rejected, metrics) -> MetricRecord:
        """An aborted round. One whose release shares reached the server (``error.opened``,
        :class:`protocols.dmm.common.OpenedRelease`) is accounted as the release of its step, and
        the mechanism halts: that state was opened, so it is never released again with fresh
        noise (and its decoding cannot go on without the rows)."""
        self.last_output, self.last_abort = None, str(error)
        before = self.epsilon()
        opened = getattr(error, "opened", None)
        log.warning("DMM round %s aborted: %s", server_round, error)
        metrics["dmm-aborted"] = 1
        if opened is not None:
            self._account(server_round, opened)
            metrics["dmm-opened"] = 1
            self.halted = f"round {server_round} aborted after its release was opened: {error}"
        else:
            self.aborted_rounds += 1  # no step spent: later rounds move one step closer
        if isinstance(error, StateLost) or opened is not None:  # no later round can run
            self.halted = self.halted or str(error)
            metrics["dmm-halted"] = 1
        self._log_rejected(server_round, rejected)
        metrics["rejected"] = sorted(rejected)
        now = self.epsilon()
        metrics["epsilon"] = now
        metrics["dmm-epsilon-cost"] = now - before if math.isfinite(before) else math.inf
        if opened is not None:
            self.aborted_releases.append(
                {
                    "round": server_round,
                    "clients": opened.clients,
                    "epsilon_cost": metrics["dmm-epsilon-cost"],
                }
            )
        self._round = {}
        return metrics

    def _persist(self, server_round: int, output: RoundOutput) -> None:
        """The committee now holding the state stores it, sealed, as its members' own state."""
        if output.handed_over:
            retired, self.committee = self.committee, list(self._round["next"])
            self.committee_round = server_round + 1
        else:
            retired = []
            if output.handoff_error:
                log.warning(
                    "DMM round %s: the state stays with this committee: %s",
                    server_round, output.handoff_error,
                )
        if self.mode == "full" and self.host is not None:
            self.host.persist(self.server.pool, output.holders, server_round, forget=retired)

    def _apply(self, server_round: int, output: RoundOutput):
        """g + gamma * unrotate(x_hat_t) / expected_clients through the wrapped strategy."""
        reference = to_numpy(self._global)
        signs = self.encoder.signs(self.rotation_seed())
        mean = unrotate(output.estimate * self.encoder.gamma, signs, self.encoder.dim)
        mean /= self.expected_clients
        tree = unflatten(mean, reference)
        new = {k: (v.astype(np.float64) + tree[k]).astype(v.dtype) for k, v in reference.items()}
        key = getattr(self.strategy, "arrayrecord_key", "arrays")
        content = RecordDict({key: to_record(new), "metrics": MetricRecord({"num-examples": 1})})
        arrays, aggregated = self.strategy.aggregate_train(
            server_round, [server_reply(content, server_round)]
        )
        return arrays, aggregated if aggregated is not None else MetricRecord()

    def _round_metrics(self, output: RoundOutput, rejected, replies) -> dict[str, Any]:
        from protocols.kit import NEW_ID_BASE, OLD_ID_BASE  # noqa: PLC0415

        t = output.transcript

        def mean_over(ids, direction: str) -> float:
            values = [t.nbytes(**{direction: i}) for i in ids]
            values = [v for v in values if v]
            return float(np.mean(values)) if values else 0.0

        seats = range(self.scheme.n)
        out: dict[str, Any] = {
            "dmm-clients": output.contributors or len(output.clients),
            "dmm-step": self.server.step,
            "dmm-bytes": t.nbytes(),
            "dmm-bytes-per-client": self._bytes_per_client(t),
            "dmm-bytes-per-member-sent": float(
                np.mean([t.nbytes(sender=SEAT_ID_BASE + j) for j in seats])
                + np.mean([t.nbytes(sender=OLD_ID_BASE + j) for j in seats])
            ),
            "dmm-bytes-per-member-received": mean_over(
                [SEAT_ID_BASE + j for j in seats], "receiver"
            ),
            "dmm-bytes-per-next-member-received": mean_over(
                [NEW_ID_BASE + j for j in seats], "receiver"
            ),
            "dmm-verified": int(output.verified),
            "dmm-corrected-members": [self._seat_client(s) for s in output.corrected],
            "dmm-rejected-members": [self._seat_client(s) for s in sorted(output.rejected_members)],
            "dmm-member-dropouts": len(output.dropped),
            "dmm-beyond-bound": int(len(output.dropped) > self.member_dropouts),
            "dmm-handed-over": int(output.handed_over),
            "rejected": sorted(rejected),
            "epsilon": self.epsilon(),
        }
        for seat, reason in output.rejected_members.items():
            log.warning("DMM round %s: member seat %s rejected: %s", output.step, seat, reason)
        self._log_rejected(self._round["round"], rejected)
        in_clear = [r for r in replies if not r.has_error() and "metrics" in r.content]
        if in_clear:
            out["metrics_in_clear"] = 1
            losses = [
                float(r.content["metrics"]["train_loss"])
                for r in in_clear
                if "train_loss" in r.content["metrics"]
            ]
            if losses:
                out["train_loss"] = float(np.mean(losses))
        return out

    def _bytes_per_client(self, transcript) -> float:
        """SHARE bytes the clients (or their workers' folds) sent, per client that sent."""
        sent = self._round["sent"]
        batches = self._round.get("batches", {})
        senders = {self._party(nodes): len(nodes) for nodes in batches.values()}
        folded = {n for nodes in batches.values() for n in nodes}
        senders.update({p: 1 for node, p in sent.items() if node not in folded})
        counted = {p: w for p, w in senders.items() if transcript.nbytes(sender=p)}
        total = sum(transcript.nbytes(sender=p) for p in counted)
        return float(total / sum(counted.values())) if counted else 0.0

    def _seat_client(self, seat: int) -> int:
        """The client id of seat ``seat`` of this round's committee."""
        return int(self._round["committee"][seat])

    @staticmethod
    def _log_rejected(server_round: int, rejected: dict[int, str]) -> None:
        for node, reason in sorted(rejected.items()):
            log.warning("DMM round %s: reply of node %s rejected: %s", server_round, node, reason)


OPTIONS = (
    "clipping_norm",
    "noise_multiplier",
    "kind",
    "bands",
    "committee_size",
    "threshold",
    "packing",
    "member_dropouts",
    "fractional_bits",
    "mode",
    "bits",
    "delta",
    "min_clients",
    "expected_client_dropout",
    "committee_actors",
    "committee_shards",
    "worker_fold",
    "reshare_checks",
)


def from_options(
    options: dict[str, Any],
    *,
    rounds: int,
    expected_clients: float,
    population: int,
    seed: int,
    participation: Participation | None = None,
    evaluate_fraction: float = 0.0,
    metrics_in_clear: bool = False,
) -> DMM:
    """ "dmm" from a config's ``strategy.options``: ``clipping_norm``, ``noise_multiplier``
    (required); ``kind`` ("banded", default; "toeplitz", "tree", "honaker") and ``bands``
    (default: the min separation, at most rounds - 1); ``committee_size`` (20), ``threshold``
    (3), ``packing`` (3), ``member_dropouts`` (3), ``fractional_bits`` (12 banded, 0 tree),
    ``mode`` ("full"), ``bits`` (20), ``delta`` (1e-5), ``min_clients`` (1),
    ``expected_client_dropout`` (0), ``committee_actors`` (false; true hosts members on Ray
    actors), ``committee_shards`` (4), ``worker_fold`` (false; true folds each worker
    batch's sharing inputs into one sealed message, :mod:`strategies.dmm_fold`) and
    ``reshare_checks`` (1: a handoff needs t + k + 1 dealers, so that a wrong dealing is
    caught). ``participation`` is the engine's schedule (a b-min-separation
    :class:`~fedsim.privacy.participation.Participation`; None: every client may be in every
    round)."""
    from flwr.serverapp.strategy import FedAvg  # noqa: PLC0415

    from fedsim.privacy.matrix.build import Spec, build  # noqa: PLC0415

    for key in options:
        if key not in OPTIONS:
            raise ValueError(f"strategy.options.{key}={options[key]!r}; allowed: one of {OPTIONS}")
    for key in ("clipping_norm", "noise_multiplier"):
        if key not in options:
            raise ValueError(f"strategy.options.{key} is required (a number)")
    participation = Participation.separated(1) if participation is None else participation
    if participation.kind != "min_sep":
        raise ValueError(
            f"participation = {participation!r}; allowed: a b-min-separation Participation "
            "(Participation.separated(b, k)) or None (every client may be in every round)"
        )
    sep = int(participation.min_sep)
    k = participation.participations(rounds)
    kind = options.get("kind", "banded")
    bands = options.get("bands")
    if bands is None and kind in dmm_privacy.BANDED_KINDS:
        bands = max(1, min(sep, rounds - 1))
    spec = Spec(kind=kind, rounds=rounds, bands=bands, participations=k, min_sep=sep)
    participation = Participation.separated(sep, k)
    inner = FedAvg(
        fraction_train=1.0,
        fraction_evaluate=evaluate_fraction,
        min_train_nodes=0,
        min_evaluate_nodes=0,
        min_available_nodes=0,
    )
    return DMM(
        inner,
        factorization=build(spec),
        population=int(population),
        committee_size=int(options.get("committee_size", 20)),
        threshold=int(options.get("threshold", 3)),
        packing=int(options.get("packing", 3)),
        member_dropouts=int(options.get("member_dropouts", 3)),
        fractional_bits=options.get("fractional_bits"),
        clipping_norm=float(options["clipping_norm"]),
        noise_multiplier=float(options["noise_multiplier"]),
        expected_clients=max(1, round(expected_clients)),
        seed=seed,
        mode=options.get("mode", "full"),
        participation=participation,
        expected_client_dropout=float(options.get("expected_client_dropout", 0.0)),
        min_clients=int(options.get("min_clients", 1)),
        bits=int(options.get("bits", 20)),
        delta=float(options.get("delta", 1e-5)),
        committee_actors=options.get("committee_actors", False),
        committee_shards=int(options.get("committee_shards", 4)),
        worker_fold=options.get("worker_fold", False),
        metrics_in_clear=metrics_in_clear,
        reshare_checks=options.get("reshare_checks", 1),
    )


NAME = "dmm"


def _always(options: Mapping[str, Any]) -> bool:
    """DMM's clients reply only their sealed shares (or, ideal mode, their integers)."""
    return True


def _build(options: Mapping[str, Any], facts: RunFacts) -> DMM:
    """:func:`from_options` with the run's facts; a bad option is a ConfigError."""
    rounds = facts.required("rounds", f"the run's rounds (required by {NAME})")
    population = facts.required("population", "the registered clients")
    try:
        return from_options(
            dict(options),
            rounds=rounds,
            expected_clients=facts.expected_clients,
            population=population,
            seed=facts.seed,
            participation=facts.participation,
            evaluate_fraction=facts.evaluate_fraction,
            metrics_in_clear=facts.metrics_in_clear,
        )
    except ValueError as err:
        raise ConfigError("strategy.options", dict(options), str(err)) from err


SPEC = StrategySpec(
    name=NAME,
    build=_build,
    accounting=Accounting(
        ledger="per round whose release the server can determine (released, or aborted after "
        "more than t members' shares reached it), the increase of the discrete-Gaussian zCDP "
        "bound of the integer matrix's rows released so far, counting only the noise actually "
        "present (KLS21); zero-out neighbours; any per-client metric the server receives is "
        "unaccounted (epsilon infinite)",
    ),
    client_app=dmm_client_app,
    secure_replies=_always,
)
