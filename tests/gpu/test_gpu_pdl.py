"""Programmatic dependent launch (runtime/backends/kernels/pdl.py) on a Hopper GPU: the same bits.

PDL changes when a kernel's programs start, never what they compute: each kernel waits for the one
before it to complete before it reads the step's data or writes anything. For each family of decode
kernels that takes it, a chain of launches (each reading what the one before wrote) is captured in
a CUDA graph with PDL on and again with it off, on fresh random inputs at bench qwen3_next's dims
(hidden 2048, attention head dim 256, GDN heads 16 / 32 of 128, 16 experts of 512 with a gated
shared expert), each side on its own copy of the same inputs and states; both graphs are replayed
twice (states carried from one replay to the next) and every output and state must be equal bit
for bit. The kernels are also checked to have been compiled with launch_pdl on the PDL side.

Families: the GEMV (one, two and four rows: its one-step, DOT and looped paths), the MoE (the token
path at batch 1, the sorted path at 32 and 256 tokens, the one-launch router at each), the GDN
decode (the split at batch 1 in two launches and in one, the one launch, the four unfused launches
at batch 8), GQA attention
(the K/V store, the split pass and its combine) and MLA attention (the split pass from the page
table and the combine) at batch 1 and 8.

Runs only on the GPU machine (`pytest -m gpu`); skipped below compute capability 9.
"""

from __future__ import annotations

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

DEV = torch.device("cuda")
D, I, E, TOP_K = 2048, 512, 16, 4
HQ, HKV, HEAD, PAGE = 16, 2, 256, 16
HK, HV, DK, DV, KW = 16, 32, 128, 128, 4
REPLAYS = 2


@pytest.fixture(autouse=True)
def pdl():
    if torch.cuda.get_device_capability()[0] < 9:
        pytest.skip("programmatic dependent launch needs compute capability 9 or more")
    from runtime.backends.kernels import pdl

    before = pdl.enabled()
    yield pdl
    pdl.enable(before)


def randn(g: torch.Generator, *shape, scale: float = 1.0, dtype=torch.bfloat16) -> torch.Tensor:
    return (torch.randn(*shape, device=DEV, generator=g) * scale).to(dtype)


def captured(pdl, make, on: bool) -> dict[str, torch.Tensor]:
    """`make(seed)` -> (run, tensors): a fresh copy of the case's inputs and states, and the chain
    of launches over them. One copy runs eagerly (its kernels compiled, scratch buffers grown, never
    inside a capture); a second is captured with PDL `on` and replayed REPLAYS times. Its tensors
    (outputs and states) after the replays."""
    pdl.enable(on)
    try:
        assert bool(pdl.launch_options(DEV)) == on
        warm, _ = make(0)
        warm()
        torch.cuda.synchronize()
        run, tensors = make(0)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            run()
        for _ in range(REPLAYS):
            graph.replay()
        torch.cuda.synchronize()
        return {name: t.clone() for name, t in tensors.items()}
    finally:
        pdl.enable(False)


def compiled_with_pdl(kernel) -> bool:
    """Whether Triton compiled `kernel` (a JITFunction) with launch_pdl for some launch."""
    return any(getattr(c.metadata, "launch_pdl", False)
               for per_device in kernel.device_caches.values() for c in per_device[0].values())


def same_bits(pdl, make, kernels) -> None:
    off = captured(pdl, make, False)
    on = captured(pdl, make, True)
    for name in off:
        assert torch.isfinite(off[name].float()).all(), f"{name}: not every value written"
        assert torch.equal(on[name], off[name]), f"{name}: PDL changed the bits"
    missing = [k.fn.__name__ for k in kernels if not compiled_with_pdl(k)]
    assert not missing, f"compiled without launch_pdl: {missing}"


# -- the GEMV ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("rows", [1, 2, 4])
def test_gemv_chain(pdl, rows):
    """Output projection (2048 x 4096) then GDN input projection (12352 x 2048), three times: each
    GEMV reads the one before's output (a 4096-column view of it, as a layer reads its slices)."""
    from runtime.backends.kernels import gemv

    def make(seed):
        g = torch.Generator(device=DEV).manual_seed(seed)
        w_out, w_in = randn(g, 2048, 4096, scale=4096 ** -0.5), randn(g, 12352, 2048, scale=2048 ** -0.5)
        x = randn(g, rows, 12352)
        outs = {f"y{i}": torch.empty(rows, n, dtype=torch.bfloat16, device=DEV)
                for i, n in enumerate((2048, 12352) * 3)}

        def run():
            h = x
            for i, w in enumerate((w_out, w_in) * 3):
                h = gemv.small_m_linear(h[:, :w.shape[1]], w, outs[f"y{i}"])
        return run, outs

    same_bits(pdl, make, [gemv._gemv_kernel])


# -- the MoE -------------------------------------------------------------------------------------------


