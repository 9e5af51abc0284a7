"""The ``fedsim`` subcommands other than ``run`` and ``flwr-run`` (:mod:`fedsim.cli`, the
console-script entry point, registers and dispatches them):

- :mod:`fedsim.commands.account` -- ``fedsim account``: epsilon, noise calibration, sweeps;
- :mod:`fedsim.commands.factorize` -- ``fedsim factorize``: build or reuse a factorization;
- :mod:`fedsim.commands.audit` -- ``fedsim audit``: audit a finished run directory;
- :mod:`fedsim.commands.minmax` -- ``fedsim minmax``: QODA on a min-max game.

Each module has ``register(subparsers)`` and ``run(args)``; they sit on top of the layers
(tests/test_layers.py) and nothing below imports them. :mod:`fedsim.commands.console` sets
up what every command writes to stderr (``--quiet``, ``--verbose``).
"""
