// The CPU kernels' entry points (each defined in its own *_cpu.cpp), for the bindings (ops.cpp)
// and for the layer loop that calls them (decoder_cpu.cpp).
#pragma once
#include <torch/extension.h>
#include "buffer_pool.h"   // pool_cached_bytes

torch::Tensor packed_linear(torch::Tensor x, torch::Tensor packed, torch::Tensor scale);
torch::Tensor packed_linear_bf16_pairs(torch::Tensor x, torch::Tensor packed);
bool set_amx(int64_t enable);
torch::Tensor quant_linear(torch::Tensor x, torch::Tensor packed, torch::Tensor scale, torch::Tensor offset);
torch::Tensor packed_rows(torch::Tensor packed, torch::Tensor scale, torch::Tensor ids);
torch::Tensor packed_linear_argmax(torch::Tensor x, torch::Tensor packed, torch::Tensor scale, torch::Tensor bias,
                                   int64_t n);
torch::Tensor packed_linear_argmax_screened(torch::Tensor x, torch::Tensor packed, torch::Tensor screen,
                                            torch::Tensor col_norm, double col_norm_max, int64_t n,
                                            torch::Tensor counts);
torch::Tensor paged_decode_attention(torch::Tensor q, torch::Tensor k_cache, torch::Tensor v_cache,
                                     torch::Tensor block_tables, torch::Tensor ctx_lens, int64_t block_size,
                                     double scale, int64_t sliding_window, double softcap,
                                     std::optional<torch::Tensor> sinks = std::nullopt);
void paged_prefill_attention(torch::Tensor q, torch::Tensor k_cache, torch::Tensor v_cache, torch::Tensor block_tables,
                             torch::Tensor q_starts, torch::Tensor q_lens, torch::Tensor ctx_lens, torch::Tensor out,
                             int64_t block_size, double scale, int64_t sliding_window, double softcap,
                             std::optional<torch::Tensor> sinks = std::nullopt);
torch::Tensor silu_and_mul(torch::Tensor x);
torch::Tensor fused_moe(torch::Tensor x, torch::Tensor weights, torch::Tensor ids, torch::Tensor w13, torch::Tensor w2,
                        std::optional<torch::Tensor> b13 = std::nullopt, std::optional<torch::Tensor> b2 = std::nullopt,
                        double swiglu_alpha = 1.0, double swiglu_limit = 0.0,
                        std::optional<torch::Tensor> s13 = std::nullopt, std::optional<torch::Tensor> s2 = std::nullopt);
torch::Tensor gelu_tanh_and_mul(torch::Tensor x);
torch::Tensor rms_norm(torch::Tensor x, torch::Tensor weight, double eps);
void fused_add_rms_norm(torch::Tensor x, torch::Tensor residual, torch::Tensor weight, double eps);
void rms_norm_heads_(torch::Tensor x, torch::Tensor weight, double eps);
void rotary_embedding(torch::Tensor q, torch::Tensor k, torch::Tensor cos, torch::Tensor sin);

namespace pdserve {
// The attention kernels' per-head sink logits (gpt-oss): (H,) fp32 contiguous, or nullptr for none.
inline const float* sink_logits(const std::optional<torch::Tensor>& sinks, int64_t H) {
  if (!sinks.has_value() || !sinks->defined()) return nullptr;
  TORCH_CHECK(sinks->dim() == 1 && sinks->size(0) == H && sinks->scalar_type() == at::kFloat && sinks->is_contiguous(),
              "sinks must be (num_heads,) fp32 contiguous");
  return sinks->data_ptr<float>();
}
}  // namespace pdserve
