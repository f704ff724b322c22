"""Process groups a control plane makes for its own use: ``ControlPlane.gloo_group`` and ``nccl_group``.

Each is built over the plane's members on a prefix of the plane's store and never registered in torch's
group table: nothing but ep_comm holds it, ``destroy_process_group`` never reaches it, and ep_comm alone
decides when it is shut down or aborted.  The ``torch.distributed`` functions run on such a group but
turn a peer's failure into an error about that table, so callers use the group object's own methods
(``backends.collective.collectives``).

Why NCCL groups of our own: a rank that dies inside an NCCL collective leaves its peers' kernel waiting
for it, and their streams, and any host thread synchronising with them, blocked until that communicator
is aborted (``ncclCommAbort``).  A caller's group is not ours to abort; an own one is.  ``OwnGroups``
aborts its NCCL groups when the plane finds a peer lost, and a watcher thread does so when no call is
running to find out (the host sitting in a device synchronisation behind such a kernel).

``ProcessGroupNCCL`` exists only in CUDA builds of torch: every reference goes through ``nccl_class()``.
"""
from __future__ import annotations

import datetime
import threading
import time
from typing import Any, Callable, Optional, Sequence

import torch
import torch.distributed as dist

from ..errors import EPError

# torch's NCCL watchdog ends the process (TORCH_NCCL_ASYNC_ERROR_HANDLING's default) when a collective
# outlasts its group's timeout.  ep_comm finds a lost peer within timeout_s + ~10 s (a call's agreement
# plus SETTLE_S, or the watcher's next poll) and aborts the group itself; the group's own timeout must
# never fire first, on a survivor that is about to shrink, nor on a collective that is merely slow (a
# peer's GPU busy with other work).  Hence far longer than timeout_s, and never under ten minutes.
NCCL_TIMEOUT_MIN_S = 600.0
NCCL_TIMEOUT_FACTOR = 20.0
#: how often the watcher looks for a lost peer (a few /proc reads; one store round trip)
WATCH_INTERVAL_S = 0.2


def nccl_class() -> Optional[type]:
    """``torch.distributed.ProcessGroupNCCL``, or None in a torch built without NCCL (CPU builds)."""
    return getattr(dist, "ProcessGroupNCCL", None)


def is_own_nccl(group: object) -> bool:
    """Whether ``group`` is a ``ProcessGroupNCCL`` object itself (an own group, not a registered one)."""
    cls = nccl_class()
    return cls is not None and isinstance(group, cls)


def nccl_error(group: Any) -> Optional[str]:
    """What torch's watchdog recorded against an NCCL group (``ErrorType``'s name: ``TIMEOUT``,
    ``COMM_ERROR``, ``REMOTE_ERROR``), or None while it recorded nothing or this torch cannot say.

    The watchdog may end a collective on its own (a peer's group was aborted: the remote error it
    reads from the store), before ep_comm's watcher sees the loss; what that collective left is then
    no result.  A getter of the group's state, no round trip."""
    get_error = getattr(group, "get_error", None)
    if get_error is None:
        return None
    try:
        error = get_error()
    except Exception:  # noqa: BLE001 - a torch without the getter for this backend: nothing recorded
        return None
    name = getattr(error, "name", str(error))
    return None if name == "SUCCESS" else name


def nccl_timeout_s(timeout_s: float) -> float:
    """The timeout of an own NCCL group for a plane whose ``timeout_s`` is given (see the constants)."""
    return max(NCCL_TIMEOUT_MIN_S, NCCL_TIMEOUT_FACTOR * timeout_s)


#: how long a caller waits for an NCCL group's abort or shutdown before going on without it.  NCCL ends a
#: communicator only once every CUDA graph that captured one of its collectives is destroyed
#: (``ncclCommAbort`` first raises the flag that ends its running kernels, then waits for those graphs),
#: so a caller that still holds such a graph, or closes before dropping it, would wait forever.
END_WAIT_S = 1.0


