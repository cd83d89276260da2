"""The fused MoE's bookkeeping around its expert GEMMs (the sort and the combine; issue 51), new
kernels against the ones before, at the bench layer: one command, checks first, JSON to --out.

    python3 benchmarks/kernels/moe_bookkeeping.py --out $OUT             # GPU
    python3 benchmarks/kernels/moe_bookkeeping.py --dry-run --out /tmp/b   # CPU: interpreter, tiny dims

The layer is gpu_moe.py's e16 (bench qwen3_next's MoE: D 2048, I 512, E 16 top-4, a gated shared
expert of width 512, so 5 slots and 17 sorted experts; bf16), at T = 32, 512, 4096 (--tokens).
For each T, first the checks (exact: the layout and the sums have one right answer):
- new and old sort_tokens against testkit.moe_checks.sorted_layout_reference, at the step's BLOCK_M;
- new and old combine against combine_reference, bit for bit (float32 rows), and each other (bf16);
- the fused op against moe_reference (float32, CPU) to gpu_moe's tolerance, and the old composition
  bit for bit (same GEMMs on the same layout, same slot-order sum).
Then times (each alone in a CUDA graph, median us, moe_layers.Bench):
- sort: sort_tokens at its defaults (one program up to 256 pairs, blocks of 128 whose programs
  count every pair themselves to SCAN_MAX_PAIRS, past that blocks of 512 counted first); at block_p
  64 .. 2048 scanned (to SCAN_MAX_PAIRS pairs) and `_counted` (a count kernel first);
  sort_unscanned: the defaults before the scanned blocks (one program up to 1024 pairs, else blocks
  of 1024 counted first); sort_counted_ranks: the default with each block's ranks counted instead of sorted
  (sort_ranks="counted"); sort_before: the kernel before (one program per expert scanning every pair) with its
  counts already made (the op before had the router's atomics make them after a zero fill);
  sort_before_counting: that plus the zero fill and a scatter_add counting (sort_tokens before,
  called without counts);
- combine and combine_before, with the bytes each moves (live y rows read, out written) over the
  run's copy rate (bench_common.device_rates);
- fused: the whole op; fused_before: the op composed as before (router, zero fill and scatter_add
  counts standing in for the router's atomics, old sort, the same GEMMs, old combine), so its
  launch count is one over the op before; kernels: device kernels per fused call (profiler).
The kernels before live in this file only (the `_before` ones below), as
runtime/backends/kernels/moe.py had them before the sort went parallel over pair blocks.
"""

from __future__ import annotations

import os
import sys

if "--dry-run" in sys.argv:
    os.environ["TRITON_INTERPRET"] = "1"  # before triton is imported anywhere

import argparse  # noqa: E402
import json  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))  # bench_common
sys.path.insert(0, str(Path(__file__).resolve().parent))  # moe_layers

import torch  # noqa: E402
import triton  # noqa: E402
import triton.language as tl  # noqa: E402

from bench_common import device_facts, device_rates, kernels_per_call, rel_err  # noqa: E402
from moe_layers import DRY_SHAPES, ROUTING, SHAPES, Bench, make_layer, runtime_config  # noqa: E402
from runtime.backends.cpu_reference import moe_reference  # noqa: E402
from runtime.backends.kernels.launch_math import cdiv, next_pow2  # noqa: E402
from runtime.backends.kernels.moe import (  # noqa: E402
    align_block_p, combine, down_sorted, fused_moe, gate_up_sorted, max_sorted_rows, route, shared_chunks,
    sort_tokens,
)
from testkit.moe_checks import combine_reference, sorted_layout_reference  # noqa: E402

TOKENS_GPU = [32, 512, 4096]
TOKENS_DRY = [8, 64, 300]
SORT_WIDTHS = [64, 128, 256, 512, 2048]


# -- the kernels before -----------------------------------------------------------------------

