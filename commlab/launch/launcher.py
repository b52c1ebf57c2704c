"""The embedded launcher: a job of N ranks (and any servers their regime needs) on this host.

A :class:`Job` says what each rank runs (a module, ``python -m workers``, or a script path), its
arguments, the exchanger URL, a deadline and where logs and metrics go; :func:`run_job` runs it
for ``commlab train``, ``commlab run`` and the benchmarks. Ranks get torchrun's environment
(``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``LOCAL_WORLD_SIZE``, ``MASTER_ADDR``, ``MASTER_PORT``)
plus ``COMMLAB_EXCHANGER`` and ``COMMLAB_METRICS``, so a rank cannot tell this launcher from
torchrun. The job, in order:

1. The regime's plan (``plan_local``, e.g. ``ps://?shards=K``) names servers that bind port 0.
   Each server prints ``... listening on ENDPOINT`` on stdout once bound; the launcher reads
   those lines (with a deadline) and writes the real endpoints into the workers' URL. No port
   is picked and released before its server binds it.
2. The rendezvous store (torch's ``TCPStore``) is hosted here, bound to port 0, as torchrun's
   agent hosts it (``TORCHELASTIC_USE_AGENT_STORE=True``): every rank, rank 0 included, is a
   client of a port that is already bound. Ranks placed in other network namespaces by
   ``rank_prefix`` cannot reach this process: for them a process started like rank 0
   (``python -m commlab.transport.store``) hosts it at ``master_addr``, port 0, and reports the port as
   servers report theirs. Servers may be placed likewise (``server_prefix``, ``place_servers``).
3. Ranks start; rank 0's stdout and stderr reach the terminal (progress), the servers' output
   reaches stderr, the other ranks' only their logs; every process's output goes to its log
   (``rank<r>.log``, ``server<i>.log`` in ``log_dir``). With ``console`` (a text file), what would
   reach the terminal goes there instead, the launcher's own lines too: a caller that runs jobs in
   its own process (the benchmark) keeps its terminal and gets one log per job.
   Every rank and server gets the job's secret (``COMMLAB_JOB_SECRET_FILE``, a 0600 file in the
   launcher's scratch folder, made fresh unless the environment names one): :mod:`commlab.transport.auth`.
4. The launcher watches: the first process to fail is named with the tail of its log, the
   rest are stopped. With ``max_restarts`` R (torchrun's ``--max-restarts``) a failed *rank* stops
   the ranks alone: the servers keep running and every rank starts again, up to R times, with
   ``TORCHELASTIC_RESTART_COUNT`` = the attempt (0 first, as torchrun sets it) and a fresh rendezvous
   store (torchrun makes one per attempt too), so no key of a dead attempt is read by the next; the
   deadline spans every attempt. Ctrl-C, SIGTERM and the deadline stop every process too (exit 130, 143,
   124). Each process leads a process group of its own, so a stop takes whatever it started;
   each also dies with the launcher if the launcher is SIGKILLed (``commlab/launch/childexec.py``).
5. A one-line summary from rank 0's last metrics line (:mod:`commlab.core.metrics`) goes to stdout.

How a process starts is a parameter (a :data:`Starter`: ``Job.starter``, ``start_group(starter=)``):
an ordinary ``subprocess`` start by default. The deadline, the group kill and the log names above hold
for any starter; the test suite passes a fork server of its own (``tests/zygote.py``), and reaches the
launchers its commands run through ``$COMMLAB_STARTER`` (:func:`starter_from_env`).
"""

from __future__ import annotations

import contextlib
import importlib
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Callable, Iterator, Mapping, Sequence

from commlab.base import trace
from commlab.transport import auth, shm
from commlab.core import metrics
from commlab.launch import exporter, scratch as scratch_dirs
from commlab.transport import store as store_mod
from commlab.base.config import ExchangerURL, check_number
from commlab.base.errors import ConfigError
from commlab.core.exchanger import PlansServers
from commlab.core.registry import ENV_URL, regime_class
from commlab.transport.rendezvous import ENTERED, KEEP_GOING, REPLACEMENT, RESTART_COUNT

CHILDEXEC = str(Path(__file__).with_name("childexec.py"))
STARTER_ENV = "COMMLAB_STARTER"  # a module whose start() starts this process's children (a test harness's)
AGENT_STORE = "TORCHELASTIC_USE_AGENT_STORE"  # torchrun's word for "the store is hosted for you"
MAX_RESTARTS = "TORCHELASTIC_MAX_RESTARTS"
ENDPOINT_LINE = re.compile(r"listening on (\S+)\s*$")
METRICS_LINE = re.compile(r" metrics on (http://\S+)\s*$")  # a server's endpoint (--metrics-port), before the above
TAIL_LINES = 20
MAX_LOCAL_RANKS = 256  # ranks one launcher starts on this host: each is a Python process with torch in memory


# ----- servers a regime plans ---------------------------------------------------------------------

@contextlib.contextmanager
def server_plan(url: str, workers: int) -> Iterator[tuple[str, list[list[str]]]]:
    """The servers ``url``'s regime wants started for a job of ``workers`` on this host.

    Yields ``(url template, [server argv for python -m servers, ...])``: the URL unchanged and no
    servers when the regime plans none or the URL names its servers. Servers bind port 0; the URL
    template holds their ``--bind`` endpoints in order, to be replaced by what they report
    (:func:`start_servers` does both). A plan that needs files (ipc sockets) calls ``scratch()``
    for a folder ``$TMPDIR/commlab-SCHEME-*``, removed when the block exits, also on errors, so
    stop the servers inside it. Starts nothing. Raises ConfigError for a bad URL.
    """
    parsed = ExchangerURL.parse(url)
    cls = regime_class(parsed.scheme)
    if not issubclass(cls, PlansServers):
        yield url, []
        return
    made: list[str] = []

    def scratch() -> str:
        # made on first use: a tcp plan makes nothing that a killed launcher could leave behind
        if not made:
            made.append(scratch_dirs.mkdtemp(parsed.scheme))
        return made[0]

    try:
        yield cls.plan_local(parsed, workers, scratch)
    finally:
        for folder in made:
            shutil.rmtree(folder, ignore_errors=True)


