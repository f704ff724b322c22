"""ep_comm: move Mixture-of-Experts tokens between expert-parallel ranks.

    topo = ep_comm.init_distributed()
    cfg = ep_comm.EPConfig(num_experts=256, top_k=8, hidden=7168, max_tokens_per_rank=128)
    with ep_comm.Communicator(cfg) as comm:
        d = comm.dispatch(x, topk_ids, topk_weights)
        y = comm.combine(my_experts(d), d)
"""
from . import routing
from .communicator import Communicator
from .config import EPConfig
from .distributed import Topology, init_distributed
from .errors import EPConfigError, EPError, EPInputError, EPTimeoutError, EPTopologyError
from .layouts import Dispatched

__version__ = "0.1.0"

__all__ = [
    "Communicator", "Dispatched", "EPConfig", "EPConfigError", "EPError", "EPInputError", "EPTimeoutError",
    "EPTopologyError", "Topology", "init_distributed", "routing",
]
