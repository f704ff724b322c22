"""Host-side control plane: every eager call is agreed before any data moves.

Each dispatch/combine first records "rank r is at (op, epoch)" in the rendezvous store, then
all-gathers a tiny status record over a CPU (gloo) group whose timeout is the communicator's
``timeout_s``.  That one exchange gives us, on every rank:
  - the typed timeout: a peer that never arrives makes the gather time out; the store records say which
    ranks are missing and what call they were last seen in (``EPTimeoutError`` naming them);
  - the epoch check: a peer that is on another call (other op or epoch) is an ``EPError``, not a hang
    or silently mixed data;
  - shared validation: a rank with bad input reports it and *every* rank raises, so nobody is left
    waiting in a collective that the faulty rank never enters;
  - every rank's live token count, for the all_gatherv/reduce_scatterv backends.
The gloo group is separate from the data group, so this works the same for NCCL data planes.

When an exchange fails, ``failure`` works out *why* before raising: a peer whose process has exited
(same machine, from ``/proc``), a peer that closed its end of this communicator (a marker it leaves in
the store), or a peer that never arrived (the arrival records).  Every failure ends up as one
``EPTimeoutError`` naming those ranks, so a killed rank or a rank that raised between two calls gives
its peers a typed error instead of a raw transport message or a hang.
"""
from __future__ import annotations

import dataclasses
import datetime
import hashlib
import os
import pickle
import secrets
import tempfile
import time
import weakref
from typing import Any, Iterable, Optional, Sequence, cast

import torch
import torch.distributed as dist

from ..errors import EPError, EPInputError, EPTimeoutError
from .evidence import MARKER_COUNT, Marker, Verdict, classify, decode_marker, encode_marker, loss_check
from .exchange import allgather_bytes_via
from .groups import OwnGroups, nccl_class
from .liveness import ProcessIdentity, process_gone
from .shm_agree import SHM_AGREE_ENV, SharedAgreement
from .topology import Topology, local_host_id

OP_NAMES = {0: "create", 1: "dispatch", 2: "combine", 3: "close", 4: "exchange"}
OP_CREATE, OP_DISPATCH, OP_COMBINE, OP_CLOSE, OP_EXCHANGE = 0, 1, 2, 3, 4

#: the NCCL groups' watcher reads /proc every groups.WATCH_INTERVAL_S and the store's marker count every
#: this many times (about once a second: one round trip per plane and rank to the store's one host)
STORE_POLL_EVERY = 5

#: after the transport reports a lost connection, how long to look for the peer that caused it: a
#: rank that raised is usually still closing its communicators, a killed one still being reaped
SETTLE_S = 5.0

# Transport messages that mean "a connection to a peer went away" (gloo over TCP).
_LOST_CONNECTION = ("connection closed", "connection reset", "broken pipe", "connection refused", "socket closed")

_peer_loss_seen = False
_blamed: set[int] = set()  # global ranks this process's control planes found gone or missing
_open_planes: weakref.WeakSet[ControlPlane] = weakref.WeakSet()


def peer_loss_seen() -> bool:
    """Whether any control plane in this process has seen a peer die or leave (teardown then aborts)."""
    return _peer_loss_seen


def open_control_planes() -> int:
    """Control planes created and not yet closed in this process (tests check it returns to 0)."""
    return len(_open_planes)


def _summary(exc: BaseException) -> str:
    """``Type: first line`` of a transport error, without gloo's source path and advice."""
    first = str(exc).splitlines()[0] if str(exc) else ""
    if first.startswith("[") and "] " in first:
        first = first.split("] ", 1)[1]
    return f"{type(exc).__name__}: {first.split(' This is typically')[0]}"


def lost_connection(exc: BaseException) -> bool:
    """Whether a transport error says a connection to a peer was lost (rather than timed out)."""
    text = str(exc).lower()
    return any(marker in text for marker in _LOST_CONNECTION)


@dataclasses.dataclass(frozen=True)
class PeerStatus:
    rank: int
    op: int
    epoch: int
    status: int  # 0 ok, else an error code (the message travels separately)
    num_tokens: int


def _default_store() -> Optional[dist.Store]:
    try:
        from torch.distributed import distributed_c10d

        return distributed_c10d._get_default_store()
    except Exception:  # store not reachable (e.g. a custom init); timeouts then name no ranks
        return None


