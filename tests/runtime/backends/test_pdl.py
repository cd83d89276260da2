"""Programmatic dependent launch (runtime/backends/kernels/pdl.py) without a GPU.

1. Every decode kernel that takes PDL, compiled for sm90 with USE_GDC True and launch_pdl: its PTX
   holds `griddepcontrol.wait` and `griddepcontrol.launch_dependents`, no path from its entry
   writes before a wait, and none reads before one except in the kernels that may stream weights
   ahead of it (PREFETCH: the one-step GEMVs, the plain one and the two with a norm folded in, and
   the router's GEMV in its two launches and in one: their weight loads come first, the rows after
   the wait). With USE_GDC
   False the kernel's Triton IR holds neither operation (the PTX instructions are made from them
   only), so no instruction of either kind can appear. The signatures come from the real launch
   sites (testkit/sm90.py: each is run once under Triton's interpreter with the kernel's run
   recorded, not executed, and compiled with the specialisation a GPU launch gives its arguments)
   at bench qwen3_next's dims (hidden 2048, attention head dim 256, GDN heads 16 / 32 of 128, 16
   experts of 512 and a gated shared expert). The compiles run in two processes of their own outside
   the interpreter (TRITON_INTERPRET is read when triton is imported): Triton needs no GPU to emit
   PTX, and the last stage, ptxas's cubin, is left out (it checks nothing asked here).
2. `launch_options` / `launch_args`: nothing on the CPU, under the interpreter or with the switch off.
3. The build decision: bundle.json's `pdl` and Inductor settings follow the flag (at the function
   level: a cuda build needs a GPU); tests/hgc/test_bundle_choices.py checks its refusals.

tests/gpu/test_gpu_pdl.py checks on a GPU that a captured chain gives the same bits with PDL on and off.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from testkit.sm90 import Launch, compile_sm90, record, specialisation

ROOT = Path(__file__).resolve().parents[3]
D, I, E, TOP_K = 2048, 512, 16, 4  # bench qwen3_next's MoE: hidden, expert width, experts, top-k
HQ, HKV, HEAD = 16, 2, 256  # its attention
HK, HV, DK, DV, KW = 16, 32, 128, 128, 4  # its GDN layers
PAGE = 16

# Kernels whose programs may read weights before the wait (pdl.py's rule): the GEMVs.
PREFETCH = {"gemv one step", "norm gemv one step", "norm epilogue one step", "moe._logits_gemv_kernel",
            "moe router one launch", "moe router one launch sorted"}
WRITES = ("st.global", "atom.", "red.", "cp.reduce.async", "st.async")
READS = ("ld.global", "cp.async")
WAIT, LAUNCH = "griddepcontrol.wait", "griddepcontrol.launch_dependents"
IR_OPS = ("tt.grid_dependency_wait", "tt.grid_dependency_launch_dependents")  # what Triton's IR calls them


# -- the launches, recorded under the interpreter (testkit/sm90.py) -----------------------------------------


def _bf16(*shape):
    return torch.empty(*shape, dtype=torch.bfloat16)


def _f32(*shape):
    return torch.empty(*shape, dtype=torch.float32)


def gemv_launches() -> dict[str, Launch]:
    """The GEMV's three paths at bench qwen3_next's projections (gemv.py CONFIGS): one row of the GDN
    input projection (FMA in one step), two rows of it (DOT) and two of the output projection (FMA
    over K in steps)."""
    from runtime.backends.kernels.gemv import small_m_linear

    cases = {"gemv one step": (1, 12352, 2048), "gemv dot": (2, 12352, 2048), "gemv fma loop": (2, 2048, 4096)}
    out = {}
    for case, (m, n, k) in cases.items():
        (out[case],) = record(lambda: small_m_linear(_bf16(m, k), _bf16(n, k)))
    return out


def norm_gemv_launches() -> dict[str, Launch]:
    """The norms folded into the GEMVs (norm_gemv.py): the input norm in the prologue on the GEMV's
    three paths as `gemv_launches` takes them (the one-row and two-row GDN input projection; an FMA
    loop over K 4096), the row kernel reading a row of 2048 once and one of 16384 in steps, and the
    post-attention norm in the output projection's epilogue (2048 x 4096) at one row (one-step
    FMA), two (FMA loop) and five (DOT)."""
    from runtime.backends.kernels.norm_gemv import (ROW_BLOCK_MAX, add_rms_norm_gemv, add_rms_norm_rows,
                                                    gemv_add_rms_norm)

    gemvs = {"norm gemv one step": (1, 12352, 2048), "norm gemv dot": (2, 12352, 2048),
             "norm gemv fma loop": (2, 2048, 4096)}
    out = {}
    for case, (m, n, k) in gemvs.items():
        (out[case],) = record(lambda: add_rms_norm_gemv(_bf16(m, k), _bf16(m, k), _bf16(k), _bf16(n, k), 1e-6, True))
    for case, k in {"norm rows": D, "norm rows loop": 2 * ROW_BLOCK_MAX}.items():
        (out[case],) = record(lambda: add_rms_norm_rows(_bf16(64, k), _bf16(64, k), _bf16(k), 1e-6, True))
    for case, m in {"norm epilogue one step": 1, "norm epilogue fma loop": 2, "norm epilogue dot": 5}.items():
        (out[case],) = record(lambda: gemv_add_rms_norm(_bf16(m, 2 * D), _bf16(D, 2 * D), _bf16(m, D), _bf16(D), 1e-6,
                                                        True))
    return out


def moe_launches() -> list[Launch]:
    """A decode step's MoE launches at batch 1 (the token path), 32 (routing and sort in one launch),
    128 (routing, then the sort in scanned blocks), 256 (the tiled router GEMM) and 1024 (the sort
    counted in blocks first), a split down's combine (down=split; its GEMMs are torch's), and a
    batch-1 step's experts in one launch (router in_experts, experts one_launch)."""
    from runtime.backends.kernels.moe import fused_moe
    from runtime.backends.kernels.moe_config import default_config

    router, w13, w2 = _bf16(E, D), _bf16(E, 2 * I, D), _bf16(E, D, I)
    shared = (_bf16(2 * I, D), _bf16(D, I), _bf16(1, D))  # a gated shared expert as wide as a routed one

    def step(T: int, split_down: bool = False, experts_one_launch: bool = False):
        fused_moe(_bf16(T, D), router, None, w13, w2, *shared, _bf16(T, D), TOP_K, "softmax", True, 1.0, 1, 1,
                  default_config(T, E, I, D, TOP_K), split_down=split_down, route_in_experts=experts_one_launch,
                  experts_one_launch=experts_one_launch)

    return record(lambda: [step(T) for T in (1, 32, 128, 256, 1024)] + [step(32, split_down=True),
                                                                         step(1, experts_one_launch=True)])


