"""The matrix mechanism: workloads, factorizations A = B C, sensitivity, streaming noise.

Modules (pure numpy / scipy, float64; no Ray, no Flower):

- :mod:`.workload_matrices` -- prefix sums, SGD with momentum and a learning-rate schedule;
- :mod:`.factorization` -- :class:`Factorization` (C, B, noising matrix, loss, per-round RMSE);
- :mod:`.tree` -- binary tree and Honaker's online tree;
- :mod:`.toeplitz` -- square-root closed form, optimised banded Toeplitz;
- :mod:`.banded` -- BandMF (column-normalised banded C);
- :mod:`.dense` -- dense multi-epoch MF with a participation mask (reverse Cholesky);
- :mod:`.blt` -- buffered linear Toeplitz;
- :mod:`.sensitivity` -- participation schemas and exact / upper-bound sensitivity
  (:func:`fedsim.privacy.matrix.sensitivity.sensitivity`);
- :mod:`.structure` -- what the families' streaming parameters generate (tree nodes and
  decoder, Toeplitz and BLT matrices); :mod:`.verify` -- a factorization's stream checked against
  its C (:meth:`Factorization.load` refuses a file that fails);
- :mod:`.streaming` -- ``C^{-1} z`` round by round with bounded state, fresh noise per round
  from the noise owner's stream;
- :mod:`.kinds` -- the registered kinds, one module each (:class:`.kind.Kind`: build, cost,
  noise stream, stream check, cached-file checks);
- :mod:`.build` -- factorizations by name (:mod:`.kinds`), cached in ``.npz`` files
  (``fedsim factorize``, whose argument parsing is :mod:`fedsim.commands.factorize`).

Example (BandMF for 4 epochs of 256 rounds, noise for a 10-parameter model)::

    from fedsim.privacy.matrix import Participation, banded, noise_stream
    from fedsim.randomness import PartySecret, Purpose

    f = banded(1024, bands=64)
    sens = f.sensitivity(Participation.fixed(4))  # exact: 2.0 (columns of norm 1)
    server = PartySecret.fresh("server")  # the noise owner's secret
    stream = noise_stream(f, lambda t: server.generator(t + 1, Purpose.NOISE), shape=10)
    noise = stream.next() * noise_multiplier * sens.value * clip_norm  # round 0
"""

from fedsim.privacy.matrix.banded import banded
from fedsim.privacy.matrix.blt import blt
from fedsim.privacy.matrix.dense import dense
from fedsim.privacy.matrix.factorization import Factorization
from fedsim.privacy.matrix.sensitivity import Sensitivity
from fedsim.privacy.matrix.streaming import noise_stream
from fedsim.privacy.matrix.toeplitz import banded_toeplitz, sqrt_factorization
from fedsim.privacy.matrix.tree import binary_tree, honaker_tree
from fedsim.privacy.matrix.workload_matrices import momentum, prefix_sum
from fedsim.privacy.participation import Participation

__all__ = [
    "Factorization",
    "Participation",
    "Sensitivity",
    "banded",
    "banded_toeplitz",
    "binary_tree",
    "blt",
    "dense",
    "honaker_tree",
    "momentum",
    "noise_stream",
    "prefix_sum",
    "sqrt_factorization",
]
