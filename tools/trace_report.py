#!/usr/bin/env python3
"""Summarise a kvbridge timeline (KVB_TRACE=FILE) request by request.

Each request is the window of an anchor span (default `client.ttft`, the bench ladder's HTTP
request; `decode.request` for a decode node's own file). For every span name seen inside the
window it prints how many there were, when the first began and the last ended (ms from the
anchor's start), their summed and longest durations: where a request's time went, in order.
Several files (a prefill node's and a decode node's on one host) share the monotonic clock and
are read as one timeline.

usage: tools/trace_report.py TRACE.json [MORE.json ...] [--anchor NAME] [--min-ms M] [--last N]
"""
import argparse
import json
import sys


def load(paths):
    spans = []
    for p in paths:
        with open(p) as f:
            d = json.load(f)
        for e in d.get("traceEvents", []):
            if e.get("ph") == "X":
                spans.append((e["name"], e["ts"] / 1e3, (e["ts"] + e["dur"]) / 1e3, e.get("args", {}).get("a", 0)))
        dropped = d.get("otherData", {}).get("dropped", 0)
        if dropped:
            print(f"{p}: {dropped} spans were dropped (raise KVB_TRACE_MAX_SPANS)", file=sys.stderr)
    spans.sort(key=lambda s: s[1])
    return spans


def report(spans, anchor, min_ms, last):
    anchors = [s for s in spans if s[0] == anchor]
    if not anchors:
        names = sorted({s[0] for s in spans})
        sys.exit(f"no '{anchor}' spans in the trace; it has: {', '.join(names) or 'no spans'} "
                 "(a decode node's own file: --anchor decode.request; bench ladder: client.ttft)")
    for a in anchors[-last:] if last else anchors:
        _, a0, a1, arg = a
        rows = {}
        for name, t0, t1, _ in spans:
            if name == anchor or t1 < a0 or t0 > a1:
                continue
            r = rows.setdefault(name, [0, t0, t1, 0.0, 0.0])
            r[0] += 1
            r[1] = min(r[1], t0)
            r[2] = max(r[2], t1)
            r[3] += t1 - t0
            r[4] = max(r[4], t1 - t0)
        print(f"\n{anchor} (arg {arg}): {a1 - a0:.3f} ms")
        print(f"  {'span':<24} {'count':>6} {'first start':>12} {'last end':>10} {'sum ms':>9} {'max ms':>8}")
        for name, (n, t0, t1, tot, mx) in sorted(rows.items(), key=lambda kv: kv[1][1]):
            if tot < min_ms and t1 - t0 < min_ms:
                continue
            print(f"  {name:<24} {n:>6} {t0 - a0:>12.3f} {t1 - a0:>10.3f} {tot:>9.3f} {mx:>8.3f}")


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("files", nargs="+")
    ap.add_argument("--anchor", default="client.ttft")
    ap.add_argument("--min-ms", type=float, default=0.0, help="hide names whose sum and extent are below this")
    ap.add_argument("--last", type=int, default=0, help="only the last N anchors")
    a = ap.parse_args()
    report(load(a.files), a.anchor, a.min_ms, a.last)


if __name__ == "__main__":
    main()
