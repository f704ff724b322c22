"""The process-wide NVSHMEM state of ``ep_comm.memory.nvshmem_heap`` without a GPU: what
``stop_runtime`` does when nothing of ours runs, and that it refuses while a buffer is open.  The
start, reuse and stop on GPUs are in tests/backends/one_sided/test_nvshmem.py."""
from __future__ import annotations

import pytest

from ep_comm.errors import EPError
from ep_comm.memory import nvshmem_heap


@pytest.fixture
def runtime(monkeypatch):
    """A fresh copy of the process-wide state, restored afterwards."""
    fresh = nvshmem_heap._Runtime()
    monkeypatch.setattr(nvshmem_heap, "_RT", fresh)
    return fresh


class _Ext:
    VERSION = "test"

    def __init__(self) -> None:
        self.finalized = 0

    def finalize(self) -> None:
        self.finalized += 1


def test_stop_without_a_running_nvshmem_does_nothing(runtime, monkeypatch) -> None:
    ext = _Ext()
    monkeypatch.setattr(nvshmem_heap, "extension", lambda: (ext, ""))
    assert nvshmem_heap.stop_runtime() is False
    assert ext.finalized == 0


def test_stop_finalises_an_idle_nvshmem_once_and_forgets_its_start(runtime, monkeypatch) -> None:
    ext = _Ext()
    monkeypatch.setattr(nvshmem_heap, "extension", lambda: (ext, ""))
    runtime.started_here, runtime.job = True, b"uid"
    assert "started by ep_comm, idle, 0 buffer(s)" in nvshmem_heap.runtime_summary()
    assert nvshmem_heap.stop_runtime() is True
    assert ext.finalized == 1
    assert (runtime.started_here, runtime.job) == (False, b"")
    assert "not started, 0 buffer(s)" in nvshmem_heap.runtime_summary()
    assert nvshmem_heap.stop_runtime() is False
    assert ext.finalized == 1


def test_stop_refuses_while_a_buffer_is_open(runtime, monkeypatch) -> None:
    ext = _Ext()
    monkeypatch.setattr(nvshmem_heap, "extension", lambda: (ext, ""))
    runtime.started_here, runtime.users = True, 1
    with pytest.raises(EPError, match="1 buffer"):
        nvshmem_heap.stop_runtime()
    assert ext.finalized == 0


def test_a_lost_peer_leaves_nvshmem_running_and_unstoppable(runtime, monkeypatch) -> None:
    """After a lost peer, finalising would wait for it forever: stop_runtime declines."""
    ext = _Ext()
    monkeypatch.setattr(nvshmem_heap, "extension", lambda: (ext, ""))
    runtime.started_here, runtime.users = True, 1
    nvshmem_heap.release_runtime(collective=False)
    assert runtime.users == 0 and runtime.poisoned
    assert nvshmem_heap.stop_runtime() is False
    assert ext.finalized == 0


def test_the_last_release_keeps_nvshmem_running(runtime, monkeypatch) -> None:
    ext = _Ext()
    monkeypatch.setattr(nvshmem_heap, "extension", lambda: (ext, ""))
    runtime.started_here, runtime.users = True, 2
    nvshmem_heap.release_runtime(collective=True)
    nvshmem_heap.release_runtime(collective=True)
    assert runtime.users == 0 and runtime.started_here and not runtime.poisoned
    assert ext.finalized == 0
