"""What the CUDA extension and Python share: the single table both sides are built from.

Python reads the enums below; ``setup.py`` writes ``csrc/common/protocol_table.h`` from them before it
compiles the kernels (``cpp_header``), so the config slots, the error record and every other shared
number are defined here once.  The extension exports ``PROTOCOL_FINGERPRINT`` and refuses to be used
by a package whose table differs (a build from other sources).

This module imports nothing but the standard library: ``setup.py`` loads it by path, before torch or
the package can be imported.
"""
from __future__ import annotations

import enum
import zlib


@enum.unique
class Op(enum.IntEnum):
    """What a flag word announces (low 2 bits of its code; the rest is the call number)."""

    DISPATCH = 1
    COMBINE = 2
    ABORT = 3


@enum.unique
class State(enum.IntEnum):
    """int64 counters at the head of the per-communicator state tensor; the error record follows."""

    SEQ = 0  # this communicator's kernel call number, advanced on the device (graph replays too)
    ARRIVE = 1  # grid-wide arrival counter
    VERDICT = 2  # the last input verdict: nonzero when some rank's input was bad (Phase.CHECKED skips)
    DISPATCH_WORK = 3  # the dispatch's send items handed out as warps ask: call code << 32 | next ticket
    COMBINE_WORK = 4  # the same for the combine's sends
    RECEIVED = 5  # grid-wide arrival counter after a batched dispatch's receive while sending
    COUNTERS = 6  # number of counters: the int32 error record starts here


@enum.unique
class Status(enum.IntEnum):
    """int32 words of the error record (device memory, after the counters)."""

    INVALID_IDS = 0  # out-of-range expert ids treated as -1 (validation switched off)
    TIMEOUTS = 1  # waits that gave up
    OVERFLOW = 2  # a peer announced more tokens than max_tokens_per_rank
    LOCAL_STALL = 3  # this rank's own blocks did not all run (grid not resident)
    ROW_FORMAT = 4  # a peer's rows had another payload/scale width than ours
    EXPECTED_CODE = 5  # code this rank waited for when the first peer problem was seen
    RANK_REASON = 8  # [world] Reason bits per peer, then [world] code seen from that peer


@enum.unique
class Reason(enum.IntEnum):
    """Bits of a peer's entry in the error record."""

    TIMEOUT = 1
    MISMATCH = 2
    ABORT = 4
    FORMAT = 8


@enum.unique
class Pending(enum.IntEnum):
    """Host-mapped int32 words per communicator: the device sets them, the host reads them without a sync."""

    FATAL = 0  # the error record holds a problem that ends the call sequence
    IDS_CHECK = 1  # the input verdict found an out-of-range id in this rank's topk_ids
    RECOVERABLE = 2  # ids were dropped (validation off) or a peer abandoned a combine: raised after a launch
    VERDICT = 3  # the input verdict: some rank's input was bad, every rank skips the dispatch
    WORDS = 4


@enum.unique
class Cfg(enum.IntEnum):
    """Slots of the static int64 configuration vector every one-sided op receives."""

    RANK = 0
    WORLD = 1
    MAX_TOKENS = 2
    NUM_EXPERTS = 3
    NUM_LOCAL = 4
    TOP_K = 5
    HIDDEN = 6
    BATCHED = 7
    NUM_BLOCKS = 8
    ROW_STRIDE = 9  # bytes per dispatch row: meta | payload | scales
    PAYLOAD_OFFSET = 10  # = meta bytes
    SCALE_OFFSET = 11
    PAYLOAD_MAX = 12
    SCALE_MAX = 13
    FLAGS_OFFSET = 14
    DISPATCH_OFFSET0 = 15
    DISPATCH_OFFSET1 = 16
    COMBINE_OFFSET0 = 17
    COMBINE_OFFSET1 = 18
    COMBINE_STRIDE = 19
    TIMEOUT_NS = 20
    PENDING_PTR = 21  # device address of the communicator's Pending words
    QUANT = 22  # Quant: what the dispatch kernel quantises x to
    OUT_DTYPE = 23  # DType of EPConfig.dtype (combine's transport and output)
    COUNTS_OFFSET0 = 24
    COUNTS_OFFSET1 = 25
    TRACE_PTR = 26  # device uint64 [2 ops][num_blocks][Trace.SLOTS] of globaltimer stamps, or 0 (off)
    GROUP_FLAGS_OFFSET = 27  # [2][world][max_groups] u64: per group of GROUP_TOKENS tokens (combine)
    COMBINE_GROUPED = 28  # 0 off, 1 every block sends and sums in turn, n >= 2: blocks [0, n - 1) only send
    PUT_MODE = 29  # 1: peers reached by NVSHMEM puts/signals from staging rows (NVSHMEM build only)
    STAGE_OFFSET = 30  # put mode: [world][max_tokens] dispatch rows staged per destination
    STAGE_COMBINE_OFFSET = 31  # put mode: [world][max_tokens] combine partials staged per owner
    STAGE_COUNTS_OFFSET = 32  # put mode: [world][num_local] int32 counts staged per destination
    ZERO_COPY = 33  # 1 (standard layout): output rows are the receive buffer's rows of dispatch half 0
    COMBINE_PULL_INPUT = 34  # 0: combine pushes partials; else this rank's address of its expert rows
    ACTIVE_PTR = 35  # 0: every rank takes part; else device int32 [world], 1 for the ranks still in (shrink)
    RECEIVE_WARPS = 36  # n > 0: a dispatch may lay peers' rows out on n warps of a block while the others send
    # (ops.h decides per call whether it can); 0: every warp sends first
    COMBINE_SUM_WARPS = 37  # n > 0 (COMBINE_GROUPED 1): n warps of a block only sum own groups, the others send
    LEN = 38


