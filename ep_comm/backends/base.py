"""The one backend interface: everything ``Communicator`` asks of a transport.

A backend is created collectively over a communicator's group (``create``), after every rank found
it available (``availability``, a local check with no communication).  Each call reaches the backend
on every rank, in the same order, as a ``DispatchCall`` or ``CombineCall``; a call whose input failed
the communicator's public checks still reaches it, carrying the error, so that the backend can tell
its peers in its own way (the collective family through its host agreement, the one-sided family by
an abort signal) and then raise it.  Whatever else a family needs per call (agreement, id checks,
error polling) happens inside ``dispatch`` and ``combine``.

Shrinking (``Communicator.shrink``, after a rank is lost): the communicator forms, over the survivors
only and without any exchange with the lost ranks, a new ``ControlPlane`` (``ControlPlane.shrink``)
and a ``BackendContext`` for them, then calls ``Backend.shrink(ctx)`` on the old backend, which returns
the backend the new communicator uses (the old one is closed right after, ``close()``, which must not
wait on any peer).  What a family gets in that ``ctx``:

* ``cfg``, ``device``: unchanged.  ``rank``: this rank's communicator rank, unchanged;
  ``world_size``: the communicator's original size, unchanged, so ``num_local_experts``,
  ``capacity`` and the expert placement stay as they were (expert ``e`` is owned by rank
  ``e // num_local_experts``: ``owner_of``).
* ``active_ranks``: the communicator ranks still in, ascending; ``group_rank``/``group_size``: this
  rank's index in it and its length (the rank and size the survivors' transport uses);
  ``expert_active``: bool ``[num_experts]`` on ``device``, False for the experts of lost ranks (their
  tokens' pairs are dropped, and counted: ``routing.count_inactive_pairs``); ``is_full``.
* ``control``: the survivors' ``ControlPlane``: ``rank``/``size`` are ``group_rank``/``group_size``,
  ``labels`` maps them to communicator ranks; ``barrier()``, ``allgather_bytes(bytes)``,
  ``gather_objects(obj)``, ``agree_start`` and ``lost_peers()`` reach the survivors only, and its
  ``EPTimeoutError`` name communicator ranks.  ``control.store`` is a store prefix private to it.
* ``group``: a gloo process group over the survivors (``control.gloo_group("data")``), ranked by
  ``group_rank``.  It is not in torch's group table: call its own methods (``allgather``,
  ``allreduce``, ``broadcast`` with group ranks; ``collective.collectives`` shows how).  Never
  ``None`` (which would mean the world, lost ranks included).  For CUDA tensors a family makes an
  NCCL group over the survivors instead (``control.nccl_group(name, device)``, the same kind of
  object; the collective family does, after aborting its old one).
* ``topology``: the survivors' ``Topology`` (indexed by ``group_rank``).

A family that cannot shrink keeps the base ``Backend.shrink``, which raises ``EPError``; the
communicator then stays closed and the caller must start over.
"""
from __future__ import annotations

import abc
import dataclasses
import functools
from typing import Callable, ClassVar, Optional

import torch
import torch.distributed as dist

from ..config import EPConfig
from ..distributed.control import ControlPlane
from ..distributed.topology import Topology
from ..errors import EPError
from ..layouts import Dispatched

#: launches the receive half of a call made with a receive hook, on the current stream
ReceiveHalf = Callable[[], None]


def capturing_graph(device: torch.device) -> bool:
    """Whether the current stream of ``device`` is capturing a CUDA graph: no host round trip, no
    synchronisation and static sizes until the capture ends."""
    return device.type == "cuda" and torch.cuda.is_current_stream_capturing()


@dataclasses.dataclass(frozen=True)
class BackendContext:
    """Everything a backend may use; built once per communicator (and once per shrink: see the module
    docstring).

    ``rank``/``world_size``: communicator rank and the communicator's original size (expert placement:
    ``num_local_experts`` experts per rank, contiguous).  ``active_ranks``: the communicator ranks still
    in (empty: all of them).  ``group``/``control`` span the active ranks only, ranked by ``group_rank``.
    """

    cfg: EPConfig
    group: Optional[dist.ProcessGroup]
    control: ControlPlane
    topology: Topology
    rank: int
    world_size: int
    device: torch.device
    active_ranks: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        if not self.active_ranks:
            object.__setattr__(self, "active_ranks", tuple(range(self.world_size)))
        active = self.active_ranks
        if list(active) != sorted(set(active)) or active[0] < 0 or active[-1] >= self.world_size:
            raise EPError(f"active_ranks {active} must be ascending distinct ranks of [0, {self.world_size})")
        if self.rank not in active:
            raise EPError(f"rank {self.rank} is not among the active ranks {active}")

    @property
    def num_local_experts(self) -> int:
        return self.cfg.num_experts // self.world_size

    @property
    def capacity(self) -> int:
        return self.cfg.max_tokens_per_rank * self.world_size

    @property
    def is_full(self) -> bool:
        """Every rank of the original communicator is active (no shrink happened)."""
        return len(self.active_ranks) == self.world_size

    @property
    def group_rank(self) -> int:
        """This rank's index among ``active_ranks``: its rank in ``group`` and ``control``."""
        return self.active_ranks.index(self.rank)

    @property
    def group_size(self) -> int:
        """Number of active ranks: the size of ``group`` and ``control``."""
        return len(self.active_ranks)

    def owner_of(self, expert: int) -> int:
        """Communicator rank owning global expert ``expert`` (contiguous blocks), active or not."""
        return expert // self.num_local_experts

    @functools.cached_property
    def expert_active(self) -> torch.Tensor:
        """bool ``[num_experts]`` on ``device``: True where the expert's owner is active (made once)."""
        owners = torch.arange(self.cfg.num_experts) // self.num_local_experts
        active = torch.zeros(self.world_size, dtype=torch.bool)
        active[list(self.active_ranks)] = True
        return active[owners].to(self.device)


