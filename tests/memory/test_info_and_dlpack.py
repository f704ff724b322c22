"""memory_report on a machine without CUDA, and the DLPack tensor-over-pointer helper."""
from __future__ import annotations

import ctypes
import gc
import random

import pytest
import torch

from ep_comm.distributed.exchange import LocalExchange
from ep_comm.memory import memory_info, memory_report
from ep_comm.memory._dlpack import live_views, tensor_from_pointer

from . import fake_cuda


def test_report_without_cuda_says_so(monkeypatch: pytest.MonkeyPatch) -> None:
    from ep_comm.memory import _driver, probe

    def no_bindings():
        raise ImportError("No module named 'cuda'")

    monkeypatch.setattr(_driver, "driver", no_bindings)
    probe._probe_cached.cache_clear()
    try:
        text = memory_report(LocalExchange())
        info = memory_info(LocalExchange())
    finally:
        probe._probe_cached.cache_clear()
    assert "no CUDA" in text and "cuda-bindings" in text
    assert info["cuda"] is False and info["plan"] is None and "EPTopologyError" in info["plan_error"]


def test_report_with_fake_driver_shows_handle_per_peer(monkeypatch: pytest.MonkeyPatch) -> None:
    from ep_comm.memory import _driver, probe, symmetric

    monkeypatch.setattr(_driver, "_DRIVER", None)
    monkeypatch.setattr(symmetric, "_TENSOR_DEVICE_TYPE", "cuda")
    fake_cuda.install()
    try:
        text = memory_report(LocalExchange(), device_index=0)
    finally:
        probe._probe_cached.cache_clear()
    assert "fabric supported but not permitted (no IMEX channel" in text
    assert "handle per peer (rank:type): 0:none" in text and "0000:18:00.0" in text


def test_tensor_views_memory_and_keeps_owner_alive() -> None:
    n = random.randrange(8, 256)
    raw = (ctypes.c_uint8 * n)(*random.randbytes(n))

    class Owner:
        alive = 0

        def __init__(self) -> None:
            Owner.alive += 1

        def __del__(self) -> None:
            Owner.alive -= 1

    before = live_views()
    t = tensor_from_pointer(ctypes.addressof(raw), n, torch.device("cpu"), owner=Owner())
    assert t.dtype == torch.uint8 and t.shape == (n,) and t.data_ptr() == ctypes.addressof(raw)
    assert bytes(t.tolist()) == bytes(raw)
    t[n // 2] = (raw[n // 2] + 1) % 256
    assert raw[n // 2] == t[n // 2].item()  # a view, not a copy
    view = t[1:5]
    del t
    gc.collect()
    assert Owner.alive == 1 and live_views() == before + 1  # the slice still needs the memory
    del view
    gc.collect()
    assert Owner.alive == 0 and live_views() == before


def test_tensor_needs_cuda_index() -> None:
    with pytest.raises(ValueError):
        tensor_from_pointer(0, 1, torch.device("cuda"))
