"""A real mpiexec launch: init_distributed under MPI without MASTER_ADDR (address broadcast by mpi4py)."""
import os
import shutil
import subprocess
import sys
import textwrap

import pytest

SCRIPT = textwrap.dedent("""
    import os, torch, ep_comm
    from ep_comm import oracle
    topo = ep_comm.init_distributed(timeout_s=60)
    cfg = ep_comm.EPConfig(num_experts=4 * topo.world_size, top_k=2, hidden=128, max_tokens_per_rank=4,
                           backend="ag_rs", timeout_s=60)
    inputs = oracle.random_inputs(cfg, topo.world_size, seed=4)
    with ep_comm.Communicator(cfg) as comm:
        mine = inputs[topo.rank]
        d = comm.dispatch(mine.x, mine.topk_ids, mine.topk_weights)
        y = comm.combine(oracle.run_experts(cfg, topo.rank, topo.world_size, d), d)
        bad = oracle.compare_combine(cfg, y, oracle.expected_combine_rank(cfg, inputs, topo.rank))
    # one file per rank: the ranks' stdout lines interleave in mpiexec's pipe
    with open(os.path.join(os.environ["RESULT_DIR"], f"rank{topo.rank}.txt"), "w") as f:
        f.write(f"RESULT rank={topo.rank} world={topo.world_size} local={topo.local_rank} ok={not bad}")
""")


def _mpi_ready() -> str:
    if shutil.which("mpiexec") is None:
        return "mpiexec not found"
    probe = subprocess.run([sys.executable, "-c", "from mpi4py import MPI"], capture_output=True, timeout=60)
    return "" if probe.returncode == 0 else "mpi4py cannot load an MPI library"


def test_mpiexec_without_master_addr(tmp_path):
    why = _mpi_ready()
    if why:
        pytest.skip(why)
    script = tmp_path / "run.py"
    script.write_text(SCRIPT)
    env = {k: v for k, v in os.environ.items()
           if k not in ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE", "LOCAL_RANK")}
    env["CUDA_VISIBLE_DEVICES"] = ""
    env["RESULT_DIR"] = str(tmp_path)
    proc = subprocess.run(["mpiexec", "-n", "2", sys.executable, str(script)], capture_output=True, text=True,
                          timeout=180, env=env)
    lines = [(tmp_path / f"rank{r}.txt").read_text() if (tmp_path / f"rank{r}.txt").exists() else "" for r in (0, 1)]
    assert proc.returncode == 0 and len(lines) == 2, proc.stdout + proc.stderr
    assert lines[0].startswith("RESULT rank=0 world=2 local=0") and lines[1].startswith("RESULT rank=1 world=2 local=1")
    assert all(line.endswith("ok=True") for line in lines)


REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _launch_script() -> tuple[str, str]:
    """The repository's launch script for the MPI on PATH, and extra mpirun flags it needs here."""
    why = _mpi_ready()
    if why:
        pytest.skip(why)
    version = subprocess.run(["mpiexec", "--version"], capture_output=True, text=True, timeout=60).stdout
    if "HYDRA" in version:  # MPICH (also what `pip install mpich` brings)
        return "launch/mpirun_mpich.sh", ""
    if "Open MPI" in version or "OpenRTE" in version:
        extra = "--oversubscribe" + (" --allow-run-as-root" if os.geteuid() == 0 else "")
        return "launch/mpirun_openmpi.sh", extra
    pytest.skip(f"unknown MPI: {version.splitlines()[:1]}")


def test_launch_script_runs_stress_on_cpu():
    """The launch script itself (not a hand-written mpiexec line): 2 CPU ranks, results checked
    against the oracle by `ep-comm stress`; a wrong combine makes the script exit non-zero."""
    script, extra = _launch_script()
    env = {k: v for k, v in os.environ.items() if k not in ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE",
                                                            "LOCAL_RANK", "EP_COMM_BACKEND")}
    env.update(NP="2", GPUS_PER_NODE="2", CUDA_VISIBLE_DEVICES="", EP_COMM_PYTHON=sys.executable,
               MPI_EXTRA_ARGS=extra, PYTHONPATH=os.pathsep.join(p for p in (REPO, env.get("PYTHONPATH")) if p))
    ok = subprocess.run(["bash", script, "stress", "--iters", "4", "--op-timeout", "60"], cwd=REPO, env=env,
                        capture_output=True, text=True, timeout=240)
    assert ok.returncode == 0, ok.stdout + ok.stderr
    assert ok.stdout.count("stress PASSED: 4 iteration(s)") == 1, ok.stdout + ok.stderr
    assert "(pmi, cpu)" in ok.stdout or "(openmpi, cpu)" in ok.stdout, ok.stdout
    bad = subprocess.run(["bash", script, "stress", "--iters", "2", "--inject-fault", "--backend", "ag_rs",
                          "--layout", "standard", "--op-timeout", "60"], cwd=REPO, env=env,
                         capture_output=True, text=True, timeout=240)
    assert bad.returncode != 0, bad.stdout + bad.stderr
    assert bad.stdout.count("MISMATCH in iteration 1") == 1, bad.stdout + bad.stderr
