"""CPU tests of the FlashInfer attention backend: everything that needs no GPU.

1. `build_paged_metadata` against hand-computed indptr / indices / last_page_len / row positions.
2. Without flashinfer, constructing the backend raises and names the gpu extra.
3. The backend's plumbing (grouping, one plan per step and group, plan arguments, stale-plan
   errors, scale checks, padding, graph buckets) through a stand-in `flashinfer` module whose
   wrappers keep the real 0.6 signatures and compute FlashInfer's documented semantics in torch
   (kv length = (pages-1)*page_size + last_page_len, causal mask aligned to the end of the
   cache). Its outputs must equal the CPU reference backend's. With extend_impl="triton" the GQA
   groups of extend and mixed steps run the Triton kernel for requests of different lengths (in
   Triton's interpreter) with nothing planned, eagerly and from a graph bucket's static buffers.
4. The Triton kernels (K/V store, MLA) in the Triton interpreter, in a subprocess so that
   TRITON_INTERPRET never leaks into this process (bf16 dots are wrong in the interpreter, so
   the MLA kernel runs on float32 here and on bf16 in the GPU tests).
"""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
import textwrap
import types
from pathlib import Path

import pytest
import torch

from compiler.splitops import MODES, LayerKind, LayerRegistry, LayerSpec, Mode, TensorSpec
from runtime.backends import flashinfer_attention as fia
from runtime.backends.cpu_reference import CPUReferenceBackend
from runtime.backends.flashinfer_attention import FlashInferAttentionBackend, FlashInferMissing, build_paged_metadata
from runtime.cache.batch import SeqState, build_step, commit_step
from runtime.cache.kv_pool import KVPool

ROOT = Path(__file__).resolve().parents[3]
HQ, HKV, D, R, P = 4, 2, 16, 16, 8  # D: the Triton GQA kernel takes head dims >= 16
GQA_SCALE, MLA_SCALE = D ** -0.5, 0.3

REGISTRY = LayerRegistry([
    LayerSpec(0, LayerKind.FULL_GQA, kv={"k": TensorSpec((HKV, D), "float32"), "v": TensorSpec((HKV, D), "float32")}),
    LayerSpec(1, LayerKind.GDN, state={"recurrent": TensorSpec((HQ, D, D), "float32")}),
    LayerSpec(2, LayerKind.FULL_MLA, kv={"latent": TensorSpec((R + P,), "float32")}),
    LayerSpec(3, LayerKind.FULL_GQA, kv={"k": TensorSpec((HKV, D), "float32"), "v": TensorSpec((HKV, D), "float32")}),
])


# -- 1. metadata --------------------------------------------------------------------------------


def _ctx_three_requests():
    """Page size 4. Request 0: new, 3 tokens. Request 1: 6 cached + 1 (decode). Request 2: 2 cached
    + 5. Pages handed out so that no request's pages are contiguous."""
    pool = KVPool(REGISTRY, 16, 4)
    a, b, c = SeqState(1, pages=[7]), SeqState(2, pages=[2, 9]), SeqState(3, pages=[4])
    b.num_cached, c.num_cached = 6, 2
    built = build_step([(a, [0] * 3), (b, [0]), (c, [0] * 5)], pool, pad_tokens_to=12, pad_seqs_to=5)
    return built.ctx, (a, b, c)


def test_metadata_matches_hand_computed_values():
    ctx, (a, b, c) = _ctx_three_requests()
    assert c.pages[0] == 4 and len(c.pages) == 2  # build_step gave request 2 one more page
    meta = build_paged_metadata(ctx)
    # kv lengths 3, 7, 7 -> pages 1, 2, 2; last pages hold 3, 3, 3 tokens.
    assert meta.num_reqs == 3 and meta.num_rows == 9
    assert meta.qo_indptr.tolist() == [0, 3, 4, 9]
    assert meta.kv_indptr.tolist() == [0, 1, 3, 5]
    assert meta.kv_lens.tolist() == [3, 7, 7]
    assert meta.kv_last_page_len.tolist() == [3, 3, 3]
    assert meta.kv_indices.tolist() == [7, 2, 9, 4, c.pages[1]]
    assert meta.row_req.tolist() == [0, 0, 0, 1, 2, 2, 2, 2, 2]
    assert meta.row_pos.tolist() == [0, 1, 2, 6, 2, 3, 4, 5, 6]
    assert all(t.dtype == torch.int32 for t in (meta.qo_indptr, meta.kv_indptr, meta.kv_lens,
                                                meta.kv_last_page_len, meta.kv_indices, meta.row_req, meta.row_pos))
    assert not meta.all_fresh


def test_metadata_full_last_page_and_fresh_batch():
    pool = KVPool(REGISTRY, 16, 4)
    a, b = SeqState(1), SeqState(2)
    ctx = build_step([(a, [0] * 8), (b, [0] * 5)], pool).ctx  # 8 tokens fill two pages exactly
    meta = build_paged_metadata(ctx)
    assert meta.kv_indptr.tolist() == [0, 2, 4]
    assert meta.kv_last_page_len.tolist() == [4, 1]
    assert meta.kv_indices.tolist() == a.pages + b.pages
    assert meta.all_fresh


def test_metadata_padded_to_a_bucket():
    """Graph buckets: padding requests own one row and read one token of page 0."""
    pool = KVPool(REGISTRY, 16, 4)
    a, b = SeqState(1, pages=[5, 6]), SeqState(2, pages=[3])
    a.num_cached, b.num_cached = 5, 2
    ctx = build_step([(a, [0]), (b, [0])], pool, pad_tokens_to=4, pad_seqs_to=4).ctx
    meta = build_paged_metadata(ctx, pad_reqs_to=4)
    assert meta.num_reqs == 4 and meta.num_rows == 4
    assert meta.qo_indptr.tolist() == [0, 1, 2, 3, 4]
    assert meta.kv_indptr.tolist() == [0, 2, 3, 4, 5]
    assert meta.kv_lens.tolist() == [6, 3, 1, 1]
    assert meta.kv_last_page_len.tolist() == [2, 3, 1, 1]
    assert meta.kv_indices.tolist() == [5, 6, 3, 0, 0]
    assert meta.row_req.tolist() == [0, 1, 2, 3] and meta.row_pos.tolist() == [5, 2, 0, 0]


def test_metadata_rejects_a_narrow_page_table():
    ctx, _ = _ctx_three_requests()
    ctx = dataclasses.replace(ctx, page_table=ctx.page_table[:, :1])
    with pytest.raises(ValueError, match="page table has 1 columns"):
        build_paged_metadata(ctx)


# -- 2. without flashinfer ---------------------------------------------------------------------


def test_clear_error_without_flashinfer(monkeypatch):
    monkeypatch.setitem(sys.modules, "flashinfer", None)  # makes `import flashinfer` raise ImportError
    with pytest.raises(FlashInferMissing, match=r"install the gpu extra"):
        FlashInferAttentionBackend(KVPool(REGISTRY, 4, 4), q_heads=HQ, scales={0: GQA_SCALE, 2: MLA_SCALE, 3: GQA_SCALE})


# -- 3. plumbing through a stand-in flashinfer ---------------------------------------------------


def _attend(q, keys, values, scale, causal):
    """q [Lq,H,Dk]; keys [L,Hkv,Dk]; values [L,Hkv,Dv] -> [Lq,H,Dv], causal aligned to the end."""
    Lq, H = q.shape[:2]
    L = keys.shape[0]
    group = H // keys.shape[1]
    k = keys.float().repeat_interleave(group, 1)
    v = values.float().repeat_interleave(group, 1)
    s = torch.einsum("qhd,khd->hqk", q.float(), k) * scale
    if causal:
        mask = torch.arange(L)[None, :] > (torch.arange(Lq)[:, None] + L - Lq)
        s = s.masked_fill(mask, float("-inf"))
    return torch.einsum("hqk,khd->qhd", torch.softmax(s, -1), v)


def _pages_of(indptr, indices, b):
    return indices[int(indptr[b]):int(indptr[b + 1])].long()


