"""``commlab``: train, run, server, bench, plan, keys, doctor.

``train`` (the built-in worker) and ``run`` (the user's script) run the local
launcher in this process. The other subcommands run their module as a process
of its own (``python -m MODULE``), so the library never imports the server's or
the benchmarks' internals.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys

from commlab.base.config import describe_options
from commlab.base.errors import ConfigError

# The launcher and the regimes' registry (torch, seconds to import) are imported where they are used: the
# other subcommands replace this process at once (os.execv), and their module imports what it needs itself.

# subcommand -> (module run as ``python -m``, one line of help)
SUBCOMMANDS = {
    "server": ("servers", "run one parameter-server shard"),
    "bench": ("bench", "compare regimes: bandwidth, convergence; cases train-step, ps-rounds, gpu-sweep"),
    "plan": ("commlab.plan", "which regime wins at 8, 512 or 4,096 workers: calibrated cost model + simulator"),
    "keys": ("commlab.transport.keys", "create CURVE key pairs for servers and workers"),
    "trace": ("commlab.tools.tracesum", "a timeline's summary (summarize trace.json) or a merge of its files (merge DIR)"),
    "doctor": ("commlab.tools.doctor", "CUDA, GPUs, NCCL, RDMA here, and which transport NCCL picks (--json)"),
}


def regimes_help() -> str:
    from commlab.core.registry import REGIMES, regime_class
    lines = ["regimes (--exchanger URL):"]
    for scheme in sorted(REGIMES):
        try:
            cls = regime_class(scheme)
        except ImportError as exc:  # a regime whose optional dependency is missing still gets listed
            lines.append(f"  {scheme}://  (unavailable: {exc})")
            continue
        lines.append(f"  {scheme}://  " + (cls.__module__ and (sys.modules[cls.__module__].__doc__ or "").strip().splitlines()[0]))
        lines += [f"      {line}" for line in describe_options(cls.Options)]
    return "\n".join(lines)


def check_url(url: str, option: str = "--exchanger") -> str | None:
    """None if ``url`` names a regime and options it accepts, else one line naming ``option``.

    Checked before anything starts, so a typo costs no process and no traceback.
    """
    from commlab.core.registry import resolve
    try:
        resolve(url)
    except ConfigError as exc:
        return f"{option} {url!r}: {exc}"
    except ImportError as exc:
        return f"{option} {url!r}: the regime cannot be imported here: {exc}"
    return None


def add_job_args(p: argparse.ArgumentParser, default_workers: int) -> None:
    """The launcher's own flags, shared by ``train`` and ``run``."""
    p.add_argument("--workers", type=int, default=default_workers, help="number of ranks")
    p.add_argument("--deadline", type=float, help="seconds the whole job may run before every process is stopped")
    p.add_argument("--log-dir", help="keep each process's output here (rank<r>.log, server<i>.log)")
    p.add_argument("--max-restarts", type=int, default=0,
                   help="as torchrun's: when a rank fails, stop the ranks and start every rank again (the servers "
                        "keep running; TORCHELASTIC_RESTART_COUNT says the attempt), up to this many times")
    p.add_argument("--metrics-port", type=int,
                   help="serve live Prometheus metrics of the ranks (their commlab.report() lines) and the servers at "
                        "http://ADDR:PORT/metrics (0: any free port, printed; needs commlab[metrics]; default: off)")
    p.add_argument("--metrics-addr", default="127.0.0.1", help="the address the metrics endpoint binds")
    p.add_argument("--metrics-insecure", action="store_true",
                   help="allow the metrics endpoint (plain, unauthenticated HTTP) on an address off loopback")
    p.add_argument("--trace", metavar="DIR", help="every rank and server writes its timeline (Chrome trace events) "
                                                  "here; merged into DIR/trace.json at the end (docs/trace.md)")
    p.add_argument("--trace-torch", metavar="STEPS", help="with --trace: torch.profiler's operator trace of these "
                                                          "steps (N or FIRST-LAST, 0-based) in the same timeline")
    p.add_argument("--replace", action="store_true",
                   help="keep going: a rank killed by a signal gets a new process of its own while the others train "
                        "on (ps://: it enters at the next step boundary with the servers' state; docs/faults.md)")
    p.add_argument("--spares", type=int, default=0,
                   help="keep going, as --replace, with this many idle ranks started up front (torch loaded) that "
                        "take over dead ranks first")


def job_fields(a: argparse.Namespace) -> dict:
    """The Job fields of :func:`add_job_args`'s keep-going, timeline and metrics flags."""
    return {"replace": a.replace, "spares": a.spares, "trace": a.trace, "trace_torch": a.trace_torch,
            "metrics_port": a.metrics_port, "metrics_addr": a.metrics_addr, "metrics_insecure": a.metrics_insecure}


