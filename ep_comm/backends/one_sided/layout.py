"""The one-sided family's buffer layout and the static config vector its ops receive.

Every offset and size here is computed once per communicator from ``EPConfig`` and written into the
config vector (slots: ``protocol.Cfg``); the kernels read them from there (csrc/one_sided/one_sided.cuh
describes the buffer).
"""
from __future__ import annotations

import dataclasses
import os
from typing import Callable, Optional

import torch

from ...config import EPConfig
from ...errors import EPConfigError
from ..protocol import Cfg, DType, Limit, Quant

# prefill-sized combines of the standard layout at world > 2 signal per group of Limit.GROUP_TOKENS
# tokens, from GROUPED_MIN_TOKENS tokens per rank on, every block sending and summing in turn; at world
# 2 the pushed combine, whose send items are handed out as warps ask, is faster than either grouped
# mode, and batched combines are slower grouped, so both stay ungrouped (docs/performance.md).
# $EP_COMM_COMBINE_GROUPED forces a mode for either layout: 0 off, 1 interleaved (every block sends and
# sums in turn), "split" (a third of the blocks only send, the others only sum) or "split:N".
GROUPED_MIN_TOKENS = 512
COMBINE_GROUPED_ENV = "EP_COMM_COMBINE_GROUPED"
# zero copy: combine pulls (reads the owners' expert rows in place) from this many tokens per rank; it
# pushes below, where the extra "done reading" round trip outweighs the saved pass
# (docs/performance.md).  "0" / "1" force it.
COMBINE_PULL_ENV = "EP_COMM_COMBINE_PULL"
PULL_MIN_TOKENS = GROUPED_MIN_TOKENS
# "0" keeps every warp of a dispatch on its sends; unset or "1": the rows (copied, or quantised to fp8
# from EP4 on; the batched layout's unquantised rows from EP4 on) are laid out while the dispatch still
# sends, at sizes where every warp sends whole rows (the extension decides per call; docs/design.md).
# Each rank's own choice: the ranks need not agree.
RECEIVE_WHILE_SENDING_ENV = "EP_COMM_RECEIVE_WHILE_SENDING"
# receiving while sending, the warps of each 16-warp block that lay rows out from the start, the rest
# sending first.  At EP2 a token sends one remote row and the SMs bound the sends (12 sending warps: 199
# µs at 4096 tokens, 16: 173): 5 receive (2-8 measured, 5 the fastest).  From EP4 a token sends about 3
# rows, the link bounds the sends, and with half the warps receiving nearly every row is laid out when
# they end (4-12 measured, 8 the fastest; docs/performance.md); the batched layout's expansion at EP4 took
# 620 µs receiving on 8 warps against 793 after the sends.  $EP_COMM_RECEIVE_WARPS (1-15) sets the count
# for every dispatch that can receive while sending, fp8 and the batched layout at EP2 included.
RECEIVE_WARPS_ONE_PEER = 5
RECEIVE_WARPS_MANY_PEERS = 8
RECEIVE_WARPS_ENV = "EP_COMM_RECEIVE_WARPS"
# the interleaved grouped combine (mode 1), the warps of each block that only sum own groups as their
# partials land, the rest only sending: the sends then never pause for a sum.  At EP4 4096 tokens 8 took
# 560 µs against 613 with every warp sending and summing in turn (4, 6, 10 and 12 measured, slower;
# docs/performance.md).  $EP_COMM_COMBINE_SUM_WARPS (0-15) sets it; 0 is the in-turn form.
SUM_WARPS = 8
SUM_WARPS_ENV = "EP_COMM_COMBINE_SUM_WARPS"

DTYPE_CODES = {torch.bfloat16: DType.BF16, torch.float16: DType.FP16, torch.float32: DType.FP32}
QUANT_CODES = {None: Quant.NONE, "fp8": Quant.FP8, "nvfp4": Quant.NVFP4}


def _align(n: int, a: int = 16) -> int:
    return (n + a - 1) // a * a


