"""``commlab trace summarize trace.json [--json]``, ``commlab trace merge DIR``: where a step's time went.

Reads a timeline ``commlab run --trace DIR`` merged (docs/trace.md), one process's file of it, or
torch.profiler's Chrome trace of plain DDP over gloo (``export_chrome_trace``), and says per regime
and step, over the ranks:

- **compute**: the step's time on the training thread less the time it was blocked;
- **exposed communication**: the time the training thread was blocked on the exchange (commlab:
  its ``blocked`` spans, which are the step report's ``wait_s``; DDP: the time its gloo/c10d spans ran
  while the training thread was not computing, see below);
- **overlap**: the share of the communication (the union of every comm span of the rank, on any
  thread) that ran while backward was computing;
- **critical path**: the communication items still running after backward ended on the rank whose
  step ended last, longest first;
- **straggler**: the rank whose backward ended last, the most often over the steps (clocks aligned
  by the merge);
- **links**: each link's achieved rate: the bytes its sends carried over the time the link was busy
  (from a send to the end of the collective or the reply that completes it).

DDP (torch.profiler, gloo): steps are its ``ProfilerStep#N`` spans; communication is every span whose
name starts with ``gloo:`` or ``c10d::`` (on any thread); the training thread (the one holding the
steps) computes in the spans directly below a step, except while a communication span of its own
runs (launching a collective); the exposed communication is the part of the communication's union
that no computing time covers (DDP's wait for its buckets is a gap on the training thread);
backward is the ``autograd::engine::evaluate_function`` spans.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from bisect import bisect_left, bisect_right
from collections import Counter, defaultdict

from commlab.base import trace as tracemod

Interval = tuple[float, float]


# ----- intervals --------------------------------------------------------------------------------------
def union(spans) -> list[Interval]:
    """Sorted, disjoint intervals covering ``spans``."""
    out: list[list[float]] = []
    for a, b in sorted(spans):
        if b <= a:
            continue
        if out and a <= out[-1][1]:
            out[-1][1] = max(out[-1][1], b)
        else:
            out.append([a, b])
    return [(a, b) for a, b in out]


def length(spans: list[Interval]) -> float:
    return sum(b - a for a, b in spans)


def intersect(x: list[Interval], y: list[Interval]) -> list[Interval]:
    """Intersection of two unions (each sorted and disjoint)."""
    out, i, j = [], 0, 0
    while i < len(x) and j < len(y):
        a, b = max(x[i][0], y[j][0]), min(x[i][1], y[j][1])
        if a < b:
            out.append((a, b))
        if x[i][1] < y[j][1]:
            i += 1
        else:
            j += 1
    return out


def clip(spans: list[Interval], lo: float, hi: float) -> list[Interval]:
    return [(max(a, lo), min(b, hi)) for a, b in spans if b > lo and a < hi]


# ----- reading ----------------------------------------------------------------------------------------
def load(path: str) -> dict:
    with open(path) as fh:
        doc = json.load(fh)
    if isinstance(doc, list):  # the JSON array form of the format
        doc = {"traceEvents": doc}
    return doc


def _spans(events) -> list[dict]:
    return [e for e in events if e.get("ph") == "X" and "dur" in e]


def summarize(doc: dict) -> dict:
    """The summary of a trace document (see the module docstring), as plain data."""
    events = doc.get("traceEvents", [])
    if isinstance(doc.get("otherData"), dict) and "commlab" in doc["otherData"]:
        return _summarize_commlab(doc, events)
    return _summarize_torch(events)


def _summarize_commlab(doc: dict, events) -> dict:
    meta = doc["otherData"]["commlab"]
    spans = _spans(events)
    by_pid: dict[int, list[dict]] = defaultdict(list)
    for e in spans:
        by_pid[e["pid"]].append(e)
    names = {e["pid"]: e["args"]["name"] for e in events if e.get("ph") == "M" and e.get("name") == "process_name"}
    processes = meta.get("processes") or {meta.get("process", "?"): meta}
    regimes = sorted({r["scheme"] for m in processes.values() for r in m.get("regimes", [])}) or ["?"]
    ranks = sorted(p for p in by_pid if p < tracemod.SHARD_PID)
    shards = sorted(p for p in names if p >= tracemod.SHARD_PID)
    per_step: dict[int, dict[int, dict]] = defaultdict(dict)  # step -> rank -> numbers
    for pid in ranks:
        mine = by_pid[pid]
        steps = [e for e in mine if e["name"] == "step" and e.get("cat") == "step"]
        if not steps:
            continue
        main = steps[0]["tid"]
        on_main = sorted((e for e in mine if e["tid"] == main), key=lambda e: e["ts"])
        main_ts = [e["ts"] for e in on_main]
        # commlab's own, and (--trace-torch) torch.distributed's gloo/c10d spans, which allreduce:// runs unseen
        comm_all = union((e["ts"], e["ts"] + e["dur"]) for e in mine
                         if e.get("cat") == "comm" or e.get("cat") == "torch" and is_comm(e["name"]))
        comm_ts = [a for a, _ in comm_all]
        # the items a critical path names: the ring's collectives, else (ps://) each send and receive
        top = [e for e in mine if e["name"] == "collective"] or \
            [e for e in mine if e.get("cat") == "comm" and e["tid"] != main]
        top.sort(key=lambda e: e["ts"])
        top_ts = [e["ts"] for e in top]
        for st in steps:
            lo, hi = st["ts"], st["ts"] + st["dur"]
            inside = [e for e in on_main[bisect_left(main_ts, lo):bisect_right(main_ts, hi)]
                      if e["ts"] + e["dur"] <= hi]
            blocked = [e for e in inside if e.get("cat") == "blocked"]
            backward = union((e["ts"], e["ts"] + e["dur"]) for e in inside if e["name"] == "backward")
            first = max(0, bisect_right(comm_ts, lo) - 1)
            comm = clip(comm_all[first:bisect_right(comm_ts, hi)], lo, hi)
            exposed = sum(e["dur"] for e in blocked)
            hidden = length(intersect(comm, backward))
            bwd_end = backward[-1][1] if backward else None
            stop = max((e["ts"] + e["dur"] for e in blocked), default=hi)
            crit = []
            if bwd_end is not None:
                for e in top[bisect_left(top_ts, lo):bisect_right(top_ts, stop)]:
                    past = min(e["ts"] + e["dur"], stop) - max(e["ts"], bwd_end)
                    if past > 0:
                        crit.append((past, e))
            per_step[st["args"]["step"]][pid] = {
                "step_us": st["dur"], "exposed_us": exposed, "compute_us": st["dur"] - exposed,
                "comm_us": length(comm), "hidden_us": hidden, "backward_end": bwd_end, "end": hi,
                "critical": crit}
    rows = []
    straggle: Counter = Counter()
    for step in sorted(per_step):
        got = per_step[step]
        ends = {p: v["backward_end"] for p, v in got.items() if v["backward_end"] is not None}
        straggler = max(ends, key=ends.__getitem__) if len(ends) > 1 else None
        if straggler is not None:
            straggle[straggler] += 1
        last = max(got, key=lambda p: got[p]["end"])
        crit = sorted(got[last]["critical"], key=lambda pe: -pe[0])[:3]
        comm = sum(v["comm_us"] for v in got.values())
        rows.append({"step": step, "ranks": len(got),
                     "step_ms": statistics.mean(v["step_us"] for v in got.values()) / 1e3,
                     "compute_ms": statistics.mean(v["compute_us"] for v in got.values()) / 1e3,
                     "exposed_ms": statistics.mean(v["exposed_us"] for v in got.values()) / 1e3,
                     "comm_ms": comm / len(got) / 1e3,
                     "overlap": (sum(v["hidden_us"] for v in got.values()) / comm) if comm else None,
                     "straggler": names.get(straggler, straggler) if straggler is not None else None,
                     "critical": [{"rank": names.get(last, last), "item": _label(e), "ms": past / 1e3}
                                  for past, e in crit],
                     "per_rank": {names.get(p, str(p)): {"exposed_ms": v["exposed_us"] / 1e3,
                                                         "compute_ms": v["compute_us"] / 1e3,
                                                         "overlap": v["hidden_us"] / v["comm_us"] if v["comm_us"] else None}
                                  for p, v in got.items()}})
    return {"source": "commlab", "regimes": regimes, "ranks": [names.get(p, str(p)) for p in ranks],
            "shards": [names.get(p, str(p)) for p in shards], "steps": rows,
            "straggler": {names.get(p, str(p)): n for p, n in straggle.most_common()},
            "links": _links(by_pid, names), "clocks": meta.get("clocks", {}),
            "totals": _totals(rows)}


def _label(e: dict) -> str:
    a = e.get("args", {})
    what = a.get("what") or " ".join(str(a[k]) for k in ("op", "peer") if k in a)
    return f"{e['name']} {what}".strip()


def _links(by_pid: dict[int, list[dict]], names: dict) -> dict:
    """Each link's bytes and achieved rate: a send's bytes count over the time from its start to the end of
    the collective around it (ring) or of the receive of the same request (ps://)."""
    busy: dict[str, list[Interval]] = defaultdict(list)
    moved: Counter = Counter()
    for pid, mine in by_pid.items():
        src = names.get(pid, str(pid)).replace(" ", "")
        collectives = defaultdict(list)
        replies = {}
        for e in mine:
            if e["name"] == "collective":
                collectives[e["tid"]].append(e)
            elif e["name"] == "recv" and "id" in e.get("args", {}):
                replies[(e["tid"], e["args"]["id"])] = e
        for e in mine:
            a = e.get("args", {})
            if e["name"] != "send" or not a.get("bytes") or "peer" not in a:
                continue
            link = f"{src}->{a['peer']}"
            end = e["ts"] + e["dur"]
            around = next((c for c in collectives.get(e["tid"], ()) if c["ts"] <= e["ts"] <= c["ts"] + c["dur"]), None)
            if around is not None:
                end = around["ts"] + around["dur"]
            elif (e["tid"], a.get("id")) in replies:
                r = replies[(e["tid"], a["id"])]
                end = r["ts"] + r["dur"]
            busy[link].append((e["ts"], end))
            moved[link] += a["bytes"]
    out = {}
    for link in sorted(moved):
        t = length(union(busy[link])) / 1e6
        out[link] = {"bytes": moved[link], "busy_s": t, "MiB_per_s": moved[link] / 2**20 / t if t else None}
    return out


def _totals(rows: list[dict]) -> dict:
    if not rows:
        return {}
    comm = sum(r["comm_ms"] for r in rows)
    hidden = sum(r["comm_ms"] * r["overlap"] for r in rows if r["overlap"] is not None)
    return {"steps": len(rows), "step_ms": statistics.median(r["step_ms"] for r in rows),
            "compute_ms": statistics.median(r["compute_ms"] for r in rows),
            "exposed_ms": statistics.median(r["exposed_ms"] for r in rows),
            "overlap": hidden / comm if comm else None}


# ----- torch.profiler's trace of DDP --------------------------------------------------------------------
COMM_PREFIXES = ("gloo:", "c10d::")


def is_comm(name: str) -> bool:
    return name.startswith(COMM_PREFIXES)


def _summarize_torch(events) -> dict:
    spans = _spans(events)
    steps = [e for e in spans if e["name"].startswith("ProfilerStep#")]
    rows = []
    for pid in sorted({e["pid"] for e in steps}, key=str):
        mine = [e for e in spans if e["pid"] == pid]
        for st in sorted((e for e in steps if e["pid"] == pid), key=lambda e: e["ts"]):
            m = ddp_step(mine, st)
            rows.append({"step": int(st["name"].split("#")[1]), "ranks": 1, "process": pid,
                         "step_ms": st["dur"] / 1e3, "compute_ms": (st["dur"] - m["exposed_us"]) / 1e3,
                         "exposed_ms": m["exposed_us"] / 1e3, "comm_ms": m["comm_us"] / 1e3,
                         "overlap": m["hidden_us"] / m["comm_us"] if m["comm_us"] else None,
                         "straggler": None, "critical": m["critical"], "per_rank": {}})
    return {"source": "torch.profiler", "regimes": ["ddp"], "ranks": sorted({str(r["process"]) for r in rows}),
            "shards": [], "steps": rows, "straggler": {}, "links": {}, "clocks": {}, "totals": _totals(rows)}


def ddp_step(spans: list[dict], st: dict) -> dict:
    """One ProfilerStep of a DDP trace (the module's docstring): comm = the union of gloo:/c10d:: spans in it
    (any thread); compute = the training thread's spans directly below the step, less the communication
    spans on that thread (launching a collective is communication); exposed = comm less compute; hidden =
    comm that ran while an autograd backward span ran."""
    lo, hi = st["ts"], st["ts"] + st["dur"]
    inside = [e for e in spans if lo <= e["ts"] < hi and e is not st]
    comm = clip(union((e["ts"], e["ts"] + e["dur"]) for e in inside if is_comm(e["name"])), lo, hi)
    main = sorted((e for e in inside if e["tid"] == st["tid"]), key=lambda e: (e["ts"], -e["dur"]))
    top, end = [], lo
    for e in main:  # directly below the step: not inside the last top-level span
        if e["ts"] >= end:
            top.append(e)
            end = e["ts"] + e["dur"]
    launched = union((e["ts"], e["ts"] + e["dur"]) for e in main if is_comm(e["name"]))
    compute = minus(union((e["ts"], e["ts"] + e["dur"]) for e in top if not is_comm(e["name"])), launched)
    backward = union((e["ts"], e["ts"] + e["dur"]) for e in top if e["name"].startswith(BACKWARD))
    exposed = length(comm) - length(intersect(comm, compute))
    after = backward[-1][1] if backward else lo
    crit = sorted(((length(clip([(e["ts"], e["ts"] + e["dur"])], after, hi)), e) for e in inside if is_comm(e["name"])),
                  key=lambda pe: -pe[0])[:3]
    return {"comm_us": length(comm), "exposed_us": exposed, "hidden_us": length(intersect(comm, backward)),
            "critical": [{"rank": "ddp", "item": e["name"], "ms": past / 1e3} for past, e in crit if past > 0]}


BACKWARD = "autograd::engine::evaluate_function"


def minus(x: list[Interval], y: list[Interval]) -> list[Interval]:
    """``x`` less ``y`` (both unions)."""
    out = []
    for a, b in x:
        for c, d in y:
            if d <= a or c >= b:
                continue
            if c > a:
                out.append((a, c))
            a = max(a, d)
            if a >= b:
                break
        if a < b:
            out.append((a, b))
    return out


# ----- the text --------------------------------------------------------------------------------------
def render(s: dict, limit: int = 10) -> str:
    lines = [f"{s['source']} timeline: {', '.join(s['regimes'])}; ranks {', '.join(s['ranks']) or '-'}"
             + (f"; shards {', '.join(s['shards'])}" if s["shards"] else "")]
    t = s["totals"]
    if t:
        ov = f"{100 * t['overlap']:.0f}%" if t["overlap"] is not None else "-"
        lines.append(f"{t['steps']} steps, medians over steps (mean over ranks): step {t['step_ms']:.2f} ms, "
                     f"compute {t['compute_ms']:.2f} ms, exposed communication {t['exposed_ms']:.2f} ms; "
                     f"overlap {ov} of the communication hidden behind backward")
    lines.append(f"{'step':>5} {'step ms':>9} {'compute':>9} {'exposed':>9} {'comm':>9} {'overlap':>8}  straggler  "
                 f"critical path (after backward)")
    rows = s["steps"]
    shown = rows if len(rows) <= limit else rows[:limit // 2] + rows[-(limit - limit // 2):]
    for r in shown:
        ov = f"{100 * r['overlap']:.0f}%" if r["overlap"] is not None else "-"
        crit = "; ".join(f"{c['item']} {c['ms']:.2f} ms" for c in r["critical"]) or "-"
        lines.append(f"{r['step']:>5} {r['step_ms']:>9.2f} {r['compute_ms']:>9.2f} {r['exposed_ms']:>9.2f} "
                     f"{r['comm_ms']:>9.2f} {ov:>8}  {str(r['straggler'] or '-'):9}  {crit}")
    if len(rows) > len(shown):
        lines.append(f"  ({len(rows) - len(shown)} steps not shown; --json has them all)")
    if s["straggler"]:
        lines.append("backward ended last: " + ", ".join(f"{p} in {n} step(s)" for p, n in s["straggler"].items()))
    for link, v in s["links"].items():
        rate = f"{v['MiB_per_s']:.0f} MiB/s" if v["MiB_per_s"] else "-"
        lines.append(f"link {link}: {v['bytes'] / 2**20:.1f} MiB in {v['busy_s'] * 1e3:.1f} ms busy, {rate}")
    unc = [v.get("uncertainty_ns") for v in s["clocks"].values() if v.get("uncertainty_ns")]
    if unc:
        lines.append(f"clocks aligned to {max(unc) / 1e3:.0f} us or better (the merge's worst uncertainty)")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="commlab trace", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="cmd", required=True)
    s = sub.add_parser("summarize", help="per step: compute, exposed communication, overlap, critical path, "
                                         "straggler, link rates")
    s.add_argument("path", help="trace.json (merged), one process's file, or torch.profiler's trace of DDP")
    s.add_argument("--json", action="store_true", help="the summary as JSON")
    s.add_argument("--rows", type=int, default=10, help="steps shown in the text")
    m = sub.add_parser("merge", help="merge DIR/*.json (a job started by torchrun) into DIR/trace.json")
    m.add_argument("dir")
    a = p.parse_args(argv)
    if a.cmd == "merge":
        out = tracemod.merge(a.dir)
        if out is None:
            print(f"commlab trace merge: no timeline files in {a.dir}", file=sys.stderr)
            return 2
        print(out)
        return 0
    try:
        doc = load(a.path)
    except (OSError, ValueError) as exc:
        print(f"commlab trace summarize: cannot read {a.path}: {exc}", file=sys.stderr)
        return 2
    summary = summarize(doc)
    print(json.dumps(summary, indent=1) if a.json else render(summary, a.rows))
    return 0


if __name__ == "__main__":
    from commlab.launch.exiting import exit_now

    exit_now(main())
