"""HybridBackend: any number of child backends (full attention, linear attention, MoE, ...) behind one backend.

1. `HybridBackend(*children)` (for example `HybridBackend(full, linear, moe)`) checks every child
   against the protocol and builds the op table: every hgc op must be declared (`supported_ops`)
   by exactly one child, otherwise construction fails naming the op and what each child
   declares. There is no fallback child, and a child that owns no op is refused (a hook forwarded
   to a backend that serves nothing is a mistake in the composition, not a harmless extra).
2. Each op method forwards to the child that declared the op, with the op's arguments unchanged.
3. Each hook of the protocol is written out below and forwarded to every child, in the order the
   children were given (`init_replay_state` only to the children whose declared capability
   captures the step's mode: in a piecewise step the others run in the eager gaps). No `hasattr`
   guard: the protocol makes every hook abstract, so a child always has it, and the protocol's
   definition-time check guarantees the child accepts the arguments forwarded here.

`children` lists the children for the compiler lint that checks wrappers (every hook a child
implements must be forwarded with a signature the child accepts). Error messages name each child
by the role its ops give it ("full", "linear", or its ops when it serves no layer kind, e.g. "moe").

It does not decide which layers are full or linear (the LayerRegistry does; an op's kind is in
its declaration, compiler/splitops/ops.py) and it holds no state of its own.
"""

from __future__ import annotations

from compiler.splitops import FULL_KINDS, LINEAR_KINDS, OP_SPECS, Mode
from runtime.backends.protocol import OP_NAMES, BackendHooks, ProtocolError, check_backend
from runtime.context import ExecContext

__all__ = ["HybridBackend"]


def _role(child: BackendHooks) -> str:
    """What a child is for, from the ops it declares: 'full', 'linear', 'full+linear' or its ops."""
    kinds = frozenset().union(*(OP_SPECS[op].kinds for op in child.supported_ops)) if child.supported_ops \
        else frozenset()
    roles = [r for r, ks in (("full", FULL_KINDS), ("linear", LINEAR_KINDS)) if kinds & ks]
    return "+".join(roles) or "+".join(sorted(child.supported_ops)) or child.name


def _captures(child: BackendHooks, mode) -> bool:
    """Whether the child's ops may sit in a CUDA graph in `mode` (a child with no declaration: yes)."""
    capability = getattr(type(child), "capability", None)
    return capability is None or Mode(mode) in capability.modes_capturable


class HybridBackend(BackendHooks):
    name = "hybrid"
    supported_ops = frozenset(OP_NAMES)  # each op has exactly one owner among the children, so all of them

    def __init__(self, *children: BackendHooks):
        if len(children) < 2:
            raise ProtocolError(f"HybridBackend composes two or more backends (got {len(children)}); "
                                f"use a single backend directly")
        for child in children:
            check_backend(child)
        self.children: tuple[BackendHooks, ...] = tuple(children)
        # init_replay_state's receivers per mode, fixed by the children's declared capabilities
        self._capturing = {mode: tuple(c for c in children if _captures(c, mode)) for mode in Mode}
        roles = [_role(c) for c in children]
        # the same role twice (two linear children, say): tell them apart by position
        self._roles = [r if roles.count(r) == 1 else f"{r} #{i}" for i, r in enumerate(roles)]
        self.name = f"hybrid({', '.join(c.name for c in children)})"
        self._owner: dict[str, BackendHooks] = {}
        problems = []
        for op in OP_NAMES:
            owners = [i for i, child in enumerate(children) if op in child.supported_ops]
            if len(owners) != 1:
                nobody = "neither child" if len(children) == 2 else "no child"
                problems.append(f"hgc.{op} is declared by {' and '.join(self._roles[i] for i in owners) or nobody}")
            else:
                self._owner[op] = children[owners[0]]
        idle = [self._roles[i] for i, c in enumerate(children) if not c.supported_ops]
        if idle:
            problems.append(f"children {idle} declare no op")
        if problems:
            declared = "; ".join(f"{r} ({c.name}) declares {sorted(c.supported_ops)}"
                                 for r, c in zip(self._roles, children))
            raise ProtocolError(f"{self.name}: every op needs exactly one owner; {'; '.join(problems)}. {declared}")

    def owner_of(self, op: str) -> BackendHooks:
        return self._owner[op]

    # -- hooks: forwarded to every child, in order ---------------------------------------------

    def init_capture_state(self, max_tokens: int, max_seqs: int) -> None:
        """Every child allocates its static buffers."""
        for child in self.children:
            child.init_capture_state(max_tokens, max_seqs)

    def init_replay_state(self, ctx: ExecContext, bucket: int) -> None:
        """Every child whose ops are captured in this step's mode copies the step's metadata into its buffers.

        In a whole-step graph that is every child. In a piecewise step (captured pieces with eager
        gaps) a child whose capability does not capture the mode runs its ops in the gaps on the
        plan `init_step_metadata` made; its replay hook would refuse the mode (FlashInfer in an
        extend) or, worse, make it treat the eager step as a replayed one.
        """
        for child in self._capturing[Mode(ctx.mode)]:
            child.init_replay_state(ctx, bucket)

    def init_step_metadata(self, ctx: ExecContext) -> None:
        """Every child plans the step."""
        for child in self.children:
            child.init_step_metadata(ctx)

    def init_chunk_metadata(self, ctx: ExecContext, chunk_size: int) -> None:
        """Every child plans chunks (the hook DESIGN.md failure 3 lost behind a hasattr guard)."""
        for child in self.children:
            child.init_chunk_metadata(ctx, chunk_size)

    # -- ops: routed to the declaring child ---------------------------------------------------

    def gqa_attention(self, ctx, q, k, v, out, layer_id, scale):
        return self._owner["gqa_attention"].gqa_attention(ctx, q, k, v, out, layer_id, scale)

    def mla_attention(self, ctx, q_latent, q_rope, kv_latent, k_rope, out, layer_id, scale):
        return self._owner["mla_attention"].mla_attention(ctx, q_latent, q_rope, kv_latent, k_rope, out,
                                                          layer_id, scale)

    def gdn_core(self, ctx, q, k, v, g, beta, out, layer_id, scale):
        return self._owner["gdn_core"].gdn_core(ctx, q, k, v, g, beta, out, layer_id, scale)

    def kda_core(self, ctx, q, k, v, g, beta, out, layer_id, scale):
        return self._owner["kda_core"].kda_core(ctx, q, k, v, g, beta, out, layer_id, scale)

    def lightning_core(self, ctx, q, k, v, decay, out, layer_id, scale):
        return self._owner["lightning_core"].lightning_core(ctx, q, k, v, decay, out, layer_id, scale)

    def short_conv(self, ctx, x, weight, bias, out, layer_id, silu):
        return self._owner["short_conv"].short_conv(ctx, x, weight, bias, out, layer_id, silu)

    def moe(self, ctx, x, router_weight, router_bias, w13, w2, shared_w13, shared_w2, shared_gate, out, layer_id,
            top_k, scoring, renormalize, routed_scale, num_groups, topk_groups):
        return self._owner["moe"].moe(ctx, x, router_weight, router_bias, w13, w2, shared_w13, shared_w2, shared_gate,
                                      out, layer_id, top_k, scoring, renormalize, routed_scale, num_groups,
                                      topk_groups)


_unrouted = [op for op in OP_SPECS if getattr(HybridBackend, op) is getattr(BackendHooks, op)]
assert not _unrouted, f"HybridBackend must route every op explicitly; missing {_unrouted}"
