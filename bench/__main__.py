"""``commlab bench [bandwidth|convergence|scaling|probes] ...``: compare the regimes; write a run folder with a report.

``commlab bench CASE ...`` runs one case with its own flags (``commlab bench CASE --help``):
``train-step`` (training-step time beside DDP), ``ps-rounds`` (ps:// beside torch.distributed.rpc),
``gpu-sweep`` (CUDA tensors beside CPU tensors), ``script`` (your script under each regime),
``workloads`` (the examples under each regime). The first three write :mod:`bench.records`'
records, the bandwidth phase's shape, and give each ratio its 95% interval. ``chaos`` (workers killed at random: goodput beside restart-all and torchft) runs only when named.

With no subcommand, the default comparison: all four phases, sized to finish within six
minutes on a 2-core machine. Every run writes ``runs/<UTC timestamp>/`` (or ``--out``)
with ``report.md``, PNG plots, ``bandwidth.json``/``convergence.json``/``scaling.json``/
``probes.json`` and ``manifest.json``. Every "A is faster than B" in the report carries the
ratio and its 95% interval from the run's own samples (:mod:`bench.verdict`).
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib
import json
import signal
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

from tqdm import tqdm

from bench import bandwidth, convergence, manifest, report
from bench import regimes as R
from bench import workloads
from bench.netns import Links, link_unavailable_reason
from bench.records import failure
from bench.text import human_bytes, parse_sizes

DEFAULT_SIZES = "4K,256K,4M,32M"
# with later phases, bandwidth may use at most this share of the budget: three launches of the default
# job (32-39 s each here, most of it starting the ranks and each size's PS servers)
BANDWIDTH_SHARE = 0.45
# the end of the budget is kept for the later phases: convergence stops starting runs this long before
# it (for scaling and probes), scaling this long before it (for the probes)
SCALING_RESERVE_S, PROBES_RESERVE_S = 70.0, 25.0
# The default run is sized to finish within six minutes on a 2-core machine with every entry run: what was
# trimmed to fit is said in docs/bench.md (100 training steps, N = 2 and 3 for scaling, fewer workload regimes, the restart probe
# only under `commlab bench probes`). The budget is a cap for runs made larger by their flags: jobs stop
# starting after it, and what did not run is reported as skipped.
DEFAULT_BUDGET_S = 900.0


# the cases with flags of their own: CASE -> the module whose main(argv) runs it
CASES = {"train-step": "bench.train_step", "ps-rounds": "bench.ps_rounds", "gpu-sweep": "bench.gpu_sweep",
         "script": "bench.script_compare", "workloads": "bench.workloads", "compress": "bench.compress",
         "lowcomm": "bench.lowcomm", "chaos": "bench.chaos"}


def _names(text: str | None, default: list[str], table: dict, what: str) -> list[str]:
    names = default if not text else [s.strip() for s in text.split(",") if s.strip()]
    return R.pick(table, names, what)


def servers_needed(bw_names: list[str], cv_names: list[str]) -> int:
    """Hosts beyond the workers a --link topology needs: the most servers one regime starts."""
    from commlab.base.config import ExchangerURL
    urls = [R.bandwidth_entry(n).url for n in bw_names] + [R.CONVERGENCE[n].url for n in cv_names]
    return max((int(dict(ExchangerURL.parse(u).query).get("shards", 1)) for u in urls if u.startswith("ps://")),
               default=0)


def _interrupt(signum, frame):
    raise KeyboardInterrupt(f"signal {signum}")


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="commlab bench", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog="cases with their own flags: " + ", ".join(CASES) +
                                "\nbandwidth regimes: " + ", ".join(R.BANDWIDTH) +
                                "\nconvergence regimes: " + ", ".join(R.CONVERGENCE))
    p.add_argument("what", nargs="?", default="all", choices=("all", "bandwidth", "convergence", "scaling", "probes"),
                   help="which comparison (default: all, then the report)")
    p.add_argument("--regimes", help="comma-separated regime names for the chosen phase (see below)")
    p.add_argument("--bw-regimes", help="with 'all': bandwidth regimes")
    p.add_argument("--conv-regimes", help="with 'all': convergence regimes")
    p.add_argument("--workers", type=int, default=2, help="N ranks per job (local:// runs one with N x the batch)")
    p.add_argument("--out", help="run folder (default runs/<UTC timestamp>)")
    p.add_argument("--json", help="also write this phase's records to FILE")
    p.add_argument("--budget-s", type=float, default=DEFAULT_BUDGET_S,
                   help="stop starting jobs after this many seconds; what did not run is reported as skipped")
    p.add_argument("--link", metavar="RATE", help="as root: ranks in network namespaces joined by veth pairs "
                                                  "capped with tc tbf at RATE (e.g. 1gbit)")
    g = p.add_argument_group("bandwidth")
    g.add_argument("--sizes", default=DEFAULT_SIZES, help="message sizes, e.g. 4K,1M,16M (float32)")
    g.add_argument("--repeat-mb", type=float, default=256, help="repeats per size: about this many MiB moved")
    g.add_argument("--min-iters", type=int, default=5)
    g.add_argument("--max-iters", type=int, default=60)
    g.add_argument("--warmup", type=int, default=2)
    g.add_argument("--launches", type=int, default=3,
                   help="run the bandwidth job this many times, each with the iterations above; verdicts "
                        "resample launches, then iterations (a launch's own spread is not the run-to-run spread)")
    g.add_argument("--ceilings", default="tcp-oneway,tcp-duplex,zmq-tcp,memcpy",
                   help="ceilings measured in the same turns as the regimes: " + ", ".join(R.CEILINGS))
    g = p.add_argument_group("convergence")
    g.add_argument("--model", default="mlp")
    g.add_argument("--steps", type=int, default=100)
    g.add_argument("--batch-size", type=int, default=32, help="per worker; local:// gets workers x this")
    g.add_argument("--lr", type=float, default=0.1)
    g.add_argument("--seed", type=int, default=0)
    g.add_argument("--eval-every", type=int, default=10)
    g.add_argument("--target-acc", type=float, default=0.85)
    g = p.add_argument_group("scaling (step time and exposed communication against N)")
    g.add_argument("--scale-regimes", help="convergence regime names (default: " + ",".join(R.DEFAULT_SCALING) + ")")
    g.add_argument("--scale-workers", default="2,3", help="the N to run; N > cores oversubscribes the machine")
    g.add_argument("--scale-steps", type=int, default=20, help="training steps per (regime, N)")
    g = p.add_argument_group("probes")
    g.add_argument("--no-probes", action="store_true", help="with 'all': skip the probes (heap faults, a killed rank)")
    g.add_argument("--workloads", default="charlm,resnet", type=workloads.names_arg,
                   help="with 'all': these examples under each regime afterwards (bench/workloads.py; 'none': skip)")
    g.add_argument("--workloads-budget-s", type=float, default=workloads.BENCH_BUDGET_S,
                   help="with 'all': the workloads start no job after this many seconds (default %(default)g)")
    return p


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] and argv[0] in CASES:
        return importlib.import_module(CASES[argv[0]]).main(argv[1:])
    a = parser().parse_args(argv)
    try:
        if a.workers < 2:
            raise ValueError("--workers must be >= 2 (a comparison of exchanges needs peers)")
        if a.what == "all" and a.regimes:
            raise ValueError("with both phases, name regimes with --bw-regimes and --conv-regimes")
        bw_names = _names(a.bw_regimes or a.regimes, R.DEFAULT_BANDWIDTH, R.BANDWIDTH, "bandwidth") \
            if a.what in ("all", "bandwidth") else []
        cv_names = _names(a.conv_regimes or a.regimes, R.DEFAULT_CONVERGENCE, R.CONVERGENCE, "convergence") \
            if a.what in ("all", "convergence") else []
        sc_names = _names(a.scale_regimes or (a.regimes if a.what == "scaling" else None), R.DEFAULT_SCALING,
                          R.CONVERGENCE, "scaling") if a.what in ("all", "scaling") else []
        sc_workers = sorted({int(n) for n in a.scale_workers.split(",") if n.strip()})
        if sc_names and (not sc_workers or min(sc_workers) < 2):
            raise ValueError("--scale-workers must list N >= 2")
        sizes = parse_sizes(a.sizes)
        ceilings = tuple(c for c in a.ceilings.split(",") if c)
        bad = [c for c in ceilings if c not in R.CEILINGS]
        if bad:
            raise ValueError(f"unknown ceiling(s) {bad}; known: {', '.join(R.CEILINGS)}")
    except ValueError as exc:
        print(f"commlab bench: {exc}", file=sys.stderr)
        return 2
    started = datetime.now(timezone.utc)
    run_dir = Path(a.out or Path("runs") / started.strftime("%Y%m%dT%H%M%SZ"))
    run_dir.mkdir(parents=True, exist_ok=True)
    bw_cfg = bandwidth.BandwidthConfig(bw_names, a.workers, sizes, int(a.repeat_mb * 2**20), a.min_iters, a.max_iters,
                                       a.warmup, ceilings, launches=max(1, a.launches)) \
        if a.what in ("all", "bandwidth") else None
    cv_cfg = convergence.ConvergenceConfig(cv_names, a.workers, a.model, a.steps, a.batch_size, a.lr, a.seed,
                                           a.eval_every, a.target_acc) if a.what in ("all", "convergence") else None
    # scaling trains the same workload for a few steps (evaluation only at the end)
    sc_cfg = convergence.ConvergenceConfig(sc_names, a.workers, a.model, a.scale_steps, a.batch_size, a.lr, a.seed,
                                           a.scale_steps, a.target_acc) if sc_names else None
    run_probes = a.what == "probes" or (a.what == "all" and not a.no_probes)
    link_note = None
    if a.link:
        link_note = link_unavailable_reason()
        if link_note:
            print(f"commlab bench: {link_note}; running on loopback instead", file=sys.stderr)
    # SIGTERM behaves like Ctrl-C: jobs are stopped and namespaces deleted on the way out
    signal.signal(signal.SIGTERM, _interrupt)
    signal.signal(signal.SIGINT, _interrupt)
    budget = bandwidth.Budget.of(a.budget_s)
    t0 = time.monotonic()
    records, failures, facts, summaries, curves, points, probed = [], [], {}, [], {}, [], {}
    wl_results, wl_pngs = {}, {}  # bench/workloads.py: the examples under each regime (with 'all')
    links = None
    print(f"commlab bench: writing {run_dir}/ (N={a.workers}"
          + (f", sizes {', '.join(human_bytes(s) for s in sizes)}" if bw_cfg else "") + ")", file=sys.stderr)
    try:
        if a.link and not link_note:
            hosts = max([a.workers] + (sc_workers if sc_cfg else []))
            links = Links(hosts + servers_needed(bw_names, cv_names + sc_names), a.link).__enter__()
        if bw_cfg:
            # with later phases, bandwidth may use at most BANDWIDTH_SHARE of the budget
            bw_budget = bandwidth.Budget(min(budget.deadline, time.monotonic() + BANDWIDTH_SHARE * a.budget_s)) \
                if cv_cfg or sc_cfg else budget
            records, f, facts = bandwidth.run(bw_cfg, run_dir, bw_budget, links, progress=tqdm)
            failures += f
            (run_dir / "bandwidth.json").write_text(json.dumps(records, indent=1))
        if cv_cfg and not any(f["status"] == "interrupted" for f in failures):
            reserve = (SCALING_RESERVE_S if sc_cfg else 0.0) + (PROBES_RESERVE_S if run_probes else 0.0)
            summaries, f, curves = convergence.run(cv_cfg, run_dir, bandwidth.Budget(budget.deadline - reserve),
                                                   links, progress=tqdm)
            failures += f
            (run_dir / "convergence.json").write_text(json.dumps(
                {"summaries": summaries, "curves": curves}, indent=1))
        if sc_cfg and not any(f["status"] == "interrupted" for f in failures):
            sc_budget = bandwidth.Budget(budget.deadline - (PROBES_RESERVE_S if run_probes else 0.0))
            points, f = convergence.run_scaling(sc_cfg, sc_names, sc_workers, a.scale_steps, run_dir, sc_budget, links,
                                                progress=tqdm, have=summaries)
            failures += f
            (run_dir / "scaling.json").write_text(json.dumps(points, indent=1))
        if run_probes and not any(f["status"] == "interrupted" for f in failures):
            if budget.left() > 0 or a.what == "probes":
                from bench import probes
                print("commlab bench: probes (heap page faults, a killed ring rank"
                      + (", a restarted job)" if a.what == "probes" else ")"), file=sys.stderr)
                probed = {"heap": probes.heap_faults()}
                if R.unavailable("ring://") is None:
                    probed["peer_loss"] = probes.peer_loss()
                if a.what == "probes":  # two jobs, each restarted once (~50 s each): not in the default run
                    probed["restart"] = probes.restart()
                (run_dir / "probes.json").write_text(json.dumps(probed, indent=1))
            else:
                failures.append(failure("probes", "-", "the benchmark's time budget ran out before the probes",
                                        status="skipped"))
        if a.what == "all" and a.workloads and not any(f["status"] == "interrupted" for f in failures):
            wl_results, wl_pngs = workloads.run_default(run_dir, a.workloads_budget_s, a.workers, names=a.workloads)
    except KeyboardInterrupt:
        print("commlab bench: interrupted; every job was stopped", file=sys.stderr)
        failures.append(failure("bench", "-", "interrupted (Ctrl-C or SIGTERM): the report covers what finished",
                                status="interrupted"))
    finally:
        if links is not None:
            links.close()
    man = {"started_utc": started.isoformat(timespec="seconds"), "seconds": time.monotonic() - t0,
           "command": "commlab bench " + " ".join(argv),
           "config": {"bandwidth": dataclasses.asdict(bw_cfg) if bw_cfg else None,
                      "convergence": dataclasses.asdict(cv_cfg) if cv_cfg else None,
                      "scaling": dict(dataclasses.asdict(sc_cfg), workers=a.workers, scale_workers=sc_workers,
                                      scale_steps=a.scale_steps, scale_warmup=convergence.SCALING_WARMUP)
                      if sc_cfg else None,
                      "budget_s": a.budget_s, "link": a.link,
                      "seeds": {"model_and_data": a.seed, "bandwidth_inputs": "closed-form (no randomness)"}},
           "regimes": {"bandwidth": {n: R.bandwidth_entry(n).url for n in bw_names} if bw_cfg else {},
                       "convergence": {n: R.CONVERGENCE[n].url for n in cv_names} if cv_cfg else {},
                       "scaling": {n: R.CONVERGENCE[n].url for n in sc_names}},
           "regime_facts": facts, "git": manifest.git_facts(), "environment": manifest.environment(),
           "transport": manifest.transport(links, link_note, facts), "failures": failures}
    (run_dir / "manifest.json").write_text(json.dumps(man, indent=1))
    if a.json:
        data = {"bandwidth": records, "convergence": summaries, "scaling": points, "probes": probed}
        Path(a.json).write_text(json.dumps(data if a.what == "all" else data[a.what], indent=1))
    path = report.write(run_dir, man, records, summaries, curves, failures, points, probed)
    if wl_results:
        workloads.append_section(path, wl_results, wl_pngs)
    print(f"commlab bench: report {path} ({man['seconds']:.0f} s)", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
