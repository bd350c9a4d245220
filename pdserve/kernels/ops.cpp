// Python bindings of pdserve's CPU kernels (one extension, built on first use).
#include <torch/extension.h>
#include "decoder.h"
#include "ops.h"

// All release the GIL while they run, as torch's own ops do: the server's asyncio thread keeps
// answering (/health, refusals, streaming) while the engine thread computes.
PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("packed_linear", &packed_linear, "y = x @ W^T with W packed in 16-channel panels (linear_cpu.cpp)",
        py::call_guard<py::gil_scoped_release>());
  m.def("packed_linear_bf16_pairs", &packed_linear_bf16_pairs,
        "y = x @ W^T, bf16 x and W in k-pair panels, AVX512-BF16 dot products (linear_cpu.cpp)",
        py::call_guard<py::gil_scoped_release>());
  m.def("packed_linear_argmax", &packed_linear_argmax,
        "each row's argmax of x @ W^T (greedy sampling's token) without the logits (argmax_cpu.cpp)",
        py::call_guard<py::gil_scoped_release>());
  m.def("packed_linear_argmax_screened", &packed_linear_argmax_screened,
        "packed_linear_argmax of an fp32 W, screened on a bf16 copy and checked exactly (argmax_cpu.cpp)",
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
  py::class_<pdserve::AttentionStep>(m, "AttentionStep", "one step's paged-attention metadata (decoder.h)")
      .def(py::init<torch::Tensor, int64_t, torch::Tensor, torch::Tensor, torch::Tensor, torch::Tensor, torch::Tensor,
                    torch::Tensor, torch::Tensor, int64_t, int64_t>())
      .def_readonly("decode_first_row", &pdserve::AttentionStep::decode_first_row);
  py::class_<pdserve::LlamaStack>(m, "LlamaStack", "a Llama-family decoder stack in one call (decoder_cpu.cpp)")
      .def(py::init<std::vector<std::vector<torch::Tensor>>, torch::Tensor, int64_t, int64_t, int64_t, int64_t, double,
                    double>())
      .def("forward", &pdserve::LlamaStack::forward, py::call_guard<py::gil_scoped_release>());
  py::class_<pdserve::OptStack>(m, "OptStack", "an OPT decoder stack in one call (decoder_cpu.cpp)")
      .def(py::init<std::vector<std::vector<torch::Tensor>>, int64_t, int64_t, int64_t, bool, std::string, double,
                    double>())
      .def("forward", &pdserve::OptStack::forward, py::call_guard<py::gil_scoped_release>());
  m.def("rotary_embedding", &rotary_embedding, "rotate-half RoPE on q and k in place (rotary_cpu.cpp)",
        py::call_guard<py::gil_scoped_release>());
}
