"""``ep-comm info``: ranks, hosts, backend usability with reasons, memory layer section."""
from __future__ import annotations

import json
import os

import torch

from ep_comm.backends import extension, registered
from ep_comm.cli.main import main


def test_info_report(cli, tmp_path):
    path = tmp_path / "info.json"
    proc = cli(["info", "--nproc", "2", "--json", str(path)], timeout=180)
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
    if not torch.cuda.is_available():  # a kernel backend says why it cannot run on CPU ranks
        why = "needs CUDA" if extension.built() else "kernels are not built"
        assert not doc["backends"]["mnnvl"]["usable"] and why in doc["backends"]["mnnvl"]["reason"]


def test_no_subcommand_prints_help(capsys):
    assert main([]) == 2
    assert "bench" in capsys.readouterr().out
