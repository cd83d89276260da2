"""The fusion pass: every Qwen GDN mixer becomes one hgc.gdn_fused node on the CPU, nothing else
does, a region that differs or a route keeps it unfused (named, with the reason), routing.json and
`hgc inspect` show the fused op, and a fused artifact computes what the unfused one does, bit for
bit in float32."""

from __future__ import annotations

import json

import pytest
import torch

from compiler.passes.context import CompileConfig
from compiler.passes.routing import RoutingError, parse_route
from compiler.pipeline import compile_checkpoint, plan
from compiler.splitops import LayerKind, op_name_of, op_nodes
from hgc import main as hgc
from hgc.wiring import toolchain
from models.families import get_family
from runtime.artifact.loader import load_artifact
from runtime.backends.cpu_reference import CPUReferenceBackend
from runtime.engine.generate import greedy_generate, make_pools
from runtime.step.bound_ops import BoundOps
from testkit.helpers import shared_artifact

pytestmark = pytest.mark.usefixtures("one_thread", "shared_traces")

QWEN = ("qwen3_next", "qwen3_5")
REGION_OPS = {"short_conv", "gdn_core"}


@pytest.fixture(scope="module")
def configs(tmp_path_factory):
    """family -> a folder holding only its tiny config.json (what a plan reads)."""
    root = tmp_path_factory.mktemp("fusion_configs")
    for family in QWEN + ("kimi_linear", "bailing_linear"):
        (root / family).mkdir()
        (root / family / "config.json").write_text(json.dumps(get_family(family).make_config("tiny")))
    return root


def _plan(folder, *routes, target="cpu", dtype="float32"):
    config = CompileConfig(target=target, dtype=dtype, routes=tuple(parse_route(r) for r in routes))
    return plan(folder, config, toolchain()).ctx


def _ops(ctx, program="main"):
    return [(op_name_of(n.target), n.meta["hgc.layer_id"]) for n in op_nodes(ctx.programs[program])]


@pytest.fixture(scope="module")
def planned(configs):
    return {family: _plan(configs / family) for family in QWEN + ("kimi_linear", "bailing_linear")}


@pytest.mark.parametrize("family", QWEN)
def test_every_gdn_layer_of_the_qwen_families_is_one_fused_node(planned, family):
    ctx = planned[family]
    gdn = [s.layer_id for s in ctx.registry if s.kind == LayerKind.GDN]
    assert gdn and [e["layer_id"] for e in ctx.fusion["main"]["fused"]] == gdn
    assert ctx.fusion["main"]["unfused"] == []
    assert not REGION_OPS & {op for op, _ in _ops(ctx)}
    fused = [n for n in op_nodes(ctx.programs["main"]) if n.meta["hgc.op"] == "gdn_fused"]
    assert [n.meta["hgc.layer_id"] for n in fused] == gdn
    for node in fused:
        assert node.meta["hgc.fused"] == "gdn" and node.meta["hgc.kind"] == "gdn"
        assert node.meta["hgc.module"].endswith("GDN") and node.meta["hgc.backend"] == "cpu_reference"
        z, out = node.args[1], node.args[8]
        assert out.meta["val"].shape == z.meta["val"].shape and out.meta["val"].is_contiguous()
    entries = [e for e in ctx.routing["main"] if e["op"] == "gdn_fused"]
    assert [e["layer_id"] for e in entries] == gdn and all(e["fused"] == "gdn" for e in entries)
    assert not ctx.errors()


@pytest.mark.parametrize("family", ["kimi_linear", "bailing_linear"])
def test_other_families_have_no_gdn_region(planned, family):
    ctx = planned[family]
    assert all(op != "gdn_fused" for op, _ in _ops(ctx))
    assert ctx.fusion["main"] == {"fused": [], "unfused": []}


def test_route_unfused_leaves_the_graph_as_exported(configs):
    from compiler import pipeline

    folder = configs / "qwen3_next"
    # the shared trace's copy: the export as traced (testkit/traces.py; test_traces.py checks a copy against it)
    exported = pipeline.trace_checkpoint(folder, "float32", toolchain().read_model).programs["main"].graph_module
    ctx = _plan(folder, "gdn_fused=unfused")
    assert [(n.name, n.target) for n in ctx.programs["main"].graph.nodes] == \
           [(n.name, n.target) for n in exported.graph.nodes]
    unfused = ctx.fusion["main"]["unfused"]
    assert [e["node"] for e in unfused] == ["gdn_core", "gdn_core_1", "gdn_core_2"]
    assert all(e["reason"] == "--route gdn_fused=unfused" for e in unfused)


