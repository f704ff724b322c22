"""An own NCCL group on a CPU-only torch: ``collectives`` routes to the group object's own methods (a
stand-in ``ProcessGroupNCCL`` class patched into ``torch.distributed``) with the options the
``torch.distributed`` functions would pass, never asks ``dist.get_backend`` about it, and keeps the
functions for a caller's registered group.  Also what the collective backend does once its NCCL group
was aborted (the typed loss, before any result), with a stand-in control plane."""
from __future__ import annotations

import dataclasses
import types
from typing import Any, Optional

import pytest
import torch
import torch.distributed as dist

import ep_comm
from ep_comm.backends.base import BackendContext, CombineCall, DispatchCall
from ep_comm.backends.collective import collectives
from ep_comm.backends.collective.ag_rs import AllGatherReduceScatterBackend
from ep_comm.backends.collective.naive import NaiveBackend
from ep_comm.distributed import groups
from ep_comm.distributed.control import OP_DISPATCH
from ep_comm.errors import EPError, EPTimeoutError

WORLD, RANK = 3, 1


class _Work:
    def __init__(self, log: list) -> None:
        self.log = log

    def wait(self) -> bool:
        self.log.append("wait")
        return True


class FakeNCCL:
    """Plays ``ProcessGroupNCCL`` for rank ``RANK`` of ``WORLD``: peer r's tensor is this rank's plus
    ``r - RANK`` (``offset``) or the same as this rank's, and every call is logged with its arguments."""

    def __init__(self, offset: bool = True) -> None:
        self.log: list = []
        self.offset = offset
        self.error = "SUCCESS"  # what torch's watchdog recorded (``ErrorType``'s name)

    def get_error(self):
        return types.SimpleNamespace(name=self.error)

    def _peer(self, t: torch.Tensor, r: int) -> torch.Tensor:
        return t + (r - RANK) if self.offset else t.clone()

    def allreduce(self, tensors, opts):
        self.log.append(("allreduce", [t.shape for t in tensors], opts))
        t = tensors[0]
        t.copy_(sum(self._peer(t, r) for r in range(WORLD)))
        return _Work(self.log)

    def _allgather_base(self, out, inp, opts):
        self.log.append(("_allgather_base", tuple(out.shape), tuple(inp.shape), opts))
        out.copy_(torch.stack([self._peer(inp, r) for r in range(WORLD)]).view(out.shape))
        return _Work(self.log)

    def allgather(self, outs, ins, opts):
        self.log.append(("allgather", [tuple(o.shape) for o in outs[0]], tuple(ins[0].shape), opts))
        for r, o in enumerate(outs[0]):  # peer r sends its first numel(o) elements, all equal to r
            o.fill_(float(r))
        return _Work(self.log)

    def _reduce_scatter_base(self, out, inp, opts):
        self.log.append(("_reduce_scatter_base", tuple(out.shape), tuple(inp.shape), opts))
        chunk = inp.shape[0] // WORLD
        total = sum(self._peer(inp, r) for r in range(WORLD))
        out.copy_(total[RANK * chunk:(RANK + 1) * chunk])
        return _Work(self.log)

    def reduce_scatter(self, outs, ins, opts):
        self.log.append(("reduce_scatter", [tuple(o.shape) for o in outs], [tuple(c.shape) for c in ins[0]], opts))
        outs[0].copy_(sum(self._peer(ins[0][RANK], r) for r in range(WORLD)))
        return _Work(self.log)

    def broadcast(self, *args, **kwargs):
        raise AssertionError("an own NCCL group never takes the gloo broadcast path")


@pytest.fixture
def fake_nccl(monkeypatch) -> FakeNCCL:
    """A stand-in ProcessGroupNCCL object; ``dist.get_backend`` and the collective functions fail the test
    if they are reached."""
    monkeypatch.setattr(dist, "ProcessGroupNCCL", FakeNCCL, raising=False)

    def refuse(*args, **kwargs):
        raise AssertionError("a torch.distributed function was called for an own NCCL group")

    for name in ("get_backend", "all_reduce", "all_gather", "all_gather_into_tensor", "reduce_scatter",
                 "reduce_scatter_tensor", "broadcast"):
        monkeypatch.setattr(dist, name, refuse)
    return FakeNCCL()


def _check_sync_opts(opts: Any, reduce: bool) -> None:
    """The options the torch.distributed functions pass for a synchronous call."""
    if hasattr(opts, "asyncOp"):
        assert opts.asyncOp is False
    if reduce:
        assert opts.reduceOp == dist.ReduceOp.SUM


def test_own_nccl_group_is_nccl_without_asking_torch(fake_nccl: FakeNCCL) -> None:
    assert groups.is_own_nccl(fake_nccl)
    assert collectives.is_nccl(fake_nccl)


