"""Run a function on N local ranks, as torchrun would, from inside Python (tests and the CLI).

Each child gets the torchrun variables (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT) plus
any extra per-rank environment and its share of the host's cores for torch's thread pool, runs
``fn(*args)``, and sends back either its return value or the exception it raised (type name, message,
traceback).  The parent never hangs: children that do not finish within ``timeout_s`` (or within
``failure_grace_s`` of another rank's failure) are killed and reported, and no child outlives
``spawn_local``.
"""
from __future__ import annotations

import dataclasses
import multiprocessing as mp
import os
import queue
import signal
import sys
import time
import traceback
from typing import TYPE_CHECKING, Any, Callable, Mapping, Optional, Sequence, Union

from .launch_env import free_port, read_launch_env

if TYPE_CHECKING:  # ForkServerContext does not exist on Windows
    from multiprocessing.context import ForkServerContext, SpawnContext

LAUNCHER_VARS = (
    "RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
    "OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_RANK",
    "PMI_RANK", "PMI_SIZE", "MPI_LOCALRANKID", "SLURM_PROCID", "SLURM_NTASKS", "SLURM_LOCALID",
)


@dataclasses.dataclass
class RankResult:
    rank: int
    ok: bool
    value: Any = None
    error_type: Optional[str] = None
    error: Optional[str] = None
    traceback: Optional[str] = None
    exitcode: Optional[int] = None


