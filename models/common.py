"""Building blocks shared by the model families, and the HybridLM base every family extends.

A family model is a plain nn.Module whose state-dict names are the checkpoint's tensor names,
except for weights held in a layout of their own: the MoE block's expert weights, in the `moe`
op's layout (routed experts stacked [E, 2I, D] and [E, D, I], the shared expert as [2S, D] and
[D, S]) so the whole block is one op, and sibling projections of one input stacked into one GEMM
(`FusedLinear`). Each such module knows how its family names its weights in a checkpoint.

Calling convention of every family model (flattened tokens, no batch dimension)::

    logits = model(input_ids [T] int64, positions [T] int64, logits_index [R] int64)  # [R, V]

Attention-like cores go through `self.ops` (an op table: compiler/splitops/table.py). Nothing
here holds a cache or state; the runtime owns them.

Tensor parallelism. `family.build(text_config, tp)` builds the model one rank of `tp` runs: every
quantity tensor parallelism splits (heads, MLP and expert widths, lm_head's vocabulary rows) is
divided by `tp` when the family's dimensions are read, with the one rule of
compiler/splitops/sharding.py (`split_count`, which names the layer when a count does not
divide), and the modules are built from those rank dimensions unchanged. The model states what
the compiler's sharding pass cannot see from shapes alone: tensors that fuse several projections
along one dimension (`fused_segments`, e.g. a conv over q | k | v channels), and tensors it
computes from its config that a rank takes a slice of (`computed_tensors`). Everything else (which
dimension is cut, where the all-reduces go) the pass derives; the embedding stays whole on every
rank, lm_head is cut by vocabulary rows (its logits are gathered).

Row orders. A module may hold a checkpoint tensor's rows in an order of its own (`row_orders()`:
checkpoint name -> compiler/splitops/rows.GroupedRows; Qwen3-Next's GDN projections, stored per
key head, held q | k | v | z | b | a). `checkpoint_tensors()` and `load_checkpoint_tensors()` map
them, so every reader and writer of checkpoints sees the release's layout; the compiler records
the orders beside the views of weights.json (compiler/frontend.py).
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from compiler.splitops import TRACED_OPS, GroupedRows, LayerRegistry, split_count

__all__ = ["RMSNorm", "SwiGLU", "Router", "MoEBlock", "FusedLinear", "HybridLM", "apply_rotary", "rope_inv_freq",
           "EXPERT_STYLES", "CheckpointError", "init_weights_", "ceil_div", "lm_head_rows"]


class CheckpointError(ValueError):
    """A checkpoint that cannot be loaded; the message names the file and the field or tensor."""


class RMSNorm(nn.Module):
    """RMSNorm computed in float32. `unit_offset`: scale by (1 + weight), weight stored around 0."""

    def __init__(self, dim: int, eps: float = 1e-6, unit_offset: bool = False):
        super().__init__()
        self.eps = eps
        self.unit_offset = unit_offset
        self.weight = nn.Parameter(torch.zeros(dim) if unit_offset else torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        w = self.weight.float()
        return (x * (1.0 + w) if self.unit_offset else x * w).to(dtype)


def rope_inv_freq(rotary_dim: int, theta: float, device=None) -> torch.Tensor:
    # Made on the device of the tensors it multiplies: a host tensor would be copied over on every
    # step, and a CUDA graph capture refuses that copy (lint host-sync-captured).
    return 1.0 / (theta ** (torch.arange(0, rotary_dim, 2, dtype=torch.float32, device=device) / rotary_dim))


def apply_rotary(x: torch.Tensor, positions: torch.Tensor, rotary_dim: int, theta: float,
                 interleaved: bool = False) -> torch.Tensor:
    """Rotate the first `rotary_dim` channels of x [T, H, D] by position; the rest pass through.

    interleaved=False pairs channel i with i + rotary_dim/2 (GPT-NeoX / rotate_half);
    interleaved=True pairs channels 2i and 2i+1 (GPT-J / DeepSeek `rope_interleave`).
    """
    inv_freq = rope_inv_freq(rotary_dim, theta, positions.device)
    freqs = positions.float().unsqueeze(-1) * inv_freq  # [T, rotary_dim/2]
    cos, sin = freqs.cos().unsqueeze(1), freqs.sin().unsqueeze(1)  # [T, 1, rotary_dim/2]
    rot, rest = x[..., :rotary_dim].float(), x[..., rotary_dim:]
    if interleaved:
        x1, x2 = rot[..., 0::2], rot[..., 1::2]
        rotated = torch.stack((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).flatten(-2)
        return torch.cat((rotated.to(x.dtype), rest), dim=-1)
    x1, x2 = rot[..., : rotary_dim // 2], rot[..., rotary_dim // 2:]
    # One cat of the two rotated halves (each cast on its own: the same bits) and the rest, not a cat
    # of a cat: Inductor computes a single cat of pointwise inputs in the kernel that writes it, where
    # the nested one had it keep the rotated channels (in float32) in buffers of their own, and a
    # second kernel combine and cast them (a GQA layer's glue, benchmarks/history/linear_extend.md).
    return torch.cat(((x1 * cos - x2 * sin).to(x.dtype), (x2 * cos + x1 * sin).to(x.dtype), rest), dim=-1)


class SwiGLU(nn.Module):
    """down(silu(gate(x)) * up(x)); names follow the checkpoints (gate_proj / up_proj / down_proj)."""

    def __init__(self, hidden: int, inter: int):
        super().__init__()
        self.gate_proj = nn.Linear(hidden, inter, bias=False)
        self.up_proj = nn.Linear(hidden, inter, bias=False)
        self.down_proj = nn.Linear(inter, hidden, bias=False)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class Router(nn.Module):
    """The router's weight [E, D] and, where the family has one, its selection bias [E]."""

    def __init__(self, hidden: int, num_experts: int, bias_name: str | None = None):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(num_experts, hidden))
        self.bias_name = bias_name
        if bias_name:
            self.register_parameter(bias_name, nn.Parameter(torch.zeros(num_experts, dtype=torch.float32)))

    @property
    def selection_bias(self):
        return getattr(self, self.bias_name) if self.bias_name else None


