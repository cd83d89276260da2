"""A layer's pace on the host and on the device, read from a step's Chrome trace (step_account.py --timeline).

    python benchmarks/kernels/trace_cadence.py TRACE.json.gz --kernel _short_conv_extend
    python benchmarks/kernels/trace_cadence.py TRACE.json.gz --host-from 4960 --host-to 5640

`--kernel NAME`: each launch of a kernel whose name contains NAME (one a layer: the extend conv of a
GDN layer, say), in the timed call's order: when the host launched it and when the device started
it (us from the call's start), the device's lag behind the host, and the host's and the device's
time since the kernel's last launch. Where the device lag stays small while the host's pace
matches the device's, the card waits on the host. `--host-from/--host-to`: every host event (torch
ops, CUDA runtime and driver calls, with the kernel each launch started) in that window of the call,
to see where the host's time between two launches goes. `--call N`: which of the trace's timed calls
(`acct-call|N` ranges; default 1, the second, after a warm one).
"""

from __future__ import annotations

import argparse
import gzip
import json
import sys

CALL = "acct-call|"


def load(path: str, call: int) -> tuple[list[dict], float, float]:
    """The trace's complete events and the timed call's start and end (us)."""
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rt") as f:
        events = [e for e in json.load(f)["traceEvents"] if e.get("ph") == "X"]
    calls = sorted((e for e in events if e.get("cat") == "user_annotation" and e["name"].startswith(CALL)),
                   key=lambda e: e["ts"])
    if call >= len(calls):
        raise SystemExit(f"{path}: {len(calls)} timed calls ({CALL}N ranges), no call {call}")
    return events, calls[call]["ts"], calls[call]["ts"] + calls[call]["dur"]


def launches(events: list[dict]) -> dict:
    """correlation id -> the runtime or driver call that launched it."""
    return {e["args"]["correlation"]: e for e in events
            if e.get("cat") in ("cuda_runtime", "cuda_driver") and "correlation" in e.get("args", {})}


def cadence(events, start: float, end: float, name: str) -> list[dict]:
    by_id = launches(events)
    rows, last = [], None
    for k in sorted((e for e in events if e.get("cat") == "kernel" and name in e["name"]), key=lambda e: e["ts"]):
        host = by_id.get(k["args"].get("correlation"))
        if host is None or not start <= host["ts"] <= end:
            continue
        row = {"host_us": host["ts"] - start, "device_us": k["ts"] - start, "lag_us": k["ts"] - host["ts"],
               "host_step_us": None if last is None else host["ts"] - last[0],
               "device_step_us": None if last is None else k["ts"] - last[1], "kernel": k["name"]}
        rows.append(row)
        last = (host["ts"], k["ts"])
    return rows


def host_window(events, start: float, a: float, b: float) -> list[tuple]:
    started = {e["args"].get("correlation"): e["name"] for e in events
               if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")}
    found = [e for e in events if e.get("cat") in ("cpu_op", "cuda_runtime", "cuda_driver")
             and a <= e["ts"] - start <= b]
    return [(e["ts"] - start, e["dur"], e["cat"], e["name"], started.get(e.get("args", {}).get("correlation"), ""))
            for e in sorted(found, key=lambda e: (e["ts"], -e["dur"]))]


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__.split("\n\n", 2)[2])
    p.add_argument("trace", help="a step_account.py --timeline trace (timeline_*.json.gz)")
    p.add_argument("--kernel", help="the cadence of the kernels whose name contains this")
    p.add_argument("--host-from", type=float, help="list the host's events from this many us into the call")
    p.add_argument("--host-to", type=float, help="... up to this many")
    p.add_argument("--call", type=int, default=1, help="which timed call (default 1)")
    args = p.parse_args(argv)
    if not args.kernel and args.host_from is None:
        p.error("name --kernel or --host-from/--host-to")
    events, start, end = load(args.trace, args.call)
    print(f"call {args.call}: {end - start:.0f} us")
    if args.kernel:
        for r in cadence(events, start, end, args.kernel):
            steps = "" if r["host_step_us"] is None else f"  host +{r['host_step_us']:.0f}  device +{r['device_step_us']:.0f}"
            print(f"host {r['host_us']:8.0f}  device {r['device_us']:8.0f}  lag {r['lag_us']:6.0f}{steps}  "
                  f"{r['kernel'][:50]}")
    if args.host_from is not None:
        for t, dur, cat, name, kernel in host_window(events, start, args.host_from, args.host_to or end - start):
            print(f"{t:9.1f} {dur:7.1f}  {cat:12s} {name[:32]:32s} {kernel[:50]}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
