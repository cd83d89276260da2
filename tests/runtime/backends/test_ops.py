"""Every op on the CPU reference backend: chunked extend == token-by-token decode == one-shot
extend, and a mixed-length batch == each sequence alone. Inputs are random per sequence, so
the same sequence sees the same inputs however it is scheduled."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from compiler.splitops import LayerKind, LayerRegistry, LayerSpec, Mode, TensorSpec, OP_SPECS
from runtime.backends.cpu_reference import CPUReferenceBackend, moe_reference
from runtime.cache.batch import SeqState, build_step, commit_step
from runtime.step.bound_ops import BoundOps, NoStepError
from runtime.cache.kv_pool import KVPool
from runtime.cache.state_pool import PADDING_SLOT, StatePool

H, HKV, D, R, P, C, K = 4, 2, 8, 12, 4, 16, 4
F32 = "float32"

REGISTRY = LayerRegistry([
    LayerSpec(0, LayerKind.FULL_GQA, kv={"k": TensorSpec((HKV, D), F32), "v": TensorSpec((HKV, D), F32)}),
    LayerSpec(1, LayerKind.FULL_MLA, kv={"latent": TensorSpec((R + P,), F32)}),
    LayerSpec(2, LayerKind.GDN, state={"recurrent": TensorSpec((H, D, D), F32), "conv": TensorSpec((C, K - 1), F32)}),
    LayerSpec(3, LayerKind.KDA, state={"recurrent": TensorSpec((H, D, D), F32), "conv": TensorSpec((C, K - 1), F32)}),
    LayerSpec(4, LayerKind.LIGHTNING, state={"recurrent": TensorSpec((H, D, D), F32)}),
])


def seq_inputs(op: str, length: int, seed: int) -> dict[str, torch.Tensor]:
    """Per-token inputs of one sequence for one op (all [length, ...])."""
    g = torch.Generator().manual_seed(seed)
    r = lambda *shape: torch.randn(length, *shape, generator=g)
    if op == "gqa_attention":
        return {"q": r(H, D), "k": r(HKV, D), "v": r(HKV, D)}
    if op == "mla_attention":
        return {"q_latent": r(H, R), "q_rope": r(H, P), "kv_latent": r(R), "k_rope": r(P)}
    if op == "gdn_core":  # two key heads serve four value heads
        return {"q": F.normalize(r(2, D), dim=-1), "k": F.normalize(r(2, D), dim=-1), "v": r(H, D),
                "g": -F.softplus(r(H)), "beta": torch.sigmoid(r(H))}
    if op == "kda_core":
        return {"q": F.normalize(r(H, D), dim=-1), "k": F.normalize(r(H, D), dim=-1), "v": r(H, D),
                "g": -F.softplus(r(H, D)), "beta": torch.sigmoid(r(H))}
    if op == "lightning_core":
        return {"q": r(H, D), "k": r(H, D) * 0.3, "v": r(H, D)}
    if op == "short_conv":
        return {"x": r(C)}
    raise AssertionError(op)


CONV_WEIGHT = torch.randn(C, K, generator=torch.Generator().manual_seed(7))
CONV_BIAS = torch.randn(C, generator=torch.Generator().manual_seed(8))
DECAY = -torch.linspace(0.05, 1.0, H)


def call_op(ops, op: str, x: dict[str, torch.Tensor]) -> torch.Tensor:
    T = next(iter(x.values())).shape[0]
    if op == "gqa_attention":
        out = torch.empty(T, H, D)
        ops.gqa_attention(x["q"], x["k"], x["v"], out, 0, D ** -0.5)
    elif op == "mla_attention":
        out = torch.empty(T, H, R)
        ops.mla_attention(x["q_latent"], x["q_rope"], x["kv_latent"], x["k_rope"], out, 1, (R + P) ** -0.5)
    elif op == "gdn_core":
        out = torch.empty(T, H, D)
        ops.gdn_core(x["q"], x["k"], x["v"], x["g"], x["beta"], out, 2, D ** -0.5)
    elif op == "kda_core":
        out = torch.empty(T, H, D)
        ops.kda_core(x["q"], x["k"], x["v"], x["g"], x["beta"], out, 3, D ** -0.5)
    elif op == "lightning_core":
        out = torch.empty(T, H, D)
        ops.lightning_core(x["q"], x["k"], x["v"], DECAY, out, 4, D ** -0.5)
    else:
        out = torch.empty(T, C)
        ops.short_conv(x["x"], CONV_WEIGHT, CONV_BIAS, out, 2, True)
    return out


def run_schedule(op: str, lengths: list[int], schedule: list[list[tuple[int, int]]], pad_tokens: int = 0,
                 seeds: list[int] | None = None):
    """schedule: steps, each a list of (sequence, tokens to add). Returns each sequence's outputs."""
    kv, st = KVPool(REGISTRY, 64, 4), StatePool(REGISTRY, 8)
    ops = BoundOps(CPUReferenceBackend(kv, st))
    inputs = [seq_inputs(op, n, seed) for n, seed in zip(lengths, seeds or range(100, 100 + len(lengths)))]
    seqs = [SeqState(st.alloc()) for _ in lengths]
    done = [0] * len(lengths)
    outs = [[] for _ in lengths]
    for step_items in schedule:
        items = [(seqs[i], [0] * n) for i, n in step_items]
        step = build_step(items, kv, pad_tokens_to=pad_tokens, pad_seqs_to=len(items) + (1 if pad_tokens else 0))
        batch = {name: torch.cat([inputs[i][name][done[i]:done[i] + n] for i, n in step_items]) for name in inputs[0]}
        if pad_tokens:  # garbage in padding rows must not reach real rows, caches or states
            batch = {k: torch.cat([v, torch.full((step.ctx.num_tokens - v.shape[0], *v.shape[1:]), float("nan"))])
                     for k, v in batch.items()}
        with ops.step(step.ctx):
            out = call_op(ops, op, batch)
        if pad_tokens:
            assert out[step.ctx.num_real_tokens:].eq(0).all(), "padded output rows must be zeroed"
        row = 0
        for i, n in step_items:
            outs[i].append(out[row:row + n])
            done[i] += n
            row += n
        commit_step(items)
    if pad_tokens and op in ("gdn_core", "kda_core", "lightning_core", "short_conv"):
        for entries in st.buffers.values():
            for t in entries.values():
                assert torch.isfinite(t[1:]).all(), "padding leaked into a real state slot"
    return [torch.cat(o) for o in outs]


