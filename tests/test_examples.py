"""The examples run with self-spawned CPU ranks and match their dense references."""
from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest

from ep_comm.distributed.spawn import LAUNCHER_VARS

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.parametrize("script, ok_line, extra", [
    ("moe_layer.py", "moe_layer example: OK", []),
    ("standard_layout.py", "standard_layout example: OK", []),
    ("standard_layout.py", "standard_layout example: OK", ["--zero-copy", "--tokens", "600"]),
])
def test_example_self_spawn(script, ok_line, extra):
    env = {k: v for k, v in os.environ.items() if k not in LAUNCHER_VARS}
    proc = subprocess.run([sys.executable, os.path.join(REPO, "examples", script), "--nproc", "2", *extra], cwd=REPO,
                          env=env, capture_output=True, text=True, timeout=180)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert ok_line in proc.stdout
    assert proc.stdout.count("rank ") >= 2  # both ranks checked themselves


@pytest.mark.parametrize("script", ["moe_layer.py", "standard_layout.py"])
def test_example_under_torchrun(script):
    """The README's launch line, `torchrun --nproc-per-node 2 examples/<script>`, on CPU ranks: every
    rank prints its own check and the run exits 0."""
    env = {k: v for k, v in os.environ.items() if k not in LAUNCHER_VARS}
    env.update(CUDA_VISIBLE_DEVICES="", PYTHONPATH=os.pathsep.join(p for p in (REPO, env.get("PYTHONPATH")) if p))
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
                           os.path.join(REPO, "examples", script)], cwd=REPO, env=env, capture_output=True,
                          text=True, timeout=180)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    # both ranks reported (their lines may interleave in the shared pipe)
    assert sorted(re.findall(r"rank ([01])/2", proc.stdout)) == ["0", "1"], proc.stdout + proc.stderr
    assert "MISMATCH" not in proc.stdout
