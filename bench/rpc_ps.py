"""The peer: a parameter server written with torch.distributed.rpc (TensorPipe), same rounds as ours.

Rank 0 is the server: it holds one flat float32 vector; ``push(grad)`` applies
``p -= lr * grad`` under a lock, ``pull()`` returns the vector. Ranks 1..N are
workers: each runs rounds of ``rpc_sync(push)`` then ``rpc_sync(pull)`` and
prints ``{"rounds": R, "seconds": S}``.

``--transport uv-basic`` forces TensorPipe onto TCP alone (transport uv,
channel basic); ``default`` lets TensorPipe choose (on one host it moves
tensors through shared memory / cross-memory copies).

    python -m bench.rpc_ps --rank R --world 3 --port P --numel N --rounds R --warmup W --transport default
"""

from __future__ import annotations

import argparse
import json
import os
import threading
import time

import torch
import torch.distributed.rpc as rpc

_STATE: dict = {}  # the server's vector and lock; set only in the server process


def _push(grad: torch.Tensor, lr: float) -> None:
    with _STATE["lock"]:
        _STATE["param"].add_(grad, alpha=-lr)


def _pull() -> torch.Tensor:
    with _STATE["lock"]:
        return _STATE["param"].clone()  # the reply is serialised after we return: hand it a stable copy


def options(kind: str) -> rpc.TensorPipeRpcBackendOptions:
    if kind == "uv-basic":
        return rpc.TensorPipeRpcBackendOptions(_transports=["uv"], _channels=["basic"], rpc_timeout=120)
    return rpc.TensorPipeRpcBackendOptions(rpc_timeout=120)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.rpc_ps")
    p.add_argument("--rank", type=int, required=True)
    p.add_argument("--world", type=int, default=3)
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--numel", type=int, default=2**20)
    p.add_argument("--rounds", type=int, default=200)
    p.add_argument("--warmup", type=int, default=20)
    p.add_argument("--lr", type=float, default=1e-6)
    p.add_argument("--transport", choices=("default", "uv-basic"), default="default")
    a = p.parse_args(argv)
    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(a.port))
    if a.rank == 0:
        _STATE.update(param=torch.zeros(a.numel), lock=threading.Lock())
        rpc.init_rpc("ps", rank=0, world_size=a.world, rpc_backend_options=options(a.transport))
        rpc.shutdown()  # waits for every worker to finish
        return 0
    rpc.init_rpc(f"worker{a.rank}", rank=a.rank, world_size=a.world, rpc_backend_options=options(a.transport))
    grad = torch.full((a.numel,), 1e-3)
    for i in range(a.warmup + a.rounds):
        if i == a.warmup:
            t0 = time.perf_counter()
        rpc.rpc_sync("ps", _push, args=(grad, a.lr))
        rpc.rpc_sync("ps", _pull)
    seconds = time.perf_counter() - t0
    print(json.dumps({"rounds": a.rounds, "seconds": seconds}), flush=True)
    rpc.shutdown()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
