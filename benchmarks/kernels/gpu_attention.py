"""GPU full-attention backend: correctness checks, JIT times and timings, in one run.

For the lent GPU machine (H100/H200, flashinfer 0.6 from the carried wheels):

    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl \
      && export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1; python3 benchmarks/kernels/gpu_attention.py --out $OUT

Sections, each part in its own try/except (an error is reported and the run goes on):

1. env and ceilings: device-to-device copy bandwidth (bytes read + written) and bf16 matmul rate,
   measured here; they turn bytes and FLOPs into floor times.
2. jit: the first plan() of each FlashInfer kernel kind builds it (JIT); its time is reported
   apart from a second, warm plan. Also the first launch of the Triton kernels.
3. checks: the checks of testkit/attention_cases.py (tests/gpu/test_gpu_attention.py asserts them) against the CPU reference (compact list).
4. decode timings at batch 1, 8, 32, 128 and context 512 / 2048 / 8192 (one layer; per op call:
   K/V store + attention + padding mask): FlashInfer inside a CUDA graph (and eager), the
   plan-free Triton GQA kernel (`decode_impl=triton`) for GQA, the Triton MLA kernel for MLA,
   torch SDPA on an already gathered contiguous cache (in a CUDA graph), and the floor: KV bytes
   read + q/out over the measured copy bandwidth. Each variant's output is compared with the
   default's on the same step before it is timed (`vs_fi`), and the host time of the
   replay hook (`replan_us`: FlashInfer's plan, or the Triton path's device copies) is reported.
5. extend timings: 512 and 2048 new tokens of one request from an empty cache, and 512 over
   2048 cached; floor = max(FLOPs over the matmul rate, bytes over the copy bandwidth).

Timings: triton.testing.do_bench medians (it clears L2 between repetitions). `--quick` runs a
small subset for a first smoke run. The full JSON goes to --out DIR/gpu_attention.json, written
after every section so a run cut short still leaves its numbers; a short table prints last.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import traceback
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: bench_common

from bench_common import capture_graph, device_rates, fmt  # noqa: E402
from compiler.splitops import LayerKind, LayerRegistry, LayerSpec  # noqa: E402
from runtime.cache.batch import SeqState, build_step  # noqa: E402
from runtime.cache.kv_pool import KVPool  # noqa: E402
from testkit.attention_cases import (GQA_64, MHA_128, MLA_16, MLA_32, MLA_P, MLA_R, QWEN3_NEXT,  # noqa: E402
                                     AttnConfig, check_decode, check_extend, check_graph_decode,
                                     check_graph_growing, check_padded_decode, check_verify)

T0 = time.time()
RESULTS: dict = {"env": {}, "ceilings": {}, "jit": [], "checks": [], "decode": [], "extend": [], "errors": []}
OUT_DIR: Path | None = None
BUDGET_S = 480.0
BACKEND_DEFAULTS: dict = {}  # --prefill-backend / --decode-backend / --mla-backend, for every backend made here
FI = {"decode_impl": "flashinfer"}  # FlashInfer's GQA decode, named: the backend's default decode is Triton's


def log(msg: str) -> None:
    print(f"[{time.time() - T0:7.1f}s] {msg}", flush=True)


def save() -> None:
    if OUT_DIR is not None:
        OUT_DIR.mkdir(parents=True, exist_ok=True)
        (OUT_DIR / "gpu_attention.json").write_text(json.dumps(RESULTS, indent=1, default=str))


def over_budget() -> bool:
    return time.time() - T0 > BUDGET_S


def guarded(section: str, what: str, fn, *args, **kwargs):
    """Run fn; on error record and print it, return None."""
    try:
        return fn(*args, **kwargs)
    except Exception as exc:  # noqa: BLE001 - every part must report and let the run go on
        tb = traceback.format_exc()
        RESULTS["errors"].append({"section": section, "what": what, "error": f"{type(exc).__name__}: {exc}",
                                  "traceback": tb[-4000:]})
        log(f"ERROR {section} / {what}: {type(exc).__name__}: {str(exc)[:400]}")
        print(tb[-1500:], flush=True)
        return None
    finally:
        try:  # after a device fault every later call fails too; the summary must still print
            torch.cuda.synchronize()
            torch.cuda.empty_cache()
        except Exception as exc:  # noqa: BLE001
            log(f"device unusable after {section} / {what}: {type(exc).__name__}: {str(exc)[:200]}")


def bench_ms(fn) -> float:
    from triton.testing import do_bench

    return float(do_bench(fn, warmup=25, rep=100, return_mode="median"))


# -- 1. env and ceilings -------------------------------------------------------------------------


def env() -> None:
    props = torch.cuda.get_device_properties(0)
    info = {"device": torch.cuda.get_device_name(0), "sms": props.multi_processor_count,
            "mem_GiB": round(props.total_memory / 2**30, 1), "torch": torch.__version__, "cuda": torch.version.cuda,
            "python": sys.version.split()[0], "date": time.strftime("%Y-%m-%d %H:%M:%S")}
    try:
        import triton
        info["triton"] = triton.__version__
    except Exception as exc:  # noqa: BLE001
        info["triton"] = f"missing: {exc}"
    try:
        import flashinfer
        info["flashinfer"] = getattr(flashinfer, "__version__", "?")
    except Exception as exc:  # noqa: BLE001
        info["flashinfer"] = f"import failed: {exc}"
    RESULTS["env"] = info
    log(f"env: {info}")


def ceilings() -> None:
    rates = device_rates()
    RESULTS["ceilings"] = {"copy_GBps": rates["copy_bytes_per_s"] / 1e9, "bf16_mm_TFLOPs": rates["matmul_flops_per_s"] / 1e12,
                           "method": rates["method"]}
    log(f"ceilings: copy {RESULTS['ceilings']['copy_GBps']:.0f} GB/s (read+write), "
        f"bf16 matmul {RESULTS['ceilings']['bf16_mm_TFLOPs']:.0f} TFLOP/s")


def copy_bw() -> float:
    return RESULTS["ceilings"].get("copy_GBps", 3000.0) * 1e9


def mm_rate() -> float:
    return RESULTS["ceilings"].get("bf16_mm_TFLOPs", 700.0) * 1e12


# -- shared set-up -------------------------------------------------------------------------------


def make_pool(cfg: AttnConfig, num_pages: int, page_size: int = 16, num_layers: int = 1) -> KVPool:
    kind = LayerKind.FULL_MLA if cfg.kind == "mla" else LayerKind.FULL_GQA
    registry = LayerRegistry([LayerSpec(i, kind, kv=cfg.kv_spec()) for i in range(num_layers)])
    pool = KVPool(registry, num_pages, page_size, device="cuda")
    for entries in pool.buffers.values():
        for t in entries.values():
            t.normal_()  # never time on zeros
    return pool


def make_backend(cfg: AttnConfig, pool: KVPool, **kw):
    from runtime.backends.flashinfer_attention import FlashInferAttentionBackend

    return FlashInferAttentionBackend(pool, q_heads=cfg.heads, scales=cfg.scale, **{**BACKEND_DEFAULTS, **kw})


def make_inputs(cfg: AttnConfig, T: int) -> dict:
    r = lambda *s: torch.randn(*s, device="cuda", dtype=torch.bfloat16)
    if cfg.kind == "mla":
        return {"q_latent": r(T, cfg.heads, MLA_R), "q_rope": r(T, cfg.heads, MLA_P), "kv_latent": r(T, MLA_R),
                "k_rope": r(T, MLA_P)}
    return {"q": r(T, cfg.heads, cfg.head_dim), "k": r(T, cfg.kv_heads, cfg.head_dim), "v": r(T, cfg.kv_heads, cfg.head_dim)}


def out_for(cfg: AttnConfig, T: int) -> torch.Tensor:
    return torch.empty(T, cfg.heads, MLA_R if cfg.kind == "mla" else cfg.head_dim, device="cuda", dtype=torch.bfloat16)


def op_call(be, cfg: AttnConfig, ctx, x: dict, out: torch.Tensor, layers=(0,)):
    """One op call per layer in `layers`, in order (as a model's full layers would run)."""
    if cfg.kind == "mla":
        def call():
            for layer in layers:
                be.mla_attention(ctx, x["q_latent"], x["q_rope"], x["kv_latent"], x["k_rope"], out, layer, cfg.scale)
    else:
        def call():
            for layer in layers:
                be.gqa_attention(ctx, x["q"], x["k"], x["v"], out, layer, cfg.scale)
    return call


def requests(pool: KVPool, B: int, cached: int, new: int, seed: int = 0):
    """B requests with `cached` tokens already in the pool, on randomly scattered pages."""
    ps = pool.page_size
    per = -(-(cached + new) // ps)
    g = torch.Generator().manual_seed(seed)
    perm = torch.randperm(pool.num_pages, generator=g)[: B * per].view(B, per).tolist()
    seqs = [SeqState(i + 1, pages=perm[i], num_cached=cached) for i in range(B)]
    return build_step([(s, [0] * new) for s in seqs], pool, device="cuda").ctx


def kv_token_bytes(cfg: AttnConfig) -> int:
    return cfg.kv_bytes_per_token()


def qo_bytes(cfg: AttnConfig, rows: int) -> int:
    if cfg.kind == "mla":
        return rows * cfg.heads * (MLA_R + MLA_P + MLA_R) * 2
    return rows * cfg.heads * cfg.head_dim * 2 * 2


def attn_flops(cfg: AttnConfig, pairs: int) -> float:
    if cfg.kind == "mla":
        return 2.0 * cfg.heads * (MLA_R + MLA_P + MLA_R) * pairs
    return 2.0 * cfg.heads * (2 * cfg.head_dim) * pairs


# -- 2. JIT --------------------------------------------------------------------------------------


def jit_one(cfg: AttnConfig, mode: str, **kw) -> dict:
    """Time the first plan (builds the kernel), a second plan, and the first and second op calls."""
    pool = make_pool(cfg, 64)
    be = make_backend(cfg, pool, **kw)
    if mode == "decode":
        ctx = requests(pool, 4, 100, 1)
    else:
        ctx = requests(pool, 2, 0 if mode == "extend-fresh" else 64, 100)
    x = make_inputs(cfg, ctx.num_tokens)
    out = out_for(cfg, ctx.num_tokens)
    times = {}
    for label in ("plan_first_s", "plan_again_s"):
        torch.cuda.synchronize()
        t = time.time()
        be.init_step_metadata(ctx)
        torch.cuda.synchronize()
        times[label] = time.time() - t
    call = op_call(be, cfg, ctx, x, out)
    for label in ("run_first_s", "run_again_s"):
        torch.cuda.synchronize()
        t = time.time()
        call()
        torch.cuda.synchronize()
        times[label] = time.time() - t
    row = {"config": cfg.name, "mode": mode, "variant": _variant(kw), **times,
           "jit_s": times["plan_first_s"] - times["plan_again_s"] + times["run_first_s"] - times["run_again_s"]}
    log(f"jit {cfg.name} {mode} {row['variant']}: build+load {row['jit_s']:.1f}s "
        f"(plan {times['plan_first_s']:.2f}s first / {times['plan_again_s'] * 1e3:.2f} ms warm)")
    return row


def _variant(kw: dict) -> str:
    return ",".join(f"{k}={v}" for k, v in sorted(kw.items())) or "default"


_LABELS = {"default": "default", "decode_impl=flashinfer": "fi", "decode_impl=flashinfer,decode_tensor_cores=False": "fi cuda-core",
           "decode_impl=flashinfer,decode_tensor_cores=True": "fi tc",
           "decode_backend=fa3,decode_impl=flashinfer,decode_tensor_cores=True": "fi tc fa3",
           "mla_impl=triton": "triton mla", "mla_backend=fa2": "fi mla fa2", "decode_impl=triton": "triton gqa"}


def jit_section(quick: bool) -> None:
    jobs = [(QWEN3_NEXT, "decode", FI), (QWEN3_NEXT, "extend", {}), (QWEN3_NEXT, "extend-fresh", {}),
            (MLA_32, "decode", {}), (MLA_32, "decode", {"mla_impl": "triton"}),
            (QWEN3_NEXT, "decode", {"decode_impl": "triton"})]
    if not quick:
        jobs += [(QWEN3_NEXT, "decode", {**FI, "decode_tensor_cores": False}),
                 (QWEN3_NEXT, "decode", {**FI, "decode_tensor_cores": True, "decode_backend": "fa3"}),
                 (QWEN3_NEXT, "extend", {"extend_impl": "paged", "prefill_backend": "fa2"}),
                 (MHA_128, "decode", FI), (MHA_128, "extend", {}), (MHA_128, "decode", {**FI, "decode_tensor_cores": True}),
                 (MLA_32, "extend", {}), (MLA_32, "decode", {"mla_backend": "fa2"})]
    for cfg, mode, kw in jobs:
        if over_budget():
            log("budget reached: skipping the rest of the jit section")
            break
        row = guarded("jit", f"{cfg.name} {mode} {_variant(kw)}", jit_one, cfg, mode, **kw)
        if row:
            RESULTS["jit"].append(row)
    save()


# -- 3. checks -----------------------------------------------------------------------------------


def checks_section(quick: bool) -> None:
    jobs = [
        (check_decode, (QWEN3_NEXT, 1), {}), (check_decode, (QWEN3_NEXT, 64), {}),
        (check_extend, (QWEN3_NEXT,), {}), (check_extend, (QWEN3_NEXT,), {"extend_impl": "paged"}),
        (check_padded_decode, (QWEN3_NEXT,), {}), (check_graph_decode, (QWEN3_NEXT,), {}),
        (check_decode, (MHA_128, 33), {}), (check_extend, (MHA_128,), {}),
        (check_decode, (MLA_32, 37), {}), (check_extend, (MLA_32,), {}), (check_graph_decode, (MLA_32,), {}),
        (check_decode, (MLA_32, 37), {"mla_impl": "triton"}), (check_extend, (MLA_32,), {"mla_impl": "triton"}),
        (check_graph_decode, (MLA_32,), {"mla_impl": "triton"}),
        (check_verify, (QWEN3_NEXT,), {}), (check_verify, (MLA_32,), {}),
        (check_verify, (MLA_32,), {"mla_impl": "triton"}),
        (check_decode, (QWEN3_NEXT, 1), {"decode_impl": "triton"}), (check_decode, (QWEN3_NEXT, 64), {"decode_impl": "triton"}),
        (check_padded_decode, (QWEN3_NEXT,), {"decode_impl": "triton"}),
        (check_graph_decode, (QWEN3_NEXT,), {"decode_impl": "triton"}),
        (check_graph_growing, (QWEN3_NEXT,), {"decode_impl": "triton"}),
        (check_verify, (QWEN3_NEXT,), {"decode_impl": "triton"}),
    ]
    if not quick:
        jobs += [
            (check_decode, (QWEN3_NEXT, 256), {}), (check_decode, (MHA_128, 256), {}),
            (check_decode, (QWEN3_NEXT, 33), {"decode_tensor_cores": False}),
            (check_decode, (QWEN3_NEXT, 33), {"decode_tensor_cores": True, "decode_backend": "fa3"}),
            (check_extend, (QWEN3_NEXT,), {"extend_impl": "paged", "prefill_backend": "fa2"}),
            (check_decode, (QWEN3_NEXT, 9), {"max_len": 300, "page_size": 1}),
            (check_graph_decode, (MHA_128,), {}), (check_padded_decode, (MLA_16,), {}),
            (check_decode, (MLA_16, 1), {}), (check_decode, (MLA_16, 128), {}), (check_extend, (MLA_16,), {}),
            (check_decode, (MLA_16, 128), {"mla_impl": "triton"}),
            (check_decode, (QWEN3_NEXT, 256), {"decode_impl": "triton"}), (check_decode, (GQA_64, 33), {"decode_impl": "triton"}),
            (check_decode, (MHA_128, 33), {"decode_impl": "triton"}),
            (check_decode, (QWEN3_NEXT, 9), {"max_len": 300, "page_size": 1, "decode_impl": "triton"}),
            (check_verify, (QWEN3_NEXT,), {"decode_impl": "triton", "dtype": torch.float32}),
        ]
    for fn, args, kw in jobs:
        if over_budget():
            log("budget reached: skipping the rest of the checks")
            break
        what = f"{fn.__name__} {args[0].name} {args[1:] or ''} {_variant(kw)}"
        t = time.time()
        res = guarded("checks", what, fn, *args, **{**BACKEND_DEFAULTS, **kw})
        if res is None:
            res = {"name": what, "ok": False, "max_err": float("nan"), "error": RESULTS["errors"][-1]["error"]}
        res["seconds"] = round(time.time() - t, 1)
        RESULTS["checks"].append(res)
        log(f"check {'PASS' if res['ok'] and res.get('caches_match', True) else 'FAIL'} {res['name']}: "
            f"max err {res['max_err']:.2e} caches_match={res.get('caches_match')} ({res['seconds']}s)")
        save()


# -- 4. decode timings ---------------------------------------------------------------------------


def gathered(cfg: AttnConfig, pool: KVPool, ctx, B: int, L: int, layer: int = 0):
    """The cache as a user with a contiguous cache would hold it: [B, Hkv, L, D] (head-major)."""
    ps = pool.page_size
    pages = ctx.page_table[:B, : -(-L // ps)].long()
    entries = pool.layer(layer)
    if cfg.kind == "mla":
        lat = entries["latent"][pages].reshape(B, -1, MLA_R + MLA_P)[:, :L]
        return lat.unsqueeze(1).contiguous(), lat[..., :MLA_R].unsqueeze(1).contiguous()
    k = entries["k"][pages].reshape(B, -1, cfg.kv_heads, cfg.head_dim)[:, :L].transpose(1, 2).contiguous()
    v = entries["v"][pages].reshape(B, -1, cfg.kv_heads, cfg.head_dim)[:, :L].transpose(1, 2).contiguous()
    return k, v


def sdpa_query(cfg: AttnConfig, x: dict, B: int, rows: int) -> torch.Tensor:
    """[B, H, rows, Dq] from the op's token-major q."""
    if cfg.kind == "mla":
        q = torch.cat([x["q_latent"], x["q_rope"]], -1)
    else:
        q = x["q"]
    return q.view(B, rows, cfg.heads, -1).transpose(1, 2).contiguous()


def layers_past_l2(layer_bytes: int) -> int:
    """Layers to rotate through so one graph replay reads well past L2 (50-60 MB on Hopper)."""
    return max(1, min(16, -(-256 * 2**20 // max(layer_bytes, 1))))


def decode_point(cfg: AttnConfig, B: int, L: int, variants: list[dict]) -> dict:
    """Per-layer time of one decode op: a graph of `nl` op calls over `nl` layers' caches, / nl."""
    ps = 16
    per_req = -(-(L + 1) // ps)
    nl = layers_past_l2(B * per_req * ps * kv_token_bytes(cfg))
    pool = make_pool(cfg, B * per_req + 1, ps, num_layers=nl)
    ctx = requests(pool, B, L, 1)
    x = make_inputs(cfg, B)
    row = {"config": cfg.name, "B": B, "ctx": L, "layers_in_graph": nl}
    kv_bytes = B * (L + 1) * kv_token_bytes(cfg) + qo_bytes(cfg, B)
    row["floor_us"] = kv_bytes / copy_bw() * 1e6
    row["bytes_MB"] = kv_bytes / 1e6
    first = None  # the default variant's output: every other variant is checked against it
    for kw in variants:
        name = _variant(kw)
        res = guarded("decode", f"{cfg.name} B={B} L={L} {name}", _fi_decode, cfg, pool, ctx, x, B, nl, kw)
        if res:
            out = res.pop("out")
            first = out if first is None else first
            res["vs_fi"] = float((out.float() - first.float()).norm() / first.float().norm().clamp_min(1e-30))
            for k, v in res.items():
                row[f"{name}:{k}"] = v
    res = guarded("decode", f"{cfg.name} B={B} L={L} sdpa", _sdpa_decode, cfg, pool, ctx, x, B, L + 1, nl)
    if res:
        row.update(res)
    del pool
    return row


def _fi_decode(cfg, pool, ctx, x, B, nl, kw) -> dict:
    be = make_backend(cfg, pool, **kw)
    out = out_for(cfg, B)
    call = op_call(be, cfg, ctx, x, out, layers=range(nl))
    be.init_step_metadata(ctx)
    call()
    eager_out = out.clone()  # the correctness check comes before the timing
    eager = bench_ms(call) / nl
    be.init_capture_state(B, B)
    be.init_replay_state(ctx, B)
    g = capture_graph(call)
    plan_s = []
    for _ in range(5):
        torch.cuda.synchronize()
        t = time.perf_counter()
        be.init_replay_state(ctx, B)
        torch.cuda.synchronize()
        plan_s.append(time.perf_counter() - t)
    graph1 = bench_ms(g.replay) / nl
    graph2 = bench_ms(g.replay) / nl  # the same version twice: the spread is the noise
    ok = bool(torch.isfinite(out).all())
    del g
    return {"graph_us": graph1 * 1e3, "graph2_us": graph2 * 1e3, "eager_us": eager * 1e3,
            "replan_us": sorted(plan_s)[2] * 1e6, "finite": ok, "out": eager_out}


def _sdpa_decode(cfg, pool, ctx, x, B, L, nl) -> dict:
    if cfg.kind == "mla" and B * L * cfg.heads * (MLA_R + MLA_P) * 2 * 2 > 16 * 2**30:
        # SDPA has no kernel for q/k 576 and v 512: its math path expands k/v to every head.
        log(f"sdpa skipped for {cfg.name} B={B} L={L}: its math path would expand k/v past 16 GiB")
        return {}
    caches = [gathered(cfg, pool, ctx, B, L, layer) for layer in range(nl)]
    q = sdpa_query(cfg, x, B, 1)

    def fn():
        for k, v in caches:
            F.scaled_dot_product_attention(q, k, v, scale=cfg.scale, enable_gqa=True)
    eager = bench_ms(fn) / nl
    try:
        g = capture_graph(fn)
        graph = bench_ms(g.replay) / nl
        del g
    except Exception as exc:  # noqa: BLE001 - report eager SDPA even when it cannot be captured
        log(f"sdpa capture failed ({type(exc).__name__}: {exc}); eager only")
        graph = float("nan")
    return {"sdpa_graph_us": graph * 1e3, "sdpa_eager_us": eager * 1e3}


# The backend's defaults first ("fi"), then the alternatives the defaults were chosen against.
GQA_DECODE_VARIANTS = [FI, {"decode_impl": "triton"}, {**FI, "decode_tensor_cores": False},
                       {**FI, "decode_tensor_cores": True, "decode_backend": "fa3"}]
MHA_DECODE_VARIANTS = [FI, {"decode_impl": "triton"}, {**FI, "decode_tensor_cores": True}]
MLA_DECODE_VARIANTS = [{}, {"mla_impl": "triton"}, {"mla_backend": "fa2"}]


def decode_section(quick: bool) -> None:
    batches = [1, 32] if quick else [1, 8, 32, 128]
    lengths = [2048] if quick else [512, 2048, 8192]
    plans = [(QWEN3_NEXT, GQA_DECODE_VARIANTS[:2] if quick else GQA_DECODE_VARIANTS),
             (MLA_32, MLA_DECODE_VARIANTS[:2] if quick else MLA_DECODE_VARIANTS)]
    if not quick:
        plans.insert(1, (MHA_128, MHA_DECODE_VARIANTS))
    for cfg, variants in plans:
        for L in lengths:
            for B in batches:
                if over_budget():
                    log("budget reached: skipping the rest of the decode timings")
                    save()
                    return
                row = guarded("decode", f"{cfg.name} B={B} L={L}", decode_point, cfg, B, L, variants)
                if row:
                    RESULTS["decode"].append(row)
                    times = ", ".join(f"{_LABELS.get(_variant(kw), _variant(kw))} {row.get(_variant(kw) + ':graph_us', float('nan')):.1f}"
                                      f" (host {row.get(_variant(kw) + ':replan_us', float('nan')):.0f},"
                                      f" vs fi {row.get(_variant(kw) + ':vs_fi', float('nan')):.0e})"
                                      for kw in variants)
                    log(f"decode {cfg.name} B={B} L={L} (x{row['layers_in_graph']} layers): {times}, "
                        f"sdpa {row.get('sdpa_graph_us', float('nan')):.1f}, floor {row['floor_us']:.1f} us")
        save()


# -- 5. extend timings ---------------------------------------------------------------------------


def extend_point(cfg: AttnConfig, N: int, C: int) -> dict:
    ps = 16
    pool = make_pool(cfg, -(-(N + C) // ps) + 1, ps)
    ctx = requests(pool, 1, C, N)
    x = make_inputs(cfg, N)
    out = out_for(cfg, N)
    pairs = N * C + N * (N + 1) // 2
    flops = attn_flops(cfg, pairs)
    bytes_ = (N + C) * kv_token_bytes(cfg) + qo_bytes(cfg, N)
    row = {"config": cfg.name, "new": N, "cached": C, "GFLOP": flops / 1e9,
           "floor_us": max(flops / mm_rate(), bytes_ / copy_bw()) * 1e6,
           "floor_kind": "flops" if flops / mm_rate() > bytes_ / copy_bw() else "bytes"}
    variants = [("paged", {"extend_impl": "paged"})]  # MLA: FlashInfer's MLA wrapper
    if cfg.kind == "gqa":
        variants.append(("paged_fa2", {"extend_impl": "paged", "prefill_backend": "fa2"}))
        if C == 0:
            variants.append(("ragged", {"extend_impl": "ragged"}))
    if cfg.kind == "mla":
        variants.append(("triton", {"mla_impl": "triton"}))
    for name, kw in variants:
        def run(kw=kw):
            be = make_backend(cfg, pool, **kw)
            be.init_step_metadata(ctx)
            call = op_call(be, cfg, ctx, x, out)
            call()
            return bench_ms(call)
        ms = guarded("extend", f"{cfg.name} N={N} C={C} {name}", run)
        if ms is not None:
            row[f"{name}_us"] = ms * 1e3

    def sdpa():
        k, v = gathered(cfg, pool, ctx, 1, N + C)
        q = sdpa_query(cfg, x, 1, N)
        if C == 0:
            fn = lambda: F.scaled_dot_product_attention(q, k, v, scale=cfg.scale, is_causal=True, enable_gqa=True)
        else:  # causal aligned to the end of the cache: query i sees keys 0..C+i
            mask = torch.ones(N, N + C, dtype=torch.bool, device="cuda").tril(diagonal=C)
            fn = lambda: F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=cfg.scale, enable_gqa=True)
        return bench_ms(fn)
    ms = guarded("extend", f"{cfg.name} N={N} C={C} sdpa", sdpa)
    if ms is not None:
        row["sdpa_us"] = ms * 1e3
    return row


def extend_section(quick: bool) -> None:
    cases = [(512, 0)] if quick else [(512, 0), (2048, 0), (512, 2048)]
    cfgs = [QWEN3_NEXT, MLA_32] if quick else [QWEN3_NEXT, MHA_128, MLA_32]
    for cfg in cfgs:
        for N, C in cases:
            if over_budget():
                log("budget reached: skipping the rest of the extend timings")
                save()
                return
            row = guarded("extend", f"{cfg.name} N={N} C={C}", extend_point, cfg, N, C)
            if row:
                RESULTS["extend"].append(row)
                log(f"extend {cfg.name} N={N} C={C}: paged {row.get('paged_us', float('nan')):.1f} us, "
                    f"sdpa {row.get('sdpa_us', float('nan')):.1f} us, floor {row['floor_us']:.1f} us")
        save()


# -- table ---------------------------------------------------------------------------------------


def print_tables() -> None:
    e, c = RESULTS["env"], RESULTS["ceilings"]
    print("\n==== gpu_attention summary ====")
    print(f"{e.get('device')} | torch {e.get('torch')} | flashinfer {e.get('flashinfer')} | triton {e.get('triton')} | "
          f"copy {fmt(c.get('copy_GBps'), '.0f')} GB/s | bf16 mm {fmt(c.get('bf16_mm_TFLOPs'), '.0f')} TFLOP/s")
    if RESULTS["jit"]:
        print("\nJIT (first plan + first run minus warm ones), seconds:")
        for r in RESULTS["jit"]:
            print(f"  {r['config']:<14} {r['mode']:<13} {r['variant']:<28} {r['jit_s']:6.1f}   warm plan {r['plan_again_s'] * 1e3:6.2f} ms")
    if RESULTS["checks"]:
        n_ok = sum(1 for r in RESULTS["checks"] if r["ok"] and r.get("caches_match", True))
        print(f"\nchecks: {n_ok}/{len(RESULTS['checks'])} pass (rel err <= 1e-2, padded rows zero, caches equal)")
        for r in RESULTS["checks"]:
            flag = "ok  " if r["ok"] and r.get("caches_match", True) else "FAIL"
            print(f"  {flag} {r['name'][:70]:<70} {r['max_err']:.1e}" + (f"  {r['error'][:80]}" if "error" in r else ""))
    if RESULTS["decode"]:
        print("\ndecode, microseconds per layer (a CUDA graph of one op call per layer, over enough layers to read past L2; "
              "fi = FlashInfer with the backend's defaults; tc = tensor-core decode; sdpa = torch SDPA on a contiguous cache):")
        found = {k.split(":")[0] for r in RESULTS["decode"] for k in r if k.endswith(":graph_us")}
        keys = ["default"] * ("default" in found) + sorted(found - {"default"})  # the backend's defaults first
        print(f"  {'config':<14} {'B':>4} {'ctx':>5} " + " ".join(f"{_LABELS.get(k, k)[:13]:>13}" for k in keys)
              + f" {'fi eager':>9} {'sdpa':>8} {'floor':>7} {'fi/floor':>8} {'fi/sdpa':>7}")
        for r in RESULTS["decode"]:
            fi = r.get("default:graph_us")
            sdpa = r.get("sdpa_graph_us")
            print(f"  {r['config']:<14} {r['B']:>4} {r['ctx']:>5} "
                  + " ".join(f"{fmt(r.get(k + ':graph_us')):>13}" for k in keys)
                  + f" {fmt(r.get('default:eager_us')):>9} {fmt(sdpa):>8} {fmt(r['floor_us']):>7}"
                  + f" {fmt(fi / r['floor_us'] if fi else None, '.2f'):>8} {fmt(fi / sdpa if fi and sdpa else None, '.2f'):>7}")
        print("\n  host time of init_replay_state per step (us; FlashInfer plans, the Triton decode copies on the device) "
              "and each variant's relative difference from the default's output:")
        for r in RESULTS["decode"]:
            print(f"  {r['config']:<14} {r['B']:>4} {r['ctx']:>5} " + " ".join(
                f"{_LABELS.get(k, k)[:13]:>13} {fmt(r.get(k + ':replan_us'), '.0f'):>6} {fmt(r.get(k + ':vs_fi'), '.0e'):>6}"
                for k in keys))
    if RESULTS["extend"]:
        print("\nextend, one request, microseconds (defaults: ragged when every request is fresh, else paged; "
              "paged/ragged on prefill_backend auto = fa3 on Hopper):")
        cols = ["paged", "paged_fa2", "ragged", "triton", "sdpa"]
        print(f"  {'config':<14} {'new':>5} {'cached':>6} " + " ".join(f"{c:>9}" for c in cols) + f" {'floor':>7} {'bound':>6}")
        for r in RESULTS["extend"]:
            print(f"  {r['config']:<14} {r['new']:>5} {r['cached']:>6} " + " ".join(f"{fmt(r.get(c + '_us')):>9}" for c in cols)
                  + f" {fmt(r['floor_us']):>7} {r['floor_kind']:>6}")
    if RESULTS["errors"]:
        print(f"\nerrors ({len(RESULTS['errors'])}; tracebacks in the JSON):")
        for err in RESULTS["errors"][:15]:
            print(f"  {err['section']} / {err['what'][:50]}: {err['error'][:150]}")
    print(f"\ntotal {time.time() - T0:.0f}s; JSON: {OUT_DIR / 'gpu_attention.json' if OUT_DIR else '(no --out)'}")


def main() -> None:
    global OUT_DIR, BUDGET_S
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", type=Path, default=None, help="folder for gpu_attention.json")
    ap.add_argument("--quick", action="store_true", help="a small subset: smoke run")
    ap.add_argument("--budget-s", type=float, default=480.0, help="stop starting new parts after this many seconds")
    ap.add_argument("--prefill-backend", default=None, help="override FlashInfer's prefill backend: auto, fa2, fa3")
    ap.add_argument("--decode-backend", default=None, help="override the tensor-core decode's backend: auto, fa2, fa3")
    ap.add_argument("--mla-backend", default=None, help="override FlashInfer's MLA backend: auto, fa2, fa3")
    ap.add_argument("--skip", default="", help="comma list of sections to skip: jit,checks,decode,extend")
    args = ap.parse_args()
    OUT_DIR = args.out or (Path(os.environ["OUT"]) if os.environ.get("OUT") else None)
    BUDGET_S = args.budget_s
    for key in ("prefill_backend", "decode_backend", "mla_backend"):
        if getattr(args, key) is not None:
            BACKEND_DEFAULTS[key] = getattr(args, key)
    skip = set(filter(None, args.skip.split(",")))
    if not torch.cuda.is_available():
        print("gpu_attention: no CUDA device; nothing to do")
        return
    guarded("env", "env", env)
    guarded("ceilings", "copy and matmul", ceilings)
    save()
    for name, fn in (("jit", jit_section), ("checks", checks_section), ("decode", decode_section),
                     ("extend", extend_section)):
        if name in skip:
            continue
        log(f"== {name}")
        guarded(name, "section", fn, args.quick)
        save()
    print_tables()


if __name__ == "__main__":
    main()
