"""A layer's input RMSNorm folded into its projection (`hgc build --norm-linear`), on the CPU.

1. The rewrite (compiler/splitops/glue_ops.py `use_norm_linear`) on real traced glue: each tiny
   family compiled for the CPU in bfloat16 (qwen3_next also in float32, where the casts to float32
   are no casts and the residual stream is read from one). It folds every input norm that feeds a
   projection (qwen3_next's unit-offset norms, bailing_linear's plain ones and its MLA q_a norm)
   and leaves the post-attention norms (they feed the MoE op core), the final norm and Kimi's norms
   (another form). Every rewritten segment of the four families' programs gives the bits the
   original gives on random inputs: the ops' CPU kernels are the traced glue's own ops, so the
   rewrite changes no token on the CPU.
2. The kernels (runtime/backends/kernels/norm_gemv.py) in Triton's interpreter against the CPU
   reference at bench qwen3_next's dims: K = 2048, the GDN input projection (N = 12352) and GQA's
   q|k|v (N = 9216) with the launch config of the full N (gemv.config_for), but the weight sliced to
   its first 72 columns (the interpreter takes about 10 ms per program of the one-row config, one
   column each: the full N would take minutes), bf16 and float32, M = 1, 2 and 5: the relative error
   of the norm of the difference, and summed bit for bit (the interpreter's casts to bf16 made to
   round as a GPU's do: testkit `nearest_even_bf16_casts`). Which calls take the GEMV
   (runtime/backends/glue_kernels.py).
3. A CPU Inductor piece holding the op gives the uncompiled piece's values.
4. The build decision: where the GEMV op is missing it is refused; compile_glue's counts (the
   CLI's refusals, bundle.json's field and `hgc inspect`'s column: tests/hgc/test_bundle_choices.py).

tests/runtime/backends/test_pdl.py compiles the kernels for sm90 and checks their waits;
tests/gpu/test_gpu_norm_linear.py runs them on a GPU.
"""

from __future__ import annotations

import contextlib
import operator

import pytest
import torch
import torch.nn.functional as F
from torch.export import Dim

# before triton: testkit/triton_interpreter.py says why
from testkit.triton_interpreter import DEVICE, interpreter_or_fresh_process, nearest_even_bf16_casts  # noqa: E402

triton = pytest.importorskip("triton", reason="triton is not importable here (it ships Linux wheels only)")

from compiler.splitops import is_hgc_op  # noqa: E402
from compiler.splitops.artifact import retarget_meta_devices  # noqa: E402
from compiler.splitops.glue import glue_segments, segment_module  # noqa: E402
from compiler.splitops.glue_ops import (ADD_RMS_NORM_LINEAR, LINEAR_ADD_RMS_NORM, RMS_NORM_LINEAR,  # noqa: E402
                                        SMALL_M_LINEAR, rms_norm_rows, use_norm_linear, use_small_m_linear)
from models.common import RMSNorm  # noqa: E402
from runtime.backends import glue_kernels  # noqa: E402
from runtime.backends.kernels import gemv as G  # noqa: E402
from runtime.backends.kernels import norm_gemv as NG  # noqa: E402
from testkit.helpers import shared_artifact  # noqa: E402
from testkit.linear_cases import rel_err  # noqa: E402
from testkit.traced_glue import assert_same_bits, segment_modules, stand_in_inductor  # noqa: E402

in_process, test_in_a_fresh_interpreter_process = interpreter_or_fresh_process(__file__)

FAMILIES = ("qwen3_next", "qwen3_5", "kimi_linear", "bailing_linear")
NORM_OPS = (ADD_RMS_NORM_LINEAR, RMS_NORM_LINEAR, LINEAR_ADD_RMS_NORM)
TOL = {torch.float32: 1e-5, torch.bfloat16: 1e-2}


# -- 1. the rewrite on traced glue ----------------------------------------------------------------------


def rewritten(module: torch.fx.GraphModule) -> int:
    """The build's order: projections made GEMV calls, then the norms folded into them; how many folded."""
    use_small_m_linear(module)
    return use_norm_linear(module)


