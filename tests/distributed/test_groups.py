"""A control plane's own NCCL groups without NCCL: how they end (``OwnGroups`` with stand-in groups),
what the close markers and ``/proc`` say about a peer (``evidence``), and the watcher that aborts the
groups of a survivor whose host would otherwise wait forever behind a dead peer's kernel: a rank is
killed with SIGKILL and the survivors' stand-in NCCL groups are aborted, one survivor learning it from
``/proc``, the other, which cannot see the victim's process, from the first survivor's close marker."""
from __future__ import annotations

import os
import signal
import threading
import time

import torch
import torch.distributed as dist

from ep_comm.distributed import evidence, groups
from ep_comm.distributed.spawn import spawn_local


class FakePG:
    def __init__(self) -> None:
        self.calls: list[str] = []

    def abort(self) -> None:
        self.calls.append("abort")

    def shutdown(self) -> None:
        self.calls.append("shutdown")


def _own(pg: FakePG, name: str = "data") -> groups.OwnGroups:
    own = groups.OwnGroups(dist.HashStore(), 0, 2, 5.0, [0, 1], "t")
    own._nccl[name], own._made_nccl = (pg, torch.device("cpu")), True
    return own


def test_abort_is_once_and_names_why() -> None:
    pg = FakePG()
    own = _own(pg)
    own.abort_nccl("rank 1 is gone")
    own.abort_nccl("again")
    assert pg.calls == ["abort"] and own.aborted == "rank 1 is gone"
    own.release_nccl("data")
    assert own.close(abort=False) and pg.calls == ["abort"]


def test_release_shuts_down_once_the_device_is_drained(monkeypatch) -> None:
    pg = FakePG()
    own = _own(pg)
    monkeypatch.setattr(own, "_drained", lambda device: True)
    own.release_nccl("data")
    assert pg.calls == ["shutdown"] and own.aborted is None and not own.close(abort=False)


def test_release_aborts_when_the_device_does_not_drain(monkeypatch) -> None:
    pg = FakePG()
    own = _own(pg)
    monkeypatch.setattr(own, "_drained", lambda device: False)
    own.close(abort=False)
    assert pg.calls == ["abort"] and "did not finish" in str(own.aborted)


def test_close_after_a_loss_aborts() -> None:
    pg = FakePG()
    own = _own(pg)
    assert own.close(abort=True) and pg.calls == ["abort"]


class GraphHeldPG(FakePG):
    """A group whose abort and shutdown, like NCCL's, return only once the CUDA graphs that captured its
    collectives are destroyed (``released``)."""

    def __init__(self) -> None:
        super().__init__()
        self.released = threading.Event()

    def abort(self) -> None:
        super().abort()
        self.released.wait()

    def shutdown(self) -> None:
        super().shutdown()
        self.released.wait()


def test_abort_and_close_do_not_wait_for_graphs_that_hold_the_group(monkeypatch) -> None:
    monkeypatch.setattr(groups, "END_WAIT_S", 0.2)
    for how in ("abort", "close", "shutdown"):
        pg = GraphHeldPG()
        own = _own(pg)
        monkeypatch.setattr(own, "_drained", lambda device: True)
        t0 = time.monotonic()
        if how == "abort":
            own.abort_nccl("rank 1 is gone")
        else:
            own.close(abort=how == "close")
        took = time.monotonic() - t0
        assert took < 2.0, f"{how}: waited {took:.1f} s for a group held by a graph"
        assert pg.calls == ["shutdown" if how == "shutdown" else "abort"], (how, pg.calls)
        pg.released.set()  # the graph goes: the abort or shutdown on its thread finishes


def test_end_group_falls_back_to_abort_when_shutdown_fails() -> None:
    class NoShutdown(FakePG):
        def shutdown(self) -> None:
            super().shutdown()
            raise RuntimeError("not supported")

    pg = NoShutdown()
    assert groups.end_group(pg, shutdown=True) and pg.calls == ["shutdown", "abort"]


def test_without_nccl_groups_nothing_is_aborted() -> None:
    own = groups.OwnGroups(dist.HashStore(), 0, 2, 5.0, [0, 1], "t")
    own.abort_nccl("a loss")
    assert own.aborted is None and not own.close(abort=True)


