// The decoder stacks of Llama-family models (Llama, Qwen2, Mistral) and OPT for one engine step,
// each in one call. Why: the same kernels and ops in the same order as the Python modules
// (pdserve/models/llama.py, opt.py), but without ~25 module calls and ~20 torch ops per layer
// between them, each run cold after the weight stream has flushed the caches: ~10% of a batch-1
// decode step of the 0.5B model. And the whole forward runs without the GIL, so the server's
// event loop does not take turns with it. Activations stay fp32 throughout: a bf16 model keeps
// bf16 weights (read by the AVX512-BF16 kernel, which takes bf16 rows, where the build has it) and a bf16 KV cache.
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <cstring>
#include "decoder.h"
#include "ops.h"
#include "vec.h"

namespace pdserve {

namespace {

// At least this many elements per thread: the glue loops below split only prefill-sized work.
constexpr int64_t kGlueGrain = 1 << 16;

// y (T, n) contiguous += bias (n): a plain loop instead of add_, whose set-up (a TensorIterator)
// costs microseconds a call on the caches a forward leaves (under torch.profiler, 14% of the ATen
// self time of 0.5B batch-1 steps).
// Biased linears (Qwen2's qkv, OPT's) have n = heads x head_dim or hidden = heads x head_dim,
// a multiple of 16 (and so of kVec) for every head size the attention kernels take.
void add_bias(torch::Tensor& y, const torch::Tensor& bias) {
  const int64_t T = y.size(0), n = y.size(1);
  TORCH_CHECK(n % 16 == 0 && bias.numel() == n, "bias of ", bias.numel(), " for rows of ", n);
  float* out = y.data_ptr<float>();
  const float* b = bias.data_ptr<float>();
  at::parallel_for(0, T, std::max<int64_t>(1, kGlueGrain / n), [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t)
      for (int64_t c = 0; c < n; c += kVec)
        (fVec::loadu(out + t * n + c) + fVec::loadu(b + c)).store(out + t * n + c);
  });
}

// A PackedLinear's forward (layers/packed_linear.py) for fp32 activations: k-pair panels (32
// wide) take the rows in bf16.
torch::Tensor linear(const torch::Tensor& x, const torch::Tensor& packed, const torch::Tensor& scale,
                     const torch::Tensor& bias, int64_t n) {
  auto y = packed.size(2) == 32 ? packed_linear_bf16_pairs(x.to(at::kBFloat16), packed) : packed_linear(x, packed, scale);
  if (y.size(1) != n) y = y.narrow(1, 0, n).contiguous();
  if (bias.numel()) add_bias(y, bias);
  return y;
}

// PagedAttention.forward (layers/attention.py) on the kernels: write this step's K/V to their
// slots, then the decodes and the prefill chunks. q: (T, H, D), k, v: (T, Hkv, D). Returns (T, H * D).
torch::Tensor attention(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v, torch::Tensor& k_cache,
                        torch::Tensor& v_cache, const AttentionStep& s, double scale) {
  const int64_t T = q.size(0), H = q.size(1), D = q.size(2), num_decodes = s.decode_tables.size(0);
  write_cache(k_cache, k, s.slot_mapping);
  write_cache(v_cache, v, s.slot_mapping);
  auto qf = q.contiguous();
  auto decode = [&](const torch::Tensor& rows) {   // the decode rows' queries -> their outputs
    return paged_decode_attention(rows, k_cache, v_cache, s.decode_tables, s.decode_ctx, s.block_size, scale,
                                  s.sliding_window);
  };
  if (num_decodes == T && s.decode_first_row == 0)   // decodes only: the kernel's output is the result
    return decode(qf).view({T, H * D});
  auto out = torch::empty({T, H, D}, q.options());
  if (num_decodes > 0) {
    if (s.decode_first_row >= 0)
      out.narrow(0, s.decode_first_row, num_decodes).copy_(decode(qf.narrow(0, s.decode_first_row, num_decodes)));
    else
      out.index_copy_(0, s.decode_rows, decode(qf.index_select(0, s.decode_rows)));
  }
  if (s.prefill_q_lens.size(0) > 0)
    paged_prefill_attention(qf, k_cache, v_cache, s.prefill_tables, s.prefill_starts, s.prefill_q_lens, s.prefill_ctx,
                            out, s.block_size, scale, s.sliding_window);
  return out.view({T, H * D});
}

void check_x(const torch::Tensor& x) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.is_contiguous(), "x must be (T, hidden) fp32");
}

