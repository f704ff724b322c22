import pytest
import torch

from ep_comm import EPConfig, EPConfigError
from ep_comm.config import BACKEND_ENV


def cfg(**kw):
    base = dict(num_experts=16, top_k=4, hidden=256, max_tokens_per_rank=8)
    base.update(kw)
    return EPConfig(**base)


def test_defaults_and_derived():
    c = cfg(dtype="bf16")
    assert c.dtype is torch.bfloat16
    assert c.num_local_experts(4) == 4
    assert c.capacity(4) == 32


@pytest.mark.parametrize(
    "field,value",
    [("num_experts", 0), ("num_experts", -3), ("top_k", 0), ("hidden", 1.5), ("max_tokens_per_rank", 0),
     ("top_k", 17), ("layout", "rank_major"), ("backend", "deepep"), ("quant", "int4"), ("dtype", "int8"),
     ("dtype", torch.int32), ("timeout_s", 0), ("timeout_s", float("inf")), ("num_experts", True),
     ("zero_copy", 1)],
)
def test_bad_field_names_field_and_value(field, value):
    with pytest.raises(EPConfigError) as info:
        cfg(**{field: value})
    assert isinstance(info.value, ValueError)
    name = "dtype" if field == "dtype" else ("top_k" if field == "top_k" else field)
    assert f"EPConfig.{name}=" in str(info.value)
    assert repr(value) in str(info.value) or str(value) in str(info.value)


def test_fp8_needs_hidden_multiple_of_128():
    with pytest.raises(EPConfigError, match="hidden"):
        cfg(hidden=200, quant="fp8")
    assert cfg(hidden=256, quant="fp8").quant == "fp8"


def test_nvfp4_needs_hidden_multiple_of_16():
    with pytest.raises(EPConfigError, match="quant='nvfp4' needs hidden % 16 == 0") as info:
        cfg(hidden=200, quant="nvfp4")
    assert info.value.field == "hidden" and info.value.value == 200
    for dtype in ("bf16", "fp16", "fp32"):
        c = cfg(hidden=208, quant="nvfp4", dtype=dtype, layout="batched")
        assert c.quant == "nvfp4" and c.hidden == 208
    with pytest.raises(EPConfigError, match="quant"):
        cfg(quant="NVFP4")


def test_world_divisibility():
    c = cfg(num_experts=12)
    c.check_world(4)
    with pytest.raises(EPConfigError, match="divisible by the world size 5"):
        c.check_world(5)


def test_backend_env_overrides_only_auto(monkeypatch):
    monkeypatch.setenv(BACKEND_ENV, "naive")
    assert cfg().resolved_backend_request() == "naive"
    assert cfg(backend="ag_rs").resolved_backend_request() == "ag_rs"
    monkeypatch.setenv(BACKEND_ENV, "bogus")
    with pytest.raises(EPConfigError, match="bogus"):
        cfg().resolved_backend_request()
    monkeypatch.delenv(BACKEND_ENV)
    assert cfg().resolved_backend_request() == "auto"


def test_zero_copy_is_for_the_standard_layout():
    assert cfg(zero_copy=True).zero_copy
    with pytest.raises(EPConfigError, match="standard layout"):
        cfg(zero_copy=True, layout="batched")
