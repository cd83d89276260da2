"""A fused GDN layer's folds against the launches they replace: one command, checks first, JSON to --out.

    python3 benchmarks/kernels/gdn_folds_bench.py --out $OUT              # GPU
    python3 benchmarks/kernels/gdn_folds_bench.py --dry-run --out /tmp/f    # CPU: interpreter, tiny dims

An extend step of a fused GDN layer on our kernels is the extend conv, `qk_gates` (the l2norm of q
and k, both gates), the chunk kernels, then `gated_rmsnorm` (runtime/backends/kernels/gdn_fused.py);
a decode of many requests the decode conv, qk_gates, the recurrence and the norm. Three routing
options of triton_linear fold the small launches into their neighbours:
- qk_gates=in_conv: the conv normalises each q and k head and computes the gates as it stores its
  rows (`short_conv_extend(qk=...)`, kernels/linear.py `ConvQk`), so q and k are never stored
  unnormalised and read back (the decode conv of a step of many requests takes it too: not timed here);
- extend_norm=in_output: the chunk output kernel applies the norm as it stores each row
  (kernels/chunk.py `chunk_extend(gated_norm=...)`, kernels/linear.py `GatedNorm`), its programs a
  head's whole Dv row wide instead of the default tile's half of bench's 128 columns;
- decode_norm=in_recurrence: the decode recurrence applies the norm on whole-row tiles.
The extend folds are a launch a layer fewer and about 67 MB a layer less each at 4096 tokens. This
times each extend pair at the bench dims (Hk 16, Hv 32, Dk = Dv = 128, the conv's 8192 channels, K
4, bf16) for one request of each of --tokens rows and for 4 x 1024, the conv in the tile the backend
would take; and the whole layer at decode ("decode": the backend's gdn_fused op on the unfused
kernels, with qk_gates=in_conv and decode_norm=in_recurrence against neither) at --decodes requests.

First the checks, on fresh random inputs, both ways of each against the CPU reference by
||x - ref|| / ||ref||: the conv (float32, then rounded to bf16) with the mixer's l2norm and gates
for q, k, g and beta (bound 1e-2); the recurrence (cpu_reference, float32) over requests of 0, 1,
100, 64, 300 and 1000 rows from random states (chunk_kernel_sweep.py's), the core rounded to bf16,
then the mixer's gated_rms_norm (bound 2e-2: the chunk kernels' 1e-2 and the norm's roundings);
and the two ways against each other; at decode, both backends' layers against the CPU reference
backend's unfused ops on the same states (testkit/gdn_cases.py unfused_gdn; bound 1e-2, 4e-2 in the
dry run's interpreter). A failed check skips that fold's timing. Then per shape: us a call inside
a CUDA graph of --calls calls (median over --replays replays) of each way (at decode, the median of
do_bench's wall times: the backend's eager step), and the profiler's time per kernel. The dry run
walks the same code on the CPU at tiny dims; its times mean nothing.
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
sys.path.insert(0, str(ROOT / "benchmarks"))  # bench_common
sys.path.insert(0, str(ROOT / "benchmarks" / "kernels"))  # chunk_kernel_sweep, gpu_linear_extend

import numpy as np  # noqa: E402
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from bench_common import device_facts, device_ms_by_kernel, graph_call_us, is_cuda, rel_err  # noqa: E402
from chunk_kernel_sweep import check_case, conv_reference, launch_case  # noqa: E402
from compiler.splitops.gdn_mixer import gated_rms_norm, l2norm  # noqa: E402
from gpu_linear_extend import DRY, REAL  # noqa: E402
from runtime.backends.kernels import chunk as TC  # noqa: E402
from runtime.backends.kernels import gdn_fused as GF  # noqa: E402
from runtime.backends.kernels import linear as TL  # noqa: E402
from runtime.backends.kernels.launch_math import token_blocks  # noqa: E402

EPS = 1e-6
K = 4
# against the reference: the kernels' bf16 bound (chunk_kernel_sweep.py's 1e-2), the norm's fold two
# roundings more (the norm, its product with the weight); between the two ways: the order of a row's sums
QK_TOL, NORM_TOL, SAME_TOL = 1e-2, 2e-2, 1e-2


# -- qk_gates=in_conv: the q / k norm and gates in the conv's launch -------------------------------


def conv_inputs(spec, lens: list[int], device, seed: int) -> dict:
    """One conv launch over a GDN layer's q | k | v channels for requests of `lens` rows (no padding
    rows), random histories, b and a as strided views of one projection, the layer's gate parameters."""
    _, _, hk, hv, dk, dv = spec
    C, T, R = 2 * hk * dk + hv * dv, sum(lens), len(lens)
    g = torch.Generator().manual_seed(seed)
    ba = torch.randn(T, 2, hv + 8, generator=g).bfloat16()
    t = dict(x=torch.randn(T, C, generator=g).bfloat16(), weight=(torch.randn(C, K, generator=g) * 0.5).bfloat16(),
             bias=torch.zeros(C).bfloat16(), state=torch.randn(R + 2, C, K - 1, generator=g).bfloat16(),
             b=ba[:, 0, :hv], a=ba[:, 1, 4:hv + 4], A_log=torch.randn(hv, generator=g),
             dt_bias=torch.randn(hv, generator=g), slots=torch.arange(2, R + 2),
             bounds=torch.tensor(np.concatenate([[0], np.cumsum(lens), [T]]), dtype=torch.int64),
             blocks=torch.from_numpy(token_blocks(np.asarray(lens + [0]), TL.CONV_EXTEND_BLOCK_T)))
    return {k: v.to(device) for k, v in t.items()}