def test_all_reduce_calls_allreduce(fake_nccl: FakeNCCL) -> None:
    buf = torch.arange(6, dtype=torch.float32)
    want = sum(buf + (r - RANK) for r in range(WORLD))
    collectives.all_reduce(buf, fake_nccl)
    assert torch.equal(buf, want)
    (name, shapes, opts), wait = fake_nccl.log
    assert (name, shapes, wait) == ("allreduce", [torch.Size([6])], "wait")
    _check_sync_opts(opts, reduce=True)


def test_equal_all_gather_calls_allgather_base(fake_nccl: FakeNCCL) -> None:
    send = torch.arange(8, dtype=torch.uint8)
    out = collectives.all_gather_equal(send, WORLD, fake_nccl)
    assert out.shape == (WORLD, 8) and all(torch.equal(out[r], send + (r - RANK)) for r in range(WORLD))
    (name, out_shape, in_shape, opts), wait = fake_nccl.log
    assert (name, out_shape, in_shape, wait) == ("_allgather_base", (WORLD, 8), (8,), "wait")
    _check_sync_opts(opts, reduce=False)
    # all_gatherv with equal sizes takes the same call
    fake_nccl.log.clear()
    got = collectives.all_gatherv(send, [8] * WORLD, RANK, fake_nccl)
    assert [g.shape for g in got] == [torch.Size([8])] * WORLD and fake_nccl.log[0][0] == "_allgather_base"


def test_uneven_all_gather_calls_allgather(fake_nccl: FakeNCCL) -> None:
    sizes = [3, 5, 0]
    got = collectives.all_gatherv(torch.zeros(sizes[RANK], dtype=torch.uint8), sizes, RANK, fake_nccl)
    assert [tuple(g.shape) for g in got] == [(3,), (5,), (0,)]
    assert all(bool((g == r).all()) for r, g in enumerate(got))
    (name, out_shapes, in_shape, opts), wait = fake_nccl.log
    assert (name, out_shapes, in_shape, wait) == ("allgather", [(3,), (5,), (0,)], (5,), "wait")
    _check_sync_opts(opts, reduce=False)


def test_equal_reduce_scatter_calls_reduce_scatter_base(fake_nccl: FakeNCCL) -> None:
    buf = torch.arange(WORLD * 4 * 2, dtype=torch.float32).view(WORLD * 4, 2)
    mine = collectives.reduce_scatterv(buf, [4] * WORLD, RANK, fake_nccl)
    want = sum(buf + (r - RANK) for r in range(WORLD))[RANK * 4:(RANK + 1) * 4]
    assert torch.equal(mine, want)
    (name, out_shape, in_shape, opts), wait = fake_nccl.log
    assert (name, out_shape, in_shape, wait) == ("_reduce_scatter_base", (4, 2), (WORLD * 4, 2), "wait")
    _check_sync_opts(opts, reduce=True)


def test_uneven_reduce_scatter_calls_reduce_scatter(fake_nccl: FakeNCCL) -> None:
    rows = [2, 3, 1]
    buf = torch.arange(sum(rows) * 2, dtype=torch.float32).view(sum(rows), 2)
    mine = collectives.reduce_scatterv(buf, rows, RANK, fake_nccl)
    chunk = buf[2:5]
    assert torch.equal(mine, sum(chunk + (r - RANK) for r in range(WORLD)))
    (name, out_shapes, in_shapes, opts), wait = fake_nccl.log
    assert (name, out_shapes, in_shapes, wait) == ("reduce_scatter", [(3, 2)], [(2, 2), (3, 2), (1, 2)], "wait")
    _check_sync_opts(opts, reduce=True)


def test_a_registered_group_still_goes_through_the_functions(monkeypatch) -> None:
    """A caller's registered NCCL group (here a sentinel the patched ``dist.get_backend`` calls NCCL)."""
    monkeypatch.delattr(dist, "ProcessGroupNCCL", raising=False)  # a CPU build: no such class at all
    group, calls = object(), []
    monkeypatch.setattr(dist, "get_backend", lambda g=None: "nccl" if g is group else "gloo")
    monkeypatch.setattr(dist, "all_reduce", lambda t, group=None: calls.append(("all_reduce", group)))
    monkeypatch.setattr(dist, "all_gather_into_tensor", lambda o, i, group=None: calls.append(("agit", group)))
    monkeypatch.setattr(dist, "reduce_scatter", lambda o, ins, group=None: calls.append(("rs", group)))
    assert not groups.is_own_nccl(group) and collectives.is_nccl(group)
    collectives.all_reduce(torch.zeros(2), group)
    collectives.all_gather_equal(torch.zeros(2), WORLD, group)
    collectives.reduce_scatterv(torch.zeros(6, 1), [2, 3, 1], RANK, group)
    assert calls == [("all_reduce", group), ("agit", group), ("rs", group)]


