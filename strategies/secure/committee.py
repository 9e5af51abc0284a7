"""``committee``: the committee host's sum of sealed inputs, as a :class:`SecureSum`.

The train instruction carries the round's public committee parameters (n, t, k, the field,
the channel session id and the members' X25519 keys, ``<prefix>committee.*``) and the client's
channel id. Each client packed-Shamir-shares its elements with share randomness from its own
secret (``(round, Purpose.SHARES, prefix)``) and seals row j for member j under its own X25519
key (``(round, Purpose.KEYS, prefix, session)``; :func:`protocols.committee.client.seal_input`);
its first reply holds only that public key and the ciphertexts (``<prefix>sealed``). A
:class:`fedsim.engine.committee.Committee` (members' keys from their own secrets; built and
bound by the run's front end from ``committee_spec()``) checks each sealed input, sums the
shares and releases only the sum (:class:`protocols.committee.server.CommitteeServer`). The
server and at most t colluding members learn nothing else about one client's input.

Opened is released: a round that aborts after more than t members' rows reached the server
(:class:`protocols.committee.common.OpenedRelease`) returns a :class:`Release` whose ``opened``
nodes are the clients in that sum. ``member_dropout`` drops members from a public schedule.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
from flwr.app import ConfigRecord, Context, Message, RecordDict
from flwr.serverapp import Grid

from fedsim.config import ConfigError, require
from fedsim.engine.client_registry import enrolled, member_name
from fedsim.engine.committee import Committee, CommitteeSpec
from fedsim.randomness import PartySecret, Purpose, Stream, public_generator
from protocols.committee.client import seal_input
from protocols.committee.common import (
    CommitteeAbort,
    CommitteeFaults,
    CommitteeKeys,
    CommitteeWire,
    SealedInput,
)
from protocols.kit import MEMBER_ID_BASE, TamperingDetected
from strategies.secure.release import Release, SecureSum, SumArguments, SumOptions
from strategies.secure.secagg_messages import envelopes_from, envelopes_record

W = CommitteeWire
#: ``strategy.options`` keys of a committee -> the :class:`CommitteeSpec` field each sets
COMMITTEE_OPTIONS = {
    "committee_size": "size",
    "threshold": "threshold",
    "packing": "packing",
    "detect": "detect",
    "committee_shards": "shards",
    "committee_actors": "actors",
}


def spec_from_options(options: Mapping[str, Any]) -> CommitteeSpec:
    """The :class:`CommitteeSpec` a strategy's options describe (``committee_size`` and
    ``threshold`` required); a ConfigError naming ``strategy.options.<key>``."""
    for key in ("committee_size", "threshold"):
        require(
            key in options, f"strategy.options.{key}", None, "a value (required with a committee)"
        )
    try:
        return CommitteeSpec(
            **{COMMITTEE_OPTIONS[k]: v for k, v in options.items() if k in COMMITTEE_OPTIONS}
        )
    except ValueError as error:
        names = ", ".join(f"{v} = strategy.options.{k}" for k, v in COMMITTEE_OPTIONS.items())
        raise ConfigError(
            "strategy.options.committee_size",
            options["committee_size"],
            f"a committee layout that holds ({error}; {names})",
        ) from None


def sealed_key(prefix: str) -> str:
    """The reply record: ConfigRecord of the client's ``public-key`` and its envelopes."""
    return prefix + W.SEALED


def committee_keys_config(keys: CommitteeKeys, party: int, prefix: str) -> dict[str, Any]:
    """The ``<prefix>committee.*`` entries of one client's instruction: the round's public
    :class:`protocols.committee.common.CommitteeKeys` (the round is ``server-round``) and the
    client's channel id. Nothing secret."""
    values = dict(
        zip(
            W.INSTRUCTION,
            (
                keys.n,
                keys.t,
                keys.k,
                keys.field_exponent,
                keys.session_id,
                list(keys.member_keys),
                int(party),
            ),
        )
    )
    if keys.member_proofs:
        values[W.MEMBER_PROOFS] = list(keys.member_proofs)
    return {prefix + W.PREFIX + name: value for name, value in values.items()}


def committee_keys_from(config: ConfigRecord, prefix: str) -> tuple[CommitteeKeys, int]:
    """(keys, party) from an instruction's ``<prefix>committee.*`` entries; ValueError naming
    what is missing or malformed."""
    base = prefix + W.PREFIX
    missing = [base + k for k in W.INSTRUCTION if base + k not in config]
    if missing:
        raise ValueError(f"the committee-mode instruction's config lacks {missing}")
    member_keys = config[base + W.MEMBER_KEYS]
    if not isinstance(member_keys, list):
        raise ValueError(f"{base}{W.MEMBER_KEYS} must be a list of public keys")
    keys = CommitteeKeys(
        round=int(config["server-round"]),
        n=int(config[base + W.N]),
        t=int(config[base + W.T]),
        k=int(config[base + W.K]),
        field_exponent=int(config[base + W.FIELD_EXPONENT]),
        session_id=config[base + W.SESSION],
        member_keys=tuple(member_keys),
        member_proofs=tuple(config.get(base + W.MEMBER_PROOFS, [])),
    )
    return keys, int(config[base + W.PARTY])


