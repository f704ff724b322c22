"""``Exchange``: the few CPU-side collectives the memory layer needs, whatever bootstrapped the job.

The memory layer exchanges small byte strings (capabilities, fabric handles, socket addresses) and
needs a barrier.  It must work under torch.distributed (gloo or NCCL default group), under mpi4py, and
in a single process.  ``Exchange`` is that minimal contract; ``exchange_from`` turns whatever the
caller has (None, a torch ProcessGroup, an mpi4py communicator, an Exchange) into one.
"""
from __future__ import annotations

import dataclasses
import os
from typing import Any, Callable, Optional, Protocol, runtime_checkable

from ..errors import EPConfigError, EPError

__all__ = ["Exchange", "TorchExchange", "MPIExchange", "LocalExchange", "exchange_from", "allgather_bytes_via",
           "close_exchange", "cached_gloo_groups"]


@runtime_checkable
class Exchange(Protocol):
    """Collective byte exchange over a fixed set of ranks (``rank`` in ``[0, size)``).

    Every method is collective: all ranks of the group call it, in the same order.
    """

    rank: int
    size: int

    def allgather_bytes(self, data: bytes) -> list[bytes]:
        """Return every rank's ``data`` (index = rank); lengths may differ per rank."""
        ...

    def barrier(self) -> None:
        """Return once every rank has entered the barrier."""
        ...


def allgather_bytes_via(allgather: Callable[[Any], list], data: bytes) -> list[bytes]:
    """Variable-length byte all-gather on top of an equal-size CPU tensor all-gather.

    ``allgather(t)`` returns every rank's copy of ``t`` (index = rank).  Lengths travel first, then
    buffers padded to the longest; every rank sees the same lengths, so all skip the second step alike.
    """
    import torch

    payload = bytearray(data)
    sizes = [int(t.item()) for t in allgather(torch.tensor([len(payload)], dtype=torch.int64))]
    longest = max(sizes)
    if longest == 0:
        return [b"" for _ in sizes]
    buf = torch.zeros(longest, dtype=torch.uint8)
    if payload:
        buf[: len(payload)] = torch.frombuffer(payload, dtype=torch.uint8)
    return [out[:n].numpy().tobytes() for out, n in zip(allgather(buf), sizes)]


class LocalExchange:
    """A group of one: what a single process without torch.distributed or MPI uses."""

    rank = 0
    size = 1

    def allgather_bytes(self, data: bytes) -> list[bytes]:
        return [bytes(data)]

    def barrier(self) -> None:
        return None

    def __repr__(self) -> str:
        return "LocalExchange()"


# One gloo group per (default group, member ranks), shared by the open TorchExchange objects over
# those ranks and destroyed when the last of them is closed.  Creating a group is collective and
# opens new TCP connections, so two exchanges alive at once share one.  Every rank opens and closes
# its TorchExchanges in the same program order, so every rank hits or misses this cache together (a
# one-sided miss would hang in new_group).
@dataclasses.dataclass
class _Shadow:
    world: Any  # the default group the entry was made under (a re-initialised world gets new entries)
    group: Any
    users: int


_GLOO_GROUPS: dict[tuple[int, tuple[int, ...]], _Shadow] = {}


def _supports_cpu_tensors(dist: Any, group: Any) -> bool:
    try:
        backend = str(dist.get_backend(group)).lower()
    except (RuntimeError, ValueError):
        return False
    # "gloo", or a multi-device backend string such as "cpu:gloo,cuda:nccl"
    return backend == "gloo" or "cpu:gloo" in backend


def _acquire_gloo_group(dist: Any, group: Any) -> tuple[Any, Optional[tuple[int, tuple[int, ...]]]]:
    """A group over the same ranks as ``group`` that carries CPU tensors, and its cache key (None when
    ``group`` itself can be used and nothing was acquired)."""
    world = dist.group.WORLD
    is_world = group is None or group is world
    if _supports_cpu_tensors(dist, world if is_world else group):
        return (world if is_world else group), None
    for key in [k for k, v in _GLOO_GROUPS.items() if v.world is not world]:
        del _GLOO_GROUPS[key]  # made under a world that has since been destroyed (and its groups with it)
    ranks = tuple(range(dist.get_world_size())) if is_world else tuple(sorted(dist.get_process_group_ranks(group)))
    key = (id(world), ranks)
    hit = _GLOO_GROUPS.get(key)
    if hit is not None:
        hit.users += 1
        return hit.group, key
    if is_world:
        gloo = dist.new_group(backend="gloo")
    else:
        # only the members call this, so ask torch not to wait for the whole world
        gloo = dist.new_group(ranks=list(ranks), backend="gloo", use_local_synchronization=True)
    _GLOO_GROUPS[key] = _Shadow(world, gloo, 1)
    return gloo, key


def _release_gloo_group(dist: Any, key: tuple[int, tuple[int, ...]]) -> None:
    entry = _GLOO_GROUPS.get(key)
    if entry is None:  # the world was destroyed and re-created since: nothing of ours is left
        return
    entry.users -= 1
    if entry.users > 0:
        return
    del _GLOO_GROUPS[key]
    if dist.is_initialized() and entry.world is dist.group.WORLD:
        try:
            dist.destroy_process_group(entry.group)  # local: closes this rank's sockets and threads
        except (RuntimeError, ValueError):  # already destroyed by the application
            pass


