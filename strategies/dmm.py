"""The distributed matrix mechanism (DMM) as a Flower strategy.

Bienstock, Kumar & Polychroniadou, ICML 2025 (reference/dmm.md). Each round the sampled clients
(:func:`dmm_client_app` around any training ClientApp) clip, rotate, scale by 1/gamma and
conditionally round their update to integers (KLS21, :class:`protocols.encoding.DDGaussEncoder`)
and draw local discrete Gaussian noise N_Z(0, s^2) for every noise row the factorization draws
this step. The committee protocol (:class:`protocols.dmm.DMMCommitteeProtocol`) combines,
applies the integer noising matrix M = round(2^f G), releases 2^f U_t + w_t and reshares its
noise state to the next committee. The server decodes

    x_t + (G' z)_t = (2^f U_t + w_t) / 2^f   (integer units)  -> times gamma, inverse rotation,

divides by the planned cohort ``expected_clients`` and hands ``g + mean`` to the wrapped Flower
strategy (FedAvg: the noisy-gradient form of DP-FTRL / BandMF, as in
:mod:`strategies.matrix_mechanism`).

Where sharing happens. ``mode="full"``: :meth:`DMM.configure_train` opens the round (the
online members publish fresh X25519 keys, :meth:`DMMCommitteeProtocol.open_round`) and sends
every sampled client the public :class:`protocols.dmm.RoundKeys` (``dmm.share.*``: n, t, k,
field, D, session id, round, step, the member keys) and its channel party id. The *client*
packed-Shamir-shares its update and noise rows and seals one ChaCha20-Poly1305 envelope per
member under its own ephemeral X25519 key (:func:`protocols.dmm.seal_client_shares`); its reply
holds only those ciphertexts and its public key (``dmm.sealed``). The server relays the
envelopes to the members (:meth:`DMMCommitteeProtocol.run_sealed_round`), holds no key that
opens them, and sees only the noisy release. A client whose envelope fails authentication at a
member (tampered, misaddressed) or is missing counts as dropped: its update and noise are in no
sum, and the accountant counts only the noise present. ``mode="ideal"`` is the no-cryptography
reference: clients reply their plaintext ``dmm.update`` / ``dmm.noise`` and the protocol sums
the same integers, so both modes release identical aggregates for the same seeds (the share
randomness cancels in every sum). With ``committee_actors=True`` (full mode) every committee
member is a Ray actor (:mod:`fedsim.engine.dmm_committee`) that holds its own shares of the
noise state across rounds, opens the clients' envelopes, combines locally, releases its share
and deals its part of the handoff to the next committee's actors; releases are bit-identical
to the in-process committee.

Calibration: each noise row should carry central std sigma = z * c * sens(C') when
``(1 - expected_client_dropout) * expected_clients`` clients contribute, so each client adds
s = sigma / sqrt((1 - expected_client_dropout) * m) real units (s / gamma integer units).

Configuration is validated together before any client trains (:meth:`DMM.check`): t + k <= n -
ceil(expected_member_dropout * n), and the worst-case release |2^f U_t + w_t| fits (p - 1)/2
(:meth:`protocols.field.MersenneField.sum_headroom_bits`, with the summed noise's tail bound at
``failure_probability``). Accounting: :mod:`fedsim.privacy.dmm` for C', the participation and
the fewest clients whose noise is actually present; epsilon so far is in every round's metrics
and :meth:`DMM.privacy_report`.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import Any, Literal

import numpy as np
from flwr.app import ArrayRecord, ConfigRecord, Context, Message, MetricRecord, RecordDict
from flwr.clientapp import ClientApp
from flwr.serverapp import Grid
from flwr.serverapp.strategy import Strategy

from fedsim.engine.reduce import partial_reply
from fedsim.privacy import dmm as dmm_privacy
from fedsim.privacy.accounting import NeighbouringRelation, PrivacyLedger
from fedsim.privacy.matrix.factorization import Factorization
from fedsim.privacy.matrix.sensitivity import Participation
from fedsim.privacy.mechanisms import SecureRandom, discrete_gaussian
from fedsim.records import to_numpy, to_record
from protocols.channels import Envelope, stage_label
from protocols.dmm import (
    MEMBER_ID_BASE,
    DMMCommitteeProtocol,
    DMMFaults,
    DMMStage,
    ReleaseTampering,
    RoundAborted,
    RoundKeys,
    SealedShares,
    StateLost,
    seal_client_shares,
)
from protocols.encoding import (
    DEFAULT_BETA,
    DEFAULT_FAILURE_PROBABILITY,
    DDGaussEncoder,
    choose_gamma,
    noise_tail_bound,
    unrotate,
)
from protocols.field import MersenneField
from protocols.resharing import ReshareAbort, ReshareTampering
from protocols.shamir import PackedShamir
from strategies.ddgauss import _instruction_parts, local_update, unflatten
from strategies.wrapper import StrategyWrapper, server_reply

UPDATE_KEY = "dmm.update"
NOISE_KEY = "dmm.noise"
SEALED_KEY = "dmm.sealed"
PREFIX = "dmm."
SHARE_PREFIX = "dmm.share."
_KEYS = ("dim", "clip", "gamma", "beta", "max-tries", "rotation-seed", "seed", "noise-std", "rows")
_SHARE_KEYS = ("round", "step", "n", "t", "k", "field-exponent", "dim", "session")
_SHARE_KEYS += ("members", "member-keys", "party")


def round_keys_config(keys: RoundKeys, party: int, share_seed: int | None) -> dict[str, Any]:
    """The ``dmm.share.*`` config entries of one client's full-mode instruction: the round's
    public :class:`protocols.dmm.RoundKeys` and the client's channel party id (plus
    ``share-seed`` for reproducible share randomness in simulation)."""
    if keys.session_id is None:
        raise ValueError("keys.session_id=None; clients share only over encrypted channels")
    members = sorted(keys.member_keys)
    out: dict[str, Any] = {
        "round": keys.round,
        "step": keys.step,
        "n": keys.n,
        "t": keys.t,
        "k": keys.k,
        "field-exponent": keys.field_exponent,
        "dim": keys.dim,
        "session": keys.session_id,
        "members": members,
        "member-keys": [keys.member_keys[j] for j in members],
        "party": int(party),
    }
    if share_seed is not None:
        out["share-seed"] = int(share_seed)
    return {SHARE_PREFIX + k: v for k, v in out.items()}


def round_keys_from_config(config: ConfigRecord, rows: int) -> tuple[RoundKeys, int, int | None]:
    """(keys, party, share seed or None) from an instruction's ``dmm.share.*`` entries."""
    missing = [SHARE_PREFIX + k for k in _SHARE_KEYS if SHARE_PREFIX + k not in config]
    if missing:
        raise ValueError(f"the full-mode instruction's config lacks {missing}")
    members = [int(j) for j in config[SHARE_PREFIX + "members"]]
    member_keys = list(config[SHARE_PREFIX + "member-keys"])
    if len(members) != len(member_keys):
        raise ValueError(
            f"{SHARE_PREFIX}members has {len(members)} entries but {SHARE_PREFIX}member-keys "
            f"has {len(member_keys)}; allowed: one key per member"
        )
    keys = RoundKeys(
        round=int(config[SHARE_PREFIX + "round"]),
        step=int(config[SHARE_PREFIX + "step"]),
        rows=int(rows),
        n=int(config[SHARE_PREFIX + "n"]),
        t=int(config[SHARE_PREFIX + "t"]),
        k=int(config[SHARE_PREFIX + "k"]),
        field_exponent=int(config[SHARE_PREFIX + "field-exponent"]),
        dim=int(config[SHARE_PREFIX + "dim"]),
        session_id=bytes(config[SHARE_PREFIX + "session"]),
        member_keys=dict(zip(members, (bytes(key) for key in member_keys))),
    )
    seed = config.get(SHARE_PREFIX + "share-seed")
    return keys, int(config[SHARE_PREFIX + "party"]), None if seed is None else int(seed)


