"""The Secrets the manifests here mount, made fresh:
``python deploy/kubernetes/make_secrets.py --workers 4 | kubectl apply -f -``.

Four Secrets (YAML documents on stdout), so that each pod holds only what it needs:

    commlab-job-secret    secret: the job's secret (32 random bytes, hex); every pod proves it
    commlab-server-keys   server.key, server.key_secret: the shards' CURVE key pair (ps.yaml only)
    commlab-client-keys   w0.key ... : the workers' public keys, the clients the shards admit (ps.yaml)
    commlab-worker-keys   server.key, w0.key_secret ... : what a worker connects with (workers.yaml;
                          rank r uses w<r>, key_name=w$(RANK) in its URL)

The key pairs are made by ``commlab keys`` (:mod:`commlab.transport.keys`) in a temporary folder that is
removed afterwards, or kept in ``--keys DIR`` (which must not exist yet) to reuse them elsewhere.
Nothing is sent anywhere: pipe the output to kubectl, or keep it as a file readable by you alone.
"""

from __future__ import annotations

import argparse
import base64
import json
import os
import sys
import tempfile
from pathlib import Path

from commlab.base.errors import ConfigError
from commlab.transport import keys


def secret(name: str, files: dict[str, bytes]) -> str:
    """One Secret as a YAML document (its strings written as JSON strings, which YAML reads as they are)."""
    data = "".join(f"  {json.dumps(k)}: {json.dumps(base64.b64encode(v).decode())}\n" for k, v in sorted(files.items()))
    return (f"apiVersion: v1\nkind: Secret\nmetadata:\n  name: {name}\n  labels:\n"
            f"    app.kubernetes.io/part-of: commlab\ntype: Opaque\ndata:\n{data}")


def documents(folder: Path, workers: int, job_secret: bytes) -> str:
    """The four Secrets from a ``commlab keys`` folder with client pairs w0 ... w<workers-1>."""
    names = [f"w{r}" for r in range(workers)]
    read = lambda p: (folder / p).read_bytes()
    docs = [secret("commlab-job-secret", {"secret": job_secret}),
            secret("commlab-server-keys", {"server.key": read("server.key"), "server.key_secret": read("server.key_secret")}),
            secret("commlab-client-keys", {f"{n}.key": read(f"clients/{n}.key") for n in names}),
            secret("commlab-worker-keys", {"server.key": read("server.key"),
                                           **{f"{n}.key_secret": read(f"{n}.key_secret") for n in names}})]
    return "---\n".join(docs)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--workers", type=int, default=4, help="ranks (client key pairs w0 ... w<N-1>); workers.yaml has 4")
    p.add_argument("--keys", help="keep the key pairs in this new folder (default: a temporary one, removed)")
    a = p.parse_args(argv)
    if a.workers < 1:
        print("make_secrets.py: --workers must be at least 1", file=sys.stderr)
        return 2
    job_secret = os.urandom(32).hex().encode()
    try:
        if a.keys:
            folder = keys.create(a.keys, [f"w{r}" for r in range(a.workers)])
            out = documents(folder, a.workers, job_secret)
        else:
            with tempfile.TemporaryDirectory(prefix="commlab-keys-") as tmp:
                folder = keys.create(Path(tmp) / "keys", [f"w{r}" for r in range(a.workers)])
                out = documents(folder, a.workers, job_secret)
    except ConfigError as exc:
        print(f"make_secrets.py: {exc}", file=sys.stderr)
        return 2
    sys.stdout.write(out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
