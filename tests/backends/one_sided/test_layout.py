"""The one-sided buffer layout and config vector, the protocol table's invariants, and the family's refusal
on CPUs."""
from __future__ import annotations

import pytest
import torch

import ep_comm
from ep_comm.backends import extension
from ep_comm.backends.one_sided import layout as lay_mod
from ep_comm.backends.protocol import Cfg, Limit, Phase, Reason, Stamp, Status, Trace, describe_code, latest_code
from ep_comm.distributed.spawn import raise_on_failure, spawn_local


def test_zero_copy_reaches_the_kernels_for_the_standard_layout():
    cfg = ep_comm.EPConfig(num_experts=8, top_k=2, hidden=64, max_tokens_per_rank=16)
    lay = lay_mod.BufferLayout.for_config(cfg, 2)
    assert lay_mod.config_vector(cfg, 0, 2, lay, 24, 0)[Cfg.ZERO_COPY] == 0
    assert lay_mod.config_vector(cfg.replace(zero_copy=True), 0, 2, lay, 24, 0)[Cfg.ZERO_COPY] == 1


def test_zero_copy_combines_pull_at_prefill_sizes_over_stores_only():
    def pulls(max_tokens=4096, hidden=7168, zero_copy=True, put=False, forced=None, dtype=torch.bfloat16):
        cfg = ep_comm.EPConfig(num_experts=16, top_k=4, hidden=hidden, max_tokens_per_rank=max_tokens,
                               dtype=dtype, zero_copy=zero_copy)
        return lay_mod.BufferLayout.for_config(cfg, 2, put_mode=put, pull_env=forced).combine_pull

    assert pulls() and pulls(max_tokens=lay_mod.PULL_MIN_TOKENS)
    assert not pulls(max_tokens=lay_mod.PULL_MIN_TOKENS - 1) and pulls(max_tokens=16, forced="1")
    assert not pulls(forced="0") and not pulls(zero_copy=False) and not pulls(zero_copy=False, forced="1")
    assert not pulls(put=True) and not pulls(put=True, forced="1")  # NVSHMEM puts: partials are pushed
    assert not pulls(hidden=7172, forced="1")  # rows padded to 16 bytes: no contiguous [N, hidden] view
    assert pulls(hidden=7172, dtype=torch.float32, forced="1")
    with pytest.raises(ValueError):
        pulls(forced="yes")


def test_combine_grouping_by_size_and_layout():
    cfg = ep_comm.EPConfig(num_experts=8, top_k=2, hidden=64, max_tokens_per_rank=lay_mod.GROUPED_MIN_TOKENS)
    lay = lay_mod.BufferLayout.for_config(cfg, 4)
    assert lay_mod.config_vector(cfg, 0, 4, lay, 24, 0)[Cfg.COMBINE_GROUPED] == 1  # interleaved
    assert lay_mod.config_vector(cfg, 0, 2, lay, 24, 0)[Cfg.COMBINE_GROUPED] == 0  # pushed at EP2
    assert lay_mod.config_vector(cfg, 0, 1, lay, 24, 0)[Cfg.COMBINE_GROUPED] == 0  # no peers, nothing to group
    small = cfg.replace(max_tokens_per_rank=lay_mod.GROUPED_MIN_TOKENS - 1)
    assert lay_mod.config_vector(small, 0, 4, lay, 24, 0)[Cfg.COMBINE_GROUPED] == 0
    batched = cfg.replace(layout="batched")  # measured slower grouped: by size, standard only
    assert lay_mod.config_vector(batched, 0, 4, lay, 24, 0)[Cfg.COMBINE_GROUPED] == 0


