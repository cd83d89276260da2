"""Pass manager, instruments, annotate / routing / split passes, the split-plan format, dumps.

Each pass test builds a toy graph, runs the pipeline (or one pass), and checks node facts, op
counts before and after, and error messages (one test per message).
"""

from __future__ import annotations

import onnx
import pytest
import torch
import torch.nn as nn

from hgc.wiring import toolchain
from compiler.passes.base import CompilePass, PassError, PassResult, PreconditionError
from compiler.passes.context import CompileConfig
from compiler.passes.instruments import Instrument, TimingInstrument
from compiler.passes.manager import PassManager
from compiler.passes.routing import RoutingError
from compiler.passes.split import SplitPass, plan_for_mode
from compiler.pipeline import make_context, run_passes
from compiler.splitops import COLLECTIVE_OPS, MODES, OP_SPECS, TRACED_OPS, LayerKind, Mode
from compiler.splitops.artifact import (CAPTURED, EAGER, ArtifactFormatError, Piece, SplitPlan, apply_split_plan,
                                        parse_split_doc, split_doc)
from compiler.splitops.capability import BackendCapability, CapabilityError, CapabilityTable, ShapeLimit
from tests.compiler.test_compiler_toys import H, HD, toy_plan, toy_traced

pytestmark = pytest.mark.usefixtures("shared_traces")  # the tiny configs traced once, compiles on copies

ALL_OPS = frozenset(OP_SPECS)
LINEAR_OPS = frozenset({"gdn_core", "kda_core", "lightning_core", "short_conv"})
FULL_OPS = frozenset({"gqa_attention", "mla_attention"})


def _op_nodes(gm):
    return [n for n in gm.graph.nodes if n.op == "call_function" and "hgc" in str(n.target)]


# -- manager and instruments ------------------------------------------------------------------------


class _Record(CompilePass):
    def __init__(self, name, log, fail=False, stop=False):
        self.name, self.log, self.fail, self.stop = name, log, fail, stop

    def __call__(self, gm, ctx):
        self.log.append((self.name, ctx.program))
        if self.fail:
            raise ValueError("boom")
        return PassResult(gm, stop=self.stop)


def _ctx(**overrides):
    traced = toy_traced(**overrides)
    return make_context(traced, CompileConfig(), toolchain())


def test_manager_runs_each_pass_on_every_program_in_order():
    ctx, log = _ctx(draft=True), []
    PassManager([_Record("a", log), _Record("b", log)]).run(ctx)
    assert log == [("a", "main"), ("a", "draft"), ("b", "main"), ("b", "draft")]


def test_manager_names_failing_pass_and_the_passes_before():
    ctx, log = _ctx(), []
    with pytest.raises(PassError) as info:
        PassManager([_Record("first", log), _Record("second", log), _Record("third", log, fail=True)]).run(ctx)
    msg = str(info.value)
    assert "pass third failed on program main" in msg and "first, second" in msg and "boom" in msg
    assert info.value.ran == ["first", "second"]


def test_manager_stops_after_a_pass_that_asks_to():
    ctx, log = _ctx(), []
    PassManager([_Record("a", log, stop=True), _Record("b", log)]).run(ctx)
    assert log == [("a", "main")] and ctx.stopped_after == "a"


def test_manager_checks_requires_and_names_it():
    class Needs(CompilePass):
        name = "needs"

        def requires(self, gm, ctx):
            raise PreconditionError("needs: run 'annotate' first")

        def __call__(self, gm, ctx):  # pragma: no cover - never reached
            return PassResult(gm)

    with pytest.raises(PassError, match="pass needs failed .*run 'annotate' first"):
        PassManager([Needs()]).run(_ctx())


def test_instruments_wrap_every_pass_and_run_after_failure():
    calls = []

    class Spy(Instrument):
        def run_before_pipeline(self, ctx):
            calls.append("start")

        def run_before_pass(self, p, index, gm, ctx):
            calls.append(f"before {index} {p.name}")

        def run_after_pass(self, p, index, result, ctx):
            calls.append(f"after {index} {p.name}")

        def run_after_pipeline(self, ctx):
            calls.append("end")

    with pytest.raises(PassError):
        PassManager([_Record("a", []), _Record("b", [], fail=True)], [Spy()]).run(_ctx())
    assert calls == ["start", "before 1 a", "after 1 a", "before 2 b", "end"]


def test_timing_instrument_prints_one_table():
    timing = TimingInstrument()
    PassManager([_Record("a", []), _Record("b", [])], [timing]).run(_ctx())
    table = timing.table()
    assert "01 a" in table and "02 b" in table and "total" in table


def test_pipeline_passes_have_fingerprints():
    result = toy_plan()
    names = [f["name"] for f in result.fingerprints]
    assert names == ["annotate", "lint_registry", "fusion", "routing", "split", "lint_capture"]
    assert all(len(f["source_sha256"]) == 64 and "version" in f for f in result.fingerprints)


