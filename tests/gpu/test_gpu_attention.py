"""FlashInfer attention backend against the CPU reference, on a CUDA GPU with flashinfer: the
checks of testkit/attention_cases.py, asserted.

Run: python -m pytest -m gpu tests/gpu/test_gpu_attention.py
"""

from __future__ import annotations

import importlib.util

import pytest
import torch

from runtime.cache.batch import build_step
from testkit.attention_cases import (GQA_64, MHA_128, MLA_16, MLA_32, QWEN3_NEXT, Harness, check_decode, check_extend,
                                     check_graph_decode, check_graph_growing, check_padded_decode, check_verify)

HAS_GPU = torch.cuda.is_available() and importlib.util.find_spec("flashinfer") is not None
pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not HAS_GPU, reason="needs a CUDA GPU and flashinfer (the gpu extra)")]



GQA_CONFIGS = [QWEN3_NEXT, MHA_128]
MLA_CONFIGS = [MLA_16, MLA_32]
MLA_IMPLS = ["flashinfer", "triton"]


def _assert(result: dict) -> None:
    assert result["ok"] and result.get("caches_match", True) and result.get("ok_graph_vs_eager", True), result


@pytest.mark.parametrize("cfg", GQA_CONFIGS, ids=lambda c: c.name)
@pytest.mark.parametrize("batch", [1, 3, 64, 256])
def test_gqa_decode(cfg, batch):
    _assert(check_decode(cfg, batch))


@pytest.mark.parametrize("kw", [{"decode_tensor_cores": False}, {"decode_tensor_cores": True},
                                {"decode_tensor_cores": True, "decode_backend": "fa3"}], ids=str)
def test_gqa_decode_every_decode_kernel(kw):
    _assert(check_decode(QWEN3_NEXT, 33, **kw))


def test_gqa_decode_page_size_1():
    _assert(check_decode(QWEN3_NEXT, 9, max_len=300, page_size=1))


@pytest.mark.parametrize("cfg", GQA_CONFIGS, ids=lambda c: c.name)
@pytest.mark.parametrize("kw", [{"extend_impl": "paged"}, {"extend_impl": "ragged"},
                                {"extend_impl": "paged", "prefill_backend": "fa2"}], ids=str)
def test_gqa_extend_chunked_mixed_padded(cfg, kw):
    _assert(check_extend(cfg, **kw))


@pytest.mark.parametrize("cfg", GQA_CONFIGS, ids=lambda c: c.name)
def test_gqa_padded_decode(cfg):
    _assert(check_padded_decode(cfg))


@pytest.mark.parametrize("cfg", GQA_CONFIGS, ids=lambda c: c.name)
def test_gqa_graph_decode(cfg):
    _assert(check_graph_decode(cfg))


@pytest.mark.parametrize("impl", MLA_IMPLS)
@pytest.mark.parametrize("cfg", MLA_CONFIGS, ids=lambda c: c.name)
@pytest.mark.parametrize("batch", [1, 37, 128])
def test_mla_decode(impl, cfg, batch):
    _assert(check_decode(cfg, batch, mla_impl=impl))


@pytest.mark.parametrize("impl", MLA_IMPLS)
@pytest.mark.parametrize("cfg", MLA_CONFIGS, ids=lambda c: c.name)
def test_mla_extend_chunked_mixed_padded(impl, cfg):
    _assert(check_extend(cfg, mla_impl=impl))


@pytest.mark.parametrize("impl", MLA_IMPLS)
@pytest.mark.parametrize("cfg", MLA_CONFIGS, ids=lambda c: c.name)
def test_mla_extend_on_the_varlen_kernel_under_whole_extend_tokens(impl, cfg):
    """Every step of check_extend (up to 338 rows) under whole_extend_tokens=512: MLA groups run the
    Triton MLA kernel's varlen form from the page table, lengths and query offsets, whatever mla_impl."""
    _assert(check_extend(cfg, mla_impl=impl, whole_extend_tokens=512))


@pytest.mark.parametrize("impl", MLA_IMPLS)
def test_mla_graph_decode(impl):
    _assert(check_graph_decode(MLA_32, mla_impl=impl))


@pytest.mark.parametrize("cfg", GQA_CONFIGS, ids=lambda c: c.name)
@pytest.mark.parametrize("kw", [{}, {"prefill_backend": "fa2"}], ids=str)
def test_gqa_verify_steps_eager_and_replayed(cfg, kw):
    _assert(check_verify(cfg, **kw))


@pytest.mark.parametrize("impl", MLA_IMPLS)
def test_mla_verify_steps_eager_and_replayed(impl):
    _assert(check_verify(MLA_32, mla_impl=impl))


# -- decode_impl="triton": the plan-free Triton decode kernel (runtime/backends/kernels/gqa.py) ------

TRITON_GQA_CONFIGS = [QWEN3_NEXT, GQA_64]
TRITON_DTYPES = [torch.bfloat16, torch.float32]


@pytest.mark.parametrize("dtype", TRITON_DTYPES, ids=str)
@pytest.mark.parametrize("cfg", TRITON_GQA_CONFIGS, ids=lambda c: c.name)
@pytest.mark.parametrize("batch", [1, 3, 64])
def test_triton_gqa_decode(cfg, dtype, batch):
    _assert(check_decode(cfg, batch, dtype=dtype, decode_impl="triton"))


