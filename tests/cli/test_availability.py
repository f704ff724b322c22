"""``ep_comm.cli.availability``: every rank's probe results merged, and what a request needs of them."""
from __future__ import annotations

import pytest

from ep_comm.backends import AUTO_ORDER
from ep_comm.cli.availability import auto_pick, request_blocker
from ep_comm.config import BACKEND_ENV, EPConfig


def _cfg(backend: str) -> EPConfig:
    return EPConfig(num_experts=8, top_k=2, hidden=128, max_tokens_per_rank=8, backend=backend)


def test_request_blocker_by_name_and_auto(monkeypatch):
    monkeypatch.delenv(BACKEND_ENV, raising=False)
    reasons = {"naive": "", "ag_rs": "", "mnnvl": "kernels not built", "nvshmem": "kernels not built"}
    assert request_blocker(_cfg("ag_rs"), reasons) == ""
    assert request_blocker(_cfg("mnnvl"), reasons) == "kernels not built"
    assert request_blocker(_cfg("auto"), reasons) == "" and auto_pick(reasons) == "ag_rs"
    nothing = {name: "no" for name in reasons}
    assert auto_pick(nothing) is None
    assert request_blocker(_cfg("auto"), nothing).startswith("no backend usable on every rank: ")
    assert all(f"{name}: no" in request_blocker(_cfg("auto"), nothing) for name in AUTO_ORDER)


@pytest.mark.parametrize("value, expect", [("mnnvl", "kernels not built"), ("ag_rs", ""), ("nosuch", BACKEND_ENV)])
def test_request_blocker_applies_the_backend_variable_to_auto_only(monkeypatch, value, expect):
    monkeypatch.setenv(BACKEND_ENV, value)
    reasons = {"naive": "", "ag_rs": "", "mnnvl": "kernels not built", "nvshmem": "kernels not built"}
    got = request_blocker(_cfg("auto"), reasons)
    assert (got == "") if not expect else (expect in got), got
    assert request_blocker(_cfg("naive"), reasons) == ""  # a backend named in the config is not overridden
