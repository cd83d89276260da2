"""Toy hybrid models for the compiler tests, with switches that break them in known ways.

`ToyLM(config)` is a HybridLM of a few layers (lightning linear attention, gated GQA full
attention, dense or MoE MLPs, an optional draft layer) calling its ops through `self.ops`, like
the real families. Config switches reproduce the failures the lints guard against:

    module_ids         the id each layer module passes to its ops (default: its index)
    registry           LayerSpec JSON overriding the registry the model reports
    wrap_linear        layer indices whose linear attention sits in a plain attention module (failure 1)
    draft_id           the id the draft module passes to its ops (default: its registry id)
    item / mask        a host read (.item()) / a boolean mask in the forward
    host_tensor        a tensor made on the host (torch.arange without a device) moved to the device
    buffer_state       a state kept in a module buffer and written in place
    foreign_op         a mutating custom op outside the hgc vocabulary
    nonpersistent      a non-persistent buffer used in the forward (no checkpoint tensor)

Other test files import from here (`from tests.compiler.test_compiler_toys import toy_traced`).
"""

from __future__ import annotations

import types

import pytest
import torch
import torch.nn as nn

from compiler.frontend import build_model, trace_model
from compiler.splitops import LayerKind, LayerRegistry, LayerSpec, TensorSpec
from models.common import HybridLM, MoEBlock, RMSNorm

D, H, HD, V, E, I = 24, 2, 8, 40, 4, 12

try:  # a custom op outside the hgc namespace that mutates an argument (defined once per process)
    torch.library.define("hgc_test_toys::fused_recurrent", "(Tensor x, Tensor(a!) state) -> ()")

    @torch.library.register_fake("hgc_test_toys::fused_recurrent")
    def _fused_recurrent_fake(x, state):
        return None
except RuntimeError:
    pass


def lightning_spec(i: int, draft: bool = False, mlp: str = "dense", module: str = "ToyLinearAttention") -> LayerSpec:
    return LayerSpec(i, LayerKind.LIGHTNING, draft=draft, mlp=mlp, module=module,
                     state={"recurrent": TensorSpec((H, HD, HD), "float32")})


def full_spec(i: int, draft: bool = False, mlp: str = "dense", module: str = "ToyAttention") -> LayerSpec:
    return LayerSpec(i, LayerKind.FULL_GQA, draft=draft, mlp=mlp, module=module,
                     kv={"k": TensorSpec((H, HD), "float32"), "v": TensorSpec((H, HD), "float32")})


class ToyLinearAttention(nn.Module):
    def __init__(self, layer_id: int):
        super().__init__()
        self.layer_id = layer_id
        self.qkv = nn.Linear(D, 3 * H * HD, bias=False)
        self.o = nn.Linear(H * HD, D, bias=False)
        self.decay = nn.Parameter(torch.full((H,), -0.5))

    def forward(self, x, ops):
        T = x.shape[0]
        q, k, v = self.qkv(x).view(T, 3, H, HD).unbind(1)
        out = torch.empty_like(q)
        ops.lightning_core(q, k, v, self.decay, out, self.layer_id, HD ** -0.5)
        return self.o(out.reshape(T, H * HD))


class ToyAttention(nn.Module):
    """Full attention; with linear=True, a linear layer wrapped in this plain attention module (failure 1)."""

    def __init__(self, layer_id: int, linear: bool = False):
        super().__init__()
        self.layer_id, self.linear = layer_id, linear
        self.qkv = nn.Linear(D, 3 * H * HD, bias=False)
        self.o = nn.Linear(H * HD, D, bias=False)
        if linear:
            self.decay = nn.Parameter(torch.full((H,), -0.5))

    def forward(self, x, ops):
        T = x.shape[0]
        q, k, v = self.qkv(x).view(T, 3, H, HD).unbind(1)
        out = torch.empty_like(q)
        if self.linear:
            ops.lightning_core(q, k, v, self.decay, out, self.layer_id, HD ** -0.5)
        else:
            ops.gqa_attention(q, k, v, out, self.layer_id, HD ** -0.5)
        return self.o(out.reshape(T, H * HD))


class ToyMLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.up = nn.Linear(D, I, bias=False)
        self.down = nn.Linear(I, D, bias=False)

    def forward(self, x, ops):
        return self.down(torch.nn.functional.silu(self.up(x)))


class ToyMoE(MoEBlock):
    def __init__(self, layer_id: int):
        super().__init__(D, I, E, layer_id, top_k=2, scoring="softmax", renormalize=True)


class ToyLayer(nn.Module):
    def __init__(self, kind: str, module_id: int, moe: bool, wrap_linear: bool):
        super().__init__()
        self.norm = RMSNorm(D)
        if kind == "lightning":
            self.attn = ToyAttention(module_id, linear=True) if wrap_linear else ToyLinearAttention(module_id)
        else:
            self.attn = ToyAttention(module_id)
        self.mlp = ToyMoE(module_id) if moe else ToyMLP()

    def forward(self, x, ops):
        x = x + self.attn(self.norm(x), ops)
        return x + self.mlp(x, ops)


class ToyDraft(nn.Module):
    """One full-attention layer fed by [embedding, main hidden]; embedding and head are the main model's."""

    def __init__(self, main: "ToyLM", layer_id: int):
        super().__init__()
        self.fc = nn.Linear(2 * D, D, bias=False)
        self.layer = ToyLayer("full_gqa", layer_id, moe=False, wrap_linear=False)
        self.__dict__["_main"] = main

    def forward(self, input_ids, positions, hidden, logits_index):
        main = self._main
        x = self.fc(torch.cat([main.embed(input_ids), hidden], dim=-1))
        x = main.norm(self.layer(x, main.ops))
        return main.head(x[logits_index]), x