# How each family names routed expert e in a checkpoint (gate, up, down), or "fused" 3-D tensors.
EXPERT_STYLES = {
    "gate_up_down": ("experts.{e}.gate_proj.weight", "experts.{e}.up_proj.weight", "experts.{e}.down_proj.weight"),
    "w1_w3_w2": ("experts.{e}.w1.weight", "experts.{e}.w3.weight", "experts.{e}.w2.weight"),
    "fused": ("experts.gate_up_proj", None, "experts.down_proj"),
}


class MoEBlock(nn.Module):
    """The whole MoE block as one `moe` op: router, routed experts and, where the family has one,
    the shared expert (`shared_inter` wide, scaled by sigmoid of a [1, D] gate when the family's
    checkpoint has one).

    Parameters are held in the op's layout (`w13`/`w2` stacked per routed expert, `shared_w13` /
    `shared_w2` / `shared_gate` for the shared expert); `checkpoint_tensors` maps them to the
    family's checkpoint names: `shared_name` is the shared MLP's prefix (its `gate_proj`,
    `up_proj` and `down_proj` weights), `shared_gate_name` the gate's tensor (None: ungated).
    """

    # Parameters named here are written and read under checkpoint names by the block itself.
    OP_LAYOUT_PARAMS = ("w13", "w2", "shared_w13", "shared_w2", "shared_gate")

    def __init__(self, hidden: int, inter: int, num_experts: int, layer_id: int, *, top_k: int,
                 scoring: str, renormalize: bool, routed_scale: float = 1.0, num_groups: int = 1,
                 topk_groups: int = 1, router_bias: str | None = None, expert_style: str = "gate_up_down",
                 shared_inter: int = 0, shared_name: str = "shared_experts", shared_gate_name: str | None = None):
        super().__init__()
        assert expert_style in EXPERT_STYLES, f"unknown expert style {expert_style!r}"
        assert shared_inter or shared_gate_name is None, "a shared-expert gate needs a shared expert"
        self.layer_id = layer_id
        self.top_k, self.scoring, self.renormalize = top_k, scoring, renormalize
        self.routed_scale, self.num_groups, self.topk_groups = float(routed_scale), num_groups, topk_groups
        self.num_experts, self.inter, self.expert_style = num_experts, inter, expert_style
        self.gate = Router(hidden, num_experts, router_bias)
        self.w13 = nn.Parameter(torch.empty(num_experts, 2 * inter, hidden))  # gate rows, then up rows
        self.w2 = nn.Parameter(torch.empty(num_experts, hidden, inter))
        self.shared_inter, self.shared_name, self.shared_gate_name = shared_inter, shared_name, shared_gate_name
        self.shared_w13 = nn.Parameter(torch.empty(2 * shared_inter, hidden)) if shared_inter else None
        self.shared_w2 = nn.Parameter(torch.empty(hidden, shared_inter)) if shared_inter else None
        self.shared_gate = nn.Parameter(torch.empty(1, hidden)) if shared_gate_name else None

    def forward(self, x: torch.Tensor, ops) -> torch.Tensor:
        out = torch.empty_like(x)
        ops.moe(x, self.gate.weight, self.gate.selection_bias, self.w13, self.w2, self.shared_w13, self.shared_w2,
                self.shared_gate, out, self.layer_id, self.top_k, self.scoring, self.renormalize, self.routed_scale,
                self.num_groups, self.topk_groups)
        return out

    def fused_segments(self) -> dict[str, tuple[int, tuple[int, ...]]]:
        """The fused routed-expert tensor stacks gate rows then up rows along dim 1: two segments."""
        if self.expert_style != "fused":
            return {}
        return {EXPERT_STYLES["fused"][0]: (1, (self.inter, self.inter))}

    # -- checkpoint names of the op-layout weights ----------------------------------------

    def _shared_names(self, prefix: str) -> tuple[str, str, str]:
        return tuple(f"{prefix}{self.shared_name}.{proj}_proj.weight" for proj in ("gate", "up", "down"))

    def checkpoint_tensors(self, prefix: str) -> dict[str, torch.Tensor]:
        out = self._routed_checkpoint_tensors(prefix)
        if self.shared_inter:
            gate_n, up_n, down_n = self._shared_names(prefix)
            S = self.shared_inter
            out.update({gate_n: self.shared_w13[:S], up_n: self.shared_w13[S:], down_n: self.shared_w2})
        if self.shared_gate_name:
            out[prefix + self.shared_gate_name] = self.shared_gate
        return out

    def _routed_checkpoint_tensors(self, prefix: str) -> dict[str, torch.Tensor]:
        gate_n, up_n, down_n = EXPERT_STYLES[self.expert_style]
        if self.expert_style == "fused":
            return {prefix + gate_n: self.w13, prefix + down_n: self.w2}
        out = {}
        for e in range(self.num_experts):
            out[prefix + gate_n.format(e=e)] = self.w13[e, : self.inter]
            out[prefix + up_n.format(e=e)] = self.w13[e, self.inter:]
            out[prefix + down_n.format(e=e)] = self.w2[e]
        return out

    def load_checkpoint_tensors(self, prefix: str, take) -> None:
        """`take(name, shape)` returns the checkpoint tensor of that name, checked for shape."""
        D = self.w13.shape[-1]
        with torch.no_grad():
            self._load_routed(prefix, take)
            if self.shared_inter:
                gate_n, up_n, down_n = self._shared_names(prefix)
                S = self.shared_inter
                self.shared_w13[:S].copy_(take(gate_n, (S, D)))
                self.shared_w13[S:].copy_(take(up_n, (S, D)))
                self.shared_w2.copy_(take(down_n, (D, S)))
            if self.shared_gate_name:
                self.shared_gate.copy_(take(prefix + self.shared_gate_name, (1, D)))

    def _load_routed(self, prefix: str, take) -> None:
        gate_n, up_n, down_n = EXPERT_STYLES[self.expert_style]
        E, I, D = self.num_experts, self.inter, self.w13.shape[-1]
        if self.expert_style == "fused":
            self.w13.copy_(take(prefix + gate_n, (E, 2 * I, D)))
            self.w2.copy_(take(prefix + down_n, (E, D, I)))
            return
        for e in range(E):
            self.w13[e, :I].copy_(take(prefix + gate_n.format(e=e), (I, D)))
            self.w13[e, I:].copy_(take(prefix + up_n.format(e=e), (I, D)))
            self.w2[e].copy_(take(prefix + down_n.format(e=e), (D, I)))


