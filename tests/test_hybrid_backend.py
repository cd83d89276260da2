"""The backend protocol and HybridBackend: routing, explicit hook forwarding, bitwise equality with the reference."""

from __future__ import annotations

import inspect
import types

import pytest
import torch

from compiler.splitops import FULL_KINDS, LINEAR_KINDS, OP_SPECS, Mode
from runtime.backends.cpu_reference import CPUReferenceBackend
from runtime.backends.hybrid import HybridBackend
from runtime.backends.protocol import (HOOK_NAMES, OP_NAMES, BackendHooks, OpNotSupported,
                                       ProtocolError, check_backend, protocol_args)
from runtime.batch import SeqState
from runtime.bound_ops import BoundOps
from runtime.engine import SamplingParams
from runtime.generate import run_step
from tests.engine_toy import available_families, build_model, make_engine, make_pools, prompts

MODELS = ["toy"] + available_families()
# Ops of full-attention kinds, plus the kind-less moe, go to the full child; linear kinds to the other.
LINEAR_OPS = frozenset(name for name, spec in OP_SPECS.items() if spec.kinds & LINEAR_KINDS)
FULL_OPS = frozenset(OP_SPECS) - LINEAR_OPS
assert all(OP_SPECS[name].kinds <= FULL_KINDS for name in FULL_OPS)


pytestmark = pytest.mark.usefixtures("one_thread")


def hybrid_over_references(kv_pool, state_pool) -> HybridBackend:
    return HybridBackend(CPUReferenceBackend(kv_pool, state_pool, supported_ops=FULL_OPS),
                         CPUReferenceBackend(kv_pool, state_pool, supported_ops=LINEAR_OPS))


class Spy(BackendHooks):
    """Records every hook and op call; declares the ops it is given."""

    name = "spy"
    supported_ops = frozenset(OP_NAMES)  # it records every op; instances narrow this

    def __init__(self, supported_ops):
        self.supported_ops = frozenset(supported_ops)
        self.calls: list[tuple] = []

    def init_capture_state(self, max_tokens, max_seqs):
        self.calls.append(("init_capture_state", max_tokens, max_seqs))

    def init_replay_state(self, ctx, bucket):
        self.calls.append(("init_replay_state", ctx, bucket))

    def init_step_metadata(self, ctx):
        self.calls.append(("init_step_metadata", ctx))

    def init_chunk_metadata(self, ctx, chunk_size):
        self.calls.append(("init_chunk_metadata", ctx, chunk_size))


def _record_op(name):
    def op(self, ctx, *args):
        self.calls.append((name, ctx, *args))
    op.__signature__ = inspect.Signature(
        [inspect.Parameter("self", inspect.Parameter.POSITIONAL_OR_KEYWORD)]
        + [inspect.Parameter(a, inspect.Parameter.POSITIONAL_OR_KEYWORD) for a in protocol_args(name)])
    return op


for _name in OP_NAMES:
    setattr(Spy, _name, _record_op(_name))


# -- bitwise equality with the plain reference --------------------------------------------------


@pytest.mark.parametrize("name", MODELS)
def test_hybrid_of_two_references_is_bitwise_the_reference(name):
    model = build_model(name)
    vocab = model.lm_head.weight.shape[0]
    plain_pools, hybrid_pools = make_pools(model, 2, 32), make_pools(model, 2, 32)
    plain = BoundOps(CPUReferenceBackend(*plain_pools))
    hybrid = BoundOps(hybrid_over_references(*hybrid_pools))

    def run(ops, pools, items):
        model.set_ops(ops)
        return run_step(model, ops, items, pools[0])

    a, b = prompts(2, [11, 5], vocab, seed=13)
    seqs = {id(p): [SeqState(p[1].alloc()), SeqState(p[1].alloc())] for p in (plain_pools, hybrid_pools)}
    steps = [[a, b]]
    for _ in range(4):
        logits_plain = run(plain, plain_pools, list(zip(seqs[id(plain_pools)], steps[-1])))
        logits_hybrid = run(hybrid, hybrid_pools, list(zip(seqs[id(hybrid_pools)], steps[-1])))
        assert torch.equal(logits_plain, logits_hybrid)
        steps.append([[t] for t in logits_plain.argmax(-1).tolist()])
    for plain_pool, hybrid_pool in zip(plain_pools, hybrid_pools):
        for layer_id, entries in plain_pool.buffers.items():
            for entry, tensor in entries.items():
                assert torch.equal(tensor, hybrid_pool.buffers[layer_id][entry]), f"layer {layer_id} {entry}"


