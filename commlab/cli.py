"""``commlab``: train, server, bench, plan, keys, doctor.

``train`` runs the local launcher in this process. The other subcommands run
their module as a process of its own (``python -m MODULE``), so the library
never imports the server's or the benchmarks' internals.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys

from commlab import launcher
from commlab.config import ExchangerURL, describe_options, parse_options
from commlab.errors import ConfigError
from commlab.registry import REGIMES, regime_class

# subcommand -> (module run as ``python -m``, one line of help)
SUBCOMMANDS = {
    "server": ("servers", "run one parameter-server shard"),
    "bench": ("bench", "compare regimes: bandwidth and convergence"),
    "plan": ("commlab.plan", "which regime wins at 8, 512 or 4,096 workers: calibrated cost model + simulator"),
    "keys": ("commlab.keys", "create CURVE key pairs for servers and workers"),
    "doctor": ("commlab.doctor", "CUDA, GPUs, NCCL, RDMA here, and which transport NCCL picks (--json)"),
}


def regimes_help() -> str:
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


def train_main(argv: list[str]) -> int:
    """Parse what the launcher needs; every other flag goes to the workers untouched.

    The library does not import ``workers/`` (dependencies point the other way): the
    worker's own flags are listed by ``python -m workers --help``, appended to our help.
    """
    p = argparse.ArgumentParser(prog="commlab train", add_help=False,
                                description="Train on N local workers (torchrun's environment, loopback).")
    p.add_argument("--workers", type=int, default=2, help="number of worker processes")
    p.add_argument("--exchanger", default="local://", help="regime URL (see below)")
    p.add_argument("-h", "--help", action="store_true")
    a, worker_args = p.parse_known_args(argv)
    if a.help:
        p.print_help()
        print("\nworker flags (python -m workers):")
        sys.stdout.flush()
        subprocess.run([sys.executable, "-m", "workers", "--help"], check=False)
        print("\n" + regimes_help())
        return 0
    try:
        parsed = ExchangerURL.parse(a.exchanger)
        cls = regime_class(parsed.scheme)
        if not hasattr(cls, "from_url"):
            parse_options(cls.Options, parsed)
    except ConfigError as exc:
        print(f"commlab train: {exc}", file=sys.stderr)
        return 2
    return launcher.launch(a.exchanger, a.workers, worker_args)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    commands = {"train": "train on N local workers (the embedded launcher)"}
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
    if cmd in SUBCOMMANDS:
        module = SUBCOMMANDS[cmd][0]
        os.execv(sys.executable, [sys.executable, "-m", module, *rest])
    print(f"commlab: unknown command {cmd!r}; known: {', '.join(commands)}", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
