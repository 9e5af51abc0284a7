"""DDGauss on the client: the encoder of a round's instruction, and the ClientApp that clips,
rotates, quantises and noises its update (KLS21 Alg. 1) and hands the result to the round's
secure sum (:mod:`strategies.methods.ddgauss.strategy`)."""

from __future__ import annotations

import logging

import numpy as np
from flwr.app import ArrayRecord, ConfigRecord, Context, Message, MetricRecord
from flwr.clientapp import ClientApp

from fedsim.privacy.mechanisms import SecureRandom, discrete_gaussian
from fedsim.randomness import PartySecret, Purpose, client_secret
from protocols.committee.common import CommitteeWire
from protocols.encoding import DDGaussEncoder, EncodedUpdate
from strategies import secure
from strategies.methods.ddgauss.options import MODES, NAME, SECURE_SUMS
from strategies.plumbing.answered_rounds import claim_round
from strategies.plumbing.vectors import trained_update
from strategies.secure.clear import client_refusal, register_evaluate
from strategies.secure.committee import sealed_key
from strategies.secure.plaintext import encoded_key

log = logging.getLogger(__name__)


PREFIX = "ddgauss."
ENCODED_KEY = encoded_key(PREFIX)
SEALED_KEY = sealed_key(PREFIX)
"""Committee mode's reply: ConfigRecord of the client's ``public-key`` and its envelopes."""
COMMITTEE_PREFIX = PREFIX + CommitteeWire.PREFIX
_KEYS = ("dim", "clip", "gamma", "noise-std", "beta", "max-tries", "rotation-seed", "mode")


def encoder_from_config(config: ConfigRecord) -> DDGaussEncoder:
    """The encoder a train instruction describes (keys ``ddgauss.*``)."""
    missing = [PREFIX + k for k in _KEYS if PREFIX + k not in config]
    if "server-round" not in config:
        missing.append("server-round")
    if missing:
        raise ValueError(f"the instruction's config lacks {missing}; is the server DDGauss?")
    return DDGaussEncoder(
        dim=int(config[PREFIX + "dim"]),
        clip=float(config[PREFIX + "clip"]),
        gamma=float(config[PREFIX + "gamma"]),
        noise_std=float(config[PREFIX + "noise-std"]),
        beta=float(config[PREFIX + "beta"]),
        max_tries=int(config[PREFIX + "max-tries"]),
    )


def _instruction_parts(message: Message) -> tuple[str, ArrayRecord, ConfigRecord]:
    arrays = [(k, v) for k, v in message.content.items() if isinstance(v, ArrayRecord)]
    configs = [v for v in message.content.values() if isinstance(v, ConfigRecord)]
    if len(arrays) != 1 or not configs:
        raise ValueError("a DDGauss instruction needs one ArrayRecord and a ConfigRecord")
    return arrays[0][0], arrays[0][1], configs[0]


def _encode(
    encoder: DDGaussEncoder,
    update: np.ndarray,
    config: ConfigRecord,
    secret: PartySecret,
    server_round: int,
    secure_noise: bool,
) -> EncodedUpdate:
    """The client's encoding: rounding and noise from its own secret's round streams (the
    noise from the OS with ``secure_noise``)."""
    rng = secret.generator(server_round, Purpose.ROUNDING, PREFIX)
    noise_rng = secret.generator(server_round, Purpose.NOISE, PREFIX)
    if secure_noise:
        noise_rng = SecureRandom()
    return encoder.encode(
        update,
        int(config[PREFIX + "rotation-seed"]),
        rng,
        noise_rng=noise_rng,
        sampler=discrete_gaussian,
    )


def ddgauss_client_app(
    inner: ClientApp, metrics_in_clear: bool = False, secure_noise: bool = False
) -> ClientApp:
    """A ClientApp that runs ``inner`` and answers DDGauss's train instructions.

    In full mode its train reply holds only the client's two SecAgg+ public keys, and the app
    answers the SecAgg+ stage messages (``query.secagg_*``) with its state kept in
    ``context.state``; in committee mode it holds only the client's channel public key and one
    sealed share row per committee member (``ddgauss.sealed``); in plaintext mode it carries
    ``ddgauss.encoded`` (D field elements). Rounding, noise, share randomness and keys come
    from the client's own secret, or the noise from the OS (``secure_noise``).
    ``metrics_in_clear``: also reply the inner metrics plus ``ddgauss.tries`` and
    ``ddgauss.clipped`` un-noised, and answer federated evaluation (``inner``'s evaluate, un-noised
    too); without it a train reply carries nothing data-dependent but the (masked, sealed or, in
    plaintext mode, clear) encoding and an evaluate message is refused. A round already answered
    (or an earlier one) is refused before anything is drawn (:func:`claim_round`).
    """
    app = ClientApp()

    @app.train()
    def train(message: Message, context: Context) -> Message:
        _, global_record, config = _instruction_parts(message)
        encoder = encoder_from_config(config)
        mode = config[PREFIX + "mode"]
        if mode not in MODES:
            raise ValueError(f"ddgauss.mode={mode!r}; allowed: {MODES}")
        server_round = int(config["server-round"])
        claim_round(context.state, NAME, server_round)  # never the same streams twice
        local = trained_update(inner, message, context, global_record)
        if isinstance(local, Message):
            return local
        update, metrics = local
        secret = client_secret(context.node_config)
        encoded = _encode(encoder, update, config, secret, server_round, secure_noise)
        contribute = secure.CONTRIBUTE_SIGNED[SECURE_SUMS[mode]]
        content = contribute(context, secret, config, encoded.signed, server_round, PREFIX)
        if metrics_in_clear:
            out_metrics = MetricRecord(dict(metrics))
            out_metrics["ddgauss.tries"] = encoded.tries
            out_metrics["ddgauss.clipped"] = int(encoded.clipped)
            content["metrics"] = out_metrics
        return Message(content=content, reply_to=message)

    secure.register_client_stages(app, SECURE_SUMS.values())

    register_evaluate(app, inner, metrics_in_clear, client_refusal("DDGauss"))
    return app