def end_group(pg: Any, shutdown: bool = False, wait_s: Optional[float] = None) -> bool:
    """Abort ``pg`` (local: it waits on no peer), or with ``shutdown`` shut it down cleanly (an abort if
    that fails), on a daemon thread; never raises.  Returns whether that finished within ``wait_s``;
    otherwise it finishes by itself once the graphs that captured the group's collectives are gone
    (``wait_s``: ``END_WAIT_S`` when None)."""

    def end() -> None:
        try:
            if shutdown and getattr(pg, "shutdown", None) is not None:
                try:
                    pg.shutdown()
                    return
                except Exception:  # noqa: BLE001 - a failed shutdown falls back to the abort
                    pass
            pg.abort()
        except Exception:  # noqa: BLE001 - already aborted, or torch has no abort() for it: nothing left to do
            pass

    thread = threading.Thread(target=end, name="ep_comm-nccl-end", daemon=True)
    thread.start()
    thread.join(END_WAIT_S if wait_s is None else wait_s)
    return not thread.is_alive()


def _new_nccl_group(store: dist.Store, rank: int, size: int, timeout_s: float, device: torch.device,
                    global_ranks: Sequence[int], name: str) -> Any:
    cls = nccl_class()
    if cls is None:
        raise EPError(f"torch {torch.__version__} has no ProcessGroupNCCL (a build without NCCL): the collective "
                      "backends need it for CUDA tensors")
    opts = cls.Options()  # type: ignore[attr-defined]
    opts._timeout = datetime.timedelta(seconds=nccl_timeout_s(timeout_s))
    for field, value in (("global_ranks_in_group", list(global_ranks)), ("group_name", name)):
        try:  # torch's logs and flight recorder only; a unique name keeps own groups apart there
            setattr(opts, field, value)
        except (AttributeError, TypeError):
            pass
    with torch.cuda.device(device):
        return cls(store, rank, size, opts)


class LossWatch:
    """A daemon thread that calls ``check()`` every ``interval_s`` until it returns a reason, then
    ``on_loss(reason)`` once, or until ``stop()``."""

    def __init__(self, check: Callable[[], Optional[str]], on_loss: Callable[[str], None],
                 interval_s: float = WATCH_INTERVAL_S):
        self._check, self._on_loss, self._interval_s = check, on_loss, interval_s
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="ep_comm-loss-watch", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(self._interval_s):
            try:
                why = self._check()
            except Exception:  # noqa: BLE001 - a failed look is no evidence; look again next time
                continue
            if why:
                self._on_loss(why)
                return

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not threading.current_thread():
            self._thread.join(timeout=2.0)  # it may be inside an abort, which ends on its own


