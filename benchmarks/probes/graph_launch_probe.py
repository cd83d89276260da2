r"""What one CUDA graph replay costs the host, by node count and node kind, and after a profiler.

A replayed decode step at batch 1 waits for the host twice: the step's own preparation, then the
graph launch itself (`CUDAGraph.replay`). That launch measured 0.145 ms for bench qwen3_next's
219-kernel step on an H200 (`bench_common.replay_host_split`) in runs that had profiled the step
before timing it. This probe asks what sets it: graphs of N tiny kernels, the same with D2D copies
(memcpy nodes), a uint8 `zero_`, cuBLAS GEMVs, cuBLAS GEMMs in the model's layout (x @ w.t(),
bf16, M = 1 or 8 rows: on Hopper cuBLAS picks its sm90 `nvjet` kernels for these, launched with
thread-block clusters, as in a real decode step), one Triton kernel or many distinct Triton
kernels (one module each) in place of some of them, one graph timed while many others are alive,
and one graph before and after a profile; the median host time of `replay()` next to the replay's
device time. Each row records how many nodes of each kind the graph holds (where two kinds ask
for the same position, the later one takes it).

    bash benchmarks/gpu_call.sh python3 benchmarks/probes/graph_launch_probe.py --out $OUT

The last rows time a plain graph before and after a torch.profiler session in the process: with
Kineto's default (CUPTI left subscribed after a profile), every later replay() costs the host about
0.05 ms and the device more time too; with TEARDOWN_CUPTI=1 nothing changes. Run it both ways:

    bash benchmarks/gpu_call.sh bash -c "TEARDOWN_CUPTI=0 python3 benchmarks/probes/graph_launch_probe.py --out \$OUT/t0; \
        TEARDOWN_CUPTI=1 python3 benchmarks/probes/graph_launch_probe.py --out \$OUT/t1"

Writes OUT/graph_launch_probe.json.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import statistics
import time
from pathlib import Path

import torch


DISTINCT_MAX = 40


@functools.cache
def _triton_adds() -> list:
    """DISTINCT_MAX launchers of distinct Triton kernels (one module each, as Inductor's and our
    backends' kernels are); each is built at its first launch, before any capture."""
    import triton
    import triton.language as tl

    @triton.jit
    def add_k(x_ptr, n, K: tl.constexpr, BLOCK: tl.constexpr):
        i = tl.arange(0, BLOCK)
        tl.store(x_ptr + i, tl.load(x_ptr + i, mask=i < n) + K, mask=i < n)
    return [functools.partial(add_k[(1,)], K=k + 1, BLOCK=64) for k in range(DISTINCT_MAX)]


def build(n: int, copies: int, fills: int, dev, gemms: int = 0, tritons: int = 0,
          distinct: int = 0, linears: int = 0, rows: int = 1) -> tuple[torch.cuda.CUDAGraph, list, dict]:
    """A graph of n nodes in one stream: elementwise kernels, with about `copies` D2D copies,
    `fills` uint8 zero_ calls, `gemms` cuBLAS GEMVs (bf16 [1,2048] x [2048,2048]), `tritons`
    launches of one Triton kernel, `distinct` launches of as many different Triton kernels and
    `linears` GEMMs in F.linear's layout (x @ w.t(), bf16 [rows,2048] by a [2048,2048] weight),
    spread evenly among them; returns (graph, its tensors, nodes per kind). A linear may launch
    more than one kernel (cuBLAS's split-K reduce): `linear_kernels` names what one launches."""
    a = torch.zeros(64, device=dev)
    b = torch.zeros(64, device=dev)
    c = torch.zeros(64, dtype=torch.uint8, device=dev)
    x = torch.randn(1, 2048, device=dev, dtype=torch.bfloat16)
    w = torch.randn(2048, 2048, device=dev, dtype=torch.bfloat16)
    y = torch.empty(1, 2048, device=dev, dtype=torch.bfloat16)
    xl = torch.randn(rows, 2048, device=dev, dtype=torch.bfloat16)
    yl = torch.empty(rows, 2048, device=dev, dtype=torch.bfloat16)
    special = {}
    for kind, count, shift in (("copy", copies, 0), ("fill", fills, 1), ("gemm", gemms, 2), ("triton", tritons, 3),
                               ("distinct", distinct, 4), ("linear", linears, 5)):
        for i in range(count):
            special[min(n - 1, (i * n) // count + shift)] = kind
    kernels = _triton_adds()[:max(distinct, 1 if tritons else 0)]
    for launch in kernels:
        launch(a, 64)  # each built before the capture
    if gemms:
        torch.mm(x, w, out=y)  # cuBLAS's handle and workspace, made before the capture
    if linears:
        torch.mm(xl, w.t(), out=yl)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    used = 0  # distinct kernels launched so far
    with torch.cuda.graph(g, stream=s):
        for i in range(n):
            kind = special.get(i)
            if kind == "copy":
                b.copy_(a)  # a D2D copy: a memcpy node
            elif kind == "fill":
                c.zero_()  # uint8 zero: torch may issue it as a memset node
            elif kind == "gemm":
                torch.mm(x, w, out=y)
            elif kind == "linear":
                torch.mm(xl, w.t(), out=yl)  # what F.linear runs, into a static output
            elif kind == "triton":
                kernels[0](a, 64)  # the same kernel each time
            elif kind == "distinct":
                kernels[used % len(kernels)](a, 64)
                used += 1
            else:
                a.add_(1)
    torch.cuda.synchronize()
    kinds = [special.get(i, "add") for i in range(n)]
    return g, [a, b, c, x, w, y, xl, yl], {k: kinds.count(k) for k in ("add", "copy", "fill", "gemm", "triton",
                                                                         "distinct", "linear")}


def linear_kernels(rows: int, dev) -> list[str]:
    """The kernels one bf16 x @ w.t() (F.linear's GEMM) of `rows` rows by a [2048, 2048] weight launches (profiler names)."""
    x = torch.randn(rows, 2048, device=dev, dtype=torch.bfloat16)
    w = torch.randn(2048, 2048, device=dev, dtype=torch.bfloat16)
    torch.mm(x, w.t())
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        torch.mm(x, w.t())
        torch.cuda.synchronize()
    return [e.name[:80] for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]


def time_replay(g: torch.cuda.CUDAGraph, iters: int) -> dict:
    host, device, wall = [], [], []
    for _ in range(5):
        g.replay()
    torch.cuda.synchronize()
    for _ in range(iters):
        e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        t0 = time.perf_counter()
        e0.record()
        t1 = time.perf_counter()
        g.replay()
        t2 = time.perf_counter()
        e1.record()
        e1.synchronize()
        t3 = time.perf_counter()
        host.append((t2 - t1) * 1e3)
        device.append(e0.elapsed_time(e1))
        wall.append((t3 - t0) * 1e3)
    return {"replay_host_ms": statistics.median(host), "events_ms": statistics.median(device),
            "wall_ms": statistics.median(wall)}


def report(row: dict) -> None:
    print(f"  {row['nodes']} nodes {row['held']}{', %d other graphs alive' % row['other_graphs_alive'] if 'other_graphs_alive' in row else ''}"
          f"{', after a profile' if row.get('after_profiler') else ''}: "
          f"replay() {row['replay_host_ms']:.4f} ms on the host, {row['events_ms']:.4f} ms between events, "
          f"{row['wall_ms']:.4f} ms wall", flush=True)


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", required=True)
    p.add_argument("--iters", type=int, default=200)
    p.add_argument("--other-graphs", type=int, default=40, help="graphs kept alive beside the one timed last")
    args = p.parse_args(argv)
    dev = torch.device("cuda")
    rows = []
    for n, copies, fills, gemms, tritons, distinct in (
            (50, 0, 0, 0, 0, 0), (220, 0, 0, 0, 0, 0), (500, 0, 0, 0, 0, 0), (220, 1, 0, 0, 0, 0),
            (220, 20, 0, 0, 0, 0), (220, 0, 1, 0, 0, 0), (220, 0, 0, 50, 0, 0), (220, 0, 0, 0, 100, 0),
            (220, 20, 1, 50, 100, 0), (220, 0, 0, 0, 0, 10), (220, 0, 0, 0, 0, 40)):
        g, keep, held = build(n, copies, fills, dev, gemms, tritons, distinct)
        row = {"nodes": n, "held": held, **time_replay(g, args.iters)}
        rows.append(row)
        report(row)
        del g, keep
    # cuBLAS's GEMMs in the layout of a decode step's projections, 40 of 220 calls (a bench decode
    # step holds about 40 such kernels), at 1 and 8 rows, and the same with elementwise adds only
    for m in (1, 8):
        for linears in (0, 10, 40):
            g, keep, held = build(220, 0, 0, dev, linears=linears, rows=m)
            row = {"nodes": 220, "held": held, "linear_rows": m, **time_replay(g, args.iters)}
            rows.append(row)
            report(row)
            del g, keep
    # Many graphs alive at once, as a runner's buckets and pieces are: whether launching one of them
    # costs more when others hold their own device resources.
    g, keep, held = build(220, 0, 0, dev)
    others = [build(220, 0, 0, dev) for _ in range(args.other_graphs)]
    row = {"nodes": 220, "held": held, "other_graphs_alive": len(others), **time_replay(g, args.iters)}
    rows.append(row)
    report(row)
    del g, keep, others
    # The same plain graph before and after this process's first torch.profiler session: Kineto
    # keeps CUPTI subscribed after a profile unless TEARDOWN_CUPTI=1, and a subscribed CUPTI slows
    # every later launch. Every row above ran before any profile.
    g, keep, held = build(220, 0, 0, dev)
    for after in (False, True):
        if after:
            with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]):
                g.replay()
                torch.cuda.synchronize()
        row = {"nodes": 220, "held": held, "after_profiler": after, **time_replay(g, args.iters)}
        rows.append(row)
        report(row)
    del g, keep
    # What cuBLAS launched for the linear rows (a profiler's names): looked up last, after every timing
    for row in rows:
        if row.get("held", {}).get("linear"):
            row["kernels_per_linear"] = linear_kernels(row["linear_rows"], dev)
    doc = {"card": torch.cuda.get_device_name(dev), "torch": torch.__version__, "cuda": torch.version.cuda,
           "TEARDOWN_CUPTI": os.environ.get("TEARDOWN_CUPTI"), "rows": rows}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "graph_launch_probe.json").write_text(json.dumps(doc, indent=1))
    return doc


if __name__ == "__main__":
    main()
