// Large-M qmm (every fp mode at any M): decode W tiles to float32 and multiply them with BLAS. See qmm_kernels.h.
//
// Each thread owns whole output tiles (rows of yT = y^T [N, M]) and, for each, walks K in steps
// of kTileK: decodes the W tile [kTileN, kTileK] into its own scratch (L2-sized, 256 KB) and
// calls a single-threaded GEMM (at::mm inside at::parallel_for runs serially) that accumulates
// into its output rows. The GEMM is a dispatcher call, so each worker runs it under the caller's
// thread-local state (inference mode, grad mode: at::ThreadLocalStateGuard, as at::launch does);
// OpenMP workers would otherwise see the defaults, and an in-place update of a tensor made under
// torch.inference_mode() outside it is an error. Decode and GEMM thus run on all cores with no barrier between them and
// decoding costs ~1 pass over the packed weights per M (it is O(N*K), the GEMM O(M*N*K)).
//
//   transpose=True : yT[n-tile, :] += W[n-tile, k-tile] @ xp[:, k-tile]^T   (xp: codec-ordered x)
//   transpose=False: yT[n-tile, :] += W[k-tile, n-tile]^T @ x[:, k-tile]^T  (n in codec order,
//                                                                            un-permuted at the end)
#include <ATen/Parallel.h>
#include <ATen/ThreadLocalState.h>
#include <ATen/ops/addmm.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/from_blob.h>
#include <ATen/ops/mm.h>

#include <vector>

#include "decode_tile.h"
#include "qmm_dispatch.h"
#include "qmm_kernels.h"

namespace torch_qmm {
namespace cpu {
namespace {

// Tile of W decoded per GEMM call: 128 x 512 float32 = 256 KB, half of a 512 KB-1 MB L2.
// kTileN is a multiple of every group size (needed by transpose=False, where tiles span N).
constexpr int64_t kTileN = 128;
constexpr int64_t kTileK = 512;

// y.T [N, M] tile by tile: each task decodes a kTileN x kTileK block of W to float32 scratch and
// multiplies it into its rows of y.T with a single-threaded GEMM, so decode needs no barrier.
// TRANSPOSE: W [N, K] quantized along K; else W [K, N] quantized along N, whose decoded rows of
// y.T come out in codec order (see n_gemm).
// decode(cols, r0, nr, c0, nc, dst) writes rows [r0, r0+nr) x columns [c0, c0+nc) of the packed
// matrix (`cols` columns) to dst [nr, nc] float32.
template <bool TRANSPOSE, typename Decode>
at::Tensor gemm_transposed_y(const QmmArgs& a, Decode decode) {
  const auto opts = at::TensorOptions().dtype(at::kFloat);
  at::Tensor yT = at::empty({a.N, a.M}, opts);
  const at::Tensor x = at::from_blob(const_cast<float*>(a.x), {a.M, a.K}, opts);
  const int64_t tiles = (a.N + kTileN - 1) / kTileN;
  const at::ThreadLocalState caller_state;
  at::parallel_for(0, tiles, 1, [&](int64_t t0, int64_t t1) {
    const at::ThreadLocalStateGuard state_guard(caller_state);
    std::vector<float> scratch(kTileN * std::min(kTileK, a.K));
    for (int64_t t = t0; t < t1; ++t) {
      const int64_t n0 = t * kTileN, nn = std::min(kTileN, a.N - n0);
      at::Tensor out = yT.narrow(0, n0, nn);
      for (int64_t k0 = 0; k0 < a.K; k0 += kTileK) {
        const int64_t kk = std::min(kTileK, a.K - k0);
        at::Tensor w;  // [nn, kk]
        if constexpr (TRANSPOSE) {
          decode(a.K, n0, nn, k0, kk, scratch.data());
          w = at::from_blob(scratch.data(), {nn, kk}, opts);
        } else {
          decode(a.N, k0, kk, n0, nn, scratch.data());
          w = at::from_blob(scratch.data(), {kk, nn}, opts).t();
        }
        const at::Tensor xs = x.narrow(1, k0, kk).t();
        if (k0 == 0)
          at::mm_out(out, w, xs);
        else
          out.addmm_(w, xs);
      }
    }
  });
  return yT;
}

template <int BITS, typename T>
at::Tensor t_gemm(const QmmArgs& a) {
  return gemm_transposed_y<true>(a, affine_decoder<BITS, T>(a)).t();
}

template <int BITS, typename T>
at::Tensor n_gemm(const QmmArgs& a) {
  const auto opts = at::TensorOptions().dtype(at::kFloat);
  const at::Tensor yT = gemm_transposed_y<false>(a, affine_decoder<BITS, T>(a));  // rows in codec order
  if (codec_is_identity(a.bits)) return yT.t();
  // Row p of yT holds column codec_to_natural(p) of y.
  at::Tensor y = at::empty({a.M, a.N}, opts);
  const float* src = yT.data_ptr<float>();
  float* dst = y.data_ptr<float>();
  at::parallel_for(0, a.N, 256, [&](int64_t p0, int64_t p1) {
    for (int64_t p = p0; p < p1; ++p) {
      const int64_t n = codec_to_natural(a.bits, p);
      for (int64_t m = 0; m < a.M; ++m) dst[m * a.N + n] = src[p * a.M + m];
    }
  });
  return y;
}

}  // namespace

at::Tensor qmm_t_gemm(const QmmArgs& a) {
  if (a.mode != Mode::kAffine) return gemm_transposed_y<true>(a, fp_decoder(a)).t();
  at::Tensor y;
  dispatch_bits_dtype(a.bits, a.dtype, [&](auto bits_c, auto t) { y = t_gemm<decltype(bits_c)::value, decltype(t)>(a); });
  return y;
}

at::Tensor qmm_n_gemm(const QmmArgs& a) {
  if (a.mode != Mode::kAffine) return gemm_transposed_y<false>(a, fp_decoder(a)).t();
  at::Tensor y;
  dispatch_bits_dtype(a.bits, a.dtype, [&](auto bits_c, auto t) { y = n_gemm<decltype(bits_c)::value, decltype(t)>(a); });
  return y;
}

}  // namespace cpu
}  // namespace torch_qmm
