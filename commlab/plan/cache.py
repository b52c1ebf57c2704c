"""What ``commlab plan`` measures on this machine, kept between calls.

The plan's measured figures (the model's forward and backward, the server costs, each compressor's
encode and decode on the model's buckets: about ten seconds and most of a gigabyte for the 25M MLP)
belong to the machine and the software, not to the query: they are measured once and kept in the
user's cache folder (``$XDG_CACHE_HOME/commlab``, else ``~/.cache/commlab``), one file per model,
batch and input shape, together with the key they were measured under:

- the query: model, batch per worker, input shape;
- this machine: CPU model, cores usable, architecture, operating system;
- the versions: commlab's version and git revision (where it runs from a checkout), torch, numpy, Python.

A file whose key differs from the call's is measured again and replaced, and the call says which part
of the key changed; a file that cannot be read (a cut write, an edit, another format) is reported and
replaced, never crashed on. ``commlab plan --recalibrate`` measures again whatever is kept. Transports
are not kept: they come from a ``commlab bench`` run or are the assumed figures. A file is written
whole (a temporary file renamed over it), so two plans running at once never leave half a file.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import json
import os
import platform
import re
import shutil
import subprocess
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np

import commlab
from commlab.plan.costmodel import Calibration

FORMAT = 1  # the file's layout: a file of another layout is replaced


def folder() -> Path:
    """Where commlab keeps what it measured: ``$XDG_CACHE_HOME/commlab``, else ``~/.cache/commlab``."""
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "commlab"


def cpu_model() -> str:
    """The CPU's model name (``/proc/cpuinfo``), else what ``platform`` knows."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def git_revision() -> str | None:
    """The commit commlab runs from, where it runs from a git checkout; else None."""
    try:
        out = subprocess.run(["git", "-C", str(Path(commlab.__file__).resolve().parent), "rev-parse", "HEAD"],
                             capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return out.stdout.strip() if out.returncode == 0 else None


def key(model: str, batch: int, input_shape: tuple[int, ...] | None) -> dict:
    """The key a calibration of this query is kept under, here and now (module docstring)."""
    return {"format": FORMAT,
            "query": {"model": model, "batch": batch, "input_shape": list(input_shape) if input_shape else None},
            "machine": {"cpu": cpu_model(), "cores": len(os.sched_getaffinity(0)), "arch": platform.machine(),
                        "system": platform.system()},
            "versions": {"commlab": commlab.__version__, "git": git_revision(),
                         "torch": importlib.metadata.version("torch"),  # not torch.__version__: no torch import
                         "numpy": np.__version__, "python": platform.python_version()}}


def changed(old: dict, new: dict) -> list[str]:
    """What differs between two keys, as ``part.field: old -> new`` (fields of the parts first)."""
    out = []
    for part in sorted(set(old) | set(new)):
        a, b = old.get(part), new.get(part)
        if isinstance(a, dict) and isinstance(b, dict):
            out += [f"{part}.{f}: {a.get(f)!r} -> {b.get(f)!r}" for f in sorted(set(a) | set(b)) if a.get(f) != b.get(f)]
        elif a != b:
            out.append(f"{part}: {a!r} -> {b!r}")
    return out


@dataclass(frozen=True)
class Kept:
    """One query's kept calibration: its file and the key it must have been measured under."""

    path: Path
    key: dict

    @classmethod
    def of(cls, model: str, batch: int, input_shape: tuple[int, ...] | None = None) -> "Kept":
        """The kept calibration of this query in :func:`folder`, keyed as measured here now."""
        k = key(model, batch, input_shape)
        digest = hashlib.sha256(json.dumps(k["query"], sort_keys=True).encode()).hexdigest()[:12]
        name = re.sub(r"[^A-Za-z0-9_.-]+", "_", model).strip("_")[:40]
        return cls(folder() / f"plan-{name}-b{batch}-{digest}.json", k)

    def load(self) -> tuple[Calibration | None, str]:
        """(the kept calibration, "") if there is one measured under this key; else (None, why not: nothing
        kept yet, a key that changed and how, or a file that could not be read and the error). Never raises
        for the file's content."""
        try:
            text = self.path.read_text()
        except FileNotFoundError:
            return None, f"nothing measured here yet for this model ({self.path} does not exist)"
        except OSError as exc:
            return None, f"{self.path} could not be read ({exc}): measuring again, and replacing it"
        try:
            doc = json.loads(text)
            old = doc["key"]
            if not isinstance(old, dict):
                raise TypeError(f"the key is a {type(old).__name__}, not an object")
            diff = changed(old, self.key)
            if diff:
                return None, (f"{self.path} was measured under another key ({'; '.join(diff)}): measuring again, "
                              f"and replacing it")
            return Calibration.from_dict(doc["calibration"]), ""
        except (ValueError, KeyError, TypeError, AttributeError) as exc:
            return None, (f"{self.path} is not a calibration this commlab can read ({type(exc).__name__}: "
                          f"{str(exc)[:200]}): measuring again, and replacing it")

    def save(self, cal: Calibration) -> None:
        """Keep ``cal``'s measured parts (its transports are the run's, not the machine's: dropped) under
        this key, replacing the file whole."""
        self.path.parent.mkdir(parents=True, exist_ok=True)
        kept = replace(cal, transports={}, facts={**cal.facts, "run_dir": None})
        tmp = self.path.with_name(f".{self.path.name}.{os.getpid()}.tmp")
        tmp.write_text(json.dumps({"key": self.key, "calibration": json.loads(kept.to_json())}, indent=1))
        os.replace(tmp, self.path)



# ----- a query's answer --------------------------------------------------------------------------
# Everything after the calibration is pure: the same calibration and the same options give the same
# plan.md, plan.json and plan.png. A repeated query (the kept calibration, assumed transports) is read back
# instead of simulated and drawn again (seconds at 4,096 workers: the async regimes' event loop, matplotlib),
# under a key made of the calibration, the options and the planner's own source, so an edited simulator
# never answers from an older one's file.
PLANNER_SOURCES = ("plan/costmodel.py", "plan/simulate.py", "plan/recommend.py", "plan/compression.py",
                   "plan/rates.py", "plan/__main__.py", "plan/localsteps.py", "transport/psproto.py", "regimes/ring.py")


@dataclass(frozen=True)
class KeptAnswer:
    """One query's answer, kept: ``plan-answers/<key>/`` holds its plan.md body, plan.json and plan.png."""

    path: Path

    @classmethod
    def of(cls, cal: Calibration, options: dict) -> "KeptAnswer":
        """The answer kept for ``options`` (the command's parsed options, less where it writes) on ``cal``."""
        root = Path(commlab.__file__).resolve().parent
        h = hashlib.sha256()
        for name in PLANNER_SOURCES:
            h.update((root / name).read_bytes())
        h.update(json.dumps({"calibration": json.loads(cal.to_json()), "options": options}, sort_keys=True,
                            default=str).encode())
        return cls(folder() / "plan-answers" / h.hexdigest()[:24])

    def load(self) -> tuple[list[str], dict, Path | None] | None:
        """(plan.md's lines after its heading, plan.json's content, the picture or None), or None when nothing
        is kept (or it cannot be read: then the query is simply answered again)."""
        try:
            lines = json.loads((self.path / "plan.md.json").read_text())
            doc = json.loads((self.path / "plan.json").read_text())
        except (OSError, ValueError):
            return None
        png = self.path / "plan.png"
        return lines, doc, png if png.exists() else None

    def save(self, lines: list[str], doc: dict, png: Path | None) -> None:
        """Keep an answer; a folder is written whole (made aside, renamed into place), so a reader never
        sees half of one."""
        self.path.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.path.with_name(f".{self.path.name}.{os.getpid()}.tmp")
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir()
        (tmp / "plan.md.json").write_text(json.dumps(lines))
        (tmp / "plan.json").write_text(json.dumps(doc, default=str))
        if png is not None:
            shutil.copyfile(png, tmp / "plan.png")
        shutil.rmtree(self.path, ignore_errors=True)  # one that could not be read (a whole one is never rewritten)
        try:
            os.replace(tmp, self.path)
        except OSError:  # another call kept the same answer in the meantime
            shutil.rmtree(tmp, ignore_errors=True)
