"""A torch tensor over raw memory with an explicit device, through a hand-built DLPack capsule.

Why not ``__cuda_array_interface__``: for a pointer without an explicit device index torch asks
``cudaPointerGetAttributes`` which device owns the memory, and for a peer GPU's memory mapped into our
address space that is the *peer's* device; torch would then run kernels for the tensor on a device
that has no access to the mapping, or copy it.  DLPack carries the device explicitly and torch's
``fromDLPack`` uses it as the tensor's device without asking the driver.

Lifetime: each capsule's ``manager_ctx`` keeps ``owner`` (the object that unmaps the memory) alive
until torch frees the tensor and calls our deleter.
"""
from __future__ import annotations

import ctypes
import threading
from typing import Any

import torch

_KDL_CPU = 1
_KDL_CUDA = 2
_KDL_UINT = 1
_CAPSULE_NAME = b"dltensor"  # module-level so the name outlives every capsule that points at it


class _DLDevice(ctypes.Structure):
    _fields_ = [("device_type", ctypes.c_int32), ("device_id", ctypes.c_int32)]


class _DLDataType(ctypes.Structure):
    _fields_ = [("code", ctypes.c_uint8), ("bits", ctypes.c_uint8), ("lanes", ctypes.c_uint16)]


class _DLTensor(ctypes.Structure):
    _fields_ = [
        ("data", ctypes.c_void_p),
        ("device", _DLDevice),
        ("ndim", ctypes.c_int32),
        ("dtype", _DLDataType),
        ("shape", ctypes.POINTER(ctypes.c_int64)),
        ("strides", ctypes.POINTER(ctypes.c_int64)),
        ("byte_offset", ctypes.c_uint64),
    ]


class _DLManagedTensor(ctypes.Structure):
    pass


_DELETER_T = ctypes.CFUNCTYPE(None, ctypes.POINTER(_DLManagedTensor))
_DLManagedTensor._fields_ = [
    ("dl_tensor", _DLTensor),
    ("manager_ctx", ctypes.c_void_p),
    ("deleter", _DELETER_T),
]

# address of a live DLManagedTensor -> the Python objects it needs (struct, shape array, owner)
_LIVE: dict[int, tuple[Any, ...]] = {}
_LIVE_LOCK = threading.Lock()


def _deleter(managed: Any) -> None:
    # Runs when torch frees the tensor (possibly at interpreter exit): never raise from here.
    try:
        addr = ctypes.cast(managed, ctypes.c_void_p).value
        if addr is None:  # a NULL pointer: no live tensor is registered under it
            return
        with _LIVE_LOCK:
            _LIVE.pop(addr, None)
    except Exception:
        pass


_DELETER = _DELETER_T(_deleter)  # module-level: the C function pointer must stay valid forever

_PyCapsule_New = ctypes.pythonapi.PyCapsule_New
_PyCapsule_New.restype = ctypes.py_object
_PyCapsule_New.argtypes = [ctypes.c_void_p, ctypes.c_char_p, ctypes.c_void_p]


def live_views() -> int:
    """How many tensors made by ``tensor_from_pointer`` torch still holds (for tests)."""
    with _LIVE_LOCK:
        return len(_LIVE)


def tensor_from_pointer(ptr: int, nbytes: int, device: torch.device, owner: Any = None) -> torch.Tensor:
    """A 1-D ``torch.uint8`` tensor of ``nbytes`` elements viewing memory at ``ptr`` on ``device``.

    ``device`` is a CPU device or a CUDA device with an index; the tensor is on exactly that device.
    ``owner`` is kept alive as long as the tensor (or any view of it) exists.
    """
    if device.type == "cuda":
        if device.index is None:
            raise ValueError("tensor_from_pointer needs a CUDA device with an index")
        dev = _DLDevice(_KDL_CUDA, int(device.index))
    elif device.type == "cpu":
        dev = _DLDevice(_KDL_CPU, 0)
    else:
        raise ValueError(f"unsupported device {device}")
    shape = (ctypes.c_int64 * 1)(int(nbytes))
    managed = _DLManagedTensor()
    managed.dl_tensor.data = ctypes.c_void_p(int(ptr))
    managed.dl_tensor.device = dev
    managed.dl_tensor.ndim = 1
    managed.dl_tensor.dtype = _DLDataType(_KDL_UINT, 8, 1)
    managed.dl_tensor.shape = ctypes.cast(shape, ctypes.POINTER(ctypes.c_int64))
    managed.dl_tensor.strides = None  # compact row-major
    managed.dl_tensor.byte_offset = 0
    managed.manager_ctx = None
    managed.deleter = _DELETER
    addr = ctypes.addressof(managed)
    with _LIVE_LOCK:
        _LIVE[addr] = (managed, shape, owner)
    try:
        capsule = _PyCapsule_New(addr, _CAPSULE_NAME, None)
        tensor = torch.utils.dlpack.from_dlpack(capsule)
    except BaseException:
        with _LIVE_LOCK:
            _LIVE.pop(addr, None)
        raise
    return tensor
