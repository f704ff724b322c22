"""Eager input checks of dispatch/combine: every bad input becomes an ``EPInputError`` naming it.

The checks depend only on the tensors' shapes, dtypes and devices (and the fixed config), which an
engine repeats call after call; ``InputChecks`` remembers the last combination that passed and skips
the checks when it comes again (host time saved on every eager call).  Expert ids are checked by
each backend family in its own way (they need the device).
"""
from __future__ import annotations

from typing import Optional

import torch

from .config import EPConfig
from .errors import EPInputError
from .layouts import Dispatched

_QUANTISABLE = (torch.bfloat16, torch.float16, torch.float32)
_FLOATS = (torch.bfloat16, torch.float16, torch.float32)


def _same_device(a: torch.device, b: torch.device) -> bool:
    return a.type == b.type and (a.type != "cuda" or (a.index or 0) == (b.index or 0))


def _tensor(name: str, t, device: torch.device, ndim: int) -> None:
    if not isinstance(t, torch.Tensor):
        raise EPInputError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dim() != ndim:
        raise EPInputError(f"{name} must be {ndim}-D, got shape {tuple(t.shape)}")
    if not _same_device(t.device, device):
        raise EPInputError(f"{name} is on {t.device} but this communicator runs on {device}")


def _global_scale(x_scales, device: torch.device) -> None:
    """quant="nvfp4": ``x_scales`` is the global scale, a float32 tensor of one element on the device
    (its value is not read: that would cost a device-to-host sync)."""
    if x_scales is None:
        raise EPInputError("quant='nvfp4' needs the global scale: pass x_scales=<float32 tensor of one element on "
                           "the device>, the same on every rank (the activation scale the expert GEMM uses; "
                           "ep_comm.quant_nvfp4.nvfp4_global_scale computes one from a tensor)")
    if not isinstance(x_scales, torch.Tensor):
        raise EPInputError(f"x_scales (quant='nvfp4': the global scale) must be a torch.Tensor, got "
                           f"{type(x_scales).__name__}")
    if x_scales.numel() != 1 or x_scales.dim() > 1 or x_scales.dtype != torch.float32:
        raise EPInputError(f"x_scales (quant='nvfp4': the global scale) must be float32 of shape [1] or [], got "
                           f"{x_scales.dtype} {tuple(x_scales.shape)}")
    if not _same_device(x_scales.device, device):
        raise EPInputError(f"x_scales (quant='nvfp4': the global scale) is on {x_scales.device} but this "
                           f"communicator runs on {device}")


def validate_dispatch(
    cfg: EPConfig, device: torch.device, x, topk_ids, topk_weights, x_scales: Optional[torch.Tensor]
) -> None:
    _tensor("x", x, device, 2)
    _tensor("topk_ids", topk_ids, device, 2)
    _tensor("topk_weights", topk_weights, device, 2)
    t = x.shape[0]
    if t > cfg.max_tokens_per_rank:
        raise EPInputError(f"x has T={t} tokens, more than max_tokens_per_rank={cfg.max_tokens_per_rank}")
    if tuple(topk_ids.shape) != (t, cfg.top_k):
        raise EPInputError(f"topk_ids has shape {tuple(topk_ids.shape)}, expected [T={t}, top_k={cfg.top_k}]")
    if tuple(topk_weights.shape) != (t, cfg.top_k):
        raise EPInputError(f"topk_weights has shape {tuple(topk_weights.shape)}, expected [T={t}, top_k={cfg.top_k}]")
    if topk_ids.dtype not in (torch.int32, torch.int64):
        raise EPInputError(f"topk_ids has dtype {topk_ids.dtype}, expected torch.int32 or torch.int64")
    if topk_weights.dtype != torch.float32:
        raise EPInputError(f"topk_weights has dtype {topk_weights.dtype}, expected torch.float32")
    if cfg.quant is not None:
        if x.dtype not in _QUANTISABLE:
            raise EPInputError(f"quant={cfg.quant!r} needs x of bf16/fp16/fp32, got {x.dtype}")
        if x.shape[1] != cfg.hidden:
            raise EPInputError(f"x has shape {tuple(x.shape)}, expected [T, hidden={cfg.hidden}]")
        if cfg.quant == "nvfp4":
            _global_scale(x_scales, device)
            return
        if x_scales is not None:
            raise EPInputError("x_scales must be None with quant='fp8' (dispatch computes the scales)")
    elif x.dtype == cfg.dtype:
        if x.shape[1] != cfg.hidden:
            raise EPInputError(f"x has shape {tuple(x.shape)}, expected [T, hidden={cfg.hidden}] for dtype {x.dtype}")
    else:
        # opaque payload (e.g. packed NVFP4 as uint8 [T, hidden // 2]): must fit a cfg.dtype row
        row_bytes, limit = x.shape[1] * x.element_size(), cfg.hidden * cfg.dtype.itemsize
        if x.dtype.is_floating_point and x.element_size() >= cfg.dtype.itemsize and x.shape[1] == cfg.hidden:
            raise EPInputError(f"x has dtype {x.dtype} but EPConfig.dtype is {cfg.dtype}")
        if row_bytes > limit or x.shape[1] == 0:
            raise EPInputError(
                f"x has shape {tuple(x.shape)} and dtype {x.dtype}: {row_bytes} bytes per token, but a row may "
                f"hold at most hidden*itemsize = {limit} bytes (EPConfig.dtype={cfg.dtype})"
            )
    if x_scales is not None:
        _tensor("x_scales", x_scales, device, 2)
        if x_scales.shape[0] != t:
            raise EPInputError(f"x_scales has shape {tuple(x_scales.shape)}, expected [T={t}, S]")