@dataclasses.dataclass(frozen=True)
class Availability:
    ok: bool
    reason: str = ""


@dataclasses.dataclass(frozen=True)
class Capabilities:
    """What a backend instance offers beyond dispatch/combine (``Communicator.capabilities``).

    ``layouts``: the output layouts it emits (every backend emits both).  ``recv_hooks``: dispatch and
    combine take ``return_recv_hook=True``.  ``zero_copy``: ``dispatch_input_buffer`` hands out rows
    of the communicator's own buffer, which dispatch sends from where they lie.  ``combine_in_place``:
    combine reads ``expert_output_buffer`` in place.  ``graph_capture``: dispatch+combine can be
    captured in a CUDA graph (on a CUDA device).  ``num_sms``: SMs the kernels run on (None: the
    backend launches no kernels of its own with a fixed grid).  ``host_agreement``: how eager calls
    agree with the peers on the host ("shared memory", "gloo", "none" for one rank), None where calls
    make no host round trip.
    """

    layouts: tuple[str, ...] = ("standard", "batched")
    recv_hooks: bool = False
    zero_copy: bool = False
    combine_in_place: bool = False
    graph_capture: bool = True
    num_sms: Optional[int] = None
    host_agreement: Optional[str] = None


@dataclasses.dataclass
class DispatchCall:
    """One rank's part of a dispatch, as the caller passed it.

    ``x [T, W]``, ``topk_ids [T, k]`` int32/int64 global ids, ``topk_weights [T, k]`` float32,
    ``x_scales [T, S]`` or None (shapes hold only when ``error`` is None).  ``epoch``: the
    communicator's call number, the same on every rank.  ``error``: why the communicator's public
    checks refused this rank's input, or None.
    """

    x: torch.Tensor
    topk_ids: torch.Tensor
    topk_weights: torch.Tensor
    x_scales: Optional[torch.Tensor]
    epoch: int
    error: Optional[BaseException] = None


@dataclasses.dataclass
class CombineCall:
    """One rank's part of a combine: ``expert_out`` in ``dispatched``'s layout, and ``out`` ``[T, hidden]``
    of ``cfg.dtype`` to write (None: the backend allocates it).  ``error`` as in ``DispatchCall``."""

    expert_out: torch.Tensor
    dispatched: Dispatched
    out: Optional[torch.Tensor]
    error: Optional[BaseException] = None


class Backend(abc.ABC):
    """A transport behind ``Communicator``.  Subclasses set ``name`` and implement every method."""

    name: ClassVar[str]

    @classmethod
    @abc.abstractmethod
    def availability(cls, ctx: BackendContext) -> Availability:
        """Whether this rank can run the backend (local check, no communication)."""

    @classmethod
    @abc.abstractmethod
    def create(cls, ctx: BackendContext) -> Backend:
        """Collective over the group: allocate buffers, exchange handles."""

    @property
    @abc.abstractmethod
    def capabilities(self) -> Capabilities: ...

    @abc.abstractmethod
    def dispatch(self, call: DispatchCall, recv_hook: bool) -> tuple[Dispatched, Optional[ReceiveHalf]]:
        """The ``Dispatched`` in the configured layout, and with ``recv_hook`` the receive half (the
        tensors are filled once it has run); raises ``call.error`` on this rank after telling the peers."""

    @abc.abstractmethod
    def combine(self, call: CombineCall, recv_hook: bool) -> tuple[torch.Tensor, Optional[ReceiveHalf]]:
        """``[T, hidden]`` of ``cfg.dtype`` (``call.out`` when given), and with ``recv_hook`` the receive half."""

    @abc.abstractmethod
    def check_errors(self) -> None:
        """Synchronise and raise what was counted on the device without a host sync (graph replays,
        ids dropped with validation off, peers' problems seen by the kernels); reset the counts."""

    @abc.abstractmethod
    def close(self) -> None:
        """Release what ``create`` allocated.  Not collective unless the backend says so; after a lost
        rank (``shrink``) it must not wait on any peer."""

    def shrink(self, ctx: BackendContext) -> Backend:
        """The backend over the survivors described by ``ctx`` (module docstring: what it holds),
        called on every survivor after a rank was lost; collective over the survivors only (use
        ``ctx.control`` and ``ctx.group``, never the old ones, which include the lost rank).  ``self``
        is closed right after.  Experts of inactive ranks get no tokens; ``dispatch`` then sets
        ``Dispatched.inactive_pairs`` (``routing.count_inactive_pairs`` with ``ctx.expert_active``).
        The default raises ``EPError``: this backend cannot shrink."""
        raise EPError(f"backend {self.name} cannot shrink")

    @abc.abstractmethod
    def dispatch_input_buffer(self) -> Optional[torch.Tensor]:
        """With ``capabilities.zero_copy``: ``[max_tokens_per_rank, hidden]`` rows dispatch sends from
        where they lie; None otherwise."""

    @abc.abstractmethod
    def expert_output_buffer(self, dispatched: Dispatched) -> Optional[torch.Tensor]:
        """With ``capabilities.combine_in_place``: the rows combine reads in place; None otherwise."""