class ControlPlane:
    """Per-communicator CPU control channel.  Creating one is collective over ``group``.

    It owns a private gloo process group built on a store prefix that is unique to this communicator
    (a random token broadcast over ``group``), so communicators over disjoint or repeated subgroups
    never share rendezvous keys, and nothing is registered in torch's global group table.
    """

    def __init__(self, group: Optional[dist.ProcessGroup], timeout_s: float):
        rank = dist.get_rank(group)
        size = dist.get_world_size(group)
        global_ranks = list(range(size)) if group is None else dist.get_process_group_ranks(group)
        token = [secrets.token_hex(8) if rank == 0 else None]
        dist.broadcast_object_list(token, src=global_ranks[0], group=group)
        base = _default_store()
        if base is None:
            raise EPError("torch.distributed has no rendezvous store to build the control plane on; "
                          "initialise with ep_comm.init_distributed() or an env:// / tcp:// init_method")
        # the broadcast filled every rank's slot with rank 0's string
        self._start(cast(str, token[0]), base, rank, size, global_ranks, list(range(size)), timeout_s)

    def _start(self, token: str, base: dist.Store, rank: int, size: int, global_ranks: list[int],
               labels: list[int], timeout_s: float, join_s: float = 0.0) -> None:
        """Build the plane over ``size`` members on ``base`` under the prefix ``token`` (collective).
        ``join_s``: first wait up to that long for every member to arrive (store keys)."""
        self.timeout_s = float(timeout_s)
        self.rank = rank
        self.size = size
        self.global_ranks = global_ranks  # torch.distributed world rank of each member
        #: the communicator rank of each member: what every message and error names (``range(size)``
        #: until a shrink leaves gaps)
        self.labels = labels
        self.token = token
        self._base_store = base
        self.store = dist.PrefixStore(f"ep_comm/{self.token}/", base)
        #: the file of the FileStore this plane meets in (a shrink whose store host was lost), which
        #: the last member to close removes
        self.store_file: Optional[str] = None
        self.broken: Optional[str] = None
        self._shm: Optional[SharedAgreement] = None  # set once the ranks are known to share a host
        self._board: Optional[SharedAgreement] = None  # that host's shared file (the close markers)
        self._store_ok = True  # False once the store failed us (its host may be the dead rank)
        self._record_tensors = (torch.zeros(4, dtype=torch.int64),
                                [torch.zeros(4, dtype=torch.int64) for _ in range(self.size)])
        self.identities: list[ProcessIdentity] = []
        self.host_ids: list[str] = []
        self._own = OwnGroups(self.store, rank, size, self.timeout_s, global_ranks, token)
        self._pg: Optional[dist.ProcessGroupGloo] = None
        if join_s > 0:
            self._join(join_s)
        try:
            self._pg = dist.ProcessGroupGloo(dist.PrefixStore("gloo/", self.store), self.rank, self.size,
                                             datetime.timedelta(seconds=self.timeout_s))
        except RuntimeError as exc:
            raise EPTimeoutError(
                f"rank {self.me}: the control plane over ranks {self.labels} could not be formed within "
                f"timeout_s={self.timeout_s:g} ({_summary(exc)}); after a shrink every survivor must name "
                "the same lost ranks", missing_ranks=[r for r in self.labels if r != self.me]) from exc
        _open_planes.add(self)
        try:
            # who runs where, and as which process: the latter lets a survivor tell later that a
            # peer's process is gone without asking the peer
            ids = self.gather_objects((local_host_id(), ProcessIdentity.current()))
        except BaseException:
            self.close("failed while being created")
            raise
        self.host_ids = [str(h) for h, _ in ids]
        self.identities = [i for _, i in ids]
        # one host: a shared file (shm_agree.py) holds the close markers and, unless a rank opts out, the agreement
        try:
            want = self.gather_objects(os.environ.get(SHM_AGREE_ENV, "1") != "0")
            if self.size > 1 and len(set(self.host_ids)) == 1:
                self._board = SharedAgreement.open(self.rank, self.size, self.token, self.gather_objects)
                self._shm = self._board if all(want) else None
        except BaseException:
            self.close("failed while being created")
            raise

    @property
    def me(self) -> int:
        """This rank's communicator rank (``labels[rank]``)."""
        return self.labels[self.rank]

    # -- shrinking ------------------------------------------------------------------------------------
    def shrink(self, lost: Iterable[int], attempt: int = 0) -> ControlPlane:
        """A new control plane over this plane's members except ``lost`` (communicator ranks), formed
        without any exchange with the lost ones: collective over the survivors only, who must all pass
        the same ``lost`` (and ``attempt``, a count of earlier tries that failed).

        Its rendezvous keys live under a prefix derived from this plane's token, the survivors and
        ``attempt``, so no broadcast is needed.  The rendezvous store is this plane's store when it
        still answers; when it does not (its host was a lost rank, e.g. rank 0 under a plain
        ``MASTER_ADDR`` launch), survivors that all share this host meet in a ``FileStore`` in the
        temporary directory instead, and survivors spread over several hosts get an ``EPError`` (run
        under torchrun, whose agent hosts the store, to shrink across hosts after rank 0 is lost).
        This plane is left open (close it yourself).
        """
        gone = set(lost)
        keep = [i for i, label in enumerate(self.labels) if label not in gone]
        if self.rank not in keep:
            raise EPError(f"rank {self.me} cannot shrink to a plane without itself (lost {sorted(gone)})")
        labels = [self.labels[i] for i in keep]
        token = hashlib.sha1(f"{self.token}/{attempt}/{labels}".encode()).hexdigest()[:16]
        base, store_file = self._survivors_store(token, keep)
        plane = ControlPlane.__new__(ControlPlane)
        # a survivor may still be inside the failed call for up to timeout_s (waiting in an exchange
        # with a peer that has already left it), then SETTLE_S looking for the cause: wait that long
        plane._start(token, base, keep.index(self.rank), len(keep), [self.global_ranks[i] for i in keep], labels,
                     self.timeout_s, join_s=2 * self.timeout_s + SETTLE_S)
        plane.store_file = store_file
        return plane

    def meet(self, name: str, window_s: float) -> None:
        """Wait on the store until every member has reached the point ``name`` (once per plane and
        name), up to ``window_s``, which may exceed the gloo group's ``timeout_s``.  ``EPTimeoutError``
        naming the absent members (all of them when the store itself fails)."""
        keys = [f"{name}/{r}" for r in range(self.size)]
        try:
            self.store.set(keys[self.rank], "1")
            self.store.wait(keys, datetime.timedelta(seconds=window_s))
            return
        except Exception as exc:  # noqa: BLE001 - a timeout or a store failure: name who is missing
            cause = exc
        absent = [self.labels[r] for r, key in enumerate(keys) if not self._store_call(self.store.check, [key])]
        raise EPTimeoutError(f"rank {self.me}: ranks {absent} did not reach {name} within {window_s:g} s "
                             f"({_summary(cause)})", missing_ranks=absent) from cause

    def _join(self, window_s: float) -> None:
        """Wait until every member has arrived, up to ``window_s``; ``EPTimeoutError`` naming the absent."""
        try:
            self.meet("joined", window_s)
        except EPTimeoutError as exc:
            raise EPTimeoutError(
                f"{exc}: they did not join the survivors' control plane over ranks {self.labels}; every survivor "
                "must shrink, naming the same lost ranks", missing_ranks=exc.missing_ranks) from exc

    def _survivors_store(self, token: str, keep: list[int]) -> tuple[dist.Store, Optional[str]]:
        """The store the survivors meet in, and its file when it is a ``FileStore``."""
        try:
            self._base_store.check(["ep_comm/alive"])  # needs the server's answer: a lost host fails it
            return self._base_store, self.store_file
        except Exception as exc:  # noqa: BLE001 - any failure means the store is gone for us
            why = _summary(exc)
        hosts = {self.host_ids[i] for i in keep} | {local_host_id()}
        if len(hosts) > 1:
            raise EPError(f"rank {self.me}: cannot shrink: the rendezvous store no longer answers ({why}; its host, "
                          "e.g. rank 0 under a plain MASTER_ADDR launch, is likely among the lost ranks) and the "
                          f"survivors {[self.labels[i] for i in keep]} span {len(hosts)} hosts; launch with torchrun "
                          "(its agent hosts the store) to survive the loss of rank 0 across hosts")
        path = os.path.join(tempfile.gettempdir(), f"ep_comm_store_{token}")
        return dist.FileStore(path, len(keep)), path

    def _remove_store_file_when_last(self) -> None:
        """Count this member out of the file store; the last one out removes its file (a member that
        died never counts out, and its file stays in the temporary directory)."""
        try:
            last = self.store.add("closed_members", 1) >= self.size
        except Exception:  # noqa: BLE001 - the file is already gone or unreadable: nothing to remove
            return
        if last:
            try:
                os.remove(cast(str, self.store_file))
            except OSError:
                pass

    def gloo_group(self, name: str) -> dist.ProcessGroup:
        """A gloo process group over this plane's members, ranked as in this plane, made on the first
        call with a given ``name`` (collective then) and shut down with the plane.  It is not in
        torch's group table: call its own methods (``allgather``, ``allreduce``, ``broadcast``, group
        ranks); the ``torch.distributed`` functions run on it but fail on its table when a peer fails.
        Its timeout is the plane's ``timeout_s``."""
        if self.broken:
            raise EPError(f"communicator is unusable after an earlier failure ({self.broken}); create a new one")
        try:
            pg = self._own.gloo(name)
        except RuntimeError as exc:
            raise self.failure(OP_CREATE, -1, exc) from exc
        # a Backend object, not a registered ProcessGroup: the collectives take it all the same
        return cast(dist.ProcessGroup, pg)

    def nccl_group(self, name: str, device: torch.device) -> Any:
        """A ``ProcessGroupNCCL`` over this plane's members on CUDA ``device``, ranked as in this plane,
        made and connected on the first call with a given ``name`` (collective then, once every member
        has arrived: else ``EPTimeoutError`` naming the absent).  Not in torch's group table: call its
        own methods.  ep_comm alone ends it: aborted as soon as this plane finds a peer lost
        (``failure``, or a watcher thread while no call runs), else at ``release_nccl_group`` or
        ``close``: shut down once this device's queued work is done, aborted if that takes longer than
        ``timeout_s``.  Its own timeout is ``groups.nccl_timeout_s(timeout_s)``.  ``EPError`` on a torch
        built without NCCL."""
        if self.broken:
            raise EPError(f"communicator is unusable after an earlier failure ({self.broken}); create a new one")
        if nccl_class() is None:
            raise EPError(f"rank {self.me}: torch {torch.__version__} has no ProcessGroupNCCL (a build without "
                          f"NCCL): no NCCL group for {device}")
        self.meet(f"nccl_group/{name}", self.timeout_s)
        try:
            return self._own.nccl(name, torch.device(device), lambda: loss_check(
                self._diagnose, self.store, self.labels, store_every=STORE_POLL_EVERY))
        except RuntimeError as exc:
            raise self.failure(OP_CREATE, -1, exc) from exc

    @property
    def nccl_aborted(self) -> Optional[str]:
        """Why this plane's NCCL groups were aborted (a peer was lost), or None while they were not."""
        return self._own.aborted

    def abort_nccl_groups(self, why: str) -> None:
        """Abort this plane's NCCL groups now (idempotent): a kernel of theirs waiting for a lost peer ends."""
        self._own.abort_nccl(why)

    def release_nccl_group(self, name: str) -> None:
        """Give the NCCL group ``name`` back before the plane closes (``nccl_group`` says how)."""
        self._own.release_nccl(name)

    @property
    def agreement(self) -> str:
        """How eager calls agree with the peers: ``"shared memory"``, ``"gloo"`` or ``"none"`` (one rank)."""
        return "none" if self.size == 1 else "shared memory" if self._shm is not None else "gloo"

    def _allgather(self, tensor: torch.Tensor, op: int = OP_EXCHANGE, epoch: int = -1) -> list[torch.Tensor]:
        return self._allgather_start(tensor, op, epoch)()

    def _allgather_start(self, tensor: torch.Tensor, op: int = OP_EXCHANGE, epoch: int = -1,
                         outs: Optional[list[torch.Tensor]] = None):
        """Start an all-gather on gloo's own threads; returns ``wait() -> list[Tensor]`` that raises the
        typed failure.  The caller can do local work (launch kernels) while the peers answer."""
        pg = self._pg
        if pg is None:
            raise EPError("the communicator's control plane is closed")
        if outs is None:
            outs = [torch.empty_like(tensor) for _ in range(self.size)]
        try:
            # torch's stubs declare allgather on ProcessGroup only; ProcessGroupGloo's base Backend binds it too
            work = pg.allgather([outs], [tensor])  # type: ignore[attr-defined]
        except RuntimeError as exc:
            raise self.failure(op, epoch, exc) from exc

        def wait() -> list[torch.Tensor]:
            try:
                work.wait()
            except RuntimeError as exc:
                raise self.failure(op, epoch, exc) from exc
            return outs
        return wait

    def topology(self, device_index: Optional[int] = None) -> Topology:
        """This group's Topology (host ids were all-gathered when the control plane was created)."""
        return Topology.from_host_ids(self.rank, self.host_ids, device_index)

    # -- the one per-call exchange -------------------------------------------------------------------
    def agree_start(self, op: int, epoch: int, num_tokens: int, error: Optional[BaseException] = None):
        """All-gather (op, epoch, status, T) with every peer, in two halves: sends this rank's record now
        and returns ``wait() -> list[PeerStatus]``, which waits for the peers' records and raises the
        typed error every rank must see (this rank: its own ``error``, after the peers learnt of it; a
        peer's input error; a peer on another call or missing).  Between the two the caller may only do
        local work that it can drop (nothing a peer waits for): the round trip then overlaps it."""
        if self.broken:
            raise EPError(f"communicator is unusable after an earlier failure ({self.broken}); create a new one")
        status = 1 if error is not None else 0
        if self.size == 1:  # nobody to agree with: only this rank's own error can be raised
            return lambda: self._checked([PeerStatus(0, op, epoch, status, num_tokens)], op, epoch, error)
        if self._shm is not None:
            return self._shm_agree_start(self._shm, op, epoch, status, num_tokens, error)
        # calls are sequential (each start is waited for before the next), so one set of record tensors
        # serves every call; filling it through numpy costs less than building a tensor from a list
        rec, outs = self._record_tensors
        rec.numpy()[:] = (op, epoch, status, num_tokens)
        gathered_wait = self._allgather_start(rec, op, epoch, outs)

        def wait() -> list[PeerStatus]:
            # the arrival record is advisory (it names where a rank was when an exchange fails); written
            # here, before this rank blocks, its store round trip overlaps the records in flight
            self._record_arrival(op, epoch)
            gathered = gathered_wait()  # a failure raises the typed error naming the peers
            return self._checked([PeerStatus(r, *t.tolist()) for r, t in enumerate(gathered)], op, epoch, error)
        return wait

    def _shm_agree_start(self, shm: SharedAgreement, op: int, epoch: int, status: int, num_tokens: int,
                         error: Optional[BaseException]):
        seq = shm.post(op, epoch, status, num_tokens)

        def gone(ranks) -> bool:
            return any(process_gone(self.identities[r]) for r in ranks)

        def wait() -> list[PeerStatus]:
            records, missing, why = shm.wait(seq, self.timeout_s, gone)
            if missing:
                what = {"closed": "closed its end", "gone": "process gone",
                        "timeout": f"no record within timeout_s={self.timeout_s:g}"}[why]
                raise self.failure(op, epoch, RuntimeError(
                    f"shared-memory agreement: rank(s) {[self.labels[r] for r in missing]}: {what}"))
            return self._checked([PeerStatus(r, *rec) for r, rec in enumerate(records)], op, epoch, error)
        return wait

    def _checked(self, peers: list[PeerStatus], op: int, epoch: int,
                 error: Optional[BaseException]) -> list[PeerStatus]:
        """Raise what every rank must see about the gathered records: input errors, ranks on other calls."""
        if any(p.status for p in peers):
            self._raise_input_errors(peers, error)
        off = [p for p in peers if (p.op, p.epoch) != (op, epoch)]
        if off:
            desc = ", ".join(f"rank {self.labels[p.rank]} is in {OP_NAMES.get(p.op, p.op)} epoch {p.epoch}"
                             for p in off)
            self.broken = "ranks disagreed on the call"
            raise EPError(
                f"rank {self.me} is in {OP_NAMES[op]} epoch {epoch} but {desc}: the ranks of a communicator "
                "must call dispatch/combine in the same order"
            )
        return peers

    # The control plane is also an ``Exchange`` (rank, size, allgather_bytes, barrier), so layers
    # below the communicator (e.g. the memory layer) can reuse it instead of opening another group.
    def allgather_bytes(self, data: bytes) -> list[bytes]:
        return allgather_bytes_via(self._allgather, data)

    def barrier(self) -> None:
        self._allgather(torch.zeros(1, dtype=torch.uint8))  # an all-gather: same typed failures as the rest

    def gather_objects(self, obj) -> list:
        """All-gather picklable objects."""
        return [pickle.loads(b) for b in self.allgather_bytes(pickle.dumps(obj))]

    # -- error paths ---------------------------------------------------------------------------------
    def _store_call(self, fn, *args):
        """A store call that never raises: None when it failed (the store is then left alone)."""
        if not self._store_ok:
            return None
        try:
            return fn(*args)
        except Exception:  # the store's host may be the rank that died; stop asking it
            self._store_ok = False
            return None

    def _record_arrival(self, op: int, epoch: int) -> None:
        # advisory: a failure here must not break the call itself
        self._store_call(self.store.set, f"arrive/{self.rank}", f"{op}:{epoch}")

    def _read(self, key: str, store: Optional[dist.Store] = None) -> Optional[str]:
        """``key``'s value, None when it is not there; ``store``: another connection to this plane's store
        (the watcher's), whose failures leave the plane's own store in use."""
        if store is not None:
            try:
                return store.get(key).decode(errors="replace") if store.check([key]) else None
            except Exception:  # noqa: BLE001 - no answer is no marker
                return None
        if not self._store_call(self.store.check, [key]):
            return None
        raw = self._store_call(self.store.get, key)
        return None if raw is None else raw.decode(errors="replace")

    def _last_seen(self, rank: int) -> Optional[tuple[int, int]]:
        if self._shm is not None:
            return self._shm.last_seen(rank)
        raw = self._read(f"arrive/{rank}")
        if raw is None:
            return None
        op, epoch = raw.split(":")
        return int(op), int(epoch)

    def _diagnose(self, use_store: bool, store: Optional[dist.Store] = None) -> Verdict:
        """``evidence.classify`` of what ``/proc`` and, with ``use_store``, the close markers say now.
        ``store``: as in ``_read``."""
        exited = {r: why for r, ident in enumerate(self.identities) if r != self.rank and (why := process_gone(ident))}
        markers: dict[int, Marker] = {}
        board = self._board  # this host's copy first: no round trip, and it outlives the store's host
        for r in range(self.size) if use_store else ():
            raw = None if r == self.rank else (board and board.marker(r)) or self._read(f"left/{r}", store)
            if raw is not None:
                markers[r] = decode_marker(raw, self.global_ranks)
        return classify(exited, markers, self.rank, self.labels)

    def lost_peers(self, use_store: bool = True) -> dict[int, str]:
        """``{rank: why}`` for peers known to be gone: their process exited (same machine only), they
        closed their end of this control plane, or a peer that left names them.  Without the store
        this is a few ``/proc`` reads.  Keys are communicator ranks (``labels``)."""
        return {self.labels[r]: why for r, why in self._diagnose(use_store)[0].items()}

    def failure(self, op: int, epoch: int, exc: BaseException) -> EPTimeoutError:
        """The typed error for a failed exchange with the peers; marks this control plane broken.

        Names the peers that are gone first, then those that left because of them, then those that
        never arrived at ``(op, epoch)``.  When the transport says a connection was lost, waits up to
        ``SETTLE_S`` for the evidence to show.
        """
        global _peer_loss_seen
        self.broken = self.broken or f"peer exchange failed in {OP_NAMES.get(op, op)} epoch {epoch}"
        deadline = time.monotonic() + (min(SETTLE_S, self.timeout_s) if lost_connection(exc) else 0.05)
        gone, followers, dead = self._diagnose(True)
        while not gone and time.monotonic() < deadline:
            time.sleep(0.05)
            gone, followers, dead = self._diagnose(True)
        lab = self.labels
        parts = [f"rank {lab[r]} is gone ({why})" for r, why in sorted(gone.items())]
        if followers:
            parts.append(", ".join(f"rank {lab[r]}" for r in sorted(followers)) + " left after losing "
                         + ", ".join(sorted({f"rank {lab[b]}" for bl in followers.values() for b in bl})))
        missing = sorted(gone) + sorted(followers)
        records = self._store_ok or self._shm is not None
        if op in (OP_DISPATCH, OP_COMBINE) and records:  # the calls that leave arrival records
            for r in range(self.size):
                if r == self.rank or r in missing:
                    continue
                last = self._last_seen(r)
                if last != (op, epoch):
                    missing.append(r)
                    where = "never arrived" if last is None else \
                        f"last seen in {OP_NAMES.get(last[0])} epoch {last[1]}"
                    parts.append(f"rank {lab[r]} ({where})")
        if not records:
            parts.append("arrival records unavailable: the rendezvous store is unreachable")
        if gone:
            _peer_loss_seen = True
        # what a rank that leaves after this tells the others (close marker): the ranks that are gone,
        # or, when none is known to be, those that never arrived; never a peer that was merely slower
        _blamed.update(self.global_ranks[r] for r in (sorted(gone) if gone else missing))
        call = f"rank {self.me}: {OP_NAMES.get(op, op)}" + (f" epoch {epoch}" if epoch >= 0 else "")
        if gone:
            msg = f"{call} failed: " + "; ".join(parts)
        elif lost_connection(exc):
            msg = (f"{call} failed: the connection to a peer was lost and no rank could be identified as gone"
                   + (f" ({'; '.join(parts)})" if parts else ""))
        else:
            detail = "; ".join(parts) if parts else "all peers had arrived; the exchange itself failed"
            msg = f"{call} did not complete within timeout_s={self.timeout_s:g}: missing {detail}"
        if gone:  # (a peer merely late is left to find out for itself: no early word to name it)
            if dead:  # NCCL kernels of this rank may wait for them forever: free the streams before more is queued
                self._own.abort_nccl(msg)
            self._leave_early(msg)
        return EPTimeoutError(f"{msg} [{_summary(exc)}]", missing_ranks=[lab[r] for r in missing],
                              lost_ranks=[lab[r] for r in gone])

    def _leave_early(self, why: str) -> None:
        """After an exchange failed because peers are gone the plane is broken: let the other peers
        know now rather than at ``close``.

        A peer may still be waiting for this rank's record of the failed call, though it will never
        come: it would wait out its timeout, and a shrink of the survivors, which waits for every one
        of them, with it.  So the shared-memory slot says closed now and the store carries the close
        marker with the ranks blamed, so that the peer names them, not this rank, as lost.  (A
        peer blocked in a gloo collective still waits for its timeout: gloo's ``shutdown``/``abort``
        leave the sockets open.)
        """
        if self._shm is not None:
            self._shm.mark_closed()
        because = sorted(g for g in _blamed if g in self.global_ranks)
        if because:
            self._leave_marker(f"it failed: {why}", because)

    def _leave_marker(self, reason: str, because: list[int]) -> None:
        """The close marker (``left/<rank>``), then the count of markers that the peers' NCCL watchers
        poll (one store read for them while nobody leaves)."""
        marker = encode_marker(reason, because, aborted=self._own.aborted is not None)
        if self._board is not None:
            self._board.leave_marker(marker)
        self._store_call(self.store.set, f"left/{self.rank}", marker)
        self._store_call(self.store.add, MARKER_COUNT, 1)

    def _raise_input_errors(self, peers: Sequence[PeerStatus], error: Optional[BaseException]) -> None:
        messages = self.gather_objects(None if error is None else f"{type(error).__name__}: {error}")
        bad = [(p.rank, messages[p.rank]) for p in peers if p.status]
        if error is not None:
            raise error
        desc = "; ".join(f"rank {self.labels[r]}: {m}" for r, m in bad)
        raise EPInputError(f"invalid input on peer rank(s) {[self.labels[r] for r, _ in bad]} ({desc})")

    def close(self, reason: str = "closed", because_of: Iterable[int] = ()) -> None:
        """Shut the gloo groups down now (left to interpreter exit, their threads can abort the process)
        and end the NCCL groups (aborted after a loss, else once this device's queued work is done).

        Leaves ``reason`` in the store first, so a peer still waiting on this rank learns that it left
        rather than timing out.  ``because_of``: communicator ranks (``labels``) this rank leaves
        because they were lost (a shrink): peers then blame them, not this rank.  Idempotent; not
        collective.
        """
        pg, self._pg = self._pg, None
        if pg is None:
            return
        lost = [r for r in because_of if r in self.labels]
        self._own.close(abort=bool(lost))
        self.broken = self.broken or "closed"
        _open_planes.discard(self)
        # the ranks this process found gone or missing travel along, so that a peer which cannot see
        # them itself (another machine) still names the root cause rather than this rank
        because = sorted({g for g in _blamed if g in self.global_ranks}
                         | {self.global_ranks[self.labels.index(r)] for r in lost})
        self._leave_marker(reason, because)
        if self.store_file is not None:
            self._remove_store_file_when_last()
        if self._board is not None:  # after the marker: a peer waiting on this rank reads why it left
            self._board.close()
        try:
            pg.shutdown()
        except Exception:  # older torch: no shutdown(); the object's destructor closes it
            pass
