"""Benchmarks: every regime compared for bandwidth and convergence, with a report a person reads.

``commlab bench`` runs ``python -m bench``. Modules: :mod:`bench.regimes` (the table of
regimes, one line each), :mod:`bench.bandwidth` and :mod:`bench.bw_worker` (nccl-tests
style exchange times), :mod:`bench.convergence` (training through ``commlab train``),
:mod:`bench.report` and :mod:`bench.plots` (the run folder), :mod:`commlab.netns`
(capped links in network namespaces), :mod:`bench.jobs` (process groups with deadlines).
Nothing imports ``bench``.
"""