def norm_weights(gm: torch.fx.GraphModule) -> dict[str, str]:
    """Each norm weight a program's glue reads -> "folded" (an input of a norm op after the rewrite)
    or "left" (still read by aten): the rewrite run on every segment."""
    found = {}
    for segment, module in segment_modules(gm):
        rewritten(module)
        names = dict(zip([n for n in module.graph.nodes if n.op == "placeholder"], segment.inputs))
        for node, name in names.items():
            if name.endswith("norm_weight"):
                folded = any(u.target in NORM_OPS and norm_weight_of(u) is node for u in node.users)
                found[name] = "folded" if folded else "left"
    return found


def norm_weight_of(call: torch.fx.Node) -> torch.fx.Node:
    """The norm weight argument of a call of one of NORM_OPS."""
    return call.args[3] if call.target is LINEAR_ADD_RMS_NORM else call.args[-4]


def layer_norms(found: dict, kind: str) -> dict[str, str]:
    return {name: how for name, how in found.items() if f"_{kind}_weight" in name}


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_qwen3_next_folds_its_input_and_post_attention_norms(programs, dtype):
    """Every layer's input norm (the first of them on the embedding's output, the draft's on its fc
    output: no add) folds into the projection after it; every post-attention norm (it feeds the MoE
    op) into the output projection before it; the final norms (their input is the MoE op's output,
    and the logits' rows are indexed first): left. In float32 too, where the residual stream is read
    from the norm's cast."""
    main_program, draft = programs("qwen3_next", dtype)["main"], programs("qwen3_next", dtype)["draft"]
    found = norm_weights(main_program)
    inputs = layer_norms(found, "input_layernorm")
    assert len(inputs) == 4 and set(inputs.values()) == {"folded"}, inputs
    post = layer_norms(found, "post_attention_layernorm")
    assert len(post) == 4 and set(post.values()) == {"folded"}, post
    assert found["p_model_norm_weight"] == "left"
    assert {k: v for k, v in norm_weights(draft).items() if v == "folded"} == {
        "p_lm_mtp_layers_0_input_layernorm_weight": "folded",
        "p_lm_mtp_layers_0_post_attention_layernorm_weight": "folded"}


def test_the_sum_and_the_embedding_take_their_two_forms(programs):
    """A layer past the first: add_rms_norm_linear of the residual sum, whose `summed` the segment
    returns as the residual stream; the first layer: rms_norm_linear of the embedding's output."""
    gm = programs("qwen3_next")["main"]
    (_, first), _, (second, layer1) = list(segment_modules(gm))[:3]  # layer 0's input; layer 1's input
    assert rewritten(first) == 1 and rewritten(layer1) == 1
    (call,) = [n for n in first.graph.nodes if n.target in NORM_OPS]
    assert call.target is RMS_NORM_LINEAR and call.args[0].target is torch.ops.aten.embedding.default
    assert call.args[-2:] == (1e-6, True), "qwen3_next's norms: eps 1e-6, unit offset"
    (call,) = [n for n in layer1.graph.nodes if n.target in NORM_OPS]
    assert call.target is ADD_RMS_NORM_LINEAR and second.outputs[0].startswith("add")
    summed = next(u for u in call.users if u.target is operator.getitem and u.args[1] == 1)
    assert layer1.graph.output_node().args[0][0] is summed, "the residual stream the segment returns"
    assert not any(n.target is SMALL_M_LINEAR and n.args[1] is call.args[3] for n in layer1.graph.nodes)
    assert use_norm_linear(layer1) == 0, "a second run finds nothing more"
    assert not is_hgc_op(ADD_RMS_NORM_LINEAR) and not is_hgc_op(RMS_NORM_LINEAR), "glue, not op cores"


