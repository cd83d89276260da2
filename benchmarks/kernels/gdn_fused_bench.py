"""The GDN region of one layer at decode, unfused (today) against hgc.gdn_fused (one launch): one
command, checks first, JSON to --out.

    python3 benchmarks/kernels/gdn_fused_bench.py --out $OUT              # GPU
    python3 benchmarks/kernels/gdn_fused_bench.py --dry-run --out /tmp/g    # CPU: interpreter, tiny dims

The region is what a Qwen3-Next / Qwen3.5 GDN layer runs between its projections, at the bench
dims (testkit/gdn_cases.py BENCH_GDN: Hk 16, Hv 32, Dk = Dv = 128, K 4; bf16), at decode batch
B = 1, 8, 16, 32, 64, 128 (--batches), every row a request on its own slot, inputs as views of one projection
row (strided qkv, z, b, a):

- unfused: the short-conv decode kernel, the glue between it and the recurrence (split, l2norm of
  q and k, beta, g) as one torch.compile'd function (Inductor with the bundle's settings: combo
  kernels, as the compiled pieces run it), the recurrent decode kernel, the gated RMSNorm as a
  second compiled function;
- fused: runtime/backends/kernels/gdn_fused.py's decode kernel (one launch: one program per
  request and key head);
- fused_2: the same op's two-launch split (`launches=2`, `v_blocks=1`; the op takes the split up
  to SPLIT_DECODE_MAX_ROWS requests): the conv step and the l2norm of q and k per (request, head of
  q, k or v) into a [B, C] buffer, then the recurrence and the gated norm per (request, value
  head): twice the programs of the one-launch kernel at batch 1, and one launch more;
- fused_2v: the split with the op's default value blocks (GF.default_v_blocks for the card's SMs,
  recorded as `v_blocks`: 4 at batch 1 of these dims, 1 from batch 8 on, where it is fused_2): each
  head's state over that many programs of Dv / v_blocks columns, the last of a head's blocks
  computing its gated norm;
- fused_1v: fused_2v's programs as one launch (`merged_split`, triton_linear's split_decode
  "one_launch"): each does the conv and l2norm of what it reads, the last of a key head's programs
  rolling its q and k history;
- fused_1v_early: fused_1v with its gates loaded before its slot is known (gdn_fused_decode's
  early_gates), where fused_1v loads them behind the key head's counter: one dependent round
  trip fewer a program, the same values;
- fused_4: the op past ONE_LAUNCH_MAX_ROWS requests, as triton_linear runs it: four launches, the
  decode conv, the op's l2norm-and-gates kernel, the recurrent decode kernel, the op's gated-norm
  kernel.

For each B, first the check: every variant from copies of the same random non-zero pools, one
step, each fused variant's output and both states against the unfused ones by ||x - ref|| / ||ref||
(bf16: 1e-2, states 5e-3); a failed check stops that B's timing. Then per variant: device kernels
of one call (torch.profiler, the launches), and the time of one call inside a CUDA graph of
--calls calls, replayed --replays times (median over replays, divided by the calls), and the
ratios unfused / fused; the one-launch kernel also at 8 and 16 warps (`fused_by_warps`, us).
Everything in $OUT/gdn_fused_bench.json, a table last. The dry run walks the same code on the CPU
with eager glue (no Inductor there) at tiny dims; its times mean nothing.
"""

from __future__ import annotations

import os
import sys

if "--dry-run" in sys.argv:
    os.environ["TRITON_INTERPRET"] = "1"  # before triton is imported anywhere

import argparse  # noqa: E402
import dataclasses  # noqa: E402
import json  # noqa: E402
from pathlib import Path  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))  # bench_common

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from bench_common import device_facts, graph_call_us, is_cuda, kernels_per_call, rel_err  # noqa: E402
from models.qwen3_next import l2norm  # noqa: E402
from runtime.backends.kernels import gdn_fused as GF  # noqa: E402
from runtime.backends.kernels import linear as TL  # noqa: E402
from runtime.backends.kernels.sm_count import num_sms  # noqa: E402
from testkit.gdn_cases import BENCH_GDN, GdnShape, gdn_inputs, gdn_params, gdn_pools  # noqa: E402

