// simdgroup_matrix<T, 8, 8>: each lane of the SIMD-group owns 2 elements in Apple's layout
//   qid = lane / 4, row = (qid & 4) + (lane / 2) % 4, col = (qid & 2) * 2 + (lane % 2) * 2 (and col + 1)
// The lanes' elements are the matrix; load/store touch only the lane's own elements;
// multiply(-accumulate) is a SIMD-group collective that gathers, multiplies and scatters.
#pragma once

namespace metal {

MSIM_INLINE constexpr int __msim_mrow(int lane) { return ((lane / 4) & 4) + (lane / 2) % 4; }
MSIM_INLINE constexpr int __msim_mcol(int lane) { return ((lane / 4) & 2) * 2 + (lane % 2) * 2; }

template <class T, int Rows = 8, int Cols = 8> struct simdgroup_matrix {
  static_assert(Rows == 8 && Cols == 8, "metalsim supports 8x8 simdgroup matrices");
  vec<T, 2> __e;
  MSIM_INLINE simdgroup_matrix() : __e(T(0)) {}
  // Metal: simdgroup_matrix(T v) is the diagonal matrix v * I
  MSIM_INLINE simdgroup_matrix(T v) {
    uint32_t l = msim_current()->lane;
    int r = __msim_mrow(l), c = __msim_mcol(l);
    __e[0] = r == c ? v : T(0);
    __e[1] = r == c + 1 ? v : T(0);
  }
  MSIM_INLINE thread vec<T, 2> &thread_elements() { return __e; }
  MSIM_INLINE const thread vec<T, 2> &thread_elements() const { return __e; }
};
typedef simdgroup_matrix<float, 8, 8> simdgroup_float8x8;
typedef simdgroup_matrix<half, 8, 8> simdgroup_half8x8;
typedef simdgroup_matrix<bfloat, 8, 8> simdgroup_bfloat8x8;

template <class T, int R = 8, int C = 8> MSIM_INLINE simdgroup_matrix<T, R, C> make_filled_simdgroup_matrix(T v) {
  simdgroup_matrix<T, R, C> m;
  m.__e = vec<T, 2>(v);
  return m;
}

// element (r, c) of the loaded matrix comes from src[(oy + r) * stride + ox + c], or from
// src[(oy + c) * stride + ox + r] when transposed (origin is (column, row) of the source)
template <class T, class P>
MSIM_INLINE void __msim_mload(simdgroup_matrix<T, 8, 8> &d, P src, ulong stride, ulong2 origin, bool transpose) {
  uint32_t l = msim_current()->lane;
  int r = __msim_mrow(l), c = __msim_mcol(l);
  for (int j = 0; j < 2; j++) {
    ulong rr = transpose ? (ulong)(c + j) : (ulong)r, cc = transpose ? (ulong)r : (ulong)(c + j);
    d.__e[j] = static_cast<T>(src[(origin.y + rr) * stride + origin.x + cc]);
  }
}
template <class T, class P>
MSIM_INLINE void __msim_mstore(const simdgroup_matrix<T, 8, 8> &m, P dst, ulong stride, ulong2 origin, bool transpose) {
  uint32_t l = msim_current()->lane;
  int r = __msim_mrow(l), c = __msim_mcol(l);
  for (int j = 0; j < 2; j++) {
    ulong rr = transpose ? (ulong)(c + j) : (ulong)r, cc = transpose ? (ulong)r : (ulong)(c + j);
    dst[(origin.y + rr) * stride + origin.x + cc] = m.__e[j];
  }
}
#define MSIM_MLOADSTORE(AS)                                                                             \
  template <class T, class U>                                                                            \
  MSIM_INLINE void simdgroup_load(thread simdgroup_matrix<T, 8, 8> &d, const AS U *src, ulong elements_per_row = 8, \
                                  ulong2 matrix_origin = ulong2(0), bool transpose_matrix = false) {    \
    __msim_mload(d, src, elements_per_row, matrix_origin, transpose_matrix);                            \
  }                                                                                                      \
  template <class T, class U>                                                                            \
  MSIM_INLINE void simdgroup_store(const thread simdgroup_matrix<T, 8, 8> &m, AS U *dst, ulong elements_per_row = 8, \
                                   ulong2 matrix_origin = ulong2(0), bool transpose_matrix = false) {   \
    __msim_mstore(m, dst, elements_per_row, matrix_origin, transpose_matrix);                           \
  }
MSIM_MLOADSTORE(device)
MSIM_MLOADSTORE(threadgroup)
MSIM_MLOADSTORE(constant)
MSIM_MLOADSTORE(thread)

struct __msim_mdep {
  float a[2], b[2], c[2];
};
// D = A * B + C with float accumulation in k order, rounded once to D's type
template <class TD>
void __msim_mma(uint32_t mask, const void *const *ins, void *const *outs) {
  float A[8][8] = {}, B[8][8] = {}, C[8][8] = {};
  for (int l = 0; l < 32; l++) {
    if (!(mask >> l & 1u)) continue;
    const __msim_mdep *d = (const __msim_mdep *)ins[l];
    int r = __msim_mrow(l), c = __msim_mcol(l);
    for (int j = 0; j < 2; j++) { A[r][c + j] = d->a[j]; B[r][c + j] = d->b[j]; C[r][c + j] = d->c[j]; }
  }
  for (int l = 0; l < 32; l++) {
    if (!(mask >> l & 1u)) continue;
    int r = __msim_mrow(l), c = __msim_mcol(l);
    vec<TD, 2> out;
    for (int j = 0; j < 2; j++) {
      float s = C[r][c + j];
      for (int k = 0; k < 8; k++) s += A[r][k] * B[k][c + j];
      out[j] = static_cast<TD>(s);
    }
    *(vec<TD, 2> *)outs[l] = out;
  }
}
template <class TD, class TA, class TB, class TC>
MSIM_COLL void simdgroup_multiply_accumulate(thread simdgroup_matrix<TD, 8, 8> &d, const thread simdgroup_matrix<TA, 8, 8> &a,
                                             const thread simdgroup_matrix<TB, 8, 8> &b,
                                             const thread simdgroup_matrix<TC, 8, 8> &c) {
  __msim_mdep dep;
  for (int j = 0; j < 2; j++) {
    dep.a[j] = (float)a.__e[j];
    dep.b[j] = (float)b.__e[j];
    dep.c[j] = (float)c.__e[j];
  }
  vec<TD, 2> out;
  msim_collective(MSIM_C_MATRIX, "simdgroup_multiply_accumulate", &dep, &out, &__msim_mma<TD>);
  d.__e = out;
}
template <class TD, class TA, class TB>
MSIM_COLL void simdgroup_multiply(thread simdgroup_matrix<TD, 8, 8> &d, const thread simdgroup_matrix<TA, 8, 8> &a,
                                  const thread simdgroup_matrix<TB, 8, 8> &b) {
  __msim_mdep dep;
  for (int j = 0; j < 2; j++) {
    dep.a[j] = (float)a.__e[j];
    dep.b[j] = (float)b.__e[j];
    dep.c[j] = 0.0f;
  }
  vec<TD, 2> out;
  msim_collective(MSIM_C_MATRIX, "simdgroup_multiply", &dep, &out, &__msim_mma<TD>);
  d.__e = out;
}
}  // namespace metal
