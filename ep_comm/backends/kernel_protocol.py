"""Python mirror of ``csrc/common/protocol.h``: config vector, buffer layout, error record.

Kept in one place so the C++ and Python sides change together; ``kernel_ops`` refuses an extension
whose config length differs from ``CFG_LEN``.
"""
from __future__ import annotations

import dataclasses
import os
from typing import Optional

import torch

from ..config import EPConfig
from ..errors import EPConfigError

# index of each entry of the int64 config vector (protocol.h, enum kCfg*)
(RANK, WORLD, MAX_TOKENS, NUM_EXPERTS, NUM_LOCAL, TOP_K, HIDDEN, BATCHED, NUM_BLOCKS, ROW_STRIDE,
 PAYLOAD_OFFSET, SCALE_OFFSET, PAYLOAD_MAX, SCALE_MAX, FLAGS_OFFSET, DISPATCH_OFFSET0, DISPATCH_OFFSET1,
 COMBINE_OFFSET0, COMBINE_OFFSET1, COMBINE_STRIDE, TIMEOUT_NS, PENDING_PTR, COUNT_INVALID, QUANT_FP8,
 OUT_DTYPE, THREADS, COUNTS_OFFSET0, COUNTS_OFFSET1, TRACE_PTR, GROUP_FLAGS_OFFSET, COMBINE_GROUPED,
 PUT_MODE, STAGE_OFFSET, STAGE_COMBINE_OFFSET, STAGE_COUNTS_OFFSET, ZERO_COPY, COMBINE_PULL_INPUT,
 CFG_LEN) = range(38)

# halves of a call (protocol.h, kPhase*): return_recv_hook launches them separately
PHASE_SEND, PHASE_RECEIVE, PHASE_BOTH = 1, 2, 3
# added to a dispatch's send/both phases: out-of-range ids make the launch signal an abort (the host
# checks the ids after launching; protocol.h, kPhaseAbandonOnInvalid)
PHASE_ABANDON_ON_INVALID = 4

# prefill-sized combines of the standard layout signal per group of GROUP_TOKENS tokens (protocol.h,
# kGroupTokens), from GROUPED_MIN_TOKENS tokens per rank on: split at world 2 (a third of the blocks
# only send partials, the others only sum), interleaved at larger worlds, where split has not been
# measured (more peers shift the work towards sending).  $EP_COMM_COMBINE_GROUPED forces a mode for
# either layout: 0 off, 1 interleaved (every block sends and sums in turn), "split" (a third of the
# blocks send) or "split:N" (N sending blocks).  Measured at EP2 x 4096 tokens, 24 SMs (bench/NOTES.md):
# standard combine 342 us off, 332 interleaved, 320-326 split:8, 340 split:12; batched combines are
# slower in every grouped mode, so they stay ungrouped.
GROUP_TOKENS, GROUPED_MIN_TOKENS = 32, 512
COMBINE_GROUPED_ENV = "EP_COMM_COMBINE_GROUPED"
# zero copy: combine pulls (reads the owners' expert rows in place) from this many tokens per rank; it
# pushes below, where the extra "done reading" round trip outweighs the saved pass (EP2, H200: pull
# 223.8 vs push 324.1 us at 4096 tokens, 20.1-20.4 vs 18.9-19.0 at 128).  "0" / "1" force it.
COMBINE_PULL_ENV = "EP_COMM_COMBINE_PULL"
PULL_MIN_TOKENS = GROUPED_MIN_TOKENS

# phase stamps (EP_COMM_TRACE=1): uint64 [2 ops][num_blocks][TRACE_SLOTS] globaltimer values
TRACE_DISPATCH, TRACE_COMBINE, TRACE_SLOTS, TRACE_SOURCES = 0, 1, 24, 8
TR_START, TR_SENT, TR_ARRIVED, TR_SIGNALLED, TR_SOURCE0, TR_END = 0, 1, 2, 3, 4, 20

DTYPE_CODES = {torch.bfloat16: 0, torch.float16: 1, torch.float32: 2}

# state tensor: int64 counters, then the int32 error record
STATE_COUNTERS = 4
ST_INVALID_IDS, ST_TIMEOUTS, ST_OVERFLOW, ST_LOCAL_STALL, ST_ROW_FORMAT, ST_EXPECTED_CODE = range(6)
ST_RANK_REASON = 8
REASON_TIMEOUT, REASON_MISMATCH, REASON_ABORT, REASON_FORMAT = 1, 2, 4, 8
# host-mapped words per communicator
PENDING_FATAL, PENDING_IDS_CHECK, PENDING_RECOVERABLE, PENDING_WORDS = 0, 1, 2, 4
OP_NAMES = {1: "dispatch", 2: "combine", 3: "abort"}