# -- annotate --------------------------------------------------------------------------------------------


def test_annotate_records_facts_on_each_op_node():
    result = toy_plan(layers=["lightning", "full_gqa"], moe=[False, True])
    nodes = _op_nodes(result.ctx.programs["main"])
    facts = [(n.meta["hgc.op"], n.meta["hgc.layer_id"], n.meta["hgc.kind"], n.meta["hgc.module"].rsplit(".", 1)[-1])
             for n in nodes]
    assert facts == [("lightning_core", 0, "lightning", "ToyLinearAttention"), ("gqa_attention", 1, "full_gqa", "ToyAttention"),
                     ("moe", 1, "full_gqa", "ToyMoE")]


# -- routing ---------------------------------------------------------------------------------------------


def test_routing_binds_every_op_node_to_the_cpu_reference():
    result = toy_plan(layers=["lightning", "full_gqa"], moe=[True, True], draft=True)
    for program, gm in result.ctx.programs.items():
        assert {n.meta["hgc.backend"] for n in _op_nodes(gm)} == {"cpu_reference"}
        assert len(result.ctx.routing[program]) == len(_op_nodes(gm))


def _cuda_table(**linear_overrides):
    return CapabilityTable([
        BackendCapability("cpu_reference", "cpu", ALL_OPS),
        BackendCapability("flash_full", "cuda", FULL_OPS, modes_capturable=frozenset(MODES)),
        BackendCapability("triton_linear", "cuda", LINEAR_OPS,
                          modes_capturable=frozenset({Mode.DECODE, Mode.TARGET_VERIFY}), **linear_overrides),
        BackendCapability("moe_kernels", "cuda", frozenset({"moe"}), modes_capturable=frozenset(MODES)),
    ])


def test_routing_uses_several_backends_of_one_device_by_op():
    result = toy_plan(target="cuda", capabilities=_cuda_table(), layers=["lightning", "full_gqa"], moe=[True, False])
    routed = [(e["op"], e["layer_id"], e["backend"]) for e in result.ctx.routing["main"]]
    assert routed == [("lightning_core", 0, "triton_linear"), ("moe", 0, "moe_kernels"), ("gqa_attention", 1, "flash_full")]


def test_routing_follows_the_registry_not_the_module_type():
    # Failure 1: a linear layer wrapped in a plain attention module still goes to the linear backend.
    result = toy_plan(target="cuda", capabilities=_cuda_table(), layers=["lightning", "full_gqa"], wrap_linear=[0])
    first = result.ctx.routing["main"][0]
    assert first["module"].endswith("ToyAttention") and first["kind"] == "lightning"
    assert first["backend"] == "triton_linear"


def test_routing_prefers_the_backend_that_can_capture_where_the_policy_allows():
    table = CapabilityTable([
        BackendCapability("plain", "cuda", ALL_OPS),
        BackendCapability("graphs", "cuda", ALL_OPS, modes_capturable=frozenset(MODES)),
    ])
    result = toy_plan(target="cuda", capabilities=table)
    assert {e["backend"] for e in result.ctx.routing["main"]} == {"graphs"}


def test_routing_error_when_no_backend_on_the_device_runs_the_op():
    table = CapabilityTable([BackendCapability("flash_full", "cuda", FULL_OPS)])
    with pytest.raises(PassError) as info:
        toy_plan(target="cuda", capabilities=table)
    msg = str(info.value)
    assert isinstance(info.value.cause, RoutingError)
    assert "pass routing failed" in msg and "node lightning_core (layer 0, kind lightning)" in msg
    assert "no backend on device 'cuda' implements hgc.lightning_core" in msg and "fix:" in msg
    assert info.value.ran == ["annotate", "lint_registry", "fusion"]


def test_routing_error_when_no_backend_supports_a_mode():
    table = CapabilityTable([BackendCapability("cpu_partial", "cpu", ALL_OPS,
                                               modes_supported=frozenset({Mode.DECODE, Mode.EXTEND}))])
    with pytest.raises(PassError, match=r"node lightning_core \(layer 0, kind lightning\): no backend supports mode "
                                        r"mixed .*fix: add mode mixed"):
        toy_plan(capabilities=table)


def test_routing_respects_declared_layer_kinds():
    table = CapabilityTable([
        BackendCapability("only_gdn", "cpu", ALL_OPS, kinds=frozenset({LayerKind.GDN}), priority=5),
        BackendCapability("cpu_reference", "cpu", ALL_OPS),
    ])
    result = toy_plan(capabilities=table)
    assert {e["backend"] for e in result.ctx.routing["main"]} == {"cpu_reference"}


# -- routes, dtypes, shape limits, kernel options ----------------------------------------------------