@pytest.mark.parametrize("T,router", [(1, "two_launches"), (32, "two_launches"), (256, "two_launches"),
                                      (1, "one_launch"), (32, "one_launch"), (256, "one_launch"),
                                      (32, "counted"), (256, "split_counted"), (256, "split_down")])
def test_moe_chain(pdl, T, router):
    """Three MoE layers, each reading the one before's output: routing, expert GEMMs and combine;
    one_launch: the router in one launch (its last program routes, and at 32 sorts); counted: the
    sort's ranks counted (sort_ranks=counted), with split past 128 tokens the split router too;
    split_down: the down as torch's GEMMs between our launches, and the split combine (down=split)."""
    from runtime.backends.kernels import moe
    from runtime.backends.kernels.moe_config import default_config, fit_shared_memory

    config = fit_shared_memory(default_config(T, E, I, D, TOP_K), 2)  # as the backend launches it, bf16

    def make(seed):
        g = torch.Generator(device=DEV).manual_seed(seed)
        layers = [(randn(g, E, D, scale=D ** -0.5), None, randn(g, E, 2 * I, D, scale=D ** -0.5),
                   randn(g, E, D, I, scale=I ** -0.5), randn(g, 2 * I, D, scale=D ** -0.5),
                   randn(g, D, I, scale=I ** -0.5), randn(g, 1, D, scale=D ** -0.5)) for _ in range(3)]
        x = randn(g, T, D)
        outs = {f"out{i}": torch.empty(T, D, dtype=torch.bfloat16, device=DEV) for i in range(3)}

        def run():
            h = x
            for i, layer in enumerate(layers):
                moe.fused_moe(h, *layer, outs[f"out{i}"], TOP_K, "softmax", True, 1.0, 1, 1, config,
                              one_launch_router=router == "one_launch",
                              logits_kernel="split" if router == "split_counted" else None,
                              count_ranks=router.endswith("counted"), split_down=router == "split_down")
                h = outs[f"out{i}"]
        return run, outs

    kernels = {1: [moe._logits_gemv_kernel, moe._route_kernel, moe._gate_up_token_kernel, moe._down_token_kernel],
               32: [moe._logits_gemv_kernel, moe._route_sort_kernel, moe._gate_up_sorted_kernel,
                    moe._down_sorted_kernel, moe._combine_kernel],
               256: [moe._logits_kernel, moe._route_kernel, moe._align_count_kernel, moe._align_kernel,
                     moe._gate_up_sorted_kernel, moe._down_sorted_kernel, moe._combine_kernel]}[T]
    if router == "one_launch":
        kernels = [moe._router_kernel if T < 256 else moe._logits_route_kernel] + kernels[2:]
    if router == "split_counted":
        kernels = [moe._split_router_kernel] + kernels[2:]
    if router == "split_down":
        kernels = kernels[:-2] + [moe._combine_split_kernel]
    same_bits(pdl, make, kernels)


# -- the GDN decode ------------------------------------------------------------------------------------


@pytest.mark.parametrize("path,B", [("split", 1), ("split_one", 1), ("one", 1), ("four", 8)])
def test_gdn_decode_chain(pdl, path, B):
    """Two GDN layers' decode, the second reading the first's output (a slice of it as its qkv), each
    on its own conv and recurrent states, every request on a slot of its own."""
    from runtime.backends.kernels import gdn_fused as GF
    from runtime.backends.kernels import linear as L

    C = 2 * HK * DK + HV * DV
    dims = GF.GdnDims(HK, HV, DK, DV, C, KW)

    def layer(g):
        return dict(conv_w=randn(g, C, KW, scale=0.5), A_log=randn(g, HV, dtype=torch.float32),
                    dt_bias=randn(g, HV, dtype=torch.float32), norm_w=randn(g, DV),
                    conv=randn(g, B + 2, C, KW - 1, scale=0.5, dtype=torch.float32),
                    state=randn(g, B + 2, HV, DK, DV, scale=0.5, dtype=torch.float32))

    def decode(p, qkv, z, b, a, out, slots):
        if path != "four":
            GF.gdn_fused_decode(qkv, z, b, a, p["conv_w"], p["A_log"], p["dt_bias"], p["norm_w"], out, p["conv"],
                                p["state"], slots, HK, DK ** -0.5, 1e-6, launches=1 if path == "one" else 2,
                                merged_split=path == "split_one")
            return
        mixed = torch.empty(qkv.shape, dtype=qkv.dtype, device=DEV)  # contiguous, as qk_gates takes it
        L.short_conv_decode(qkv, p["conv_w"], None, mixed, p["conv"], slots, True)
        q, k, v, g, beta = GF.qk_gates(mixed, b, a, p["A_log"], p["dt_bias"], dims)
        core = torch.empty_like(out)
        L.gdn_decode(q, k, v, g, beta, core, p["state"], slots, DK ** -0.5)
        GF.gated_rmsnorm(core, z, p["norm_w"], out, 1e-6, slots=slots, rows_per_slot=1)

    def make(seed):
        g = torch.Generator(device=DEV).manual_seed(seed)
        layers = [layer(g) for _ in range(2)]
        qkv, z, b, a = randn(g, B, C), randn(g, B, HV, DV), randn(g, B, HV), randn(g, B, HV)
        slots = torch.arange(1, B + 1, dtype=torch.int64, device=DEV)
        outs = {f"out{i}": torch.empty(B, HV, DV, dtype=torch.bfloat16, device=DEV) for i in range(2)}

        def run():
            x = qkv
            for i, p in enumerate(layers):
                decode(p, x, z, b, a, outs[f"out{i}"], slots)
                x = torch.cat([outs[f"out{i}"].reshape(B, -1)] * 3, dim=1)[:, :C]  # a torch kernel between
        return run, {**outs, **{f"{k}{i}": p[k] for i, p in enumerate(layers) for k in ("conv", "state")}}

    kernels = {"split": [GF._split_prep_kernel, GF._split_core_kernel], "split_one": [GF._split_one_kernel],
               "one": [GF._gdn_fused_decode_kernel],
               "four": [L._short_conv_decode_kernel, GF._qk_gates_kernel, L._recurrent_decode_kernel,
                        GF._gated_rmsnorm_kernel]}[path]
    same_bits(pdl, make, kernels)