def sealed_to_record(sealed: SealedShares) -> ConfigRecord:
    """A client's sealed shares as its reply record: its public key and, per member, the
    envelope's nonce and ciphertext (the header is the server's to rebuild)."""
    members = sorted(sealed.shares)
    envelopes = [sealed.shares[j] for j in members]
    if not all(isinstance(e, Envelope) for e in envelopes):
        raise ValueError("sealed.shares must all be Envelopes; clients never send plain shares")
    return ConfigRecord(
        {
            "public-key": sealed.public_key,
            "members": members,
            "nonces": [e.nonce for e in envelopes],
            "ciphertexts": [e.ciphertext for e in envelopes],
        }
    )


def sealed_from_record(record: ConfigRecord, party: int, round_: int) -> SealedShares:
    """The server's view of a reply: envelopes from the client's *assigned* ``party`` to each
    member for ``round_`` at SHARE (a client that sealed under other ids fails authentication
    at the members)."""
    members = [int(j) for j in record.get("members", [])]
    nonces = list(record.get("nonces", []))
    ciphertexts = list(record.get("ciphertexts", []))
    if not len(members) == len(nonces) == len(ciphertexts) or "public-key" not in record:
        raise ValueError(
            f"a sealed reply needs public-key and equally long members, nonces, ciphertexts; got "
            f"{len(members)}, {len(nonces)}, {len(ciphertexts)}"
        )
    label = stage_label(DMMStage.SHARE)
    shares = {
        j: Envelope(party, MEMBER_ID_BASE + j, int(round_), label, bytes(nonce), bytes(body))
        for j, nonce, body in zip(members, nonces, ciphertexts)
    }
    return SealedShares(int(party), bytes(record["public-key"]), shares)


