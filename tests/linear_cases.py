"""Shared by the linear-kernel tests and the linear benchmarks (gpu_linear_decode.py,
gpu_linear_extend.py): ExecContexts without a KV pool (`decode_ctx`, `step_ctx`), fresh random
inputs of one step for a linear op (padding rows NaN), `FakeFLA`, FLA's chunk interface over
the reference recurrence for CPU runs of the extend path, and `interpreted_triton_linear`, the
triton_linear backend declared for the cpu device so routing can bind a CPU artifact's linear
ops to it (its kernels then run in Triton's interpreter)."""

from __future__ import annotations

import dataclasses

import torch
import torch.nn.functional as F

from compiler.splitops import Mode
from runtime.backends.cpu_reference import gated_recurrence
from runtime.backends.triton_linear_backend import TritonLinearBackend
from runtime.context import ExecContext
from runtime.state_pool import PADDING_SLOT


def decode_ctx(slots: list[int], num_real: int, device) -> ExecContext:
    """A decode step of len(slots) rows: the first num_real are requests, the rest padding."""
    B = len(slots)
    ctx = ExecContext(
        mode=Mode.DECODE, query_lens=[1] * num_real, cache_lens=[7] * num_real,
        query_start_loc=torch.tensor(list(range(num_real + 1)) + [num_real] * (B - num_real), dtype=torch.int32,
                                     device=device),
        seq_lens=torch.tensor([8] * num_real + [0] * (B - num_real), dtype=torch.int32, device=device),
        state_slots=torch.tensor(slots, dtype=torch.int64, device=device),
        page_table=torch.zeros(B, 1, dtype=torch.int32, device=device),
        slot_mapping=torch.full((B,), -1, dtype=torch.int64, device=device),
        page_size=16, num_tokens=B, num_seqs=B)
    ctx.check()
    return ctx


def random_inputs(op: str, rows: int, num_real: int, dims: tuple[int, int, int, int], conv_channels: int,
                  dtype, g: torch.Generator, k_scale: float) -> dict[str, torch.Tensor]:
    """Inputs of `op` for `rows` rows; rows from num_real on hold NaN (they must never matter).

    dims = (Hk, Hv, Dk, Dv); Lightning keys are scaled by k_scale to keep its sums O(1)."""
    hk, hv, dk, dv = dims
    r = lambda *shape: torch.randn(rows, *shape, generator=g)
    if op == "short_conv":
        x = {"x": r(conv_channels)}
    elif op == "gdn_core":
        x = {"q": F.normalize(r(hk, dk), dim=-1), "k": F.normalize(r(hk, dk), dim=-1), "v": r(hv, dv),
             "g": -F.softplus(r(hv)), "beta": torch.sigmoid(r(hv))}
    elif op == "kda_core":
        x = {"q": F.normalize(r(hv, dk), dim=-1), "k": F.normalize(r(hv, dk), dim=-1), "v": r(hv, dv),
             "g": -F.softplus(r(hv, dk)), "beta": torch.sigmoid(r(hv))}
    else:
        x = {"q": r(hv, dk), "k": r(hv, dk) * k_scale, "v": r(hv, dv)}
    for t in x.values():
        t[num_real:] = float("nan")
    return {name: t.to(dtype) for name, t in x.items()}


def step_ctx(mode: Mode, reqs: list[tuple[int, int, int]], pad_tokens: int, pad_seqs: int, device) -> ExecContext:
    """(slot, cached, new tokens) per request, padding rows and requests at the end."""
    lens = [n for *_, n in reqs]
    T, B = sum(lens) + pad_tokens, len(reqs) + pad_seqs
    qsl = [0]
    for n in lens:
        qsl.append(qsl[-1] + n)
    ctx = ExecContext(
        mode=mode, query_lens=lens, cache_lens=[c for _, c, _ in reqs],
        query_start_loc=torch.tensor(qsl + [qsl[-1]] * pad_seqs, dtype=torch.int32, device=device),
        seq_lens=torch.tensor([c + n for _, c, n in reqs] + [0] * pad_seqs, dtype=torch.int32, device=device),
        state_slots=torch.tensor([s for s, *_ in reqs] + [PADDING_SLOT] * pad_seqs, dtype=torch.int64, device=device),
        page_table=torch.zeros(B, 1, dtype=torch.int32, device=device),
        slot_mapping=torch.full((T,), -1, dtype=torch.int64, device=device),
        page_size=16, num_tokens=T, num_seqs=B)
    ctx.check()
    return ctx


