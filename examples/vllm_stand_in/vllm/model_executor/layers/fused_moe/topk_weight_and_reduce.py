"""Stand-in: the two reduction markers the adapter's tests hand to finalize."""
from __future__ import annotations

from .modular_kernel import TopKWeightAndReduce


class TopKWeightAndReduceDelegate(TopKWeightAndReduce):
    """The experts left weighting and reducing to the prepare/finalize."""


class TopKWeightAndReduceNoOP(TopKWeightAndReduce):
    """The experts' output is already weighted and reduced."""

    def apply(self, output, fused_expert_output, topk_weights, topk_ids, apply_router_weight_on_input):
        if output is None:
            return fused_expert_output
        output.copy_(fused_expert_output)
        return output