def test_which_caller_groups_carry_cuda_tensors_over_nccl(monkeypatch) -> None:
    names = {1: "nccl", 2: "cpu:gloo,cuda:nccl", 3: "gloo", 4: "cpu:gloo,cuda:gloo"}
    monkeypatch.setattr(dist, "get_backend", lambda g=None: names[g])
    assert [collectives.carries_cuda_over_nccl(g) for g in names] == [True, True, False, False]


def test_nccl_group_on_a_torch_without_nccl_is_a_typed_error(monkeypatch) -> None:
    """``ControlPlane.nccl_group`` refuses with ``EPError`` (not AttributeError) before any rendezvous."""
    from ep_comm.distributed.control import ControlPlane

    monkeypatch.delattr(dist, "ProcessGroupNCCL", raising=False)
    assert groups.nccl_class() is None and not groups.is_own_nccl(object())
    plane = ControlPlane.__new__(ControlPlane)  # only what nccl_group reads before it would meet the peers
    plane.broken, plane.labels, plane.rank = None, [0, 1], 1
    with pytest.raises(EPError, match="no ProcessGroupNCCL"):
        plane.nccl_group("data", torch.device("cuda", 0))
    with pytest.raises(EPError, match="no ProcessGroupNCCL"):
        groups.OwnGroups(dist.HashStore(), 0, 2, 5.0, [0, 1], "t").nccl("data", torch.device("cuda", 0),
                                                                          lambda: lambda: None)


def test_nccl_timeout_outlasts_ep_comm_detection() -> None:
    assert groups.nccl_timeout_s(5.0) == 600.0
    assert groups.nccl_timeout_s(100.0) == 2000.0
    for t in (0.5, 5.0, 60.0, 1000.0):  # far beyond timeout_s + ~10 s, the detection bound
        assert groups.nccl_timeout_s(t) >= 10 * (t + 10)


# -- the backend once its NCCL group was aborted ----------------------------------------------------------
class _Plane:
    """A stand-in control plane: no peers to agree with; ``failure`` builds the typed loss."""

    agreement = "none"

    def __init__(self) -> None:
        self.nccl_aborted: Optional[str] = None
        self.failures: list = []
        self.aborts: list = []
        self.released: list = []
        self.gone: dict = {}

    def lost_peers(self) -> dict:
        return self.gone

    def agree_start(self, op, epoch, num_tokens, error=None):
        def wait():
            if error is not None:
                raise error
            from ep_comm.distributed.control import PeerStatus

            return [PeerStatus(r, op, epoch, 0, num_tokens) for r in range(WORLD)]
        return wait

    def failure(self, op, epoch, exc):
        self.failures.append((op, epoch, str(exc)))
        return EPTimeoutError(f"rank {RANK}: lost rank 2 ({exc})", missing_ranks=[2], lost_ranks=[2])

    def abort_nccl_groups(self, why: str) -> None:
        self.aborts.append(why)

    def release_nccl_group(self, name: str) -> None:
        self.released.append(name)


def _backend(cls, fake: FakeNCCL, plane: _Plane):
    cfg = ep_comm.EPConfig(num_experts=2 * WORLD, top_k=2, hidden=8, max_tokens_per_rank=4, dtype=torch.float32,
                           layout="standard", backend=cls.name, timeout_s=5.0)
    ctx = BackendContext(cfg=cfg, group=fake, control=plane, topology=None,  # type: ignore[arg-type]
                         rank=RANK, world_size=WORLD, device=torch.device("cpu"))
    return cls(ctx)


@pytest.mark.parametrize("cls", [NaiveBackend, AllGatherReduceScatterBackend])
def test_calls_after_the_nccl_group_was_aborted_raise_the_loss(fake_nccl: FakeNCCL, cls) -> None:
    plane, fake_nccl.offset = _Plane(), False  # every peer sends what this rank sends
    backend = _backend(cls, fake_nccl, plane)
    x, ids, w = torch.zeros(2, 8), torch.tensor([[0, 1], [2, 3]]), torch.ones(2, 2)
    d, _ = backend.dispatch(DispatchCall(x, ids, w, None, 0), False)  # healthy: goes through
    assert plane.failures == []
    plane.nccl_aborted = "rank 2 is gone (its process 42 has exited)"  # what the watcher or failure() set
    for call in (lambda: backend.dispatch(DispatchCall(x, ids, w, None, 2), False),
                 lambda: backend.combine(CombineCall(torch.zeros(d.x.shape[0], 8), d, None), False),
                 backend.check_errors):
        with pytest.raises(EPTimeoutError) as err:
            call()
        assert list(err.value.lost_ranks) == [2]
    assert [f[2] for f in plane.failures] == [f"NCCL data group aborted: {plane.nccl_aborted}"] * 3
    backend.close()
    assert plane.released == ["data"]