CPU_ALL = BackendCapability("cpu_reference", "cpu", ALL_OPS, modes_capturable=frozenset(MODES))


def _entries(result, program="main"):
    return {e["node"]: e for e in result.ctx.routing[program]}


def _routes(*texts):
    from compiler.passes.routing import parse_route
    return tuple(parse_route(t) for t in texts)


def _route_plan(routes, table, **overrides):
    from compiler.passes.context import CompileConfig
    from compiler.pipeline import make_context, run_passes
    traced = toy_traced(**overrides)
    config = CompileConfig(routes=_routes(*routes))
    ctx = make_context(traced, config, toolchain())
    ctx.capabilities = table
    return run_passes(traced, config, ctx=ctx)


def test_routes_bind_an_op_and_layers_and_a_layer_route_beats_an_op_route():
    alt = BackendCapability("alt_linear", "cpu", LINEAR_OPS, priority=-1)
    table = CapabilityTable([CPU_ALL, alt])
    layers = ["lightning", "full_gqa", "lightning"]
    by_priority = _entries(_route_plan((), table, layers=layers, moe=[False, True, False]))
    assert {e["backend"] for e in by_priority.values()} == {"cpu_reference"}
    assert {e["chosen_by"] for e in by_priority.values()} == {"priority"}
    routed = _entries(_route_plan(["lightning_core=alt_linear", "layers=2:cpu_reference"], table, layers=layers,
                                  moe=[False, True, False]))
    assert routed["lightning_core"]["backend"] == "alt_linear"
    assert routed["lightning_core"]["chosen_by"] == "route lightning_core=alt_linear"
    assert routed["lightning_core_1"]["backend"] == "cpu_reference"  # layer 2: the layer route wins
    assert routed["lightning_core_1"]["chosen_by"] == "route layers=2:cpu_reference"
    assert routed["gqa_attention"]["backend"] == routed["moe"]["backend"] == "cpu_reference"


@pytest.mark.parametrize("routes, message", [
    (["lightning_core=nowhere"], r"names backend 'nowhere', which this installation does not have \(backends: "
                                 r"cpu_reference, alt_linear, cuda_all\)"),
    (["gqa_attention=alt_linear"], r"alt_linear does not implement hgc.gqa_attention"),
    (["layers=1:alt_linear"], r"alt_linear implements none of layer 1's ops \['gqa_attention'\]"),
    (["layers=9:alt_linear"], r"the registry has no layer 9"),
    (["lightning_core=cuda_all"], r"node lightning_core \(layer 0, kind lightning\): route lightning_core=cuda_all "
                                  r"names cuda_all, which runs on 'cuda', and the compile target is 'cpu'"),
    (["mla_attention=cpu_reference"], r"route mla_attention=cpu_reference matches no node"),
    (["lightning_core=alt_linear[impl=fast]"], r"backend 'alt_linear' has no option 'impl' \(options: none\)"),
    (["layers=0:alt_linear", "layers=0:cpu_reference"], r"routes layers=0:alt_linear, layers=0:cpu_reference each "
                                                        r"claim it"),
])
def test_route_errors_name_the_route_the_layer_and_what_is_lacking(routes, message):
    table = CapabilityTable([CPU_ALL, BackendCapability("alt_linear", "cpu", LINEAR_OPS, priority=-1),
                             BackendCapability("cuda_all", "cuda", ALL_OPS)])
    with pytest.raises(PassError, match=message):
        _route_plan(routes, table)


def test_route_syntax_is_refused_with_the_forms_it_takes():
    from compiler.passes.routing import RoutingError, parse_route
    assert str(parse_route("layers=7, 3:x[a=b, c=d]")) == "layers=3,7:x[a=b,c=d]"
    for bad, words in [("gdn_core", "expected OP=BACKEND"), ("flash_attention=x", "hgc has no op 'flash_attention'"),
                       ("gdn_core=x[fast]", "kernel option 'fast' is not option=choice")]:
        with pytest.raises(RoutingError, match=words):
            parse_route(bad)


def test_routing_skips_a_backend_that_does_not_serve_the_dtype_and_names_each_when_none_does():
    """DESIGN.md failure 9: float32 full attention must not land on a backend without float32 kernels."""
    bf16 = BackendCapability("bf16_attention", "cuda", FULL_OPS, dtypes=frozenset({"bfloat16"}), priority=5)
    anyd = BackendCapability("any_attention", "cuda", FULL_OPS)
    linear = BackendCapability("cuda_rest", "cuda", ALL_OPS - FULL_OPS)
    entries = _entries(toy_plan(target="cuda", capabilities=CapabilityTable([bf16, anyd, linear])))
    assert entries["gqa_attention"]["backend"] == "any_attention" and entries["gqa_attention"]["dtype"] == "float32"
    with pytest.raises(PassError, match=r"node gqa_attention \(layer 1, kind full_gqa\): no backend on cuda runs "
                                        r"hgc.gqa_attention in float32 .*considered: bf16_attention runs dtypes "
                                        r"\['bfloat16'\], not float32\); fix: compile with another --dtype"):
        toy_plan(target="cuda", capabilities=CapabilityTable([bf16, linear]))


