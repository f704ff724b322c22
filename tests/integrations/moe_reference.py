"""A dense, single-process MoE layer in plain torch: the reference the vLLM adapter tests compare with,
and plain-torch experts for machines without vLLM's kernels.  Imports neither vLLM nor the adapter.

Every rank builds the same weights and every rank's tokens from one seed, so each rank can compute
its own tokens' output densely (all experts, no communication).
"""
from __future__ import annotations

import dataclasses

import torch


@dataclasses.dataclass
class Layer:
    """Weights of the whole layer in vLLM's layout: ``w13 [E, 2F, H]`` (gate rows then up rows) and
    ``w2 [E, H, F]``, float32 on the CPU."""

    w13: torch.Tensor
    w2: torch.Tensor

    @staticmethod
    def random(experts: int, hidden: int, ffn: int, seed: int) -> Layer:
        g = torch.Generator().manual_seed(seed)
        return Layer(torch.randn(experts, 2 * ffn, hidden, generator=g) / hidden**0.5,
                     torch.randn(experts, hidden, ffn, generator=g) / ffn**0.5)

    def local(self, rank: int, num_local: int) -> Layer:
        s = slice(rank * num_local, (rank + 1) * num_local)
        return Layer(self.w13[s], self.w2[s])

    def to(self, device: torch.device, dtype: torch.dtype) -> Layer:
        return Layer(self.w13.to(device, dtype), self.w2.to(device, dtype))


def expert_mlp(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor) -> torch.Tensor:
    """One expert, SiLU-and-mul, in float32: ``x [n, H]`` -> ``[n, H]``."""
    h = x.float() @ w13.float().t()
    f = h.shape[-1] // 2
    return (torch.nn.functional.silu(h[:, :f]) * h[:, f:]) @ w2.float().t()


@dataclasses.dataclass
class Tokens:
    """One rank's input: ``x [T, H]``, ``ids [T, k]`` int32 global ids, ``weights [T, k]`` float32."""

    x: torch.Tensor
    ids: torch.Tensor
    weights: torch.Tensor

    def to(self, device: torch.device) -> Tokens:
        return Tokens(self.x.to(device), self.ids.to(device), self.weights.to(device))


def random_tokens(counts: list[int], hidden: int, experts: int, top_k: int, seed: int, dtype: torch.dtype
                  ) -> list[Tokens]:
    """Every rank's tokens (``counts[r]`` of them), drawn fresh from ``seed``: normal activations, k
    distinct experts per token from random router logits, softmax weights renormalised over the k."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for t in counts:
        x = torch.randn(t, hidden, generator=g).to(dtype)
        logits = torch.randn(t, experts, generator=g)
        values, ids = torch.topk(logits, top_k, dim=-1)
        out.append(Tokens(x, ids.to(torch.int32), torch.softmax(values, dim=-1).float()))
    return out


def dense_moe(tok: Tokens, layer: Layer, weights_on_input: bool = False) -> torch.Tensor:
    """``y[t] = sum_j w[t,j] * expert_{ids[t,j]}(x[t])`` in float32 (``weights_on_input``, top-1:
    ``expert(w * x)``, the input rounded to its dtype as the engine does)."""
    x = tok.x.cpu()
    ids, w = tok.ids.cpu(), tok.weights.cpu()
    y = torch.zeros(x.shape[0], x.shape[1])
    for e in torch.unique(ids).tolist():
        rows, slot = torch.nonzero(ids == e, as_tuple=True)
        if weights_on_input:
            y[rows] += expert_mlp((x[rows] * w[rows, slot].unsqueeze(1).to(x.dtype)), layer.w13[e], layer.w2[e])
        else:
            y[rows] += w[rows, slot].unsqueeze(1) * expert_mlp(x[rows], layer.w13[e], layer.w2[e])
    return y


def rel_err(y: torch.Tensor, ref: torch.Tensor) -> float:
    if ref.numel() == 0:
        return 0.0 if y.numel() == 0 else float("inf")
    return float((y.float().cpu() - ref).norm() / ref.norm().clamp_min(1e-12))


TOLERANCE = {torch.float32: 1e-4, torch.float16: 5e-3, torch.bfloat16: 2e-2}


# -- plain-torch experts (what a GPU machine without vLLM's kernels runs) ----------------------------------
def torch_experts_standard(x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, local: Layer,
                           id_offset: int = 0, weights_on_input: bool = False) -> torch.Tensor:
    """vLLM's standard format: ``x [N, H]``, ``ids [N, k]`` (local ids, or global ones when ``id_offset``
    is this rank's first expert: ids outside this rank are skipped, as experts that apply ``expert_map``
    do) -> ``[N, H]`` weighted and summed over each row's slots.  No host synchronisation (capturable)."""
    out = torch.zeros(x.shape[0], x.shape[1], dtype=torch.float32, device=x.device)
    local_ids = ids.long() - id_offset
    for e in range(local.w13.shape[0]):
        w = torch.where(local_ids == e, weights, torch.zeros_like(weights)).sum(dim=1, keepdim=True)
        if weights_on_input:
            w = (local_ids == e).any(dim=1, keepdim=True).float()
        out += w * expert_mlp(x, local.w13[e], local.w2[e])
    return out.to(x.dtype)


def torch_experts_batched(x: torch.Tensor, local: Layer) -> torch.Tensor:
    """vLLM's batched format: ``x [L, C, H]`` -> unweighted ``[L, C, H]`` for every slot (rows past an
    expert's count hold whatever; combine ignores them).  No host synchronisation (capturable)."""
    return torch.stack([expert_mlp(x[e], local.w13[e], local.w2[e]) for e in range(x.shape[0])]).to(x.dtype)