def dmm_client_app(inner: ClientApp, secure_noise: bool = False) -> ClientApp:
    """A ClientApp that runs ``inner``, rounds its update, draws its noise rows and, in full
    mode, shares and seals both itself.

    The rounded update u_i (D signed integers) and the noise rows (rows x D, N_Z(0, s^2) with
    s = ``dmm.noise-std`` integer units) draw from ``SeedSequence([seed, server_round,
    partition_id])`` (simulation), the noise from the OS with ``secure_noise``. Full mode
    (``dmm.mode = "full"``): the instruction carries the committee's public keys
    (``dmm.share.*``); the client packed-Shamir-shares u_i and its noise rows and seals each
    member's shares under its own ephemeral X25519 key
    (:func:`protocols.dmm.seal_client_shares`; share randomness from the OS, or from
    ``SeedSequence([share-seed, server_round, partition_id])`` when the server set one for
    reproducible simulation), and replies ``dmm.sealed`` (its public key, one nonce and
    ciphertext per member) and its metrics: nothing the server can open. Ideal mode (the
    no-cryptography reference) replies the plaintext ``dmm.update`` and ``dmm.noise``.
    """
    app = ClientApp()

    @app.train()
    def train(message: Message, context: Context) -> Message:
        _, global_record, config = _instruction_parts(message)
        missing = [PREFIX + k for k in _KEYS if PREFIX + k not in config]
        if missing:
            raise ValueError(f"the instruction's config lacks {missing}; is the server DMM?")
        encoder = DDGaussEncoder(
            dim=int(config[PREFIX + "dim"]),
            clip=float(config[PREFIX + "clip"]),
            gamma=float(config[PREFIX + "gamma"]),
            noise_std=0.0,
            beta=float(config[PREFIX + "beta"]),
            max_tries=int(config[PREFIX + "max-tries"]),
        )
        local = local_update(inner, message, context, global_record, config, PREFIX)
        if isinstance(local, Message):
            return local
        update, metrics, rng = local
        rounded, tries, clipped = encoder.quantise(
            update, int(config[PREFIX + "rotation-seed"]), rng
        )
        rows = int(config[PREFIX + "rows"])
        noise = discrete_gaussian(
            (rows, encoder.padded_dim),
            float(config[PREFIX + "noise-std"]),
            SecureRandom() if secure_noise else rng,
        )
        out = MetricRecord(dict(metrics))
        out["dmm.tries"] = tries
        out["dmm.clipped"] = int(clipped)
        mode = str(config.get(PREFIX + "mode", "ideal"))
        if mode not in ("full", "ideal"):
            raise ValueError(f"{PREFIX}mode={mode!r}; allowed: 'full', 'ideal'")
        if mode == "full":
            keys, party, share_seed = round_keys_from_config(config, rows)
            if keys.dim != encoder.padded_dim:
                raise ValueError(
                    f"{SHARE_PREFIX}dim={keys.dim} but the encoder pads to {encoder.padded_dim}"
                )
            share_rng = None
            if share_seed is not None:
                partition = int(context.node_config.get("partition-id", 0))
                share_rng = np.random.default_rng(
                    [share_seed, int(config.get("server-round", 0)), partition]
                )
            sealed = seal_client_shares(
                keys, party, rounded.astype(np.int64), noise.astype(np.int64), share_rng
            )
            content = RecordDict({SEALED_KEY: sealed_to_record(sealed), "metrics": out})
            return Message(content=content, reply_to=message)
        content = RecordDict(
            {
                UPDATE_KEY: to_record({UPDATE_KEY: rounded.astype(np.int64)}),
                NOISE_KEY: to_record({NOISE_KEY: noise.astype(np.int64)}),
                "metrics": out,
            }
        )
        return Message(content=content, reply_to=message)

    @app.evaluate()
    def evaluate(message: Message, context: Context) -> Message:
        return inner(message, context)

    return app


