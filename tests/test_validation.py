"""ep_comm.validation: the remembered checks never let a bad call through after a good one."""
from __future__ import annotations

import pytest
import torch

from ep_comm import EPConfig, EPInputError
from ep_comm.layouts import Dispatched
from ep_comm.validation import InputChecks

CPU = torch.device("cpu")


def _cfg() -> EPConfig:
    return EPConfig(num_experts=8, top_k=2, hidden=32, max_tokens_per_rank=16, dtype=torch.bfloat16)


def _inputs(t: int = 5):
    x = torch.randn(t, 32).bfloat16()
    ids = torch.randint(0, 8, (t, 2), dtype=torch.int32)
    return x, ids, torch.rand(t, 2)


def test_dispatch_checks_run_again_whenever_shape_dtype_or_device_change():
    checks = InputChecks(_cfg(), CPU)
    x, ids, w = _inputs()
    checks.dispatch(x, ids, w, None)
    checks.dispatch(*_inputs(), None)  # same shapes, new tensors: passes without re-checking
    bad = [
        (x, ids.float(), w, None),                      # ids dtype
        (x, ids, w.double(), None),                     # weights dtype
        (x[:, :16], ids, w, None),                      # hidden
        (torch.randn(17, 32).bfloat16(), *_inputs(17)[1:], None),  # T > max_tokens_per_rank
        (x, ids[:, :1], w, None),                       # top_k
        (x, ids, w, torch.ones(4, 1)),                  # scales rows != T
        (x, ids.tolist(), w, None),                     # not a tensor
        (x, ids, w, "scales"),                          # not a tensor
    ]
    for args in bad:
        with pytest.raises(EPInputError):
            checks.dispatch(*args)
        checks.dispatch(x, ids, w, None)  # the good signature still passes in between
    checks.dispatch(*_inputs(3), None)  # another T is checked and passes
    checks.dispatch(x, ids, w, torch.ones(5, 1))


def test_combine_checks_run_again_when_the_dispatched_or_out_change():
    cfg = _cfg()
    checks = InputChecks(cfg, CPU)
    d = Dispatched(layout="standard", x=torch.zeros(10, 32, dtype=torch.bfloat16), num_tokens=5, epoch=0)
    eo = torch.randn(10, 32).bfloat16()
    checks.combine(eo, d, None)
    checks.combine(eo, d, torch.empty(5, 32, dtype=torch.bfloat16))
    with pytest.raises(EPInputError):
        checks.combine(eo, d, torch.empty(5, 32, dtype=torch.float32))  # out dtype
    with pytest.raises(EPInputError):
        checks.combine(eo.int(), d, None)  # expert_out dtype
    d2 = Dispatched(layout="standard", x=torch.zeros(12, 32, dtype=torch.bfloat16), num_tokens=6, epoch=1)
    with pytest.raises(EPInputError):
        checks.combine(eo, d2, None)  # rows of another dispatch
    with pytest.raises(EPInputError):
        checks.combine(eo, d, torch.empty(6, 32, dtype=torch.bfloat16))  # out rows
    checks.combine(eo, d, None)


def test_nvfp4_dispatch_takes_activations_and_the_global_scale_as_x_scales():
    cfg = EPConfig(num_experts=8, top_k=2, hidden=32, max_tokens_per_rank=16, dtype=torch.bfloat16, quant="nvfp4")
    checks = InputChecks(cfg, CPU)
    x, ids, w = _inputs()
    gs = torch.rand(1) + 0.5
    checks.dispatch(x, ids, w, gs)
    checks.dispatch(x.float(), ids, w, gs.reshape(()))  # fp32 activations, a 0-d scale
    checks.dispatch(x.half(), ids, w, gs)
    bad = {
        "needs the global scale": (x, ids, w, None),
        "must be float32 of shape": (x, ids, w, torch.ones(5, 2)),  # per-token scales are not taken
        "float32 of shape \\[1\\]": (x, ids, w, gs.double()),
        "must be a torch.Tensor": (x, ids, w, 2.5),
        "needs x of bf16/fp16/fp32": (torch.randint(0, 255, (5, 16), dtype=torch.uint8), ids, w, gs),
        "expected \\[T, hidden=32\\]": (x[:, :16], ids, w, gs),
    }
    for message, args in bad.items():
        with pytest.raises(EPInputError, match=message):
            checks.dispatch(*args)
        checks.dispatch(x, ids, w, gs)


def test_nvfp4_global_scale_must_live_on_the_communicators_device():
    cfg = EPConfig(num_experts=8, top_k=2, hidden=32, max_tokens_per_rank=16, quant="nvfp4")
    meta = torch.device("meta")
    checks = InputChecks(cfg, meta)
    x, ids, w = (t.to(meta) for t in _inputs())
    checks.dispatch(x, ids, w, torch.ones(1, device=meta))
    with pytest.raises(EPInputError, match="global scale\\) is on cpu"):
        checks.dispatch(x, ids, w, torch.ones(1))
