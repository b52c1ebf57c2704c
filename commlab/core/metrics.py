"""How a training script tells the launcher what it did: one JSON line per report.

The contract is small enough to follow without commlab: the launcher (``commlab train``,
``commlab run``) sets ``COMMLAB_METRICS=PATH``; rank 0 appends JSON objects, one per line,
to ``PATH`` and rank r > 0 to ``PATH.rank<r>`` (:func:`metrics_path`, the one naming rule).
Each object has ``step`` (0-based index of the optimizer step it describes) and any of:

    loss            training loss of that step (float)
    test_acc        accuracy on held-out data, in [0, 1]
    test_loss       loss on held-out data
    bytes_sent      bytes this rank sent in that step's exchanges
    bytes_received  bytes it received
    bytes_uncompressed  under compress=: what that step would have sent uncompressed
    exchanges       how many exchanges the step made (more than one: micro-steps exchanged separately)
    time_s          seconds since training began, when the step ended
    step_s          seconds the step took
    comm_s          seconds of it spent waiting on the exchange (exposed communication)
    unix_s          when the line was written (seconds since the epoch); :func:`report` adds it

plus whatever else the script wants to keep (lr, tokens, ...). When the job ends the launcher
reads rank 0's last line and prints a one-line summary. :func:`report` writes such a line;
without ``COMMLAB_METRICS`` (a plain ``python script.py``) it writes nothing.
"""

from __future__ import annotations

import json
import math
import os
import time
from pathlib import Path

ENV = "COMMLAB_METRICS"


def metrics_path(base: str | os.PathLike, rank: int) -> Path:
    """Where rank ``rank`` writes: ``base`` for rank 0, ``base.rank<r>`` for the others."""
    return Path(base if rank == 0 else f"{os.fspath(base)}.rank{rank}")


def _rank_from_env() -> int:
    from commlab.transport import rendezvous  # torchrun's, Slurm's or Open MPI's names, as everywhere else

    return rendezvous.from_env().rank


def report(step: int, *, exchange=None, path: str | os.PathLike | None = None, rank: int | None = None,
           **fields) -> dict | None:
    """Append ``{"step": step, "rank": rank, "unix_s": now, **fields}`` as one JSON line to this rank's
    metrics file.

    ``exchange``, a :class:`commlab.StepReport` (``ex.step()``'s result, or ``ex.last_report``
    after ``optimizer.step()``), adds its ``bytes_sent``, ``bytes_received``, ``exchanges`` and its ``wait_s``
    as ``comm_s``.

    ``path`` defaults to ``$COMMLAB_METRICS``; with neither, nothing is written and ``None`` is
    returned. ``rank`` defaults to the launcher's environment (``RANK`` and its Slurm / Open MPI
    equivalents). Values must be JSON numbers, strings, booleans or None (tensors: ``.item()``
    first). Blocks for one small append; the file is opened and closed on every call, so a
    killed rank leaves whole lines behind. Not a collective: every rank may call it, or only
    rank 0.
    """
    base = os.environ.get(ENV) if path is None else path
    if not base:
        return None
    rank = _rank_from_env() if rank is None else rank
    record = {"step": int(step), "rank": rank, "unix_s": time.time()}
    if exchange is not None:
        record.update(bytes_sent=exchange.bytes_sent, bytes_received=exchange.bytes_received,
                      comm_s=exchange.wait_s, exchanges=exchange.exchanges)
        if exchange.bytes_uncompressed:
            record.update(bytes_uncompressed=exchange.bytes_uncompressed)
    record.update(fields)
    line = json.dumps(record, allow_nan=True)
    with metrics_path(base, rank).open("a") as fh:
        fh.write(line + "\n")
    return record


def last_record(path: str | os.PathLike) -> dict | None:
    """The last whole JSON line of ``path`` (a rank's metrics file), or None if there is none."""
    try:
        lines = Path(path).read_text(errors="replace").splitlines()
    except FileNotFoundError:
        return None
    for line in reversed(lines):
        try:
            record = json.loads(line)
        except ValueError:  # a line cut short by a kill
            continue
        if isinstance(record, dict):
            return record
    return None


def human_bytes(n: float | None) -> str:
    """Bytes in binary units, as nccl-tests and every page of docs/ write them: ``4096`` -> ``'4 KiB'``,
    ``1.5 * 2**20`` -> ``'1.5 MiB'``, ``1500`` -> ``'1.5 KiB'`` (a whole number bare, else one decimal);
    None -> ``'—'``. The one such function: ``bench`` writes its sizes with it too."""
    if n is None:
        return "—"
    for unit, k in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(n) >= k:
            v = n / k
            return f"{v:.0f} {unit}" if v == int(v) else f"{v:.1f} {unit}"
    return f"{n:.0f} B"


def summary(record: dict | None, wall_s: float) -> str:
    """``'200 steps in 12.3 s, final loss 0.412, test accuracy 91.7%, 1.5 MiB sent per step'`` from a
    rank-0 record (whatever of it is there); without one, says how to report."""
    if record is None:
        return (f"finished in {wall_s:.1f} s; no metrics reported (call commlab.report(step=..., loss=...) "
                f"or write JSON lines to ${ENV})")
    parts = [f"{int(record['step']) + 1} steps in {wall_s:.1f} s" if "step" in record else f"{wall_s:.1f} s"]
    loss = record.get("loss")
    if isinstance(loss, (int, float)):
        parts.append(f"final loss {loss:.4g}" if math.isfinite(loss) else f"final loss {loss}")
    if isinstance(record.get("test_acc"), (int, float)):
        parts.append(f"test accuracy {100 * record['test_acc']:.1f}%")
    sent, received = record.get("bytes_sent"), record.get("bytes_received")
    if isinstance(sent, (int, float)):
        moved = human_bytes(sent) + " sent"
        if isinstance(received, (int, float)):
            moved += f", {human_bytes(received)} received"
        exchanges = record.get("exchanges")
        if isinstance(exchanges, int) and exchanges > 1:
            moved += f" in {exchanges} exchanges"
        raw = record.get("bytes_uncompressed")
        ratio = f" ({sent / raw:.3g}x of uncompressed)" if isinstance(raw, (int, float)) and raw > 0 else ""
        parts.append(moved + " per step by rank 0" + ratio)
    return ", ".join(parts)
