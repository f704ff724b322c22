"""The backend protocols: the whole contract between ``Communicator`` and a transport.

A collective backend (``Backend``) receives already-validated, already-sanitised inputs
(``RoutedBatch``) after the host control plane agreed on the call, and returns a ``Dispatched`` in the
layout the config asks for; ``combine`` gets a validated ``expert_out``.  A kernel backend
(``KernelBackend``, ``kernel = True``) gets the caller's raw tensors after the generic checks: it
merges duplicates, drops invalid ids and quantises inside its kernels, makes no host round trip to
peers, and reports peers' problems through a device error record (``poll_errors``/``check_errors``).
Availability is a local, side-effect-free check; the communicator agrees on it across ranks.
"""
from __future__ import annotations

import dataclasses
from typing import ClassVar, Optional, Protocol, Sequence

import torch
import torch.distributed as dist

from ..config import EPConfig
from ..distributed.control import ControlPlane
from ..distributed.topology import Topology
from ..layouts import Dispatched


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
    error_flags: torch.Tensor  # int64 [NUM_FLAGS] on device; counts problems seen without host sync

    @property
    def num_local_experts(self) -> int:
        return self.cfg.num_experts // self.world_size

    @property
    def capacity(self) -> int:
        return self.cfg.max_tokens_per_rank * self.world_size


# indices into BackendContext.error_flags
FLAG_INVALID_IDS = 0  # out-of-range expert ids dropped while capturing a CUDA graph
FLAG_EPOCH_MISMATCH = 1  # a peer's data carried another (op, epoch) than ours
FLAG_TOKEN_OVERFLOW = 2  # a peer claimed more tokens than max_tokens_per_rank
NUM_FLAGS = 4


@dataclasses.dataclass
class RoutedBatch:
    """One rank's dispatch input after validation, routing guard and quantisation.

    ``x [T, W]`` payload (any dtype, row-contiguous), ``x_scales [T, S]`` or None, ``topk_ids [T, k]``
    int32/int64 global ids, -1 or valid, ``topk_weights [T, k]`` float32.  ``merged``: duplicates are
    already merged (weights summed into the first slot, 0 on -1 slots); when False (eager collective
    calls) the receiver merges them while it selects its pairs.  ``peer_tokens`` holds every rank's T
    when the control plane exchanged it (eager mode) and None while capturing a CUDA graph (sizes must
    then be static).
    """

    x: torch.Tensor
    x_scales: Optional[torch.Tensor]
    topk_ids: torch.Tensor
    topk_weights: torch.Tensor
    epoch: int
    peer_tokens: Optional[Sequence[int]]
    merged: bool = True

    @property
    def num_tokens(self) -> int:
        return self.x.shape[0]


@dataclasses.dataclass(frozen=True)
class Capabilities:
    """What a backend instance offers beyond dispatch/combine (``Communicator.capabilities``).

    ``layouts``: the output layouts it emits (every backend emits both); ``recv_hooks``: dispatch and
    combine take ``return_recv_hook=True``; ``zero_copy``: ``dispatch_input_buffer`` /
    ``expert_output_buffer`` hand out views of the communicator's own buffer; ``graph_capture``:
    dispatch+combine can be captured in a CUDA graph (on a CUDA device).
    """

    layouts: tuple[str, ...] = ("standard", "batched")
    recv_hooks: bool = False
    zero_copy: bool = False
    graph_capture: bool = True


@dataclasses.dataclass(frozen=True)
class Availability:
    ok: bool
    reason: str = ""


class Backend(Protocol):
    name: ClassVar[str]
    #: True when the backend moves data with device kernels and never syncs the host in dispatch/combine
    graph_capturable: ClassVar[bool]

    @classmethod
    def availability(cls, ctx: BackendContext) -> Availability:
        """Whether this rank can run the backend (local check, no communication)."""

    @classmethod
    def create(cls, ctx: BackendContext) -> "Backend":
        """Collective over the group: allocate buffers, exchange handles."""

    def dispatch(self, batch: RoutedBatch) -> Dispatched: ...

    def combine(self, expert_out: torch.Tensor, dispatched: Dispatched, out: torch.Tensor) -> torch.Tensor:
        """Write ``[T, hidden]`` into ``out`` (cfg.dtype) and return it."""

    def close(self) -> None: ...


class KernelBackend(Protocol):
    name: ClassVar[str]
    graph_capturable: ClassVar[bool]
    kernel: ClassVar[bool]  # True
    num_sms: int

    @classmethod
    def availability(cls, ctx: BackendContext) -> Availability: ...

    @classmethod
    def create(cls, ctx: BackendContext) -> "KernelBackend": ...

    def check_inputs(self, x: torch.Tensor, x_scales: Optional[torch.Tensor]) -> None:
        """Backend-specific limits beyond the generic validation (raise ``EPInputError``)."""

    def start_id_check(self, topk_ids: torch.Tensor) -> None:
        """Queue a check that every id is in [-1, num_experts) (eager validation); no synchronisation."""

    def id_check_passed(self) -> bool:
        """The queued check's answer: waits for that check only, not for work queued after it."""

    def dispatch(self, x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor,
                 x_scales: Optional[torch.Tensor], epoch: int, abandon_on_invalid: bool = False) -> Dispatched:
        """With ``abandon_on_invalid`` an out-of-range id makes the launch signal the peers an abort
        instead of its rows (the host checks the ids after launching and then raises)."""

    def abandoned_in_kernel(self, reason: BaseException) -> None:
        """A launch with ``abandon_on_invalid`` met invalid ids: it already told the peers; this rank's
        communicator is unusable from now on, as after ``abort``."""

    def combine(self, expert_out: torch.Tensor, dispatched: Dispatched, out: torch.Tensor) -> torch.Tensor: ...

    def abort(self, reason: BaseException) -> None:
        """End the peers' current call with an error naming this rank (this rank's input was bad)."""

    def poll_errors(self) -> None:
        """Before a call: raise a recorded peer problem, synchronising only when there is one."""

    def recoverable_pending(self) -> bool:
        """Whether an earlier call dropped invalid ids (no synchronisation); raised after the next launch."""

    def check_errors(self) -> None:
        """Synchronise and raise whatever the device recorded."""

    def close(self) -> None: ...
