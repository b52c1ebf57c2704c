"""Every module imports on a machine without a GPU, the CUDA code paths included.

CUDA-only code (host staging, the doctor's NCCL probe, the GPU sweep) cannot
run here, so this is what keeps it from rotting: every module of the packages
is imported, every script under bench/ and tests/ compiles, and, where mypy is
installed, the CUDA paths are type-checked against torch's annotations.
"""

from __future__ import annotations

import importlib
import os
import pkgutil
import py_compile
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = [p for p in ("commlab", "workers", "servers") if (ROOT / p / "__init__.py").exists()]
# The code a CPU run never executes: typed here so that a GPU machine is not the first to see it.
CUDA_PATHS = ["commlab/core/staging.py", "commlab/tools/doctor.py", "bench/gpu_sweep.py", "tests/gpu"]
TYPED = [*PACKAGES, *(p for p in CUDA_PATHS if p.split("/")[0] not in PACKAGES)]  # the library, CUDA paths included


def modules() -> list[str]:
    names = []
    for pkg in PACKAGES:
        names.append(pkg)
        names += [m.name for m in pkgutil.walk_packages([str(ROOT / pkg)], prefix=pkg + ".")
                  if not m.name.endswith("__main__")]
    return sorted(names)


@pytest.mark.parametrize("name", modules())
def test_module_imports(name):
    importlib.import_module(name)


def test_scripts_compile(tmp_path):
    scripts = sorted(p for d in ("bench", "tests") if (ROOT / d).exists() for p in (ROOT / d).rglob("*.py"))
    assert any(p.name == "gpu_sweep.py" for p in scripts)
    for i, path in enumerate(scripts):
        py_compile.compile(str(path), cfile=str(tmp_path / f"{i}.pyc"), doraise=True)


def test_cuda_paths_type_check():
    pytest.importorskip("mypy", reason="mypy is not installed: the CUDA paths were imported and compiled only")
    out = subprocess.run([sys.executable, "-m", "mypy", "--ignore-missing-imports", "--follow-imports=silent",
                          "--cache-dir", str(ROOT / ".pytest_cache" / "mypy"), *TYPED],
                         cwd=ROOT, capture_output=True, text=True, timeout=170,
                         env=dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])))
    assert out.returncode == 0, out.stdout + out.stderr


# The layers of commlab/, lowest first: a module imports only its own layer's and lower layers' modules
# (docs/architecture.md). Regimes are found by name (core/registry.py), never imported by the core.
LAYERS = ["base", "transport", "compress", "core", "launch", "regimes", "plan", "tools"]


def _imports(path: Path) -> set[str]:
    import ast
    out = set()
    tree = ast.parse(path.read_text())
    typing_only = {id(n) for block in ast.walk(tree) if isinstance(block, ast.If)
                   and isinstance(block.test, ast.Name) and block.test.id == "TYPE_CHECKING"
                   for stmt in block.body for n in ast.walk(stmt)}  # annotations only: never run
    for node in ast.walk(tree):
        if id(node) in typing_only:
            continue
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0 and node.module.split(".")[0] == "commlab":
            base = ROOT.joinpath(*node.module.split("."))
            for a in node.names:  # "from package import submodule" depends on the submodule, else on the module
                sub = base / a.name
                out.add(f"{node.module}.{a.name}" if sub.with_suffix(".py").exists() or sub.is_dir() else node.module)
        elif isinstance(node, ast.Import):
            out |= {a.name for a in node.names if a.name.startswith("commlab.")}
    return out


def _module(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _layer(module: str) -> int | None:
    parts = module.split(".")
    return LAYERS.index(parts[1]) if len(parts) > 1 and parts[1] in LAYERS else None


def test_layers_import_only_downward_and_without_cycles():
    graph = {}
    for path in sorted((ROOT / "commlab").rglob("*.py")):
        graph[_module(path)] = {m for m in _imports(path) if m != "commlab"}
    assert set(LAYERS) <= {m.split(".")[1] for m in graph if "." in m}, "a layer package is missing"
    upward = []
    for mod, deps in graph.items():
        if mod == "commlab":
            continue  # the package's public names re-export the top of the stack
        mine = _layer(mod)
        assert mine is not None, f"{mod} sits outside the layer packages {LAYERS}"
        for dep in deps:
            theirs = _layer(dep)
            if theirs is None or theirs > mine:
                upward.append(f"{mod} -> {dep}")
    assert not upward, "imports against the layering: " + ", ".join(sorted(upward))
    # no cycle among modules: depth-first search over the import graph (packages resolve to their __init__)
    state: dict[str, int] = {}

    def visit(mod, trail):
        if state.get(mod) == 1:
            raise AssertionError("import cycle: " + " -> ".join(trail[trail.index(mod):] + [mod]))
        if state.get(mod) == 2 or mod not in graph:
            return
        state[mod] = 1
        for dep in sorted(graph[mod]):
            visit(dep, trail + [mod])
        state[mod] = 2

    for mod in sorted(graph):
        visit(mod, [])