@pytest.mark.parametrize("dtype", TRITON_DTYPES, ids=str)
@pytest.mark.parametrize("cfg", TRITON_GQA_CONFIGS, ids=lambda c: c.name)
def test_triton_gqa_padded_decode_writes_no_padding_row(cfg, dtype):
    _assert(check_padded_decode(cfg, dtype=dtype, decode_impl="triton"))


@pytest.mark.parametrize("dtype", TRITON_DTYPES, ids=str)
@pytest.mark.parametrize("cfg", TRITON_GQA_CONFIGS, ids=lambda c: c.name)
def test_triton_gqa_verify_steps_eager_and_replayed(cfg, dtype):
    _assert(check_verify(cfg, dtype=dtype, decode_impl="triton"))


@pytest.mark.parametrize("dtype", TRITON_DTYPES, ids=str)
@pytest.mark.parametrize("cfg", TRITON_GQA_CONFIGS, ids=lambda c: c.name)
def test_triton_gqa_graph_decode(cfg, dtype):
    _assert(check_graph_decode(cfg, dtype=dtype, decode_impl="triton"))


@pytest.mark.parametrize("cfg", TRITON_GQA_CONFIGS, ids=lambda c: c.name)
def test_triton_gqa_graph_replays_growing_lengths_like_eager(cfg):
    _assert(check_graph_growing(cfg, decode_impl="triton"))


@pytest.mark.parametrize("check", [check_decode, check_graph_decode, check_verify], ids=lambda f: f.__name__)
def test_mla_decode_on_the_triton_kernel_beside_flashinfers_mla(check):
    """The routing default for a bf16 MLA layer on this backend: FlashInfer's MLA for extends, the
    Triton MLA kernel's page-table mode for decode and verify steps (mla_decode_impl="triton"),
    eager and replayed, against the reference."""
    args = (MLA_32, 37) if check is check_decode else (MLA_32,)
    _assert(check(*args, mla_impl="flashinfer", mla_decode_impl="triton"))


def test_triton_mla_decode_in_float32():
    """The MLA kernel's page-table mode (decode steps of the triton_mla backend) in float32."""
    _assert(check_decode(MLA_16, 5, dtype=torch.float32, mla_impl="triton"))


def test_split_kernels_build_once_for_every_row_count_and_table_width():
    """Steps of 1 to 300 rows (1 to 32 splits) over page tables 3 and 256 pages wide run on the
    kernels the first of them compiled: a compiled artifact's bundle, built over its buckets, then
    holds every kernel a later step of any size needs (nothing is built mid-serving)."""
    from runtime.backends.kernels import gqa as triton_gqa, mla as triton_mla, split_kv as triton_split_kv

    dev, R, P, page = "cuda", 64, 16, 16
    ckv = torch.randn(600, page, R, device=dev, dtype=torch.bfloat16)
    kpe = torch.randn(600, page, P, device=dev, dtype=torch.bfloat16)
    k_cache = torch.randn(600, page, 2, 64, device=dev, dtype=torch.bfloat16)
    kernels = (triton_mla._mla_split_kernel, triton_gqa._gqa_split_kernel, triton_split_kv._combine_kernel)

    def step(rows: int, width: int) -> None:
        lens = torch.full((rows,), min(40, width * page), dtype=torch.int32, device=dev)
        table = torch.randint(0, 600, (rows, width), dtype=torch.int32, device=dev)
        q = torch.randn(rows, 4, R, device=dev, dtype=torch.bfloat16)
        triton_mla.triton_mla_attention_paged(q, torch.randn(rows, 4, P, device=dev, dtype=torch.bfloat16), ckv, kpe,
                                              table, lens, 1, torch.empty_like(q), 0.1)
        qg = torch.randn(rows, 8, 64, device=dev, dtype=torch.bfloat16)
        triton_gqa.triton_gqa_attention(qg, k_cache, k_cache, table, lens, 1, torch.empty_like(qg), 0.1)

    def compiled() -> list[set]:
        return [{key for per_device in k.device_caches.values() for key in per_device[0]} for k in kernels]

    step(1, 3)
    first = compiled()
    for rows, width in [(1, 256), (7, 3), (7, 256), (300, 3), (300, 256)]:
        step(rows, width)
    torch.cuda.synchronize()
    for kernel, before, after in zip(kernels, first, compiled()):
        assert after == before, f"{kernel.fn.__name__}: {len(after - before)} more compiled variant(s)"


def test_unplanned_step_raises():
    from runtime.backends.flashinfer_attention import FlashInferAttentionBackend  # noqa: F401

    h = Harness(QWEN3_NEXT, num_pages=8)
    seqs = h.new_seqs([3])
    built = build_step([(seqs[0], [0])], h.cpu_pool, device="cuda")
    x = {k: v.cuda() for k, v in h.inputs(1).items()}
    out = torch.empty(h.out_shape(1), dtype=torch.bfloat16, device="cuda")
    with pytest.raises(RuntimeError, match="not planned"):
        h.call(h.backend, built.ctx, x, out)
