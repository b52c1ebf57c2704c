"""ring://?compress= with real processes: every compressor (and none) in one program per N and transport.

The program is tests/test_compress_allreduce.py's (a default process group made first, as under DDP: the ring
meets in its store and leaves it working). Per compressor, every step: each rank's exchanged gradient equals
what the in-process simulation of N ranks' compressors (commlab.compress.simulate) computes from every rank's
gradient, with fp16/bf16 added as the ring adds them per hop (float32 partials rounded once per hop:
simulate's per_hop=True follows the ring's segment order); the parameters and the optimizer's momentum are
bitwise equal on every rank; the bytes the step reports equal the ring's closed form; and resuming from
ex.state_dict() at step 3 replays steps 3..5 exactly.
"""

import pytest

from test_compress_allreduce import MORE_QUERIES, QUERIES, check, run_every_compressor, wire_bytes

pytestmark = pytest.mark.multiproc


def ring_sent(numel: int, rank: int, n: int) -> int:
    """Elements ``rank`` sends in a ring all-reduce of ``numel``: every segment once in the reduce-scatter, then
    every segment but those of ranks r+1 and r+2 in the all-gather (segment s: [s numel/N, (s+1) numel/N)). At
    N = 2, numel (the two-rank swap sends it all at once)."""
    size = [(s + 1) * numel // n - s * numel // n for s in range(n)]
    return 2 * numel - size[(rank + 1) % n] - size[(rank + 2) % n]


@pytest.mark.parametrize("n, transport, links, queries", [
    (2, "transport=auto", "shm", QUERIES),  # the default: shared memory on one host; the two-rank swap
    pytest.param(2, "transport=auto", "shm", MORE_QUERIES, marks=pytest.mark.full),
    pytest.param(3, "transport=auto", "shm", QUERIES, marks=pytest.mark.full),
    pytest.param(2, "transport=tcp&swap_kb=0&chunk_mb=0.0002", "tcp", QUERIES, marks=pytest.mark.full),  # two steps, chunks
    pytest.param(3, "transport=ipc&chunk_mb=0.0002", "ipc", QUERIES, marks=pytest.mark.full),
    pytest.param(2, "transport=torch&swap_kb=0&chunk_mb=0.0002", "torch", QUERIES, marks=pytest.mark.full),
])
def test_every_compressor_keeps_ranks_identical_and_matches_the_simulation(run_ranks, n, transport, links, queries):
    results = run_every_compressor(run_ranks, n, f"ring://?{transport}&", per_hop=True, queries=queries)
    assert {res[QUERIES[0]]["links"]["to_right"] for res in results} == {links}
    # N=2: one addition, the same on the ring as in the simulation, bit for bit; fp16/bf16 per hop, top-k, sign and
    # the quantizers at any N (the simulation follows the ring's order); N=3 float32 sums: the ring adds segment s from rank s on
    # (not in rank order, and the flags ride in the same flat), and PowerSGD's state carries that on
    sent = lambda query, shapes, step, rank: wire_bytes(
        query, shapes, step, n, lambda elements, itemsize: itemsize * ring_sent(elements, rank, n), per_hop=True)
    check(results, n, sent,
          lambda query: n == 2 or any(name in query for name in ("fp16", "bf16", "topk", "sign", "int", "fp4", "fp8")),
          queries)


def test_a_bad_spec_stops_commlab_train_in_one_line_before_anything_starts():
    from conftest import commlab_train
    proc = commlab_train(["--exchanger", "ring://?compress=topk:1.5", "--workers", "2"], timeout=60)
    assert proc.returncode == 2
    lines = [l for l in proc.stderr.splitlines() if l.strip()]
    assert len(lines) == 1 and "option 'compress': 'topk:1.5' (topk:F): F=1.5 is outside (0, 1]" in lines[0], \
        proc.stderr
