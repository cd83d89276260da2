"""Test helpers for the engine and backend tests: a toy hybrid model, tiny family models, engines.

`ToyHybridLM` is the smallest model that exercises every cache the runtime owns: a GDN-like layer
(ops.short_conv + ops.gdn_core: conv window and recurrent state in the state pool) and a GQA layer
(ops.gqa_attention: paged K/V), twice. The family models (models/*.py) are used where they import.
"""

from __future__ import annotations

import importlib.util

import torch
import torch.nn as nn
import torch.nn.functional as F

from compiler.splitops import TRACED_OPS, LayerKind, LayerRegistry, LayerSpec, TensorSpec
from models.common import RMSNorm, apply_rotary
from models.families import FAMILY_IDS
from runtime.backends.cpu_reference import CPUReferenceBackend
from runtime.step.bound_ops import BoundOps
from runtime.engine.engine import Engine
from runtime.graphs.step_runner import EagerRunner
from runtime.cache.kv_pool import KVPool
from runtime.cache.state_pool import StatePool



class ToyGDN(nn.Module):
    def __init__(self, hidden: int, layer_id: int, hk=2, hv=4, dk=8, dv=8, conv_k=4):
        super().__init__()
        self.layer_id, self.hk, self.hv, self.dk, self.dv = layer_id, hk, hv, dk, dv
        self.channels = 2 * hk * dk + hv * dv
        self.in_proj = nn.Linear(hidden, self.channels, bias=False)
        self.ab_proj = nn.Linear(hidden, 2 * hv, bias=False)
        self.conv_weight = nn.Parameter(torch.empty(self.channels, conv_k))
        self.out_proj = nn.Linear(hv * dv, hidden, bias=False)

    def state_specs(self) -> dict[str, TensorSpec]:
        return {"recurrent": TensorSpec((self.hv, self.dk, self.dv), "float32"),
                "conv": TensorSpec((self.channels, self.conv_weight.shape[1] - 1), "float32")}

    def forward(self, x, positions, ops):
        T = x.shape[0]
        mixed = torch.empty(T, self.channels)
        ops.short_conv(self.in_proj(x), self.conv_weight, None, mixed, self.layer_id, True)
        q, k, v = mixed.split([self.hk * self.dk, self.hk * self.dk, self.hv * self.dv], dim=-1)
        q = F.normalize(q.reshape(T, self.hk, self.dk), dim=-1)
        k = F.normalize(k.reshape(T, self.hk, self.dk), dim=-1)
        a, b = self.ab_proj(x).chunk(2, dim=-1)
        out = torch.empty(T, self.hv, self.dv)
        ops.gdn_core(q, k, v.reshape(T, self.hv, self.dv), -F.softplus(a), torch.sigmoid(b), out, self.layer_id,
                     self.dk ** -0.5)
        return self.out_proj(out.reshape(T, -1))


class ToyGQA(nn.Module):
    def __init__(self, hidden: int, layer_id: int, hq=4, hkv=2, d=8):
        super().__init__()
        self.layer_id, self.hq, self.hkv, self.d = layer_id, hq, hkv, d
        self.q_proj = nn.Linear(hidden, hq * d, bias=False)
        self.k_proj = nn.Linear(hidden, hkv * d, bias=False)
        self.v_proj = nn.Linear(hidden, hkv * d, bias=False)
        self.o_proj = nn.Linear(hq * d, hidden, bias=False)

    def kv_specs(self) -> dict[str, TensorSpec]:
        return {"k": TensorSpec((self.hkv, self.d), "float32"), "v": TensorSpec((self.hkv, self.d), "float32")}

    def forward(self, x, positions, ops):
        T = x.shape[0]
        q = apply_rotary(self.q_proj(x).reshape(T, self.hq, self.d), positions, self.d, 10000.0)
        k = apply_rotary(self.k_proj(x).reshape(T, self.hkv, self.d), positions, self.d, 10000.0)
        out = torch.empty(T, self.hq, self.d)
        ops.gqa_attention(q, k, self.v_proj(x).reshape(T, self.hkv, self.d), out, self.layer_id, self.d ** -0.5)
        return self.o_proj(out.reshape(T, -1))


