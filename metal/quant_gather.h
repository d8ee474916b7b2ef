// gather_qmm (mixture of experts): y[i] = x[lhs[i]] @ W[rhs[i]].T (or @ W[rhs[i]]) for every pair
// i of the broadcast indices, every quantized mode (format policy F, metal/quant_format.h).
//
//   wq [E][N, K*bits/8 bytes] (transpose) or [E][K, N*bits/8 bytes]; scales (, biases) per expert
//   likewise; x [x_batch * M, K]; y [pairs * M, N]; lhs, rhs, order int32 [pairs]
//   (GatherParams and the buffer indices: metal/qmm_params.h)
//
// The pair order. `order` is a permutation of the pairs in which the pairs of one expert are
// adjacent (a run): the pairs as given when rhs is sorted (sorted_indices), else a stable argsort
// of rhs that the executor computes on the device before the launch (plan::Launch::order). Rows
// are numbered in that order, r = i * M + m for the i-th pair of `order` and its row m
// (GatherRows, metal/row_map.h). Results never depend on the order being sorted: a run is just
// a maximal stretch of equal experts, so an expert that appears in two runs is read twice.
//
// gather_qmv (decode; the design of llama.cpp's mul_mv_id, whose per-expert row lists are our
// runs, with MLX gather_qmv's one-launch-for-all-pairs grid):
//   grid (ceil(N/8), pairs); threadgroup (tx, i): the qmm_t_small threadgroup (metal/
//   quant_qmm_small.h: 2 SIMD-groups x 4 W rows). Only the threadgroups of the first pair of a
//   run work (the others exit at once, uniformly): they compute all the run's rows, 8 at a
//   time, against the expert's 8 W rows, so each expert's weights are fetched by one threadgroup
//   per column tile, once per launch for runs of up to 8 rows.
//
// gather_qmm_mma32 / gather_qmm_n_mma32 (prefill; MLX gather_qmm_rhs):
//   grid (ceil(N/32), ceil(pairs * M / 32)); threadgroup (tx, ty): rows r in [32 ty, 32 ty + 32)
//   of the order, which hold one or more runs; for each run the whole simdgroup-matrix tile
//   (metal/mma_tile.h, W loader of metal/quant_mma.h on that expert) with the other rows
//   masked. An expert's W is read once per tile its rows touch.
#pragma once

#include "quant_common.h"
#include "quant_mma.h"
#include "quant_qmm_small.h"

// Every gather_qmm kernel's buffers (QMM_ARGS with GatherParams and the three index buffers).
#define GATHER_ARGS                                                                                   \
  const device uint8_t* wq [[buffer(BUF_WQ)]], const device typename F::scale_t* scales [[buffer(BUF_SCALES)]], \
      const device T* biases [[buffer(BUF_BIASES)]], const device T* x [[buffer(BUF_DENSE)]],        \
      device T* y [[buffer(BUF_Y)]], constant GatherParams& p [[buffer(BUF_PARAMS)]],                \
      const device int* lhs [[buffer(BUF_LHS)]], const device int* rhs [[buffer(BUF_RHS)]],           \
      const device int* order [[buffer(BUF_ORDER)]], uint3 tgid [[threadgroup_position_in_grid]],     \
      uint simd_gid [[simdgroup_index_in_threadgroup]], uint lane [[thread_index_in_simdgroup]]

// One expert's slice of the stacked W: packed codes, scales, biases (the same element counts for
// both layouts: N * K codes, N * K / G groups).
template <typename T, typename F>
struct ExpertW {
  const device uint8_t* wq;
  const device typename F::scale_t* scales;
  const device T* biases;
};

template <typename T, typename F>
inline ExpertW<T, F> expert_w(const device uint8_t* wq, const device typename F::scale_t* scales,
                              const device T* biases, uint N, uint K, uint e) {
  const uint codes = N * K;
  return ExpertW<T, F>{wq + e * (codes / 8 * F::BITS), scales + e * (codes / F::G),
                       F::HAS_BIAS ? biases + e * (codes / F::G) : biases};
}

// The expert of the pair at position i of the order.
inline uint expert_at(const device int* rhs, const device int* order, uint i) { return uint(rhs[order[i]]); }

template <typename T, typename F>
[[kernel]] void gather_qmv(GATHER_ARGS) {
  const uint i = tgid.y;
  const uint e = expert_at(rhs, order, i);
  if (i > 0 && expert_at(rhs, order, i - 1) == e) return;  // not the first pair of its run
  uint end = i + 1;
  while (end < p.pairs && expert_at(rhs, order, end) == e) ++end;
  const ExpertW<T, F> w = expert_w<T, F>(wq, scales, biases, p.N, p.K, e);
  const GatherRows rows{lhs, order, p.M, i * p.M, end * p.M};
  for (uint m0 = rows.lo; m0 < rows.hi; m0 += GATHER_ROWS)
    qmm_small_impl<T, F, GATHER_ROWS>(w.wq, w.scales, w.biases, x, y, p.N, p.K, rows, tgid.x, m0, simd_gid, lane);
}

template <typename T, typename F, bool transpose>
[[kernel]] void gather_qmm_mma(GATHER_ARGS, uint tid [[thread_index_in_threadgroup]]) {
  constexpr int BM = 32;
  threadgroup T xs[BM * mma_tile_ld(sizeof(T))];
  threadgroup float ws[MMA_BN * MMA_LDW];
  const uint M = p.M, qlen = transpose ? p.K : p.N;  // length of a packed row
  const uint tile_end = min((tgid.y + 1) * BM, p.pairs * M);
  // Each run of the tile's rows (whole pairs; a run may start or end outside the tile).
  for (uint lo = tgid.y * BM; lo < tile_end;) {
    const uint e = expert_at(rhs, order, lo / M);
    uint hi = (lo / M + 1) * M;
    while (hi < tile_end && expert_at(rhs, order, hi / M) == e) hi += M;
    const ExpertW<T, F> w = expert_w<T, F>(wq, scales, biases, p.N, p.K, e);
    const QuantWLoader<T, F, transpose> wl{w.wq, w.scales, w.biases, transpose ? p.N : p.K, qlen * F::BITS / 8,
                                           qlen / F::G};
    mma_tile<T, BM>(wl, x, y, GatherRows{lhs, order, M, lo, min(hi, tile_end)}, p.N, p.K, xs, ws, tgid.xy, tid,
                    simd_gid, lane);
    lo = min(hi, tile_end);
  }
}
