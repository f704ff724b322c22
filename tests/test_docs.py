"""The documentation stays true to the code: it stands alone (links stay inside the repository and
resolve, anchors included), the README fits in 200 lines and its usage snippet runs and prints its own
check, every environment variable the code reads is documented in docs/operations.md and nothing
documented there is gone from the code, every ``ep-comm`` flag the docs show exists, and bench/ holds
exactly what the docs cite."""
from __future__ import annotations

import os
import re
import subprocess
import sys
import tempfile

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
LINK = re.compile(r"\]\(([^)\s]+)\)")
SECTION_REF = re.compile(r"docs/design\.md §(\d+)(?:[–-]§?(\d+))?")
ENV_NAME = re.compile(r"\bEP_COMM_[A-Z0-9_]*[A-Z0-9]\b")
RESULT_FILE = re.compile(r"\b\d{4}-\d\d-\d\d-[A-Za-z0-9._-]+\.(?:json|txt)\b")


def _tracked(*suffixes: str) -> list[str]:
    try:
        out = subprocess.run(["git", "ls-files"], cwd=REPO, capture_output=True, text=True, timeout=60).stdout.split()
    except OSError:
        out = []
    if not out:  # not a git checkout (an sdist): walk the tree
        out = [os.path.relpath(os.path.join(d, f), REPO) for d, _, fs in os.walk(REPO) if ".git" not in d for f in fs]
    return sorted(p for p in out if p.endswith(suffixes) and os.path.exists(os.path.join(REPO, p)))


def _read(rel: str) -> str:
    with open(os.path.join(REPO, rel), encoding="utf-8") as f:
        return f.read()


def _docs() -> list[str]:
    """The user-facing documents: README.md and docs/*.md."""
    return ["README.md"] + [p for p in _tracked(".md") if p.startswith("docs/")]


def _outside_code_blocks(text: str) -> list[str]:
    lines, fenced = [], False
    for line in text.splitlines():
        if line.lstrip().startswith("```"):
            fenced = not fenced
        elif not fenced:
            lines.append(line)
    return lines


def _anchors(text: str) -> set[str]:
    """GitHub's heading anchors: lower case, punctuation dropped, spaces to dashes, -N for repeats."""
    anchors: set[str] = set()
    counts: dict[str, int] = {}
    for line in _outside_code_blocks(text):
        m = re.match(r"#{1,6}\s+(.*?)\s*#*\s*$", line)
        if m:
            slug = re.sub(r"[^\w\- ]", "", m.group(1).strip().lower()).replace(" ", "-")
            n = counts.get(slug, 0)
            counts[slug] = n + 1
            anchors.add(slug if n == 0 else f"{slug}-{n}")
    return anchors


def test_markdown_links_stay_inside_the_repository_and_resolve():
    problems = []
    for rel in _tracked(".md"):
        for target in LINK.findall(_read(rel)):
            if re.match(r"[a-z]+://|mailto:", target):
                continue
            file_part, _, anchor = target.partition("#")
            path = (os.path.normpath(os.path.join(os.path.dirname(os.path.join(REPO, rel)), file_part))
                    if file_part else os.path.join(REPO, rel))
            if not path.startswith(REPO + os.sep) or not os.path.exists(path):
                problems.append(f"{rel}: {target}")
            elif anchor and path.endswith(".md") and anchor not in _anchors(_read(os.path.relpath(path, REPO))):
                problems.append(f"{rel}: {target} (no such heading)")
    assert problems == []


def test_no_reference_to_files_outside_the_repository():
    offenders = [rel for rel in _tracked(".md", ".py", ".sh", ".sbatch", ".toml")
                 if rel != "tests/test_docs.py" and re.search(r"\.\./shared|DESIGN\.md|DESIGN §", _read(rel))]
    assert offenders == []


def test_design_section_references_exist():
    design = _read("docs/design.md")
    sections = {int(n) for n in re.findall(r"^## (\d+)\. ", design, re.M)}
    assert sections == set(range(1, max(sections) + 1))
    bad = []
    for rel in _tracked(".md", ".py", ".sh", ".sbatch"):
        for first, last in SECTION_REF.findall(_read(rel)):
            for n in (first, last):
                if n and int(n) not in sections:
                    bad.append(f"{rel}: §{n}")
    assert bad == []


def test_readme_fits_in_200_lines():
    assert len(_read("README.md").splitlines()) <= 200


def test_repository_paths_the_docs_name_exist():
    """A file path in README.md, docs/*.md, csrc/README.md or the launch/ and bench/ READMEs names a file
    of this repository (from its root, or from the document's folder)."""
    path = re.compile(r"(?<![\w/.~$-])((?:[\w-]+/)+[\w.-]+\.(?:py|sh|sbatch|md|cu|cuh|h|cpp|toml|json|txt))\b")
    docs = ["README.md", "docs/design.md", "docs/operations.md", "docs/performance.md", "docs/vllm.md",
            "csrc/README.md"]
    docs += [p for p in _tracked("README.md") if p.startswith(("launch/", "bench/"))]
    # (paths under vllm/ name vLLM's own sources, in docs/vllm.md)
    missing = [f"{rel}: {p}" for rel in docs for p in sorted(set(path.findall(_read(rel))))
               if not p.startswith("vllm/") and not os.path.exists(os.path.join(REPO, p))
               and not os.path.exists(os.path.join(REPO, os.path.dirname(rel), p))]
    assert missing == []


# ---- environment variables ------------------------------------------------------------------------

def _code_files(*tops: str, suffixes: tuple[str, ...]) -> list[str]:
    """Files under these folders of the working tree (tracked or not: new modules count at once)."""
    out = []
    for top in tops:
        if os.path.isfile(os.path.join(REPO, top)):
            out.append(top)
        for d, dirs, fs in os.walk(os.path.join(REPO, top)):
            dirs[:] = [x for x in dirs if x != "__pycache__"]
            out += [os.path.relpath(os.path.join(d, f), REPO) for f in fs if f.endswith(suffixes)]
    return sorted(out)


