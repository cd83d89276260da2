"""The Triton GQA varlen kernel (kernels/gqa.py) on prompt-sized steps: split counts and key tiles.

    python3 benchmarks/kernels/gqa_extend_sweep.py --out $OUT            # GPU: bench qwen3_next's GQA layer
    python3 benchmarks/kernels/gqa_extend_sweep.py --out /tmp/g --dry-run  # CPU: interpreter, tiny dims

Why: extend steps of up to `whole_extend_tokens` (512) rows run their GQA layers on this kernel, and
a 512-token step spent 0.17 ms in three GQA layers (6% of the matrix rate; history/linear_extend.md).
The kernel splits each row block's keys over `num_splits_for` programs, chosen for decode, where
few rows must fill the card; a prompt's rows fill it already, and every split writes float32
partial rows that the combine pass reads back. This weighs, per step shape, the split count (the
default's choice, 1, 2, 4, 8, 16) and the key tile (16, 32, 64 keys), and the grid: one program per
request and row block of the longest request (the default; a bucket laid out for 256 requests
launches them for every request row) against one per row block the step's rows can fill
(`flat_grid`):

1. each variant's output first checked against a float32 CPU reference of causal attention over
   the request's keys (relative error of the norm, within CHECK_TOL), on fresh random inputs, a
   request's pages out of order in the cache as the pool leaves them;
2. then one call (the kernel and its combine pass) timed inside a CUDA graph (bench_common.graph_call_us).

Shapes: bench qwen3_next's GQA layer (16 query heads, 2 kv heads, head dim 256, pages of 16), one
request of 128, 256 and 512 new tokens from an empty cache, and 4 x 128, each alone (every split and
tile, both grids at the default's); then 512 tokens in buckets laid out for 33 and 256 requests
and 4 x 128 in one for 256 (the default's split and tile, both grids). `--long` times instead the
steps past `whole_extend_tokens` (2048 and 4096 tokens of one request, 4 x 1024; each key tile, both
grids), which run FlashInfer's prefill kernel in an eager gap today: whether this kernel could take
them inside the step's graph. `--tiles` times instead, for the steps alone, the program's launch:
query rows a program (64, 128), warps (4, 8) and pipeline stages (2, 3), each with the default's
split count, one and two splits, and 32 and 64-key tiles (kernels/gqa.py VARLEN_WARPS says what
the default holds and what the sweep found). Writes OUT/gqa_extend_sweep.json.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

if "--dry-run" in sys.argv:  # the interpreter must be chosen before triton is imported
    os.environ["TRITON_INTERPRET"] = "1"

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

import torch  # noqa: E402

from bench_common import device_facts, graph_call_us, rel_err  # noqa: E402
from runtime.backends.kernels.gqa import triton_gqa_attention_varlen  # noqa: E402

CHECK_TOL = {torch.bfloat16: 2e-2, torch.float32: 1e-4}
SPLITS = ("auto", 1, 2, 4, 8, 16)  # 16: the two-wave count at 128 tokens, the default before one wave
BLOCK_N = (16, 32, 64)
DRY_SPLITS, DRY_BLOCK_N = ("auto", 4), (32,)  # the interpreter is slow: enough to walk every path
# --tiles: (query rows a program, warps, stages), crossed with TILE_SPLITS and BLOCK_N[1:]
TILES = [(m, w, st) for m in (64, 128) for w in (4, 8) for st in (2, 3)]
TILE_SPLITS = ("auto", 1, 2)
DRY_TILES = [(16, 4, 2), (32, 2, 1)]


def make_step(reqs: list[int], hq: int, hkv: int, d: int, page: int, dtype, device, gen, seqs: int = 0) -> dict:
    """Fresh prompts of reqs[b] tokens each (the cache already holds this step's keys), pages out of
    order; laid out for `seqs` requests as a captured bucket is (the ones past reqs own no rows)."""
    width = max(-(-n // page) for n in reqs)
    num_pages = len(reqs) * width
    order = torch.randperm(num_pages, generator=gen)
    seqs = max(seqs, len(reqs))
    table = torch.zeros(seqs, width, dtype=torch.int32)
    for b, n in enumerate(reqs):
        table[b, :-(-n // page)] = order[b * width:b * width + -(-n // page)].to(torch.int32)
    starts = [0]
    for n in reqs:
        starts.append(starts[-1] + n)
    starts += [starts[-1]] * (seqs - len(reqs))
    q = torch.randn(starts[-1], hq, d, generator=gen).to(dtype)
    kc = torch.randn(num_pages, page, hkv, d, generator=gen).to(dtype)
    vc = torch.randn(num_pages, page, hkv, d, generator=gen).to(dtype)
    lens = torch.tensor(reqs + [0] * (seqs - len(reqs)), dtype=torch.int32)
    starts = torch.tensor(starts, dtype=torch.int32)
    return {"q": q, "k": kc, "v": vc, "table": table, "starts": starts, "reqs": reqs, "page": page,
            "dev": {k: v.to(device) for k, v in dict(q=q, k=kc, v=vc, table=table, lens=lens, starts=starts).items()}}


def reference(step: dict, scale: float) -> torch.Tensor:
    """Causal attention of each request's rows over its own keys, float32 on the CPU."""
    q, kc, vc, page = step["q"].float(), step["k"].float(), step["v"].float(), step["page"]
    group = q.shape[1] // kc.shape[2]
    out = torch.zeros_like(q)
    for b, n in enumerate(step["reqs"]):
        j = torch.arange(n)
        pages = step["table"][b][j // page].long()
        k = kc[pages, j % page].repeat_interleave(group, 1)
        v = vc[pages, j % page].repeat_interleave(group, 1)
        s0 = int(step["starts"][b])
        s = torch.einsum("qhd,khd->hqk", q[s0:s0 + n], k) * scale
        s = s.masked_fill(j[None, :] > j[:, None], float("-inf"))
        out[s0:s0 + n] = torch.einsum("hqk,khd->qhd", torch.softmax(s, -1), v)
    return out


def run(args) -> dict:
    device = torch.device("cpu" if args.dry_run else "cuda")
    dtype = torch.float32 if args.dry_run else torch.bfloat16
    hq, hkv, d, page = (4, 1, 16, 4) if args.dry_run else (16, 2, 256, 16)
    # (new tokens of each request, request rows of the layout): a step alone, then in a bucket laid out
    # for more requests than it has (the served artifact's extend buckets hold 256)
    shapes = ([([24], 1), ([8, 8], 2), ([24], 6)] if args.dry_run else
              [([128], 1), ([256], 1), ([512], 1), ([128] * 4, 4), ([512], 33), ([512], 256), ([128] * 4, 256)])
    if args.long:  # the steps past whole_extend_tokens, where FlashInfer's prefill runs eagerly today
        shapes = [([48], 1), ([16] * 3, 3)] if args.dry_run else [([2048], 1), ([4096], 1), ([1024] * 4, 4)]
    scale = d ** -0.5
    gen = torch.Generator().manual_seed(0)
    doc = {"env": device_facts(args.dry_run), "layer": dict(hq=hq, hkv=hkv, d=d, page=page, dtype=str(dtype)),
           "rows": []}
    for reqs, seqs in shapes:
        step = make_step(reqs, hq, hkv, d, page, dtype, device, gen, seqs)
        ref = reference(step, scale)
        t = step["dev"]
        out = torch.empty(t["q"].shape[0], hq, d, dtype=dtype, device=device)
        row = {"requests": reqs, "seqs": seqs, "variants": {}}
        alone = seqs == len(reqs)  # the split and tile sweep for steps alone; the default's grids everywhere
        if args.tiles and not alone:
            continue
        variants = [(splits, block_n, False, None) for splits in (DRY_SPLITS if args.dry_run else SPLITS)
                    for block_n in (DRY_BLOCK_N if args.dry_run else BLOCK_N)] if alone else [("auto", 32, False, None)]
        if args.long:  # one split fills the card at these sizes: the key tiles only
            variants = [("auto", block_n, False, None) for block_n in (DRY_BLOCK_N if args.dry_run else BLOCK_N)]
        if args.tiles:
            variants = [("auto", 32, False, None)] + [
                (splits, block_n, False, tile) for tile in (DRY_TILES if args.dry_run else TILES)
                for splits in (DRY_SPLITS if args.dry_run else TILE_SPLITS)
                for block_n in (DRY_BLOCK_N if args.dry_run else BLOCK_N[1:])]
        for splits, block_n, flat, tile in variants + [("auto", 32, True, None)]:
            kw = dict(num_splits=None if splits == "auto" else splits, block_n=block_n, flat_grid=flat)
            if tile is not None:
                kw.update(block_m=tile[0], num_warps=tile[1], num_stages=tile[2])

            def call(_=None, kw=kw):
                triton_gqa_attention_varlen(t["q"], t["k"], t["v"], t["table"], t["lens"], t["starts"], out,
                                            scale, **kw)
            out.fill_(float("nan"))
            call()
            err = rel_err(out, ref)
            cell = {"rel_err": err, "ok": err <= CHECK_TOL[dtype]}
            if cell["ok"]:
                cell["us"] = graph_call_us(call, args.calls, args.replays, device)
            launch = "" if tile is None else f" block_m={tile[0]} warps={tile[1]} stages={tile[2]}"
            row["variants"][f"{'flat ' if flat else ''}splits={splits} block_n={block_n}{launch}"] = cell
        doc["rows"].append(row)
        timed = {k: v["us"] for k, v in row["variants"].items() if "us" in v}
        best = min(timed, key=timed.get) if timed else None
        default, flat = row["variants"]["splits=auto block_n=32"], row["variants"]["flat splits=auto block_n=32"]
        print(f"{'x'.join(map(str, reqs))} tokens in {seqs} request rows: default {default.get('us', float('nan')):.1f} "
              f"us, flat grid {flat.get('us', float('nan')):.1f} us; best {best} {timed.get(best, float('nan')):.1f} us; "
              f"failed {[k for k, v in row['variants'].items() if not v['ok']]}", flush=True)
    return doc


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True, type=Path)
    ap.add_argument("--dry-run", action="store_true", help="CPU: Triton's interpreter, tiny dims; times mean nothing")
    ap.add_argument("--long", action="store_true",
                    help="instead: 2048 and 4096 tokens of one request and 4 x 1024 (every key tile, both grids)")
    ap.add_argument("--tiles", action="store_true",
                    help="instead: the steps alone at each program tile, warps and stages (TILES)")
    ap.add_argument("--calls", type=int, default=20, help="calls captured in one graph")
    ap.add_argument("--replays", type=int, default=30)
    args = ap.parse_args(argv)
    doc = run(args)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "gqa_extend_sweep.json").write_text(json.dumps(doc, indent=1))
    return doc


if __name__ == "__main__":
    main()