def bind_of(argv: Sequence[str]) -> str:
    """The ``--bind`` endpoint in a server's argv."""
    try:
        return argv[list(argv).index("--bind") + 1]
    except (ValueError, IndexError):
        raise ConfigError(f"server argv {list(argv)} has no --bind ENDPOINT") from None


def with_endpoints(url: str, binds: Sequence[str], endpoints: Sequence[str]) -> str:
    """``url`` with server i's planned ``binds[i]`` replaced by the ``endpoints[i]`` it reported.

    The plan lists its servers in the URL in server order, so the i-th replacement starts where
    the (i-1)-th ended: equal binds (``tcp://127.0.0.1:0`` K times) still map one to one.
    """
    out, pos = url, 0
    for bind, endpoint in zip(binds, endpoints, strict=True):
        at = out.find(bind, pos)
        if at < 0:
            raise ConfigError(f"the plan's URL {url!r} does not name server endpoint {bind!r}")
        out = out[:at] + endpoint + out[at + len(bind):]
        pos = at + len(endpoint)
    return out


def swap_endpoint(url: str, old: str, new: str) -> str:
    """``url`` with the server endpoint ``old`` replaced by ``new`` where it stands whole (in the host list or
    ``endpoints=``, between separators): ``127.0.0.1:5555`` is not the start of ``127.0.0.1:55556``."""
    return re.sub(r"(?<![\w.:-])" + re.escape(old) + r"(?![\w.:/-])", lambda _m: new, url)


# ----- processes ----------------------------------------------------------------------------------

@dataclass
class Proc:
    name: str  # "rank 1", "server 0"
    popen: subprocess.Popen
    log: Path | None = None  # everything the process wrote (stdout and stderr)
    forwarded: bool = False  # its output also reached the launcher's terminal
    endpoint: str | None = None  # a server: what it reported binding
    metrics_url: str | None = None  # a server started with --metrics-port: where it serves them
    reported: threading.Event = field(default_factory=threading.Event)
    pumps: list[threading.Thread] = field(default_factory=list)
    files: list = field(default_factory=list)  # closed once the pumps are done

    def drain(self, timeout: float = 10.0) -> None:
        """Wait for the output pumps (bounded: a grandchild that escaped the group may hold a pipe). The
        launcher's own last line comes after this, so a bound too short for a loaded machine would let a
        rank's last words (its traceback) land after it."""
        for t in self.pumps:
            t.join(timeout)
        if not any(t.is_alive() for t in self.pumps):
            for fh in self.files:
                fh.close()

    def tail(self, lines: int = TAIL_LINES) -> str:
        if self.log is None or not self.log.exists():
            return ""
        return "\n".join(self.log.read_text(errors="replace").splitlines()[-lines:])


def _signal_group(popen: subprocess.Popen, sig: int) -> None:
    """``sig`` to the process group ``popen`` leads (:func:`start_group`), else to ``popen`` alone.

    A live process that leads no group has no group of its pid (a pid is never reused while a group
    of that id exists), so ``killpg`` finds none and only the process itself is signalled.
    """
    try:
        os.killpg(popen.pid, sig)
    except ProcessLookupError:  # not a group leader (started by someone else), or the group is gone
        if popen.poll() is None:
            popen.send_signal(sig)
    except PermissionError:
        pass


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except (ProcessLookupError, PermissionError):
        return False
    return True


def kill_groups(popens: Sequence[subprocess.Popen], grace: float = 5.0, *, reap_s: float = 30.0) -> None:
    """The one way commlab stops processes: each process's group, with whatever it started.

    With ``grace`` > 0 every group first gets SIGTERM (a server checkpoints, a launcher stops its
    ranks) and up to ``grace`` seconds, shared, to empty; then every group gets SIGKILL, exited
    leaders' groups too (what they started goes with them). Reaps each leader (at most ``reap_s``
    seconds for all: a SIGKILLed process still there after that is stuck in the kernel,
    TimeoutExpired) and waits up to 1 s for the groups to empty. SIGKILL is sent even when the
    grace period is cut short (Ctrl-C). Blocks at most ``grace + reap_s + 1`` seconds.
    """
    try:
        if grace > 0:
            for p in popens:
                _signal_group(p, signal.SIGTERM)
            _wait_empty(popens, grace)
    finally:
        for p in popens:
            _signal_group(p, signal.SIGKILL)
        deadline = time.monotonic() + reap_s
        for p in popens:
            p.wait(max(0.0, deadline - time.monotonic()))
    # a leader reaped, its group may still hold members dying of the SIGKILL (or zombies init has
    # not reaped yet): hence the bound
    _wait_empty(popens, 1.0)


def _wait_empty(popens: Sequence[subprocess.Popen], within: float) -> None:
    """Until every leader exited (reaped: an unreaped leader keeps its group alive as a zombie) and
    every group is empty, at most ``within`` seconds."""
    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        if all(p.poll() is not None for p in popens) and not any(_group_alive(p.pid) for p in popens):
            return
        time.sleep(0.02)


def stop_all(procs: Sequence[Proc], grace: float = 5.0) -> None:
    """:func:`kill_groups` for launcher processes, then wait for their output pumps."""
    kill_groups([p.popen for p in procs], grace)
    for p in procs:
        p.drain()


def _pump(src, sinks: list, lock: threading.Lock, on_line: Callable[[bytes], None] | None) -> None:
    """Copy ``src`` (a pipe) to every sink until EOF; a sink that fails (a closed terminal pipe)
    is dropped, the others go on. ``on_line`` sees each line (servers report their endpoint)."""
    read = src.readline if on_line else (lambda: src.read1(65536))
    while True:
        try:
            chunk = read()
        except (OSError, ValueError):
            break
        if not chunk:
            break
        if on_line:
            on_line(chunk)
        with lock:
            for sink in list(sinks):
                try:
                    sink.write(chunk)
                    sink.flush()
                except (OSError, ValueError):
                    sinks.remove(sink)
    src.close()


Starter = Callable[..., subprocess.Popen]
"""How a process starts: ``starter(argv, env, **popen_kw)`` returns a :class:`subprocess.Popen` of ``argv``
with environment ``env`` (a full mapping) that leads a session (so a process group) of its own and dies
with this process. :func:`plain_start` is the default; a test harness passes its own (a fork server)."""