class _Fake:
    """Shared bookkeeping: every plan and run is logged so tests can count them."""

    log: list = []

    def __init__(self, float_workspace_buffer, *args, use_cuda_graph=False, **kwargs):
        self.use_cuda_graph = use_cuda_graph
        self.kwargs = kwargs
        _Fake.log.append(("init", type(self).__name__, use_cuda_graph))

    def _into(self, name, value):
        """Graph wrappers copy plan data into their fixed buffers, as flashinfer does."""
        buf = self.kwargs.get(name)
        if not self.use_cuda_graph:
            return value
        if name.endswith(("indices_buffer", "indices_buf")) or name == "kv_indices":
            assert value.numel() <= buf.numel(), f"{name}: {value.numel()} entries, buffer {buf.numel()}"
            buf[: value.numel()].copy_(value)
        else:
            assert buf.shape == value.shape, f"{name}: plan size {tuple(value.shape)} != fixed buffer {tuple(buf.shape)}"
            buf.copy_(value)
        return buf


class FakeDecode(_Fake):
    def plan(self, indptr, indices, last_page_len, num_qo_heads, num_kv_heads, head_dim, page_size,
             pos_encoding_mode="NONE", window_left=-1, logits_soft_cap=None, q_data_type="float16",
             kv_data_type=None, o_data_type=None, data_type=None, sm_scale=None, rope_scale=None,
             rope_theta=None, non_blocking=True, block_tables=None, seq_lens=None, fixed_split_size=None,
             disable_split_kv=False):
        self.indptr = self._into("paged_kv_indptr_buffer", indptr)
        self.indices = self._into("paged_kv_indices_buffer", indices)
        self.last = self._into("paged_kv_last_page_len_buffer", last_page_len)
        self.ps, self.scale = page_size, sm_scale
        _Fake.log.append(("plan", "decode", len(last_page_len)))

    def run(self, q, paged_kv_cache, *args, out=None, **kwargs):
        kc, vc = paged_kv_cache
        assert out is not None and out.shape == q.shape
        for b in range(len(self.last)):
            pages = _pages_of(self.indptr, self.indices, b)
            L = (len(pages) - 1) * self.ps + int(self.last[b])
            out[b] = _attend(q[b:b + 1], kc[pages].flatten(0, 1)[:L], vc[pages].flatten(0, 1)[:L], self.scale, False)[0]
        _Fake.log.append(("run", "decode", q.shape[0]))
        return out


class FakePagedPrefill(_Fake):
    def plan(self, qo_indptr, paged_kv_indptr, paged_kv_indices, paged_kv_last_page_len, num_qo_heads, num_kv_heads,
             head_dim_qk, page_size, head_dim_vo=None, custom_mask=None, packed_custom_mask=None, causal=False,
             pos_encoding_mode="NONE", use_fp16_qk_reduction=False, sm_scale=None, window_left=-1,
             logits_soft_cap=None, rope_scale=None, rope_theta=None, q_data_type="float16", kv_data_type=None,
             o_data_type=None, non_blocking=True, prefix_len_ptr=None, token_pos_in_items_ptr=None,
             token_pos_in_items_len=0, max_item_len_ptr=None, seq_lens=None, seq_lens_q=None, block_tables=None,
             max_token_per_sequence=None, max_sequence_kv=None, fixed_split_size=None, disable_split_kv=False):
        self.qo = self._into("qo_indptr_buf", qo_indptr)
        self.indptr = self._into("paged_kv_indptr_buf", paged_kv_indptr)
        self.indices = self._into("paged_kv_indices_buf", paged_kv_indices)
        self.last = self._into("paged_kv_last_page_len_buf", paged_kv_last_page_len)
        self.ps, self.scale, self.causal = page_size, sm_scale, causal
        _Fake.log.append(("plan", "prefill", len(paged_kv_last_page_len)))

    def run(self, q, paged_kv_cache, *args, out=None, **kwargs):
        kc, vc = paged_kv_cache
        assert q.shape[0] == int(self.qo[-1]), f"q has {q.shape[0]} rows, qo_indptr[-1] is {int(self.qo[-1])}"
        for b in range(len(self.last)):
            pages = _pages_of(self.indptr, self.indices, b)
            L = (len(pages) - 1) * self.ps + int(self.last[b])
            rows = slice(int(self.qo[b]), int(self.qo[b + 1]))
            out[rows] = _attend(q[rows], kc[pages].flatten(0, 1)[:L], vc[pages].flatten(0, 1)[:L], self.scale, self.causal)
        _Fake.log.append(("run", "prefill", q.shape[0]))
        return out


class FakeRagged(_Fake):
    def plan(self, qo_indptr, kv_indptr, num_qo_heads, num_kv_heads, head_dim_qk, head_dim_vo=None, custom_mask=None,
             packed_custom_mask=None, causal=False, pos_encoding_mode="NONE", use_fp16_qk_reduction=False,
             window_left=-1, logits_soft_cap=None, sm_scale=None, rope_scale=None, rope_theta=None,
             q_data_type="float16", kv_data_type=None, o_data_type=None, non_blocking=True, prefix_len_ptr=None,
             token_pos_in_items_ptr=None, token_pos_in_items_len=0, max_item_len_ptr=None, fixed_split_size=None,
             disable_split_kv=False):
        self.qo, self.kv, self.scale, self.causal = qo_indptr, kv_indptr, sm_scale, causal
        _Fake.log.append(("plan", "ragged", len(qo_indptr) - 1))

    def run(self, q, k, v, *args, out=None, **kwargs):
        for b in range(len(self.qo) - 1):
            rows = slice(int(self.qo[b]), int(self.qo[b + 1]))
            kv = slice(int(self.kv[b]), int(self.kv[b + 1]))
            out[rows] = _attend(q[rows], k[kv], v[kv], self.scale, self.causal)
        _Fake.log.append(("run", "ragged", q.shape[0]))
        return out


class FakeMLA(_Fake):
    def plan(self, qo_indptr, kv_indptr, kv_indices, kv_len_arr, num_heads, head_dim_ckv, head_dim_kpe, page_size,
             causal, sm_scale, q_data_type, kv_data_type, use_profiler=False):
        self.qo = self._into("qo_indptr", qo_indptr)
        self.indptr = self._into("kv_indptr", kv_indptr)
        self.indices = self._into("kv_indices", kv_indices)
        self.lens = self._into("kv_len_arr", kv_len_arr)
        self.ps, self.scale, self.causal = page_size, sm_scale, causal
        _Fake.log.append(("plan", "mla", len(kv_len_arr)))

    def run(self, q_nope, q_pe, ckv_cache, kpe_cache, out=None, lse=None, return_lse=False, **kwargs):
        assert out is not None and out.shape == q_nope.shape
        for b in range(len(self.lens)):
            pages = _pages_of(self.indptr, self.indices, b)
            L = int(self.lens[b])
            rows = slice(int(self.qo[b]), int(self.qo[b + 1]))
            c, kr = ckv_cache[pages].flatten(0, 1)[:L], kpe_cache[pages].flatten(0, 1)[:L]
            q = torch.cat([q_nope[rows], q_pe[rows]], -1)
            keys = torch.cat([c, kr], -1).unsqueeze(1)
            out[rows] = _attend(q, keys, c.unsqueeze(1), self.scale, self.causal)
        _Fake.log.append(("run", "mla", q_nope.shape[0]))
        return out


def _fake_flashinfer() -> types.ModuleType:
    fi = types.ModuleType("flashinfer")
    fi.BatchDecodeWithPagedKVCacheWrapper = FakeDecode
    fi.BatchPrefillWithPagedKVCacheWrapper = FakePagedPrefill
    fi.BatchPrefillWithRaggedKVCacheWrapper = FakeRagged
    fi.mla = types.ModuleType("flashinfer.mla")
    fi.mla.BatchMLAPagedAttentionWrapper = FakeMLA
    return fi


