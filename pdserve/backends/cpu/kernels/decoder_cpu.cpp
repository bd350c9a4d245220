// A decoder's layers for one engine step in one call, after the recipe its model declares (Llama,
// Qwen2, Mistral, OPT, ...). Why: the same kernels and ops in the same order as the Python modules
// (pdserve/models/llama.py, opt.py), but without ~25 module calls and ~20 torch ops per layer
// between them, each run cold after the weight stream has flushed the caches: ~10% of a batch-1
// decode step of the 0.5B model. And the whole forward runs without the GIL, so the server's
// event loop does not take turns with it. Activations stay fp32 throughout: a bf16 model keeps
// bf16 weights (read by the AVX512-BF16 kernel, which takes bf16 rows, where the build has it) and a bf16 KV cache.
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <algorithm>
#include <cstring>
#include <tuple>
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

// A PackedLinear's (or QuantLinear's) forward (backends/cpu/packed_linear.py, quant_linear.py) for
// fp32 activations: k-pair panels (32 wide) take the rows in bf16; group-quantized codes have a
// 3-D scale.
torch::Tensor linear(const torch::Tensor& x, const StackLinear& l) {
  const auto& packed = l.packed;
  auto y = packed.size(2) == 32   ? packed_linear_bf16_pairs(x.to(at::kBFloat16), packed)
           : l.scale.dim() == 3   ? quant_linear(x, packed, l.scale, l.offset)
                                  : packed_linear(x, packed, l.scale);
  const int64_t n = l.n;
  const auto& bias = l.bias;
  if (y.size(1) != n) y = y.narrow(1, 0, n).contiguous();
  if (bias.numel()) add_bias(y, bias);
  return y;
}

// PagedAttention.forward (layers/attention.py) on the kernels: write this step's K/V to their
// slots, then the decodes and the prefill chunks. q: (T, H, D), k, v: (T, Hkv, D). Returns (T, H * D).
torch::Tensor attention(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v, torch::Tensor& k_cache,
                        torch::Tensor& v_cache, const AttentionStep& s, double scale, int64_t window, double cap) {
  const int64_t T = q.size(0), H = q.size(1), D = q.size(2), num_decodes = s.decode_tables.size(0);
  write_cache(k_cache, k, s.slot_mapping);
  write_cache(v_cache, v, s.slot_mapping);
  auto qf = q.contiguous();
  auto decode = [&](const torch::Tensor& rows) {   // the decode rows' queries -> their outputs
    return paged_decode_attention(rows, k_cache, v_cache, s.decode_tables, s.decode_ctx, s.block_size, scale,
                                  window, cap);
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
                            out, s.block_size, scale, window, cap);
  return out.view({T, H * D});
}

void check_x(const torch::Tensor& x) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.is_contiguous(), "x must be (T, hidden) fp32");
}

// The layer's tensor `name`, or an empty tensor where it has none and may.
torch::Tensor take(const std::map<std::string, torch::Tensor>& t, const std::string& name, bool required) {
  auto it = t.find(name);
  TORCH_CHECK_VALUE(it != t.end() || !required, "the decoder stack needs the tensor ", name);
  return it == t.end() ? torch::Tensor() : it->second;
}

torch::Tensor fp32_vector(const torch::Tensor& t, int64_t n, const std::string& name) {
  if (!t.defined() || t.numel() == 0) return torch::Tensor();
  TORCH_CHECK_VALUE(t.dim() == 1 && t.size(0) == n && t.scalar_type() == at::kFloat && t.is_contiguous(), name,
                    " must be a contiguous fp32 vector of ", n);
  return t;
}