void check_layers(const std::vector<std::vector<torch::Tensor>>& layers, size_t n) {
  for (const auto& l : layers) TORCH_CHECK(l.size() == n, "each layer needs ", n, " tensors, got ", l.size());
}

std::optional<torch::Tensor> maybe(const torch::Tensor& t) {
  return t.numel() ? std::optional<torch::Tensor>(t) : std::nullopt;
}

}  // namespace

// cache[slots[t]] = x[t] for each of the step's T tokens; x: (T, Hkv, D) fp32 with rows of Hkv x D
// contiguous (a view of the qkv product), cache (num_slots, Hkv, D) fp32 or bf16 (rounded as .to()
// rounds). What index_copy_ did, without its set-up per call.
void write_cache(const torch::Tensor& cache, const torch::Tensor& x, const torch::Tensor& slots) {
  TORCH_CHECK(x.dim() == 3 && x.scalar_type() == at::kFloat && x.stride(2) == 1 && x.stride(1) == x.size(2),
              "K/V rows must be fp32 and contiguous");
  const int64_t T = x.size(0), row = x.size(1) * x.size(2), stride = x.stride(0);
  TORCH_CHECK(cache.dim() == 3 && cache.is_contiguous() && cache.size(1) * cache.size(2) == row &&
              (cache.scalar_type() == at::kFloat || cache.scalar_type() == at::kBFloat16),
              "an fp32 or bf16 cache with rows of ", row, " elements expected");
  TORCH_CHECK(slots.dim() == 1 && slots.scalar_type() == at::kLong && slots.is_contiguous() && slots.size(0) == T,
              "one int64 slot per row expected");
  const int64_t num_slots = cache.size(0);
  const float* src = x.data_ptr<float>();
  const int64_t* slot = slots.data_ptr<int64_t>();
  for (int64_t t = 0; t < T; ++t) TORCH_CHECK(slot[t] >= 0 && slot[t] < num_slots, "slot ", slot[t], " out of range");
  at::parallel_for(0, T, std::max<int64_t>(1, kGlueGrain / row), [&](int64_t t0, int64_t t1) {
    if (cache.scalar_type() == at::kFloat) {
      float* dst = cache.data_ptr<float>();
      for (int64_t t = t0; t < t1; ++t) std::memcpy(dst + slot[t] * row, src + t * stride, row * sizeof(float));
    } else {
      at::BFloat16* dst = cache.data_ptr<at::BFloat16>();
      for (int64_t t = t0; t < t1; ++t)
        for (int64_t i = 0; i < row; ++i) dst[slot[t] * row + i] = static_cast<at::BFloat16>(src[t * stride + i]);
    }
  });
}

AttentionStep AttentionStep::from_buffer(const torch::Tensor& buf, int64_t offset, int64_t num_tokens,
                                         int64_t num_decodes, int64_t decode_blocks, int64_t decode_first_row,
                                         int64_t num_prefills, int64_t prefill_blocks, int64_t block_size,
                                         int64_t sliding_window) {
  TORCH_CHECK(buf.dim() == 1 && buf.scalar_type() == at::kLong && buf.is_contiguous(), "buf must be 1-D int64");
  auto next = [&](int64_t n) {
    TORCH_CHECK(offset + n <= buf.size(0), "the step's metadata runs past its buffer");
    auto t = buf.narrow(0, offset, n);
    offset += n;
    return t;
  };
  AttentionStep s;
  s.slot_mapping = next(num_tokens);
  s.decode_first_row = decode_first_row;
  s.decode_ctx = next(num_decodes);
  s.decode_rows = next(decode_first_row < 0 ? num_decodes : 0);
  s.prefill_starts = next(num_prefills);
  s.prefill_q_lens = next(num_prefills);
  s.prefill_ctx = next(num_prefills);
  s.decode_tables = next(num_decodes * decode_blocks).view({num_decodes, decode_blocks});
  s.prefill_tables = next(num_prefills * prefill_blocks).view({num_prefills, prefill_blocks});
  s.block_size = block_size;
  s.sliding_window = sliding_window;
  return s;
}

