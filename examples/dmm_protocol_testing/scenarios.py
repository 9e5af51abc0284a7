"""DMM protocol testing: committee dropouts and a tampering member at chosen stages.

Runs the distributed matrix mechanism (``strategies.methods.dmm.DMM``, full mode: packed Shamir
shares sealed per seat with X25519 + ChaCha20-Poly1305, committees of clients drawn each round,
linear resharing to the next committee) on fedsim's in-process engine, a small digits federation and
logistic regression. One round of each scenario gets a fault plan
(:class:`protocols.dmm.common.DMMFaults`) through the hook the engine already uses for the run's
``[faults]``: :meth:`fedsim.engine.dmm_committee.CommitteeHost.member_faults`, here answering
with the scenario's plan instead of a random one. Seats index the round's committee (0..n-1).

For every scenario it prints what the protocol did in the faulted round:

* ``released``: the committee's release was decoded; ``verified`` says whether the decoding was
  unique (more than t + k answers), ``corrected`` names the tampering seats whose shares were
  corrected (named only when the decoding is unique), ``handed over`` whether the next committee
  took the state; ``exact`` says whether the run's final model equals, bit for bit, the
  fault-free run in ideal mode (the same integers without cryptography, same secret root);
* ``aborted``: nothing decoded that round, with the protocol's reason (too few answers at a
  stage, or tampering beyond the decoding radius, where nobody is named); ``opened`` says
  whether more than t members' release shares had reached the server first -- then the round
  is accounted as the release of its step and the run halts (opened is released: that state is
  never released again with fresh noise), else nothing is accounted.

    python examples/dmm_protocol_testing/scenarios.py                 # the built-in scenarios
    python examples/dmm_protocol_testing/scenarios.py --stage release --tamper 3 --dropouts 2
    python examples/dmm_protocol_testing/scenarios.py --list
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:  # run as a script from anywhere
    sys.path.insert(0, str(ROOT))

import numpy as np  # noqa: E402
from flwr.supercore.logger import FLOWER_LOGGER  # noqa: E402

from fedsim.data import DatasetSpec, build_dataset  # noqa: E402
from fedsim.engine import Engine, EngineConfig, MinSeparationCohort  # noqa: E402
from fedsim.engine.dmm_committee import CommitteeHost  # noqa: E402
from fedsim.engine.rounds import run_rounds  # noqa: E402
from fedsim.models import ModelSpec, initial_arrays  # noqa: E402
from fedsim.randomness import RunSecret, new_nonce  # noqa: E402
from fedsim.record_codec import to_numpy, to_record  # noqa: E402
from fedsim.workloads.supervised import LocalTraining, make_client_app  # noqa: E402
from protocols.dmm.common import ACTIVE, DMMFaults  # noqa: E402
from strategies.registry import build_strategy, spec_for  # noqa: E402

STAGES = {stage.name.lower(): stage for stage in ACTIVE}
TAMPER_STAGES = ("combine", "release", "reshare")  # members hold nothing to alter at SHARE


@dataclass(frozen=True)
class Scenario:
    """A fault plan for one round: ``dropouts`` seats (the last ones) silent from ``stage``,
    and ``tamper`` seats altering what they hold, send or deal at ``tamper_stage``."""

    name: str
    stage: str = "release"
    dropouts: int = 0
    tamper: tuple[int, ...] = ()
    tamper_stage: str = "release"
    round: int = 2

    def faults(self, committee_size: int) -> DMMFaults:
        drop = range(committee_size - self.dropouts, committee_size)
        plan = {(seat, STAGES[self.stage]): "drop" for seat in drop}
        plan.update({(seat, STAGES[self.tamper_stage]): "tamper" for seat in self.tamper})
        return DMMFaults(member=plan, seed=self.round)


BUILT_IN = (
    Scenario("no faults"),
    Scenario("2 dropouts at SHARE", stage="share", dropouts=2),
    Scenario("2 dropouts at RESHARE", stage="reshare", dropouts=2),
    Scenario("tamperer at COMBINE", tamper=(1,), tamper_stage="combine"),
    Scenario("tamperer at RELEASE + 2 dropouts", dropouts=2, tamper=(1,)),
    Scenario("tamperer at RESHARE", tamper=(1,), tamper_stage="reshare"),
    Scenario("8 dropouts at RELEASE", dropouts=8),
    Scenario("9 dropouts at RELEASE", dropouts=9),
    Scenario("5 tamperers at RELEASE", tamper=(0, 2, 4, 6, 8)),
)


class ScenarioHost(CommitteeHost):
    """The engine's committee host, answering the faulted round with the scenario's plan."""

    def __init__(self, secrets: RunSecret, faulted_round: int, plan: DMMFaults) -> None:
        super().__init__(secrets)
        self.faulted_round, self.plan = faulted_round, plan

    def member_faults(self, server_round, committee, next_committee=()) -> DMMFaults:
        if server_round == self.faulted_round:
            return self.plan
        return super().member_faults(server_round, committee, next_committee)


@dataclass
class Federation:
    """The clients, the model and the DMM's parameters every scenario shares."""

    clients: int
    rounds: int
    committee_size: int
    threshold: int
    packing: int
    member_dropouts: int
    bands: int
    secrets: RunSecret
    #: the public nonce mixed into ``secrets`` (the reference run's); every scenario replays it
    nonce: str
    data: DatasetSpec = field(init=False)

    def __post_init__(self) -> None:
        self.data = DatasetSpec(source="digits", partition="iid", num_clients=self.clients, seed=0)
        self.dataset = build_dataset(self.data)
        self.model = ModelSpec(
            kind="logreg",
            input_shape=tuple(self.dataset.feature_shape),
            num_classes=self.dataset.num_classes,
        )
        training = LocalTraining(epochs=1, batch_size=16, lr=0.1, seed=0)
        self.client_app = spec_for("dmm").wrap_client_app(
            make_client_app(self.model, self.data, training), False
        )
        # the clients in ``bands`` groups, each group every ``bands`` rounds: the min
        # separation a BandMF with that many bands is accounted for
        self.participation = MinSeparationCohort(self.clients, self.bands, 0)

    def strategy(self, mode: str):
        options = {
            "clipping_norm": 1.0,
            "noise_multiplier": 1.0,
            "committee_size": self.committee_size,
            "threshold": self.threshold,
            "packing": self.packing,
            "member_dropouts": self.member_dropouts,
            "bands": self.bands,
            "mode": mode,
        }
        return build_strategy(
            "dmm",
            options,
            expected_clients=self.participation.group_size(0),
            evaluate_fraction=0.0,
            seed=0,
            sampling=self.participation.accounting(self.rounds),
            population=self.clients,
            rounds=self.rounds,
        )

    def run(self, engine: Engine, mode: str, host: CommitteeHost, watch=None):
        """Run the rounds; ``watch(server_round, strategy)`` after each; the final arrays."""
        strategy = self.strategy(mode)
        strategy.bind_committee_host(host)
        grid = engine.open_run(
            self.client_app,
            self.clients,
            run_config={"seed": 0},
            participation=self.participation,
            datasets=((self.data, self.dataset),),
            secrets=self.secrets,
        )
        try:
            final = run_rounds(
                strategy,
                grid,
                to_record(initial_arrays(self.model, 0)),
                self.rounds,
                on_round=None if watch is None else (lambda o: watch(o.server_round, strategy)),
            )
            grid.wait_idle()
        finally:
            strategy.close()
            host.close()
        return {k: np.asarray(v) for k, v in to_numpy(final).items()}