def router_launches() -> dict[str, Launch]:
    """The one-launch router at batch 1 (the GEMV's last program routes: the token path), 32 (it sorts
    too) and 256 (the GEMM's programs route their rows), and the split router at 256 (router=split)."""
    from runtime.backends.kernels.moe import route, route_sort

    router, gate = _bf16(E, D), _bf16(1, D)
    args = (router, None, TOP_K, "softmax", True, 1.0, 1, 1)
    (token,) = record(lambda: route(_bf16(1, D), *args, n_shared=1, shared_gate=gate, one_launch=True))
    (sort,) = record(lambda: route_sort(_bf16(32, D), *args, 16, n_shared=1, shared_gate=gate, one_launch=True))
    (dot,) = record(lambda: route(_bf16(256, D), *args, n_shared=1, shared_gate=gate, one_launch=True))
    (split,) = record(lambda: route(_bf16(256, D), *args, n_shared=1, shared_gate=gate, logits_kernel="split"))
    return {"moe router one launch": token, "moe router one launch sorted": sort, "moe router one launch dot": dot,
            "moe router split": split}


def gdn_launches() -> list[Launch]:
    """A GDN layer's decode launches: the split (batch 1) in two launches and in one, the one launch,
    the four launches of the unfused kernels (a decode step of 8), and the recurrence walking its
    tiles (decode_tiles=walk)."""
    from runtime.backends.kernels import gdn_fused as GF
    from runtime.backends.kernels import linear as L

    C = 2 * HK * DK + HV * DV
    conv_w, A_log, dt_bias, norm_w = _bf16(C, KW), _f32(HV), _f32(HV), _bf16(DV)
    conv_state, state = _f32(4, C, KW - 1), _f32(4, HV, DK, DV)

    def fused(B: int, launches: int, merged: bool = False):
        GF.gdn_fused_decode(_bf16(B, C), _bf16(B, HV, DV), _bf16(B, HV), _bf16(B, HV), conv_w, A_log, dt_bias,
                            norm_w, _bf16(B, HV, DV), conv_state, state, torch.zeros(B, dtype=torch.int64), HK,
                            DK ** -0.5, 1e-6, launches=launches, merged_split=merged)

    def unfused(B: int, config=None):
        slots = torch.zeros(B, dtype=torch.int64)
        mixed = _bf16(B, C)
        L.short_conv_decode(_bf16(B, C), conv_w, None, mixed, conv_state, slots, True)
        dims = GF.GdnDims(HK, HV, DK, DV, C, KW)
        q, k, v, g, beta = GF.qk_gates(mixed, _bf16(B, HV), _bf16(B, HV), A_log, dt_bias, dims)
        core = _bf16(B, HV, DV)
        L.gdn_decode(q, k, v, g, beta, core, state, slots, DK ** -0.5, config)
        GF.gated_rmsnorm(core, _bf16(B, HV, DV), norm_w, _bf16(B, HV, DV), 1e-6, slots=slots, rows_per_slot=1)

    walk = L.RecurrentConfig(64, 4, walk=L.WALK_PER_SM, stages=L.WALK_STAGES)
    return record(lambda: (fused(1, 2), fused(1, 2, merged=True), fused(1, 1), unfused(8), unfused(8, walk)))


