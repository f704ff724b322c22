"""``ep-comm info``: ranks, hosts, the CUDA kernels' state, backend usability with reasons, memory layer section."""
from __future__ import annotations

import json
import os

import pytest

from ep_comm.backends import extension, registered
from ep_comm.cli import info
from ep_comm.cli.main import main

from .conftest import CPU_RANKS


@pytest.fixture(scope="module")
def info_run(cli, tmp_path_factory):
    path = tmp_path_factory.mktemp("info") / "info.json"
    proc = cli(["info", "--nproc", "2", "--json", str(path)], timeout=180, **CPU_RANKS)  # on GPU machines too
    return proc, path


def test_info_report(info_run):
    proc, path = info_run
    assert proc.returncode == 0, proc.stdout + proc.stderr
    out = proc.stdout
    assert out.count("== backends") == 1  # one report, from rank 0
    assert "world size 2" in out
    for name in registered():
        assert any(ln.startswith(name) and "usable" in ln for ln in out.splitlines()), name
    assert "auto -> " in out
    assert "== memory layer ==" in out and "memory" in out.split("== memory layer ==")[1]
    assert "IMEX" in out and "nvidia-smi" in out
    assert "eager calls of naive/ag_rs agree on the host" in out
    doc = json.loads(path.read_text())
    # two ranks of one host: the shared-memory agreement, unless this machine has no usable /dev/shm
    assert doc["agreement"] == ("shared memory" if os.path.isdir("/dev/shm") else "gloo")
    assert doc["world_size"] == 2 and len(doc["ranks"]) == 2
    assert set(doc["backends"]) == set(registered())
    assert doc["backends"]["naive"]["usable"] and doc["backends"]["ag_rs"]["usable"]
    assert all(doc["backends"][n]["usable"] or doc["backends"][n]["reason"] for n in registered())
    assert doc["kernels"]["built"] == extension.built()
    # a kernel backend says why it cannot run on CPU ranks
    why = "needs CUDA" if extension.built() else "kernels are not built"
    assert not doc["backends"]["mnnvl"]["usable"] and why in doc["backends"]["mnnvl"]["reason"]


@pytest.mark.skipif(extension.built(), reason="this install has the CUDA kernels (ep_comm._C)")
def test_info_says_kernels_not_built_and_how_to_build_them(info_run):
    """A pure-Python install: one section says so plainly, with the build command; the kernel backends'
    lines point there instead of repeating the loader's message."""
    proc, path = info_run
    assert proc.returncode == 0, proc.stdout + proc.stderr
    lines = proc.stdout.splitlines()
    start = lines.index("== CUDA kernels (ep_comm._C) ==")
    section = lines[start + 1: lines.index("", start)]
    assert section[0].startswith("kernels not built: this is a pure-Python install"), section
    assert "  python3 -m pip install --no-build-isolation -e ." in section
    assert start < lines.index("== backends (usable on every rank?) ==")
    for name in ("mnnvl", "nvshmem"):
        line = next(ln for ln in lines if ln.startswith(f"{name} "))
        assert line.endswith("not usable: kernels not built (see CUDA kernels above)"), line
    doc = json.loads(path.read_text())
    assert doc["kernels"] == {"built": False, "ranks_without": [0, 1], "present": False,
                              "reason": extension.unavailable_reason(),
                              "build_command": "python3 -m pip install --no-build-isolation -e ."}


def _rep(kernels: dict, ranks: int = 2) -> dict:
    backends = {"naive": {"usable": True, "reason": ""},
                "mnnvl": {"usable": False, "reason": kernels["reason"] or "needs CUDA"}}
    return {"kernels": {"build_command": info.BUILD_COMMAND, **kernels}, "ranks": [{}] * ranks, "backends": backends}


def test_kernel_section_per_state():
    built = info._render_kernels(_rep({"built": True, "ranks_without": [], "present": True, "reason": ""}))
    assert len(built) == 1 and built[0].startswith("built")
    missing = info._render_kernels(_rep({"built": False, "ranks_without": [0, 1], "present": False, "reason": "x"}))
    assert missing[0] == ("kernels not built: this is a pure-Python install (no ep_comm._C), so only the backends "
                          "without kernels run (naive)")
    assert f"  {info.BUILD_COMMAND}" in missing
    stale = info._render_kernels(_rep({"built": False, "ranks_without": [1], "present": True,
                                       "reason": "ep_comm._C was built from other sources"}))
    assert stale[0] == "kernels built but not loadable on ranks [1]: ep_comm._C was built from other sources"
    assert f"  {info.BUILD_COMMAND}" in stale


def test_kernels_report_merges_ranks():
    ok = {"built": True, "present": True, "reason": ""}
    gone = {"built": False, "present": False, "reason": "not built"}
    assert info._kernels_report([ok, ok])["built"] is True
    merged = info._kernels_report([ok, gone, gone])
    assert merged["built"] is False and merged["ranks_without"] == [1, 2] and merged["reason"] == "not built"
    assert merged["present"] is False and merged["build_command"] == info.BUILD_COMMAND


def test_no_subcommand_prints_help(capsys):
    assert main([]) == 2
    assert "bench" in capsys.readouterr().out