def plain_start(argv: Sequence[str], env: Mapping[str, str], **popen_kw) -> subprocess.Popen:
    """The ordinary start (a :data:`Starter`): ``subprocess.Popen`` through ``commlab/launch/childexec.py``, which
    makes ``argv`` a session leader that is SIGKILLed if the thread that called this exits."""
    return subprocess.Popen([sys.executable, "-I", CHILDEXEC, str(os.getpid()), *argv], env=dict(env),
                            start_new_session=True, **popen_kw)


def starter_from_env(environ: Mapping[str, str] | None = None) -> Starter:
    """The starter this process's children get when the caller names none: :func:`plain_start`, unless
    ``$COMMLAB_STARTER`` names a module; then that module's ``start`` (a :data:`Starter`). The variable is
    how a harness reaches the processes it does not call directly (a ``commlab run`` that a test starts
    starts ranks, which start servers): they inherit it. Raises ConfigError where the module or its
    ``start`` cannot be imported."""
    name = (os.environ if environ is None else environ).get(STARTER_ENV, "")
    if not name:
        return plain_start
    try:
        return importlib.import_module(name).start
    except (ImportError, AttributeError) as exc:
        raise ConfigError(f"${STARTER_ENV}={name!r} names no importable module with a start(): {exc}") from None


def start_group(argv: Sequence[str], env: Mapping[str, str] | None = None, *, starter: Starter | None = None,
                **popen_kw) -> subprocess.Popen:
    """``argv`` started by ``starter`` (default: :func:`starter_from_env`, which is :func:`plain_start`
    unless a harness says otherwise) as the leader of a process group of its own, which dies with this
    process. :func:`kill_groups` stops it with whatever it started. ``env`` defaults to this process's;
    stdin defaults to /dev/null. The pid is ``argv``'s own. Does not block.
    """
    popen_kw.setdefault("stdin", subprocess.DEVNULL)
    start = starter if starter is not None else starter_from_env()
    return start(list(argv), dict(os.environ if env is None else env), **popen_kw)


def spawn(name: str, argv: list[str], env: Mapping[str, str], log: Path | None, *, forward: str | None = None,
          report_endpoint: bool = False, console: IO[str] | None = None, starter: Starter | None = None) -> Proc:
    """Start ``argv`` in a process group of its own that dies with this process (``starter``: see
    :func:`start_group`).

    Its output goes to ``log`` and, with ``forward="both"``, to this process's stdout and stderr
    (rank 0: progress and prints; a stderr that is a terminal is handed over as it is, so that
    progress bars see a terminal, and is then not in the log), with ``forward="stderr"`` both its streams to this process's
    stderr (servers: diagnostics, never mixed into the stdout a caller may parse).
    With ``console`` (a text file with a ``buffer``), what is forwarded goes there instead of this
    process's stdout and stderr. With ``report_endpoint`` the first ``... listening on ENDPOINT``
    line on its stdout sets ``Proc.endpoint`` and ``Proc.reported``. Does not block.
    """
    out, err = (console, console) if console is not None else (sys.stdout, sys.stderr)
    terminal = forward == "both" and _is_terminal(err)
    stderr = None if terminal else subprocess.PIPE if forward == "both" else subprocess.STDOUT
    popen = start_group(argv, env, starter=starter, stdout=subprocess.PIPE, stderr=stderr)
    proc = Proc(name, popen, log, forward is not None)
    lock = threading.Lock()
    fh = log.open("ab") if log is not None else None

    def on_line(line: bytes) -> None:
        if not proc.reported.is_set():
            text = line.decode(errors="replace")
            m = ENDPOINT_LINE.search(text)
            if m:
                proc.endpoint = m.group(1)
                proc.reported.set()
            m = METRICS_LINE.search(text)
            if m:
                proc.metrics_url = m.group(1)

    if forward == "both":  # to the terminal as it came
        streams = [(popen.stdout, out)] + ([] if terminal else [(popen.stderr, err)])
    elif forward == "stderr":
        streams = [(popen.stdout, err)]
    else:
        streams = [(popen.stdout, None)]
    for src, term in streams:
        sinks = [s for s in (fh, getattr(term, "buffer", None)) if s is not None]
        t = threading.Thread(target=_pump, args=(src, sinks, lock, on_line if report_endpoint else None),
                             name=f"commlab-pump-{name}", daemon=True)
        t.start()
        proc.pumps.append(t)
    proc.files = [fh] if fh is not None else []
    return proc


def _is_terminal(stream) -> bool:
    try:
        return stream.isatty()
    except (AttributeError, ValueError):
        return False


class JobFailed(Exception):
    """A process of the job failed, or the job could not start; the message is for the user."""

    def __init__(self, message: str, code: int):
        super().__init__(message)
        self.code = code


def _how(code: int) -> str:
    return f"exit code {code}" if code >= 0 else f"signal {signal.Signals(-code).name}"


def await_endpoints(procs: Sequence[Proc], timeout: float) -> list[str]:
    """The endpoints ``procs`` (spawned with ``report_endpoint``) report, in order. Blocks until each
    reported, at most ``timeout`` seconds for all; raises JobFailed naming the first that exited
    or never reported."""
    deadline = time.monotonic() + timeout
    for p in procs:
        while not p.reported.wait(0.05):
            code = p.popen.poll()
            if code is not None:
                p.reported.wait(1.0)  # the line may be in the pipe still
                if p.reported.is_set():
                    break
                raise JobFailed(f"{p.name} exited ({_how(code)}) before it reported its endpoint"
                                + _tail_text(p), code if code > 0 else 1)
            if time.monotonic() > deadline:
                raise JobFailed(f"{p.name} did not report its endpoint within {timeout:g}s" + _tail_text(p), 1)
    return [p.endpoint or "" for p in procs]


