"""cuMem VMM memory layer: probe, handle plan, fd passing, symmetric buffers mapped on every rank.

Layering: imports ``ep_comm.errors`` and ``ep_comm.distributed`` only.  cuda-bindings is imported
lazily, so this package imports (and ``memory_report`` says "no CUDA") on CPU-only machines.
"""
from ._driver import CudaDriverError
from .fd_passing import FdPassingError, FdPassingRefused, FdServer, exchange_fds, fetch_fds
from .info import memory_info, memory_report
from .plan import DEFAULT_FALLBACK_BACKENDS, HandlePlan, HandleType, plan_handles
from .probe import IMEX_CHANNEL_DIR, Capabilities, peer_access_matrix, probe_capabilities
from .symmetric import SymmetricBuffer

__all__ = [
    "Capabilities",
    "CudaDriverError",
    "DEFAULT_FALLBACK_BACKENDS",
    "FdPassingError",
    "FdPassingRefused",
    "FdServer",
    "HandlePlan",
    "HandleType",
    "IMEX_CHANNEL_DIR",
    "SymmetricBuffer",
    "exchange_fds",
    "fetch_fds",
    "memory_info",
    "memory_report",
    "peer_access_matrix",
    "plan_handles",
    "probe_capabilities",
]