def test_engine_over_the_hybrid_gives_the_reference_tokens():
    model = build_model(MODELS[-1])
    requests = [(p, SamplingParams(max_new_tokens=5)) for p in prompts(3, [9, 4, 14], model.lm_head.weight.shape[0])]

    def tokens(factory):
        engine = make_engine(model, num_slots=3, num_pages=64, backend_factory=factory, max_tokens_per_step=8)
        ids = [engine.add_request(p, params) for p, params in requests]
        results = engine.run_until_done()
        return [results[rid].output_ids for rid in ids]

    assert tokens(hybrid_over_references) == tokens(None)


# -- routing and forwarding ---------------------------------------------------------------------


def call_every_hook(hybrid, ctx) -> list[tuple]:
    """Call each protocol hook once on `hybrid`; returns the calls a child that gets them all records."""
    hybrid.init_capture_state(64, 8)
    hybrid.init_replay_state(ctx, 8)
    hybrid.init_step_metadata(ctx)
    hybrid.init_chunk_metadata(ctx, 512)
    return [("init_capture_state", 64, 8), ("init_replay_state", ctx, 8), ("init_step_metadata", ctx),
            ("init_chunk_metadata", ctx, 512)]


def test_every_hook_reaches_both_children_and_each_op_only_its_owner():
    full, linear = Spy(FULL_OPS), Spy(LINEAR_OPS)
    hybrid = HybridBackend(full, linear)
    assert hybrid.children == (full, linear)
    ctx = types.SimpleNamespace(mode=Mode.DECODE)
    expected = call_every_hook(hybrid, ctx)
    assert full.calls == expected and linear.calls == expected
    assert {c[0] for c in expected} == set(HOOK_NAMES)
    full.calls.clear()
    linear.calls.clear()
    for op in OP_NAMES:
        args = tuple(f"{op}.{a}" for a in protocol_args(op)[1:])
        getattr(hybrid, op)(ctx, *args)
        owner, other = (full, linear) if op in FULL_OPS else (linear, full)
        assert owner.calls[-1] == (op, ctx, *args)
        assert all(call[0] != op for call in other.calls)
    assert len(full.calls) + len(linear.calls) == len(OP_NAMES)


def test_replay_hook_reaches_only_the_children_that_capture_the_step_mode():
    """In a piecewise extend step, a child whose kernels are never captured in extend (FlashInfer,
    FLA's chunk kernels) runs in the eager gaps on its eager plan: its replay hook is not called."""
    from runtime.backends.capability import BackendCapability

    class DecodeOnly(Spy):
        capability = BackendCapability(name="decode_only", device="cpu", ops=frozenset(FULL_OPS),
                                       modes_capturable=frozenset({Mode.DECODE}))

    class Everywhere(Spy):
        capability = BackendCapability(name="everywhere", device="cpu", ops=frozenset(LINEAR_OPS),
                                       modes_capturable=frozenset(Mode))

    full, linear = DecodeOnly(FULL_OPS), Everywhere(LINEAR_OPS)
    hybrid = HybridBackend(full, linear)
    extend, decode = types.SimpleNamespace(mode=Mode.EXTEND), types.SimpleNamespace(mode=Mode.DECODE)
    hybrid.init_replay_state(extend, 64)
    assert full.calls == [] and linear.calls == [("init_replay_state", extend, 64)]
    hybrid.init_replay_state(decode, 8)
    assert full.calls == [("init_replay_state", decode, 8)] and linear.calls[-1] == ("init_replay_state", decode, 8)


def test_hybrid_forwards_what_each_child_accepts():
    """What the wrapper lint checks: every hook a child has is forwarded with arguments the child takes."""
    hybrid = hybrid_over_references(*make_pools(build_model("toy"), 1, 4))
    for child in hybrid.children:
        for name in HOOK_NAMES + tuple(child.supported_ops):
            wrapper_params = list(inspect.signature(getattr(hybrid, name)).parameters)
            assert wrapper_params == list(protocol_args(name)), name
            inspect.signature(getattr(child, name)).bind(*protocol_args(name))