class ToyHybridLM(nn.Module):
    """embedding -> [GDN, GQA, GDN, GQA] (pre-norm residual) -> norm -> lm_head; float32."""

    def __init__(self, vocab: int = 96, hidden: int = 32, seed: int = 0):
        super().__init__()
        self.ops = TRACED_OPS
        self.embed = nn.Embedding(vocab, hidden)
        self.layers = nn.ModuleList([ToyGDN(hidden, 0), ToyGQA(hidden, 1), ToyGDN(hidden, 2), ToyGQA(hidden, 3)])
        self.norms = nn.ModuleList([RMSNorm(hidden) for _ in self.layers])
        self.final_norm = RMSNorm(hidden)
        self.lm_head = nn.Linear(hidden, vocab, bias=False)
        self.layer_registry = LayerRegistry(
            LayerSpec(l.layer_id, LayerKind.GDN, state=l.state_specs(), mlp="dense") if isinstance(l, ToyGDN)
            else LayerSpec(l.layer_id, LayerKind.FULL_GQA, kv=l.kv_specs(), mlp="dense")
            for l in self.layers)
        g = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            for name, p in self.named_parameters():
                if "norm" not in name:
                    # Large enough that greedy choices are far from ties.
                    p.copy_(torch.randn(p.shape, generator=g) * (1.0 if name == "embed.weight" else 0.3))

    def set_ops(self, ops) -> "ToyHybridLM":
        self.ops = ops
        return self

    def forward(self, input_ids, positions, logits_index):
        x = self.embed(input_ids)  # [T, hidden]
        for norm, layer in zip(self.norms, self.layers):
            x = x + layer(norm(x), positions, self.ops)
        return self.lm_head(self.final_norm(x[logits_index]))  # [R, vocab]


def available_families() -> list[str]:
    return [f for f in FAMILY_IDS if importlib.util.find_spec(f"models.{f}") is not None]


def build_model(name: str, seed: int = 0) -> nn.Module:
    """'toy' or a family id; tiny, float32, seeded."""
    if name == "toy":
        return ToyHybridLM(seed=seed)
    from models.families import get_family
    family = get_family(name)
    model = family.build(family.text_config(family.make_config("tiny")))
    family.init_weights(model, seed)
    return model.float().eval()


def make_pools(model, num_slots: int, num_pages: int, page_size: int = 4) -> tuple[KVPool, StatePool]:
    return KVPool(model.layer_registry, num_pages, page_size), StatePool(model.layer_registry, num_slots)


def make_engine(model, num_slots: int = 8, num_pages: int = 256, page_size: int = 4, backend_factory=None,
                **engine_kwargs) -> Engine:
    """An Engine over fresh pools, its steps eager; the model is bound to this engine's op table."""
    kv_pool, state_pool = make_pools(model, num_slots, num_pages, page_size)
    factory = backend_factory or (lambda kv, st: CPUReferenceBackend(kv, st))
    ops = BoundOps(factory(kv_pool, state_pool))
    model.set_ops(ops)
    return eager_engine(model, ops, kv_pool, state_pool, **engine_kwargs)


def eager_engine(forward, ops: BoundOps, kv_pool: KVPool, state_pool: StatePool, max_tokens_per_step: int = 512,
                 **engine_kwargs) -> Engine:
    """An Engine whose steps run `forward` eagerly over `ops` (an EagerRunner)."""
    runner = EagerRunner(forward, ops, kv_pool, engine_kwargs.get("device", "cpu"), max_tokens_per_step)
    return Engine(runner, kv_pool, state_pool, max_tokens_per_step=max_tokens_per_step, **engine_kwargs)


def prompts(count: int, lengths, vocab: int, seed: int = 1) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(2, vocab, (lengths[i % len(lengths)],), generator=g).tolist() for i in range(count)]
