// CPU gguf_qmm: y[..., N] = x[..., K] @ W.T, W [N, K] given as GGUF K-quant blocks (Q2_K, Q3_K,
// Q4_K, Q5_K, Q6_K) or i-quant blocks (IQ4_XS and the lattice types IQ1_S .. IQ3_S).
//
// Small M: the chunk kernels (gguf_chunked.cpp). Otherwise, small M: each task owns rows of
// W; a super-block is decoded once to 256 floats and reused for every row of x.
// Large M: rows of W are decoded in blocks to float32 and multiplied with a BLAS GEMM.
// Accumulation is float32 throughout. Block layouts: csrc/gguf_format.h.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/mm_cpu_dispatch.h>
#include <ATen/ops/zeros.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include <algorithm>
#include <cstring>
#include <string>
#include <vector>

#include "../gguf_format.h"
#include "../gguf_validate.h"
#include "decode.h"
#include "gguf_chunked.h"
#include "gguf_lattice_avx2.h"
#include "qmm_kernels.h"
#include "work_split.h"
#include "x_rows.h"

namespace torch_qmm {
namespace {

using gguf::BlockQ2K;
using gguf::BlockQ3K;
using gguf::BlockQ4K;
using gguf::BlockQ5K;
using gguf::BlockQ6K;
using gguf::BlockIQ4XS;
using gguf::kQK_K;

using cpu::kGemmMinRows;  // qmm_kernels.h
constexpr int64_t kGemmBlockRows = 256;

inline float half_to_float(uint16_t bits) { return float(c10::Half(bits, c10::Half::from_bits())); }

// After llama.cpp dequantize_row_q2_K: 2 halves of 128 weights; in each, 4 shifts x 2 runs of 16
// codes (qs bytes 0-15, then 16-31 of the half), one 4-bit scale and min per run.
void decode_q2_K(const uint8_t* raw, float* y) {
  BlockQ2K b;
  std::memcpy(&b, raw, sizeof b);
  const float d = half_to_float(b.d), dmin = half_to_float(b.dmin);
  for (int h = 0; h < 2; ++h) {
    for (int j = 0; j < 4; ++j) {
      for (int s = 0; s < 2; ++s) {
        const uint8_t sc = b.scales[8 * h + 2 * j + s];
        const float dl = d * float(sc & 0xF), ml = dmin * float(sc >> 4);
        const uint8_t* q = b.qs + 32 * h + 16 * s;
        float* yr = y + 128 * h + 32 * j + 16 * s;
        for (int l = 0; l < 16; ++l) yr[l] = dl * float((q[l] >> (2 * j)) & 3) - ml;
      }
    }
  }
}

// After llama.cpp dequantize_row_q3_K: Q2_K's runs, a third code bit from hmask, signed 6-bit
// scales and the codes centred on 4 (every weight exact in float32: 11 + 6 + 3 bits).
void decode_q3_K(const uint8_t* raw, float* y) {
  BlockQ3K b;
  std::memcpy(&b, raw, sizeof b);
  const float d = half_to_float(b.d);
  for (int h = 0; h < 2; ++h) {
    for (int j = 0; j < 4; ++j) {
      for (int s = 0; s < 2; ++s) {
        const float dl = d * float(gguf::q3k_scale(8 * h + 2 * j + s, b.scales));
        const uint8_t* q = b.qs + 32 * h + 16 * s;
        const uint8_t* hm = b.hmask + 16 * s;
        float* yr = y + 128 * h + 32 * j + 16 * s;
        for (int l = 0; l < 16; ++l) {
          const int code = ((q[l] >> (2 * j)) & 3) | (((hm[l] >> (4 * h + j)) & 1) << 2);
          yr[l] = dl * float(code - 4);
        }
      }
    }
  }
}

// After llama.cpp dequantize_row_q4_K: 4 chunks of 64 weights, low then high nibbles.
void decode_q4_K(const uint8_t* raw, float* y) {
  BlockQ4K b;
  std::memcpy(&b, raw, sizeof b);  // blocks are byte-aligned inside a row
  const float d = half_to_float(b.d), dmin = half_to_float(b.dmin);
  for (int c = 0; c < 4; ++c) {
    const gguf::ScaleMin lo = gguf::q4k_scale_min(2 * c, b.scales);
    const gguf::ScaleMin hi = gguf::q4k_scale_min(2 * c + 1, b.scales);
    const float d1 = d * float(lo.scale), m1 = dmin * float(lo.min);
    const float d2 = d * float(hi.scale), m2 = dmin * float(hi.min);
    const uint8_t* q = b.qs + 32 * c;
    float* yc = y + 64 * c;
    for (int l = 0; l < 32; ++l) {
      yc[l] = d1 * float(q[l] & 0xF) - m1;
      yc[l + 32] = d2 * float(q[l] >> 4) - m2;
    }
  }
}

// After llama.cpp dequantize_row_q5_K: Q4_K's order, each code's fifth bit from qh.
void decode_q5_K(const uint8_t* raw, float* y) {
  BlockQ5K b;
  std::memcpy(&b, raw, sizeof b);
  const float d = half_to_float(b.d), dmin = half_to_float(b.dmin);
  for (int c = 0; c < 4; ++c) {
    for (int nib = 0; nib < 2; ++nib) {
      const gguf::ScaleMin sm = gguf::q4k_scale_min(2 * c + nib, b.scales);
      const float dl = d * float(sm.scale), ml = dmin * float(sm.min);
      const uint8_t* q = b.qs + 32 * c;
      float* yc = y + 64 * c + 32 * nib;
      for (int l = 0; l < 32; ++l) {
        const int code = ((q[l] >> (4 * nib)) & 0xF) | (((b.qh[l] >> (2 * c + nib)) & 1) << 4);
        yc[l] = dl * float(code) - ml;
      }
    }
  }
}

// After llama.cpp dequantize_row_q6_K: 2 halves of 128 weights, 4 interleaved runs of 32.
void decode_q6_K(const uint8_t* raw, float* y) {
  BlockQ6K b;
  std::memcpy(&b, raw, sizeof b);
  const float d = half_to_float(b.d);
  for (int h = 0; h < 2; ++h) {
    const uint8_t* ql = b.ql + 64 * h;
    const uint8_t* qh = b.qh + 32 * h;
    const int8_t* sc = b.scales + 8 * h;
    float* yh = y + 128 * h;
    // Runs of 16 share their four scales, so the inner loop has none to look up (vectorizes).
    for (int is = 0; is < 2; ++is) {
      const float s1 = d * float(sc[is]), s2 = d * float(sc[is + 2]), s3 = d * float(sc[is + 4]),
                  s4 = d * float(sc[is + 6]);
      for (int l = 16 * is; l < 16 * is + 16; ++l) {
        const int q1 = int((ql[l] & 0xF) | (((qh[l] >> 0) & 3) << 4)) - 32;
        const int q2 = int((ql[l + 32] & 0xF) | (((qh[l] >> 2) & 3) << 4)) - 32;
        const int q3 = int((ql[l] >> 4) | (((qh[l] >> 4) & 3) << 4)) - 32;
        const int q4 = int((ql[l + 32] >> 4) | (((qh[l] >> 6) & 3) << 4)) - 32;
        yh[l] = s1 * float(q1);
        yh[l + 32] = s2 * float(q2);
        yh[l + 64] = s3 * float(q3);
        yh[l + 96] = s4 * float(q4);
      }
    }
  }
}

// After llama.cpp dequantize_row_iq4_xs: 8 sub-blocks of 32, each a signed 6-bit scale times the
// table values its 16 code bytes index (low nibbles the first 16 weights, high nibbles the rest).
void decode_iq4_XS(const uint8_t* raw, float* y) {
  BlockIQ4XS b;
  std::memcpy(&b, raw, sizeof b);
  const float d = half_to_float(b.d);
  for (int j = 0; j < 8; ++j) {
    const float dl = d * float(gguf::iq4xs_scale(j, b.scales_l, b.scales_h));
    const uint8_t* q = b.qs + 16 * j;
    float* yj = y + 32 * j;
    for (int l = 0; l < 16; ++l) {
      yj[l] = dl * float(gguf::kIQ4Values[q[l] & 0xF]);
      yj[l + 16] = dl * float(gguf::kIQ4Values[q[l] >> 4]);
    }
  }
}

// After llama.cpp dequantize_row_iq2_xxs / iq2_xs / iq2_s / iq3_xxs / iq3_s / iq1_s / iq1_m: 32
// groups of 8 weights, each decoded by the type's gguf::Lattice (metal/gguf_format.h).
template <int type>
void decode_lattice(const uint8_t* raw, float* y) {
  using L = gguf::Lattice<type>;
  typename L::Block b;
  std::memcpy(&b, raw, sizeof b);
  const float d = half_to_float(uint16_t(L::d_bits(&b)));
  for (int r = 0; r < kQK_K / 8; ++r) {
    const gguf::Group8 g = gguf::group8(L::code(&b, r, d));
    for (int i = 0; i < 8; ++i) y[8 * r + i] = g.scale * g.q[i];
  }
}

// The decoder of a ggml type as a functor (inlined into the loops below; a function pointer
// passed at run time was not).
template <void (*kDecode)(const uint8_t*, float*)>
struct Decoder {
  void operator()(const uint8_t* raw, float* y) const { kDecode(raw, y); }
};

// f(the Decoder of a lattice type): with `vector` (and AVX2 built) the AVX2 decode of
// gguf_lattice_avx2.h (the same values, 8 at a time; the GEMM route, IQ2_XXS 4096 x 4096, M = 24,
// one thread: 53 -> 21 ms), else the scalar one.
template <int type, typename F>
void with_lattice_decoder(bool vector, F&& f) {
#if defined(__AVX2__) && defined(__FMA__)
  if (vector) return f(Decoder<cpu::lattice::decode_block<type>>{});
#else
  (void)vector;
#endif
  f(Decoder<decode_lattice<type>>{});
}

// f(the Decoder of ggml_type), a native type (gguf_validate refuses the others first); `vector`:
// with_lattice_decoder's choice.
template <typename F>
void with_decoder(int64_t ggml_type, bool vector, F&& f) {
  switch (ggml_type) {
    case gguf::kTypeQ2_K:
      return f(Decoder<decode_q2_K>{});
    case gguf::kTypeQ3_K:
      return f(Decoder<decode_q3_K>{});
    case gguf::kTypeQ4_K:
      return f(Decoder<decode_q4_K>{});
    case gguf::kTypeQ5_K:
      return f(Decoder<decode_q5_K>{});
    case gguf::kTypeQ6_K:
      return f(Decoder<decode_q6_K>{});
    case gguf::kTypeIQ4_XS:
      return f(Decoder<decode_iq4_XS>{});
    case gguf::kTypeIQ2_XXS:
      return with_lattice_decoder<gguf::kTypeIQ2_XXS>(vector, f);
    case gguf::kTypeIQ2_XS:
      return with_lattice_decoder<gguf::kTypeIQ2_XS>(vector, f);
    case gguf::kTypeIQ2_S:
      return with_lattice_decoder<gguf::kTypeIQ2_S>(vector, f);
    case gguf::kTypeIQ3_XXS:
      return with_lattice_decoder<gguf::kTypeIQ3_XXS>(vector, f);
    case gguf::kTypeIQ3_S:
      return with_lattice_decoder<gguf::kTypeIQ3_S>(vector, f);
    case gguf::kTypeIQ1_S:
      return with_lattice_decoder<gguf::kTypeIQ1_S>(vector, f);
    case gguf::kTypeIQ1_M:
      return with_lattice_decoder<gguf::kTypeIQ1_M>(vector, f);
    default:
      TORCH_CHECK_VALUE(false, "gguf_qmm: no CPU kernel for ggml_type ", ggml_type);
  }
}

// sum_j w[j] * x[j] over one super-block, 16 lanes at a time (a scalar `s += w * x` loop stays
// scalar: float sums are not reassociated without -ffast-math).
inline float dot_block(const float* w, const float* x) {
  cpu::f32x16 a0{}, a1{};
  for (int j = 0; j < kQK_K; j += 32) {
    a0 += cpu::load16(w + j) * cpu::load16(x + j);
    a1 += cpu::load16(w + j + 16) * cpu::load16(x + j + 16);
  }
  return cpu::hsum16(a0 + a1);
}

template <typename Decode>
void qmm_fused(const float* xf, const uint8_t* blocks, float* yf, int64_t M, int64_t N, int64_t K,
               int64_t bytes_per_block, Decode decode) {
  const int64_t nb = K / kQK_K;
  const int64_t row_bytes = nb * bytes_per_block;
  at::parallel_for(0, N, cpu::grain_for_work(N, 4, M, N, K), [&](int64_t n0, int64_t n1) {
    alignas(64) float w[kQK_K];
    std::vector<float> acc(M);
    for (int64_t n = n0; n < n1; ++n) {
      std::fill(acc.begin(), acc.end(), 0.0f);
      const uint8_t* row = blocks + n * row_bytes;
      for (int64_t b = 0; b < nb; ++b) {
        decode(row + b * bytes_per_block, w);  // once per super-block, reused for all M rows of x
        for (int64_t m = 0; m < M; ++m) acc[m] += dot_block(w, xf + m * K + b * kQK_K);
      }
      for (int64_t m = 0; m < M; ++m) yf[m * N + n] = acc[m];
    }
  });
}

template <typename Decode>
void decode_rows(const uint8_t* blocks, float* dst, int64_t r0, int64_t r1, int64_t K, int64_t bytes_per_block,
                 Decode decode) {
  const int64_t nb = K / kQK_K;
  const int64_t row_bytes = nb * bytes_per_block;
  at::parallel_for(r0, r1, 4, [&](int64_t a, int64_t b) {
    for (int64_t r = a; r < b; ++r)
      for (int64_t j = 0; j < nb; ++j) decode(blocks + r * row_bytes + j * bytes_per_block, dst + (r - r0) * K + j * kQK_K);
  });
}

cpu::GgufArgs args_for(const cpu::XRows& xr, const at::Tensor& blocks, int64_t N, int64_t K, at::ScalarType x_dtype) {
  const at::Tensor& xf = xr.xf;
  cpu::GgufArgs a;
  a.x = xf.data_ptr<float>();
  a.x_in_range = xr.in_range;
  a.x_in_subnormal_range = xr.in_subnormal_range;
  a.blocks = blocks.data_ptr<uint8_t>();
  a.M = xf.size(0);
  a.N = N;
  a.K = K;
  a.x_bf16_terms = cpu::x_bf16_terms_for(x_dtype);
  a.avoid_bf16 = cpu::avoid_bf16();
  return a;
}

at::Tensor gguf_qmm_cpu(const at::Tensor& x, const at::Tensor& blocks_in, int64_t ggml_type, int64_t N, int64_t K) {
  check_gguf_qmm(x, blocks_in, ggml_type, N, K);
  auto out_shape = x.sizes().vec();
  out_shape.back() = N;
  const int64_t M = x.numel() / K;
  if (M == 0 || N == 0) return at::zeros(out_shape, x.options());

  const at::Tensor blocks = blocks_in.contiguous();
  const cpu::XRows xr = cpu::x_rows(x, M, K);
  const at::Tensor& xf = xr.xf;
  at::Tensor yf = at::empty({M, N}, xf.options());
  const cpu::GgufArgs a = args_for(xr, blocks, N, K, x.scalar_type());
  // The chunk kernels hoist the offsets (the mins, Q3_K's -4, Q6_K's -32) out of the dot products; where that
  // gives a non-finite value it need not be the one IEEE arithmetic on the decoded weights gives,
  // so such calls are redone by the fused / GEMM kernels below, which multiply decoded weights.
  if (cpu::gguf_chunked_multiplier(a, ggml_type) != nullptr) {
    cpu::gguf_chunked(a, ggml_type, yf.data_ptr<float>());
    if (cpu::all_finite(yf.data_ptr<float>(), yf.numel())) return yf.to(x.scalar_type()).reshape(out_shape);
  }
  const auto* w = blocks.data_ptr<uint8_t>();
  const int64_t bpb = gguf::block_bytes(ggml_type);
  // The lattice types' vector decode goes with their AVX2 kernel (TORCH_QMM_CPU_NO_AVX2_CHUNKS=1:
  // the scalar one, which the fused route of the tests then checks).
  with_decoder(ggml_type, !cpu::avx2_chunks_avoided(), [&](auto decode) {
    if (M < kGemmMinRows) {
      qmm_fused(xf.data_ptr<float>(), w, yf.data_ptr<float>(), M, N, K, bpb, decode);
    } else {
      at::Tensor wf = at::empty({std::min(kGemmBlockRows, N), K}, xf.options());
      for (int64_t r0 = 0; r0 < N; r0 += kGemmBlockRows) {
        const int64_t r1 = std::min(N, r0 + kGemmBlockRows);
        decode_rows(w, wf.data_ptr<float>(), r0, r1, K, bpb, decode);
        // The CPU kernel itself (at::cpu::), not the dispatcher: under torch.autocast, at::mm would
        // multiply in bfloat16.
        yf.narrow(1, r0, r1 - r0).copy_(at::cpu::mm(xf, wf.narrow(0, 0, r1 - r0).t()));
      }
    }
  });
  return yf.to(x.scalar_type()).reshape(out_shape);
}

// Which CPU kernel gguf_qmm would run: "chunked/<multiplier>", "fused", "gemm", or "empty" (for a
// finite result; a chunked call whose result is not finite is redone by "fused" / "gemm").
std::string gguf_qmm_cpu_route(const at::Tensor& x, const at::Tensor& blocks_in, int64_t ggml_type, int64_t N,
                               int64_t K) {
  check_gguf_qmm(x, blocks_in, ggml_type, N, K);
  const int64_t M = x.numel() / K;
  if (M == 0 || N == 0) return "empty";
  const at::Tensor blocks = blocks_in.contiguous();
  if (const char* t = cpu::gguf_chunked_multiplier(args_for(cpu::x_rows(x, M, K), blocks, N, K, x.scalar_type()), ggml_type))
    return std::string("chunked/") + t;
  return M < kGemmMinRows ? "fused" : "gemm";
}

}  // namespace

TORCH_LIBRARY_IMPL(torch_qmm, CPU, m) {
  m.impl("gguf_qmm", &gguf_qmm_cpu);
  m.impl("_gguf_cpu_route", &gguf_qmm_cpu_route);
}

}  // namespace torch_qmm