def test_a_layer_route_keeps_that_layer_unfused(configs):
    ctx = _plan(configs / "qwen3_next", "layers=1:unfused")
    assert [e["layer_id"] for e in ctx.fusion["main"]["fused"]] == [0, 2]
    assert ctx.fusion["main"]["unfused"] == [{"pattern": "gdn", "node": "gdn_core_1", "layer_id": 1,
                                              "reason": "--route layers=1:unfused"}]
    assert ("short_conv", 1) in _ops(ctx) and ("gdn_fused", 1) not in _ops(ctx)


def test_unfused_is_refused_for_an_op_that_stands_for_no_region():
    with pytest.raises(RoutingError, match=r"--route 'moe=unfused'.*hgc.moe is no fused op"):
        parse_route("moe=unfused")


def _fuse_on_cuda(configs, tools, *routes):
    from compiler import pipeline
    from compiler.passes.annotate import AnnotateOpsPass
    from compiler.passes.fusion import FusionPass
    from compiler.passes.manager import PassManager
    from compiler.pipeline import make_context

    config = CompileConfig(target="cuda", dtype="bfloat16", routes=tuple(parse_route(r) for r in routes))
    traced = pipeline.trace_checkpoint(configs / "qwen3_next", "bfloat16", tools.read_model)  # the shared trace's copy
    ctx = make_context(traced, config, tools)
    PassManager([AnnotateOpsPass(), FusionPass()]).run(ctx)
    return ctx.fusion["main"]


def test_a_cuda_compile_fuses_its_gdn_layers_on_triton_linear_unless_a_route_keeps_them(configs):
    fused = _fuse_on_cuda(configs, toolchain())
    assert [e["layer_id"] for e in fused["fused"]] == [0, 1, 2] and fused["unfused"] == [], fused
    kept = _fuse_on_cuda(configs, toolchain(), "gdn_fused=unfused")
    assert kept["fused"] == [] and [e["layer_id"] for e in kept["unfused"]] == [0, 1, 2], kept


def test_a_backend_that_fuses_only_on_a_route_keeps_the_regions_without_one(configs):
    import dataclasses

    from compiler.splitops import CapabilityTable

    tools = toolchain()
    table = CapabilityTable([dataclasses.replace(c, fused_on_route=frozenset({"gdn_fused"}))
                             if c.name == "triton_linear" else c for c in tools.capabilities],
                            tools.capabilities.sources)
    kept = _fuse_on_cuda(configs, tools.with_capabilities(table))
    assert kept["fused"] == [] and [e["layer_id"] for e in kept["unfused"]] == [0, 1, 2]
    assert all(e["reason"] == "triton_linear runs hgc.gdn_fused only where a route names it "
               "(--route gdn_fused=triton_linear)" for e in kept["unfused"]), kept
    fused = _fuse_on_cuda(configs, tools.with_capabilities(table), "gdn_fused=triton_linear")
    assert [e["layer_id"] for e in fused["fused"]] == [0, 1, 2] and fused["unfused"] == [], fused


def test_a_compile_stays_unfused_where_its_linear_backend_does_not_declare_the_op(configs):
    import dataclasses

    from compiler.splitops import CapabilityTable

    tools = toolchain()
    def without_op(c):  # the declaration as it was before the backend took the op on
        return dataclasses.replace(c, ops=c.ops - {"gdn_fused"}, fused_on_route=frozenset(),
                                   op_capture=tuple(x for x in c.op_capture if x.op != "gdn_fused"),
                                   choice_ops=tuple(dataclasses.replace(x, ops=x.ops - {"gdn_fused"})
                                                    for x in c.choice_ops))

    table = CapabilityTable([without_op(c) if c.name == "triton_linear" else c for c in tools.capabilities],
                            tools.capabilities.sources)
    unfused = _fuse_on_cuda(configs, tools.with_capabilities(table))["unfused"]
    assert [e["layer_id"] for e in unfused] == [0, 1, 2]
    assert all(e["reason"] == f"triton_linear, the backend of {e['node']} on 'cuda', does not declare hgc.gdn_fused"
               for e in unfused), unfused