def test_combine_grouped_mode_from_the_environment():
    assert lay_mod.combine_grouped_mode(None, "split", 24) == 9 and lay_mod.combine_grouped_mode("", "0", 24) == 0
    assert lay_mod.combine_grouped_mode(None, "split", 2) == 1  # too few blocks to split: interleaved
    assert lay_mod.combine_grouped_mode("0", "split", 24) == 0 and lay_mod.combine_grouped_mode("1", "0", 24) == 1
    assert lay_mod.combine_grouped_mode("split", "0", 24) == 9  # 8 sending blocks, 16 summing
    assert lay_mod.combine_grouped_mode("split:8", "0", 24) == 9
    assert lay_mod.combine_grouped_mode("split", "0", 1) == 1  # one block: interleaved
    assert lay_mod.combine_grouped_mode("split:24", "0", 24) == 1  # no block left to sum
    with pytest.raises(ValueError, match="EP_COMM_COMBINE_GROUPED"):
        lay_mod.combine_grouped_mode("yes", "0", 24)
    std = ep_comm.EPConfig(num_experts=64, top_k=2, hidden=64, max_tokens_per_rank=lay_mod.GROUPED_MIN_TOKENS)
    assert lay_mod.default_combine_grouping(std, 2) == "0"  # pushed is faster at EP2 (docs/performance.md)
    assert lay_mod.default_combine_grouping(std, 4) == "1" and lay_mod.default_combine_grouping(std, 8) == "1"
    assert lay_mod.default_combine_grouping(std, 1) == "0"
    assert lay_mod.default_combine_grouping(std.replace(layout="batched"), 2) == "0"
    assert lay_mod.default_combine_grouping(std.replace(max_tokens_per_rank=lay_mod.GROUPED_MIN_TOKENS - 1), 4) == "0"


def test_the_table_keeps_its_own_invariants():
    """What the kernels assume of the shared numbers."""
    assert Stamp.SOURCE0 + 2 * Trace.SOURCES <= Stamp.END < Stamp.ROWS_BY_SENT < Stamp.WAITED_BY_SENT < Trace.SLOTS
    assert Phase.CHECKED & Phase.BOTH == 0 and Phase.SEND | Phase.RECEIVE == Phase.BOTH
    assert Status.EXPECTED_CODE < Status.RANK_REASON
    assert all(bin(r).count("1") == 1 for r in Reason)  # bits of one word
    assert Limit.THREADS % 32 == 0 and Limit.ROW_HEADER_BYTES % 16 == 0


@pytest.mark.parametrize("world,layout,dtype,zero_copy", [
    (2, "standard", torch.bfloat16, False), (8, "batched", torch.float32, False), (3, "batched", torch.float16, False),
    (4, "standard", torch.bfloat16, True)])
