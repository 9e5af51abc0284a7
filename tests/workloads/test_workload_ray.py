"""Client methods on the Ray engine: MARS + local LAWA + 4-bit uploads inside a ClientApp."""

import random

import numpy as np
import pytest
from flwr.serverapp.strategy import FedAvg

from fedsim.data import DatasetSpec, build_dataset
from fedsim.engine.rounds import run_rounds
from fedsim.models import ModelSpec, initial_arrays
from fedsim.record_codec import to_numpy, to_record
from fedsim.workloads.supervised import LocalTraining, make_client_app
from strategies.methods.quantized import DequantizedUploads

pytestmark = pytest.mark.ray


class Phases:
    def __init__(self):
        self.reports = []

    def phase_finished(self, report):
        self.reports.append(report)


def test_mars_lawa_and_quantised_uploads_run_in_a_client_app_on_ray(ray_engine):
    spec = DatasetSpec(source="digits", partition="dirichlet", alpha=0.5, num_clients=16, seed=2)
    dataset = build_dataset(spec)
    model = ModelSpec(kind="mlp", input_shape=dataset.feature_shape, num_classes=10, hidden=(16,))
    methods = dict(
        optimizer={"name": "mars-adamw", "lr": 1e-2},
        averaging={"kind": "lawa", "k": 3, "every": 1, "burn_in": 0},
        compression={"bits": 4, "seed": 5},
    )
    app = make_client_app(model, spec, LocalTraining(epochs=1, batch_size=16, seed=1, **methods))

    def federate():
        phases = Phases()
        random.seed(0)
        grid = ray_engine.open_run(app, 16, datasets=((spec, dataset),), observer=phases)
        strategy = DequantizedUploads(FedAvg(fraction_evaluate=0.0))
        final = run_rounds(strategy, grid, to_record(initial_arrays(model, 0)), 2)
        return to_numpy(final), phases.reports

    (first, reports), (second, _) = federate(), federate()
    start = initial_arrays(model, 0)
    coordinates = sum(v.size for v in start.values())
    train = [r for r in reports if r.message_type.startswith("train")]
    assert [r.succeeded for r in train] == [16, 16]
    assert all(r.client_metrics["upload-bits"] == 4 * 32 + 4 * coordinates for r in train)
    assert all(r.bytes_up < 0.3 * r.bytes_down for r in train)  # packed uploads, dense downloads
    for name, value in first.items():
        assert np.all(np.isfinite(value)) and not np.array_equal(value, start[name])
        np.testing.assert_array_equal(value, second[name])  # seeded: same run, same result
