"""``commlab``: train, server, bench, keys, doctor.

``train`` runs the local launcher in this process. The other subcommands run
their module as a process of its own (``python -m MODULE``), so the library
never imports the server's or the benchmarks' internals.
"""

from __future__ import annotations

import argparse
import os
import sys

from commlab import launcher
from commlab.config import describe_options
from commlab.errors import ConfigError
from commlab.registry import REGIMES, regime_class

# subcommand -> (module run as ``python -m``, one line of help)
SUBCOMMANDS = {
    "server": ("servers", "run one parameter-server shard"),
    "bench": ("bench", "compare regimes: bandwidth and convergence"),
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
    from workers.loop import add_training_args  # the worker's flags, parsed here only to validate them early

    p = argparse.ArgumentParser(prog="commlab train", description="Train on N local workers.",
                                epilog=regimes_help(), formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--workers", type=int, default=2)
    add_training_args(p)
    a, rest = p.parse_known_args(argv)
    if rest:
        p.error(f"unrecognised arguments: {' '.join(rest)}")
    try:
        from commlab.config import ExchangerURL, parse_options
        parsed = ExchangerURL.parse(a.exchanger)
        cls = regime_class(parsed.scheme)
        if not hasattr(cls, "from_url"):
            parse_options(cls.Options, parsed)
    except ConfigError as exc:
        print(f"commlab train: {exc}", file=sys.stderr)
        return 2
    worker_args = [x for x in argv]
    # drop --workers/--exchanger: the launcher sets them
    for flag in ("--workers", "--exchanger"):
        while flag in worker_args:
            i = worker_args.index(flag)
            del worker_args[i:i + 2]
        worker_args = [x for x in worker_args if not x.startswith(flag + "=")]
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
