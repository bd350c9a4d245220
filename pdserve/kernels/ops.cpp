// Python bindings of pdserve's CPU kernels (one extension, built on first use).
#include <torch/extension.h>

torch::Tensor packed_linear(torch::Tensor x, torch::Tensor packed, torch::Tensor scale);
torch::Tensor packed_linear_bf16_pairs(torch::Tensor x, torch::Tensor packed);
torch::Tensor paged_decode_attention(torch::Tensor q, torch::Tensor k_cache, torch::Tensor v_cache,
                                     torch::Tensor block_tables, torch::Tensor ctx_lens, int64_t block_size,
                                     double scale, int64_t sliding_window);
void paged_prefill_attention(torch::Tensor q, torch::Tensor k_cache, torch::Tensor v_cache, torch::Tensor block_tables,
                             torch::Tensor q_starts, torch::Tensor q_lens, torch::Tensor ctx_lens, torch::Tensor out,
                             int64_t block_size, double scale, int64_t sliding_window);
torch::Tensor silu_and_mul(torch::Tensor x);
torch::Tensor rms_norm(torch::Tensor x, torch::Tensor weight, double eps);
void fused_add_rms_norm(torch::Tensor x, torch::Tensor residual, torch::Tensor weight, double eps);
void rotary_embedding(torch::Tensor q, torch::Tensor k, torch::Tensor cos, torch::Tensor sin);
namespace pdserve { int64_t pool_cached_bytes(); }

// All release the GIL while they run, as torch's own ops do: the server's asyncio thread keeps
// answering (/health, refusals, streaming) while the engine thread computes.
PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("packed_linear", &packed_linear, "y = x @ W^T with W packed in 16-channel panels (linear_cpu.cpp)",
        py::call_guard<py::gil_scoped_release>());
  m.def("packed_linear_bf16_pairs", &packed_linear_bf16_pairs,
        "y = x @ W^T, bf16 x and W in k-pair panels, AVX512-BF16 dot products (linear_cpu.cpp)",
        py::call_guard<py::gil_scoped_release>());
  m.def("paged_decode_attention", &paged_decode_attention,
        "one-query attention over the paged KV cache (attention_cpu.cpp)", py::call_guard<py::gil_scoped_release>());
  m.def("paged_prefill_attention", &paged_prefill_attention,
        "causal attention of prefill chunks over the paged KV cache, into out (prefill_attention_cpu.cpp)",
        py::call_guard<py::gil_scoped_release>());
  m.def("silu_and_mul", &silu_and_mul, "silu(x[:, :I]) * x[:, I:] (activation_cpu.cpp)",
        py::call_guard<py::gil_scoped_release>());
  m.def("rms_norm", &rms_norm, "RMSNorm of fp32 rows (norm_cpu.cpp)", py::call_guard<py::gil_scoped_release>());
  m.def("fused_add_rms_norm", &fused_add_rms_norm, "in place: residual += x; x = RMSNorm(residual) (norm_cpu.cpp)",
        py::call_guard<py::gil_scoped_release>());
  m.def("pool_cached_bytes", &pdserve::pool_cached_bytes,
        "bytes of freed big outputs the kernels keep for reuse (buffer_pool.cpp)");
  m.def("rotary_embedding", &rotary_embedding, "rotate-half RoPE on q and k in place (rotary_cpu.cpp)",
        py::call_guard<py::gil_scoped_release>());
}
