"""A GQA layer's q / k norms and partial rotary, compiled by Inductor, with the NeoX rotation written two ways.

The glue of a GQA layer at 4096 tokens took 0.27 ms (bench qwen3_next, H200). Its q / k norms and
rotary ran as two combo kernels (86 and 24 us a layer; step_account_flat_gdn_rows_h200_2026-12-03):
the first wrote the rotated channels' float32 products to buffers of their own, the second
combined and cast them (benchmarks/history/linear_extend.md; the output gate's kernel, 81 us, is
apart). `models.common.apply_rotary` now writes one cat of the two rotated halves and the rest;
the nested form (a cat of the rotated halves, cast, then a cat with the rest) is kept here as
`nested_rotary`. Per form:

1. the function the layer runs between its projection and the attention op (q and k views of the
   projection's output, per-head RMSNorm with the unit offset, rotary of the first quarter of the
   channels) compiled with torch.compile on the device;
2. checked against a float64 CPU reference of the same math on fresh random inputs (relative error
   of the norm), then timed in a CUDA graph (bench_common.graph_call_us) with its kernels counted
   (torch.profiler), at each token count.

    bash benchmarks/gpu_call.sh python3 benchmarks/probes/rotary_glue_probe.py --out $OUT
    python3 benchmarks/probes/rotary_glue_probe.py --dry-run --out /tmp/rot   # CPU: C++ kernels, tiny

A third form, `kernel`, is runtime/backends/kernels/norm_rope.py's `qk_norm_rope`: q and k in one
launch that reads each row once, with the layer's inv_freq made once outside the timed call (a
constant of the layer); checked and timed the same way, not compiled (the dry run interprets it).

Shapes: bench qwen3_next's GQA layer (16 query heads with their gates, 2 kv heads, head dim 256,
rotary dim 64, theta 1e7), bf16. Writes OUT/rotary_glue_probe.json.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

if "--dry-run" in sys.argv:  # the kernel form in Triton's interpreter, chosen before triton is imported
    os.environ.setdefault("TRITON_INTERPRET", "1")

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

import torch  # noqa: E402

from bench_common import device_facts, graph_call_us, kernels_per_call, rel_err  # noqa: E402
from models.common import apply_rotary, rope_inv_freq  # noqa: E402
from runtime.backends.kernels.norm_rope import qk_norm_rope  # noqa: E402

CHECK_TOL = 1e-2  # bf16 outputs against float64


def nested_rotary(x, positions, rotary_dim, theta):
    """The NeoX rotation as models.common wrote it before: a cat of the rotated halves, then one with the rest."""
    freqs = positions.float().unsqueeze(-1) * rope_inv_freq(rotary_dim, theta, positions.device)
    cos, sin = freqs.cos().unsqueeze(1), freqs.sin().unsqueeze(1)
    rot, rest = x[..., :rotary_dim].float(), x[..., rotary_dim:]
    x1, x2 = rot[..., : rotary_dim // 2], rot[..., rotary_dim // 2:]
    rotated = torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)
    return torch.cat((rotated.to(x.dtype), rest), dim=-1)


def layer_glue(rotary, dims):
    H, Hkv, hd, rd, theta, eps = dims

    def rms(x, w):
        var = x.float().pow(2).mean(-1, keepdim=True)
        return (x.float() * torch.rsqrt(var + eps) * (1.0 + w.float())).to(x.dtype)

    def glue(qkv, wq, wk, positions):
        q, k = qkv[:, :H * 2 * hd], qkv[:, H * 2 * hd:H * 2 * hd + Hkv * hd]
        q, gate = q.view(-1, H, 2 * hd).split([hd, hd], dim=-1)
        q = rotary(rms(q, wq), positions, rd, theta)
        k = rotary(rms(k.view(-1, Hkv, hd), wk), positions, rd, theta)
        return q, k, gate
    return glue


def kernel_glue(dims, device):
    """The same q and k through qk_norm_rope: one launch (the gate is the view beside q)."""
    H, Hkv, hd, rd, theta, eps = dims
    inv_freq = rope_inv_freq(rd, theta, device)

    def glue(qkv, wq, wk, positions):
        q, k = qkv[:, :H * 2 * hd], qkv[:, H * 2 * hd:H * 2 * hd + Hkv * hd]
        q, gate = q.view(-1, H, 2 * hd).split([hd, hd], dim=-1)
        q, k = qk_norm_rope(q, k.view(-1, Hkv, hd), wq, wk, positions, inv_freq, eps, unit_offset=True)
        return q, k, gate
    return glue


def reference(qkv, wq, wk, positions, dims):
    """The same math in float64 on the CPU."""
    H, Hkv, hd, rd, theta, eps = dims
    x, p = qkv.double().cpu(), positions.cpu()
    angle = p.double()[:, None] * rope_inv_freq(rd, theta, torch.device("cpu")).double()
    c, s = angle.cos()[:, None], angle.sin()[:, None]

    def rot(v, w):
        v = v * torch.rsqrt(v.pow(2).mean(-1, keepdim=True) + eps) * (1.0 + w.double().cpu())
        a, b = v[..., : rd // 2], v[..., rd // 2:rd]
        return torch.cat((a * c - b * s, b * c + a * s, v[..., rd:]), -1)
    q = x[:, :H * 2 * hd].view(-1, H, 2 * hd)[..., :hd]
    k = x[:, H * 2 * hd:H * 2 * hd + Hkv * hd].view(-1, Hkv, hd)
    return rot(q, wq), rot(k, wk)


def run(args) -> dict:
    device = torch.device("cpu" if args.dry_run else "cuda")
    dims = (2, 1, 32, 8, 1e7, 1e-6) if args.dry_run else (16, 2, 256, 64, 1e7, 1e-6)
    H, Hkv, hd = dims[:3]
    width = H * 2 * hd + 2 * Hkv * hd  # q with its gates, k, v: the projection's output row
    tokens = [8] if args.dry_run else [1, 512, 4096]
    g = torch.Generator().manual_seed(0)
    doc = {"env": device_facts(args.dry_run), "dims": dict(zip(("H", "Hkv", "hd", "rotary", "theta", "eps"), dims)),
           "rows": []}
    compiled = {"nested": nested_rotary, "one_cat": apply_rotary}
    forms = [*compiled, "kernel"]
    for T in tokens:
        qkv = torch.randn(T, width, generator=g).to(torch.bfloat16).to(device)
        wq, wk = (0.1 * torch.randn(hd, generator=g)).to(torch.bfloat16).to(device), \
            (0.1 * torch.randn(hd, generator=g)).to(torch.bfloat16).to(device)
        positions = torch.randint(0, 8192, (T,), generator=g).to(device)
        want_q, want_k = reference(qkv, wq, wk, positions, dims)
        row = {"tokens": T}
        for name in forms:
            torch._dynamo.reset()
            fn = torch.compile(layer_glue(compiled[name], dims), dynamic=False) if name in compiled else \
                kernel_glue(dims, device)
            with torch.no_grad():
                q, k, _ = fn(qkv, wq, wk, positions)
                err = max(rel_err(q, want_q), rel_err(k, want_k))
                cell = {"rel_err": err, "ok": err <= CHECK_TOL}
                if cell["ok"]:
                    cell["us"] = graph_call_us(lambda _, f=fn: f(qkv, wq, wk, positions), args.calls, args.replays,
                                               device)
                    cell["kernels"] = kernels_per_call(lambda f=fn: f(qkv, wq, wk, positions))
            row[name] = cell
        doc["rows"].append(row)
        print(f"T={T}: " + "; ".join(f"{n} {row[n].get('us', float('nan')):.1f} us, {row[n].get('kernels')} kernels, "
                                     f"err {row[n]['rel_err']:.1e}" for n in forms), flush=True)
    return doc


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True, type=Path)
    ap.add_argument("--dry-run", action="store_true", help="CPU: C++ kernels, tiny dims; times mean nothing")
    ap.add_argument("--calls", type=int, default=20, help="calls captured in one graph")
    ap.add_argument("--replays", type=int, default=30)
    args = ap.parse_args(argv)
    doc = run(args)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "rotary_glue_probe.json").write_text(json.dumps(doc, indent=1))
    return doc


if __name__ == "__main__":
    main()
    # Everything is written. On an H100 (2026-12-06) the process wrote its JSON (its last step),
    # then did not end in the 400 s its call had left: the interpreter's teardown, with torch.compile's
    # compile workers still up, is what remained. Nothing is left to tear down, so it ends here.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