def test_the_post_attention_norm_folds_with_the_output_projection(programs):
    """Layer 0's segment between its mixer op and its MoE op: the output projection, the residual add
    and the post-attention norm become one linear_add_rms_norm, whose normed row the segment returns
    for the MoE op and whose summed it returns as the residual stream; no projection, add or norm is
    left, and a second run finds nothing more."""
    gm = programs("qwen3_next")["main"]
    segment, module = list(segment_modules(gm))[1]
    assert rewritten(module) == 1
    (call,) = [n for n in module.graph.nodes if n.target in NORM_OPS]
    assert call.target is LINEAR_ADD_RMS_NORM and call.args[-2:] == (1e-6, True)
    x, weight, residual = call.args[:3]
    assert all(n.op == "placeholder" for n in (weight, residual)), "the weight and the residual come from outside"
    outputs = module.graph.output_node().args[0]
    readers = {u.args[1]: u for u in call.users if u.target is operator.getitem}
    assert set(readers) == {0, 1} and readers[0] in outputs and readers[1] in outputs
    left = {n.target for n in module.graph.nodes}
    assert not left & {SMALL_M_LINEAR, torch.ops.aten.add.Tensor, torch.ops.aten.rsqrt.default}, left
    assert use_norm_linear(module) == 0, "a second run finds nothing more"
    assert not is_hgc_op(LINEAR_ADD_RMS_NORM), "glue, not an op core"


def test_bailing_linear_folds_its_plain_norms_and_kimi_linear_none(programs):
    """bailing_linear's norms are plain weight (no unit offset): every input norm folds, and the MLA
    layer's q_a norm before its q_b projection; Kimi's KimiRMSNorm rounds before it scales (another
    form): nothing folds, every segment stays as it was."""
    found = norm_weights(programs("bailing_linear")["main"])
    assert set(layer_norms(found, "input_layernorm").values()) == {"folded"}
    assert len(layer_norms(found, "input_layernorm")) == 4
    assert set(layer_norms(found, "post_attention_layernorm").values()) == {"folded"}
    assert set(layer_norms(found, "q_a_layernorm").values()) == {"folded"}
    calls = [n for _, m in segment_modules(programs("bailing_linear")["main"]) if rewritten(m)
             for n in m.graph.nodes if n.target in NORM_OPS]
    assert calls and all(n.args[-1] is False for n in calls), "plain weights: no unit offset"
    kimi = programs("kimi_linear")["main"]
    assert sum(rewritten(m) for _, m in segment_modules(kimi)) == 0


@pytest.mark.parametrize("family,dtype", [(f, "bfloat16") for f in FAMILIES] + [("qwen3_next", "float32")])
def test_every_rewritten_segment_gives_the_bits_it_gave(programs, family, dtype):
    """Every glue segment of every program, rewritten as the build does, against itself unrewritten
    on the same random inputs at a token count it was not traced with: every output the same bits
    (the allocations a segment hands its op cores hold nothing to compare)."""
    folded = 0
    for program, gm in programs(family, dtype).items():
        for segment, reference in segment_modules(gm):
            module = segment_module(gm, segment)
            retarget_meta_devices(module.graph, torch.device("cpu"))
            if not rewritten(module):
                continue
            folded += 1
            assert_same_bits(reference, module, segment.index, f"{family} {program} segment {segment.index}")
    assert folded or family == "kimi_linear"


def test_the_reference_is_the_models_rmsnorm():
    """rms_norm_rows (the ops' CPU kernels) and models/common.py RMSNorm: the same bits."""
    for unit_offset in (True, False):
        norm = RMSNorm(64, eps=1e-6, unit_offset=unit_offset).to(torch.bfloat16)
        with torch.no_grad():
            norm.weight.normal_(0, 0.3)
        x = torch.randn(5, 64).bfloat16()
        assert torch.equal(rms_norm_rows(x, norm.weight, 1e-6, unit_offset), norm(x))


# -- 2. the kernels, in the interpreter -----------------------------------------------------------------

K_BENCH, COLUMNS = 2048, 72  # bench qwen3_next's hidden size; the columns of the weight computed here
PROJECTIONS = {"gdn_in_proj": 12352, "gqa_qkv": 9216}  # N of the two input projections


def operands(M: int, N: int, K: int, dtype: torch.dtype, seed: int, add: bool = True):
    g = torch.Generator().manual_seed(seed)
    a = torch.randn(M, K, generator=g).to(dtype)
    b = torch.randn(M, K, generator=g).to(dtype) if add else None
    norm_weight = (torch.randn(K, generator=g) * 0.2).to(dtype)
    weight = (torch.randn(N, K, generator=g) * K ** -0.5).to(dtype)
    return [t.to(DEVICE) if t is not None else None for t in (a, b, norm_weight, weight)]


