"""``commlab plan``: which regime wins for this model at 8, 512 or 4,096 workers, and why.

    commlab plan --model mlp-25m --workers 8,64,512,4096 --link 100gbit --workers-per-host 8
    commlab plan --model mypkg.models:resnet --input-shape 3,32,32 --bench-run runs/20261123T070000Z
    commlab plan --calibrate --save-calibration cal.json      # a short bench run first (about a minute)
    commlab plan --model mlp-25m --recalibrate                 # measure this machine again (kept: docs/plan.md)
    commlab plan --calibration cal.json --regimes 'ring://' 'ps://?shards=16&mode=ssp&staleness=2'

Prints a table (step time, exposed communication, scaling efficiency, samples/s, the busiest link's
bytes, staleness), the crossovers (how many PS shards beat the ring at each N) and a recommendation;
writes ``plan.md``, ``plan.json`` and ``plan.png`` into ``--out``. What it measures here (the model's
compute, the server costs, the compressors) is measured once per machine and kept in the user's cache
folder (:mod:`commlab.plan.cache`); ``plan.json``'s ``calibration`` says what this call measured and
where the rest was kept. The same query again is answered from the cache too (its plan.md, plan.json and
plan.png, kept under the calibration, the options and the planner's source: :class:`~commlab.plan.cache.KeptAnswer`),
measuring, simulating and drawing nothing. See docs/plan.md.
"""

from __future__ import annotations

import argparse
import json
import math
import shutil
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path

from commlab.base.errors import ConfigError
from commlab.plan.cache import Kept, KeptAnswer
from commlab.plan.rates import parse_rate
from commlab.plan import recommend as R
from commlab.plan.costmodel import BUILTIN_COMPRESSORS, Calibration, Straggler, Topology, parse_regime

# What measures (commlab.plan.calibrate, commlab.plan.compression, the compressors) imports torch, seconds
# of a call that measures nothing: each is imported where a call needs it, so a repeated query answered
# from the cache (KeptAnswer) never imports torch.


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="commlab plan", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="mlp-25m", help="built-in model name, or module:function returning a module")
    p.add_argument("--input-shape", help="shape of one input sample for module:function models, e.g. 3,32,32")
    p.add_argument("--batch-size", type=int, default=64, help="per worker")
    p.add_argument("--workers", default="8,64,512,4096", help="worker counts, comma-separated")
    p.add_argument("--regimes", nargs="+", default=list(R.DEFAULT_REGIMES), metavar="URL",
                   help="ring://, allreduce://?backend=gloo|nccl, ps://?shards=K&mode=sync|async|ssp&staleness=S"
                        "&placement=dedicated|colocated")
    p.add_argument("--link", default="100gbit", help="each host's NIC, each way (tc units: 10gbit, 500mbit, 1gbps)")
    p.add_argument("--intra", default="20gbps", help="between workers on one host")
    p.add_argument("--workers-per-host", type=int, default=8)
    p.add_argument("--compute-scale", type=float, default=1.0, help="stretch the measured compute (other hardware)")
    p.add_argument("--cpu-share", default="1",
                   help="share of a core each worker gets while all of a host's workers compute (hosts running "
                        "other work too): a number in (0, 1], or 'measure': --workers-per-host processes spin on "
                        "this machine now (commlab.plan.calibrate.cpu_share); bounds a compressed step from below")
    p.add_argument("--straggler", default="none", help="none, lognormal:SIGMA, slow:SECONDS[:COUNT], factor:F[:COUNT]; "
                                                       "join with +")
    p.add_argument("--max-shards", type=int, default=256, help="largest K searched for the crossover")
    p.add_argument("--compress", nargs="+", default=list(BUILTIN_COMPRESSORS), metavar="SPEC",
                   help="compressors to weigh against the uncompressed all-reduce (compress= values, with error "
                        "feedback; measured on the model here); 'none' for none")
    p.add_argument("--local-steps", nargs="+", default=[], metavar="OPTIONS",
                   help="local steps to weigh (docs/localsteps.md), each as the URL's options: "
                        "'sync_every=48', 'sync_every=48&fragments=4&overlap=2', 'sync_every=48&compress=int8': "
                        "their step, utilization and the link rate below which they beat the synchronous step and "
                        "each --compress compressor")
    g = p.add_argument_group("calibration (one of)")
    g.add_argument("--calibration", help="a calibration JSON saved before (--save-calibration)")
    g.add_argument("--bench-run", help="a 'commlab bench' run folder: transports fitted to its bandwidth.json")
    g.add_argument("--calibrate", action="store_true", help="run a short 'commlab bench bandwidth' first")
    p.add_argument("--recalibrate", action="store_true",
                   help="measure this machine again (compute, server costs, compressors) instead of using what was "
                        "kept from an earlier call, and keep the new figures (commlab.plan.cache)")
    p.add_argument("--save-calibration", help="write the calibration used to this JSON file")
    p.add_argument("--out", help="folder for plan.md, plan.json, plan.png (default runs/plan-<UTC time>)")
    p.add_argument("--seed", type=int, default=0)
    return p


