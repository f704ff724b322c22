"""The collective backends' fused batched-combine kernel (``ep_comm::collective_combine_partial``).

Against a float64 reference and the torch path of ``reduction.combine_partial`` on random inputs drawn
fresh every run (the seed is in every failure message), with NaN in every padding slot; under CUDA
graph capture; and end to end through naive / ag_rs against ``ep_comm.oracle``, eager and replayed.
Run on a GPU machine: ``pytest -m "gpu or multigpu" tests/backends/collective/test_combine_kernel.py``.
"""
import random

import pytest
import torch

import ep_comm
from ep_comm.backends.collective import kernels
from ep_comm.backends.collective.packing import GatherHandle
from ep_comm.backends.collective.reduction import combine_partial
from ep_comm.distributed.spawn import raise_on_failure, spawn_local

from .. import cases

pytestmark = [pytest.mark.gpu]

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def _fresh_seed() -> int:
    return random.SystemRandom().randrange(1 << 31)


@pytest.fixture(autouse=True)
def _kernel_built():
    # on a GPU machine the extension must be built: a missing kernel is a failure, not a skip
    why = kernels.combine_unavailable()
    assert why == "", f"fused collective combine kernel unavailable: {why}"


def _case(rows: int, k: int, slots: int, hidden: int, p_local: float, dtype: torch.dtype, seed: int,
          far_dest: bool = False):
    """``(expert_out [slots, hidden], handle, want float64 [rows, hidden])`` on the GPU.  Local pairs get
    distinct slots like select_local gives them; the others point at trash rows past ``slots`` (or,
    with ``far_dest``, anywhere past it); every slot no local pair names holds NaN."""
    g = torch.Generator().manual_seed(seed)
    expert_out = torch.randn(slots, hidden, generator=g).to(dtype)
    away = torch.rand(rows, k, generator=g) >= p_local
    n_local = int((~away).sum())
    if n_local > slots:  # not enough slots for distinct local pairs: keep the first ones
        keep = torch.cumsum((~away).reshape(-1).int(), 0).view(rows, k) <= slots
        away |= ~keep
        n_local = int((~away).sum())
    dest = torch.empty(rows, k, dtype=torch.int64)
    dest[~away] = torch.randperm(slots, generator=g)[:n_local]
    trash = slots + torch.arange(rows).view(-1, 1).expand(rows, k)
    if far_dest:
        trash = slots + torch.randint(0, 1 << 40, (rows, k), generator=g)
    dest[away] = trash[away]
    weights = torch.where(away, 0.0, torch.rand(rows, k, generator=g) + 0.05)
    used = torch.zeros(slots, dtype=torch.bool)
    used[dest[~away]] = True
    expert_out[~used] = float("nan")
    picked = expert_out.double()[torch.where(away, 0, dest)]  # [rows, k, hidden]
    want = torch.where(away.unsqueeze(2), 0.0, weights.double().unsqueeze(2) * picked).sum(1)
    handle = GatherHandle([rows], (~away).any(1).cuda(), dest.cuda(), weights.cuda())
    return expert_out.cuda(), handle, want


def _check(got: torch.Tensor, want: torch.Tensor, seed: int, what: str) -> None:
    assert torch.isfinite(got).all(), f"{what}: NaN/Inf leaked (seed {seed})"
    torch.testing.assert_close(got.double().cpu(), want, rtol=1e-5, atol=1e-5,
                               msg=lambda m: f"{what} (seed {seed}): {m}")


SHAPES = [  # rows, k, slots, hidden, p_local
    (256, 8, 2048, 7168, 0.5),  # DeepSeek-V3 width at EP2, 128 tok
    (64, 8, 512, 7168, 0.0),  # no local pair anywhere: zeros
    (64, 8, 512, 7168, 1.0),
    (33, 3, 200, 72, 0.4),  # a piece shorter than a warp's share
    (17, 5, 100, 100, 0.6),  # hidden % 8 != 0: the scalar kernel
    (9, 40, 400, 64, 0.3),  # k > 32: the pairs are read in two ballots
    (5, 1, 8, 8, 0.7),
]


@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_kernel_matches_reference_and_torch_path(shape, dtype):
    rows, k, slots, hidden, p_local = shape
    seed = _fresh_seed()
    eo, handle, want = _case(rows, k, slots, hidden, p_local, DTYPES[dtype], seed)
    got = torch.full((rows, hidden), float("nan"), device="cuda")  # every row must be overwritten
    combine_partial(eo, handle, got, fused=True)
    _check(got, want, seed, "kernel")
    ref = torch.empty(rows, hidden, device="cuda")
    combine_partial(eo, handle, ref, fused=False)
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5, msg=lambda m: f"kernel vs torch path (seed {seed}): {m}")


def test_far_out_of_range_slots_are_never_read():
    seed = _fresh_seed()
    eo, handle, want = _case(48, 8, 256, 512, 0.5, torch.bfloat16, seed, far_dest=True)
    got = torch.empty(48, 512, device="cuda")
    combine_partial(eo, handle, got, fused=True)
    torch.cuda.synchronize()
    _check(got, want, seed, "far slots")


def test_strided_reduction_view_keeps_header_rows():
    seed = _fresh_seed()
    world, n, hidden = 2, 40, 7168
    eo, handle, want = _case(world * n, 8, 640, hidden, 0.5, torch.bfloat16, seed)
    buf = torch.full((world, n + 1, hidden), 7.0, device="cuda")  # the reduce buffer: header row per chunk
    combine_partial(eo.view(4, 160, hidden), handle, buf[:, :n], fused=True)
    _check(buf[:, :n].reshape(world * n, hidden), want, seed, "strided view")
    assert bool((buf[:, n] == 7.0).all()), "the header rows between the chunks were written"


