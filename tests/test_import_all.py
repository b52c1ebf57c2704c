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
CUDA_PATHS = ["commlab/staging.py", "commlab/doctor.py", "bench/gpu_sweep.py", "tests/gpu"]
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