def parse_cpu_share(text: str, workers_per_host: int) -> float:
    """``--cpu-share``: a number in (0, 1], or 'measure' (:func:`commlab.plan.calibrate.cpu_share` of a host's
    workers, here and now)."""
    if text.strip().lower() == "measure":
        from commlab.plan import calibrate as C
        return C.cpu_share(max(1, workers_per_host))
    try:
        share = float(text)
    except ValueError:
        share = math.nan
    if not 0 < share <= 1:
        raise ConfigError(f"--cpu-share: give a number in (0, 1] or 'measure', not {text!r}")
    return share


def load_calibration(a) -> tuple[Calibration, Kept | None, list[str]]:
    """The calibration of this call, the file it is kept in (None with ``--calibration``: the user's own
    file), and what was measured now (empty when everything came from the kept file)."""
    if sum(bool(x) for x in (a.calibration, a.bench_run, a.calibrate)) > 1:
        raise ConfigError("give at most one of --calibration, --bench-run, --calibrate")
    if a.calibration:
        if a.recalibrate:
            raise ConfigError("--recalibrate: measures this machine again, which --calibration FILE replaces; "
                              "give one of them")
        return Calibration.load(a.calibration), None, []
    from commlab.plan import calibrate as C
    shape = tuple(int(x) for x in a.input_shape.split(",")) if a.input_shape else None
    run = a.bench_run
    if a.calibrate:
        run = C.calibration_run(Path(tempfile.mkdtemp(prefix="commlab-plan-cal-")))
        print(f"commlab plan: calibration run in {run}", file=sys.stderr)
    kept = Kept.of(a.model, a.batch_size, shape)
    cal, why = (None, "--recalibrate: measuring this machine again") if a.recalibrate else kept.load()
    measured = []
    if cal is None:
        print(f"commlab plan: {why}", file=sys.stderr)
        cal = C.calibrate(a.model, a.batch_size, None, input_shape=shape)
        measured.append("compute and server costs")
    transports = C.transports_from_run(run) if run else {}
    return (replace(cal, transports=transports, facts={**cal.facts, "run_dir": str(run) if run else None}), kept,
            measured)


