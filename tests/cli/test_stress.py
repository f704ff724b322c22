"""``ep-comm stress``: passes on the built backends, and a corrupted combine fails it loudly."""
from __future__ import annotations

import argparse
import shutil
import subprocess
import sys

import pytest
import torch

from ep_comm.backends import registered
from ep_comm.cli.stress_cases import case_inputs as _case_inputs
from ep_comm.cli.stress_cases import plan
from ep_comm.config import EPConfig

from .conftest import REPO, clean_env, usable_backends


def test_stress_passes(cli):
    proc = cli(["stress", "--nproc", "2", "--iters", "12", "--seed", "3"], timeout=240)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "stress PASSED: 12 iteration(s)" in proc.stdout
    rows = [ln.split() for ln in proc.stdout.splitlines() if ln.split()[:1] and ln.split()[0] in registered()]
    assert len(rows) == len(usable_backends()) * 2
    assert all(r[-1] == "ok" for r in rows)


def test_injected_fault_exits_nonzero_and_prints_the_case(cli):
    proc = cli(["stress", "--nproc", "2", "--iters", "6", "--inject-fault"], timeout=240)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    out = proc.stdout
    assert out.count("MISMATCH in iteration 3 (seed 0)") == 1  # printed once, by rank 0
    assert "tokens per rank [" in out
    assert "rank 1, backend " in out and "combine differs from oracle" in out
    assert "replay: ep-comm stress --nproc 2 --seed 0 --start 3 --iters 1" in out
    assert "stress FAILED" in out


def test_fault_under_torchrun_fails_every_rank():
    if shutil.which("torchrun") is None and not _has_torchrun_module():
        pytest.skip("torchrun not available")
    proc = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "-m", "ep_comm", "stress",
         "--iters", "2", "--inject-fault", "--backend", "ag_rs", "--layout", "standard"],
        cwd=REPO, env=clean_env(), capture_output=True, text=True, timeout=240,
    )
    assert proc.returncode != 0
    assert proc.stdout.count("MISMATCH in iteration 1") == 1
    assert "(torchrun, cpu)" in proc.stdout or "(torchrun, cuda)" in proc.stdout


def _has_torchrun_module() -> bool:
    try:
        import torch.distributed.run  # noqa: F401
    except ImportError:
        return False
    return True


def _args(**kw) -> argparse.Namespace:
    base = dict(seed=0, max_tokens=32, inject_fault=False, start=0, iters=400)
    base.update(kw)
    return argparse.Namespace(**base)


def test_plan_is_deterministic_and_covers_the_edge_cases():
    args = _args()
    cases = [plan(args, i, 4, fp8_ok=True) for i in range(400)]
    assert cases == [plan(args, i, 4, fp8_ok=True) for i in range(400)]
    assert any(0 in c.tokens for c in cases) and any(c.tokens == [0, 0, 0, 0] for c in cases)
    assert {c.routing for c in cases} == {"uniform", "skewed"}
    assert {c.quant for c in cases} == {None, "fp8"}
    assert {c.payload for c in cases} == {"dtype", "uint8"}
    assert any(c.p_minus_one for c in cases) and any(c.p_duplicate for c in cases)
    assert all(c.quant is None for c in (plan(args, i, 4, fp8_ok=False) for i in range(50)))
    assert all(0 <= t <= 32 for c in cases for t in c.tokens)


def test_case_inputs_handle_zero_token_ranks_with_skewed_routing():
    cfg = EPConfig(num_experts=8, top_k=2, hidden=128, max_tokens_per_rank=8)
    case = plan(_args(), 0, 3, fp8_ok=False)
    case.routing, case.tokens, case.payload, case.scales_width = "skewed", [5, 0, 3], "uint8", 0
    case.p_minus_one = case.p_duplicate = 0.0
    inputs = _case_inputs(cfg, case)
    assert [i.x.shape[0] for i in inputs] == [5, 0, 3]
    assert inputs[1].x.dtype == torch.uint8 and inputs[1].x.shape == (0, 64)
    assert inputs[1].topk_ids.shape == (0, 2) and inputs[1].topk_ids.dtype == torch.int32
    hot = {int(i.topk_ids[0, 0]) for i in inputs if i.x.shape[0]}
    assert len(hot) == 1  # skewed: every token's first choice is the same expert


