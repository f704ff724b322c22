"""``ep-comm info``: what this job looks like to ep_comm.

Prints whether the CUDA kernels (``ep_comm._C``) are built and, when they are not, the command that
builds them; the ranks and hosts (the ``Topology`` every communicator sees), the CUDA devices of each host
with their peer-access (NVLink/PCIe P2P) matrix and ``nvidia-smi topo -m``, the IMEX channel state
(needed for cross-tray MNNVL), which backends are usable on *every* rank and, for each that is not,
why (one line), what ``backend="auto"`` would pick, and the memory layer's report.
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import os
import platform
import shutil
import subprocess
from typing import Any, Optional

import torch

from .. import __version__
from ..backends import AUTO_ORDER, extension
from ..backends.choice import merge_reasons
from ..config import BACKEND_ENV, EPConfig
from . import format_table
from .availability import auto_pick, local_reasons
from .launcher import RankEnv, agree_exit_code, gather_objects, setup_rank, teardown

#: how the CUDA kernels get built: on a GPU node, from the source checkout (README "Install")
BUILD_COMMAND = "python3 -m pip install --no-build-isolation -e ."

IMEX_DIR = "/dev/nvidia-caps-imex-channels"
#: variables that change what ep_comm or its transports do; shown so a report is reproducible
ENV_VARS = (
    BACKEND_ENV, "EP_COMM_HOST_ID", "CUDA_VISIBLE_DEVICES", "NCCL_NVLS_ENABLE", "NVSHMEM_DISABLE_NVLS",
    "TORCH_SYMM_MEM_DISABLE_MULTICAST", "NVSHMEM_REMOTE_TRANSPORT", "NCCL_P2P_DISABLE", "NCCL_DEBUG",
    "EP_COMM_NVSHMEM_PUT", "NVSHMEM_DISABLE_P2P", "NVSHMEM_SYMMETRIC_SIZE", "NVSHMEM_IB_ENABLE_IBGDA",
    "EP_COMM_SHM_AGREE",
)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--experts", type=int, default=256,
                   help="num_experts of the config the availability probes see (default: 256)")
    p.add_argument("--json", metavar="PATH", help="also write the report as JSON")


def check_arguments(args: argparse.Namespace) -> Optional[str]:
    if args.experts < 1:
        return "--experts must be >= 1"
    return None


def worker(args: argparse.Namespace) -> int:
    env = setup_rank(args.op_timeout)
    try:
        return agree_exit_code(env, _info(env, args))
    finally:
        teardown()


# -- facts gathered on every rank ---------------------------------------------------------------------------
def _rank_facts(env: RankEnv) -> dict:
    device = str(env.device)
    if env.device.type == "cuda":
        device += f" ({torch.cuda.get_device_name(env.device)})"
    return {"rank": env.rank, "host": env.topology.host_id, "local_rank": env.topology.local_rank,
            "device": device, "pid": os.getpid()}


def _host_facts() -> dict:
    """Per-host facts; collected on the first rank of each host only (they are the same for its peers)."""
    facts: dict[str, Any] = {"devices": [], "p2p": [], "nvidia_smi_topo": None, "imex": _imex_state()}
    n = torch.cuda.device_count() if torch.cuda.is_available() else 0
    for i in range(n):
        p = torch.cuda.get_device_properties(i)
        facts["devices"].append({
            "index": i, "name": p.name, "memory_gib": round(p.total_memory / 2**30, 1),
            "capability": f"{p.major}.{p.minor}", "sms": p.multi_processor_count,
        })
    facts["p2p"] = [[None if i == j else bool(torch.cuda.can_device_access_peer(i, j)) for j in range(n)]
                    for i in range(n)]
    facts["nvidia_smi_topo"] = _nvidia_smi_topo()
    return facts


def _nvidia_smi_topo() -> str:
    exe = shutil.which("nvidia-smi")
    if exe is None:
        return "nvidia-smi: not found on PATH"
    try:
        res = subprocess.run([exe, "topo", "-m"], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.SubprocessError) as exc:
        return f"nvidia-smi topo -m failed: {exc}"
    return (res.stdout or res.stderr).rstrip() or f"nvidia-smi topo -m: exit code {res.returncode}, no output"


def _imex_state() -> str:
    if not os.path.isdir(IMEX_DIR):
        return (f"{IMEX_DIR} absent: no IMEX channel, so FABRIC handles (cross-tray MNNVL on GB200 NVL72) "
                "cannot be created here; same-host P2P is unaffected")
    channels = sorted(os.listdir(IMEX_DIR))
    if not channels:
        return f"{IMEX_DIR} exists but holds no channel"
    usable = [c for c in channels if os.access(os.path.join(IMEX_DIR, c), os.R_OK | os.W_OK)]
    return f"{IMEX_DIR}: {', '.join(channels)} ({len(usable)} read/writable by this user)"


def _memory_report(env: RankEnv) -> str:
    """The memory layer's report.  Collective (it all-gathers every rank's probe): call on every rank."""
    try:
        from ..memory.info import memory_report
    except (ImportError, AttributeError) as exc:
        return f"memory layer: not available ({exc})"
    try:
        return str(memory_report(device_index=env.device.index if env.device.type == "cuda" else None)).rstrip()
    except Exception as exc:  # noqa: BLE001 - info must still print everything else
        return f"memory layer: report failed ({type(exc).__name__}: {exc})"


def _backend_reasons(env: RankEnv, experts: int, timeout_s: float) -> tuple[dict[str, str], str]:
    """``{backend: ""}`` if usable on this rank, else ``{backend: reason}``, and how eager calls of the
    collective backends agree on the host (``ControlPlane.agreement``); collective (control plane)."""
    world = env.world_size
    experts = experts if experts % world == 0 else world * max(1, experts // world)
    cfg = EPConfig(num_experts=experts, top_k=min(8, experts), hidden=7168, max_tokens_per_rank=128,
                   timeout_s=timeout_s)
    (reasons,), agreement = local_reasons(env, [cfg], timeout_s)
    return reasons, agreement


def _kernel_state() -> dict:
    """This rank's CUDA kernels (``ep_comm._C``): ``built``; else whether its file is there at all
    (``present``: it is, but cannot be loaded or was built from other sources) and the loader's reason."""
    if extension.built():
        return {"built": True, "present": True, "reason": ""}
    return {"built": False, "present": importlib.util.find_spec("ep_comm._C") is not None,
            "reason": extension.unavailable_reason()}