def sealed_record(sealed: SealedInput) -> ConfigRecord:
    """A client's sealed input as its reply record: its public key and its envelopes (member
    order) as parallel lists (:func:`strategies.secure.secagg_messages.envelopes_record`)."""
    record = envelopes_record(sealed.envelopes[j] for j in sorted(sealed.envelopes))
    record[W.PUBLIC_KEY] = sealed.public_key
    return record


def sealed_from(record: object, name: str = "the sealed input") -> SealedInput:
    """The :class:`~protocols.committee.common.SealedInput` of a reply record; ValueError if it is
    not one (what the envelopes say is the committee's to check)."""
    if not isinstance(record, ConfigRecord) or W.PUBLIC_KEY not in record:
        raise ValueError(f"{name} must be a ConfigRecord with a '{W.PUBLIC_KEY}'")
    key = record[W.PUBLIC_KEY]
    if not isinstance(key, bytes):
        raise ValueError(f"{name}'s {W.PUBLIC_KEY} is a {type(key).__name__}, not bytes")
    rest = {k: v for k, v in record.items() if k != W.PUBLIC_KEY}
    envelopes = envelopes_from(ConfigRecord(rest))
    members = [e.receiver - MEMBER_ID_BASE for e in envelopes]
    if len(set(members)) != len(members):
        raise ValueError(f"{name} holds two envelopes for one member")
    return SealedInput(key, dict(zip(members, envelopes)))


def contribute(
    context: Context,
    secret: PartySecret,
    config: ConfigRecord,
    elements: np.ndarray,
    server_round: int,
    prefix: str,
) -> RecordDict:
    """Share ``elements`` and seal each member's row, with share randomness and key from the
    client's own ``secret``. An enrolled client (its ``node_config``) first checks that every
    member key was signed by member j itself: a substituted key is refused."""
    keys, party = committee_keys_from(config, prefix)
    enrolment = enrolled(context.node_config, secret)
    sealed = seal_input(
        keys,
        party,
        elements,
        secret.generator(server_round, Purpose.SHARES, prefix),
        secret.seed_bytes(server_round, Purpose.KEYS, prefix, keys.session_id.hex()),
        verifier=None if enrolment is None else enrolment[1],
        names=[member_name(j) for j in range(keys.n)],
    )
    return RecordDict({sealed_key(prefix): sealed_record(sealed)})


@dataclass(frozen=True)
class CommitteeOptions(SumOptions):
    """The committee's ``strategy.options`` under a FedAvg-family strategy, only with
    ``secure_sum = "committee"``: its layout (:data:`COMMITTEE_OPTIONS`; ``committee_size`` and
    ``threshold`` required) and ``member_dropout`` (each member's drop probability per stage)."""

    only_with = "committee"

    committee_size: int | None = None
    threshold: int | None = None
    packing: int | None = None
    detect: int | None = None
    committee_shards: int | None = None
    committee_actors: bool | None = None
    member_dropout: float | None = None

    def check(self, where: str) -> None:
        dropout = self.member_dropout
        require(
            dropout is None or 0.0 <= dropout <= 1.0,
            f"{where}.member_dropout",
            dropout,
            "a probability in [0, 1]",
        )
        self.committee()

    def committee(self) -> CommitteeSpec | None:
        """The committee these options describe (None unless ``secure_sum = "committee"``)."""
        if self.secure_sum != self.only_with:
            return None
        given = {k: getattr(self, k) for k in COMMITTEE_OPTIONS if getattr(self, k) is not None}
        return spec_from_options(given)

    def arguments(self) -> dict[str, Any]:
        if self.secure_sum != self.only_with:
            return {}
        dropout = {} if self.member_dropout is None else {"member_dropout": self.member_dropout}
        return {"committee": self.committee(), **dropout}


