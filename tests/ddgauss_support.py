"""The run config DDGauss's strategy tests and its attacks share (``mode`` and ``dropout`` are
formatted in)."""

RUN = """
seed = 4
rounds = 3

[data]
source = "digits"
partition = "iid"
num_clients = 30

[model]
kind = "logreg"

[client]
lr = 0.2

[strategy]
name = "ddgauss"
clients_per_round = 10

[strategy.options]
clipping_norm = 1.0
noise_multiplier = 0.5
mode = "{mode}"
ring_bits = 32

[faults]
dropout = {dropout}

[engine]
backend = "local"
"""