def test_each_op_needs_exactly_one_owner():
    with pytest.raises(ProtocolError, match=r"hgc\.moe is declared by full and linear"):
        HybridBackend(Spy(FULL_OPS), Spy(LINEAR_OPS | {"moe"}))
    with pytest.raises(ProtocolError, match=r"hgc\.moe is declared by neither child"):
        HybridBackend(Spy(FULL_OPS - {"moe"}), Spy(LINEAR_OPS))


def test_a_child_outside_the_protocol_is_refused():
    from runtime.backends.cpu_reference import CPUReferenceBackend
    kv_pool, state_pool = make_pools(build_model("toy"), 1, 4)
    class OpsWithoutHooks:  # the ops, but none of the protocol's hooks
        supported_ops = FULL_OPS
        gqa_attention = CPUReferenceBackend.gqa_attention
        mla_attention = CPUReferenceBackend.mla_attention

    with pytest.raises(ProtocolError, match="does not implement the backend protocol"):
        HybridBackend(OpsWithoutHooks(), Spy(LINEAR_OPS))


# -- the protocol itself ------------------------------------------------------------------------


def test_protocol_op_arguments_are_the_op_schemas():
    for op in OP_NAMES:
        schema = [a.name for a in getattr(torch.ops.hgc, op).default._schema.arguments]
        assert list(protocol_args(op)) == ["ctx", *schema], op
        protocol_params = list(inspect.signature(getattr(HybridBackend, op)).parameters)[1:]
        assert protocol_params == ["ctx", *schema], op


def test_a_backend_missing_a_hook_cannot_be_built():
    class NoChunkPlan(BackendHooks):
        def init_capture_state(self, max_tokens, max_seqs): ...
        def init_replay_state(self, ctx, bucket): ...
        def init_step_metadata(self, ctx): ...

    with pytest.raises(TypeError, match="init_chunk_metadata"):
        NoChunkPlan()


def test_a_hook_that_cannot_take_the_protocol_arguments_fails_at_definition():
    with pytest.raises(ProtocolError, match=r"init_chunk_metadata.*chunk_size"):
        class Narrow(Spy):
            def init_chunk_metadata(self, ctx):  # DESIGN.md failure 4: a forwarded argument it does not take
                pass
    with pytest.raises(ProtocolError, match="gdn_core"):
        class WrongOp(Spy):
            def gdn_core(self, ctx, q, k, v):
                pass


def test_declared_ops_must_be_implemented_and_undeclared_ops_refuse():
    class Partial(Spy):
        gdn_core = BackendHooks.gdn_core  # declared below, but the protocol's refusing body

    with pytest.raises(ProtocolError, match=r"does not implement \['gdn_core'\]"):
        check_backend(Partial({"gdn_core"}))
    kv_pool, state_pool = make_pools(build_model("toy"), 1, 4)
    with pytest.raises(ProtocolError):
        CPUReferenceBackend(kv_pool, state_pool, supported_ops={"not_an_op"})

    class FullOnly(Spy):
        gdn_core = BackendHooks.gdn_core

    with pytest.raises(OpNotSupported, match="does not implement hgc.gdn_core"):
        FullOnly(FULL_OPS).gdn_core(None, 1, 2, 3, 4, 5, 6, 7, 8)


def test_the_engine_plans_every_step_and_chunks_only_prompt_steps():
    model = build_model("toy")
    seen = []

    class Recording(CPUReferenceBackend):
        def init_step_metadata(self, ctx):
            seen.append(("step", ctx.mode))

        def init_chunk_metadata(self, ctx, chunk_size):
            seen.append(("chunk", ctx.mode, chunk_size))

    engine = make_engine(model, backend_factory=Recording, max_tokens_per_step=8)
    engine.generate(list(range(2, 14)), SamplingParams(max_new_tokens=3))
    # 12 prompt tokens in chunks of 8 and 4, then 2 decodes.
    assert seen == [("step", Mode.EXTEND), ("chunk", Mode.EXTEND, 8), ("step", Mode.EXTEND), ("chunk", Mode.EXTEND, 8),
                    ("step", Mode.DECODE), ("step", Mode.DECODE)]


