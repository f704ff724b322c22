"""0-d device tensors made once: ``torch.where`` turns a Python scalar into a fresh device tensor on
every call (a fill kernel each on CUDA), and ``where(out=)`` takes none at all."""
from __future__ import annotations

import torch

from ..base import capturing_graph

_CONSTS: dict = {}


def const(value, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    key = (value, dtype, device)
    c = _CONSTS.get(key)
    if c is None:
        c = torch.full((), value, dtype=dtype, device=device)
        # one made while a CUDA graph is captured holds its value only inside replays (and lives in
        # the graph's memory pool): use it for this call, never keep it
        if not capturing_graph(device):
            _CONSTS[key] = c
    return c


def zero(device: torch.device) -> torch.Tensor:
    return const(0.0, torch.float32, device)
