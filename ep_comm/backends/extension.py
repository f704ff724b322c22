"""The CUDA extension ``ep_comm._C``: loading it, and why it cannot be used when it cannot.

Its ops live under ``torch.ops.ep_comm`` (each family registers the fake implementations of its own
ops for ``torch.compile``).  Without a CUDA build of torch or nvcc at install time the extension is
absent and the package runs as pure Python: the collective backends then use torch ops only.
"""
from __future__ import annotations

import functools
from types import ModuleType
from typing import Optional

import torch

from . import protocol

#: how to get the kernels, for every message that says they are missing
BUILD_HINT = ("they are compiled by `python3 -m pip install --no-build-isolation -e .` on a machine with a CUDA "
              "build of torch and nvcc (pip's default build isolation hides the installed torch from the build; "
              "EP_COMM_BUILD_CUDA=1 makes the build fail loudly instead of skipping it)")


@functools.cache
def _load() -> tuple[Optional[ModuleType], str]:
    try:
        from .. import _C  # type: ignore[attr-defined]
    except ImportError as exc:
        return None, f"the CUDA kernels are not built (ep_comm._C: {exc}); {BUILD_HINT}"
    why = fingerprint_mismatch(_C, "ep_comm._C")
    return (None, why) if why else (_C, "")


def fingerprint_mismatch(module: ModuleType, what: str) -> str:
    """'' when ``module`` was built from this package's protocol table, else what to do."""
    built = int(getattr(module, "PROTOCOL_FINGERPRINT", -1))
    if built != protocol.FINGERPRINT:
        return (f"{what} was built from other sources (protocol fingerprint {built}, this package "
                f"{protocol.FINGERPRINT}): reinstall the package")
    return ""


def built() -> bool:
    """Whether ``ep_comm._C`` is installed and matches this package (no CUDA needed to ask)."""
    return _load()[0] is not None


def extension() -> ModuleType:
    """The loaded extension module; raises ``ImportError`` with the reason when it is absent."""
    ext, why = _load()
    if ext is None:
        raise ImportError(why)
    return ext


def unavailable_reason() -> str:
    """'' when the kernels can run here, else why not."""
    if not built():
        return _load()[1]
    if not torch.cuda.is_available():
        return "needs CUDA (this torch has no usable GPU)"
    return ""
