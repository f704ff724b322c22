"""``Dispatched``: what ``dispatch`` hands to the engine's expert kernels (docs/design.md §6)."""
from __future__ import annotations

import dataclasses
from typing import Any, Optional

import torch

from .errors import EPInputError


@dataclasses.dataclass
class Dispatched:
    """Tokens received by this rank.

    standard layout (``layout == "standard"``):
      - ``x``: ``[N, hidden]`` one row per (source token, this rank); rows whose ``topk_ids`` are all -1
        are padding.  ``N`` is fixed per communicator where the backend can (CUDA graphs).
      - ``x_scales``: ``[N, S]`` or None.
      - ``topk_ids``: ``[N, top_k]`` int32 local expert ids in ``[0, L)``, -1 elsewhere.
      - ``topk_weights``: ``[N, top_k]`` float32, 0 where the id is -1.
    batched layout (``layout == "batched"``):
      - ``x``: ``[L, capacity, hidden]``; rows ``[e, :expert_num_tokens[e]]`` are valid.
      - ``x_scales``: ``[L, capacity, S]`` or None.
      - ``expert_num_tokens``: ``[L]`` int32 on the device.
    ``x_global_scale``: with ``quant="nvfp4"`` the float32 ``[1]`` global scale the rows were quantised
    with (the tensor this rank passed as ``x_scales``, the same value on every rank): element ``i`` of a
    row is ``e2m1(x) * x_scales[i // 16] / x_global_scale``.  None otherwise.
    ``inactive_pairs``: after ``Communicator.shrink``, a 0-d int64 tensor on the call's device counting
    the (token, expert) pairs of this rank's tokens (unique per token) that went nowhere because the
    expert's owner is no longer active (they contribute nothing to ``combine``); counted without a
    host sync.  None while every rank is active.
    ``handle`` is the backend's private state that ``combine`` needs; treat it as opaque.
    """

    layout: str
    x: torch.Tensor
    x_scales: Optional[torch.Tensor] = None
    topk_ids: Optional[torch.Tensor] = None
    topk_weights: Optional[torch.Tensor] = None
    expert_num_tokens: Optional[torch.Tensor] = None
    num_tokens: int = 0  # T of the calling rank (rows combine returns)
    epoch: int = 0
    handle: Any = dataclasses.field(default=None, repr=False)
    owner: Any = dataclasses.field(default=None, repr=False, compare=False)
    x_global_scale: Optional[torch.Tensor] = None
    inactive_pairs: Optional[torch.Tensor] = None

    @property
    def is_batched(self) -> bool:
        return self.layout == "batched"

    def filled(self, name: str) -> torch.Tensor:
        """The tensor field ``name`` that this layout always fills (``expert_num_tokens`` batched,
        ``topk_ids``/``topk_weights`` standard, ``x_scales`` when scales travel); ``EPInputError`` when it
        is missing (a ``Dispatched`` that no dispatch of this layout made)."""
        value = getattr(self, name)
        if not isinstance(value, torch.Tensor):
            raise EPInputError(f"Dispatched.{name} is missing: a {self.layout} dispatch always fills it")
        return value