DRY_SHAPE = GdnShape(2, 4, 16, 64)  # Dv 64: the default value blocks split it (2 blocks of 32 columns)
EPS = 1e-6
# bf16: both variants round the same values, their float32 sums in other orders; Triton's
# interpreter (the dry run) truncates where a GPU rounds to nearest, a few bf16 steps more
BF16_STEPS = 4 if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0") else 1
OUT_TOL, STATE_TOL = 1e-2 * BF16_STEPS, 5e-3 * BF16_STEPS


def qk_gates_glue(mixed, b, a, A_log, dt_bias, hk: int, dk: int, hv: int, dv: int):
    """The model's glue between the conv and the recurrence (models/qwen3_next.py GatedDeltaNetBase.forward)."""
    q, k, v = mixed.split([hk * dk, hk * dk, hv * dv], dim=-1)
    q = l2norm(q.reshape(-1, hk, dk))
    k = l2norm(k.reshape(-1, hk, dk))
    v = v.reshape(-1, hv, dv)
    beta = b.sigmoid()
    g = -A_log.float().exp() * F.softplus(a.float() + dt_bias)
    return q, k, v, g, beta


def gated_norm_glue(core, z, weight, eps: float):
    """models/qwen3_next.py GatedRMSNorm.forward, as a function."""
    dtype = core.dtype
    xf = core.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    y = weight * xf.to(dtype)
    return (y * F.silu(z.float())).to(dtype)


class Region:
    """One layer's GDN region at decode batch B over one pool: `unfused()` and `fused()` each run
    one step (static inputs, static slots: what a captured decode step replays); the fused op
    writes `out`, the unfused glue makes a new one."""

    def __init__(self, s: GdnShape, pool, x: dict, p, slots: torch.Tensor, glue: tuple):
        self.s, self.x, self.p, self.slots = s, x, p, slots
        self.conv, self.state = pool.layer(0)["conv"], pool.layer(0)["recurrent"]
        B = slots.shape[0]
        self.out = self.out_buf = torch.empty(B, s.hv, s.dv, dtype=x["qkv"].dtype, device=slots.device)
        self.mixed = torch.empty(x["qkv"].shape, dtype=x["qkv"].dtype, device=slots.device)
        self.core = torch.empty_like(self.out)
        self.qk_gates, self.norm = glue

    def unfused(self, op_glue: bool = False) -> None:
        """op_glue: the op's own l2norm-and-gates and gated-norm kernels in place of the compiled glue."""
        s, x, p = self.s, self.x, self.p
        TL.short_conv_decode(x["qkv"], p.conv_weight, None, self.mixed, self.conv, self.slots, True)
        if op_glue:
            dims = GF.GdnDims(s.hk, s.hv, s.dk, s.dv, s.channels, s.kernel_width)
            q, k, v, g, beta = GF.qk_gates(self.mixed, x["b"], x["a"], p.A_log, p.dt_bias, dims)
        else:
            q, k, v, g, beta = self.qk_gates(self.mixed, x["b"], x["a"], p.A_log, p.dt_bias, s.hk, s.dk, s.hv, s.dv)
        TL.gdn_decode(q, k, v, g, beta, self.core, self.state, self.slots, s.scale)
        if op_glue:
            GF.gated_rmsnorm(self.core, x["z"], p.norm_weight, self.out_buf, EPS, slots=self.slots, rows_per_slot=1)
            self.out = self.out_buf
        else:
            self.out = self.norm(self.core, x["z"], p.norm_weight, EPS)  # feeds out_proj as it is: no copy

    def fused_2(self) -> None:
        self.fused(launches=2, v_blocks=1)

    def fused_2v(self) -> None:
        self.fused(launches=2)  # the default value blocks (v_blocks_of)

    def fused_1v(self) -> None:
        self.fused(launches=2, merged_split=True)

    def fused_1v_early(self) -> None:
        self.fused(launches=2, merged_split=True, early_gates=True)

    def fused_4(self) -> None:
        """The op past ONE_LAUNCH_MAX_ROWS requests, as triton_linear runs it: the unfused kernels with
        the op's own two glue kernels."""
        self.unfused(op_glue=True)

    def fused(self, num_warps: int | None = None, launches: int = 1, v_blocks: int | None = None,
              merged_split: bool = False, early_gates: bool = False) -> None:
        s, x, p = self.s, self.x, self.p
        GF.gdn_fused_decode(x["qkv"], x["z"], x["b"], x["a"], p.conv_weight, p.A_log, p.dt_bias, p.norm_weight,
                            self.out_buf, self.conv, self.state, self.slots, s.hk, s.scale, EPS, num_warps=num_warps,
                            launches=launches, v_blocks=v_blocks, merged_split=merged_split,
                            early_gates=early_gates)