// A linear of `k` inputs and `n` outputs: 16-channel panels (N/16, K, 16), k-pair panels
// (N/16, K/2, 32) of bf16 (packed_linear.py's layouts), or group-quantized codes: (N/16, K/2, 16)
// uint8 or (N/16, K, 16) int8 with (N/16, groups, 16) scales and offsets (quant_linear.py's).
StackLinear take_linear(const std::map<std::string, torch::Tensor>& t, const std::string& name, int64_t k, int64_t n) {
  StackLinear l{take(t, name + ".packed", true), take(t, name + ".scale", false), take(t, name + ".bias", false),
                take(t, name + ".offset", false), n};
  const auto& p = l.packed;
  TORCH_CHECK_VALUE(p.dim() == 3 && (p.size(2) == 16 || (p.size(2) == 32 && p.scalar_type() == at::kBFloat16)),
                    name, ".packed is not a packed weight");
  const bool grouped = l.scale.defined() && l.scale.dim() == 3;
  TORCH_CHECK_VALUE(grouped || p.scalar_type() != at::kByte, name, ": 4-bit codes need their group scales");
  if (grouped) {
    TORCH_CHECK_VALUE(p.scalar_type() == at::kByte || p.scalar_type() == at::kChar, name,
                      ": group scales for codes of ", p.scalar_type());
    const int64_t inputs = p.scalar_type() == at::kByte ? 2 * p.size(1) : p.size(1);
    TORCH_CHECK_VALUE(inputs == k && p.size(0) * 16 >= n, name, " must take ", k, " inputs to ", n, " outputs, got ",
                      inputs, " to ", p.size(0) * 16);
    TORCH_CHECK_VALUE(l.scale.size(0) == p.size(0) && l.scale.size(2) == 16 && l.scale.size(1) > 0 &&
                      k % l.scale.size(1) == 0 && l.scale.scalar_type() == at::kFloat && l.scale.is_contiguous(),
                      name, ".scale is not (N/16, groups, 16) fp32");
    if (!l.offset.defined()) l.offset = torch::empty({0});
    TORCH_CHECK_VALUE(l.offset.numel() == 0 || l.offset.sizes() == l.scale.sizes(), name, ".offset is not shaped as ",
                      name, ".scale");
    l.bias = fp32_vector(l.bias, n, name + ".bias");
    if (!l.bias.defined()) l.bias = torch::empty({0});
    return l;
  }
  TORCH_CHECK_VALUE(!l.offset.defined(), name, ".offset without group scales");
  const int64_t inputs = p.size(2) == 32 ? 2 * p.size(1) : p.size(1);
  TORCH_CHECK_VALUE(inputs == k && p.size(0) * 16 >= n, name, " must take ", k, " inputs to ", n, " outputs, got ",
                    inputs, " to ", p.size(0) * 16);
  if (!l.scale.defined()) l.scale = torch::empty({0});
  TORCH_CHECK_VALUE(l.scale.numel() == 0 || l.scale.numel() == p.size(0) * 16, name, ".scale has ", l.scale.numel(),
                    " channels");
  l.bias = fp32_vector(l.bias, n, name + ".bias");
  if (!l.bias.defined()) l.bias = torch::empty({0});
  return l;
}

StackNorm take_norm(const std::map<std::string, torch::Tensor>& t, const std::string& prefix, bool rms, int64_t n) {
  StackNorm m{fp32_vector(take(t, prefix + "weight", rms), n, prefix + "weight"),
              fp32_vector(take(t, prefix + "bias", false), n, prefix + "bias"), true};
  TORCH_CHECK_VALUE(!rms || (m.weight.defined() && !m.bias.defined()), "an RMSNorm has a weight and no bias (",
                    prefix, ")");
  return m;
}

void check_names(const std::map<std::string, torch::Tensor>& t, const std::vector<std::string>& known) {
  for (const auto& [name, _] : t)
    TORCH_CHECK_VALUE(std::find(known.begin(), known.end(), name) != known.end(), "the decoder stack takes no tensor ",
                      name);
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
                                         int64_t num_prefills, int64_t prefill_blocks, int64_t block_size) {
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
  return s;
}

