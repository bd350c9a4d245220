// Python bindings of pdserve's CPU kernels (one extension, built on first use).
#include <torch/extension.h>
#include <algorithm>
#include <utility>
#include "decoder.h"
#include "ops.h"
#include "vec.h"

namespace {

// build_step_metadata's (backends/cpu/metadata.py) one call for the CPU kernels' path. ints: the step's
// integers but its block tables, a Python list: num_flat per-token lists of num_tokens each (the
// last the slot mapping), then AttentionStep::from_buffer's layout up to the tables. The tables
// (lists of block ids) are cut or padded with block 0 to decode_blocks and prefill_blocks here.
// All of it goes into one int64 tensor, viewed in C++: on the caches a forward leaves, array(),
// torch.frombuffer and a split into views took ~60 us at batch 32, each Python-made tensor several.
// Returns the views of the flat lists before the slot mapping (input ids, positions) and the step.
py::tuple step_from_ints(const py::list& ints, const py::list& decode_tables, const py::list& prefill_tables,
                         int64_t num_flat, int64_t num_tokens, int64_t num_decodes, int64_t decode_blocks,
                         int64_t decode_first_row, int64_t num_prefills, int64_t prefill_blocks, int64_t block_size) {
  TORCH_CHECK(PyList_GET_SIZE(decode_tables.ptr()) == num_decodes &&
              PyList_GET_SIZE(prefill_tables.ptr()) == num_prefills, "one block table per sequence");
  const auto n = static_cast<int64_t>(PyList_GET_SIZE(ints.ptr()));
  auto buf = torch::empty({n + num_decodes * decode_blocks + num_prefills * prefill_blocks}, torch::kLong);
  int64_t* p = buf.data_ptr<int64_t>();
  auto copy = [&](PyObject* list, int64_t count) {   // list[:count] to p, as int64
    for (int64_t i = 0; i < count; ++i) {
      const int64_t v = PyLong_AsLongLong(PyList_GET_ITEM(list, i));
      if (v == -1 && PyErr_Occurred()) throw py::error_already_set();
      *p++ = v;
    }
  };
  copy(ints.ptr(), n);
  for (const auto& [tables, width] : {std::pair(decode_tables.ptr(), decode_blocks),
                                      std::pair(prefill_tables.ptr(), prefill_blocks)}) {
    for (Py_ssize_t b = 0; b < PyList_GET_SIZE(tables); ++b) {
      PyObject* table = PyList_GET_ITEM(tables, b);
      TORCH_CHECK(PyList_Check(table), "a block table must be a list");
      const int64_t have = std::min<int64_t>(PyList_GET_SIZE(table), width);
      copy(table, have);
      p = std::fill_n(p, width - have, int64_t{0});
    }
  }
  auto step = pdserve::AttentionStep::from_buffer(buf, (num_flat - 1) * num_tokens, num_tokens, num_decodes,
                                                  decode_blocks, decode_first_row, num_prefills, prefill_blocks,
                                                  block_size);
  TORCH_CHECK(step.prefill_tables.data_ptr<int64_t>() + step.prefill_tables.numel() == p,
              "the step's integers do not match its layout");
  py::list flat;
  for (int64_t f = 0; f + 1 < num_flat; ++f) flat.append(buf.narrow(0, f * num_tokens, num_tokens));
  return py::make_tuple(flat, step);
}

}  // namespace

