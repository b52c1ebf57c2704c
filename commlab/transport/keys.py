"""``commlab keys DIR``: CURVE key pairs for servers and the workers allowed to reach them.

Layout (one folder, handed whole to the server side and, without
``server.key_secret``, to the workers)::

    DIR/server.key            server public key      (workers need it)
    DIR/server.key_secret     server key pair        (server only; mode 0600)
    DIR/clients/NAME.key      authorised client public keys: the server admits exactly these
    DIR/NAME.key_secret       client key pair        (that worker only; mode 0600)

A server started with ``--keys DIR`` encrypts and authenticates every
connection and refuses clients whose public key is not in ``DIR/clients``.
Workers pass ``?keys=DIR`` (and ``&key_name=NAME``) in their exchanger URL.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
from pathlib import Path

from commlab.base.errors import ConfigError
from commlab.transport.sockets import CurveKeys


def _check_client_names(clients: list[str]) -> None:
    """Raise ``ConfigError`` naming the first client name that cannot be a key file in the layout above."""
    seen = set()
    for name in clients:
        # 'server' would overwrite the server's own pair, '/' would write outside the folder, and NUL
        # fails only in open(), after the pairs before it were written
        if not name or "/" in name or "\0" in name or name in ("server", "clients"):
            raise ConfigError(f"bad client key name {name!r}: it must be non-empty, hold no '/' or NUL, "
                              f"and not be 'server' or 'clients'")
        if name in seen:
            raise ConfigError(f"client key name {name!r} given twice")
        seen.add(name)


def create(directory: str | os.PathLike, clients: list[str]) -> Path:
    """Create the server pair and one pair per client name; refuses to overwrite.

    Every check comes before the first write: a refused call leaves ``directory`` as it was.
    """
    import zmq.auth

    d = Path(directory)
    _check_client_names(clients)
    if (d / "server.key_secret").exists():
        raise ConfigError(f"{d} already holds keys; remove it or choose another folder")
    (d / "clients").mkdir(parents=True, exist_ok=True)
    for name in ["server", *clients]:
        public, secret = zmq.auth.create_certificates(d, name)
        os.chmod(secret, 0o600)
        if name != "server":
            shutil.move(public, d / "clients" / Path(public).name)
    return d


def server_keys(directory: str | os.PathLike) -> tuple[CurveKeys, Path]:
    d = Path(directory)
    secret, clients = d / "server.key_secret", d / "clients"
    if not secret.exists() or not clients.is_dir():
        raise ConfigError(f"{d} has no server.key_secret or clients/: create it with 'commlab keys {d}'")
    return CurveKeys.load(secret), clients


def client_keys(directory: str | os.PathLike, name: str = "worker") -> CurveKeys:
    d = Path(directory)
    secret, server = d / f"{name}.key_secret", d / "server.key"
    if not secret.exists() or not server.exists():
        raise ConfigError(f"{d} has no {name}.key_secret or server.key: create it with 'commlab keys {d} --client {name}'")
    return CurveKeys.load(secret, server)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="commlab keys", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("directory")
    p.add_argument("--client", action="append", default=None, help="client key name (repeatable; default: worker)")
    a = p.parse_args(argv)
    try:
        d = create(a.directory, a.client or ["worker"])
    except ConfigError as exc:
        print(f"commlab keys: {exc}", file=sys.stderr)
        return 2
    print(f"server key pair: {d / 'server.key_secret'} (keep it on the server)")
    for name in a.client or ["worker"]:
        print(f"client '{name}': {d / (name + '.key_secret')}, authorised in {d / 'clients'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