def _variant(change):
    """models/qwen3_next.py's region with one change: `norm` (the gated norm left out) or `gate`
    (dt_bias left out of g)."""
    import torch.nn.functional as F

    from compiler.splitops.gdn_mixer import l2norm

    def region(ops, qkv, z, b, a, conv_weight, A_log, dt_bias, norm, layer_id, k_heads, k_dim, scale):
        v_heads, v_dim = z.shape[-2], z.shape[-1]
        mixed = torch.empty_like(qkv)
        ops.short_conv(qkv, conv_weight.squeeze(1), None, mixed, layer_id, True)
        kd = k_heads * k_dim
        q, k, v = mixed.split([kd, kd, v_heads * v_dim], dim=-1)
        q, k = l2norm(q.reshape(-1, k_heads, k_dim)), l2norm(k.reshape(-1, k_heads, k_dim))
        v = v.reshape(-1, v_heads, v_dim)
        g = -A_log.float().exp() * F.softplus(a.float() + (0 if change == "gate" else dt_bias))
        core = torch.empty_like(v)
        ops.gdn_core(q, k, v, g, b.sigmoid(), core, layer_id, scale)
        return core if change == "norm" else norm(core, z)

    return region


@pytest.mark.parametrize("change", ["norm", "gate"])
def test_a_region_that_differs_is_left_unfused_and_named(configs, monkeypatch, change):
    import compiler.frontend
    import compiler.pipeline
    import models.qwen3_next

    monkeypatch.setattr(models.qwen3_next, "gdn_mixer_region", _variant(change))
    # a trace of the changed model: the module's shared traces are of the model as written
    monkeypatch.setattr(compiler.pipeline, "trace_checkpoint", compiler.frontend.trace_checkpoint)
    ctx = _plan(configs / "qwen3_next")
    assert ctx.fusion["main"]["fused"] == []
    unfused = ctx.fusion["main"]["unfused"]
    assert [e["layer_id"] for e in unfused] == [0, 1, 2]
    # the gate feeds gdn_core (paired backwards from it); the norm follows it (paired forwards)
    why = {"gate": "the inputs of {} are not those of the gdn region",
           "norm": "{}'s region differs from the gdn pattern at aten.to.dtype"}[change]
    assert all(e["reason"].startswith(why.format(e["node"])) for e in unfused), unfused
    assert {op for op, _ in _ops(ctx)} >= REGION_OPS and not ctx.errors()


def test_routing_json_and_inspect_show_the_fused_op(tmp_path_factory, capsys):
    _, art = shared_artifact(tmp_path_factory, "qwen3_next")
    routing = json.loads((art / "routing.json").read_text())
    fused = [e for e in routing["programs"]["main"] if e.get("fused")]
    assert [(e["op"], e["layer_id"], e["fused"]) for e in fused] == [("gdn_fused", i, "gdn") for i in (0, 1, 2)]
    assert hgc(["inspect", str(art)]) == 0
    rows = [line for line in capsys.readouterr().out.splitlines() if line.startswith("main ")]
    assert sum("gdn_fused=gdn" in line for line in rows) == 3
    assert "unfused" not in routing  # nothing left


def _generate(art, prompts, new_tokens):
    kv, st = make_pools(art.registry, max(map(len, prompts)) + new_tokens, len(prompts))
    ops = BoundOps(CPUReferenceBackend(kv, st))
    forward, logits = art.bind(ops), []

    def recorded(*args):
        out = forward(*args)
        logits.append(out.clone())
        return out

    return greedy_generate(recorded, ops, kv, st, prompts, new_tokens), logits


@pytest.mark.parametrize("family", QWEN)
def test_the_fused_artifact_computes_what_the_unfused_one_does(tmp_path_factory, family):
    ckpt, fused = shared_artifact(tmp_path_factory, family)
    unfused = tmp_path_factory.mktemp(f"{family}_unfused") / "art"
    compile_checkpoint(ckpt, unfused, CompileConfig(routes=(parse_route("gdn_fused=unfused"),)), toolchain(),
                       dumps=False)
    left = json.loads((unfused / "routing.json").read_text())["unfused"]["main"]
    assert [(e["layer_id"], e["reason"]) for e in left] == [(i, "--route gdn_fused=unfused") for i in (0, 1, 2)]
    fused, unfused = load_artifact(fused), load_artifact(unfused)
    assert "gdn_fused" in {e.op for e in fused.docs.routing.entries("main")}
    assert "gdn_fused" not in {e.op for e in unfused.docs.routing.entries("main")}
    prompts = [[1, 2, 3, 4, 5, 6, 7], [8, 9], [10, 11, 12]]
    tokens_f, logits_f = _generate(fused, prompts, 4)
    tokens_u, logits_u = _generate(unfused, prompts, 4)
    assert tokens_f == tokens_u
    assert len(logits_f) == len(logits_u) and all(torch.equal(f, u) for f, u in zip(logits_f, logits_u))