def attention_launches() -> list[Launch]:
    """A GQA layer's decode launches at batch 1: the K/V rows stored, the split pass and its combine."""
    from runtime.backends.flashinfer_attention import store_kv_rows
    from runtime.backends.kernels.gqa import triton_gqa_attention

    k_cache, v_cache = _bf16(64, PAGE, HKV, HEAD), _bf16(64, PAGE, HKV, HEAD)

    def step():
        store_kv_rows(torch.zeros(1, dtype=torch.int64), PAGE, (_bf16(1, HKV, HEAD), k_cache),
                      (_bf16(1, HKV, HEAD), v_cache))
        triton_gqa_attention(_bf16(1, HQ, HEAD), k_cache, v_cache, torch.zeros(1, 32, dtype=torch.int32),
                             torch.full((1,), 300, dtype=torch.int32), 1, _bf16(1, HQ, HEAD), HEAD ** -0.5)

    return record(step)


def mla_launches() -> list[Launch]:
    """An MLA layer's decode launch at batch 1 from the page table (kimi_linear's and bailing_linear's
    full layers: a latent of 512 and a rope part of 64); its combine is split_kv's, as GQA's."""
    from runtime.backends.kernels.mla import triton_mla_attention_paged

    R, P, H = 512, 64, 16
    cache = _bf16(64, PAGE, R + P)

    def step():
        triton_mla_attention_paged(_bf16(1, H, R), _bf16(1, H, P), cache[..., :R], cache[..., R:],
                                   torch.zeros(1, 32, dtype=torch.int32), torch.full((1,), 300, dtype=torch.int32), 1,
                                   _bf16(1, H, R), (R + P) ** -0.5)

    return record(step)


def label(launch: Launch) -> str:
    """A kernel's name in these tests: its module's last name and its own (two modules have a _combine_kernel)."""
    return f"{launch.module.rsplit('.', 1)[-1]}.{launch.name}"


