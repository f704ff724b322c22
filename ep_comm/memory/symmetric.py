"""``SymmetricBuffer``: one cuMem allocation per rank, every rank's mapped into every rank's address space.

Layout: one ``cuMemAddressReserve`` of ``world_size * stride`` bytes; rank p's allocation is mapped
at ``base + p * stride`` (``stride`` = size rounded up to the group's allocation granularity), so
peer pointers are ``base + p * stride`` on every rank and kernels can store straight into a peer's
buffer over NVLink.

Creation is collective and all-or-nothing: the plan (``plan.plan_handles``) is decided from
all-gathered capabilities before anything is allocated, so a cross-host peer without FABRIC handles
raises ``EPTopologyError`` on every rank within one all-gather; after each later phase (allocation,
fd hand-over, mapping) the ranks all-gather a status, so a failure on one rank (out of memory, a
driver error, a refused fd) makes every rank release what it made and raise the same ``EPError``.
"""
from __future__ import annotations

import json
import os
import sys
import threading
from typing import Any, Optional, Sequence, cast

import torch

from ..distributed.exchange import Exchange, close_exchange, exchange_from
from ..distributed.topology import Topology, local_host_id
from ..errors import EPConfigError, EPError
from . import _driver
from ._dlpack import tensor_from_pointer
from .fd_passing import exchange_fds
from .plan import DEFAULT_FALLBACK_BACKENDS, HandlePlan, HandleType, plan_handles
from .probe import Capabilities, default_device_index, probe_capabilities

__all__ = ["SymmetricBuffer"]

# Device type of the tensors handed out.  Always "cuda" in use; the CPU tests swap in a host-memory
# fake of the driver and set "cpu" so the whole create/map/close path runs without a GPU.
_TENSOR_DEVICE_TYPE = "cuda"


def _round_up(n: int, g: int) -> int:
    return (n + g - 1) // g * g


class _Resources:
    """Everything one rank created for one buffer; ``release`` undoes it (idempotent, thread-safe).

    Views handed out as tensors keep this object alive, so dropping the ``SymmetricBuffer`` without
    ``close()`` frees the memory only once no tensor views it any more.
    """

    def __init__(self, device_index: int):
        self.device_index = device_index
        self.dev: Any = None
        self.ctx: Any = None
        self.ctx_retained = False
        self.ctx_pushed = False
        self.own_handle: Any = None
        self.imported: list[Any] = []
        self.base = 0
        self.reserved = 0
        self.mapped: list[tuple[int, int]] = []
        self.fds: list[int] = []
        self._lock = threading.Lock()
        self._released = False

    def enter_context(self) -> None:
        """Retain the device's primary context (held until ``release``) and make it current."""
        _driver.init()
        self.dev = _driver.call("cuDeviceGet", self.device_index)
        self.ctx = _driver.call("cuDevicePrimaryCtxRetain", self.dev)
        self.ctx_retained = True
        _driver.call("cuCtxPushCurrent", self.ctx)
        self.ctx_pushed = True

    def leave_context(self) -> None:
        if self.ctx_pushed:
            self.ctx_pushed = False
            _driver.call("cuCtxPopCurrent")

    def close_fds(self) -> None:
        while self.fds:
            fd = self.fds.pop()
            try:
                os.close(fd)
            except OSError:
                pass

    def release(self) -> None:
        """Unmap, release handles, free the VA range, close fds.  Raises the first driver error after
        trying every step (so one failure does not leak the rest)."""
        with self._lock:
            if self._released:
                return
            self._released = True
        self.close_fds()
        if not self.ctx_retained:
            return
        errors: list[BaseException] = []

        def attempt(name: str, *args: Any) -> None:
            try:
                _driver.call(name, *args)
            except BaseException as exc:
                errors.append(exc)

        pushed = False
        try:
            _driver.call("cuCtxPushCurrent", self.ctx)
            pushed = True
        except BaseException as exc:
            errors.append(exc)
        try:
            if pushed:
                # kernels may still be reading or writing the mappings: let them finish first
                attempt("cuCtxSynchronize")
            for ptr, size in reversed(self.mapped):
                attempt("cuMemUnmap", ptr, size)
            self.mapped = []
            for h in self.imported:
                attempt("cuMemRelease", h)
            self.imported = []
            if self.own_handle is not None:
                attempt("cuMemRelease", self.own_handle)
                self.own_handle = None
            if self.reserved:
                attempt("cuMemAddressFree", self.base, self.reserved)
                self.base = self.reserved = 0
        finally:
            if pushed:
                attempt("cuCtxPopCurrent")
            attempt("cuDevicePrimaryCtxRelease", self.dev)  # the retain of enter_context
            self.ctx_retained = False
        if errors:
            raise errors[0]

    def __del__(self) -> None:
        if sys.is_finalizing():  # the driver may already be unloaded; the OS reclaims everything
            return
        if not self._released and _capturing():
            # release() synchronises and unmaps, which would invalidate the CUDA graph being captured
            # right now: keep this alive until the next create/close outside a capture
            _DEFERRED.append(self)
            return
        try:
            self.release()
        except Exception:
            pass