class CommitteeSum(SecureSum):
    """The clients share and seal to a committee, which sums. ``committee``: a
    :class:`~fedsim.engine.committee.Committee`, or the
    :class:`~fedsim.engine.committee.CommitteeSpec` from which the run's front end builds one
    and binds it (:meth:`bind`); ``member_dropout``: probability that a member drops out at
    each of SHARE, COMBINE, RELEASE (a public schedule from ``seed`` and the round)."""

    name = "committee"
    reply_kind = ConfigRecord
    takes_committee = True
    options_type = CommitteeOptions

    def __init__(
        self,
        prefix: str,
        committee: Committee | CommitteeSpec,
        *,
        seed: int,
        member_dropout: float = 0.0,
    ) -> None:
        if not isinstance(committee, Committee | CommitteeSpec):
            raise ValueError(
                f"committee is a {type(committee).__name__}; allowed: Committee or CommitteeSpec"
            )
        super().__init__(prefix)
        self.spec = committee.spec() if isinstance(committee, Committee) else committee
        self.committee = committee if isinstance(committee, Committee) else None
        self.seed = int(seed)
        self.member_dropout = float(member_dropout)
        self._party: dict[int, int] = {}

    @classmethod
    def from_arguments(cls, arguments: SumArguments) -> CommitteeSum:
        return cls(
            arguments.prefix,
            arguments.committee,
            seed=arguments.plan.seed,
            member_dropout=arguments.member_dropout,
        )

    contribute = staticmethod(contribute)

    def __getstate__(self) -> dict[str, Any]:
        state = super().__getstate__()
        state["committee"] = None  # the members' keys and shares are theirs; bound again
        return state

    @property
    def reply_key(self) -> str:
        return sealed_key(self.prefix)

    def bind(self, committee: Committee) -> None:
        """Sum through ``committee`` (engine-side: it holds the members' keys); it must be
        built to :attr:`spec`."""
        if not isinstance(committee, Committee):
            raise ValueError(f"committee is a {type(committee).__name__}, not a Committee")
        scheme, spec = committee.scheme, self.spec
        if (scheme.n, scheme.t, scheme.k) != (spec.size, spec.threshold, spec.packing):
            raise ValueError(
                f"the committee has (n, t, k) = {(scheme.n, scheme.t, scheme.k)}; this strategy "
                f"is configured for {(spec.size, spec.threshold, spec.packing)}"
            )
        self.committee = committee

    def instruct(self, server_round: int, config: ConfigRecord, grid: Grid | None) -> None:
        if self.committee is None:
            raise RuntimeError(
                "a committee sum needs a committee: pass committee=Committee(...), or run "
                "through fedsim's front end, which builds one from committee_spec() and binds "
                "it (bind_committee)"
            )
        super().instruct(server_round, config, grid)

    def address(self, server_round: int, messages: list[Message]) -> None:
        """Each client's channel id (its place among the round's messages) and the round's
        committee keys, added to every ConfigRecord of its instruction."""
        self._party = {int(m.metadata.dst_node_id): p for p, m in enumerate(messages)}
        keys = self.committee.keys_for(server_round)
        for message in messages:
            party = self._party[int(message.metadata.dst_node_id)]
            own = committee_keys_config(keys, party, self.prefix)
            message.content = RecordDict(
                {
                    name: ConfigRecord({**dict(record), **own})
                    if isinstance(record, ConfigRecord)
                    else record
                    for name, record in message.content.items()
                }
            )

    def payload(self, record: Any, length: int) -> SealedInput:
        return sealed_from(record, self.reply_key)

    def member_faults(self, server_round: int) -> CommitteeFaults:
        """The committee members that drop out this round, by stage (a public schedule)."""
        if not self.member_dropout:
            return CommitteeFaults()
        rng = public_generator(self.seed, server_round, Stream.FAULTS, 2)
        return CommitteeFaults.random(self.committee.scheme.n, rng, drop=self.member_dropout)

    def finish(self, server_round: int, payloads: Mapping[int, Any], length: int) -> Release:
        """The committee's sum of the clients' sealed inputs (by node id); clients whose input
        the committee excluded are rejected with its reason."""
        if len(payloads) < 1:
            return Release(None, aborted=f"round {server_round}: no client contributed")
        node_of = {party: node for node, party in self._party.items()}
        inputs = {self._party[node]: value for node, value in payloads.items()}
        faults = self.member_faults(server_round)
        try:
            result = self.committee.run_round_sealed(server_round, inputs, length, faults)
        except (CommitteeAbort, TamperingDetected) as error:
            rejected = {node_of[c]: why for c, why in error.excluded.items()}
            opened = () if error.opened is None else error.opened.clients
            return Release(
                None,
                rejected=rejected,
                aborted=str(error),
                opened=tuple(sorted(node_of[c] for c in opened)),
            )
        rejected = {node_of[c]: _reason(result.reasons, c) for c in result.excluded}
        clients = tuple(sorted(node_of[c] for c in result.clients))
        counts = {
            "member-dropouts": len(result.dropped) + len(result.late),
            "members-rejected": len(result.rejected) + len(result.tampered),
            "verified": int(result.verified),
        }
        return Release(result.aggregate, clients, rejected, counts=counts)


def _reason(reasons: Iterable[str], client: int) -> str:
    """The committee's reason for excluding ``client`` (``"client C: ..."`` entries)."""
    prefix = f"client {client}: "
    return "; ".join(r[len(prefix) :] for r in reasons if r.startswith(prefix))