// All release the GIL while they run, as torch's own ops do: the server's asyncio thread keeps
// answering (/health, refusals, streaming) while the engine thread computes.
// The classes are module_local: each instruction set's build is its own module, and a process
// (the tests) may load both.
PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.attr("isa") = pdserve::kIsa;
  m.def("packed_linear", &packed_linear, "y = x @ W^T with W packed in 16-channel panels (linear_cpu.cpp)",
        py::call_guard<py::gil_scoped_release>());
  m.def("packed_linear_bf16_pairs", &packed_linear_bf16_pairs,
        "y = x @ W^T, bf16 x and W in k-pair panels, AVX512-BF16 dot products or AMX tiles (linear_cpu.cpp; AVX-512 build)",
        py::call_guard<py::gil_scoped_release>());
  m.def("set_amx", &set_amx, "k-pair products on AMX tiles where they can (1), not (0), or ask (-1): whether they are "
        "on and usable (linear_cpu.cpp)", py::arg("enable") = -1);
  m.def("quant_linear", &quant_linear,
        "y = x @ W^T with W group-quantized (4/8-bit codes, scale, offset) in 16-channel panels (quant_linear_cpu.cpp)",
        py::call_guard<py::gil_scoped_release>());
  m.def("packed_rows", &packed_rows, "rows W[ids] of a packed weight, fp32 (linear_cpu.cpp)",
        py::call_guard<py::gil_scoped_release>());
  m.def("packed_linear_argmax", &packed_linear_argmax,
        "each row's argmax of x @ W^T (greedy sampling's token) without the logits (argmax_cpu.cpp)",
        py::call_guard<py::gil_scoped_release>());
  m.def("packed_linear_argmax_screened", &packed_linear_argmax_screened,
        "packed_linear_argmax of an fp32 W, screened on a bf16 copy and checked exactly (argmax_cpu.cpp)",
        py::call_guard<py::gil_scoped_release>());
  m.def("paged_decode_attention", &paged_decode_attention,
        "one-query attention over the paged KV cache (attention_cpu.cpp)", py::arg("q"), py::arg("k_cache"),
        py::arg("v_cache"), py::arg("block_tables"), py::arg("ctx_lens"), py::arg("block_size"), py::arg("scale"),
        py::arg("sliding_window"), py::arg("softcap"), py::arg("sinks") = py::none(),
        py::call_guard<py::gil_scoped_release>());
  m.def("paged_prefill_attention", &paged_prefill_attention,
        "causal attention of prefill chunks over the paged KV cache, into out (prefill_attention_cpu.cpp)",
        py::arg("q"), py::arg("k_cache"), py::arg("v_cache"), py::arg("block_tables"), py::arg("q_starts"),
        py::arg("q_lens"), py::arg("ctx_lens"), py::arg("out"), py::arg("block_size"), py::arg("scale"),
        py::arg("sliding_window"), py::arg("softcap"), py::arg("sinks") = py::none(),
        py::call_guard<py::gil_scoped_release>());
  m.def("silu_and_mul", &silu_and_mul, "silu(x[:, :I]) * x[:, I:] (activation_cpu.cpp)",
        py::call_guard<py::gil_scoped_release>());
  m.def("gelu_tanh_and_mul", &gelu_tanh_and_mul, "gelu(x[:, :I], approximate='tanh') * x[:, I:] (activation_cpu.cpp)",
        py::call_guard<py::gil_scoped_release>());
  m.def("fused_moe", &fused_moe,
        "an MoE layer's SwiGLU experts (fp32, bf16, int8 or MXFP4; biases, gpt-oss's clamp), tokens grouped by expert "
        "(moe_cpu.cpp)", py::arg("x"), py::arg("weights"), py::arg("ids"), py::arg("w13"), py::arg("w2"),
        py::arg("b13") = py::none(), py::arg("b2") = py::none(), py::arg("swiglu_alpha") = 1.0,
        py::arg("swiglu_limit") = 0.0, py::arg("s13") = py::none(), py::arg("s2") = py::none(),
        py::call_guard<py::gil_scoped_release>());
  m.def("rms_norm", &rms_norm, "RMSNorm of fp32 rows (norm_cpu.cpp)", py::call_guard<py::gil_scoped_release>());
  m.def("fused_add_rms_norm", &fused_add_rms_norm, "in place: residual += x; x = RMSNorm(residual) (norm_cpu.cpp)",
        py::call_guard<py::gil_scoped_release>());
  m.def("rms_norm_heads_", &rms_norm_heads_, "in place: RMSNorm of each head row of (T, heads, n) q or k views (norm_cpu.cpp)",
        py::call_guard<py::gil_scoped_release>());
  m.def("pool_cached_bytes", &pdserve::pool_cached_bytes,
        "bytes of freed big outputs the kernels keep for reuse (buffer_pool.cpp)");
  m.def("write_cache", &pdserve::write_cache, "cache[slots[t]] = x[t], bf16 rounded as .to() rounds (decoder_cpu.cpp)",
        py::call_guard<py::gil_scoped_release>());
  py::class_<pdserve::AttentionStep>(m, "AttentionStep", "one step's paged-attention metadata (decoder.h)", py::module_local())
      .def_static("from_ints", &step_from_ints,
                  "(the flat lists before the slot mapping as tensors, the step) from the step's lists (see step_from_ints)")
      .def_readonly("slot_mapping", &pdserve::AttentionStep::slot_mapping)
      .def_readonly("decode_first_row", &pdserve::AttentionStep::decode_first_row)
      .def_readonly("decode_rows", &pdserve::AttentionStep::decode_rows)
      .def_readonly("decode_tables", &pdserve::AttentionStep::decode_tables)
      .def_readonly("decode_ctx", &pdserve::AttentionStep::decode_ctx)
      .def_readonly("prefill_starts", &pdserve::AttentionStep::prefill_starts)
      .def_readonly("prefill_q_lens", &pdserve::AttentionStep::prefill_q_lens)
      .def_readonly("prefill_tables", &pdserve::AttentionStep::prefill_tables)
      .def_readonly("prefill_ctx", &pdserve::AttentionStep::prefill_ctx)
      .def_readonly("block_size", &pdserve::AttentionStep::block_size);
  py::class_<pdserve::DecoderStack>(m, "DecoderStack", "a decoder's layers in one call, after its recipe (decoder_cpu.cpp)",
                                    py::module_local())
      .def(py::init<const std::vector<std::map<std::string, torch::Tensor>>&, const std::map<std::string, torch::Tensor>&,
                    bool, std::string, std::string, const std::vector<std::string>&, const std::vector<int64_t>&,
                    std::string, int64_t, int64_t, int64_t, int64_t, double, double, const std::vector<int64_t>&,
                    double, double>(),
           py::arg("layers"), py::arg("final_norm"), py::arg("has_final_norm"), py::arg("norm"),
           py::arg("norm_position"), py::arg("norms"), py::arg("rotary"), py::arg("activation"), py::arg("num_heads"),
           py::arg("num_kv_heads"), py::arg("head_dim"), py::arg("intermediate_size"), py::arg("eps"), py::arg("scale"),
           py::arg("windows"), py::arg("softcap"), py::arg("residual_multiplier"))
      .def_property_readonly("num_layers", &pdserve::DecoderStack::num_layers)
      .def("forward", &pdserve::DecoderStack::forward, py::call_guard<py::gil_scoped_release>());
  m.def("rotary_embedding", &rotary_embedding, "rotate-half RoPE on q and k in place (rotary_cpu.cpp)",
        py::call_guard<py::gil_scoped_release>());
}
