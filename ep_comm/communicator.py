"""``Communicator``: configuration, backend choice, call numbering, the public input checks and the
receive hooks; everything a transport does is its backend's (``ep_comm.backends``)."""
from __future__ import annotations

import contextlib
import dataclasses
from typing import Any, Callable, Iterable, Iterator, Literal, Optional, Union, overload

import torch
import torch.distributed as dist

from .backends import BackendContext, Capabilities, CombineCall, DispatchCall
from .backends.base import ReceiveHalf
from .backends.choice import create_backend
from .config import EPConfig
from .distributed.bootstrap import init_distributed
from .distributed.control import ControlPlane
from .errors import EPConfigError, EPError, EPInputError, EPTimeoutError
from .layouts import Dispatched
from .validation import InputChecks


class Communicator:
    """Expert-parallel dispatch/combine over a process group.  Creating one is collective.

    Attributes: ``rank``, ``world_size``, ``num_local_experts`` (L), ``backend`` (resolved name),
    ``capacity`` (= max_tokens_per_rank × world_size, rows per expert in the batched layout),
    ``capabilities`` (what the backend offers: receive hooks, zero copy, ...), ``num_sms`` (SMs the
    kernel backends use, None for the collective ones), ``active_ranks`` (the ranks still in: all of
    them until ``shrink``).  After a shrink ``rank`` and ``world_size`` keep their original values
    (global numbering: expert ``e`` stays on rank ``e // L``).
    """

    def __init__(self, cfg: EPConfig, group: Optional[dist.ProcessGroup] = None,
                 device: Optional[torch.device] = None):
        """``device``: where tensors live; default the current CUDA device on an NCCL group, else the
        CPU.  A CUDA device on a gloo group lets the kernel backends run with a CPU-only bootstrap
        (e.g. several ranks sharing one GPU)."""
        if not isinstance(cfg, EPConfig):
            raise EPConfigError("cfg", type(cfg).__name__, "must be an ep_comm.EPConfig")
        if not dist.is_initialized():
            init_distributed(cfg.timeout_s)
        self.cfg = cfg
        self.group = group
        self.rank = dist.get_rank(group)
        self.world_size = dist.get_world_size(group)
        cfg.check_world(self.world_size)
        self.num_local_experts = cfg.num_experts // self.world_size
        self.capacity = cfg.capacity(self.world_size)
        self.device = _default_device(group) if device is None else torch.device(device)
        if self.device.type == "cuda" and self.device.index is None:
            self.device = torch.device("cuda", torch.cuda.current_device())
        self._checks = InputChecks(cfg, self.device)
        self._closed = True  # until fully built: close() and the calls refuse a half-made communicator
        self.control = ControlPlane(group, cfg.timeout_s)
        try:
            self.topology = self.control.topology(self.device.index)
            ctx = BackendContext(cfg=cfg, group=group, control=self.control, topology=self.topology, rank=self.rank,
                                 world_size=self.world_size, device=self.device)
            self.backend, self._impl, self.auto_skipped = create_backend(ctx, cfg.resolved_backend_request())
        except BaseException as exc:
            # a refused backend (raised alike on every rank) must not leave the gloo group behind
            self.control.close(f"creation failed: {type(exc).__name__}")
            raise
        self._ready(ctx)

    def _ready(self, ctx: BackendContext) -> None:
        """The per-backend state, once ``self._impl`` exists (creation and shrink)."""
        self._ctx = ctx
        self.active_ranks: tuple[int, ...] = ctx.active_ranks
        self.capabilities: Capabilities = self._impl.capabilities
        self.num_sms = self.capabilities.num_sms
        self._epoch = 0  # call number: the same on every rank, carried by every dispatch
        self._input_rows: Optional[torch.Tensor] = None  # dispatch_input_buffer where the backend has none
        self._pending_hook: Optional[RecvHook] = None
        self._lost: set[int] = set()  # ranks the last EPTimeoutError of a call named as lost
        self._shrink_attempts = 0
        self._closed = False

    # -- public API ----------------------------------------------------------------------------------
    @overload
    def dispatch(self, x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor,
                 x_scales: Optional[torch.Tensor] = ..., return_recv_hook: Literal[False] = ...) -> Dispatched: ...

    @overload
    def dispatch(self, x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor,
                 x_scales: Optional[torch.Tensor] = ..., *,
                 return_recv_hook: Literal[True]) -> tuple[Dispatched, RecvHook]: ...

    def dispatch(self, x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor,
                 x_scales: Optional[torch.Tensor] = None,
                 return_recv_hook: bool = False) -> Union[Dispatched, tuple[Dispatched, RecvHook]]:
        """Send each token to the ranks owning its experts.

        Args:
            x: ``[T, hidden]`` payload, ``0 <= T <= max_tokens_per_rank`` (any dtype when ``quant`` is
               None, e.g. packed NVFP4 as uint8 ``[T, hidden // 2]``; bf16/fp16/fp32 for ``quant="fp8"``).
            topk_ids: ``[T, top_k]`` int32/int64 global expert ids; -1 means no expert.
            topk_weights: ``[T, top_k]`` float32.
            x_scales: optional ``[T, S]`` carried unchanged (not with ``quant="fp8"``); with
                ``quant="nvfp4"`` the required float32 ``[1]`` global scale, the same on every rank
                (docs/design.md §5).
            return_recv_hook: backends with ``capabilities.recv_hooks`` (mnnvl, nvshmem): only issue the
                sends and return ``(Dispatched, hook)``; the tensors are filled once ``hook()`` has run
                on the stream (it launches the receive half).  Other work can run in between; the next
                call on this communicator must come after the hook.
        Returns:
            ``Dispatched`` in the configured layout (see ``ep_comm.layouts``), or ``(Dispatched, hook)``.
        Raises:
            ``EPInputError`` on every rank when any rank's input is invalid; ``EPTimeoutError`` naming
            the ranks that did not take part.
        """
        self._before_call(return_recv_hook)
        epoch, self._epoch = self._epoch, self._epoch + 1
        error = _checked(lambda: self._checks.dispatch(x, topk_ids, topk_weights, x_scales), "dispatch")
        with self._noting_losses():
            out, receive = self._impl.dispatch(DispatchCall(x, topk_ids, topk_weights, x_scales, epoch, error),
                                               return_recv_hook)
        out.owner = self
        return (out, self._new_hook(receive, "dispatch")) if return_recv_hook else out

    @overload
    def combine(self, expert_out: torch.Tensor, dispatched: Dispatched, out: Optional[torch.Tensor] = ...,
                return_recv_hook: Literal[False] = ...) -> torch.Tensor: ...

    @overload
    def combine(self, expert_out: torch.Tensor, dispatched: Dispatched, out: Optional[torch.Tensor] = ..., *,
                return_recv_hook: Literal[True]) -> tuple[torch.Tensor, RecvHook]: ...

    def combine(self, expert_out: torch.Tensor, dispatched: Dispatched, out: Optional[torch.Tensor] = None,
                return_recv_hook: bool = False) -> Union[torch.Tensor, tuple[torch.Tensor, RecvHook]]:
        """Bring expert outputs back to the tokens' ranks and reduce them (float32 accumulation).

        Args:
            expert_out: batched ``[L, capacity, hidden]`` unweighted expert outputs, or standard
                ``[N, hidden]`` rows already weighted and summed over this rank's experts.
            dispatched: what ``dispatch`` returned on this rank for the same call.
            out: optional ``[T, hidden]`` tensor of ``cfg.dtype`` to write into.
            return_recv_hook: as in ``dispatch``: returns ``(out, hook)``; ``out`` holds the result once
                ``hook()`` has run on the stream.
        Returns:
            ``[T, hidden]`` of ``cfg.dtype``; tokens with no valid expert get zeros.  Or ``(out, hook)``.
        """
        self._before_call(return_recv_hook)

        def check() -> None:
            if not isinstance(dispatched, Dispatched) or dispatched.owner is not self:
                raise EPInputError("combine: `dispatched` must be the result of this communicator's dispatch")
            self._checks.combine(expert_out, dispatched, out)
        error = _checked(check, "combine")
        with self._noting_losses():
            result, receive = self._impl.combine(CombineCall(expert_out, dispatched, out, error), return_recv_hook)
        return (result, self._new_hook(receive, "combine")) if return_recv_hook else result

    def dispatch_input_buffer(self) -> torch.Tensor:
        """Where to write the next ``dispatch``'s ``x``: ``[max_tokens_per_rank, hidden]`` of ``cfg.dtype``.

        With ``zero_copy=True`` on the kernel backends (no fp8 quantisation) these are this rank's own
        rows of the receive buffer, row-strided, the same tensor every time: ``dispatch(buf[:T], ...)``
        sends the rows from where they lie and copies none of them (they become ``Dispatched.x``'s own
        rows).  Write them only after this rank's previous ``combine`` (stream order) and leave them
        until this dispatch's ``combine``; only the first T rows are read.  Elsewhere (fp8, other
        backends, no zero copy) it is a tensor of its own, also the same every time (dispatch has
        consumed it, in stream order, when it returns).
        """
        self._check_open()
        rows = self._impl.dispatch_input_buffer()
        if rows is None:
            if self._input_rows is None:
                self._input_rows = torch.empty(self.cfg.max_tokens_per_rank, self.cfg.hidden, dtype=self.cfg.dtype,
                                               device=self.device)
            rows = self._input_rows
        return rows

    def expert_output_buffer(self, dispatched: Dispatched) -> torch.Tensor:
        """Where the experts should write the ``expert_out`` of ``dispatched`` for ``combine``.

        With ``zero_copy=True`` on the kernel backends (peers reached over NVLink, prefill sizes),
        combine reads every rank's expert outputs in place, the peers' ones included: this returns that
        region of the communicator's buffer, ``[N, hidden]`` of ``cfg.dtype`` (standard layout), the
        same tensor on every call.  Pass it to ``combine`` once written and combine copies nothing; any
        other ``expert_out`` is first copied there.  Write it only after this rank's previous
        ``combine`` (stream order); it must not be changed until this ``combine`` has run.  Elsewhere
        this is a new tensor of ``expert_out``'s shape and ``cfg.dtype``, so the same code runs on every
        backend.
        """
        self._check_open()
        if not isinstance(dispatched, Dispatched) or dispatched.owner is not self:
            raise EPInputError("expert_output_buffer: `dispatched` must be the result of this communicator's dispatch")
        rows = self._impl.expert_output_buffer(dispatched)
        if rows is not None:
            return rows
        shape = (tuple(dispatched.x.shape[:2]) if dispatched.layout == "batched" else (dispatched.x.shape[0],))
        return torch.empty(*shape, self.cfg.hidden, dtype=self.cfg.dtype, device=self.device)

    def check_errors(self) -> None:
        """Raise for problems counted on the device without a host sync (CUDA-graph replays, ids dropped
        with ``validate_ids=False``, and every call of a kernel backend: timeouts, peers on another
        call, peers' invalid input).  Synchronises the device and resets the counts (a timeout or a
        mismatch stays: the communicator cannot be used after it)."""
        self._check_open()
        with self._noting_losses():  # the kernel backends report most timeouts here
            self._impl.check_errors()

    @contextlib.contextmanager
    def _noting_losses(self) -> Iterator[None]:
        """Remember the ``lost_ranks`` of an ``EPTimeoutError`` raised inside: what ``shrink()`` drops
        by default."""
        try:
            yield
        except EPTimeoutError as exc:
            self._lost.update(exc.lost_ranks)
            raise

    def shrink(self, lost_ranks: Optional[Iterable[int]] = None) -> Communicator:
        """A communicator over the survivors after ranks were lost, in the same processes; collective
        over the survivors only: nothing waits on a lost rank or runs a collective that includes it.

        Args:
            lost_ranks: ranks to drop (this communicator's numbering).  Default: the ranks it knows are
                gone: the ``lost_ranks`` of the ``EPTimeoutError`` its calls raised, and the peers its
                control plane finds gone now (process exited on this machine, or closed its end for a
                reason of its own).  Every survivor must drop the same set.
        Returns:
            A ``Communicator`` with the same ``EPConfig``, backend, ``rank``, ``world_size``,
            ``num_local_experts`` and ``capacity`` (global expert ids: expert ``e`` stays on rank
            ``e // L``), and ``active_ranks`` without the lost ranks.  Experts of inactive ranks get no
            tokens and contribute nothing to ``combine``; every ``dispatch`` counts the (token, expert)
            pairs of this rank's tokens that went to them in ``Dispatched.inactive_pairs``.  This
            communicator is closed (without waiting on anyone); it may already be closed.  Shrinking
            the result again after another loss works the same way.
        Raises:
            ``EPError`` when no lost rank is given or known, one is not active or is this rank; when
            the backend cannot shrink (the base ``Backend.shrink``); when the rendezvous store was
            hosted by a lost rank and the survivors span several hosts (``ControlPlane.shrink``: on one
            host they meet in a file store).  ``EPTimeoutError`` when a survivor does not join within
            2 × ``timeout_s`` + 5 s (a survivor may still be in the failed call for ``timeout_s``; or
            the survivors named different lost ranks).  On any failure this
            communicator is left as it was, so ``shrink`` can be tried again.
        """
        if not hasattr(self, "_impl"):
            raise EPError("shrink: the communicator was never fully created")
        lost = self._ranks_to_drop(lost_ranks)
        attempt, self._shrink_attempts = self._shrink_attempts, self._shrink_attempts + 1
        plane = self.control.shrink(lost, attempt)
        try:
            ctx = dataclasses.replace(self._ctx, group=plane.gloo_group("data"), control=plane,
                                      topology=plane.topology(self.device.index), active_ranks=tuple(plane.labels))
            impl = self._impl.shrink(ctx)
        except BaseException as exc:
            plane.close(f"shrink failed: {type(exc).__name__}: {exc}", because_of=lost)
            raise
        new = Communicator.__new__(Communicator)
        new.cfg, new.group, new.rank, new.world_size = self.cfg, ctx.group, self.rank, self.world_size
        new.num_local_experts, new.capacity, new.device = self.num_local_experts, self.capacity, self.device
        new._checks, new.control, new.topology = self._checks, plane, ctx.topology
        new.backend, new._impl, new.auto_skipped = self.backend, impl, self.auto_skipped
        new._ready(ctx)
        self._close(f"shrunk to ranks {list(plane.labels)}", because_of=lost)
        return new

    def _ranks_to_drop(self, lost_ranks: Optional[Iterable[int]]) -> list[int]:
        if lost_ranks is None:
            lost = set(self._lost) | set(self.control.lost_peers())
            if not lost:
                raise EPError(f"rank {self.rank}: shrink: no rank is known to be lost (none named by an "
                              "EPTimeoutError of this communicator, none found gone now); pass lost_ranks")
        else:
            lost = {int(r) for r in lost_ranks}
            if not lost:
                raise EPError(f"rank {self.rank}: shrink: lost_ranks is empty")
        inactive = sorted(lost - set(self.active_ranks))
        if inactive:
            raise EPError(f"rank {self.rank}: shrink: rank(s) {inactive} are not active (active: "
                          f"{list(self.active_ranks)})")
        if self.rank in lost:
            raise EPError(f"rank {self.rank}: shrink: a rank cannot drop itself (lost ranks {sorted(lost)})")
        return sorted(lost)

    def close(self, reason: str = "closed") -> None:
        """Release backend resources and the control plane's groups.  Idempotent; not collective.

        A peer still waiting in a call on this communicator fails at once with an ``EPTimeoutError``
        that names this rank and quotes ``reason``.
        """
        self._close(reason)

    def _close(self, reason: str, because_of: Iterable[int] = ()) -> None:
        """``close``; ``because_of``: ranks this rank leaves because they were lost (peers then name
        them, not this rank, as the cause)."""
        if self._closed:
            return
        self._closed = True
        try:
            self._impl.close()
        finally:
            self.control.close(reason, because_of=because_of)

    def __enter__(self) -> Communicator:
        return self

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        self.close("closed" if exc is None else f"closed after {type(exc).__name__}: {exc}")

    def __repr__(self) -> str:
        return (f"Communicator(backend={self.backend!r}, rank={self.rank}, world_size={self.world_size}, "
                f"layout={self.cfg.layout!r}, num_local_experts={self.num_local_experts}"
                + ("" if len(self.active_ranks) == self.world_size else f", active_ranks={list(self.active_ranks)}")
                + ")")

    # -- helpers -------------------------------------------------------------------------------------
    def _before_call(self, return_recv_hook: bool) -> None:
        self._check_open()
        if return_recv_hook and not self.capabilities.recv_hooks:
            raise EPConfigError("return_recv_hook", True, f"backend {self.backend!r} does not split send and "
                                "receive; the kernel backends 'mnnvl' and 'nvshmem' do")
        if self._pending_hook is not None:
            raise EPError(f"rank {self.rank}: the receive hook of the previous {self._pending_hook.what} has not "
                          "run; call it before the next dispatch/combine on this communicator (overlap two "
                          "micro-batches with two communicators)")

    def _new_hook(self, receive: Optional[ReceiveHalf], what: str) -> RecvHook:
        if receive is None:
            raise EPError(f"backend {self.backend!r} returned no receive half for a {what} with a receive hook")
        self._pending_hook = RecvHook(self, receive, what)
        return self._pending_hook

    def _check_open(self) -> None:
        if self._closed:
            raise EPError("communicator is closed")


class RecvHook:
    """The receive half of a call made with ``return_recv_hook=True``: calling it launches the half on
    the current stream (once; under CUDA-graph capture it is captured like any launch)."""

    def __init__(self, comm: Communicator, receive: ReceiveHalf, what: str):
        self._comm, self._receive, self.what, self._done = comm, receive, what, False

    def __call__(self) -> None:
        if self._done:
            raise EPError(f"the receive hook of this {self.what} already ran")
        self._comm._check_open()
        self._done = True
        if self._comm._pending_hook is self:
            self._comm._pending_hook = None
        self._receive()


def _default_device(group: Optional[dist.ProcessGroup]) -> torch.device:
    if dist.get_backend(group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _checked(check: Callable[[], None], op: str) -> Optional[EPError]:
    """The error ``check()`` raises, typed (``EPInputError`` for anything not already an ``EPError``)."""
    try:
        check()
    except Exception as exc:  # noqa: BLE001 - whatever it is, every rank must learn of it
        if isinstance(exc, EPError):
            return exc
        typed = EPInputError(f"invalid {op} input: {exc!r}")
        typed.__cause__ = exc
        return typed
    return None
