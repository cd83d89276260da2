"""Every lint rule fires on a deliberately broken model or backend, and stays silent on the shipped ones.

The fixtures reproduce the incidents of DESIGN.md: a linear layer wrapped in a plain attention
module (1), a stateful kernel captured during prefill (2), an unforwarded init_mha_chunk_metadata
hook (3), a forwarded hook with an argument a child does not take (4), a draft id clashing (6).
"""

from __future__ import annotations

import dataclasses
import json

import pytest

from compiler.lints import ALL_RULES, CAPTURE_RULES, wrapper_findings
from compiler.passes.annotate import AnnotateOpsPass
from hgc.wiring import toolchain
from compiler.passes.context import CompileConfig
from compiler.passes.lints import LintPass
from compiler.passes.manager import PassManager
from compiler.passes.routing import RoutingPass, parse_route
from compiler.passes.split import SplitPass
from compiler.pipeline import make_context, plan
from compiler.splitops import OP_SPECS, Capture, Mode
from models.families import FAMILY_IDS
from compiler.splitops.capability import BackendCapability, CapabilityTable, OpCapture
from tests.compiler.test_compiler_toys import full_spec, lightning_spec, rule_ids, toy_plan, toy_traced

pytestmark = pytest.mark.usefixtures("shared_traces")  # the tiny configs traced once, compiles on copies


def _errors(result):
    return {f.rule for f in result.ctx.findings if f.severity == "error"}


def _one(result, rule):
    found = [f for f in result.ctx.findings if f.rule == rule]
    assert found, f"rule {rule} did not fire; findings: {[f.line() for f in result.ctx.findings]}"
    return found[0]


def test_every_rule_has_an_id_severity_doc_and_a_test_here():
    from pathlib import Path
    source = open(__file__).read()
    design = (Path(__file__).resolve().parents[2] / "docs" / "DESIGN.md").read_text()
    for rule in ALL_RULES:
        assert rule.id and rule.severity in ("error", "warning", "info") and rule.doc
        assert f'"{rule.id}"' in source, f"no test names rule {rule.id}"
        if rule.failure is not None:  # its messages point at that failure class of the design
            assert f"\n{rule.failure}. **" in design, f"{rule.id}: docs/DESIGN.md lists no failure {rule.failure}"


def test_the_toy_model_is_clean():
    result = toy_plan(layers=["lightning", "full_gqa"], moe=[True, False], draft=True)
    assert result.ctx.findings == [] and result.ctx.stopped_after is None


# -- registry rules ----------------------------------------------------------------------------------


def test_op_layer_unknown():
    result = toy_plan(module_ids=[0, 7])
    f = _one(result, "op-layer-unknown")
    assert f.layer_id == 7 and "layer 7" in f.message and "registry" in f.message and f.fix
    assert result.ctx.stopped_after == "lint_registry" and "main" not in result.ctx.routing


def test_op_layer_id_not_constant():
    # export refuses a SymInt layer id outright, so build the broken graph by hand: layer 0's id
    # argument becomes a value computed in the graph (the token count).
    from compiler.pipeline import run_passes
    traced = toy_traced()
    gm = traced.programs["main"].graph_module
    node = next(n for n in gm.graph.nodes if n.name == "lightning_core")
    size = next(n for n in gm.graph.nodes if n.op == "call_function" and "sym_size" in str(n.target))
    node.args = node.args[:5] + (size,) + node.args[6:]
    result = run_passes(traced, CompileConfig(), toolchain())
    f = _one(result, "op-layer-id-not-constant")
    assert f.node == "lightning_core" and "not a constant int" in f.message and "self.layer_id" in f.fix


def test_op_kind_mismatch():
    # the registry says layer 1 is a lightning layer; the model runs full attention there
    result = toy_plan(registry=[lightning_spec(0).to_json(), lightning_spec(1).to_json()])
    f = _one(result, "op-kind-mismatch")
    assert f.layer_id == 1 and "hgc.gqa_attention" in f.message and "lightning" in f.message


def test_op_kind_mismatch_moe_on_a_dense_layer():
    result = toy_plan(moe=[True, False], registry=[lightning_spec(0, mlp="dense").to_json(), full_spec(1).to_json()])
    f = _one(result, "op-kind-mismatch")
    assert "hgc.moe" in f.message and "'dense'" in f.message


def test_duplicate_layer_id():
    result = toy_plan(layers=["lightning", "lightning"], module_ids=[0, 0])
    f = _one(result, "duplicate-layer-id")
    assert f.layer_id == 0 and "share one cache" in f.message and "layers.0" in f.message and "layers.1" in f.message