@triton.jit(do_not_specialize=["P"])
def _align_before_kernel(ids_ptr, counts_ptr, sorted_ptr, block_expert_ptr, total_ptr, P,
                         E: tl.constexpr, E_PAD: tl.constexpr, BLOCK_M: tl.constexpr,
                         BLOCK_P: tl.constexpr, BLOCK_B: tl.constexpr):
    """Expert e's segment of the sorted layout: its pairs in pair order, then sentinels (P)."""
    e = tl.program_id(0)
    offs = tl.arange(0, E_PAD)
    counts = tl.load(counts_ptr + offs, mask=offs < E, other=0)
    padded = (counts + BLOCK_M - 1) // BLOCK_M * BLOCK_M
    starts = tl.cumsum(padded, axis=0) - padded
    mine = offs == e
    start = tl.sum(tl.where(mine, starts, 0), axis=0)
    count = tl.sum(tl.where(mine, counts, 0), axis=0)
    size = tl.sum(tl.where(mine, padded, 0), axis=0)
    if e == 0:
        tl.store(total_ptr, tl.sum(padded, axis=0))
    if count > 0:
        seen = count * 0
        for p0 in range(0, P, BLOCK_P):
            p = p0 + tl.arange(0, BLOCK_P)
            ids = tl.load(ids_ptr + p, mask=p < P, other=E)
            hit = ids == e
            rank = seen + tl.cumsum(hit.to(tl.int32), axis=0) - 1
            tl.store(sorted_ptr + start + rank, p, mask=hit)
            seen += tl.sum(hit.to(tl.int32), axis=0)
        q = tl.arange(0, BLOCK_M)
        tl.store(sorted_ptr + start + count + q, tl.full((BLOCK_M,), P, dtype=tl.int32), mask=q < size - count)
        first_block = start // BLOCK_M
        for b0 in range(0, size // BLOCK_M, BLOCK_B):
            b = b0 + tl.arange(0, BLOCK_B)
            tl.store(block_expert_ptr + first_block + b, tl.full((BLOCK_B,), e, dtype=tl.int32),
                     mask=b < size // BLOCK_M)


@triton.jit(do_not_specialize=["SENTINEL"])
def _combine_before_kernel(y_ptr, ids_ptr, out_ptr, SENTINEL, SLOTS, D, stride_yp, stride_ot, BLOCK_D: tl.constexpr):
    t = tl.program_id(0)
    offs = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    d_mask = offs < D
    acc = tl.zeros((BLOCK_D,), dtype=tl.float32)
    for j in range(SLOTS):
        pair = t * SLOTS + j
        if tl.load(ids_ptr + pair) < SENTINEL:
            acc += tl.load(y_ptr + pair.to(tl.int64) * stride_yp + offs, mask=d_mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + t.to(tl.int64) * stride_ot + offs, acc.to(out_ptr.dtype.element_ty), mask=d_mask)


def count_before(ids, E):
    """Pairs per expert as sort_tokens counted them before without the router's counts: E+1 bins."""
    counts = torch.zeros(E + 1, dtype=torch.int32, device=ids.device)
    flat = ids.reshape(-1).long().clamp(max=E)
    counts.scatter_add_(0, flat, torch.ones_like(flat, dtype=torch.int32))
    return counts


def sort_before(ids, E, block_m, counts):
    P = ids.numel()
    R = max_sorted_rows(P, E, block_m)
    sorted_pairs = torch.empty(R, dtype=torch.int32, device=ids.device)
    block_expert = torch.empty(R // block_m, dtype=torch.int32, device=ids.device)
    total = torch.zeros(1, dtype=torch.int32, device=ids.device)
    _align_before_kernel[(E,)](ids, counts, sorted_pairs, block_expert, total, P, E=E, E_PAD=next_pow2(E),
                               BLOCK_M=block_m, BLOCK_P=1024 if P > 256 else 256, BLOCK_B=64, num_warps=4)
    return sorted_pairs, block_expert, total


def combine_before(y, ids, out, sentinel):
    T, slots = ids.shape
    D = out.shape[1]
    block_d = min(1024, next_pow2(D))
    _combine_before_kernel[(T, cdiv(D, block_d))](y, ids, out, sentinel, slots, D, y.stride(0), out.stride(0),
                                                  BLOCK_D=block_d, num_warps=4 if block_d <= 512 else 8)


# -- checks and times -------------------------------------------------------------------------

def layout_ok(sort, ids, experts, bm) -> bool:
    sorted_pairs, block_expert, total = (t.cpu() for t in sort)
    rows, blocks = sorted_layout_reference(ids, experts, bm)
    n = int(total)
    return n == rows.numel() and torch.equal(sorted_pairs[:n], rows) and torch.equal(block_expert[:n // bm], blocks)


def bench_tokens(bench: Bench, layer, E: int, top_k: int, T: int, rates: dict) -> dict:
    router, _, w13, w2, sw13, sw2, gate = layer
    D, I = bench.D, bench.I
    n_shared = shared_chunks(bench.S, I)
    experts, slots = E + n_shared, top_k + n_shared
    routing = (top_k, ROUTING["scoring"], ROUTING["renormalize"], ROUTING["routed_scale"],
               ROUTING["num_groups"], ROUTING["topk_groups"])
    config, config_source = runtime_config(bench, T, E, top_k)
    bm = config.gate_up.BLOCK_M
    assert config.path == "sorted", f"T={T}: the token path has no sort or combine"
    x = torch.randn(T, D, device=bench.device).to(bench.dtype)
    ids, weights = route(x, router, None, *routing, n_shared=n_shared, shared_gate=gate)
    counts = count_before(ids, experts)

    def fused(out):
        fused_moe(x, *layer, out, *routing, config)

    def fused_before(out):
        ids_b, weights_b = route(x, router, None, *routing, n_shared=n_shared, shared_gate=gate)
        sort = sort_before(ids_b, experts, bm, count_before(ids_b, experts))
        h = gate_up_sorted(x, w13, *sort, slots, config.gate_up, shared_w13=sw13)
        y = down_sorted(h, w2, weights_b, *sort, config.down, shared_w2=sw2)
        combine_before(y, ids_b, out, experts)

    # Checks.
    sort = sort_tokens(ids, experts, bm)
    h = gate_up_sorted(x, w13, *sort, slots, config.gate_up, shared_w13=sw13)
    y = down_sorted(h, w2, weights, *sort, config.down, shared_w2=sw2)
    # The sums into float32 rows: exact whatever rounds to bf16 (the interpreter truncates).
    sums = [torch.full((T, D), float("nan"), device=bench.device) for _ in range(2)]
    combine(y, ids, sums[0], experts)
    combine_before(y, ids, sums[1], experts)
    want = combine_reference(y, ids, experts)
    out_new = torch.full((T, D), float("nan"), device=bench.device, dtype=bench.dtype)
    out_old = out_new.clone()
    combine(y, ids, out_new, experts)
    combine_before(y, ids, out_old, experts)
    op_new, op_old = out_new.clone().fill_(float("nan")), out_old.clone().fill_(float("nan"))
    fused(op_new)
    fused_before(op_old)
    bench.sync()
    ref = moe_reference(x.float().cpu(), *(None if t is None else t.float().cpu() for t in layer), *routing)
    checks = {
        "sort_layout": layout_ok(sort, ids, experts, bm),
        "sort_layout_counted_ranks": layout_ok(sort_tokens(ids, experts, bm, count_ranks=True), ids, experts, bm),
        "sort_layout_widths": all(layout_ok(sort_tokens(ids, experts, bm, block_p=w, scan=scan), ids, experts, bm)
                                  for w in SORT_WIDTHS for scan in (False, True)),
        "sort_before_layout": layout_ok(sort_before(ids, experts, bm, counts), ids, experts, bm),
        "combine_exact": bool(torch.equal(sums[0], want)), "combine_before_exact": bool(torch.equal(sums[1], want)),
        "combine_equals_before": bool(torch.equal(out_new, out_old)),
        "fused_equals_before": bool(torch.equal(op_new, op_old)), "fused_rel_err": rel_err(op_new, ref),
    }
    checks["ok"] = all(v for k, v in checks.items() if k != "fused_rel_err") and checks["fused_rel_err"] <= bench.tol

    # Times (us), each alone in a graph.
    def us(fn):
        return bench.graph_ms(fn)[0] * 1e3

    out = torch.empty_like(out_new)
    times = {"sort": us(lambda: sort_tokens(ids, experts, bm)),
             "sort_counted_ranks": us(lambda: sort_tokens(ids, experts, bm, count_ranks=True)),
             **{f"sort_block_p{w}": us(lambda w=w: sort_tokens(ids, experts, bm, block_p=w)) for w in SORT_WIDTHS},
             **{f"sort_block_p{w}_counted": us(lambda w=w: sort_tokens(ids, experts, bm, block_p=w, scan=False))
                for w in SORT_WIDTHS},
             "sort_unscanned": us(lambda: sort_tokens(ids, experts, bm, block_p=align_block_p(ids.numel()),
                                                      scan=False)),
             "sort_before": us(lambda: sort_before(ids, experts, bm, counts)),
             "sort_before_counting": us(lambda: sort_before(ids, experts, bm, count_before(ids, experts))),
             "combine": us(lambda: combine(y, ids, out, experts)),
             "combine_before": us(lambda: combine_before(y, ids, out, experts)),
             "fused": us(lambda: fused(out)), "fused_before": us(lambda: fused_before(out))}
    live = int((ids < experts).sum())
    combine_bytes = (live + T) * D * y.element_size() + ids.numel() * 4
    row = {"T": T, "E": E, "top_k": top_k, "D": D, "I": I, "S": bench.S, "pairs": ids.numel(), "BLOCK_M": bm,
           "config_source": config_source, "checks": checks, "us": times, "combine_bytes": combine_bytes,
           "combine_GBps": combine_bytes / times["combine"] / 1e3,
           "combine_before_GBps": combine_bytes / times["combine_before"] / 1e3,
           "combine_copy_floor_us": combine_bytes / rates["copy_bytes_per_s"] * 1e6,
           "kernels_per_call": kernels_per_call(lambda: fused(out)),
           "kernels_per_call_before": kernels_per_call(lambda: fused_before(out))}
    print(f"[T={T}, {config_source} tiles] checks {checks}", flush=True)
    print("    us: " + " ".join(f"{k}={v:.1f}" for k, v in times.items())
          + f"; combine {row['combine_GBps']:.0f} GB/s (before {row['combine_before_GBps']:.0f}),"
          f" copy floor {row['combine_copy_floor_us']:.1f} us; kernels per call {row['kernels_per_call']}"
          f" (before {row['kernels_per_call_before']})", flush=True)
    return row


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", required=True, type=Path, help="folder for moe_bookkeeping.json")
    parser.add_argument("--dry-run", action="store_true", help="CPU, Triton interpreter, tiny dims")
    parser.add_argument("--tokens", default=None, help="comma list of token counts")
    args = parser.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    t0 = time.time()
    bench = Bench(args.dry_run)
    shape = (DRY_SHAPES if bench.dry else SHAPES)["e16"]
    bench = bench.for_shape(shape)
    tokens = [int(t) for t in args.tokens.split(",")] if args.tokens else (TOKENS_DRY if bench.dry else TOKENS_GPU)
    env = device_facts(bench.dry)
    rates = device_rates()
    print(f"moe_bookkeeping: {env}; rates {rates}", flush=True)
    layer = make_layer(bench, shape["E"], seed=shape["E"])
    rows = [bench_tokens(bench, layer, shape["E"], shape["top_k"], T, rates) for T in tokens]
    result = {"env": env, "rates": rates, "rows": rows, "seconds": time.time() - t0}
    (args.out / "moe_bookkeeping.json").write_text(json.dumps(result, indent=1))
    print(f"\nwrote {args.out / 'moe_bookkeeping.json'} after {time.time() - t0:.0f}s")
    print("us per call, new / before (the sort before with its counts made; kernels: per fused call)")
    head = f"{'T':>6} {'ok':>4} {'sort':>19} {'combine':>19} {'fused':>19} {'kernels':>8}"
    print(head + "\n" + "-" * len(head))
    for r in rows:
        u = r["us"]
        k = "-" if r["kernels_per_call"] is None else f"{r['kernels_per_call']:.0f}/{r['kernels_per_call_before']:.0f}"
        pairs = " ".join(f"{u[name]:>9.1f}/{u[name + '_before']:<9.1f}" for name in ("sort", "combine", "fused"))
        print(f"{r['T']:>6} {'yes' if r['checks']['ok'] else 'NO':>4} {pairs} {k:>8}")
    return 0 if all(r["checks"]["ok"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
