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
"""
from __future__ import annotations

import dataclasses
import datetime
import pickle
import secrets
import time
from typing import Optional, Sequence

import torch
import torch.distributed as dist

from ..errors import EPError, EPInputError, EPTimeoutError
from .exchange import allgather_bytes_via
from .topology import Topology, local_host_id

OP_NAMES = {0: "create", 1: "dispatch", 2: "combine", 3: "close"}
OP_CREATE, OP_DISPATCH, OP_COMBINE, OP_CLOSE = 0, 1, 2, 3


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
        self.timeout_s = float(timeout_s)
        self.rank = dist.get_rank(group)
        self.size = dist.get_world_size(group)
        self.global_ranks: list[int] = (
            list(range(self.size)) if group is None else dist.get_process_group_ranks(group)
        )
        token = [secrets.token_hex(8) if self.rank == 0 else None]
        dist.broadcast_object_list(token, src=self.global_ranks[0], group=group)
        self.token: str = token[0]
        base = _default_store()
        if base is None:
            raise EPError("torch.distributed has no rendezvous store to build the control plane on; "
                          "initialise with ep_comm.init_distributed() or an env:// / tcp:// init_method")
        self.store = dist.PrefixStore(f"ep_comm/{self.token}/", base)
        self._pg = dist.ProcessGroupGloo(
            dist.PrefixStore("gloo/", self.store), self.rank, self.size,
            datetime.timedelta(seconds=self.timeout_s),
        )
        self.broken: Optional[str] = None

    def _allgather(self, tensor: torch.Tensor) -> list[torch.Tensor]:
        outs = [torch.empty_like(tensor) for _ in range(self.size)]
        self._pg.allgather([outs], [tensor]).wait()
        return outs

    def topology(self, device_index: Optional[int] = None) -> Topology:
        """Collective: this group's Topology (host ids all-gathered over the control plane)."""
        return Topology.from_host_ids(self.rank, [str(h) for h in self.gather_objects(local_host_id())],
                                      device_index)

    # -- the one per-call exchange -------------------------------------------------------------------
    def agree(
        self, op: int, epoch: int, num_tokens: int, error: Optional[BaseException] = None
    ) -> list[PeerStatus]:
        """All-gather (op, epoch, status, T) with every peer; raise the typed error every rank must see.

        ``error`` is this rank's own validation failure (re-raised here after the peers learnt of it).
        """
        if self.broken:
            raise EPError(f"communicator is unusable after an earlier failure ({self.broken}); create a new one")
        self._record_arrival(op, epoch)
        mine = torch.tensor([op, epoch, 1 if error is not None else 0, num_tokens], dtype=torch.int64)
        try:
            gathered = self._allgather(mine)
        except RuntimeError as exc:
            self.broken = f"peer exchange failed in {OP_NAMES[op]} epoch {epoch}"
            raise self._timeout_error(op, epoch, exc) from exc
        peers = [PeerStatus(r, *map(int, t.tolist())) for r, t in enumerate(gathered)]

        if any(p.status for p in peers):
            self._raise_input_errors(peers, error)
        off = [p for p in peers if (p.op, p.epoch) != (op, epoch)]
        if off:
            desc = ", ".join(f"rank {p.rank} is in {OP_NAMES.get(p.op, p.op)} epoch {p.epoch}" for p in off)
            self.broken = "ranks disagreed on the call"
            raise EPError(
                f"rank {self.rank} is in {OP_NAMES[op]} epoch {epoch} but {desc}: the ranks of a communicator "
                "must call dispatch/combine in the same order"
            )
        return peers

    # The control plane is also an ``Exchange`` (rank, size, allgather_bytes, barrier), so layers
    # below the communicator (e.g. the memory layer) can reuse it instead of opening another group.
    def allgather_bytes(self, data: bytes) -> list[bytes]:
        return allgather_bytes_via(self._allgather, data)

    def barrier(self) -> None:
        self._pg.barrier().wait()

    def gather_objects(self, obj) -> list:
        """All-gather picklable objects."""
        return [pickle.loads(b) for b in self.allgather_bytes(pickle.dumps(obj))]

    # -- error paths ---------------------------------------------------------------------------------
    def _record_arrival(self, op: int, epoch: int) -> None:
        if self.store is not None:
            try:
                self.store.set(f"arrive/{self.rank}", f"{op}:{epoch}")
            except Exception:  # the store is advisory; a failure must not break the call itself
                pass

    def _last_seen(self, rank: int) -> Optional[tuple[int, int]]:
        if self.store is None:
            return None
        key = f"arrive/{rank}"
        try:
            if not self.store.check([key]):
                return None
            op, epoch = self.store.get(key).decode().split(":")
            return int(op), int(epoch)
        except Exception:
            return None

    def _timeout_error(self, op: int, epoch: int, exc: BaseException) -> EPTimeoutError:
        # Give slow peers a moment to record their arrival before we call them missing.
        time.sleep(0.05)
        missing, seen = [], []
        for r in range(self.size):
            if r == self.rank:
                continue
            last = self._last_seen(r)
            if last != (op, epoch):
                missing.append(r)
                where = "never arrived" if last is None else f"last seen in {OP_NAMES.get(last[0])} epoch {last[1]}"
                seen.append(f"rank {r} ({where})")
        if not missing and self.store is None:
            missing = [r for r in range(self.size) if r != self.rank]
            seen = ["store unavailable: cannot tell which peer"]
        detail = "; ".join(seen) if seen else "all peers had arrived; the exchange itself failed"
        return EPTimeoutError(
            f"rank {self.rank}: {OP_NAMES[op]} epoch {epoch} did not complete within timeout_s={self.timeout_s:g}: "
            f"missing {detail} [{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}]",
            missing_ranks=missing,
        )

    def _raise_input_errors(self, peers: Sequence[PeerStatus], error: Optional[BaseException]) -> None:
        messages = self.gather_objects(None if error is None else f"{type(error).__name__}: {error}")
        bad = [(p.rank, messages[p.rank]) for p in peers if p.status]
        if error is not None:
            raise error
        desc = "; ".join(f"rank {r}: {m}" for r, m in bad)
        raise EPInputError(f"invalid input on peer rank(s) {[r for r, _ in bad]} ({desc})")

    def close(self) -> None:
        """Shut the gloo group down now: left to interpreter exit, its threads can abort the process."""
        self.broken = self.broken or "closed"
        pg, self._pg = self._pg, None
        if pg is not None:
            try:
                pg.shutdown()
            except Exception:  # older torch: no shutdown(); the object's destructor closes it
                pass
