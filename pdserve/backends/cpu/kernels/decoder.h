// Decoder stacks run by decoder_cpu.cpp, bound in ops.cpp: LlamaStack (Llama, Qwen2, Mistral) and
// OptStack, each a model's layers for one engine step in one call.
#pragma once
#include <torch/extension.h>
#include <vector>

namespace pdserve {

// One step's paged-attention metadata for the CPU kernels. Decodes: rows decode_first_row.. (or
// decode_rows if it is -1), their block tables and context lengths (0 rows: none). Prefill chunks:
// as paged_prefill_attention takes them (0 rows: none). Every tensor is a view of one int64 buffer
// that layers/attention.py's build_metadata fills (from_buffer gives the layout): between two
// forwards each Python-made tensor costs microseconds on cold caches, a view made here does not.
struct AttentionStep {
  torch::Tensor slot_mapping;
  int64_t decode_first_row;
  torch::Tensor decode_rows, decode_tables, decode_ctx;
  torch::Tensor prefill_starts, prefill_q_lens, prefill_tables, prefill_ctx;
  int64_t block_size, sliding_window;

  // buf from `offset`: slot_mapping (num_tokens); decode_ctx (num_decodes), decode_rows (num_decodes,
  // only if decode_first_row is -1); prefill_starts, prefill_q_lens, prefill_ctx (num_prefills each);
  // decode_tables (num_decodes x decode_blocks), prefill_tables (num_prefills x prefill_blocks).
  static AttentionStep from_buffer(const torch::Tensor& buf, int64_t offset, int64_t num_tokens, int64_t num_decodes,
                                   int64_t decode_blocks, int64_t decode_first_row, int64_t num_prefills,
                                   int64_t prefill_blocks, int64_t block_size, int64_t sliding_window);
};

// cache[slots[t]] = x[t]: this step's K or V rows into their cache slots (decoder_cpu.cpp; bound
// in ops.cpp for its tests). x: (T, Hkv, D) fp32 with contiguous rows, cache (slots, Hkv, D) fp32|bf16.
void write_cache(const torch::Tensor& cache, const torch::Tensor& x, const torch::Tensor& slots);

// Each layer's tensors, in these orders (models/llama.py and models/opt.py build the lists). A
// linear is its packed weight, its per-channel scale (empty unless int8) and its bias (empty if
// none); norm weights and biases are fp32 (empty: none), the caches fp32 or bf16.
enum LlamaLayerTensor {
  kInputNorm, kQkv, kQkvScale, kQkvBias, kO, kOScale, kOBias, kPostNorm,
  kGateUp, kGateUpScale, kGateUpBias, kDown, kDownScale, kDownBias, kKeyCache, kValueCache,
  kLlamaTensors
};
enum OptLayerTensor {
  kAttnNormW, kAttnNormB, kOptQkv, kOptQkvScale, kOptQkvBias, kOut, kOutScale, kOutBias, kFinalNormW, kFinalNormB,
  kFc1, kFc1Scale, kFc1Bias, kFc2, kFc2Scale, kFc2Bias, kOptKeyCache, kOptValueCache,
  kOptTensors
};

class LlamaStack {
 public:
  LlamaStack(std::vector<std::vector<torch::Tensor>> layers, torch::Tensor final_norm, int64_t num_heads,
             int64_t num_kv_heads, int64_t head_dim, int64_t intermediate_size, double eps, double scale);

  // x: (T, hidden) fp32 embeddings of the step's flat batch; cos, sin: (T, D) of each position.
  // Returns the final norm's output, (T, hidden).
  torch::Tensor forward(torch::Tensor x, torch::Tensor cos, torch::Tensor sin, const AttentionStep& step);

 private:
  std::vector<std::vector<torch::Tensor>> layers_;
  torch::Tensor final_norm_;
  int64_t H_, Hkv_, D_, I_;
  double eps_, scale_;
};

class OptStack {
 public:
  OptStack(std::vector<std::vector<torch::Tensor>> layers, int64_t num_heads, int64_t head_dim, int64_t ffn_dim,
           bool pre_layer_norm, std::string activation, double eps, double scale);

  // x: (T, hidden) fp32, embeddings plus positions. Returns the last layer's output (the decoder's
  // final norm and project_out stay in Python).
  torch::Tensor forward(torch::Tensor x, const AttentionStep& step);

 private:
  std::vector<std::vector<torch::Tensor>> layers_;
  int64_t H_, D_, F_;
  bool pre_ln_;
  std::string act_;
  double eps_, scale_;
};

}  // namespace pdserve