class DMM(StrategyWrapper):
    """Wrap a FedAvg-family strategy with the distributed matrix mechanism.

    Args:
        strategy: samples clients and applies the mean update.
        factorization: the public A = B C (prefix sums; :mod:`fedsim.privacy.matrix`: Honaker
            tree, binary tree, BandMF, ...); its n is the number of rounds.
        committee_size, threshold, packing: n, t, k of every committee (t + k shares
            reconstruct; any t reveal nothing).
        fractional_bits: f of M = round(2^f G); window: keep noise only ``window`` steps
            (None: as long as M uses it).
        clipping_norm, noise_multiplier: c and z (central std z c sens(C') per noise row).
        expected_clients: m, the planned cohort (the mean's denominator).
        expected_client_dropout, expected_member_dropout: fractions tolerated by the plan.
        participation: the schema sens(C') is computed for (single participation by default).
        seed: rotation seeds, clients' rounding/noise streams and injected faults.
        mode: 'full' (clients share and seal; the server relays ciphertexts) or 'ideal'
            (plaintext integers, the no-cryptography reference).
        bits: signed bits of the sum of m rounded updates (sets gamma; the noise term is
            budgeted separately in the field).
        field_exponent: p = 2^e - 1; delta: the run's delta.
        member_faults: per (member, stage) probability of 'drop' at each stage (simulation).
        share_rng_seed: seeds the share randomness of the clients (sent to them as
            ``dmm.share.share-seed``) and of the handoff, for reproducible simulation only
            (whoever knows it learns shared values from fewer than t shares); None, the
            secure default, draws it from each party's OS CSPRNG.
        committee_actors: full mode only: run the members as Ray actors (Ray must be running,
            e.g. the Ray engine backend); two pools of actors take turns as the current and the
            next committee; :meth:`close` ends them.
        committee_shards: member groups per committee (one actor or one in-process object
            each); None: one per member with actors, one for all members in process.
    """

    def __init__(
        self,
        strategy: Strategy,
        *,
        factorization: Factorization,
        committee_size: int,
        threshold: int,
        packing: int,
        fractional_bits: int,
        clipping_norm: float,
        noise_multiplier: float,
        expected_clients: int,
        seed: int,
        mode: Literal["full", "ideal"] = "full",
        window: int | None = None,
        participation: Participation | None = None,
        expected_client_dropout: float = 0.0,
        expected_member_dropout: float = 0.0,
        bits: int = 20,
        beta: float = DEFAULT_BETA,
        max_tries: int = 100,
        field_exponent: int = 61,
        delta: float = 1e-5,
        member_dropout: float = 0.0,
        failure_probability: float = DEFAULT_FAILURE_PROBABILITY,
        share_rng_seed: int | None = None,
        committee_actors: bool = False,
        committee_shards: int | None = None,
    ) -> None:
        for name, value in (
            ("clipping_norm", clipping_norm),
            ("noise_multiplier", noise_multiplier),
        ):
            if not (math.isfinite(value) and value > 0):
                raise ValueError(f"{name}={value!r}; it must be finite and > 0")
        if not isinstance(expected_clients, int) or expected_clients < 1:
            raise ValueError(f"expected_clients={expected_clients!r}; it must be an integer >= 1")
        for name, value in (
            ("expected_client_dropout", expected_client_dropout),
            ("expected_member_dropout", expected_member_dropout),
            ("member_dropout", member_dropout),
        ):
            if not 0.0 <= value < 1.0:
                raise ValueError(f"{name}={value!r}; allowed: a fraction in [0, 1)")
        if mode not in ("full", "ideal"):
            raise ValueError(f"mode={mode!r}; allowed: 'full', 'ideal'")
        if not isinstance(committee_actors, bool):
            raise ValueError(f"committee_actors={committee_actors!r}; allowed: True or False")
        if committee_actors and mode != "full":
            raise ValueError(
                f"committee_actors=True with mode={mode!r}; allowed only with mode='full' "
                "(ideal mode has no shares for members to hold)"
            )
        if committee_shards is not None and (
            isinstance(committee_shards, bool)
            or not isinstance(committee_shards, int)
            or not 1 <= committee_shards <= committee_size
        ):
            raise ValueError(
                f"committee_shards={committee_shards!r}; allowed: None or an integer in "
                f"[1, committee_size={committee_size}]"
            )
        field = MersenneField(field_exponent)
        scheme = PackedShamir(committee_size, threshold, packing, field)
        tolerated = math.ceil(expected_member_dropout * committee_size)
        if threshold + packing > committee_size - tolerated:
            raise ValueError(
                f"threshold + packing = {threshold} + {packing} > committee_size - expected "
                f"member dropouts = {committee_size} - {tolerated}: a committee could not "
                f"reconstruct; allowed: t + k <= {committee_size - tolerated}"
            )
        super().__init__(strategy)
        self.noising = dmm_privacy.IntegerNoising(
            factorization, fractional_bits, window, participation or Participation.single()
        )
        self.scheme = scheme
        self.clipping_norm = float(clipping_norm)
        self.noise_multiplier = float(noise_multiplier)
        self.expected_clients = expected_clients
        self.expected_client_dropout = float(expected_client_dropout)
        self.member_dropout = float(member_dropout)
        self.seed = int(seed)
        self.mode = mode
        self.bits, self.beta, self.max_tries = bits, beta, max_tries
        self.failure_probability = failure_probability
        self.share_rng_seed = share_rng_seed
        self.committee_actors = committee_actors
        self.committee_shards = committee_shards
        self.ledger = PrivacyLedger(NeighbouringRelation.ADD_REMOVE, delta)
        self.encoder: DDGaussEncoder | None = None
        self.protocol: DMMCommitteeProtocol | None = None
        self.last_release: np.ndarray | None = None
        self.last_clients: tuple[int, ...] = ()
        self.last_abort: str | None = None
        self.halted: str | None = None
        self._zcdp = 0.0
        self._global: tuple[str, ArrayRecord] | None = None
        self._faults = DMMFaults()
        self._round_keys: RoundKeys | None = None
        self._parties: dict[int, int] = {}

    # ------------------------------------------------------------------ configuration
    @property
    def sensitivity(self) -> float:
        """sens(C') of the implemented matrix over all n rounds."""
        return self.noising.sensitivity.value

    @property
    def client_noise_std(self) -> float:
        """s (real units): z c sens(C') / sqrt(planned contributing clients)."""
        planned = max(1.0, (1.0 - self.expected_client_dropout) * self.expected_clients)
        return self.noise_multiplier * self.clipping_norm * self.sensitivity / math.sqrt(planned)

    def check(self, dim: int) -> DDGaussEncoder:
        """Validate the bit budget for models of ``dim`` parameters and build the encoder;
        raises ``ValueError`` with the budget when 2^f U_t + w_t could wrap mod p."""
        # gamma: the sum U_t of m rounded updates fits `bits` signed bits; the noise term w_t
        # is budgeted in the field check below
        gamma = choose_gamma(
            dim, self.expected_clients, self.clipping_norm, 0.0, self.bits, beta=self.beta
        )
        encoder = DDGaussEncoder(dim, self.clipping_norm, gamma, 0.0, self.beta, self.max_tries)
        scaled = self.client_noise_std / gamma
        if scaled < 0.5:
            raise ValueError(
                f"each client's noise is {scaled:.3g} integer steps (gamma={gamma:.3g}); KLS21 "
                f"needs >= 1/2: raise bits (now {self.bits}) or noise_multiplier"
            )
        rows = self.noising.integer_matrix.shape[1]
        tail = noise_tail_bound(
            scaled * math.sqrt(self.expected_clients),
            encoder.padded_dim * rows,
            self.failure_probability,
        )
        f = self.noising.fractional_bits
        try:
            self.scheme.field.sum_headroom_bits(
                self.expected_clients,
                encoder.l2_bound * 2.0**f,
                self.noising.max_row_l1() * tail,
            )
        except ValueError as error:
            raise ValueError(
                f"bit budget: 2^f U_t + w_t with fractional_bits={f}, bits={self.bits}, "
                f"expected_clients={self.expected_clients} and max row |M| = "
                f"{self.noising.max_row_l1()} does not fit F_p (p = 2^"
                f"{self.scheme.field.exponent} - 1): {error}"
            ) from error
        self._scaled_noise_std = scaled
        return encoder

    def encoder_for(self, dim: int) -> DDGaussEncoder:
        if self.encoder is None or self.encoder.dim != dim:
            self.encoder = self.check(dim)
            rng = (
                None if self.share_rng_seed is None else np.random.default_rng(self.share_rng_seed)
            )
            self.close()
            if self.committee_actors:
                from fedsim.engine.dmm_committee import actor_committee  # noqa: PLC0415

                self.protocol = actor_committee(
                    self.scheme,
                    self.noising,
                    self.encoder.padded_dim,
                    shards=self.committee_shards,
                    rng=rng,
                )
            else:
                self.protocol = DMMCommitteeProtocol(
                    self.scheme,
                    self.noising,
                    self.encoder.padded_dim,
                    mode=self.mode,
                    rng=rng,
                    shards=self.committee_shards or 1,
                )
        return self.encoder

    def close(self) -> None:
        """Release the committee (ends its actors with ``committee_actors``)."""
        if self.protocol is not None:
            self.protocol.close()

    def rotation_seed(self, server_round: int) -> int:
        """The run's public rotation seed, the same in every round: the noise G'z of round t
        combines noise rows drawn in earlier rounds, and it only cancels across rounds as the
        factorization intends when every round uses the same basis."""
        return int(np.random.SeedSequence([self.seed, 1]).generate_state(1)[0])

    # ------------------------------------------------------------------ accounting
    def epsilon(self) -> float:
        return self.ledger.epsilon() if len(self.ledger) else 0.0

    def privacy_report(self) -> dict[str, Any]:
        counts = self.protocol.noise_counts if self.protocol else {}
        return {
            "epsilon": self.epsilon(),
            "delta": self.ledger.delta,
            "accountant": "rdp",
            "relation": self.ledger.relation.value,
            "rounds_accounted": len(self.ledger),
            "steps": self.protocol.step if self.protocol else 0,
            "factorization": self.noising.factorization.kind,
            "fractional_bits": self.noising.fractional_bits,
            "sensitivity_implemented": self.sensitivity,
            "sensitivity_exact": self.noising.sensitivity.exact,
            "fewest_noise_clients": min(counts.values()) if counts else None,
            "bound": "KLS21 Theorem 1 on C' = implemented integer matrix, noise present only",
        }

    def _account(self, server_round: int) -> None:
        steps = self.protocol.step
        counts = self.protocol.noise_counts
        eps = dmm_privacy.run_zcdp_epsilon(
            self.noising,
            steps,
            self.encoder.l2_bound,
            self.encoder.l1_bound,
            self._scaled_noise_std,
            min(counts.values()) if counts else 0,
            self.encoder.padded_dim,
        )
        self.ledger.record(server_round, dmm_privacy.increment_event(self._zcdp, eps))
        self._zcdp = max(self._zcdp, eps)

    # ------------------------------------------------------------------ rounds
    def configure_train(
        self, server_round: int, arrays: ArrayRecord, config: ConfigRecord, grid: Grid
    ) -> Iterable[Message]:
        reference = to_numpy(arrays)
        encoder = self.encoder_for(int(sum(v.size for v in reference.values())))
        if self.halted:
            return []
        step = self.protocol.step
        if step >= self.noising.n:
            raise ValueError(
                f"server round {server_round} needs step {step} but the factorization has "
                f"n = {self.noising.n} rounds; build it for more rounds"
            )
        extended = ConfigRecord(dict(config))
        extended["server-round"] = server_round
        extended.update(
            {
                PREFIX + "dim": encoder.dim,
                PREFIX + "clip": encoder.clip,
                PREFIX + "gamma": encoder.gamma,
                PREFIX + "beta": encoder.beta,
                PREFIX + "max-tries": encoder.max_tries,
                PREFIX + "rotation-seed": self.rotation_seed(server_round),
                PREFIX + "seed": self.seed,
                PREFIX + "noise-std": self._scaled_noise_std,
                PREFIX + "rows": int(self.noising.rows_drawn_at(step).size),
                PREFIX + "mode": self.mode,
            }
        )
        self._global = (getattr(self.strategy, "arrayrecord_key", "arrays"), arrays)
        messages = list(self.strategy.configure_train(server_round, arrays, extended, grid))
        self._faults = self.round_faults(server_round)
        if self.mode != "full":
            return messages
        # the committee publishes fresh keys; each sampled client gets them and its party id
        self._round_keys = self.protocol.open_round(self._faults, server_round)
        self._parties = {}
        for party, message in enumerate(messages):
            self._parties[int(message.metadata.dst_node_id)] = party
            share = round_keys_config(self._round_keys, party, self.share_rng_seed)
            message.content = RecordDict(
                {
                    name: ConfigRecord({**dict(record), **share})
                    if isinstance(record, ConfigRecord)
                    else record
                    for name, record in message.content.items()
                }
            )
        return messages

    def round_faults(self, server_round: int) -> DMMFaults:
        """Members that drop, each stage with probability ``member_dropout`` (seeded)."""
        if self.member_dropout == 0:
            return DMMFaults()
        rng = np.random.default_rng([self.seed, server_round, 5])
        plan = {}
        stages = (DMMStage.SHARE, DMMStage.COMBINE, DMMStage.RELEASE, DMMStage.RESHARE)
        for j in range(self.scheme.n):
            for stage in stages:
                if rng.random() < self.member_dropout:
                    plan[(j, stage)] = "drop"
                    break
        nxt = frozenset(
            int(j) for j in np.flatnonzero(rng.random(self.scheme.n) < self.member_dropout)
        )
        return DMMFaults(member=plan, next_drop=nxt, seed=int(rng.integers(2**31)))

    def _run_protocol(self, server_round: int, valid: list[Message]):
        """Full mode: relay the replies' sealed shares (the server never holds a plaintext
        update or noise row; a reply that is not a well-formed sealed message counts as a
        dropout). Ideal mode: the plaintext integers of the no-cryptography reference."""
        if self.mode == "full":
            keys = self._round_keys
            if keys is None:
                raise RuntimeError("aggregate_train in full mode before configure_train")
            self._round_keys = None
            sealed = {}
            for reply in valid:
                node = int(reply.metadata.src_node_id)
                party = self._parties.get(node)
                record = reply.content.get(SEALED_KEY)
                if party is None or not isinstance(record, ConfigRecord):
                    continue
                try:
                    sealed[node] = sealed_from_record(record, party, keys.round)
                except ValueError:
                    continue
            return self.protocol.run_sealed_round(sealed)
        rows = int(self.noising.rows_drawn_at(self.protocol.step).size)
        updates, noises = {}, {}
        for reply in valid:
            node = int(reply.metadata.src_node_id)
            updates[node] = np.asarray(to_numpy(reply.content[UPDATE_KEY])[UPDATE_KEY])
            noise = np.asarray(to_numpy(reply.content[NOISE_KEY])[NOISE_KEY])
            noises[node] = noise.reshape(rows, self.encoder.padded_dim)
        return self.protocol.run_round(
            updates, noises, self.round_faults(server_round), server_round
        )

    def aggregate_train(
        self, server_round: int, replies: Iterable[Message]
    ) -> tuple[ArrayRecord | None, MetricRecord | None]:
        if self._global is None or self.encoder is None:
            raise RuntimeError("aggregate_train called before configure_train")
        metrics = MetricRecord({"dmm-planned": self.expected_clients})
        if self.halted:
            metrics["dmm-halted"] = 1
            metrics["epsilon"] = self.epsilon()
            return None, metrics
        key, global_record = self._global
        reference = to_numpy(global_record)
        valid = [r for r in replies if not r.has_error()]
        handoff_error = None
        try:
            output = self._run_protocol(server_round, valid)
        except (RoundAborted, ReleaseTampering) as error:
            self.last_release, self.last_clients = None, ()
            self.last_abort = str(error)
            metrics["dmm-aborted"] = 1
            if isinstance(error, StateLost):  # the noise state is gone: no later round can run
                self.halted = str(error)
                metrics["dmm-halted"] = 1
            metrics["epsilon"] = self.epsilon()
            return None, metrics
        except (ReshareAbort, ReshareTampering) as error:
            # the release happened; the state could not be handed on
            handoff_error = error
            output = self.protocol.last_output
        self.last_release = output.release
        self.last_clients = output.clients
        self._account(server_round)
        real = output.release.astype(np.float64) / 2.0**self.noising.fractional_bits
        signs = self.encoder.signs(self.rotation_seed(server_round))
        mean_update = unrotate(real * self.encoder.gamma, signs, self.encoder.dim)
        mean_update /= self.expected_clients
        updates_tree = unflatten(mean_update, reference)
        new = {
            k: (v.astype(np.float64) + updates_tree[k]).astype(v.dtype)
            for k, v in reference.items()
        }
        content = RecordDict({key: to_record(new), "metrics": MetricRecord({"num-examples": 1})})
        reply = partial_reply(valid[0], content) if valid else server_reply(content, server_round)
        arrays, aggregated = self.strategy.aggregate_train(server_round, [reply])
        aggregated = aggregated if aggregated is not None else MetricRecord()
        aggregated.update(dict(metrics))
        aggregated["dmm-clients"] = len(output.clients)
        aggregated["dmm-step"] = self.protocol.step
        aggregated["dmm-bytes"] = output.transcript.nbytes()
        aggregated["dmm-faulty-members"] = len(output.faulty)
        aggregated["epsilon"] = self.epsilon()
        if handoff_error is not None:
            self.halted = str(handoff_error)
            aggregated["dmm-halted"] = 1
        return arrays, aggregated


