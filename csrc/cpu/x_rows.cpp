#include "x_rows.h"

#include <ATen/Parallel.h>
#include <ATen/ops/empty.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <cstring>

#include "chunk_driver.h"

namespace torch_qmm {
namespace cpu {

namespace {

// Values per work item: 32 KB of float32, a few microseconds of work.
constexpr int64_t kGrain = 8192;
// Flags of a range of x, or-ed over the ranges.
constexpr int kNotFinite = 1, kOutOfRange = 2, kOutOfSubnormalRange = 4;

// The subnormal range lies inside the range, which implies finite, so the common case takes one
// scan; the wider range and Inf / NaN are looked for only in a range of x that is not in the
// narrower one.
int flags_of(const float* x, int64_t n) {
  if (chunk::x_in_subnormal_range(x, n)) return 0;
  if (chunk::x_in_range(x, n)) return kOutOfSubnormalRange;
  uint32_t inf_or_nan = 0;
  for (int64_t k = 0; k < n; ++k) {
    uint32_t u;
    std::memcpy(&u, x + k, 4);
    inf_or_nan |= uint32_t((u & 0x7f800000u) == 0x7f800000u);
  }
  return kOutOfSubnormalRange | kOutOfRange | (inf_or_nan ? kNotFinite : 0);
}

// The flags of n values, item by item over the threads: item(i0, i1) gives those of [i0, i1).
template <typename Item>
int flags_over(int64_t n, const Item& item) {
  return at::parallel_reduce(
      0, n, kGrain, 0, [&](int64_t i0, int64_t i1, int acc) { return acc | item(i0, i1); },
      [](int a, int b) { return a | b; });
}

// dst[0 .. n) = float(src[0 .. n)): exact for both 16-bit types.
void widen(const c10::BFloat16* src, float* dst, int64_t n) {
  for (int64_t k = 0; k < n; ++k) {
    const uint32_t u = uint32_t(src[k].x) << 16;
    std::memcpy(dst + k, &u, 4);
  }
}
void widen(const c10::Half* src, float* dst, int64_t n) {
  for (int64_t k = 0; k < n; ++k) dst[k] = float(src[k]);
}

template <typename T>
int convert_and_check(const at::Tensor& src, float* dst, int64_t n) {
  const T* s = src.const_data_ptr<T>();
  return flags_over(n, [&](int64_t i0, int64_t i1) {
    widen(s + i0, dst + i0, i1 - i0);
    return flags_of(dst + i0, i1 - i0);
  });
}

}  // namespace

XRows x_rows(const at::Tensor& x, int64_t M, int64_t K) {
  XRows r;
  at::Tensor xr = x.reshape({M, K});
  const int64_t n = M * K;
  int flags = 0;
  if (xr.scalar_type() == at::kBFloat16 || xr.scalar_type() == at::kHalf) {
    xr = xr.contiguous();
    r.xf = at::empty({M, K}, xr.options().dtype(at::kFloat));
    float* dst = r.xf.data_ptr<float>();
    flags = xr.scalar_type() == at::kBFloat16 ? convert_and_check<c10::BFloat16>(xr, dst, n)
                                              : convert_and_check<c10::Half>(xr, dst, n);
  } else {  // float32 as it is (a copy only if strided); any other dtype by torch's conversion
    r.xf = xr.to(at::kFloat).contiguous();
    const float* p = r.xf.const_data_ptr<float>();
    flags = flags_over(n, [&](int64_t i0, int64_t i1) { return flags_of(p + i0, i1 - i0); });
  }
  r.finite = !(flags & kNotFinite);
  r.in_range = !(flags & kOutOfRange);
  r.in_subnormal_range = !(flags & kOutOfSubnormalRange);
  return r;
}

}  // namespace cpu
}  // namespace torch_qmm
