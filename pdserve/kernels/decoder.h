// LlamaStack: a Llama-family decoder stack run by decoder_cpu.cpp, bound in ops.cpp.
#pragma once
#include <torch/extension.h>
#include <vector>

namespace pdserve {

// Each layer's tensors, in this order (models/llama.py builds the lists). A linear is its packed
// weight, its per-channel scale (empty unless int8) and its bias (empty if none); norm weights and
// biases are fp32, the caches fp32 or bf16.
enum LayerTensor {
  kInputNorm, kQkv, kQkvScale, kQkvBias, kO, kOScale, kOBias, kPostNorm,
  kGateUp, kGateUpScale, kGateUpBias, kDown, kDownScale, kDownBias, kKeyCache, kValueCache,
  kTensorsPerLayer
};

class LlamaStack {
 public:
  LlamaStack(std::vector<std::vector<torch::Tensor>> layers, torch::Tensor final_norm, int64_t num_heads,
             int64_t num_kv_heads, int64_t head_dim, int64_t intermediate_size, double eps, double scale);

  // x: (T, hidden) fp32 embeddings of the step's flat batch; cos, sin: (T, D) of each position;
  // slot_mapping: (T,). Decodes: rows decode_first_row.. (or decode_rows if it is -1), their block
  // tables and context lengths (0 rows: none). Prefill chunks: as paged_prefill_attention takes
  // them. Returns the final norm's output, (T, hidden).
  torch::Tensor forward(torch::Tensor x, torch::Tensor cos, torch::Tensor sin, torch::Tensor slot_mapping,
                        int64_t decode_first_row, torch::Tensor decode_rows, torch::Tensor decode_tables,
                        torch::Tensor decode_ctx, torch::Tensor prefill_starts, torch::Tensor prefill_q_lens,
                        torch::Tensor prefill_tables, torch::Tensor prefill_ctx, int64_t block_size,
                        int64_t sliding_window);

 private:
  std::vector<std::vector<torch::Tensor>> layers_;
  torch::Tensor final_norm_;
  int64_t H_, Hkv_, D_, I_;
  double eps_, scale_;
};

}  // namespace pdserve
