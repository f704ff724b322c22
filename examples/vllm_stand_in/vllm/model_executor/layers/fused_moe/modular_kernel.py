"""Stand-in: the base classes and records of vLLM's modular MoE kernel that the adapter builds on."""
from __future__ import annotations

import dataclasses
import enum
from collections.abc import Callable
from typing import Any


class FusedMoEActivationFormat(enum.Enum):
    Standard = "standard"
    BatchedExperts = "batched_experts"


@dataclasses.dataclass
class ExpertTokensMetadata:
    expert_num_tokens: Any
    expert_num_tokens_cpu: Any
    psum_recv_per_rank: Any = None


class TopKWeightAndReduce:
    def apply(self, output, fused_expert_output, topk_weights, topk_ids, apply_router_weight_on_input):
        raise NotImplementedError


class FusedMoEExperts:
    pass


class FusedMoEPrepareAndFinalizeModular:
    def post_init_setup(self, fused_experts: Any) -> None:
        return None


PrepareResultType = tuple
ReceiverType = Callable[[], tuple]
