"""A CPU stand-in for DeepEP's V1 Python API (``deep_ep.Buffer``), for the bench's peer tests only.

It follows the calls and semantics ``ep_comm.cli.peers`` relies on (normal dispatch: one row per
(token, receiving rank) with local ids, combine sums rows without weights; low-latency dispatch:
``[L, world × max, hidden]`` packed per expert with counts, combine applies the weights), moving data
with gloo all-gathers.  ``EP_COMM_FAKE_DEEPEP=wrong`` corrupts one combined value on the last rank,
``=raise`` makes low-latency dispatch raise, so the tests see both kinds of failure handled.

The bench refuses CPU ranks for DeepEP (``DeepEPPeer.needs_cuda``); this stand-in runs on them, so
importing it, which the bench's probe does first, lifts that refusal in the importing process.
"""
import os

import torch
import torch.distributed as dist

from ep_comm.cli.peers import DeepEPPeer

DeepEPPeer.needs_cuda = False
topk_idx_t = torch.int64


class Config:
    def __init__(self, num_sms: int):
        self.num_sms = num_sms

    def get_nvl_buffer_size_hint(self, hidden_bytes: int, num_ranks: int) -> int:
        return hidden_bytes * num_ranks


def _bytes(t):
    """fp8 tensors do not pickle: carry them as bytes."""
    return t.view(torch.uint8) if t is not None and t.dtype == torch.float8_e4m3fn else t


def _fp8(t):
    return t.view(torch.float8_e4m3fn) if t is not None and t.dtype == torch.uint8 else t


def _gather(obj):
    out = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj)
    return out


def _mode() -> str:
    return os.environ.get("EP_COMM_FAKE_DEEPEP", "")


class Buffer:
    num_sms = 20

    def __init__(self, group, num_nvl_bytes=0, num_rdma_bytes=0, low_latency_mode=False, num_qps_per_rank=24,
                 explicitly_destroy=False, **_):
        self.rank, self.size = group.rank(), group.size()
        self.low_latency_mode = low_latency_mode
        _gather(self.rank)  # collective, like the real constructor

    @staticmethod
    def set_num_sms(n: int) -> None:
        assert n % 2 == 0
        Buffer.num_sms = n

    @staticmethod
    def get_dispatch_config(num_ranks: int) -> Config:
        return Config(Buffer.num_sms)

    get_combine_config = get_dispatch_config

    @staticmethod
    def get_low_latency_rdma_size_hint(num_max, hidden, num_ranks, num_experts) -> int:
        return num_max * hidden * num_experts

    def destroy(self) -> None:
        _gather(None)

    # -- normal mode -------------------------------------------------------------------------------------
    def get_dispatch_layout(self, topk_idx, num_experts):
        L = num_experts // self.size
        owner = torch.where(topk_idx >= 0, topk_idx // L, torch.full_like(topk_idx, -1))
        in_rank = torch.stack([(owner == r).any(dim=1) for r in range(self.size)], dim=1)
        per_expert = torch.stack([(topk_idx == e).sum() for e in range(num_experts)]).int()
        return in_rank.sum(dim=0).int(), None, per_expert, in_rank, None

    def dispatch(self, x, num_tokens_per_rank=None, is_token_in_rank=None, num_tokens_per_expert=None,
                 topk_idx=None, topk_weights=None, config=None, **_):
        assert isinstance(config, Config) and topk_idx.dtype == topk_idx_t
        q, s = x if isinstance(x, tuple) else (x, None)
        L = num_tokens_per_expert.numel() // self.size
        fp8 = q.dtype == torch.float8_e4m3fn
        everyone = _gather((_bytes(q), s, topk_idx, topk_weights, is_token_in_rank))
        rows, scales, ids, ws, src = [], [], [], [], []
        for r, (xq, xs, idx, w, in_rank) in enumerate(everyone):
            xq = _fp8(xq) if fp8 else xq
            for t in torch.nonzero(in_rank[:, self.rank]).flatten().tolist():
                local = idx[t] - self.rank * L
                mine = (idx[t] >= 0) & (local >= 0) & (local < L)
                rows.append(xq[t])
                scales.append(None if xs is None else xs[t])
                ids.append(torch.where(mine, local, torch.full_like(local, -1)))
                ws.append(w[t] + 3.0 * ~mine)  # junk weights on -1 slots: the contract leaves them unspecified
                src.append((r, t))
        hidden = q.shape[1]
        recv_x = torch.stack(rows) if rows else q.new_empty(0, hidden)
        if s is not None:
            recv_x = (recv_x, torch.stack(scales) if scales else s.new_empty(0, s.shape[1]))
        k = topk_idx.shape[1]
        recv_ids = torch.stack(ids) if ids else topk_idx.new_empty(0, k)
        recv_w = torch.stack(ws) if ws else topk_weights.new_empty(0, k)
        return recv_x, recv_ids, recv_w, [], (src, q.shape[0]), None

    def combine(self, x, handle, config=None, **_):
        src, num_tokens = handle
        everyone = _gather((x, src))
        y = torch.zeros(num_tokens, x.shape[1])
        for rows, srcs in everyone:
            for row, (r, t) in zip(rows, srcs):
                if r == self.rank:
                    y[t] += row.float()
        if _mode() == "wrong" and self.rank == self.size - 1 and num_tokens:
            y[0] += 1.0
        return y.to(torch.bfloat16), None, None

    # -- low-latency mode ----------------------------------------------------------------------------------
    def low_latency_dispatch(self, x, topk_idx, num_max_dispatch_tokens_per_rank, num_experts, use_fp8=True, **_):
        assert self.low_latency_mode and x.shape[0] <= num_max_dispatch_tokens_per_rank
        if _mode() == "raise":
            raise RuntimeError("DeepEP error: fake low-latency failure")
        from ep_comm.quant import quantize_fp8

        L, cap = num_experts // self.size, self.size * num_max_dispatch_tokens_per_rank
        hidden = x.shape[1]
        recv = torch.zeros(L, cap, hidden, dtype=torch.float8_e4m3fn if use_fp8 else torch.bfloat16)
        scales = torch.zeros(L, cap, hidden // 128)
        counts = torch.zeros(L, dtype=torch.int32)
        slots = {}
        for r, (xr, idx) in enumerate(_gather((x, topk_idx))):
            q, s = quantize_fp8(xr) if use_fp8 else (xr, None)
            for t in range(xr.shape[0]):
                for e in idx[t].tolist():
                    if e >= 0 and e // L == self.rank:
                        n = int(counts[e % L])
                        recv[e % L, n] = q[t]
                        if use_fp8:
                            scales[e % L, n] = s[t]
                        slots[(r, t, e)] = n
                        counts[e % L] += 1
        handle = (slots, x.shape[0], L)
        return ((recv, scales) if use_fp8 else recv), counts, handle, None, None

    def low_latency_combine(self, x, topk_idx, topk_weights, handle, **_):
        slots, num_tokens, L = handle
        everyone = _gather((x, slots))
        y = torch.zeros(num_tokens, x.shape[2])
        for t in range(num_tokens):
            for j, e in enumerate(topk_idx[t].tolist()):
                if e >= 0:
                    out, owner_slots = everyone[e // L]
                    y[t] += float(topk_weights[t, j]) * out[e % L, owner_slots[(self.rank, t, e)]].float()
        return y.to(torch.bfloat16), None, None
