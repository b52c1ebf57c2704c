"""A CPU cap per rank slot, so that a death cannot speed the survivors up (``commlab bench chaos``).

:class:`Caps` (the bench, as root) makes one cgroup folder per run, ``commlab-chaos-<pid>``, under the
cpu controller: cgroup v2's ``cpu.max`` where the unified hierarchy has the cpu controller, else v1's
``cpu.cfs_quota_us`` / ``cpu.cfs_period_us``. It hands the folder and the quota to its processes in
``$BENCH_CPU_CAP`` (``FOLDER:QUOTA_US:PERIOD_US``); each rank calls :func:`join_from_env` first thing, which
makes ``slot<r>`` (the same cgroup for a slot's replacement) with the quota and moves the process in:
its threads and children follow. :meth:`Caps.close` moves whatever is left to the parent and removes the
folders. Where neither hierarchy can be written (not root, no cpu controller), :attr:`Caps.why_not` says
why and nothing is capped: the report says so.

Only the standard library: imported before torch.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

ENV = "BENCH_CPU_CAP"
PERIOD_US = 100_000
V2_ROOT, V1_ROOT = Path("/sys/fs/cgroup"), Path("/sys/fs/cgroup/cpu")


def _v2_root() -> Path | None:
    for root in (V2_ROOT, V2_ROOT / "unified"):
        try:
            if "cpu" in (root / "cgroup.controllers").read_text().split():
                return root
        except OSError:
            continue
    return None


class Caps:
    def __init__(self, cpus: float):
        self.cpus, self.folder, self.kind, self.why_not = cpus, None, None, None
        self.quota_us = int(cpus * PERIOD_US)
        root = _v2_root()
        try:
            if root is not None:
                folder = root / f"commlab-chaos-{os.getpid()}"
                folder.mkdir()
                self.folder, self.root, self.kind = folder, folder, "v2"
                try:  # children need the controller enabled here
                    (folder / "cgroup.subtree_control").write_text("+cpu")
                except OSError:
                    pass
            elif (V1_ROOT / "cpu.cfs_quota_us").exists():
                folder = V1_ROOT / f"commlab-chaos-{os.getpid()}"
                folder.mkdir()
                self.folder, self.root, self.kind = folder, folder, "v1"
            else:
                self.why_not = "no cgroup cpu controller here (neither cgroup v2's cpu.max nor v1's cpu.cfs_quota_us)"
        except OSError as exc:
            self.why_not = f"cannot make a cgroup ({exc}); run as root to cap each worker"

    @classmethod
    def none(cls, why: str) -> "Caps":
        """No cap, for ``why``."""
        caps = cls.__new__(cls)
        caps.cpus, caps.folder, caps.kind, caps.why_not, caps.quota_us = 0.0, None, None, why, 0
        return caps

    def env(self) -> dict[str, str]:
        return {ENV: f"{self.folder}:{self.quota_us}:{PERIOD_US}"} if self.folder else {}

    def describe(self) -> str:
        if self.kind is None:
            return f"uncapped: {self.why_not}"
        knob = "cpu.max" if self.kind == "v2" else "cpu.cfs_quota_us"
        return f"each worker capped at {self.cpus:g} CPU (cgroup {self.kind} {knob}, {self.root})"

    def close(self) -> None:
        """Move any process left to the parent cgroup and remove every folder (a second after the jobs ended)."""
        if self.folder is None:
            return
        parent = self.folder.parent
        for sub in sorted(self.folder.glob("slot*")) + [self.folder]:
            if not sub.is_dir():
                continue
            for _ in range(50):
                try:
                    for pid in (sub / "cgroup.procs").read_text().split():
                        try:
                            (parent / "cgroup.procs").write_text(pid)
                        except OSError:
                            pass
                    sub.rmdir()
                    break
                except OSError:
                    time.sleep(0.02)
        self.folder = None


def join_from_env(slot: int) -> None:
    """Move this process into slot ``slot``'s cgroup as ``$BENCH_CPU_CAP`` says (nothing without it)."""
    spec = os.environ.get(ENV)
    if not spec:
        return
    folder, quota, period = spec.rsplit(":", 2)
    sub = Path(folder, f"slot{slot}")
    sub.mkdir(exist_ok=True)
    if (sub / "cpu.max").exists():
        (sub / "cpu.max").write_text(f"{quota} {period}")
    else:
        (sub / "cpu.cfs_period_us").write_text(period)
        (sub / "cpu.cfs_quota_us").write_text(quota)
    (sub / "cgroup.procs").write_text(str(os.getpid()))