class FusedLinear(nn.Module):
    """Several projections of one input as one GEMM: their weights stacked by rows in one
    parameter [sum(rows), in], the output split back into the parts (views of the one result).

    A decode step reads each weight once however it is stacked, so stacking saves launches: each
    GEMM of a batch-1 step is a few microseconds of launch and ramp whatever its size
    (benchmarks/history/compiled_pieces.md, "Sibling projections as one GEMM, ..."). The parts keep their names:
    part `q_proj` of the module at `...attn.in_proj` is read and written as `...attn.q_proj.weight`
    (the parent's projection, as the release names it), a row-slice view of the stack, so
    checkpoints, the artifact's weight views and the sharding of each part (a rank's rows of every
    part, cut or replicated part by part) are unchanged. The module holding the stack may keep a
    part's rows in an order of its own (`row_orders()`, module docstring): Qwen3-Next's GDN does.

    `bias`: True (every part has one), False, or the names of the parts that have one. Their biases
    are stacked the same way in one parameter; where only some parts have one, the GEMM runs
    without and each biased part adds its own (a pointwise add the compiled glue fuses with the
    part's next op), since a bias for the other rows would be a tensor the checkpoint does not have.
    """

    OP_LAYOUT_PARAMS = ("weight", "bias")  # read and written under the parts' names (checkpoint_tensors)

    def __init__(self, in_features: int, parts: dict[str, int], bias: bool | tuple[str, ...] = False):
        super().__init__()
        assert parts and all(n > 0 for n in parts.values()), f"FusedLinear needs parts with rows, got {parts}"
        self.parts = dict(parts)
        named = set(parts) if bias is True else set(bias or ())
        assert named <= set(parts), f"FusedLinear: biases {sorted(named)} for parts {list(parts)}"
        self.biased = tuple(p for p in parts if p in named)  # in part order, as the bias rows are stacked
        self.weight = nn.Parameter(torch.empty(sum(parts.values()), in_features))
        self.bias = nn.Parameter(torch.empty(sum(parts[p] for p in self.biased))) if self.biased else None

    def forward(self, x: torch.Tensor, sizes: tuple[int, ...] | None = None) -> tuple[torch.Tensor, ...]:
        """One piece per part, or split by `sizes` (a piece may span adjacent parts; every part
        or none biased)."""
        if len(self.biased) in (0, len(self.parts)):
            return F.linear(x, self.weight, self.bias).split(list(sizes or self.parts.values()), dim=-1)
        assert sizes is None, "FusedLinear: pieces spanning parts need every part or none biased"
        pieces, biases = F.linear(x, self.weight).split(list(self.parts.values()), dim=-1), iter(self._bias_rows())
        return tuple(piece + next(biases) if part in self.biased else piece
                     for part, piece in zip(self.parts, pieces))

    def _bias_rows(self):
        start = 0
        for part in self.biased:
            yield self.bias[start:start + self.parts[part]]
            start += self.parts[part]

    def _named_rows(self, prefix: str):
        """(checkpoint name prefix of each part, its weight rows, its bias rows or None)."""
        parent = prefix[:-1].rpartition(".")[0]
        parent = parent + "." if parent else ""
        biases = iter(self._bias_rows())
        weights = self.weight.split(list(self.parts.values()))
        for (part, rows), weight in zip(self.parts.items(), weights):
            yield parent + part + ".", weight, next(biases) if part in self.biased else None

    def checkpoint_tensors(self, prefix: str) -> dict[str, torch.Tensor]:
        out = {}
        for name, weight, bias in self._named_rows(prefix):
            out[name + "weight"] = weight
            if bias is not None:
                out[name + "bias"] = bias
        return out

    def load_checkpoint_tensors(self, prefix: str, take) -> None:
        with torch.no_grad():
            for name, weight, bias in self._named_rows(prefix):
                weight.copy_(take(name + "weight", tuple(weight.shape)))
                if bias is not None:
                    bias.copy_(take(name + "bias", tuple(bias.shape)))