# -- GQA attention -------------------------------------------------------------------------------------


@pytest.mark.parametrize("B", [1, 8])
def test_gqa_chain(pdl, B):
    """Two attention layers' decode: each stores its row's K and V (slices of its input) into its
    paged cache, then attends over 300 cached keys; the second layer's input is the first's output."""
    from runtime.backends.flashinfer_attention import _store_rows_kernel, store_kv_rows
    from runtime.backends.kernels import gqa, split_kv

    pages_per_req = 32
    seq_len = 300

    def make(seed):
        g = torch.Generator(device=DEV).manual_seed(seed)
        caches = [(randn(g, B * pages_per_req, PAGE, HKV, HEAD), randn(g, B * pages_per_req, PAGE, HKV, HEAD))
                  for _ in range(2)]
        table = torch.arange(B * pages_per_req, dtype=torch.int32, device=DEV).view(B, pages_per_req)
        lens = torch.full((B,), seq_len, dtype=torch.int32, device=DEV)
        slots = (table[:, (seq_len - 1) // PAGE].to(torch.int64) * PAGE + (seq_len - 1) % PAGE).contiguous()
        x = randn(g, B, HQ, HEAD)
        outs = {f"out{i}": torch.empty(B, HQ, HEAD, dtype=torch.bfloat16, device=DEV) for i in range(2)}

        def run():
            q = x
            for i, (k_cache, v_cache) in enumerate(caches):
                store_kv_rows(slots, PAGE, (q[:, :HKV], k_cache), (q[:, HKV:2 * HKV], v_cache))
                gqa.triton_gqa_attention(q, k_cache, v_cache, table, lens, 1, outs[f"out{i}"], HEAD ** -0.5)
                q = outs[f"out{i}"]
        return run, {**outs, **{f"{side}_cache{i}": c for i, pair in enumerate(caches) for side, c in zip("kv", pair)}}

    same_bits(pdl, make, [_store_rows_kernel, gqa._gqa_split_kernel, split_kv._combine_kernel])


# -- MLA attention -------------------------------------------------------------------------------------


@pytest.mark.parametrize("B", [1, 8])
def test_mla_chain(pdl, B):
    """Two MLA layers' decode from the page table (kimi_linear's and bailing_linear's full layers: a
    latent of 512, a rope part of 64): each attends over 300 cached latents; the second layer's
    latent query is the first's output."""
    from runtime.backends.kernels import mla, split_kv

    R, P, pages_per_req, seq_len = 512, 64, 32, 300

    def make(seed):
        g = torch.Generator(device=DEV).manual_seed(seed)
        caches = [randn(g, B * pages_per_req, PAGE, R + P) for _ in range(2)]
        table = torch.arange(B * pages_per_req, dtype=torch.int32, device=DEV).view(B, pages_per_req)
        lens = torch.full((B,), seq_len, dtype=torch.int32, device=DEV)
        q_lat, q_rope = randn(g, B, HQ, R), randn(g, B, HQ, P)
        outs = {f"out{i}": torch.empty(B, HQ, R, dtype=torch.bfloat16, device=DEV) for i in range(2)}

        def run():
            q = q_lat
            for i, cache in enumerate(caches):
                mla.triton_mla_attention_paged(q, q_rope, cache[..., :R], cache[..., R:], table, lens, 1,
                                               outs[f"out{i}"], (R + P) ** -0.5)
                q = outs[f"out{i}"]
        return run, outs

    same_bits(pdl, make, [mla._mla_split_kernel, split_kv._combine_kernel])