def start_servers(template: str, argvs: list[list[str]], env: Mapping[str, str], logs: Path | None,
                  timeout: float, procs: list[Proc], prefix: Callable[[int], Sequence[str]] | None = None,
                  console: IO[str] | None = None, starter: Starter | None = None,
                  replica_sets: "ReplicaSets | None" = None) -> str:
    """Start the planned servers (appended to ``procs`` as they start, so the caller stops them);
    return the workers' URL with the endpoints they reported. ``prefix(i)`` goes before server i's
    command line (``ip netns exec NS``: a server in another network namespace binds there and
    reports what it bound all the same). Blocks until every server reported, at most ``timeout``
    seconds; raises JobFailed naming a server that exited or never reported. ``console``, ``starter``: see
    :func:`spawn`. An argv naming ``{server:I}`` (a backup's ``--replica-of``) starts once server I reported,
    with its endpoint there; ``replica_sets`` then keeps every server (see :class:`ReplicaSets`)."""
    servers: list[Proc] = [None] * len(argvs)  # type: ignore[list-item]
    later = [i for i, argv in enumerate(argvs) if any(SERVER_REF.search(x) for x in argv)]
    for wave in ([i for i in range(len(argvs)) if i not in later], later):  # backups once their primaries listen
        for i in wave:
            argv = [SERVER_REF.sub(lambda m: servers[int(m[1])].endpoint or "", x) for x in argvs[i]]
            cmd = [*(prefix(i) if prefix else ()), sys.executable, "-m", "servers", *argv]
            p = spawn(f"server {i}", cmd, env, logs / f"server{i}.log" if logs else None, forward="stderr",
                      report_endpoint=True, console=console, starter=starter)
            procs.append(p)
            servers[i] = p
            if replica_sets is not None:
                replica_sets.add(p, argv, cmd[:len(cmd) - len(argv)])
        await_endpoints([servers[i] for i in wave], timeout)
    return with_endpoints(template, [bind_of(a) for a in argvs], [p.endpoint or "" for p in servers])


SERVER_REF = re.compile(r"\{server:(\d+)\}")  # in a planned server's argv: server I's reported endpoint


class ReplicaSets:
    """The servers of a replicated plan (``ps://?replicas=2``; docs/ps.md): a shard lives while one of its
    servers does. One that exits is replaced by a new backup of a live one (``--replica-of``), which takes
    its state and follows it; a shard with no server left ends the job."""

    def __init__(self, env: Mapping[str, str], logs: Path | None, procs: list[Proc], say: Callable[[str], None],
                 console: IO[str] | None = None, starter: Starter | None = None):
        self.env, self.logs, self.procs, self.say = env, logs, procs, say
        self.console, self.starter = console, starter
        self.shards: dict[str, list[tuple[Proc, list[str], list[str]]]] = {}  # --shard I/K -> (proc, argv, prefix)
        self.made = 0
        self.replaced: set[int] = set()
        self.first: list[Proc] = []  # the servers start_servers started (the URL names their endpoints)
        self.successor: dict[int, Proc] = {}  # id(a server that exited) -> the backup started in its place

    def add(self, proc: Proc, argv: list[str], prefix: list[str]) -> None:
        shard = argv[argv.index("--shard") + 1] if "--shard" in argv else "0/1"
        self.shards.setdefault(shard, []).append((proc, argv, prefix))
        self.first.append(proc)

    def current(self, url: str) -> str:
        """``url`` with each server that exited replaced by the live one started in its place: a worker started
        now (a replacement, a spare handed a rank) must find its shard's servers from its URL alone, and after
        two deaths neither server the job's URL names may be alive. A successor that has not reported its
        endpoint yet leaves the old one (the worker fails over to the shard's other server)."""
        for p in self.first:
            q = p
            while id(q) in self.successor:
                q = self.successor[id(q)]
            if q is not p and p.endpoint and q.endpoint:
                url = swap_endpoint(url, p.endpoint, q.endpoint)
        return url

    def watched(self) -> set[int]:
        """ids of the Procs this supervises or replaced (the job's watch leaves them to :meth:`check`)."""
        return self.replaced | {id(p) for members in self.shards.values() for p, _, _ in members}

    def check(self) -> None:
        """Replace each server that exited by a new backup of a live one; JobFailed for a shard left with none."""
        for shard, members in self.shards.items():
            live = [m for m in members if m[0].popen.poll() is None]
            if len(live) == len(members):
                continue
            anchor = next((m for m in live if m[0].endpoint), None)
            if anchor is None:
                dead = members[0][0]
                dead.drain()
                raise JobFailed(f"every server of shard {shard} exited ({dead.name}: "
                                f"{_how(dead.popen.returncode)})" + _tail_text(dead), 1)
            for gone in [m for m in members if m not in live]:
                members.remove(gone)
                proc, argv, prefix = gone
                self.replaced.add(id(proc))
                self.made += 1
                argv = list(argv)
                bind = bind_of(argv)
                argv[argv.index("--bind") + 1] = bind + f".r{self.made}" if bind.startswith("ipc://") else bind
                if "--replica-of" in argv:
                    argv[argv.index("--replica-of") + 1] = anchor[0].endpoint or ""
                else:
                    argv += ["--replica-of", anchor[0].endpoint or ""]
                name = f"{proc.name.split(' (')[0]} (backup {self.made})"
                self.say(f"{proc.name} of shard {shard} exited ({_how(proc.popen.returncode)}); {anchor[0].name} "
                         f"serves it; starting a new backup of it")
                new = spawn(name, [*prefix, *argv], self.env,
                            self.logs / f"server-backup{self.made}.log" if self.logs else None, forward="stderr",
                            report_endpoint=True, console=self.console, starter=self.starter)
                self.procs.append(new)
                members.append((new, argv, prefix))
                self.successor[id(proc)] = new


def start_store(addr: str, prefix: Sequence[str], env: Mapping[str, str], log: Path | None, timeout: float,
                procs: list[Proc], console: IO[str] | None = None, starter: Starter | None = None) -> int:
    """Host the rendezvous store in a process of its own (``python -m commlab.transport.store``) started with
    ``prefix`` (``ip netns exec NS``), bound to ``addr`` and port 0; return the port it reports.

    For ranks that cannot reach this process's own store (:func:`commlab.transport.store.host`): ranks in
    other network namespaces. The process is appended to ``procs`` at once (the caller stops it);
    ``timeout`` bounds its start-up and each of its waits. Blocks until it reported; raises
    JobFailed if it exits or does not report within ``timeout``. ``console``, ``starter``: see :func:`spawn`.
    """
    p = spawn("store", [*prefix, sys.executable, "-m", "commlab.transport.store", "--bind", addr, "--timeout", f"{timeout:g}"],
              env, log, forward="stderr", report_endpoint=True, console=console, starter=starter)
    procs.append(p)
    endpoint = await_endpoints([p], timeout)[0]
    return int(endpoint.rsplit(":", 1)[1])


