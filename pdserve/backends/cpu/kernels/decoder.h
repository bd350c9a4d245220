// The decoder stack run by decoder_cpu.cpp, bound in ops.cpp: a model's layers for one engine step
// in one call, after the recipe the model declares.
#pragma once
#include <torch/extension.h>
#include <map>
#include <string>
#include <vector>

namespace pdserve {

// One step's paged-attention metadata for the CPU kernels. Decodes: rows decode_first_row.. (or
// decode_rows if it is -1), their block tables and context lengths (0 rows: none). Prefill chunks:
// as paged_prefill_attention takes them (0 rows: none). Every tensor is a view of one int64 buffer
// that backends/cpu/metadata.py's build_step_metadata fills (from_buffer gives the layout): between two
// forwards each Python-made tensor costs microseconds on cold caches, a view made here does not.
struct AttentionStep {
  torch::Tensor slot_mapping;
  int64_t decode_first_row;
  torch::Tensor decode_rows, decode_tables, decode_ctx;
  torch::Tensor prefill_starts, prefill_q_lens, prefill_tables, prefill_ctx;
  int64_t block_size;

  // buf from `offset`: slot_mapping (num_tokens); decode_ctx (num_decodes), decode_rows (num_decodes,
  // only if decode_first_row is -1); prefill_starts, prefill_q_lens, prefill_ctx (num_prefills each);
  // decode_tables (num_decodes x decode_blocks), prefill_tables (num_prefills x prefill_blocks).
  static AttentionStep from_buffer(const torch::Tensor& buf, int64_t offset, int64_t num_tokens, int64_t num_decodes,
                                   int64_t decode_blocks, int64_t decode_first_row, int64_t num_prefills,
                                   int64_t prefill_blocks, int64_t block_size);
};

// cache[slots[t]] = x[t]: this step's K or V rows into their cache slots (decoder_cpu.cpp; bound
// in ops.cpp for its tests). x: (T, Hkv, D) fp32 with contiguous rows, cache (slots, Hkv, D) fp32|bf16.
void write_cache(const torch::Tensor& cache, const torch::Tensor& x, const torch::Tensor& slots);

// One decoder layer's linear: its packed weight, its per-channel scale (empty unless int8), its fp32
// bias (empty: none) and its output width n. Group-quantized codes (quant_linear_cpu.cpp): packed
// uint8 (4-bit) or int8 with a (Npad/16, groups, 16) scale, and an offset of that shape (empty: none).
struct StackLinear {
  torch::Tensor packed, scale, bias, offset;
  int64_t n = 0;
};
// A norm's fp32 weight and bias (empty: none); on: the recipe has this norm (a LayerNorm without
// affine parameters has neither tensor).
struct StackNorm {
  torch::Tensor weight, bias;
  bool on = false;
};
struct StackLayer {
  StackNorm attn_norm, mlp_norm, q_norm, k_norm, post_attn_norm, post_mlp_norm;
  StackLinear qkv, o, up, down;
  torch::Tensor k_cache, v_cache;
  int64_t window = 0;   // this layer's sliding window (0: none), from its attention module
  int64_t rotary = -1;  // this layer's (cos, sin) table in forward's lists, -1: no RoPE
};

// A decoder's layers for one engine step in one call, after the recipe a model declares
// (pdserve/models/decoder_spec.py; the CPU backend collects each layer's tensors by name):
//   norm: "rms" | "layer"; norm_position: "pre" (a norm before each block, the residual stream
//   apart) | "post" (a norm after each residual add);
//   norms: the norms each layer has, of attn_norm, mlp_norm (both in a post-norm stack), and,
//   pre-norm only: q_norm, k_norm (RMSNorms of q and k before RoPE: their weight has head_dim
//   entries, per head, or all of q's or k's, over the whole projection), post_attn_norm,
//   post_mlp_norm (of a block's output before it joins the stream);
//   rotary: each layer's index into forward's cos/sin lists, -1: no RoPE (rotate-half, on q and k;
//   a table narrower than the head rotates its first dims only);
//   activation: "silu_and_mul" | "gelu_tanh_and_mul" (up is gate then up rows) | "relu" | "gelu" | "silu";
//   final_norm: a pre-norm stack ends with this norm of the stream;
//   windows: each layer's sliding window (0: full attention); softcap: the attention scores' cap
//   (cap * tanh(s / cap), 0: none); residual_multiplier: each block's output is scaled by it as it
//   joins the stream (pre-norm).
// A pre-norm layer, every optional part shown (r = residual_multiplier):
//   h = attn_norm(x); q, k, v = qkv(h); q, k = q_norm(q), k_norm(k); q, k = rope(q, k)
//   x = x + r * post_attn_norm(o(attention(q, k, v)))
//   x = x + r * post_mlp_norm(down(act(up(mlp_norm(x)))))
// Each layer is a dict of the names below (a missing optional one: none); the constructor checks
// every name and shape and throws ValueError on any it cannot run.
//   <norm>.weight, <norm>.bias for each norm of `norms`,
//   {qkv,o,up,down}.packed, {qkv,o,up,down}.scale, {qkv,o,up,down}.bias, {qkv,o,up,down}.offset, k_cache, v_cache
class DecoderStack {
 public:
  DecoderStack(const std::vector<std::map<std::string, torch::Tensor>>& layers,
               const std::map<std::string, torch::Tensor>& final_norm, bool has_final_norm, std::string norm,
               std::string norm_position, const std::vector<std::string>& norms, const std::vector<int64_t>& rotary,
               std::string activation, int64_t num_heads, int64_t num_kv_heads, int64_t head_dim,
               int64_t intermediate_size, double eps, double scale, const std::vector<int64_t>& windows,
               double softcap, double residual_multiplier);

  // x: (T, hidden) fp32 input of the first layer for the step's flat batch; cos[i], sin[i]: (T, R)
  // (or (T, 1, R)) of each position, rotary table i (R <= head_dim, even). Returns the final norm's
  // output, or the residual stream after the last layer where there is none.
  torch::Tensor forward(torch::Tensor x, const std::vector<torch::Tensor>& cos, const std::vector<torch::Tensor>& sin,
                        const AttentionStep& step);

  int64_t num_layers() const { return static_cast<int64_t>(layers_.size()); }

 private:
  torch::Tensor norm(const torch::Tensor& x, const StackNorm& n) const;
  torch::Tensor add_norm(torch::Tensor& x, torch::Tensor& residual, const StackNorm& n) const;
  torch::Tensor enter(torch::Tensor& x, torch::Tensor& residual, const StackNorm& n, bool first) const;
  torch::Tensor leave(torch::Tensor y, const StackNorm& n) const;

  std::vector<StackLayer> layers_;
  StackNorm final_norm_;
  bool has_final_norm_, rms_, pre_norm_;
  std::string act_;
  int64_t H_, Hkv_, D_, I_, hidden_, tables_ = 0;   // tables_: rotary tables forward takes
  double eps_, scale_, softcap_, r_;
};

}  // namespace pdserve
