"""The backend protocol and BackendSet: explicit hook forwarding to the instances a routing table names,
and artifacts whose layers are bound to different instances giving the reference's results bitwise."""

from __future__ import annotations

import inspect
import types

import pytest
import torch

from hgc import main
from hgc.wiring import toolchain
from compiler.passes.context import CompileConfig
from compiler.passes.routing import parse_route
from compiler.pipeline import compile_checkpoint
from compiler.splitops import (COLLECTIVE_OPS, MODES, OP_SPECS, BackendCapability, LINEAR_KINDS, Mode, OpCapture,
                               op_arguments)
from runtime.backends import discover
from runtime.backends.backend_set import BackendSet
from runtime.backends.collectives import GlooCollectives
from runtime.backends.cpu_reference import CPUReferenceBackend
from runtime.backends.protocol import (HOOK_NAMES, OP_NAMES, BackendHooks, OpNotSupported,
                                       ProtocolError, check_backend, protocol_args)
from runtime.cache.batch import SeqState
from runtime.step.bound_ops import BoundOps
from runtime.engine.engine import SamplingParams
from runtime.engine.generate import run_step
from runtime.artifact.loader import load_artifact
from runtime.assembly import EngineOptions, engine_for_artifact
from testkit.engine_toy import build_model, make_engine, make_pools

LINEAR_OPS = frozenset(name for name, spec in OP_SPECS.items() if spec.kinds & LINEAR_KINDS)
FULL_OPS = frozenset(OP_SPECS) - LINEAR_OPS - COLLECTIVE_OPS


pytestmark = pytest.mark.usefixtures("one_thread", "shared_traces")


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


# -- the set: hooks forwarded explicitly ---------------------------------------------------------


def call_every_hook(backends, ctx) -> list[tuple]:
    """Call each protocol hook once; returns the calls a member that gets them all records."""
    backends.init_capture_state(64, 8)
    backends.init_replay_state(ctx, 8)
    backends.init_step_metadata(ctx)
    backends.init_chunk_metadata(ctx, 512)
    return [("init_capture_state", 64, 8), ("init_replay_state", ctx, 8), ("init_step_metadata", ctx),
            ("init_chunk_metadata", ctx, 512)]


def test_every_hook_reaches_every_member_and_the_set_runs_no_op():
    full, linear, moe = Spy(FULL_OPS - {"moe"}), Spy(LINEAR_OPS), Spy({"moe"})
    backends = BackendSet({"full": full, "linear": linear, "moe": moe}, {Mode.DECODE: ("full", "linear", "moe")})
    assert backends.children == (full, linear, moe) and backends.supported_ops == frozenset()
    ctx = types.SimpleNamespace(mode=Mode.DECODE)
    expected = call_every_hook(backends, ctx)
    assert full.calls == linear.calls == moe.calls == expected
    assert {c[0] for c in expected} == set(HOOK_NAMES)
    with pytest.raises(OpNotSupported, match="does not implement hgc.gdn_core"):
        backends.gdn_core(ctx, *range(8))  # ops are bound per node to a member, never through the set


def test_replay_hook_reaches_only_the_members_captured_in_the_step_mode():
    """In a piecewise extend step, a member whose nodes are all eager gaps in extend (FlashInfer, FLA's
    chunk kernels) runs on its eager plan: its replay hook is not called. Who is captured where is
    split.json's decision, handed to the set, never the set's own."""
    full, linear = Spy(FULL_OPS), Spy(LINEAR_OPS)
    backends = BackendSet({"full": full, "linear": linear}, {Mode.DECODE: ("full", "linear"), Mode.EXTEND: ("linear",)})
    extend, decode = types.SimpleNamespace(mode=Mode.EXTEND), types.SimpleNamespace(mode=Mode.DECODE)
    backends.init_replay_state(extend, 64)
    assert full.calls == [] and linear.calls == [("init_replay_state", extend, 64)]
    backends.init_replay_state(decode, 8)
    assert full.calls == [("init_replay_state", decode, 8)] and linear.calls[-1] == ("init_replay_state", decode, 8)
    with pytest.raises(ProtocolError, match=r"captured members \['moe'\] are not members"):
        BackendSet({"full": full}, {Mode.DECODE: ("moe",)})


