"""Keep big freed blocks in the process heap (glibc), so per-step temporaries stop page-faulting.

glibc serves every allocation above its mmap threshold (at most 32 MiB, by default much
less) with a fresh mapping and unmaps it on free. Two kinds of such blocks come back on every
step of a commlab worker:

- autograd's gradient temporaries: the weight gradient of a 4096x4096 layer is a new 64 MiB
  tensor in every backward, which the bucket hook then copies into its bucket;
- libzmq's received messages (one malloc per message, 1-16 MiB for ring chunks and PS pushes).

A fresh mapping faults in one 4 KiB page at a time on first touch (the kernel zeroes each), so
100 MB of gradients cost ~25,000 faults per step: on the 25M-parameter MLP of the benchmarks,
zero_grad + forward + backward took 145 ms with glibc's defaults and 106 ms with the threshold
above the largest gradient (1 thread, this machine). Raising the thresholds is what the PyTorch
CPU performance guides get by preloading jemalloc or tcmalloc, with two ``mallopt`` calls.

The setting is process-wide and only ever raised here. Where the C library is not glibc nothing
changes and :func:`keep_freed_memory` returns False.
"""

from __future__ import annotations

import threading

_lock = threading.Lock()
_current = (0, 0)  # (mmap threshold, trim threshold) this process asked for so far


def keep_freed_memory(mmap_threshold: int = 32 * 2**20, trim_threshold: int = 2**30) -> bool:
    """Serve allocations below ``mmap_threshold`` bytes from the heap and keep up to
    ``trim_threshold`` bytes of freed memory there for reuse (never lowers an earlier setting).
    Returns whether glibc took it."""
    global _current
    with _lock:
        mmap_threshold = max(mmap_threshold, _current[0])
        trim_threshold = max(trim_threshold, _current[1], 2 * mmap_threshold)
        if (mmap_threshold, trim_threshold) == _current:
            return True
        mallopt = _glibc("mallopt")
        if mallopt is None:
            return False
        M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3
        ok = bool(mallopt(M_MMAP_THRESHOLD, mmap_threshold)) and bool(mallopt(M_TRIM_THRESHOLD, trim_threshold))
        if ok:
            _current = (mmap_threshold, trim_threshold)
        return ok


def release_freed_memory() -> bool:
    """Hand the heap's free memory back to the system now (glibc's ``malloc_trim``), whatever trim
    threshold :func:`keep_freed_memory` set: for a process done with a big model's temporaries (``commlab
    plan`` between its measurements), not for a worker's loop. Returns whether glibc did it."""
    trim = _glibc("malloc_trim")
    return trim is not None and bool(trim(0))


def _glibc(name: str):
    """The C library's function ``name``, or None where there is no such library or function."""
    import ctypes
    import ctypes.util

    try:
        return getattr(ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6"), name)
    except (OSError, AttributeError):
        return None


def keep_freed_gradients(params) -> bool:
    """:func:`keep_freed_memory` sized for these parameters' gradients: the largest one's temporary
    stays in the heap (see :func:`threshold_for`)."""
    return keep_freed_memory(threshold_for(max((p.numel() * p.element_size() for p in params), default=0)))


def threshold_for(largest_bytes: int) -> int:
    """An mmap threshold that keeps a temporary of ``largest_bytes`` (a model's largest gradient) in
    the heap: twice it, at least 64 MiB, at most 1 GiB."""
    return int(min(max(2 * largest_bytes, 64 * 2**20), 2**30))