def test_supported_ops_come_from_the_capability_declaration():
    from runtime.backends.capability import BackendCapability
    assert CPUReferenceBackend.supported_ops == frozenset(OP_SPECS)  # CPUReferenceBackend.capability.ops

    class FromCapability(Spy):  # states no supported_ops of its own
        capability = BackendCapability(name="from_capability", device="cpu", ops=frozenset({"gdn_core"}))

    assert FromCapability.supported_ops == frozenset({"gdn_core"})
    with pytest.raises(ProtocolError, match="disagrees with its capability"):
        class Twice(Spy):
            capability = BackendCapability(name="twice", device="cpu", ops=frozenset({"gdn_core"}))
            supported_ops = frozenset({"gdn_core", "short_conv"})


def test_the_compiler_lint_finds_nothing_to_say_about_the_hybrid():
    backend_rules = pytest.importorskip("compiler.lints.backend_rules")
    kv_pool, state_pool = make_pools(build_model("toy"), 1, 4)
    hybrid = hybrid_over_references(kv_pool, state_pool)
    assert backend_rules.wrapper_findings(HybridBackend) == []  # against the protocol itself
    assert backend_rules.wrapper_findings(hybrid) == []  # against this instance's children


# -- more than two children ---------------------------------------------------------------------

ATTENTION_OPS = FULL_OPS - {"moe"}


def test_three_children_each_op_to_its_owner_every_hook_to_all():
    full, linear, moe = Spy(ATTENTION_OPS), Spy(LINEAR_OPS), Spy({"moe"})
    hybrid = HybridBackend(full, linear, moe)
    assert hybrid.children == (full, linear, moe)
    ctx = types.SimpleNamespace(mode=Mode.DECODE)
    expected = call_every_hook(hybrid, ctx)
    assert full.calls == linear.calls == moe.calls == expected
    for child in (full, linear, moe):
        child.calls.clear()
    for op in OP_NAMES:
        args = tuple(f"{op}.{a}" for a in protocol_args(op)[1:])
        getattr(hybrid, op)(ctx, *args)
        owner = moe if op == "moe" else full if op in ATTENTION_OPS else linear
        assert owner.calls[-1] == (op, ctx, *args) and hybrid.owner_of(op) is owner
    assert [len(c.calls) for c in (full, linear, moe)] == [len(ATTENTION_OPS), len(LINEAR_OPS), 1]


def test_three_children_need_exactly_one_owner_per_op():
    with pytest.raises(ProtocolError, match=r"hgc\.moe is declared by full and moe"):
        HybridBackend(Spy(FULL_OPS), Spy(LINEAR_OPS), Spy({"moe"}))
    with pytest.raises(ProtocolError, match=r"hgc\.gdn_core is declared by linear #1 and linear #2.*"
                                            r"hgc\.moe is declared by no child"):
        HybridBackend(Spy(ATTENTION_OPS), Spy(LINEAR_OPS), Spy(LINEAR_OPS - {"short_conv"}))
    with pytest.raises(ProtocolError, match="two or more"):
        HybridBackend(Spy(OP_NAMES))


def test_three_reference_children_are_bitwise_the_reference_and_lint_clean():
    model = build_model(MODELS[-1])
    vocab = model.lm_head.weight.shape[0]
    plain_pools, hybrid_pools = make_pools(model, 2, 32), make_pools(model, 2, 32)
    plain = BoundOps(CPUReferenceBackend(*plain_pools))
    three = HybridBackend(CPUReferenceBackend(*hybrid_pools, supported_ops=FULL_OPS - {"moe"}),
                          CPUReferenceBackend(*hybrid_pools, supported_ops=LINEAR_OPS),
                          CPUReferenceBackend(*hybrid_pools, supported_ops={"moe"}))
    hybrid = BoundOps(three)
    a, b = prompts(2, [7, 4], vocab, seed=3)
    seqs = {id(p): [SeqState(p[1].alloc()), SeqState(p[1].alloc())] for p in (plain_pools, hybrid_pools)}
    step = [a, b]
    for _ in range(3):
        outs = []
        for ops, pools in ((plain, plain_pools), (hybrid, hybrid_pools)):
            model.set_ops(ops)
            outs.append(run_step(model, ops, list(zip(seqs[id(pools)], step)), pools[0]))
        assert torch.equal(outs[0], outs[1])
        step = [[t] for t in outs[0].argmax(-1).tolist()]
    backend_rules = pytest.importorskip("compiler.lints.backend_rules")
    assert backend_rules.wrapper_findings(three) == []