def test_a_piecewise_step_plans_eagerly_only_the_members_in_its_gaps():
    """Before a piecewise extend step, a member with a node in an eager gap plans the step (step and
    chunk metadata), a member captured there stages it (init_replay_state), one with both gets both;
    a member whose nodes are all captured plans nothing its replay state would replace. A set made
    without split.json's gaps plans every member, as an eager step does."""
    attn, linear, mixed = Spy(FULL_OPS - {"moe"}), Spy(LINEAR_OPS), Spy({"moe"})
    backends = BackendSet({"attn": attn, "linear": linear, "mixed": mixed},
                          {Mode.EXTEND: ("linear", "mixed")}, {Mode.EXTEND: ("attn", "mixed")})
    ctx = types.SimpleNamespace(mode=Mode.EXTEND)
    backends.plan_piecewise_step(ctx, 4, 512)
    assert attn.calls == [("init_step_metadata", ctx), ("init_chunk_metadata", ctx, 512)]
    assert linear.calls == [("init_replay_state", ctx, 4)]
    assert mixed.calls == [("init_step_metadata", ctx), ("init_chunk_metadata", ctx, 512), ("init_replay_state", ctx, 4)]
    assert backends.planned_in_gaps(Mode.EXTEND) == (attn, mixed)
    assert backends.planned_in_gaps(Mode.DECODE) == (attn, linear, mixed)  # no gaps named for decode: everyone
    with pytest.raises(ProtocolError, match=r"gap members \['moe'\] are not members"):
        BackendSet({"attn": attn}, {}, {Mode.EXTEND: ("moe",)})


def test_a_piecewise_step_hands_the_plans_of_gap_only_members_to_defer_gaps():
    """defer_gaps (the runner's): a member whose nodes are all in the gaps is handed over with its
    plan, which runs when called (the runner calls it before the member's first op); a member on
    both sides plans now (its init_replay_state keeps the eager plan made first), and the captured
    members stage as before."""
    attn, linear, mixed = Spy(FULL_OPS - {"moe"}), Spy(LINEAR_OPS), Spy({"moe"})
    backends = BackendSet({"attn": attn, "linear": linear, "mixed": mixed},
                          {Mode.EXTEND: ("linear", "mixed")}, {Mode.EXTEND: ("attn", "mixed")})
    ctx = types.SimpleNamespace(mode=Mode.EXTEND)
    deferred = {}
    backends.plan_piecewise_step(ctx, 4, 512, defer_gaps=deferred.__setitem__)
    assert attn.calls == [] and list(deferred) == [attn]
    assert linear.calls == [("init_replay_state", ctx, 4)]
    assert mixed.calls == [("init_step_metadata", ctx), ("init_chunk_metadata", ctx, 512), ("init_replay_state", ctx, 4)]
    deferred[attn]()
    assert attn.calls == [("init_step_metadata", ctx), ("init_chunk_metadata", ctx, 512)]


def test_a_gap_only_member_plans_through_plan_gap_step_with_the_bucket():
    """A member whose nodes are all in the gaps plans through its plan_gap_step (ctx, bucket, chunk
    size), now or when the deferred plan runs; the protocol's answer is an eager step's plan. A
    member on both sides plans an eager step, which its init_replay_state keeps."""

    class GapSpy(Spy):
        def plan_gap_step(self, ctx, bucket, chunk_size):
            self.calls.append(("plan_gap_step", ctx, bucket, chunk_size))

    attn, mixed, plain = GapSpy(FULL_OPS - {"moe"}), GapSpy({"moe"}), Spy(LINEAR_OPS)
    backends = BackendSet({"attn": attn, "mixed": mixed, "plain": plain}, {Mode.EXTEND: ("mixed",)},
                          {Mode.EXTEND: ("attn", "mixed", "plain")})
    ctx = types.SimpleNamespace(mode=Mode.EXTEND)
    backends.plan_piecewise_step(ctx, 4, 512)
    assert attn.calls == [("plan_gap_step", ctx, 4, 512)]
    assert mixed.calls == [("init_step_metadata", ctx), ("init_chunk_metadata", ctx, 512), ("init_replay_state", ctx, 4)]
    assert plain.calls == [("init_step_metadata", ctx), ("init_chunk_metadata", ctx, 512)]  # the protocol's
    deferred = {}
    attn.calls.clear()
    backends.plan_piecewise_step(ctx, 8, 256, defer_gaps=deferred.__setitem__)
    assert attn.calls == [] and set(deferred) == {attn, plain}
    deferred[attn]()
    assert attn.calls == [("plan_gap_step", ctx, 8, 256)]


