"""Start the ranks of a CLI subcommand: in-process under a launcher, or self-spawned with ``--nproc``.

Every subcommand is written as a *rank worker* ``worker(args) -> int`` (the exit code) that runs on
every rank.  ``run_ranks`` decides how those ranks come to exist:

* started by torchrun / mpirun / srun with a world size > 1 (``read_launch_env``): this process *is*
  one rank, so the worker runs here and its return value becomes the process's exit code;
* otherwise: ``--nproc N`` local ranks are spawned with ``spawn_local`` (torchrun-style environment),
  the parent waits, reports ranks that raised, and exits non-zero if any rank failed.  A rank that a
  run plans to kill (``ep-comm stress --kill``) and that dies of SIGKILL is no failure.

Workers print only on rank 0, so output appears once however the job was started.  They also agree on
their exit code (``agree_exit_code``) so that under an external launcher every rank exits with the
same status, and the launcher's "first failing rank" message is never the only sign of a failure.
"""
from __future__ import annotations

import dataclasses
import datetime
import os
import sys
import traceback
from typing import Any, Callable, Iterable, Optional

import torch

from ..distributed.launch_env import LaunchInfo, read_launch_env

#: set in spawned children so the worker knows it shares this host's CPU cores with its siblings
_SPAWNED_ENV = "EP_COMM_CLI_SPAWNED_NPROC"

Worker = Callable[[Any], int]


def cuda_device_count() -> int:
    """Visible CUDA devices (0 without CUDA), without ever raising."""
    try:
        return torch.cuda.device_count() if torch.cuda.is_available() else 0
    except Exception:  # a broken driver must not break `ep-comm info`
        return 0


def default_nproc() -> int:
    """One rank per visible GPU; 2 CPU ranks without CUDA (the smallest real exchange)."""
    return cuda_device_count() or 2


def external_launch() -> Optional[LaunchInfo]:
    """The launcher's info when this process is one rank of a multi-rank job, else None."""
    info = read_launch_env()
    if info.launcher != "none" and info.world_size > 1:
        return info
    return None


def check_nproc(nproc: int, share_gpus: bool = False) -> Optional[str]:
    """Why ``nproc`` local ranks cannot run here (None when they can).  ``share_gpus``: the ranks form a
    gloo job and share the GPUs (``setup_rank``), so there may be more of them than GPUs."""
    if nproc < 1:
        return f"--nproc must be >= 1, got {nproc}"
    ngpu = cuda_device_count()
    if ngpu and nproc > ngpu and not share_gpus:
        # NCCL refuses two ranks on one GPU; say so before spawning instead of failing in every child
        return (f"--nproc {nproc} exceeds the {ngpu} visible CUDA device(s); NCCL needs one GPU per rank "
                "(set CUDA_VISIBLE_DEVICES= to run CPU ranks over gloo instead)")
    return None


def run_ranks(worker: Worker, args: Any, nproc: Optional[int], timeout_s: float,
              failure_grace_s: Optional[float] = None,
              planned_victim: Optional[Callable[[Any, int], Optional[int]]] = None,
              share_gpus: bool = False) -> int:
    """Run ``worker(args)`` on every rank and return the exit code for this process.

    ``planned_victim(args, world)``: the rank the command kills on purpose (``ep-comm stress --kill``),
    whose own SIGKILL is then no failure.  ``share_gpus``: more spawned ranks than GPUs are allowed
    (the worker sets its ranks up with ``setup_rank(share_gpus=True)``).

    Self-spawned ranks still running ``failure_grace_s`` after one rank failed are killed (their own
    typed errors normally end them well before); none outlives this call.
    """
    info = external_launch()
    if info is not None:
        if nproc is not None and nproc != info.world_size and info.rank == 0:
            print(f"note: started by {info.launcher} with {info.world_size} ranks; --nproc {nproc} ignored",
                  file=sys.stderr, flush=True)
        return _run_here(worker, args)
    nproc = default_nproc() if nproc is None else nproc
    problem = check_nproc(nproc, share_gpus)
    if problem:
        print(f"error: {problem}", file=sys.stderr, flush=True)
        return 2
    if nproc == 1:
        return _run_here(worker, args)

    from ..distributed.spawn import spawn_local

    victim = planned_victim(args, nproc) if planned_victim is not None else None
    if victim is not None:
        # the survivors go on for the rest of the run after the planned death, so it must not start the
        # countdown that kills them; their own typed errors (and --timeout) still end a failing run
        failure_grace_s = None
    # torch (97% of a rank's import time) is imported once in a fork server, not once per rank; only
    # torch: importing it never initialises CUDA, so forking after it is safe (ep_comm modules could)
    results = spawn_local(_spawned_entry, nproc, (worker, args), timeout_s=timeout_s,
                          extra_env=lambda rank: {_SPAWNED_ENV: str(nproc)}, preload=("torch", "torch.distributed"),
                          failure_grace_s=failure_grace_s)
    code = 0
    for res in results:
        if res.rank == victim and planned_death(res):
            print(f"note: rank {res.rank} was killed with SIGKILL as planned (--kill)", file=sys.stderr)
            continue
        if res.ok:
            code = max(code, int(res.value or 0))
            continue
        code = max(code, 1)
        print(f"--- rank {res.rank} failed: {res.error_type}: {res.error}", file=sys.stderr)
        if res.traceback:
            print(res.traceback.rstrip(), file=sys.stderr)
    sys.stderr.flush()
    return code