def test_routing_honours_shape_limits():
    head_dims = (ShapeLimit("gqa_attention", "q", -1, frozenset({64, 128}), why="kernels built for 64 and 128"),)
    limited = BackendCapability("limited", "cpu", FULL_OPS, limits=head_dims, priority=5)
    table = CapabilityTable([limited, CPU_ALL])
    assert _entries(toy_plan(capabilities=table))["gqa_attention"]["backend"] == "cpu_reference"  # head dim HD
    with pytest.raises(PassError, match=rf"route gqa_attention=limited sends hgc.gqa_attention \(float32\) to limited, "
                                        rf"which q dim -1 is {HD}, it takes \[64, 128\] \(kernels built for 64 and 128\)"):
        _route_plan(["gqa_attention=limited"], table)


def test_an_explicit_only_backend_is_bound_by_a_route_and_never_by_priority():
    slow = BackendCapability("slow_everything", "cpu", ALL_OPS, priority=9, explicit_only=True)
    table = CapabilityTable([slow, CPU_ALL])
    assert {e["backend"] for e in _route_plan((), table).ctx.routing["main"]} == {"cpu_reference"}
    routed = _entries(_route_plan(["layers=0:slow_everything"], table))
    assert routed["lightning_core"]["backend"] == "slow_everything" and routed["gqa_attention"]["backend"] == "cpu_reference"


def test_kernel_options_are_resolved_and_recorded_per_node():
    opts = BackendCapability("with_options", "cpu", FULL_OPS, priority=5, modes_capturable=frozenset(MODES),
                             options=(("extend_impl", ("ragged", "paged")), ("decode", ("fa2", "fa3"))))
    table = CapabilityTable([opts, CPU_ALL])
    assert _entries(_route_plan((), table))["gqa_attention"]["options"] == {"extend_impl": "ragged", "decode": "fa2"}
    routed = _entries(_route_plan(["gqa_attention=with_options[extend_impl=paged]"], table))
    assert routed["gqa_attention"]["options"] == {"extend_impl": "paged", "decode": "fa2"}
    assert routed["lightning_core"]["options"] == {}
    with pytest.raises(PassError, match=r"option extend_impl takes ragged\|paged, not 'chunked'"):
        _route_plan(["gqa_attention=with_options[extend_impl=chunked]"], table)


def test_split_makes_a_node_of_a_backend_that_cannot_capture_an_eager_gap():
    """Captured or eager is the op's policy AND the routed backend's capability, decided by the
    split pass (and read from split.json by the runtime)."""
    uncaptured = BackendCapability("uncaptured_linear", "cpu", LINEAR_OPS, priority=-1)
    table = CapabilityTable([CPU_ALL, uncaptured])
    plans = _route_plan(["layers=2:uncaptured_linear"], table, layers=["lightning", "full_gqa", "lightning"],
                        moe=[False, True, False]).ctx.split_plans["main"]
    decode_gaps = [p.nodes for p in plans[Mode.DECODE].pieces if p.kind == EAGER]
    assert decode_gaps == [("lightning_core_1",)]  # layer 2 only: its neighbours stay captured
    assert [p.kind for p in plans[Mode.DECODE].pieces] == [CAPTURED, EAGER, CAPTURED]
    extend_gaps = [p.nodes for p in plans[Mode.EXTEND].pieces if p.kind == EAGER]
    # extend: layer 2's lightning by its backend (layer 0's is captured); GQA attention's policy
    # leaves extend to its backend, and this one captures every mode
    assert extend_gaps == [("lightning_core_1",)]