_DEFERRED: list[_Resources] = []


def _capturing() -> bool:
    try:
        return torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()
    except Exception:
        return False


def _release_deferred() -> None:
    """Release buffers dropped (without close) while a CUDA graph was being captured."""
    if _capturing():
        return
    while _DEFERRED:
        res = _DEFERRED.pop()
        try:
            res.release()
        except Exception:
            pass


def _all_ok(exchange: Exchange, phase: str, error: Optional[BaseException], extra: dict) -> list[dict]:
    """All-gather this rank's status; raise on every rank if any rank failed."""
    msg = dict(extra)
    msg["error"] = None if error is None else f"{type(error).__name__}: {error}"
    infos = [json.loads(raw.decode()) for raw in exchange.allgather_bytes(json.dumps(msg).encode())]
    failed = [(r, i["error"]) for r, i in enumerate(infos) if i["error"]]
    if failed:
        text = "; ".join(f"rank {r}: {e}" for r, e in failed)
        raise EPError(f"SymmetricBuffer.create failed while {phase} on {len(failed)} rank(s): {text}") from error
    return infos


class SymmetricBuffer:
    """``nbytes`` of device memory on every rank of a group, each rank's mapped into all ranks.

    Attributes: ``rank``, ``world_size``, ``nbytes`` (usable bytes per rank), ``stride`` (bytes between
    ranks' buffers in the mapping, granularity-aligned), ``device`` (``torch.device("cuda", i)``),
    ``plan`` (``HandlePlan``), ``local`` (uint8 tensor ``[nbytes]`` of own memory), ``peer(r)``,
    ``peer_ptrs`` (int64 tensor ``[world_size]`` on ``device``: base address of each rank's buffer).
    Tensors from ``local``/``peer`` become invalid after ``close()``.
    """

    def __init__(self, res: _Resources, plan: HandlePlan, nbytes: int, stride: int, exchange: Optional[Exchange],
                 views: list[torch.Tensor], peer_ptrs: torch.Tensor):
        # built by ``create`` only: the views and pointer table already exist at this point, so
        # nothing that can fail happens after the last all-gather of the collective creation
        self._res = res
        self.plan = plan
        self.rank = plan.rank
        self.world_size = plan.world_size
        self.nbytes = nbytes
        self.stride = stride
        self.exchange = exchange
        self.device = views[0].device if views else torch.device(_TENSOR_DEVICE_TYPE, res.device_index)
        self._ptrs = [res.base + p * stride for p in range(self.world_size)]
        self._views = views
        self.peer_ptrs = peer_ptrs
        self._closed = False

    # ---- creation -------------------------------------------------------------------------------
    @classmethod
    def create(
        cls,
        nbytes: int,
        exchange: Any = None,
        topology: Optional[Topology] = None,
        device_index: Optional[int] = None,
        *,
        usable_backends: Sequence[str] = DEFAULT_FALLBACK_BACKENDS,
        timeout_s: float = 60.0,
    ) -> SymmetricBuffer:
        """Collective: allocate ``nbytes`` per rank and map every rank's buffer on every rank.

        ``exchange``: None (torch.distributed world), a ProcessGroup, an mpi4py comm or an Exchange.
        ``topology``: optional; its ``host_id`` is this rank's host and its ``device_index`` the GPU.
        ``device_index``: GPU to allocate on (default: topology's, else torch's current device).
        ``usable_backends``: named in the ``EPTopologyError`` when peers cannot be mapped.
        ``timeout_s``: limit for the same-host fd hand-over.
        Every rank must pass the same ``nbytes``.  Pass an ``Exchange`` you keep open (e.g. a
        ``TorchExchange``) when creating several buffers over an NCCL group: a temporary one made from
        None or a ProcessGroup builds (and afterwards destroys) a gloo group for each call.
        """
        _release_deferred()
        ex = exchange_from(exchange)
        temporary = ex is not exchange  # made here from None / a ProcessGroup: ours to give back
        try:
            buf = cls._create(ex, nbytes, topology, device_index, usable_backends, timeout_s)
            if temporary:
                buf.exchange = None  # closed below; a buffer needs no exchange after creation
            return buf
        finally:
            if temporary:
                close_exchange(ex)

    @classmethod
    def _create(cls, ex: Exchange, nbytes: int, topology: Optional[Topology], device_index: Optional[int],
                usable_backends: Sequence[str], timeout_s: float) -> SymmetricBuffer:
        local_error = ""
        try:
            size = int(nbytes)
            if size <= 0 or size != nbytes:
                local_error = f"nbytes={nbytes!r} must be a positive integer"
        except (TypeError, ValueError):
            size, local_error = -1, f"nbytes={nbytes!r} must be a positive integer"
        if topology is not None and (topology.rank != ex.rank or topology.world_size != ex.size):
            local_error = (f"topology is rank {topology.rank} of {topology.world_size} but the exchange is "
                           f"rank {ex.rank} of {ex.size}")
        if device_index is None:
            device_index = topology.device_index if topology is not None and topology.device_index is not None \
                else default_device_index()
        try:
            caps = probe_capabilities(device_index)
        except Exception as exc:  # report through the all-gather rather than leave peers waiting
            caps = Capabilities(cuda=False, reason=f"probe failed: {exc}")
        host = topology.host_id if topology is not None else local_host_id()

        # One all-gather carries everything the plan needs; everything after it is decided from
        # identical data on every rank.
        mine = {"host": host, "nbytes": size, "error": local_error, "caps": caps.to_dict()}
        infos = [json.loads(raw.decode()) for raw in ex.allgather_bytes(json.dumps(mine).encode())]
        bad = [(r, i["error"]) for r, i in enumerate(infos) if i["error"]]
        if bad:  # field and value built from gathered data only, so every rank raises the same text
            field = "nbytes" if bad[0][1].startswith("nbytes") else "topology"
            raise EPConfigError(field, [i["nbytes"] for i in infos], "; ".join(f"rank {r}: {e}" for r, e in bad))
        per_rank = [i["nbytes"] for i in infos]
        if len(set(per_rank)) > 1:  # the value shown is the same list on every rank
            raise EPConfigError("nbytes", per_rank, "ranks asked for different sizes (index = rank); all must agree")
        topo = Topology.from_host_ids(ex.rank, [i["host"] for i in infos], device_index)
        all_caps = [Capabilities.from_dict(i["caps"]) for i in infos]
        plan = plan_handles(topo, all_caps, usable_backends)  # raises on every rank alike
        stride = _round_up(size, plan.granularity)
        return cls._build(ex, topo, plan, size, stride, device_index, timeout_s)

    @classmethod
    def _build(cls, ex: Exchange, topo: Topology, plan: HandlePlan, nbytes: int, stride: int,
               device_index: int, timeout_s: float) -> SymmetricBuffer:
        """Allocate, hand over handles, map.  Each phase ends in a status all-gather, so a failure on
        any rank makes every rank release what it made and raise (nobody is left waiting)."""
        res = _Resources(device_index)
        try:
            try:
                fabric_handles = cls._allocate(ex, plan, res, stride)
                received = cls._hand_over_fds(ex, topo, plan, res, timeout_s)
                views, peer_ptrs = cls._map_all(ex, plan, res, stride, nbytes, fabric_handles, received)
            finally:
                res.leave_context()
            return cls(res, plan, nbytes, stride, ex, views, peer_ptrs)
        except BaseException:
            try:
                res.release()
            except Exception:  # the original failure is the one to report
                pass
            raise

    @staticmethod
    def _allocate(ex: Exchange, plan: HandlePlan, res: _Resources, stride: int) -> list[Optional[bytes]]:
        """cuMemCreate + exports; returns every rank's fabric handle (None where not exported)."""
        error: Optional[BaseException] = None
        fabric = b""
        try:
            res.enter_context()
            if plan.uses_posix_fd and plan.uses_fabric:
                handle_types = _driver.combined_handle_type_enum()
                if handle_types is None:  # the plan only mixes types when every rank said it can
                    raise EPError("cuda-python cannot request POSIX_FD|FABRIC on one allocation")
            elif plan.uses_fabric:
                handle_types = _driver.handle_type_enum("fabric")
            elif plan.uses_posix_fd:
                handle_types = _driver.handle_type_enum("posix_fd")
            else:
                handle_types = _driver.handle_type_enum("none")
            prop = _driver.allocation_prop(res.device_index, handle_types)
            res.own_handle = _driver.call("cuMemCreate", stride, prop, 0)
            if HandleType.POSIX_FD in plan.peer_handle:
                fd = _driver.call("cuMemExportToShareableHandle", res.own_handle,
                                  _driver.handle_type_enum("posix_fd"), 0)
                res.fds.append(int(fd))
            if plan.uses_fabric:
                exported = _driver.call("cuMemExportToShareableHandle", res.own_handle,
                                        _driver.handle_type_enum("fabric"), 0)
                fabric = _driver.fabric_handle_bytes(exported)
        except Exception as exc:
            error = exc
        infos = _all_ok(ex, "allocating", error, {"fabric": fabric.hex()})
        return [bytes.fromhex(i["fabric"]) if i["fabric"] else None for i in infos]

    @staticmethod
    def _hand_over_fds(ex: Exchange, topo: Topology, plan: HandlePlan, res: _Resources,
                       timeout_s: float) -> dict[int, list[int]]:
        if not plan.uses_posix_fd:  # same decision on every rank: all skip the collective together
            return {}
        error: Optional[BaseException] = None
        received: dict[int, list[int]] = {}
        try:
            received = exchange_fds(res.fds, ex, topo, timeout_s)
        except Exception as exc:
            error = exc
        finally:
            res.close_fds()  # peers hold dups (or failed anyway): our exported fd is no longer needed
        # received fds are ours to close whatever happens next (right after import, or on failure)
        for fds in received.values():
            res.fds.extend(fds)
        _all_ok(ex, "passing file descriptors", error, {})
        return received

    @staticmethod
    def _map_all(ex: Exchange, plan: HandlePlan, res: _Resources, stride: int, nbytes: int,
                 fabric_handles: list[Optional[bytes]], received: dict[int, list[int]]
                 ) -> tuple[list[torch.Tensor], torch.Tensor]:
        error: Optional[BaseException] = None
        views: list[torch.Tensor] = []
        peer_ptrs: Optional[torch.Tensor] = None
        try:
            world = plan.world_size
            res.base = int(_driver.call("cuMemAddressReserve", world * stride, plan.granularity, 0, 0))
            res.reserved = world * stride
            access = [_driver.access_desc(res.device_index)]
            for p in range(world):
                how = plan.peer_handle[p]
                if how is HandleType.NONE:
                    handle = res.own_handle
                elif how is HandleType.POSIX_FD:
                    fds = received.get(p, [])
                    if len(fds) != 1:
                        raise EPError(f"rank {plan.rank}: expected 1 fd from rank {p}, got {len(fds)}")
                    handle = _driver.call("cuMemImportFromShareableHandle", fds[0],
                                          _driver.handle_type_enum("posix_fd"), detail=f"fd from rank {p}")
                    res.imported.append(handle)
                else:
                    data = fabric_handles[p]
                    if data is None:
                        raise EPError(f"rank {plan.rank}: rank {p} exported no fabric handle")
                    handle = _driver.call("cuMemImportFromShareableHandle", data,
                                          _driver.handle_type_enum("fabric"), detail=f"fabric handle of rank {p}")
                    res.imported.append(handle)
                ptr = res.base + p * stride
                _driver.call("cuMemMap", ptr, stride, 0, handle, 0, detail=f"rank {p}'s buffer")
                res.mapped.append((ptr, stride))
                # our GPU gets read/write access; the memory may live on a peer GPU (NVLink P2P)
                _driver.call("cuMemSetAccess", ptr, stride, access, 1, detail=f"rank {p}'s buffer")
            device = torch.device(_TENSOR_DEVICE_TYPE, res.device_index)
            ptrs = [res.base + p * stride for p in range(world)]
            views = [tensor_from_pointer(ptr, nbytes, device, owner=res) for ptr in ptrs]
            peer_ptrs = torch.tensor(ptrs, dtype=torch.int64, device=device)
        except Exception as exc:
            error = exc
            views, peer_ptrs = [], None
        finally:
            # an open fd keeps a reference that would stop the peer's memory from being freed when
            # everyone releases it; the imported handle holds its own reference
            res.close_fds()
        _all_ok(ex, "mapping peer memory", error, {})
        # _all_ok raised on every rank if this one failed (error set), so the try block built the table
        return views, cast(torch.Tensor, peer_ptrs)

    # ---- use ------------------------------------------------------------------------------------
    def _check_open(self) -> None:
        if self._closed:
            raise EPError("SymmetricBuffer is closed")

    @property
    def local(self) -> torch.Tensor:
        """uint8 tensor ``[nbytes]`` over this rank's own buffer (on ``device``)."""
        self._check_open()
        return self._views[self.rank]

    def peer(self, r: int) -> torch.Tensor:
        """uint8 tensor ``[nbytes]`` over rank ``r``'s buffer through the mapping (on our ``device``).

        Writes go straight to rank r's GPU memory; ordering with rank r's work is the caller's job
        (stream sync + barrier, or flags).
        """
        self._check_open()
        if not isinstance(r, int) or not 0 <= r < self.world_size:
            raise EPConfigError("rank", r, f"must be an int in [0, {self.world_size})")
        return self._views[r]

    def ptr(self, r: int) -> int:
        """Device address of rank ``r``'s buffer in this process."""
        self.peer(r)  # same checks: open, r in range
        return self._ptrs[r]

    def close(self) -> None:
        """Unmap and release everything (not collective; idempotent).  Synchronises the device first."""
        if self._closed:
            return
        self._closed = True
        self._views = []
        self._res.release()
        _release_deferred()

    @property
    def closed(self) -> bool:
        return self._closed

    def __enter__(self) -> SymmetricBuffer:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def __repr__(self) -> str:
        state = "closed" if self._closed else f"base=0x{self._ptrs[0]:x}"
        return (f"SymmetricBuffer(rank={self.rank}, world_size={self.world_size}, nbytes={self.nbytes}, "
                f"stride={self.stride}, handles={[h.value for h in self.plan.alloc_handles]}, {state})")
