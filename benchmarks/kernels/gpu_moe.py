"""GPU check and benchmark of the fused Triton MoE (runtime/backends/kernels/moe.py): one script, one call.

On the GPU machine (benchmarks/gpu_call.sh has the wheel install line):

    python3 benchmarks/kernels/gpu_moe.py --out $OUT            # GPU tests, correctness, timings, table
    python3 benchmarks/kernels/gpu_moe.py --tune --out $OUT     # tune configs first (writes JSON), then the above
    python3 benchmarks/kernels/gpu_moe.py --dry-run --out /tmp/moe   # CPU: Triton interpreter, tiny dims
    python3 benchmarks/kernels/gpu_moe.py --out $OUT --shapes e16 --tokens 1,2,4 --skip-loop --skip-tests \
        --experts two_launches,one_launch      # a token step's experts as two launches against one

Steps, in order:
1. `pytest -m gpu tests/gpu/test_gpu_moe.py` in a subprocess (skipped with --skip-tests; log in OUT); its summary
   goes into the JSON and the table.
2. Measures the two ceilings in this run (bench_common.device_rates, as every kernel benchmark
   does): device-to-device copy bandwidth (bytes read + written, 1 GiB) and the bf16 matmul rate (8192^3).
3. With --tune: `tune_moe.tune_all` writes runtime/backends/kernels/moe_configs/E=..,I=..,device=...json
   and a copy as OUT/moe_configs/E.._I.._<device>.json (the GPU machine keeps nothing; install the
   copies with `python3 benchmarks/kernels/tune_moe.py --install OUTDIR/moe_configs/*.json`, then commit).
4. For each bench layer (Qwen3-Next-like: D 2048, I 512, softmax top-k renormalised, a shared
   expert of width S 512 scaled by a sigmoid gate (--no-shared: routed experts only); E 16 top-4
   and E 512 top-10; and one rank's share at tensor parallel 2 of Qwen3-Next-80B-A3B (E 512
   top-10, I 256, S 256) and of Kimi-Linear-48B-A3B (E 256 top-8, D 2304, I 512, S 512)) and T in
   {1, 8, 32, 128, 512, 2048}: checks the fused op (bf16) against
   `moe_reference` on the CPU in float32 (rel err of norms <= 1e-2, every row written, eager and
   graph replay equal bit for bit), then times (median, L2 flushed before each run by do_bench):
   - fused: the op captured in a CUDA graph, replayed;       fused eager: the same without a graph;
   - loop: the reference's per-expert loop on the GPU in bf16, shared expert included (what a
     user has; syncs on the host);
   - floor: max(bytes / copy bandwidth, FLOPs / matmul rate) with bytes = distinct experts hit x
     (w13 + w2 of one expert) + the shared expert's weights (3 S D) + router weight + shared gate
     + x + out, FLOPs = 2 T k 3 I D + 2 T 3 S D + 2 T (E + 1) D.
   With --experts, each layer and T runs once per choice of the backend's experts option (each
   checked before it is timed), its rows tagged with it: the A/B of one launch in one run.
5. Writes OUT/gpu_moe.json and prints a short table last, with the two targets of the issue:
   fused within 1.3x of the floor at T=1, and ahead of the loop at every T.
"""

from __future__ import annotations

import os
import sys

if "--dry-run" in sys.argv:
    os.environ["TRITON_INTERPRET"] = "1"  # before triton is imported anywhere

import argparse  # noqa: E402
import datetime  # noqa: E402
import json  # noqa: E402
import platform  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))  # bench_common

import torch  # noqa: E402
import triton  # noqa: E402

from bench_common import device_rates, is_cuda, rel_err, run_gpu_pytest, verdict  # noqa: E402
from runtime.backends.cpu_reference import moe_reference, route_topk  # noqa: E402
from moe_layers import DRY_SHAPES, ROUTING, SHAPES, Bench, make_layer  # noqa: E402
from runtime.backends.kernels.moe_config import CONFIG_DIR, device_name_of  # noqa: E402
from runtime.backends.triton_moe import EXPERTS, TritonMoEBackend  # noqa: E402
from runtime.backends.kernels.moe import (  # noqa: E402
    combine, down_sorted, down_token, fused_moe, gate_up_sorted, gate_up_token, logits_kernel_for, route, route_sort,
    route_sort_folds, shared_chunks, sort_tokens,
)