class ToyLM(HybridLM):
    family = "toy"

    def __init__(self, config: dict):
        super().__init__(config)
        kinds = config.get("layers", ["lightning", "full_gqa"])
        moe = config.get("moe", [False] * len(kinds))
        ids = config.get("module_ids", list(range(len(kinds))))
        wrap = set(config.get("wrap_linear", ()))
        specs = [(lightning_spec if k == "lightning" else full_spec)(i, mlp="moe" if moe[i] else "dense")
                 for i, k in enumerate(kinds)]
        if config.get("draft"):
            specs.append(full_spec(len(kinds), draft=True))
        if "registry" in config:
            specs = [LayerSpec.from_json(s) for s in config["registry"]]
        self.layer_registry = LayerRegistry(specs)
        self.embed = nn.Embedding(V, D)
        self.layers = nn.ModuleList(ToyLayer(k, ids[i], moe[i], i in wrap) for i, k in enumerate(kinds))
        self.norm = RMSNorm(D)
        self.head = nn.Linear(D, V, bias=False)
        if config.get("draft"):
            self.mtp = ToyDraft(self, config.get("draft_id", len(kinds)))
        if config.get("buffer_state"):
            self.register_buffer("running", torch.zeros(D))
        if config.get("nonpersistent"):
            self.register_buffer("scale_table", torch.ones(D), persistent=False)

    @property
    def draft(self):
        return self.mtp if self.config.get("draft") else None

    def forward(self, input_ids, positions, logits_index):
        return self.compute_logits(self.forward_hidden(input_ids, positions), logits_index)

    def compute_logits(self, hidden, logits_index):
        return self.head(hidden[logits_index])

    def forward_hidden(self, input_ids, positions):
        x = self.embed(input_ids)
        if self.config.get("item"):
            x = x * (x.abs().max().item() + 1.0)
        if self.config.get("mask"):
            x = x[x[:, 0] > 0]
        if self.config.get("host_tensor"):
            x = x * torch.arange(D, dtype=torch.float32).to(x.device)
        if self.config.get("buffer_state"):
            self.running.add_(x.mean(0))
        if self.config.get("foreign_op"):
            scratch = torch.zeros_like(x)
            torch.ops.hgc_test_toys.fused_recurrent(x, scratch)
            x = x + scratch
        if self.config.get("nonpersistent"):
            x = x * self.scale_table
        for layer in self.layers:
            x = layer(x, self.ops)
        return self.norm(x)


TOY_FAMILY = types.SimpleNamespace(name="toy", build=ToyLM)


def toy_config(**overrides) -> dict:
    return {"model_type": "toy", "hidden_size": D, "vocab_size": V, **overrides}


def toy_traced(**overrides):
    """The toy model with `overrides`, built on the meta device and exported."""
    config = toy_config(**overrides)
    model = build_model(TOY_FAMILY, config, "float32")
    return trace_model(model, TOY_FAMILY, config, config, "float32")


def toy_plan(target: str = "cpu", capabilities=None, wrappers=None, **overrides):
    """Run the compile passes over a toy: returns the CompileResult (findings in result.ctx)."""
    from compiler.passes.context import CompileConfig
    from hgc.wiring import toolchain
    from compiler.pipeline import make_context, run_passes

    traced = toy_traced(**overrides)
    config = CompileConfig(target=target)
    ctx = make_context(traced, config, toolchain())
    if capabilities is not None:
        ctx.capabilities = capabilities
    if wrappers is not None:
        ctx.backend_wrappers = tuple(wrappers)
    return run_passes(traced, config, ctx=ctx)


def rule_ids(result, severity: str | None = None) -> set[str]:
    return {f.rule for f in result.ctx.findings if severity is None or f.severity == severity}


# -- the toys themselves --------------------------------------------------------------------------


def test_toy_exports_one_inplace_node_per_op_call():
    traced = toy_traced(layers=["lightning", "full_gqa", "lightning"], moe=[False, True, False], draft=True)
    main = [str(n.target) for n in traced.programs["main"].graph.nodes if "hgc" in str(n.target)]
    assert main == ["hgc.lightning_core.default", "hgc.gqa_attention.default", "hgc.moe.default",
                    "hgc.lightning_core.default"]
    draft = [str(n.target) for n in traced.programs["draft"].graph.nodes if "hgc" in str(n.target)]
    assert draft == ["hgc.gqa_attention.default"]
    # the ops return nothing and mutate `out`: the node has no users
    assert all(not n.users for n in traced.programs["main"].graph.nodes if "hgc" in str(n.target))


def test_toy_example_sizes_avoid_static_dims():
    traced = toy_traced(moe=[True, False])
    static = {D, H, HD, V, E, I, 3 * H * HD, H * HD, 0, 1}
    assert traced.sizes["T"] >= 2 and traced.sizes["R"] >= 2
    assert traced.sizes["T"] not in static and traced.sizes["R"] not in static
    assert traced.sizes["T"] != traced.sizes["R"]


def test_toy_weights_bind_to_checkpoint_names():
    traced = toy_traced(moe=[True, False])
    w13 = traced.tensors["layers.0.mlp.w13"]
    assert not w13.is_whole() and len(w13.views) == 2 * E
    assert traced.tensors["embed.weight"].is_whole()
    assert traced.missing == {"main": []}


@pytest.mark.parametrize("dim", ["T", "R"])
def test_toy_program_is_dynamic_in_tokens_and_rows(dim):
    traced = toy_traced()
    ep = traced.programs["main"]
    placeholder = {"T": "input_ids", "R": "logits_index"}[dim]
    node = next(n for n in ep.graph.nodes if n.name == placeholder)
    assert not isinstance(node.meta["val"].shape[0], int), f"{dim} was specialised to a constant"