def test_a_choice_scoped_to_some_ops_is_refused_on_a_node_of_another():
    """`choice_ops`: a kernel option's choice that serves only some of a backend's ops (FlashInfer's
    extend_impl=triton serves GQA layers). A route giving it to a node of another op fails the
    compile naming the layer, the route and the choice; routed to the ops it serves, it is recorded."""
    from compiler.splitops import ChoiceScope
    scoped = BackendCapability("scoped", "cpu", ALL_OPS - COLLECTIVE_OPS, options=(("impl", ("plain", "tiled")),),
                               choice_ops=(ChoiceScope("impl", "tiled", frozenset({"lightning_core"}),
                                                       why="tiles of the linear kernel"),))
    assert scoped.choice_refusal("gqa_attention", {"impl": "tiled"}) == (
        "impl=tiled serves hgc.lightning_core only, not hgc.gqa_attention (tiles of the linear kernel)")
    assert scoped.choice_refusal("lightning_core", {"impl": "tiled"}) is None
    assert scoped.choice_refusal("gqa_attention", {}) is None  # the default serves every op
    assert BackendCapability.from_json(scoped.to_json()) == scoped
    table = CapabilityTable([CPU_ALL, scoped])
    routed = _entries(_route_plan(["lightning_core=scoped[impl=tiled]"], table))
    assert routed["lightning_core"]["options"] == {"impl": "tiled"}
    with pytest.raises(PassError, match=r"node gqa_attention \(layer 1, kind full_gqa\): route layers=1:scoped\[impl=tiled\] "
                                        r"sends hgc.gqa_attention to scoped, whose impl=tiled serves hgc.lightning_core "
                                        r"only, not hgc.gqa_attention \(tiles of the linear kernel\); fix: route this "
                                        r"layer without that choice"):
        _route_plan(["layers=1:scoped[impl=tiled]"], table)
    with pytest.raises(CapabilityError, match="names no choice of its options but their defaults"):
        BackendCapability("x", "cpu", ALL_OPS, options=(("impl", ("plain", "tiled")),),
                          choice_ops=(ChoiceScope("impl", "plain", frozenset({"gdn_core"})),))
    with pytest.raises(CapabilityError, match=r"names ops \['gdn_core'\] it does not declare"):
        BackendCapability("x", "cpu", FULL_OPS, options=(("impl", ("plain", "tiled")),),
                          choice_ops=(ChoiceScope("impl", "tiled", frozenset({"gdn_core"})),))


def test_option_dtypes_let_a_backend_run_more_dtypes_under_some_kernel_options():
    """`option_dtypes`: FlashInfer's GQA runs float32 where every step is on the Triton kernels. The
    refusal reads the node's kernel options (a route's; unset ones their defaults) and, where it
    refuses, says under which options the dtype would run; declarations are checked."""
    from compiler.splitops import OptionDtypes
    gqa = LayerKind.FULL_GQA
    cap = BackendCapability("fi", "cuda", FULL_OPS, dtypes=frozenset({"bfloat16"}),
                            options=(("extend", ("library", "ours")), ("decode", ("ours", "library"))),
                            option_dtypes=(OptionDtypes("gqa_attention", frozenset({"float32"}),
                                                        when=(("extend", "ours"), ("decode", "ours"))),))
    assert cap.refusal("gqa_attention", gqa, "float32") == (
        "runs dtypes ['bfloat16'], not float32 (hgc.gqa_attention runs float32 with extend=ours, decode=ours)")
    assert cap.refusal("gqa_attention", gqa, "float32", options={"extend": "ours"}) is None
    assert cap.refusal("gqa_attention", gqa, "float32", options={"extend": "ours", "decode": "library"}) is not None
    assert cap.refusal("mla_attention", LayerKind.FULL_MLA, "float32", options={"extend": "ours"}) == (
        "runs dtypes ['bfloat16'], not float32")
    assert cap.refusal("gqa_attention", gqa, "float16", options={"extend": "ours"}) == "runs dtypes ['bfloat16'], not float16"
    assert BackendCapability.from_json(cap.to_json()) == cap
    with pytest.raises(CapabilityError, match="option dtypes of gqa_attention name extend=fast"):
        BackendCapability("x", "cuda", FULL_OPS, options=(("extend", ("library", "ours")),),
                          option_dtypes=(OptionDtypes("gqa_attention", frozenset({"float32"}), (("extend", "fast"),)),))
    with pytest.raises(CapabilityError, match=r"option dtypes of 'gdn_core', an op it does not declare"):
        BackendCapability("x", "cuda", FULL_OPS, option_dtypes=(OptionDtypes("gdn_core", frozenset({"float32"}), ()),))
    with pytest.raises(CapabilityError, match=r"\['float64'\] are not among"):
        OptionDtypes("gqa_attention", frozenset({"float64"}), ())


def test_capability_declarations_are_checked():
    with pytest.raises(CapabilityError, match="outside the vocabulary"):
        BackendCapability("x", "cpu", frozenset({"flash_attention"}))
    with pytest.raises(CapabilityError, match="capturable in modes it does not support"):
        BackendCapability("x", "cpu", ALL_OPS, modes_supported=frozenset({Mode.DECODE}),
                          modes_capturable=frozenset({Mode.EXTEND}))
    with pytest.raises(CapabilityError, match="two backends"):
        CapabilityTable([BackendCapability("x", "cpu", ALL_OPS), BackendCapability("x", "cuda", ALL_OPS)])
    with pytest.raises(CapabilityError, match=r"dtypes \['float64'\] are not among"):
        BackendCapability("x", "cpu", ALL_OPS, dtypes=frozenset({"float64"}))
    with pytest.raises(CapabilityError, match="shape limits on ops it does not declare"):
        BackendCapability("x", "cpu", FULL_OPS, limits=(ShapeLimit("gdn_core", "q", -1, frozenset({64})),))
    with pytest.raises(CapabilityError, match="needs distinct choices"):
        BackendCapability("x", "cpu", ALL_OPS, options=(("impl", ("a", "a")),))


