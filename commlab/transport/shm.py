"""Shared-memory segments between the processes of one host, and their lifetime.

A segment is a plain file under ``/dev/shm`` (tmpfs), mapped with ``mmap``; a process that
creates one owns it. Names say who owns them, so that what a dead run left behind can be
found and removed by the next one::

    /dev/shm/commlab-<run>-<pid>.<start>-<what>
                     run:   hex id shared by the ranks of one job (chosen in the rendezvous store)
                     pid, start: the owner process and its start time (/proc/PID/stat field 22),
                            so a reused pid is not mistaken for the owner
                     what:  the user's name for it (``r0-out``, ``r0.sock``, ...)

Lifetime, from the safest to the last resort:

1. **Unlink once mapped.** A mapping outlives its file: the user of a segment unlinks it as
   soon as every process that needs it has mapped it (:meth:`Segment.unlink`). From then on
   nothing is left in /dev/shm even if every process is killed with SIGKILL; the memory goes
   back when the last mapping does.
2. **Exit.** Whatever this process created and has not unlinked yet is unlinked at normal
   interpreter exit (``atexit``), on Ctrl-C (KeyboardInterrupt ends in a normal exit) and on
   SIGTERM (:func:`guard_sigterm`: a handler that unlinks, then lets the previous disposition
   act).
3. **The next start.** :func:`sweep_stale` removes entries whose owner is gone (SIGKILL during
   the short window before 1). Entries of live owners, and any name not in the pattern
   above, are never touched.

Not thread-safe per segment (one owner thread); the process-wide list of names to remove on
exit is guarded by a lock. Python's ``multiprocessing.shared_memory`` is not used: its resource
tracker unlinks and warns on its own schedule, which would fight rule 1.
"""

from __future__ import annotations

import atexit
import errno
import mmap
import os
import re
import secrets
import signal
import stat
import threading

from commlab.base.errors import ConfigError, ProtocolError

SHM_DIR = "/dev/shm"
NAME = re.compile(r"commlab-(?P<run>[0-9a-f]{4,32})-(?P<pid>\d+)\.(?P<start>\d+)-(?P<what>[A-Za-z0-9._-]+)")


def new_run_id() -> str:
    return secrets.token_hex(4)


def start_time(pid: int) -> int | None:
    """The start time of process ``pid`` in clock ticks since boot, or None if there is no such process."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as fh:
            return int(fh.read().rsplit(b")", 1)[1].split()[19])
    except (OSError, IndexError, ValueError):
        return None


def owner_alive(pid: int, start: int) -> bool:
    return start_time(pid) == start


def host_identity() -> str:
    """This host and network namespace: the boot id (one per running kernel) and the namespace's inode.
    Two processes that share both can share memory and reach each other's Unix sockets."""
    with open("/proc/sys/kernel/random/boot_id") as fh:
        boot = fh.read().strip()
    st = os.stat("/proc/self/ns/net")
    return f"{boot}/{st.st_dev}:{st.st_ino}"


def path_for(run: str, what: str, directory: str = SHM_DIR) -> str:
    """Where this process puts its entry ``what`` of run ``run`` (the name carries the owner)."""
    if not re.fullmatch(r"[0-9a-f]{4,32}", run) or not re.fullmatch(r"[A-Za-z0-9._-]+", what):
        raise ConfigError(f"bad shared-memory name parts run={run!r} what={what!r}")
    pid = os.getpid()
    return os.path.join(directory, f"commlab-{run}-{pid}.{start_time(pid)}-{what}")


def orphans(directory: str, pattern: re.Pattern) -> list[str]:
    """The paths in ``directory`` whose names match ``pattern`` (groups ``pid`` and ``start``: the
    owner) and whose owner process is gone. Names that do not match are never listed."""
    try:
        names = os.listdir(directory)
    except OSError:
        return []
    found = []
    for name in names:
        m = pattern.fullmatch(name)
        if m is not None and not owner_alive(int(m["pid"]), int(m["start"])):
            found.append(os.path.join(directory, name))
    return found


def sweep_stale(directory: str = SHM_DIR) -> list[str]:
    """Remove the entries in ``directory`` whose owner process is gone; the paths removed.
    Safe to call from any number of processes at once (a lost race is a missing file)."""
    removed: list[str] = []
    for path in orphans(directory, NAME):
        try:
            os.unlink(path)
            removed.append(path)
        except FileNotFoundError:
            pass
    return removed


# ----- what this process must remove on the way out ---------------------------------------------
# Process-wide by nature: exit handlers and signal dispositions belong to the process, not to an object.
_lock = threading.Lock()
_linked: set[str] = set()
_hooks: dict = {"atexit": False, "sigterm": None}  # sigterm: the disposition ours replaced, while ours is set


def track(path: str) -> None:
    """Remove ``path`` at exit or SIGTERM unless :func:`forget` / :func:`remove` came first."""
    with _lock:
        _linked.add(path)
        if not _hooks["atexit"]:
            atexit.register(remove_all)
            _hooks["atexit"] = True
    guard_sigterm()


def forget(path: str) -> None:
    with _lock:
        _linked.discard(path)
        empty = not _linked
    if empty:
        _unguard_sigterm()


def remove(path: str) -> None:
    """Unlink ``path`` (idempotent) and stop tracking it."""
    forget(path)
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass


def remove_all() -> None:
    with _lock:
        paths = list(_linked)
        _linked.clear()
    for p in paths:
        try:
            os.unlink(p)
        except OSError:
            pass


def guard_sigterm() -> None:
    """Unlink tracked entries on SIGTERM, then let the disposition found here act (default: die by
    the signal; a Python handler: called). Set only while something is tracked (the previous
    disposition comes back when the last entry is removed), so a process's SIGTERM behaves as before
    outside that window. Only the main thread may set handlers: elsewhere this is a no-op and rules 1
    and 3 of the module docstring remain."""
    if _hooks["sigterm"] is not None or threading.current_thread() is not threading.main_thread():
        return
    try:
        previous = signal.getsignal(signal.SIGTERM)
    except ValueError:
        return
    if previous is signal.SIG_IGN:
        return

    def on_sigterm(signum, frame):
        remove_all()
        if callable(previous):
            previous(signum, frame)
        else:  # SIG_DFL, or None (set outside Python): die by the signal, as we would have
            signal.signal(signal.SIGTERM, signal.SIG_DFL)
            os.kill(os.getpid(), signal.SIGTERM)

    try:
        signal.signal(signal.SIGTERM, on_sigterm)
    except ValueError:
        return
    _hooks["sigterm"] = signal.SIG_DFL if previous is None else previous


def _unguard_sigterm() -> None:
    previous = _hooks["sigterm"]
    if previous is None or threading.current_thread() is not threading.main_thread():
        return
    try:
        signal.signal(signal.SIGTERM, previous)
    except ValueError:
        return
    _hooks["sigterm"] = None


# ----- segments ------------------------------------------------------------------------------------
MAGIC = b"CLSHM001"
HEADER_BYTES = 4096  # magic, size, then free for the user's fields; data starts page-aligned


class Segment:
    """A mapped /dev/shm file. :meth:`create` makes one (this process owns it and removes it at exit
    unless unlinked before), :meth:`attach` maps another process's. :meth:`array` views the bytes
    after the header. Neither call blocks beyond the file system."""

    def __init__(self, path: str, fd: int, mm: mmap.mmap, owned: bool):
        self.path, self.mm, self.owned = path, mm, owned
        os.close(fd)  # the mapping holds the memory; the descriptor is not needed
        self.size = len(mm) - HEADER_BYTES
        self.linked = True

    def array(self):
        """A writable numpy uint8 view of the data bytes (no copy; valid while this segment is open)."""
        import numpy as np
        return np.frombuffer(self.mm, dtype=np.uint8, count=self.size, offset=HEADER_BYTES)

    @classmethod
    def create(cls, run: str, what: str, size: int, directory: str = SHM_DIR) -> "Segment":
        path = path_for(run, what, directory)
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        track(path)
        try:
            os.ftruncate(fd, HEADER_BYTES + size)
            # Reserve the pages now: a tmpfs without room for them (a container's 64 MiB /dev/shm) would
            # otherwise kill this process with SIGBUS at the first write past what fits.
            try:
                os.posix_fallocate(fd, 0, HEADER_BYTES + size)
            except OSError as exc:
                if exc.errno not in (errno.ENOSPC, errno.ENOMEM):
                    raise
                free = os.statvfs(directory)
                raise OSError(exc.errno, f"{directory} has no room for a {HEADER_BYTES + size}-byte segment "
                                         f"({free.f_bavail * free.f_frsize} bytes free): give it more (docker: "
                                         f"--shm-size) or use transport=tcp") from None
            mm = mmap.mmap(fd, HEADER_BYTES + size)
        except BaseException:
            os.close(fd)
            remove(path)
            raise
        mm[:16] = MAGIC + size.to_bytes(8, "little")
        return cls(path, fd, mm, owned=True)

    @classmethod
    def attach(cls, path: str, min_size: int = 0) -> "Segment":
        """Map another process's segment (read and write: the caller promises to only read).
        Raises :class:`ProtocolError` if it is not a commlab segment or is smaller than ``min_size``."""
        if NAME.fullmatch(os.path.basename(path)) is None or os.path.dirname(path) == "":
            raise ProtocolError(f"{path!r} is not a commlab shared-memory segment name")
        fd = os.open(path, os.O_RDWR | os.O_NOFOLLOW)
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode) or st.st_size < HEADER_BYTES + min_size:
                raise ProtocolError(f"{path} holds {st.st_size} bytes, expected at least {HEADER_BYTES + min_size}")
            mm = mmap.mmap(fd, st.st_size)
        except BaseException:
            os.close(fd)
            raise
        if mm[:8] != MAGIC or int.from_bytes(mm[8:16], "little") != st.st_size - HEADER_BYTES:
            mm.close()
            os.close(fd)
            raise ProtocolError(f"{path} is not a commlab segment (bad magic or size)")
        return cls(path, fd, mm, owned=False)

    def unlink(self) -> None:
        """Remove the file (idempotent); mappings stay valid until closed."""
        if self.linked:
            remove(self.path)
            self.linked = False

    def close(self) -> None:
        """Unmap (the owner also unlinks). Views from :meth:`array` still held elsewhere keep the
        mapping alive until they go (the memory is freed with the last of them)."""
        if self.owned:
            self.unlink()
        try:
            self.mm.close()
        except BufferError:  # a numpy/torch view still exports the buffer: the GC unmaps it later
            pass