class OwnGroups:
    """The gloo and NCCL groups of one control plane (``store``: the plane's store; ``rank``/``size``: its
    ranks).  ``aborted``: why its NCCL groups were aborted, once they were."""

    def __init__(self, store: dist.Store, rank: int, size: int, timeout_s: float, global_ranks: Sequence[int],
                 tag: str):
        self._store, self._rank, self._size, self._timeout_s = store, rank, size, timeout_s
        self._global_ranks, self._tag = list(global_ranks), tag
        self._gloo: dict[str, Any] = {}
        self._nccl: dict[str, tuple[Any, torch.device]] = {}
        self._lock = threading.Lock()  # the watcher aborts from its own thread
        self._watch: Optional[LossWatch] = None
        self._made_nccl = False
        self.aborted: Optional[str] = None

    def gloo(self, name: str) -> Any:
        """The gloo group ``name``, made on the first call (collective then; RuntimeError if a member fails)."""
        pg = self._gloo.get(name)
        if pg is None:
            pg = self._gloo[name] = dist.ProcessGroupGloo(dist.PrefixStore(f"group/{name}/", self._store), self._rank,
                                                          self._size, datetime.timedelta(seconds=self._timeout_s))
        return pg

    def nccl(self, name: str, device: torch.device, make_check: Callable[[], Callable[[], Optional[str]]]) -> Any:
        """The NCCL group ``name`` on ``device``, made and connected on the first call (collective then).
        ``make_check()``: what the watcher asks (``LossWatch``), made once, when the first group starts it."""
        if self.aborted is not None:
            raise EPError(f"the communicator's NCCL groups were aborted ({self.aborted}); create a new one")
        entry = self._nccl.get(name)
        if entry is not None:
            if entry[1] != device:
                raise EPError(f"NCCL group {name!r} is on {entry[1]}, not {device}")
            return entry[0]
        # own prefix: the gloo group of the same name keeps its rendezvous keys under group/<name>/
        pg = _new_nccl_group(dist.PrefixStore(f"nccl_group/{name}/", self._store), self._rank, self._size,
                             self._timeout_s, device, self._global_ranks, f"ep_comm:{self._tag}:{name}")
        with self._lock:  # registered before it connects, so that a loss meanwhile aborts the connection too
            self._nccl[name], self._made_nccl = (pg, device), True
        try:
            connect = getattr(pg, "eager_connect_single_device", None)
            if connect is not None:  # else torch connects on the first collective
                with torch.cuda.device(device):
                    connect(device)
        except BaseException:
            with self._lock:
                self._nccl.pop(name, None)
            end_group(pg)
            raise
        if self._watch is None and self._size > 1:
            self._watch = LossWatch(make_check(), self.abort_nccl)
        return pg

    def abort_nccl(self, why: str) -> None:
        """Abort every NCCL group now (idempotent; from any thread): their kernels waiting for a lost peer
        end, so the streams behind them run again.  Returns once each abort is done, or after ``END_WAIT_S``
        for one that waits for CUDA graphs (``end_group``).  A plane that never made one has nothing to
        abort (and its close marker says so)."""
        with self._lock:
            if self.aborted is None and self._made_nccl:
                self.aborted = why
            groups, self._nccl = list(self._nccl.values()), {}
        for pg, _ in groups:  # outside the lock: an abort may wait for CUDA graphs (end_group)
            end_group(pg)

    def release_nccl(self, name: str) -> None:
        """Give the NCCL group ``name`` back: shut down cleanly once this device's queued work is done,
        aborted when that does not happen within ``timeout_s`` or a peer is lost meanwhile."""
        with self._lock:
            entry = self._nccl.pop(name, None)
        if entry is not None:
            self._release(*entry)

    def _release(self, pg: Any, device: torch.device) -> None:
        if self.aborted is None:
            if self._drained(device):
                end_group(pg, shutdown=True)
                return
            # peers may be waiting in a collective with this rank: the close marker tells them
            why = f"this rank's queued work did not finish within {self._timeout_s:g} s"
            with self._lock:
                self.aborted = self.aborted or why
        end_group(pg)

    def _drained(self, device: torch.device) -> bool:
        """Whether every kernel queued on ``device`` finished within ``timeout_s`` (no lost peer meanwhile).
        A clean shutdown waits for the communicator's pending collectives, so it is only tried after this;
        the synchronisation runs on a thread of its own, which an abort releases if it is stuck."""
        done, failed = threading.Event(), []

        def sync() -> None:
            try:
                torch.cuda.synchronize(device)
            except Exception as exc:  # noqa: BLE001 - a device error: no clean shutdown
                failed.append(exc)
            finally:
                done.set()

        threading.Thread(target=sync, name="ep_comm-drain", daemon=True).start()
        deadline = time.monotonic() + self._timeout_s
        while not done.wait(0.05):
            if self.aborted is not None or time.monotonic() > deadline:
                return False
        return not failed

    def close(self, abort: bool) -> bool:
        """Stop the watcher, release the NCCL groups (abort them when ``abort`` or after a loss) and shut
        the gloo groups down.  Returns whether the NCCL groups were aborted."""
        if abort:
            self.abort_nccl("the communicator was closed after losing ranks")
        for name in list(self._nccl):
            self.release_nccl(name)  # the watcher still runs: a loss during the drain aborts at once
        if self._watch is not None:
            self._watch.stop()
            self._watch = None
        groups, self._gloo = list(self._gloo.values()), {}
        for group in groups:
            try:
                group.shutdown()
            except Exception:  # noqa: BLE001 - older torch: no shutdown(); the destructor closes it
                pass
        return self.aborted is not None
