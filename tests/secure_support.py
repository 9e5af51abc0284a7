"""A one-round harness for :class:`strategies.secure.SecureSum` implementations: enrolled
clients (their secrets and certificates from one root) answer in this process, each with its
own persistent Context, as fedsim's workers would. ``dmm`` runs with M = I (one row per step)
and no noise, so that its release is the field sum of the inputs, on an in-process committee
host of the same root."""

from __future__ import annotations

from collections.abc import Callable, Mapping

import numpy as np
from flwr.app import ConfigRecord, Context, Message, RecordDict
from flwr.clientapp import ClientApp
from flwr.common.constant import NUM_PARTITIONS_KEY, PARTITION_ID_KEY

from fedsim.engine.client_registry import NODE_ID_OFFSET, Enrolment
from fedsim.engine.committee import Committee
from fedsim.engine.dmm_committee import CommitteeHost
from fedsim.randomness import NODE_SECRET_KEY, RunSecret, client_secret
from protocols.field import DEFAULT_FIELD
from protocols.shamir import PackedShamir
from strategies import secure
from strategies.secure import CommitteeSum, DMMSum, Release, SecAggPlan

PREFIX = "contract."
PHRASE = "secure-contract"
SEED = 11


def nodes(count: int) -> list[int]:
    return [NODE_ID_OFFSET + p for p in range(count)]


def make_dmm(population: int, length: int) -> DMMSum:
    """The DMM committees' sum over committees of 5 of ``population`` clients (t = k = 1),
    started for M = I and no noise on vectors of ``length`` entries, its host bound (in this
    process, the harness's root)."""
    summing = DMMSum(PackedShamir(5, 1, 1, DEFAULT_FIELD), seed=SEED, population=population)
    summing.start(length, np.array([[1]], dtype=np.int64))
    summing.bind_host(CommitteeHost(RunSecret.from_passphrase(PHRASE)))
    return summing


def make_sum(
    name: str,
    plan: SecAggPlan | None = None,
    members: int = 7,
    population: int = 6,
    length: int = 10,
) -> secure.SecureSum:
    """The implementation ``name`` over ``plan`` (default: the complete graph, no dropouts),
    built by the registry's :func:`strategies.secure.build`; ``committee`` gets a committee of
    ``members`` (t = 2, k = 2) enrolled under the harness's root; ``dmm`` (which the DMM
    strategy builds) is :func:`make_dmm`'s for ``population`` clients and ``length``."""
    if name == DMMSum.name:
        return make_dmm(population, length)
    plan = plan if plan is not None else SecAggPlan(SEED)
    committee = None
    if name == CommitteeSum.name:
        root = RunSecret.from_passphrase(PHRASE)
        committee = Committee(
            members,
            2,
            2,
            member_secrets={m: root.member(m) for m in range(members)},
            enrolment=Enrolment(root),
        )
    return secure.build(name, prefix=PREFIX, plan=plan, committee=committee)


def client_app(inputs: Mapping[int, np.ndarray], name: str) -> ClientApp:
    """Clients whose train handler contributes ``inputs[node]`` through ``name``'s client side
    and that answer every secure sum's later stages (SecAgg+'s)."""
    app = ClientApp()

    @app.train()
    def train(message: Message, context: Context) -> Message:
        config = message.content["config"]
        server_round = int(config["server-round"])
        contribute = secure.CONTRIBUTE[name]
        secret = client_secret(context.node_config)
        content = contribute(context, secret, config, inputs[context.node_id], server_round, PREFIX)
        return Message(content=content, reply_to=message)

    secure.register_client_stages(app)
    return app


class LocalGrid:
    """A Grid that runs each message through ``app`` in this process, one persistent Context
    per node; it keeps every message sent and every reply received (the server's view)."""

    def __init__(self, app: ClientApp, node_ids: list[int]) -> None:
        root = RunSecret.from_passphrase(PHRASE)
        enrolment = Enrolment(root)
        self.app, self.node_ids = app, list(node_ids)
        self.sent: list[Message] = []
        self.received: list[Message] = []
        self.silent: set[int] = set()
        self.contexts = {}
        for node in self.node_ids:
            partition = node - NODE_ID_OFFSET
            own = root.client(partition)
            config = {
                PARTITION_ID_KEY: partition,
                NUM_PARTITIONS_KEY: len(self.node_ids),
                NODE_SECRET_KEY: own.token(),
                **enrolment.node_entries(partition, own),
            }
            self.contexts[node] = Context(
                run_id=1,
                node_id=node,
                node_config=config,
                state=RecordDict(),
                run_config={"seed": SEED},
            )

    def get_node_ids(self) -> list[int]:
        return list(self.node_ids)

    def send_and_receive(self, messages, *, timeout=None):
        from flwr.supercore.task_identity import TaskIdentity

        replies = []
        for message in messages:
            self.sent.append(message)
            node = int(message.metadata.dst_node_id)
            if node in self.silent:
                continue
            TaskIdentity.node_id = node
            try:
                reply = self.app(message, self.contexts[node])
            finally:
                TaskIdentity.node_id = 1
            replies.append(reply)
        self.received.extend(replies)
        return replies


def one_round(
    name: str,
    inputs: Mapping[int, np.ndarray],
    *,
    plan: SecAggPlan | None = None,
    tamper: Callable[[int, RecordDict], None] | None = None,
    server_round: int = 1,
) -> tuple[Release, LocalGrid, secure.SecureSum]:
    """One round of ``name`` over ``inputs`` (node -> field elements): instruct, address, the
    clients' first replies (``tamper(node, content)`` may rewrite one), payloads, finish."""
    length = len(next(iter(inputs.values())))
    summing = make_sum(name, plan, population=len(inputs), length=length)
    grid = LocalGrid(client_app(inputs, name), sorted(inputs))
    config = ConfigRecord({"server-round": server_round})
    summing.instruct(server_round, config, grid)
    messages = [
        Message(RecordDict({"config": ConfigRecord(dict(config))}), node, "train")
        for node in sorted(inputs)
    ]
    summing.address(server_round, messages)
    payloads = {}
    for reply in grid.send_and_receive(messages):
        node = int(reply.metadata.src_node_id)
        assert not reply.has_error(), reply.error
        content = RecordDict(dict(reply.content))
        if tamper is not None:
            tamper(node, content)
        try:
            payloads[node] = summing.payload(content[summing.reply_key], length)
        except ValueError:
            continue
    return summing.finish(server_round, payloads, length), grid, summing


def random_inputs(count: int, length: int, seed: int = 0) -> dict[int, np.ndarray]:
    """Signed 20-bit integers per node, as field elements."""
    rng = np.random.default_rng(seed)
    return {
        node: DEFAULT_FIELD.encode_signed(rng.integers(-(2**19), 2**19, size=length))
        for node in nodes(count)
    }
