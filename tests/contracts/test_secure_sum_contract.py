"""The contract every :class:`strategies.secure.SecureSum` passes (each one found in the
tree, :mod:`contracts.discovery`, and registered in :data:`strategies.secure.NAMES`): the
release is the field sum of the accepted inputs and names them; the first reply holds only the
implementation's record; a malformed record is refused; a round with no input releases nothing
and accounts nothing; a dropped client is left out; pickling (as checkpoints do, with
cloudpickle) keeps no transport and no committee; an implementation that hides inputs never
shows one."""

from __future__ import annotations

import cloudpickle
import numpy as np
import pytest
from flwr.app import ArrayRecord, ConfigRecord
from flwr.clientapp import ClientApp
from secure_support import make_sum, nodes, one_round, random_inputs

from contracts.discovery import implementations
from fedsim.record_codec import to_numpy, to_record
from protocols.field import DEFAULT_FIELD
from strategies import secure
from strategies.secure import Release, SecAggPlan, SecureSum
from strategies.secure.secagg_messages import ACTIONS

NAMES = secure.NAMES
FOUND = implementations(SecureSum)
COUNT, LENGTH = 6, 10


def test_every_implementation_is_registered():
    """The SecureSum classes found in the tree (printed with -v) are the registered names,
    each with its client side, each built by the registry's factory."""
    print("secure sums:", ", ".join(f"{cls.name} ({path})" for path, cls in FOUND.items()))
    assert FOUND, "no SecureSum subclass found under fedsim/, strategies/, protocols/"
    found = sorted(cls.name for cls in FOUND.values())
    assert len(set(found)) == len(found), f"two implementations share a name: {found}"
    assert sorted(NAMES) == found, f"registered {sorted(NAMES)}, found {found}"
    assert sorted(secure.CONTRIBUTE) == found
    for name in NAMES:
        summing = make_sum(name)
        assert summing.name == name and isinstance(summing, secure.SecureSum)
        assert type(summing) in FOUND.values()
        assert isinstance(summing.hides_inputs, bool)
        assert summing.reply_kind in (ArrayRecord, ConfigRecord)


@pytest.mark.parametrize("name", NAMES)
def test_the_release_is_the_field_sum_of_every_input(name):
    inputs = random_inputs(COUNT, LENGTH)
    release, _, _ = one_round(name, inputs)
    assert isinstance(release, Release) and release.aborted is None, release.aborted
    expected = DEFAULT_FIELD.sum(np.stack([inputs[n] for n in sorted(inputs)]), axis=0)
    np.testing.assert_array_equal(release.total, expected)
    assert release.contributors == tuple(sorted(inputs)) == release.accounted
    assert release.rejected == {} and release.opened == ()


@pytest.mark.parametrize("name", NAMES)
def test_the_first_reply_holds_only_the_sum_record(name):
    inputs = random_inputs(COUNT, LENGTH, seed=1)
    _, grid, summing = one_round(name, inputs)
    first = [r for r in grid.received if r.metadata.message_type == "train"]
    assert len(first) == COUNT
    for reply in first:
        assert set(reply.content.keys()) == {summing.reply_key}
        assert isinstance(reply.content[summing.reply_key], summing.reply_kind)


@pytest.mark.parametrize("name", NAMES)
def test_an_input_never_reaches_the_server_unless_plaintext(name):
    """Every array and byte string the server received is compared with every input (as
    field elements, signed integers and their bytes)."""
    inputs = random_inputs(COUNT, LENGTH, seed=2)
    _, grid, summing = one_round(name, inputs)
    seen_arrays, seen_bytes = [], b""
    for reply in grid.received:
        for record in reply.content.values():
            if isinstance(record, ArrayRecord):
                seen_arrays += [np.asarray(a).ravel() for a in to_numpy(record).values()]
            if isinstance(record, ConfigRecord):
                for value in record.values():
                    for item in value if isinstance(value, list) else [value]:
                        seen_bytes += item if isinstance(item, bytes) else b""
    found = 0
    for value in inputs.values():
        signed = DEFAULT_FIELD.decode_signed(value)
        for array in seen_arrays:
            if array.size == value.size and (
                np.array_equal(array, value) or np.array_equal(array, signed)
            ):
                found += 1
        found += value.astype(np.int64).tobytes() in seen_bytes
    assert found == (0 if summing.hides_inputs else COUNT)


@pytest.mark.parametrize("name", NAMES)
def test_a_malformed_record_is_refused_and_the_round_goes_on(name):
    inputs = random_inputs(COUNT, LENGTH, seed=3)
    bad = nodes(COUNT)[2]

    def tamper(node, content):
        if node == bad:
            key = next(iter(content.keys()))
            if isinstance(content[key], ArrayRecord):
                content[key] = to_record({"wrong": np.zeros(3, dtype=np.int64)})
            else:
                content[key] = ConfigRecord({"public-key": 7})

    release, _, summing = one_round(name, inputs, tamper=tamper)
    kept = [n for n in sorted(inputs) if n != bad]
    for malformed in (ConfigRecord({"public-key": 7}), to_record({"wrong": np.zeros(3, np.int64)})):
        with pytest.raises(ValueError):
            summing.payload(malformed, LENGTH)
    assert release.contributors == tuple(kept), release.aborted
    expected = DEFAULT_FIELD.sum(np.stack([inputs[n] for n in kept]), axis=0)
    np.testing.assert_array_equal(release.total, expected)