def test_a_long_iteration_says_so_in_a_log(capsys):
    """Off a terminal the progress prints a line whenever one iteration runs for heartbeat_s more
    seconds: a stuck run says where it is instead of going silent."""
    import time

    from ep_comm.cli.stress_report import Progress

    progress = Progress(10, enabled=True, heartbeat_s=0.05)
    try:
        time.sleep(0.3)
        progress.update(0)
    finally:
        progress.close()
    lines = [line for line in capsys.readouterr().err.splitlines() if "still running" in line]
    assert lines and lines[0].startswith("stress: iteration 1 of 10 still running after"), lines
    time.sleep(0.15)  # closed: no more lines
    assert "still running" not in capsys.readouterr().err


def test_an_sm_count_is_checked_and_carried_into_the_replay(cli):
    """``--num-sms`` goes into every communicator's config (0 is refused like ``EPConfig(num_sms=0)``) and
    into the replay command of a failing case, which must run the same kernels."""
    bad = cli(["stress", "--nproc", "2", "--iters", "1", "--num-sms", "0"], timeout=120)
    assert bad.returncode != 0 and "num_sms" in bad.stdout + bad.stderr, bad.stdout + bad.stderr
    proc = cli(["stress", "--nproc", "2", "--iters", "4", "--inject-fault", "--num-sms", "3", "--backend", "ag_rs",
                "--layout", "standard"], timeout=240)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    replays = [ln for ln in proc.stdout.splitlines() if "replay: ep-comm stress" in ln]
    assert replays and all(ln.rstrip().endswith("--num-sms 3 --inject-fault") for ln in replays), replays


def test_shared_gpus_take_the_mnnvl_backend_only(cli):
    """``--share-gpus`` (more ranks than GPUs, a gloo job) runs only mnnvl: other backends and ``--kill`` are
    refused before any rank starts, and without GPUs it says so."""
    for extra in (["--backend", "ag_rs"], ["--backend", "mnnvl", "nvshmem"], ["--kill"]):
        proc = cli(["stress", "--nproc", "2", "--iters", "1", "--share-gpus", *extra], timeout=120)
        assert proc.returncode == 2, proc.stdout + proc.stderr
        assert "--share-gpus runs the mnnvl backend only" in proc.stderr, proc.stderr
    if not torch.cuda.is_available():
        proc = cli(["stress", "--nproc", "2", "--iters", "1", "--share-gpus"], timeout=120)
        assert proc.returncode == 2 and "--share-gpus needs CUDA GPUs" in proc.stderr, proc.stdout + proc.stderr


@pytest.mark.gpu
def test_more_ranks_than_gpus_stress_mnnvl_with_shared_gpus(cli):
    """Twice as many ranks as GPUs (two on one GPU, four on two): every iteration checked against the
    oracle passes, and a failing case's replay command keeps ``--share-gpus``."""
    nproc = str(2 * torch.cuda.device_count())
    refused = cli(["stress", "--nproc", nproc, "--iters", "1", "--backend", "mnnvl"], timeout=120)
    assert refused.returncode == 2 and "exceeds the" in refused.stderr, refused.stdout + refused.stderr
    proc = cli(["stress", "--nproc", nproc, "--iters", "12", "--share-gpus"], timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert f"ep-comm stress: {nproc} ranks (spawn, cuda, GPUs shared)" in proc.stdout
    rows = [ln.split() for ln in proc.stdout.splitlines() if ln.split()[:1] == ["mnnvl"]]
    assert len(rows) == 2 and all(r[-1] == "ok" for r in rows), proc.stdout
    bad = cli(["stress", "--nproc", nproc, "--iters", "6", "--share-gpus", "--inject-fault"], timeout=300)
    assert bad.returncode == 1, bad.stdout + bad.stderr
    replays = [ln for ln in bad.stdout.splitlines() if "replay: ep-comm stress" in ln]
    assert replays and all(ln.rstrip().endswith("--share-gpus --inject-fault") for ln in replays), replays