# The kernels that take PDL (each launched with USE_GDC), by label.
KERNELS = {"gemv one step", "gemv dot", "gemv fma loop", "moe router one launch", "moe router one launch sorted",
           "moe gate-up shared by token",
           "moe router one launch dot", "moe router split",
           "norm gemv one step", "norm gemv dot", "norm gemv fma loop", "norm rows", "norm rows loop",
           "norm epilogue one step", "norm epilogue fma loop", "norm epilogue dot",
           *(f"moe.{k}" for k in ("_logits_gemv_kernel", "_logits_kernel", "_route_kernel", "_route_sort_kernel",
                                  "_align_count_kernel", "_align_kernel", "_gate_up_sorted_kernel",
                                  "_down_sorted_kernel", "_combine_kernel", "_split_maps_kernel",
                                  "_combine_split_kernel", "_gate_up_token_kernel",
                                  "_down_token_kernel", "_experts_token_kernel")),
           *(f"gdn_fused.{k}" for k in ("_split_prep_kernel", "_split_core_kernel", "_split_one_kernel",
                                        "_gdn_fused_decode_kernel",
                                        "_qk_gates_kernel", "_gated_rmsnorm_kernel")),
           "linear._recurrent_decode_kernel", "linear._recurrent_walk_kernel", "linear._short_conv_decode_kernel",
           "gqa._gqa_split_kernel", "split_kv._combine_kernel", "flashinfer_attention._store_rows_kernel",
           "mla._mla_split_kernel"}


@pytest.fixture(scope="module")
def launches() -> dict[str, Launch]:
    """One recorded launch of each kernel (its first), by label; the split down's gate-up (its shared
    rows stored by token) under a label of its own."""
    pytest.importorskip("triton")
    by_label = {**gemv_launches(), **norm_gemv_launches(), **router_launches()}
    for launch in moe_launches() + gdn_launches() + attention_launches() + mla_launches():
        by_label.setdefault(label(launch), launch)
        if launch.args.get("SHARED_TOKENS"):
            by_label.setdefault("moe gate-up shared by token", launch)
    return by_label


# -- compiled for sm90, in a process outside the interpreter -------------------------------------------


def compile_ptx(specs: dict) -> dict:
    """label -> {"on": the PTX with USE_GDC and launch_pdl, "off": the Triton IR without}, for sm90.
    Outside the interpreter only (`_compile_main`)."""
    import importlib

    import triton
    from triton._C.libtriton import ir
    from triton.backends.compiler import GPUTarget
    from triton.compiler.compiler import make_backend

    target = GPUTarget("cuda", 90, 32)
    backend = make_backend(target)
    out = {}
    for name, spec in specs.items():
        launch = Launch(**spec)
        launch.options = {**launch.options, "launch_pdl": True}
        on = compile_sm90(launch, cubin=False, USE_GDC=True).asm["ptx"]
        # USE_GDC False: the IR straight from the kernel's source, before any pass
        kernel = getattr(importlib.import_module(launch.module), launch.name)
        src = triton.compiler.ASTSource(kernel, *specialisation(kernel, {**launch.args, "USE_GDC": False}))
        parsed = backend.parse_options({k: v for k, v in spec["options"].items() if k != "launch_pdl"})
        context = ir.context()
        ir.load_dialects(context)
        backend.load_dialects(context)
        off = src.make_ir(target, parsed, backend.get_codegen_implementation(parsed), backend.get_module_map(), context)
        out[name] = {"on": on, "off": str(off)}
    return out


def _compile_main(spec_path: str, out_path: str) -> None:
    Path(out_path).write_text(json.dumps(compile_ptx(json.loads(Path(spec_path).read_text()))))


@pytest.fixture(scope="module")
def ptx(launches, tmp_path_factory) -> dict:
    """compile_ptx of every kernel, in two processes (half the kernels each) at once."""
    work = tmp_path_factory.mktemp("pdl_ptx")
    names = sorted(KERNELS)
    # a cache of its own: the compiles must not land in (or come from) the suite's Triton cache
    env = dict(os.environ, TRITON_INTERPRET="0", TRITON_CACHE_DIR=str(work / "cache"), PYTHONPATH=str(ROOT))
    procs = []
    for half in range(2):
        specs, result, log = work / f"specs{half}.json", work / f"ptx{half}.json", work / f"log{half}.txt"
        specs.write_text(json.dumps({name: dataclasses.asdict(launches[name]) for name in names[half::2]}))
        script = (f"from tests.runtime.backends.test_pdl import _compile_main; "
                  f"_compile_main({str(specs)!r}, {str(result)!r})")
        with open(log, "w") as sink:
            procs.append((subprocess.Popen([sys.executable, "-c", script], env=env, cwd=ROOT, stdout=sink,
                                           stderr=subprocess.STDOUT), result, log))
    out = {}
    for proc, result, log in procs:
        assert proc.wait(timeout=600) == 0, log.read_text()[-3000:]
        out.update(json.loads(result.read_text()))
    return out