def reference(a, b, norm_weight, weight, unit_offset: bool):
    """(out, summed) as the traced glue computes them on the CPU."""
    a, b, norm_weight, weight = [t.cpu() if t is not None else None for t in (a, b, norm_weight, weight)]
    summed = a + b if b is not None else a
    return F.linear(rms_norm_rows(summed, norm_weight, 1e-6, unit_offset), weight), summed


@in_process
@pytest.mark.parametrize("M", [1, 2, 5])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("projection", sorted(PROJECTIONS))
def test_the_norm_gemv_at_bench_dims(projection, dtype, M):
    """The GEMV with the norm in its prologue, in the config it launches for the full projection
    (norm_gemv.norm_config_for: its own two-column tile at one row, the plain GEMV's DOT or two-row
    FMA past it) on its first columns."""
    config = NG.norm_config_for(PROJECTIONS[projection], K_BENCH, M)
    assert (config in NG.NORM_CONFIGS.values()) == (M == 1), "bench's input norms have a tile of their own at one row"
    a, b, norm_weight, weight = operands(M, COLUMNS, K_BENCH, dtype, seed=M + len(projection))
    with nearest_even_bf16_casts():
        out, summed = NG.add_rms_norm_gemv(a, b, norm_weight, weight, 1e-6, True, config=config)
    want, want_summed = reference(a, b, norm_weight, weight, True)
    assert out.shape == (M, COLUMNS) and out.dtype == dtype
    err = rel_err(out, want)
    assert err <= TOL[dtype], f"{projection} M={M} {dtype} {config}: rel err {err:.2e}"
    assert torch.equal(summed.cpu(), want_summed)


@in_process
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("case", ["no add", "plain weight", "fma over K in steps", "masked K"])
def test_the_norm_gemv_other_forms(dtype, case):
    """Without b (rms_norm_linear: no summed), a plain norm weight, the FMA path over K in steps (a
    first pass for the statistics), and a K that fills no tile."""
    M, K = 2, {"masked K": 200}.get(case, K_BENCH)
    config = {"fma over K in steps": G.GemvConfig(BLOCK_N=4, BLOCK_K=512),
              "masked K": G.GemvConfig(BLOCK_N=8, BLOCK_K=64)}.get(case, G.config_for(12352, K, M))
    unit_offset = case != "plain weight"
    a, b, norm_weight, weight = operands(M, 37, K, dtype, seed=11, add=case != "no add")
    with nearest_even_bf16_casts():
        out, summed = NG.add_rms_norm_gemv(a, b, norm_weight, weight, 1e-6, unit_offset, config=config)
    want, want_summed = reference(a, b, norm_weight, weight, unit_offset)
    assert rel_err(out, want) <= TOL[dtype], case
    assert summed is None if b is None else torch.equal(summed.cpu(), want_summed)


@in_process
@pytest.mark.parametrize("M", [1, 2, 5, 40])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
def test_the_row_kernel_at_bench_dims(dtype, M):
    """summed and the normed row for any number of rows (40: past the GEMV's), the row read once."""
    a, b, norm_weight, _ = operands(M, 1, K_BENCH, dtype, seed=20 + M)
    with nearest_even_bf16_casts():
        normed, summed = NG.add_rms_norm_rows(a, b, norm_weight, 1e-6, True)
    want_summed = a.cpu() + b.cpu()
    assert torch.equal(summed.cpu(), want_summed)
    err = rel_err(normed, rms_norm_rows(want_summed, norm_weight.cpu(), 1e-6, True))
    assert err <= TOL[dtype] / 10, f"M={M} {dtype}: rel err {err:.2e}"


@in_process
@pytest.mark.parametrize("add", [True, False], ids=["add", "no add"])
def test_the_row_kernel_over_k_in_steps(monkeypatch, add):
    """A row wider than the kernel's widest tile: statistics first, then the normed row tile by tile."""
    monkeypatch.setattr(NG, "ROW_BLOCK_MAX", 512)
    a, b, norm_weight, _ = operands(3, 1, K_BENCH + 40, torch.bfloat16, seed=5, add=add)
    with nearest_even_bf16_casts():
        normed, summed = NG.add_rms_norm_rows(a, b, norm_weight, 1e-6, False)
    want_summed = a.cpu() + b.cpu() if add else a.cpu()
    assert summed is None if not add else torch.equal(summed.cpu(), want_summed)
    assert rel_err(normed, rms_norm_rows(want_summed, norm_weight.cpu(), 1e-6, False)) <= 1e-3