TOKENS_GPU = [1, 8, 32, 128, 512, 2048]
TOKENS_DRY = [1, 4, 16]


def moe_loop(x, *layer_and_routing):
    """The reference's per-expert loop (shared expert included) on the inputs' device and dtype:
    the baseline a user has."""
    return moe_reference(x, *layer_and_routing).to(x.dtype)


def measure_rates() -> dict:
    """bench_common.device_rates (the ceilings of every floor), in the units of the table."""
    rates = device_rates()
    return {**rates, "copy_GBps": rates["copy_bytes_per_s"] / 1e9, "mm_TFLOPs": rates["matmul_flops_per_s"] / 1e12,
            "mm_dtype": "bfloat16" if is_cuda() else "float32"}


def floor_us(rates: dict, T: int, E: int, k: int, D: int, I: int, S: int, hit: int, elt: int) -> dict:
    # w13 (2I x D) and w2 (D x I) of each distinct expert hit, and the shared expert's (2S x D, D x S).
    weight_bytes = (hit * I + S) * 3 * D * elt
    other_bytes = (E + (1 if S else 0)) * D * elt + 2 * T * D * elt  # router weight and shared gate, x, out
    flops = 2 * T * 3 * (k * I + S) * D + 2 * T * (E + (1 if S else 0)) * D
    bytes_us = (weight_bytes + other_bytes) / (rates["copy_GBps"] * 1e3)
    flops_us = flops / (rates["mm_TFLOPs"] * 1e6)
    return {"bytes": weight_bytes + other_bytes, "flops": flops, "bytes_us": bytes_us, "flops_us": flops_us,
            "floor_us": max(bytes_us, flops_us), "bound": "bytes" if bytes_us >= flops_us else "flops"}


def bench_shape(bench: Bench, name: str, E: int, top_k: int, tokens: list[int], rates: dict,
                backend: TritonMoEBackend, skip_loop: bool) -> list[dict]:
    D, I, S = bench.D, bench.I, bench.S
    layer = make_layer(bench, E, seed=E)
    router = layer[0]
    cpu_layer = tuple(None if t is None else t.float().cpu() for t in layer)
    routing = (top_k, ROUTING["scoring"], ROUTING["renormalize"], ROUTING["routed_scale"],
               ROUTING["num_groups"], ROUTING["topk_groups"])
    cfg_file = backend.config_path(E, I, device_name_of(bench.device))
    rows = []
    for T in tokens:
        t_start = time.time()
        x = torch.randn(T, D, device=bench.device).to(bench.dtype)
        config = backend.config_for(T, E, I, D, top_k, bench.device)

        def fused(out):
            backend.moe(None, x, *layer, out, 0, *routing)

        # Correctness: poisoned output, float32 CPU reference on the same bf16 values.
        out = torch.full((T, D), float("nan"), device=bench.device, dtype=bench.dtype)
        fused(out)
        bench.sync()
        finite = bool(torch.isfinite(out).all())
        ref = moe_reference(x.float().cpu(), *cpu_layer, *routing)
        err = rel_err(out, ref)
        ids, _ = route(x, router, None, *routing)
        rids, _ = route_topk(x.float().cpu(), cpu_layer[0], None, *routing)
        same_routing = float((ids.long().cpu() == rids).all(-1).float().mean())
        hit = int(ids.unique().numel())
        again = torch.empty_like(out)
        fused(again)
        deterministic = bool(torch.equal(again, out))

        # Timings.
        static_out = torch.empty_like(out)
        graph_ms, graph = bench.graph_ms(lambda: fused(static_out))
        graph_equal = True
        if graph is not None:
            graph.replay()
            bench.sync()
            graph_equal = bool(torch.equal(static_out, out))
            del graph
        eager_ms = bench.time_ms(lambda: fused(static_out))
        loop_ms = None
        if not skip_loop:
            loop_ms = bench.time_ms(lambda: moe_loop(x, *layer, *routing), rep_ms=200)
        stages = stage_times(bench, x, layer, routing, config)
        before = baseline_stages_us(bench, x, layer, routing, config)
        fl = floor_us(rates, T, E, top_k, D, I, S, hit, out.element_size())
        row = {
            "shape": name, "E": E, "top_k": top_k, "D": D, "I": I, "S": S, "shared_gated": S > 0, "T": T,
            "path": config.path, "BLOCK_M": config.gate_up.BLOCK_M, "config": config.to_dict(),
            "config_source": str(cfg_file.name) if cfg_file.is_file() else "default",
            "rel_err": err, "tol": bench.tol, "finite": finite, "deterministic": deterministic,
            "graph_equals_eager": graph_equal, "same_routing_frac": same_routing, "experts_hit": hit,
            "ok": finite and err <= bench.tol and deterministic and graph_equal,
            "fused_graph_us": graph_ms * 1e3, "fused_eager_us": eager_ms * 1e3,
            "loop_us": None if loop_ms is None else loop_ms * 1e3, "stages_us": stages,
            "baseline_stages_us": before, **fl,
        }
        row["x_floor"] = row["fused_graph_us"] / fl["floor_us"]
        row["speedup_vs_loop"] = None if loop_ms is None else row["loop_us"] / row["fused_graph_us"]
        row["GBps"] = fl["bytes"] / row["fused_graph_us"] / 1e3
        row["TFLOPs"] = fl["flops"] / row["fused_graph_us"] / 1e6
        rows.append(row)
        loop_txt = "-" if loop_ms is None else f"{row['loop_us']:.1f}"
        print(f"[{name} T={T}] {config.path} BM={config.gate_up.BLOCK_M} err={err:.2e} ok={row['ok']} "
              f"hit={hit} graph={row['fused_graph_us']:.1f}us eager={row['fused_eager_us']:.1f}us "
              f"loop={loop_txt}us floor={fl['floor_us']:.1f}us ({fl['bound']}) x_floor={row['x_floor']:.2f} "
              f"[{time.time() - t_start:.1f}s]", flush=True)
        print("    stages (each alone in a graph, us): " + " ".join(f"{k}={v:.1f}" for k, v in stages.items())
              + "".join(f"; before: {k}={v:.1f}" for k, v in before.items()),
              flush=True)
    return rows


