"""The CUDA extension ``ep_comm._C``: its ops under ``torch.ops.ep_comm`` and their fake kernels.

The ops (C++ in ``csrc/ops.cpp``) launch on the current stream and never synchronise, so they can be
captured in CUDA graphs; the fake implementations below give ``torch.compile`` their output shapes,
so a compiled function traces through them without a graph break.

    mnnvl_dispatch(x, topk_ids, topk_weights, x_scales?, state!, work!, peer_base, expert_owner, cfg, phases=3)
        -> (out_x, out_scales, row_ids, row_w, row_slot, counts, dest)
    mnnvl_dispatch_recv(x, x_scales?, state!, work!, peer_base, out_x!, out_scales!, row_ids!, row_w!,
                        row_slot!, counts!, cfg) -> ()        the receive half after phases=1 (send only)
    mnnvl_combine(expert_out, row_ids, row_w, row_slot, dest, state!, peer_base, out!, cfg, phases=3) -> ()
        phases: 1 send half, 2 receive half, 3 both (kernel_protocol.PHASE_*)
    mnnvl_abort(state!, peer_base, cfg) -> ()
    nvshmem_dispatch / nvshmem_dispatch_recv / nvshmem_combine / nvshmem_abort: the same ops from
        ep_comm._C_nvshmem (the kernels built with NVSHMEM; cfg[PUT_MODE] = 1 moves data with puts)
    check_ids(topk_ids, num_experts, flag_ptr) -> ()
    collective_combine_partial(expert_out, dest, weights, out!) -> ()   (naive/ag_rs batched combine)
    collective_select_local(ids, weights, rank, num_local, capacity, local_ids!, local_w!, row_valid!, dest!,
                            counts!) -> ()                                (naive/ag_rs layout selection)
    collective_scatter_rows(src, dest, out!) -> ()                         (batched rows into their slots)

``cfg`` is the int vector described in ``ep_comm.backends.kernel_protocol``.  Without a CUDA build
of torch or nvcc at install time the extension is absent; ``unavailable_reason()`` says so.
"""
from __future__ import annotations

import functools
import os
import threading
from typing import Any, Optional, Sequence

import numpy as np
import torch

from . import kernel_protocol as kp

__all__ = ["extension", "unavailable_reason", "nvshmem_ops_reason", "collective_op_reason", "MappedWords"]


@functools.lru_cache(maxsize=None)
def _load() -> tuple[Optional[Any], str]:
    try:
        from .. import _C  # type: ignore[attr-defined]
    except ImportError as exc:
        return None, (f"the CUDA extension ep_comm._C is not built ({exc}); it is compiled by "
                      "`pip install --no-build-isolation -e .` on a machine with a CUDA build of torch and nvcc "
                      "(pip's default build isolation hides the installed torch from the build; "
                      "EP_COMM_BUILD_CUDA=1 makes the build fail loudly instead of skipping it)")
    if int(_C.CFG_LEN) != kp.CFG_LEN:
        return None, (f"ep_comm._C was built from other sources (config length {_C.CFG_LEN}, "
                      f"expected {kp.CFG_LEN}): reinstall the package")
    _register_fakes()
    return _C, ""


@functools.lru_cache(maxsize=None)
def collective_op_reason(op: str, env: str) -> str:
    """'' when the collective backends can run the extension's ``ep_comm::<op>`` on CUDA, else why they run
    torch ops instead.  ``$<env>=torch`` keeps the torch ops (to compare the two on a GPU); read once."""
    if os.environ.get(env, "").lower() == "torch":
        return f"{env}=torch"
    why = unavailable_reason()
    if why:
        return why
    if not hasattr(torch.ops.ep_comm, op):
        return f"the built ep_comm._C predates ep_comm::{op}: reinstall the package"
    return ""


def extension() -> Any:
    """The loaded extension module; raises ``ImportError`` with the reason when it is absent."""
    ext, why = _load()
    if ext is None:
        raise ImportError(why)
    return ext


def unavailable_reason() -> str:
    """'' when the kernels can run here, else why not."""
    if not torch.cuda.is_available():
        return "needs CUDA (this torch has no usable GPU)"
    return _load()[1]


class MappedWords:
    """``kp.PENDING_WORDS`` int32 words of host memory the device writes and the host reads without
    synchronising (``words``, a numpy view; ``device_ptr`` for the kernels).

    Slots come from one process-wide page-locked arena that is never freed (freeing page-locked
    memory would invalidate a CUDA graph being captured at that moment); ``release`` recycles a slot.
    """

    _lock = threading.Lock()
    _free: list[int] = []
    _next = 0

    def __init__(self) -> None:
        arena, base = _arena()
        with MappedWords._lock:
            if MappedWords._free:
                slot = MappedWords._free.pop()
            else:
                slot = MappedWords._next
                if (slot + 1) * kp.PENDING_WORDS > arena.shape[0]:
                    raise RuntimeError(f"ep_comm: more than {arena.shape[0] // kp.PENDING_WORDS} live kernel-backend "
                                       "communicators in one process")
                MappedWords._next += 1
        self._slot = slot
        self.words: np.ndarray = arena[slot * kp.PENDING_WORDS: (slot + 1) * kp.PENDING_WORDS]
        self.words[:] = 0
        self.device_ptr = base + 4 * slot * kp.PENDING_WORDS

    def release(self) -> None:
        if self._slot is None:
            return
        self.words[:] = 0
        with MappedWords._lock:
            MappedWords._free.append(self._slot)
        self._slot = None