def _tail_text(p: Proc) -> str:
    if p.forwarded:
        return ""
    text = p.tail()
    return f"; the last lines of its log:\n{text}" if text.strip() else ""


# ----- the job ------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Job:
    """Everything :func:`run_job` needs: what each rank runs, how many, with which exchanger."""

    command: tuple[str, ...]  # after the interpreter: ("-m", "workers") or ("path/train.py",)
    args: tuple[str, ...] = ()
    workers: int = 1
    exchanger: str = "local://"
    url_flag: str | None = None  # also pass the workers' URL as this flag (besides $COMMLAB_EXCHANGER)
    rank_args: Callable[[int], Sequence[str]] | None = None  # extra arguments of rank r
    env: Mapping[str, str] | None = None  # base environment (default: this process's)
    deadline_s: float | None = None  # the whole job, from start; None: no limit
    start_timeout_s: float = 60.0  # servers reporting their endpoints
    log_dir: str | None = None  # keep per-process logs here (default: a scratch folder, removed)
    metrics: str | None = None  # $COMMLAB_METRICS for the ranks (default: in the scratch folder)
    master_addr: str = "127.0.0.1"
    # Ranks and servers elsewhere (network namespaces): prefix(i) goes before rank or server i's command
    # line (ip netns exec NS); with rank_prefix the store is hosted by a process started with
    # rank_prefix(0), at master_addr, port 0 (start_store). place_servers(template, argvs) rewrites the
    # plan before its servers start (binds on their namespace's address); each bind it puts in an argv
    # must appear in the template it returns, in server order (with_endpoints).
    rank_prefix: Callable[[int], list[str]] | None = None
    server_prefix: Callable[[int], list[str]] | None = None
    place_servers: Callable[[str, list[list[str]]], tuple[str, list[list[str]]]] | None = None
    name: str = "commlab run"  # how the launcher's own lines start
    summary: bool = True
    poll_s: float = 0.05
    max_restarts: int = 0  # torchrun's --max-restarts: a failed rank restarts every rank, servers kept
    # keep-going (docs/faults.md): a rank killed by a signal is started again alone while the others train on
    # (replace), or handed to one of `spares` idle processes started up front (commlab/launch/spare.py)
    replace: bool = False
    spares: int = 0
    # a text file: rank 0's and the servers' output and the launcher's own lines go here instead of this
    # process's stdout and stderr (the benchmark runs jobs in its own process and keeps its terminal)
    console: IO[str] | None = None
    starter: Starter | None = None  # how every process of the job starts (start_group; default: plain_start)
    # one Prometheus endpoint for the job (commlab.launch.exporter): the ranks' reports and the servers' stats
    metrics_port: int | None = None
    metrics_addr: str = "127.0.0.1"
    metrics_insecure: bool = False  # an address off loopback serves unauthenticated HTTP: only when told
    trace: str | None = None  # $COMMLAB_TRACE: every rank and server writes its timeline here, merged at the end
    trace_torch: str | None = None  # $COMMLAB_TRACE_TORCH: the steps whose torch.profiler trace goes in too

    def describe(self) -> str:
        return " ".join(self.command).removeprefix("-m ")

    def say(self, line: str, *, stdout: bool = False) -> None:
        """One line of the launcher's own, ``NAME: line``, to the console (default: stderr; ``stdout``:
        stdout)."""
        print(f"{self.name}: {line}", file=self.console or (sys.stdout if stdout else sys.stderr), flush=True)


class Terminated(Exception):
    """SIGTERM reached the launcher (raised by its handler, so the ``finally`` that stops the job runs)."""


def _terminated(signum, frame):
    signal.signal(signal.SIGTERM, signal.SIG_IGN)  # a second SIGTERM must not cut the clean-up short
    raise Terminated()


def run_job(job: Job) -> int:
    """Run ``job``; return 0, or non-zero after naming what failed first. Leaves nothing running.

    Blocks until every rank has exited, a process failed, the deadline passed, or Ctrl-C/SIGTERM
    (130/143). Call from the main thread to have SIGTERM handled.
    """
    try:  # before anything starts; the URL was checked by whoever built the job
        check_number("--workers", job.workers, ge=1, le=MAX_LOCAL_RANKS, why="ranks this host starts")
        check_number("--max-restarts", job.max_restarts, ge=0)
        check_number("--spares", job.spares, ge=0, le=MAX_LOCAL_RANKS, why="idle ranks this host starts")
        if job.deadline_s is not None:
            check_number("--deadline", job.deadline_s, gt=0)
        if job.metrics_port is not None:
            check_number("--metrics-port", job.metrics_port, ge=0, le=65535)
            exporter.check_bind(job.metrics_addr, job.metrics_insecure)
            exporter.require()
            if job.server_prefix is not None:
                raise ConfigError("--metrics-port: the launcher reads its servers' metrics on loopback; it cannot "
                                  "with servers in other network namespaces")
        if job.trace_torch is not None and not job.trace:
            raise ConfigError("--trace-torch needs --trace DIR (where the timeline goes)")
        if job.trace_torch is not None:
            trace.torch_steps({trace.TORCH_ENV: job.trace_torch})
        problem = trace.folder_problem(job.trace) if job.trace else None
        if problem:
            raise ConfigError(f"--trace: {problem}")
    except ValueError as exc:  # ConfigError, and --trace-torch that is not STEP or FIRST-LAST
        job.say(str(exc) if isinstance(exc, ConfigError) else f"--trace-torch {job.trace_torch!r}: give a step "
                f"or FIRST-LAST ({exc})")
        return 2
    # SIGTERM's default action ends the launcher at once; turned into an exception it unwinds like
    # Ctrl-C. (Signal handlers live in the main thread only.)
    installed = threading.current_thread() is threading.main_thread()
    previous = signal.signal(signal.SIGTERM, _terminated) if installed else None
    try:
        return _run(job)
    except JobFailed as exc:
        job.say(str(exc))
        return exc.code
    except ConfigError as exc:
        job.say(str(exc))
        return 2
    except KeyboardInterrupt:
        job.say("interrupted; stopped every process")
        return 130
    except Terminated:
        job.say("terminated (SIGTERM); stopped every process")
        return 128 + signal.SIGTERM
    finally:
        if installed:  # None: a handler set outside Python, which Python cannot put back
            signal.signal(signal.SIGTERM, signal.SIG_DFL if previous is None else previous)