def baseline_stages_us(bench: Bench, x, layer, routing, config) -> dict:
    """Stages as they ran before two changes, timed in this run alone in a graph (us), as the
    baselines of those changes: `route` with the shared gate's dot in the one-program routing
    kernel (the logits GEMV now computes it), where the GEMV runs; `down` of the token path with
    its reduction loop kept around a single tile (it now runs without the loop), where one tile
    covers I; where a sorted step routes and sorts in one launch (`route_sort_folds`), the router
    and the sort in their own launches (`route_then_sort`) and the whole op so
    (`fused_route_then_sort`, against the row's `fused`)."""
    router, _, w13, w2, sw13, sw2, gate = layer
    T, D = x.shape
    E, I = w13.shape[0], w13.shape[1] // 2
    shared = dict(n_shared=shared_chunks(0 if sw13 is None else sw13.shape[0] // 2, I), shared_gate=gate)
    out = {}
    if gate is not None and logits_kernel_for(T, E, D) == "gemv":
        out["route_gate_in_route_kernel"] = bench.graph_ms(
            lambda: route(x, router, None, *routing, **shared, gate_in_logits=False))[0] * 1e3
    if config.path == "token" and I <= config.down.BLOCK_K:
        ids, weights = route(x, router, None, *routing, **shared)
        h = gate_up_token(x, w13, ids, config.gate_up, shared_w13=sw13)
        y = torch.empty_like(x)
        out["down_with_loop"] = bench.graph_ms(
            lambda: down_token(h, w2, ids, weights, y, config.down, shared_w2=sw2, one_step=False))[0] * 1e3
    slots = routing[0] + shared["n_shared"]
    if config.path == "sorted" and route_sort_folds(T, E, slots, logits_kernel_for(T, E, D)):
        bm = config.gate_up.BLOCK_M
        out["route_then_sort"] = bench.graph_ms(
            lambda: route_sort(x, router, None, *routing, bm, **shared, fold=False))[0] * 1e3
        y = torch.empty_like(x)
        out["fused_route_then_sort"] = bench.graph_ms(
            lambda: fused_moe(x, *layer, y, *routing, config, fold=False))[0] * 1e3
    return out


def stage_times(bench: Bench, x, layer, routing, config) -> dict:
    """Each stage of the op captured alone in a CUDA graph and replayed (us): where a step's time goes.

    Graphs, because timing these small launches eagerly measures Python launch time instead. The
    stages overlap nothing in the op either, so their sum minus the op's time is the launch gaps.
    """
    router, _, w13, w2, sw13, sw2, gate = layer
    E, I = w13.shape[0], w13.shape[1] // 2
    n_shared = shared_chunks(0 if sw13 is None else sw13.shape[0] // 2, I)
    experts, slots = E + n_shared, routing[0] + n_shared  # the shared chunks sort as experts E..
    shared = dict(n_shared=n_shared, shared_gate=gate)
    ids, weights = route(x, router, None, *routing, **shared)
    out = torch.empty_like(x)
    times = {"route": bench.graph_ms(lambda: route(x, router, None, *routing, **shared))[0]}
    if config.path == "sorted" and route_sort_folds(x.shape[0], E, slots, logits_kernel_for(x.shape[0], E, x.shape[1])):
        # What the op launches for these two stages: one kernel after the GEMV.
        times["route_sort"] = bench.graph_ms(
            lambda: route_sort(x, router, None, *routing, config.gate_up.BLOCK_M, **shared))[0]
    if config.path == "token":
        h = gate_up_token(x, w13, ids, config.gate_up, shared_w13=sw13)
        times["gate_up"] = bench.graph_ms(lambda: gate_up_token(x, w13, ids, config.gate_up, h=h, shared_w13=sw13))[0]
        times["down"] = bench.graph_ms(lambda: down_token(h, w2, ids, weights, out, config.down, shared_w2=sw2))[0]
    else:
        bm = config.gate_up.BLOCK_M
        times["sort"] = bench.graph_ms(lambda: sort_tokens(ids, experts, bm))[0]
        sorted_pairs, block_expert, total = sort_tokens(ids, experts, bm)
        sort = (sorted_pairs, block_expert, total)
        h = gate_up_sorted(x, w13, *sort, slots, config.gate_up, shared_w13=sw13)
        y = down_sorted(h, w2, weights, *sort, config.down, shared_w2=sw2)
        times["gate_up"] = bench.graph_ms(
            lambda: gate_up_sorted(x, w13, *sort, slots, config.gate_up, h=h, shared_w13=sw13))[0]
        times["down"] = bench.graph_ms(lambda: down_sorted(h, w2, weights, *sort, config.down, y=y, shared_w2=sw2))[0]
        times["combine"] = bench.graph_ms(lambda: combine(y, ids, out, experts))[0]
    return {k: v * 1e3 for k, v in times.items()}


def print_table(rows: list[dict], tests: dict | None, rates: dict, device: str, dry_run: bool) -> None:
    print()
    print(f"device {device}; copy {rates['copy_GBps']:.0f} GB/s (read+write); "
          f"matmul {rates['mm_TFLOPs']:.1f} TFLOP/s ({rates['mm_dtype']})")
    widths = sorted({r["S"] for r in rows})
    print("shared expert: " + (", ".join(f"width {S}, gated" for S in widths if S) or "none"))
    if tests is not None:
        print(f"gpu tests: rc={tests['rc']} {tests['summary']}")
    head = (f"{'layer':<6}{'experts':<13}{'T':>6} {'path':<7}{'BM':>4}{'err':>9} {'ok':<4}{'hit':>5}{'floor us':>10}"
            f"{'fused us':>10}{'x floor':>8}{'eager us':>10}{'loop us':>10}{'vs loop':>8}{'GB/s':>7}{'TF/s':>7}")
    print(head)
    print("-" * len(head))
    for r in rows:
        loop = "-" if r["loop_us"] is None else f"{r['loop_us']:.1f}"
        vs = "-" if r["speedup_vs_loop"] is None else f"{r['speedup_vs_loop']:.1f}x"
        print(f"{r['shape']:<6}{r['experts']:<13}{r['T']:>6} {r['path']:<7}{r['BLOCK_M']:>4}{r['rel_err']:>9.1e} "
              f"{'yes' if r['ok'] else 'NO':<4}{r['experts_hit']:>5}{r['floor_us']:>10.1f}{r['fused_graph_us']:>10.1f}"
              f"{r['x_floor']:>8.2f}{r['fused_eager_us']:>10.1f}{loop:>10}{vs:>8}{r['GBps']:>7.0f}{r['TFLOPs']:>7.1f}")
    for shape in sorted({r["shape"] for r in rows}):
        mine = [r for r in rows if r["shape"] == shape]
        t1 = [r for r in mine if r["T"] == 1 and r["experts"] == mine[0]["experts"]]
        if t1:
            word = verdict(t1[0]["x_floor"] <= 1.3, dry_run)
            print(f"target {shape}: T=1 within 1.3x of floor: {word} ({t1[0]['x_floor']:.2f}x)")
        with_loop = [r for r in mine if r["speedup_vs_loop"] is not None]
        if with_loop:
            behind = [r["T"] for r in with_loop if r["speedup_vs_loop"] <= 1.0]
            word = verdict(not behind, dry_run) + ("" if not behind or dry_run else " at T=" + ",".join(map(str, behind)))
            print(f"target {shape}: ahead of the per-expert loop at every T: {word}")
    bad = [f"{r['shape']}/T={r['T']}" for r in rows if not r["ok"]]
    print("correctness: " + ("all ok" if not bad else "FAILED " + " ".join(bad)))


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", required=True, type=Path, help="folder for gpu_moe.json (and tuned configs)")
    parser.add_argument("--dry-run", action="store_true", help="CPU, Triton interpreter, tiny dims")
    parser.add_argument("--tune", action="store_true", help="tune and write the config JSON files first")
    parser.add_argument("--tune-budget-s", type=float, default=420.0, help="time budget of --tune, all shapes")
    parser.add_argument("--tune-buckets", default=None,
                        help="comma list of token buckets --tune tunes (default: tune_moe's, 1 to 4096)")
    parser.add_argument("--shapes", default=None, help="comma list of layers (default: all)")
    parser.add_argument("--tokens", default=None, help="comma list of token counts")
    parser.add_argument("--skip-tests", action="store_true", help="do not run the GPU pytest file first")
    parser.add_argument("--skip-loop", action="store_true", help="do not time the per-expert loop baseline")
    parser.add_argument("--no-shared", action="store_true", help="bench layers without the shared expert")
    parser.add_argument("--experts", default=EXPERTS[0],
                        help=f"the backend's experts option, comma list of {', '.join(EXPERTS)}: each is checked and "
                             f"timed at every layer and T (default {EXPERTS[0]})")
    args = parser.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    t0 = time.time()
    bench = Bench(args.dry_run, shared=not args.no_shared)
    shapes = DRY_SHAPES if bench.dry else SHAPES
    if args.shapes:
        shapes = {k: shapes[k] for k in args.shapes.split(",")}
    tokens = [int(t) for t in args.tokens.split(",")] if args.tokens else (TOKENS_DRY if bench.dry else TOKENS_GPU)
    device = device_name_of(bench.device)
    env = {"device": device, "torch": torch.__version__, "triton": triton.__version__,
           "python": platform.python_version(), "date": datetime.datetime.now().isoformat(timespec="seconds"),
           "argv": sys.argv, "interpreter": bench.dry, "shared_width": bench.S, "shared_gated": bench.S > 0}
    print(f"gpu_moe: {env}", flush=True)

    tests = None if args.skip_tests else run_gpu_pytest("tests/gpu/test_gpu_moe.py", 600, args.out / "gpu_moe_pytest.log")
    rates = measure_rates()
    print(f"rates: {rates}", flush=True)

    config_dir = CONFIG_DIR
    tuned = None
    if args.tune:
        import tune_moe  # the script's folder is on sys.path

        # A dry run never writes into the repository's config folder.
        config_dir = args.out / "moe_configs" if bench.dry else CONFIG_DIR
        tuned = tune_moe.tune_all(bench, shapes, config_dir=config_dir, out_dir=args.out,
                                  budget_s=args.tune_budget_s,
                                  buckets=[int(b) for b in args.tune_buckets.split(",")] if args.tune_buckets else None)
    rows = []
    for experts in args.experts.split(","):
        backend = TritonMoEBackend(config_dir=config_dir, experts=experts)
        for name, shape in shapes.items():
            rows += [dict(row, experts=experts) for row in bench_shape(
                bench.for_shape(shape), name, shape["E"], shape["top_k"], tokens, rates, backend, args.skip_loop)]

    result = {"env": env, "rates": rates, "tests": tests, "tuned": tuned, "rows": rows,
              "seconds": time.time() - t0}
    (args.out / "gpu_moe.json").write_text(json.dumps(result, indent=1))
    print(f"\nwrote {args.out / 'gpu_moe.json'} after {time.time() - t0:.0f}s")
    print_table(rows, tests, rates, device, args.dry_run)
    failed = any(not r["ok"] for r in rows) or (tests is not None and tests["rc"] not in (0, 5))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
