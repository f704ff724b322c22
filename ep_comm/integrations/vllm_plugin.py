"""``vllm.general_plugins`` entry point: vLLM engines build their MoE layers' prepare/finalize on ep_comm.

Installing ep-comm registers ``register`` under vLLM's ``vllm.general_plugins`` group; vLLM calls it in
every process it starts.  It does nothing unless ``EP_COMM_VLLM=1`` is set, so an installed ep-comm never
changes an engine that did not ask for it.  With it set:

- the installed vLLM must be a version this adapter was checked against (``SUPPORTED_VLLM``), else
  ``register`` raises ``EPConfigError`` naming the version (set ``EP_COMM_VLLM_ANY_VERSION=1`` to try
  another one anyway);
- vLLM's ``maybe_make_prepare_finalize`` (``vllm/model_executor/layers/fused_moe/all2all_utils.py``, where
  every MoE kernel oracle asks for the prepare/finalize of its layer) is wrapped: for a layer that runs
  expert parallel with data parallel over ``--all2all-backend allgather_reducescatter`` (vLLM's default),
  it returns an ``EPCommPrepareAndFinalize`` over an ``ep_comm.Communicator`` of vLLM's EP group instead
  of vLLM's all-gather/reduce-scatter one.  Every other layer gets what vLLM would have built.

The communicator's backend is ``auto`` (``EP_COMM_BACKEND`` overrides it: ``mnnvl``/``nvshmem`` on GPUs,
``ag_rs``/``naive`` anywhere); layers with the same shape share one communicator.
"""
from __future__ import annotations

import atexit
import os
import sys
from typing import Any

from ..config import FP8_BLOCK, EPConfig
from ..errors import EPConfigError

ENABLE_ENV = "EP_COMM_VLLM"
ANY_VERSION_ENV = "EP_COMM_VLLM_ANY_VERSION"
#: vLLM release series whose prepare/finalize interface and kernel construction the adapter was run against
SUPPORTED_VLLM = ("0.32.",)

_communicators: dict[tuple, Any] = {}


def register() -> None:
    """The entry point vLLM calls in each of its processes (possibly several times)."""
    if os.environ.get(ENABLE_ENV, "").strip() in ("", "0"):
        return
    import vllm

    check_vllm_version(getattr(vllm, "__version__", "unknown"))
    install()


def check_vllm_version(version: str) -> None:
    """Raise ``EPConfigError`` unless ``version`` is a supported vLLM (or ``EP_COMM_VLLM_ANY_VERSION=1``)."""
    if version.startswith(SUPPORTED_VLLM) or os.environ.get(ANY_VERSION_ENV, "") == "1":
        return
    raise EPConfigError(f"${ENABLE_ENV}", os.environ.get(ENABLE_ENV),
                        f"ep_comm's vLLM integration supports vLLM {', '.join(s + 'x' for s in SUPPORTED_VLLM)}; "
                        f"this is vLLM {version}. Install a supported vLLM, unset {ENABLE_ENV}, or set "
                        f"{ANY_VERSION_ENV}=1 to try this version anyway")


def install() -> None:
    """Wrap vLLM's ``maybe_make_prepare_finalize`` where it is defined and wherever it was imported
    already.  Idempotent."""
    from vllm.model_executor.layers.fused_moe import all2all_utils

    original = all2all_utils.maybe_make_prepare_finalize
    if getattr(original, "_ep_comm_wrapper", False):
        return

    def maybe_make_prepare_finalize(moe: Any, quant_config: Any, routing_tables: Any = None,
                                    allow_new_interface: bool = False, use_monolithic: bool = False,
                                    all2all_manager: Any = None, input_dtype: Any = None) -> Any:
        if allow_new_interface and not use_monolithic and _wants_ep_comm(moe):
            return make_prepare_finalize(moe, quant_config)
        return original(moe, quant_config, routing_tables=routing_tables, allow_new_interface=allow_new_interface,
                        use_monolithic=use_monolithic, all2all_manager=all2all_manager, input_dtype=input_dtype)

    maybe_make_prepare_finalize._ep_comm_wrapper = True  # type: ignore[attr-defined]
    maybe_make_prepare_finalize.__wrapped__ = original  # type: ignore[attr-defined]
    # the kernel oracles import the function by name: rebind it in those already imported
    # (their own namespaces only: a module-level __getattr__ elsewhere may import things when asked)
    for name, module in list(sys.modules.items()):
        if name.startswith("vllm.") and vars(module).get("maybe_make_prepare_finalize") is original:
            module.maybe_make_prepare_finalize = maybe_make_prepare_finalize  # type: ignore[attr-defined]
    all2all_utils.maybe_make_prepare_finalize = maybe_make_prepare_finalize


def _wants_ep_comm(moe: Any) -> bool:
    par = moe.moe_parallel_config
    return bool(par.use_all2all_kernels and par.all2all_backend == "allgather_reducescatter")


def ep_group() -> Any:
    """The process group the communicators span: vLLM's expert-parallel group (its device group: NCCL on
    GPUs, gloo on CPUs)."""
    from vllm.distributed import get_ep_group

    return get_ep_group().device_group


def config_for(moe: Any, quant_config: Any, world_size: int) -> EPConfig:
    """The ``EPConfig`` of a vLLM MoE layer (``FusedMoEConfig``): its experts, top-k, hidden size, the
    scheduler's token budget per rank and activation dtype; the batched layout where vLLM selected
    batched experts; ep_comm's fp8 dispatch where the experts take vLLM's fp8 block-quantised
    activations (the same format, quantised inside dispatch)."""
    from .vllm import _is_fp8_per_token_block

    fp8 = _is_fp8_per_token_block(quant_config) and moe.hidden_dim % FP8_BLOCK == 0
    cfg = EPConfig(num_experts=moe.num_experts, top_k=moe.experts_per_token, hidden=moe.hidden_dim,
                   max_tokens_per_rank=moe.max_num_tokens, dtype=moe.in_dtype,
                   layout="batched" if moe.moe_parallel_config.use_batched_activation_format else "standard",
                   quant="fp8" if fp8 else None)
    cfg.check_world(world_size)
    return cfg


def make_prepare_finalize(moe: Any, quant_config: Any, group: Any = None) -> Any:
    """``EPCommPrepareAndFinalize`` for one vLLM MoE layer; collective over ``group`` (default: vLLM's EP
    group), so every rank must build its layers in the same order (vLLM does)."""
    import torch.distributed as dist

    from .. import Communicator
    from .vllm import EPCommPrepareAndFinalize

    group = ep_group() if group is None else group
    cfg = config_for(moe, quant_config, dist.get_world_size(group))
    key = (cfg, id(group))
    comm = _communicators.get(key)
    if comm is None:
        comm = _communicators[key] = Communicator(cfg, group=group)
    return EPCommPrepareAndFinalize(comm)


@atexit.register
def _close_communicators() -> None:
    for comm in _communicators.values():
        comm.close("vLLM process exiting")
    _communicators.clear()