def _child(fn: Callable, args: tuple, rank: int, env: Mapping[str, str], threads: int, results) -> None:
    for var in LAUNCHER_VARS:
        os.environ.pop(var, None)
    os.environ.update(env)
    import torch

    # N ranks on one host share its cores: at torch's default (a thread per core in every rank) the
    # host-side work on small tensors (inputs, the oracle) thrashes in the thread pools' barriers
    torch.set_num_threads(threads)
    try:
        value = fn(*args)
        results.put(RankResult(rank, True, value))
    except BaseException as exc:  # report everything, including SystemExit, to the parent
        results.put(RankResult(rank, False, None, type(exc).__name__, str(exc), traceback.format_exc()))
    # The result is all the parent needs, so the child leaves without the interpreter's teardown:
    # torch's exit-time destruction of process groups and stores races with their threads and now and
    # then aborts a rank ("terminate called without an active exception") after it reported success.
    results.close()
    results.join_thread()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def spawn_local(
    fn: Callable,
    nproc: int,
    args: Sequence[Any] = (),
    timeout_s: float = 300.0,
    extra_env: Optional[Callable[[int], Mapping[str, str]]] = None,
    preload: Sequence[str] = (),
    failure_grace_s: Optional[float] = None,
) -> list[RankResult]:
    """Start ``nproc`` processes running ``fn(*args)`` as ranks of one torchrun-like job.

    ``fn`` must be importable (module level).  Returns one ``RankResult`` per rank, in rank order.
    ``preload``: modules to import once in a fork server that then forks the ranks (``forkserver``
    start method) instead of every rank importing them in a fresh interpreter (``spawn``).  Importing
    torch costs seconds of CPU per process, paid N times at once by N spawned ranks; the fork server
    pays it once.  Forking stays CUDA-safe as long as importing ``preload`` initialises no CUDA context
    (true of torch itself): the server is a fresh interpreter that only imports.

    Ranks still running after ``timeout_s`` are killed.  With ``failure_grace_s``, once one rank has
    failed (raised, or died without reporting, e.g. ``kill -9``) the others get that many seconds to
    notice and finish; then they are killed too.  No child outlives this call.
    """
    ctx: Union[ForkServerContext, SpawnContext]
    if preload:
        ctx = mp.get_context("forkserver")
        ctx.set_forkserver_preload(list(preload))
    else:
        ctx = mp.get_context("spawn")
    results = ctx.Queue()
    port = free_port()
    threads = max(1, _usable_cpus() // max(1, nproc))
    procs = []
    try:
        for rank in range(nproc):
            env = {
                "RANK": str(rank), "WORLD_SIZE": str(nproc), "LOCAL_RANK": str(rank),
                "LOCAL_WORLD_SIZE": str(nproc), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
            }
            if extra_env is not None:
                env.update(extra_env(rank))
            p = ctx.Process(target=_child, args=(fn, tuple(args), rank, env, threads, results), daemon=False)
            p.start()
            procs.append(p)
        collected, killed = _collect(procs, results, timeout_s, failure_grace_s)
    finally:
        for p in procs:  # an interrupted parent (Ctrl-C, an exception) still takes its children along
            if p.is_alive():
                p.kill()
            p.join()
    out = []
    for rank, p in enumerate(procs):
        res = collected.get(rank)
        if res is None:
            why = killed.get(rank) or _exit_reason(p.exitcode)
            res = RankResult(rank, False, None, "SpawnError", f"rank {rank} {why}")
        res.exitcode = p.exitcode
        out.append(res)
    return out


def _usable_cpus() -> int:
    """The cores this process may run on (its affinity mask under Slurm or taskset), else all."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # no affinity API (macOS)
        return os.cpu_count() or 1


def _exit_reason(code: Optional[int]) -> str:
    if code is not None and code < 0:
        try:
            name = signal.Signals(-code).name
        except ValueError:
            name = "unknown signal"
        return f"was killed by signal {-code} ({name}) without reporting"
    return f"exited with code {code} without reporting"


def _collect(procs: list, results, timeout_s: float, grace_s: Optional[float]) -> tuple[dict, dict]:
    """Wait for the ranks' reports; returns ``({rank: RankResult}, {rank: why it was killed})``."""
    nproc = len(procs)
    collected: dict[int, RankResult] = {}
    deadline = time.monotonic() + timeout_s
    failed: Optional[str] = None  # the first failure, once seen

    def note_failure(what: str) -> None:
        nonlocal failed, deadline
        if failed is None:
            failed = what
            if grace_s is not None:
                deadline = min(deadline, time.monotonic() + grace_s)

    while len(collected) < nproc and time.monotonic() < deadline:
        try:
            res = results.get(timeout=0.2)
        except queue.Empty:
            dead = [r for r, p in enumerate(procs) if r not in collected and not p.is_alive()]
            for r in dead:
                if procs[r].exitcode != 0:
                    note_failure(f"rank {r} {_exit_reason(procs[r].exitcode)}")
            if len(dead) == nproc - len(collected):
                break  # everyone left has exited: whatever they reported is drained below
            continue
        collected[res.rank] = res
        if not res.ok:
            note_failure(f"rank {res.rank} raised {res.error_type}")
    killed: dict[int, str] = {}
    for r, p in enumerate(procs):
        if r not in collected and p.is_alive():
            p.kill()
            killed[r] = (f"was still running {grace_s:g} s after {failed}; killed by the launcher"
                         if failed is not None and grace_s is not None else
                         f"did not finish within {timeout_s:g} s; killed by the launcher")
    for p in procs:
        # a rank that reported may still be exiting; one stuck in teardown is killed (its exit code,
        # -9 after a report, is what raise_on_failure then shows)
        p.join(timeout=max(0.0, min(10.0, deadline + 10.0 - time.monotonic())))
        if p.is_alive():
            p.kill()
            p.join()
    try:  # reports sent just before a rank exited (or was killed) are still in the pipe
        while True:
            res = results.get(timeout=0.2)
            collected.setdefault(res.rank, res)
    except queue.Empty:
        pass
    return collected, killed


def raise_on_failure(results: Sequence[RankResult]) -> list[Any]:
    """Return the values, or raise one RuntimeError that shows every failed rank's traceback."""
    failed = [r for r in results if not r.ok or r.exitcode not in (0, None)]
    if failed:
        text = "\n".join(
            f"--- rank {r.rank}: {r.error_type or 'exit'}: "
            f"{r.error or f'exit code {r.exitcode} after reporting success'}"
            f"\n{r.traceback or ''}" for r in failed)
        raise RuntimeError(f"{len(failed)} of {len(results)} ranks failed:\n{text}")
    return [r.value for r in results]


def run_or_spawn(fn: Callable, args: tuple = (), nproc: Optional[int] = None, timeout_s: float = 300.0,
                 launched: Optional[Callable] = None) -> Optional[list[RankResult]]:
    """The ``main()`` of a script that runs under a launcher or on its own: started by torchrun, mpirun
    or srun (a world of more than one rank in the environment), this process is one rank and runs
    ``(launched or fn)(*args)``; returns None.  Otherwise it spawns ``nproc`` local ranks (default: the
    CUDA GPUs, or 2 without any) running ``fn(*args)``, prints each failed rank's error to stderr and
    returns every rank's result."""
    import torch  # here: the rest of this module runs without importing torch

    if read_launch_env().world_size > 1:
        (launched or fn)(*args)
        return None
    n = nproc or (torch.cuda.device_count() if torch.cuda.is_available() else 0) or 2
    results = spawn_local(fn, n, args, timeout_s=timeout_s)
    for r in results:
        if not r.ok:
            print(f"rank {r.rank} failed: {r.error_type}: {r.error}\n{r.traceback or ''}", file=sys.stderr)
    return results
