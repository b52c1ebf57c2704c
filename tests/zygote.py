"""A fork server for the test suite: torch imported once, every Python process forked from it.

Test plumbing, not the library's (as torch keeps its harness under ``torch/testing/_internal``): the
launcher takes how to start a process as a parameter (:data:`commlab.launch.launcher.Starter`), and this
module provides one.

Each rank, server and launcher the tests start imports torch (about 2 s of CPU) and, to build an
optimizer, torch._dynamo (1.3-1.6 s more); the suite starts several hundred of them on 2 cores.
A zygote (``python -m tests.zygote SOCKET``) imports all that once, then serves requests on a Unix
socket: each request is a command line ``[sys.executable, -m MODULE | -c CODE | SCRIPT, ARGS...]``,
an environment, a folder and three file descriptors (stdin, stdout, stderr, passed with
``SCM_RIGHTS``), and is answered by a forked child that runs the program as a fresh interpreter
would, with torch already in memory.

Opt-in only: the tests' helpers pass :func:`start` to :func:`commlab.launch.launcher.start_group` (and
``Job(starter=...)``); it asks the zygote named by ``$COMMLAB_ZYGOTE`` (the tests' conftest starts one
and sets it) for command lines it can serve, and starts every other command, or any command without
that variable (or with ``off``), the ordinary way. The processes the tests start inherit
``$COMMLAB_STARTER=tests.zygote``, so the launchers, ranks and servers they run start theirs here too
(:func:`commlab.launch.launcher.starter_from_env`). Users never get one.

Only its owner: the socket is bound under a temporary name inside a folder of mode 0700 that the
zygote makes (or finds owned by it, with no access for others), set to mode 0600 and renamed, so
no other user can reach it in between; and every connection's peer uid (``SO_PEERCRED``) must be
the zygote's own, else it is closed unread, counted and logged on stderr (what a connection can ask
for, ``-c CODE``, is code run as the zygote's user).
A command line may start with ``ip netns exec NS`` (as root; the child joins the network
namespace, without the /sys and /etc mounts ``ip netns exec`` adds) and ``env NAME=VALUE...``.

What a child gets, as from a real start: a session (and process group) of its own, so
:func:`commlab.launch.launcher.kill_groups` stops it with whatever it started; its own argv,
environment, folder, ``sys.path`` (the script's folder or the current one, then ``$PYTHONPATH``,
then the interpreter's own), standard streams built as the interpreter builds them
(``PYTHONUNBUFFERED``/``PYTHONIOENCODING`` honoured); Python's default signal dispositions;
an exit status as the interpreter's (``SystemExit``, a traceback and 1, death by SIGINT after an
uncaught KeyboardInterrupt), after non-daemon threads are joined and ``atexit`` handlers run.
RNGs: ``random`` is reseeded at fork by Python itself, numpy's global generator and torch's
default generator from the OS, as at a fresh import. Left as they were in the zygote: the hash
seed of str (one per zygote) and whatever the preloaded modules computed from the environment
when imported.

Death with the requester: a requester holds one connection per child until it has the child's
exit status; if the connection closes first (the requester died), the zygote SIGKILLs the child's
process group, as ``PR_SET_PDEATHSIG`` does for a real start (:mod:`commlab.launch.childexec`). The
children die with the zygote (``PR_SET_PDEATHSIG``), and the zygote with the process that started
it. Fork happens before any thread pool (OpenMP) or zmq context exists: the zygote only imports.

On the wire: msgpack maps, never pickle. Request ``{argv, env, cwd}`` with three descriptors;
replies ``{pid}`` or ``{error, errno}``, then ``{status}`` (the raw wait status) once it exited; the
child stays a zombie until the requester half-closes the connection, then the zygote reaps it and
closes, so a requester's ``wait`` returns with the pid gone, as ``waitpid`` leaves it.
"""

from __future__ import annotations

import contextlib
import errno as errno_mod
import os
import select
import signal
import socket
import stat
import struct
import subprocess
import sys
import time