def test_watch_reports_once_and_stops() -> None:
    seen: list[str] = []
    answers = iter([None, None, "rank 2 is gone"])
    watch = groups.LossWatch(lambda: next(answers, "again"), seen.append, interval_s=0.01)
    deadline = time.monotonic() + 5
    while not seen and time.monotonic() < deadline:
        time.sleep(0.01)
    time.sleep(0.05)
    watch.stop()
    assert seen == ["rank 2 is gone"]


def test_classify_tells_dead_peers_from_peers_that_closed() -> None:
    labels = [0, 1, 2, 3]
    markers = {
        1: evidence.decode_marker(evidence.encode_marker("closed", [], aborted=False), labels),
        2: evidence.decode_marker(evidence.encode_marker("closed", [], aborted=True), labels),
        3: evidence.decode_marker(evidence.encode_marker("it failed", [7], aborted=True), labels),  # 7: no member
    }
    gone, followers, dead = evidence.classify({}, markers, 0, labels)
    # 1 closed its end after draining: gone, but what it queued completes; 2 aborted its groups
    assert set(gone) == {1, 2, 3} and followers == {} and dead == {2, 3}
    gone, followers, dead = evidence.classify({3: "its process 7 has exited"}, {}, 0, labels)
    assert gone == {3: "its process 7 has exited"} and dead == {3}
    # a follower's blame makes its target dead, seen from a rank that cannot see the process
    markers = {1: evidence.decode_marker(evidence.encode_marker("it failed", [3], aborted=True), labels)}
    gone, followers, dead = evidence.classify({}, markers, 0, labels)
    assert gone == {3: "rank 1 lost it"} and followers == {1: [3]} and dead == {3}
    assert evidence.decode_marker("not json", labels) == ("not json", [], False)


def test_classify_a_follower_that_has_exited_is_no_loss_of_its_own() -> None:
    """World 3, rank 0 killed: rank 2 left because of it and exited before rank 1 looked; /proc shows
    both processes gone, and rank 2's marker says why it left."""
    labels = [0, 1, 2]
    exited = {0: "its process 10 has exited", 2: "its process 12 has exited"}
    left = {2: evidence.decode_marker(evidence.encode_marker("it failed", [0], aborted=True), labels)}
    assert evidence.classify(exited, left, 1, labels) == ({0: "its process 10 has exited"}, {2: [0]}, {0})
    assert set(evidence.classify(exited, {}, 1, labels)[0]) == {0, 2}  # without the marker: both look lost
    # it left blaming only this rank (slow, not lost): its exit is the news
    left = {2: evidence.decode_marker(evidence.encode_marker("it failed", [1], aborted=True), labels)}
    gone, followers, dead = evidence.classify({2: "its process 12 has exited"}, left, 1, labels)
    assert gone == {2: "its process 12 has exited"} and followers == {} and dead == {2}
    # a follower named by another follower (which saw its exit before its marker) is still a follower
    left = {2: evidence.decode_marker(evidence.encode_marker("it failed", [0], aborted=True), [0, 1, 2, 3]),
            3: evidence.decode_marker(evidence.encode_marker("it failed", [0, 2], aborted=True), [0, 1, 2, 3])}
    gone, followers, dead = evidence.classify({0: "killed", 2: "exited", 3: "exited"}, left, 1, [0, 1, 2, 3])
    assert gone == {0: "killed"} and followers == {2: [0], 3: [0, 2]} and dead == {0}


def test_loss_check_reads_the_store_only_after_a_new_marker() -> None:
    server = dist.TCPStore("127.0.0.1", 0, 1, True, wait_for_workers=False)
    store = dist.PrefixStore("plane/", server)
    asked: list[bool] = []

    def diagnose(use_store, st):
        asked.append(use_store)
        if use_store and st is not None and st.check(["left/1"]):
            return {2: "rank 1 lost it"}, {1: [2]}, {2}
        return {}, {}, set()

    check = evidence.loss_check(diagnose, store, [0, 1, 2])
    assert check() is None and asked == [False]
    store.set("left/1", "x")
    store.add(evidence.MARKER_COUNT, 1)
    assert check() == "rank 2 is gone (rank 1 lost it)" and asked == [False, False, True]