def conv_config(x: dict):
    """The tile the backend takes for this step (triton_linear._conv_extend)."""
    T, C = x["x"].shape
    if TL.conv_extend_takes_rows(T, x["blocks"].shape[0], K):
        return TL.conv_extend_rows_config(C)
    return TL.conv_extend_config(x["blocks"].shape[0], C, x["x"].device)


def conv_step(spec, x: dict, state, fold: bool, bufs: dict):
    """The conv and q / k norm and gates, folded (ConvQk) or apart (qk_gates after the conv):
    (q, k, g, beta, mixed)."""
    _, _, hk, hv, dk, dv = spec
    mixed, cfg = bufs["mixed"], bufs["config"]
    if fold:
        qk = TL.ConvQk(bufs["q"], bufs["k"], bufs["g"], bufs["beta"], x["b"], x["a"], x["A_log"], x["dt_bias"],
                       GF.L2NORM_EPS, GF.SOFTPLUS_THRESHOLD)
        TL.short_conv_extend(x["x"], x["weight"], None, mixed, state, x["slots"], x["bounds"], x["blocks"], True,
                             config=cfg, qk=qk)
        return qk.q, qk.k, qk.g, qk.beta, mixed
    TL.short_conv_extend(x["x"], x["weight"], None, mixed, state, x["slots"], x["bounds"], x["blocks"], True,
                         config=cfg)
    dims = GF.GdnDims(hk, hv, dk, dv, mixed.shape[1], K)
    q, k, _, g, beta = GF.qk_gates(mixed, x["b"], x["a"], x["A_log"], x["dt_bias"], dims)
    return q, k, g, beta, mixed


def conv_buffers(spec, x: dict) -> dict:
    _, _, hk, hv, dk, dv = spec
    T, C = x["x"].shape
    dev = x["x"].device
    return dict(mixed=torch.empty(T, C, dtype=torch.bfloat16, device=dev), config=conv_config(x),
                q=torch.empty(T, hk, dk, dtype=torch.bfloat16, device=dev),
                k=torch.empty(T, hk, dk, dtype=torch.bfloat16, device=dev),
                g=torch.empty(T, hv, device=dev), beta=torch.empty(T, hv, dtype=torch.bfloat16, device=dev))


