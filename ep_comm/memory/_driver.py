"""Thin, checked access to the CUDA driver through cuda-python (``cuda.bindings.driver``).

cuda-bindings is imported lazily so CPU-only machines can import ``ep_comm.memory``.  Every driver
call goes through ``call``, which turns a non-success ``CUresult`` into ``CudaDriverError`` naming
the call and the error (e.g. ``cuMemCreate -> CUDA_ERROR_NOT_PERMITTED``).
"""
from __future__ import annotations

import contextlib
from typing import Any, Iterator, Optional

from ..errors import EPError

_DRIVER: Optional[Any] = None


class CudaDriverError(EPError):
    """A CUDA driver call failed; ``call`` and ``error_name`` say which and how."""

    def __init__(self, call: str, error_name: str, code: int, detail: str = ""):
        self.call = call
        self.error_name = error_name
        self.code = code
        extra = f" ({detail})" if detail else ""
        super().__init__(f"{call} failed: {error_name} ({code}){extra}")


def driver() -> Any:
    """The ``cuda.bindings.driver`` module (raises ImportError when cuda-bindings is missing)."""
    global _DRIVER
    if _DRIVER is None:
        try:
            from cuda.bindings import driver as cu
        except ImportError:
            from cuda import cuda as cu  # cuda-python < 12.9 spelled the module this way
        _DRIVER = cu
    return _DRIVER


def error_name(cu: Any, err: Any) -> str:
    name = getattr(err, "name", None)
    if isinstance(name, str) and name:
        return name
    try:
        res, raw = cu.cuGetErrorName(err)
        if raw:
            return raw.decode() if isinstance(raw, bytes) else str(raw)
    except Exception:  # error naming must never hide the original failure
        pass
    return f"CUresult {int(err)}"


def call(name: str, *args: Any, detail: str = "") -> Any:
    """Call ``cuda.bindings.driver.<name>(*args)`` and check its CUresult.

    Returns None, the single output, or a tuple of outputs.
    """
    cu = driver()
    out = getattr(cu, name)(*args)
    if not isinstance(out, tuple):  # defensive: every driver binding returns a tuple today
        out = (out,)
    err, rest = out[0], out[1:]
    if err != cu.CUresult.CUDA_SUCCESS:
        raise CudaDriverError(name, error_name(cu, err), int(err), detail)
    if not rest:
        return None
    return rest[0] if len(rest) == 1 else rest


def init() -> None:
    """cuInit; a machine without the NVIDIA driver library (libcuda) gets ``CudaDriverError`` too.

    cuda-bindings >= 13 loads libcuda on first use and raises its own exception type when it is
    missing (a CPU-only machine with cuda-bindings installed): report that like any driver failure.
    """
    try:
        call("cuInit", 0)
    except CudaDriverError:
        raise
    except Exception as exc:  # e.g. cuda.pathfinder's DynamicLibNotFoundError
        raise CudaDriverError("cuInit", "CUDA_DRIVER_NOT_FOUND", -1,
                              f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}") from exc


def host_waits_yield(device_index: int) -> bool:
    """Whether waits on this device's primary context (torch's) yield the CPU or block: the
    process asked for ``cudaDeviceScheduleYield`` / ``BlockingSync``.  The default (auto, with fewer
    contexts than CPUs) and ``Spin`` busy-wait instead."""
    cu = driver()
    init()
    flags, _active = call("cuDevicePrimaryCtxGetState", call("cuDeviceGet", device_index))
    sched = int(flags) & int(cu.CUctx_flags.CU_CTX_SCHED_MASK)
    return sched in (int(cu.CUctx_flags.CU_CTX_SCHED_YIELD), int(cu.CUctx_flags.CU_CTX_SCHED_BLOCKING_SYNC))


@contextlib.contextmanager
def device_context(device_index: int) -> Iterator[Any]:
    """Make device ``device_index``'s primary context current for the block (then restore).

    The primary context is the one torch uses, so memory mapped here is usable from torch tensors.
    Retain/release keeps it alive even if nothing else had created it yet.
    """
    init()
    dev = call("cuDeviceGet", device_index)
    ctx = call("cuDevicePrimaryCtxRetain", dev)
    try:
        call("cuCtxPushCurrent", ctx)
        try:
            yield dev
        finally:
            call("cuCtxPopCurrent")
    finally:
        call("cuDevicePrimaryCtxRelease", dev)


def handle_type_enum(kind: str) -> Any:
    """``CUmemAllocationHandleType`` member for ``"none"``, ``"posix_fd"`` or ``"fabric"``."""
    t = driver().CUmemAllocationHandleType
    if kind == "none":
        return t.CU_MEM_HANDLE_TYPE_NONE
    if kind == "posix_fd":
        return t.CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR
    if kind == "fabric":
        return t.CU_MEM_HANDLE_TYPE_FABRIC
    raise ValueError(kind)


def combined_handle_type_enum() -> Optional[Any]:
    """POSIX_FD|FABRIC as one ``CUmemAllocationHandleType`` value, or None.

    The C API takes an OR of handle types, but cuda-python's enum only accepts its named members and
    has no combined one, so today this is None and an allocation carries exactly one handle type.
    """
    t = driver().CUmemAllocationHandleType
    value = int(t.CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR) | int(t.CU_MEM_HANDLE_TYPE_FABRIC)
    try:
        return t(value)
    except (ValueError, TypeError):
        return None


def allocation_prop(device_index: int, handle_types: Any) -> Any:
    """Pinned device allocation on ``device_index`` exportable as ``handle_types``."""
    cu = driver()
    prop = cu.CUmemAllocationProp()
    prop.type = cu.CUmemAllocationType.CU_MEM_ALLOCATION_TYPE_PINNED
    loc = cu.CUmemLocation()
    loc.type = cu.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
    loc.id = device_index
    prop.location = loc
    prop.requestedHandleTypes = handle_types
    return prop


def granularity(prop: Any) -> int:
    cu = driver()
    flag = cu.CUmemAllocationGranularity_flags.CU_MEM_ALLOC_GRANULARITY_RECOMMENDED
    return int(call("cuMemGetAllocationGranularity", prop, flag))


def access_desc(device_index: int) -> Any:
    """Read/write access for ``device_index`` (what cuMemSetAccess needs for our own GPU)."""
    cu = driver()
    desc = cu.CUmemAccessDesc()
    loc = cu.CUmemLocation()
    loc.type = cu.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
    loc.id = device_index
    desc.location = loc
    desc.flags = cu.CUmemAccess_flags.CU_MEM_ACCESS_FLAGS_PROT_READWRITE
    return desc


def fabric_handle_bytes(handle: Any) -> bytes:
    """The 64 opaque bytes of an exported ``CUmemFabricHandle``."""
    data = getattr(handle, "data", handle)
    return bytes(data)