ENV = "COMMLAB_ZYGOTE"  # the zygote's socket path; unset (or "off"): real starts
MODULE = "tests.zygote"  # this module's name for $COMMLAB_STARTER (the repository root on sys.path)
PRELOAD = ("torch", "torch._dynamo", "torch.distributed", "torch.utils.checkpoint", "numpy", "zmq", "msgpack",
           "tqdm", "commlab", "commlab.tools.cli", "commlab.launch.launcher", "commlab.core.exchanger", "commlab.transport.store",
           "workers.loop", "servers.server", "bench", MODULE)
MAX_MSG = 1 << 20
CONNECT_S = 120.0  # how long a requester waits for a zygote that is still importing
REAP_S = 30.0  # how long a requester waits for the zygote to reap a child whose exit it reported
PR_SET_PDEATHSIG = 1
CLONE_NEWNET = 0x40000000


def socket_path() -> str | None:
    path = os.environ.get(ENV, "")
    return None if path in ("", "off", "0") else path


class Starter:
    """A :data:`commlab.launch.launcher.Starter` that forks what it can from the zygote listening at ``path``
    and starts anything else the ordinary way (:func:`commlab.launch.launcher.plain_start`)."""

    def __init__(self, path: str):
        self.path = path

    def __call__(self, argv, env, **popen_kw) -> subprocess.Popen:
        from commlab.launch import launcher

        if serves(argv):
            return Popen(list(argv), zygote=self.path, env=dict(env), start_new_session=True, **popen_kw)
        return launcher.plain_start(argv, env, **popen_kw)


def start(argv, env, **popen_kw) -> subprocess.Popen:
    """The starter ``$COMMLAB_STARTER=tests.zygote`` names: the zygote at ``$COMMLAB_ZYGOTE`` (read now, so
    a test that turns it off turns it off), else the ordinary start."""
    from commlab.launch import launcher

    path = socket_path()
    return Starter(path)(argv, env, **popen_kw) if path else launcher.plain_start(argv, env, **popen_kw)


def serves(argv) -> bool:
    """Whether a zygote can run ``argv``: this interpreter with ``-m MODULE``, ``-c CODE`` or a script,
    possibly after ``ip netns exec NS`` (as root) and ``env NAME=VALUE...`` (:func:`split`)."""
    return split(argv) is not None


def split(argv) -> tuple[str | None, dict[str, str], list[str]] | None:
    """``(network namespace or None, variables set by env, the interpreter's command line)`` of ``argv``,
    or None where a zygote cannot run it."""
    argv = [os.fsdecode(a) for a in argv]
    netns = None
    if argv[:3] == ["ip", "netns", "exec"] and len(argv) > 3 and os.geteuid() == 0:
        netns, argv = argv[3], argv[4:]
    extra: dict[str, str] = {}
    if argv[:1] == ["env"]:
        argv = argv[1:]
        while argv and "=" in argv[0] and not argv[0].startswith(("-", "=")):
            name, _, value = argv.pop(0).partition("=")
            extra[name] = value
    if len(argv) < 2 or argv[0] != sys.executable:
        return None
    if argv[1] in ("-m", "-c"):
        return (netns, extra, argv) if len(argv) >= 3 else None
    return None if argv[1].startswith("-") else (netns, extra, argv)


# ----- the requester's side ----------------------------------------------------------------------

def _connect(path: str, timeout: float) -> socket.socket:
    deadline = time.monotonic() + timeout
    while True:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        try:
            sock.connect(path)
            return sock
        except (FileNotFoundError, ConnectionRefusedError):
            sock.close()
            if time.monotonic() > deadline:
                raise OSError(errno_mod.ECONNREFUSED, f"no zygote answers at {path} within {timeout:g}s") from None
            time.sleep(0.05)


