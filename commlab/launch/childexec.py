"""``python commlab/launch/childexec.py LAUNCHER_PID PROGRAM [ARGS...]``: die with the launcher, then exec.

The launcher starts every rank and server in a process group of its own, so that stopping one
takes whatever it started too (a data loader's workers). A process group of its own is also
out of reach of a kill aimed at the launcher's group: if the launcher itself is SIGKILLed it
cannot stop them. This shim asks Linux to SIGKILL it when its parent dies (``PR_SET_PDEATHSIG``,
kept across ``exec``), checks that the parent is still the launcher (it may have died before
the request), and replaces itself with ``PROGRAM``: the pid the launcher holds is the program's.
Elsewhere than Linux it only execs. Run by path, not with ``-m``: importing the commlab
package would import torch, seconds per process for a shim that needs only the standard library.
"""

from __future__ import annotations

import ctypes
import os
import signal
import sys

PR_SET_PDEATHSIG = 1


def main(argv: list[str]) -> int:
    if len(argv) < 2:
        print("usage: python commlab/launch/childexec.py LAUNCHER_PID PROGRAM [ARGS...]", file=sys.stderr)
        return 2
    parent, program = int(argv[0]), argv[1:]
    if sys.platform.startswith("linux"):
        libc = ctypes.CDLL(None, use_errno=True)
        if libc.prctl(PR_SET_PDEATHSIG, int(signal.SIGKILL), 0, 0, 0) != 0:
            print(f"commlab: prctl(PR_SET_PDEATHSIG) failed: {os.strerror(ctypes.get_errno())}", file=sys.stderr)
            return 1
    if os.getppid() != parent:  # the launcher died before the request took effect
        return 1
    try:
        os.execvp(program[0], program)
    except OSError as exc:
        print(f"commlab: cannot start {program[0]!r}: {exc}", file=sys.stderr)
        return 127
    return 1  # not reached


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