def _run(job: Job) -> int:
    started = time.monotonic()
    procs: list[Proc] = []
    with contextlib.ExitStack() as stack:
        scratch_dirs.sweep_stale()  # folders of launchers and ranks killed before they could remove them
        scratch = Path(stack.enter_context(scratch_dirs.folder("job")))
        logs = Path(job.log_dir) if job.log_dir else scratch
        logs.mkdir(parents=True, exist_ok=True)
        metrics_base = job.metrics or str(scratch / "metrics.jsonl")
        for r in range(job.workers):  # this run's lines only
            metrics.metrics_path(metrics_base, r).unlink(missing_ok=True)
        template, server_argvs = stack.enter_context(server_plan(job.exchanger, job.workers))
        base = dict(os.environ if job.env is None else job.env)
        base.update(WORLD_SIZE=str(job.workers), LOCAL_WORLD_SIZE=str(job.workers), MASTER_ADDR=job.master_addr,
                    PYTHONUNBUFFERED="1")
        base[metrics.ENV] = metrics_base
        if job.trace:  # every rank and server writes DIR/<process>.json; merged into DIR/trace.json at the end
            base[trace.ENV] = os.path.abspath(job.trace)
            for old in Path(job.trace).glob("*.json"):  # this run's files only
                old.unlink(missing_ok=True)
            if job.trace_torch:
                base[trace.TORCH_ENV] = job.trace_torch
        if job.place_servers is not None:
            template, server_argvs = job.place_servers(template, server_argvs)
        collector: exporter.JobCollector | None = None
        ranks_now: list[Proc] = []  # the attempt's rank processes (the metrics endpoint reads it)
        if job.metrics_port is not None:  # bound before anything starts: a taken port costs no process
            collector = exporter.JobCollector(metrics_base, job.workers, up=lambda: _ranks_up(ranks_now))
            endpoint = exporter.serve(collector, job.metrics_addr, job.metrics_port)
            stack.callback(endpoint.close)
            job.say(f"metrics on {endpoint.url}")
            server_argvs = [[*argv, "--metrics-port", "0"] for argv in server_argvs]  # on loopback: read from here
        if auth.load(base) is None:  # the job's secret, for its ranks and servers only (none given: a fresh one)
            base[auth.SECRET_FILE_ENV] = auth.create_file(str(scratch))
        base[AGENT_STORE] = "True"  # every rank is a client of a store already bound
        base[MAX_RESTARTS] = str(job.max_restarts)
        if job.replace or job.spares:
            base[KEEP_GOING] = "1"  # the regimes keep going when a peer dies (ps://: min_workers=1 by default)
        healed: list[str] = []  # per replacement: which rank, how it died, how long healing took
        failures: list[str] = []  # per restart: which rank failed, how
        replicas = None
        if any(SERVER_REF.search(x) for argv in server_argvs for x in argv):  # ps://?replicas=2: kept alive
            replicas = ReplicaSets(base, logs, procs, job.say, job.console, job.starter)
        try:
            url = start_servers(template, server_argvs, base, logs, job.start_timeout_s, procs, job.server_prefix,
                                job.console, job.starter, replicas)
            base[ENV_URL] = url
            if collector is not None:
                collector.server_urls = [p.metrics_url for p in procs if p.metrics_url]
            for attempt in range(job.max_restarts + 1):
                if collector is not None:
                    collector.restarts = attempt
                try:
                    _attempt(job, dict(base, **{RESTART_COUNT: str(attempt)}), url, logs, procs, started,
                             restarts_left=job.max_restarts - attempt, healed=healed, replicas=replicas,
                             ranks_now=ranks_now)
                    break
                except RankFailed as exc:
                    failures.append(f"{exc.rank} ({exc.how})")
                    job.say(f"{exc.rank} failed ({exc.how}); restarting every rank (restart {attempt + 1} of "
                            f"{job.max_restarts})" + exc.tail)
        except JobFailed as exc:
            if failures:
                exc.args = (f"{exc.args[0]} (after {_restarts(failures)})",)
            raise
        finally:
            stop_all(procs)
            shm.sweep_stale()  # shared-memory segments of a process of this run that was killed (kill -9)
            if job.trace:
                merged = trace.merge(job.trace)
                job.say(f"timeline in {merged} (open it in https://ui.perfetto.dev; 'commlab trace summarize "
                        f"{merged}')" if merged else f"--trace {job.trace}: no process wrote a timeline")
        if job.summary:
            record = metrics.last_record(metrics.metrics_path(metrics_base, 0))
            job.say(f"{job.workers} rank{'s' if job.workers > 1 else ''} of {job.describe()}, {job.exchanger}: "
                    + metrics.summary(record, time.monotonic() - started)
                    + (f"; {_restarts(failures)}" if job.max_restarts else "")
                    + (f"; {len(healed)} replaced" + (f" ({'; '.join(healed)})" if healed else "")
                       if job.replace or job.spares else ""),
                    stdout=True)
    return 0


def _ranks_up(ranks: list[Proc]) -> dict[int, bool]:
    """rank -> whether its process (of the attempt under way) runs: the metrics endpoint's ``commlab_rank_up``."""
    return {r: p.popen.poll() is None for r, p in enumerate(list(ranks))}


def _restarts(failures: list[str]) -> str:
    """``'1 restart (failed: rank 1 (signal SIGKILL))'``: how many, and which rank failed before each."""
    if not failures:
        return "0 restarts"
    return f"{len(failures)} restart{'s' if len(failures) > 1 else ''} (failed: {'; '.join(failures)})"


