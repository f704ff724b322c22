"""Helpers for the CLI tests: run ``python -m ep_comm ...`` as a subprocess with a timeout."""
from __future__ import annotations

import os
import subprocess
import sys
from typing import Sequence

import pytest

from ep_comm.distributed.spawn import LAUNCHER_VARS

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def clean_env(**extra: str) -> dict:
    """This environment minus any launcher variables (pytest itself may run under a launcher)."""
    env = {k: v for k, v in os.environ.items() if k not in LAUNCHER_VARS and k != "EP_COMM_BACKEND"}
    env.update(extra)
    return env


def run_cli(args: Sequence[str], timeout: float = 240, **extra_env: str) -> subprocess.CompletedProcess:
    """``python -m ep_comm <args>``; stdout/stderr captured as text."""
    return subprocess.run([sys.executable, "-m", "ep_comm", *args], cwd=REPO, env=clean_env(**extra_env),
                          capture_output=True, text=True, timeout=timeout)


def usable_backends() -> list[str]:
    """Registered backends the CLI's ranks can run here: kernel backends need GPUs."""
    import torch

    from ep_comm.backends import registered
    from ep_comm.backends.one_sided import OneSidedBackend

    return [n for n, cls in registered().items() if torch.cuda.is_available() or not issubclass(cls, OneSidedBackend)]


def collective_backends() -> list[str]:
    """Registered backends that run on CPU ranks (the kernel backends need GPUs)."""
    from ep_comm.backends import registered
    from ep_comm.backends.one_sided import OneSidedBackend

    return [n for n, cls in registered().items() if not issubclass(cls, OneSidedBackend)]


#: environment that makes the CLI's ranks CPU ranks over gloo, on GPU machines too
CPU_RANKS = {"CUDA_VISIBLE_DEVICES": ""}


@pytest.fixture(scope="session")
def cli():
    return run_cli
