"""What each Triton kernel of bench qwen3_next's steps asks of an sm90 card, compiled on any machine.

    python3 benchmarks/probes/kernel_resources_probe.py --out /tmp/kr                  # every step
    python3 benchmarks/probes/kernel_resources_probe.py --out /tmp/kr --steps extend4096 \
        --kernels _gate_up_sorted_kernel,_down_sorted_kernel

No GPU: Triton emits PTX without one and its wheel carries ptxas and cuobjdump (testkit/sm90.py). A
step account (benchmarks/kernels/step_account.py) says how long each kernel took on the card; this
says what the compiled kernel is, which the times alone do not: its registers and spills, its
shared memory, how many of its programs an SM holds and what limits that, how many waves its grid
makes on the H200's 132 SMs and how full the last one is, and whether it multiplies on Hopper's
warpgroup tensor cores (HGMMA) and pipelines its loads (LDGSTS: cp.async; UTMALDG: TMA).

1. Record (under Triton's interpreter, nothing run) the launches each step makes through the
   kernels' own entry points, at bench qwen3_next's dims (hidden 2048, 16 experts of 512 top-4
   with a gated shared expert of 512, GDN heads 16 / 32 of 128 with a conv of 4, GQA 16 / 2 heads
   of 256, vocabulary 151936), bf16, with the configs those entry points choose and the MoE's
   H200 table (runtime/backends/kernels/moe_configs):
   - decode1 / decode128: the GEMVs of the projections and the logits head (1 row; at 128 rows
     they are cuBLAS GEMMs, not ours), the norms folded into them (`--norm-linear`, 1 row), the
     MoE at 1 / 128 tokens, the GDN decode (the split in two launches at 1 request, the unfused
     kernels at 128) and the GQA split-KV decode over 1024 cached tokens a request;
   - extend512 / extend4096: one request of 512 / 4096 tokens through the MoE, the extend conv
     (row layout, as the backend takes it for long steps), the GDN gates, the chunk kernels and
     the gated norm;
   - every step: a GQA layer's q / k norms and rotary as one kernel (`hgc build --norm-rope`) and
     its output gate as one kernel (`hgc build --sigmoid-gate`);
   - extend512 / extend4096: the captured extend step's tables (one kernel variant for every
     request count: made here for 256 requests).
2. Compile each distinct launch for sm90 in a process outside the interpreter, read its resources
   (cuobjdump) and its SASS op counts.

`--state-dtype bfloat16` records the GDN kernels over bfloat16 recurrent states (`hgc compile
--state-dtype`); `--decode-tiles walk` decode128's recurrence on programs walking its tiles
(`triton_linear[decode_tiles=walk]`). OUT/kernel_resources.json and a table. Not here: times (a GPU's), Inductor's glue
kernels and cuBLAS / FlashInfer kernels (not ours to compile), the attention of an extend step
(FlashInfer).
"""

from __future__ import annotations

import os
import sys

if "--compile" not in sys.argv:
    os.environ["TRITON_INTERPRET"] = "1"  # recording: before triton is imported anywhere

import argparse  # noqa: E402
import importlib  # noqa: E402
import json  # noqa: E402
import math  # noqa: E402
import subprocess  # noqa: E402
import tempfile  # noqa: E402
from pathlib import Path  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from compiler.splitops.registry import STATE_DTYPES  # noqa: E402
from testkit.sm90 import SM90, Launch, compile_sm90, programs_per_sm, record, resources  # noqa: E402

D, E, I, TOP_K, VOCAB = 2048, 16, 512, 4, 151936
HK, HV, DK, DV, KW = 16, 32, 128, 128, 4
HQ, HKV, HEAD, PAGE = 16, 2, 256, 16
STEPS = ("decode1", "decode128", "extend512", "extend4096")
CACHED = 1024  # tokens a decode request has in its KV cache


def _bf16(*shape):
    return torch.empty(*shape, dtype=torch.bfloat16)


def _f32(*shape):
    return torch.empty(*shape, dtype=torch.float32)


def _i64(*shape):
    return torch.zeros(*shape, dtype=torch.int64)


STATE_DTYPE = torch.float32  # --state-dtype: the GDN recurrent states' (hgc compile --state-dtype)


DECODE_TILES = "by_batch"  # --decode-tiles: the GDN decode's (the triton_linear routing option)


def _state(*shape):
    return torch.empty(*shape, dtype=STATE_DTYPE)