def outcome_of(scenario: Scenario, strategy) -> dict[str, Any]:
    """What the protocol did in the scenario's faulted round (read from the strategy)."""
    out: dict[str, Any] = {"scenario": scenario.name, "round": scenario.round}
    if strategy.last_output is None:  # aborted, or halted by an earlier abort
        opened = any(r["round"] == scenario.round for r in strategy.aborted_releases)
        out.update(status="aborted", reason=strategy.last_abort or strategy.halted, opened=opened)
        return out
    output = strategy.last_output
    out.update(
        status="released",
        verified=bool(output.verified),
        corrected=list(output.corrected),
        rejected_members={str(seat): why for seat, why in output.rejected_members.items()},
        reshare_attempts=output.reshare_attempts,
        member_dropouts=len(output.dropped),
        handed_over=bool(output.handed_over),
        clients=len(output.clients),
    )
    return out


def run_scenario(fed: Federation, engine: Engine, scenario: Scenario, reference) -> dict:
    """The faulted round's outcome, how the rounds after it went, and (when the round
    released) whether the final model equals the fault-free ideal run's bit for bit."""
    plan = scenario.faults(fed.committee_size)
    seen: dict[str, Any] = {}
    later: list[dict[str, Any]] = []

    def watch(server_round: int, strategy) -> None:
        if server_round == scenario.round:
            seen.update(outcome_of(scenario, strategy))
        elif server_round > scenario.round:
            after = outcome_of(scenario, strategy)
            later.append({k: after[k] for k in ("status", "reason") if k in after})
            later[-1]["round"] = server_round

    host = ScenarioHost(fed.secrets, scenario.round, plan)
    final = fed.run(engine, "full", host, watch)
    seen["later"] = later
    # the reference's streams again: a copy of its releases, made only for this comparison
    seen["replay_of"] = fed.nonce
    if seen.get("status") == "released":
        seen["exact"] = all(np.array_equal(final[k], reference[k]) for k in reference)
    return seen


