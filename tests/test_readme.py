"""The README and docs/ cite only files that exist, and the README stays short.

Reads Markdown as text (no subprocess, no torch): every repository path the README or a doc
names, backticked, linked or in prose, must exist. A path counts when its first component is a
top-level entry of the repository (``bench/results/x.json``, ``docs/ps.md``, ``Makefile``);
brace patterns expand (``run{1,2,3}`` -> three paths), a glob (``*``) must match at least one
file, and a path with a placeholder (``runs/<time>/``, ``gpu-<device>.json``) or under ``runs/``
(benchmark output, not committed) is not checked. Markdown links resolve from the file's folder.
"""

from __future__ import annotations

import glob
import itertools
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
DOCS = sorted((ROOT / "docs").glob("*.md"))
MAX_README_LINES = 260

# top-level entries a cited path may start with (runs/ is output, never committed)
TOP = ("commlab", "servers", "workers", "examples", "bench", "tests", "docs", "deploy", ".ci")
TOP_FILES = ("Makefile", "pyproject.toml", "README.md")

_PATH = re.compile(r"(?<![\w./:~-])((?:%s)/[\w./{},*<>-]*|(?:%s)\b)"
                   % ("|".join(re.escape(t) for t in TOP), "|".join(re.escape(f) for f in TOP_FILES)))
_LINK = re.compile(r"\]\(([^)\s]+)\)")


def expand_braces(path: str) -> list[str]:
    """``a-run{1,2,3}.json`` -> ``a-run1.json``, ``a-run2.json``, ``a-run3.json`` (several groups: every combination)."""
    parts = re.split(r"\{([^{}]*)\}", path)
    choices = [[p] if i % 2 == 0 else p.split(",") for i, p in enumerate(parts)]
    return ["".join(c) for c in itertools.product(*choices)]


def cited_paths(text: str) -> set[str]:
    """Repository-relative paths named in ``text`` (prose, backticks and code blocks alike)."""
    found = set()
    for m in _PATH.finditer(text):
        path = m.group(1).rstrip(".,;:")
        if "<" in path or ">" in path:  # a placeholder: runs/<time>/report.md
            continue
        found.update(expand_braces(path))
    return found


def linked_paths(text: str, folder: Path) -> set[tuple[Path, str]]:
    """Targets of relative Markdown links, resolved from ``folder``, each with its anchor ('' if none)."""
    found = set()
    for m in _LINK.finditer(text):
        target, _, anchor = m.group(1).partition("#")
        if "://" not in target and not target.startswith("mailto:"):
            found.add(((folder / target).resolve() if target else folder, anchor))
    return found


def anchors(markdown: str) -> set[str]:
    """GitHub's anchors for the headings of a Markdown file: lower case, punctuation dropped, spaces to '-'."""
    markdown = re.sub(r"^```.*?^```", "", markdown, flags=re.S | re.M)  # a '# comment' in a code block is no heading
    return {re.sub(r"[^\w\- ]", "", h.strip().lower()).replace(" ", "-")
            for h in re.findall(r"^#{1,6} (.+)$", markdown, re.M)}


def broken_links(text: str, folder: Path) -> list[str]:
    broken = []
    for path, anchor in sorted(linked_paths(text, folder)):
        if not path.exists():
            broken.append(str(path.relative_to(ROOT)))
        elif anchor and path.suffix == ".md" and anchor not in anchors(path.read_text()):
            broken.append(f"{path.relative_to(ROOT)}#{anchor}")
    return broken


def missing(path_text: str) -> bool:
    if "*" in path_text:
        return not glob.glob(str(ROOT / path_text))
    return not (ROOT / path_text).exists()


def test_the_checker_sees_what_it_should():
    text = ("see `bench/results/train_step-s11-run{1,2}.json`, [docs](docs/ps.md#modes), "
            "tests/test_ps.py::test_x, `runs/<time>/report.md` and a /etc/commlab/ring folder.")
    assert cited_paths(text) == {"bench/results/train_step-s11-run1.json",
                                 "bench/results/train_step-s11-run2.json",
                                 "docs/ps.md", "tests/test_ps.py"}
    assert missing("bench/results/no-such-file.json") and not missing("bench/results/*.json")
    assert linked_paths("[a](ring.md#x) [b](https://x.org/a.md)", ROOT / "docs") == {(ROOT / "docs" / "ring.md", "x")}
    assert "the-test-suites-time" in anchors("## The test suite's time\n")
    assert "commlab-run-in-detail" in anchors("## `commlab run` in detail\n")
    assert broken_links("[a](ps.md#no-such-heading) [b](no-such.md) [c](ps.md#modes)", ROOT / "docs") == [
        "docs/no-such.md", "docs/ps.md#no-such-heading"]


@pytest.mark.parametrize("doc", [README, *DOCS], ids=lambda p: str(p.relative_to(ROOT)))
def test_every_cited_path_exists(doc: Path):
    text = doc.read_text()
    absent = sorted(p for p in cited_paths(text) if missing(p))
    absent += broken_links(text, doc.parent)
    assert not absent, f"{doc.relative_to(ROOT)} cites paths that do not exist: {absent}"


def test_readme_is_short_and_keeps_the_two_commands():
    text = README.read_text()
    assert len(text.splitlines()) <= MAX_README_LINES
    assert "    make bench\n" in text and "    make test\n" in text
    assert "make test" in (ROOT / ".ci" / "run").read_text()
    makefile = (ROOT / "Makefile").read_text()
    assert re.search(r"^bench:", makefile, re.M) and re.search(r"^test:", makefile, re.M)


def test_readme_names_only_commands_that_exist():
    """``commlab X`` and ``commlab bench CASE`` in the README are commands the CLI has (read from its source)."""
    cli = (ROOT / "commlab" / "tools" / "cli.py").read_text()
    commands = {"train", "run"} | set(re.findall(r'^\s+"(\w+)": \("', cli, re.M))
    bench_main = (ROOT / "bench" / "__main__.py").read_text()
    cases = set(re.findall(r'"([\w-]+)": "bench\.\w+"', bench_main))
    phases = {"bandwidth", "convergence", "scaling", "probes", "all"}
    text = README.read_text()
    # command lines: fenced blocks, then backticked spans and indented lines (prose says "commlab" too)
    fenced = re.findall(r"^```.*?^```", text, re.S | re.M)
    prose = re.sub(r"^```.*?^```", "", text, flags=re.S | re.M)
    code = "\n".join(fenced + re.findall(r"`([^`\n]+)`", prose) + re.findall(r"^    (.+)$", prose, re.M))
    used = set(re.findall(r"(?:^|[\s/])commlab ([a-z][\w-]*)", code, re.M))
    assert used and used <= commands, used - commands
    used_cases = set(re.findall(r"(?:^|[\s/])commlab bench ([a-z][\w-]*)", code, re.M))
    assert used_cases <= cases | phases, used_cases - cases - phases