def check_qk(spec, device) -> dict:
    _, _, hk, hv, dk, dv = spec
    lens = [1, 100, 64, 300] if device != "cpu" else [1, 40, 7]
    x = conv_inputs(spec, lens, device, seed=21)
    host = {k: v.cpu() for k, v in x.items()}
    hist = host["state"][2:2 + len(lens)]
    mixed = conv_reference(host["x"], host["weight"], host["bias"], hist, lens).bfloat16().float()
    T = mixed.shape[0]
    want = dict(q=l2norm(mixed[:, :hk * dk].view(T, hk, dk)), k=l2norm(mixed[:, hk * dk:2 * hk * dk].view(T, hk, dk)),
                g=-host["A_log"].exp() * F.softplus(host["a"].float() + host["dt_bias"]),
                beta=torch.sigmoid(host["b"].float()))
    got, errs = {}, {}
    for fold in (True, False):
        q, k, g, beta, _ = conv_step(spec, x, x["state"].clone(), fold, conv_buffers(spec, x))
        way = "folded" if fold else "apart"
        got[way] = dict(q=q.float().cpu(), k=k.float().cpu(), g=g.float().cpu(), beta=beta.float().cpu())
        errs[way] = {n: rel_err(got[way][n], want[n]) for n in want}
    errs["folded_vs_apart"] = max(rel_err(got["folded"][n], got["apart"][n]) for n in want)
    errs["ok"] = (max(max(errs["folded"].values()), max(errs["apart"].values())) <= QK_TOL
                  and errs["folded_vs_apart"] <= SAME_TOL
                  and all(bool(torch.isfinite(t).all()) for way in got.values() for t in way.values()))
    return errs