class FakeFLA:
    """Stands in for FLA's chunk functions on the CPU: the reference recurrence per varlen sequence.

    It checks what the backend must pass: keyword arguments, batch 1, cu_seqlens int64 equal to
    cu_seqlens_cpu, one initial state per sequence, final states requested, no in-kernel l2norm,
    and q, k, v of one dtype (FLA's kernels tl.dot them together and refuse a mix)."""

    def __init__(self):
        self.calls = []

    def _run(self, name, *, q, k, v, scale, initial_state, output_final_state, cu_seqlens, cu_seqlens_cpu,
             g=None, beta=None, g_gamma=None, use_qk_l2norm_in_kernel=False):
        assert q.shape[0] == 1 and k.shape[0] == 1 and v.shape[0] == 1, "varlen calls use batch 1"
        assert q.dtype == k.dtype == v.dtype, f"FLA needs q, k, v of one dtype, got {q.dtype}, {k.dtype}, {v.dtype}"
        assert cu_seqlens.dtype == torch.int64 and torch.equal(cu_seqlens.cpu(), cu_seqlens_cpu)
        assert cu_seqlens_cpu.device.type == "cpu" and int(cu_seqlens_cpu[-1]) == q.shape[1]
        assert initial_state.shape[0] == len(cu_seqlens_cpu) - 1 and initial_state.dtype == torch.float32
        assert output_final_state and not use_qk_l2norm_in_kernel
        self.calls.append((name, cu_seqlens_cpu.tolist()))
        rep = v.shape[2] // q.shape[2]
        qq, kk = q[0].repeat_interleave(rep, dim=1), k[0].repeat_interleave(rep, dim=1)
        ht = initial_state.clone()
        o = torch.empty(v.shape[1:], dtype=torch.float32, device=v.device)
        bounds = cu_seqlens_cpu.tolist()
        for i, (a, b) in enumerate(zip(bounds[:-1], bounds[1:])):
            if name == "gdn":
                decay = g[0, a:b].unsqueeze(-1)
            elif name == "kda":
                decay = g[0, a:b]
            else:
                assert g is None and g_gamma is not None and g_gamma.shape == (v.shape[2],)
                decay = g_gamma.float().view(1, -1, 1)
            o[a:b] = gated_recurrence(qq[a:b], kk[a:b], v[0, a:b], decay, None if beta is None else beta[0, a:b],
                                      ht[i], scale)
        initial_state.fill_(float("nan"))  # FLA may scribble on it: the backend must not reuse it
        return o[None].to(v.dtype), ht

    def gdn(self, **kw):
        return self._run("gdn", **kw)

    def kda(self, **kw):
        return self._run("kda", **kw)

    def simple_gla(self, **kw):
        return self._run("simple_gla", **kw)


INTERPRETED_TRITON_LINEAR = "triton_linear_interpreted"


def interpreted_triton_linear(**options) -> type:
    """TritonLinearBackend declared for the "cpu" device under its own name (routing binds a node
    only to a backend of the compile target's device), built with FakeFLA for its extend path.

    options: TritonLinearBackend keyword arguments, e.g. a pinned `recurrent_config` / `conv_config`
    (the interpreter walks every program of a launch in Python: one wide tile per row is cheapest)."""

    class InterpretedTritonLinear(TritonLinearBackend):
        name = INTERPRETED_TRITON_LINEAR
        capability = dataclasses.replace(TritonLinearBackend.capability, name=name, device="cpu")

        @classmethod
        def build(cls, setup):
            return cls(setup.state_pool, fla=FakeFLA(), **options)

    return InterpretedTritonLinear