_GUARD = re.compile(r"^(@!?%\w+)\s+")  # an instruction's guard predicate: `@%p1 ld.global...`
_LABEL = re.compile(r"^(\$[\w$]+):")


@dataclasses.dataclass
class Block:
    """A basic block of a PTX function: its instructions (guards dropped) and the labels it may go to."""

    label: str | None
    lines: list[str] = dataclasses.field(default_factory=list)
    targets: list[str] = dataclasses.field(default_factory=list)
    falls_through: bool = True


def blocks(ptx: str) -> list[Block]:
    """The PTX's basic blocks in text order: one starts at each label and after each branch or return."""
    found = [Block(None)]
    for raw in ptx.splitlines():
        line = raw.strip()
        if not line or line.startswith("//"):
            continue
        label = _LABEL.match(line)
        if label:
            found.append(Block(label.group(1)))
            continue
        guard = _GUARD.match(line)
        instruction = line[guard.end():] if guard else line
        block = found[-1]
        block.lines.append(instruction)
        if instruction.startswith(("bra", "ret", "exit")):
            if instruction.startswith("bra"):
                block.targets.append(instruction.split()[-1].rstrip(";"))
            block.falls_through = guard is not None  # a guarded branch may not be taken
            found.append(Block(None))
    return found


def accesses(ptx: str) -> list[tuple[str, bool]]:
    """Every global memory access of the kernel, with whether every path from its entry to it passes a
    griddepcontrol.wait (a must-analysis over the basic blocks: a wait on one branch only does not count)."""
    found = blocks(ptx)
    preds: dict[int, list[int]] = {i: [] for i in range(len(found))}
    at = {b.label: i for i, b in enumerate(found) if b.label}
    for i, b in enumerate(found):
        for target in b.targets:
            preds[at[target]].append(i)
        if b.falls_through and i + 1 < len(found):
            preds[i + 1].append(i)
    waits = [any(line.startswith(WAIT) for line in b.lines) for b in found]
    waited_out = [True] * len(found)  # the must-analysis starts from "waited" and only takes it away
    changed = True
    while changed:
        changed = False
        for i in range(len(found)):
            waited_in = False if i == 0 else all(waited_out[p] for p in preds[i])
            out = waited_in or waits[i]
            if out != waited_out[i]:
                waited_out[i], changed = out, True
    result = []
    for i, b in enumerate(found):
        waited = False if i == 0 else all(waited_out[p] for p in preds[i])
        for line in b.lines:
            waited = waited or line.startswith(WAIT)
            if line.startswith(READS + WRITES):
                result.append((line, waited))
    return result


def test_every_decode_kernel_was_launched_as_a_gpu_launches_it(launches):
    assert KERNELS <= set(launches), sorted(KERNELS - set(launches))
    for name in KERNELS:
        assert launches[name].args["USE_GDC"] is False, f"{name}: PDL is off on the CPU"
    for dot in ("gemv dot", "norm gemv dot"):
        assert launches[dot].args["UPCAST"] is False and launches[dot].args["PRECISION"] == "tf32"
    assert launches["norm rows loop"].args["ONE_STEP"] is False and launches["norm rows"].args["ONE_STEP"] is True
    assert launches["moe._down_sorted_kernel"].args["DOT_FP32"] is False, "bf16 tensor-core dots, as on the GPU"