@in_process
@pytest.mark.parametrize("M", [1, 2, 5])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
def test_the_gemv_with_the_norm_in_its_epilogue_at_bench_dims(dtype, M):
    """gemv_add_rms_norm in the config of bench qwen3_next's output projection (N 2048, K 4096:
    one-step FMA at one row, an FMA loop at two, DOT at five) on the first 72 columns: summed and the
    normed row against the CPU reference (relative error of the norm), and the shared counter back
    at zero (the last program to finish normalised the rows)."""
    from runtime.backends.kernels.arrivals import arrival_counters

    K = 2 * K_BENCH
    config = G.config_for(K_BENCH, K, M)
    g = torch.Generator().manual_seed(30 + M)
    x, residual = torch.randn(M, K, generator=g).to(dtype), torch.randn(M, COLUMNS, generator=g).to(dtype)
    norm_weight = (torch.randn(COLUMNS, generator=g) * 0.2).to(dtype)
    weight = (torch.randn(COLUMNS, K, generator=g) * K ** -0.5).to(dtype)
    with nearest_even_bf16_casts():
        normed, summed = NG.gemv_add_rms_norm(*(t.to(DEVICE) for t in (x, weight, residual, norm_weight)), 1e-6,
                                              True, config=config)
    want_summed = residual + F.linear(x, weight)
    assert normed.shape == summed.shape == (M, COLUMNS) and normed.dtype == dtype
    assert rel_err(summed, want_summed) <= TOL[dtype] / 2, f"M={M} {dtype} {config}"
    err = rel_err(normed, rms_norm_rows(want_summed, norm_weight, 1e-6, True))
    assert err <= TOL[dtype], f"M={M} {dtype} {config}: rel err {err:.2e}"
    assert int(arrival_counters(DEVICE, 1, "gemv_add_rms_norm")[0]) == 0


@in_process
def test_the_epilogue_reads_a_wide_row_in_steps():
    """A row wider than the last program's tile (a plain norm weight): the statistics over every step,
    then the normed row step by step."""
    M, N, K = 2, NG.EPILOGUE_BLOCK + 40, 64
    g = torch.Generator().manual_seed(4)
    x, weight = torch.randn(M, K, generator=g), torch.randn(N, K, generator=g) * K ** -0.5
    residual, norm_weight = torch.randn(M, N, generator=g), torch.randn(N, generator=g) * 0.2
    normed, summed = NG.gemv_add_rms_norm(*(t.to(DEVICE) for t in (x, weight, residual, norm_weight)), 1e-6, False,
                                          config=G.GemvConfig(BLOCK_N=512, BLOCK_K=64))
    want_summed = residual + F.linear(x, weight)
    assert rel_err(summed, want_summed) <= 1e-5
    assert rel_err(normed, rms_norm_rows(want_summed, norm_weight, 1e-6, False)) <= 1e-5


N, K = 24, 32  # a shape of our own, put into CONFIGS for 1 and 2 rows


@pytest.fixture
def measured(monkeypatch):
    """CONFIGS with (N, K) at buckets 1 and 2, and the paths norm ops' calls take."""
    monkeypatch.setitem(G.CONFIGS, (N, K, 1), G.GemvConfig(BLOCK_N=4, BLOCK_K=32))
    monkeypatch.setitem(G.CONFIGS, (N, K, 2), G.GemvConfig(BLOCK_N=8, BLOCK_K=16))
    paths = []
    for name in ("add_rms_norm_gemv", "add_rms_norm_rows", "gemv_add_rms_norm"):
        real = getattr(NG, name)
        monkeypatch.setattr(NG, name, lambda *args, real=real, name=name, **kw: paths.append(name) or real(*args, **kw))
    return paths


@in_process
@pytest.mark.parametrize("case", ["measured", "bucket not measured", "past MAX_ROWS", "float32", "strided b",
                                  "torch_only"])
