"""Per-rank probe of what the cuMem VMM layer can do on this process's GPU.

The device attribute ``CU_DEVICE_ATTRIBUTE_HANDLE_TYPE_FABRIC_SUPPORTED`` is not enough: in a
container without an IMEX channel it reads 1 while ``cuMemCreate`` with a FABRIC handle type returns
``CUDA_ERROR_NOT_PERMITTED`` (docs/design.md §14).  So the probe makes a real small allocation of each handle
type, exports it, and releases it.  The result is a small frozen ``Capabilities`` that ranks
all-gather (as bytes) before deciding how to map each other's memory.
"""
from __future__ import annotations

import dataclasses
import functools
import json
import os
from typing import Any, Optional

from . import _driver
from ._driver import CudaDriverError

IMEX_CHANNEL_DIR = "/dev/nvidia-caps-imex-channels"

__all__ = ["Capabilities", "probe_capabilities", "peer_access_matrix", "IMEX_CHANNEL_DIR", "imex_channels"]


@dataclasses.dataclass(frozen=True)
class Capabilities:
    """What one rank's GPU and driver allow (all fields JSON-serialisable).

    ``cuda`` is False when there is no usable GPU (``reason`` says why: no cuda-bindings, no device).
    ``*_supported`` are device attributes; ``*_permitted`` are the outcome of a real cuMemCreate plus
    cuMemExportToShareableHandle with that handle type, and ``*_error`` the CUDA error name when it
    failed (e.g. ``CUDA_ERROR_NOT_PERMITTED`` for FABRIC without an IMEX channel).
    ``peer_access`` lists, per local GPU (by PCI bus id), whether this rank's GPU can access it.
    """

    cuda: bool
    reason: str = ""
    device_index: int = -1
    device_name: str = ""
    pci_bus_id: str = ""
    driver_version: int = 0
    vmm_supported: bool = False
    posix_fd_supported: bool = False
    posix_fd_permitted: bool = False
    posix_fd_error: str = ""
    fabric_supported: bool = False
    fabric_permitted: bool = False
    fabric_error: str = ""
    combined_handle_types: bool = False
    imex_channels: tuple[str, ...] = ()
    imex_channel_dir: bool = False
    granularity: int = 0
    fabric_granularity: int = 0
    peer_access: tuple[tuple[str, bool], ...] = ()

    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["imex_channels"] = list(self.imex_channels)
        d["peer_access"] = [[bus, ok] for bus, ok in self.peer_access]
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Capabilities:
        known = {f.name for f in dataclasses.fields(cls)}
        kw = {k: v for k, v in d.items() if k in known}  # tolerate newer peers' extra fields
        kw["imex_channels"] = tuple(kw.get("imex_channels", ()))
        kw["peer_access"] = tuple((str(b), bool(ok)) for b, ok in kw.get("peer_access", ()))
        return cls(**kw)

    def to_bytes(self) -> bytes:
        return json.dumps(self.to_dict(), sort_keys=True).encode()

    @classmethod
    def from_bytes(cls, raw: bytes) -> Capabilities:
        return cls.from_dict(json.loads(raw.decode()))

    def can_access(self, pci_bus_id: str) -> Optional[bool]:
        """Whether this GPU can access the local GPU with that bus id (None: not visible here)."""
        if pci_bus_id == self.pci_bus_id:
            return True
        for bus, ok in self.peer_access:
            if bus == pci_bus_id:
                return ok
        return None

    def fabric_summary(self) -> str:
        """One line on FABRIC handles, e.g. 'fabric supported but not permitted (no IMEX channel)'."""
        if not self.cuda:
            return f"no CUDA ({self.reason})"
        if self.fabric_permitted:
            return "fabric permitted"
        if not self.fabric_supported:
            return "fabric not supported by this GPU/driver (CU_DEVICE_ATTRIBUTE_HANDLE_TYPE_FABRIC_SUPPORTED=0)"
        if self.fabric_error == "CUDA_ERROR_NOT_PERMITTED":
            why = "no IMEX channel" if not self.imex_channels else "IMEX channel present but not usable"
            return f"fabric supported but not permitted ({why}; cuMemCreate(FABRIC) -> CUDA_ERROR_NOT_PERMITTED)"
        return f"fabric supported but the probe failed ({self.fabric_error or 'unknown error'})"


def imex_channels() -> tuple[bool, tuple[str, ...]]:
    """(does IMEX_CHANNEL_DIR exist, channel device names in it).  Never creates anything."""
    if not os.path.isdir(IMEX_CHANNEL_DIR):
        return False, ()
    try:
        return True, tuple(sorted(os.listdir(IMEX_CHANNEL_DIR)))
    except OSError:
        return True, ()


def _attr(cu: Any, dev: Any, name: str) -> int:
    attr = getattr(cu.CUdevice_attribute, name, None)
    if attr is None:  # older bindings do not know the attribute: the driver cannot either
        return 0
    return int(_driver.call("cuDeviceGetAttribute", attr, dev))


def _try_export(device_index: int, handle_type: Any, size: int) -> str:
    """Allocate ``size`` bytes exportable as ``handle_type``, export, release.  '' or the error name."""
    handle = None
    try:
        prop = _driver.allocation_prop(device_index, handle_type)
        handle = _driver.call("cuMemCreate", size, prop, 0)
        exported = _driver.call("cuMemExportToShareableHandle", handle, handle_type, 0)
        if isinstance(exported, int):  # a POSIX fd: ours to close
            os.close(exported)
        return ""
    except CudaDriverError as exc:
        return exc.error_name
    finally:
        if handle is not None:
            _driver.call("cuMemRelease", handle)