def planned_death(res: Any) -> bool:
    """Whether a spawned rank died of its own SIGKILL, not of the launcher's (its timeout kills too)."""
    import signal

    return res.exitcode == -signal.SIGKILL and not res.ok and "killed by the launcher" not in (res.error or "")


def _spawned_entry(worker: Worker, args: Any) -> int:
    """What each spawned child runs (module level so the spawn context can pickle it)."""
    _exit_with_parent()
    return worker(args)


def _exit_with_parent(poll_s: float = 1.0) -> None:
    """End this rank when the spawning ``ep-comm`` process goes away.

    A parent killed by ``timeout``/SIGTERM/SIGKILL cannot clean up its children, and orphaned ranks
    would keep holding GPUs (and block peers in collectives) on a shared machine.  Re-parenting is
    how we notice: ``getppid`` changes once the parent is gone.
    """
    import threading
    import time

    parent = os.getppid()

    def watch() -> None:
        while True:
            time.sleep(poll_s)
            if os.getppid() != parent:
                os._exit(143)  # no cleanup on purpose: peers are gone too, collectives would hang

    threading.Thread(target=watch, name="ep-comm-parent-watch", daemon=True).start()


def _run_here(worker: Worker, args: Any) -> int:
    try:
        return int(worker(args) or 0)
    except Exception:
        traceback.print_exc()
        return 1


# -- helpers for the rank workers ------------------------------------------------------------------------
@dataclasses.dataclass
class RankEnv:
    """What a rank worker needs after ``setup_rank``."""

    rank: int
    world_size: int
    device: torch.device
    cpu_group: Any  # gloo group for host-side gathers/barriers (None = the default group is gloo)
    topology: Any
    launcher: str  # "spawn" or the external launcher's name

    @property
    def is_root(self) -> bool:
        return self.rank == 0


def setup_rank(timeout_s: float = 300.0, share_gpus: bool = False) -> RankEnv:
    """``ep_comm.init_distributed`` plus a gloo group for host-side control of the CLI itself.

    ``share_gpus``: a gloo job whose ranks take GPU ``local_rank % device_count`` (more ranks than GPUs);
    the device is then CUDA on a gloo group, which only the ``mnnvl`` backend runs on.
    """
    import torch.distributed as dist

    from ..distributed import init_distributed

    hang_dump = os.environ.get("EP_COMM_HANG_DUMP_S")
    if hang_dump:
        # diagnosing a stuck run on a remote machine: every thread's Python stack to stderr after N s
        import faulthandler

        faulthandler.dump_traceback_later(float(hang_dump), exit=False)
    # read before init_distributed, which exports RANK/WORLD_SIZE (torchrun's names) for any launcher
    launcher = "spawn" if os.environ.get(_SPAWNED_ENV) else read_launch_env().launcher
    topo = init_distributed(timeout_s, backend="gloo" if share_gpus else None)
    if dist.get_backend() == "gloo":
        cpu_group = None
        device = torch.device("cuda", torch.cuda.current_device()) if share_gpus else torch.device("cpu")
    else:
        cpu_group = dist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=timeout_s))
        device = torch.device("cuda", torch.cuda.current_device())
    return RankEnv(dist.get_rank(), dist.get_world_size(), device, cpu_group, topo, launcher)


def gather_objects(env: RankEnv, obj: Any) -> list:
    """All-gather a picklable object over the CLI's gloo group."""
    import torch.distributed as dist

    out: list = [None] * env.world_size
    dist.all_gather_object(out, obj, group=env.cpu_group)
    return out


def host_barrier(env: RankEnv, hide_launch: bool = False) -> None:
    """Line the ranks up on the host (after the device is idle), then on the devices
    (``align_devices``), so the op timed next starts together on every rank."""
    import torch.distributed as dist

    if env.device.type == "cuda":
        torch.cuda.synchronize()
    dist.barrier(group=env.cpu_group)
    align_devices(env, hide_launch)


#: ``torch.cuda._sleep`` cycles (~1 ms on an H200) the GPU busy-waits in front of a timed launch.  It must
#: outlast the host's issue of the all_reduce, the start stamp and the timed call: at 200k cycles
#: (~100 µs) that was not always so on nvidia-h200-x2, and the 128-token dispatch read 30-47 µs p50
#: (p90 ~100) where 1 ms gives 19.9 (p90 20.2).  EP_COMM_BENCH_GAP_CYCLES overrides it.
LAUNCH_GAP_CYCLES = int(os.environ.get("EP_COMM_BENCH_GAP_CYCLES", "2000000"))


