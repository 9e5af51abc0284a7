"""DMM's client side: :func:`dmm_client_app` around any training ClientApp (docs/dmm-design.md,
steps 1 and 3): clip, rotate, scale by 1/gamma and round (KLS21), draw one fresh noise row
N_Z(0, s^2)^D per released row, and in full mode share and seal both to the committee's seats
(or hand them to the worker's fold, :mod:`strategies.secure.dmm.fold`) -- all from the client's own
secret, never from anything the server knows. The noise, the sharing and the sealing are the
secure sum's client side (:func:`strategies.secure.dmm.committee_sum.contribute`)."""

from __future__ import annotations

import numpy as np
from flwr.app import ArrayRecord, ConfigRecord, Context, Message, MetricRecord
from flwr.clientapp import ClientApp

from fedsim.randomness import Purpose, client_secret
from fedsim.record_codec import to_numpy
from fedsim.worker_reduce import single
from protocols.dmm.common import DMMKeys
from protocols.encoding import DDGaussEncoder
from protocols.field import DEFAULT_FIELD
from strategies.plumbing.answered_rounds import claim_round
from strategies.plumbing.vectors import flatten
from strategies.secure.clear import client_refusal, register_evaluate
from strategies.secure.dmm import (
    committee_sum as dmm_sum,  # the module: it imports this package's parts
)
from strategies.secure.dmm.wire import instruction


def _encoder(config: ConfigRecord) -> DDGaussEncoder:
    """The instruction's KLS21 encoder (no noise of its own: DMM's noise rows are drawn
    apart)."""
    return DDGaussEncoder(
        dim=int(config[DMMKeys.PREFIX + DMMKeys.DIM]),
        clip=float(config[DMMKeys.PREFIX + DMMKeys.CLIP]),
        gamma=float(config[DMMKeys.PREFIX + DMMKeys.GAMMA]),
        noise_std=0.0,
        beta=float(config[DMMKeys.PREFIX + DMMKeys.BETA]),
        max_tries=int(config[DMMKeys.PREFIX + DMMKeys.MAX_TRIES]),
    )


def _train_reply(message: Message, context: Context, inner: ClientApp, in_clear: bool):
    """One client's DMM train reply (see :func:`dmm_client_app`)."""
    global_record, config = instruction(message.content)
    secret = client_secret(context.node_config)
    round_ = int(config["server-round"])
    claim_round(context.state, DMMKeys.NAME, round_)  # never the same streams twice
    encoder = _encoder(config)
    reply = inner(message, context)
    if reply.has_error():
        return reply
    _, trained = single(reply.content, ArrayRecord)
    update = flatten(to_numpy(trained)) - flatten(to_numpy(global_record))
    rounded, tries, clipped = encoder.quantise(
        update,
        int(config[DMMKeys.PREFIX + DMMKeys.ROTATION_SEED]),
        secret.generator(round_, Purpose.ROUNDING, "dmm"),
    )
    elements = DEFAULT_FIELD.encode_signed(rounded.astype(np.int64))
    content = dmm_sum.contribute(context, secret, config, elements, round_, DMMKeys.PREFIX)
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
    anything is drawn (:func:`strategies.plumbing.answered_rounds.claim_round`).
    """
    app = ClientApp()

    @app.train()
    def train(message: Message, context: Context) -> Message:
        return _train_reply(message, context, inner, metrics_in_clear)

    register_evaluate(app, inner, metrics_in_clear, client_refusal("DMM"))
    return app
