"""The public SecAgg+ parameters of a run (:class:`SecAggPlan`), which every secure sum is
given (:class:`strategies.secure.release.SumArguments`): SecAgg+ (:mod:`strategies.secure.secagg`)
runs under them, the ``plaintext`` simulation reproduces their outcome, and the others take the
run seed of their public schedules from them."""

from __future__ import annotations

from dataclasses import dataclass

from fedsim.randomness import Stream, public_generator
from protocols.secagg.common import SecAggConfig, Stage
from protocols.secagg.prg import MaskPRG

_STAGES = (Stage.ADVERTISE_KEYS, Stage.SHARE_KEYS, Stage.MASKED_INPUT, Stage.UNMASK)


@dataclass(frozen=True)
class SecAggPlan:
    """The public SecAgg+ parameters of a run: ``seed`` (the run seed: the neighbour graph and
    the simulated dropouts are public streams of it), ``degree`` (neighbours per client; None:
    the complete graph), ``ring_bits`` (mask in Z_{2^ring_bits}; None: in F_p),
    ``dropout`` (probability that a client whose first reply arrived stops answering, at a
    stage drawn uniformly from SecAgg+'s four) and ``prg`` (the mask PRG by its name,
    :class:`~protocols.secagg.prg.MaskPRG`)."""

    seed: int
    degree: int | None = None
    ring_bits: int | None = None
    dropout: float = 0.0
    prg: str = MaskPRG.CHACHA20.value

    def config(self, server_round: int, count: int, length: int) -> SecAggConfig:
        """The SecAgg+ parameters for ``count`` clients: degree ``degree`` (None: the complete
        graph), threshold a majority of the neighbours."""
        degree = count - 1 if self.degree is None else min(self.degree, count - 1)
        if degree != count - 1 and degree % 2:
            degree -= 1
        return SecAggConfig(
            num_clients=count,
            degree=degree,
            threshold=degree // 2 + 1 if degree >= 2 else 2,
            vector_length=length,
            round=server_round,
            ring_bits=self.ring_bits,
            prg=MaskPRG.parse(self.prg, "prg"),
        )

    def dropouts(self, server_round: int, ids: list[int]) -> dict[Stage, set[int]]:
        """The clients that stop answering inside SecAgg+ this round, by stage."""
        rng = public_generator(self.seed, server_round, Stream.FAULTS, 1)
        lost = rng.random(len(ids)) < self.dropout
        stage_index = rng.integers(0, 4, size=len(ids))
        out: dict[Stage, set[int]] = {}
        for client, is_lost, index in zip(ids, lost, stage_index):
            if is_lost:
                out.setdefault(_STAGES[index], set()).add(client)
        return out