def describe(outcome: dict[str, Any]) -> str:
    """One paragraph per scenario: the faulted round, then the rounds after it."""
    head = f"{outcome['scenario']} (round {outcome['round']}): "
    if outcome["status"] == "aborted":
        if outcome["opened"]:
            text = head + (
                "ABORTED after the release shares reached the server (accounted as released; "
                f"the run halts): {outcome['reason']}"
            )
        else:
            text = head + f"ABORTED, nothing released: {outcome['reason']}"
    else:
        named = outcome["corrected"]
        redealt = outcome["reshare_attempts"] > 1
        text = head + (
            f"released and decoded ({'verified' if outcome['verified'] else 'UNVERIFIED'}); "
            f"tamperer named: {', '.join(f'seat {s}' for s in named) if named else 'none'}; "
            f"member dropouts {outcome['member_dropouts']}; resharing attempts "
            f"{outcome['reshare_attempts']}"
            f"{' (a dealing failed VERIFY: dealt again without its dealer)' if redealt else ''}"
            f"; handed over: "
            f"{'yes' if outcome['handed_over'] else 'no (the old committee keeps the state)'}; "
            f"final model equals the fault-free ideal run's: {'yes' if outcome['exact'] else 'NO'}"
        )
    for after in outcome["later"]:
        status = after["status"] + (f" ({after['reason']})" if "reason" in after else "")
        text += f"\n    then round {after['round']}: {status}"
    return text


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--list", action="store_true", help="list the built-in scenarios")
    parser.add_argument(
        "--scenario", action="append", default=None, help="run this built-in scenario (repeatable)"
    )
    parser.add_argument("--stage", choices=tuple(STAGES), default=None, help="dropouts' stage")
    parser.add_argument("--dropouts", type=int, default=0, help="members silent from --stage")
    parser.add_argument(
        "--tamper", type=int, action="append", default=[], help="a tampering seat (repeatable)"
    )
    parser.add_argument("--tamper-stage", choices=TAMPER_STAGES, default="release")
    parser.add_argument("--round", type=int, default=2, help="the faulted round")
    parser.add_argument("--rounds", type=int, default=3, help="rounds per scenario")
    parser.add_argument("--clients", type=int, default=12, help="clients (committees too)")
    parser.add_argument("--committee-size", type=int, default=11, help="n")
    parser.add_argument("--threshold", type=int, default=2, help="t (colluders tolerated)")
    parser.add_argument("--packing", type=int, default=1, help="k (secrets per polynomial)")
    parser.add_argument("--member-dropouts", type=int, default=2, help="dropouts planned for")
    parser.add_argument("--bands", type=int, default=2, help="BandMF bands (state handed on)")
    parser.add_argument("--json", default=None, help="also write the outcomes to this file")
    args = parser.parse_args(argv)
    n = args.committee_size
    checks = (
        ("--dropouts", args.dropouts, 0 <= args.dropouts <= n, f"in [0, {n}]"),
        ("--tamper", args.tamper, all(0 <= s < n for s in args.tamper), f"seats in [0, {n})"),
        ("--round", args.round, 1 <= args.round <= args.rounds, "in [1, --rounds]"),
        ("--clients", args.clients, args.clients >= n, "at least --committee-size"),
        ("--bands", args.bands, 1 <= args.bands <= args.rounds, "in [1, --rounds]"),
    )
    for flag, value, ok, allowed in checks:
        if not ok:
            parser.error(f"{flag} = {value!r} is not allowed: {allowed}")
    return args