DecoderStack::DecoderStack(const std::vector<std::map<std::string, torch::Tensor>>& layers,
                           const std::map<std::string, torch::Tensor>& final_norm, bool has_final_norm,
                           std::string norm, std::string norm_position, const std::vector<std::string>& norms,
                           const std::vector<int64_t>& rotary, std::string activation, int64_t num_heads,
                           int64_t num_kv_heads, int64_t head_dim, int64_t intermediate_size, double eps, double scale,
                           const std::vector<int64_t>& windows, double softcap, double residual_multiplier)
    : has_final_norm_(has_final_norm), rms_(norm == "rms"), pre_norm_(norm_position == "pre"),
      act_(std::move(activation)), H_(num_heads), Hkv_(num_kv_heads), D_(head_dim), I_(intermediate_size),
      eps_(eps), scale_(scale), softcap_(softcap), r_(residual_multiplier) {
  TORCH_CHECK_VALUE(norm == "rms" || norm == "layer", "norm must be rms or layer, got ", norm);
  TORCH_CHECK_VALUE(pre_norm_ || norm_position == "post", "norm_position must be pre or post, got ", norm_position);
  TORCH_CHECK_VALUE(act_ == "silu_and_mul" || act_ == "gelu_tanh_and_mul" || act_ == "relu" || act_ == "gelu" ||
                    act_ == "silu", "activation must be silu_and_mul, gelu_tanh_and_mul, relu, gelu or silu, got ", act_);
  TORCH_CHECK_VALUE(pre_norm_ || !has_final_norm_, "a post-norm stack has no final norm");
  TORCH_CHECK_VALUE(!layers.empty() && H_ > 0 && Hkv_ > 0 && H_ % Hkv_ == 0 && I_ > 0, "bad decoder sizes");
  TORCH_CHECK_VALUE(windows.size() == layers.size() && rotary.size() == layers.size(),
                    "one sliding window and one rotary table per layer expected, got ", windows.size(), " and ",
                    rotary.size(), " for ", layers.size(), " layers");
  TORCH_CHECK_VALUE(softcap >= 0, "softcap must be >= 0 (0: none), got ", softcap);
  TORCH_CHECK_VALUE(pre_norm_ || residual_multiplier == 1.0, "a residual multiplier is for pre-norm stacks");
  const std::vector<std::string> roles = {"attn_norm", "mlp_norm", "q_norm", "k_norm", "post_attn_norm", "post_mlp_norm"};
  auto has = [&](const std::string& role) { return std::find(norms.begin(), norms.end(), role) != norms.end(); };
  for (const auto& n : norms)
    TORCH_CHECK_VALUE(std::find(roles.begin(), roles.end(), n) != roles.end(), "norms: no norm named ", n);
  TORCH_CHECK_VALUE(pre_norm_ || (has("attn_norm") && has("mlp_norm")), "a post-norm stack has both block norms");
  for (const char* role : {"q_norm", "k_norm", "post_attn_norm", "post_mlp_norm"})
    TORCH_CHECK_VALUE(pre_norm_ || !has(role), role, " is for pre-norm stacks");
  TORCH_CHECK_VALUE(rms_ || !(has("q_norm") || has("k_norm")), "q_norm and k_norm are RMSNorms: the stack's norm must be rms");
  const auto& qkv = take(layers[0], "qkv.packed", true);
  // k-pairs of bf16 and 4-bit codes (two to a byte) hold two inputs per k-step
  const bool pairs = qkv.dim() == 3 && (qkv.size(2) == 32 || qkv.scalar_type() == at::kByte);
  hidden_ = qkv.dim() == 3 ? (pairs ? 2 * qkv.size(1) : qkv.size(1)) : 0;
  std::vector<std::string> known = {"k_cache", "v_cache"};
  for (const char* l : {"qkv", "o", "up", "down"})
    for (const char* part : {".packed", ".scale", ".bias", ".offset"}) known.push_back(std::string(l) + part);
  for (const auto& n : norms) {
    known.push_back(n + ".weight");
    if (n != "q_norm" && n != "k_norm") known.push_back(n + ".bias");
  }
  const bool gated = act_ == "silu_and_mul" || act_ == "gelu_tanh_and_mul";
  for (size_t i = 0; i < layers.size(); ++i) {
    const auto& t = layers[i];
    check_names(t, known);
    StackLayer l;
    TORCH_CHECK_VALUE(windows[i] >= 0, "a sliding window must be >= 0 (0: none), got ", windows[i]);
    TORCH_CHECK_VALUE(rotary[i] >= -1, "a layer's rotary table must be >= 0 (-1: no RoPE), got ", rotary[i]);
    l.window = windows[i];
    l.rotary = rotary[i];
    tables_ = std::max(tables_, rotary[i] + 1);
    for (auto [role, dst] : {std::pair<const char*, StackNorm*>{"attn_norm", &l.attn_norm}, {"mlp_norm", &l.mlp_norm},
                             {"post_attn_norm", &l.post_attn_norm}, {"post_mlp_norm", &l.post_mlp_norm}})
      if (has(role)) *dst = take_norm(t, std::string(role) + ".", rms_, hidden_);
    // q/k norms: per head (head_dim entries) or over the whole projection (heads x head_dim)
    for (auto [role, dst, heads] : {std::tuple<const char*, StackNorm*, int64_t>{"q_norm", &l.q_norm, H_},
                                    {"k_norm", &l.k_norm, Hkv_}}) {
      if (!has(role)) continue;
      const auto w = take(t, std::string(role) + ".weight", true);
      const int64_t n = w.numel() == heads * D_ ? heads * D_ : D_;
      *dst = take_norm(t, std::string(role) + ".", true, n);
    }
    l.qkv = take_linear(t, "qkv", hidden_, (H_ + 2 * Hkv_) * D_);
    l.o = take_linear(t, "o", H_ * D_, hidden_);
    l.up = take_linear(t, "up", hidden_, gated ? 2 * I_ : I_);
    l.down = take_linear(t, "down", I_, hidden_);
    l.k_cache = take(t, "k_cache", true);
    l.v_cache = take(t, "v_cache", true);
    for (const auto& c : {l.k_cache, l.v_cache})
      TORCH_CHECK_VALUE(c.dim() == 3 && c.size(1) == Hkv_ && c.size(2) == D_ && c.is_contiguous() &&
                        (c.scalar_type() == at::kFloat || c.scalar_type() == at::kBFloat16),
                        "a KV cache view must be (slots, ", Hkv_, ", ", D_, ") fp32 or bf16");
    layers_.push_back(std::move(l));
  }
  check_names(final_norm, {"weight", "bias"});
  if (has_final_norm_) final_norm_ = take_norm(final_norm, "", rms_, hidden_);
  TORCH_CHECK_VALUE(has_final_norm_ || final_norm.empty(), "final-norm tensors given for a stack without one");
}