# -- the report ---------------------------------------------------------------------------------------------
def _info(env: RankEnv, args: argparse.Namespace) -> int:
    facts = _rank_facts(env)
    host = _host_facts() if env.topology.local_rank == 0 else None
    reasons, agreement = _backend_reasons(env, args.experts, args.op_timeout)
    memory = _memory_report(env)
    everyone = gather_objects(env, {"facts": facts, "host": host, "backends": reasons, "kernels": _kernel_state()})
    if not env.is_root:
        return 0
    report = _build_report(env, everyone)
    report["memory_report"] = memory  # rank 0's copy already covers every rank
    report["agreement"] = agreement  # the same on every rank (decided collectively)
    print(_render(report), flush=True)
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(report, fh, indent=2)
            fh.write("\n")
        print(f"wrote {args.json}", flush=True)
    return 0


def _build_report(env: RankEnv, everyone: list[dict]) -> dict:
    import torch.distributed as dist

    merged = merge_reasons([e["backends"] for e in everyone])
    backends = {name: {"usable": not why, "reason": why} for name, why in merged.items()}
    auto = auto_pick(merged)
    override = os.environ.get(BACKEND_ENV, "").strip() or None
    hosts = {}
    for e in everyone:
        if e["host"] is not None:
            hosts[e["facts"]["host"]] = e["host"]
    return {
        "versions": {
            "ep_comm": __version__, "torch": torch.__version__, "python": platform.python_version(),
            "cuda": torch.version.cuda, "nccl": _nccl_version(), "platform": platform.platform(),
            "mpi4py": _module_version("mpi4py"), "cuda_bindings": _module_version("cuda.bindings"),
            "nvshmem": _nvshmem_version(),
        },
        "launcher": env.launcher, "world_size": env.world_size, "process_group": dist.get_backend(),
        "ranks": [e["facts"] for e in everyone],
        "ranks_by_host": {h: list(rs) for h, rs in env.topology.ranks_by_host.items()},
        "hosts": hosts, "kernels": _kernels_report([e["kernels"] for e in everyone]), "backends": backends,
        "auto": {"env_override": override, "would_pick": override or auto, "order": list(AUTO_ORDER)},
        "env": {v: os.environ.get(v) for v in ENV_VARS},
    }


def _kernels_report(per_rank: list[dict]) -> dict:
    """The ranks' kernel states merged: ``built`` on every rank, else the ranks without them, whether
    any of those has an ``ep_comm._C`` that does not load, the first such rank's reason, and the build
    command."""
    without = [r for r, k in enumerate(per_rank) if not k["built"]]
    if not without:
        return {"built": True, "ranks_without": [], "present": True, "reason": "", "build_command": BUILD_COMMAND}
    first = per_rank[without[0]]
    return {"built": False, "ranks_without": without, "present": any(per_rank[r]["present"] for r in without),
            "reason": first["reason"], "build_command": BUILD_COMMAND}


def _nvshmem_version() -> Optional[str]:
    """NVSHMEM's version as ep_comm._C_nvshmem was built against it, or None when that is not built."""
    from ..memory import nvshmem_heap

    ext, _ = nvshmem_heap.extension()
    return None if ext is None else str(ext.VERSION)


