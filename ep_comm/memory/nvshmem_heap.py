"""NVSHMEM's symmetric heap as a kernel backend's buffer (the ``nvshmem`` backend).

``NvshmemBuffer`` has what the kernel backends use of a ``SymmetricBuffer`` (``local``, ``peer_ptrs``,
``close``), over one ``nvshmem_malloc`` per communicator.  Peer pointers come from ``nvshmem_ptr``:
NVSHMEM maps NVLink peers' heaps into this process, so the mnnvl kernels store straight into them.

The process has one NVSHMEM (torch's cu12/cu13 wheels load ``libnvshmem_host.so.3``, and our
``ep_comm._C_nvshmem`` links that same file).  ``acquire_runtime`` starts it on the first communicator
with a unique id sent over the communicator's control group, or reuses one that torch symmetric memory
or the engine already started (then it is never finalised here).  What we started stays running after
the last ``release``, idle, and the next communicator over the same processes reuses it: NVSHMEM 3.x
keeps some GPU memory of every start after its finalise (a CUDA stream and handle arrays per
``nvshmem_init``), so start/stop cycles would grow without bound.  ``stop_runtime`` finalises an idle
one on request (every PE calls it).  A start failure becomes one ``EPError`` on every rank, carrying
NVSHMEM's own messages and the variables that decide the transports.

Layering: imports ``ep_comm.errors`` and ``ep_comm.distributed`` only.
"""
from __future__ import annotations

import os
import sys
import tempfile
import threading
from types import ModuleType
from typing import Any, Optional, cast

import torch

from ..distributed.control import ControlPlane
from ..distributed.topology import Topology
from ..errors import EPError, EPTopologyError
from ._dlpack import tensor_from_pointer

__all__ = ["NvshmemBuffer", "acquire_runtime", "release_runtime", "stop_runtime", "unavailable_reason",
           "runtime_summary", "NVSHMEM_ENV"]

#: variables that decide how NVSHMEM starts and reaches peers (quoted in every start error)
NVSHMEM_ENV = ("NVSHMEM_REMOTE_TRANSPORT", "NVSHMEM_IB_ENABLE_IBGDA", "NVSHMEM_BOOTSTRAP",
               "NVSHMEM_BOOTSTRAP_UID_SOCK_IFNAME", "NVSHMEM_SYMMETRIC_SIZE", "NVSHMEM_DISABLE_P2P",
               "NVSHMEM_DISABLE_NVLS", "NVSHMEM_DEBUG")
HEAP_MARGIN = 256 << 20  # headroom over the first communicator's buffer when we size the heap


def extension() -> tuple[Optional[Any], str]:
    """``(ep_comm._C_nvshmem, "")``, or ``(None, why it is missing)``."""
    try:
        from .. import _C_nvshmem  # type: ignore[attr-defined]
    except ImportError as exc:
        return None, (f"ep_comm._C_nvshmem is not built ({exc}); it is compiled by `pip install "
                      "--no-build-isolation -e .` where the NVSHMEM wheel is installed "
                      "(pip install nvidia-nvshmem-cu13 "
                      "for a CUDA 13 torch, nvidia-nvshmem-cu12 for CUDA 12; the extra `nvshmem` of this package)")
    return _C_nvshmem, ""


def unavailable_reason() -> str:
    """'' when this process can use NVSHMEM (extension built and loadable), else why not."""
    return extension()[1]


def _env_summary() -> str:
    return ", ".join(f"{k}={os.environ.get(k, '<unset>')}" for k in NVSHMEM_ENV)


