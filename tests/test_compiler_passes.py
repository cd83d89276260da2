"""Pass manager, instruments, annotate / routing / split passes, the split-plan format, dumps.

Each pass test builds a toy graph, runs the pipeline (or one pass), and checks node facts, op
counts before and after, and error messages (one test per message).
"""

from __future__ import annotations

import onnx
import pytest
import torch
import torch.nn as nn

from compiler.passes.base import CompilePass, PassError, PassResult, PreconditionError
from compiler.passes.context import CompileConfig
from compiler.passes.instruments import Instrument, TimingInstrument
from compiler.passes.manager import PassManager
from compiler.passes.routing import RoutingError
from compiler.passes.split import SplitPass, plan_for_mode
from compiler.pipeline import make_context, run_passes
from compiler.splitops import MODES, OP_SPECS, TRACED_OPS, LayerKind, Mode
from compiler.splitops.artifact import (CAPTURED, EAGER, ArtifactFormatError, Piece, SplitPlan, apply_split_plan,
                                        parse_split_doc, split_doc)
from runtime.backends.capability import BackendCapability, CapabilityError, CapabilityTable
from tests.test_compiler_toys import H, HD, toy_plan, toy_traced

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
    return make_context(traced, CompileConfig())


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
    assert names == ["annotate", "lint_registry", "routing", "split", "lint_capture"]
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
    assert info.value.ran == ["annotate", "lint_registry"]


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


def test_capability_declarations_are_checked():
    with pytest.raises(CapabilityError, match="outside the vocabulary"):
        BackendCapability("x", "cpu", frozenset({"flash_attention"}))
    with pytest.raises(CapabilityError, match="capturable in modes it does not support"):
        BackendCapability("x", "cpu", ALL_OPS, modes_supported=frozenset({Mode.DECODE}),
                          modes_capturable=frozenset({Mode.EXTEND}))
    with pytest.raises(CapabilityError, match="two backends"):
        CapabilityTable([BackendCapability("x", "cpu", ALL_OPS), BackendCapability("x", "cuda", ALL_OPS)])
    with pytest.raises(CapabilityError, match="names children"):
        CapabilityTable([BackendCapability("hybrid", "cuda", ALL_OPS, children=("a", "b"))])


def test_cpu_reference_declares_every_op_every_mode_capturable_in_none():
    from runtime.backends import capability_table
    cap = capability_table()["cpu_reference"]
    assert cap.device == "cpu" and cap.ops == ALL_OPS
    assert set(cap.modes_supported) == set(MODES) and not cap.modes_capturable


# -- split -----------------------------------------------------------------------------------------------------


def test_split_decode_is_one_captured_piece_extend_has_gaps_at_stateful_ops():
    result = toy_plan(layers=["lightning", "full_gqa", "lightning"], moe=[False, True, False])
    plans = result.ctx.split_plans["main"]
    for mode in (Mode.DECODE, Mode.TARGET_VERIFY):
        assert [p.kind for p in plans[mode].pieces] == [CAPTURED]
    for mode in (Mode.EXTEND, Mode.MIXED):
        kinds = [p.kind for p in plans[mode].pieces]
        assert kinds == [CAPTURED, EAGER, CAPTURED, EAGER, CAPTURED, EAGER, CAPTURED]
        gaps = [p.nodes for p in plans[mode].pieces if p.kind == EAGER]
        assert gaps == [("lightning_core",), ("gqa_attention",), ("lightning_core_1",)]  # moe stays captured


def test_split_records_the_piece_of_each_node():
    result = toy_plan()
    gm = result.ctx.programs["main"]
    node = next(n for n in gm.graph.nodes if n.name == "lightning_core")
    assert node.meta["hgc.piece"] == {"decode": 0, "extend": 1, "mixed": 1, "target_verify": 0}


class _TwoOps(nn.Module):
    """Two op cores back to back with nothing between them: their gaps must merge."""

    def __init__(self):
        super().__init__()
        self.decay = nn.Parameter(torch.zeros(H))

    def forward(self, q, k, v):
        a, b = torch.empty_like(q), torch.empty_like(q)
        TRACED_OPS.lightning_core(q, k, v, self.decay, a, 0, 1.0)
        TRACED_OPS.gqa_attention(q, k, v, b, 1, 1.0)
        return a + b


def _two_ops_gm():
    q = torch.zeros(5, H, HD)
    dim = torch.export.Dim("T", min=1)
    ep = torch.export.export(_TwoOps(), (q, q.clone(), q.clone()), dynamic_shapes=({0: dim}, {0: dim}, {0: dim}),
                             strict=False)
    return ep.graph_module


def test_split_merges_adjacent_eager_ops_into_one_gap():
    gm = _two_ops_gm()
    plan = plan_for_mode(gm, Mode.EXTEND)
    assert [p.kind for p in plan.pieces] == [CAPTURED, EAGER, CAPTURED]
    assert plan.pieces[1].nodes == ("lightning_core", "gqa_attention")


def test_apply_split_plan_keeps_graph_order_and_only_op_cores_in_gaps():
    gm = _two_ops_gm()
    plan = plan_for_mode(gm, Mode.EXTEND)
    split = apply_split_plan(gm, plan)
    subs = [n.target for n in split.graph.nodes if n.op == "call_module"]
    assert subs == ["submod_0", "submod_1", "submod_2"]
    gap_ops = [n for n in getattr(split, "submod_1").graph.nodes if n.op == "call_function"]
    assert [str(n.target) for n in gap_ops] == ["hgc.lightning_core.default", "hgc.gqa_attention.default"]
    before = len(_op_nodes(gm))
    after = sum(len(_op_nodes(getattr(split, s))) for s in subs)
    assert before == after == 2
    assert not any(hasattr(n, "_fx_partition") for n in gm.graph.nodes)  # the source graph is untouched


def test_apply_split_plan_refuses_a_plan_for_another_graph():
    gm = _two_ops_gm()
    plan = plan_for_mode(gm, Mode.EXTEND)
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
    run_passes(traced, CompileConfig(), dump_dir=tmp_path)
    names = sorted(p.name for p in tmp_path.iterdir() if p.is_file())
    assert names[:3] == ["00_export.onnx", "00_export.svg", "00_export.txt"]
    assert "04_split.onnx" in names and (tmp_path / "draft" / "04_split.onnx").is_file()
    for path in list(tmp_path.rglob("*.onnx")):
        onnx.checker.check_model(onnx.load(str(path)))
    model = onnx.load(str(tmp_path / "03_routing.onnx"))
    ops = {n.name: {a.name: onnx.helper.get_attribute_value(a) for a in n.attribute}
           for n in model.graph.node if n.domain == "hgc"}
    assert ops["L0/lightning_core/lightning_core"]["layer_id"] == 0
    assert ops["L1/moe/moe"]["op"] == b"moe" and ops["L1/moe/moe"]["backend"] == b"cpu_reference"
    split = onnx.load(str(tmp_path / "04_split.onnx"))
    assert [f.name for f in split.functions] == ["piece_0_captured", "piece_1_eager", "piece_2_captured",
                                                 "piece_3_eager", "piece_4_captured"]
    gap = next(f for f in split.functions if f.name == "piece_1_eager")
    assert [(n.domain, n.op_type) for n in gap.node] == [("hgc", "lightning_core")]
    text = (tmp_path / "04_split.txt").read_text()
    assert "# ---- piece 1: eager (extend) ----" in text and "-> cpu_reference" in text
    assert (tmp_path / "04_split.svg").read_text().startswith("<svg")