def _nccl_version() -> Optional[str]:
    try:
        if torch.cuda.is_available():
            v = torch.cuda.nccl.version()
            return ".".join(map(str, v)) if isinstance(v, tuple) else str(v)
    except Exception:  # noqa: BLE001
        pass
    return None


def _module_version(name: str) -> Optional[str]:
    try:
        mod = __import__(name, fromlist=["_"])
    except Exception:  # noqa: BLE001 - optional dependency
        return None
    return str(getattr(mod, "__version__", "installed"))


def _render(rep: dict) -> str:
    v = rep["versions"]
    lines = [
        f"ep_comm {v['ep_comm']} | torch {v['torch']} | Python {v['python']} | CUDA {v['cuda'] or '-'} | "
        f"NCCL {v['nccl'] or '-'} | mpi4py {v['mpi4py'] or '-'} | cuda-bindings {v['cuda_bindings'] or '-'} | "
        f"NVSHMEM {v.get('nvshmem') or '-'}",
        f"launcher: {rep['launcher']}, world size {rep['world_size']}, process group {rep['process_group']}",
        "", "== CUDA kernels (ep_comm._C) ==", *_render_kernels(rep),
        "", "== ranks ==",
        format_table(["rank", "host", "local_rank", "device", "pid"],
                     [[r["rank"], r["host"], r["local_rank"], r["device"], r["pid"]] for r in rep["ranks"]],
                     right=(0, 2, 4)),
    ]
    for host, facts in rep["hosts"].items():
        lines += ["", f"== host {host}: ranks {rep['ranks_by_host'].get(host)} =="]
        if facts["devices"]:
            lines.append(format_table(["gpu", "name", "memory_GiB", "cc", "SMs"],
                                      [[d["index"], d["name"], d["memory_gib"], d["capability"], d["sms"]]
                                       for d in facts["devices"]], right=(0, 2, 4)))
            n = len(facts["p2p"])
            lines.append("peer access (torch.cuda.can_device_access_peer; row = from, column = to):")
            lines.append(format_table([""] + [f"gpu{j}" for j in range(n)],
                                      [[f"gpu{i}"] + ["X" if c is None else ("yes" if c else "no") for c in row]
                                       for i, row in enumerate(facts["p2p"])]))
        else:
            lines.append("CUDA devices: none visible (CPU ranks use gloo)")
        lines += ["nvidia-smi topo -m:", _indent(facts["nvidia_smi_topo"]), f"IMEX: {facts['imex']}"]
    lines += ["", "== backends (usable on every rank?) =="]
    width = max(len(n) for n in rep["backends"]) if rep["backends"] else 0
    kernels = rep["kernels"]
    for name, b in rep["backends"].items():
        # the missing kernels were said once, in their own section
        why = ("kernels not built (see CUDA kernels above)" if not kernels["built"] and b["reason"] == kernels["reason"]
               else b["reason"])
        lines.append(f"{name.ljust(width)}  " + ("usable" if b["usable"] else f"not usable: {why}"))
    auto = rep["auto"]
    if auto["env_override"]:
        lines.append(f"auto -> {auto['env_override']} (forced by ${BACKEND_ENV})")
    else:
        lines.append(f"auto -> {auto['would_pick'] or 'nothing usable'} (first usable of {', '.join(auto['order'])})")
    how = {"shared memory": "through a shared-memory file (every rank on one host; EP_COMM_SHM_AGREE=0: gloo)",
           "gloo": "over gloo (ranks on several hosts, /dev/shm unusable, or EP_COMM_SHM_AGREE=0)",
           "none": "not needed (one rank)"}
    lines.append(f"eager calls of naive/ag_rs agree on the host {how.get(str(rep.get('agreement')), '?')}")
    lines += ["", "== memory layer ==", rep.get("memory_report", "-")]
    lines += ["", "== environment =="]
    for var, val in rep["env"].items():
        lines.append(f"{var}={'(unset)' if val is None else val}")
    return "\n".join(lines)


def _render_kernels(rep: dict) -> list[str]:
    """The kernels section: built, or plainly not built (or not loadable) with the command that builds them."""
    k = rep["kernels"]
    if k["built"]:
        return ["built (the kernel backends can run where their devices allow; see backends below)"]
    where = "" if len(k["ranks_without"]) == len(rep["ranks"]) else f" on ranks {k['ranks_without']}"
    usable = [name for name, b in rep["backends"].items() if b["usable"]]
    head = (f"kernels built but not loadable{where}: {k['reason']}" if k["present"] else
            f"kernels not built{where}: this is a pure-Python install (no ep_comm._C), so only the backends "
            f"without kernels run ({', '.join(usable) or 'none usable here'})")
    return [head,
            "to build them: on a GPU node with a CUDA build of torch and nvcc, in the source checkout, run",
            f"  {k['build_command']}",
            "(--no-build-isolation lets the build see the installed torch; without it pip installs pure Python again)"]


def _indent(text: str, pad: str = "  ") -> str:
    return "\n".join(pad + line for line in str(text).splitlines())