@enum.unique
class Quant(enum.IntEnum):
    """What the dispatch kernel quantises x to (``EPConfig.quant``)."""

    NONE = 0
    FP8 = 1  # e4m3, one float32 scale per 128 channels
    NVFP4 = 2  # e2m1 pairs, one e4m3 scale per 16 channels, a float32 global scale per call


@enum.unique
class Phase(enum.IntEnum):
    """Halves of a call (``return_recv_hook``).

    The send half issues the stores, signals and advances the call number; the receive half waits and
    lays out or sums."""

    SEND = 1
    RECEIVE = 2
    BOTH = 3
    # added to a dispatch's send or both phases when an input verdict (eager calls with validate_ids)
    # was queued in front of it: when any rank's verdict was bad, every rank's launch skips the call
    CHECKED = 4


@enum.unique
class Trace(enum.IntEnum):
    """Phase stamps (``EP_COMM_TRACE=1``): uint64 [2 ops][num_blocks][SLOTS] globaltimer values."""

    DISPATCH = 0
    COMBINE = 1
    SLOTS = 24
    SOURCES = 8  # dispatch stamps per source for the first SOURCES sources (own, rank + 1, ...)


@enum.unique
class Stamp(enum.IntEnum):
    """Slots of one block's stamps."""

    START = 0  # block entered the kernel
    SENT = 1  # block finished its sends
    ARRIVED = 2  # grid-wide arrival done
    SIGNALLED = 3  # the last block released the peers' flags (last block only)
    SOURCE0 = 4  # dispatch: 4 + 2i flag of source i seen, 5 every source's rows laid out; combine: every flag seen
    END = 20  # block done
    # receive while sending (counts, not times), written when the block's send warps arrive:
    ROWS_BY_SENT = 21  # peer rows the block's receiving warps had laid out
    WAITED_BY_SENT = 22  # ns they had waited for rows to land, summed over the warps


@enum.unique
class DType(enum.IntEnum):
    """Codes of the float dtypes the kernels read and write."""

    BF16 = 0
    FP16 = 1
    FP32 = 2


class Limit:
    """Sizes both sides rely on (plain ints: several share a value)."""

    THREADS = 512  # threads per block of the one-sided kernels
    MAX_TOP_K = 32
    MAX_EXPERTS = 24576  # the dispatch's per-block [world][local experts] counts and slot bases, 2 x 4 B each, fit
    # the 227 KB of shared memory a Hopper or Blackwell block may opt into
    GROUP_TOKENS = 32  # prefill combines signal per group of this many tokens
    ROW_HEADER_BYTES = 16  # RowHeader at the head of every dispatch row
    SEQ_BITS = 30  # call numbers wrap modulo 2**SEQ_BITS in a flag code


# enum -> C++ prefix of its names (Cfg.ROW_STRIDE -> kCfgRowStride) and the underlying type
_CPP: tuple[tuple[type, str, str], ...] = (
    (Op, "kOp", "uint32_t"), (State, "kState", "int"), (Status, "kStatus", "int"), (Reason, "kReason", "int"),
    (Pending, "kPending", "int"), (Cfg, "kCfg", "int"), (Quant, "kQuant", "int"), (Phase, "kPhase", "int"),
    (Trace, "kTrace", "int"), (Stamp, "kTr", "int"), (DType, "k", "int"), (Limit, "k", "int"))


def _members(cls: type) -> list[tuple[str, int]]:
    if issubclass(cls, enum.Enum):
        return [(m.name, int(m.value)) for m in cls]
    return [(k, v) for k, v in vars(cls).items() if k.isupper() and isinstance(v, int)]


def _cpp_name(prefix: str, member: str) -> str:
    return prefix + "".join(part.capitalize() for part in member.split("_"))


def _table_text() -> str:
    return "\n".join(f"{cls.__name__}.{name}={value}" for cls, _, _ in _CPP for name, value in _members(cls))


#: crc32 of the table: the extension is built with it and compared with it at load
FINGERPRINT = zlib.crc32(_table_text().encode())


def cpp_header() -> str:
    """``csrc/common/protocol_table.h``: every enum above as C++ constants in namespace ep_comm."""
    lines = ["// Generated by setup.py from ep_comm/backends/protocol.py: edit that table, not this file.",
             "#pragma once", "", "#include <cstdint>", "", "namespace ep_comm {", ""]
    for cls, prefix, ctype in _CPP:
        lines.append(f"// {cls.__name__}: {(cls.__doc__ or '').strip().splitlines()[0]}")
        names = [(_cpp_name(prefix, name), value) for name, value in _members(cls)]
        if issubclass(cls, enum.Enum):
            lines.append(f"enum : {ctype} {{ " + ", ".join(f"{n} = {v}" for n, v in names) + " };")
        else:
            lines += [f"constexpr {ctype} {n} = {v};" for n, v in names]
    lines += ["", f"constexpr uint32_t kProtocolFingerprint = {FINGERPRINT}u;", "", "}  // namespace ep_comm", ""]
    return "\n".join(lines)


def describe_code(code: int) -> str:
    """'dispatch #12' for a flag code (the number is the communicator's kernel call number)."""
    if code == 0:
        return "nothing yet"
    op = code & 3
    return f"{Op(op).name.lower() if op in Op._value2member_map_ else f'op {op}'} #{code >> 2}"


def latest_code(*codes: int) -> int:
    """The code of the latest call among ``codes`` (0 = none), call numbers compared modulo their wrap
    as the kernels compare them."""
    wrap = 1 << Limit.SEQ_BITS
    best = 0
    for c in codes:
        c &= 0xFFFFFFFF
        if c and (not best or 0 < ((c >> 2) - (best >> 2)) % wrap < wrap // 2 - 1):
            best = c
    return best