class RankFailed(JobFailed):
    """A rank failed and the job may restart: the ranks are stopped, the servers still run."""

    def __init__(self, code: int, rank: str, how: str, tail: str):
        super().__init__(f"{rank} failed ({how})", code)
        self.rank, self.how, self.tail = rank, how, tail


def _attempt(job: Job, env: dict, url: str, logs: Path, procs: list[Proc], started: float,
             restarts_left: int, healed: list[str] | None = None, replicas: ReplicaSets | None = None,
             ranks_now: list[Proc] | None = None) -> None:
    """One attempt: a fresh rendezvous store, every rank, watched. Returns once every rank exited 0;
    raises RankFailed (ranks and store stopped, servers left running) when a rank failed and
    ``restarts_left`` > 0, else JobFailed (see :func:`_watch`). With ``job.replace`` or spares, a rank
    killed by a signal is replaced alone (:class:`Replacer`; ``healed`` gets a line per replacement).
    ``ranks_now`` gets the attempt's ranks as they start (the metrics endpoint reads it)."""
    attempt: list[Proc] = []  # this attempt's store process (if any) and ranks
    store = None
    try:
        if job.rank_prefix is None:
            store = store_mod.host(job.master_addr, job.start_timeout_s)  # served while the attempt runs
            env["MASTER_PORT"] = str(store.port)
        else:  # ranks in other namespaces: the store runs where rank 0 runs
            env["MASTER_PORT"] = str(start_store(job.master_addr, job.rank_prefix(0), env, logs / "store.log",
                                                 job.start_timeout_s, attempt, job.console, job.starter))
        ranks = ranks_now if ranks_now is not None else []
        ranks.clear()
        for r in range(job.workers):
            ranks.append(spawn(f"rank {r}", rank_argv(job, url, r), dict(env, RANK=str(r), LOCAL_RANK=str(r)),
                               logs / f"rank{r}.log", forward="both" if r == 0 else None, console=job.console,
                               starter=job.starter))
            attempt.append(ranks[-1])
        replacer = Replacer(job, env, url, logs, attempt, healed if healed is not None else [], replicas) \
            if job.replace or job.spares else None
        _watch(job, [*procs, *attempt], ranks, started, restartable=restarts_left > 0, replacer=replacer,
               replicas=replicas)
    except RankFailed:
        stop_all(attempt)
        shm.sweep_stale()  # what the killed rank left in /dev/shm
        raise
    finally:
        procs.extend(p for p in attempt if p.popen.poll() is None)  # stopped with the job otherwise
        del store  # the attempt's store closes with it: the next attempt's is fresh


def rank_argv(job: Job, url: str, r: int | None) -> list[str]:
    """Rank ``r``'s command line, after ``job.rank_prefix``'s (ip netns exec NS); ``r`` None: what every rank
    runs, without a rank's own arguments and prefix (a spare's, which learns its rank later)."""
    argv = [sys.executable, *job.command, *job.args]
    if job.url_flag:
        argv += [job.url_flag, url]
    if r is not None and job.rank_args:
        argv += list(job.rank_args(r))
    if r is not None and job.rank_prefix:
        argv = [*job.rank_prefix(r), *argv]
    return argv


class Replacer:
    """Keep-going's side of the launcher: a rank that died of a signal gets a new process of its own while the
    others train on (:meth:`replace`); no other process is touched. With ``job.spares`` S, S idle processes
    (``python -m commlab.launch.spare``: the interpreter, torch and commlab loaded, waiting for a rank) start
    with the ranks and are handed the dead ranks first, each replaced by a new idle one as it is handed out (so S
    stay ready; one that exits while idle is not replaced); a fresh start takes over when none is left.

    The process gets the rank's environment plus ``$COMMLAB_REPLACEMENT`` (when the death was noticed,
    :func:`commlab.transport.rendezvous.replacement_since`): the regime then enters it at the next step
    boundary (ps://: :meth:`commlab.regimes.ps.PSExchanger._enter`), and says when it did in its log
    (:func:`commlab.transport.rendezvous.announce_entry`), which :meth:`report` reads.
    A rank that exits with an error is no failure of its process: the job fails as without replacement."""

    def __init__(self, job: Job, env: dict, url: str, logs: Path, attempt: list[Proc], healed: list[str],
                 replicas: "ReplicaSets | None" = None):
        self.job, self.env, self.url, self.logs, self.attempt, self.healed = job, env, url, logs, attempt, healed
        self.replicas = replicas  # replicated servers: a replacement gets the URL of the servers alive now
        self.count = 0
        self.spares: list[tuple[Proc, Path]] = []
        self.done: list[tuple[str, str, Proc]] = []  # (rank name, how it died, its replacement)
        self.started = 0  # spares started so far (their logs' and assignment files' numbers)
        for _ in range(job.spares):
            self._start_spare()

    def _start_spare(self) -> Proc:
        job, i = self.job, self.started
        self.started += 1
        assign = self.logs / f"spare{i}.assign"
        assign.unlink(missing_ok=True)
        argv = [sys.executable, "-m", "commlab.launch.spare", str(assign), *rank_argv(job, self.url, None)[1:]]
        if job.rank_prefix:
            argv = [*job.rank_prefix(0), *argv]
        p = spawn(f"spare {i}", argv, {k: v for k, v in self.env.items() if k not in ("RANK", "LOCAL_RANK")},
                  self.logs / f"spare{i}.log", console=job.console, starter=job.starter)
        self.attempt.append(p)
        self.spares.append((p, assign))
        return p

    def replace(self, dead: Proc) -> Proc:
        """A process in ``dead``'s place, started or handed over now; the line the launcher says."""
        r = int(dead.name.split()[-1])
        since = time.time()
        self.count += 1
        url = self.replicas.current(self.url) if self.replicas is not None else self.url
        env = dict(self.env, RANK=str(r), LOCAL_RANK=str(r), **{REPLACEMENT: f"{since:.6f}", ENV_URL: url})
        extra = list(self.job.rank_args(r)) if self.job.rank_args else []
        while self.spares:
            p, assign = self.spares.pop(0)
            if p.popen.poll() is not None:
                continue
            tmp = assign.with_suffix(".tmp")
            tmp.write_text(json.dumps({"rank": r, "since": since, "args": extra, "url": url}))
            os.replace(tmp, assign)
            p.name = dead.name
            how = f"spare (pid {p.popen.pid}; {self._start_spare().name} starts in its place)"
            break
        else:
            p = spawn(dead.name, rank_argv(self.job, url, r), env,
                      self.logs / f"rank{r}.replacement{self.count}.log", forward="both" if r == 0 else None,
                      console=self.job.console, starter=self.job.starter)
            self.attempt.append(p)
            how = f"new process (pid {p.popen.pid})"
        self.done.append((dead.name, _how(dead.popen.returncode), p))
        self.job.say(f"{dead.name} died ({_how(dead.popen.returncode)}); replaced by a {how} while the others "
                     f"train on")
        return p

    def idle(self, p: Proc) -> bool:
        """``p`` is a spare no rank was handed to yet."""
        return any(p is q for q, _ in self.spares)

    def drop_spare(self, p: Proc) -> None:
        """An idle spare exited (killed, too): it leaves the pool; the job goes on."""
        self.spares = [(q, a) for q, a in self.spares if q is not p]
        p.drain()
        self.job.say(f"{p.name} exited while idle ({_how(p.popen.returncode)}); {len(self.spares)} spare(s) left")

    def waiting(self, p: Proc) -> bool:
        """``p`` replaces a dead rank and has not entered the job yet (its log does not say so)."""
        return any(p is q for _, _, q in self.done) and p.popen.poll() is None and not ENTERED.search(p.tail(200))

    def report(self) -> None:
        """Each replacement's line for the summary: which rank, how it died, when it entered."""
        for name, how, p in self.done:
            m = ENTERED.search(p.tail(200)) if p.log is not None else None
            when = "; never entered" if m is None else f"; entered at step {m.group(1)}" + (
                f", healed {float(m.group(2)):.2f} s after the death" if m.group(2) else "")
            self.healed.append(f"{name} ({how}{when})")