def test_draft_id_clash():
    # failure 6: the MTP layer built with a main layer's id
    result = toy_plan(draft=True, draft_id=0)
    f = _one(result, "draft-id-clash")
    assert f.program == "draft" and f.layer_id == 0 and "own id" in f.fix


def test_layer_without_op():
    result = toy_plan(registry=[lightning_spec(0).to_json(), full_spec(1).to_json(), lightning_spec(2).to_json()])
    f = _one(result, "layer-without-op")
    assert f.layer_id == 2 and "lightning" in f.message
    assert _errors(result) == {"layer-without-op"}


def test_layer_without_op_moe_declared_but_missing():
    result = toy_plan(registry=[lightning_spec(0, mlp="moe").to_json(), full_spec(1).to_json()])
    assert "'moe'" in _one(result, "layer-without-op").message


def test_module_kind_mismatch_is_information_and_routing_ignores_it():
    # failure 1: a linear layer wrapped in a plain attention module
    result = toy_plan(wrap_linear=[0])
    f = _one(result, "module-kind-mismatch")
    assert f.severity == "info" and "ToyAttention" in f.message and "ToyLinearAttention" in f.message
    assert not _errors(result)
    assert result.ctx.routing["main"][0]["kind"] == "lightning"


# -- capture rules ----------------------------------------------------------------------------------------


class _NoGraphBreakSplit(SplitPass):
    """A split that never breaks the graph: the prefill plan captures everything (failure 2)."""

    def __call__(self, gm, ctx):
        result = super().__call__(gm, ctx)
        plans = ctx.split_plans[ctx.program]
        for mode in (Mode.EXTEND, Mode.MIXED):
            plans[mode] = type(plans[mode])(mode, plans[Mode.DECODE].pieces)
        return result

    def ensures(self, gm, ctx):
        pass


def test_stateful_op_captured(monkeypatch):
    # The toys' attention is GQA, whose policy leaves extend to the routed backend; an op whose
    # policy says eager there (MLA's and KDA's do) is what the rule guards: GQA with such a policy.
    eager_extend = {**OP_SPECS["gqa_attention"].policy, Mode.EXTEND: Capture.EAGER, Mode.MIXED: Capture.EAGER}
    monkeypatch.setitem(OP_SPECS, "gqa_attention", dataclasses.replace(OP_SPECS["gqa_attention"], policy=eager_extend))
    traced = toy_traced()
    ctx = make_context(traced, CompileConfig(), toolchain())
    PassManager([AnnotateOpsPass(), RoutingPass(), _NoGraphBreakSplit(), LintPass("lint_capture", CAPTURE_RULES)]).run(ctx)
    found = [f for f in ctx.findings if f.rule == "stateful-op-captured"]
    # Lightning's policy allows extend capture (a table-driven core): this attention's does not
    assert {(f.node, f.layer_id) for f in found} == {("gqa_attention", 1)}
    assert any("mode extend" in f.message for f in found) and ctx.stopped_after == "lint_capture"


def test_state_mutation_outside_ops_buffer():
    f = _one(toy_plan(buffer_state=True), "state-mutation-outside-ops")
    assert "buffer 'running'" in f.message and "in place" in f.message


def test_state_mutation_outside_ops_foreign_custom_op():
    f = _one(toy_plan(foreign_op=True), "state-mutation-outside-ops")
    assert "hgc_test_toys::fused_recurrent" in f.message and "decode" in f.message


@pytest.mark.parametrize("switch, words", [("item", ".item()"), ("mask", "data-dependent size")])
def test_host_sync_captured(switch, words):
    f = _one(toy_plan(**{switch: True}), "host-sync-captured")
    assert words in f.message and "decode" in f.message


def test_host_tensor_copied_to_the_device_in_a_captured_piece():
    """A CUDA graph cannot capture a copy from pageable host memory (seen at the first capture on an
    H200: rotary frequencies made with torch.arange on the host): an error on a cuda target only."""
    ops, modes = frozenset(OP_SPECS), frozenset(Mode)
    table = CapabilityTable([BackendCapability("cpu_reference", "cpu", ops, modes_capturable=modes),
                             BackendCapability("capturing_cuda", "cuda", ops, modes_capturable=modes)])
    f = _one(toy_plan(target="cuda", capabilities=table, host_tensor=True), "host-sync-captured")
    assert "copies a host tensor to the device" in f.message and "decode" in f.message
    assert "host-sync-captured" not in rule_ids(toy_plan(host_tensor=True)), "nothing is captured on the cpu"


def test_input_without_checkpoint_tensor():
    f = _one(toy_plan(nonpersistent=True), "input-without-checkpoint-tensor")
    assert "scale_table" in f.message