def problems_of(name: str, compiled: dict) -> list[str]:
    """What breaks pdl.py's rule in one kernel's compiles (compile_ptx's "on" and "off")."""
    on, off = compiled["on"], compiled["off"]
    found = []
    if WAIT not in on or LAUNCH not in on:
        found.append("no griddepcontrol with USE_GDC")
    if "tt.func" not in off or any(op in off for op in IR_OPS):
        found.append("grid dependency operations without USE_GDC")
    early = [line for line, waited in accesses(on) if not waited]
    writes = [line for line in early if line.startswith(WRITES)]
    if writes:
        found.append(f"writes a path reaches before any wait: {writes[:2]}")
    reads = [line for line in early if line.startswith(READS)]
    if reads and name not in PREFETCH:
        found.append(f"reads a path reaches before any wait: {reads[:2]}")
    return [f"{name}: {problem}" for problem in found]


def test_every_pdl_kernel_waits_before_it_touches_the_step(ptx):
    """One test over every kernel: their compiles are one fixture, made once whichever worker runs it."""
    assert set(ptx) == KERNELS
    problems = [problem for name in sorted(ptx) for problem in problems_of(name, ptx[name])]
    assert not problems, "\n".join(problems)
    # the one-step GEMVs stream their weight tiles before the wait, and read the rows after it
    for name in ("gemv one step", "norm gemv one step"):
        reads = [waited for line, waited in accesses(ptx[name]["on"]) if line.startswith("ld.global")]
        assert False in reads and True in reads, f"{name}: the weights before the wait, the rows after it"


def test_the_access_check_follows_branches():
    """A wait on one branch does not cover the access after the branches meet."""
    ptx = """
        ld.param.b64 %rd1, [k_param_0];
        @%p1 bra $L__BB0_2;
        griddepcontrol.wait ;
    $L__BB0_2:
        @%p2 st.global.b32 [ %rd1 + 0 ], { %r1 };
        griddepcontrol.wait ;
        ld.global.b32 { %r2 }, [ %rd1 + 0 ];
        ret;
    """
    assert accesses(ptx) == [("st.global.b32 [ %rd1 + 0 ], { %r1 };", False),
                             ("ld.global.b32 { %r2 }, [ %rd1 + 0 ];", True)]


# -- the switch -----------------------------------------------------------------------------------------


@pytest.fixture
def pdl_switch():
    pytest.importorskip("triton")
    from runtime.backends.kernels import pdl

    before = pdl.enabled()
    yield pdl
    pdl.enable(before)


def test_launch_options_are_empty_unless_a_hopper_gpu_runs_compiled_kernels(pdl_switch, monkeypatch):
    pdl = pdl_switch
    assert not pdl.enabled(), "off by default"
    assert pdl.launch_options("cpu") == {} and pdl.launch_args("cpu") == {"USE_GDC": False}
    pdl.enable(True)
    assert pdl.launch_options("cpu") == {}, "the CPU launches nothing with PDL"
    monkeypatch.setitem(pdl._capable, 0, True)  # as a Hopper GPU at index 0 would answer
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert pdl.launch_options("cuda:0") == {}, "the interpreter launches nothing with PDL"
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    assert pdl.launch_options("cuda:0") == {"launch_pdl": True}
    assert pdl.launch_args("cuda:0") == {"USE_GDC": True, "launch_pdl": True}
    monkeypatch.setitem(pdl._capable, 0, False)  # an Ampere GPU
    assert pdl.launch_options("cuda:0") == {}
    pdl.enable(False)
    monkeypatch.setitem(pdl._capable, 0, True)
    assert pdl.launch_options("cuda:0") == {} and pdl.launch_args("cuda:0") == {"USE_GDC": False}


