"""examples/vllm_adapter_overhead.py (the adapter's overhead over raw dispatch+combine) runs on CPU ranks,
prints its table and writes its JSON.  Over the vLLM stand-in (what the GPU machines run) even where vLLM
is installed: ranks that import the real vLLM take half a minute to start on two cores, and the adapter
over the real vLLM is tested in test_vllm.py."""
from __future__ import annotations

import json
import os
import subprocess
import sys

from ep_comm.distributed.spawn import LAUNCHER_VARS

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SCRIPT = os.path.join(REPO, "examples", "vllm_adapter_overhead.py")


def test_overhead_bench_on_cpu_ranks(tmp_path):
    env = {k: v for k, v in os.environ.items() if k not in LAUNCHER_VARS}
    env.update(CUDA_VISIBLE_DEVICES="", VLLM_LOGGING_LEVEL="WARNING",
               PYTHONPATH=os.pathsep.join(p for p in (REPO, env.get("PYTHONPATH")) if p))
    out = tmp_path / "overhead.json"
    proc = subprocess.run([sys.executable, SCRIPT, "--nproc", "2", "--warmup", "2", "--iters", "5", "--stand-in",
                           "--json", str(out)],
                          cwd=REPO, env=env, check=False, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    rows = [line for line in proc.stdout.splitlines() if line.startswith("| ") and " eager |" in line]
    assert sorted(r.split("|")[1].strip() + "/" + r.split("|")[2].strip() for r in rows) == [
        "ag_rs/batched", "ag_rs/standard", "naive/batched", "naive/standard"], proc.stdout
    report = json.loads(out.read_text())
    assert report["world_size"] == 2 and report["timer"] == "time.perf_counter"
    assert report["vllm"] == "vLLM stand-in (asked for)", report["vllm"]
    for row in report["rows"]:
        assert "skipped" not in row, row
        assert len(row["per_rank_us"]) == 2
        for path in ("raw dispatch+combine", "adapter prepare+finalize"):
            assert 0 < row["us"][path]["p50"] <= row["us"][path]["p90"]