// The norm of fp32 rows x (a new tensor).
torch::Tensor DecoderStack::norm(const torch::Tensor& x, const StackNorm& n) const {
  if (rms_) return rms_norm(x, n.weight, eps_);
  auto maybe = [](const torch::Tensor& t) { return t.defined() ? std::optional<torch::Tensor>(t) : std::nullopt; };
  return at::layer_norm(x, {hidden_}, maybe(n.weight), maybe(n.bias), eps_);
}

// residual += x; returns the norm of the sum (RMSNorm in place in x: x is this step's scratch).
torch::Tensor DecoderStack::add_norm(torch::Tensor& x, torch::Tensor& residual, const StackNorm& n) const {
  if (rms_) {
    fused_add_rms_norm(x, residual, n.weight, eps_);
    return x;
  }
  residual.add_(x);
  return norm(residual, n);
}

// Pre-norm: x (the last block's output; the first layer's input where `first`) joins the stream
// and the block's input is returned: the stream's norm, or the stream itself where the block has
// no norm (OLMo 2: the block reads the stream, which the next join adds to in place after).
torch::Tensor DecoderStack::enter(torch::Tensor& x, torch::Tensor& residual, const StackNorm& n, bool first) const {
  if (first) {
    residual = x;
    return n.on ? norm(x, n) : x;
  }
  if (n.on) return add_norm(x, residual, n);
  residual.add_(x);
  return residual;
}

