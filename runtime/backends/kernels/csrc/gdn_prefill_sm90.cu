// FlashInfer's SM90 GDN prefill kernel (flat/prefill/prefill_kernel_delta_rule_sm90.cuh, FlashInfer 0.6)
// in the one variant bench qwen3_next's GDN layers take: bf16 q/k/v, more value heads than key heads
// (GVA), beta and alpha given, an initial state per request. FlashInfer's own JIT module instantiates
// all 32 variants in one translation unit, which nvcc did not finish within a GPU call (480 s); this file
// instantiates one, behind C functions that ctypes can call (gdn_prefill_probe.py prints the nvcc
// command, --build-command, and loads the library).
//
// Two entry points:
// - hgc_gdn_prefill_bf16_gva: FlashInfer's own launch function. It allocates the kernel's workspace
//   (a TMA descriptor per SM) with cudaMalloc and frees it in every call, so it cannot be captured in
//   a CUDA graph, and it takes q, k, v with contiguous rows.
// - hgc_gdn_prefill_bf16_gva_into: the same kernel type launched here with the caller's workspace
//   (hgc_gdn_prefill_workspace_bytes of it, kept across calls) and the values' row stride given, so
//   they may be a strided view of the convolution's output; nothing is allocated in the call.
#include <cuda_bf16.h>

#include <cstdio>
#include <exception>

#include "flat/prefill/prefill_kernel_delta_rule_sm90.cuh"

namespace {

using namespace cute;
using namespace flat::kernel;

// The options FlashInfer's launcher adds for this variant, in its order (the kernel type is the same).
using GvaOptions = decltype(add_option(
    Option<Tag::kInitStateFromInput, cute::true_type>{},
    add_option(Option<Tag::kNeedsAlpha, cute::true_type>{},
               add_option(Option<Tag::kNeedsBeta, cute::true_type>{},
                          add_option(Option<Tag::kIsGVA, cute::true_type>{},
                                     add_option(Option<Tag::kIsDeltaRule, cute::true_type>{}, DefaultOptions{}))))));
using RowStrides = cute::tuple<int64_t, _1, int32_t>;  // (token, channel, head)
using Prefill = cutlass::device::Universal<typename FlatBuilderDeltaRule<
    cutlass::bfloat16_t, float, float, Shape<_64, _64, _128>, RowStrides, RowStrides, RowStrides, RowStrides,
    cutlass::gemm::KernelTmaWarpSpecializedCooperative, GvaOptions>::Kernel>;

Prefill::Arguments arguments(void* output, float* output_state, void const* q, void const* k, void const* v,
                             int64_t v_token_stride, float const* input_state, float const* alpha,
                             float const* beta, int64_t const* cu_seqlens, int32_t num_seqs, int32_t qk_heads,
                             int32_t v_heads, int32_t head_size, int64_t total_seqlen, float scale, int32_t sm_count) {
  using T = cutlass::bfloat16_t;
  cutlass::KernelHardwareInfo hw_info;
  hw_info.sm_count = sm_count;
  int64_t const qk_row = int64_t(qk_heads) * head_size, o_row = int64_t(v_heads) * head_size;
  return Prefill::Arguments{
      .problem_size = {.cu_seqlens = cu_seqlens, .total_seqlen = total_seqlen, .num_seqs = num_seqs,
                       .num_q_heads = qk_heads, .num_k_heads = qk_heads, .num_v_heads = v_heads,
                       .num_o_heads = v_heads, .num_sab_heads = v_heads, .head_size = head_size},
      .mainloop = {.ptr_Q = static_cast<T const*>(q), .dQ = {qk_row, _1{}, head_size},
                   .ptr_K = static_cast<T const*>(k), .dK = {qk_row, _1{}, head_size},
                   .ptr_V = static_cast<T const*>(v), .dV = {v_token_stride, _1{}, head_size},
                   .ptr_O = static_cast<T*>(output), .dO = {o_row, _1{}, head_size},
                   .ptr_output_state = output_state, .ptr_input_state = input_state, .scale = scale,
                   .alpha_ptr = alpha, .alpha_stride = {v_heads, 1},
                   .beta_ptr = beta, .beta_stride = {v_heads, 1}},
      .hw_info = hw_info};
}

}  // namespace

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

extern "C" size_t hgc_gdn_prefill_workspace_bytes(int32_t sm_count) {
  // the kernel's workspace depends on the SM count alone (a TMA descriptor each, for output tails)
  return Prefill::get_workspace_size(arguments(nullptr, nullptr, nullptr, nullptr, nullptr, 0, nullptr, nullptr,
                                               nullptr, nullptr, 1, 1, 2, 128, 0, 1.0f, sm_count));
}

extern "C" int hgc_gdn_prefill_bf16_gva_into(void* output, float* output_state, void const* q, void const* k,
                                             void const* v, int64_t v_token_stride, float const* input_state,
                                             float const* alpha, float const* beta, int64_t const* cu_seqlens,
                                             int32_t num_seqs, int32_t qk_heads, int32_t v_heads,
                                             int32_t head_size, int64_t total_seqlen, float scale,
                                             int32_t sm_count, void* workspace, size_t workspace_bytes,
                                             cudaStream_t stream) {
  Prefill::Arguments args = arguments(output, output_state, q, k, v, v_token_stride, input_state, alpha, beta,
                                      cu_seqlens, num_seqs, qk_heads, v_heads, head_size, total_seqlen, scale,
                                      sm_count);
  if (Prefill::get_workspace_size(args) > workspace_bytes) return 3;
  if (Prefill::can_implement(args) != cutlass::Status::kSuccess) return 4;
  Prefill op;
  if (op.initialize(args, workspace, stream) != cutlass::Status::kSuccess) return 5;
  if (op.run(stream) != cutlass::Status::kSuccess) return 6;
  return cudaGetLastError() == cudaSuccess ? 0 : 2;
}
