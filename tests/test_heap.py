"""commlab.core.heap: the glibc setting that stops per-step gradient temporaries from page-faulting.

The page-fault counts themselves (default heap against the kept one) depend on the machine's
glibc and allocator state: they are measured by the bench (``python -m bench.probes heap``, the
report's "Probes" section), not asserted here."""

from commlab.core.heap import threshold_for


def test_threshold_for_largest_gradient():
    assert threshold_for(0) == 64 * 2**20
    assert threshold_for(64 * 2**20) == 128 * 2**20
    assert threshold_for(10 * 2**30) == 2**30