def cached_gloo_groups() -> int:
    """How many shadow gloo groups TorchExchange holds open right now (tests check it returns to 0)."""
    return len(_GLOO_GROUPS)


class TorchExchange:
    """``Exchange`` over torch.distributed.

    Bytes travel as CPU uint8 tensors over gloo: when ``group`` (default: world) has no CPU backend
    (plain NCCL), a gloo group with the same members is created, collectively, and shared with the
    other open TorchExchanges over the same ranks.  ``close()`` (or leaving a ``with`` block) gives it
    back; the last user destroys it.  Open and close TorchExchanges in the same order on every rank.
    Variable-length data: the lengths are all-gathered first, then padded uint8 buffers.
    """

    def __init__(self, group: Any = None):
        import torch.distributed as dist

        if not dist.is_available() or not dist.is_initialized():
            raise EPConfigError(
                "group", group, "torch.distributed is not initialised; call ep_comm.init_distributed() first"
            )
        self._dist = dist
        self.group = group
        self._cpu_group, self._key = _acquire_gloo_group(dist, group)
        self._closed = False
        self.rank: int = dist.get_rank(self._cpu_group)
        self.size: int = dist.get_world_size(self._cpu_group)
        if group is not None and self.rank != dist.get_rank(group):
            # both groups list the same global ranks in ascending order, so this cannot differ
            # unless torch changed how it numbers group ranks
            self.close()
            raise EPError(f"gloo shadow group numbers this rank {self.rank}, the group {dist.get_rank(group)}")

    def allgather_bytes(self, data: bytes) -> list[bytes]:
        """All-gather one byte string per rank (lengths may differ)."""
        self._check_open()

        def gather(t):
            outs = [t.new_empty(t.shape) for _ in range(self.size)]
            self._dist.all_gather(outs, t, group=self._cpu_group)
            return outs

        return allgather_bytes_via(gather, data)

    def barrier(self) -> None:
        self._check_open()
        self._dist.barrier(group=self._cpu_group)

    def close(self) -> None:
        """Give back the shadow gloo group (destroyed with its last user).  Idempotent, not collective."""
        if self._closed:
            return
        self._closed = True
        if self._key is not None:
            _release_gloo_group(self._dist, self._key)

    def __enter__(self) -> TorchExchange:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def _check_open(self) -> None:
        if self._closed:
            raise EPError("TorchExchange is closed")

    def __repr__(self) -> str:
        return f"TorchExchange(rank={self.rank}, size={self.size})"


class MPIExchange:
    """``Exchange`` over an mpi4py communicator (default ``MPI.COMM_WORLD``); mpi4py is imported lazily."""

    def __init__(self, comm: Any = None):
        try:
            from mpi4py import MPI
        except ImportError as exc:
            raise EPConfigError(
                "exchange", "mpi4py", "mpi4py is not installed (pip install mpi4py), or use torch.distributed"
            ) from exc
        self.comm = MPI.COMM_WORLD if comm is None else comm
        self.rank: int = int(self.comm.Get_rank())
        self.size: int = int(self.comm.Get_size())

    def allgather_bytes(self, data: bytes) -> list[bytes]:
        """All-gather one byte string per rank (lengths may differ)."""
        return [bytes(x) for x in self.comm.allgather(bytes(data))]

    def barrier(self) -> None:
        self.comm.Barrier()

    def __repr__(self) -> str:
        return f"MPIExchange(rank={self.rank}, size={self.size})"


_WORLD_SIZE_VARS = ("WORLD_SIZE", "OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "SLURM_NTASKS")


def exchange_from(obj: Any = None) -> Exchange:
    """Turn ``obj`` into an ``Exchange``.

    - ``None``: the torch.distributed world if it is initialised, else a single-process group (and an
      ``EPConfigError`` if the launcher says the job has more than one rank: a silent group of one
      there would make every rank think it is alone).
    - a torch ``ProcessGroup``: ``TorchExchange(obj)``; an mpi4py communicator: ``MPIExchange(obj)``;
      anything with ``rank``, ``size``, ``allgather_bytes`` and ``barrier``: returned as is.

    An exchange made here (``obj`` is not already an Exchange) belongs to the caller, who closes it
    with ``close_exchange`` once done, at the same point on every rank.
    """
    if obj is None:
        try:
            import torch.distributed as dist

            initialised = dist.is_available() and dist.is_initialized()
        except ImportError:
            initialised = False
        if initialised:
            return TorchExchange()
        for var in _WORLD_SIZE_VARS:
            raw = os.environ.get(var, "")
            if raw.isdigit() and int(raw) > 1:
                raise EPConfigError(
                    "group", None,
                    f"{var}={raw} but torch.distributed is not initialised; call ep_comm.init_distributed() "
                    "first or pass an mpi4py communicator",
                )
        return LocalExchange()
    if isinstance(obj, Exchange):
        return obj
    if type(obj).__module__.startswith("mpi4py"):
        return MPIExchange(obj)
    try:
        import torch.distributed as dist

        if dist.is_available() and isinstance(obj, dist.ProcessGroup):
            return TorchExchange(obj)
    except ImportError:
        pass
    raise EPConfigError(
        "group", obj, "expected None, a torch.distributed ProcessGroup, an mpi4py communicator or an Exchange"
    )


def close_exchange(ex: Any) -> None:
    """Close ``ex`` if it has a ``close`` (a TorchExchange does; MPI and local exchanges hold nothing)."""
    close = getattr(ex, "close", None)
    if callable(close):
        close()
