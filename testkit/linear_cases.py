"""Shared by the linear-kernel tests and the linear benchmarks (gpu_linear_decode.py,
gpu_linear_extend.py): ExecContexts without a KV pool (`decode_ctx`, `step_ctx`), fresh random
inputs of one step for a linear op (padding rows NaN), `FakeFLA`, FLA's chunk interface over
the reference recurrence for CPU runs of the extend path, `FakeFlashInferGdn`, FlashInfer's GDN
prefill launch over it, `interpreted_triton_linear`, the
triton_linear backend declared for the cpu device so routing can bind a CPU artifact's linear
ops to it (its kernels then run in Triton's interpreter), `check_conv_extend`, the extend
conv kernel against the reference over the request lengths that matter to it,
`conv_extend_launch`, one launch of it in a given layout (tile or row streaming), and
`captured_chunk_tables`, the chunk kernels' tables of a step padded to a captured bucket."""

from __future__ import annotations

import dataclasses

import numpy as np
import torch
import torch.nn.functional as F

from compiler.splitops import LayerKind, LayerRegistry, LayerSpec, Mode, TensorSpec
from runtime.backends.cpu_reference import CPUReferenceBackend, gated_recurrence
from runtime.backends.kernels.launch_math import cdiv, token_blocks
from runtime.backends.protocol import plan_eager_step
from runtime.backends.triton_linear import TritonLinearBackend
from runtime.step.context import ExecContext
from runtime.cache.state_pool import PADDING_SLOT, StatePool


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
    and q, k, v of one dtype (FLA's kernels tl.dot them together and refuse a mix). Like FLA's
    current entry points, gdn takes precomputed chunk indices and kda / simple_gla do not; kda also
    takes FLA 0.6's graph form (use_graph), whose rows past the real requests' it leaves NaN."""

    def __init__(self):
        self.calls = []

    def _run(self, name, *, q, k, v, scale, initial_state, output_final_state, cu_seqlens, cu_seqlens_cpu=None,
             g=None, beta=None, g_gamma=None, use_qk_l2norm_in_kernel=False, use_graph=False, max_num_seqs=None):
        assert q.shape[0] == 1 and k.shape[0] == 1 and v.shape[0] == 1, "varlen calls use batch 1"
        assert q.dtype == k.dtype == v.dtype, f"FLA needs q, k, v of one dtype, got {q.dtype}, {k.dtype}, {v.dtype}"
        assert cu_seqlens.dtype == torch.int64
        if use_graph:
            # chunk_kda's graph form: cu_seqlens on the device alone, max_num_seqs + 1 entries, the
            # requests past the real ones empty; rows past the last request's are left undefined
            assert cu_seqlens_cpu is None and max_num_seqs == len(cu_seqlens) - 1, (cu_seqlens, max_num_seqs)
            bounds = cu_seqlens.cpu().tolist()
            assert bounds[-1] <= q.shape[1]
        else:
            assert torch.equal(cu_seqlens.cpu(), cu_seqlens_cpu)
            assert cu_seqlens_cpu.device.type == "cpu" and int(cu_seqlens_cpu[-1]) == q.shape[1]
            bounds = cu_seqlens_cpu.tolist()
        assert initial_state.shape[0] == len(bounds) - 1 and initial_state.dtype == torch.float32
        assert output_final_state and not use_qk_l2norm_in_kernel
        self.calls.append((name, bounds, use_graph))
        rep = v.shape[2] // q.shape[2]
        qq, kk = q[0].repeat_interleave(rep, dim=1), k[0].repeat_interleave(rep, dim=1)
        ht = initial_state.clone()
        o = torch.full(v.shape[1:], float("nan"), dtype=torch.float32, device=v.device)
        for i, (a, b) in enumerate(zip(bounds[:-1], bounds[1:])):
            if name == "gdn":
                decay = g[0, a:b].unsqueeze(-1)
            elif name == "kda":
                decay = g[0, a:b]
            else:
                assert g is None and g_gamma is not None and g_gamma.shape == (v.shape[2],)
                decay = g_gamma.float().view(1, -1, 1)
            if use_graph and a == b:
                ht[i] = float("nan")  # the graph form's empty requests: sentinel rows, their states not promised
                continue
            o[a:b] = gated_recurrence(qq[a:b], kk[a:b], v[0, a:b], decay, None if beta is None else beta[0, a:b],
                                      ht[i], scale)
        initial_state.fill_(float("nan"))  # FLA may scribble on it: the backend must not reuse it
        return o[None].to(v.dtype), ht

    def gdn(self, *, chunk_indices, **kw):
        """As FLA's chunk_gated_delta_rule, which takes the chunk indices precomputed: checked here
        against the (sequence, chunk of 64) rows of cu_seqlens_cpu."""
        bounds = kw["cu_seqlens_cpu"].tolist()
        want = [[i, c] for i, (a, b) in enumerate(zip(bounds[:-1], bounds[1:])) for c in range((b - a + 63) // 64)]
        assert chunk_indices.dtype == torch.int64 and chunk_indices.tolist() == want, (chunk_indices, want)
        return self._run("gdn", **kw)

    def kda(self, *, use_graph=False, max_num_seqs=None, **kw):
        """As FLA 0.6's chunk_kda, which has the graph form (use_graph, max_num_seqs) besides its plain one."""
        return self._run("kda", use_graph=use_graph, max_num_seqs=max_num_seqs, **kw)

    def simple_gla(self, **kw):
        return self._run("simple_gla", **kw)


class FakeFlashInferGdn:
    """Stands in for FlashInfer's GDN prefill launch (kernels/flashinfer_gdn.GdnPrefill.launch) on
    the CPU: the reference recurrence per request, in FlashInfer's conventions.

    It checks what the route must hand the kernel: q, k and the output contiguous, v's heads of D
    (rows of any stride), alpha the decay itself and beta in float32, one float32 initial state per
    request in FlashInfer's [Dv, Dk] layout, cu_seqlens int64 ending at the step's rows. It writes
    NaN into the initial states it was given (the kernel may: the route must not reuse them).
    `calls`: (cu_seqlens) of each launch."""

    def __init__(self):
        self.calls = []

    def __call__(self, q, k, v, alpha, beta, scale, initial_state, cu_seqlens, output, output_state):
        assert q.is_contiguous() and k.is_contiguous() and output.is_contiguous()
        assert v.stride(2) == 1 and v.stride(1) == v.shape[2]
        assert alpha.dtype == beta.dtype == initial_state.dtype == output_state.dtype == torch.float32
        assert cu_seqlens.dtype == torch.int64 and int(cu_seqlens[-1]) == q.shape[0] == v.shape[0]
        bounds = cu_seqlens.cpu().tolist()
        assert initial_state.shape == output_state.shape == (len(bounds) - 1, v.shape[1], v.shape[2], q.shape[2])
        self.calls.append(bounds)
        rep = v.shape[1] // q.shape[1]
        qq, kk = q.float().repeat_interleave(rep, dim=1), k.float().repeat_interleave(rep, dim=1)
        for i, (a, b) in enumerate(zip(bounds[:-1], bounds[1:])):
            state = initial_state[i].transpose(-1, -2).clone()  # [Hv, Dk, Dv], the reference's layout
            o = gated_recurrence(qq[a:b], kk[a:b], v[a:b].float(), torch.log(alpha[a:b])[..., None], beta[a:b],
                                 state, scale)
            output[a:b] = o.to(output.dtype)
            output_state[i] = state.transpose(-1, -2)
        initial_state.fill_(float("nan"))


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
            # routing's recorded options, as the real build passes them, then the test's own
            return cls(setup.state_pool, fla=FakeFLA(), snapshots=setup.snapshots,
                       routed_ops=frozenset(c.op for c in setup.calls),
                       **{**cls.routed_options(setup.options), **options})

    return InterpretedTritonLinear


def interpreted_linear_registry(source: str):
    """The backends of this runtime with `interpreted_triton_linear` beside them, its decode kernels
    on one wide tile a row (the interpreter walks every program of a launch in Python)."""
    from runtime.backends import discover
    from runtime.backends.kernels.linear import ConvConfig, RecurrentConfig

    wide = interpreted_triton_linear(recurrent_config=RecurrentConfig(32, 1), conv_config=ConvConfig(512, 4))
    return discover().with_classes(wide, source=source)


def compile_linear_routed(ckpt, out, ops, options: str, registry, **config) -> None:
    """`hgc compile --route OP=triton_linear_interpreted[OPTIONS]` for each of `ops`, with `registry`;
    `config`: other CompileConfig fields (the buckets, say)."""
    from compiler.passes.context import CompileConfig
    from compiler.passes.routing import parse_route
    from compiler.pipeline import compile_checkpoint
    from hgc.wiring import toolchain

    routes = tuple(parse_route(f"{op}={INTERPRETED_TRITON_LINEAR}[{options}]") for op in ops)
    compile_checkpoint(ckpt, out, CompileConfig(routes=routes, **config), toolchain(registry), dumps=False)


def rel_err(x: torch.Tensor, ref: torch.Tensor) -> float:
    """||x - ref|| / ||ref|| in float64 on the host."""
    x, ref = x.double().cpu(), ref.double().cpu()
    return float((x - ref).norm() / ref.norm().clamp_min(1e-30))


def conv_extend_steps(K: int, many: int) -> list:
    """(mode, (slot, cached, new tokens) requests, padding rows, padding requests). Step 1 mixes
    requests of 1, K-2, K-1, K and `many` tokens with one of none (slot 6); step 2 gives three of
    the same slots fewer than K-1 tokens, so their new history reaches back into the one step 1
    wrote, next to a new request. Slots are not in row order."""
    return [(Mode.EXTEND, [(7, 5, 1), (3, 0, K - 2), (9, 2, K - 1), (1, 0, K), (5, 0, many), (6, 4, 0)], 5, 1),
            (Mode.MIXED, [(3, K - 2, 1), (5, many, K - 2), (9, K + 1, 2), (2, 0, 3)], 2, 1)]


def column_slice(t: torch.Tensor, extra: int = 24) -> torch.Tensor:
    """t's values as the first columns of a wider tensor whose other columns are NaN: the layout a
    stacked projection (models/common.py, FusedLinear) hands an op, rows `extra` elements further
    apart than their width."""
    wide = torch.full((t.shape[0], t.shape[1] + extra), float("nan"), dtype=t.dtype, device=t.device)
    wide[:, : t.shape[1]] = t
    return wide[:, : t.shape[1]]


def check_conv_extend(channels: int, K: int, dtype, device, many: int, seed: int, bias=True, silu=True,
                      sliced: bool = False, rows: bool = False) -> dict:
    """The short conv's extend path of TritonLinearBackend against CPUReferenceBackend (float32 math
    on the same rounded inputs) over `conv_extend_steps`, from random non-zero histories; inputs'
    padding rows NaN, outputs poisoned; `sliced`: the device input is a `column_slice`; `rows`: the
    row-streaming kernel (the backend's conv_extend_rows) in place of the tile one. Per step:
    relative errors of the norm of the real rows and of
    the touched slots' states, whether every real row is finite and every padding row zero; and
    whether the padding slot, the free slots and the token-less request's slot kept every bit."""
    from runtime.backends.triton_linear import TritonLinearBackend

    num_slots = 10
    reg = LayerRegistry([LayerSpec(0, LayerKind.GDN, state={"conv": TensorSpec((channels, K - 1), "float32")})])
    ref_pool, dev_pool = StatePool(reg, num_slots), StatePool(reg, num_slots, device)
    g = torch.Generator().manual_seed(seed)
    ref_state = ref_pool.layer(0)["conv"]
    ref_state.copy_(torch.randn(ref_state.shape, generator=g))
    dev_pool.layer(0)["conv"].copy_(ref_state)
    before = ref_state.clone()
    w = torch.randn(channels, K, generator=g).to(dtype)
    b = torch.randn(channels, generator=g).to(dtype) if bias else None
    w_dev, b_dev = w.to(device), None if b is None else b.to(device)
    ref, tri = CPUReferenceBackend(None, ref_pool), TritonLinearBackend(dev_pool)
    tri.conv_extend_rows = rows
    steps, touched = [], set()
    for mode, reqs, pad_t, pad_s in conv_extend_steps(K, many):
        ctx = step_ctx(mode, reqs, pad_t, pad_s, device)
        plan_eager_step(tri, ctx, 2048)
        R, T = ctx.num_real_tokens, ctx.num_tokens
        x = torch.randn(T, channels, generator=g).to(dtype)
        x[R:] = float("nan")  # padding rows: never read
        out_ref = torch.full((T, channels), float("nan"), dtype=dtype)
        ref.short_conv(step_ctx(mode, reqs, pad_t, pad_s, "cpu"), x, w, b, out_ref, 0, silu)
        out = torch.full((T, channels), float("nan"), dtype=dtype, device=device)
        tri.short_conv(ctx, column_slice(x.to(device)) if sliced else x.to(device), w_dev, b_dev, out, 0, silu)
        out = out.cpu()
        touched |= {slot for slot, _, n in reqs if n > 0}
        t = sorted(touched)
        steps.append({"mode": mode.value, "lengths": [n for *_, n in reqs],
                      "out_rel_err": rel_err(out[:R], out_ref[:R]),
                      "state_rel_err": rel_err(dev_pool.layer(0)["conv"].cpu()[t], ref_state[t]),
                      "finite": bool(torch.isfinite(out[:R]).all()), "padding_zero": bool(out[R:].eq(0).all())})
    untouched = [s for s in range(num_slots + 1) if s not in touched]
    assert PADDING_SLOT in untouched and 6 in untouched
    kept = bool(torch.equal(dev_pool.layer(0)["conv"].cpu()[untouched], before[untouched]))
    return {"channels": channels, "K": K, "dtype": str(dtype).removeprefix("torch."), "rows": rows, "steps": steps,
            "untouched_slots_kept": kept}


def conv_extend_launch(config, K: int, channels: int, device, sliced: bool = False, seed: int = 0,
                       channels_last: bool = False):
    """One short_conv_extend launch with `config` (a ConvConfig: tile or row streaming) over requests
    of 0, 1, 2 (fewer than K-1), 70 (three token blocks) and 33 tokens, 5 padding rows (NaN inputs)
    and table rows past their request's blocks (the padding rows again, the empty request, a fourth
    block of 70 tokens), from random histories; float32, bias and silu; in-step snapshots after rows
    1 and 40. `sliced`: x is a `column_slice`; `channels_last`: the histories and the snapshot pool
    stored [.., K-1, C] (the state pool's layout, CONV_HISTORY_CHANNELS_LAST) and passed as their
    [.., C, K-1] views. Returns (outputs, histories, snapshot pool) on the host, contiguous."""
    from runtime.backends.kernels.linear import CONV_EXTEND_BLOCK_T, StepSnapshots, short_conv_extend

    g = torch.Generator().manual_seed(seed)
    lens, pad = [0, 1, 2, 70, 33], 5
    R, rows = len(lens), sum(lens) + pad
    x = torch.randn(rows, channels, generator=g)
    x[sum(lens):] = float("nan")
    w, b = torch.randn(channels, K, generator=g), torch.randn(channels, generator=g)
    state = laid_out(torch.randn(R + 2, channels, K - 1, generator=g).to(device), channels_last)
    bounds = torch.tensor(np.concatenate([[0], np.cumsum(lens), [rows]]), dtype=torch.int64)
    blocks = torch.from_numpy(token_blocks(np.asarray(lens + [pad]), CONV_EXTEND_BLOCK_T))
    blocks = torch.cat([blocks, torch.tensor([[R, 0], [0, 0], [3, 3]])])
    pool = laid_out(torch.zeros(R + 1, channels, K - 1, device=device), channels_last)
    snaps = StepSnapshots(torch.tensor([-1, 1, -1, 40, -1], device=device),
                          torch.tensor([0, 1, 0, 2, 0], device=device), pool)
    out = torch.full((rows, channels), float("nan"), device=device)
    x = column_slice(x.to(device)) if sliced else x.to(device)
    short_conv_extend(x, w.to(device), b.to(device), out, state, torch.tensor([2, 5, 1, 4, 3], device=device),
                      bounds.to(device), blocks.to(device), True, config=config, snapshots=snaps)
    return out.cpu(), state.contiguous().cpu(), pool.contiguous().cpu()


def laid_out(history: torch.Tensor, channels_last: bool) -> torch.Tensor:
    """A conv history [.., C, K-1] as is, or (channels_last) the same values stored [.., K-1, C] and
    returned as that storage's [.., C, K-1] view."""
    return history.transpose(-1, -2).contiguous().transpose(-1, -2) if channels_last else history


def conv_extend_ok(result: dict, out_tol: float, state_tol: float = 1e-6) -> bool:
    """Whether a check_conv_extend result passes: within the tolerances, rows written, padding zero, slots kept."""
    return result["untouched_slots_kept"] and all(
        s["finite"] and s["padding_zero"] and s["out_rel_err"] <= out_tol and s["state_rel_err"] <= state_tol
        for s in result["steps"])


def captured_chunk_tables(lens: list[int], slots: list[int], bucket: int, seqs: int, block_t: int,
                          device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(slots, bounds, chunks) of chunk_extend for a step of `lens` padded to a captured bucket of
    `bucket` rows and `seqs` requests, as the backend's static plan lays them out
    (triton_linear._StaticExtendPlan): slots [seqs+1] (padding requests and the always-empty one on
    the padding slot), bounds [seqs+3] (the last request owns the padding rows), chunks
    [bucket / block_t + seqs, 2] (the padding rows' chunks after the real ones, then rows naming the
    empty request seqs). Made on the host, apart from the device kernel that makes them in the
    backend (kernels/extend_tables.py, which its own test checks against token_blocks)."""
    full = np.zeros(seqs + 2, dtype=np.int64)
    full[:len(lens)] = lens
    full[seqs + 1] = bucket - sum(lens)
    bounds = np.concatenate([[0], np.cumsum(full)]).astype(np.int64)
    blocks = token_blocks(full, block_t)
    chunks = np.tile(np.array([seqs, 0], dtype=np.int64), (cdiv(bucket, block_t) + seqs, 1))
    chunks[:blocks.shape[0]] = blocks
    slot_ids = list(slots) + [PADDING_SLOT] * (seqs + 1 - len(slots))
    return (torch.tensor(slot_ids, dtype=torch.int64, device=device), torch.from_numpy(bounds).to(device),
            torch.from_numpy(chunks).to(device))
