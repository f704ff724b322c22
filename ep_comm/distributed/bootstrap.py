"""``init_distributed``: one call that works under torchrun, mpirun (Open MPI, MPICH), srun or alone."""
from __future__ import annotations

import atexit
import datetime
import os
from typing import Optional

import torch
import torch.distributed as dist

from ..errors import EPConfigError, EPTimeoutError, EPTopologyError
from .launch_env import LaunchInfo, free_port, read_launch_env, slurm_default_rendezvous, this_host_address
from .topology import Topology, gather_topology

DEFAULT_TIMEOUT_S = 300.0


def _mpi_rendezvous(info: LaunchInfo) -> tuple[str, int]:
    """Rank 0 picks its address and a free port; mpi4py broadcasts them."""
    try:
        from mpi4py import MPI
    except ImportError as exc:  # pragma: no cover - depends on the environment
        raise EPConfigError(
            "env MASTER_ADDR", None,
            f"not set under {info.launcher}; install mpi4py (pip install mpi4py) so rank 0 can "
            "broadcast its address, or export MASTER_ADDR/MASTER_PORT",
        ) from exc
    comm = MPI.COMM_WORLD
    payload = (this_host_address(), free_port()) if comm.Get_rank() == 0 else None
    addr, port = comm.bcast(payload, root=0)
    return addr, int(port)


def resolve_rendezvous(info: LaunchInfo, env=None) -> tuple[str, int]:
    """MASTER_ADDR/PORT from the environment, else derived from the launcher."""
    env = os.environ if env is None else env
    addr, port = info.master_addr, info.master_port
    if addr and port:
        return addr, port
    if info.world_size == 1:
        return addr or "127.0.0.1", port or free_port()
    if info.is_mpi:
        m_addr, m_port = _mpi_rendezvous(info)
        return addr or m_addr, port or m_port
    if info.launcher == "slurm":
        s_addr, s_port = slurm_default_rendezvous(env)
        r_addr, r_port = addr or s_addr, port or s_port
        if r_addr and r_port:
            return r_addr, r_port
    raise EPConfigError(
        "env MASTER_ADDR", addr,
        f"launcher {info.launcher!r} with world size {info.world_size} needs MASTER_ADDR and MASTER_PORT",
    )


def shutdown(abort: Optional[bool] = None) -> None:
    """Tear torch.distributed down without hanging.  A no-op when it is not initialised.

    Normally destroys every process group.  When a peer is known to be gone (``abort=None``: an
    ep_comm control plane in this process has seen a peer die or leave), NCCL groups are aborted
    instead: destroying them waits for the dead peer, forever.  Gloo groups close their sockets
    either way.
    """
    if not dist.is_initialized():
        return
    if abort is None:
        from .control import peer_loss_seen

        abort = peer_loss_seen()
    try:
        aborter = getattr(dist.distributed_c10d, "_abort_process_group", None)
        if abort and aborter is not None and dist.get_backend() == "nccl":
            aborter()
        else:
            dist.destroy_process_group()
    except Exception:  # teardown must never turn into the error the user sees
        pass


def _shutdown() -> None:
    """At interpreter exit: the groups we created go before teardown (avoids gloo/NCCL exit aborts)."""
    shutdown()


def init_distributed(timeout_s: Optional[float] = None, backend: Optional[str] = None) -> Topology:
    """Initialise torch.distributed from the launcher's environment and return this rank's Topology.

    A no-op (apart from building the Topology) when torch.distributed is already initialised.
    Uses NCCL and sets the CUDA device to the local rank (modulo the visible GPUs) when CUDA is
    available, gloo otherwise.  ``backend="gloo"`` with CUDA: a gloo job whose ranks still take GPU
    ``local_rank % device_count``, so that more ranks than GPUs can share them (NCCL refuses two ranks
    on one GPU; the ``mnnvl`` backend maps peers on the same GPU alike).
    Collective: every rank of the job must call it.
    """
    if backend not in (None, "nccl", "gloo"):
        raise EPConfigError("init_distributed backend", backend, "must be None, 'nccl' or 'gloo'")
    timeout = datetime.timedelta(seconds=timeout_s or DEFAULT_TIMEOUT_S)
    use_cuda = torch.cuda.is_available()
    if backend == "nccl" and not use_cuda:
        raise EPTopologyError("init_distributed: backend='nccl' needs CUDA, and none is available")
    device_index: Optional[int] = None
    if not dist.is_initialized():
        info = read_launch_env()
        addr, port = resolve_rendezvous(info)
        os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"] = addr, str(port)
        os.environ.setdefault("RANK", str(info.rank))
        os.environ.setdefault("WORLD_SIZE", str(info.world_size))
        os.environ.setdefault("LOCAL_RANK", str(info.local_rank))
        if use_cuda:
            device_index = info.local_rank % torch.cuda.device_count()
            torch.cuda.set_device(device_index)
        try:
            dist.init_process_group(
                backend=backend or ("nccl" if use_cuda else "gloo"),
                init_method=f"tcp://{addr}:{port}",
                rank=info.rank,
                world_size=info.world_size,
                timeout=timeout,
            )
        except (RuntimeError, dist.DistStoreError) as exc:
            if "timed out" in str(exc).lower() or "timeout" in str(exc).lower():
                raise EPTimeoutError(
                    f"rendezvous at {addr}:{port} timed out after {timeout.total_seconds():.0f}s: "
                    f"not every one of {info.world_size} ranks arrived ({exc})"
                ) from exc
            if info.rank != 0 and "connection" in str(exc).lower():
                # with a tcp:// rendezvous rank 0 hosts the store: losing it means losing rank 0
                raise EPTimeoutError(
                    f"rendezvous at {addr}:{port} failed: the store hosted by rank 0 went away while the "
                    f"{info.world_size} ranks were starting (rank 0 died or exited?) ({str(exc).splitlines()[0]})",
                    missing_ranks=[0],
                ) from exc
            raise
        atexit.register(_shutdown)
    elif use_cuda and dist.get_backend() == "nccl":
        device_index = torch.cuda.current_device()
    return gather_topology(device_index=device_index)