def test_a_decode_step_through_the_extend_pieces_is_planned_as_the_extend_plan_places_its_members():
    """Piecewise decode (a decode step run through the extend plan's pieces and gaps): attention, in
    the gaps there, plans the step eagerly instead of staging it for a graph that does not hold it;
    the hooks still get the decode step (no chunk metadata for it)."""
    attn, linear = Spy(FULL_OPS - {"moe"}), Spy(LINEAR_OPS)
    backends = BackendSet({"attn": attn, "linear": linear}, {Mode.DECODE: ("attn", "linear"), Mode.EXTEND: ("linear",)},
                          {Mode.DECODE: (), Mode.EXTEND: ("attn",)})
    decode = types.SimpleNamespace(mode=Mode.DECODE)
    backends.plan_piecewise_step(decode, 2, 512, Mode.EXTEND)
    assert attn.calls == [("init_step_metadata", decode)] and linear.calls == [("init_replay_state", decode, 2)]


def test_the_first_piece_stages_only_members_captured_alone_whose_staging_a_graph_holds():
    """first_piece_stages: of the members captured in the plan, those with no node in its gaps and
    whose replay state a graph may hold are left to the first piece (stage_in_first_piece), in decode
    and target_verify steps only; a member on both sides, or whose staging is host work, is staged
    on the host as before; an extend step stages everyone on the host."""
    class InGraph(Spy):
        def replay_state_in_graph(self, mode):
            return True

    attn, moe, linear, host = InGraph(FULL_OPS - {"moe"}), InGraph({"moe"}), InGraph(LINEAR_OPS), Spy(set())
    backends = BackendSet({"attn": attn, "moe": moe, "linear": linear, "host": host},
                          {Mode.EXTEND: ("moe", "linear", "host")}, {Mode.EXTEND: ("attn", "linear")})
    decode = types.SimpleNamespace(mode=Mode.DECODE)
    backends.plan_piecewise_step(decode, 2, 512, Mode.EXTEND, first_piece_stages=True)
    assert moe.calls == [] and host.calls == [("init_replay_state", decode, 2)]
    assert linear.calls == [("init_step_metadata", decode), ("init_replay_state", decode, 2)]
    backends.stage_in_first_piece(decode, 2, Mode.EXTEND)
    assert moe.calls == [("init_replay_state", decode, 2)] and len(host.calls) == 1 and len(linear.calls) == 2
    extend = types.SimpleNamespace(mode=Mode.EXTEND)
    backends.plan_piecewise_step(extend, 4, 512, first_piece_stages=True)
    backends.stage_in_first_piece(extend, 4, Mode.EXTEND)
    assert moe.calls[-1] == ("init_replay_state", extend, 4) and len(moe.calls) == 2


def test_the_set_forwards_what_each_member_accepts():
    """What the wrapper lint checks: every hook a member has is forwarded with arguments the member takes."""
    backends = BackendSet({"cpu_reference": CPUReferenceBackend(*make_pools(build_model("toy"), 1, 4))}, {})
    for member in backends.children:
        for name in HOOK_NAMES:
            assert list(inspect.signature(getattr(backends, name)).parameters) == list(protocol_args(name)), name
            inspect.signature(getattr(member, name)).bind(*protocol_args(name))


def test_a_member_outside_the_protocol_is_refused():
    class OpsWithoutHooks:  # the ops, but none of the protocol's hooks
        supported_ops = FULL_OPS
        gqa_attention = CPUReferenceBackend.gqa_attention

    with pytest.raises(ProtocolError, match="does not implement the backend protocol"):
        BackendSet({"x": OpsWithoutHooks(), "linear": Spy(LINEAR_OPS)}, {})
    with pytest.raises(ProtocolError, match="no backend to forward hooks to"):
        BackendSet({}, {})


def test_the_compiler_lint_finds_nothing_to_say_about_the_set():
    from compiler.lints.backend_rules import wrapper_findings
    backends = BackendSet({"cpu_reference": CPUReferenceBackend(*make_pools(build_model("toy"), 1, 4)),
                           "spy": Spy(LINEAR_OPS)}, {})
    assert wrapper_findings(BackendSet) == []  # against the protocol itself
    assert wrapper_findings(backends) == []  # against this instance's members


# -- the protocol itself ------------------------------------------------------------------------


