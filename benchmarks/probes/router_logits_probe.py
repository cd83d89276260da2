"""Which router logits kernel a short extend's MoE should launch, by token count (kernels/moe.py `route`).

`moe.logits_kernel_for` picks the many-program GEMV up to 16 tokens and the routing kernel with the
logits folded in ("fused") up to 64; in a 32-token step of bench qwen3_next on an H200 the fused
routing kernel took about 10 us a layer against 2.1 + 2.6 us for the GEMV and the routing kernel at
16 tokens (benchmarks/kernels/step_account.py). This probe times `route` with each logits kernel
("gemv", "fused", "dot") at bench qwen3_next's router (16 experts, D = 2048, top 4, softmax, a shared
expert with its gate; bf16) for each --tokens count, each call captured alone in a CUDA graph and
replayed (so launch time is not timed), after checking its ids and weights against a float32 torch
reference on fresh random inputs.

Past the GEMV's bound (128 tokens) the router GEMM ("dot") is timed at each tile of DOT_TILES, the
default `moe.LOGITS_DOT_TILE` first. Where the step fits one routing tile (`moe.router_folds`),
"gemv_one_launch" times the GEMV whose last program routes (`route(..., one_launch=True)`, the
backend's router option "one_launch") against "gemv", the GEMV then the routing kernel. "split"
times the split router (the GEMM in slices of D, the last slice of each row block routing it: one
launch; the router option "split" takes it past the GEMV's bound) at every count, against the
GEMM and the routing kernel ("dot") and the GEMV.

    bash benchmarks/gpu_call.sh python3 benchmarks/probes/router_logits_probe.py --out $OUT

Writes OUT/router_logits_probe.json and prints one line per (tokens, kernel).
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

from bench_common import capture_graph  # noqa: E402
from runtime.backends.kernels import moe  # noqa: E402
from runtime.backends.kernels.moe import logits_kernel_for, route, shared_chunks  # noqa: E402

E, D, TOP_K, I_SHARED, I = 16, 2048, 4, 512, 512
# The router GEMM's tiles timed past the GEMV's bound ("dot"): (BLOCK_M, BLOCK_K, num_warps, num_stages),
# the default moe.LOGITS_DOT_TILE first
DOT_TILES = [moe.LOGITS_DOT_TILE, (16, 128, 4, 4), (16, 256, 4, 3), (32, 128, 4, 4), (32, 256, 4, 3), (64, 256, 8, 3)]


def reference(x, w, gate):
    """(top-k ids sorted, their renormalised softmax weights largest first, the shared gate) in float32."""
    probs = torch.softmax(x.float() @ w.float().t(), dim=-1)
    top, ids = probs.topk(TOP_K, dim=-1)
    return ids.sort(dim=-1).values, top / top.sum(-1, keepdim=True), torch.sigmoid(x.float() @ gate.float().t())


def graph_us(fn, iters: int = 200) -> float:
    g = capture_graph(fn)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        g.replay()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) * 1e3 / iters


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", required=True)
    p.add_argument("--tokens", default="1,8,16,24,32,48,64,96,128")
    args = p.parse_args(argv)
    dev = torch.device("cuda")
    g = torch.Generator(device=dev).manual_seed(0)
    w = torch.randn(E, D, device=dev, generator=g).to(torch.bfloat16) * 0.05
    gate = torch.randn(1, D, device=dev, generator=g).to(torch.bfloat16) * 0.05
    n_shared = shared_chunks(I_SHARED, I)
    rows = []
    for T in [int(t) for t in args.tokens.split(",")]:
        x = torch.randn(T, D, device=dev, generator=g).to(torch.bfloat16)
        want_ids, want_w, want_gate = reference(x, w, gate)
        dots = [("dot", tile) for tile in (DOT_TILES if T > moe.GEMV_LOGITS_MAX_TOKENS else DOT_TILES[:1])]
        one = [("gemv_one_launch", None)] if moe.router_folds(T, E, "gemv") else []
        split = [("split", None)]  # at every count: where it would beat the GEMV is one of its questions
        for kernel, tile in [("gemv", None), *one, ("fused", None), *split, *dots]:
            def call(kernel=kernel, tile=tile):
                moe.LOGITS_DOT_TILE = tile or DOT_TILES[0]  # read at launch: a captured graph keeps its tile
                return route(x, w, None, TOP_K, "softmax", True, 1.0, 1, 1, n_shared=n_shared, shared_gate=gate,
                             logits_kernel=kernel.removesuffix("_one_launch"),
                             one_launch=kernel.endswith("_one_launch"))
            ids, weights = call()
            ok_ids = torch.equal(ids[:, :TOP_K].long().sort(dim=-1).values, want_ids)
            got_w = weights[:, :TOP_K].sort(dim=-1, descending=True).values
            err = float((got_w - want_w).norm() / want_w.norm())
            gate_err = float((weights[:, TOP_K] - want_gate[:, 0]).norm() / want_gate.norm())
            row = {"tokens": T, "kernel": kernel, "default": logits_kernel_for(T, E, D) == kernel, "ids_equal": ok_ids,
                   "weights_rel_err": err, "shared_gate_rel_err": gate_err}
            name = kernel
            if tile:
                row["dot_tile"] = list(tile)
                row["default"] = row["default"] and tile == DOT_TILES[0]
                name = f"dot {tile}"
            if ok_ids and err < 1e-2 and gate_err < 1e-2:
                row["us"] = graph_us(call)
            rows.append(row)
            print(f"T={T:4d} {name:22s}{' (default)' if row['default'] else '          '} ids equal {ok_ids}, "
                  f"weights {err:.1e}, gate {gate_err:.1e}: {row.get('us', float('nan')):.2f} us", flush=True)
    moe.LOGITS_DOT_TILE = DOT_TILES[0]
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "router_logits_probe.json").write_text(json.dumps({"device": torch.cuda.get_device_name(), "rows": rows},
                                                             indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
