"""``EPConfig``: the static shape of an expert-parallel exchange (docs/design.md §3)."""
from __future__ import annotations

import dataclasses
import math
import os
from typing import Optional

import torch

from .errors import EPConfigError

LAYOUTS = ("standard", "batched")
BACKEND_NAMES = ("auto", "naive", "ag_rs", "mnnvl", "nvshmem")
QUANT_MODES = (None, "fp8", "nvfp4")
FP8_BLOCK = 128  # channels per fp8 scale (DeepSeek-V3 recipe)
NVFP4_BLOCK = 16  # channels per NVFP4 e4m3 block scale
BACKEND_ENV = "EP_COMM_BACKEND"

_DTYPE_NAMES = {
    "bf16": torch.bfloat16, "bfloat16": torch.bfloat16, "fp16": torch.float16, "float16": torch.float16,
    "half": torch.float16, "fp32": torch.float32, "float32": torch.float32, "float": torch.float32,
}
_FLOAT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


def parse_dtype(value: torch.dtype | str) -> torch.dtype:
    if isinstance(value, torch.dtype):
        return value
    try:
        return _DTYPE_NAMES[str(value).lower().replace("torch.", "")]
    except KeyError:
        raise EPConfigError("dtype", value, f"expected one of {sorted(set(_DTYPE_NAMES))}") from None


