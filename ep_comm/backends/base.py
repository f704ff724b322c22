"""The one backend interface: everything ``Communicator`` asks of a transport.

A backend is created collectively over a communicator's group (``create``), after every rank found
it available (``availability``, a local check with no communication).  Each call reaches the backend
on every rank, in the same order, as a ``DispatchCall`` or ``CombineCall``; a call whose input failed
the communicator's public checks still reaches it, carrying the error, so that the backend can tell
its peers in its own way (the collective family through its host agreement, the one-sided family by
an abort signal) and then raise it.  Whatever else a family needs per call (agreement, id checks,
error polling) happens inside ``dispatch`` and ``combine``.
"""
from __future__ import annotations

import abc
import dataclasses
from typing import Callable, ClassVar, Optional

import torch
import torch.distributed as dist

from ..config import EPConfig
from ..distributed.control import ControlPlane
from ..distributed.topology import Topology
from ..layouts import Dispatched

#: launches the receive half of a call made with a receive hook, on the current stream
ReceiveHalf = Callable[[], None]


def capturing_graph(device: torch.device) -> bool:
    """Whether the current stream of ``device`` is capturing a CUDA graph: no host round trip, no
    synchronisation and static sizes until the capture ends."""
    return device.type == "cuda" and torch.cuda.is_current_stream_capturing()


@dataclasses.dataclass(frozen=True)
class BackendContext:
    """Everything a backend may use; built once per communicator."""

    cfg: EPConfig
    group: Optional[dist.ProcessGroup]
    control: ControlPlane
    topology: Topology
    rank: int
    world_size: int
    device: torch.device

    @property
    def num_local_experts(self) -> int:
        return self.cfg.num_experts // self.world_size

    @property
    def capacity(self) -> int:
        return self.cfg.max_tokens_per_rank * self.world_size


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
        """Release what ``create`` allocated.  Not collective unless the backend says so."""

    @abc.abstractmethod
    def dispatch_input_buffer(self) -> Optional[torch.Tensor]:
        """With ``capabilities.zero_copy``: ``[max_tokens_per_rank, hidden]`` rows dispatch sends from
        where they lie; None otherwise."""

    @abc.abstractmethod
    def expert_output_buffer(self, dispatched: Dispatched) -> Optional[torch.Tensor]:
        """With ``capabilities.combine_in_place``: the rows combine reads in place; None otherwise."""