def test_misaligned_rows_take_the_scalar_kernel():
    seed = _fresh_seed()
    eo, handle, want = _case(20, 4, 64, 256, 0.5, torch.bfloat16, seed)
    shifted = torch.empty(eo.numel() + 1, dtype=eo.dtype, device="cuda")[1:].view_as(eo)  # 2-byte offset
    shifted.copy_(eo)
    out_store = torch.empty(20 * 256 + 1, device="cuda")
    out = out_store[1:].view(20, 256)  # 4-byte offset: no 16-byte stores possible
    combine_partial(shifted, handle, out, fused=True)
    _check(out, want, seed, "misaligned")


def test_no_rows():
    eo, handle, _ = _case(0, 4, 16, 64, 0.5, torch.bfloat16, 1)
    out = torch.empty(0, 64, device="cuda")
    combine_partial(eo, handle, out, fused=True)
    assert out.shape == (0, 64)


def test_bad_arguments_raise_a_typed_error():
    eo, handle, _ = _case(8, 4, 64, 64, 0.5, torch.bfloat16, 2)
    bad = GatherHandle(handle.rows, handle.row_valid, handle.dest.int(), handle.local_weights)
    with pytest.raises(ep_comm.EPError, match="collective combine kernel cannot run: dest must be int64"):
        combine_partial(eo, bad, torch.empty(8, 64, device="cuda"), fused=True)
    with pytest.raises(ep_comm.EPError, match="collective combine kernel cannot run: out has width 63"):
        combine_partial(eo, handle, torch.empty(8, 63, device="cuda"), fused=True)


def test_graph_capture_replays_new_data():
    rows, k, slots, hidden = 128, 8, 1024, 7168
    seed = _fresh_seed()
    eo, handle, _ = _case(rows, k, slots, hidden, 0.5, torch.bfloat16, seed)
    s_eo, s_dest, s_w = eo.clone(), handle.dest.clone(), handle.local_weights.clone()
    s_handle = GatherHandle([rows], handle.row_valid, s_dest, s_w)
    out = torch.empty(rows, hidden, device="cuda")
    combine_partial(s_eo, s_handle, out, fused=True)  # warm-up outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        combine_partial(s_eo, s_handle, out, fused=True)
    for rep in range(3):
        seed_r = _fresh_seed()
        eo_r, h_r, want = _case(rows, k, slots, hidden, 0.3 + 0.2 * rep, torch.bfloat16, seed_r)
        s_eo.copy_(eo_r), s_dest.copy_(h_r.dest), s_w.copy_(h_r.local_weights)
        graph.replay()
        torch.cuda.synchronize()
        _check(out, want, seed_r, f"replay {rep}")


def test_torch_compile_traces_the_op():
    seed = _fresh_seed()
    eo, handle, want = _case(32, 8, 256, 512, 0.5, torch.bfloat16, seed)

    def partial(eo, dest, w):
        out = torch.empty(dest.shape[0], eo.shape[1], device=eo.device)
        torch.ops.ep_comm.collective_combine_partial(eo, dest, w, out)
        return out * 1.0

    got = torch.compile(partial, fullgraph=True, backend="aot_eager")(eo, handle.dest, handle.local_weights)
    _check(got, want, seed, "compiled")


# -- end to end: naive / ag_rs batched, one rank per GPU (one rank on a one-GPU machine) ---------------------
def _e2e_world() -> int:
    n = torch.cuda.device_count() if torch.cuda.is_available() else 0
    return min(n, 4) if n >= 2 else 1


def e2e_worker(seed: int) -> dict:
    topo = ep_comm.init_distributed()
    world, rank = topo.world_size, topo.rank
    results: dict[str, list[str]] = {}
    if kernels.combine_unavailable():
        return {"kernel": [kernels.combine_unavailable()]}
    for backend in ("naive", "ag_rs"):
        cfg = cases.make_cfg(world, backend, "batched", None, max_tokens=24, hidden=7168, num_experts=8 * world)
        with ep_comm.Communicator(cfg) as comm:
            for name, spec in cases.scenarios(world, cfg.max_tokens_per_rank).items():
                seed += 1
                key = f"{backend}/eager/{name}"
                results[key] = [f"seed {seed}: {p}" for p in
                                cases.run_case(comm, cfg, world, rank, seed, "bf16+scales", spec)]
    # under CUDA graphs at the DeepSeek width: the shared graph test of cases, fresh seeds
    for backend in ("naive", "ag_rs"):
        graph = cases.graph_capture((backend,), ("batched",), seed=seed + 100, hidden=7168, num_experts=8 * world,
                                    max_tokens=24)
        results[f"{backend}/graph"] = [f"{key}: {p}" for key, problems in graph.items() for p in problems]
    return results


_e2e: dict = {}


@pytest.mark.parametrize("case", [f"{b}/{m}" for b in ("naive", "ag_rs") for m in
                                  ["graph"] + [f"eager/{s}" for s in cases.scenarios(2, 24)]])
def test_end_to_end_matches_oracle(case):
    if not _e2e:
        seed = _fresh_seed()
        _e2e.update(cases.merge_ranks(raise_on_failure(spawn_local(e2e_worker, _e2e_world(), args=(seed,),
                                                                   timeout_s=600))))
    assert "kernel" not in _e2e, _e2e.get("kernel")
    assert case in _e2e
    assert _e2e[case] == [], "\n".join(_e2e[case])
