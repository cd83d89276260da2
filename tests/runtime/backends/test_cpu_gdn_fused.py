"""The CPU reference's gdn_fused against the unfused region (short_conv, glue, gdn_core, gated norm)
it stands for: outputs, conv and recurrent states, and a verify step's intermediate states, bit for
bit in float32, over extend, mixed, decode and target_verify steps of several requests."""

from __future__ import annotations

import torch

from compiler.splitops import LayerKind, LayerRegistry, LayerSpec, Mode, TensorSpec
from compiler.splitops.gdn_mixer import gated_rms_norm, gdn_mixer_region
from runtime.backends.cpu_reference import CPUReferenceBackend
from runtime.cache.batch import SeqState, build_step, commit_step
from runtime.cache.kv_pool import KVPool
from runtime.cache.state_pool import StatePool
from runtime.step.bound_ops import BoundOps

HK, DK, HV, DV, K = 2, 8, 4, 8, 4
C = 2 * HK * DK + HV * DV
LAYER, EPS, SCALE, DRAFT = 0, 1e-6, DK ** -0.5, 2
REGISTRY = LayerRegistry([LayerSpec(LAYER, LayerKind.GDN, state={"recurrent": TensorSpec((HV, DK, DV), "float32"),
                                                                 "conv": TensorSpec((C, K - 1), "float32")})])


def _weights(g):
    return {"conv_weight": torch.randn(C, K, generator=g) * 0.5, "A_log": torch.rand(HV, generator=g).log(),
            "dt_bias": torch.randn(HV, generator=g), "norm_weight": 1 + 0.1 * torch.randn(DV, generator=g)}


def _inputs(g, T):
    """qkv, z, b, a as one projection's slices, as a model hands them over (b and a strided)."""
    proj = torch.randn(T, C + HV * DV + 2 * HV, generator=g)
    qkv, z, b, a = proj.split([C, HV * DV, HV, HV], dim=-1)
    return qkv, z.view(T, HV, DV), b, a


def _unfused(ops, qkv, z, b, a, w, out):
    out.copy_(gdn_mixer_region(ops, qkv, z, b, a, w["conv_weight"], w["A_log"], w["dt_bias"],
                               lambda x, gate: gated_rms_norm(x, gate, w["norm_weight"], EPS), LAYER, HK, DK, SCALE))


def _fused(ops, qkv, z, b, a, w, out):
    ops.gdn_fused(qkv, z, b, a, w["conv_weight"], w["A_log"], w["dt_bias"], w["norm_weight"], out, LAYER, HK, SCALE,
                  EPS)


def _run(call, schedule):
    """Each step of `schedule` ((mode or None, [tokens per request])) on fresh pools: outputs, then
    the pool's states (slots and verify intermediates)."""
    g = torch.Generator().manual_seed(0)
    w = _weights(g)
    st, kv = StatePool(REGISTRY, 8, draft_tokens=DRAFT, verify_rows=4), KVPool(REGISTRY, 16, 4)
    ops = BoundOps(CPUReferenceBackend(kv, st))
    seqs = [SeqState(st.alloc()) for _ in range(3)]
    outs, modes = [], []
    for mode, counts in schedule:
        items = [(seqs[i], [0] * n) for i, n in enumerate(counts) if n]
        step = build_step(items, kv, mode=mode)
        modes.append(step.ctx.mode)
        qkv, z, b, a = _inputs(g, step.ctx.num_tokens)
        out = torch.empty(step.ctx.num_tokens, HV, DV)
        with ops.step(step.ctx):
            call(ops, qkv, z, b, a, w, out)
        outs.append(out)
        if mode is not None and step.ctx.mode == Mode.TARGET_VERIFY:
            outs += list(st.verify_layer(LAYER, DRAFT + 1, len(items)).values())
        commit_step(items)
    assert modes == [Mode.EXTEND, Mode.MIXED, Mode.DECODE, Mode.TARGET_VERIFY][:len(modes)], modes
    return outs + [t.clone() for t in st.layer(LAYER).values()]


def test_cpu_reference_gdn_fused_equals_the_unfused_region_bit_for_bit():
    schedule = [(None, [5, 1, 3]), (None, [1, 4, 1]), (None, [1, 1, 1]),
                (Mode.TARGET_VERIFY, [DRAFT + 1, DRAFT + 1, DRAFT + 1])]
    fused, unfused = _run(_fused, schedule), _run(_unfused, schedule)
    assert len(fused) == len(unfused) == len(schedule) + 2 + 2  # + verify intermediates, + conv and recurrent
    for f, u in zip(fused, unfused):
        assert f.dtype == u.dtype == torch.float32 and torch.equal(f, u)
    assert fused[0].abs().sum() > 0