def test_which_calls_take_the_norm_gemv(measured, case):
    """The norm ops' CUDA kernels, called directly (the dispatcher sends CPU tensors to the reference):
    the GEMV where small_m_linear would take it, the row kernel and F.linear for every other call."""
    M = {"bucket not measured": 3, "past MAX_ROWS": G.MAX_ROWS + 1}.get(case, 1)
    a, b, norm_weight, weight = operands(M, N, K, torch.float32 if case == "float32" else torch.bfloat16, seed=1)
    if case == "strided b":
        b = torch.cat([b, b], dim=1)[:, ::2]
    with glue_kernels.torch_only() if case == "torch_only" else contextlib.nullcontext(), nearest_even_bf16_casts():
        out, summed = glue_kernels.add_norm_project(a, b, norm_weight, weight, 1e-6, True)
        alone = glue_kernels.norm_project(a, norm_weight, weight, 1e-6, True)
    gemv, rows = "add_rms_norm_gemv", "add_rms_norm_rows"
    assert measured == ({"measured": [gemv, gemv], "strided b": [rows, gemv]}.get(case) or [rows, rows]), case
    want, want_summed = reference(a, b, norm_weight, weight, True)
    assert rel_err(out, want) <= 1e-2 and torch.equal(summed.cpu(), want_summed)
    assert rel_err(alone, reference(a, None, norm_weight, weight, True)[0]) <= 1e-2
    assert out.is_contiguous() and summed.is_contiguous()


@in_process
@pytest.mark.parametrize("case", ["measured", "bucket not measured", "past MAX_ROWS", "float32", "strided residual",
                                  "torch_only"])
def test_which_calls_take_the_gemv_with_the_norm_in_its_epilogue(measured, case):
    """linear_add_rms_norm's CUDA kernel, called directly: the GEMV with the add and the norm in its
    epilogue where small_m_linear would take the GEMV (and the residual is a row-major [M, N]);
    F.linear and the row kernel for every other call."""
    M = {"bucket not measured": 3, "past MAX_ROWS": G.MAX_ROWS + 1}.get(case, 1)
    dtype = torch.float32 if case == "float32" else torch.bfloat16
    g = torch.Generator().manual_seed(2)
    x, weight = torch.randn(M, K, generator=g).to(dtype), (torch.randn(N, K, generator=g) * K ** -0.5).to(dtype)
    residual, norm_weight = torch.randn(M, N, generator=g).to(dtype), (torch.randn(N, generator=g) * 0.2).to(dtype)
    if case == "strided residual":
        residual = torch.cat([residual, residual], dim=1)[:, ::2]
    with glue_kernels.torch_only() if case == "torch_only" else contextlib.nullcontext(), nearest_even_bf16_casts():
        normed, summed = glue_kernels.linear_add_norm(*(t.to(DEVICE) for t in (x, weight, residual, norm_weight)),
                                                      1e-6, True)
    assert measured == (["gemv_add_rms_norm"] if case == "measured" else ["add_rms_norm_rows"]), case
    want_summed = residual + F.linear(x, weight)
    assert rel_err(summed, want_summed) <= 1e-2
    assert rel_err(normed, rms_norm_rows(want_summed, norm_weight, 1e-6, True)) <= 1e-2
    assert normed.is_contiguous() and summed.is_contiguous()


def test_register_installs_the_norm_ops_cuda_kernels():
    has = torch._C._dispatch_has_kernel_for_dispatch_key
    glue_kernels.register()
    assert all(has(f"hgc_glue::{op}", "CUDA") for op in ("small_m_linear", "add_rms_norm_linear", "rms_norm_linear",
                                                        "linear_add_rms_norm"))
    a, b, w, nw = torch.randn(2, 8), torch.randn(2, 8), torch.randn(3, 8), torch.randn(8)
    out, summed = ADD_RMS_NORM_LINEAR(a, b, nw, w, 1e-6, False)  # the CPU keeps the reference
    torch.testing.assert_close(out, F.linear(rms_norm_rows(a + b, nw, 1e-6, False), w), rtol=0, atol=0)


# -- 3. a CPU Inductor piece holding the op -------------------------------------------------------------


