// Row maps: which rows of x a tile reads and which rows of y it writes, for the kernels that
// compute several rows of x at once (metal/quant_qmm_small.h, metal/mma_tile.h). A tile's rows
// are numbered r = m0, m0 + 1, ...; a map says whether row r exists (`live`), the row of x it
// reads and the row of y it writes.
//   DenseRows : x [M, K], y [M, N], row r is row r of both (qmm, gguf_qmm).
//   GatherRows: gather_qmm (metal/quant_gather.h); rows r = i * M + m run over the pairs in the
//               order `order` (pair order[i], its row m), live in [lo, hi) (one expert's run).
#pragma once

#include <metal_stdlib>

using namespace metal;

struct DenseRows {
  uint M;
  bool live(uint r) const { return r < M; }
  uint x_row(uint r) const { return r; }
  uint y_row(uint r) const { return r; }
};

struct GatherRows {
  const device int* lhs;    // x batch of each pair
  const device int* order;  // the pairs, those of one expert adjacent
  uint M;                   // rows of x per pair
  uint lo, hi;              // the live rows
  bool live(uint r) const { return r >= lo && r < hi; }
  uint x_row(uint r) const { return uint(lhs[order[r / M]]) * M + r % M; }
  uint y_row(uint r) const { return uint(order[r / M]) * M + r % M; }
};
