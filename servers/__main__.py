"""``python -m servers --bind tcp://127.0.0.1:PORT --mode sync|async|ssp [--staleness S] [--shard I/K]``."""

from __future__ import annotations

import argparse
import sys

from commlab.transport import auth, psproto
from commlab.base.errors import CommError, ConfigError
from commlab.launch import exporter


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="commlab server", description="Run one parameter-server shard.")
    p.add_argument("--bind", default="tcp://127.0.0.1:0",
                   help="zmq endpoint (port 0: any free port; the bound endpoint is printed on stdout)")
    p.add_argument("--mode", default="sync", choices=psproto.MODES)
    p.add_argument("--staleness", type=int, default=2, help="ssp: how many steps a worker may run ahead")
    p.add_argument("--shard", default="0/1", help="I/K: this server holds shard I of K")
    p.add_argument("--checkpoint-dir", help="write the shard here (atomically) every N updates and on SIGTERM")
    p.add_argument("--checkpoint-every", type=int, default=0, help="updates between checkpoints (0: on stop only)")
    p.add_argument("--resume", help="continue from the checkpoint in this folder (and keep writing there)")
    p.add_argument("--log-every", type=float, default=10.0, help="seconds between stats lines on stderr (0: off)")
    p.add_argument("--io-threads", type=int, default=2, help="zmq I/O threads")
    p.add_argument("--threads", type=int, default=1, help="torch intra-op threads for the optimizer")
    p.add_argument("--keys", help="folder made by 'commlab keys': CURVE with DIR/server.key_secret, admitting "
                                  "exactly the clients in DIR/clients (needed to bind a non-loopback address)")
    p.add_argument("--insecure", action="store_true", help="allow binding a non-loopback address without CURVE")
    p.add_argument("--curve-secret", help="this server's CURVE secret key file (commlab keys)")
    p.add_argument("--authorized", help="folder of authorised client public keys (with --curve-secret)")
    p.add_argument("--secret-file", help="the job's secret (a 0600 file): serve only processes that prove it "
                                         "(default: $COMMLAB_JOB_SECRET_FILE or $COMMLAB_JOB_SECRET, which "
                                         "commlab run/train set for the servers they start; none: anyone, "
                                         "with a warning)")
    p.add_argument("--replica-of", metavar="ENDPOINT",
                   help="run as the backup of the shard server at ENDPOINT (same --mode, --shard, --staleness): "
                        "take its state, then every request it serves; serve its workers once it is gone "
                        "(ps://?replicas=2, docs/ps.md). With --keys, the link uses DIR/replica.key_secret")
    p.add_argument("--replica-log", type=float, default=4.0, metavar="R",
                   help="as a primary: its backup logs the requests it streams instead of applying each, and gets a "
                        "fresh copy of the shard's state once the log holds R times the state's bytes; a failover "
                        "applies the log (at most about R x the state) first. 0: the backup applies every request "
                        "as it arrives (its CPU cost is the primary's). Default 4")
    p.add_argument("--peer-timeout", type=float, default=60.0,
                   help="seconds after which a key space whose connections all closed without bye is freed "
                        "(zmq heartbeats close a dead host's connection within half of it)")
    p.add_argument("--metrics-port", type=int, help="serve Prometheus metrics at http://ADDR:PORT/metrics (0: any free "
                                                    "port, printed on stdout; needs commlab[metrics]; default: off)")
    p.add_argument("--metrics-addr", default=exporter.DEFAULT_ADDR, help="the address the metrics endpoint binds")
    p.add_argument("--metrics-insecure", action="store_true",
                   help="allow the metrics endpoint (plain, unauthenticated HTTP) on an address off loopback")
    return p


def main(argv: list[str] | None = None) -> int:
    a = parser().parse_args(argv)
    import torch

    from servers.server import ServerConfig, ShardServer  # torch import after --help

    torch.set_num_threads(a.threads)  # the update is memory-bound; more threads only contend with zmq's

    try:
        i, _, k = a.shard.partition("/")
        shard, shards = int(i), int(k or 1)
    except ValueError:
        print(f"commlab server: --shard {a.shard!r} is not I/K", file=sys.stderr)
        return 2
    try:
        if a.metrics_port is not None:  # before anything binds
            if not 0 <= a.metrics_port < 65536:
                raise ConfigError(f"--metrics-port {a.metrics_port}: a port is in [0, 65536)")
            exporter.check_bind(a.metrics_addr, a.metrics_insecure)
            exporter.require()
        if a.keys:
            if a.curve_secret or a.authorized:
                raise ConfigError("--keys DIR replaces --curve-secret and --authorized: give one or the other")
            from commlab.transport.keys import server_keys
            _, clients = server_keys(a.keys)  # checks the folder; says how to create it
            a.curve_secret, a.authorized = str(clients.parent / "server.key_secret"), str(clients)
        replica_curve = None
        if a.replica_of and a.resume:
            raise ConfigError("--replica-of takes the primary's state: it does not take --resume")
        if a.replica_of:
            from commlab.transport.keys import client_keys
            if a.keys:
                replica_curve = client_keys(a.keys, "replica")
            elif a.curve_secret:
                raise ConfigError("--replica-of with CURVE needs --keys DIR (the backup connects to its primary "
                                  "with the client key DIR/replica.key_secret)")
        secret = auth.load({auth.SECRET_FILE_ENV: a.secret_file} if a.secret_file else None)
        cfg = ServerConfig(a.bind, a.mode, a.staleness, shard, shards, a.checkpoint_dir, a.checkpoint_every,
                           a.resume, a.log_every, a.io_threads, a.insecure, a.curve_secret, a.authorized, secret,
                           a.peer_timeout, a.replica_of, replica_curve, a.replica_log)
        server = ShardServer(cfg)
    except (ValueError, ConfigError, CommError, FileNotFoundError) as exc:
        print(f"commlab server: {exc}", file=sys.stderr)
        return 2
    if a.metrics_port is not None:
        from servers.metrics import ShardCollector, StatsProbe

        probe = server.probe = StatsProbe()
        try:
            endpoint = exporter.serve(ShardCollector(probe, server.COUNTERS), a.metrics_addr, a.metrics_port)
        except ConfigError as exc:
            server.close()
            print(f"commlab server: {exc}", file=sys.stderr)
            return 2
        # before the "listening on" line: a launcher that waits for that one has this one too
        print(f"commlab server {cfg.name} metrics on {endpoint.url}", flush=True)
    try:
        server.serve()
    finally:
        server.close()
    return 0


if __name__ == "__main__":
    # done: sockets closed, checkpoint written, stats logged (commlab.launch.exiting says why and what it keeps)
    from commlab.launch.exiting import exit_now

    exit_now(main())