def test_capability_refusals_name_what_the_backend_lacks():
    cap = BackendCapability("fi", "cuda", FULL_OPS, kinds=frozenset({LayerKind.FULL_GQA}),
                            dtypes=frozenset({"bfloat16"}),
                            limits=(ShapeLimit("gqa_attention", "q", -1, frozenset({64, 128}), why="kernels"),),
                            options=(("impl", ("fast", "safe")),))
    gqa = LayerKind.FULL_GQA
    assert cap.refusal("gqa_attention", gqa, "bfloat16", {"q": (None, 4, 64)}) is None
    assert "does not implement hgc.gdn_core" in cap.refusal("gdn_core", LayerKind.GDN, "bfloat16")
    assert "serves ['full_gqa'] layers, not full_mla" in cap.refusal("mla_attention", LayerKind.FULL_MLA, "bfloat16")
    assert "runs dtypes ['bfloat16'], not float32" in cap.refusal("gqa_attention", gqa, "float32")
    assert cap.refusal("gqa_attention", gqa, "bfloat16", {"q": (None, 4, 32)}) == \
        "q dim -1 is 32, it takes [64, 128] (kernels)"
    pow2 = ShapeLimit("gqa_attention", "q", -1, power_of_two=True)
    assert pow2.refusal(48) == "q dim -1 is 48, it takes powers of two" and pow2.refusal(None) is None
    assert cap.resolve_options({}) == {"impl": "fast"} and cap.resolve_options({"impl": "safe"}) == {"impl": "safe"}
    with pytest.raises(CapabilityError, match=r"option impl takes fast\|safe, not 'slow'"):
        cap.resolve_options({"impl": "slow"})
    with pytest.raises(CapabilityError, match="has no option 'tiles'"):
        cap.resolve_options({"tiles": "8"})
    assert BackendCapability.from_json(cap.to_json()) == cap


def test_the_reference_backends_declare_every_op_and_their_capture():
    """The CPU reference may sit in captured pieces (on the CPU a captured piece is rerun, nothing is
    frozen), so CPU plans follow the op policies, but for GQA and MLA attention and KDA in extend
    and mixed steps, which their policies leave to the backend and the CPU keeps eager (the CPU
    plans as they were);
    the same math on cuda captures nothing and is bound only by a route (never a silent slow
    fallback). The collectives are torch.distributed's: gloo on the CPU, NCCL on cuda, both capturable."""
    from runtime.backends import discover
    table = discover().capability_table()
    cpu, cuda = table["cpu_reference"], table["torch_reference"]
    assert cpu.device == "cpu" and cpu.ops == ALL_OPS - COLLECTIVE_OPS and not cpu.explicit_only
    assert set(cpu.modes_supported) == set(MODES)
    for op in cpu.ops:
        kept_eager = op in ("gqa_attention", "mla_attention", "kda_core")
        want = [m.value for m in MODES if not kept_eager or m in (Mode.DECODE, Mode.TARGET_VERIFY)]
        assert cpu.capturable_modes(op) == want, op
    assert cuda.device == "cuda" and cuda.ops == ALL_OPS - COLLECTIVE_OPS and cuda.explicit_only
    assert not cuda.modes_capturable
    for name, device in (("gloo", "cpu"), ("nccl", "cuda")):
        assert table[name].device == device and table[name].ops == COLLECTIVE_OPS
        assert set(table[name].modes_capturable) == set(MODES)
    assert table.candidates("gdn_core", LayerKind.GDN, "cuda")[0].name == "triton_linear"
    assert "torch_reference" not in [c.name for c in table.candidates("gqa_attention", LayerKind.FULL_GQA, "cuda")]


def test_small_all_reduces_go_to_symmetric_memory_and_gathers_and_float16_to_nccl():
    """On cuda the one-shot symmetric-memory all-reduce outranks NCCL for all_reduce (decode's
    all-reduces are a few KiB: latency, not bandwidth); it declares no gather, and its kernel takes
    float32 and bfloat16 only, so a float16 all-reduce and every gather are NCCL's."""
    from runtime.backends import discover

    table = discover().capability_table()
    assert [c.name for c in table.candidates("all_reduce", None, "cuda")] == ["symm_mem", "nccl"]
    assert [c.name for c in table.candidates("all_gather", None, "cuda")] == ["nccl"]
    symm = table["symm_mem"]
    assert symm.refusal("all_reduce", None, "bfloat16", {"out": (None, 2048)}) is None
    assert "float16" in symm.refusal("all_reduce", None, "float16", {"out": (None, 2048)})
    assert table["nccl"].refusal("all_reduce", None, "float16", {"out": (None, 2048)}) is None