MAX_TOP_K = 32
MAX_LOCAL_EXPERTS = 4096
THREADS_PER_BLOCK = 512
ROW_HEADER_BYTES = 16


def status_words(world: int) -> int:
    return ST_RANK_REASON + 2 * world


def state_numel(world: int) -> int:
    """int64 elements of the state tensor: counters + the int32 error record, rounded up."""
    return STATE_COUNTERS + (status_words(world) + 1) // 2


def describe_code(code: int) -> str:
    """'dispatch #12' for a flag code (seq is the communicator's kernel call number)."""
    if code == 0:
        return "nothing yet"
    return f"{OP_NAMES.get(code & 3, 'op ' + str(code & 3))} #{code >> 2}"


def latest_code(*codes: int) -> int:
    """The code of the latest call among ``codes`` (0 = none; seq compared modulo its 30-bit wrap, as the
    kernels do)."""
    best = 0
    for c in codes:
        c &= 0xFFFFFFFF
        if c and (not best or 0 < ((c >> 2) - (best >> 2)) % (1 << 30) < (1 << 29) - 1):
            best = c
    return best


def _align(n: int, a: int = 16) -> int:
    return (n + a - 1) // a * a


@dataclasses.dataclass(frozen=True)
class BufferLayout:
    """Byte layout of one rank's symmetric buffer (see csrc/mnnvl/mnnvl.cuh).

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
                   pull_env: Optional[str] = None) -> "BufferLayout":
        """``pull_env``: $EP_COMM_COMBINE_PULL (see ``_pulls``; ValueError when malformed)."""
        k, hidden, max_t = cfg.top_k, cfg.hidden, cfg.max_tokens_per_rank
        meta = _align(ROW_HEADER_BYTES + 12 * k)
        payload_max = hidden * cfg.dtype.itemsize
        scale_max = _align(max(4 * -(-hidden // 128), hidden // 4, 64))
        row_stride = meta + _align(payload_max) + scale_max
        combine_stride = _align(hidden * cfg.dtype.itemsize)
        pull = _pulls(cfg, put_mode, combine_stride, pull_env)
        flags = _align(2 * world * 8, 256)
        max_groups = -(-max_t // GROUP_TOKENS)
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
    forced = os.environ.get(COMBINE_PULL_ENV)
    try:
        return BufferLayout.for_config(cfg, world, put_mode, pull_env=forced)
    except ValueError as exc:
        raise EPConfigError(f"${COMBINE_PULL_ENV}", forced, str(exc)) from exc


def _pulls(cfg: EPConfig, put_mode: bool, combine_stride: int, forced: Optional[str]) -> bool:
    """Whether combine reads the peers' expert rows in place (kCfgCombinePullInput): zero copy, peers
    reached by stores (not put mode), rows of exactly ``hidden`` elements so that the experts can
    write a contiguous ``[N, hidden]`` view of them, and prefill sizes (PULL_MIN_TOKENS) unless
    ``forced`` ($EP_COMM_COMBINE_PULL) says "1" (or "0": never)."""
    _check_pull_switch(forced)
    possible = cfg.zero_copy and not put_mode and combine_stride == cfg.hidden * cfg.dtype.itemsize
    if forced in ("0", "1"):
        return possible and forced == "1"
    return possible and cfg.max_tokens_per_rank >= PULL_MIN_TOKENS


def _check_pull_switch(forced: Optional[str]) -> None:
    if forced not in (None, "", "0", "1"):
        raise ValueError("expected 0 or 1")


def check_environment() -> None:
    """``EPConfigError`` for a malformed $EP_COMM_COMBINE_GROUPED or $EP_COMM_COMBINE_PULL, raised before
    any backend is made: under ``backend="auto"`` it must not pass for a backend that cannot start."""
    checks = ((COMBINE_GROUPED_ENV, lambda v: combine_grouped_mode(v, "0", 24)),
              (COMBINE_PULL_ENV, _check_pull_switch))
    for name, check in checks:
        value = os.environ.get(name)
        try:
            check(value)
        except ValueError as exc:
            raise EPConfigError(f"${name}", value, str(exc)) from exc


def default_combine_grouping(cfg: EPConfig, world: int) -> str:
    """The grouped-combine mode a config gets without $EP_COMM_COMBINE_GROUPED: "0", "1" or "split"."""
    if cfg.layout != "standard" or cfg.max_tokens_per_rank < GROUPED_MIN_TOKENS or world < 2:
        return "0"
    return "split" if world == 2 else "1"


def combine_grouped_mode(forced: Optional[str], default: str, num_blocks: int) -> int:
    """The config's COMBINE_GROUPED value: 0 off, 1 interleaved, n >= 2 split with n - 1 sending
    blocks (protocol.h, kCfgCombineGrouped); ``forced`` is $EP_COMM_COMBINE_GROUPED, else ``default``."""
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
    """The static int64 vector every kernel-backend op receives."""
    v = [0] * CFG_LEN
    v[RANK], v[WORLD], v[MAX_TOKENS] = rank, world, cfg.max_tokens_per_rank
    v[NUM_EXPERTS], v[NUM_LOCAL], v[TOP_K] = cfg.num_experts, cfg.num_experts // world, cfg.top_k
    v[HIDDEN], v[BATCHED], v[NUM_BLOCKS] = cfg.hidden, int(cfg.layout == "batched"), num_blocks
    v[ROW_STRIDE], v[PAYLOAD_OFFSET], v[SCALE_OFFSET] = layout.row_stride, layout.meta_bytes, layout.scale_offset
    v[PAYLOAD_MAX], v[SCALE_MAX], v[FLAGS_OFFSET] = layout.payload_max, layout.scale_max, layout.flags_offset
    v[DISPATCH_OFFSET0], v[DISPATCH_OFFSET1] = layout.dispatch_offset
    v[COMBINE_OFFSET0], v[COMBINE_OFFSET1] = layout.combine_offset
    v[COMBINE_STRIDE] = layout.combine_stride
    v[COUNTS_OFFSET0], v[COUNTS_OFFSET1] = layout.counts_offset
    v[GROUP_FLAGS_OFFSET] = layout.group_flags_offset
    mode = combine_grouped_mode(os.environ.get(COMBINE_GROUPED_ENV), default_combine_grouping(cfg, world),
                                num_blocks)
    # put mode signals once per call (no per-group signals)
    v[COMBINE_GROUPED] = mode if world > 1 and not layout.put_mode else 0
    v[PUT_MODE] = int(layout.put_mode)
    v[STAGE_OFFSET], v[STAGE_COMBINE_OFFSET] = layout.stage_offset, layout.stage_combine_offset
    v[STAGE_COUNTS_OFFSET] = layout.stage_counts_offset
    v[ZERO_COPY] = int(cfg.zero_copy)
    v[TIMEOUT_NS] = int(cfg.timeout_s * 1e9)
    v[PENDING_PTR] = pending_ptr
    v[COUNT_INVALID] = int(not cfg.validate_ids)
    v[QUANT_FP8] = int(cfg.quant == "fp8")
    v[OUT_DTYPE] = DTYPE_CODES[cfg.dtype]
    v[THREADS] = THREADS_PER_BLOCK
    return v


@dataclasses.dataclass(frozen=True)
class StatusReport:
    """The device error record, decoded (``state`` read after a synchronisation)."""

    invalid_ids: int
    timeouts: int
    overflow: int
    local_stall: int
    row_format: int
    expected_code: int
    reasons: tuple[int, ...]  # per rank
    seen: tuple[int, ...]  # per rank: the flag code seen when it was flagged

    @classmethod
    def from_words(cls, words: list[int], world: int) -> "StatusReport":
        return cls(words[ST_INVALID_IDS], words[ST_TIMEOUTS], words[ST_OVERFLOW], words[ST_LOCAL_STALL],
                   words[ST_ROW_FORMAT], words[ST_EXPECTED_CODE] & 0xFFFFFFFF,
                   tuple(words[ST_RANK_REASON: ST_RANK_REASON + world]),
                   tuple(w & 0xFFFFFFFF for w in words[ST_RANK_REASON + world: ST_RANK_REASON + 2 * world]))

    def ranks_with(self, reason: int) -> list[int]:
        return [r for r, bits in enumerate(self.reasons) if bits & reason]

    @property
    def empty(self) -> bool:
        return not (self.invalid_ids or self.timeouts or self.overflow or self.local_stall or self.row_format
                    or any(self.reasons))


DECODE_MAX_TOKENS = 256  # up to this many tokens per rank, the default SM count is the decode one
DECODE_SMS, PREFILL_SMS = 64, 24


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