OPTIONS = (
    "clipping_norm",
    "noise_multiplier",
    "kind",
    "bands",
    "committee_size",
    "threshold",
    "packing",
    "fractional_bits",
    "window",
    "mode",
    "bits",
    "delta",
    "expected_client_dropout",
    "expected_member_dropout",
    "member_dropout",
    "committee_actors",
    "committee_shards",
)


def from_options(
    options: dict[str, Any],
    *,
    rounds: int,
    expected_clients: float,
    seed: int,
    min_separation: int | None,
    max_participations: int | None,
    evaluate_fraction: float = 0.0,
) -> DMM:
    """ "dmm" from a config's ``strategy.options``: ``clipping_norm``, ``noise_multiplier``
    (required); ``kind`` ("honaker", default; any kind of :mod:`fedsim.privacy.matrix.build`)
    and ``bands``; ``committee_size`` (10), ``threshold`` (2), ``packing`` (3),
    ``fractional_bits`` (12), ``window``, ``mode`` ("full"), ``bits`` (20), ``delta`` (1e-5),
    ``expected_client_dropout``, ``expected_member_dropout``, ``member_dropout`` (0),
    ``committee_actors`` (false; true runs the members as Ray actors, full mode and the Ray
    engine backend) and ``committee_shards`` (actors per committee; default one per member).
    The participation (min separation, participations) comes from the engine's schedule."""
    from flwr.serverapp.strategy import FedAvg  # noqa: PLC0415

    from fedsim.privacy.matrix.build import Spec, build  # noqa: PLC0415

    for key in options:
        if key not in OPTIONS:
            raise ValueError(f"strategy.options.{key}={options[key]!r}; allowed: one of {OPTIONS}")
    for key in ("clipping_norm", "noise_multiplier"):
        if key not in options:
            raise ValueError(f"strategy.options.{key} is required (a number)")
    actors = options.get("committee_actors", False)
    if not isinstance(actors, bool):
        raise ValueError(f"strategy.options.committee_actors={actors!r}; allowed: true or false")
    shards = options.get("committee_shards")
    if shards is not None and (isinstance(shards, bool) or not isinstance(shards, int)):
        raise ValueError(
            f"strategy.options.committee_shards={shards!r}; allowed: an integer in "
            "[1, committee_size]"
        )
    # no schedule: every client may be in every round (1-min-separation, `rounds` times)
    sep = 1 if min_separation is None else int(min_separation)
    k = -(-rounds // sep) if max_participations is None else int(max_participations)
    spec = Spec(
        kind=options.get("kind", "honaker"),
        rounds=rounds,
        bands=options.get("bands"),
        participations=k,
        min_sep=sep,
    )
    participation = Participation(kind="min_sep", min_sep=sep, max_participations=k)
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
        committee_size=int(options.get("committee_size", 10)),
        threshold=int(options.get("threshold", 2)),
        packing=int(options.get("packing", 3)),
        fractional_bits=int(options.get("fractional_bits", 12)),
        clipping_norm=float(options["clipping_norm"]),
        noise_multiplier=float(options["noise_multiplier"]),
        expected_clients=max(1, round(expected_clients)),
        seed=seed,
        mode=options.get("mode", "full"),
        window=options.get("window"),
        participation=participation,
        expected_client_dropout=float(options.get("expected_client_dropout", 0.0)),
        expected_member_dropout=float(options.get("expected_member_dropout", 0.0)),
        bits=int(options.get("bits", 20)),
        delta=float(options.get("delta", 1e-5)),
        member_dropout=float(options.get("member_dropout", 0.0)),
        committee_actors=actors,
        committee_shards=shards,
    )