@functools.lru_cache(maxsize=None)
def _arena() -> tuple[np.ndarray, int]:
    tensor, base = extension().mapped_arena()
    return tensor.numpy(), int(base)


def nvshmem_ops_reason() -> str:
    """'' when the nvshmem_* ops (ep_comm._C_nvshmem) are loaded and their fakes registered, else why not."""
    return _load_nvshmem_ops()


@functools.lru_cache(maxsize=None)
def _load_nvshmem_ops() -> str:
    why = unavailable_reason()
    if why:
        return why
    from ..memory import nvshmem_heap

    ext, why = nvshmem_heap.extension()
    if ext is None:
        return why
    if int(ext.CFG_LEN) != kp.CFG_LEN:
        return (f"ep_comm._C_nvshmem was built from other sources (config length {ext.CFG_LEN}, expected "
                f"{kp.CFG_LEN}): reinstall the package")
    _register_kernel_op_fakes("nvshmem")
    return ""


def _register_fakes() -> None:
    lib = "ep_comm::"
    _register_kernel_op_fakes("mnnvl")

    @torch.library.register_fake(lib + "check_ids")
    def _check_fake(topk_ids, num_experts, flag_ptr):
        return None

    # collective backends (naive, ag_rs): fused batched-combine partial sums.  An extension built
    # before this op existed lacks it; the collective path then stays on torch ops.
    if hasattr(torch.ops.ep_comm, "collective_combine_partial"):
        @torch.library.register_fake(lib + "collective_combine_partial")
        def _collective_combine_partial_fake(expert_out, dest, weights, out):
            return None
    if hasattr(torch.ops.ep_comm, "collective_select_local"):
        @torch.library.register_fake(lib + "collective_select_local")
        def _collective_select_local_fake(ids, weights, rank, num_local, capacity, local_ids, local_w, row_valid,
                                          dest, counts):
            return None

        @torch.library.register_fake(lib + "collective_scatter_rows")
        def _collective_scatter_rows_fake(src, dest, out):
            return None


def _register_kernel_op_fakes(prefix: str) -> None:
    """Fakes of one kernel backend's ops (``<prefix>_dispatch`` etc., one schema for both backends)."""
    lib = f"ep_comm::{prefix}"

    @torch.library.register_fake(lib + "_dispatch")
    def _dispatch_fake(x, topk_ids, topk_weights, x_scales, state, work, peer_base, expert_owner, cfg: Sequence[int],
                       phases: int = kp.PHASE_BOTH):
        world, max_tokens, k = cfg[kp.WORLD], cfg[kp.MAX_TOKENS], cfg[kp.TOP_K]
        local, hidden, batched = cfg[kp.NUM_LOCAL], cfg[kp.HIDDEN], bool(cfg[kp.BATCHED])
        n = world * max_tokens
        if cfg[kp.QUANT_FP8]:
            x_width, x_dtype, s_width, s_dtype = hidden, torch.float8_e4m3fn, hidden // 128, torch.float32
        else:
            x_width, x_dtype = x.shape[1], x.dtype
            s_width = 0 if x_scales is None else x_scales.shape[1]
            s_dtype = torch.float32 if x_scales is None else x_scales.dtype
        has_scales = bool(cfg[kp.QUANT_FP8]) or x_scales is not None
        # zero copy (standard): the rows stay in the receive buffer, the op returns none
        lead = (local, n) if batched else (0 if cfg[kp.ZERO_COPY] else n,)
        out_x = x.new_empty((*lead, x_width), dtype=x_dtype)
        out_s = x.new_empty((*lead, s_width) if has_scales else (0,), dtype=s_dtype)
        row_ids = x.new_empty((n, k), dtype=torch.int32)
        row_w = x.new_empty((n, k), dtype=torch.float32)
        row_slot = x.new_empty((n if batched else 0, k), dtype=torch.int32)
        counts = x.new_empty((local if batched else 0,), dtype=torch.int32)
        dest = x.new_empty((x.shape[0], k), dtype=torch.int32)
        return out_x, out_s, row_ids, row_w, row_slot, counts, dest

    @torch.library.register_fake(lib + "_dispatch_recv")
    def _dispatch_recv_fake(x, x_scales, state, work, peer_base, out_x, out_scales, row_ids, row_w, row_slot,
                            counts, cfg):
        return None

    @torch.library.register_fake(lib + "_combine")
    def _combine_fake(expert_out, row_ids, row_w, row_slot, dest, state, peer_base, out, cfg,
                      phases: int = kp.PHASE_BOTH):
        return None

    @torch.library.register_fake(lib + "_abort")
    def _abort_fake(state, peer_base, cfg):
        return None