// Pre-norm: a block's output y as it joins the stream: its post norm (Gemma, OLMo 2), then times
// the residual multiplier (Granite), in the modules' order and roundings.
torch::Tensor DecoderStack::leave(torch::Tensor y, const StackNorm& n) const {
  if (n.on) y = norm(y, n);
  if (r_ != 1.0) y.mul_(r_);
  return y;
}

torch::Tensor DecoderStack::forward(torch::Tensor x, const std::vector<torch::Tensor>& cos,
                                    const std::vector<torch::Tensor>& sin, const AttentionStep& step) {
  check_x(x);
  TORCH_CHECK(x.size(1) == hidden_, "x must have rows of ", hidden_);
  const int64_t T = x.size(0), H = H_, Hkv = Hkv_, D = D_;
  TORCH_CHECK(static_cast<int64_t>(cos.size()) == tables_ && static_cast<int64_t>(sin.size()) == tables_,
              "the stack's layers take ", tables_, " rotary tables (cos and sin), got ", cos.size(), " and ", sin.size());
  torch::Tensor residual;
  for (size_t i = 0; i < layers_.size(); ++i) {
    auto& w = layers_[i];
    // pre-norm (Llama, OPT-125m): the norm of the stream before each block, the block's output
    // added at the next norm; post-norm (OPT-350m): x = norm(x + block(x)) after each block
    torch::Tensor h = pre_norm_ ? enter(x, residual, w.attn_norm, i == 0) : x;
    auto qkv = linear(h, w.qkv);
    auto q = qkv.narrow(1, 0, H * D).view({T, H, D});
    auto k = qkv.narrow(1, H * D, Hkv * D).view({T, Hkv, D});
    auto v = qkv.narrow(1, (H + Hkv) * D, Hkv * D).view({T, Hkv, D});
    // q/k norms in place on the views: rows of a head, or (viewed as one head) of the projection
    if (w.q_norm.on) {
      const int64_t n = w.q_norm.weight.numel();
      rms_norm_heads_(q.view({T, H * D / n, n}), w.q_norm.weight, eps_);
    }
    if (w.k_norm.on) {
      const int64_t n = w.k_norm.weight.numel();
      rms_norm_heads_(k.view({T, Hkv * D / n, n}), w.k_norm.weight, eps_);
    }
    if (w.rotary >= 0) rotary_embedding(q, k, cos[w.rotary], sin[w.rotary]);
    auto o = linear(attention(q, k, v, w.k_cache, w.v_cache, step, scale_, w.window, softcap_), w.o);
    if (pre_norm_) {
      o = leave(o, w.post_attn_norm);
      h = enter(o, residual, w.mlp_norm, false);
    } else {
      x = norm(x + o, w.attn_norm);
      h = x;
    }
    auto u = linear(h, w.up);
    u = act_ == "silu_and_mul" ? silu_and_mul(u) : act_ == "gelu_tanh_and_mul" ? gelu_tanh_and_mul(u)
        : act_ == "relu" ? at::relu(u) : act_ == "gelu" ? at::gelu(u) : at::silu(u);
    auto d = linear(u, w.down);
    x = pre_norm_ ? leave(d, w.post_mlp_norm) : norm(x + d, w.mlp_norm);
  }
  if (!pre_norm_) return x;
  if (has_final_norm_) return add_norm(x, residual, final_norm_);
  residual.add_(x);
  return residual;
}

}  // namespace pdserve
