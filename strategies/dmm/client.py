"""DMM's client side: :func:`dmm_client_app` around any training ClientApp (docs/dmm-design.md,
steps 1 and 3): clip, rotate, scale by 1/gamma and round (KLS21), draw one fresh noise row
N_Z(0, s^2)^D per released row, and in full mode share and seal both to the committee's seats
(or hand them to the worker's fold, :mod:`strategies.dmm.fold`) -- all from the client's own
secret, never from anything the server knows."""

from __future__ import annotations

from typing import Any

import numpy as np
from flwr.app import ArrayRecord, ConfigRecord, Context, Message, MetricRecord, RecordDict
from flwr.clientapp import ClientApp

from fedsim.engine.client_registry import (
    NUM_PARTITIONS_KEY,
    client_name,
    enrolled,
    public_committee,
)
from fedsim.privacy.mechanisms import discrete_gaussian
from fedsim.randomness import Purpose, RunSecret, client_secret
from fedsim.record_codec import to_numpy, to_record
from fedsim.worker_reduce import FOLDS_KEY, single
from protocols.channels import KeySubstitution
from protocols.dmm.client import check_seat_keys, mask_client_shares, seal_client_shares
from protocols.dmm.common import DMMSealedShares, RoundKeys
from protocols.encoding import DDGaussEncoder
from strategies.answered_rounds import claim_round
from strategies.dmm.wire import (
    FOLD_KEY,
    NAME,
    NOISE_KEY,
    PADS_KEY,
    PREFIX,
    SEALED_KEY,
    SHARE_PREFIX,
    UPDATE_KEY,
    instruction,
    round_keys_from_config,
    sealed_to_record,
)
from strategies.secure.clear import client_refusal, register_evaluate
from strategies.vectors import flatten


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


def _encoder(config: ConfigRecord) -> DDGaussEncoder:
    """The instruction's KLS21 encoder (no noise of its own: DMM's noise rows are drawn
    apart)."""
    return DDGaussEncoder(
        dim=int(config[PREFIX + "dim"]),
        clip=float(config[PREFIX + "clip"]),
        gamma=float(config[PREFIX + "gamma"]),
        noise_std=0.0,
        beta=float(config[PREFIX + "beta"]),
        max_tries=int(config[PREFIX + "max-tries"]),
    )


def _shared(
    config: ConfigRecord,
    context: Context,
    secret: RunSecret,
    round_: int,
    rounded: np.ndarray,
    noise: np.ndarray,
    padded_dim: int,
) -> RecordDict:
    """Full mode's reply: the client's shares of ``rounded`` and ``noise`` sealed to the seats
    (or masked for its worker's fold), after checking the seats' keys when enrolled."""
    keys, party = round_keys_from_config(config, len(noise), context.node_id)
    if keys.dim != padded_dim:
        raise ValueError(f"{SHARE_PREFIX}dim={keys.dim} but the encoder pads to {padded_dim}")
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
    key_seed = secret.seed_bytes(round_, Purpose.KEYS, "dmm", "client")
    if SHARE_PREFIX + "cohort" in config and context.node_config.get(FOLDS_KEY) is True:
        masked = mask_client_shares(keys, party, rounded, noise, shares, key_seed)
        client = masked.client
        pads = DMMSealedShares(client.party, client.public_key, client.pads)
        return RecordDict(
            {FOLD_KEY: to_record({"masked": masked.rows}), PADS_KEY: sealed_to_record(pads)}
        )
    sealed = seal_client_shares(keys, party, rounded, noise, shares, key_seed)
    return RecordDict({SEALED_KEY: sealed_to_record(sealed)})


def _train_reply(message: Message, context: Context, inner: ClientApp, in_clear: bool):
    """One client's DMM train reply (see :func:`dmm_client_app`)."""
    global_record, config = instruction(message.content)
    secret = client_secret(context.node_config)
    round_ = int(config["server-round"])
    claim_round(context.state, NAME, round_)  # never the same streams twice
    encoder = _encoder(config)
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
    noise = discrete_gaussian(
        (int(config[PREFIX + "rows"]), encoder.padded_dim),
        float(config[PREFIX + "noise-std"]),
        secret.generator(round_, Purpose.NOISE, "dmm"),
    )
    mode = str(config[PREFIX + "mode"])
    if mode == "full":
        content = _shared(
            config,
            context,
            secret,
            round_,
            rounded.astype(np.int64),
            noise.astype(np.int64),
            encoder.padded_dim,
        )
    elif mode == "ideal":
        content = RecordDict(
            {
                UPDATE_KEY: to_record({UPDATE_KEY: rounded.astype(np.int64)}),
                NOISE_KEY: to_record({NOISE_KEY: noise.astype(np.int64)}),
            }
        )
    else:
        raise ValueError(f"{PREFIX}mode={mode!r}; allowed: 'full', 'ideal'")
    if in_clear:
        _, metrics = single(reply.content, MetricRecord)
        out = MetricRecord(dict(metrics))
        out["dmm.tries"] = tries
        out["dmm.clipped"] = int(clipped)
        content["metrics"] = out
    return Message(content=content, reply_to=message)


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
        return _train_reply(message, context, inner, metrics_in_clear)

    register_evaluate(app, inner, metrics_in_clear, client_refusal("DMM"))
    return app