# -- split -----------------------------------------------------------------------------------------------------


def test_split_decode_is_one_captured_piece_extend_has_gaps_at_host_planned_ops():
    """Attention plans its extend kernels on the host: a gap. Lightning's policy allows capture in
    extend (a table-driven core) and the CPU reference captures every mode, so it stays captured."""
    result = toy_plan(layers=["lightning", "full_gqa", "lightning"], moe=[False, True, False])
    plans = result.ctx.split_plans["main"]
    for mode in (Mode.DECODE, Mode.TARGET_VERIFY):
        assert [p.kind for p in plans[mode].pieces] == [CAPTURED]
    for mode in (Mode.EXTEND, Mode.MIXED):
        kinds = [p.kind for p in plans[mode].pieces]
        assert kinds == [CAPTURED, EAGER, CAPTURED]
        gaps = [p.nodes for p in plans[mode].pieces if p.kind == EAGER]
        assert gaps == [("gqa_attention",)]  # moe and both lightning cores stay captured


def test_split_records_the_piece_of_each_node():
    result = toy_plan()
    gm = result.ctx.programs["main"]
    pieces = {n.name: n.meta["hgc.piece"] for n in gm.graph.nodes if n.name in ("lightning_core", "gqa_attention")}
    assert pieces["gqa_attention"] == {"decode": 0, "extend": 1, "mixed": 1, "target_verify": 0}
    assert pieces["lightning_core"] == {"decode": 0, "extend": 0, "mixed": 0, "target_verify": 0}


class _TwoOps(nn.Module):
    """Two op cores back to back with nothing between them: their gaps must merge (MLA attention on
    the CPU reference, which keeps it eager in extend; shapes do not matter to the trace)."""

    def __init__(self):
        super().__init__()
        self.decay = nn.Parameter(torch.zeros(H))

    def forward(self, q, k, v):
        a, b = torch.empty_like(q), torch.empty_like(q)
        latent = k[:, 0]
        TRACED_OPS.mla_attention(q, v, latent, latent, a, 0, 1.0)
        TRACED_OPS.mla_attention(q, v, latent, latent, b, 1, 1.0)
        return a + b


def _two_ops_gm():
    q = torch.zeros(5, H, HD)
    dim = torch.export.Dim("T", min=1)
    ep = torch.export.export(_TwoOps(), (q, q.clone(), q.clone()), dynamic_shapes=({0: dim}, {0: dim}, {0: dim}),
                             strict=False)
    for node in _op_nodes(ep.graph_module):
        node.meta["hgc.backend"] = "cpu_reference"
    return ep.graph_module


def _two_ops_extend_plan(gm) -> SplitPlan:
    from runtime.backends import discover
    return plan_for_mode(gm, Mode.EXTEND, discover().capability_table())


def test_split_merges_adjacent_eager_ops_into_one_gap():
    gm = _two_ops_gm()
    plan = _two_ops_extend_plan(gm)
    assert [p.kind for p in plan.pieces] == [CAPTURED, EAGER, CAPTURED]
    assert plan.pieces[1].nodes == ("mla_attention", "mla_attention_1")


def test_apply_split_plan_keeps_graph_order_and_only_op_cores_in_gaps():
    gm = _two_ops_gm()
    plan = _two_ops_extend_plan(gm)
    split = apply_split_plan(gm, plan)
    subs = [n.target for n in split.graph.nodes if n.op == "call_module"]
    assert subs == ["submod_0", "submod_1", "submod_2"]
    gap_ops = [n for n in getattr(split, "submod_1").graph.nodes if n.op == "call_function"]
    assert [str(n.target) for n in gap_ops] == ["hgc.mla_attention.default"] * 2
    before = len(_op_nodes(gm))
    after = sum(len(_op_nodes(getattr(split, s))) for s in subs)
    assert before == after == 2
    assert not any(hasattr(n, "_fx_partition") for n in gm.graph.nodes)  # the source graph is untouched


def test_apply_split_plan_refuses_a_plan_for_another_graph():
    gm = _two_ops_gm()
    plan = _two_ops_extend_plan(gm)
    stale = SplitPlan(plan.mode, plan.pieces[:-1])
    with pytest.raises(ArtifactFormatError, match="does not match the graph"):
        apply_split_plan(gm, stale)
    shuffled = SplitPlan(plan.mode, (Piece(0, CAPTURED, plan.pieces[2].nodes), Piece(1, EAGER, plan.pieces[1].nodes),
                                     Piece(2, CAPTURED, plan.pieces[0].nodes)))
    with pytest.raises(ArtifactFormatError, match="pieces must follow graph order"):
        apply_split_plan(gm, shuffled)