def train_main(argv: list[str]) -> int:
    """Parse what the launcher needs; every other flag goes to the workers untouched.

    The library does not import ``workers/`` (dependencies point the other way): the
    worker's own flags are listed by ``python -m workers --help``, appended to our help.
    """
    from commlab.launch import launcher
    p = argparse.ArgumentParser(prog="commlab train", add_help=False,
                                description="Train on N local workers (torchrun's environment, loopback).")
    add_job_args(p, default_workers=2)
    p.add_argument("--exchanger", default="local://", help="regime URL (see below)")
    p.add_argument("--metrics", help="JSON lines per step; rank r > 0 writes PATH.rank<r> (kept)")
    p.add_argument("-h", "--help", action="store_true")
    a, worker_args = p.parse_known_args(argv)
    if a.help:
        p.print_help()
        print("\nworker flags (python -m workers):")
        sys.stdout.flush()
        subprocess.run([sys.executable, "-m", "workers", "--help"], check=False)
        print("\n" + regimes_help())
        return 0
    problem = check_url(a.exchanger)
    if problem:
        print(f"commlab train: {problem}", file=sys.stderr)
        return 2
    return launcher.launch(a.exchanger, a.workers, worker_args, deadline_s=a.deadline, log_dir=a.log_dir,
                           metrics_path=a.metrics, max_restarts=a.max_restarts, **job_fields(a))


def run_main(argv: list[str]) -> int:
    """``commlab run [--workers N] [--exchanger URL] script.py ARGS``: N ranks of the user's script."""
    from commlab.core.registry import ENV_URL
    from commlab.launch import launcher
    p = argparse.ArgumentParser(
        prog="commlab run", description="Run N ranks of a training script on this host, as torchrun would "
        "(RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, MASTER_ADDR, MASTER_PORT), with COMMLAB_EXCHANGER "
        "(read by commlab.connect()) and COMMLAB_METRICS (written by commlab.report()) set, and the servers "
        "the exchanger needs started first.", epilog=regimes_help(),
        formatter_class=argparse.RawDescriptionHelpFormatter)
    add_job_args(p, default_workers=1)
    p.add_argument("--exchanger", default=os.environ.get(ENV_URL, "allreduce://"),
                   help="regime URL (default: $COMMLAB_EXCHANGER, else allreduce://)")
    p.add_argument("--metrics", help="keep the ranks' metrics here (rank r > 0: PATH.rank<r>)")
    p.add_argument("-m", dest="module", help="run this module (python -m MODULE) instead of a script")
    p.add_argument("script", nargs="?", help="the training script each rank runs")
    p.add_argument("args", nargs=argparse.REMAINDER, help="its arguments")
    a = p.parse_args(argv)
    command: tuple[str, ...]
    if a.module:
        command, args = ("-m", a.module), ([a.script] if a.script else []) + a.args
    elif a.script:
        command, args = (a.script,), a.args
    else:
        print("commlab run: give a script (or -m MODULE) to run", file=sys.stderr)
        return 2
    problem = check_url(a.exchanger)
    if problem:
        print(f"commlab run: {problem}", file=sys.stderr)
        return 2
    job = launcher.Job(command, tuple(args), a.workers, a.exchanger, env=None, deadline_s=a.deadline,
                       log_dir=a.log_dir, metrics=a.metrics, name="commlab run", max_restarts=a.max_restarts,
                       **job_fields(a))
    return launcher.run_job(job)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    commands = {"train": "train the built-in worker on N local ranks (the embedded launcher)",
                "run": "run N local ranks of your training script (torchrun's environment + COMMLAB_EXCHANGER)"}
    commands.update({k: v[1] for k, v in SUBCOMMANDS.items()})
    if not argv or argv[0] in ("-h", "--help"):
        print("usage: commlab COMMAND [ARGS]\n\ncommands:")
        for name, text in commands.items():
            print(f"  {name:8} {text}")
        print("\n" + regimes_help())
        return 0 if argv else 2
    cmd, rest = argv[0], argv[1:]
    if cmd == "train":
        return train_main(rest)
    if cmd == "run":
        return run_main(rest)
    if cmd in SUBCOMMANDS:
        module = SUBCOMMANDS[cmd][0]
        os.execv(sys.executable, [sys.executable, "-m", module, *rest])
    print(f"commlab: unknown command {cmd!r}; known: {', '.join(commands)}", file=sys.stderr)
    return 2


def entry() -> None:
    """The ``commlab`` command: :func:`main`, then out without the interpreter's teardown
    (:mod:`commlab.launch.exiting`); an exception leaves the normal way."""
    from commlab.launch.exiting import exit_now

    exit_now(main())


if __name__ == "__main__":
    entry()
