"""The distributed matrix mechanism (DMM) as a Flower strategy.

Bienstock, Kumar & Polychroniadou, ICML 2025, as docs/dmm-design.md sets it out. Each round:

* the sampled clients (:func:`dmm_client_app` around any training ClientApp,
  :mod:`strategies.methods.dmm.client`) clip, rotate, scale by 1/gamma and conditionally round their
  update to integers u_c (KLS21, :class:`protocols.encoding.DDGaussEncoder`) and draw one
  *fresh* noise row N_Z(0, s^2)^D for every row of the integer strategy matrix M released this
  round -- all from the client's own secret (``client_secret(node_config).generator(round,
  Purpose.X)``), never from anything the server knows; in ``mode="full"`` they
  packed-Shamir-share both and seal each share to its committee seat
  (:func:`protocols.dmm.client.seal_client_shares`): the reply carries only ciphertexts and the
  client's public key (with ``worker_fold`` the clients of a fedsim worker batch hand their
  sharing inputs to the worker, which deals their sum once and seals one row per seat:
  :mod:`strategies.secure.dmm.fold`);
* the round's committee -- n clients drawn publicly from the population with
  ``public_generator(seed, round, Stream.COMMITTEE)`` and hosted by the engine's
  :class:`fedsim.engine.dmm_committee.CommitteeHost` (bound with :meth:`DMM.bind_committee_host`,
  held by :mod:`strategies.secure.dmm.custody`; the round's sum is the
  :class:`strategies.secure.dmm.committee_sum.DMMSum`, a :class:`~strategies.secure.SecureSum`) --
  combines the agreed clients' shares with the partial sums it holds, releases
  y_i = sum_s M[i, s] X_s + z_i and hands the partial sums of the rows still open to the next
  round's committee (:class:`protocols.dmm.server.DMMServer`);
* the server decodes x_hat_t = (D y)_t (D M = I: forward substitution for the banded M), and
  applies ``g + gamma * unrotate(x_hat_t) / expected_clients`` through the wrapped FedAvg: the
  matrix mechanism in its x + C^{-1} z form (:mod:`strategies.methods.dmm.strategy`).

Privacy (:mod:`fedsim.privacy.dmm`, :mod:`strategies.methods.dmm.accounting`): the discrete Gaussian
mechanism on the integer query M X, sensitivity of M's columns under the participation schema
times KLS21's rounded-update bound, the DDGauss bound for sums of the shares, and the count of
clients whose noise each released row actually carries. The ledger gets one ``dp_accounting``
event per round. ``mode="ideal"`` is the no-cryptography reference (plaintext integers, the
same agreement and dropout rules): both modes release identical integers for the same
RunSecret.

Configuration is checked before any client trains (:mod:`strategies.methods.dmm.options`,
:mod:`strategies.methods.dmm.calibration`): M must be banded or the 0/1 tree
(:class:`fedsim.privacy.dmm.IntegerMechanism`), the worst-case released row must fit the field
(the *bit budget*, :meth:`DMM.check`), and the committee must meet the bound the thresholds
assume (Bienstock et al.): t_corrupt + t_dropout < (1/2 - mu) n with mu = k / n, i.e.
``threshold + member_dropouts + packing < committee_size / 2``.

Every reply is validated at this boundary (:mod:`strategies.secure.dmm.replies`: sender sampled this
round, one reply each, exactly the protocol's records, well-formed sealed shares / plaintext
integers in range); a bad one drops that client, and the round's metrics name it in
``rejected``.

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
(:mod:`strategies.plumbing.answered_rounds`).
"""

from strategies.methods.dmm.client import dmm_client_app
from strategies.methods.dmm.spec import SPEC, from_options
from strategies.methods.dmm.strategy import DMM

__all__ = ["DMM", "SPEC", "dmm_client_app", "from_options"]