def test_protocol_op_arguments_are_the_op_schemas():
    for op in OP_NAMES:
        schema = [a.name for a in getattr(torch.ops.hgc, op).default._schema.arguments]
        assert list(protocol_args(op)) == ["ctx", *schema] and list(op_arguments(op)) == schema, op
        implementer = GlooCollectives if op in COLLECTIVE_OPS else CPUReferenceBackend
        reference_params = list(inspect.signature(getattr(implementer, op)).parameters)[1:]
        assert reference_params == ["ctx", *schema], op


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
    from compiler.splitops.capability import BackendCapability
    assert CPUReferenceBackend.supported_ops == frozenset(OP_SPECS) - COLLECTIVE_OPS  # CPUReferenceBackend.capability.ops

    class FromCapability(Spy):  # states no supported_ops of its own
        capability = BackendCapability(name="from_capability", device="cpu", ops=frozenset({"gdn_core"}))

    assert FromCapability.supported_ops == frozenset({"gdn_core"})
    with pytest.raises(ProtocolError, match="disagrees with its capability"):
        class Twice(Spy):
            capability = BackendCapability(name="twice", device="cpu", ops=frozenset({"gdn_core"}))
            supported_ops = frozenset({"gdn_core", "short_conv"})


# -- layers bound to different instances -------------------------------------------------------


class SecondReference(CPUReferenceBackend):
    """A second CPU backend for the linear ops: the reference's math behind another name and instance,
    recording the layers it ran. A route binds layers to it; nothing picks it by priority. Captured
    where the reference is: every mode but KDA's extend and mixed steps."""

    name = "second_reference"
    capability = BackendCapability(name="second_reference", device="cpu", ops=LINEAR_OPS,
                                   modes_capturable=frozenset({Mode.DECODE, Mode.TARGET_VERIFY}), priority=-1,
                                   op_capture=tuple(OpCapture(op, frozenset({Mode.EXTEND, Mode.MIXED}))
                                                    for op in sorted(LINEAR_OPS - {"kda_core"})),
                                   doc="the reference's linear ops, as a second backend for routing tests")
    built: list = []

    @classmethod
    def build(cls, setup):
        instance = cls(setup.kv_pool, setup.state_pool)
        instance.layers_run = set()
        cls.built.append((instance, setup.layer_ids()))
        return instance

    def gdn_core(self, ctx, q, k, v, g, beta, out, layer_id, scale):
        self.layers_run.add(layer_id)
        super().gdn_core(ctx, q, k, v, g, beta, out, layer_id, scale)


REGISTRY = discover().with_classes(SecondReference, source="tests/runtime/backends/test_backend_set.py")
PROMPTS = [[5, 6, 7, 8, 9, 10, 11], [3, 4], [12, 13, 14, 15]]


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("routed")
    for family in ("qwen3_next", "kimi_linear"):
        assert main(["init-model", "--family", family, "--size", "tiny", "--seed", "4", "-o", str(root / family)]) == 0
    return root


_COMPILED: dict = {}


def _compile(root, family, name, *routes):
    """The checkpoint compiled with `routes` (once per module: an artifact is only read afterwards)."""
    key = (str(root), family, name, routes)
    if key not in _COMPILED:
        config = CompileConfig(routes=tuple(parse_route(r) for r in routes))
        compile_checkpoint(root / family, root / f"{family}-{name}", config, toolchain(REGISTRY), dumps=False,
                           force=True)
        _COMPILED[key] = load_artifact(root / f"{family}-{name}")
    return _COMPILED[key]


def _linear_apart(root, family):
    """The checkpoint compiled with every linear op it has routed to SecondReference."""
    plain = _compile(root, family, "plain")
    return _compile(root, family, "linear", *(f"{op}=second_reference" for op in sorted(LINEAR_OPS)
                                              if any(e.op == op for e in plain.docs.routing.entries("main"))))


def _tokens(art):
    engine = engine_for_artifact(art, EngineOptions(slots=3, token_budget=8), 32, registry=REGISTRY)
    params = SamplingParams(max_new_tokens=5)
    ids = [engine.add_request(p, params) for p in PROMPTS]
    results = engine.run_until_done()
    return engine, [results[i].output_ids for i in ids]


def _logits(art, steps: int = 3) -> list[torch.Tensor]:
    """Each step's logits: the prompts in one extend step, then greedy decodes."""
    kv, st = make_pools_for(art.registry)
    ops = BoundOps(art.backends(kv, st, REGISTRY).for_program("main"))
    forward = art.bind(ops)
    seqs = [SeqState(st.alloc()) for _ in PROMPTS]
    pending, out = [list(p) for p in PROMPTS], []
    for _ in range(steps):
        logits = run_step(forward, ops, list(zip(seqs, pending)), kv)
        out.append(logits)
        pending = [[t] for t in logits.argmax(-1).tolist()]
    return out