class Popen(subprocess.Popen):
    """:class:`subprocess.Popen` whose child is forked by the zygote listening at ``zygote``.

    Used like any Popen (pipes, ``communicate``, ``poll``, ``wait``, signals to ``pid``); the
    child is not this process's own, so its exit status comes from the zygote over the connection
    this object holds. Only what :func:`commlab.launch.launcher.start_group` passes is supported: stdio
    redirections, ``cwd``, ``env``, ``text``, and a new session (always).
    """

    def __init__(self, args, *, zygote: str, **popen_kw):
        self._zygote_path = zygote
        super().__init__(args, **popen_kw)

    def _execute_child(self, args, executable, preexec_fn, close_fds, pass_fds, cwd, env, startupinfo,
                       creationflags, shell, p2cread, p2cwrite, c2pread, c2pwrite, errread, errwrite, *rest):
        import msgpack

        parts = split(args)
        if parts is None:
            raise subprocess.SubprocessError(f"a zygote does not run {list(args)}")
        netns, extra, argv = parts
        request = msgpack.packb({"argv": argv, "netns": netns,
                                 "env": {**{os.fsdecode(k): os.fsdecode(v) for k, v in
                                            (os.environ if env is None else env).items()}, **extra},
                                 "cwd": os.path.abspath(os.fsdecode(cwd)) if cwd is not None else os.getcwd()})
        sock = _connect(self._zygote_path, CONNECT_S)
        try:
            fds = [p2cread if p2cread != -1 else 0, c2pwrite if c2pwrite != -1 else 1,
                   errwrite if errwrite != -1 else 2]
            socket.send_fds(sock, [request], fds)
            sock.settimeout(60)
            data = sock.recv(MAX_MSG)
            sock.settimeout(None)
            reply = msgpack.unpackb(data) if data else {"error": "the zygote closed the connection", "errno": 0}
        except BaseException:
            sock.close()
            raise
        finally:
            self._close_pipe_fds(p2cread, p2cwrite, c2pread, c2pwrite, errread, errwrite)
        if "error" in reply:
            sock.close()
            if reply.get("errno"):
                raise OSError(reply["errno"], reply["error"], cwd)
            raise subprocess.SubprocessError(reply["error"])
        self._zygote = sock
        self.pid = reply["pid"]
        self._child_created = True

    def _try_wait(self, wait_flags):
        """(pid, raw status) once the zygote reported the exit, else (0, 0) under WNOHANG."""
        import msgpack

        sock = self._zygote
        if sock.fileno() < 0:
            return self.pid, 0
        if wait_flags & os.WNOHANG and not select.select([sock], [], [], 0)[0]:
            return 0, 0
        try:
            data = sock.recv(MAX_MSG)
            if data:  # as waitpid does: return once the child is reaped (the zygote closes when it is)
                sock.shutdown(socket.SHUT_WR)
                sock.settimeout(REAP_S)
                sock.recv(1)
        except OSError:
            pass
        sock.close()
        # no report: the zygote is gone, and its children with it (PR_SET_PDEATHSIG)
        return self.pid, msgpack.unpackb(data)["status"] if data else int(signal.SIGKILL)

    def _internal_poll(self, _deadstate=None, **_):
        if self.returncode is None and self._waitpid_lock.acquire(False):
            try:
                if self.returncode is None:
                    pid, sts = self._try_wait(os.WNOHANG)
                    if pid == self.pid:
                        self._handle_exitstatus(sts)
            except OSError:
                if _deadstate is not None:
                    self.returncode = _deadstate
            finally:
                self._waitpid_lock.release()
        return self.returncode


# ----- the zygote ---------------------------------------------------------------------------------

def _private_folder(folder: str) -> None:
    """``folder`` made with mode 0700, or found as a folder of this user's that no one else may enter;
    PermissionError otherwise (the socket inside is reachable by whoever may enter it)."""
    with contextlib.suppress(FileExistsError):
        os.mkdir(folder, 0o700)
    st = os.lstat(folder)
    if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.geteuid() or st.st_mode & 0o077:
        raise PermissionError(f"the zygote's folder {folder} must be a folder of uid {os.geteuid()} with mode 0700, "
                              f"not mode {stat.S_IMODE(st.st_mode):o} of uid {st.st_uid}")


def _bind_private(path: str) -> socket.socket:
    """A listening socket at ``path``, mode 0600, in a private folder (:func:`_private_folder`). Bound
    under a temporary name (bind makes the file with the umask's mode), then set to 0600 and renamed:
    connectable under its name only once it is, and the folder keeps others out in between."""
    _private_folder(os.path.dirname(os.path.abspath(path)))
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    tmp = f"{path}.{os.getpid()}"
    listener.bind(tmp)
    os.chmod(tmp, 0o600)
    listener.listen(128)
    os.rename(tmp, path)
    return listener