@pytest.mark.parametrize("cls", [NaiveBackend, AllGatherReduceScatterBackend])
@pytest.mark.parametrize("dead", [False, True], ids=["peers_alive", "peer_dead"])
def test_garbage_from_a_collective_cut_short_is_the_loss(fake_nccl: FakeNCCL, cls, dead: bool) -> None:
    """NCCL's own error handling ended a collective before the watcher saw the loss: the peers' rows
    are garbage (here: every peer's header has a nonzero invalid-id count).  A dead peer makes that the typed
    loss; with every peer alive it is the peers' bad input, as the counts say."""
    plane = _Plane()
    plane.gone = {2: "its process 42 has exited"} if dead else {}
    backend = _backend(cls, fake_nccl, plane)  # offset: peer r's header counts r - RANK more invalid ids
    x, ids, w = torch.randn(2, 8), torch.tensor([[0, 1], [2, 3]]), torch.ones(2, 2)
    with pytest.raises(EPError) as err:
        backend.dispatch(DispatchCall(x, ids, w, None, 0), False)
    if dead:
        assert type(err.value) is EPTimeoutError and list(err.value.lost_ranks) == [2], err.value
        assert plane.failures == [(OP_DISPATCH, 0, "NCCL data group aborted: rank 2 is gone (its process 42 "
                                                    "has exited)")]
    else:
        assert type(err.value) is ep_comm.EPInputError and "invalid input on peer rank(s) [0, 2]" in str(err.value)
        assert plane.failures == []


@pytest.mark.parametrize("cls", [NaiveBackend, AllGatherReduceScatterBackend])
@pytest.mark.parametrize("dead", [False, True], ids=["peers_alive", "peer_dead"])
def test_an_error_torch_recorded_on_the_group_is_no_result(fake_nccl: FakeNCCL, cls, dead: bool) -> None:
    """torch's watchdog ended the collective (a peer's group was aborted) and recorded REMOTE_ERROR:
    the call raises the loss instead of returning what the collective left, naming the dead peer
    when there is one."""
    plane, fake_nccl.offset = _Plane(), False  # the rows themselves look valid
    plane.gone = {2: "its process 42 has exited"} if dead else {}
    backend = _backend(cls, fake_nccl, plane)
    x, ids, w = torch.randn(2, 8), torch.tensor([[0, 1], [2, 3]]), torch.ones(2, 2)
    backend.dispatch(DispatchCall(x, ids, w, None, 0), False)  # nothing recorded: a result
    fake_nccl.error = "REMOTE_ERROR"
    with pytest.raises(EPTimeoutError):  # the stand-in plane's failure() builds it
        backend.dispatch(DispatchCall(x, ids, w, None, 2), False)
    expected = "rank 2 is gone (its process 42 has exited)" if dead else "its NCCL group recorded REMOTE_ERROR"
    assert plane.failures == [(OP_DISPATCH, 2, f"NCCL data group aborted: {expected}")]


def test_nccl_error_reads_what_torch_recorded() -> None:
    assert groups.nccl_error(object()) is None  # a torch without the getter
    fake = FakeNCCL()
    assert groups.nccl_error(fake) is None
    fake.error = "COMM_ERROR"
    assert groups.nccl_error(fake) == "COMM_ERROR"

    class Raising:
        def get_error(self):
            raise RuntimeError("not for this backend")

    assert groups.nccl_error(Raising()) is None


def test_shrink_aborts_the_old_nccl_group_first(fake_nccl: FakeNCCL, monkeypatch) -> None:
    old, new = _Plane(), _Plane()
    made: list = []

    def nccl_group(name: str, device: torch.device) -> FakeNCCL:
        assert old.aborts, "the new group was made while the old one (with the lost rank) was not aborted"
        made.append((name, device))
        return FakeNCCL()

    new.nccl_group = nccl_group  # type: ignore[attr-defined]
    backend = _backend(NaiveBackend, fake_nccl, old)
    ctx = dataclasses.replace(backend.ctx, control=new, group=None, active_ranks=(0, 1))
    shrunk = backend.shrink(ctx)
    assert made == [("data", torch.device("cpu"))] and groups.is_own_nccl(shrunk.ctx.group)
    assert shrunk.ctx.group is not fake_nccl and shrunk.ctx.active_ranks == (0, 1)
    assert "without [2]" in old.aborts[0]
