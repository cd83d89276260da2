"""CPU reference backend: every hgc op in plain torch, the oracle for every other backend.

The collectives are torch.distributed's own calls (runtime/backends/collectives.py: gloo is their
CPU reference).

Each method takes the step's ExecContext, then the op's arguments in schema order, and writes
`out` in place. The math is written for clarity, not speed:

- requests are processed one at a time (so a request's result cannot depend on its batch),
- linear-attention cores run the recurrence token by token in float32 (so extending in chunks
  and decoding token by token execute the same arithmetic),
- attention gathers the request's pages and runs a float32 causal softmax.

In a TARGET_VERIFY step (speculative decoding: every request feeds its last token and D drafts)
the linear ops run their D + 1 tokens one at a time, as D + 1 decode steps would, and write the
state after each of the first D tokens into the state pool's intermediate entries of the
request's row (`StatePool.verify_layer`); the state after the last one goes to its slot.

A request with an in-step snapshot (ExecContext.snapshot_rows[b] = r) runs its rows in two spans,
its first r and the rest, and between them the linear ops copy the state (the slot's, as a step
ending there would leave it) into the snapshot pool at snapshot_ids[b]: the snapshot is what a
step of its first r rows alone would leave, bit for bit, and the rest runs on from it as the next
step would. The pool is the prefix cache's, given at construction (`writes_step_snapshots`).

Rows past the step's real tokens (padding) are zeroed and touch no cache or state.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from compiler.splitops import COLLECTIVE_OPS, OP_SPECS, BackendCapability, Mode, OpCapture, moe_shared_width
from compiler.splitops.gdn_mixer import gated_rms_norm, gdn_mixer_region
from compiler.splitops.shared_expert import shared_expert, swiglu_expert
from runtime.backends.protocol import BackendHooks, BackendSetup, check_backend
from runtime.step.context import ExecContext
from runtime.cache.kv_pool import KVPool, pages_for
from runtime.cache.snapshot_pool import SnapshotPool
from runtime.cache.state_pool import StatePool

__all__ = ["CPUReferenceBackend", "gated_recurrence", "moe_reference", "route_topk"]


def gated_recurrence(q, k, v, log_decay, beta, state, scale):
    """Run S_t = exp(g_t) * S_{t-1} (+ delta-rule or plain outer-product update); return outputs.

    q, k [L,H,Dk]; v [L,H,Dv]; log_decay broadcastable to [L,H,Dk]; beta [L,H] (delta rule) or
    None (plain GLA: S += k v^T); state [H,Dk,Dv] float32, updated in place. Returns [L,H,Dv] f32.
    """
    L, H, Dk = k.shape
    q, k, v = q.float(), k.float(), v.float()
    decay = torch.exp(log_decay.float()).expand(L, H, Dk)
    out = torch.empty(L, H, v.shape[-1], dtype=torch.float32, device=v.device)
    S = state.clone()
    for t in range(L):
        S = S * decay[t].unsqueeze(-1)  # [H,Dk,1]: decay acts on the key dimension
        if beta is None:
            S = S + k[t].unsqueeze(-1) * v[t].unsqueeze(-2)
        else:
            predicted = torch.einsum("hk,hkv->hv", k[t], S)
            delta = (v[t] - predicted) * beta[t].float().unsqueeze(-1)
            S = S + k[t].unsqueeze(-1) * delta.unsqueeze(-2)
        out[t] = torch.einsum("hk,hkv->hv", q[t] * scale, S)
    state.copy_(S)
    return out


def route_topk(x, router_weight, router_bias, top_k, scoring, renormalize, routed_scale, num_groups, topk_groups):
    """Router of the moe op: returns (expert ids [T,k], weights [T,k] float32)."""
    logits = F.linear(x.float(), router_weight.float())  # [T,E]
    if scoring == "softmax":
        scores = torch.softmax(logits, dim=-1)
    elif scoring == "sigmoid":
        scores = torch.sigmoid(logits)
    else:
        raise ValueError(f"moe: unknown scoring {scoring!r} (expected 'softmax' or 'sigmoid')")
    choice = scores if router_bias is None else scores + router_bias.float()
    if num_groups > 1:
        T, E = choice.shape
        grouped = choice.view(T, num_groups, E // num_groups)
        group_score = grouped.topk(min(2, E // num_groups), dim=-1).values.sum(-1)  # [T,G]
        keep = torch.zeros_like(group_score).scatter_(1, group_score.topk(topk_groups, dim=-1).indices, 1.0)
        choice = choice.masked_fill(keep.repeat_interleave(E // num_groups, dim=1) == 0, float("-inf"))
    ids = choice.topk(top_k, dim=-1).indices
    weights = scores.gather(1, ids)
    if renormalize:
        weights = weights / (weights.sum(-1, keepdim=True) + (1e-20 if scoring == "sigmoid" else 0.0))
    return ids, weights * routed_scale


def moe_reference(x, router_weight, router_bias, w13, w2, shared_w13, shared_w2, shared_gate, top_k, scoring,
                  renormalize, routed_scale, num_groups, topk_groups):
    """The moe op with a plain per-expert loop: [T,D] -> [T,D] float32 (arguments in schema order)."""
    moe_shared_width(shared_w13, shared_w2, shared_gate, x.shape[1])
    ids, weights = route_topk(x, router_weight, router_bias, top_k, scoring, renormalize, routed_scale,
                              num_groups, topk_groups)
    out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
    for e in ids.unique().tolist():
        rows, which = (ids == e).nonzero(as_tuple=True)
        y = swiglu_expert(x[rows], w13[e], w2[e])
        out.index_add_(0, rows, y * weights[rows, which].unsqueeze(-1))
    if shared_w13 is not None:
        out += shared_expert(x, shared_w13, shared_w2, shared_gate)
    return out


class _WithStep:
    """An op table over one backend's methods and one step's ExecContext (what a fused op's region calls)."""

    def __init__(self, backend, ctx):
        self.backend, self.ctx = backend, ctx

    def __getattr__(self, op: str):
        method = getattr(self.backend, op)
        return lambda *args: method(self.ctx, *args)


class CPUReferenceBackend(BackendHooks):
    """Implements every op on the CPU over a KV pool (full layers) and a state pool (linear layers).

    `supported_ops` narrows it to some ops.
    """

    name = "cpu_reference"
    # Every op in every mode, any dtype. Capturable in every mode but one op's two: on the CPU no
    # CUDA graph freezes anything, and the graph runner's CPU stand-in reruns a captured piece's ops
    # on each replay, so the CPU plans are those of the ops' policies and the runner's bookkeeping
    # (whole-step and piecewise graphs) runs in CI on them. GQA and MLA attention's and KDA's
    # policies leave extend and mixed steps to the routed backend (GPU kernels from the page table
    # or the static tables capture them); here they stay eager gaps there, so the CPU plans, and
    # every CPU artifact, are what they were.
    # The same math on a GPU is torch_reference, which declares no capture (its host loops would
    # be frozen into a CUDA graph).
    _OPS = frozenset(OP_SPECS) - COLLECTIVE_OPS
    capability = BackendCapability(
        name="cpu_reference", device="cpu", ops=_OPS, modes_capturable=frozenset({Mode.DECODE, Mode.TARGET_VERIFY}),
        op_capture=tuple(OpCapture(op, frozenset({Mode.EXTEND, Mode.MIXED}), why="the CPU stand-in reruns its ops")
                         for op in sorted(_OPS - {"gqa_attention", "mla_attention", "kda_core"})),
        doc="plain-torch reference of every op: the test oracle")

    def __init__(self, kv_pool: KVPool, state_pool: StatePool, supported_ops=None, *,
                 snapshots: SnapshotPool | None = None):
        """snapshots: the prefix cache's pool, which in-step snapshots are written to (None: caching off)."""
        self.kv_pool = kv_pool
        self.state_pool = state_pool
        self.snapshots = snapshots
        if supported_ops is not None:
            self.supported_ops = frozenset(supported_ops)
        check_backend(self)

    @classmethod
    def build(cls, setup: BackendSetup) -> "CPUReferenceBackend":
        """Over the pools alone: every op reads its layer's cache or state by layer id."""
        return cls(setup.kv_pool, setup.state_pool, snapshots=setup.snapshots)

    def writes_step_snapshots(self, snapshots) -> bool:
        """Into the pool it was built with (the module docstring says how)."""
        return snapshots is not None and snapshots is self.snapshots

    # -- hooks: the reference plans nothing, and says why ----------------------------------

    def init_capture_state(self, max_tokens: int, max_seqs: int) -> None:
        """Nothing to allocate: the reference never runs inside a captured graph."""

    def init_replay_state(self, ctx: ExecContext, bucket: int) -> None:
        """Nothing to copy: each op reads the ExecContext it is called with."""

    def init_step_metadata(self, ctx: ExecContext) -> None:
        """Nothing to plan: each op walks ctx.token_ranges() itself, one request at a time."""

    def init_chunk_metadata(self, ctx: ExecContext, chunk_size: int) -> None:
        """Nothing to plan: the recurrence and attention run over whole extends token by token."""

    # -- helpers ---------------------------------------------------------------------------

    @staticmethod
    def _zero_padding(ctx: ExecContext, out: torch.Tensor) -> None:
        if ctx.num_real_tokens < out.shape[0]:
            out[ctx.num_real_tokens:].zero_()

    def _write_kv(self, ctx: ExecContext, layer_id: int, entries: dict[str, torch.Tensor]) -> None:
        """Scatter this step's per-token entries into the layer's pages (padding rows skipped)."""
        cache = self.kv_pool.layer(layer_id)
        n = ctx.num_real_tokens
        flat_index = ctx.slot_mapping[:n].long()
        for name, values in entries.items():
            buf = cache[name]
            buf.view(-1, *buf.shape[2:])[flat_index] = values[:n].to(buf.dtype)

    def _read_kv(self, ctx: ExecContext, layer_id: int, b: int, length: int) -> dict[str, torch.Tensor]:
        """The first `length` cached entries of request b, gathered from its pages."""
        pages = ctx.page_table[b, : pages_for(length, ctx.page_size)].long()
        return {name: buf[pages].reshape(-1, *buf.shape[2:])[:length]
                for name, buf in self.kv_pool.layer(layer_id).items()}

    @staticmethod
    def _causal_softmax_attention(scores: torch.Tensor, cached: int) -> torch.Tensor:
        """scores [H,Lq,Lk] f32 for queries at positions cached..cached+Lq-1 -> probabilities."""
        Lq, Lk = scores.shape[-2:]
        q_pos = torch.arange(Lq, device=scores.device).unsqueeze(1) + cached
        mask = torch.arange(Lk, device=scores.device).unsqueeze(0) > q_pos
        return torch.softmax(scores.masked_fill(mask, float("-inf")), dim=-1)

    # -- full attention -------------------------------------------------------------------

    def gqa_attention(self, ctx, q, k, v, out, layer_id, scale):
        self._write_kv(ctx, layer_id, {"k": k, "v": v})
        Hq, Hkv = q.shape[1], k.shape[1]
        for b, start, n, cached in ctx.token_ranges():
            kv = self._read_kv(ctx, layer_id, b, cached + n)
            keys = kv["k"].float().repeat_interleave(Hq // Hkv, dim=1)  # [L,Hq,D]
            values = kv["v"].float().repeat_interleave(Hq // Hkv, dim=1)
            scores = torch.einsum("qhd,khd->hqk", q[start:start + n].float(), keys) * scale
            probs = self._causal_softmax_attention(scores, cached)
            out[start:start + n] = torch.einsum("hqk,khd->qhd", probs, values).to(out.dtype)
        self._zero_padding(ctx, out)

    def mla_attention(self, ctx, q_latent, q_rope, kv_latent, k_rope, out, layer_id, scale):
        R = kv_latent.shape[-1]
        self._write_kv(ctx, layer_id, {"latent": torch.cat([kv_latent, k_rope], dim=-1)})
        for b, start, n, cached in ctx.token_ranges():
            cache = self._read_kv(ctx, layer_id, b, cached + n)["latent"].float()  # [L, R+P]
            c, kr = cache[:, :R], cache[:, R:]
            scores = (torch.einsum("qhr,kr->hqk", q_latent[start:start + n].float(), c)
                      + torch.einsum("qhp,kp->hqk", q_rope[start:start + n].float(), kr)) * scale
            probs = self._causal_softmax_attention(scores, cached)
            out[start:start + n] = torch.einsum("hqk,kr->qhr", probs, c).to(out.dtype)
        self._zero_padding(ctx, out)

    # -- linear attention -----------------------------------------------------------------

    def _verify_states(self, ctx, layer_id: int, entry: str):
        """[rows, D, *shape] intermediate states of this entry in a TARGET_VERIFY step, else None."""
        if ctx.mode != Mode.TARGET_VERIFY or not ctx.query_lens:
            return None
        return self.state_pool.verify_layer(layer_id, max(ctx.query_lens), ctx.num_real_seqs)[entry]

    def _step_snapshots(self, ctx) -> dict[int, tuple[int, int]]:
        """Request index -> (row r, snapshot id) of the step's in-step snapshots."""
        if ctx.snapshot_rows is None:
            return {}
        rows = ctx.snapshot_rows[:ctx.num_real_seqs].tolist()
        if max(rows) < 0:
            return {}
        assert self.snapshots is not None, "cpu_reference: a step asks for in-step snapshots; built without a pool"
        return {b: (r, i) for b, (r, i) in enumerate(zip(rows, ctx.snapshot_ids[:len(rows)].tolist())) if r >= 0}

    @staticmethod
    def _token_spans(start: int, n: int, verify, snapshot_row: int | None) -> list[slice]:
        """The rows of one request as the recurrence runs them: all at once, in two spans split at
        its in-step snapshot's row, or one by one in verify."""
        if verify is not None:
            return [slice(start + t, start + t + 1) for t in range(n)]
        if snapshot_row is not None:
            return [slice(start, start + snapshot_row), slice(start + snapshot_row, start + n)]
        return [slice(start, start + n)]

    def _keep_state(self, b: int, t: int, n: int, state, verify, snapshot, layer_id: int, entry: str) -> None:
        """After span t of request b: the state after it into the verify entries or the in-step snapshot."""
        if verify is not None and t < n - 1:
            verify[b, t].copy_(state)
        if snapshot is not None and t == 0:
            self.snapshots.buffers[layer_id][entry][snapshot[1]].copy_(state)

    def _linear_core(self, ctx, layer_id, q, k, v, log_decay_rows, beta, out, scale):
        """Shared driver: per request, run the recurrence from its slot and write the slot back."""
        states = self.state_pool.layer(layer_id)["recurrent"]
        verify = self._verify_states(ctx, layer_id, "recurrent")
        snapshots = self._step_snapshots(ctx)
        for b, start, n, _ in ctx.token_ranges():
            slot = int(ctx.state_slots[b])
            S = states[slot]
            snapshot = snapshots.get(b)
            for t, rows in enumerate(self._token_spans(start, n, verify, None if snapshot is None else snapshot[0])):
                result = gated_recurrence(q[rows], k[rows], v[rows], log_decay_rows(rows),
                                          None if beta is None else beta[rows], S, scale)
                out[rows] = result.to(out.dtype)
                self._keep_state(b, t, n, S, verify, snapshot, layer_id, "recurrent")
        self._zero_padding(ctx, out)

    def gdn_core(self, ctx, q, k, v, g, beta, out, layer_id, scale):
        Hk, Hv = q.shape[1], v.shape[1]
        q = q.repeat_interleave(Hv // Hk, dim=1)  # value head h reads key head h // (Hv/Hk)
        k = k.repeat_interleave(Hv // Hk, dim=1)
        self._linear_core(ctx, layer_id, q, k, v, lambda rows: g[rows].unsqueeze(-1), beta, out, scale)

    def kda_core(self, ctx, q, k, v, g, beta, out, layer_id, scale):
        self._linear_core(ctx, layer_id, q, k, v, lambda rows: g[rows], beta, out, scale)

    def lightning_core(self, ctx, q, k, v, decay, out, layer_id, scale):
        per_head = decay.float().view(1, -1, 1)
        self._linear_core(ctx, layer_id, q, k, v, lambda rows: per_head, None, out, scale)

    def short_conv(self, ctx, x, weight, bias, out, layer_id, silu):
        states = self.state_pool.layer(layer_id)["conv"]  # [slots, C, K-1]
        verify = self._verify_states(ctx, layer_id, "conv")
        snapshots = self._step_snapshots(ctx)
        K = weight.shape[-1]
        w = weight.float()
        for b, start, n_all, _ in ctx.token_ranges():
            slot = int(ctx.state_slots[b])
            snapshot = snapshots.get(b)
            for t, rows in enumerate(self._token_spans(start, n_all, verify, None if snapshot is None else snapshot[0])):
                n = rows.stop - rows.start
                window = torch.cat([states[slot].float(), x[rows].float().t()], dim=1)  # [C, K-1+n]
                y = sum(window[:, j:j + n] * w[:, j:j + 1] for j in range(K)).t()  # [n, C]
                if bias is not None:
                    y = y + bias.float()
                out[rows] = (F.silu(y) if silu else y).to(out.dtype)
                states[slot].copy_(window[:, n:].to(states.dtype))
                self._keep_state(b, t, n_all, states[slot], verify, snapshot, layer_id, "conv")
        self._zero_padding(ctx, out)

    def gdn_fused(self, ctx, qkv, z, b, a, conv_weight, A_log, dt_bias, norm_weight, out, layer_id, k_heads, scale,
                  eps):
        # The region's own statement over this backend's short_conv and gdn_core: in float32 the
        # unfused program's values, states included, bit for bit.
        k_dim = (qkv.shape[-1] - z.shape[-2] * z.shape[-1]) // (2 * k_heads)
        y = gdn_mixer_region(_WithStep(self, ctx), qkv, z, b, a, conv_weight, A_log, dt_bias,
                             lambda x, gate: gated_rms_norm(x, gate, norm_weight, eps), layer_id, k_heads, k_dim, scale)
        out.copy_(y)

    # -- MoE ------------------------------------------------------------------------------

    def moe(self, ctx, x, router_weight, router_bias, w13, w2, shared_w13, shared_w2, shared_gate, out, layer_id,
            top_k, scoring, renormalize, routed_scale, num_groups, topk_groups):
        n = ctx.num_real_tokens if ctx is not None else x.shape[0]
        out[:n] = moe_reference(x[:n], router_weight, router_bias, w13, w2, shared_w13, shared_w2, shared_gate,
                                top_k, scoring, renormalize, routed_scale, num_groups, topk_groups).to(out.dtype)
        out[n:].zero_()


_missing = [name for name in OP_SPECS if name not in COLLECTIVE_OPS and getattr(getattr(CPUReferenceBackend, name), "_hgc_protocol_stub", False)]
assert not _missing, f"the CPU reference backend must implement every op but the collectives; missing {_missing}"