class _Runtime:
    """Process-wide NVSHMEM state: whether we hold a reference (started it, or attached to one started
    elsewhere), for which group, how many buffers use it."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.users = 0
        self.started_here = False
        self.attached = False
        self.pe_of_rank: Optional[tuple[int, ...]] = None
        self.job = b""  # the unique id NVSHMEM was started with here: equal on every PE of that start
        self.poisoned = ""  # a peer was lost: collective calls (free, finalize) would block forever


_RT = _Runtime()


def runtime_summary() -> str:
    ext, why = extension()
    if ext is None:
        return why
    if _RT.started_here:
        state = "started by ep_comm" if _RT.users else "started by ep_comm, idle"
    else:
        state = "started elsewhere, attached" if _RT.attached else "not started"
    return f"NVSHMEM {ext.VERSION}, {state}, {_RT.users} buffer(s); {_env_summary()}"


def _captured_stderr(fn, *args):
    """Run ``fn`` with file descriptor 2 going to a temporary file; return (result, captured text).  The
    text is written back to stderr too: NVSHMEM reports why it failed only there."""
    sys.stderr.flush()
    saved = os.dup(2)
    with tempfile.TemporaryFile(mode="w+b") as tmp:
        os.dup2(tmp.fileno(), 2)
        try:
            result = fn(*args)
        finally:
            os.dup2(saved, 2)
            os.close(saved)
        tmp.seek(0)
        text = tmp.read().decode(errors="replace")
    if text:
        sys.stderr.write(text)
    return result, text


def acquire_runtime(control: ControlPlane, topology: Topology, device_index: int, heap_bytes: int) -> tuple[int, ...]:
    """Start (or join) NVSHMEM for this communicator's ranks; collective over ``control``.  Returns the
    PE of every rank.  Raises ``EPError`` on every rank alike when it cannot start."""
    ext, why = extension()
    rank, world = topology.rank, topology.world_size
    error = ""
    with _RT.lock:
        if ext is None:
            error = why
        elif _RT.poisoned:
            error = f"NVSHMEM is unusable in this process: {_RT.poisoned}"
    # from here every rank takes part in the same exchanges, so a failure on one reaches all
    reuse = ext is not None and not error and ext.init_status() >= ext.STATUS_IS_INITIALIZED
    uid = b""
    if ext is not None and not error and not reuse and rank == 0:
        try:
            uid = ext.unique_id()
        except RuntimeError as exc:
            error = f"rank 0: {exc}"
    with _RT.lock:
        job = _RT.job if reuse and _RT.started_here else b""
    votes = control.gather_objects((error, reuse, uid, job))
    errors = [f"rank {r}: {e}" for r, (e, _, _, _) in enumerate(votes) if e]
    if errors:
        raise EPError("nvshmem backend: NVSHMEM cannot start: " + "; ".join(errors))
    if len({v[1] for v in votes}) != 1:
        raise EPError("nvshmem backend: NVSHMEM is already running on some ranks but not on others "
                      f"({[r for r, v in enumerate(votes) if v[1]]}); start it on all or none")
    if len({v[3] for v in votes}) != 1:
        raise EPError("nvshmem backend: these ranks run NVSHMEM started for different groups of processes "
                      f"(ranks {[r for r, v in enumerate(votes) if v[3]]} started it with ep_comm); call "
                      "ep_comm.memory.nvshmem_heap.stop_runtime() on every process of the earlier group first")
    # without the extension this rank's vote carried why, and the check above raised it
    lib = cast(ModuleType, ext)
    with torch.cuda.device(device_index):
        status, text = 0, ""
        if reuse:
            with _RT.lock:
                first = not (_RT.attached or _RT.started_here)
            if first:  # register our kernels' device state with the running NVSHMEM (one reference)
                status, text = _captured_stderr(lib.attach)
        else:
            if topology.num_hosts == 1:
                # one host: NVLink/P2P reaches every PE, and probing NICs only fails noisily
                os.environ.setdefault("NVSHMEM_REMOTE_TRANSPORT", "none")
            os.environ.setdefault("NVSHMEM_SYMMETRIC_SIZE", str(max(1 << 30, heap_bytes + HEAP_MARGIN)))
            status, text = _captured_stderr(lib.init, votes[0][2], rank, world)
        pe = lib.my_pe() if status == 0 else -1
        n = lib.n_pes() if status == 0 else -1
    outcome = control.gather_objects((status, pe, n, text[-600:]))
    bad = [(r, s, t) for r, (s, _, _, t) in enumerate(outcome) if s != 0]
    if bad:
        detail = "; ".join(f"rank {r}: status {s}" + (f" ({t.strip()})" if t.strip() else "") for r, s, t in bad)
        raise EPError(f"nvshmem backend: NVSHMEM failed to start: {detail}. Variables: {_env_summary()}")
    pes = tuple(p for _, p, _, _ in outcome)
    if len(set(pes)) != world:
        raise EPError(f"nvshmem backend: the running NVSHMEM gives these ranks the PEs {list(pes)}; each rank of "
                      "the communicator needs its own PE (NVSHMEM was started for another group)")
    with _RT.lock:
        if not reuse:
            _RT.started_here = True
            _RT.job = votes[0][2]
        elif not _RT.started_here:
            _RT.attached = True
        _RT.users += 1
        _RT.pe_of_rank = pes
    return pes


def release_runtime(collective: bool) -> None:
    """One buffer fewer.  NVSHMEM keeps running when the last one goes (see the module docstring).
    Without ``collective`` (a peer was lost) NVSHMEM is unusable from then on: its collective calls
    would wait for the lost peer."""
    with _RT.lock:
        _RT.users = max(0, _RT.users - 1)
        if not collective and not _RT.poisoned:
            _RT.poisoned = "a peer was lost while a buffer was open (its memory was not freed)"


def stop_runtime() -> bool:
    """Finalise the NVSHMEM that ``ep_comm`` started (or joined), once no communicator uses it.
    Collective: every process of the group that started it calls this (``nvshmem_finalize`` waits for
    all of them).  Returns whether it finalised; False when none of ours runs (never started, or
    unusable after a lost peer, where finalising would wait forever).  Raises ``EPError`` while a
    communicator still holds a buffer.  A later communicator starts NVSHMEM again."""
    ext, _ = extension()
    with _RT.lock:
        if _RT.users:
            raise EPError(f"nvshmem: {_RT.users} buffer(s) still open; close every nvshmem communicator first")
        stop = ext is not None and (_RT.started_here or _RT.attached) and not _RT.poisoned
        if stop:
            _RT.started_here = _RT.attached = False
            _RT.job = b""
    if stop and ext is not None:
        ext.finalize()
    return stop


class NvshmemBuffer:
    """``nbytes`` of NVSHMEM symmetric heap per rank, every peer's copy reachable by loads and stores.

    ``local``: uint8 tensor over this rank's copy; ``peer_ptrs``: int64 ``[world_size]`` on the device,
    the address of each rank's copy in this process.
    """

    def __init__(self, ext: Any, base: int, nbytes: int, device: torch.device, peer_ptrs: torch.Tensor,
                 pes: tuple[int, ...]):
        self._ext = ext
        self.pes = pes  # NVSHMEM PE of every rank
        self._base = base
        self.nbytes = nbytes
        self.device = device
        self.local = tensor_from_pointer(base, nbytes, device, owner=self)
        self.peer_ptrs = peer_ptrs
        self._closed = False

    @classmethod
    def create(cls, nbytes: int, control: ControlPlane, topology: Topology, device_index: int,
               put_mode: bool = False) -> NvshmemBuffer:
        """Collective over the communicator's ranks.  Without ``put_mode`` every peer must be reachable
        by stores: ``EPTopologyError`` when ``nvshmem_ptr`` gives no address for one.  With it, such
        peers get address 0 in ``peer_ptrs`` (the kernels reach them with puts)."""
        pes = acquire_runtime(control, topology, device_index, nbytes)
        ext = cast(ModuleType, extension()[0])  # loaded: acquire_runtime raises without it
        device = torch.device("cuda", device_index)
        with torch.cuda.device(device_index):
            base = ext.malloc(nbytes)
        got = control.gather_objects(base != 0)
        if not all(got):
            # where it succeeded the memory stays: nvshmem_free is collective and the others have none
            release_runtime(collective=True)
            raise EPError(f"nvshmem backend: nvshmem_malloc({nbytes}) failed on rank(s) "
                          f"{[r for r, ok in enumerate(got) if not ok]}: the symmetric heap is too small; set "
                          f"NVSHMEM_SYMMETRIC_SIZE (bytes) above the total of every communicator's buffer before "
                          f"the first one starts NVSHMEM ({_env_summary()})")
        ptrs = [ext.ptr(base, pe) for pe in pes]
        unreachable = [r for r, p in enumerate(ptrs) if p == 0]
        votes = control.gather_objects(unreachable)
        if any(votes) and not put_mode:
            with torch.cuda.device(device_index):
                ext.free(base)
            release_runtime(collective=True)
            pairs = "; ".join(f"rank {r} cannot reach {v}" for r, v in enumerate(votes) if v)
            raise EPTopologyError(
                f"nvshmem backend: NVSHMEM gives no load/store address for some peers ({pairs}) although the "
                f"ranks are on one host: is P2P between these GPUs off? (EP_COMM_NVSHMEM_PUT=1 reaches them "
                f"with NVSHMEM puts instead)")
        peer_ptrs = torch.tensor(ptrs, dtype=torch.int64, device=device)
        return cls(ext, base, nbytes, device, peer_ptrs, pes)

    def close(self, collective: bool = True) -> None:
        """Free the heap memory (collective: every rank must close) and release the runtime.  With
        ``collective=False`` (a peer is gone) nothing collective runs: the memory stays allocated."""
        if self._closed:
            return
        self._closed = True
        torch.cuda.synchronize(self.device)  # no kernel may still store into a peer's copy
        try:
            if collective:
                with torch.cuda.device(self.device):
                    self._ext.free(self._base)
        finally:
            release_runtime(collective)
