"""The MoE's expert GEMMs of a prompt step as torch's grouped GEMM (`torch._grouped_mm`, CUTLASS on
sm90) against the fused MoE's two Triton kernels, on the same sorted layout (issue 51).

At 4096 tokens the fused MoE's gate-up and down kernels take 180 and 102 us a layer (bench
qwen3_next, H200; 20480 (token, slot) rows: top-4 and the shared expert as a fifth slot), about
70% and 62% of the matmul rate the same call measured, while the step's dense projections (cuBLAS)
run at that rate. This probe asks whether a grouped GEMM library kernel does better on the
expert GEMMs themselves, and what the data movement it needs around them costs:

- ours: `gate_up_sorted` (gathers token rows, gate and up products, SiLU-and-multiply) and
  `down_sorted` (down products times the routing weight, into the pair's row);
- grouped: gather the sorted rows' tokens (`index_select`, padding rows read a zero row), one
  grouped GEMM against every expert's [gate | up] rows, SiLU-and-multiply, one grouped GEMM against
  the down rows, the routing weight and a scatter of each row to its pair.

Both run on `sort_tokens`'s layout at the op's BLOCK_M (experts 0..15 and the shared expert as
expert 16, each segment padded to BLOCK_M: the group offsets are the segments' ends), ours at the
tiles the runtime takes on the card (moe_layers.runtime_config: its tuned table where it has one).

And the split down (`--route 'moe=triton_moe[down=split]'`, kernels/moe.py `down_split`) as the
fused MoE runs it: the gate-up kernel with the shared expert's rows by token, torch's grouped GEMM
over the routed experts' rows with w2 as it is, the shared expert's dense GEMM, and the combine
through the sort's inverse map; checked like the others, timed piece by piece and whole against
the sorted down and the combine.

    bash benchmarks/gpu_call.sh python3 benchmarks/probes/grouped_mm_probe.py --out $OUT
    python3 benchmarks/probes/grouped_mm_probe.py --dry-run --out /tmp/gmm   # CPU: interpreter, tiny dims

Writes OUT/grouped_mm_probe.json.
"""

from __future__ import annotations

import os
import sys

if "--dry-run" in sys.argv:
    os.environ["TRITON_INTERPRET"] = "1"  # before triton is imported anywhere

import argparse  # noqa: E402
import json  # noqa: E402
from pathlib import Path  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))
sys.path.insert(0, str(ROOT / "benchmarks" / "kernels"))  # moe_layers

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from bench_common import device_facts, device_rates, rel_err  # noqa: E402
from moe_layers import DRY_SHAPES, ROUTING, SHAPES, Bench, make_layer, runtime_config  # noqa: E402
from runtime.backends.cpu_reference import moe_reference  # noqa: E402
from runtime.backends.kernels.moe import (combine, combine_split, down_sorted, down_split,  # noqa: E402
                                          gate_up_sorted, route, shared_chunks, sort_tokens, split_maps)

TOKENS_GPU = [512, 1024, 2048, 4096]  # 1024: between the last count the library lost at and the first it won
TOKENS_DRY = [64, 300]


