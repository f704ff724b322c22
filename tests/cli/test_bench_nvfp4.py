"""``ep-comm bench --quant nvfp4`` on CPU ranks: the collective backends are checked against the
dequantising oracle and timed, the kernel backends are skipped (no CUDA here), the wire bytes per token
are NVFP4's, a wrong backend is still caught, and impossible requests fail before any rank starts."""
from __future__ import annotations

import json

import pytest

from .conftest import CPU_RANKS, collective_backends

SHAPE = ["--hidden", "128", "--experts", "8", "--topk", "2"]


def test_bench_nvfp4_checks_and_times_the_collective_backends(cli, tmp_path):
    path = tmp_path / "r.json"
    proc = cli(["bench", "--nproc", "2", "--tokens", "8", *SHAPE, "--iters", "3", "--warmup", "1", "--sets", "2",
                "--quant", "nvfp4", "--json", str(path)], timeout=180, **CPU_RANKS)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "quant nvfp4" in proc.stdout
    assert "not fused" not in proc.stdout  # the kernel backends are skipped for want of CUDA, not of NVFP4
    doc = json.loads(path.read_text())
    assert not doc["failures"]
    results = doc["results"]
    assert {r["backend"] for r in results} == set(collective_backends())
    assert len(results) == len(collective_backends()) * 2 * 2  # backends x layouts x ops
    assert all(r["quant"] == "nvfp4" for r in results)


def test_bench_nvfp4_catches_a_wrong_backend(cli):
    proc = cli(["bench", "--nproc", "2", "--tokens", "8", *SHAPE, "--iters", "2", "--warmup", "0", "--sets", "1",
                "--backend", "ag_rs", "--layout", "standard", "--quant", "nvfp4", "--inject-fault"],
               timeout=180, **CPU_RANKS)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "FAILED oracle check: backend ag_rs, layout standard, tokens 8" in proc.stdout


@pytest.mark.parametrize("argv, message", [
    (["--quant", "nvfp4", "--hidden", "100"], "quant='nvfp4' needs hidden % 16 == 0"),
    (["--quant", "nvfp4", "--peer", "deepep"], "no NVFP4 here"),
])
def test_bench_nvfp4_argument_errors_exit_2_without_spawning(cli, argv, message):
    proc = cli(["bench", *argv], timeout=60)
    assert proc.returncode == 2
    assert message in proc.stderr


def test_wire_bytes_per_token():
    from ep_comm import EPConfig
    from ep_comm.cli.bench import _bytes_per_token

    cfg = EPConfig(num_experts=8, top_k=2, hidden=7168, max_tokens_per_rank=8, quant="nvfp4")
    assert _bytes_per_token(cfg, "dispatch") == 7168 // 2 + 7168 // 16  # 4032: 0.28 of bf16's 14336
    assert _bytes_per_token(cfg, "combine") == 7168 * 2