def _bus_id(dev: Any) -> str:
    raw = _driver.call("cuDeviceGetPCIBusId", 32, dev)
    text = raw.decode() if isinstance(raw, (bytes, bytearray)) else str(raw)
    return text.split("\x00", 1)[0].lower()


def _probe_uncached(device_index: int) -> Capabilities:
    try:
        cu = _driver.driver()
    except ImportError:
        return Capabilities(cuda=False, reason="cuda-bindings (cuda-python) not installed")
    try:
        _driver.init()
        count = int(_driver.call("cuDeviceGetCount"))
    except CudaDriverError as exc:
        return Capabilities(cuda=False, reason=f"no CUDA device ({exc.call}: {exc.error_name})")
    if count == 0:
        return Capabilities(cuda=False, reason="no CUDA device")
    if not 0 <= device_index < count:
        return Capabilities(cuda=False, reason=f"device index {device_index} not in [0, {count})")
    dev = _driver.call("cuDeviceGet", device_index)
    name_raw = _driver.call("cuDeviceGetName", 256, dev)
    name = (name_raw.decode() if isinstance(name_raw, (bytes, bytearray)) else str(name_raw)).split("\x00", 1)[0]
    bus = _bus_id(dev)
    version = int(_driver.call("cuDriverGetVersion"))
    vmm = _attr(cu, dev, "CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED") == 1
    fd_attr = _attr(cu, dev, "CU_DEVICE_ATTRIBUTE_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR_SUPPORTED") == 1
    fabric_attr = _attr(cu, dev, "CU_DEVICE_ATTRIBUTE_HANDLE_TYPE_FABRIC_SUPPORTED") == 1
    imex_dir, channels = imex_channels()
    peers = []
    for other in range(count):
        if other == device_index:
            continue
        odev = _driver.call("cuDeviceGet", other)
        peers.append((_bus_id(odev), bool(_driver.call("cuDeviceCanAccessPeer", dev, odev))))

    fd_err = fab_err = "not probed"
    gran = fab_gran = 0
    combined = False
    if vmm:
        with _driver.device_context(device_index):
            # a granularity query may already refuse a handle type: record it like a failed export
            try:
                fd_type = _driver.handle_type_enum("posix_fd")
                gran = _driver.granularity(_driver.allocation_prop(device_index, fd_type))
                fd_err = _try_export(device_index, fd_type, gran) if fd_attr else "not supported"
            except CudaDriverError as exc:
                fd_err = exc.error_name
            if fabric_attr:
                try:
                    fab_type = _driver.handle_type_enum("fabric")
                    fab_gran = _driver.granularity(_driver.allocation_prop(device_index, fab_type))
                    fab_err = _try_export(device_index, fab_type, fab_gran)
                except CudaDriverError as exc:
                    fab_err = exc.error_name
                both = _driver.combined_handle_type_enum()
                if both is not None and not fab_err and not fd_err:
                    combined = _try_export(device_index, both, max(gran, fab_gran)) == ""
            else:
                fab_err = "not supported"
    return Capabilities(
        cuda=True,
        device_index=device_index,
        device_name=name,
        pci_bus_id=bus,
        driver_version=version,
        vmm_supported=vmm,
        posix_fd_supported=fd_attr,
        posix_fd_permitted=vmm and fd_err == "",
        posix_fd_error=fd_err,
        fabric_supported=fabric_attr,
        fabric_permitted=vmm and fab_err == "",
        fabric_error=fab_err,
        combined_handle_types=combined,
        imex_channels=channels,
        imex_channel_dir=imex_dir,
        granularity=gran,
        fabric_granularity=fab_gran,
        peer_access=tuple(peers),
    )


@functools.cache
def _probe_cached(device_index: int) -> Capabilities:
    return _probe_uncached(device_index)


def default_device_index() -> int:
    """torch's current CUDA device, or 0 when torch has no CUDA."""
    try:
        import torch

        if torch.cuda.is_available():
            return int(torch.cuda.current_device())
    except Exception:  # a broken CUDA install must not stop the probe from reporting it
        pass
    return 0


def probe_capabilities(device_index: Optional[int] = None, refresh: bool = False) -> Capabilities:
    """Probe this process's GPU ``device_index`` (default: torch's current device).

    Cached per device (the probe makes real allocations); ``refresh=True`` probes again.
    Failing driver calls outside the handle-type probes raise ``CudaDriverError``.
    """
    idx = default_device_index() if device_index is None else int(device_index)
    if refresh:
        _probe_cached.cache_clear()
    return _probe_cached(idx)


def peer_access_matrix() -> list[list[bool]]:
    """``m[i][j]``: can local GPU i access GPU j's memory (``cuDeviceCanAccessPeer``; diagonal True).

    Empty on a machine without CUDA.
    """
    try:
        _driver.driver()
        _driver.init()
        count = int(_driver.call("cuDeviceGetCount"))
    except (ImportError, CudaDriverError):
        return []
    devs = [_driver.call("cuDeviceGet", i) for i in range(count)]
    return [
        [i == j or bool(_driver.call("cuDeviceCanAccessPeer", devs[i], devs[j])) for j in range(count)]
        for i in range(count)
    ]