def main(argv: list[str] | None = None) -> int:
    a = parser().parse_args(argv)
    try:
        workers = [int(x) for x in a.workers.split(",") if x.strip()]
        if not workers or min(workers) < 1:
            raise ConfigError("--workers: give positive worker counts, e.g. 8,64,512")
        regimes = [parse_regime(u) for u in a.regimes]
        topo = Topology(a.workers_per_host, parse_rate(a.link), parse_rate(a.intra), a.compute_scale,
                        parse_cpu_share(a.cpu_share, a.workers_per_host))
        straggler = Straggler.parse(a.straggler)
        kept_answer = answer_of(a)
        answer = kept_answer.load() if kept_answer is not None else None
        if kept_answer is not None and answer is not None:
            return write_kept_answer(a, argv, kept_answer, *answer)
        specs = compress_specs(a.compress)
        local = local_settings(a.local_steps)
        creg = next((r for r in regimes if r.transport == "ring"), next((r for r in regimes if r.kind == "allreduce"), None))
        cal, kept, measured = load_calibration(a)
        weigh = list(dict.fromkeys(specs + [spec for _, _, _, spec, _ in local if spec]))
        if weigh and creg is not None:
            from commlab.plan import compression as K
            had = set(cal.compressors)
            cal = K.with_compressors(cal, weigh, creg)
            new = [label for label in cal.compressors if label not in had]
            measured += [f"compressors {', '.join(new)}"] if new else []
    except (ConfigError, ValueError) as exc:
        print(f"commlab plan: {exc}", file=sys.stderr)
        return 2
    if kept is not None and measured:
        kept.save(cal)
        print(f"commlab plan: measured {'; '.join(measured)} on this machine; kept in {kept.path} for the next "
              f"call", file=sys.stderr)
    elif kept is not None:
        print(f"commlab plan: measured nothing: this machine's figures (measured {cal.facts.get('measured_utc')}) "
              f"kept in {kept.path} (--recalibrate measures again)", file=sys.stderr)
    if a.save_calibration:
        cal.save(a.save_calibration)
    t0 = time.perf_counter()
    plan = R.sweep(cal, topo, regimes, workers, a.batch_size, straggler, a.max_shards, a.seed)
    took = time.perf_counter() - t0
    out = Path(a.out or Path("runs") / time.strftime("plan-%Y%m%dT%H%M%SZ", time.gmtime()))
    out.mkdir(parents=True, exist_ok=True)
    png = R.plots(plan, out / "plan.png")
    text = ["# commlab plan", "", f"{command(argv)}; simulated in {took:.1f} s.", ""] + R.report(plan, cal, png)
    compression: dict = {}
    if specs:
        lines, compression = compression_section(cal, specs, creg, topo, workers, a.batch_size)
        text += lines
    local_data: dict = {}
    if local and creg is not None:
        from commlab.plan import localsteps as L
        settings = [L.LocalSteps(h, p_, t, cal.compressors[spec] if spec else None, by)
                    for h, p_, t, spec, by in local]
        lines, local_data = L.section(cal, settings, creg, topo, workers, specs, a.batch_size)
        text += lines
    doc = {
        "workers": workers, "regimes": [r.url for r in regimes], "batch": a.batch_size,
        "results": [{"regime": k[0], "workers": k[1], **(v.as_dict() if not isinstance(v, str) else {"error": v})}
                    for k, v in plan.results.items()],
        "crossovers": {str(k): v for k, v in plan.crossovers.items()}, "seconds": took,
        "compression": {"regime": creg.url if creg else None, "by_workers": {str(n): v for n, v in compression.items()}},
        "local_steps": {str(n): v for n, v in local_data.items()},
        "calibration": {"kept": str(kept.path) if kept else None, "measured_now": measured,
                        "measured_utc": cal.facts.get("measured_utc")}, "kept_answer": None}
    if answerable(a):  # kept under the calibration as it is now, with what this call measured
        KeptAnswer.of(cal, answer_options(a)).save(text[4:], doc, png)
    return write(out, text, doc, png)


def command(argv: list[str] | None) -> str:
    return f"`commlab plan {' '.join(argv if argv is not None else sys.argv[1:])}`"


def write(out: Path, text: list[str], doc: dict, png: Path | None) -> int:
    """plan.md (``text``) and plan.json (``doc``) into ``out`` (beside ``png``, drawn there); the plan on stdout."""
    (out / "plan.md").write_text("\n".join(text))
    (out / "plan.json").write_text(json.dumps(doc, indent=1, default=str))
    print("\n".join(text[4:]))
    print(f"\ncommlab plan: wrote {out}/plan.md, plan.json" + (", plan.png" if png else ""), file=sys.stderr)
    return 0


def answer_options(a) -> dict:
    """The options an answer depends on: all but where it is written and whether the figures were measured
    again (the calibration they make is in the key)."""
    return {k: v for k, v in sorted(vars(a).items()) if k not in ("out", "save_calibration", "recalibrate")}


def answerable(a) -> bool:
    """Whether this query's answer may be kept and read back: it rests on the kept calibration alone (no
    --calibration, --bench-run, --calibrate, and no --cpu-share measured now)."""
    return not (a.calibration or a.bench_run or a.calibrate or a.cpu_share.strip().lower() == "measure")


def answer_of(a) -> KeptAnswer | None:
    """Where this query's answer is kept, when it may be answered from the cache (:func:`answerable`, no
    --recalibrate, a calibration kept under this call's key); else None."""
    if a.recalibrate or not answerable(a):
        return None
    shape = tuple(int(x) for x in a.input_shape.split(",")) if a.input_shape else None
    cal, _ = Kept.of(a.model, a.batch_size, shape).load()
    if cal is None:
        return None
    return KeptAnswer.of(replace(cal, transports={}, facts={**cal.facts, "run_dir": None}), answer_options(a))