def bench_tokens(bench: Bench, layer, E: int, top_k: int, T: int, rates: dict) -> dict:
    router, _, w13, w2, sw13, sw2, gate = layer
    D, I = bench.D, bench.I
    assert bench.S == I, "the probe stacks the shared expert as one more expert of width I"
    n_shared = shared_chunks(bench.S, I)
    experts, slots = E + n_shared, top_k + n_shared
    routing = (top_k, ROUTING["scoring"], ROUTING["renormalize"], ROUTING["routed_scale"],
               ROUTING["num_groups"], ROUTING["topk_groups"])
    config, config_source = runtime_config(bench, T, E, top_k)
    assert config.path == "sorted", f"T={T}: the token path has no sorted layout"
    bm = config.gate_up.BLOCK_M
    dev, dt = bench.device, bench.dtype
    x = torch.randn(T, D, device=dev).to(dt)
    ids, weights = route(x, router, None, *routing, n_shared=n_shared, shared_gate=gate)
    sorted_pairs, block_expert, total_t = sort_tokens(ids, experts, bm)
    total = int(total_t)
    P = ids.numel()
    R = sorted_pairs.numel()

    # The grouped path's operands: every expert's weights stacked (the shared expert is expert E),
    # seen as [G, K, N] (column-major per group: no copy of the weights at run time).
    w13_all = torch.cat([w13, sw13[None]]).transpose(1, 2)   # [G, D, 2I]
    w2_all = torch.cat([w2, sw2[None]]).transpose(1, 2)      # [G, I, D]
    offs = split_maps(sorted_pairs, block_expert, total_t, bm, experts, T * slots)[0]  # the shared one last
    live = torch.arange(R, device=dev) < total  # entries past total are unspecified
    pairs = torch.where(live, sorted_pairs.long(), P)
    valid = pairs < P
    real = pairs.clamp(max=P - 1)
    token_of_row = torch.where(valid, real // slots, T)  # T: the zero row
    pair_of_row = torch.where(valid, pairs, P)           # P: a row nobody reads
    weight_of_row = torch.where(valid, weights.reshape(-1)[real], 0.0)
    x_pad = torch.cat([x, torch.zeros(1, D, device=dev, dtype=dt)])
    xs = torch.empty(R, D, device=dev, dtype=dt)
    y_pairs = torch.zeros(P + 1, D, device=dev, dtype=dt)

    def gather():
        torch.index_select(x_pad, 0, token_of_row, out=xs)

    def gemm1():
        return torch._grouped_mm(xs, w13_all, offs=offs)

    def act(h13):
        return F.silu(h13[:, :I]) * h13[:, I:]

    def gemm2(h):
        return torch._grouped_mm(h, w2_all, offs=offs)

    def scatter(y):
        y_pairs.index_copy_(0, pair_of_row, (y.float() * weight_of_row[:, None]).to(dt))

    def grouped_all(out):
        gather()
        scatter(gemm2(act(gemm1())))
        combine(y_pairs[:P], ids, out, experts)

    # The split down (module docstring), as fused_moe runs it.
    h_shared = torch.empty(T, bench.S, device=dev, dtype=dt)

    def split_gate_up():
        return gate_up_sorted(x, w13, sorted_pairs, block_expert, total_t, slots, config.gate_up, shared_w13=sw13,
                              h_shared=h_shared)

    def split_down(h):
        return down_split(h, h_shared, w2, sw2, sorted_pairs, block_expert, total_t, bm, P)

    def split_combine(ys, out):
        combine_split(*ys, ids, weights, out, top_k, E, experts)

    def split_all(out):
        split_combine(split_down(split_gate_up()), out)

    def ours_all(out):
        h = gate_up_sorted(x, w13, sorted_pairs, block_expert, total_t, slots, config.gate_up, shared_w13=sw13)
        y = down_sorted(h, w2, weights, sorted_pairs, block_expert, total_t, config.down, shared_w2=sw2)
        combine(y, ids, out, experts)

    # Checks: both against the float32 reference, and each other.
    out_ours = torch.full((T, D), float("nan"), device=dev, dtype=dt)
    out_grouped = out_ours.clone()
    out_split = out_ours.clone()
    ours_all(out_ours)
    grouped_all(out_grouped)
    h_ours = gate_up_sorted(x, w13, sorted_pairs, block_expert, total_t, slots, config.gate_up, shared_w13=sw13)
    split_all(out_split)
    bench.sync()
    ref = moe_reference(x.float().cpu(), *(None if t is None else t.float().cpu() for t in layer), *routing)
    checks = {"ours_rel_err": rel_err(out_ours, ref), "grouped_rel_err": rel_err(out_grouped, ref),
              "split_rel_err": rel_err(out_split, ref), "grouped_vs_ours": rel_err(out_grouped, out_ours),
              "split_vs_ours": rel_err(out_split, out_ours)}
    checks["ok"] = max(checks["ours_rel_err"], checks["grouped_rel_err"], checks["split_rel_err"]) <= bench.tol

    def us(fn):
        return bench.graph_ms(fn)[0] * 1e3

    gather()
    h13 = gemm1()
    h = act(h13)
    y = gemm2(h)
    h_split = split_gate_up()
    y_split = split_down(h_split)
    out = torch.empty_like(out_ours)
    times = {
        "ours_gate_up": us(lambda: gate_up_sorted(x, w13, sorted_pairs, block_expert, total_t, slots,
                                                  config.gate_up, h=h_ours, shared_w13=sw13)),
        "ours_down": us(lambda: down_sorted(h_ours, w2, weights, sorted_pairs, block_expert, total_t, config.down,
                                            shared_w2=sw2)),
        "gather": us(gather), "grouped_gate_up": us(gemm1), "act": us(lambda: act(h13)),
        "grouped_down": us(lambda: gemm2(h)), "scatter": us(lambda: scatter(y)),
        "ours_all": us(lambda: ours_all(out)), "grouped_all": us(lambda: grouped_all(out)),
        "ours_down_combine": us(lambda: combine(down_sorted(h_ours, w2, weights, sorted_pairs, block_expert, total_t,
                                                            config.down, shared_w2=sw2), ids, out, experts)),
        "split_gate_up": us(split_gate_up), "split_down": us(lambda: split_down(h_split)),
        "split_combine": us(lambda: split_combine(y_split, out)),
        "split_down_combine": us(lambda: split_combine(split_down(h_split), out)),
        "split_all": us(lambda: split_all(out)),
    }
    flops_gate_up = 2 * total * D * 2 * I  # padded rows: both paths compute them
    flops_down = 2 * total * I * D
    tflops = {k: f / (times[k] * 1e-6) / 1e12 for k, f in (
        ("ours_gate_up", flops_gate_up), ("grouped_gate_up", flops_gate_up),
        ("ours_down", flops_down), ("grouped_down", flops_down))}
    matmul = rates["matmul_flops_per_s"] / 1e12
    row = {"T": T, "pairs": P, "sorted_rows": total, "BLOCK_M": bm, "config": config.to_dict(),
           "config_source": config_source, "checks": checks, "us": times,
           "tflops": tflops, "matmul_tflops": matmul,
           "share_of_matmul_rate": {k: v / matmul for k, v in tflops.items()}}
    print(f"[T={T}, rows {total}, {config_source} tiles] checks {checks}", flush=True)
    print("    us: " + " ".join(f"{k}={v:.1f}" for k, v in times.items()), flush=True)
    print("    TFLOP/s: " + " ".join(f"{k}={v:.0f} ({v / matmul:.0%})" for k, v in tflops.items()), flush=True)
    return row


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", required=True, type=Path, help="folder for grouped_mm_probe.json")
    parser.add_argument("--dry-run", action="store_true", help="CPU, Triton interpreter, tiny dims")
    parser.add_argument("--tokens", default=None, help="comma list of token counts")
    args = parser.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(0)
    bench = Bench(args.dry_run)
    shape = (DRY_SHAPES if bench.dry else SHAPES)["e16"]
    bench = bench.for_shape(shape)
    tokens = [int(t) for t in args.tokens.split(",")] if args.tokens else (TOKENS_DRY if bench.dry else TOKENS_GPU)
    env, rates = device_facts(bench.dry), device_rates()
    print(f"grouped_mm_probe: {env}; rates {rates}", flush=True)
    layer = make_layer(bench, shape["E"], seed=1)
    rows = [bench_tokens(bench, layer, shape["E"], shape["top_k"], T, rates) for T in tokens]
    (args.out / "grouped_mm_probe.json").write_text(json.dumps({"env": env, "rates": rates, "rows": rows}, indent=1))
    return 0 if all(r["checks"]["ok"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