@dataclasses.dataclass(frozen=True)
class EPConfig:
    """Static description of one MoE layer's exchange.

    Rank ``r`` owns global experts ``[r*L, (r+1)*L)`` with ``L = num_experts // world_size``.
    ``dtype`` is the activation dtype: what ``combine`` returns and what ``quant`` quantises from.
    ``quant``: None, ``"fp8"`` (e4m3, a float32 scale per token per 128 channels; ``hidden % 128 == 0``)
    or ``"nvfp4"`` (e2m1 packed two per byte, an e4m3 scale per 16 channels and the caller's float32
    global scale; ``hidden % 16 == 0``), applied on dispatch only (``ep_comm.quant``,
    ``ep_comm.quant_nvfp4``).
    ``num_sms``: SMs the kernel backends (``mnnvl``) run on; None means ``$EP_COMM_NUM_SMS``, else 64
    when ``max_tokens_per_rank <= 256`` (decode) and 24 above (prefill).
    ``validate_ids``: eager dispatch checks expert ids (one device→host sync per dispatch) and raises
    ``EPInputError`` naming the token. The collective backends send bad ids as -1, carry each rank's
    count in the gathered data and raise on every rank at the end of the call; the kernel backends
    launch the dispatch behind the check kernel and wait for the check after, and a dispatch that
    meets a bad id sends its peers an abort instead of rows. False skips that sync: out-of-range
    ids are treated as -1 and counted on the device, and a later call (kernel backends: the next
    combine, after its launch, so the ranks stay in step; collective backends: the first dispatch
    after the device has counted them) or ``check_errors()`` raises.
    ``zero_copy`` (standard layout): the kernel backends return ``Dispatched.x`` / ``x_scales`` as
    row-strided views of the communicator's receive buffer instead of copying the received rows out
    (a pass over the received bytes saved; docs/performance.md).  Read them only before this rank's ``combine`` of
    that dispatch (in stream order); every eager dispatch must be combined before the next one on the
    communicator (``EPError`` otherwise).  Where peers are reached over NVLink and
    ``max_tokens_per_rank >= 512``, ``combine`` also works in place: each rank reads its tokens'
    expert outputs from the experts' ranks while summing (no partials written to the token's rank
    and read back); write them into ``Communicator.expert_output_buffer(d)`` to save combine
    copying them there, and write ``x`` into ``Communicator.dispatch_input_buffer()`` to save dispatch
    copying this rank's own rows.  The collective backends' standard ``x`` is a view of the gathered data
    already; they accept the flag and change nothing.
    """

    num_experts: int
    top_k: int
    hidden: int
    max_tokens_per_rank: int
    dtype: torch.dtype = torch.bfloat16
    layout: str = "standard"
    backend: str = "auto"
    quant: Optional[str] = None
    timeout_s: float = 100.0
    num_sms: Optional[int] = None
    validate_ids: bool = True
    zero_copy: bool = False

    def __post_init__(self) -> None:
        object.__setattr__(self, "dtype", parse_dtype(self.dtype))
        for name in ("num_experts", "top_k", "hidden", "max_tokens_per_rank"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise EPConfigError(name, value, "must be a positive int")
        if self.top_k > self.num_experts:
            raise EPConfigError("top_k", self.top_k, f"exceeds num_experts={self.num_experts}")
        if self.dtype not in _FLOAT_DTYPES:
            raise EPConfigError("dtype", self.dtype, "must be bfloat16, float16 or float32")
        if self.layout not in LAYOUTS:
            raise EPConfigError("layout", self.layout, f"must be one of {LAYOUTS}")
        if self.backend not in BACKEND_NAMES:
            raise EPConfigError("backend", self.backend, f"must be one of {BACKEND_NAMES}")
        if self.quant not in QUANT_MODES:
            raise EPConfigError("quant", self.quant, f"must be one of {QUANT_MODES}")
        if self.quant == "fp8" and self.hidden % FP8_BLOCK:
            raise EPConfigError("hidden", self.hidden, f"quant='fp8' needs hidden % {FP8_BLOCK} == 0")
        if self.quant == "nvfp4" and self.hidden % NVFP4_BLOCK:
            raise EPConfigError("hidden", self.hidden, f"quant='nvfp4' needs hidden % {NVFP4_BLOCK} == 0 (one e4m3 "
                                f"scale per {NVFP4_BLOCK} channels)")
        if not isinstance(self.timeout_s, (int, float)) or not math.isfinite(self.timeout_s) or self.timeout_s <= 0:
            raise EPConfigError("timeout_s", self.timeout_s, "must be a positive finite number of seconds")
        if self.num_sms is not None and (isinstance(self.num_sms, bool) or not isinstance(self.num_sms, int)
                                         or self.num_sms <= 0):
            raise EPConfigError("num_sms", self.num_sms, "must be None or a positive int")
        if not isinstance(self.validate_ids, bool):
            raise EPConfigError("validate_ids", self.validate_ids, "must be True or False")
        if not isinstance(self.zero_copy, bool):
            raise EPConfigError("zero_copy", self.zero_copy, "must be True or False")
        if self.zero_copy and self.layout != "standard":
            raise EPConfigError("zero_copy", self.zero_copy, "applies to the standard layout only (the batched "
                                "layout's rows are laid out per expert, so they are always copied)")

    def check_world(self, world_size: int) -> None:
        """Raise EPConfigError unless the experts split evenly over ``world_size`` ranks."""
        if self.num_experts % world_size:
            raise EPConfigError(
                "num_experts", self.num_experts,
                f"must be divisible by the world size {world_size} (contiguous expert blocks per rank)",
            )

    def num_local_experts(self, world_size: int) -> int:
        self.check_world(world_size)
        return self.num_experts // world_size

    def capacity(self, world_size: int) -> int:
        """Rows per expert in the batched layout: every token of every rank could pick one expert."""
        return self.max_tokens_per_rank * world_size

    def resolved_backend_request(self) -> str:
        """``backend`` with ``EP_COMM_BACKEND`` applied (it only overrides ``auto``)."""
        if self.backend != "auto":
            return self.backend
        env = os.environ.get(BACKEND_ENV, "").strip()
        if not env:
            return "auto"
        if env not in BACKEND_NAMES:
            raise EPConfigError("backend", env, f"from ${BACKEND_ENV}: must be one of {BACKEND_NAMES}")
        return env

    def replace(self, **changes) -> EPConfig:
        return dataclasses.replace(self, **changes)
