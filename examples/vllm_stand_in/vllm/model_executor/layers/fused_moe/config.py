"""Stand-in: the fields of vLLM's FusedMoEQuantConfig that the adapter reads."""
from __future__ import annotations

import dataclasses
from typing import Any


@dataclasses.dataclass
class FusedMoEQuantConfig:
    quant_dtype: Any = None
    block_shape: list[int] | None = None
    per_act_token_quant: bool = False
    a1_scale: Any = None
