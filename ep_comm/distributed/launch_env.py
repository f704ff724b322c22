"""Reading rank/world/local-rank and the rendezvous address from the launcher's environment.

Pure functions over a mapping (``os.environ`` by default) so every launcher can be tested on a laptop.
Precedence when several launchers' variables are present: torchrun, Open MPI, MPICH/PMI, Slurm
(an ``srun`` inside an ``mpirun`` or ``torchrun`` inside Slurm sets both, and the innermost wins).
"""
from __future__ import annotations

import dataclasses
import os
import re
import socket
import zlib
from typing import Mapping, Optional

from ..errors import EPConfigError


@dataclasses.dataclass(frozen=True)
class LaunchInfo:
    """What the launcher told this process."""

    launcher: str  # "torchrun" | "openmpi" | "pmi" | "slurm" | "none"
    rank: int
    world_size: int
    local_rank: int
    master_addr: Optional[str]
    master_port: Optional[int]

    @property
    def is_mpi(self) -> bool:
        return self.launcher in ("openmpi", "pmi")


_LAUNCHERS = (
    # name, rank var, size var, local rank var(s)
    ("torchrun", "RANK", "WORLD_SIZE", ("LOCAL_RANK",)),
    ("openmpi", "OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE", ("OMPI_COMM_WORLD_LOCAL_RANK",)),
    ("pmi", "PMI_RANK", "PMI_SIZE", ("MPI_LOCALRANKID", "PMI_LOCAL_RANK")),
    ("slurm", "SLURM_PROCID", "SLURM_NTASKS", ("SLURM_LOCALID",)),
)


def _int(env: Mapping[str, str], name: str) -> int:
    raw = env[name]
    try:
        return int(raw)
    except ValueError:
        raise EPConfigError(f"env {name}", raw, "must be an integer") from None


def read_launch_env(env: Optional[Mapping[str, str]] = None) -> LaunchInfo:
    """Parse the first launcher whose rank and size variables are both set."""
    env = os.environ if env is None else env
    for name, rank_var, size_var, local_vars in _LAUNCHERS:
        if rank_var in env and size_var in env:
            rank, size = _int(env, rank_var), _int(env, size_var)
            if not 0 <= rank < size:
                raise EPConfigError(f"env {rank_var}", rank, f"must be in [0, {size_var}={size})")
            local = next((_int(env, v) for v in local_vars if v in env), None)
            if local is None:
                local = rank  # single-node launch without a local-rank variable
            port = _int(env, "MASTER_PORT") if "MASTER_PORT" in env else None
            return LaunchInfo(name, rank, size, local, env.get("MASTER_ADDR"), port)
    port = _int(env, "MASTER_PORT") if "MASTER_PORT" in env else None
    return LaunchInfo("none", 0, 1, 0, env.get("MASTER_ADDR"), port)


def expand_slurm_nodelist(nodelist: str) -> list[str]:
    """Expand ``node[01-03,7],gpu5`` into host names (what ``scontrol show hostnames`` prints)."""
    hosts: list[str] = []
    for part in re.findall(r"[^,\[]+(?:\[[^\]]*\])?[^,]*", nodelist):
        m = re.fullmatch(r"(.*?)\[([^\]]*)\](.*)", part)
        if not m:
            hosts.append(part)
            continue
        prefix, ranges, suffix = m.groups()
        for r in ranges.split(","):
            if "-" in r:
                lo, hi = r.split("-", 1)
                width = len(lo)
                hosts.extend(f"{prefix}{i:0{width}d}{suffix}" for i in range(int(lo), int(hi) + 1))
            else:
                hosts.append(f"{prefix}{r}{suffix}")
    return hosts


def slurm_default_rendezvous(env: Mapping[str, str]) -> tuple[Optional[str], Optional[int]]:
    """First node of the job and a port derived from the job id (same on every task, no exchange)."""
    nodelist = env.get("SLURM_STEP_NODELIST") or env.get("SLURM_JOB_NODELIST") or env.get("SLURM_NODELIST")
    addr = expand_slurm_nodelist(nodelist)[0] if nodelist else None
    job = env.get("SLURM_JOB_ID") or env.get("SLURM_JOBID")
    port = 20000 + (zlib.crc32(job.encode()) % 20000) if job else None
    return addr, port


def free_port() -> int:
    """A TCP port that was free a moment ago on this host."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("", 0))
        return s.getsockname()[1]


def this_host_address() -> str:
    """An address of this host that peers can reach (falls back to loopback on an offline laptop)."""
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.connect(("10.255.255.255", 1))  # no packet is sent; picks the outgoing interface
            return s.getsockname()[0]
    except OSError:
        try:
            return socket.gethostbyname(socket.gethostname())
        except OSError:
            return "127.0.0.1"
