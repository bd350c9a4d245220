// The decoder stack of a Llama-family model (Llama, Qwen2, Mistral) for one engine step, in one call.
// Why: the same kernels in the same order as the Python modules (pdserve/models/llama.py), but
// without ~25 module calls and ~20 torch ops per layer between them, each run cold after the
// weight stream has flushed the caches: ~10% of a batch-1 decode step of the 0.5B model. And the
// whole forward runs without the GIL, so the server's event loop does not take turns with it.
// Activations stay fp32 from the embedding to the final norm: a bf16 model keeps bf16 weights
// (read by the AVX512-BF16 kernel, which takes bf16 rows) and a bf16 KV cache.
#include <torch/extension.h>
#include "decoder.h"
#include "ops.h"

namespace pdserve {

namespace {

// A PackedLinear's forward (layers/packed_linear.py) for fp32 activations: k-pair panels (32
// wide) take the rows in bf16.
torch::Tensor linear(const torch::Tensor& x, const torch::Tensor& packed, const torch::Tensor& scale,
                     const torch::Tensor& bias, int64_t n) {
  auto y = packed.size(2) == 32 ? packed_linear_bf16_pairs(x.to(at::kBFloat16), packed) : packed_linear(x, packed, scale);
  if (y.size(1) != n) y = y.narrow(1, 0, n).contiguous();
  if (bias.numel()) y.add_(bias);
  return y;
}

}  // namespace

LlamaStack::LlamaStack(std::vector<std::vector<torch::Tensor>> layers, torch::Tensor final_norm, int64_t num_heads,
                       int64_t num_kv_heads, int64_t head_dim, int64_t intermediate_size, double eps, double scale)
    : layers_(std::move(layers)), final_norm_(std::move(final_norm)), H_(num_heads), Hkv_(num_kv_heads),
      D_(head_dim), I_(intermediate_size), eps_(eps), scale_(scale) {
  for (const auto& l : layers_)
    TORCH_CHECK(l.size() == kTensorsPerLayer, "each layer needs ", kTensorsPerLayer, " tensors, got ", l.size());
}

torch::Tensor LlamaStack::forward(torch::Tensor x, torch::Tensor cos, torch::Tensor sin, torch::Tensor slot_mapping,
                                  int64_t decode_first_row, torch::Tensor decode_rows, torch::Tensor decode_tables,
                                  torch::Tensor decode_ctx, torch::Tensor prefill_starts, torch::Tensor prefill_q_lens,
                                  torch::Tensor prefill_tables, torch::Tensor prefill_ctx, int64_t block_size,
                                  int64_t sliding_window) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.is_contiguous(), "x must be (T, hidden) fp32");
  const int64_t T = x.size(0), H = H_, Hkv = Hkv_, D = D_, hidden = x.size(1);
  const int64_t num_decodes = decode_tables.size(0);
  torch::Tensor residual;
  for (size_t i = 0; i < layers_.size(); ++i) {
    auto& w = layers_[i];
    // LlamaDecoderLayer: norm (adding the previous layer's output to the stream), attention, norm, MLP
    if (i == 0) {
      residual = x;
      x = rms_norm(x, w[kInputNorm], eps_);
    } else {
      fused_add_rms_norm(x, residual, w[kInputNorm], eps_);
    }
    auto qkv = linear(x, w[kQkv], w[kQkvScale], w[kQkvBias], (H + 2 * Hkv) * D);
    auto q = qkv.narrow(1, 0, H * D).view({T, H, D});
    auto k = qkv.narrow(1, H * D, Hkv * D).view({T, Hkv, D});
    auto v = qkv.narrow(1, (H + Hkv) * D, Hkv * D).view({T, Hkv, D});
    rotary_embedding(q, k, cos, sin);
    // PagedAttention: write the new K/V to their slots, then decodes and prefill chunks
    auto& k_cache = w[kKeyCache];
    auto& v_cache = w[kValueCache];
    k_cache.index_copy_(0, slot_mapping, k.to(k_cache.scalar_type()));   // fp32: no copy
    v_cache.index_copy_(0, slot_mapping, v.to(v_cache.scalar_type()));
    auto qf = q.contiguous();
    auto out = torch::empty({T, H, D}, x.options());
    if (num_decodes > 0) {
      if (decode_first_row >= 0) {
        out.narrow(0, decode_first_row, num_decodes)
            .copy_(paged_decode_attention(qf.narrow(0, decode_first_row, num_decodes), k_cache, v_cache,
                                          decode_tables, decode_ctx, block_size, scale_, sliding_window));
      } else {
        out.index_copy_(0, decode_rows,
                        paged_decode_attention(qf.index_select(0, decode_rows), k_cache, v_cache, decode_tables,
                                               decode_ctx, block_size, scale_, sliding_window));
      }
    }
    if (prefill_q_lens.size(0) > 0)
      paged_prefill_attention(qf, k_cache, v_cache, prefill_tables, prefill_starts, prefill_q_lens, prefill_ctx, out,
                              block_size, scale_, sliding_window);
    auto o = linear(out.view({T, H * D}), w[kO], w[kOScale], w[kOBias], hidden);
    fused_add_rms_norm(o, residual, w[kPostNorm], eps_);
    auto act = silu_and_mul(linear(o, w[kGateUp], w[kGateUpScale], w[kGateUpBias], 2 * I_));
    x = linear(act, w[kDown], w[kDownScale], w[kDownBias], hidden);
  }
  fused_add_rms_norm(x, residual, final_norm_, eps_);
  return x;
}

}  // namespace pdserve