STATEFUL_OPS = ["gqa_attention", "mla_attention", "gdn_core", "kda_core", "lightning_core", "short_conv"]


def close(a, b, tol=1e-5):
    return float((a - b).norm() / b.norm()) <= tol


@pytest.mark.parametrize("op", STATEFUL_OPS)
def test_chunked_extend_equals_token_by_token_decode(op):
    L = 11
    whole = run_schedule(op, [L], [[(0, L)]])[0]
    token_by_token = run_schedule(op, [L], [[(0, 1)] for _ in range(L)])[0]
    chunked = run_schedule(op, [L], [[(0, 4)], [(0, 5)], [(0, 2)]])[0]
    assert close(token_by_token, whole) and close(chunked, whole)


@pytest.mark.parametrize("op", STATEFUL_OPS)
def test_mixed_length_batch_equals_each_alone(op):
    lengths = [9, 3, 6]
    alone = [run_schedule(op, [n], [[(0, n)]], seeds=[100 + i])[0] for i, n in enumerate(lengths)]
    # seq 0 prefills in two chunks while seq 1 prefills and then decodes; seq 2 joins late.
    schedule = [[(0, 5), (1, 2)], [(0, 4), (1, 1), (2, 3)], [(2, 1)], [(2, 2)]]
    batched = run_schedule(op, lengths, schedule)
    for a, b in zip(batched, alone):
        assert close(a, b)


@pytest.mark.parametrize("op", STATEFUL_OPS)
def test_padding_rows_are_zeroed_and_touch_no_state(op):
    lengths = [5, 2]
    plain = run_schedule(op, lengths, [[(0, 5), (1, 2)]])
    padded = run_schedule(op, lengths, [[(0, 5), (1, 2)]], pad_tokens=10)
    for a, b in zip(padded, plain):
        assert close(a, b)


def test_decode_state_lives_in_the_slot_not_the_call():
    """Two sequences decoding in one step keep separate states (slot indexing, not position)."""
    L = 6
    a = run_schedule("gdn_core", [L, L], [[(0, 1), (1, 1)] for _ in range(L)])
    b = run_schedule("gdn_core", [L], [[(0, 1)] for _ in range(L)])
    assert close(a[0], b[0])
    assert not close(a[1], a[0], tol=1e-2), "different inputs must give different outputs"