def test_loss_check_never_clones_a_file_store(tmp_path) -> None:
    """A clone would count in the file's clean-up and could remove it under the plane's members."""
    path = str(tmp_path / "store")
    members = [dist.FileStore(path, 2), dist.FileStore(path, 2)]
    asked: list[bool] = []
    checks = [evidence.loss_check(lambda use, st: (asked.append(use), ({}, {}, set()))[1],
                                  dist.PrefixStore("plane/", m), [0, 1]) for m in members]
    members[0].add(evidence.MARKER_COUNT, 1)
    assert [c() for c in checks] == [None, None] and asked == [False, False]  # /proc only
    del checks
    assert os.path.exists(path)


# -- the watcher across processes -------------------------------------------------------------------------
def _watch_worker(victim: int, blind: int) -> dict:
    """Every rank: a control plane with a stand-in NCCL group; ``victim`` kills itself; ``blind`` cannot
    see other processes (another machine, as far as ``/proc`` goes) and must learn it from a marker."""
    from ep_comm.distributed import init_distributed, liveness
    from ep_comm.distributed.control import OP_EXCHANGE, ControlPlane

    topo = init_distributed(timeout_s=60)
    rank = topo.rank
    if rank == blind:
        real = liveness._machine_id.__wrapped__
        liveness._machine_id = lambda: real() + "/elsewhere"  # type: ignore[assignment]
    made: list[FakePG] = []

    def new_group(*args, **kwargs):
        made.append(FakePG())
        return made[-1]

    dist.ProcessGroupNCCL = FakePG  # type: ignore[attr-defined]
    groups._new_nccl_group = new_group  # type: ignore[assignment]
    plane = ControlPlane(None, 5.0)
    pg = plane.nccl_group("data", torch.device("cpu"))
    assert pg is made[0]
    plane.barrier()
    if rank == victim:
        os.kill(os.getpid(), signal.SIGKILL)
    t0 = time.monotonic()
    while plane.nccl_aborted is None and time.monotonic() - t0 < 20:
        time.sleep(0.02)
    report = {"aborted": plane.nccl_aborted, "calls": list(made[0].calls), "after_s": time.monotonic() - t0}
    if rank != blind:
        # the main thread's own word: what a survivor does when its call fails (marker naming the victim)
        report["lost"] = list(plane.failure(OP_EXCHANGE, -1, RuntimeError("peer lost")).lost_ranks)
    else:
        report["lost"] = list(plane.lost_peers())
    plane.close()
    return report


def test_watcher_aborts_the_survivors_groups() -> None:
    victim, blind = 2, 0
    results = spawn_local(_watch_worker, 3, (victim, blind), timeout_s=120,
                          extra_env=lambda r: {"CUDA_VISIBLE_DEVICES": ""}, preload=["torch", "ep_comm"])
    assert results[victim].exitcode == -signal.SIGKILL, (results[victim].error, results[victim].traceback)
    for r in (0, 1):
        res = results[r]
        assert res.ok, f"rank {r}: {res.error_type}: {res.error}\n{res.traceback}"
        rep = res.value
        assert rep["aborted"] is not None, f"rank {r}: its NCCL group was never aborted: {rep}"
        assert "rank 2 is gone" in rep["aborted"], rep
        assert rep["calls"] == ["abort"], rep
        assert rep["lost"] == [victim], rep
    # the blind rank learnt it from the other survivor's marker, which it leaves once it raised
    assert "rank 1 lost it" in results[blind].value["aborted"], results[blind].value
    assert "has exited" in results[1].value["aborted"], results[1].value


def test_stop_from_the_watcher_thread_does_not_join_itself() -> None:
    holder: list = []
    done = threading.Event()

    def on_loss(why: str) -> None:
        holder[0].stop()
        done.set()

    holder.append(groups.LossWatch(lambda: "x", on_loss, interval_s=0.01))
    assert done.wait(5)