def test_backend_cannot_capture_is_a_warning_on_capturing_targets():
    ops = frozenset(OP_SPECS)
    table = CapabilityTable([BackendCapability("cpu_reference", "cpu", ops),
                             BackendCapability("slow_cuda", "cuda", ops)])
    result = toy_plan(target="cuda", capabilities=table)
    f = _one(result, "backend-cannot-capture")
    assert f.severity == "warning" and f.backend == "slow_cuda" and "decode" in f.message
    assert not _errors(result)


def _bounded_cuda(choice: str) -> CapabilityTable:
    """A cuda backend of every op that captures extend and mixed steps of up to `choice` tokens only
    (an op capture bounded by a kernel option, as FlashInfer's GQA under whole_extend_tokens)."""
    ops = frozenset(OP_SPECS)
    bounded = BackendCapability(
        "bounded_cuda", "cuda", ops, modes_capturable=frozenset({Mode.DECODE, Mode.TARGET_VERIFY}),
        op_capture=tuple(OpCapture(op, frozenset({Mode.EXTEND, Mode.MIXED}), up_to="whole_extend_tokens")
                         for op in sorted(ops)),
        options=(("whole_extend_tokens", (choice,)),))
    return CapabilityTable([BackendCapability("cpu_reference", "cpu", ops), bounded])


def test_a_capture_bounded_by_tokens_is_a_note_and_its_bound_must_be_a_bucket():
    """Captured in extend steps of up to 512 tokens: a note (whole-step graphs up to there, gaps
    above), the plans record the bound. 48, no default extend bucket: a 40-token step would run its
    eager kernel in the 64-token bucket's pieces, and the compile stops."""
    result = toy_plan(target="cuda", capabilities=_bounded_cuda("512"))
    notes = [f for f in result.ctx.findings if f.rule == "backend-cannot-capture"]
    assert notes and {f.severity for f in notes} == {"info"} and not _errors(result)
    assert all("captured in extend and mixed steps of up to 512 tokens (whole_extend_tokens=512)" in f.message
               and f.fix == "route it with another whole_extend_tokens to move the bound" for f in notes)
    plans = result.ctx.split_plans["main"]
    assert plans[Mode.EXTEND].whole_up_to == plans[Mode.MIXED].whole_up_to == 512
    assert "bounded_cuda (whole_extend_tokens=512)" in plans[Mode.EXTEND].whole_why
    f = _one(toy_plan(target="cuda", capabilities=_bounded_cuda("48")), "whole-extend-bound-off-buckets")
    assert f.severity == "error" and "up to 48 tokens" in f.message and "no extend bucket of [16, 32, 64" in f.message


class _CaptureAllSplit(SplitPass):
    """A split that plans by the op policies alone, blind to what the routed backend can capture."""

    def __call__(self, gm, ctx):
        from compiler.passes.split import plan_for_mode
        result = super().__call__(gm, ctx)
        ctx.split_plans[ctx.program] = {mode: plan_for_mode(gm, mode) for mode in ctx.split_plans[ctx.program]}
        return result

    def ensures(self, gm, ctx):
        pass


def test_captured_beyond_backend():
    """A plan that captures a node in decode although its routed backend declares no capture there:
    its kernels would be frozen into a graph (a split.json made for another routing)."""
    ops = frozenset(OP_SPECS)
    table = CapabilityTable([BackendCapability("cpu_reference", "cpu", ops, modes_capturable=frozenset(Mode)),
                             BackendCapability("uncaptured_gqa", "cpu", frozenset({"gqa_attention"}), priority=3)])
    ctx = make_context(toy_traced(), CompileConfig(routes=(parse_route("gqa_attention=uncaptured_gqa"),)),
                       toolchain())
    ctx.capabilities = table
    PassManager([AnnotateOpsPass(), RoutingPass(), _CaptureAllSplit(), LintPass("lint_capture", CAPTURE_RULES)]).run(ctx)
    found = [f for f in ctx.findings if f.rule == "captured-beyond-backend"]
    assert {(f.node, f.layer_id, f.backend) for f in found} == {("gqa_attention", 1, "uncaptured_gqa")}
    assert "mode decode" in found[0].message and ctx.stopped_after == "lint_capture"


# -- backend wrappers ---------------------------------------------------------------------------------------


class FullChild:
    def init_step_metadata(self, ctx):
        pass

    def init_mha_chunk_metadata(self, ctx, chunk_size):
        pass


class LinearChild:
    def init_step_metadata(self, ctx):
        pass

    def init_chunk_metadata(self, ctx, chunk_size):
        pass


