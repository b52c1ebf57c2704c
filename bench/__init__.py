"""Benchmarks: every regime compared for bandwidth, convergence and scaling, with a report a person reads.

``commlab bench`` runs ``python -m bench``. Modules: :mod:`bench.regimes` (the table of
regimes, one line each), :mod:`bench.bandwidth` and :mod:`bench.bw_worker` (nccl-tests
style exchange times, every regime and ceiling of a job taking turns), :mod:`bench.convergence`
(the built-in worker trained under every regime; scaling with N),
:mod:`bench.verdict` (ratios with bootstrap intervals: who is faster, or indistinguishable),
:mod:`bench.probes` (page faults, a killed rank), :mod:`bench.report` and :mod:`bench.plots`
(the run folder), :mod:`bench.netns` (capped links in network namespaces), :mod:`bench.jobs`
(the one way a case runs a job: the launcher in this process, with a deadline and a log). Nothing imports ``bench``.
"""
