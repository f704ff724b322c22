"""The process-wide NVSHMEM state of ``ep_comm.memory.nvshmem_heap`` without a GPU: what
``stop_runtime`` does when nothing of ours runs, and that it refuses while a buffer is open.  The
start, reuse and stop on GPUs are in tests/backends/one_sided/test_nvshmem.py."""
from __future__ import annotations

import pytest

from ep_comm.errors import EPError
from ep_comm.memory import nvshmem_heap


class _Ext:
    VERSION = "test"

    def __init__(self) -> None:
        self.finalized = 0

    def finalize(self) -> None:
        self.finalized += 1


@pytest.fixture
def runtime(monkeypatch) -> tuple[nvshmem_heap._Runtime, _Ext]:
    """A fresh copy of the process-wide state (restored afterwards), and the stand-in extension it
    runs over, which counts its finalisations."""
    fresh, ext = nvshmem_heap._Runtime(), _Ext()
    monkeypatch.setattr(nvshmem_heap, "_RT", fresh)
    monkeypatch.setattr(nvshmem_heap, "extension", lambda: (ext, ""))
    return fresh, ext


def test_stop_without_a_running_nvshmem_does_nothing(runtime) -> None:
    rt, ext = runtime
    assert nvshmem_heap.stop_runtime() is False
    assert ext.finalized == 0


def test_stop_finalises_an_idle_nvshmem_once_and_forgets_its_start(runtime) -> None:
    rt, ext = runtime
    rt.started_here, rt.job = True, b"uid"
    assert "started by ep_comm, idle, 0 buffer(s)" in nvshmem_heap.runtime_summary()
    assert nvshmem_heap.stop_runtime() is True
    assert ext.finalized == 1
    assert (rt.started_here, rt.job) == (False, b"")
    assert "not started, 0 buffer(s)" in nvshmem_heap.runtime_summary()
    assert nvshmem_heap.stop_runtime() is False
    assert ext.finalized == 1


def test_stop_refuses_while_a_buffer_is_open(runtime) -> None:
    rt, ext = runtime
    rt.started_here, rt.users = True, 1
    with pytest.raises(EPError, match="1 buffer"):
        nvshmem_heap.stop_runtime()
    assert ext.finalized == 0


def test_a_lost_peer_leaves_nvshmem_running_and_unstoppable(runtime) -> None:
    """After a lost peer, finalising would wait for it forever: stop_runtime declines."""
    rt, ext = runtime
    rt.started_here, rt.users = True, 1
    nvshmem_heap.release_runtime(collective=False)
    assert rt.users == 0 and rt.poisoned
    assert nvshmem_heap.stop_runtime() is False
    assert ext.finalized == 0


def test_the_last_release_keeps_nvshmem_running(runtime) -> None:
    rt, ext = runtime
    rt.started_here, rt.users = True, 2
    nvshmem_heap.release_runtime(collective=True)
    nvshmem_heap.release_runtime(collective=True)
    assert rt.users == 0 and rt.started_here and not rt.poisoned
    assert ext.finalized == 0
