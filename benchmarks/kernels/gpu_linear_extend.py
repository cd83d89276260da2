"""Linear-attention extend on the GPU: TritonLinearBackend's extend / mixed / target-verify paths.

One call on the lent GPU machine (table last, JSON in --out):

1. Device facts: copy bandwidth (1 GiB copy_, read + write) and the bf16 matmul rate, both
   measured here, for the floors.
2. Checks, before anything is timed, per family at real dims (GDN Hk 16 / Hv 32 / 128, KDA
   32 x 128, Lightning 16 x 128, short conv 8192 x 4), bf16 inputs with float32 log-decays (as the
   models pass them): a chain of steps over one state pool: an extend from an empty state and one
   from an existing state, a mixed step (the first request's next prompt chunk, decode rows, a new
   request, padding), a uniform target-verify step (strided decode kernels), a ragged one (chunk
   path). Outputs AND updated states against CPUReferenceBackend run on CPU copies in float32
   (relative error of the norm; bf16 within 1e-2), padding rows zero, padding and free slots
   untouched. The conv's extend kernel is also checked on its own at the bench models' widths
   (Qwen3-Next 8192, Kimi-Linear 12288 channels, K 4) over requests of 1, K-2, K-1, K and 1000
   tokens (testkit/linear_cases.check_conv_extend); the conv is timed only if it passes.
   The same chain again with the short-extend limit above every request's length: the eager
   steps through the recurrent extend kernel (triton_linear.recurrent_extend) instead of FLA.
3. Timing of one extend step of 512 and 2048 tokens over 1, 4 and 16 requests: the backend with
   its step planning ("ours"), one layer's op call on a step already planned ("layer": what each
   further layer of a step costs), its kernels alone (profiler), its floor (max of bytes / copy
   rate and FLOPs / matmul rate) and the torch reference on the GPU. For the conv, also the torch
   extend path the Triton kernel replaced (gathers and a K-term sum over a scratch, its index
   tables built once per step), measured in the same run: its step, layer and kernel times and
   its ratio to ours.
   Then short extends (8 to 64 tokens a request, 1 to 16 requests), each timed through FLA's
   chunk path and through the recurrent extend kernel, in the same run, once the recurrent
   chain's check passed: the evidence for the default of the backend's `short_extend_tokens`
   routing option (runtime/backends/triton_linear.py SHORT_EXTEND_CHOICES).
4. `pytest -m gpu tests/gpu/test_gpu_linear_kernels.py`.

The FLA families run in subprocesses (in parallel: their Triton compiles overlap; the timing
phases take a file lock, so one family is timed at a time), so a crash inside FLA (an illegal
memory access poisons a CUDA context) costs one family, not the run.

`--dry-run` runs on the CPU at tiny dims: the Triton kernels (decode and the extend conv) in
Triton's interpreter, the FLA families through a stand-in (the reference recurrence behind FLA's
keyword interface), every piece of argument plumbing, the JSON and the table.
"""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import json
import os
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path

if "--dry-run" in sys.argv:  # the interpreter must be chosen before triton is imported
    os.environ["TRITON_INTERPRET"] = "1"

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))  # bench_common

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from compiler.splitops import LayerKind, LayerRegistry, LayerSpec, Mode, TensorSpec  # noqa: E402
from runtime.backends.cpu_reference import CPUReferenceBackend  # noqa: E402
from runtime.backends.triton_linear import TritonLinearBackend  # noqa: E402
from runtime.cache.state_pool import StatePool  # noqa: E402
from bench_common import device_facts as common_device_facts  # noqa: E402
from runtime.backends.protocol import plan_eager_step  # noqa: E402
from bench_common import (device_ms_by_kernel, device_rates, ensure_einops, fmt, host_profile, is_cuda,  # noqa: E402
                          rel_err, run_gpu_pytest)
from testkit.linear_cases import FakeFLA, check_conv_extend, conv_extend_ok, step_ctx  # noqa: E402

START = time.time()
OUT_TOL = 1e-2  # bf16 inputs
STATE_TOL = 1e-2  # FLA's chunk form keeps bf16 intermediates: states are not bitwise the recurrence

# family -> (op, layer kind, Hk, Hv, Dk, Dv); conv: C, K in Hv, Dk
REAL = {"gdn": ("gdn_core", LayerKind.GDN, 16, 32, 128, 128), "kda": ("kda_core", LayerKind.KDA, 32, 32, 128, 128),
        "lightning": ("lightning_core", LayerKind.LIGHTNING, 16, 16, 128, 128),
        "conv": ("short_conv", LayerKind.GDN, 0, 8192, 4, 0)}
DRY = {"gdn": ("gdn_core", LayerKind.GDN, 2, 4, 16, 16), "kda": ("kda_core", LayerKind.KDA, 4, 4, 16, 16),
       "lightning": ("lightning_core", LayerKind.LIGHTNING, 4, 4, 16, 16),
       "conv": ("short_conv", LayerKind.GDN, 0, 24, 4, 0)}
CONV_WIDTHS = {"qwen3_next": 8192, "kimi_linear": 3 * 32 * 128}  # the bench models' conv channels (K 4)




def log(msg: str) -> None:
    print(f"[{time.time() - START:6.1f}s] {msg}", flush=True)






# -- problems ------------------------------------------------------------------------------------


def registry(spec) -> LayerRegistry:
    op, kind, hk, hv, dk, dv = spec
    state = ({"conv": TensorSpec((hv, dk - 1), "float32")} if op == "short_conv"
             else {"recurrent": TensorSpec((hv, dk, dv), "float32")})
    return LayerRegistry([LayerSpec(0, kind, state=state)])


