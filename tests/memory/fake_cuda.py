"""A stand-in for ``cuda.bindings.driver`` that backs cuMem VMM with host memory (for CPU tests).

Physical allocations are memfds, a "POSIX fd handle" is a dup of the memfd, the VA reservation is a
PROT_NONE anonymous mapping and cuMemMap maps the memfd MAP_SHARED|MAP_FIXED into it, so two
processes that map each other's handles really share memory.  Call forms and return tuples follow
cuda-python; the fake also checks what the real driver would reject (no current context, sizes not
multiples of the granularity, mapping outside a reservation, exporting a handle type that was not
requested) and counts live objects so tests can assert that close() leaks nothing.

FABRIC: ``cuMemCreate`` with FABRIC returns CUDA_ERROR_NOT_PERMITTED, as on the GPU machine without
an IMEX channel, unless ``FAKE_CUDA_FABRIC=1``; then a fabric handle carries (pid, fd) and import
uses pidfd_getfd (needs ptrace permission over the peer).
"""
from __future__ import annotations

import ctypes
import enum
import os
import struct
from typing import Any

GRANULARITY = 2 << 20
NUM_DEVICES = 2

_libc = ctypes.CDLL(None, use_errno=True)
_libc.mmap.restype = ctypes.c_void_p
_libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
_libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
_libc.syscall.restype = ctypes.c_long
_PROT_NONE, _PROT_RW = 0, 3
_MAP_SHARED, _MAP_PRIVATE, _MAP_FIXED, _MAP_ANON, _MAP_NORESERVE = 0x1, 0x2, 0x10, 0x20, 0x4000
_MAP_FAILED = ctypes.c_void_p(-1).value
_SYS_PIDFD_OPEN, _SYS_PIDFD_GETFD = 434, 438


class CUresult(enum.IntEnum):
    CUDA_SUCCESS = 0
    CUDA_ERROR_INVALID_VALUE = 1
    CUDA_ERROR_OUT_OF_MEMORY = 2
    CUDA_ERROR_INVALID_CONTEXT = 201
    CUDA_ERROR_NOT_PERMITTED = 800
    CUDA_ERROR_NOT_SUPPORTED = 801


class CUmemAllocationHandleType(enum.IntEnum):
    CU_MEM_HANDLE_TYPE_NONE = 0
    CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR = 1
    CU_MEM_HANDLE_TYPE_WIN32 = 2
    CU_MEM_HANDLE_TYPE_WIN32_KMT = 4
    CU_MEM_HANDLE_TYPE_FABRIC = 8


class CUmemAllocationType(enum.IntEnum):
    CU_MEM_ALLOCATION_TYPE_PINNED = 1


class CUmemLocationType(enum.IntEnum):
    CU_MEM_LOCATION_TYPE_DEVICE = 1


class CUmemAllocationGranularity_flags(enum.IntEnum):
    CU_MEM_ALLOC_GRANULARITY_MINIMUM = 0
    CU_MEM_ALLOC_GRANULARITY_RECOMMENDED = 1


class CUmemAccess_flags(enum.IntEnum):
    CU_MEM_ACCESS_FLAGS_PROT_READWRITE = 3


class CUdevice_attribute(enum.IntEnum):
    CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED = 102
    CU_DEVICE_ATTRIBUTE_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR_SUPPORTED = 103
    CU_DEVICE_ATTRIBUTE_HANDLE_TYPE_FABRIC_SUPPORTED = 128


class CUmemLocation:
    def __init__(self) -> None:
        self.type: Any = None
        self.id = 0


class CUmemAllocationProp:
    def __init__(self) -> None:
        self.type: Any = None
        self.location = CUmemLocation()
        self._handle_types = CUmemAllocationHandleType.CU_MEM_HANDLE_TYPE_NONE

    @property
    def requestedHandleTypes(self) -> Any:
        return self._handle_types

    @requestedHandleTypes.setter
    def requestedHandleTypes(self, value: Any) -> None:
        if not isinstance(value, CUmemAllocationHandleType):  # cuda-bindings 13 is this strict
            raise TypeError("requestedHandleTypes requires a CUmemAllocationHandleType member")
        self._handle_types = value


class CUmemAccessDesc:
    def __init__(self) -> None:
        self.location = CUmemLocation()
        self.flags: Any = None