def peer_uid(conn: socket.socket) -> tuple[int, int]:
    """(pid, uid) of the process at the other end of a Unix socket, as the kernel recorded it at connect
    (``SO_PEERCRED``)."""
    pid, uid, _gid = struct.unpack("3i", conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i")))
    return pid, uid


def _die_with_parent(parent: int) -> None:
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(PR_SET_PDEATHSIG, int(signal.SIGKILL), 0, 0, 0)
    if os.getppid() != parent:
        os._exit(1)


class Zygote:
    def __init__(self, path: str, preload: tuple[str, ...] = PRELOAD):
        _private_folder(os.path.dirname(os.path.abspath(path)))  # before the minute of imports
        self.path = path
        self.zygote_pid = os.getpid()
        self.children: dict[int, socket.socket] = {}  # pid -> its requester's connection
        self.reported: dict[int, socket.socket] = {}  # exited, status sent, a zombie until the requester closes
        self.orphans: set[int] = set()  # requester gone, group killed, not reaped yet
        self.refused = 0  # connections from another user, closed unread
        self.base_path = [p for p in sys.path[1:] if p not in os.environ.get("PYTHONPATH", "").split(os.pathsep)]
        self.preload(preload)
        self.listener = _bind_private(path)
        self.wake_r, self.wake_w = socket.socketpair()
        self.wake_r.setblocking(False)
        self.wake_w.setblocking(False)
        signal.set_wakeup_fd(self.wake_w.fileno())
        signal.signal(signal.SIGCHLD, lambda *_: None)
        signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))

    @staticmethod
    def preload(names: tuple[str, ...]) -> None:
        import importlib

        for name in names:
            with contextlib.suppress(ImportError):
                importlib.import_module(name)

    def serve(self) -> None:
        while True:
            watched = [self.listener, self.wake_r, *self.children.values(), *self.reported.values()]
            for sock in select.select(watched, [], [])[0]:
                if sock is self.listener:
                    self.accept()
                elif sock is self.wake_r:
                    with contextlib.suppress(BlockingIOError):
                        while self.wake_r.recv(4096):
                            pass
                    self.reap()
                else:
                    self.closed(sock)

    def closed(self, sock: socket.socket) -> None:
        """A requester's connection closed or half-closed (requesters send nothing after the request):
        after the exit status reached it, the zombie is reaped now and the connection closed, which tells
        the requester; before, the requester is gone and so goes its child."""
        reported = next((p for p, s in self.reported.items() if s is sock), None)
        if reported is not None:
            del self.reported[reported]
            with contextlib.suppress(ChildProcessError):
                os.waitpid(reported, 0)  # a zombie: at once
            sock.close()
            return
        pid = next((p for p, s in self.children.items() if s is sock), None)
        sock.close()
        if pid is None:
            return
        del self.children[pid]
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(pid, signal.SIGKILL)
        self.orphans.add(pid)
        self.reap()

    def reap(self) -> None:
        """Report each exited child to its requester, keeping it a zombie (its pid, and its group's id,
        not reused) until the requester closes the connection, as a process's own child stays until
        waited for; reap the children whose requester is done or gone."""
        import msgpack

        for pid in list(self.orphans):
            with contextlib.suppress(ChildProcessError):
                if os.waitpid(pid, os.WNOHANG)[0] == 0:
                    continue
            self.orphans.discard(pid)
        for pid, sock in list(self.children.items()):
            try:
                info = os.waitid(os.P_PID, pid, os.WEXITED | os.WNOHANG | os.WNOWAIT)
            except ChildProcessError:
                info = None
            if info is None:
                continue
            del self.children[pid]
            if info.si_code == os.CLD_EXITED:
                status = (info.si_status & 0xFF) << 8
            else:  # killed by a signal (0x80: it dumped core)
                status = info.si_status | (0x80 if info.si_code == os.CLD_DUMPED else 0)
            try:
                sock.send(msgpack.packb({"status": status}))
                self.reported[pid] = sock
            except OSError:  # the requester is gone too
                sock.close()
                self.orphans.add(pid)
                with contextlib.suppress(ChildProcessError):
                    os.waitpid(pid, os.WNOHANG)
                    self.orphans.discard(pid)

    def accept(self) -> None:
        import msgpack

        conn, _ = self.listener.accept()
        pid, uid = peer_uid(conn)
        if uid != os.geteuid():  # what it would ask for runs as this user: only this user may ask
            conn.close()
            self.refused += 1
            print(f"zygote: refused a connection from uid {uid} (pid {pid}): only uid {os.geteuid()} is served; "
                  f"{self.refused} refused so far", file=sys.stderr, flush=True)
            return
        fds: list[int] = []
        try:
            conn.settimeout(10)
            data, fds, _, _ = socket.recv_fds(conn, MAX_MSG, 3)
            request = msgpack.unpackb(data)
            if len(fds) != 3 or not serves(request["argv"]):
                raise ValueError(f"a zygote runs {sys.executable} with -m, -c or a script, and three descriptors")
            conn.settimeout(None)
            ready_r, ready_w = os.pipe()
            sys.stdout.flush()
            sys.stderr.flush()
            pid = os.fork()
            if pid == 0:
                os.close(ready_r)
                self.child(conn, fds, ready_w, request)  # never returns
            os.close(ready_w)
            with os.fdopen(ready_r, "rb") as ready:
                failure = ready.read()  # EOF once the child is set up (or an error message)
        except (OSError, ValueError, KeyError, TypeError) as exc:
            with contextlib.suppress(OSError):
                conn.send(msgpack.packb({"error": str(exc), "errno": getattr(exc, "errno", 0) or 0}))
            conn.close()
            return
        finally:
            for fd in fds:
                os.close(fd)
        if failure:
            code, _, message = failure.decode(errors="replace").partition(":")
            self.orphans.add(pid)
            with contextlib.suppress(OSError):
                conn.send(msgpack.packb({"error": message, "errno": int(code)}))
            conn.close()
            self.reap()
            return
        self.children[pid] = conn
        conn.send(msgpack.packb({"pid": pid}))

    # ----- in the child

    def child(self, conn: socket.socket, fds: list[int], ready_w: int, request: dict) -> None:
        code = 1
        try:
            signal.set_wakeup_fd(-1)
            for sig in (signal.SIGCHLD, signal.SIGTERM):
                signal.signal(sig, signal.SIG_DFL)
            signal.signal(signal.SIGINT, signal.default_int_handler)
            for sock in (self.listener, self.wake_r, self.wake_w, conn, *self.children.values(),
                         *self.reported.values()):
                sock.close()
            os.setsid()
            _die_with_parent(self.zygote_pid)
            for target, fd in enumerate(fds):
                os.dup2(fd, target)
            for fd in fds:
                if fd > 2:
                    os.close(fd)
            try:
                if request.get("netns"):  # what `ip netns exec` does for the network (not its /sys, /etc mounts)
                    self.enter_netns(request["netns"])
                os.chdir(request["cwd"])
            except OSError as exc:
                os.write(ready_w, f"{exc.errno}:{exc.strerror}".encode())
                os._exit(255)
            os.close(ready_w)
            code = self.run(request["argv"], request["env"])
        finally:
            os._exit(code)

    @staticmethod
    def enter_netns(name: str) -> None:
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        fd = os.open(os.path.join("/run/netns", name), os.O_RDONLY)
        try:
            if libc.setns(fd, CLONE_NEWNET) != 0:
                err = ctypes.get_errno()
                raise OSError(err, f"setns into network namespace {name}: {os.strerror(err)}")
        finally:
            os.close(fd)

    def run(self, argv: list[str], env: dict) -> int:
        """Run ``argv`` as the interpreter would; the exit code (or death by SIGINT)."""
        import atexit
        import builtins
        import tempfile
        import threading
        import types

        os.environ.clear()
        os.environ.update(env)
        tempfile.tempdir = None  # $TMPDIR as this child's environment says
        self.streams(env)
        self.reseed()
        mode, target, args = (argv[1], argv[2], argv[3:]) if argv[1] in ("-m", "-c") else ("", argv[1], argv[2:])
        first = os.getcwd() if mode == "-m" else "" if mode == "-c" else os.path.dirname(os.path.realpath(target))
        extra = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
        sys.path[:] = [first, *extra, *self.base_path]
        interrupted = False
        main = types.ModuleType("__main__")  # a fresh one: `python -m` runs the module in __main__'s dict
        main.__dict__["__builtins__"] = builtins
        sys.modules["__main__"] = main
        try:
            if mode == "-m":
                import runpy

                sys.argv = ["-m", *args]
                # preloaded here, not yet imported in a fresh interpreter (runpy would warn about it); a
                # package runs its __main__, which is never preloaded
                if not hasattr(sys.modules.get(target), "__path__"):
                    sys.modules.pop(target, None)
                getattr(runpy, "_run_module_as_main")(target)  # what `python -m` calls
            elif mode == "-c":
                sys.argv = ["-c", *args]
                exec(compile(target, "<string>", "exec"), main.__dict__)
            else:
                sys.argv = [target, *args]
                main.__file__ = target
                with open(target, "rb") as fh:
                    source = fh.read()
                exec(compile(source, target, "exec"), main.__dict__)
            code = 0
        except SystemExit as exc:
            code = self.exit_code(exc.code)
        except KeyboardInterrupt as exc:
            self.report(exc)
            interrupted, code = True, 1
        except BaseException as exc:
            self.report(exc)
            code = 1
        with contextlib.suppress(BaseException):
            threading._shutdown()  # type: ignore[attr-defined]
        with contextlib.suppress(BaseException):
            atexit._run_exitfuncs()
        for stream in (sys.stdout, sys.stderr):
            with contextlib.suppress(BaseException):
                stream.flush()
        if interrupted:
            signal.signal(signal.SIGINT, signal.SIG_DFL)
            os.kill(os.getpid(), signal.SIGINT)
        return code

    @staticmethod
    def exit_code(code) -> int:
        if code is None:
            return 0
        if isinstance(code, int):
            return code & 0xFF
        with contextlib.suppress(BaseException):
            print(code, file=sys.stderr)
        return 1

    @staticmethod
    def report(exc: BaseException) -> None:
        """The traceback the interpreter would print, without the zygote's own frames."""
        tb = exc.__traceback__
        while tb is not None and tb.tb_frame.f_code.co_filename == __file__:
            tb = tb.tb_next
        with contextlib.suppress(BaseException):
            sys.excepthook(type(exc), exc.with_traceback(tb), tb)

    @staticmethod
    def streams(env: dict) -> None:
        import io

        unbuffered = bool(env.get("PYTHONUNBUFFERED"))
        encoding, _, errors = (env.get("PYTHONIOENCODING") or "").partition(":")
        encoding = encoding or "utf-8"

        def stream(fd: int, write: bool, errs: str):
            raw = io.FileIO(fd, "w" if write else "r", closefd=False)
            interactive = raw.isatty()
            buf = raw if write and unbuffered else (io.BufferedWriter(raw) if write else io.BufferedReader(raw))
            return io.TextIOWrapper(buf, encoding=encoding, errors=errs, line_buffering=write and interactive,
                                    write_through=write and unbuffered)

        for name, fd, write, errs in (("stdin", 0, False, errors or "strict"), ("stdout", 1, True, errors or "strict"),
                                      ("stderr", 2, True, "backslashreplace")):
            made = stream(fd, write, errs)
            if name == "stderr":
                made.reconfigure(line_buffering=True)
            setattr(sys, name, made)
            setattr(sys, f"__{name}__", made)

    @staticmethod
    def reseed() -> None:
        """The generators a preloaded module seeded once in the zygote, seeded from the OS again, as at a fresh
        import (``random``: reseeded at fork by Python; a module not preloaded seeds itself when imported)."""
        if "numpy" in sys.modules:
            sys.modules["numpy"].random.seed()
        if "torch" in sys.modules:
            sys.modules["torch"].seed()


def main(argv: list[str]) -> int:
    """``[--bare] SOCKET_PATH``; ``--bare``: import nothing ahead (a zygote to test the zygote with)."""
    bare = argv[:1] == ["--bare"]
    argv = argv[1:] if bare else argv
    if len(argv) != 1:
        print("usage: python -m tests.zygote [--bare] SOCKET_PATH", file=sys.stderr)
        return 2
    os.environ.pop(ENV, None)
    _die_with_parent(os.getppid())
    zygote = Zygote(argv[0], () if bare else PRELOAD)
    try:
        zygote.serve()
    finally:
        with contextlib.suppress(OSError):
            os.unlink(argv[0])
    return 0


if __name__ == "__main__":
    # served from the module tests.zygote, not from __main__, whose dict each child's program takes over
    from tests.zygote import main as served

    sys.exit(served(sys.argv[1:]))