def align_devices(env: RankEnv, hide_launch: bool = False) -> None:
    """Queue a one-element NCCL all_reduce: it ends at nearly the same moment on every GPU, so the
    op queued next starts together everywhere (a host barrier alone leaves launches tens of µs
    apart).  ``hide_launch``: a GPU busy-wait first, so that by the time the all_reduce ends the host
    has already queued the timed launch behind it; CUDA events then time the op on the GPU, not the
    host's launch call (an idle GPU records a start event at once and waits 10-35 µs for the launch).
    The busy-wait comes before the all_reduce: busy-waits count clock cycles, and the GPUs' clocks
    differ, so a wait after it would undo the alignment."""
    import torch.distributed as dist

    if env.device.type != "cuda":
        return
    if hide_launch and hasattr(torch.cuda, "_sleep"):
        torch.cuda._sleep(LAUNCH_GAP_CYCLES)
    tiny = _ALIGN.get(env.device)
    if tiny is None:
        tiny = _ALIGN[env.device] = torch.zeros(1, device=env.device)
    dist.all_reduce(tiny)


_ALIGN: dict = {}
_GAP_US: dict = {}


def launch_gap_us(device: torch.device) -> float:
    """How long the pre-launch busy-wait (``LAUNCH_GAP_CYCLES``) lasts on this GPU, in µs (timed once)."""
    if device not in _GAP_US:
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda._sleep(1000)
        start.record()
        torch.cuda._sleep(LAUNCH_GAP_CYCLES)
        end.record()
        end.synchronize()
        _GAP_US[device] = start.elapsed_time(end) * 1e3
    return _GAP_US[device]


def agree_exit_code(env: RankEnv, code: int) -> int:
    """Every rank returns the worst exit code of any rank."""
    return max(int(c) for c in gather_objects(env, int(code)))


def teardown() -> None:
    """Destroy the process groups (quiet exit under NCCL), or abort them after a peer was lost
    (destroying an NCCL group waits for the dead peer forever).  Never raises."""
    from ..distributed import shutdown

    shutdown()


class PeerWatch:
    """Backstop for a rank whose peer died while it is stuck where no error can reach it.

    On gloo a dead peer fails the pending collective at once and the rank raises a typed error by
    itself.  On NCCL the host can sit in a device synchronisation behind a kernel that waits for the
    dead peer forever.  This thread looks at the peers' processes (same machine, ``/proc``) every
    ``poll_s``; once one is gone it gives the rank ``grace_s`` to end on its own, then prints the
    typed error and ends the process with exit code 1.  ``stop()`` it before the ranks leave normally
    (a peer that finished first is not a failure).

    ``expected``: ranks whose death is planned (``ep-comm stress --kill``): the survivors do not end but
    raise, shrink and go on, so for those the rank gets ``expected_grace_s`` to get there, after which
    ``rebind`` to the survivors' control plane (where the dead rank is no member) ends the wait.
    """

    def __init__(self, control: Any, label: str, grace_s: float, poll_s: float = 0.5,
                 expected: Iterable[int] = (), expected_grace_s: Optional[float] = None):
        import threading

        self._control, self._label, self._grace_s, self._poll_s = control, label, grace_s, poll_s
        self._expected = set(expected)
        self._expected_grace_s = grace_s if expected_grace_s is None else expected_grace_s
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="ep-comm-peer-watch", daemon=True)
        self._thread.start()

    def rebind(self, control: Any) -> None:
        """Watch ``control``'s members from now on (after a shrink: the survivors)."""
        self._control = control

    def _run(self) -> None:
        import time

        while not self._stop.wait(self._poll_s):
            control = self._control
            lost = control.lost_peers(use_store=False)
            if not lost:
                continue
            grace = self._expected_grace_s if set(lost) <= self._expected else self._grace_s
            deadline = time.monotonic() + grace
            while self._control is control and time.monotonic() < deadline:
                if self._stop.wait(min(self._poll_s, max(0.0, deadline - time.monotonic()))):
                    return
            if self._control is not control:
                continue  # rebound to the survivors: look again there
            from ..errors import EPTimeoutError

            me = getattr(control, "me", control.rank)
            gone = "; ".join(f"rank {r} is gone ({why})" for r, why in sorted(lost.items()))
            err = EPTimeoutError(
                f"rank {me}: {gone}; this rank did not finish within {grace:g} s after "
                "that and is ending itself",
                missing_ranks=lost, lost_ranks=lost)
            print(f"{self._label}: rank {me}: {type(err).__name__}: {err}", file=sys.stderr, flush=True)
            os._exit(1)  # no cleanup on purpose: it is what we are stuck in

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()


def say(env: RankEnv, *parts: Any, file=None) -> None:
    """Print on rank 0 only (flushed, so spawned ranks' output is not lost or reordered)."""
    if env.is_root:
        print(*parts, file=file or sys.stdout, flush=True)