def test_the_launch_cache_passes_the_pdl_option_through_and_keys_on_it():
    """launch_cache.Launcher: launch_pdl reaches Triton's path unchanged and makes another key; a
    repeated launch runs the compiled kernel (launch_pdl is in its metadata) with USE_GDC in order."""
    import inspect
    import types

    from runtime.backends.kernels.launch_cache import Launcher

    slow, fast = [], []
    compiled = types.SimpleNamespace(function="f", packed_metadata="m", run=lambda *a: fast.append(a[9:]))

    class Kernel:
        params = [types.SimpleNamespace(name=n, default=inspect.Parameter.empty) for n in ("x", "USE_GDC")]

        def __getitem__(self, grid):
            return lambda *args, **kwargs: slow.append(kwargs) or compiled

    class Here(Launcher):
        _device = staticmethod(lambda: 0)
        _stream = staticmethod(lambda device: "stream")

    launch, x = Here(Kernel()), torch.zeros(4)
    launch._hooks = types.SimpleNamespace(launch_enter_hook=None, launch_exit_hook=None)
    for _ in range(2):
        launch[(1,)](x, USE_GDC=True, launch_pdl=True)
        launch[(1,)](x, USE_GDC=False)
    assert slow == [{"USE_GDC": True, "launch_pdl": True}, {"USE_GDC": False}] and launch.misses == 2
    assert launch.hits == 2 and fast == [(x, True), (x, False)]


# -- the build decision ---------------------------------------------------------------------------------


def test_bundle_json_and_the_inductor_settings_follow_the_flag():
    from compiler.splitops.bundle import (INDUCTOR_CONFIG, INDUCTOR_PDL, bundle_doc, bundle_pdl, inductor_config,
                                          inductor_has_pdl, parse_bundle_doc)
    from compiler.splitops.artifact import ArtifactFormatError
    from hgc.compile_commands import pdl_column

    assert inductor_has_pdl(), "the torch of this machine has Inductor's PDL setting"
    assert inductor_config("cuda") == INDUCTOR_CONFIG["cuda"] and inductor_config("cpu", True) == INDUCTOR_CONFIG["cpu"]
    assert inductor_config("cuda", True) == {**INDUCTOR_CONFIG["cuda"], INDUCTOR_PDL: True}
    facts = {"device": "cuda", "torch": torch.__version__}
    docs = {pdl: bundle_doc("sm90-x", facts, {}, {}, {}, {}, 1.0, "0", pdl=pdl) for pdl in (False, True)}
    for pdl, doc in docs.items():
        assert doc["pdl"] is pdl and bundle_pdl(doc) is pdl and pdl_column(doc) == ("on" if pdl else "off")
        assert doc["inductor_config"] == inductor_config("cuda", pdl)
        parse_bundle_doc(doc, "bundle.json")
    older = {k: v for k, v in docs[False].items() if k != "pdl"}
    assert bundle_pdl(older) is False and pdl_column(older) == "off", "a bundle from before the field: no PDL"
    with pytest.raises(ArtifactFormatError, match="field 'pdl' must be true or false"):
        parse_bundle_doc({**docs[True], "pdl": "yes"}, "bundle.json")


def test_the_loader_switches_pdl_as_a_cuda_bundle_says_and_loads_with_its_settings(pdl_switch, monkeypatch,
                                                                                      tmp_path):
    """runtime/artifact/bundle.py: a cuda bundle built with --pdl turns the switch on before its
    pieces load (and start-up captures), one without turns it off; its pieces load with the Inductor
    settings bundle.json says they were built with."""
    from torch._inductor import config

    from compiler.splitops.bundle import INDUCTOR_PDL, bundle_doc
    from runtime.artifact import bundle as loader
    from runtime.backends import glue_kernels

    monkeypatch.setattr(glue_kernels, "register", lambda: None)  # no CUDA op library on this machine
    seen = []
    monkeypatch.setattr(loader, "check_hash", lambda *a: None)
    monkeypatch.setattr("torch._inductor.CompiledArtifact.load",
                        lambda path, format: seen.append((pdl_switch.enabled(), getattr(config.triton, "enable_pdl"))))
    (tmp_path / "pieces").mkdir()
    (tmp_path / "pieces" / "a.bin").write_bytes(b"")
    for pdl in (True, False):
        doc = bundle_doc("sm90-x", {"device": "cuda"}, {"main": [{"piece": "pieces/a.bin"}]}, {}, {"pieces/a.bin": {}},
                         {"pieces/a.bin": "0"}, 1.0, "0", pdl=pdl)
        assert list(loader._load_pieces(tmp_path, doc)) == ["pieces/a.bin"]
        assert seen[-1] == (pdl, pdl), f"pdl={pdl}: switch and Inductor's {INDUCTOR_PDL} as the bundle says"