def _moe(T: int) -> None:
    from runtime.backends.kernels.moe import fused_moe
    from runtime.backends.kernels.moe_config import CONFIG_DIR, config_file_name, load_config_table, pick_bucket

    table = load_config_table(CONFIG_DIR / config_file_name(E, I, "NVIDIA_H200"))
    shared = (_bf16(2 * I, D), _bf16(D, I), _bf16(1, D))
    fused_moe(_bf16(T, D), _bf16(E, D), None, _bf16(E, 2 * I, D), _bf16(E, D, I), *shared, _bf16(T, D), TOP_K,
              "softmax", True, 1.0, 1, 1, pick_bucket(table, T))


def _gemvs() -> None:
    from runtime.backends.kernels.gemv import small_m_linear
    from runtime.backends.kernels.norm_gemv import add_rms_norm_gemv, gemv_add_rms_norm

    for n, k in ((12352, D), (9216, D), (D, 4096), (VOCAB, D)):  # GDN in_proj, GQA q|k|v, out_proj, head
        small_m_linear(_bf16(1, k), _bf16(n, k))
    for n in (12352, 9216):
        add_rms_norm_gemv(_bf16(1, D), _bf16(1, D), _bf16(D), _bf16(n, D), 1e-6, True)
    gemv_add_rms_norm(_bf16(1, 4096), _bf16(D, 4096), _bf16(1, D), _bf16(D), 1e-6, True)


def _gdn_decode(B: int) -> None:
    from runtime.backends.kernels import gdn_fused as GF
    from runtime.backends.kernels import linear as L

    C = 2 * HK * DK + HV * DV
    conv_w, norm_w, slots = _bf16(C, KW), _bf16(DV), _i64(B)
    conv_state, state = _f32(B + 1, C, KW - 1), _state(B + 1, HV, DK, DV)
    if GF.decode_launches(B) < 4:  # the fused decode (in one or two launches), else the unfused kernels
        GF.gdn_fused_decode(_bf16(B, C), _bf16(B, HV, DV), _bf16(B, HV), _bf16(B, HV), conv_w, _f32(HV), _f32(HV),
                            norm_w, _bf16(B, HV, DV), conv_state, state, slots, HK, DK ** -0.5, 1e-6)
        return
    mixed = _bf16(B, C)
    L.short_conv_decode(_bf16(B, C), conv_w, None, mixed, conv_state, slots, True)
    q, k, v, g, beta = GF.qk_gates(mixed, _bf16(B, HV), _bf16(B, HV), _f32(HV), _f32(HV),
                                   GF.GdnDims(HK, HV, DK, DV, C, KW))
    core = _bf16(B, HV, DV)
    walk = L.walk_recurrent_config(B, HV, DK, DV, torch.device("cpu")) if DECODE_TILES == "walk" else None
    L.gdn_decode(q, k, v, g, beta, core, state, slots, DK ** -0.5, walk)
    GF.gated_rmsnorm(core, _bf16(B, HV, DV), norm_w, _bf16(B, HV, DV), 1e-6, slots=slots, rows_per_slot=1)