def chosen_scenarios(args: argparse.Namespace) -> list[Scenario]:
    if args.stage is not None or args.dropouts or args.tamper:
        stage = args.stage or "release"
        name = f"{args.dropouts} dropouts at {stage.upper()}" + (
            f", tamperers {args.tamper} at {args.tamper_stage.upper()}" if args.tamper else ""
        )
        custom = Scenario(
            name, stage, args.dropouts, tuple(args.tamper), args.tamper_stage, args.round
        )
        return [custom]
    by_name = {s.name: s for s in BUILT_IN}
    if args.scenario is None:
        return list(BUILT_IN)
    unknown = [s for s in args.scenario if s not in by_name]
    if unknown:
        raise SystemExit(f"--scenario {unknown[0]!r} is not allowed: one of {list(by_name)}")
    return [by_name[s] for s in args.scenario]


def main(argv: list[str] | None = None) -> list[dict[str, Any]]:
    args = parse_args(argv)
    if args.list:
        for scenario in BUILT_IN:
            print(scenario.name)
        return []
    scenarios = chosen_scenarios(args)
    nonce = new_nonce()
    fed = Federation(
        args.clients,
        args.rounds,
        args.committee_size,
        args.threshold,
        args.packing,
        args.member_dropouts,
        args.bands,
        # a fresh root from OS randomness for each invocation (never a phrase in the
        # repository) mixed with the reference run's nonce: every scenario of one invocation
        # replays it (``replay_of``), so each is compared with the ideal run on the same
        # noise; two invocations draw independent noise
        RunSecret(os.urandom(32)).for_run(nonce),
        nonce,
    )
    print(
        f"DMM full mode: {args.clients} clients in {args.bands} groups (BandMF, "
        f"{args.bands} bands), committees of n = {args.committee_size} "
        f"(t = {args.threshold}, k = {args.packing}, {args.member_dropouts} dropouts planned "
        f"for), {args.rounds} rounds"
    )
    FLOWER_LOGGER.setLevel(logging.WARNING)  # Flower's per-round lines
    outcomes = []
    with Engine(EngineConfig(backend="local")) as engine:
        reference = fed.run(engine, "ideal", CommitteeHost(fed.secrets))
        for scenario in scenarios:
            outcome = run_scenario(fed, engine, scenario, reference)
            print(describe(outcome))
            outcomes.append(outcome)
    if args.json:
        Path(args.json).write_text(json.dumps(outcomes, indent=2) + "\n")
    return outcomes


if __name__ == "__main__":
    main()