@dataclasses.dataclass(frozen=True)
class BufferLayout:
    """Byte layout of one rank's symmetric buffer (see csrc/one_sided/one_sided.cuh).

    ``scale_max`` bounds the bytes of one token's ``x_scales`` row: ``hidden // 128`` float32 scales
    (fp8) or, for opaque payloads, up to ``max(hidden // 4, 64)`` bytes (e.g. NVFP4 block scales).
    """

    world: int
    max_tokens: int
    top_k: int
    meta_bytes: int
    payload_max: int
    scale_max: int
    row_stride: int
    combine_stride: int
    flags_offset: int
    group_flags_offset: int
    max_groups: int
    dispatch_offset: tuple[int, int]
    combine_offset: tuple[int, int]
    counts_offset: tuple[int, int]
    nbytes: int
    # put mode (nvshmem network path): staging for rows, partials and counts, per destination; 0 otherwise
    stage_offset: int = 0
    stage_combine_offset: int = 0
    stage_counts_offset: int = 0
    # combine reads the expert rows in place (combine_pulls): one combine region, holding them
    combine_pull: bool = False

    @property
    def scale_offset(self) -> int:
        return self.meta_bytes + _align(self.payload_max)

    @property
    def put_mode(self) -> bool:
        return self.stage_offset != 0

    @classmethod
    def for_config(cls, cfg: EPConfig, world: int, put_mode: bool = False,
                   pull_env: Optional[str] = None) -> BufferLayout:
        """``pull_env``: $EP_COMM_COMBINE_PULL (see ``_pulls``; ValueError when malformed)."""
        k, hidden, max_t = cfg.top_k, cfg.hidden, cfg.max_tokens_per_rank
        meta = _align(Limit.ROW_HEADER_BYTES + 12 * k)
        payload_max = hidden * cfg.dtype.itemsize
        scale_max = _align(max(4 * -(-hidden // 128), hidden // 4, 64))
        row_stride = meta + _align(payload_max) + scale_max
        combine_stride = _align(hidden * cfg.dtype.itemsize)
        pull = _pulls(cfg, put_mode, combine_stride, pull_env)
        # [2 parities][world] call flags, then [2 parities][world] input verdicts (Phase.CHECKED)
        flags = _align(4 * world * 8, 256)
        max_groups = -(-max_t // Limit.GROUP_TOKENS)
        group_flags = _align(2 * world * max_groups * 8, 256)
        counts = _align(world * (cfg.num_experts // world) * 4, 256)
        dispatch = world * max_t * row_stride
        combine = world * max_t * combine_stride
        # zero copy keeps every call's rows in dispatch half 0 (kCfgZeroCopy): no second dispatch region
        one_half = cfg.zero_copy
        n0 = flags + group_flags
        n1 = n0 + counts
        d0 = n1 + counts
        c0 = d0 + dispatch
        d1 = d0 if one_half else c0 + combine
        # a pulling combine never receives partials: region 0 holds the expert rows, no region 1
        c1 = (c0 if pull else c0 + combine) if one_half else d1 + dispatch
        end = c1 + combine
        stages = (end, end + dispatch, end + dispatch + combine) if put_mode else (0, 0, 0)
        if put_mode:
            end += dispatch + combine + counts
        return cls(world, max_t, k, meta, payload_max, scale_max, row_stride, combine_stride, 0, flags, max_groups,
                   (d0, d1), (c0, c1), (n0, n1), end, *stages, combine_pull=pull)

    def work_numel(self, num_local: int) -> int:
        """int32 elements of the dispatch workspace: per (peer, expert) counters, own slots, ready codes."""
        return self.world * num_local + self.max_tokens * (self.top_k + 1)


def backend_layout(cfg: EPConfig, world: int, put_mode: bool = False) -> BufferLayout:
    """The layout a kernel backend allocates, $EP_COMM_COMBINE_PULL read here (a setting the
    communicator checked: the same, and well formed, on every rank)."""
    return BufferLayout.for_config(cfg, world, put_mode, pull_env=_checked_env(COMBINE_PULL_ENV, _check_on_off))


def _pulls(cfg: EPConfig, put_mode: bool, combine_stride: int, forced: Optional[str]) -> bool:
    """Whether combine reads the peers' expert rows in place (kCfgCombinePullInput): zero copy, peers
    reached by stores (not put mode), rows of exactly ``hidden`` elements so that the experts can
    write a contiguous ``[N, hidden]`` view of them, and prefill sizes (PULL_MIN_TOKENS) unless
    ``forced`` ($EP_COMM_COMBINE_PULL) says "1" (or "0": never)."""
    _check_on_off(forced)
    possible = cfg.zero_copy and not put_mode and combine_stride == cfg.hidden * cfg.dtype.itemsize
    if forced in ("0", "1"):
        return possible and forced == "1"
    return possible and cfg.max_tokens_per_rank >= PULL_MIN_TOKENS


def _check_on_off(forced: Optional[str]) -> None:
    if forced not in (None, "", "0", "1"):
        raise ValueError("expected 0 or 1")


def _warp_count_check(lowest: int) -> Callable[[Optional[str]], None]:
    """The check of a $EP_COMM_* count of a block's warps: ``lowest`` to all but one (the rest send)."""
    def check(value: Optional[str]) -> None:
        if value:
            try:
                ok = lowest <= int(value) < Limit.THREADS // 32
            except ValueError:
                ok = False
            if not ok:
                raise ValueError(f"expected {lowest} to {Limit.THREADS // 32 - 1} (warps of a block; the rest send)")
    return check


_check_receive_warps = _warp_count_check(1)
_check_sum_warps = _warp_count_check(0)


def _checked_env(name: str, check: Callable[[Optional[str]], object]) -> Optional[str]:
    """$name, or ``EPConfigError`` naming it where ``check`` rejects its value (``ValueError``)."""
    value = os.environ.get(name)
    try:
        check(value)
    except ValueError as exc:
        raise EPConfigError(f"${name}", value, str(exc)) from exc
    return value


def check_environment() -> None:
    """``EPConfigError`` for a malformed $EP_COMM_COMBINE_GROUPED, $EP_COMM_COMBINE_PULL,
    $EP_COMM_NUM_SMS, $EP_COMM_RECEIVE_WHILE_SENDING, $EP_COMM_RECEIVE_WARPS or $EP_COMM_COMBINE_SUM_WARPS,
    raised before any backend is made: under ``backend="auto"`` it must not pass for a backend that cannot
    start."""
    checks = ((COMBINE_GROUPED_ENV, lambda v: combine_grouped_mode(v, "0", 24)),
              (COMBINE_PULL_ENV, _check_on_off), (NUM_SMS_ENV, _check_num_sms),
              (RECEIVE_WHILE_SENDING_ENV, _check_on_off), (RECEIVE_WARPS_ENV, _check_receive_warps),
              (SUM_WARPS_ENV, _check_sum_warps))
    for name, check in checks:
        _checked_env(name, check)


def receive_warps(cfg: EPConfig, world: int) -> int:
    """``Cfg.RECEIVE_WARPS``: the warps of each block that lay peers' rows out while the others send, in
    a dispatch the extension lets receive while sending; 0: every warp sends first.  Quantised: fp8 from
    EP4 on (at EP2 the quantiser bounds the sends by instructions and lost 5 % with 4 warps receiving),
    never NVFP4.  The batched layout unquantised from EP4 on (at EP2 it gained 2 %, too little to
    switch on by one run; batched fp8 at EP2 lost 21 %, at EP4 it is not measured)."""
    if os.environ.get(RECEIVE_WHILE_SENDING_ENV) == "0" or world < 2 or cfg.quant == "nvfp4":
        return 0
    forced = _checked_env(RECEIVE_WARPS_ENV, _check_receive_warps)
    if forced:
        return int(forced)
    if cfg.layout == "batched" and (world == 2 or cfg.quant is not None):
        return 0
    if world == 2:
        return RECEIVE_WARPS_ONE_PEER if cfg.quant is None else 0
    return RECEIVE_WARPS_MANY_PEERS


def combine_sum_warps(grouped_mode: int) -> int:
    """``Cfg.COMBINE_SUM_WARPS``: in the interleaved grouped combine (``grouped_mode`` 1), the warps of
    each block that only sum own groups while the others only send; 0 for every other mode."""
    if grouped_mode != 1:
        return 0
    forced = _checked_env(SUM_WARPS_ENV, _check_sum_warps)
    return int(forced) if forced else SUM_WARPS


def default_combine_grouping(cfg: EPConfig, world: int) -> str:
    """The grouped-combine mode a config gets without $EP_COMM_COMBINE_GROUPED: "0" or "1"."""
    if cfg.layout != "standard" or cfg.max_tokens_per_rank < GROUPED_MIN_TOKENS or world <= 2:
        return "0"
    return "1"


def combine_grouped_mode(forced: Optional[str], default: str, num_blocks: int) -> int:
    """The config's combine grouping (``Cfg.COMBINE_GROUPED``): 0 off, 1 interleaved, n >= 2 split with
    n - 1 sending blocks; ``forced`` is $EP_COMM_COMBINE_GROUPED, else ``default``."""
    if forced is None or forced == "":
        forced = default
    if forced in ("0", "1"):
        return int(forced)
    if forced == "split" or forced.startswith("split:"):
        senders = int(forced[6:]) if forced.startswith("split:") else num_blocks // 3
        if num_blocks < 2 or not 1 <= senders < num_blocks:
            return 1  # one block cannot be split; the interleaved mode does the same work
        return 1 + senders
    raise ValueError(f"${COMBINE_GROUPED_ENV}={forced!r}: expected 0, 1, split or split:N")


def config_vector(cfg: EPConfig, rank: int, world: int, layout: BufferLayout, num_blocks: int,
                  pending_ptr: int) -> list[int]:
    """The static int64 vector every one-sided op receives (slots: ``protocol.Cfg``)."""
    v = [0] * Cfg.LEN
    v[Cfg.RANK], v[Cfg.WORLD], v[Cfg.MAX_TOKENS] = rank, world, cfg.max_tokens_per_rank
    v[Cfg.NUM_EXPERTS], v[Cfg.NUM_LOCAL], v[Cfg.TOP_K] = cfg.num_experts, cfg.num_experts // world, cfg.top_k
    v[Cfg.HIDDEN], v[Cfg.BATCHED], v[Cfg.NUM_BLOCKS] = cfg.hidden, int(cfg.layout == "batched"), num_blocks
    v[Cfg.ROW_STRIDE], v[Cfg.PAYLOAD_OFFSET] = layout.row_stride, layout.meta_bytes
    v[Cfg.SCALE_OFFSET], v[Cfg.PAYLOAD_MAX] = layout.scale_offset, layout.payload_max
    v[Cfg.SCALE_MAX], v[Cfg.FLAGS_OFFSET] = layout.scale_max, layout.flags_offset
    v[Cfg.DISPATCH_OFFSET0], v[Cfg.DISPATCH_OFFSET1] = layout.dispatch_offset
    v[Cfg.COMBINE_OFFSET0], v[Cfg.COMBINE_OFFSET1] = layout.combine_offset
    v[Cfg.COMBINE_STRIDE] = layout.combine_stride
    v[Cfg.COUNTS_OFFSET0], v[Cfg.COUNTS_OFFSET1] = layout.counts_offset
    v[Cfg.GROUP_FLAGS_OFFSET] = layout.group_flags_offset
    mode = combine_grouped_mode(os.environ.get(COMBINE_GROUPED_ENV), default_combine_grouping(cfg, world),
                                num_blocks)
    # put mode signals once per call (no per-group signals)
    v[Cfg.COMBINE_GROUPED] = mode if world > 1 and not layout.put_mode else 0
    v[Cfg.COMBINE_SUM_WARPS] = combine_sum_warps(v[Cfg.COMBINE_GROUPED])
    v[Cfg.PUT_MODE] = int(layout.put_mode)
    v[Cfg.STAGE_OFFSET], v[Cfg.STAGE_COMBINE_OFFSET] = layout.stage_offset, layout.stage_combine_offset
    v[Cfg.STAGE_COUNTS_OFFSET] = layout.stage_counts_offset
    v[Cfg.ZERO_COPY] = int(cfg.zero_copy)
    v[Cfg.RECEIVE_WARPS] = receive_warps(cfg, world)
    v[Cfg.TIMEOUT_NS] = int(cfg.timeout_s * 1e9)
    v[Cfg.PENDING_PTR] = pending_ptr
    v[Cfg.QUANT] = int(QUANT_CODES[cfg.quant])
    v[Cfg.OUT_DTYPE] = int(DTYPE_CODES[cfg.dtype])
    return v


NUM_SMS_ENV = "EP_COMM_NUM_SMS"
DECODE_MAX_TOKENS = 256  # up to this many tokens per rank, the default SM count is the decode one
DECODE_SMS, PREFILL_SMS = 64, 24


def _check_num_sms(value: Optional[str]) -> None:
    if value:
        try:
            ok = int(value) > 0
        except ValueError:
            ok = False
        if not ok:
            raise ValueError("expected a positive integer")


def default_num_blocks(cfg: EPConfig, device: torch.device, env_value: Optional[str]) -> int:
    """SMs (one block each) the kernels use: ``cfg.num_sms``, else ``$EP_COMM_NUM_SMS``, else 64 for
    decode-sized communicators (``max_tokens_per_rank <= 256``: latency-bound, more warps in flight
    help) and 24 for prefill (bandwidth-bound: 24 SMs leave the rest to the engine's GEMMs).  Never
    more than the GPU has: every block must be resident, since blocks wait for each other."""
    sms = torch.cuda.get_device_properties(device).multi_processor_count
    if cfg.num_sms is not None:
        want = cfg.num_sms
    elif env_value:
        want = int(env_value)
    else:
        want = DECODE_SMS if cfg.max_tokens_per_rank <= DECODE_MAX_TOKENS else PREFILL_SMS
    return max(1, min(int(want), sms))