def validate_combine(
    cfg: EPConfig, device: torch.device, expert_out, dispatched: Dispatched, out: Optional[torch.Tensor]
) -> None:
    if dispatched.layout == "batched":
        expected = tuple(dispatched.x.shape[:2]) + (cfg.hidden,)
        _tensor("expert_out", expert_out, device, 3)
    else:
        expected = (dispatched.x.shape[0], cfg.hidden)
        _tensor("expert_out", expert_out, device, 2)
    if tuple(expert_out.shape) != expected:
        raise EPInputError(f"expert_out has shape {tuple(expert_out.shape)}, expected {list(expected)} "
                           f"({dispatched.layout} layout)")
    if expert_out.dtype not in _FLOATS:
        raise EPInputError(f"expert_out has dtype {expert_out.dtype}, expected bf16/fp16/fp32")
    if out is not None:
        _tensor("out", out, device, 2)
        if tuple(out.shape) != (dispatched.num_tokens, cfg.hidden) or out.dtype != cfg.dtype:
            raise EPInputError(f"out has shape {tuple(out.shape)} dtype {out.dtype}, expected "
                               f"[{dispatched.num_tokens}, {cfg.hidden}] {cfg.dtype}")


def _meta(t) -> object:
    """What the checks read from one argument: (shape, dtype, device) of a tensor; the object otherwise."""
    return (t.shape, t.dtype, t.device) if isinstance(t, torch.Tensor) else (type(t), id(t))


class InputChecks:
    """``validate_dispatch`` / ``validate_combine`` for one communicator, skipped when the arguments'
    shapes, dtypes and devices are those of the last call that passed."""

    def __init__(self, cfg: EPConfig, device: torch.device):
        self.cfg, self.device = cfg, device
        self._dispatch_ok: Optional[tuple] = None
        self._combine_ok: Optional[tuple] = None

    def dispatch(self, x, topk_ids, topk_weights, x_scales: Optional[torch.Tensor]) -> None:
        key = (_meta(x), _meta(topk_ids), _meta(topk_weights), None if x_scales is None else _meta(x_scales))
        if key != self._dispatch_ok:
            validate_dispatch(self.cfg, self.device, x, topk_ids, topk_weights, x_scales)
            self._dispatch_ok = key

    def combine(self, expert_out, dispatched: Dispatched, out: Optional[torch.Tensor]) -> None:
        # what the expected shapes derive from: the layout, the received rows' shape and the token count
        key = (_meta(expert_out), dispatched.layout, dispatched.x.shape, dispatched.num_tokens,
               None if out is None else _meta(out))
        if key != self._combine_ok:
            validate_combine(self.cfg, self.device, expert_out, dispatched, out)
            self._combine_ok = key