FUSED = ("fused", "fused_2", "fused_2v", "fused_1v", "fused_1v_early", "fused_4")


def v_blocks_of(s: GdnShape, B: int, device) -> int:
    """The value blocks fused_2v takes at batch B: the op's default on this device."""
    return GF.default_v_blocks(B, s.hv, s.dv, num_sms(device))


WARPS = (8, 16)  # 4 spill (GF.decode_warps)


def check(s: GdnShape, B: int, glue: tuple, device) -> dict:
    """One step of each variant from copies of the same pools: each fused variant's output and
    states against the unfused ones."""
    pools = gdn_pools({0: s}, B, device, seed=B, copies=2 + len(FUSED))[1:]
    x = gdn_inputs(s, B, B, torch.bfloat16, torch.Generator().manual_seed(B + 1), device)
    p = gdn_params(s, torch.bfloat16, seed=B + 2).to(device)
    slots = torch.arange(1, B + 1, device=device)
    ref = Region(s, pools[0], x, p, slots, glue)
    ref.unfused()
    doc = {}
    for name, pool in zip(FUSED, pools[1:]):
        region = Region(s, pool, x, p, slots, glue)
        getattr(region, name)()
        errs = {"out": rel_err(region.out, ref.out)}
        for entry in ("conv", "recurrent"):
            errs[entry] = rel_err(pool.layer(0)[entry][1:], pools[0].layer(0)[entry][1:])
        doc[name] = {"rel_err": errs, "ok": bool(torch.isfinite(region.out).all()) and errs["out"] <= OUT_TOL
                     and max(errs["conv"], errs["recurrent"]) <= STATE_TOL}
    return {"variants": doc, "ok": all(v["ok"] for v in doc.values()), "v_blocks": v_blocks_of(s, B, device)}


def bench(s: GdnShape, B: int, glue: tuple, device, calls: int, replays: int) -> dict:
    _, pool = gdn_pools({0: s}, B, device, seed=B)
    x = gdn_inputs(s, B, B, torch.bfloat16, torch.Generator().manual_seed(B + 1), device)
    p = gdn_params(s, torch.bfloat16, seed=B + 2).to(device)
    region = Region(s, pool, x, p, torch.arange(1, B + 1, device=device), glue)
    row = {}
    for name in ("unfused",) + FUSED:
        fn = getattr(region, name)
        row[name] = {"us": graph_call_us(lambda _: fn(), calls, replays, device), "kernels": kernels_per_call(fn)}
    row["ratio"] = row["unfused"]["us"] / row["fused"]["us"]  # the op's kernel against today
    row["ratio_2"] = row["unfused"]["us"] / row["fused_2"]["us"]
    row["ratio_2v"] = row["unfused"]["us"] / row["fused_2v"]["us"]  # its v_blocks: the check's
    row["ratio_1v"] = row["unfused"]["us"] / row["fused_1v"]["us"]
    row["ratio_1v_early"] = row["unfused"]["us"] / row["fused_1v_early"]["us"]
    row["ratio_4"] = row["unfused"]["us"] / row["fused_4"]["us"]
    # the one-launch kernel's warps (default: GF.decode_warps): few programs at batch 1 may want more
    row["fused_by_warps"] = {w: graph_call_us(lambda _, w=w: region.fused(w), calls, replays, device) for w in WARPS}
    return row