class HybridLM(nn.Module):
    """Base of every family model: op table, registry, and checkpoint-name mapping.

    Subclasses build their modules in __init__, set `self.layer_registry`, and implement
    `forward_hidden(input_ids, positions) -> hidden [T,D]` (after the final norm) and
    `compute_logits(hidden, logits_index) -> [R,V]`; `forward` is their composition.
    A draft (MTP / NextN) module, where the family has one, is `self.draft` (None otherwise) with
    `forward(input_ids, positions, hidden, logits_index) -> (logits [R,V], hidden [T,D])`, where
    `input_ids` are the tokens one ahead of the positions whose main-model `hidden` is given.
    `set_ops` must reach the draft too.
    """

    family: str = ""

    def __init__(self, config: dict, tp: int = 1):
        super().__init__()
        self.config = config
        self.tp = tp  # the rank count this model is one rank of (1: the whole model)
        self.ops = TRACED_OPS
        self.layer_registry: LayerRegistry | None = None

    def set_ops(self, ops) -> "HybridLM":
        """Choose the op table: TRACED_OPS to export, a runtime BoundOps to run eagerly."""
        self.ops = ops
        return self

    def _self_named_blocks(self) -> dict[str, nn.Module]:
        """Modules that hold weights in an op's layout and name them in checkpoints themselves."""
        return {name + ".": m for name, m in self.named_modules() if isinstance(m, (MoEBlock, FusedLinear))}

    def checkpoint_tensors(self, held: bool = False) -> dict[str, torch.Tensor]:
        """Every tensor under its checkpoint name, in the checkpoint's layout: views of the
        parameters, except a tensor whose rows the model holds in an order of its own
        (`row_orders()`), given as a rearranged copy. `held`: every tensor a view of the
        parameters, its rows as the model holds them (what the artifact's views describe)."""
        blocks = self._self_named_blocks()
        out: dict[str, torch.Tensor] = {}
        for name, t in self.state_dict(keep_vars=True).items():
            if not _in_op_layout(name, blocks):
                out[name] = t.detach()
        for prefix, block in blocks.items():
            out.update({k: v.detach() for k, v in block.checkpoint_tensors(prefix).items()})
        if not held:
            out.update({name: rows.to_stored(out[name]) for name, rows in self.row_orders().items()})
        return out

    def checkpoint_shapes(self) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
        return {k: (tuple(v.shape), v.dtype) for k, v in self.checkpoint_tensors(held=True).items()}

    def _declared(self, method: str) -> dict:
        """What modules declare with `method()` (keyed by names under the module), by checkpoint name."""
        out = {}
        for prefix, module in self.named_modules():
            own = getattr(module, method, None)
            if module is self or own is None:
                continue
            out.update({f"{prefix}.{name}": fact for name, fact in own().items()})
        return out

    def fused_segments(self) -> dict[str, tuple[int, tuple[int, ...]]]:
        """Checkpoint name -> (dim, segment lengths) of every tensor that fuses several projections
        along one dimension (q | k | v rows, gate | up rows), in this model's shapes: a rank takes
        its part of each segment, not one contiguous block. Modules declare theirs with a
        `fused_segments()` method of their own, keyed by names under the module."""
        return self._declared("fused_segments")

    def row_orders(self) -> dict[str, GroupedRows]:
        """Checkpoint name -> the order in which the model holds the tensor's rows, for every tensor
        stored in another (module docstring), in this model's shapes. Modules declare theirs with a
        `row_orders()` method of their own, keyed by names under the module."""
        return self._declared("row_orders")

    def computed_tensors(self) -> dict[str, torch.Tensor]:
        """Checkpoint-named tensors the model computes from its config rather than reads, whole (for
        every rank), on the CPU: a rank model holds a slice of each as a buffer. Empty by default."""
        return {}

    def load_checkpoint_tensors(self, get, source: str = "checkpoint") -> None:
        """Fill every parameter from `get(name) -> tensor` (KeyError if absent), in the checkpoint's
        layout: rows the model holds in an order of its own are rearranged as they are read."""
        orders = self.row_orders()

        def take(name, shape):
            try:
                t = get(name)
            except KeyError:
                raise CheckpointError(f"{source}: missing tensor {name!r}") from None
            if tuple(t.shape) != tuple(shape):
                raise CheckpointError(f"{source}: tensor {name!r} has shape {list(t.shape)}, expected {list(shape)}")
            return orders[name].to_held(t) if name in orders else t

        blocks = self._self_named_blocks()
        with torch.no_grad():
            for name, p in self.state_dict(keep_vars=True).items():
                if _in_op_layout(name, blocks):
                    continue
                p.copy_(take(name, p.shape))
            for prefix, block in blocks.items():
                block.load_checkpoint_tensors(prefix, take)