def time_qk(spec, T: int, R: int, device, calls: int, replays: int) -> dict:
    x = conv_inputs(spec, [T // R] * R, device, seed=T + R)
    bufs = conv_buffers(spec, x)
    row = {"config": str(bufs["config"])}
    for name, fold in (("apart", False), ("folded", True)):
        fn = lambda fold=fold: conv_step(spec, x, x["state"], fold, bufs)  # noqa: E731
        row[name] = timed(fn, calls, replays, device, f"qk {R} x {T // R} tokens, {name}")
    row["folded_over_apart"] = row["folded"]["us"] / row["apart"]["us"]
    return row


# -- extend_norm=in_output: the gated norm in the chunk output kernel -----------------------------


def norm_inputs(T: int, hv: int, dv: int, device, seed: int) -> TC.GatedNorm:
    """z as a strided view (the mixer's projection hands it so) and a weight near one."""
    g = torch.Generator().manual_seed(seed)
    z = torch.randn(T, hv, dv + 64, generator=g).bfloat16()[..., :dv]
    weight = (1 + 0.1 * torch.randn(dv, generator=g)).bfloat16()
    return TC.GatedNorm(z.to(device), weight.to(device), EPS)


def norm_step(spec, x: dict, state, tables: dict, out, core, gated: TC.GatedNorm, fold: bool, bounds) -> None:
    """One layer's core and norm, folded (into `out` directly) or apart (core, then the norm's launch)."""
    dk = spec[4]
    TC.chunk_extend(x["q"], x["k"], x["v"], x["g"], x["beta"], out if fold else core, state, tables["slots"],
                    tables["bounds"], tables["chunks"], dk ** -0.5, TL.GATE_PER_HEAD,
                    gated_norm=gated if fold else None)
    if not fold:
        GF.gated_rmsnorm(core, gated.z, gated.weight, out, gated.eps, bounds=bounds)


def padded_bounds(tables: dict, T: int) -> torch.Tensor:
    """The request bounds, then the step's rows: gated_rmsnorm's `bounds` (real rows end at the second-to-last)."""
    b = tables["bounds"]
    return torch.cat([b, b.new_tensor([T])])


def check_norm(spec, device) -> dict:
    _, _, hk, hv, dk, dv = spec
    lens, x, states, slots, tables, ref_core, _ = check_case(spec, device)
    T = sum(lens)
    gated = norm_inputs(T, hv, dv, device, seed=11)
    want = gated_rms_norm(ref_core.bfloat16(), gated.z.cpu(), gated.weight.cpu(), EPS)
    x = {k: v.to(device) for k, v in x.items()}
    got = {}
    for fold in (True, False):
        out = torch.full((T, hv, dv), float("nan"), dtype=torch.bfloat16, device=device)
        core = torch.empty_like(out)
        norm_step(spec, x, states.to(device, copy=True), tables, out, core, gated, fold, padded_bounds(tables, T))
        got["folded" if fold else "apart"] = out.float().cpu()
    errs = {name: rel_err(o, want) for name, o in got.items()}
    errs["folded_vs_apart"] = rel_err(got["folded"], got["apart"])
    errs["ok"] = (all(bool(torch.isfinite(o).all()) for o in got.values())
                  and max(errs["folded"], errs["apart"]) <= NORM_TOL and errs["folded_vs_apart"] <= SAME_TOL)
    return errs


def time_norm(spec, T: int, R: int, device, calls: int, replays: int) -> dict:
    _, _, hk, hv, dk, dv = spec
    x, states, _, tables = launch_case(spec, [T // R] * R, device, seed=T + R)
    x = {k: v.to(device) for k, v in x.items()}
    state = states.to(device)
    gated = norm_inputs(T, hv, dv, device, seed=T)
    out = torch.empty(T, hv, dv, dtype=torch.bfloat16, device=device)
    core = torch.empty_like(out)
    bounds = padded_bounds(tables, T)
    row = {}
    for name, fold in (("apart", False), ("folded", True)):
        fn = lambda fold=fold: norm_step(spec, x, state, tables, out, core, gated, fold, bounds)  # noqa: E731
        row[name] = timed(fn, calls, replays, device, f"norm {R} x {T // R} tokens, {name}")
    row["folded_over_apart"] = row["folded"]["us"] / row["apart"]["us"]
    return row


# -- decode: the layer on the unfused kernels, with qk_gates=in_conv and decode_norm=in_recurrence ---


DECODE_FOLDS = dict(qk_gates="in_conv", decode_norm="in_recurrence")


def decode_layer(spec, B: int, device, seed: int):
    """A GDN layer's decode step of B requests (the last an eighth padding) on two triton_linear
    backends, apart and folded, and the CPU reference, over copies of one state pool: (shape, ctx on
    the device, ctx on the host, inputs, params, {name: backend}, reference backend)."""
    from runtime.backends.cpu_reference import CPUReferenceBackend
    from runtime.backends.protocol import plan_eager_step
    from runtime.backends.triton_linear import TritonLinearBackend
    from testkit.gdn_cases import GdnShape, gdn_inputs, gdn_params, gdn_pools
    from testkit.linear_cases import decode_ctx

    _, _, hk, hv, dk, dv = spec
    shape = GdnShape(hk, hv, dk, dv, K)
    real = B - max(1, B // 8)
    slots = list(range(1, real + 1)) + [0] * (B - real)  # slot 0: the padding slot
    host, *dev = gdn_pools({0: shape}, B + 1, device, seed, copies=3, state_dtype="bfloat16")
    backends = {name: TritonLinearBackend(pool, **opts) for (name, opts), pool in
                zip((("apart", {}), ("folded", DECODE_FOLDS)), dev)}
    ctx = decode_ctx(slots, real, device)
    for backend in backends.values():
        plan_eager_step(backend, ctx, B)
    g = torch.Generator().manual_seed(seed + 1)
    x = gdn_inputs(shape, B, real, torch.bfloat16, g, device)
    params = gdn_params(shape, torch.bfloat16, seed + 2).to(device)
    return shape, ctx, decode_ctx(slots, real, "cpu"), x, params, backends, CPUReferenceBackend(None, host), real


def check_decode(spec, device) -> dict:
    from testkit.gdn_cases import fused_gdn, unfused_gdn

    B = 8 if device == "cpu" else 32
    shape, ctx, host_ctx, x, params, backends, ref, real = decode_layer(spec, B, device, seed=61)
    want = torch.empty(B, shape.hv, shape.dv, dtype=torch.bfloat16)
    unfused_gdn(ref, host_ctx, {k: v.cpu() for k, v in x.items()}, params.to("cpu"), want, 0, shape, EPS)
    got = {}
    for name, backend in backends.items():
        out = torch.full((B, shape.hv, shape.dv), float("nan"), dtype=torch.bfloat16, device=device)
        fused_gdn(backend, ctx, x, params, out, 0, shape, EPS)
        got[name] = out.float().cpu()
    errs = {name: rel_err(o[:real], want[:real].float()) for name, o in got.items()}
    errs["folded_vs_apart"] = rel_err(got["folded"][:real], got["apart"][:real])
    # the interpreter truncates where a GPU rounds to nearest, a bias at each of the layer's bf16
    # roundings (tests/runtime/backends/test_triton_gdn_fused.py BF16_STEPS): the dry run's bound is 4x
    tol = QK_TOL * (4 if device == "cpu" else 1)
    errs["ok"] = (max(errs["folded"], errs["apart"]) <= tol and errs["folded_vs_apart"] <= SAME_TOL
                  and all(bool(o[real:].eq(0).all()) and bool(torch.isfinite(o).all()) for o in got.values()))
    return errs


def time_decode(spec, B: int, device, reps: int) -> dict:
    from gpu_linear_extend import bench_ms
    from testkit.gdn_cases import fused_gdn

    shape, ctx, _, x, params, backends, _, _ = decode_layer(spec, B, device, seed=B)
    out = torch.empty(B, shape.hv, shape.dv, dtype=torch.bfloat16, device=device)
    row = {}
    for name, backend in backends.items():
        fn = lambda backend=backend: fused_gdn(backend, ctx, x, params, out, 0, shape, EPS)  # noqa: E731
        fn()
        kernels = device_ms_by_kernel(fn)
        row[name] = {"wall_us": 1e3 * bench_ms(fn, reps), "kernels_us": {k: 1e3 * v for k, v in kernels.items()},
                     "kernel_us": 1e3 * sum(kernels.values()) if kernels else None}
        print(f"decode {B} requests, {name}: kernels {row[name]['kernel_us'] or 0:.1f} us"
              + "".join(f"; {k} {1e3 * v:.1f}" for k, v in kernels.items()), flush=True)
    if row["apart"]["kernel_us"]:
        row["folded_over_apart"] = row["folded"]["kernel_us"] / row["apart"]["kernel_us"]
    return row


# -- all --------------------------------------------------------------------------------------------


def timed(fn, calls: int, replays: int, device, what: str) -> dict:
    us = graph_call_us(lambda i: fn(), calls, replays, device)
    kernels = device_ms_by_kernel(fn)
    print(f"{what}: {us:.1f} us" + "".join(f"; {k} {1e3 * v:.1f}" for k, v in kernels.items()), flush=True)
    return {"us": us, "kernels_us": {k: 1e3 * v for k, v in kernels.items()}}


FOLDS = {"qk": (check_qk, time_qk), "norm": (check_norm, time_norm), "decode": (check_decode, None)}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog="Writes OUT/gdn_folds_bench.json and prints a line per shape and way.")
    p.add_argument("--out", type=Path, required=True, help="folder for gdn_folds_bench.json")
    p.add_argument("--folds", default="qk,norm,decode",
                   help="comma-separated folds to check and time (default qk,norm,decode)")
    p.add_argument("--tokens", type=lambda s: [int(v) for v in s.split(",")], default=[512, 2048, 4096],
                   help="one request of each of these many rows, comma-separated (default 512,2048,4096); "
                        "4 x 1024 is timed too")
    p.add_argument("--decodes", type=lambda s: [int(v) for v in s.split(",")], default=[32, 128],
                   help="requests of the decode steps timed, comma-separated (default 32,128)")
    p.add_argument("--calls", type=int, default=10, help="calls in the timed CUDA graph (default 10)")
    p.add_argument("--replays", type=int, default=10, help="replays timed, median taken (default 10)")
    p.add_argument("--dry-run", action="store_true", help="the CPU interpreter at tiny dims (times mean nothing)")
    args = p.parse_args(argv)
    folds = [f for f in args.folds.split(",") if f]
    unknown = sorted(set(folds) - set(FOLDS))
    if unknown:
        p.error(f"--folds: unknown {unknown}; known: {sorted(FOLDS)}")
    device = torch.device("cuda" if is_cuda() else "cpu")
    if device.type != "cuda" and not args.dry_run:
        p.error("no CUDA device here: run with --dry-run on the CPU")
    spec = DRY["gdn"] if args.dry_run else REAL["gdn"]
    shapes = [(64, 1), (64, 4)] if args.dry_run else [(T, 1) for T in args.tokens] + [(4096, 4)]
    rec = {"env": device_facts(args.dry_run), "spec": list(spec[2:]), "folds": {}}
    ok = True
    for fold in folds:
        check, time_fold = FOLDS[fold]
        entry = rec["folds"][fold] = {"check": check(spec, str(device)), "rows": {}}
        print(f"{fold} check: {entry['check']}", flush=True)
        if not entry["check"]["ok"]:
            ok = False
            print(f"{fold}: check failed, not timed", flush=True)
            continue
        if fold == "decode":
            for B in ([8] if args.dry_run else args.decodes):
                entry["rows"][str(B)] = time_decode(spec, B, device, reps=args.replays * 10)
            continue
        for T, R in shapes:
            entry["rows"][f"{R}x{T // R}"] = time_fold(spec, T, R, device, args.calls, args.replays)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "gdn_folds_bench.json").write_text(json.dumps(rec, indent=1, default=str))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