class CUmemFabricHandle:
    def __init__(self, data: bytes) -> None:
        self.data = data


def _ok(*outs: Any) -> tuple:
    return (CUresult.CUDA_SUCCESS, *outs)


def _err(code: CUresult, n_out: int) -> tuple:
    return (code, *([None] * n_out))


class FakeDriver:
    """Module-like object: enums and cu* functions as attributes."""

    CUresult = CUresult
    CUmemAllocationHandleType = CUmemAllocationHandleType
    CUmemAllocationType = CUmemAllocationType
    CUmemLocationType = CUmemLocationType
    CUmemAllocationGranularity_flags = CUmemAllocationGranularity_flags
    CUmemAccess_flags = CUmemAccess_flags
    CUdevice_attribute = CUdevice_attribute
    CUmemLocation = CUmemLocation
    CUmemAllocationProp = CUmemAllocationProp
    CUmemAccessDesc = CUmemAccessDesc

    def __init__(self, fabric: bool = False) -> None:
        self.fabric = fabric
        self.initialised = False
        self.ctx_stack: list[int] = []
        self.ctx_refs = [0] * NUM_DEVICES
        self.handles: dict[int, tuple[int, Any]] = {}  # handle id -> (memfd, requested types)
        self.reservations: dict[int, int] = {}  # base -> size
        self.mappings: dict[int, int] = {}  # ptr -> size
        self.mapped_origin: dict[int, str] = {}  # ptr -> "created" | "imported" (what is mapped there)
        self.imported: set[int] = set()
        self.next_handle = 1
        self.calls: list[str] = []
        self.failures: dict[str, CUresult] = {}  # call name -> error it returns (failure injection)

    def __getattribute__(self, name: str) -> Any:
        failures = object.__getattribute__(self, "failures") if name.startswith("cu") else {}
        if name in failures:
            code = failures[name]
            return lambda *args: (code, None)
        return object.__getattribute__(self, name)

    # ---- bookkeeping the tests look at -------------------------------------------------------
    def live(self) -> dict[str, int]:
        return {"handles": len(self.handles), "reservations": len(self.reservations),
                "mappings": len(self.mappings), "ctx_refs": sum(self.ctx_refs), "ctx_stack": len(self.ctx_stack)}

    def origin_at(self, ptr: int) -> str:
        return self.mapped_origin.get(int(ptr), "unmapped")

    def _need_ctx(self) -> bool:
        return bool(self.ctx_stack)

    # ---- init / device -------------------------------------------------------------------------
    def cuInit(self, flags: int) -> tuple:
        self.initialised = True
        return _ok()

    def cuGetErrorName(self, err: Any) -> tuple:
        return _ok(CUresult(int(err)).name.encode())

    def cuDeviceGetCount(self) -> tuple:
        return _ok(NUM_DEVICES) if self.initialised else _err(CUresult.CUDA_ERROR_INVALID_VALUE, 1)

    def cuDeviceGet(self, ordinal: int) -> tuple:
        if not self.initialised or not 0 <= ordinal < NUM_DEVICES:
            return _err(CUresult.CUDA_ERROR_INVALID_VALUE, 1)
        return _ok(ordinal)

    def cuDeviceGetName(self, length: int, dev: int) -> tuple:
        return _ok(b"Fake H200\x00".ljust(length, b"\x00"))

    def cuDeviceGetPCIBusId(self, length: int, dev: int) -> tuple:
        return _ok(f"0000:{0x18 + dev:02X}:00.0".encode() + b"\x00")

    def cuDriverGetVersion(self) -> tuple:
        return _ok(13000)

    def cuDeviceGetAttribute(self, attrib: Any, dev: int) -> tuple:
        return _ok(1 if attrib in CUdevice_attribute.__members__.values() else 0)

    def cuDeviceCanAccessPeer(self, dev: int, peer: int) -> tuple:
        return _ok(1)

    # ---- contexts ------------------------------------------------------------------------------
    def cuDevicePrimaryCtxRetain(self, dev: int) -> tuple:
        self.ctx_refs[dev] += 1
        return _ok(1000 + dev)

    def cuDevicePrimaryCtxRelease(self, dev: int) -> tuple:
        if self.ctx_refs[dev] <= 0:
            return _err(CUresult.CUDA_ERROR_INVALID_CONTEXT, 0)
        self.ctx_refs[dev] -= 1
        return _ok()

    def cuCtxPushCurrent(self, ctx: int) -> tuple:
        self.ctx_stack.append(ctx)
        return _ok()

    def cuCtxPopCurrent(self) -> tuple:
        if not self.ctx_stack:
            return _err(CUresult.CUDA_ERROR_INVALID_CONTEXT, 1)
        return _ok(self.ctx_stack.pop())

    def cuCtxSynchronize(self) -> tuple:
        return _ok() if self._need_ctx() else _err(CUresult.CUDA_ERROR_INVALID_CONTEXT, 0)

    # ---- physical memory -----------------------------------------------------------------------
    def cuMemGetAllocationGranularity(self, prop: CUmemAllocationProp, option: Any) -> tuple:
        return _ok(GRANULARITY)

    def cuMemCreate(self, size: int, prop: CUmemAllocationProp, flags: int) -> tuple:
        self.calls.append("cuMemCreate")
        if not self._need_ctx():
            return _err(CUresult.CUDA_ERROR_INVALID_CONTEXT, 1)
        if size <= 0 or size % GRANULARITY:
            return _err(CUresult.CUDA_ERROR_INVALID_VALUE, 1)
        types = prop.requestedHandleTypes
        if types == CUmemAllocationHandleType.CU_MEM_HANDLE_TYPE_FABRIC and not self.fabric:
            return _err(CUresult.CUDA_ERROR_NOT_PERMITTED, 1)
        fd = os.memfd_create("fake_cuda_alloc")
        os.ftruncate(fd, size)
        h = self.next_handle
        self.next_handle += 1
        self.handles[h] = (fd, types)
        return _ok(h)

    def cuMemExportToShareableHandle(self, handle: int, handle_type: Any, flags: int) -> tuple:
        if handle not in self.handles:
            return _err(CUresult.CUDA_ERROR_INVALID_VALUE, 1)
        fd, types = self.handles[handle]
        if handle_type != types:
            return _err(CUresult.CUDA_ERROR_INVALID_VALUE, 1)
        if handle_type == CUmemAllocationHandleType.CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR:
            return _ok(os.dup(fd))
        if handle_type == CUmemAllocationHandleType.CU_MEM_HANDLE_TYPE_FABRIC:
            return _ok(CUmemFabricHandle(struct.pack("=qq", os.getpid(), fd).ljust(64, b"\x00")))
        return _err(CUresult.CUDA_ERROR_INVALID_VALUE, 1)

    def cuMemImportFromShareableHandle(self, os_handle: Any, handle_type: Any) -> tuple:
        if handle_type == CUmemAllocationHandleType.CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR:
            if not isinstance(os_handle, int):
                return _err(CUresult.CUDA_ERROR_INVALID_VALUE, 1)
            fd = os.dup(os_handle)  # the import holds its own reference, as the driver does
        elif handle_type == CUmemAllocationHandleType.CU_MEM_HANDLE_TYPE_FABRIC:
            if not self.fabric:
                return _err(CUresult.CUDA_ERROR_NOT_PERMITTED, 1)
            raw = bytes(os_handle)
            if len(raw) != 64:
                return _err(CUresult.CUDA_ERROR_INVALID_VALUE, 1)
            pid, remote_fd = struct.unpack("=qq", raw[:16])
            pidfd = _libc.syscall(_SYS_PIDFD_OPEN, pid, 0)
            if pidfd < 0:
                return _err(CUresult.CUDA_ERROR_NOT_PERMITTED, 1)
            fd = _libc.syscall(_SYS_PIDFD_GETFD, pidfd, remote_fd, 0)
            os.close(pidfd)
            if fd < 0:
                return _err(CUresult.CUDA_ERROR_NOT_PERMITTED, 1)
        else:
            return _err(CUresult.CUDA_ERROR_INVALID_VALUE, 1)
        h = self.next_handle
        self.next_handle += 1
        self.handles[h] = (fd, handle_type)
        self.imported.add(h)
        return _ok(h)

    def cuMemRelease(self, handle: int) -> tuple:
        if handle not in self.handles:
            return _err(CUresult.CUDA_ERROR_INVALID_VALUE, 0)
        fd, _ = self.handles.pop(handle)
        self.imported.discard(handle)
        os.close(fd)  # a mapping keeps the memory alive on its own, as in the driver
        return _ok()

    # ---- virtual addresses ---------------------------------------------------------------------
    def cuMemAddressReserve(self, size: int, alignment: int, addr: int, flags: int) -> tuple:
        if size <= 0 or size % GRANULARITY or (alignment and alignment % GRANULARITY):
            return _err(CUresult.CUDA_ERROR_INVALID_VALUE, 1)
        # over-reserve so the base can be aligned to the granularity, then trim
        raw = _libc.mmap(None, size + GRANULARITY, _PROT_NONE, _MAP_PRIVATE | _MAP_ANON | _MAP_NORESERVE, -1, 0)
        if raw in (None, _MAP_FAILED):
            return _err(CUresult.CUDA_ERROR_OUT_OF_MEMORY, 1)
        base = (raw + GRANULARITY - 1) // GRANULARITY * GRANULARITY
        if base > raw:
            _libc.munmap(raw, base - raw)
        tail = raw + size + GRANULARITY - (base + size)
        if tail:
            _libc.munmap(base + size, tail)
        self.reservations[base] = size
        return _ok(base)

    def _inside_reservation(self, ptr: int, size: int) -> bool:
        return any(b <= ptr and ptr + size <= b + s for b, s in self.reservations.items())

    def cuMemMap(self, ptr: int, size: int, offset: int, handle: int, flags: int) -> tuple:
        ptr = int(ptr)
        if handle not in self.handles or offset or ptr % GRANULARITY or size % GRANULARITY:
            return _err(CUresult.CUDA_ERROR_INVALID_VALUE, 0)
        if not self._inside_reservation(ptr, size) or any(
                p < ptr + size and ptr < p + s for p, s in self.mappings.items()):
            return _err(CUresult.CUDA_ERROR_INVALID_VALUE, 0)
        fd, _ = self.handles[handle]
        if os.fstat(fd).st_size < size:
            return _err(CUresult.CUDA_ERROR_INVALID_VALUE, 0)
        got = _libc.mmap(ptr, size, _PROT_RW, _MAP_SHARED | _MAP_FIXED, fd, 0)
        if got != ptr:
            return _err(CUresult.CUDA_ERROR_OUT_OF_MEMORY, 0)
        self.mappings[ptr] = size
        self.mapped_origin[ptr] = "imported" if handle in self.imported else "created"
        return _ok()

    def cuMemSetAccess(self, ptr: int, size: int, descs: list, count: int) -> tuple:
        ptr = int(ptr)
        covered = sum(s for p, s in self.mappings.items() if ptr <= p and p + s <= ptr + size)
        if count != len(descs) or count < 1 or covered != size:
            return _err(CUresult.CUDA_ERROR_INVALID_VALUE, 0)
        if not all(d.flags == CUmemAccess_flags.CU_MEM_ACCESS_FLAGS_PROT_READWRITE for d in descs):
            return _err(CUresult.CUDA_ERROR_INVALID_VALUE, 0)
        return _ok()

    def cuMemUnmap(self, ptr: int, size: int) -> tuple:
        ptr = int(ptr)
        if self.mappings.get(ptr) != size:
            return _err(CUresult.CUDA_ERROR_INVALID_VALUE, 0)
        del self.mappings[ptr]
        del self.mapped_origin[ptr]
        # put the PROT_NONE reservation back in place of the mapping
        _libc.mmap(ptr, size, _PROT_NONE, _MAP_PRIVATE | _MAP_ANON | _MAP_FIXED | _MAP_NORESERVE, -1, 0)
        return _ok()

    def cuMemAddressFree(self, ptr: int, size: int) -> tuple:
        ptr = int(ptr)
        if self.reservations.get(ptr) != size or any(ptr <= p < ptr + size for p in self.mappings):
            return _err(CUresult.CUDA_ERROR_INVALID_VALUE, 0)
        del self.reservations[ptr]
        _libc.munmap(ptr, size)
        return _ok()


def install(fabric: bool = False) -> FakeDriver:
    """Make ep_comm.memory use a fresh FakeDriver and CPU tensors (in this process)."""
    from ep_comm.memory import _driver, probe, symmetric

    fake = FakeDriver(fabric=fabric)
    _driver._DRIVER = fake
    symmetric._TENSOR_DEVICE_TYPE = "cpu"
    probe._probe_cached.cache_clear()
    return fake
