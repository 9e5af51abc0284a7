"""The ``fedsim`` subcommands other than ``run`` and ``flwr-run`` (:mod:`fedsim.cli`, the
console-script entry point, registers and dispatches them):

- :mod:`fedsim.commands.account` -- ``fedsim account``: epsilon, noise calibration, sweeps;
- :mod:`fedsim.commands.factorize` -- ``fedsim factorize``: build or reuse a factorization;
- :mod:`fedsim.commands.audit` -- ``fedsim audit``: audit a finished run directory;
- :mod:`fedsim.commands.minmax` -- ``fedsim minmax``: QODA on a min-max game;
- :mod:`fedsim.commands.plot` -- ``fedsim plot``: runs' curves as a PNG (runs that differ
  only in seed as a mean with a band);
- :mod:`fedsim.commands.compare` -- ``fedsim compare``: runs' final and best values (mean ± sd
  over seeds, paired differences), config differences.

Each module has ``register(subparsers)`` and ``run(args)``, or ``add_parser(subparsers)``,
which sets the parser's ``func`` to its handler; they sit on top of the layers
(tests/test_layers.py) and nothing below imports them. :mod:`fedsim.commands.console` sets
up what every command writes to stderr (``--quiet``, ``--verbose``).
"""
