"""Writes the decode-attention lab kernels (2026-11-30 evening) into LAB_DIR (default
/tmp/decode_attention_labs), each a copy of pdserve/kernels/attention_cpu.cpp at ba7fd11 with one
change and a pybind module of its own:
  att_ahead.cpp   the next-tile prefetch `lab_ahead` tiles ahead (set_ahead; 1 is the kernel's own,
                  0 prefetches the tile about to be read, i.e. no useful prefetch), and at a pass's
                  start the first lab_ahead tiles
  att_skip.cpp    pass 1 (scores) or pass 2 (weighted values) skipped (set_skip 1 or 2): their
                  times, not results
  att_dmajor.cpp  pass 1 on a d-major key cache, (blocks, Hkv, D, 16): a block's 16 keys of one
                  head are a (D, 16) tile, so G query heads' 16 scores are D FMAs each with q[g][d]
                  broadcast and no transpose-add tree (sum16). Block size 16, no sliding window.
Run from the repository root: python benchmarks/results/perf/decode_attention_labs/make_labs.py"""
import os
import subprocess

LAB_DIR = os.environ.get("LAB_DIR", "/tmp/decode_attention_labs")
src = subprocess.run(["git", "show", "ba7fd11:pdserve/kernels/attention_cpu.cpp"], capture_output=True, text=True,
                     check=True).stdout
os.makedirs(LAB_DIR, exist_ok=True)


def sub(text, old, new):
    assert old in text, old
    return text.replace(old, new)


P1 = "      for (int64_t i0 = 0; i0 < len; i0 += 16) {\n        const int64_t nk = std::min<int64_t>(16, len - i0);   // a short tail"
P2 = "      for (int64_t i0 = 0; i0 < len; i0 += 16) {\n        const int64_t nk = std::min<int64_t>(16, len - i0);\n        prefetch_rows(vrows"
ATTN = "\nPYBIND11_MODULE(TORCH_EXTENSION_NAME, m) { m.def(\"attn\", &paged_decode_attention); %s}\n"

# prefetch distance
p = sub(src, "namespace {\n", "namespace {\nint lab_ahead = 1;\n")
for rows in ("krows", "vrows"):
    p = sub(p, f"prefetch_rows({rows}.data() + i0 + 16, std::min<int64_t>(16, len - i0 - 16), slot_bytes);",
            f"prefetch_rows({rows}.data() + i0 + 16 * lab_ahead, std::min<int64_t>(16, len - i0 - 16 * lab_ahead), slot_bytes);")
p = sub(p, P1, "      if (lab_ahead > 1) prefetch_rows(krows.data(), std::min<int64_t>(16 * lab_ahead, len), slot_bytes);\n" + P1)
p = sub(p, "      for (int64_t i = 0; i < nh * G * D; ++i) o[i] = 0.f;\n",
        "      for (int64_t i = 0; i < nh * G * D; ++i) o[i] = 0.f;\n"
        "      if (lab_ahead > 1) prefetch_rows(vrows.data(), std::min<int64_t>(16 * lab_ahead, len), slot_bytes);\n")
p += "\nvoid set_ahead(int a) { lab_ahead = a; }" + ATTN % 'm.def("set_ahead", &set_ahead); '
open(os.path.join(LAB_DIR, "att_ahead.cpp"), "w").write(p)

# one pass skipped
p = sub(src, "namespace {\n", "namespace {\nint lab_skip = 0;\n")
p = sub(p, P1, P1.replace("i0 < len;", "i0 < (lab_skip == 2 ? 0 : len);"))
p = sub(p, P2, P2.replace("i0 < len;", "i0 < (lab_skip == 1 ? 0 : len);"))
p += "\nvoid set_skip(int a) { lab_skip = a; }" + ATTN % 'm.def("set_skip", &set_skip); '
open(os.path.join(LAB_DIR, "att_skip.cpp"), "w").write(p)

# d-major keys in pass 1
start, end = src.index("      // pass 1: scores q.k"), src.index("      for (int64_t g = 0; g < nh * G; ++g) softmax(")
pass1 = r'''      // pass 1 (d-major keys): block blk's keys of head h are a (D, 16) tile
      for (int64_t i0 = 0; i0 < len; i0 += 16) {
        const int64_t blk = i0 / 16, nk = std::min<int64_t>(16, len - i0);
        if (i0 + 16 < len)
          for (int64_t h = 0; h < nh; ++h)
            for (int64_t off = 0; off < D * 16 * int64_t(sizeof(T)); off += 64)
              _mm_prefetch(reinterpret_cast<const char*>(kc + ((table[blk + 1] * Hkv + h0 + h) * D) * 16) + off, _MM_HINT_T2);
        for (int64_t h = 0; h < nh; ++h) {
          const T* kt = kc + ((table[blk] * Hkv + h0 + h) * D) * 16;
          for (int64_t g0 = h * G; g0 < (h + 1) * G; g0 += 8) {
            const int64_t gn = std::min<int64_t>(8, (h + 1) * G - g0);
            __m512 acc[8];
            const float* qg = qs.data() + g0 * D;
            auto run = [&](auto GN) {   // GN heads: accumulators in registers
              constexpr int n = decltype(GN)::value;
              for (int g = 0; g < n; ++g) acc[g] = _mm512_setzero_ps();
              for (int64_t d = 0; d < D; ++d) {
                const __m512 k = load16<T>(kt + d * 16);
                for (int g = 0; g < n; ++g) acc[g] = _mm512_fmadd_ps(_mm512_set1_ps(qg[g * D + d]), k, acc[g]);
              }
            };
            switch (gn) {
              case 1: run(std::integral_constant<int, 1>{}); break;
              case 2: run(std::integral_constant<int, 2>{}); break;
              case 3: run(std::integral_constant<int, 3>{}); break;
              case 4: run(std::integral_constant<int, 4>{}); break;
              case 5: run(std::integral_constant<int, 5>{}); break;
              case 6: run(std::integral_constant<int, 6>{}); break;
              case 7: run(std::integral_constant<int, 7>{}); break;
              default: run(std::integral_constant<int, 8>{}); break;
            }
            for (int g = 0; g < gn; ++g) _mm512_mask_storeu_ps(scores.data() + (g0 + g) * len + i0, pdserve::lanes(nk), acc[g]);
          }
        }
      }
'''
p = src[:start] + pass1 + src[end:] + ATTN % ""
open(os.path.join(LAB_DIR, "att_dmajor.cpp"), "w").write(p)
print("wrote", LAB_DIR)
