"""The examples run with self-spawned CPU ranks and match their dense references."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest

from ep_comm.distributed.spawn import LAUNCHER_VARS

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.parametrize("script, ok_line", [
    ("moe_layer.py", "moe_layer example: OK"),
    ("standard_layout.py", "standard_layout example: OK"),
])
def test_example_self_spawn(script, ok_line):
    env = {k: v for k, v in os.environ.items() if k not in LAUNCHER_VARS}
    proc = subprocess.run([sys.executable, os.path.join(REPO, "examples", script), "--nproc", "2"], cwd=REPO,
                          env=env, capture_output=True, text=True, timeout=180)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert ok_line in proc.stdout
    assert proc.stdout.count("rank ") >= 2  # both ranks checked themselves