def make_inputs(spec, T: int, R: int, g: torch.Generator, gate_scale: float = 1.0) -> dict:
    """bf16 activations, float32 log-decays (as the models pass them); padding rows NaN."""
    op, _, hk, hv, dk, dv = spec
    r = lambda *shape: torch.randn(T, *shape, generator=g)
    if op == "short_conv":
        x = {"x": r(hv).bfloat16()}
    elif op == "gdn_core":
        x = {"q": F.normalize(r(hk, dk), dim=-1).bfloat16(), "k": F.normalize(r(hk, dk), dim=-1).bfloat16(),
             "v": r(hv, dv).bfloat16(), "g": -F.softplus(r(hv)) * gate_scale, "beta": torch.sigmoid(r(hv)).bfloat16()}
    elif op == "kda_core":
        x = {"q": F.normalize(r(hv, dk), dim=-1).bfloat16(), "k": F.normalize(r(hv, dk), dim=-1).bfloat16(),
             "v": r(hv, dv).bfloat16(), "g": -F.softplus(r(hv, dk)) * gate_scale,
             "beta": torch.sigmoid(r(hv)).bfloat16()}
    else:
        x = {"q": r(hv, dk).bfloat16(), "k": (r(hv, dk) * 0.1).bfloat16(), "v": r(hv, dv).bfloat16()}
    for t in x.values():
        t[R:] = float("nan")
    return x


def consts(spec, device) -> dict:
    op, _, hk, hv, dk, dv = spec
    g = torch.Generator().manual_seed(5)
    if op == "short_conv":
        return {"weight": (torch.randn(hv, dk, generator=g) * 0.5).bfloat16().to(device),
                "bias": torch.randn(hv, generator=g).bfloat16().to(device)}
    if op == "lightning_core":
        return {"decay": (-torch.linspace(0.01, 1.0, hv)).to(device)}
    return {}


def out_for(spec, T, device):
    op, _, hk, hv, dk, dv = spec
    shape = (T, hv) if op == "short_conv" else (T, hv, dv)
    return torch.full(shape, float("nan"), dtype=torch.bfloat16, device=device)


def call(backend, spec, ctx, x: dict, c: dict, out) -> None:
    op, _, hk, hv, dk, dv = spec
    if op == "short_conv":
        backend.short_conv(ctx, x["x"], c["weight"], c["bias"], out, 0, True)
    elif op == "lightning_core":
        backend.lightning_core(ctx, x["q"], x["k"], x["v"], c["decay"], out, 0, dk ** -0.5)
    else:
        getattr(backend, op)(ctx, x["q"], x["k"], x["v"], x["g"], x["beta"], out, 0, dk ** -0.5)


def steps_for(dry: bool):
    """(name, mode, requests (slot, cached, n), pad tokens, pad requests). Slot 1 starts empty."""
    a, b, m, d = (9, 5, 4, 3) if dry else (160, 97, 70, 33)
    return [
        ("extend: empty + existing state", Mode.EXTEND, [(1, 0, a), (2, 40, b)], 3, 1),
        ("mixed: next chunk + decode + new", Mode.MIXED, [(1, a, m), (2, 40 + b, 1), (3, 0, d), (4, 7, 1)], 5, 2),
        ("target_verify: uniform (decode kernels)", Mode.TARGET_VERIFY,
         [(1, a + m, 4), (2, 41 + b, 4), (3, d, 4)], 4, 1),
        ("target_verify: ragged (chunk path)", Mode.TARGET_VERIFY, [(2, 45 + b, 2), (4, 8, 3)], 0, 0),
        ("decode", Mode.DECODE, [(3, d + 4, 1), (1, a + m + 4, 1)], 1, 1),
    ]


def check_family(name: str, spec, device, dry: bool, fla, gate_scale: float = 1.0, short_extend_tokens: int = 0,
                 chunk_impl: str = "fla") -> dict:
    """The step chain on the backend and on the CPU reference (float32) from the same states
    (with `short_extend_tokens` above every request's length: the eager steps through the recurrent
    extend kernel instead of FLA)."""
    reg = registry(spec)
    num_slots = 6
    # the chain's target_verify steps keep each request's state after every draft token: D = 3 of them
    verify = dict(draft_tokens=3, verify_rows=num_slots)
    ref_pool, dev_pool = StatePool(reg, num_slots, **verify), StatePool(reg, num_slots, device, **verify)
    gen = torch.Generator().manual_seed(11)
    entry = "conv" if spec[0] == "short_conv" else "recurrent"
    ref_state = ref_pool.layer(0)[entry]
    ref_state.copy_(torch.randn(ref_state.shape, generator=gen) * 0.5)
    ref_state[1].zero_()  # slot 1: a new request
    dev_pool.layer(0)[entry].copy_(ref_state)
    before = ref_state.clone()
    ref = CPUReferenceBackend(None, ref_pool)
    tri = TritonLinearBackend(dev_pool, fla=fla, short_extend_tokens=short_extend_tokens, chunk_impl=chunk_impl)
    c_dev, c_cpu = consts(spec, device), consts(spec, "cpu")
    c_cpu = {k: v.float() for k, v in c_cpu.items()}
    rows, touched = [], set()
    for label, mode, reqs, pad_t, pad_s in steps_for(dry):
        ctx = step_ctx(mode, reqs, pad_t, pad_s, device)
        R, T = ctx.num_real_tokens, ctx.num_tokens
        x = make_inputs(spec, T, R, gen, gate_scale)
        plan_eager_step(tri, ctx, 2048)
        out = out_for(spec, T, device)
        err = None
        try:
            call(tri, spec, ctx, {k: v.to(device) for k, v in x.items()}, c_dev, out)
            out = out.float().cpu()
        except Exception as e:
            err = f"{type(e).__name__}: {e}"[:400]
        out_ref = torch.zeros(T, *out.shape[1:])
        call(ref, spec, step_ctx(mode, reqs, pad_t, pad_s, "cpu"), {k: v.float() for k, v in x.items()}, c_cpu,
             out_ref)
        touched |= {s for s, *_ in reqs}
        t = sorted(touched)
        row = {"step": label, "mode": mode.value, "tokens": R, "rows": T}
        if err:
            row["error"] = err
            rows.append(row)
            log(f"  {name} {label}: ERROR {err}")
            break
        row.update(out_rel_err=rel_err(out[:R], out_ref[:R]),
                   state_rel_err=rel_err(dev_pool.layer(0)[entry].cpu()[t], ref_state[t]),
                   finite=bool(torch.isfinite(out).all()), padding_zero=bool(out[R:].eq(0).all()))
        row["ok"] = (row["finite"] and row["padding_zero"] and row["out_rel_err"] <= OUT_TOL
                     and row["state_rel_err"] <= STATE_TOL)
        rows.append(row)
        log(f"  {name} {label}: out {row['out_rel_err']:.2e} state {row['state_rel_err']:.2e} "
            f"{'ok' if row['ok'] else 'FAIL'}")
    untouched = [s for s in range(num_slots + 1) if s not in touched]
    kept = bool(torch.equal(dev_pool.layer(0)[entry].cpu()[untouched], before[untouched]))
    return {"steps": rows, "untouched_slots_kept": kept, "gate_scale": gate_scale,
            "ok": kept and all(r.get("ok") for r in rows)}