def _watch(job: Job, procs: list[Proc], ranks: list[Proc], started: float, restartable: bool = False,
           replacer: Replacer | None = None, replicas: ReplicaSets | None = None) -> None:
    """Return when every rank exited 0. At the first failure: a rank killed by a signal, with a ``replacer``,
    is replaced alone; a rank, with ``restartable``, raises RankFailed and stops nothing (the caller stops the
    ranks); anything else stops every process and raises JobFailed; so does the deadline. ``replicas``:
    replicated servers, which it keeps (a shard's server that exits is replaced while another serves)."""
    try:
        _watch_loop(job, procs, ranks, started, restartable, replacer, replicas)
    finally:
        if replacer is not None:
            replacer.report()


def _watch_loop(job: Job, procs: list[Proc], ranks: list[Proc], started: float, restartable: bool,
                replacer: Replacer | None, replicas: ReplicaSets | None) -> None:
    while True:
        kept = set()
        if replicas is not None:
            try:
                replicas.check()
            except JobFailed:
                stop_all(replicas.procs)
                raise
            kept = replicas.watched()
        for p in list(procs):
            if id(p) in kept:
                continue
            code = p.popen.poll()
            if replacer is not None and code is not None and replacer.idle(p):
                replacer.drop_spare(p)
                procs.remove(p)
                continue
            if replacer is not None and p in ranks and code is not None and code < 0:
                p.drain()
                new = replacer.replace(p)
                ranks[ranks.index(p)] = new
                if new in procs:  # a spare, watched already
                    procs.remove(p)
                else:
                    procs[procs.index(p)] = new
                continue
            if code not in (None, 0) or (code == 0 and p not in ranks):
                if restartable and p in ranks:
                    p.drain()
                    raise RankFailed(code if code > 0 else 1, p.name, _how(code), _tail_text(p))
                stop_all([q for q in procs if q is not p])
                p.drain()
                raise JobFailed(f"{p.name} failed first ({_how(code)}); stopped the others" + _tail_text(p),
                                code if code > 0 else 1)
        if all(p.popen.poll() == 0 for p in ranks):
            return
        others = [p for p in ranks if replacer is None or not replacer.waiting(p)]
        # (every rank a replacement that has not entered, none finished: no one has ended the job; they enter from
        # the servers or fail naming what they waited for, never a silent rc 0)
        late = [p for p in ranks if p not in others] if others and all(p.popen.poll() == 0 for p in others) else []
        if late:  # every other rank finished before the replacements could enter: nothing left to join
            stop_all(late, grace=0)
            job.say(f"{', '.join(p.name for p in late)}: the replacement was stopped before it entered (every "
                    f"other rank had finished)")
            return
        if job.deadline_s is not None and time.monotonic() - started > job.deadline_s:
            running = [p.name for p in ranks if p.popen.poll() is None]
            stop_all(procs)
            raise JobFailed(f"passed its deadline of {job.deadline_s:g}s with {', '.join(running)} still "
                            f"running; stopped every process", 124)
        time.sleep(job.poll_s)


def worker_job(url: str, workers: int, worker_args: Sequence[str], *, module: str = "workers",
               quiet_ranks: bool = True, name: str = "commlab train", **fields) -> Job:
    """The :class:`Job` of ``python -m MODULE --exchanger URL WORKER_ARGS`` as ``workers`` ranks.

    ``quiet_ranks`` adds ``--no-progress`` to every rank but 0; ``fields`` are the Job's others
    (``env``, ``deadline_s``, ``rank_prefix``, ...).
    """
    return Job(("-m", module), tuple(worker_args), workers, url, url_flag="--exchanger",
               rank_args=(lambda r: ["--no-progress"] if r > 0 else []) if quiet_ranks else None, name=name, **fields)


def launch(url: str, workers: int, worker_args: list[str], *, env: dict | None = None, module: str = "workers",
           deadline_s: float | None = None, log_dir: str | None = None, metrics_path: str | None = None,
           name: str = "commlab train", max_restarts: int = 0, **fields) -> int:
    """Run :func:`worker_job` on this host (:func:`run_job`): ``commlab train``. ``fields``: the Job's others
    (``metrics_port``, ...)."""
    return run_job(worker_job(url, workers, worker_args, module=module, name=name, env=env, deadline_s=deadline_s,
                              log_dir=log_dir, metrics=metrics_path, max_restarts=max_restarts, **fields))