class UnforwardedWrapper:
    """Failure 3: forgets init_mha_chunk_metadata, which the full child has."""

    children = (FullChild, LinearChild)

    def init_step_metadata(self, ctx):
        self.full.init_step_metadata(ctx)
        self.linear.init_step_metadata(ctx)

    def init_chunk_metadata(self, ctx, chunk_size):
        self.linear.init_chunk_metadata(ctx, chunk_size)


class ExtraArgWrapper:
    """Failure 4: forwards an argument the linear child does not take."""

    children = {"full": FullChild, "linear": LinearChild}

    def init_step_metadata(self, ctx):
        self.full.init_step_metadata(ctx)
        self.linear.init_step_metadata(ctx)

    def init_mha_chunk_metadata(self, ctx, chunk_size):
        self.full.init_mha_chunk_metadata(ctx, chunk_size)

    def init_chunk_metadata(self, ctx, chunk_size):
        self.linear.init_chunk_metadata(ctx, chunk_size, self.prefix_lens)


class GuardedWrapper:
    children = (FullChild, LinearChild)

    def init_step_metadata(self, ctx):
        for child in (self.full, self.linear):
            if hasattr(child, "init_step_metadata"):
                child.init_step_metadata(ctx)

    def init_mha_chunk_metadata(self, ctx, chunk_size):
        self.full.init_mha_chunk_metadata(ctx, chunk_size)

    def init_chunk_metadata(self, ctx, chunk_size):
        self.linear.init_chunk_metadata(ctx, chunk_size)


class GoodWrapper(GuardedWrapper):
    def init_step_metadata(self, ctx):
        self.full.init_step_metadata(ctx)
        self.linear.init_step_metadata(ctx)


def test_hook_not_forwarded():
    found = wrapper_findings(UnforwardedWrapper)
    f = next(f for f in found if f.rule == "hook-not-forwarded")
    assert f.severity == "error" and "init_mha_chunk_metadata" in f.message and "FullChild" in f.message
    assert f.backend == "UnforwardedWrapper"


def test_hook_not_forwarded_warns_on_hasattr_guards():
    found = wrapper_findings(GuardedWrapper)
    assert [(f.rule, f.severity) for f in found] == [("hook-not-forwarded", "warning")] * 2  # one per child
    assert "hasattr" in found[0].message


def test_hook_signature_mismatch():
    found = [f for f in wrapper_findings(ExtraArgWrapper) if f.rule == "hook-signature-mismatch"]
    assert found and all(f.severity == "error" for f in found)
    assert any("self.linear.init_chunk_metadata(ctx, chunk_size, self.prefix_lens)" in f.message and "LinearChild" in f.message
               for f in found)


def test_hook_signature_mismatch_in_the_wrapper_signature():
    class NarrowChild:
        def init_step_metadata(self, ctx):
            pass

    class WideWrapper:
        children = (NarrowChild,)

        def init_step_metadata(self, ctx, budget):
            self.child.init_step_metadata(ctx)

    found = [f for f in wrapper_findings(WideWrapper) if f.rule == "hook-signature-mismatch"]
    assert found and "budget" in found[0].message


def test_good_wrapper_and_the_real_backend_set_are_clean():
    from runtime.backends.backend_set import BackendSet
    assert wrapper_findings(GoodWrapper) == []
    assert wrapper_findings(BackendSet) == []


def test_protocol_wrapper_missing_a_hook():
    from runtime.backends.protocol import BackendHooks

    class HalfHybrid(BackendHooks):
        name = "half"

        def init_capture_state(self, max_tokens, max_seqs):
            self.full.init_capture_state(max_tokens, max_seqs)

        def init_replay_state(self, ctx, bucket):
            self.full.init_replay_state(ctx, bucket)

        def init_step_metadata(self, ctx):
            self.full.init_step_metadata(ctx)

    found = wrapper_findings(HalfHybrid)
    assert [(f.rule, "init_chunk_metadata" in f.message) for f in found] == [("hook-not-forwarded", True)]


def test_broken_wrapper_fails_the_compile_pipeline():
    result = toy_plan(wrappers=[UnforwardedWrapper])
    assert "hook-not-forwarded" in _errors(result) and result.ctx.stopped_after == "lint_capture"


# -- silent on the shipped models ------------------------------------------------------------------------------


@pytest.mark.parametrize("family", FAMILY_IDS)
def test_lints_are_silent_on_shipped_families(family, tmp_path):
    from models.families import get_family
    (tmp_path / "config.json").write_text(json.dumps(get_family(family).make_config("tiny")))
    result = plan(tmp_path, CompileConfig(), toolchain())
    assert [f.line() for f in result.ctx.findings] == []
    assert set(result.ctx.split_plans) == set(result.ctx.programs)
    assert {e["backend"] for es in result.ctx.routing.values() for e in es} == {"cpu_reference"}