def make_pools_for(registry):
    from runtime.engine.generate import make_pools as pools
    return pools(registry, 32, len(PROMPTS))


def test_one_layer_routed_apart_runs_that_layer_and_only_that_layer_on_its_backend(checkpoints):
    SecondReference.built.clear()
    plain = _compile(checkpoints, "qwen3_next", "plain")
    _, plain_tokens = _tokens(plain)
    assert SecondReference.built == [], "a backend routing.json does not name is never built"
    art = _compile(checkpoints, "qwen3_next", "layer1", "layers=1:second_reference")
    engine, tokens = _tokens(art)
    assert tokens == plain_tokens  # the same math on another instance: the same tokens
    ((instance, layers),) = SecondReference.built
    assert layers == [1] and instance.layers_run == {1}
    executed = engine.ops.executed_backends()
    assert executed["1"] == ["second_reference"]  # layer 1's short_conv and gdn_core: no moe there
    assert all(names == ["cpu_reference"] for layer, names in executed.items() if layer != "1")
    assert set(engine.ops.backend.members) == {"cpu_reference", "second_reference"}
    assert art.routed_backends() == ["cpu_reference", "second_reference"]


@pytest.mark.parametrize("family", ["qwen3_next", "kimi_linear"])
def test_every_linear_op_on_a_second_instance_is_bitwise_the_reference(checkpoints, family):
    """Binding layers to different instances changes nothing but who runs them: logits bitwise equal."""
    plain = _compile(checkpoints, family, "plain")
    SecondReference.built.clear()
    routed = _linear_apart(checkpoints, family)
    for a, b in zip(_logits(plain), _logits(routed)):
        assert torch.equal(a, b)
    linear_layers = sorted({e.layer_id for e in plain.docs.routing.entries("main") if e.op in LINEAR_OPS})
    ((instance, layers),) = SecondReference.built
    assert layers == linear_layers
    engine, _ = _tokens(routed)
    executed = engine.ops.executed_backends()
    assert [int(k) for k, v in executed.items() if "second_reference" in v] == linear_layers


@pytest.mark.parametrize("family", ["qwen3_next", "kimi_linear"])
def test_the_gaps_of_each_mode_come_from_split_json(checkpoints, family):
    """A linear backend whose ops are captured in extend (Qwen3-Next's GDN and conv) is staged, not
    planned, before a piecewise extend step; one with an op in an extend gap (Kimi's KDA, which this
    backend does not capture there) is planned too; attention is in the gaps of extend only."""
    art = _linear_apart(checkpoints, family)
    kv, st = make_pools_for(art.registry)
    backends = art.backends(kv, st, REGISTRY).for_program("main")
    second = next(m for m in backends.children if isinstance(m, SecondReference))
    reference = next(m for m in backends.children if not isinstance(m, SecondReference))
    assert second in backends.replayed_in(Mode.EXTEND)
    assert (second in backends.planned_in_gaps(Mode.EXTEND)) == (family == "kimi_linear")
    assert reference in backends.planned_in_gaps(Mode.EXTEND)
    assert backends.planned_in_gaps(Mode.DECODE) == ()  # every op captured in decode on the CPU target


def test_an_eager_model_over_the_op_table_calls_each_layer_s_routed_instance(checkpoints):
    """Backends.op_table serves the eager model of the same checkpoint too: each `ops.<op>` call goes
    to the instance routing.json names for its layer (a layer routed apart stays apart)."""
    from models.loader import load_checkpoint
    from runtime.engine.generate import greedy_generate

    art = _compile(checkpoints, "qwen3_next", "layer1", "layers=1:second_reference")
    _, _, model = load_checkpoint(checkpoints / "qwen3_next")
    kv, st = make_pools_for(art.registry)
    ops = art.backends(kv, st, REGISTRY).op_table("main")
    model.set_ops(ops)
    tokens = greedy_generate(model, ops, kv, st, PROMPTS, 4)
    _, plain = _tokens(_compile(checkpoints, "qwen3_next", "plain"))
    assert tokens == [list(t[:4]) for t in plain]
    executed = ops.executed_backends()
    assert executed["1"] == ["second_reference"] and all(v == ["cpu_reference"] for k, v in executed.items() if k != "1")
