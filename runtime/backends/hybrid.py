"""HybridBackend: one full-attention child and one linear-attention child behind one backend.

1. `HybridBackend(full, linear)` checks both children against the protocol and builds the op
   table: every hgc op must be declared (`supported_ops`) by exactly one child, otherwise
   construction fails naming the op and what each child declares. There is no fallback child.
2. Each op method forwards to the child that declared the op, with the op's arguments unchanged.
3. Each hook of the protocol is written out below and forwarded to both children, full first.
   No `hasattr` guard: the protocol makes every hook abstract, so a child always has it, and the
   protocol's definition-time check guarantees the child accepts the arguments forwarded here.

`children` lists the children for the compiler lint that checks wrappers (every hook a child
implements must be forwarded with a signature the child accepts).

It does not decide which layers are full or linear (the LayerRegistry does; an op's kind is in
its declaration, compiler/splitops/ops.py) and it holds no state of its own.
"""

from __future__ import annotations

from compiler.splitops import OP_SPECS
from runtime.backends.protocol import OP_NAMES, BackendHooks, ProtocolError, check_backend
from runtime.context import ExecContext

__all__ = ["HybridBackend"]


class HybridBackend(BackendHooks):
    name = "hybrid"
    supported_ops = frozenset(OP_NAMES)  # each op has exactly one owner among the children, so all of them

    def __init__(self, full: BackendHooks, linear: BackendHooks):
        check_backend(full)
        check_backend(linear)
        self.full = full
        self.linear = linear
        self.children: tuple[BackendHooks, ...] = (full, linear)
        self.name = f"hybrid({full.name}, {linear.name})"
        self._owner: dict[str, BackendHooks] = {}
        problems = []
        for op in OP_NAMES:
            owners = [role for role, child in (("full", full), ("linear", linear)) if op in child.supported_ops]
            if len(owners) != 1:
                problems.append(f"hgc.{op} is declared by {' and '.join(owners) or 'neither child'}")
            else:
                self._owner[op] = full if owners[0] == "full" else linear
        if problems:
            raise ProtocolError(
                f"{self.name}: every op needs exactly one owner; {'; '.join(problems)}. "
                f"full declares {sorted(full.supported_ops)}, linear declares {sorted(linear.supported_ops)}")

    def owner_of(self, op: str) -> BackendHooks:
        return self._owner[op]

    # -- hooks: forwarded to both children ----------------------------------------------------

    def init_capture_state(self, max_tokens: int, max_seqs: int) -> None:
        """Both children allocate their static buffers."""
        self.full.init_capture_state(max_tokens, max_seqs)
        self.linear.init_capture_state(max_tokens, max_seqs)

    def init_replay_state(self, ctx: ExecContext, bucket: int) -> None:
        """Both children copy this step's metadata into their buffers for `bucket`."""
        self.full.init_replay_state(ctx, bucket)
        self.linear.init_replay_state(ctx, bucket)

    def init_step_metadata(self, ctx: ExecContext) -> None:
        """Both children plan the step."""
        self.full.init_step_metadata(ctx)
        self.linear.init_step_metadata(ctx)

    def init_chunk_metadata(self, ctx: ExecContext, chunk_size: int) -> None:
        """Both children plan chunks (the hook DESIGN.md failure 3 lost behind a hasattr guard)."""
        self.full.init_chunk_metadata(ctx, chunk_size)
        self.linear.init_chunk_metadata(ctx, chunk_size)

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

    def moe(self, ctx, x, router_weight, router_bias, w13, w2, out, layer_id, top_k, scoring, renormalize,
            routed_scale, num_groups, topk_groups):
        return self._owner["moe"].moe(ctx, x, router_weight, router_bias, w13, w2, out, layer_id, top_k, scoring,
                                      renormalize, routed_scale, num_groups, topk_groups)


_unrouted = [op for op in OP_SPECS if getattr(HybridBackend, op) is getattr(BackendHooks, op)]
assert not _unrouted, f"HybridBackend must route every op explicitly; missing {_unrouted}"
