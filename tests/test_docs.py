"""The project's documentation stands alone: links stay inside the repository and resolve, and every
"docs/design.md §N" reference in the code and docs names a section that exists."""
from __future__ import annotations

import os
import re
import subprocess

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
LINK = re.compile(r"\]\(([^)\s]+)\)")
SECTION_REF = re.compile(r"docs/design\.md §(\d+)(?:[–-]§?(\d+))?")


def _tracked(*suffixes: str) -> list[str]:
    try:
        out = subprocess.run(["git", "ls-files"], cwd=REPO, capture_output=True, text=True, timeout=60).stdout.split()
    except OSError:
        out = []
    if not out:  # not a git checkout (an sdist): walk the tree
        out = [os.path.relpath(os.path.join(d, f), REPO) for d, _, fs in os.walk(REPO) if ".git" not in d for f in fs]
    return [p for p in out if p.endswith(suffixes) and os.path.exists(os.path.join(REPO, p))]


def _read(rel: str) -> str:
    with open(os.path.join(REPO, rel), encoding="utf-8") as f:
        return f.read()


def test_markdown_links_stay_inside_the_repository_and_resolve():
    problems = []
    for rel in _tracked(".md"):
        for target in LINK.findall(_read(rel)):
            if re.match(r"[a-z]+://|mailto:|#", target):
                continue
            path = os.path.normpath(os.path.join(os.path.dirname(os.path.join(REPO, rel)), target.split("#")[0]))
            if not path.startswith(REPO + os.sep) or not os.path.exists(path):
                problems.append(f"{rel}: {target}")
    assert problems == []


def test_no_reference_to_files_outside_the_repository():
    offenders = [rel for rel in _tracked(".md", ".py", ".sh", ".sbatch", ".toml")
                 if rel != "tests/test_docs.py" and re.search(r"\.\./shared|DESIGN\.md|DESIGN §", _read(rel))]
    assert offenders == []


def test_design_section_references_exist():
    design = _read("docs/design.md")
    sections = {int(n) for n in re.findall(r"^## (\d+)\. ", design, re.M)}
    assert sections == set(range(1, max(sections) + 1))
    assert "\n## 13a. The `mnnvl` kernel backend\n" in design  # the kernel backend is documented
    bad = []
    for rel in _tracked(".md", ".py", ".sh", ".sbatch"):
        for first, last in SECTION_REF.findall(_read(rel)):
            for n in (first, last):
                if n and int(n) not in sections:
                    bad.append(f"{rel}: §{n}")
    assert bad == []