def compiled_glue(dry: bool) -> tuple:
    """The glue as the compiled pieces run it (Inductor with the bundle's cuda settings); eager in a dry run."""
    if dry:
        return qk_gates_glue, gated_norm_glue
    from compiler.splitops.bundle import INDUCTOR_CONFIG
    options = INDUCTOR_CONFIG["cuda"]
    return (torch.compile(qk_gates_glue, dynamic=False, options=options),
            torch.compile(gated_norm_glue, dynamic=False, options=options))


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True, type=Path)
    ap.add_argument("--dry-run", action="store_true", help="CPU, Triton's interpreter, tiny dims, eager glue")
    ap.add_argument("--batches", default=None,
                    help="comma-separated decode batches (default 1,8,16,32,64,128; dry run 1,3)")
    ap.add_argument("--calls", type=int, default=50, help="calls captured in one graph")
    ap.add_argument("--replays", type=int, default=200)
    args = ap.parse_args(argv)
    dry = args.dry_run
    if not dry and not is_cuda():
        ap.error("needs a CUDA GPU (or --dry-run)")
    device = torch.device("cpu" if dry else "cuda")
    s = DRY_SHAPE if dry else BENCH_GDN
    batches = [int(b) for b in (args.batches or ("1,3" if dry else "1,8,16,32,64,128")).split(",")]
    glue = compiled_glue(dry)
    doc = {"env": device_facts(dry), "shape": dataclasses.asdict(s), "calls_per_graph": args.calls,
           "replays": args.replays,
           "batches": {}}
    args.out.mkdir(parents=True, exist_ok=True)
    for B in batches:
        entry = {"check": check(s, B, glue, device)}
        if entry["check"]["ok"]:
            entry.update(bench(s, B, glue, device, args.calls, args.replays))
        doc["batches"][str(B)] = entry
        (args.out / "gdn_fused_bench.json").write_text(json.dumps(doc, indent=2))
    print(f"{'B':>5} {'check':>6} {'out err':>9} {'unfused us':>11} {'kernels':>8} {'fused us':>9} {'kernels':>8} "
          f"{'ratio':>6} {'fused_2 us':>11} {'ratio_2':>8} {'fused_2v us':>12} {'v_blocks':>9} {'ratio_2v':>9} "
          f"{'fused_1v us':>12} {'ratio_1v':>9} {'early us':>9} {'fused_4 us':>11} {'ratio_4':>8}")
    nan = float("nan")
    for B, e in doc["batches"].items():
        u, f, f2, f4 = e.get("unfused", {}), e.get("fused", {}), e.get("fused_2", {}), e.get("fused_4", {})
        f2v, f1v, f1e = e.get("fused_2v", {}), e.get("fused_1v", {}), e.get("fused_1v_early", {})
        err = e["check"]["variants"]["fused"]["rel_err"]["out"]
        print(f"{B:>5} {'ok' if e['check']['ok'] else 'FAIL':>6} {err:>9.2e} {u.get('us', nan):>11.2f} "
              f"{str(u.get('kernels')):>8} {f.get('us', nan):>9.2f} {str(f.get('kernels')):>8} "
              f"{e.get('ratio', nan):>6.2f} {f2.get('us', nan):>11.2f} {e.get('ratio_2', nan):>8.2f} "
              f"{f2v.get('us', nan):>12.2f} {e['check']['v_blocks']:>9} {e.get('ratio_2v', nan):>9.2f} "
              f"{f1v.get('us', nan):>12.2f} {e.get('ratio_1v', nan):>9.2f} {f1e.get('us', nan):>9.2f} "
              f"{f4.get('us', nan):>11.2f} {e.get('ratio_4', nan):>8.2f}")
    return doc


if __name__ == "__main__":
    doc = main()
    sys.exit(0 if all(e["check"]["ok"] for e in doc["batches"].values()) else 1)
