"""Scratch folders in ``$TMPDIR`` named by the process that owns them.

A launcher, a ring rank or a benchmark job makes a folder for its logs or its ipc sockets and
removes it on the way out. A process killed with SIGKILL has no way out: its folder stays. So the
folder's name carries its owner, ``commlab-KIND-PID.START-XXXXXXXX`` (START: the owner's start
time in clock ticks since boot, so a reused pid is not mistaken for the owner), and the next
start of any of them (:func:`sweep_stale`) removes the folders whose owner is gone: the rule
:mod:`commlab.transport.shm` follows for /dev/shm.
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import tempfile
from collections.abc import Iterator

from commlab.transport.shm import orphans, start_time

NAME = re.compile(r"commlab-(?P<kind>[a-z0-9]+)-(?P<pid>\d+)\.(?P<start>\d+)-[a-z0-9_]+")


def mkdtemp(kind: str, directory: str | None = None) -> str:
    """A new folder ``commlab-KIND-PID.START-...`` owned by this process; the caller removes it."""
    if not re.fullmatch(r"[a-z0-9]+", kind):
        raise ValueError(f"scratch kind {kind!r}: lower-case letters and digits only")
    pid = os.getpid()
    return tempfile.mkdtemp(prefix=f"commlab-{kind}-{pid}.{start_time(pid)}-", dir=directory)


@contextlib.contextmanager
def folder(kind: str, directory: str | None = None) -> Iterator[str]:
    """:func:`mkdtemp`, removed when the block exits (also on errors)."""
    path = mkdtemp(kind, directory)
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


def sweep_stale(directory: str | None = None) -> list[str]:
    """Remove the scratch folders in ``directory`` (default ``$TMPDIR``) whose owner is gone; the
    paths removed. Safe to run in any number of processes at once."""
    removed: list[str] = []
    for path in orphans(directory or tempfile.gettempdir(), NAME):
        shutil.rmtree(path, ignore_errors=True)
        if not os.path.exists(path):
            removed.append(path)
    return removed