def test_buffer_layout_regions_are_aligned_and_disjoint(world, layout, dtype, zero_copy):
    cfg = ep_comm.EPConfig(num_experts=12 * world, top_k=6, hidden=7168, max_tokens_per_rank=37, dtype=dtype,
                           layout=layout, zero_copy=zero_copy)
    lay = lay_mod.BufferLayout.for_config(cfg, world)
    spans = [(lay.flags_offset, 4 * world * 8),  # call flags, then input verdicts
              (lay.group_flags_offset, 2 * world * lay.max_groups * 8)]
    assert lay.max_groups == -(-37 // Limit.GROUP_TOKENS)
    dispatch = world * 37 * lay.row_stride
    if zero_copy:  # one dispatch region: every call's rows stay in half 0
        assert lay.dispatch_offset[0] == lay.dispatch_offset[1]
        assert lay.nbytes == lay_mod.BufferLayout.for_config(cfg.replace(zero_copy=False), world).nbytes - dispatch
        # a pulling combine keeps its expert rows in combine region 0 and needs no region 1
        pulled = lay_mod.BufferLayout.for_config(cfg, world, pull_env="1")
        assert pulled.combine_pull and not lay.combine_pull
        assert pulled.combine_offset == (lay.combine_offset[0],) * 2
        assert pulled.nbytes == lay.nbytes - world * 37 * lay.combine_stride
    for p in (0, 1):
        spans.append((lay.counts_offset[p], world * 12 * 4))
        if p == 0 or not zero_copy:
            spans.append((lay.dispatch_offset[p], dispatch))
        spans.append((lay.combine_offset[p], world * 37 * lay.combine_stride))
    spans.sort()
    for (a, na), (b, _) in zip(spans, spans[1:]):
        assert a + na <= b
    assert spans[-1][0] + spans[-1][1] == lay.nbytes
    assert all(off % 16 == 0 for off, _ in spans)
    assert lay.row_stride % 16 == 0 and lay.combine_stride % 16 == 0 and lay.meta_bytes % 16 == 0
    assert lay.meta_bytes >= Limit.ROW_HEADER_BYTES + 12 * cfg.top_k
    assert lay.scale_offset >= lay.meta_bytes + lay.payload_max
    assert lay.scale_max >= 4 * (7168 // 128)  # fp8 scales fit
    vec = lay_mod.config_vector(cfg, 1, world, lay, 24, 0)
    assert len(vec) == Cfg.LEN and vec[Cfg.NUM_LOCAL] == 12 and vec[Cfg.BATCHED] == (layout == "batched")


def test_flag_codes_round_trip():
    assert describe_code((5 << 2) | 1) == "dispatch #5"
    assert describe_code((7 << 2) | 2) == "combine #7"
    assert describe_code(0) == "nothing yet"


def test_latest_code_picks_the_later_call_across_the_seq_wrap():
    d5, c6 = (5 << 2) | 1, (6 << 2) | 2
    assert latest_code(0, 0) == 0
    assert latest_code(d5, 0, c6) == c6 and latest_code(c6, d5) == c6
    wrapped = (0 << 2) | 1  # seq 2**30 wraps to 0: still after seq 2**30 - 1
    assert latest_code(((1 << 30) - 1) << 2 | 2, wrapped) == wrapped
    assert latest_code((1 << 32) | d5) == d5  # the token count in the high word is not part of it


def _cpu_mnnvl_worker() -> tuple[str, str]:
    ep_comm.init_distributed()
    cfg = ep_comm.EPConfig(num_experts=4, top_k=2, hidden=64, max_tokens_per_rank=4, backend="mnnvl")
    try:
        ep_comm.Communicator(cfg)
        return "created", ""
    except ep_comm.EPTopologyError as exc:
        auto = ep_comm.Communicator(cfg.replace(backend="auto"))
        name = auto.backend
        auto.close()
        return str(exc), name


def test_mnnvl_on_cpu_says_why_and_auto_falls_back():
    # a pure-Python install says the kernels are not built; a CUDA build on a CPU group needs CUDA tensors
    why = "needs CUDA" if extension.built() else "kernels are not built"
    # the ranks see no GPU, so that on a GPU machine they form the CPU group this test is about
    cpu_only = spawn_local(_cpu_mnnvl_worker, 2, timeout_s=120, extra_env=lambda rank: {"CUDA_VISIBLE_DEVICES": ""})
    for msg, auto in raise_on_failure(cpu_only):
        assert "mnnvl" in msg and why in msg, msg
        assert msg.count(why) == 1 and "rank" not in msg.split(why)[0], msg  # shared by every rank: said once
        assert auto == "ag_rs"


def test_put_mode_layout_adds_disjoint_staging_and_turns_grouping_off(monkeypatch):
    """nvshmem put mode: staging copies of the rows, partials and counts after the regular regions."""
    world, max_t = 4, 600  # above the grouped-combine threshold
    cfg = ep_comm.EPConfig(num_experts=8 * world, top_k=4, hidden=256, max_tokens_per_rank=max_t)
    plain = lay_mod.BufferLayout.for_config(cfg, world)
    put = lay_mod.BufferLayout.for_config(cfg, world, put_mode=True)
    assert not plain.put_mode and put.put_mode
    assert (plain.stage_offset, plain.stage_combine_offset, plain.stage_counts_offset) == (0, 0, 0)
    dispatch, combine = world * max_t * put.row_stride, world * max_t * put.combine_stride
    assert put.stage_offset == plain.nbytes  # the regular regions are unchanged
    assert put.stage_combine_offset == put.stage_offset + dispatch
    assert put.stage_counts_offset == put.stage_combine_offset + combine
    assert put.stage_counts_offset + world * 8 * 4 <= put.nbytes
    assert all(o % 16 == 0 for o in (put.stage_offset, put.stage_combine_offset, put.stage_counts_offset))
    monkeypatch.setenv(lay_mod.COMBINE_GROUPED_ENV, "1")
    vec = lay_mod.config_vector(cfg, 0, world, put, 24, 0)
    assert vec[Cfg.PUT_MODE] == 1 and vec[Cfg.COMBINE_GROUPED] == 0  # signals once per call in put mode
    assert (vec[Cfg.STAGE_OFFSET], vec[Cfg.STAGE_COMBINE_OFFSET], vec[Cfg.STAGE_COUNTS_OFFSET]) == (
        put.stage_offset, put.stage_combine_offset, put.stage_counts_offset)
    vec = lay_mod.config_vector(cfg, 0, world, plain, 24, 0)
    assert vec[Cfg.PUT_MODE] == 0 and vec[Cfg.COMBINE_GROUPED] == 1


def test_a_malformed_pull_switch_is_a_config_error(monkeypatch):
    cfg = ep_comm.EPConfig(num_experts=16, top_k=4, hidden=256, max_tokens_per_rank=1024, zero_copy=True)
    assert lay_mod.backend_layout(cfg, 2).combine_pull
    monkeypatch.setenv(lay_mod.COMBINE_PULL_ENV, "0")
    assert not lay_mod.backend_layout(cfg, 2).combine_pull
    monkeypatch.setenv(lay_mod.COMBINE_PULL_ENV, "yes")
    with pytest.raises(ep_comm.EPConfigError, match=r"\$EP_COMM_COMBINE_PULL='yes'"):
        lay_mod.backend_layout(cfg, 2)


def test_receiving_while_sending_is_on_unless_switched_off(monkeypatch):
    cfg = ep_comm.EPConfig(num_experts=8, top_k=2, hidden=64, max_tokens_per_rank=1024)
    lay = lay_mod.BufferLayout.for_config(cfg, 2)
    assert lay_mod.config_vector(cfg, 0, 2, lay, 24, 0)[Cfg.RECEIVE_WARPS] == lay_mod.RECEIVE_WARPS_ONE_PEER
    monkeypatch.setenv(lay_mod.RECEIVE_WHILE_SENDING_ENV, "0")
    assert lay_mod.config_vector(cfg, 0, 2, lay, 24, 0)[Cfg.RECEIVE_WARPS] == 0
    monkeypatch.setenv(lay_mod.RECEIVE_WARPS_ENV, "6")  # a count does not switch it back on
    assert lay_mod.config_vector(cfg, 0, 2, lay, 24, 0)[Cfg.RECEIVE_WARPS] == 0
    monkeypatch.setenv(lay_mod.RECEIVE_WHILE_SENDING_ENV, "1")
    assert lay_mod.config_vector(cfg, 0, 2, lay, 24, 0)[Cfg.RECEIVE_WARPS] == 6
    lay_mod.check_environment()
    monkeypatch.setenv(lay_mod.RECEIVE_WHILE_SENDING_ENV, "yes")
    with pytest.raises(ep_comm.EPConfigError, match=r"\$EP_COMM_RECEIVE_WHILE_SENDING='yes'"):
        lay_mod.check_environment()


def test_the_receiving_warps_follow_the_world_size_and_the_quantisation():
    """Half the warps from EP4 on (the link bounds the sends), 5 at EP2 (the SMs do); fp8 only from EP4
    on, the batched layout unquantised from EP4 on, NVFP4 never, a single rank never: the config's
    defaults, whatever the extension then allows."""
    bf16 = ep_comm.EPConfig(num_experts=64, top_k=8, hidden=128, max_tokens_per_rank=4096)
    fp8, nvfp4 = bf16.replace(quant="fp8"), bf16.replace(quant="nvfp4")
    warps = Limit.THREADS // 32
    assert 0 < lay_mod.RECEIVE_WARPS_ONE_PEER < lay_mod.RECEIVE_WARPS_MANY_PEERS < warps  # some warps send
    assert lay_mod.receive_warps(bf16, 1) == 0
    assert lay_mod.receive_warps(bf16, 2) == lay_mod.RECEIVE_WARPS_ONE_PEER
    assert [lay_mod.receive_warps(bf16, w) for w in (3, 4, 8, 64)] == [lay_mod.RECEIVE_WARPS_MANY_PEERS] * 4
    assert lay_mod.receive_warps(fp8, 2) == 0
    assert lay_mod.receive_warps(fp8, 4) == lay_mod.RECEIVE_WARPS_MANY_PEERS
    assert lay_mod.receive_warps(nvfp4, 2) == lay_mod.receive_warps(nvfp4, 8) == 0
    batched = bf16.replace(layout="batched")  # unquantised from EP4 on
    assert lay_mod.receive_warps(batched, 2) == 0
    assert [lay_mod.receive_warps(batched, w) for w in (3, 4, 8)] == [lay_mod.RECEIVE_WARPS_MANY_PEERS] * 3
    assert lay_mod.receive_warps(batched.replace(quant="fp8"), 4) == 0


@pytest.mark.parametrize("value", ["0", "16", "-1", "half"])
def test_a_malformed_receiving_warp_count_is_a_config_error(monkeypatch, value):
    cfg = ep_comm.EPConfig(num_experts=8, top_k=2, hidden=64, max_tokens_per_rank=1024)
    monkeypatch.setenv(lay_mod.RECEIVE_WARPS_ENV, value)
    with pytest.raises(ep_comm.EPConfigError, match=r"\$EP_COMM_RECEIVE_WARPS="):
        lay_mod.check_environment()
    with pytest.raises(ep_comm.EPConfigError, match=r"\$EP_COMM_RECEIVE_WARPS="):
        lay_mod.receive_warps(cfg, 2)


def test_a_receiving_warp_count_reaches_fp8_and_batched_at_ep2_and_leaves_nvfp4_alone(monkeypatch):
    monkeypatch.setenv(lay_mod.RECEIVE_WARPS_ENV, "15")
    cfg = ep_comm.EPConfig(num_experts=8, top_k=2, hidden=128, max_tokens_per_rank=1024)
    assert lay_mod.receive_warps(cfg.replace(quant="fp8"), 2) == 15
    assert lay_mod.receive_warps(cfg.replace(layout="batched"), 2) == 15
    assert lay_mod.receive_warps(cfg.replace(layout="batched", quant="fp8"), 4) == 15
    assert lay_mod.receive_warps(cfg.replace(quant="nvfp4"), 2) == 0
    lay_mod.check_environment()


def test_the_interleaved_grouped_combine_sums_on_warps_of_its_own(monkeypatch):
    """Interleaved (mode 1): SUM_WARPS of each block's warps sum, the rest send; $EP_COMM_COMBINE_SUM_WARPS
    sets the count, 0 the in-turn form; every other mode (off, split) carries 0."""
    cfg = ep_comm.EPConfig(num_experts=16, top_k=4, hidden=128, max_tokens_per_rank=lay_mod.GROUPED_MIN_TOKENS)
    lay = lay_mod.BufferLayout.for_config(cfg, 4)
    assert 0 < lay_mod.SUM_WARPS < Limit.THREADS // 32  # some warps send
    vec = lay_mod.config_vector(cfg, 0, 4, lay, 24, 0)
    assert (vec[Cfg.COMBINE_GROUPED], vec[Cfg.COMBINE_SUM_WARPS]) == (1, lay_mod.SUM_WARPS)
    assert lay_mod.config_vector(cfg, 0, 2, lay_mod.BufferLayout.for_config(cfg, 2), 24, 0)[Cfg.COMBINE_SUM_WARPS] == 0
    assert lay_mod.combine_sum_warps(0) == lay_mod.combine_sum_warps(4) == 0
    for value, want in (("0", 0), ("15", 15), ("3", 3)):
        monkeypatch.setenv(lay_mod.SUM_WARPS_ENV, value)
        lay_mod.check_environment()
        assert lay_mod.config_vector(cfg, 0, 4, lay, 24, 0)[Cfg.COMBINE_SUM_WARPS] == want
        assert lay_mod.combine_sum_warps(5) == 0  # split: blocks, not warps, divide the work
    monkeypatch.setenv(lay_mod.COMBINE_GROUPED_ENV, "0")
    assert lay_mod.config_vector(cfg, 0, 4, lay, 24, 0)[Cfg.COMBINE_SUM_WARPS] == 0


@pytest.mark.parametrize("value", ["16", "-1", "eight"])
def test_a_malformed_summing_warp_count_is_a_config_error(monkeypatch, value):
    monkeypatch.setenv(lay_mod.SUM_WARPS_ENV, value)
    with pytest.raises(ep_comm.EPConfigError, match=r"\$EP_COMM_COMBINE_SUM_WARPS="):
        lay_mod.check_environment()
    with pytest.raises(ep_comm.EPConfigError, match=r"\$EP_COMM_COMBINE_SUM_WARPS="):
        lay_mod.combine_sum_warps(1)


@pytest.mark.parametrize("value", ["0", "-3", "many"])
def test_a_malformed_sm_count_is_a_config_error_before_any_backend_starts(monkeypatch, value):
    monkeypatch.setenv(lay_mod.NUM_SMS_ENV, value)
    with pytest.raises(ep_comm.EPConfigError, match=rf"\$EP_COMM_NUM_SMS='{value}'"):
        lay_mod.check_environment()
    monkeypatch.setenv(lay_mod.NUM_SMS_ENV, "24")
    lay_mod.check_environment()
