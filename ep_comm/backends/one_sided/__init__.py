"""The one-sided family: one set of kernels over two memory providers (``mnnvl``, ``nvshmem``)."""
from .backend import OneSidedBackend
from .layout import check_environment
from .mnnvl import MnnvlBackend
from .nvshmem import NvshmemBackend

__all__ = ["OneSidedBackend", "MnnvlBackend", "NvshmemBackend", "check_environment"]