def _in_op_layout(name: str, blocks: dict[str, nn.Module]) -> bool:
    """Whether state-dict entry `name` is an op-layout weight of a block (named in checkpoints by the block)."""
    return any(name.startswith(prefix) and name[len(prefix):] in block.OP_LAYOUT_PARAMS
               for prefix, block in blocks.items())


def init_weights_(model: nn.Module, seed: int, std: float = 0.02) -> None:
    """Seeded random weights: N(0, std) matrices, norms at their identity, A_log-like set by families.

    The values drawn for a tensor whose rows the model holds in an order of its own are taken as
    its checkpoint's rows, so a seed gives the checkpoint it gave before the model held them so
    (seeded benchmark checkpoints keep their bytes, and their tokens)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() >= 2:
                p.copy_(torch.randn(p.shape, generator=g, dtype=torch.float32) * std)
            elif "norm" in name:
                p.copy_(torch.zeros_like(p) if getattr(_owner(model, name), "unit_offset", False) else torch.ones_like(p))
            else:
                p.copy_(torch.randn(p.shape, generator=g, dtype=torch.float32) * std)
        if isinstance(model, HybridLM):
            held = model.checkpoint_tensors(held=True)
            for name, rows in model.row_orders().items():
                held[name].copy_(rows.to_held(held[name]))


def _owner(model: nn.Module, param_name: str) -> nn.Module:
    return model.get_submodule(param_name.rsplit(".", 1)[0]) if "." in param_name else model


def ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def lm_head_rows(vocab: int, tp: int) -> int:
    """lm_head's rows on one rank of `tp`: the vocabulary is split, the logits gathered after it."""
    return split_count(vocab, tp, "vocabulary rows", "lm_head")