def _store_rows_torch(slot_mapping, page_size, a, b):
    """What the Triton store kernel does, in torch (eager only): skip rows whose slot is -1."""
    keep = slot_mapping >= 0
    for src, dst in (a, b):
        rows = src[: slot_mapping.shape[0]][keep].reshape(int(keep.sum()), *dst.shape[2:])
        slots = slot_mapping[keep]
        dst[slots // page_size, slots % page_size] = rows


class CPUFlashInferBackend(FlashInferAttentionBackend):
    """The backend over the stand-in flashinfer. Decode steps go through FlashInfer's wrappers
    unless a test asks for the Triton decode (the backend's default for GQA) by name."""

    def __init__(self, *args, decode_impl: str = "flashinfer", **kwargs):
        super().__init__(*args, decode_impl=decode_impl, **kwargs)

    def _check_device(self) -> None:  # the stand-in flashinfer runs on the CPU
        pass


@pytest.fixture
def fake_fi(monkeypatch):
    fi = _fake_flashinfer()
    monkeypatch.setitem(sys.modules, "flashinfer", fi)
    monkeypatch.setitem(sys.modules, "flashinfer.mla", fi.mla)
    monkeypatch.setattr(fia, "store_kv_rows", _store_rows_torch)
    _Fake.log = []
    return fi


SCALES = {0: GQA_SCALE, 2: MLA_SCALE, 3: GQA_SCALE}


class Pair:
    """The stand-in backend and the CPU reference over two pools with the same pages."""

    def __init__(self, **kw):
        self.pool = KVPool(REGISTRY, 64, 4)
        self.ref_pool = KVPool(REGISTRY, 64, 4)
        self.ref = CPUReferenceBackend(self.ref_pool, None)
        self.be = CPUFlashInferBackend(self.pool, q_heads=HQ, scales=SCALES, mla_rope_dim=P, **kw)
        self.gen = torch.Generator().manual_seed(0)

    def run(self, ctx, layer_id, T, graph=None):
        r = lambda *s: torch.randn(*s, generator=self.gen)
        if layer_id == 2:
            args, shape = (r(T, HQ, R), r(T, HQ, P), r(T, R), r(T, P)), (T, HQ, R)
            call = lambda be, out: be.mla_attention(ctx, *args, out, 2, MLA_SCALE)
        else:
            args, shape = (r(T, HQ, D), r(T, HKV, D), r(T, HKV, D)), (T, HQ, D)
            call = lambda be, out: be.gqa_attention(ctx, *args, out, layer_id, GQA_SCALE)
        n = ctx.num_real_tokens
        for a in args:
            a[n:] = float("nan")
        out, ref = torch.full(shape, float("nan")), torch.empty(shape)
        call(self.ref, ref)
        call(self.be, out)
        assert torch.isfinite(out).all() and out[n:].eq(0).all()
        return float((out - ref).norm() / ref.norm())


def _schedule(pool, seqs=None, **kw):
    """Three steps of three requests (slots 1-3, or `seqs`): fresh extend, chunked extend + decode
    (mixed), decode; 9, 4 and 14 tokens cached after."""
    seqs = seqs or [SeqState(i + 1) for i in range(3)]
    steps = [[(0, 5), (1, 2), (2, 7)], [(0, 3), (1, 1), (2, 6)], [(0, 1), (1, 1), (2, 1)]]
    for items in steps:
        step_items = [(seqs[i], [0] * n) for i, n in items]
        yield build_step(step_items, pool, **kw).ctx
        commit_step(step_items)


@pytest.mark.parametrize("extend_impl", ["paged", "ragged"])
def test_backend_matches_reference_through_fake_flashinfer(fake_fi, extend_impl):
    pair = Pair(extend_impl=extend_impl)
    for ctx in _schedule(pair.ref_pool, pad_tokens_to=16, pad_seqs_to=4):
        pair.be.init_step_metadata(ctx)
        for layer in (0, 2, 3):
            assert pair.run(ctx, layer, ctx.num_tokens) < 1e-5
    for name in ("k", "v"):
        assert torch.equal(pair.pool.layer(0)[name], pair.ref_pool.layer(0)[name])
    assert torch.equal(pair.pool.layer(2)["latent"], pair.ref_pool.layer(2)["latent"])
    kinds = [entry[1] for entry in _Fake.log if entry[0] == "plan"]
    # One plan per step and head group (layers 0 and 3 share one): GQA then MLA, three steps.
    first = "ragged" if extend_impl == "ragged" else "prefill"
    assert kinds == [first, "mla", "prefill", "mla", "decode", "mla"]


def test_ops_refuse_a_step_that_was_not_planned(fake_fi):
    pair = Pair()
    ctxs = list(_schedule(pair.ref_pool))
    with pytest.raises(RuntimeError, match="not planned"):
        pair.run(ctxs[0], 0, ctxs[0].num_tokens)
    pair.be.init_step_metadata(ctxs[0])
    with pytest.raises(RuntimeError, match="not planned"):  # a new context needs a new plan
        pair.run(ctxs[1], 0, ctxs[1].num_tokens)


def test_op_scale_must_match_the_planned_scale(fake_fi):
    pair = Pair()
    ctx = next(_schedule(pair.ref_pool))
    pair.be.init_step_metadata(ctx)
    T = ctx.num_tokens
    with pytest.raises(ValueError, match="differs from the planned"):
        pair.be.gqa_attention(ctx, torch.randn(T, HQ, D), torch.randn(T, HKV, D), torch.randn(T, HKV, D),
                              torch.empty(T, HQ, D), 0, 0.5)


def test_mla_layers_need_a_scale(fake_fi):
    with pytest.raises(ValueError, match="MLA.*scale"):
        CPUFlashInferBackend(KVPool(REGISTRY, 4, 4), q_heads=HQ, scales=None, mla_rope_dim=P)
    with pytest.raises(KeyError, match="no softmax scale given for full layer 2"):
        CPUFlashInferBackend(KVPool(REGISTRY, 4, 4), q_heads=HQ, scales={0: GQA_SCALE, 3: GQA_SCALE}, mla_rope_dim=P)


def _prefilled_pair(**kw) -> tuple[Pair, list[SeqState]]:
    """A Pair whose three requests (slots 1-3) have 6, 9 and 3 tokens in both pools, run eagerly."""
    pair = Pair(**kw)
    seqs = [SeqState(i + 1) for i in range(3)]
    prefill = [(s, [0] * n) for s, n in zip(seqs, (6, 9, 3))]
    ctx = build_step(prefill, pair.ref_pool).ctx
    pair.be.init_step_metadata(ctx)
    for layer in (0, 2):
        pair.run(ctx, layer, ctx.num_tokens)
    commit_step(prefill)
    return pair, seqs


def test_graph_buckets_plan_fixed_buffers_and_mask_padding(fake_fi):
    """Capture/replay planning on the stand-in: bucket checks, fixed buffers, padded rows zeroed."""
    pair, seqs = _prefilled_pair()

    items = [(s, [0]) for s in seqs]
    with pytest.raises(RuntimeError, match="before init_capture_state"):
        pair.be.init_replay_state(build_step(items, pair.ref_pool, pad_tokens_to=4, pad_seqs_to=4).ctx, 4)
    pair.be.init_capture_state(8, 8)
    for count in (2, 3):  # "capture" with 2 real requests, "replay" with 3
        items = [(s, [0]) for s in seqs[:count]]
        ctx = build_step(items, pair.ref_pool, pad_tokens_to=4, pad_seqs_to=4, max_pages=8).ctx
        pair.be.init_replay_state(ctx, 4)
        for layer in (0, 2):
            assert pair.run(ctx, layer, 4) < 1e-5
        commit_step(items)
    assert ("init", "FakeDecode", True) in _Fake.log and ("init", "FakeMLA", True) in _Fake.log
    assert sum(1 for e in _Fake.log if e[0] == "init" and e[2]) == 2, "one graph wrapper per bucket and head group"

    items = [(s, [0]) for s in seqs]
    with pytest.raises(ValueError, match="bucket 4"):
        pair.be.init_replay_state(build_step(items, pair.ref_pool, pad_tokens_to=5, pad_seqs_to=5).ctx, 4)
    with pytest.raises(ValueError, match="bucket 16"):
        pair.be.init_replay_state(build_step(items, pair.ref_pool, pad_tokens_to=16, pad_seqs_to=16).ctx, 16)
    extend = build_step([(seqs[0], [0] * 3)], pair.ref_pool, pad_tokens_to=4, pad_seqs_to=4, mode=Mode.EXTEND).ctx
    with pytest.raises(ValueError, match="only decode and target_verify steps are captured"):
        pair.be.init_replay_state(extend, 4)


def test_verify_buckets_plan_fixed_prefill_buffers_with_n_rows_per_request(fake_fi):
    """A target_verify bucket (speculative decoding: every request n tokens) replays through the
    graph-mode paged prefill wrapper: padded requests own n rows each, so a bucket is always
    bucket * n rows; real rows equal the reference's, padded rows are zero, KV matches."""
    pair, seqs = _prefilled_pair()
    pair.be.init_capture_state(16, 4)
    n = 3
    for count in (2, 3, 1):  # capture with 2 real requests, replay with 3, then 1
        items = [(s, [0] * n) for s in seqs[:count]]
        ctx = build_step(items, pair.ref_pool, mode=Mode.TARGET_VERIFY, pad_tokens_to=4 * n, pad_seqs_to=4,
                         max_pages=8).ctx
        pair.be.init_replay_state(ctx, 4)
        assert pair.be._step.meta.num_rows == 4 * n
        for layer in (0, 2, 3):
            assert pair.run(ctx, layer, 4 * n) < 1e-5
        commit_step(items)
    for name in ("k", "v"):
        assert torch.equal(pair.pool.layer(0)[name], pair.ref_pool.layer(0)[name])
    assert torch.equal(pair.pool.layer(2)["latent"], pair.ref_pool.layer(2)["latent"])
    assert ("init", "FakePagedPrefill", True) in _Fake.log
    assert sum(1 for e in _Fake.log if e[0] == "init" and e[2]) == 2, "one graph wrapper per bucket, kind and group"
    ragged = build_step([(seqs[0], [0] * 2), (seqs[1], [0] * 4)], pair.ref_pool, mode=Mode.TARGET_VERIFY,
                        pad_tokens_to=8, pad_seqs_to=2, max_pages=8).ctx
    with pytest.raises(ValueError, match="the same n rows for every request"):
        pair.be.init_replay_state(ragged, 2)


@pytest.fixture
def host_plans(fake_fi, monkeypatch):
    """Counts the host planning a step does: build_paged_metadata calls (by step mode) and the
    stand-in wrappers' plan() calls (in _Fake.log). The Triton kernels run in Triton's interpreter
    here, with the splits of an 8-SM device so that it walks few programs (the splits themselves
    are checked in test_triton_kernels_in_the_interpreter)."""
    pytest.importorskip("triton")
    from runtime.backends.kernels import gqa as triton_gqa, mla as triton_mla

    built = []
    real = fia.build_paged_metadata
    monkeypatch.setattr(fia, "build_paged_metadata", lambda ctx, *a, **k: built.append(Mode(ctx.mode)) or real(ctx, *a, **k))
    for module in (triton_gqa, triton_mla):
        monkeypatch.setattr(module, "num_sms", lambda device: 8)
    return built


def _plans() -> list:
    return [entry[1] for entry in _Fake.log if entry[0] == "plan"]


def test_triton_decode_plans_nothing_for_decode_and_verify_steps(host_plans):
    """decode_impl="triton" (GQA) with mla_impl="triton" (MLA): eager extend and mixed steps plan
    FlashInfer's prefill for GQA (and the MLA kernel's row arrays); eager decode and uniform
    target_verify steps build no paged metadata and plan no wrapper; every output equals the
    reference's, padding rows zero."""
    pair = Pair(decode_impl="triton", mla_impl="triton")
    seqs = [SeqState(i + 1) for i in range(3)]
    for ctx in _schedule(pair.ref_pool, seqs, pad_tokens_to=16, pad_seqs_to=4):
        pair.be.init_step_metadata(ctx)
        for layer in (0, 2, 3):
            assert pair.run(ctx, layer, ctx.num_tokens) < 1e-5
    assert host_plans == [Mode.EXTEND, Mode.MIXED] and _plans() == ["ragged", "prefill"]
    items = [(s, [0] * 3) for s in seqs]  # 9, 4, 14 cached: the new rows cross page boundaries
    ctx = build_step(items, pair.ref_pool, mode=Mode.TARGET_VERIFY, pad_tokens_to=12, pad_seqs_to=5).ctx
    pair.be.init_step_metadata(ctx)
    for layer in (0, 2, 3):
        assert pair.run(ctx, layer, ctx.num_tokens) < 1e-5
    assert host_plans == [Mode.EXTEND, Mode.MIXED] and len(_plans()) == 2
    assert pair.be._step.meta is None and pair.be._step.table.rows_per_req == 3
    for name in ("k", "v"):
        assert torch.equal(pair.pool.layer(0)[name], pair.ref_pool.layer(0)[name])
    assert torch.equal(pair.pool.layer(2)["latent"], pair.ref_pool.layer(2)["latent"])
    commit_step(items)
    with pytest.raises(RuntimeError, match="not planned"):  # a new step needs its own (empty) plan
        pair.run(build_step([(s, [0]) for s in seqs], pair.ref_pool).ctx, 0, 3)


@pytest.mark.parametrize("n", [1, 3], ids=["decode", "verify"])
def test_triton_decode_graph_buckets_plan_nothing_on_the_host(host_plans, n):
    """Graph buckets with decode_impl="triton" and mla_impl="triton": capture with 2 real requests
    of a bucket of 4, replay with 3 and 1, each from a context of its own (new tensors: the hook
    copies the page table and lengths into the static ones). No paged metadata, no plan, no
    use_cuda_graph wrapper; real rows equal the reference's, padding rows are zero, KV matches."""
    pair, seqs = _prefilled_pair(decode_impl="triton", mla_impl="triton")
    before = (list(host_plans), _plans())
    pair.be.init_capture_state(4 * n, 4)
    mode = Mode.DECODE if n == 1 else Mode.TARGET_VERIFY
    for count in (2, 3, 1):
        items = [(s, [0] * n) for s in seqs[:count]]
        ctx = build_step(items, pair.ref_pool, mode=mode, pad_tokens_to=4 * n, pad_seqs_to=4, max_pages=8).ctx
        pair.be.init_replay_state(ctx, 4)
        assert pair.be._step.num_rows == 4 * n and pair.be._step.table.page_table.data_ptr() == (
            pair.be._static["page_table"].data_ptr())
        for layer in (0, 2, 3):
            assert pair.run(ctx, layer, 4 * n) < 1e-5
        commit_step(items)
    assert (host_plans, _plans()) == before and not any(e[0] == "init" and e[2] for e in _Fake.log)
    for name in ("k", "v"):
        assert torch.equal(pair.pool.layer(0)[name], pair.ref_pool.layer(0)[name])
    assert torch.equal(pair.pool.layer(2)["latent"], pair.ref_pool.layer(2)["latent"])
    wide = build_step([(seqs[0], [0] * n)], pair.ref_pool, mode=mode, pad_tokens_to=4 * n, pad_seqs_to=4,
                      max_pages=9).ctx
    with pytest.raises(ValueError, match="page table has 9 columns, the static one 8"):
        pair.be.init_replay_state(wide, 4)


def test_mla_decode_on_the_triton_kernel_beside_flashinfers_mla_extends(host_plans):
    """mla_decode_impl="triton" with mla_impl="flashinfer" (the routing defaults for a bf16 MLA
    layer): extend and mixed steps plan FlashInfer's MLA wrapper; eager decode steps and decode
    graph buckets build no paged metadata and plan nothing (a decode graph then records its replay
    state); every output equals the reference's, padding rows zero; the KV pages match."""
    pair = Pair(decode_impl="triton", mla_decode_impl="triton", layers=[2])
    assert pair.be.replay_state_in_graph(Mode.DECODE) and pair.be.replay_state_in_graph(Mode.TARGET_VERIFY)
    assert not Pair(decode_impl="triton", layers=[2]).be.replay_state_in_graph(Mode.DECODE), "FlashInfer's MLA plans"
    seqs = [SeqState(i + 1) for i in range(3)]
    for ctx in _schedule(pair.ref_pool, seqs, pad_tokens_to=16, pad_seqs_to=4):
        pair.be.init_step_metadata(ctx)
        assert pair.run(ctx, 2, ctx.num_tokens) < 1e-5
    assert host_plans == [Mode.EXTEND, Mode.MIXED] and _plans() == ["mla", "mla"]
    pair.be.init_capture_state(4, 4)
    for count in (2, 3, 1):
        items = [(s, [0]) for s in seqs[:count]]
        ctx = build_step(items, pair.ref_pool, pad_tokens_to=4, pad_seqs_to=4, max_pages=8).ctx
        pair.be.init_replay_state(ctx, 4)
        assert pair.be._step.meta is None and pair.be._step.table.rows_per_req == 1
        assert pair.run(ctx, 2, 4) < 1e-5
        commit_step(items)
    assert host_plans == [Mode.EXTEND, Mode.MIXED] and _plans() == ["mla", "mla"]
    assert not any(e[0] == "init" and e[2] for e in _Fake.log), "no use_cuda_graph wrapper"
    assert torch.equal(pair.pool.layer(2)["latent"], pair.ref_pool.layer(2)["latent"])


@pytest.mark.parametrize("n", [1, 3], ids=["decode", "verify"])
def test_a_graph_bucket_on_the_table_kernels_records_no_padding_mask(host_plans, n):
    """A graph bucket on the Triton table kernels plans no padding mask and its ops launch no
    masked_fill (one kernel fewer per attention layer): a bucket of one request has no padding
    rows (a decode row, or a verify step's n), and in a bucket of two holding one request the
    kernels write the padding request's rows as zeros themselves (pair.run fills them with NaN
    first and checks them zero)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Ops(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.seen = set()

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.seen.add(func.overloadpacket.__name__)
            return func(*args, **(kwargs or {}))

    pair, seqs = _prefilled_pair(decode_impl="triton", mla_impl="triton")
    pair.be.init_capture_state(2 * n, 2)
    mode = Mode.DECODE if n == 1 else Mode.TARGET_VERIFY
    for bucket in (1, 2):
        items = [(seqs[0], [0] * n)]
        ctx = build_step(items, pair.ref_pool, mode=mode, pad_tokens_to=bucket * n, pad_seqs_to=bucket,
                         max_pages=8).ctx
        pair.be.init_replay_state(ctx, bucket)
        assert pair.be._step.pad_rows is None
        ops = Ops()
        for layer in (0, 2, 3):
            with ops:
                err = pair.run(ctx, layer, bucket * n)  # padding rows (bucket 2) checked zero there
            assert err < 1e-5
        assert "masked_fill_" not in ops.seen, sorted(ops.seen)
        commit_step(items)


GQA_LAYERS = [0, 3]  # extend_impl="triton" serves GQA layers: the instance takes REGISTRY's GQA layers only


def _gqa_steps(pool, seqs, **kw):
    """Extend and mixed steps of three requests (slots 1-3, or `seqs`), as the backend sees them:
    a fresh extend (5, 2, 7 tokens), a mixed step (a 3-token chunk, a decode row, a 6-token chunk),
    a prefix hit's tail beside a decode row and a fresh 1-token request. The rows cross page
    boundaries (pages of 4); the caches are committed after each step."""
    fresh = SeqState(9)
    steps = [[(0, 5), (1, 2), (2, 7)], [(0, 3), (1, 1), (2, 6)], [(0, 9), (1, 1), (3, 1)]]
    everyone = list(seqs) + [fresh]
    for items in steps:
        step_items = [(everyone[i], [0] * n) for i, n in items]
        yield build_step(step_items, pool, **kw).ctx
        commit_step(step_items)


def test_triton_extend_plans_nothing_and_matches_the_reference(host_plans):
    """extend_impl="triton" (with decode_impl="triton"): extend and mixed steps run GQA groups on the
    varlen Triton kernel from the page table, seq_lens and query_start_loc, in Triton's interpreter:
    no paged metadata, no plan(), outputs equal to the reference's, padding rows zero, KV stored."""
    pair = Pair(extend_impl="triton", decode_impl="triton", layers=GQA_LAYERS)
    seqs = [SeqState(i + 1) for i in range(3)]
    modes = []
    for ctx in _gqa_steps(pair.ref_pool, seqs, pad_tokens_to=24, pad_seqs_to=4):
        pair.be.init_step_metadata(ctx)
        pair.be.init_chunk_metadata(ctx, 64)
        modes.append(Mode(ctx.mode))
        t = pair.be._step.table
        assert t is not None and t.rows_per_req == 0 and t.max_rows == max(ctx.query_lens)
        for layer in GQA_LAYERS:
            assert pair.run(ctx, layer, ctx.num_tokens) < 1e-5
    assert modes == [Mode.EXTEND, Mode.MIXED, Mode.MIXED]
    # an eager target_verify step of unequal rows (no graph replays one) takes the same kernel
    items = [(seqs[0], [0] * 2), (seqs[1], [0] * 4)]
    ctx = build_step(items, pair.ref_pool, mode=Mode.TARGET_VERIFY, pad_tokens_to=8, pad_seqs_to=3).ctx
    pair.be.init_step_metadata(ctx)
    assert pair.be._step.table.rows_per_req == 0
    for layer in GQA_LAYERS:
        assert pair.run(ctx, layer, ctx.num_tokens) < 1e-5
    assert host_plans == [] and _plans() == [] and not any(e[0] == "init" for e in _Fake.log)
    for name in ("k", "v"):
        assert torch.equal(pair.pool.layer(0)[name], pair.ref_pool.layer(0)[name])


def test_triton_extend_graph_buckets_copy_the_step_and_equal_eager(host_plans):
    """Graph buckets of extend and mixed steps (init_capture_state, then init_replay_state with the
    bucket's request rows): the page table, lengths and query offsets are copied into the static
    buffers (the kernel reads those addresses), the grid is the bucket's, nothing is planned on the
    host; each real row equals the reference's and the same step run eagerly, padded rows (past
    the real ones, and whole padded requests) are zero. A step too large for the buffers and a
    decode-only instance are refused."""
    pair = Pair(extend_impl="triton", decode_impl="triton", layers=GQA_LAYERS)
    pair.be.init_capture_state(32, 8)
    static = pair.be._static
    seqs = [SeqState(i + 1) for i in range(3)]
    gen = torch.Generator().manual_seed(3)
    for ctx in _gqa_steps(pair.ref_pool, seqs, pad_tokens_to=24, pad_seqs_to=6, max_pages=8):
        pair.be.init_replay_state(ctx, 6)
        t = pair.be._step.table
        assert pair.be._step.num_rows == 24 and t.max_rows == 24 and t.rows_per_req == 0
        assert t.page_table.data_ptr() == static["page_table"].data_ptr()
        assert t.query_start_loc.data_ptr() == static["query_start_loc"].data_ptr()
        assert t.query_start_loc.tolist() == ctx.query_start_loc.tolist()
        n = ctx.num_real_tokens
        for layer in GQA_LAYERS:
            q, k, v = (torch.randn(24, h, D, generator=gen) for h in (HQ, HKV, HKV))
            q[n:] = k[n:] = v[n:] = float("nan")
            graph, want = torch.full((24, HQ, D), float("nan")), torch.empty(24, HQ, D)
            pair.ref.gqa_attention(ctx, q, k, v, want, layer, GQA_SCALE)
            pair.be.gqa_attention(ctx, q, k, v, graph, layer, GQA_SCALE)
            assert torch.isfinite(graph).all() and graph[n:].eq(0).all()
            assert float((graph - want).norm() / want.norm()) < 1e-5
            replay = pair.be._step
            pair.be.init_step_metadata(ctx)  # the same step eagerly: its own tensors, its real rows
            eager = torch.full((24, HQ, D), float("nan"))
            pair.be.gqa_attention(ctx, q, k, v, eager, layer, GQA_SCALE)  # stores the same rows again
            assert float((graph[:n] - eager[:n]).norm() / eager[:n].norm()) < 1e-5
            pair.be._step = replay
    assert host_plans == [] and _plans() == []
    for name in ("k", "v"):
        assert torch.equal(pair.pool.layer(0)[name], pair.ref_pool.layer(0)[name])
    big = build_step([(SeqState(5), [0] * 40)], pair.ref_pool, pad_tokens_to=40, pad_seqs_to=1).ctx
    with pytest.raises(ValueError, match=r"flashinfer: extend step of 1 requests and 40 rows replayed in bucket 1 \(static "
                                        r"buffers hold 32 rows\)"):
        pair.be.init_replay_state(big, 1)
    ragged = Pair(decode_impl="triton", layers=GQA_LAYERS)
    ragged.be.init_capture_state(32, 8)
    with pytest.raises(ValueError, match="extend and mixed with extend_impl='triton', this instance's is 'ragged'"):
        ragged.be.init_replay_state(build_step([(SeqState(6), [0] * 3)], ragged.ref_pool, pad_tokens_to=4,
                                               pad_seqs_to=2).ctx, 2)


def test_triton_extend_is_captured_and_its_replay_state_is_device_work(fake_fi):
    """The declaration: GQA extend and mixed steps capturable with extend_impl=triton only (an op
    capture), a choice MLA layers refuse (a choice scope; the constructor too, in one line naming
    the layer and the option). Such an instance records its extend replay state in the graph."""
    cap = FlashInferAttentionBackend.capability
    assert cap.option_choices()["extend_impl"] == ("ragged", "paged", "triton")  # ragged: the default
    assert cap.capturable_modes("gqa_attention", {"extend_impl": "triton"}) == ["decode", "extend", "mixed",
                                                                                 "target_verify"]
    assert cap.capturable_modes("gqa_attention") == cap.capturable_modes("mla_attention", {"extend_impl": "triton"}) \
        == ["decode", "target_verify"]
    assert "serves hgc.gqa_attention only, not hgc.mla_attention" in cap.choice_refusal("mla_attention",
                                                                                          {"extend_impl": "triton"})
    with pytest.raises(ValueError) as info:
        Pair(extend_impl="triton")
    assert str(info.value) == ("layer 2 (extend_impl='triton'): MLA extends are not served by the Triton GQA kernel; "
                               "route MLA layers with extend_impl ragged or paged")
    with pytest.raises(ValueError, match="extend_impl must be one of 'ragged', 'paged', 'triton', not 'fa3'"):
        Pair(extend_impl="fa3", layers=GQA_LAYERS)
    table = Pair(extend_impl="triton", decode_impl="triton", layers=GQA_LAYERS).be
    assert [table.replay_state_in_graph(m) for m in MODES] == [True, True, True, True]
    mixed = Pair(extend_impl="triton", layers=GQA_LAYERS).be  # FlashInfer's decode: planned on the host
    assert [mixed.replay_state_in_graph(m) for m in MODES] == [False, True, True, False]
    assert not any(Pair(decode_impl="triton", layers=GQA_LAYERS).be.replay_state_in_graph(m)
                   for m in (Mode.EXTEND, Mode.MIXED))


def test_the_eager_kernel_of_an_extend_step_is_its_graphs_for_every_step_size():
    """whole_extend_tokens: the rule that picks the GQA kernel of an extend or mixed step (the Triton
    varlen kernel up to the bound, extend_impl's above) gives an eager step of n tokens what the
    graph of the bucket it goes to runs, for every n up to the largest default bucket and every
    choice of the option; and a bucket is captured whole (its GQA gap in the graph) exactly where
    that kernel is the varlen one. A bound that is no bucket breaks the agreement: refused."""
    from compiler.splitops.artifact import (CAPTURED, DEFAULT_EXTEND_TOKEN_COUNTS, EAGER, Piece, SplitPlan,
                                            whole_bound_refusal)
    from runtime.graphs.buckets import Buckets

    cap = FlashInferAttentionBackend.capability
    buckets = Buckets((1,), DEFAULT_EXTEND_TOKEN_COUNTS, 1)
    assert cap.option_choices()["whole_extend_tokens"][0] == "512"
    for choice in fia.WHOLE_EXTEND_TOKENS:
        limit = cap.capture_tokens("gqa_attention", Mode.EXTEND, {"whole_extend_tokens": choice})
        assert limit == int(choice) and not cap.capturable("gqa_attention", Mode.EXTEND, {"whole_extend_tokens": choice})
        for mode in (Mode.EXTEND, Mode.MIXED):
            for n in range(1, DEFAULT_EXTEND_TOKEN_COUNTS[-1] + 1):
                bucket = buckets.key_for(mode, n, 1).tokens
                eager, graph = (fia.varlen_extend(mode, t, "ragged", limit) for t in (n, bucket))
                assert eager == graph, (choice, mode, n, bucket)
                assert graph == (bucket <= limit), "whole exactly where the gap runs the capturable kernel"
        assert all(fia.varlen_extend(Mode.EXTEND, t, "triton", limit) for t in (1, 512, 4096))
    assert not fia.varlen_extend(Mode.TARGET_VERIFY, 8, "ragged", 512), "the bound is about extend and mixed steps"
    from hgc.compile_commands import capturable_column
    assert capturable_column(cap.to_json()).endswith(
        "gqa_attention +extend +mixed (extend_impl=triton); gqa_attention mla_attention +extend +mixed "
        "(steps up to whole_extend_tokens)")
    small = Buckets((1,), (16, 32, 64), 1)
    assert fia.varlen_extend(Mode.EXTEND, 40, "ragged", 48) != fia.varlen_extend(
        Mode.EXTEND, small.key_for(Mode.EXTEND, 40, 1).tokens, "ragged", 48)
    gapped = (Piece(0, CAPTURED, ("a",)), Piece(1, EAGER, ("gqa",)))
    plans = {m: SplitPlan(m, gapped, whole_up_to=48) for m in (Mode.EXTEND, Mode.MIXED)}
    assert "no extend bucket of [16, 32, 64]" in whole_bound_refusal(plans, (16, 32, 64))
    assert whole_bound_refusal(plans, (16, 48, 64)) is None and whole_bound_refusal(plans, (16, 32)) is None


def test_whole_extend_tokens_runs_small_extends_on_the_varlen_kernel_and_captures_them(host_plans):
    """whole_extend_tokens=16 beside FlashInfer's extend: an eager extend step of up to 16 rows takes
    the varlen Triton kernel (no paged metadata, no plan), a larger one FlashInfer's prefill; a graph
    bucket of 16 rows is captured (replay state copied to the static buffers, recorded in the graph),
    one of 24 refused naming the bound."""
    pair = Pair(decode_impl="triton", whole_extend_tokens=16, layers=GQA_LAYERS)
    small = build_step([(SeqState(1), [0] * 5), (SeqState(2), [0] * 9)], pair.ref_pool).ctx
    pair.be.init_step_metadata(small)
    assert pair.be._step.table is not None and pair.be._step.table.rows_per_req == 0 and _plans() == []
    large = build_step([(SeqState(3), [0] * 20)], pair.ref_pool).ctx
    pair.be.init_step_metadata(large)
    assert pair.be._step.table is None and _plans() == ["ragged"]
    assert pair.be.replay_state_in_graph(Mode.EXTEND) and pair.be.replay_state_in_graph(Mode.MIXED)
    pair.be.init_capture_state(32, 4)
    bucket = build_step([(SeqState(4), [0] * 7)], pair.ref_pool, pad_tokens_to=16, pad_seqs_to=4).ctx
    pair.be.init_replay_state(bucket, 4)
    assert pair.be._step.table.page_table.data_ptr() == pair.be._static["page_table"].data_ptr()
    over = build_step([(SeqState(5), [0] * 7)], pair.ref_pool, pad_tokens_to=24, pad_seqs_to=4).ctx
    with pytest.raises(ValueError, match="of up to whole_extend_tokens=16 tokens"):
        pair.be.init_replay_state(over, 4)
    assert FlashInferAttentionBackend._kernel_options({"whole_extend_tokens": "512"}) == {"whole_extend_tokens": 512}


def test_mla_extends_up_to_whole_extend_tokens_run_the_varlen_kernel_eagerly_and_in_graphs(host_plans):
    """MLA layers under whole_extend_tokens=16 (FlashInfer's MLA above it): an eager extend or mixed
    step of up to 16 rows runs the Triton MLA kernel's varlen form from the page table, lengths and
    query offsets (no paged metadata, no plan), a larger one FlashInfer's MLA plan. A graph bucket
    of 16 rows copies the step into the static buffers (device work: recorded in the graph); its
    real rows equal the reference's and the same step's run eagerly, its padding rows are zero."""
    pair = Pair(whole_extend_tokens=16, layers=[2])
    for ctx, _ in zip(_schedule(pair.ref_pool), range(2)):  # 14 and 10 rows: extend, mixed
        pair.be.init_step_metadata(ctx)
        assert pair.be._step.table is not None and pair.be._step.table.rows_per_req == 0
        assert pair.run(ctx, 2, ctx.num_tokens) < 1e-5
    assert host_plans == [] and _plans() == []
    large = build_step([(SeqState(4), [0] * 20)], pair.ref_pool).ctx
    pair.be.init_step_metadata(large)
    assert pair.be._step.table is None and _plans() == ["mla"]
    host_plans.clear()
    _Fake.log.clear()

    pair = Pair(whole_extend_tokens=16, layers=[2])
    assert pair.be.replay_state_in_graph(Mode.EXTEND) and pair.be.replay_state_in_graph(Mode.MIXED)
    pair.be.init_capture_state(32, 8)
    static, gen = pair.be._static, torch.Generator().manual_seed(4)
    steps = _schedule(pair.ref_pool, [SeqState(i + 1) for i in range(3)], pad_tokens_to=16, pad_seqs_to=4,
                      max_pages=8)
    for _, ctx in zip(range(2), steps):
        pair.be.init_replay_state(ctx, 4)
        t = pair.be._step.table
        assert t.rows_per_req == 0 and t.query_start_loc.data_ptr() == static["query_start_loc"].data_ptr()
        assert t.page_table.data_ptr() == static["page_table"].data_ptr()
        n = ctx.num_real_tokens
        args = [torch.randn(16, *shape, generator=gen) for shape in ((HQ, R), (HQ, P), (R,), (P,))]
        for a in args:
            a[n:] = float("nan")
        graph, want = torch.full((16, HQ, R), float("nan")), torch.empty(16, HQ, R)
        pair.ref.mla_attention(ctx, *args, want, 2, MLA_SCALE)
        pair.be.mla_attention(ctx, *args, graph, 2, MLA_SCALE)
        assert torch.isfinite(graph).all() and graph[n:].eq(0).all()
        assert float((graph[:n] - want[:n]).norm() / want[:n].norm()) < 1e-5
        replay = pair.be._step
        pair.be.init_step_metadata(ctx)  # the same step eagerly: its own tensors, its real rows
        eager = torch.full((16, HQ, R), float("nan"))
        pair.be.mla_attention(ctx, *args, eager, 2, MLA_SCALE)
        assert float((graph[:n] - eager[:n]).norm() / eager[:n].norm()) < 1e-5
        pair.be._step = replay
    assert host_plans == [] and _plans() == []


def test_the_binder_refuses_a_recorded_choice_its_backend_scopes_to_other_ops():
    """A routing.json entry giving an MLA node extend_impl=triton (edited, or from a declaration that
    did not scope it) is refused at start-up, as routing refuses the route."""
    from compiler.splitops import CallFacts
    from compiler.splitops.artifact import RouteEntry
    from runtime.artifact.binding import _refusal

    cap = FlashInferAttentionBackend.capability
    options = cap.resolve_options({"extend_impl": "triton"})
    facts = CallFacts("mla_attention", 2, "bfloat16", {"q_latent": (None, 4, 512), "q_rope": (None, 4, 64)}, {})
    entry = RouteEntry("mla_attention", "mla_attention", 2, "full_mla", "flashinfer", options, "bfloat16", "priority")
    assert _refusal(entry, facts, FlashInferAttentionBackend, torch.device("cuda")) == (
        "flashinfer's extend_impl=triton serves hgc.gqa_attention only, not hgc.mla_attention (the Triton kernel "
        "serves GQA layers; MLA extends are not served by it)")
    gqa = dataclasses.replace(entry, op="gqa_attention", kind="full_gqa")
    gqa_facts = CallFacts("gqa_attention", 0, "bfloat16", {"q": (None, 4, 64), "v": (None, 2, 64)}, {})
    assert _refusal(gqa, gqa_facts, FlashInferAttentionBackend, torch.device("cuda")) is None
    # float32 GQA binds where every step is on the Triton kernels, as routing decided it (option_dtypes)
    f32 = dataclasses.replace(gqa_facts, dtype="float32")
    assert _refusal(gqa, f32, FlashInferAttentionBackend, torch.device("cuda")) is None
    ragged = dataclasses.replace(gqa, options=cap.resolve_options({}))
    assert "runs dtypes ['bfloat16', 'float16'], not float32" in _refusal(ragged, f32, FlashInferAttentionBackend,
                                                                          torch.device("cuda"))


def test_decode_impl_is_a_routing_choice_and_refuses_odd_head_dims(fake_fi):
    cap = FlashInferAttentionBackend.capability
    assert cap.option_choices()["decode_impl"] == ("triton", "flashinfer")  # triton: the default
    assert cap.option_choices()["mla_decode_impl"] == ("triton", "flashinfer")
    assert FlashInferAttentionBackend._kernel_options({"mla_decode_impl": "flashinfer"}) == {
        "mla_decode_impl": "flashinfer"}
    assert FlashInferAttentionBackend._kernel_options({"decode_impl": "triton"}) == {"decode_impl": "triton"}
    reg = LayerRegistry([LayerSpec(0, LayerKind.FULL_GQA, kv={"k": TensorSpec((1, 24), "float32"),
                                                              "v": TensorSpec((1, 24), "float32")})])
    with pytest.raises(ValueError, match=r"layer 0 \(decode_impl='triton'\): .*powers of two >= 16, not 24"):
        CPUFlashInferBackend(KVPool(reg, 4, 4), q_heads=2, decode_impl="triton", workspace_bytes=0)
    with pytest.raises(ValueError, match="decode_impl must be"):
        CPUFlashInferBackend(KVPool(reg, 4, 4), q_heads=2, decode_impl="fa3", workspace_bytes=0)


def test_chunk_hook_needs_a_planned_step(fake_fi):
    pair = Pair()
    ctx = next(_schedule(pair.ref_pool))
    with pytest.raises(RuntimeError, match="did not plan"):
        pair.be.init_chunk_metadata(ctx, 64)
    pair.be.init_step_metadata(ctx)
    pair.be.init_chunk_metadata(ctx, 64)


def test_backend_follows_the_protocol_and_declares_its_capability():
    from runtime.backends.protocol import BackendHooks

    cap = FlashInferAttentionBackend.capability
    assert issubclass(FlashInferAttentionBackend, BackendHooks)
    assert FlashInferAttentionBackend.supported_ops == frozenset({"gqa_attention", "mla_attention"})
    assert cap.device == "cuda" and cap.modes_capturable == frozenset({Mode.DECODE, Mode.TARGET_VERIFY})
    assert cap.kinds == frozenset({LayerKind.FULL_GQA, LayerKind.FULL_MLA})


# -- 4. Triton kernels in the interpreter -------------------------------------------------------

_INTERPRETER_SCRIPT = textwrap.dedent("""
    import json, torch
    from testkit.triton_interpreter import install_interpreter_patches
    install_interpreter_patches()  # the interpreter as the suite's kernel tests run it (half the time)
    from compiler.splitops import LayerKind, LayerRegistry, LayerSpec, Mode, TensorSpec
    from runtime.backends.cpu_reference import CPUReferenceBackend
    from runtime.backends.flashinfer_attention import build_paged_metadata, store_kv_rows
    from runtime.backends.kernels.gqa import triton_gqa_attention
    from runtime.backends.kernels.mla import triton_mla_attention, triton_mla_attention_paged
    from runtime.cache.batch import SeqState, build_step, commit_step
    from runtime.cache.kv_pool import KVPool

    ps = 4
    g = torch.Generator().manual_seed(0)
    errors, stores, pad_zero = {}, [], []

    def check(name, out, expect, real):
        # real rows against the reference; every row after them (padding requests) exactly zero
        errors.setdefault(name, []).append(float((out[:real] - expect[:real]).norm() / expect[:real].norm()))
        pad_zero.append(bool(torch.isfinite(out).all() and out[real:].eq(0).all()))

    # MLA: row arrays for every step (extend, mixed, decode, verify); the page table for the
    # decode and verify steps (all requests n rows), padded to 3 requests.
    H, R, P = 20, 32, 16
    reg = LayerRegistry([LayerSpec(0, LayerKind.FULL_MLA, kv={"latent": TensorSpec((R + P,), "float32")})])
    ref_pool, pool = KVPool(reg, 32, ps), KVPool(reg, 32, ps)
    ref = CPUReferenceBackend(ref_pool, None)
    seqs = [SeqState(1), SeqState(2)]
    for items, mode in (([(0, 6), (1, 3)], None), ([(0, 1), (1, 5)], None), ([(0, 1), (1, 1)], Mode.DECODE),
                        ([(0, 3), (1, 3)], Mode.TARGET_VERIFY)):
        step_items = [(seqs[i], [0] * n) for i, n in items]
        ctx = build_step(step_items, ref_pool, pad_tokens_to=12, pad_seqs_to=3, mode=mode).ctx
        T, n = ctx.num_tokens, ctx.num_real_tokens
        x = [torch.randn(T, H, R, generator=g), torch.randn(T, H, P, generator=g),
             torch.randn(T, R, generator=g), torch.randn(T, P, generator=g)]
        expect = torch.empty(T, H, R)
        ref.mla_attention(ctx, *x, expect, 0, 0.2)
        lat = pool.layer(0)["latent"]
        store_kv_rows(ctx.slot_mapping, ps, (x[2], lat[..., :R]), (x[3], lat[..., R:]))
        stores.append(bool(torch.equal(lat, ref_pool.layer(0)["latent"])))
        meta = build_paged_metadata(ctx)
        for splits in (1, 4):
            out = torch.full((n, H, R), float("nan"))
            triton_mla_attention(x[0][:n], x[1][:n], lat[..., :R], lat[..., R:], meta.kv_indptr, meta.kv_indices,
                                 meta.row_req, meta.row_pos, out, 0.2, num_splits=splits)
            check("mla rows", out, expect, n)
            if mode is not None:
                per = items[0][1]
                rows = ctx.num_seqs * per
                out = torch.full((rows, H, R), float("nan"))
                triton_mla_attention_paged(x[0][:rows], x[1][:rows], lat[..., :R], lat[..., R:], ctx.page_table,
                                           ctx.seq_lens, per, out, 0.2, num_splits=splits)
                check("mla table", out, expect, n)
        commit_step(step_items)

    # GQA from the page table: decode and verify rows (n = 4, after which each request keeps
    # some of its n tokens, as after rejected drafts), requests crossing page boundaries, two
    # padding requests with NaN queries, 1 and 4 splits of 16-key blocks; a group of 4 heads
    # (one tile of 16 rows), and in verify steps one of 20 with head dims 32 / 16 (80 rows: two
    # row blocks).
    decode, verify = (Mode.DECODE, 1), (Mode.TARGET_VERIFY, 4)
    for Hq, Hkv, D, DV, steps in ((8, 2, 16, 16, (decode, verify, verify, decode)), (20, 1, 32, 16, (verify,))):
        kv = {"k": TensorSpec((Hkv, D), "float32"), "v": TensorSpec((Hkv, DV), "float32")}
        pool = KVPool(LayerRegistry([LayerSpec(0, LayerKind.FULL_GQA, kv=kv)]), 64, ps)
        ref = CPUReferenceBackend(pool, None)  # it writes each step's K/V: the kernel reads them
        seqs = [SeqState(1), SeqState(2), SeqState(3)]
        prefill = [(s, [0] * n) for s, n in zip(seqs, (21, 34, 6))]
        for items, mode, n in ((prefill, None, 0), *(([(s, [0] * n) for s in seqs], mode, n) for mode, n in steps)):
            ctx = build_step(items, pool, mode=mode, pad_seqs_to=5, pad_tokens_to=5 * max(n, 1) + 40 * (n == 0)).ctx
            T, real = ctx.num_tokens, ctx.num_real_tokens
            x = [torch.randn(T, Hq, D, generator=g), torch.randn(T, Hkv, D, generator=g),
                 torch.randn(T, Hkv, DV, generator=g)]
            for t in x:
                t[real:] = float("nan")
            expect = torch.empty(T, Hq, DV)
            ref.gqa_attention(ctx, *x, expect, 0, 0.25)
            for splits in (1, 4) if n else ():
                out = torch.full((T, Hq, DV), float("nan"))
                triton_gqa_attention(x[0], pool.layer(0)["k"], pool.layer(0)["v"], ctx.page_table, ctx.seq_lens, n,
                                     out, 0.25, num_splits=splits, block_n=16)
                check(f"gqa {Hq}/{Hkv}/{D}/{DV} n={n} splits={splits}", out, expect, real)
            commit_step(items)
            for s in seqs if n == 4 else ():
                s.num_cached -= int(torch.randint(0, 4, (1,), generator=g))
    try:
        triton_gqa_attention(torch.zeros(1, 2, 24), torch.zeros(1, 4, 1, 24), torch.zeros(1, 4, 1, 24),
                             torch.zeros(1, 1, dtype=torch.int32), torch.ones(1, dtype=torch.int32), 1,
                             torch.zeros(1, 2, 24), 1.0)
        refusal = None
    except ValueError as e:
        refusal = str(e)
    print(json.dumps({"errors": errors, "stores": stores, "pad_zero": pad_zero, "refusal": refusal}))
""")


def test_triton_kernels_in_the_interpreter():
    """The K/V store, the MLA kernel (row arrays and page table) and the GQA kernel (page table)
    under Triton's interpreter against the CPU reference, in float32 on fresh random inputs."""
    pytest.importorskip("triton")
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=str(ROOT))
    proc = subprocess.run([sys.executable, "-c", _INTERPRETER_SCRIPT], env=env, cwd=ROOT, capture_output=True,
                          text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert all(result["stores"]), "the store kernel must write every real row and skip padding rows"
    errors = result["errors"]
    assert len(errors["mla rows"]) == 8 and len(errors["mla table"]) == 4
    assert sum(1 for name in errors if name.startswith("gqa")) == 6, sorted(errors)  # (n=1, 4; 4) x 2 splits
    assert max(max(e) for e in errors.values()) < 1e-5, errors
    assert all(result["pad_zero"]), "padding requests must get finite zero rows"
    assert result["refusal"] == "the Triton GQA kernel takes head dims that are powers of two >= 16, not 24"


def test_the_triton_mla_backend_runs_mla_without_flashinfer(monkeypatch):
    """triton_mla (the backend routing picks for float32 MLA on cuda, or by --route) on the CPU: the
    Triton MLA kernel under Triton's interpreter, the paged metadata and row store of the FlashInfer
    backend it extends, against the CPU reference over three steps (fresh extend, mixed, decode) in
    float32; flashinfer is not importable and never asked for."""
    pytest.importorskip("triton")
    from runtime.backends.triton_mla import TritonMLABackend

    class CPUTritonMLA(TritonMLABackend):
        def _check_device(self) -> None:  # the interpreter runs on the CPU
            pass

    monkeypatch.setitem(sys.modules, "flashinfer", None)  # `import flashinfer` would raise
    monkeypatch.setattr(fia, "store_kv_rows", _store_rows_torch)
    pool, ref_pool = KVPool(REGISTRY, 64, 4), KVPool(REGISTRY, 64, 4)
    be = CPUTritonMLA(pool, q_heads=HQ, scales={2: MLA_SCALE}, layers=[2], mla_rope_dim=P)
    assert be.flashinfer is None and set(be.layers) == {2} and be.workspace.numel() == 0
    with pytest.raises(ValueError, match=r"serves MLA layers only; layers \[0\] are GQA"):
        CPUTritonMLA(pool, q_heads=HQ, scales={0: GQA_SCALE}, layers=[0])
    ref = CPUReferenceBackend(ref_pool, None)
    gen = torch.Generator().manual_seed(1)
    for ctx in _schedule(ref_pool, pad_tokens_to=16, pad_seqs_to=4):
        be.init_step_metadata(ctx)
        T, n = ctx.num_tokens, ctx.num_real_tokens
        args = [torch.randn(T, HQ, R, generator=gen), torch.randn(T, HQ, P, generator=gen),
                torch.randn(T, R, generator=gen), torch.randn(T, P, generator=gen)]
        for a in args:
            a[n:] = float("nan")
        out, want = torch.full((T, HQ, R), float("nan")), torch.empty(T, HQ, R)
        ref.mla_attention(ctx, *args, want, 2, MLA_SCALE)
        be.mla_attention(ctx, *args, out, 2, MLA_SCALE)
        assert torch.isfinite(out).all() and out[n:].eq(0).all()
        assert float((out - want).norm() / want.norm()) < 1e-5
    assert torch.equal(pool.layer(2)["latent"], ref_pool.layer(2)["latent"])
