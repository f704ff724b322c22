"""Import ep_comm's vLLM adapter over the real vLLM, or over a stand-in where vLLM is not installed.

The GPU machines ep_comm is measured on have no vLLM.  ``vllm/`` in this folder is a stand-in for the
few names of vLLM that ``ep_comm.integrations.vllm`` imports (the modular kernel's base classes and
records, ``FusedMoEQuantConfig``, the two top-k reduction markers, the micro-batch id): enough to import
the adapter and drive it the way vLLM's ``FusedMoEKernel`` does.  It is not vLLM and computes nothing.
Used by ``examples/vllm_adapter_overhead.py`` and ``tests/integrations/test_vllm_gpu.py``.
"""
from __future__ import annotations

import os
import sys

ROOT = os.path.dirname(os.path.abspath(__file__))  # holds the stand-in package ``vllm``


def import_adapter(stand_in: bool = False) -> str:
    """Import ``ep_comm.integrations.vllm`` over the installed vLLM, or over the stand-in when vLLM is
    not importable or ``stand_in`` is set.  Puts the stand-in first on ``sys.path`` of this process only
    when it is used.  Returns which one: ``"vLLM <version>"`` or ``"vLLM stand-in (...why)"``."""
    if "ep_comm.integrations.vllm" in sys.modules:
        import vllm

        return _describe(vllm)
    why = "asked for"
    if not stand_in:
        try:
            import vllm
            import vllm.model_executor.layers.fused_moe.modular_kernel  # noqa: F401

            import ep_comm.integrations.vllm  # noqa: F401
            return _describe(vllm)
        except ImportError as exc:
            why = f"vLLM not importable here: {exc}"
    for name in [m for m in sys.modules if m == "vllm" or m.startswith("vllm.")]:
        del sys.modules[name]
    sys.path.insert(0, ROOT)
    import vllm

    import ep_comm.integrations.vllm  # noqa: F401

    assert getattr(vllm, "__file__", "").startswith(ROOT), vllm
    return f"vLLM stand-in ({why})"


def _describe(vllm) -> str:
    if getattr(vllm, "__file__", "").startswith(ROOT):
        return "vLLM stand-in"
    return f"vLLM {vllm.__version__}"
