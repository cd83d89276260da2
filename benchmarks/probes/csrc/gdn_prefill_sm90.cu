// FlashInfer's SM90 GDN prefill kernel (flat/prefill/prefill_kernel_delta_rule_sm90.cuh, FlashInfer 0.6)
// in the one variant bench qwen3_next's GDN layers take: bf16 q/k/v, more value heads than key heads
// (GVA), beta and alpha given, an initial state per request. FlashInfer's own JIT module instantiates
// all 32 variants in one translation unit, which nvcc did not finish within a GPU call (480 s); this file
// instantiates one, behind a C function that ctypes can call (gdn_prefill_probe.py prints the nvcc
// command, --build-command, and loads the library).
#include <cuda_bf16.h>

#include <exception>
#include <cstdio>

#include "flat/prefill/prefill_kernel_delta_rule_sm90.cuh"

extern "C" int hgc_gdn_prefill_bf16_gva(void* output, float* output_state, void const* q, void const* k,
                                        void const* v, float const* input_state, float const* alpha,
                                        float const* beta, int64_t const* cu_seqlens, int32_t num_seqs,
                                        int32_t num_q_heads, int32_t num_k_heads, int32_t num_v_heads,
                                        int32_t head_size, int64_t total_seqlen, float scale, int32_t sm_count,
                                        cudaStream_t stream) {
  try {
    flat::launch_delta_rule_prefill_kernel_gbai<true, true, true, true, cutlass::arch::Sm90, nv_bfloat16,
                                                nv_bfloat16, float>(
        stream, static_cast<nv_bfloat16*>(output), output_state, static_cast<nv_bfloat16 const*>(q),
        static_cast<nv_bfloat16 const*>(k), static_cast<nv_bfloat16 const*>(v), input_state, alpha, beta,
        cu_seqlens, num_seqs, num_q_heads, num_k_heads, num_v_heads, /*num_o_heads=*/num_v_heads, head_size,
        total_seqlen, scale, sm_count);
  } catch (std::exception const& e) {
    std::fprintf(stderr, "hgc_gdn_prefill_bf16_gva: %s\n", e.what());
    return 1;
  }
  return cudaGetLastError() == cudaSuccess ? 0 : 2;
}