LlamaStack::LlamaStack(std::vector<std::vector<torch::Tensor>> layers, torch::Tensor final_norm, int64_t num_heads,
                       int64_t num_kv_heads, int64_t head_dim, int64_t intermediate_size, double eps, double scale)
    : layers_(std::move(layers)), final_norm_(std::move(final_norm)), H_(num_heads), Hkv_(num_kv_heads),
      D_(head_dim), I_(intermediate_size), eps_(eps), scale_(scale) {
  check_layers(layers_, kLlamaTensors);
}

torch::Tensor LlamaStack::forward(torch::Tensor x, torch::Tensor cos, torch::Tensor sin, const AttentionStep& step) {
  check_x(x);
  const int64_t T = x.size(0), H = H_, Hkv = Hkv_, D = D_, hidden = x.size(1);
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
    auto o = linear(attention(q, k, v, w[kKeyCache], w[kValueCache], step, scale_), w[kO], w[kOScale], w[kOBias], hidden);
    fused_add_rms_norm(o, residual, w[kPostNorm], eps_);
    auto act = silu_and_mul(linear(o, w[kGateUp], w[kGateUpScale], w[kGateUpBias], 2 * I_));
    x = linear(act, w[kDown], w[kDownScale], w[kDownBias], hidden);
  }
  fused_add_rms_norm(x, residual, final_norm_, eps_);
  return x;
}

OptStack::OptStack(std::vector<std::vector<torch::Tensor>> layers, int64_t num_heads, int64_t head_dim,
                   int64_t ffn_dim, bool pre_layer_norm, std::string activation, double eps, double scale)
    : layers_(std::move(layers)), H_(num_heads), D_(head_dim), F_(ffn_dim), pre_ln_(pre_layer_norm),
      act_(std::move(activation)), eps_(eps), scale_(scale) {
  check_layers(layers_, kOptTensors);
  TORCH_CHECK(act_ == "relu" || act_ == "gelu" || act_ == "silu", "unsupported activation ", act_);
}

torch::Tensor OptStack::forward(torch::Tensor x, const AttentionStep& step) {
  check_x(x);
  const int64_t T = x.size(0), H = H_, D = D_, hidden = x.size(1);
  for (auto& w : layers_) {
    // OPTDecoderLayer: pre-LN (125m) norms before each block, post-LN (350m) after each residual add
    auto norm = [&](const torch::Tensor& t, int weight, int bias) {
      return at::layer_norm(t, {hidden}, maybe(w[weight]), maybe(w[bias]), eps_);
    };
    auto qkv = linear(pre_ln_ ? norm(x, kAttnNormW, kAttnNormB) : x, w[kOptQkv], w[kOptQkvScale], w[kOptQkvBias],
                      3 * H * D);
    auto q = qkv.narrow(1, 0, H * D).view({T, H, D});
    auto k = qkv.narrow(1, H * D, H * D).view({T, H, D});
    auto v = qkv.narrow(1, 2 * H * D, H * D).view({T, H, D});
    x = x + linear(attention(q, k, v, w[kOptKeyCache], w[kOptValueCache], step, scale_), w[kOut], w[kOutScale],
                   w[kOutBias], hidden);
    if (!pre_ln_) x = norm(x, kAttnNormW, kAttnNormB);
    auto h = linear(pre_ln_ ? norm(x, kFinalNormW, kFinalNormB) : x, w[kFc1], w[kFc1Scale], w[kFc1Bias], F_);
    h = act_ == "relu" ? at::relu(h) : act_ == "gelu" ? at::gelu(h) : at::silu(h);
    x = x + linear(h, w[kFc2], w[kFc2Scale], w[kFc2Bias], hidden);
    if (!pre_ln_) x = norm(x, kFinalNormW, kFinalNormB);
  }
  return x;
}

}  // namespace pdserve