def test_split_plans_round_trip_through_split_json():
    result = toy_plan(draft=True)
    plans = result.ctx.split_plans
    assert parse_split_doc(split_doc(plans)) == plans


def test_split_ensures_catches_a_broken_plan():
    class BadSplit(SplitPass):
        def __call__(self, gm, ctx):
            out = super().__call__(gm, ctx)
            plan = ctx.split_plans[ctx.program][Mode.EXTEND]
            merged = Piece(0, EAGER, tuple(n for p in plan.pieces for n in p.nodes))
            ctx.split_plans[ctx.program][Mode.EXTEND] = SplitPlan(Mode.EXTEND, (merged,))
            return out

    ctx = _ctx()
    from compiler.passes.annotate import AnnotateOpsPass
    from compiler.passes.routing import RoutingPass
    with pytest.raises(PassError, match="eager piece 0 holds non-op-core nodes"):
        PassManager([AnnotateOpsPass(), RoutingPass(), BadSplit()]).run(ctx)


def test_split_requires_routing_first():
    ctx = _ctx()
    from compiler.passes.annotate import AnnotateOpsPass
    with pytest.raises(PassError, match="the routing pass must run first"):
        PassManager([AnnotateOpsPass(), SplitPass()]).run(ctx)


# -- dumps ----------------------------------------------------------------------------------------------------


def test_dumps_per_pass_are_valid_onnx_with_layer_ids(tmp_path):
    traced = toy_traced(layers=["lightning", "full_gqa"], moe=[False, True], draft=True)
    run_passes(traced, CompileConfig(), toolchain(), dump_dir=tmp_path)
    names = sorted(p.name for p in tmp_path.iterdir() if p.is_file())
    assert names[:3] == ["00_export.onnx", "00_export.svg", "00_export.txt"]
    assert "05_split.onnx" in names and (tmp_path / "draft" / "05_split.onnx").is_file()
    for path in list(tmp_path.rglob("*.onnx")):
        onnx.checker.check_model(onnx.load(str(path)))
    model = onnx.load(str(tmp_path / "04_routing.onnx"))
    ops = {n.name: {a.name: onnx.helper.get_attribute_value(a) for a in n.attribute}
           for n in model.graph.node if n.domain == "hgc"}
    assert ops["L0/lightning_core/lightning_core"]["layer_id"] == 0
    assert ops["L1/moe/moe"]["op"] == b"moe" and ops["L1/moe/moe"]["backend"] == b"cpu_reference"
    split = onnx.load(str(tmp_path / "05_split.onnx"))
    # extend: the attention core is the one gap (the lightning core is captured with its glue)
    assert [f.name for f in split.functions] == ["piece_0_captured", "piece_1_eager", "piece_2_captured"]
    gap = next(f for f in split.functions if f.name == "piece_1_eager")
    assert [(n.domain, n.op_type) for n in gap.node] == [("hgc", "gqa_attention")]
    text = (tmp_path / "05_split.txt").read_text()
    assert "# ---- piece 1: eager (extend) ----" in text and "-> cpu_reference" in text
    picture = (tmp_path / "05_split.svg").read_text()
    assert picture.startswith("<svg") and "main program" in picture and "draft program" in picture
    assert not (tmp_path / "draft" / "05_split.svg").exists()  # the draft sits beside the main program


def test_the_layer_picture_has_a_row_per_layer_and_brackets_each_captured_piece():
    from compiler.dump.layers import layer_picture, layer_rows

    traced = toy_traced(layers=["lightning", "full_gqa"], moe=[False, True], draft=True)
    ctx = run_passes(traced, CompileConfig(), toolchain()).ctx
    main, draft = (layer_rows(ctx.programs[p], ctx, p) for p in ("main", "draft"))
    assert [r.label for r in main.rows] == ["in", "0", "1", "out"] and [r.label for r in draft.rows] == ["in", "2", "out"]
    layer1 = main.rows[2]
    assert (layer1.kind, layer1.ops, layer1.backends) == ("full_gqa", ["gqa_attention", "moe"], ["cpu_reference"] * 2)
    assert layer1.states["decode"] == [CAPTURED, CAPTURED] and layer1.states["extend"] == [EAGER, CAPTURED]
    assert main.rows[1].states["extend"] == [CAPTURED]  # the lightning core: table-driven, captured
    # decode: one graph over every row; extend: two captured pieces around the eager attention core
    assert main.pieces["decode"] == [(0, 0, 3)] and [p[0] for p in main.pieces["extend"]] == [0, 2]
    svg = layer_picture([main, draft], "split")
    assert svg.count("<path") == sum(len(spans) for t in (main, draft) for spans in t.pieces.values())
    assert svg.count('fill="white">eager<') == 2 + 2  # extend and mixed: one eager core in main, one in the draft
