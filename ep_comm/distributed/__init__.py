"""Bootstrap and topology: the lowest layer (imports nothing else from ep_comm but errors)."""
from .bootstrap import init_distributed, shutdown
from .topology import Topology, gather_topology, local_host_id

__all__ = ["init_distributed", "shutdown", "Topology", "gather_topology", "local_host_id"]
