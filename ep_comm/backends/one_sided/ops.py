"""The one-sided kernels' ops, one set per memory provider, and their fake implementations.

The ops (C++ in ``csrc/one_sided/ops.h``) launch on the current stream and never synchronise, so they
can be captured in CUDA graphs; the fakes give ``torch.compile`` their output shapes, so a compiled
function traces through them without a graph break.  ``<prefix>`` is ``mnnvl`` (``ep_comm._C``,
peers' buffers mapped by ``ep_comm.memory``) or ``nvshmem`` (``ep_comm._C_nvshmem``):

    <prefix>_dispatch(x, topk_ids, topk_weights, x_scales?, state!, work!, peer_base, expert_owner, cfg,
                      phases=3) -> (out_x, out_scales, row_ids, row_w, row_slot, counts, dest)
    <prefix>_dispatch_recv(x, x_scales?, state!, work!, peer_base, out_x!, out_scales!, row_ids!, row_w!,
                           row_slot!, counts!, cfg) -> ()     the receive half after phases=SEND
    <prefix>_combine(expert_out, row_ids, row_w, row_slot, dest, state!, peer_base, out!, cfg, phases=3) -> ()
    <prefix>_abort(state!, peer_base, cfg, calls=1) -> ()
    <prefix>_verdict(topk_ids?, own_bad, advance, state!, peer_base, cfg) -> ()
                           the input verdict in front of a dispatch launched with Phase.CHECKED

``cfg`` is the int vector of ``layout.config_vector`` (slots: ``protocol.Cfg``); ``phases`` a sum
of ``protocol.Phase`` values.
"""
from __future__ import annotations

import dataclasses
import functools
import threading
from typing import Any, Callable, Optional, Sequence

import numpy as np
import torch

from ...errors import EPError
from .. import extension
from ..protocol import Cfg, Pending, Phase, Quant


@dataclasses.dataclass(frozen=True)
class KernelOps:
    """The ops of one memory provider's build (``torch.ops.ep_comm.<prefix>_*``)."""

    dispatch: Callable[..., Any]
    dispatch_recv: Callable[..., Any]
    combine: Callable[..., Any]
    abort: Callable[..., Any]
    verdict: Callable[..., Any]

    @classmethod
    def load(cls, prefix: str) -> KernelOps:
        """The ops named ``<prefix>_*``, their fakes registered (the extension must be loaded)."""
        _register_fakes(prefix)
        ops = torch.ops.ep_comm
        return cls(*(getattr(ops, f"{prefix}_{name}") for name in ("dispatch", "dispatch_recv", "combine", "abort",
                                                                     "verdict")))


class MappedWords:
    """``Pending.WORDS`` int32 words of host memory the device writes and the host reads without
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
                if (slot + 1) * Pending.WORDS > arena.shape[0]:
                    raise EPError(f"more than {arena.shape[0] // Pending.WORDS} live one-sided communicators in "
                                  "one process: close the ones no longer used")
                MappedWords._next += 1
        self._slot: Optional[int] = slot
        self.words: np.ndarray = arena[slot * Pending.WORDS: (slot + 1) * Pending.WORDS]
        self.words[:] = 0
        self.device_ptr = base + 4 * slot * Pending.WORDS

    def release(self) -> None:
        if self._slot is None:
            return
        self.words[:] = 0
        with MappedWords._lock:
            MappedWords._free.append(self._slot)
        self._slot = None


@functools.cache
def _arena() -> tuple[np.ndarray, int]:
    tensor, base = extension.extension().mapped_arena()
    return tensor.numpy(), int(base)


@functools.cache
def _register_fakes(prefix: str) -> None:
    """Fakes of one provider's ops (one schema for both providers)."""
    lib = f"ep_comm::{prefix}"

    @torch.library.register_fake(lib + "_dispatch")
    def _dispatch_fake(x, topk_ids, topk_weights, x_scales, state, work, peer_base, expert_owner, cfg: Sequence[int],
                       phases: int = Phase.BOTH):
        world, max_tokens, k = cfg[Cfg.WORLD], cfg[Cfg.MAX_TOKENS], cfg[Cfg.TOP_K]
        local, hidden, batched = cfg[Cfg.NUM_LOCAL], cfg[Cfg.HIDDEN], bool(cfg[Cfg.BATCHED])
        n = world * max_tokens
        quant = cfg[Cfg.QUANT]
        if quant == Quant.FP8:
            x_width, x_dtype, s_width, s_dtype = hidden, torch.float8_e4m3fn, hidden // 128, torch.float32
        elif quant == Quant.NVFP4:  # x_scales is the global scale, not rows
            x_width, x_dtype, s_width, s_dtype = hidden // 2, torch.uint8, hidden // 16, torch.float8_e4m3fn
        else:
            x_width, x_dtype = x.shape[1], x.dtype
            s_width = 0 if x_scales is None else x_scales.shape[1]
            s_dtype = torch.float32 if x_scales is None else x_scales.dtype
        has_scales = quant != Quant.NONE or x_scales is not None
        # zero copy (standard): the rows stay in the receive buffer, the op returns none
        lead = (local, n) if batched else (0 if cfg[Cfg.ZERO_COPY] else n,)
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
                      phases: int = Phase.BOTH):
        return None

    @torch.library.register_fake(lib + "_abort")
    def _abort_fake(state, peer_base, cfg, calls=1):
        return None

    @torch.library.register_fake(lib + "_verdict")
    def _verdict_fake(topk_ids, own_bad, advance, state, peer_base, cfg):
        return None
