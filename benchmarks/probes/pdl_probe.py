"""What programmatic dependent launch (PDL) saves between the kernels of a replayed CUDA graph.

A batch-1 decode step of bench qwen3_next is ~200 kernels of a few microseconds each; its replay
takes about 0.18 ms more than the sum of its kernels (benchmarks/kernels/step_account.py): the
launch gap between one kernel's end and the next one's start. Hopper's PDL lets a kernel launched
with the programmatic-serialization attribute start while the kernel before it drains: it runs up to
`gdc_wait()` (which returns once the kernel before has finished and its writes are visible), so its
launch, and any loads that do not depend on the kernel before (weights), overlap the tail of that
kernel. Triton launches a kernel that way with `launch_pdl=True`; Inductor emits the waits and
launches with `torch._inductor.config.triton.enable_pdl`. Whether a CUDA graph captured by torch
keeps the attribute, and what it saves per boundary, is what this probe measures:

1. chains of N dependent Triton kernels captured in one graph (each reads the buffer the one before
   wrote and writes the other of two), without PDL, with PDL (wait first), and with PDL where each
   kernel loads its own weight slice before the wait (the prefetch a GEMV can do); one program per
   kernel (launch-bound) and 132 programs each loading 8 KB of weights (a 1 MB GEMV-like read);
2. a chain of small reductions compiled by Inductor with and without `triton.enable_pdl`, captured
   the same way, and whether the generated code holds `gdc_wait`.

Every variant's result is checked against the value the chain must produce before it is timed.

    bash benchmarks/gpu_call.sh python3 benchmarks/probes/pdl_probe.py --out $OUT

Writes OUT/pdl_probe.json; prints one line per variant (median replay time, per kernel).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

import torch  # noqa: E402
import triton  # noqa: E402
import triton.language as tl  # noqa: E402

from bench_common import capture_graph, device_facts, time_ms  # noqa: E402

W_BLOCK = 4096  # bf16 weights one program loads: 8 KB; 132 programs read about 1 MB


@triton.jit
def _chain_kernel(src_ptr, dst_ptr, w_ptr, BLOCK: tl.constexpr, W_BLOCK: tl.constexpr,
                  PDL: tl.constexpr, PREFETCH: tl.constexpr, WEIGHTS: tl.constexpr):
    """dst[slice] = src[slice] + 1 (+ 0 * sum of this program's weight slice, kept so it is loaded)."""
    pid = tl.program_id(0)
    offs = pid * BLOCK + tl.arange(0, BLOCK)
    w_offs = pid * W_BLOCK + tl.arange(0, W_BLOCK)
    wsum = 0.0
    if WEIGHTS and PREFETCH:
        wsum = tl.sum(tl.load(w_ptr + w_offs).to(tl.float32), axis=0)  # independent of the kernel before
    if PDL:
        tl.extra.cuda.gdc_wait()
    if WEIGHTS and not PREFETCH:
        wsum = tl.sum(tl.load(w_ptr + w_offs).to(tl.float32), axis=0)
    x = tl.load(src_ptr + offs)
    tl.store(dst_ptr + offs, x + 1.0 + 0.0 * wsum)


def chain(n: int, programs: int, weights: bool, pdl: bool, prefetch: bool, device) -> dict:
    block = 128
    bufs = [torch.zeros(programs * block, device=device) for _ in range(2)]
    w = torch.randn(programs * W_BLOCK, device=device, dtype=torch.bfloat16) if weights else bufs[0]
    extra = {"launch_pdl": True} if pdl else {}

    def run():
        for i in range(n):
            _chain_kernel[(programs,)](bufs[i % 2], bufs[(i + 1) % 2], w, BLOCK=block, W_BLOCK=W_BLOCK,
                                       PDL=pdl, PREFETCH=prefetch, WEIGHTS=weights, num_warps=4, **extra)

    graph = capture_graph(run)
    for b in bufs:
        b.zero_()
    graph.replay()
    torch.cuda.synchronize()
    # From zeros, the last kernel wrote n into bufs[n % 2]; the one before n - 1 into the other.
    want = float(n)
    ok = bool((bufs[n % 2] == want).all()) and bool((bufs[(n + 1) % 2] == want - 1).all())
    ms = time_ms(graph.replay, device, iters=200, warmup=20) if ok else None
    return {"kernels": n, "programs": programs, "weights_mb": programs * W_BLOCK * 2 / 1e6 if weights else 0,
            "pdl": pdl, "prefetch": prefetch, "correct": ok, "ms": ms, "us_per_kernel": ms and ms * 1e3 / n}


def inductor_chain(n: int, pdl: bool, device) -> dict:
    """n rounds of x = x / (|x| + 1) + w_i: a reduction and a pointwise kernel each (Inductor cannot
    fuse across a full reduction), compiled with enable_pdl as asked, captured, replayed."""
    import torch._inductor.config as inductor_config
    from torch._inductor.utils import run_and_get_code

    ws = [torch.randn(4096, device=device) for _ in range(n)]

    def fn(x):
        for w in ws:
            x = x / (x.abs().sum() + 1.0) + w
        return x

    torch._dynamo.reset()
    with inductor_config.patch({"triton.enable_pdl": pdl, "triton.cudagraphs": False}):
        compiled = torch.compile(fn, dynamic=False)
        x = torch.randn(4096, device=device)
        out, codes = run_and_get_code(compiled, x)
    ref = fn(x)
    err = float((out - ref).norm() / ref.norm())
    code = "\n".join(codes)
    holder = {}

    def run():
        holder["y"] = compiled(x)

    graph = capture_graph(run)
    ms = time_ms(graph.replay, device, iters=200, warmup=20)
    return {"rounds": n, "pdl": pdl, "rel_err": err, "correct": err < 1e-5,
            "gdc_wait_in_code": code.count("gdc_wait"), "kernels_in_code": code.count("@triton.jit"),
            "ms": ms}


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--kernels", type=int, default=200)
    args = ap.parse_args(argv)
    device = torch.device("cuda")
    rec = {"env": {**device_facts(False), "triton": triton.__version__}, "chains": [], "inductor": []}
    for programs, weights in ((1, False), (132, True)):
        for pdl, prefetch in ((False, False), (True, False), (True, True)):
            if prefetch and not weights:
                continue
            try:
                row = chain(args.kernels, programs, weights, pdl, prefetch, device)
            except Exception as e:  # noqa: BLE001 (an older Triton has no launch_pdl: recorded, not fatal)
                row = {"programs": programs, "pdl": pdl, "prefetch": prefetch, "error": f"{type(e).__name__}: {e}"}
            rec["chains"].append(row)
            print(json.dumps(row), flush=True)
    for pdl in (False, True):
        try:
            row = inductor_chain(64, pdl, device)
        except Exception as e:  # noqa: BLE001
            row = {"pdl": pdl, "error": f"{type(e).__name__}: {e}"}
        rec["inductor"].append(row)
        print(json.dumps(row), flush=True)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "pdl_probe.json").write_text(json.dumps(rec, indent=1))
    return rec


if __name__ == "__main__":
    main()
