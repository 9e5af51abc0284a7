"""Client optimisers from recent papers, as ``torch.optim.Optimizer`` subclasses.

:class:`~fedsim.workloads.optim.mars.MARS` (AdamW and Lion variants; Yuan et al.,
ICML 2025), :class:`~fedsim.workloads.optim.zeroth_order.RAdaZO` and
:class:`~fedsim.workloads.optim.zeroth_order.ZOAdaMM` (forward-only),
:class:`~fedsim.workloads.optim.hdm_hb.HDMHB` (full-batch hypergradient descent), and
:class:`~fedsim.workloads.optim.choice.ClientOptimizer`, the config that builds one.
"""

from fedsim.workloads.optim.choice import ClientOptimizer, build_optimizer
from fedsim.workloads.optim.hdm_hb import HDMHB
from fedsim.workloads.optim.mars import MARS
from fedsim.workloads.optim.zeroth_order import RAdaZO, ZOAdaMM

__all__ = ["HDMHB", "MARS", "ClientOptimizer", "RAdaZO", "ZOAdaMM", "build_optimizer"]
