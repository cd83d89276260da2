"""The Triton GQA varlen kernel (kernels/gqa.py) on prompt-sized steps: split counts and key tiles.

    python3 benchmarks/kernels/gqa_extend_sweep.py --out $OUT            # GPU: bench qwen3_next's GQA layer
    python3 benchmarks/kernels/gqa_extend_sweep.py --out /tmp/g --dry-run  # CPU: interpreter, tiny dims

Why: extend steps of up to `whole_extend_tokens` (512) rows run their GQA layers on this kernel, and
a 512-token step spent 0.17 ms in three GQA layers (6% of the matrix rate; history/linear_extend.md).
The kernel splits each row block's keys over `num_splits_for` programs, chosen for decode, where
few rows must fill the card; a prompt's rows fill it already, and every split writes float32
partial rows that the combine pass reads back. This weighs, per step shape, the split count (the
default's choice, 1, 2, 4, 8) and the key tile (16, 32, 64 keys):

1. each variant's output first checked against a float32 CPU reference of causal attention over
   the request's keys (relative error of the norm, within CHECK_TOL), on fresh random inputs, a
   request's pages out of order in the cache as the pool leaves them;
2. then one call (the kernel and its combine pass) timed inside a CUDA graph (bench_common.graph_call_us).

Shapes: bench qwen3_next's GQA layer (16 query heads, 2 kv heads, head dim 256, pages of 16), one
request of 128, 256 and 512 new tokens from an empty cache, and 4 x 128. Writes OUT/gqa_extend_sweep.json.
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
SPLITS = ("auto", 1, 2, 4, 8)
BLOCK_N = (16, 32, 64)
DRY_SPLITS, DRY_BLOCK_N = ("auto", 1, 4), (16, 32)  # the interpreter is slow: enough to walk every path


def make_step(reqs: list[int], hq: int, hkv: int, d: int, page: int, dtype, device, gen) -> dict:
    """Fresh prompts of reqs[b] tokens each (the cache already holds this step's keys), pages out of order."""
    width = max(-(-n // page) for n in reqs)
    num_pages = len(reqs) * width
    order = torch.randperm(num_pages, generator=gen)
    table = torch.zeros(len(reqs), width, dtype=torch.int32)
    for b, n in enumerate(reqs):
        table[b, :-(-n // page)] = order[b * width:b * width + -(-n // page)].to(torch.int32)
    starts = [0]
    for n in reqs:
        starts.append(starts[-1] + n)
    q = torch.randn(starts[-1], hq, d, generator=gen).to(dtype)
    kc = torch.randn(num_pages, page, hkv, d, generator=gen).to(dtype)
    vc = torch.randn(num_pages, page, hkv, d, generator=gen).to(dtype)
    return {"q": q, "k": kc, "v": vc, "table": table, "lens": torch.tensor(reqs, dtype=torch.int32),
            "starts": torch.tensor(starts, dtype=torch.int32), "reqs": reqs, "page": page,
            "dev": {k: v.to(device) for k, v in dict(q=q, k=kc, v=vc, table=table,
                                                       lens=torch.tensor(reqs, dtype=torch.int32),
                                                       starts=torch.tensor(starts, dtype=torch.int32)).items()}}


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
    shapes = [[24], [8, 8]] if args.dry_run else [[128], [256], [512], [128] * 4]
    scale = d ** -0.5
    gen = torch.Generator().manual_seed(0)
    doc = {"env": device_facts(args.dry_run), "layer": dict(hq=hq, hkv=hkv, d=d, page=page, dtype=str(dtype)),
           "rows": []}
    for reqs in shapes:
        step = make_step(reqs, hq, hkv, d, page, dtype, device, gen)
        ref = reference(step, scale)
        t = step["dev"]
        out = torch.empty(t["q"].shape[0], hq, d, dtype=dtype, device=device)
        row = {"requests": reqs, "variants": {}}
        for splits in DRY_SPLITS if args.dry_run else SPLITS:
            for block_n in DRY_BLOCK_N if args.dry_run else BLOCK_N:
                kw = dict(num_splits=None if splits == "auto" else splits, block_n=block_n)

                def call(_=None, kw=kw):
                    triton_gqa_attention_varlen(t["q"], t["k"], t["v"], t["table"], t["lens"], t["starts"], out,
                                                scale, **kw)
                out.fill_(float("nan"))
                call()
                err = rel_err(out, ref)
                cell = {"rel_err": err, "ok": err <= CHECK_TOL[dtype]}
                if cell["ok"]:
                    cell["us"] = graph_call_us(call, args.calls, args.replays, device)
                row["variants"][f"splits={splits} block_n={block_n}"] = cell
        doc["rows"].append(row)
        timed = {k: v["us"] for k, v in row["variants"].items() if "us" in v}
        best = min(timed, key=timed.get) if timed else None
        default = row["variants"]["splits=auto block_n=32"]
        print(f"{'x'.join(map(str, reqs))} tokens: default {default.get('us', float('nan')):.1f} us; best {best} "
              f"{timed.get(best, float('nan')):.1f} us; failed {[k for k, v in row['variants'].items() if not v['ok']]}",
              flush=True)
    return doc


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True, type=Path)
    ap.add_argument("--dry-run", action="store_true", help="CPU: Triton's interpreter, tiny dims; times mean nothing")
    ap.add_argument("--calls", type=int, default=20, help="calls captured in one graph")
    ap.add_argument("--replays", type=int, default=30)
    args = ap.parse_args(argv)
    doc = run(args)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "gqa_extend_sweep.json").write_text(json.dumps(doc, indent=1))
    return doc


if __name__ == "__main__":
    main()