def write_kept_answer(a, argv, kept: KeptAnswer, body: list[str], doc: dict, png: Path | None) -> int:
    """Answer a repeated query from what :class:`KeptAnswer` kept of it: the same plan, table and picture as
    simulating it again gives (tests/test_plan_cache.py), none of it computed now."""
    out = Path(a.out or Path("runs") / time.strftime("plan-%Y%m%dT%H%M%SZ", time.gmtime()))
    out.mkdir(parents=True, exist_ok=True)
    if png is not None:
        png = Path(shutil.copyfile(png, out / "plan.png"))
    calibration = Kept.of(a.model, a.batch_size, tuple(int(x) for x in a.input_shape.split(","))
                          if a.input_shape else None)
    doc = {**doc, "calibration": {**doc["calibration"], "kept": str(calibration.path), "measured_now": []},
           "kept_answer": str(kept.path)}
    print(f"commlab plan: measured nothing: this machine's figures (measured {doc['calibration']['measured_utc']}) "
          f"kept in {calibration.path}; simulated nothing: this query's answer on them kept in {kept.path} "
          f"(--recalibrate measures again)", file=sys.stderr)
    text = ["# commlab plan", "", f"{command(argv)}; the same query's answer, kept from an earlier call "
            f"(simulated then in {doc['seconds']:.1f} s).", ""] + body
    return write(out, text, doc, png)


def local_settings(given: list[str]) -> list[tuple[int, int, int, str, str]]:
    """``--local-steps``: each as the URL's options (sync_every, fragments, fragment_by, overlap, compress), checked
    by the exchangers' own option rules; (H, P, T, compress spec or "", fragment_by)."""
    from urllib.parse import parse_qsl
    from commlab.base.config import ExchangerURL, parse_options
    from commlab.regimes.allreduce import AllReduceOptions
    out = []
    for text in given:
        keys = {k for k, _ in parse_qsl(text)}
        if not keys <= {"sync_every", "fragments", "fragment_by", "overlap", "compress"} or "sync_every" not in keys:
            raise ConfigError(f"--local-steps {text!r}: give sync_every=H and optionally fragments=, fragment_by=, "
                              f"overlap=, compress=")
        try:
            o = parse_options(AllReduceOptions, ExchangerURL.parse("allreduce://?" + text))
        except ConfigError as exc:
            raise ConfigError(f"--local-steps {text!r}: {exc}") from None
        out.append((o.sync_every, o.fragments, o.overlap, "" if o.compress in ("", "none") else o.compress,
                    o.fragment_by))
    return out


def compress_specs(given: list[str]) -> list[str]:
    """The ``--compress`` specs to weigh (none for ``none``); a bad one raises naming ``--compress``."""
    specs = [s.strip() for s in given if s.strip().lower() not in ("", "none")]
    from commlab.compress import build
    for spec in specs:
        try:
            build(spec)
        except ConfigError as exc:
            raise ConfigError(f"--compress {spec}: {exc}") from None
    return list(dict.fromkeys(specs))


def compression_section(cal: Calibration, specs: list[str], regime, topo: Topology, workers: list[int],
                        batch: int) -> tuple[list[str], dict]:
    """The plan's "Compression" section (markdown lines) and the predictions behind it."""
    if regime is None:
        return ["### Compression", "", "Not weighed: no all-reduce regime among --regimes (compression is modelled "
                "for ring:// and allreduce://).", ""], {}
    from commlab.plan import compression as K
    rows, data = K.table(cal, specs, regime, topo, workers, batch)
    head = [f"### Compression ({regime.url})", "",
            f"Each compressor measured on this model here (its bytes by closed form; encode and decode timed on its "
            f"buckets, with error feedback, once past its warm-up), its step predicted for identical workers "
            f"(docs/plan.md#compression). \"pays below\": the link rate under which its step beats the uncompressed "
            f"one. On loopback (the ranks on one machine) no compressor pays, measured: the link is memory, and "
            f"encoding costs more than the bytes it saves (docs/compress.md); the rates here are a NIC's.", ""]
    return head + rows + ["", "### Recommendation (compression)", ""] + K.recommend(data, topo) + [""], data


if __name__ == "__main__":
    sys.exit(main())