def test_moe_batch_equals_each_token_alone_and_groups_restrict_choice():
    g = torch.Generator().manual_seed(0)
    T, Dm, E, I = 7, 16, 8, 12
    x = torch.randn(T, Dm, generator=g)
    router, bias = torch.randn(E, Dm, generator=g), torch.randn(E, generator=g) * 0.1
    w13, w2 = torch.randn(E, 2 * I, Dm, generator=g) * 0.1, torch.randn(E, Dm, I, generator=g) * 0.1
    args = (router, bias, w13, w2, None, None, None, 2, "sigmoid", True, 2.5, 4, 2)
    batch = moe_reference(x, *args)
    alone = torch.cat([moe_reference(x[t:t + 1], *args) for t in range(T)])
    assert close(batch, alone)
    # A dense reference: every expert computed, weights zero outside the chosen ones.
    from runtime.backends.cpu_reference import route_topk
    ids, weights = route_topk(x, *args[:2], *args[7:])
    dense = torch.zeros(T, Dm)
    for t in range(T):
        for j in range(ids.shape[1]):
            e = int(ids[t, j])
            h = x[t] @ w13[e].t()
            dense[t] += weights[t, j] * ((F.silu(h[:I]) * h[I:]) @ w2[e].t())
    assert close(batch, dense)
    # With 4 groups of 2 experts and 2 groups kept, chosen experts span at most 2 groups.
    assert all(len(set((ids[t] // 2).tolist())) <= 2 for t in range(T))


@pytest.mark.parametrize("gated", [False, True])
def test_moe_shared_expert_adds_its_swiglu_scaled_by_the_gate(gated):
    g = torch.Generator().manual_seed(2)
    T, Dm, E, I, S = 5, 16, 4, 8, 12
    x = torch.randn(T, Dm, generator=g)
    router = torch.randn(E, Dm, generator=g)
    w13, w2 = torch.randn(E, 2 * I, Dm, generator=g) * 0.1, torch.randn(E, Dm, I, generator=g) * 0.1
    sw13, sw2 = torch.randn(2 * S, Dm, generator=g) * 0.1, torch.randn(Dm, S, generator=g) * 0.1
    gate = torch.randn(1, Dm, generator=g) if gated else None
    tail = (2, "softmax", True, 1.0, 1, 1)
    routed = moe_reference(x, router, None, w13, w2, None, None, None, *tail)
    with_shared = moe_reference(x, router, None, w13, w2, sw13, sw2, gate, *tail)
    swiglu = (F.silu(x @ sw13[:S].t()) * (x @ sw13[S:].t())) @ sw2.t()
    scale = torch.sigmoid(x @ gate.t()) if gated else 1.0
    assert close(with_shared, routed + scale * swiglu)


def test_moe_refuses_a_half_given_or_misshapen_shared_expert():
    x, router = torch.randn(3, 16), torch.randn(4, 16)
    w13, w2 = torch.randn(4, 16, 16), torch.randn(4, 16, 8)
    sw13, sw2, gate = torch.randn(24, 16), torch.randn(16, 12), torch.randn(1, 16)
    tail = (2, "softmax", True, 1.0, 1, 1)
    for bad, match in [((sw13, None, None), r"needs both shared_w13 and shared_w2 \(got only \['shared_w13'\]\)"),
                       ((None, None, gate), r"got only \['shared_gate'\]"),
                       ((sw13, torch.randn(16, 10), None), r"shared_w2 \[16, 10\] is not \[D=16, S=12\]"),
                       ((torch.randn(24, 8), sw2, None), r"shared_w13 \[24, 8\] is not \[2S, D=16\]"),
                       ((sw13, sw2, torch.randn(16)), r"shared_gate \[16\] is not \[1, D=16\]")]:
        with pytest.raises(ValueError, match=match):
            moe_reference(x, router, None, w13, w2, *bad, *tail)


def test_softmax_routing_renormalised_weights_sum_to_scale():
    g = torch.Generator().manual_seed(1)
    x, router = torch.randn(5, 8, generator=g), torch.randn(6, 8, generator=g)
    from runtime.backends.cpu_reference import route_topk
    _, w = route_topk(x, router, None, 3, "softmax", True, 1.0, 1, 1)
    assert torch.allclose(w.sum(-1), torch.ones(5))


def test_every_op_has_a_policy_for_every_mode_and_stateful_ops_leave_extend_to_their_backend():
    """Every stateful op may be captured in extend and mixed steps where the routed backend can (a
    kernel over the step's static tables or its page table: GQA and MLA attention up to
    whole_extend_tokens, KDA up to short_extend_tokens, GDN and Lightning on our chunk kernels);
    whether it is, is the backend's declaration, not the op's."""
    for spec in OP_SPECS.values():
        assert set(spec.policy) == set(Mode)
        if spec.stateful:
            assert spec.capture(Mode.EXTEND).value == spec.capture(Mode.MIXED).value == "capturable", spec.name
            assert spec.capture(Mode.DECODE).value == "capturable"
    assert all(c.value == "capturable" for c in OP_SPECS["moe"].policy.values())


def test_op_outside_a_step_is_an_error():
    ops = BoundOps(CPUReferenceBackend(KVPool(REGISTRY, 4, 4), StatePool(REGISTRY, 2)))
    with pytest.raises(NoStepError, match="outside a runtime step"):
        call_op(ops, "short_conv", {"x": torch.zeros(2, C)})


def test_state_slot_is_reset_when_handed_out_and_padding_slot_never_is():
    st = StatePool(REGISTRY, 2)
    slot = st.alloc()
    assert slot != PADDING_SLOT
    st.layer(2)["recurrent"][slot].fill_(3.0)
    st.free(slot)
    again = st.alloc()
    assert again == slot and st.layer(2)["recurrent"][again].abs().sum() == 0
    st.alloc()
    with pytest.raises(RuntimeError, match="all 2 slots"):
        st.alloc()
