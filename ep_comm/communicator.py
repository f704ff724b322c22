"""``Communicator``: validation, backend choice and the public dispatch/combine (docs/design.md §4-§7)."""
from __future__ import annotations

import os
import warnings
from typing import Callable, Optional

import torch
import torch.distributed as dist

from . import backends as _backends
from .backends import invalid_ids as _invalid_ids
from .config import EPConfig
from .distributed.bootstrap import init_distributed
from .distributed.control import OP_COMBINE, OP_DISPATCH, OP_NAMES, ControlPlane
from .errors import EPConfigError, EPError, EPInputError, EPTimeoutError, EPTopologyError
from .layouts import Dispatched
from .quant import quantize_fp8
from .routing import check_ids, sanitize_routing
from .backends.base import FLAG_EPOCH_MISMATCH, FLAG_INVALID_IDS, FLAG_TOKEN_OVERFLOW, NUM_FLAGS
from .validation import DroppedIds, InputChecks


def _group_device(group) -> torch.device:
    if dist.get_backend(group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _is_transport_error(exc: BaseException) -> bool:
    """A torch.distributed failure (peer gone, connection lost, collective timed out), not a bug."""
    if isinstance(exc, getattr(dist, "DistError", ())):
        return True
    text = str(exc).lower()
    return isinstance(exc, RuntimeError) and any(
        m in text for m in ("gloo", "nccl", "connection", "timed out", "broken pipe", "socket"))


class Communicator:
    """Expert-parallel dispatch/combine over a process group.  Creating one is collective.

    Attributes: ``rank``, ``world_size``, ``num_local_experts`` (L), ``backend`` (resolved name),
    ``capacity`` (= max_tokens_per_rank × world_size, rows per expert in the batched layout).
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
        self.device = _group_device(group) if device is None else torch.device(device)
        if self.device.type == "cuda" and self.device.index is None:
            self.device = torch.device("cuda", torch.cuda.current_device())
        self._checks = InputChecks(cfg, self.device)
        self._closed = True  # until fully built: close() and the calls refuse a half-made communicator
        self.control = ControlPlane(group, cfg.timeout_s)
        try:
            self.topology = self.control.topology(self.device.index)
            self._error_flags = torch.zeros(NUM_FLAGS, dtype=torch.int64, device=self.device)
            self._ctx = _backends.BackendContext(
                cfg=cfg, group=group, control=self.control, topology=self.topology, rank=self.rank,
                world_size=self.world_size, device=self.device, error_flags=self._error_flags,
            )
            self.backend, self._impl, self.auto_skipped = self._create_backend(cfg.resolved_backend_request())
        except BaseException as exc:
            # a refused backend (raised alike on every rank) must not leave the gloo group behind
            self.control.close(f"creation failed: {type(exc).__name__}")
            raise
        self._kernel = bool(getattr(self._impl, "kernel", False))
        self._dropped_ids = None if self._kernel else DroppedIds(self._error_flags, cfg.num_experts)
        self._invalid_ids = (None if self._kernel
                             else _invalid_ids.InvalidIdReport(self.world_size, cfg.num_experts, self.device))
        self.num_sms = getattr(self._impl, "num_sms", None)
        self.capabilities = _backends.Capabilities(recv_hooks=bool(getattr(self._impl, "recv_hooks", False)),
                                                   zero_copy=bool(getattr(self._impl, "zero_copy", False)))
        self._epoch = 0
        self._uncombined: Optional[int] = None  # zero_copy: the dispatch whose rows are still in use
        self._input_rows: Optional[torch.Tensor] = None  # dispatch_input_buffer off the kernels' zero copy
        self._pending_hook: Optional[RecvHook] = None
        self._closed = False

    # -- backend choice ------------------------------------------------------------------------------
    def _create_backend(self, requested: str):
        """``(name, backend, skipped)``.  Under ``auto`` a candidate whose creation fails alike on every
        rank with an ``EPError`` (NVSHMEM cannot start, say) gives way to the next; ``skipped`` says why."""
        *fallible, last = self._choose_backends(requested)
        skipped: list[str] = []
        for name in fallible:
            try:
                return name, _backends.get_backend(name).create(self._ctx), skipped
            except EPTimeoutError:
                raise  # a peer is missing: the next candidate would wait for it too
            except EPError as exc:
                skipped.append(f"{name}: {exc}")
                warnings.warn(f"ep_comm: backend='auto' skips {name!r}: {exc}", RuntimeWarning, stacklevel=3)
        return last, _backends.get_backend(last).create(self._ctx), skipped

    def _choose_backends(self, requested: str) -> list[str]:
        """Every rank reports what it can run and the settings every rank must share; all ranks get the
        same candidates (the requested backend, or every usable one in ``AUTO_ORDER``) or all raise."""
        local = _backends.local_availability(self._ctx)
        reports = self.control.gather_objects((local, _shared_settings(self.cfg, requested)))
        _check_shared_settings([s for _, s in reports])
        _backends.check_environment()  # (the same values on every rank now: every rank raises alike)
        everyone = [a for a, _ in reports]

        def blocker(name: str) -> str:
            # one entry per distinct reason: at 72 ranks the same reason must not be repeated 72 times
            by_reason: dict[str, list[int]] = {}
            for r, v in enumerate(everyone):
                if v.get(name, "unknown"):
                    by_reason.setdefault(v.get(name, "unknown"), []).append(r)
            return "; ".join(f"{_rank_list(ranks)}: {why}" for why, ranks in by_reason.items())

        if requested != "auto":
            why = blocker(requested)
            if why:
                usable = [n for n in _backends.registered() if not blocker(n)]
                raise EPTopologyError(f"backend {requested!r} cannot run on this group ({why}); usable: {usable}")
            return [requested]
        usable = [name for name in _backends.AUTO_ORDER if name in local and not blocker(name)]
        if usable:
            return usable
        raise EPTopologyError("no backend usable on every rank: " + "; ".join(f"{n}: {blocker(n)}" for n in local))

    # -- public API ----------------------------------------------------------------------------------
    def dispatch(
        self,
        x: torch.Tensor,
        topk_ids: torch.Tensor,
        topk_weights: torch.Tensor,
        x_scales: Optional[torch.Tensor] = None,
        return_recv_hook: bool = False,
    ) -> Dispatched:
        """Send each token to the ranks owning its experts.

        Args:
            x: ``[T, hidden]`` payload, ``0 <= T <= max_tokens_per_rank`` (any dtype when ``quant`` is
               None, e.g. packed NVFP4 as uint8 ``[T, hidden // 2]``; bf16/fp16/fp32 for ``quant="fp8"``).
            topk_ids: ``[T, top_k]`` int32/int64 global expert ids; -1 means no expert.
            topk_weights: ``[T, top_k]`` float32.
            x_scales: optional ``[T, S]`` carried unchanged (not with ``quant="fp8"``).
            return_recv_hook: kernel backends (mnnvl, nvshmem): only issue the sends and return
                ``(Dispatched, hook)``; the tensors are filled once ``hook()`` has run on the stream (it
                launches the receive half). Other work can run in between; the next call on this
                communicator must come after the hook.
        Returns:
            ``Dispatched`` in the configured layout (see ``ep_comm.layouts``), or ``(Dispatched, hook)``.
        """
        self._check_open()
        self._check_hooks(return_recv_hook)
        if self._kernel:
            return self._dispatch_kernel(x, topk_ids, topk_weights, x_scales, return_recv_hook)
        capturing = self._capturing()
        # Eager calls agree with the peers after the local work (pack) is queued: a local failure then
        # reaches the peers like an input error instead of leaving them inside the collective.  With
        # validate_ids the out-of-range ids go as -1 and their count rides in the packed header, so every
        # rank learns every rank's count from the gathered data and the host reads it at the end of the
        # call, with the whole dispatch queued (docs/design.md §10).
        late_check = not capturing and self.cfg.validate_ids
        error: Optional[BaseException] = None
        try:
            self._checks.dispatch(x, topk_ids, topk_weights, x_scales)
            if not capturing and not late_check:
                self._dropped_ids.raise_earlier()
        except Exception as exc:  # noqa: BLE001 - whatever it is, every rank must learn of it
            error = _input_error(exc, "dispatch")
        if error is not None:
            if not capturing:
                self._agree(OP_DISPATCH, self._epoch, 0, error)
            raise error
        num_invalid = None
        try:  # local work: it only reads this rank's inputs, so it is dropped if a peer reports an error
            if capturing:
                ids, weights, num_invalid_ids = sanitize_routing(topk_ids, topk_weights, self.cfg.num_experts)
                self._error_flags[FLAG_INVALID_IDS] += num_invalid_ids
            elif late_check:  # receivers merge duplicates; the count is answered after the gather
                (ids, num_invalid), weights = self._invalid_ids.drop(topk_ids), topk_weights
            else:  # no sync: out-of-range ids go as -1, counted for a later call to raise
                ids, weights = self._dropped_ids.drop(topk_ids), topk_weights
            if self.cfg.quant == "fp8":
                payload, scales = quantize_fp8(x)
            else:
                payload, scales = x.contiguous(), None if x_scales is None else x_scales.contiguous()
            batch = _backends.RoutedBatch(payload, scales, ids, weights, self._epoch, None, merged=capturing)
            prepared = self._impl.prepare_dispatch(batch, eager=not capturing, invalid_ids=num_invalid)
        except EPInputError as exc:
            if not capturing:
                self._agree(OP_DISPATCH, self._epoch, 0, exc)
            raise
        except BaseException as exc:
            if not capturing:
                _tell_peers(self._agree, OP_DISPATCH, self._epoch, exc)
            raise
        if not capturing:
            batch.peer_tokens = [p.num_tokens for p in self._agree(OP_DISPATCH, self._epoch, x.shape[0])]
        try:
            out = self._impl.dispatch(batch, prepared, self._invalid_ids if late_check else None)
        except Exception as exc:
            typed = self._transport_failure(OP_DISPATCH, self._epoch, exc, capturing)
            if typed is exc:
                raise
            raise typed from exc
        self._epoch += 1  # the exchange happened on every rank, whatever the answer below
        if late_check:
            bad = self._invalid_ids.invalid_ranks()
            if bad:  # every rank holds the same counts, so every rank raises here
                if self.rank in bad:
                    raise self._invalid_ids_error(topk_ids)
                raise EPInputError(f"invalid input on peer rank(s) {bad} (topk_ids outside [-1, num_experts="
                                   f"{self.cfg.num_experts}); the dispatch is not returned on any rank)")
        out.owner = self
        return out

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
        rows = getattr(self._impl, "dispatch_input_buffer", lambda: None)()
        if rows is None:
            if self._input_rows is None:
                self._input_rows = torch.empty(self.cfg.max_tokens_per_rank, self.cfg.hidden, dtype=self.cfg.dtype,
                                               device=self.device)
            rows = self._input_rows
        return rows

    def expert_output_buffer(self, dispatched: Dispatched) -> torch.Tensor:
        """Where the experts should write the ``expert_out`` of ``dispatched`` for ``combine``.

        With ``zero_copy=True`` on the kernel backends (peers reached over NVLink), combine reads every
        rank's expert outputs in place, the peers' ones included: this returns that region of the
        communicator's buffer, ``[N, hidden]`` of ``cfg.dtype`` (standard layout), the same tensor on
        every call.  Pass it to ``combine`` once written and combine copies nothing; any other
        ``expert_out`` is first copied there.  Write it only after this rank's previous ``combine``
        (stream order); it must not be changed until this ``combine`` has run.  Elsewhere this is a new
        tensor of ``expert_out``'s shape and ``cfg.dtype``, so the same code runs on every backend.
        """
        self._check_open()
        if not isinstance(dispatched, Dispatched) or dispatched.owner is not self:
            raise EPInputError("expert_output_buffer: `dispatched` must be the result of this communicator's dispatch")
        rows = getattr(self._impl, "expert_output_buffer", lambda d: None)(dispatched)
        if rows is not None:
            return rows
        shape = (tuple(dispatched.x.shape[:2]) if dispatched.layout == "batched" else (dispatched.x.shape[0],))
        return torch.empty(*shape, self.cfg.hidden, dtype=self.cfg.dtype, device=self.device)

    def combine(self, expert_out: torch.Tensor, dispatched: Dispatched, out: Optional[torch.Tensor] = None,
                return_recv_hook: bool = False) -> torch.Tensor:
        """Bring expert outputs back to the tokens' ranks and reduce them (float32 accumulation).

        Args:
            expert_out: batched ``[L, capacity, hidden]`` unweighted expert outputs, or standard
                ``[N, hidden]`` rows already weighted and summed over this rank's experts.
            dispatched: what ``dispatch`` returned on this rank for the same call.
            out: optional ``[T, hidden]`` tensor of ``cfg.dtype`` to write into.
            return_recv_hook: kernel backends (mnnvl, nvshmem): only issue the sends and return ``(out, hook)``;
                ``out`` holds the result once ``hook()`` has run on the stream.
        Returns:
            ``[T, hidden]`` of ``cfg.dtype``; tokens with no valid expert get zeros. Or ``(out, hook)``.
        """
        self._check_open()
        self._check_hooks(return_recv_hook)
        if self._kernel:
            return self._combine_kernel(expert_out, dispatched, out, return_recv_hook)
        capturing = self._capturing()
        error: Optional[BaseException] = None
        try:
            if not isinstance(dispatched, Dispatched) or dispatched.owner is not self:
                raise EPInputError("combine: `dispatched` must be the result of this communicator's dispatch")
            self._checks.combine(expert_out, dispatched, out)
        except Exception as exc:  # noqa: BLE001 - whatever it is, every rank must learn of it
            error = _input_error(exc, "combine")
        if error is not None:
            if not capturing:
                self._agree(OP_COMBINE, -1, 0, error)
            raise error
        try:  # the partial sums are local work: agreed on after it, as in dispatch
            if out is None:
                out = torch.empty(dispatched.num_tokens, self.cfg.hidden, dtype=self.cfg.dtype, device=self.device)
            prepared = self._impl.prepare_combine(expert_out, dispatched)
        except BaseException as exc:
            if not capturing:
                _tell_peers(self._agree, OP_COMBINE, dispatched.epoch, exc)
            raise
        if not capturing:
            self._agree(OP_COMBINE, dispatched.epoch, dispatched.num_tokens)
        try:
            return self._impl.combine(expert_out, dispatched, out, prepared)
        except Exception as exc:
            typed = self._transport_failure(OP_COMBINE, dispatched.epoch, exc, capturing)
            if typed is exc:
                raise
            raise typed from exc

    def check_errors(self) -> None:
        """Raise for problems counted on the device without a host sync (CUDA-graph replays, and every
        call of a kernel backend: timeouts, peers on another call, peers' invalid input).

        Synchronises the device.  Resets the counters (a timeout or a mismatch stays: the communicator
        cannot be used after it).
        """
        if self._kernel:
            self._impl.check_errors()
        flags = self._error_flags.tolist()
        self._error_flags.zero_()
        if self._dropped_ids is not None:
            self._dropped_ids.reset()
        if flags[FLAG_EPOCH_MISMATCH]:
            raise EPError(f"{flags[FLAG_EPOCH_MISMATCH]} peer message(s) carried another call's epoch: "
                          "ranks replayed different dispatch/combine calls")
        if flags[FLAG_TOKEN_OVERFLOW]:
            raise EPError(f"{flags[FLAG_TOKEN_OVERFLOW]} peer(s) sent more than max_tokens_per_rank="
                          f"{self.cfg.max_tokens_per_rank} tokens")
        if flags[FLAG_INVALID_IDS]:
            raise EPInputError(f"{flags[FLAG_INVALID_IDS]} topk_ids outside [-1, num_experts="
                               f"{self.cfg.num_experts}) were treated as -1 (graph replays, or validate_ids=False)")

    def close(self, reason: str = "closed") -> None:
        """Release backend resources and the control plane's gloo group.  Idempotent; not collective.

        A peer still waiting in a call on this communicator fails at once with an ``EPTimeoutError``
        that names this rank and quotes ``reason``.
        """
        if self._closed:
            return
        self._closed = True
        try:
            self._impl.close()
        finally:
            self.control.close(reason)

    def __enter__(self) -> "Communicator":
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        self.close("closed" if exc is None else f"closed after {type(exc).__name__}: {exc}")

    def __repr__(self) -> str:
        return (f"Communicator(backend={self.backend!r}, rank={self.rank}, world_size={self.world_size}, "
                f"layout={self.cfg.layout!r}, num_local_experts={self.num_local_experts})")

    # -- kernel backends: no host agreement, errors travel through the device --------------------------
    def _dispatch_kernel(self, x, topk_ids, topk_weights, x_scales, hook: bool = False):
        self._check_no_pending_hook()
        compiling = torch.compiler.is_compiling()
        if compiling and getattr(self._impl, "zero_copy", False):
            # nothing in a traced graph orders the reads of the buffer's rows after the op that fills them
            raise EPConfigError("zero_copy", True, "its rows are views of the receive buffer, which a torch.compile "
                                "graph cannot order after the dispatch; use eager calls or CUDA graphs")
        host_checks = not self._capturing() and not compiling
        earlier_drops = host_checks and self._before_kernel_call()
        try:
            if self._uncombined is not None:
                raise EPError(f"rank {self.rank}: zero_copy: dispatch {self._uncombined} has not been combined; its "
                              "rows are views of the receive buffer that this dispatch would overwrite")
            self._checks.dispatch(x, topk_ids, topk_weights, x_scales)
            self._impl.check_inputs(x, x_scales)
        except Exception as exc:  # noqa: BLE001 - whatever it is, the peers must not wait for us
            self._abandon_call(exc)
            if isinstance(exc, EPError):
                raise
            raise EPInputError(f"invalid dispatch input: {exc!r}") from exc
        # ids are checked by a kernel queued in front of the dispatch and answered after its launch: a
        # bad id makes the dispatch kernel abort the call for every rank, and this rank raises here
        validate = host_checks and self.cfg.validate_ids
        if validate:
            self._impl.start_id_check(topk_ids)
        if hook:
            out, receive = self._impl.dispatch_split(x, topk_ids, topk_weights, x_scales, self._epoch,
                                                     abandon_on_invalid=validate)
        else:
            out = self._impl.dispatch(x, topk_ids, topk_weights, x_scales, self._epoch, abandon_on_invalid=validate)
        epoch = self._epoch
        self._epoch += 1
        if validate and not self._impl.id_check_passed():
            error = self._invalid_ids_error(topk_ids)
            self._impl.abandoned_in_kernel(error)  # the kernel already told the peers
            raise error
        out.owner = self
        if earlier_drops:
            self._impl.check_errors()
        # zero copy: the rows handed out now are read until this rank's combine of them (eager calls:
        # a failed capture must not leave a call behind that never ran; replays are the user's order)
        if host_checks and getattr(self._impl, "zero_copy", False):
            self._uncombined = epoch
        return (out, self._new_hook(receive, "dispatch")) if hook else out

    def _combine_kernel(self, expert_out, dispatched, out, hook: bool = False):
        self._check_no_pending_hook()
        if torch.compiler.is_compiling() and getattr(self._impl, "combine_pulls", False):
            raise EPConfigError("zero_copy", True, "combine reads the expert outputs in place in the buffer, which a "
                                "torch.compile graph cannot order; use eager calls or CUDA graphs")
        host_checks = not self._capturing() and not torch.compiler.is_compiling()
        earlier_drops = host_checks and self._before_kernel_call()
        try:
            if not isinstance(dispatched, Dispatched) or dispatched.owner is not self:
                raise EPInputError("combine: `dispatched` must be the result of this communicator's dispatch")
            self._checks.combine(expert_out, dispatched, out)
        except Exception as exc:  # noqa: BLE001
            self._abandon_call(exc)
            if isinstance(exc, EPError):
                raise
            raise EPInputError(f"invalid combine input: {exc!r}") from exc
        if out is None:
            out = torch.empty(dispatched.num_tokens, self.cfg.hidden, dtype=self.cfg.dtype, device=self.device)
        if dispatched.epoch == self._uncombined:
            self._uncombined = None
        if hook:
            receive = self._impl.combine_split(expert_out, dispatched, out)
        else:
            out = self._impl.combine(expert_out, dispatched, out)
        if earlier_drops:
            self._impl.check_errors()
        return (out, self._new_hook(receive, "combine")) if hook else out

    # -- receive hooks (kernel backends) ---------------------------------------------------------------
    def _check_hooks(self, requested: bool) -> None:
        if requested and not getattr(self._impl, "recv_hooks", False):
            raise EPConfigError("return_recv_hook", True, f"backend {self.backend!r} does not split send and "
                                "receive; the kernel backends 'mnnvl' and 'nvshmem' do")

    def _check_no_pending_hook(self) -> None:
        if self._pending_hook is not None:
            raise EPError(f"rank {self.rank}: the receive hook of the previous {self._pending_hook.what} has not "
                          "run; call it before the next dispatch/combine on this communicator (overlap two "
                          "micro-batches with two communicators)")

    def _new_hook(self, receive: Callable[[], None], what: str) -> "RecvHook":
        self._pending_hook = RecvHook(self, receive, what)
        return self._pending_hook

    def _before_kernel_call(self) -> bool:
        """Raise a recorded peer problem now (the call must not start: the ranks are out of step).
        Returns whether an earlier call dropped invalid ids: that is raised once this call has been
        launched, so this rank stays in step with its peers."""
        self._impl.poll_errors()
        return self._impl.recoverable_pending()

    def _abandon_call(self, reason: BaseException) -> None:
        """Tell the peers this rank gives up its current call (they raise instead of timing out)."""
        if not self._capturing():
            try:
                self._impl.abort(reason)
            except Exception:  # the caller's error is the one to report
                pass

    # -- helpers -------------------------------------------------------------------------------------
    def _invalid_ids_error(self, topk_ids: torch.Tensor) -> EPInputError:
        """After a range check said no: the error naming the first offending token (one more sync)."""
        try:
            check_ids(topk_ids, self.cfg.num_experts, self.rank)
        except EPInputError as exc:
            return exc
        return EPInputError(f"rank {self.rank}: topk_ids outside [-1, num_experts={self.cfg.num_experts})")

    def _agree(self, op: int, epoch: int, num_tokens: int, error: Optional[BaseException] = None) -> list:
        """The eager call's one host round trip: every rank's (op, epoch, status, T).  Raises on every
        rank when any rank reports an error (this rank: its own ``error``), or a peer is on another call
        or missing."""
        return self.control.agree_start(op, epoch, num_tokens, error)()

    def _transport_failure(self, op: int, epoch: int, exc: Exception, capturing: bool) -> Exception:
        """What to raise when the backend's data movement failed after the peers had agreed.

        A collective that fails in eager mode means a peer died or left mid-call (the control plane
        had just seen every rank arrive): that becomes the control plane's typed error naming it.
        Other errors, and anything raised while capturing a CUDA graph, pass through unchanged.
        """
        if capturing or isinstance(exc, EPError) or not _is_transport_error(exc):
            return exc
        return self.control.failure(op, epoch, exc)

    def _check_open(self) -> None:
        if self._closed:
            raise EPError("communicator is closed")

    def _capturing(self) -> bool:
        return self.device.type == "cuda" and torch.cuda.is_current_stream_capturing()


# EPConfig fields that size or shape what ranks exchange, and the environment knobs that change the
# protocol: a rank that differs would corrupt or wait forever, so creation refuses it on every rank.
# (timeout_s, num_sms and validate_ids may differ: each rank's own business.)
_SHARED_FIELDS = ("num_experts", "top_k", "hidden", "max_tokens_per_rank", "dtype", "layout", "quant", "zero_copy")
_SHARED_ENV = ("EP_COMM_COMBINE_GROUPED", "EP_COMM_COMBINE_PULL")


def _shared_settings(cfg: EPConfig, requested: str) -> dict:
    out = {f: getattr(cfg, f) for f in _SHARED_FIELDS}
    out["backend"] = requested  # after $EP_COMM_BACKEND
    out.update({f"${name}": os.environ.get(name, "") for name in _SHARED_ENV})
    return out


def _check_shared_settings(per_rank: list[dict]) -> None:
    """Raise ``EPConfigError`` (on every rank: all see the same reports) naming the first setting the
    ranks disagree on and which ranks hold which value."""
    for key in per_rank[0]:
        by_value: dict[str, list[int]] = {}
        for r, s in enumerate(per_rank):
            by_value.setdefault(repr(s.get(key, "<missing>")), []).append(r)
        if len(by_value) > 1:
            held = "; ".join(f"{_rank_list(ranks)}: {value}" for value, ranks in by_value.items())
            raise EPConfigError(key, per_rank[0].get(key), f"must be the same on every rank of the group ({held})")


def _rank_list(ranks: list[int]) -> str:
    """``rank 3`` or ``ranks 0-2, 5`` (sorted ranks, runs collapsed)."""
    runs: list[str] = []
    start = prev = ranks[0]
    for r in ranks[1:] + [None]:
        if r is not None and r == prev + 1:
            prev = r
            continue
        runs.append(str(start) if start == prev else f"{start}-{prev}")
        if r is not None:
            start = prev = r
    return ("rank " if len(ranks) == 1 else "ranks ") + ", ".join(runs)


def _input_error(exc: BaseException, op: str) -> EPError:
    return exc if isinstance(exc, EPError) else EPInputError(f"invalid {op} input: {exc!r}")


def _tell_peers(agree, op: int, epoch: int, exc: BaseException) -> None:
    """Local work failed before this rank's record went out: send it with the failure, so the peers
    raise instead of waiting in the collective, then let the local error propagate."""
    try:
        agree(op, epoch, 0, EPError(f"local {OP_NAMES.get(op, op)} work failed: {exc!r}"))
    except Exception:  # noqa: BLE001 - the local error is the one to report
        pass


class RecvHook:
    """The receive half of a call made with ``return_recv_hook=True``: calling it launches the half on
    the current stream (once; under CUDA-graph capture it is captured like any launch)."""

    def __init__(self, comm: Communicator, receive: Callable[[], None], what: str):
        self._comm, self._receive, self.what, self._done = comm, receive, what, False

    def __call__(self) -> None:
        if self._done:
            raise EPError(f"the receive hook of this {self.what} already ran")
        self._comm._check_open()
        self._done = True
        if self._comm._pending_hook is self:
            self._comm._pending_hook = None
        self._receive()