class Layer(torch.nn.Module):
    """A layer's start as the families trace it: the residual sum, its input norm, a projection."""

    def __init__(self):
        super().__init__()
        self.norm = RMSNorm(32, eps=1e-6, unit_offset=True)
        self.proj = torch.nn.Linear(32, 48, bias=False)
        with torch.no_grad():
            self.norm.weight.normal_(0, 0.3)

    def forward(self, residual, update):  # [T, 32] each
        h = residual + update
        return h, torch.sigmoid(self.proj(self.norm(h)))


@pytest.mark.slow  # one Inductor C++ compile: about 10 s on 2 cores
def test_a_piece_with_the_op_compiles_with_inductor_and_gives_the_uncompiled_values(tmp_path, one_thread):
    from compiler.inductor_pieces import compile_piece
    from compiler.splitops.bundle import cache_env

    torch.manual_seed(0)
    model = Layer()
    T = Dim("T", min=1, max=64)
    example = (torch.randn(5, 32), torch.randn(5, 32))
    gm = torch.export.export(model, example, dynamic_shapes=({0: T}, {0: T})).graph_module
    (segment,) = glue_segments(gm)
    reference_module, module = segment_module(gm, segment), segment_module(gm, segment)
    assert rewritten(module) == 1
    with cache_env({"inductor": tmp_path / "inductor"}):
        piece = compile_piece(module, torch.device("cpu"))
    params = {"p_norm_weight": model.norm.weight.detach(), "p_proj_weight": model.proj.weight.detach()}
    for rows in (1, 7):  # neither is the traced count (5)
        given = {**params, "residual": torch.randn(rows, 32), "update": torch.randn(rows, 32)}
        inputs = [given[name] for name in segment.inputs]
        got, want = piece(*inputs), reference_module(*inputs)
        assert len(got) == len(want) == 2
        for g, w in zip(got, want):
            assert g.shape == w.shape and g.dtype == w.dtype
            torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-5)


# -- 4. the build decision ------------------------------------------------------------------------------


def test_norm_linear_needs_the_gemv_projections():
    """Refused where the GEMV op is not used: a batch-invariant artifact, a compile that builds no bundle."""
    import argparse

    from hgc.build_command import BundleChoices, norm_linear_refusal
    from hgc.compile_commands import _choices_refusal

    assert norm_linear_refusal("cuda") is None
    assert "batch-invariant" in norm_linear_refusal("cuda", batch_invariant=True)
    args = argparse.Namespace(target="cuda", batch_invariant=False, inductor=False, plan_only=False)
    why = _choices_refusal(args, False, BundleChoices(norm_linear=True))
    assert why.startswith("--norm-linear: it is a choice of the target bundle, and this compile builds none "
                          "(--no-inductor"), why
    assert _choices_refusal(args, True, BundleChoices(norm_linear=True)) is None


def test_compile_glue_counts_the_folded_norms_per_piece(tmp_path_factory, tmp_path, monkeypatch):
    """compile_glue(small_m=True, norm_linear=True) folds before the key is taken and it compiles
    (Inductor stood in for); per forward, qwen3_next's four input and four post-attention norms and
    the draft's one of each. Without the GEMV op it refuses."""
    import compiler.inductor_pieces as inductor_pieces
    from runtime.artifact.docs import read_artifact
    from runtime.artifact.loader import load_programs

    docs = read_artifact(shared_artifact(tmp_path_factory, "qwen3_next")[1])
    gms = {p: ep.graph_module for p, ep in load_programs(docs).items()}
    compiled = stand_in_inductor(monkeypatch, lambda module: sum(n.target in NORM_OPS for n in module.graph.nodes))
    records, pieces = inductor_pieces.compile_glue(gms, docs.split_plans, "cpu", tmp_path, tmp_path / "cache",
                                                   small_m=True, norm_linear=True)
    assert sorted(p["norm_linear"] for p in pieces.values()) == sorted(compiled)
    per_forward = {p: sum(pieces[r["piece"]]["norm_linear"] for r in records[p] if r["piece"]) for p in gms}
    assert per_forward == {"main": 8, "draft": 2}
    with pytest.raises(ValueError, match="needs small_m"):
        inductor_pieces.compile_glue(gms, docs.split_plans, "cpu", tmp_path, tmp_path / "cache", norm_linear=True)