@pytest.mark.parametrize("name", NAMES)
def test_no_input_releases_nothing_and_accounts_nothing(name):
    summing = make_sum(name)
    summing.instruct(1, ConfigRecord({"server-round": 1}), None)
    summing.address(1, [])
    release = summing.finish(1, {}, LENGTH)
    assert release.total is None and release.aborted
    assert release.accounted == () and release.contributors == ()


def test_plaintext_reproduces_secagg_under_protocol_dropouts():
    """The plaintext simulation and SecAgg+ over messages lose the same clients under one
    public dropout plan, and release the same sum (or both nothing)."""
    inputs = random_inputs(10, LENGTH, seed=4)
    outcomes = []
    for seed in range(SEEDS := 6):
        plan = SecAggPlan(seed, dropout=0.25)
        plain, _, _ = one_round("plaintext", inputs, plan=plan)
        masked, _, _ = one_round("secagg", inputs, plan=plan)
        assert plain.contributors == masked.contributors
        if plain.total is None:
            assert masked.total is None
        else:
            np.testing.assert_array_equal(plain.total, masked.total)
        outcomes.append(len(plain.contributors))
    assert len(outcomes) == SEEDS and min(outcomes) < 10  # some clients were lost


@pytest.mark.parametrize("name", NAMES)
def test_pickling_keeps_no_transport_and_no_committee(name):
    inputs = random_inputs(COUNT, LENGTH, seed=5)
    _, _, summing = one_round(name, inputs)
    restored = cloudpickle.loads(cloudpickle.dumps(summing))
    assert getattr(restored, "_grid", None) is None
    assert getattr(restored, "committee", None) is None
    assert restored.name == name and restored.reply_key == summing.reply_key


def test_a_release_accounts_its_contributors_or_what_was_opened():
    total = np.zeros(3, dtype=np.int64)
    assert Release(total, (1, 2)).accounted == (1, 2)
    assert Release(None, opened=(1, 2, 3), aborted="late").accounted == (1, 2, 3)
    assert Release(None, aborted="too few").accounted == ()


def test_build_names_the_implementations():
    with pytest.raises(ValueError, match="allowed: " + ", ".join(map(repr, NAMES))):
        secure.build("lightsecagg", prefix="x.", plan=SecAggPlan(0))
    with pytest.raises(ValueError, match="exactly for 'committee'"):
        secure.build("committee", prefix="x.", plan=SecAggPlan(0))
    with pytest.raises(ValueError, match="built by the DMM strategy"):
        secure.build("dmm", prefix="x.", plan=SecAggPlan(0))


def test_each_implementation_carries_its_client_side_and_builds_itself():
    """The registry's client sides are the classes' own; ``register_client_stages`` adds each
    named sum's later exchanges (SecAgg+'s three, nothing for the others) and refuses an
    unknown name; ``build`` hands every class the same :class:`SumArguments`."""
    for name, cls in secure.CLASSES.items():
        assert secure.CONTRIBUTE[name] is cls.contribute
    for name in NAMES:
        app = ClientApp()
        secure.register_client_stages(app, [name])
        registered = set(app._registered_funcs)  # noqa: SLF001 (Flower keeps them there)
        later = {f"query.{action}" for action in ACTIONS.values()} if name == "secagg" else set()
        assert registered == later, (name, registered)
    with pytest.raises(ValueError, match="secure sum 'lightsecagg'; allowed"):
        secure.register_client_stages(ClientApp(), ["lightsecagg"])
    arguments = secure.SumArguments("x.", SecAggPlan(3, 4), 5.0)
    built = secure.SecAggSum.from_arguments(arguments)
    assert (built.prefix, built.plan, built.stage_timeout) == ("x.", SecAggPlan(3, 4), 5.0)
    with pytest.raises(ValueError, match="built by the DMM strategy"):
        secure.DMMSum.from_arguments(arguments)


def test_only_standalone_sums_that_hide_inputs_run_without_dp():
    """FedAvg's ``secure_sum`` names come from the registry: every implementation that hides
    the inputs and sums on its own, never plaintext nor DMM's committees' sum."""
    from strategies.plumbing.secure_aggregation import SECURE_SUMS  # noqa: PLC0415

    expected = [n for n, cls in secure.CLASSES.items() if cls.hides_inputs and cls.standalone]
    assert list(SECURE_SUMS) == list(secure.WITHOUT_DP) == expected
    assert "plaintext" not in SECURE_SUMS and "dmm" not in SECURE_SUMS
    assert {"secagg", "committee"} <= set(SECURE_SUMS)