def _read_by_the_code() -> dict[str, str]:
    """Every EP_COMM_* variable the package, its build or the launch scripts read -> where."""
    found: dict[str, str] = {}
    for rel in _code_files("ep_comm", "launch", "setup.py", suffixes=(".py", ".sh", ".sbatch")):
        text = _read(rel)
        if rel.endswith(".py"):
            text = re.sub(r"getattr\([^,()]+,\s*[\"']EP_COMM_\w+[\"']", "", text)  # attribute names
            names = re.findall(r"[\"'](EP_COMM_[A-Z0-9_]+)[\"']", text)
        else:
            names = re.findall(r"\$\{(EP_COMM_[A-Z0-9_]+)", text)
        for name in names:
            found.setdefault(name, rel)
    return found


def _documented_in_operations() -> set[str]:
    """EP_COMM_* names in the first column of docs/operations.md's tables."""
    names = set()
    for line in _read("docs/operations.md").splitlines():
        cells = line.split("|")
        if line.startswith("|") and len(cells) > 2:
            names.update(ENV_NAME.findall(cells[1]))
    return names


def test_every_environment_variable_the_code_reads_is_documented_and_vice_versa():
    read, documented = _read_by_the_code(), _documented_in_operations()
    undocumented = sorted(f"{name} ({where})" for name, where in read.items() if name not in documented)
    gone = sorted(documented - set(read))
    assert undocumented == [], "read by the code but not in docs/operations.md's tables"
    assert gone == [], "in docs/operations.md's tables but read nowhere in ep_comm/, setup.py or launch/"


def test_every_environment_variable_the_docs_name_exists_in_the_code():
    code = "\n".join(_read(p) for p in _code_files("ep_comm", "launch", "tests", "bench", "csrc", "examples",
                                                    "setup.py", suffixes=(".py", ".sh", ".sbatch", ".cu", ".cuh",
                                                                          ".h", ".cpp"))
                     if p != "tests/test_docs.py")
    docs = _docs() + [p for p in _tracked(".md") if p.startswith(("launch/", "bench/"))]
    stale = sorted({f"{rel}: {name}" for rel in docs for name in ENV_NAME.findall(_read(rel))
                    if not re.search(rf"\b{name}\b", code)})
    assert stale == []


# ---- the command line the docs show -------------------------------------------------------------

def _cli_options() -> dict[str, set[str]]:
    import argparse

    from ep_comm.cli.main import build_parser

    parser = build_parser()
    subparsers = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return {name: {s for a in sub._actions for s in a.option_strings} for name, sub in subparsers.choices.items()}


def test_every_ep_comm_flag_in_the_docs_exists():
    options = _cli_options()
    command = re.compile(r"(?:ep-comm|-m ep_comm) (bench|stress|info)\b([^`\n]*)")
    unknown = []
    for rel in _docs() + [p for p in _tracked(".md") if p.startswith(("launch/", "bench/"))]:
        for sub, rest in command.findall(_read(rel)):
            rest = rest.split("#")[0]  # a shell comment after the command
            unknown += [f"{rel}: ep-comm {sub} {flag}" for flag in re.findall(r"(?<![\w-])--[a-z][a-z0-9-]*", rest)
                        if flag not in options[sub]]
    assert unknown == []


# ---- bench/ holds what the docs cite ------------------------------------------------------------

def _cited_text() -> str:
    return "\n".join(_read(p) for p in _docs())


def test_bench_results_are_exactly_the_files_the_docs_cite():
    on_disk = {os.path.basename(p) for p in _tracked(".json", ".txt") if p.startswith("bench/results/")}
    cited = set(RESULT_FILE.findall(_cited_text()))
    assert sorted(on_disk - cited) == [], "results no document cites"
    assert sorted(cited - on_disk) == [], "cited results missing from bench/results/"


def test_every_bench_script_and_microbenchmark_is_cited_and_every_cited_one_exists():
    text = _cited_text()
    files = [p for p in _tracked(".py", ".sh", ".cu") if p.startswith("bench/") and not p.startswith("bench/results/")]
    uncited = [p for p in files if os.path.basename(p) not in text]
    cited = set(re.findall(r"\bbench/[\w/.-]+\.(?:py|sh|cu|cuh)\b", text))
    missing = sorted(p for p in cited if not os.path.exists(os.path.join(REPO, p)))
    assert uncited == [] and missing == []


# ---- the README's snippet -----------------------------------------------------------------------

def _readme_snippet() -> str:
    use = _read("README.md").split("\n## Use\n", 1)[1]
    return re.search(r"```python\n(.*?)```", use, re.S).group(1)


def test_readme_snippet_runs_on_two_gloo_ranks_and_prints_its_check():
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "use.py")
        with open(path, "w") as f:
            f.write(_readme_snippet())
        env = dict(os.environ, CUDA_VISIBLE_DEVICES="", OMP_NUM_THREADS="1",
                   PYTHONPATH=os.pathsep.join(p for p in (REPO, os.environ.get("PYTHONPATH")) if p))
        try:
            run = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone",
                                  "--nproc-per-node", "2", path], cwd=tmp, env=env, capture_output=True,
                                 text=True, timeout=180)
        except subprocess.TimeoutExpired:
            pytest.fail("the README snippet did not finish within 180 s on 2 gloo ranks")
    checks = sorted(re.findall(r"rank (\d)/2 backend \w+: y == 2\*x (True|False)", run.stdout))
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-4000:]
    assert checks == [("0", "True"), ("1", "True")], run.stdout