def _gqa_decode(B: int) -> None:
    from runtime.backends.flashinfer_attention import store_kv_rows
    from runtime.backends.kernels.gqa import triton_gqa_attention

    pages = B * CACHED // PAGE + 1
    k_cache, v_cache = _bf16(pages, PAGE, HKV, HEAD), _bf16(pages, PAGE, HKV, HEAD)
    store_kv_rows(_i64(B), PAGE, (_bf16(B, HKV, HEAD), k_cache), (_bf16(B, HKV, HEAD), v_cache))
    table = torch.zeros(B, CACHED // PAGE, dtype=torch.int32)
    triton_gqa_attention(_bf16(B, HQ, HEAD), k_cache, v_cache, table, torch.full((B,), CACHED, dtype=torch.int32),
                         1, _bf16(B, HQ, HEAD), HEAD ** -0.5)  # one query row a request


def _qk_norm_rope(T: int) -> None:
    """A GQA layer's q / k norms and rotary as `hgc build --norm-rope` runs them: q and k views of the
    projection's output (q beside its gates), rotary dim 64, theta 1e7."""
    from models.common import rope_inv_freq
    from runtime.backends.kernels.norm_rope import qk_norm_rope

    qkv = _bf16(T, HQ * 2 * HEAD + 2 * HKV * HEAD)
    q = qkv[:, :HQ * 2 * HEAD].view(T, HQ, 2 * HEAD)[..., :HEAD]
    k = qkv[:, HQ * 2 * HEAD:HQ * 2 * HEAD + HKV * HEAD].view(T, HKV, HEAD)
    qk_norm_rope(q, k, _bf16(HEAD), _bf16(HEAD), _i64(T), rope_inv_freq(HEAD // 4, 1e7), 1e-6, True)


def _sigmoid_gate(T: int) -> None:
    """A GQA layer's output gate as `hgc build --sigmoid-gate` runs it: the attention output and the
    gate view of the projection's output, beside q."""
    from runtime.backends.kernels.sigmoid_gate import sigmoid_gate

    qkv = _bf16(T, HQ * 2 * HEAD + 2 * HKV * HEAD)
    sigmoid_gate(_bf16(T, HQ, HEAD), qkv[:, :HQ * 2 * HEAD].view(T, HQ, 2 * HEAD)[..., HEAD:])


def _extend_tables(T: int, B: int = 256) -> None:
    """The captured extend step's tables for T tokens of a bucket of B requests."""
    from runtime.backends.kernels.extend_tables import fill_extend_tables
    from runtime.backends.kernels.linear import CONV_EXTEND_BLOCK_T
    from runtime.backends.triton_linear import FLA_CHUNK, _StaticExtendPlan

    fill_extend_tables(torch.zeros(B + 1, dtype=torch.int32), _i64(_StaticExtendPlan._size(T, B)), _i64(B + 1), T, B,
                       _StaticExtendPlan._layout(T, B), FLA_CHUNK, CONV_EXTEND_BLOCK_T)


def _gdn_extend(T: int) -> None:
    from runtime.backends.kernels import chunk as CK
    from runtime.backends.kernels import gdn_fused as GF
    from runtime.backends.kernels import linear as L
    from runtime.backends.kernels.launch_math import token_blocks

    C = 2 * HK * DK + HV * DV
    slots = _i64(1)
    bounds = torch.tensor([0, T, T], dtype=torch.int64)  # one request, no padding rows
    blocks = torch.from_numpy(token_blocks([T], L.CONV_EXTEND_BLOCK_T))
    mixed = _bf16(T, C)
    L.short_conv_extend(_bf16(T, C), _bf16(C, KW), None, mixed, _f32(2, C, KW - 1), slots, bounds, blocks, True,
                        config=L.conv_extend_rows_config(C))
    q, k, v, g, beta = GF.qk_gates(mixed, _bf16(T, HV), _bf16(T, HV), _f32(HV), _f32(HV),
                                   GF.GdnDims(HK, HV, DK, DV, C, KW))
    core = _bf16(T, HV, DV)
    chunks = torch.from_numpy(token_blocks([T], CK.chunk_length(T)))
    CK.chunk_extend(q, k, v, g, beta, core, _state(2, HV, DK, DV), slots, bounds[:2], chunks, DK ** -0.5,
                    L.GATE_PER_HEAD)
    GF.gated_rmsnorm(core, _bf16(T, HV, DV), _bf16(DV), _bf16(T, HV, DV), 1e-6, bounds=bounds)


def step_launches(step: str) -> list[Launch]:
    """Step 1: the launches of one step, recorded."""
    if step.startswith("decode"):
        B = int(step[len("decode"):])
        return record(lambda: (_gemvs() if B == 1 else None, _moe(B), _gdn_decode(B), _gqa_decode(B),
                               _qk_norm_rope(B), _sigmoid_gate(B)))
    T = int(step[len("extend"):])
    return record(lambda: (_moe(T), _gdn_extend(T), _qk_norm_rope(T), _sigmoid_gate(T), _extend_tables(T)))


def _key(launch: Launch) -> str:
    """Launches that compile to the same kernel (the same arguments, grid aside) share one compile."""
    return json.dumps([launch.module, launch.name, launch.args, launch.options], sort_keys=True, default=str)


def compile_all(specs: list[dict]) -> list[dict]:
    """Step 2, outside the interpreter: each launch's compile and resources."""
    out = []
    with tempfile.TemporaryDirectory() as work:
        for spec in specs:
            launch = Launch(**spec)
            compiled = compile_sm90(launch)
            found = resources(compiled.asm["cubin"], work)
            found["dynamic_shared_bytes"] = int(compiled.metadata.shared)
            kernel = getattr(importlib.import_module(launch.module), launch.name)
            found["constants"] = {p.name: launch.args[p.name] for p in kernel.params if p.is_constexpr}
            out.append(found)
    return out


def describe(launch: Launch, found: dict) -> dict:
    warps = int(launch.options.get("num_warps", 4))
    shared = found["dynamic_shared_bytes"] + found["static_shared_bytes"]
    fit = programs_per_sm(found["registers"], shared, warps)
    programs = math.prod(launch.grid)
    wave = fit["programs"] * SM90["sms"]
    waves = programs / wave if wave else float("inf")
    return {"kernel": launch.name, "module": launch.module.rsplit(".", 1)[-1], "grid": launch.grid,
            "programs": programs, "warps": warps, "stages": launch.options.get("num_stages"),
            "registers": found["registers"], "local_bytes": found["local_bytes"], "shared_bytes": shared,
            "programs_per_sm": fit["programs"], "limited_by": fit["limit"], "waves": round(waves, 2),
            "last_wave_full": round(waves - math.floor(waves), 2) if waves % 1 else 1.0, "sass": found["sass"],
            "constants": found["constants"]}


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True, type=Path)
    ap.add_argument("--steps", default=",".join(STEPS), help=f"comma-separated, of {', '.join(STEPS)}")
    ap.add_argument("--kernels", default="", help="comma-separated kernel names (e.g. _gemv_kernel): only those")
    ap.add_argument("--state-dtype", default="float32", choices=STATE_DTYPES,
                    help="the GDN recurrent states' dtype (hgc compile --state-dtype)")
    ap.add_argument("--decode-tiles", default="by_batch", choices=("by_batch", "walk"),
                    help="the GDN decode's tiles (triton_linear[decode_tiles=...]): walk runs decode128's on "
                         "programs walking them")
    ap.add_argument("--compile", help=argparse.SUPPRESS)  # internal: the compiling process's specs file
    args = ap.parse_args(argv)
    global STATE_DTYPE, DECODE_TILES
    STATE_DTYPE, DECODE_TILES = getattr(torch, args.state_dtype), args.decode_tiles
    if args.compile:  # the compiling process: specs in, resources out
        specs = json.loads(Path(args.compile).read_text())
        Path(args.compile + ".out").write_text(json.dumps(compile_all(specs)))
        return {}
    steps = [s for s in args.steps.split(",") if s]
    unknown = sorted(set(steps) - set(STEPS))
    if unknown:
        ap.error(f"--steps: unknown {unknown} (known: {', '.join(STEPS)})")
    names = [k for k in args.kernels.split(",") if k]
    launches = {s: [la for la in step_launches(s) if not names or la.name in names] for s in steps}
    distinct = {}
    for found in launches.values():
        for launch in found:
            distinct.setdefault(_key(launch), launch)
    args.out.mkdir(parents=True, exist_ok=True)
    specs_path = args.out / "kernel_specs.json"
    specs_path.write_text(json.dumps([vars(la) for la in distinct.values()]))
    # the caller's PYTHONPATH after the repo: a Triton put first there (another version's wheel) compiles
    path = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p)
    env = dict(os.environ, TRITON_INTERPRET="0", TRITON_DEFAULT_FP_FUSION="1", PYTHONPATH=path,
               TRITON_CACHE_DIR=str(args.out / "triton_cache"))  # a cache of its own: sm90 kernels, not this machine's
    proc = subprocess.run([sys.executable, str(Path(__file__).resolve()), "--out", str(args.out), "--compile",
                           str(specs_path)], env=env, capture_output=True, text=True, timeout=1800)
    if proc.returncode != 0:
        sys.exit(f"kernel_resources_probe: the sm90 compile failed:\n{proc.stderr[-3000:]}")
    by_key = dict(zip(distinct, json.loads(Path(str(specs_path) + ".out").read_text())))
    import triton  # the recording process's: the compiling one's, by the path above

    doc = {"target": "sm90 (H100 / H200)", "sms": SM90["sms"], "triton": triton.__version__,
           "steps": {s: [describe(la, by_key[_key(la)]) for la in found] for s, found in launches.items()}}
    (args.out / "kernel_resources.json").write_text(json.dumps(doc, indent=2))
    print(f"{'step':10s} {'kernel':30s} {'programs':>8} {'warps':>5} {'regs':>4} {'spill':>5} {'smem KiB':>8} "
          f"{'per SM':>6} {'by':>9} {'waves':>6} {'HGMMA':>5} {'LDGSTS':>6} {'TMA':>3}")
    for step, rows in doc["steps"].items():
        for r in rows:
            print(f"{step:10s} {r['kernel'][:30]:30s} {r['programs']:>8} {r['warps']:>5} {r['registers']:>4} "
                  f"{r['local_bytes']:>5} {r['shared_bytes'] / 1024:>8.1f} {r['programs_per_sm']:>6} "
                  f"{r['limited_by']:>9} {r['waves']:>6} {r['sass']['HGMMA']:>5} {r['sass']['LDGSTS']:>6} "
                  f"{r['sass']['UTMALDG']:>3}")
    return doc


if __name__ == "__main__":
    main()
