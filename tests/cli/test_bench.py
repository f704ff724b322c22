"""``ep-comm bench`` on CPU ranks: table, docs/design.md §17 JSON, oracle gate, argument errors."""
from __future__ import annotations

import json

import pytest
import torch

from ep_comm.backends import NOT_BUILT, registered
from ep_comm.cli import format_table, resolve_backend_request, split_backends
from ep_comm.cli.bench import _remote_sends

SHAPE = ["--hidden", "128", "--experts", "8", "--topk", "2"]
RESULT_KEYS = {"backend": str, "op": str, "layout": str, "tokens": int, "hidden": int, "top_k": int, "experts": int,
               "dtype": str, "p50_us": float, "p90_us": float, "gbps": float, "baseline_nccl_us": float}


@pytest.fixture(scope="module")
def bench_run(cli, tmp_path_factory):
    out = tmp_path_factory.mktemp("bench")
    proc = cli(["bench", "--nproc", "2", "--tokens", "8", "16", *SHAPE, "--iters", "4", "--warmup", "1",
                "--sets", "2", "--json", str(out / "r.json"), "--plot", str(out / "r.png")], timeout=240)
    return proc, out


def test_bench_runs_and_prints_one_table(bench_run):
    proc, _ = bench_run
    assert proc.returncode == 0, proc.stdout + proc.stderr
    lines = proc.stdout.splitlines()
    headers = [ln for ln in lines if ln.startswith("backend") and "p50_us" in ln]
    assert len(headers) == 1, proc.stdout  # rank 0 prints, the other rank does not
    for col in ("p90_us", "GB/s", "SMs", "gloo_a2a_us", "ratio"):
        assert col in headers[0]
    rows = [ln.split() for ln in lines if ln.split()[:1] and ln.split()[0] in registered()]
    assert len(rows) == len(registered()) * 2 * 2 * 2  # backends x layouts x token counts x ops
    assert {r[2] for r in rows} == {"dispatch", "combine"}


def test_bench_json_matches_design_schema(bench_run):
    proc, out = bench_run
    assert proc.returncode == 0, proc.stderr
    doc = json.loads((out / "r.json").read_text())
    for key, typ in (("device", str), ("date", str), ("git_commit", str), ("world_size", int), ("results", list)):
        assert isinstance(doc[key], typ), key
    assert doc["world_size"] == 2
    assert len(doc["results"]) == len(registered()) * 8
    for r in doc["results"]:
        for key, typ in RESULT_KEYS.items():
            assert isinstance(r[key], typ), (key, r)
        assert "sms" in r and r["sms"] is None  # collective backends use no dedicated SMs
        assert r["op"] in ("dispatch", "combine") and r["layout"] in ("standard", "batched")
        assert r["tokens"] in (8, 16) and r["hidden"] == 128 and r["top_k"] == 2 and r["experts"] == 8
        assert r["dtype"] == "bf16"
        assert 0 < r["p50_us"] <= r["p90_us"]
        assert r["gbps"] > 0 and r["baseline_nccl_us"] > 0
        assert r["baseline_backend"] == "gloo"


def test_bench_plot_written_or_explained(bench_run):
    proc, out = bench_run
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        assert "matplotlib is not installed" in proc.stdout
        return
    png = out / "r.png"
    assert png.exists() and png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_bench_refuses_to_time_a_wrong_backend(cli):
    proc = cli(["bench", "--nproc", "2", "--tokens", "8", *SHAPE, "--iters", "2", "--warmup", "0",
                "--backend", "ag_rs", "--layout", "batched", "--inject-fault"], timeout=180)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "FAILED oracle check: backend ag_rs, layout batched, tokens 8" in proc.stdout
    assert "combine differs from oracle" in proc.stdout
    assert "dispatch " not in proc.stdout.split("FAILED")[-1]  # no timing row for the failed config


@pytest.mark.parametrize("argv, message", [
    (["--backend", "nosuch"], "unknown backend 'nosuch'"),
    (["--tokens", "0"], "--tokens must be >= 1"),
    (["--quant", "fp8", "--hidden", "100"], "hidden"),
])
def test_bench_argument_errors_exit_2_without_spawning(cli, argv, message):
    proc = cli(["bench", *argv], timeout=60)
    assert proc.returncode == 2
    assert message in proc.stderr


@pytest.mark.skipif(not NOT_BUILT, reason="every backend of the contract is built")
def test_bench_names_why_an_unbuilt_backend_is_missing(cli):
    name, why = next(iter(NOT_BUILT.items()))
    proc = cli(["bench", "--backend", name], timeout=60)
    assert proc.returncode == 2
    assert f"backend {name!r} is not available in this build" in proc.stderr


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU-only error")
def test_bench_graph_mode_needs_cuda(cli):
    proc = cli(["bench", "--mode", "graph"], timeout=60)
    assert proc.returncode == 2
    assert "needs CUDA" in proc.stderr


def test_remote_sends_counts_distinct_remote_ranks():
    # 4 experts over 2 ranks: experts 0,1 on rank 0, 2,3 on rank 1
    ids = torch.tensor([[0, 1], [2, 3], [0, 2], [-1, 3], [-1, -1], [1, 1]])
    assert _remote_sends(ids, rank=0, world=2, num_experts=4) == 3  # rows 1, 2, 3
    assert _remote_sends(ids, rank=1, world=2, num_experts=4) == 3  # rows 0, 2, 5
    assert _remote_sends(torch.empty(0, 2, dtype=torch.long), 0, 2, 4) == 0


def test_backend_list_parsing():
    assert split_backends(["naive,ag_rs", "auto", "naive"]) == ["naive", "ag_rs", "auto"]
    names, explicit, err = resolve_backend_request(["all"])
    assert names == list(registered()) and not explicit and err is None
    names, explicit, err = resolve_backend_request(["ag_rs"])
    assert names == ["ag_rs"] and explicit and err is None
    assert "unknown backend" in resolve_backend_request(["x"])[2]


def test_format_table_aligns_columns():
    text = format_table(["a", "num"], [["xx", 1], ["y", 22]], right=[1])
    assert text.splitlines() == ["a   num", "--  ---", "xx    1", "y    22"]
