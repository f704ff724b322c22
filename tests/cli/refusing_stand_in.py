"""CPU stand-ins for backends that handle bad input worse than naive and ag_rs, so ``ep-comm stress
--faults`` shows on gloo ranks what it reports for them (the backends that refuse every call after
bad input today, mnnvl and nvshmem, need GPUs).

``RefusingStandIn`` wraps a real ``naive`` ``Communicator``.  Mode "refuse": once a call (or
``check_errors``) has raised, every later call raises the ``EPError`` the kernel backends raise then
("communicator unusable ... create a new Communicator").  Mode "untyped": every error a call raises
comes out as a plain ``RuntimeError``.  Everything else is the real communicator's.
"""
from __future__ import annotations

import argparse
import contextlib
from typing import Any, Callable, Optional

import torch

from ep_comm import Communicator, EPConfig
from ep_comm.errors import EPError
from ep_comm.layouts import Dispatched

#: "refuse" or "untyped" (see the module docstring), set in each rank by ``stress_rank``
MODE = "refuse"


class RefusingStandIn:
    """A naive communicator that refuses every call after one raised, or raises untyped errors."""

    def __init__(self, cfg: EPConfig, device: Optional[torch.device] = None):
        self._comm = Communicator(cfg, device=device)
        self.cfg = cfg
        self.backend = self._comm.backend
        self.device = self._comm.device
        self.capabilities = self._comm.capabilities
        self._unusable: Optional[str] = None

    def dispatch(self, x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor,
                 x_scales: Optional[torch.Tensor] = None) -> Dispatched:
        return self._guarded(lambda: self._comm.dispatch(x, topk_ids, topk_weights, x_scales))

    def combine(self, expert_out: torch.Tensor, dispatched: Dispatched,
                out: Optional[torch.Tensor] = None) -> torch.Tensor:
        return self._guarded(lambda: self._comm.combine(expert_out, dispatched, out))

    def check_errors(self) -> None:
        self._guarded(self._comm.check_errors)

    def dispatch_input_buffer(self) -> torch.Tensor:
        return self._comm.dispatch_input_buffer()

    def expert_output_buffer(self, dispatched: Dispatched) -> torch.Tensor:
        return self._comm.expert_output_buffer(dispatched)

    def close(self, reason: str = "closed") -> None:
        self._comm.close(reason)

    def _guarded(self, call: Callable[[], Any]) -> Any:
        if self._unusable is not None:
            raise EPError(f"communicator unusable: rank {self._comm.rank} abandoned a call after invalid input "
                          f"({self._unusable}); create a new Communicator")
        try:
            return call()
        except Exception as exc:
            if MODE == "untyped":
                raise RuntimeError(str(exc)) from None
            self._unusable = f"{type(exc).__name__}: {exc}"
            raise


def stress_rank(args: argparse.Namespace, out_path: str, mode: str) -> int:
    """One rank of ``ep-comm stress`` on the stand-in in ``mode``; rank 0's output goes to ``out_path``."""
    import os

    from ep_comm.cli import stress

    global MODE
    MODE = mode
    stress.Communicator = RefusingStandIn  # this rank's process only: stress creates its communicators here
    path = out_path if os.environ.get("RANK") == "0" else os.devnull
    with open(path, "w") as f, contextlib.redirect_stdout(f):
        return stress.worker(args)
