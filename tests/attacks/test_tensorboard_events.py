"""The holder of a private run's directory against its TensorBoard events (``[output]
tensorboard = true``): every event in ``tensorboard/`` releases only what ``rounds.jsonl``
releases, so no un-noised client number (train loss, federated evaluation, the exact clipped
fraction) reaches the event files unless ``[privacy] metrics_in_clear`` asked for it."""

from __future__ import annotations

from tensorboard.backend.event_processing.event_file_loader import EventFileLoader

from fedsim.frontend.experiment import run_experiment
from fedsim.frontend.run_config import ExperimentConfig
from fedsim.randomness import RunSecret

ROOT = RunSecret.from_passphrase("tensorboard attack tests")
RUN = {
    "name": "private",
    "seed": 4,
    "rounds": 2,
    "data": {"source": "digits", "partition": "iid", "num_clients": 12},
    "model": {"kind": "logreg"},
    "client": {"lr": 0.2, "batch_size": 16},
    "strategy": {
        "name": "dp-fedavg",
        "clients_per_round": 4,
        "options": {"clipping_norm": 0.5, "noise_multiplier": 0.8},
    },
    "evaluation": {"clients": 2, "every": 1, "central_rows": 100},
    "engine": {"backend": "local"},
    "output": {"tensorboard": True},
}
#: what the clients' own numbers are called, in any section
CLIENT_NUMBERS = ("train_loss", "steps", "dp-clipped-fraction", "evaluate/", "aggregated_evaluate/")


def every_tag(run_dir):
    """Every summary value's tag in every event file of the run, read raw (all kinds of
    summaries, not only the scalars TensorBoard's accumulator keeps)."""
    tags = set()
    for path in (run_dir / "tensorboard").glob("events.out.tfevents.*"):
        for event in EventFileLoader(str(path)).Load():
            tags.update(value.tag for value in event.summary.value)
    return tags


def private_run(tmp_path, name, **privacy):
    out = tmp_path / name
    config = ExperimentConfig.from_dict({**RUN, "privacy": privacy})
    run_experiment(config, out, progress=False, secrets=ROOT)
    return every_tag(out)


def test_a_private_runs_events_hold_no_client_numbers(tmp_path):
    tags = private_run(tmp_path, "private")
    assert {"central/accuracy", "privacy/epsilon", "aggregated/dp-noise-std"} <= tags
    assert not [t for t in tags if any(n in t for n in CLIENT_NUMBERS)], sorted(tags)

    # the same reader sees them when the run releases them in the clear
    clear = private_run(tmp_path, "in-clear", metrics_in_clear=True)
    assert {"train/train_loss", "evaluate/accuracy", "aggregated/dp-clipped-fraction"} <= clear
