"""Run a function on N local ranks, as torchrun would, from inside Python (tests and the CLI).

Each child gets the torchrun variables (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT) plus
any extra per-rank environment, runs ``fn(*args)``, and sends back either its return value or the
exception it raised (type name, message, traceback).  The parent never hangs: children that do not
finish within ``timeout_s`` are killed and reported.
"""
from __future__ import annotations

import dataclasses
import multiprocessing as mp
import os
import queue
import time
import traceback
from typing import Any, Callable, Mapping, Optional, Sequence

from .launch_env import free_port

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


def _child(fn: Callable, args: tuple, rank: int, env: Mapping[str, str], results) -> None:
    for var in LAUNCHER_VARS:
        os.environ.pop(var, None)
    os.environ.update(env)
    try:
        value = fn(*args)
        results.put(RankResult(rank, True, value))
    except BaseException as exc:  # report everything, including SystemExit, to the parent
        results.put(RankResult(rank, False, None, type(exc).__name__, str(exc), traceback.format_exc()))


def spawn_local(
    fn: Callable,
    nproc: int,
    args: Sequence[Any] = (),
    timeout_s: float = 300.0,
    extra_env: Optional[Callable[[int], Mapping[str, str]]] = None,
    preload: Sequence[str] = (),
) -> list[RankResult]:
    """Start ``nproc`` processes running ``fn(*args)`` as ranks of one torchrun-like job.

    ``fn`` must be importable (module level).  Returns one ``RankResult`` per rank, in rank order.
    ``preload``: modules to import once in a fork server that then forks the ranks (``forkserver``
    start method) instead of every rank importing them in a fresh interpreter (``spawn``).  Importing
    torch costs seconds of CPU per process, paid N times at once by N spawned ranks; the fork server
    pays it once.  Forking stays CUDA-safe as long as importing ``preload`` initialises no CUDA context
    (true of torch itself): the server is a fresh interpreter that only imports.
    """
    if preload:
        ctx = mp.get_context("forkserver")
        ctx.set_forkserver_preload(list(preload))
    else:
        ctx = mp.get_context("spawn")
    results = ctx.Queue()
    port = free_port()
    procs = []
    for rank in range(nproc):
        env = {
            "RANK": str(rank), "WORLD_SIZE": str(nproc), "LOCAL_RANK": str(rank),
            "LOCAL_WORLD_SIZE": str(nproc), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
        }
        if extra_env is not None:
            env.update(extra_env(rank))
        p = ctx.Process(target=_child, args=(fn, tuple(args), rank, env, results), daemon=False)
        p.start()
        procs.append(p)

    collected: dict[int, RankResult] = {}
    deadline = time.monotonic() + timeout_s
    while len(collected) < nproc and time.monotonic() < deadline:
        try:
            res = results.get(timeout=0.2)
            collected[res.rank] = res
        except queue.Empty:
            if all(not p.is_alive() for p in procs):
                # drain what is left, then stop waiting for ranks that died without reporting
                try:
                    while True:
                        res = results.get(timeout=0.5)
                        collected[res.rank] = res
                except queue.Empty:
                    break
    for p in procs:
        p.join(timeout=max(0.0, min(10.0, deadline - time.monotonic())))
        if p.is_alive():
            p.kill()
            p.join()
    out = []
    for rank, p in enumerate(procs):
        res = collected.get(rank)
        if res is None:
            why = "timed out" if p.exitcode in (None, -9) else f"died with exit code {p.exitcode}"
            res = RankResult(rank, False, None, "SpawnError", f"rank {rank} {why} without reporting")
        res.exitcode = p.exitcode
        out.append(res)
    return out


def raise_on_failure(results: Sequence[RankResult]) -> list[Any]:
    """Return the values, or raise one RuntimeError that shows every failed rank's traceback."""
    failed = [r for r in results if not r.ok or r.exitcode not in (0, None)]
    if failed:
        text = "\n".join(
            f"--- rank {r.rank}: {r.error_type or 'exit'}: {r.error or f'exit code {r.exitcode} after reporting success'}"
            f"\n{r.traceback or ''}" for r in failed)
        raise RuntimeError(f"{len(failed)} of {len(results)} ranks failed:\n{text}")
    return [r.value for r in results]
