"""Routing guard and NaN-safe top-k (docs/design.md §8, seed bugs vLLM #39593 and #39391).

Everything here runs on the device without host synchronisation except ``find_invalid_ids``, which the
eager validation path uses to name the offending token.
"""
from __future__ import annotations

from typing import Optional

import torch

from .errors import EPInputError


def topk(logits: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """NaN-safe ``torch.topk`` over the last dimension.

    Rows without NaN give exactly what ``torch.topk(logits, k)`` gives.  NaN entries rank below every
    number (they become ``-inf``); ``torch.topk`` returns ``k`` distinct positions whatever the values,
    so a row of NaNs still yields ``k`` distinct ids and no downstream kernel sees a duplicate.
    Returns ``(values, ids)``; ``ids`` is int64 like ``torch.topk``.
    """
    if k > logits.shape[-1]:
        raise EPInputError(f"topk: k={k} exceeds the number of experts {logits.shape[-1]}")
    if logits.is_floating_point():
        logits = logits.masked_fill(torch.isnan(logits), float("-inf"))
    return torch.topk(logits, k, dim=-1)


def invalid_id_mask(topk_ids: torch.Tensor, num_experts: int) -> torch.Tensor:
    """True where an id is neither -1 nor a valid global expert id."""
    return (topk_ids < -1) | (topk_ids >= num_experts)


def find_invalid_ids(topk_ids: torch.Tensor, num_experts: int) -> Optional[tuple[int, int, int]]:
    """First ``(token, slot, id)`` with an out-of-range id, or None.  Synchronises the device."""
    bad = invalid_id_mask(topk_ids, num_experts)
    if not bool(bad.any()):
        return None
    flat = int(torch.argmax(bad.reshape(-1).to(torch.uint8)))
    k = topk_ids.shape[1]
    tok, slot = divmod(flat, k)
    return tok, slot, int(topk_ids[tok, slot])


def check_ids(topk_ids: torch.Tensor, num_experts: int, rank: Optional[int] = None) -> None:
    """Raise ``EPInputError`` naming the token index and the id if any id is out of range."""
    found = find_invalid_ids(topk_ids, num_experts)
    if found is not None:
        tok, slot, value = found
        where = f" on rank {rank}" if rank is not None else ""
        raise EPInputError(
            f"topk_ids[{tok}, {slot}] = {value}{where} is not a valid expert id: expected -1 or 0 <= id < "
            f"num_experts={num_experts}"
        )


def drop_invalid_ids(topk_ids: torch.Tensor, num_experts: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(ids, num_invalid)``: out-of-range ids replaced by -1 (same dtype), and a 0-d int64 device
    tensor counting them.  No host synchronisation."""
    invalid = invalid_id_mask(topk_ids, num_experts)
    return torch.where(invalid, torch.full_like(topk_ids, -1), topk_ids), invalid.sum()


def _repeats(same: torch.Tensor) -> torch.Tensor:
    """``[T, k]``: True where a slot's id already appears in an earlier slot of its row, from ``same``,
    ``[T, k, k]`` with ``same[t, i, j]`` when slots i and j of row t hold the same id."""
    k = same.shape[-1]
    earlier = torch.ones(k, k, dtype=torch.bool, device=same.device).tril(diagonal=-1)
    return (same & earlier).any(dim=-1)


def sanitize_routing(
    topk_ids: torch.Tensor, topk_weights: torch.Tensor, num_experts: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Merge duplicate ids per token and drop invalid ones, without host synchronisation.

    Returns ``(ids, weights, num_invalid)``: ``ids`` int64 ``[T, k]`` where each valid expert appears
    at most once per row (its first slot) and every other slot is -1; ``weights`` float32 ``[T, k]``
    with the duplicates' weights summed into the first slot and 0 on -1 slots; ``num_invalid`` a 0-d
    int64 device tensor counting out-of-range ids (treated as -1).
    """
    ids, num_invalid = drop_invalid_ids(topk_ids.to(torch.int64), num_experts)
    weights = topk_weights.to(torch.float32)
    valid = ids >= 0
    same = (ids.unsqueeze(2) == ids.unsqueeze(1)) & valid.unsqueeze(2)  # [T, k, k]
    keep = valid & ~_repeats(same)
    merged = (same.to(torch.float32) * weights.unsqueeze(1)).sum(dim=2)
    out_ids = torch.where(keep, ids, torch.full_like(ids, -1))
    out_w = torch.where(keep, merged, torch.zeros_like(merged))
    return out_ids, out_w, num_invalid


def count_inactive_pairs(topk_ids: torch.Tensor, expert_active: torch.Tensor) -> torch.Tensor:
    """How many (token, expert) pairs of ``topk_ids`` go to an inactive expert (its owner was lost):
    a 0-d int64 tensor on ``topk_ids``' device, without host synchronisation.

    ``topk_ids``: ``[T, k]`` int32/int64 global ids; ``expert_active``: bool ``[num_experts]`` on the
    same device.  Pairs are unique per token (an id repeated in a row counts once, as the routing guard
    merges it); -1 and out-of-range ids are not pairs and count nothing.
    """
    num_experts = expert_active.shape[0]
    ids = topk_ids.to(torch.int64)
    valid = (ids >= 0) & (ids < num_experts)
    inactive = valid & ~expert_active[ids.clamp(0, max(num_experts - 1, 0))]
    # a later slot repeating an earlier slot's id is the same pair
    inactive &= ~_repeats(ids.unsqueeze(-1) == ids.unsqueeze(-2))
    return inactive.sum(dtype=torch.int64)


__all__ = ["topk", "count_inactive_pairs", "sanitize_routing", "drop_invalid_ids", "check_ids", "find_invalid_ids",
           "invalid_id_mask"]
