"""The CUDA sources compile wherever nvcc is found, also on a machine with no GPU and a CPU build of torch
(CI's): every kernel file of ``csrc/`` to sm_90 machine code, as the GPU build compiles it (the kernels
use no torch header; the NVSHMEM variant needs NVSHMEM's headers and is left to the GPU build), and
every microbenchmark of ``bench/microbench/``.  So a change that breaks a kernel or a microbenchmark
fails where no GPU is.  Skipped without nvcc, and where this install built the kernels itself
(``ep_comm._C`` imports: that build compiled them)."""
from __future__ import annotations

import concurrent.futures
import importlib.util
import os
import shutil
import subprocess
from pathlib import Path

import pytest

from ep_comm.backends import protocol

ROOT = Path(__file__).resolve().parent.parent
KERNELS = sorted(str(p.relative_to(ROOT)) for p in (ROOT / "csrc").rglob("*.cu"))
MICROBENCHMARKS = sorted(str(p.relative_to(ROOT)) for p in (ROOT / "bench" / "microbench").glob("*.cu"))
NVCC = shutil.which("nvcc")  # as setup.py finds it


def _why_skip() -> str | None:
    if NVCC is None:
        return "nvcc not found"
    if importlib.util.find_spec("ep_comm._C") is not None:
        return "this install built the kernels (ep_comm._C): that build compiled them"
    return None


pytestmark = pytest.mark.skipif(_why_skip() is not None, reason=_why_skip() or "")


@pytest.fixture(scope="module")
def compiled(tmp_path_factory):
    """Every source compiled at once, as many at a time as there are cores: {source: (returncode, output)}.

    csrc/ is copied with its generated ``common/protocol_table.h`` (what setup.py writes before building),
    so that the checkout is left as it was."""
    work = tmp_path_factory.mktemp("csrc_compiles")
    csrc = work / "csrc"
    shutil.copytree(ROOT / "csrc", csrc)
    (csrc / "common" / "protocol_table.h").write_text(protocol.cpp_header())

    def compile_one(src: str) -> tuple[int, str]:
        out = work / (src.replace("/", "_") + ".cubin")
        # a kernel file from the copy (its quoted includes resolve next to it), a microbenchmark from the
        # checkout (its check.cuh is beside it) against the copy's headers
        path = csrc / Path(src).relative_to("csrc") if src.startswith("csrc/") else ROOT / src
        cmd = [NVCC, "-std=c++17", "-O3", "-arch=sm_90", "-cubin", f"-I{csrc}", str(path), "-o", str(out)]
        run = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
        return run.returncode, f"{' '.join(cmd)}\n{run.stdout}{run.stderr}"

    with concurrent.futures.ThreadPoolExecutor(max_workers=os.cpu_count() or 2) as pool:
        futures = {src: pool.submit(compile_one, src) for src in KERNELS + MICROBENCHMARKS}
        return {src: f.result() for src, f in futures.items()}


def test_there_are_sources_to_compile():
    assert "csrc/one_sided/dispatch.cu" in KERNELS and "csrc/one_sided/combine.cu" in KERNELS
    assert "bench/microbench/quant_arith.cu" in MICROBENCHMARKS


@pytest.mark.parametrize("src", KERNELS + MICROBENCHMARKS)
def test_compiles_for_sm90(compiled, src):
    returncode, output = compiled[src]
    assert returncode == 0, output