# -- timing ---------------------------------------------------------------------------------------


def bytes_and_flops(spec, T: int, R: int) -> tuple[int, int]:
    """Ideal traffic (inputs, output, each state read and written once) and chunk-form FLOPs."""
    op, _, hk, hv, dk, dv = spec
    if op == "short_conv":
        C, K = hv, dk
        return T * C * 2 * 2 + R * C * (K - 1) * 4 * 2, 2 * K * C * T
    io = T * (2 * hk * dk * 2 + hv * dv * 2 + hv * dv * 2)  # q, k, v, out in bf16 (KDA/Lightning: hk = hv)
    if op == "gdn_core":
        io += T * hv * (4 + 2)  # g f32, beta bf16
    elif op == "kda_core":
        io += T * hv * (dk * 4 + 2)
    state = R * hv * dk * dv * 4 * 2
    C = 64  # FLA's chunk: per token and head, state reads/updates plus the intra-chunk products
    per = 4 * dk * dv + 2 * C * (dk + dv)
    if op != "lightning_core":
        per += 4 * dk * dv + 2 * C * (dk + dv)  # delta rule: k.S, w.S, K K^T and the WY solve
    return io + state, T * hv * per


def bench_ms(fn, reps: int) -> float:
    if not is_cuda():
        t0 = time.perf_counter()
        fn()
        return (time.perf_counter() - t0) * 1e3
    from triton.testing import do_bench
    return do_bench(fn, warmup=max(5, reps // 4), rep=reps, return_mode="median")


def device_busy_ms(fn, reps: int = 20) -> float | None:
    """Milliseconds of GPU kernel time per call of fn (the profiler's kernel durations summed), or
    None off the GPU. Set against bench_ms (wall time per call), it splits an extend step into the
    kernels' own time and the host's planning and launching, which an eager step waits on."""
    return sum(device_ms_by_kernel(fn, reps).values()) if is_cuda() else None


class OldTorchConv:
    """The extend conv this backend ran before its Triton kernel, kept as the baseline it is measured
    against: each request's K-1 history rows and its tokens gathered into a float32 scratch, a sum
    of K shifted products, index_copy_ of the new histories. `plan` builds its index tables (host
    lists, once per step in the old backend); `layer` is one layer's op call on them."""

    def __init__(self, ctx, device):
        self.lens = [n for n in ctx.query_lens if n > 0]
        self.T, self.device = sum(self.lens), device

    def plan(self, K: int) -> None:
        P, cu = K - 1, 0
        win, hist, tok, tail = [], [], [], []
        for r, n in enumerate(self.lens):
            off = cu + r * P
            hist.extend(range(off, off + P))
            tok.extend(range(off + P, off + P + n))
            win.extend(range(off, off + n))
            tail.extend(range(off + n, off + n + P))
            cu += n
        idx = torch.tensor([win, tok], dtype=torch.int64).to(self.device, non_blocking=True)
        side = torch.tensor([hist, tail], dtype=torch.int64).to(self.device, non_blocking=True)
        self.index = (idx[0], side[0], idx[1], side[1])

    def layer(self, x, weight, bias, out, states, slots, silu) -> None:
        T, (C, K), R = self.T, weight.shape, len(self.lens)
        P = K - 1
        win, hist, tok, tail = self.index
        E = torch.empty(T + R * P, C, dtype=torch.float32, device=x.device)
        E[hist] = states.index_select(0, slots).float().transpose(1, 2).reshape(R * P, C)
        E[tok] = x[:T].float()
        w = weight.float()
        y = E[win] * w[:, 0]
        for j in range(1, K):
            y = y + E[win + j] * w[:, j]
        if bias is not None:
            y = y + bias.float()
        out[:T].copy_(F.silu(y) if silu else y)
        states.index_copy_(0, slots, E[tail].reshape(R, P, C).transpose(1, 2).to(states.dtype))
        if out.shape[0] > T:
            out[T:].zero_()


def time_old_conv(spec, ctx, states, x, c, ours_out) -> dict:
    """The old torch conv on the same step, timed like ours: `states` is the conv state pool layer as
    our kernel found it when it wrote `ours_out`, which the old path must reproduce."""
    op, _, hk, C, K, dv = spec
    old = OldTorchConv(ctx, x.device)
    slots = ctx.state_slots[:ctx.num_real_seqs].to(x.device)
    old_out = torch.empty_like(ours_out)
    old.plan(K)
    old.layer(x, c["weight"], c["bias"], old_out, states, slots, True)
    agree = rel_err(old_out.float(), ours_out.float())

    def step():
        old.plan(K)
        old.layer(x, c["weight"], c["bias"], old_out, states, slots, True)

    step_ms = bench_ms(step, 100)
    layer_ms = bench_ms(lambda: old.layer(x, c["weight"], c["bias"], old_out, states, slots, True), 100)
    kernel_ms = device_busy_ms(lambda: old.layer(x, c["weight"], c["bias"], old_out, states, slots, True))
    return {"old_torch_ms": step_ms, "old_torch_layer_ms": layer_ms, "old_torch_kernel_ms": kernel_ms,
            "old_torch_vs_ours_rel_err": agree}


# The recurrent cores our chunk kernels serve (runtime/backends/kernels/chunk.py); KDA keeps FLA's.
CHUNK_OPS = ("gdn_core", "lightning_core")


def time_triton_chunk(spec, ctx, x, c, pool, entry: str, states_before, fla_out, fla_state, T: int) -> dict:
    """The same extend layer through our chunk kernels (chunk_impl="triton"), in the same run as FLA's:
    from the state FLA's first call started from, its output and new state against FLA's (both
    bf16 kernels: agreement, not accuracy, which the checks measured against the reference); then
    its step (planning + the op call), one more layer and its kernels, timed as FLA's are."""
    pool.layer(0)[entry].copy_(states_before)
    ours = TritonLinearBackend(pool, chunk_impl="triton")
    out = out_for(spec, T, "cuda" if is_cuda() else "cpu")

    def step():
        plan_eager_step(ours, ctx, T)
        call(ours, spec, ctx, x, c, out)

    step()
    agree_out, agree_state = rel_err(out, fla_out), rel_err(pool.layer(0)[entry], fla_state)
    step_ms = bench_ms(step, 100)
    layer_ms = bench_ms(lambda: call(ours, spec, ctx, x, c, out), 100)
    return {"triton_chunk_ms": step_ms, "triton_chunk_layer_ms": layer_ms,
            "triton_chunk_kernel_ms": device_busy_ms(step), "triton_chunk_vs_fla_out": agree_out,
            "triton_chunk_vs_fla_state": agree_state}


def time_family(name: str, spec, device, dry: bool, fla, env: dict, quick: bool, triton_chunk: bool = False) -> list[dict]:
    reg = registry(spec)
    rows = []
    cases = [(32, 1), (32, 4), (64, 16)] if dry else [(512, 1), (512, 4), (512, 16), (2048, 1), (2048, 4), (2048, 16)]
    for T, R in cases:
        lens = [T // R] * R
        pool = StatePool(reg, R + 1, device)
        entry = "conv" if spec[0] == "short_conv" else "recurrent"
        pool.layer(0)[entry].normal_().mul_(0.1)
        ref_pool = StatePool(reg, R + 1, device)
        ref_pool.layer(0)[entry].copy_(pool.layer(0)[entry])
        ctx = step_ctx(Mode.EXTEND, [(i + 1, 0, n) for i, n in enumerate(lens)], 0, 0, device)
        x = {k: v.to(device) for k, v in make_inputs(spec, T, T, torch.Generator().manual_seed(T + R)).items()}
        c = consts(spec, device)
        out = out_for(spec, T, device)
        tri = TritonLinearBackend(pool, fla=fla)

        def ours():
            plan_eager_step(tri, ctx, T)
            call(tri, spec, ctx, x, c, out)

        def layer():
            call(tri, spec, ctx, x, c, out)

        states_before = pool.layer(0)[entry].clone()
        ours()  # compile / autotune outside the timing
        first_out = out.clone()
        first_state = pool.layer(0)[entry].clone()
        ms = bench_ms(ours, 100)
        layer_ms = bench_ms(layer, 100)  # the plan ours() made last stays: each call is one more layer
        public_ms = None
        if spec[0] == "gdn_core" and fla is None and is_cuda():
            # the same layer through FLA's public entry (the backend calls its forward): same run
            from runtime.backends.triton_linear import fla_ops

            public = TritonLinearBackend(pool, fla=fla_ops(gdn_entry="public"))
            plan_eager_step(public, ctx, T)
            call(public, spec, ctx, x, c, out)
            public_ms = bench_ms(lambda: call(public, spec, ctx, x, c, out), 100)
            call(tri, spec, ctx, x, c, out)  # tri's plan again the step's current one
        chunk = time_triton_chunk(spec, ctx, x, c, pool, entry, states_before, first_out, first_state, T) \
            if triton_chunk else {}
        if chunk:
            call(tri, spec, ctx, x, c, out)  # tri's plan again the step's current one
        kernel_ms = device_busy_ms(ours)
        # where a step's wall time beyond its kernels goes (issue 14's per-request host cost)
        host = host_profile(ours, 10, top=12, sync=torch.cuda.synchronize) if is_cuda() else None
        nbytes, flops = bytes_and_flops(spec, T, R)
        floor_bw = nbytes / env["copy_bytes_per_s"] * 1e3
        floor_fl = flops / env["matmul_flops_per_s"] * 1e3
        floor = max(floor_bw, floor_fl)
        ref = CPUReferenceBackend(None, ref_pool)
        ref_ms = None
        if not quick:
            xf = {k: v for k, v in x.items()}
            call(ref, spec, ctx, xf, c, out_for(spec, T, device))  # warm
            if is_cuda():
                torch.cuda.synchronize()
            t0 = time.perf_counter()
            call(ref, spec, ctx, xf, c, out_for(spec, T, device))
            if is_cuda():
                torch.cuda.synchronize()
            ref_ms = (time.perf_counter() - t0) * 1e3
        row = {"family": name, "tokens": T, "requests": R, "ours_ms": ms, "layer_ms": layer_ms, "floor_ms": floor,
               "floor_bytes_ms": floor_bw, "floor_flops_ms": floor_fl, "bytes": nbytes, "flops": flops,
               "x_floor": ms / floor, "kernel_ms": kernel_ms, "host_profile": host,
               "kernel_x_floor": None if kernel_ms is None else kernel_ms / floor, "torch_ref_gpu_ms": ref_ms,
               "ref_over_ours": None if ref_ms is None else ref_ms / ms, "layer_public_entry_ms": public_ms, **chunk}
        if spec[0] == "short_conv":
            row.update(time_old_conv(spec, ctx, states_before, x["x"], c, first_out))
            row["old_over_ours"] = row["old_torch_ms"] / ms
            row["old_over_ours_layer"] = row["old_torch_layer_ms"] / layer_ms
        rows.append(row)
        old_note = ""
        if "old_torch_ms" in row:
            old_note = (f"; old torch conv {row['old_torch_ms'] * 1e3:.1f} us (layer "
                        f"{row['old_torch_layer_ms'] * 1e3:.1f}), x{row['old_over_ours']:.1f} / layer "
                        f"x{row['old_over_ours_layer']:.1f}")
        if public_ms is not None:
            old_note += f"; layer through FLA's public entry {public_ms * 1e3:.1f} us"
        if chunk:
            old_note += (f"; our chunk kernels: step {chunk['triton_chunk_ms'] * 1e3:.1f} us, layer "
                         f"{chunk['triton_chunk_layer_ms'] * 1e3:.1f} us (kernels "
                         f"{fmt(None if chunk['triton_chunk_kernel_ms'] is None else chunk['triton_chunk_kernel_ms'] * 1e3)}"
                         f" us), against FLA's out {chunk['triton_chunk_vs_fla_out']:.2e} state "
                         f"{chunk['triton_chunk_vs_fla_state']:.2e}")
        log(f"  {name} T={T} R={R}: {ms * 1e3:.1f} us, layer {layer_ms * 1e3:.1f} us "
            f"(kernels {fmt(None if kernel_ms is None else kernel_ms * 1e3)} us), floor {floor * 1e3:.1f} us "
            f"(bytes {floor_bw * 1e3:.1f}, flops {floor_fl * 1e3:.1f}), x{ms / floor:.2f}; torch ref "
            f"{'n/a' if ref_ms is None else f'{ref_ms:.1f} ms'}{old_note}")
        for r in (host or {}).get("top_cum", [])[:8]:
            log(f"      host cum {r['cum_ms']:8.3f} ms  own {r['own_ms']:8.3f} ms  x{r['calls_per_call']:g} {r['function']}")
        del pool, ref_pool
    return rows


# Short extends (each request at most SHORT_TOKENS tokens: a prefix-cache hit's tail, a short chunk):
# FLA's chunk path against the recurrent extend kernel, same step, same run.
SHORT_TOKENS = 64
SHORT_CASES = [(8, 1), (32, 1), (64, 1), (32, 4), (256, 16)]


def time_short_extend(name: str, spec, device, dry: bool, fla) -> list[dict]:
    """Per case and path: the step with its planning (wall), one more planned layer (wall), and the
    kernels alone; the recurrent kernel's outputs and states against FLA's from the same start."""
    reg = registry(spec)
    rows = []
    for T, R in [(8, 1), (16, 4)] if dry else SHORT_CASES:
        ctx = step_ctx(Mode.EXTEND, [(i + 1, 0, T // R) for i in range(R)], 0, 0, device)
        x = {k: v.to(device) for k, v in make_inputs(spec, T, T, torch.Generator().manual_seed(T * 7 + R)).items()}
        c = consts(spec, device)
        start = torch.randn(StatePool(reg, R + 1).layer(0)["recurrent"].shape, generator=torch.Generator().manual_seed(3))
        row, outs = {"family": name, "tokens": T, "requests": R}, {}
        for path, limit in (("fla", 0), ("recurrent_extend", SHORT_TOKENS)):
            pool = StatePool(reg, R + 1, device)
            pool.layer(0)["recurrent"].copy_(start * 0.1)
            tri = TritonLinearBackend(pool, fla=fla, short_extend_tokens=limit)
            out = out_for(spec, T, device)

            def step():
                plan_eager_step(tri, ctx, T)
                call(tri, spec, ctx, x, c, out)

            def layer():
                call(tri, spec, ctx, x, c, out)

            step()  # compiles outside the timing; its result is the one compared
            outs[path] = (out.float().cpu().clone(), pool.layer(0)["recurrent"].float().cpu().clone())
            reps = 3 if dry else 100  # the interpreter's timings mean nothing: the dry run checks the plumbing
            row[f"{path}_ms"] = bench_ms(step, reps)
            row[f"{path}_layer_ms"] = bench_ms(layer, reps)
            row[f"{path}_kernel_ms"] = device_busy_ms(step)
        row["out_rel_err_vs_fla"] = rel_err(outs["recurrent_extend"][0], outs["fla"][0])
        row["fla_over_recurrent"] = row["fla_ms"] / row["recurrent_extend_ms"]
        row["fla_over_recurrent_layer"] = row["fla_layer_ms"] / row["recurrent_extend_layer_ms"]
        rows.append(row)
        log(f"  {name} short T={T} R={R}: fla {row['fla_ms'] * 1e3:.1f} us (layer {row['fla_layer_ms'] * 1e3:.1f}), "
            f"recurrent {row['recurrent_extend_ms'] * 1e3:.1f} us (layer {row['recurrent_extend_layer_ms'] * 1e3:.1f}), "
            f"x{row['fla_over_recurrent']:.1f}; outputs vs fla {row['out_rel_err_vs_fla']:.1e}")
    return rows


def conv_kernel_checks(dry: bool, device) -> list[dict]:
    """The extend conv kernel on its own at the bench models' widths, bf16 (dry: 24 channels)."""
    widths = {"dry": 24} if dry else CONV_WIDTHS
    rows = []
    for model, channels in widths.items():
        r = check_conv_extend(channels, 4, torch.bfloat16, device, many=70 if dry else 1000, seed=channels)
        r.update(model=model, ok=conv_extend_ok(r, out_tol=OUT_TOL))
        log(f"  conv kernel {model} ({channels} ch): out " +
            ", ".join(f"{s['out_rel_err']:.1e}" for s in r["steps"]) +
            f"; state {max(s['state_rel_err'] for s in r['steps']):.1e} {'ok' if r['ok'] else 'FAIL'}")
        rows.append(r)
    return rows


# -- device facts -----------------------------------------------------------------------------------


def device_facts(dry: bool) -> dict:
    """bench_common's facts plus the FLA version the extend path runs."""
    env = common_device_facts(dry)
    try:
        import fla
        env["fla"] = getattr(fla, "__version__", "?")
    except Exception as e:
        env["fla"] = f"not importable: {type(e).__name__}: {e}"[:200]
    return env



# -- parts ----------------------------------------------------------------------------------------------


def family_part(name: str, args) -> dict:
    """One FLA family: checks (also with 10x milder gates), then timing under the shared lock."""
    dry = args.dry_run
    spec = (DRY if dry else REAL)[name]
    device = "cpu" if dry else "cuda"
    res: dict = {"family": name}
    if dry:
        fla = FakeFLA()
    else:
        res["einops"] = ensure_einops()
        fla = None  # the backend imports FLA itself
    env = {"copy_bytes_per_s": args.copy_bytes_per_s, "matmul_flops_per_s": args.matmul_flops_per_s}
    t0 = time.time()
    try:
        res["check"] = check_family(name, spec, device, dry, fla)
        if spec[0] != "lightning_core" and not res["check"]["ok"]:
            res["check_mild_gates"] = check_family(name, spec, device, dry, fla, gate_scale=0.1)
        res["check_recurrent_extend"] = check_family(name, spec, device, dry, fla, short_extend_tokens=1 << 20)
        if spec[0] in CHUNK_OPS:
            res["check_triton_chunk"] = check_family(name, spec, device, dry, fla, chunk_impl="triton")
    except Exception as e:
        res["check_error"] = f"{type(e).__name__}: {e}"[:600]
        res["traceback"] = traceback.format_exc()[-2500:]
    res["check_s"] = time.time() - t0
    save_json(args.result, res)
    lock = open(args.lock, "a+") if args.lock else contextlib.nullcontext()
    with lock:
        if args.lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            # our chunk kernels are timed beside FLA's only once their chain matched the reference
            chunk = spec[0] in CHUNK_OPS and res.get("check_triton_chunk", {}).get("ok", False)
            res["timing"] = time_family(name, spec, device, dry, fla, env, quick=False, triton_chunk=chunk)
            if res.get("check_recurrent_extend", {}).get("ok"):  # timed only once it matches the reference
                res["short_extend"] = time_short_extend(name, spec, device, dry, fla)
        except Exception as e:
            res["timing_error"] = f"{type(e).__name__}: {e}"[:600]
            res["timing_traceback"] = traceback.format_exc()[-2500:]
    return res


def save_json(path, data) -> None:
    tmp = Path(str(path) + ".tmp")
    tmp.write_text(json.dumps(data, indent=1, default=str))
    tmp.replace(path)


def run_parts(args, names: list[str], timeout: float, log_dir: Path, lock: Path, meanwhile) -> dict:
    """The FLA families in parallel subprocesses (each result survives a crash of the others);
    `meanwhile()` runs in this process while they compile."""
    if timeout < 20:
        meanwhile()
        return {n: {"error": f"skipped: {timeout:.0f} s left"} for n in names}
    tmp = Path(tempfile.mkdtemp())
    procs = {}
    for n in names:
        cmd = [sys.executable, str(Path(__file__).resolve()), "--part", n, "--result", str(tmp / f"{n}.json"),
               "--lock", str(lock), "--copy-bytes-per-s", str(args.copy_bytes_per_s),
               "--matmul-flops-per-s", str(args.matmul_flops_per_s)] + (["--dry-run"] if args.dry_run else [])
        lf = open(log_dir / f"part_{n}.log", "w")
        procs[n] = (subprocess.Popen(cmd, stdout=lf, stderr=subprocess.STDOUT, cwd=str(ROOT)), lf)
    log(f"subprocesses {names} (timeout {timeout:.0f} s)")
    deadline = time.time() + timeout
    meanwhile()
    results = {}
    for n, (p, lf) in procs.items():
        try:
            rc = p.wait(timeout=max(1.0, deadline - time.time()))
        except subprocess.TimeoutExpired:
            p.kill()
            rc = "timeout"
        lf.close()
        path = tmp / f"{n}.json"
        try:
            data = json.loads(path.read_text()) if path.exists() else {}
        except ValueError:
            data = {}
        text = (log_dir / f"part_{n}.log").read_text()
        if rc != 0:
            data["error"] = f"subprocess rc={rc}; tail: {text[-1200:]}"
        for line in text.splitlines():
            if line.startswith("[") and "  " in line:
                print("   " + line, flush=True)
        results[n] = data
    return results






def table(results: dict) -> str:
    env = results["env"]
    lines = [f"device: {env.get('device')}  torch {env['torch']}  triton {env['triton']}  fla {env.get('fla')}  "
             f"copy {env['copy_bytes_per_s'] / 1e12:.2f} TB/s  bf16 matmul {env['matmul_flops_per_s'] / 1e12:.0f} "
             f"TFLOP/s", "", "checks (rel err of the norm vs CPU reference, float32; bf16 tolerance 1e-2):",
             "| family | step | out | state | ok |", "|---|---|---|---|---|"]
    fams = results.get("families", {})
    for name, r in fams.items():
        for key in ("check", "check_mild_gates", "check_recurrent_extend", "check_triton_chunk"):
            chk = r.get(key)
            if not chk:
                continue
            tag = name + {"check": "", "check_mild_gates": " (gates x0.1)",
                          "check_recurrent_extend": " (recurrent extend)",
                          "check_triton_chunk": " (our chunk kernels)"}[key]
            for s in chk["steps"]:
                if "error" in s:
                    lines.append(f"| {tag} | {s['step']} | ERROR {s['error'][:80]} | | no |")
                else:
                    lines.append(f"| {tag} | {s['step']} | {s['out_rel_err']:.1e} | {s['state_rel_err']:.1e} | "
                                 f"{'yes' if s['ok'] else 'NO'} |")
            if not chk["untouched_slots_kept"]:
                lines.append(f"| {tag} | padding / free slots | WRITTEN | | NO |")
        for chk in r.get("kernel_check", []):
            for s in chk["steps"]:
                lines.append(f"| conv kernel {chk['model']} {chk['channels']} ch | {s['mode']} {s['lengths']} | "
                             f"{s['out_rel_err']:.1e} | {s['state_rel_err']:.1e} | {'yes' if chk['ok'] else 'NO'} |")
            if not chk["untouched_slots_kept"]:
                lines.append(f"| conv kernel {chk['model']} | padding / free slots | WRITTEN | | NO |")
        for k in ("check_error", "error", "timing_error"):
            if k in r:
                lines.append(f"| {name} | {k} | {str(r[k])[:160]} | | no |")
    lines += ["", "extend step timing (eager; ms): ours (wall, the step's planning included), one more layer of a"
              " planned step (wall), its kernels alone (profiler), vs floor = max(bytes / copy, FLOPs / matmul),"
              " torch ref on GPU",
              "| family | T | requests | ours ms | layer ms | kernels ms | floor ms (bytes / flops) | x floor |"
              " kernels x floor | torch ref ms | ref / ours |",
              "|---|---|---|---|---|---|---|---|---|---|---|"]
    for name, r in fams.items():
        for t in r.get("timing", []):
            lines.append(f"| {name} | {t['tokens']} | {t['requests']} | {t['ours_ms']:.3f} | {t['layer_ms']:.3f} | "
                         f"{fmt(t.get('kernel_ms'), '.3f')} "
                         f"| {t['floor_ms']:.3f} ({t['floor_bytes_ms']:.3f} / {t['floor_flops_ms']:.3f}) | "
                         f"{t['x_floor']:.1f} | {fmt(t.get('kernel_x_floor'))} | "
                         f"{fmt(t['torch_ref_gpu_ms'])} | {fmt(t['ref_over_ours'], '.0f')} |")
    chunk = [(name, t) for name, r in fams.items() for t in r.get("timing", []) if "triton_chunk_ms" in t]
    if chunk:
        lines += ["", "our chunk kernels (chunk_impl=triton) against FLA's, same run (ms; step: planning + one layer)",
                  "| family | T | requests | FLA step | ours step | FLA / ours | FLA layer | ours layer | FLA / ours |"
                  " FLA kernels | our kernels | out vs FLA | state vs FLA |",
                  "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
        for name, t in chunk:
            lines.append(f"| {name} | {t['tokens']} | {t['requests']} | {t['ours_ms']:.3f} | {t['triton_chunk_ms']:.3f} | "
                         f"{t['ours_ms'] / t['triton_chunk_ms']:.2f} | {t['layer_ms']:.3f} | "
                         f"{t['triton_chunk_layer_ms']:.3f} | {t['layer_ms'] / t['triton_chunk_layer_ms']:.2f} | "
                         f"{fmt(t.get('kernel_ms'), '.3f')} | {fmt(t.get('triton_chunk_kernel_ms'), '.3f')} | "
                         f"{t['triton_chunk_vs_fla_out']:.1e} | {t['triton_chunk_vs_fla_state']:.1e} |")
    conv = [t for t in fams.get("conv", {}).get("timing", []) if "old_torch_ms" in t]
    if conv:
        lines += ["", "extend conv: the Triton kernel against the torch path it replaced, same run (ms)",
                  "| T | requests | ours | old torch | old / ours | ours layer | old layer | old / ours (layer) |"
                  " ours kernels | old kernels | old vs ours rel err |",
                  "|---|---|---|---|---|---|---|---|---|---|---|"]
        for t in conv:
            lines.append(f"| {t['tokens']} | {t['requests']} | {t['ours_ms']:.3f} | {t['old_torch_ms']:.3f} | "
                         f"{t['old_over_ours']:.1f} | {t['layer_ms']:.3f} | {t['old_torch_layer_ms']:.3f} | "
                         f"{t['old_over_ours_layer']:.1f} | {fmt(t.get('kernel_ms'), '.3f')} | "
                         f"{fmt(t.get('old_torch_kernel_ms'), '.3f')} | {t['old_torch_vs_ours_rel_err']:.1e} |")
    short = [t for r in fams.values() for t in r.get("short_extend", [])]
    if short:
        lines += ["", f"short extends (every request <= {SHORT_TOKENS} tokens): FLA's chunk path against the recurrent "
                      "extend kernel, same run (ms; step = with its planning)",
                  "| family | T | requests | fla step | recurrent step | fla / recurrent | fla layer | recurrent layer |"
                  " fla / recurrent (layer) | fla kernels | recurrent kernels | out vs fla |",
                  "|---|---|---|---|---|---|---|---|---|---|---|---|"]
        for t in short:
            lines.append(f"| {t['family']} | {t['tokens']} | {t['requests']} | {t['fla_ms']:.3f} | "
                         f"{t['recurrent_extend_ms']:.3f} | {t['fla_over_recurrent']:.1f} | {t['fla_layer_ms']:.3f} | "
                         f"{t['recurrent_extend_layer_ms']:.3f} | {t['fla_over_recurrent_layer']:.1f} | "
                         f"{fmt(t.get('fla_kernel_ms'), '.3f')} | {fmt(t.get('recurrent_extend_kernel_ms'), '.3f')} | "
                         f"{t['out_rel_err_vs_fla']:.1e} |")
    py = results.get("pytest", {})
    lines.append("")
    lines.append(f"pytest -m gpu tests/gpu/test_gpu_linear_kernels.py: {py.get('summary') or py.get('error') or py.get('skipped')}")
    return "\n".join(lines)


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=os.environ.get("OUT", "gpu_linear_extend_out"))
    ap.add_argument("--dry-run", action="store_true", help="CPU, tiny dims, FLA stood in for by the reference")
    ap.add_argument("--budget-s", type=float, default=430.0, help="seconds for the whole script (device limit 480)")
    ap.add_argument("--no-pytest", action="store_true")
    ap.add_argument("--part", default="main", choices=["main", "gdn", "kda", "lightning"])
    ap.add_argument("--families", default="gdn,kda,lightning",
                    help="FLA families to check and time, comma-separated (the conv always runs)")
    ap.add_argument("--result", default=None)
    ap.add_argument("--lock", default=None)
    ap.add_argument("--copy-bytes-per-s", type=float, default=None)
    ap.add_argument("--matmul-flops-per-s", type=float, default=None)
    return ap.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    if not args.dry_run and not torch.cuda.is_available():
        print("no CUDA device: use --dry-run on a CPU", file=sys.stderr)
        return 2
    if args.part != "main":
        try:
            res = family_part(args.part, args)
        except Exception as e:
            res = {"family": args.part, "error": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc()[-2500:]}
        save_json(args.result, res)
        return 0
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    json_path = out / "gpu_linear_extend.json"
    env = device_facts(args.dry_run)
    env.update(device_rates())
    args.copy_bytes_per_s, args.matmul_flops_per_s = env["copy_bytes_per_s"], env["matmul_flops_per_s"]
    log(f"{env['device']}: copy {env['copy_bytes_per_s'] / 1e12:.2f} TB/s, bf16 matmul "
        f"{env['matmul_flops_per_s'] / 1e12:.0f} TFLOP/s, fla {env['fla']}")
    results: dict = {"env": env, "families": {}}
    save = lambda: save_json(json_path, results)
    save()
    names = [n for n in args.families.split(",") if n]
    unknown = sorted(set(names) - {"gdn", "kda", "lightning"})
    if unknown:
        print(f"--families: no family {unknown[0]} (gdn, kda, lightning)", file=sys.stderr)
        return 2
    deadline = START + args.budget_s
    reserve = 0 if (args.dry_run or args.no_pytest) else 100
    lock = Path(tempfile.mkdtemp()) / "timing.lock"

    def conv_part():
        """The conv in this process (no FLA), while the FLA families compile; timed under the lock."""
        spec = (DRY if args.dry_run else REAL)["conv"]
        device = "cpu" if args.dry_run else "cuda"
        conv: dict = {"family": "conv"}
        try:
            conv["check"] = check_family("conv", spec, device, args.dry_run, None)
            conv["kernel_check"] = conv_kernel_checks(args.dry_run, device)
            if not (conv["check"]["ok"] and all(r["ok"] for r in conv["kernel_check"])):
                conv["timing_error"] = "not timed: the extend conv failed its checks"
                log(f"  conv: {conv['timing_error']}")
                return
            with open(lock, "a+") as f:
                fcntl.flock(f, fcntl.LOCK_EX)
                conv["timing"] = time_family("conv", spec, device, args.dry_run, None, env, quick=False)
        except Exception as e:
            conv["error"] = f"{type(e).__name__}: {e}"
            conv["traceback"] = traceback.format_exc()[-2500:]
        finally:
            results["families"]["conv"] = conv
            save()

    fams = run_parts(args, names, deadline - time.time() - reserve, out, lock, conv_part)
    results["families"].update(fams)
    save()
    if not args.no_pytest:
        results["pytest"] = ({"skipped": "dry run (the gpu tests need CUDA)"} if args.dry_run else
                             run_gpu_pytest("tests/gpu/test_gpu_linear_kernels.py", min(150, deadline - time.time() - 5),
                                            out / "pytest.log"))
        save()
    results["table"] = table(results)
    save()
    print("\n" + results["table"], flush=True)
    print(f"\nresults: {json_path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
