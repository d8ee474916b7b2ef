// CPU gather_qmm (mlx.core.gather_qmm): y[p] = x[lhs[p]] @ W[rhs[p]] for every p of the
// broadcast index shape (csrc/validate.h, check_gather_qmm).
//
// The pairs p are grouped by their matrix of W: a counting sort of rhs, or, with sorted_indices
// and rhs indeed in order, the runs of equal indices as given (the same groups, without the sort).
// Indices out of order are sorted whatever the hint says, so the hint never changes the groups,
// and with them the rows each kernel call gets and the result. Each matrix is then read once per call: the rows of x its pairs use are
// gathered (float32, contiguous) and go through qmm's own route for that many rows
// (qmm_kernels.h, qmm_float: chunked / fused / GEMM by M), and each pair's rows of y are written
// back to their place. Work items are (group, slice of N rows of W) for transpose=True, whole
// groups for transpose=False (W [K, N] is quantized along N); threads take items from a shared
// counter, and the dense kernels run single-threaded inside an item. Where there are fewer items
// than threads the groups run one after another, each on every thread.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/aminmax.h>
#include <ATen/ops/arange.h>
#include <ATen/ops/broadcast_to.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/from_blob.h>
#include <ATen/ops/zeros.h>
#include <torch/library.h>

#include <algorithm>
#include <atomic>
#include <cstring>
#include <optional>
#include <string_view>
#include <vector>

#include "../validate.h"
#include "chunk_driver.h"
#include "qmm_kernels.h"

namespace torch_qmm {
namespace {

// The indices of `idx` (or, for None, an arange over the matrices of `target`) broadcast to
// `batch`, as int64 [P], after checking that every index is in range.
at::Tensor flat_indices(const char* arg, const std::optional<at::Tensor>& idx, const at::Tensor& target,
                        const char* target_name, int64_t count, at::IntArrayRef batch) {
  at::Tensor i;
  if (idx) {
    i = idx->to(at::kLong);
    if (i.numel() > 0) {
      const auto [lo, hi] = at::aminmax(i);
      check_gather_index_range(arg, lo.item<int64_t>(), hi.item<int64_t>(), count, target_name, target.sizes());
    }
  } else {
    i = at::arange(count, target.options().dtype(at::kLong)).reshape(target.sizes().slice(0, target.dim() - 2));
  }
  return at::broadcast_to(i, batch).reshape({-1}).contiguous();
}

// A run of pairs (positions [start, start + count) of `order`) that use matrix `matrix` of W.
struct Group {
  int64_t matrix, start, count;
};

// Groups of the pairs by rhs[p]; order[j] is the pair at sorted position j.
std::vector<Group> group_pairs(const int64_t* rhs, int64_t P, int64_t matrices, bool sorted, std::vector<int64_t>& order) {
  order.resize(P);
  std::vector<Group> groups;
  if (sorted && std::is_sorted(rhs, rhs + P)) {
    for (int64_t p = 0; p < P; ++p) order[p] = p;
    for (int64_t p = 0; p < P; ++p) {
      if (p == 0 || rhs[p] != rhs[p - 1]) groups.push_back({rhs[p], p, 0});
      ++groups.back().count;
    }
    return groups;
  }
  std::vector<int64_t> offset(matrices + 1, 0);
  for (int64_t p = 0; p < P; ++p) ++offset[rhs[p] + 1];
  for (int64_t e = 0; e < matrices; ++e) {  // offset[e + 1]: the count of e, then the end of its run
    if (offset[e + 1] > 0) groups.push_back({e, offset[e], offset[e + 1]});
    offset[e + 1] += offset[e];
  }
  std::vector<int64_t> next(offset.begin(), offset.end() - 1);
  for (int64_t p = 0; p < P; ++p) order[next[rhs[p]]++] = p;
  return groups;
}

at::Tensor gather_qmm_cpu(const at::Tensor& x, const at::Tensor& w, const at::Tensor& scales,
                          const std::optional<at::Tensor>& biases, const std::optional<at::Tensor>& lhs_indices,
                          const std::optional<at::Tensor>& rhs_indices, std::string_view mode, int64_t bits,
                          int64_t group_size, bool transpose, bool sorted_indices) {
  const FormatSpec& f = check_mode("gather_qmm", mode);
  const GatherShape s =
      check_gather_qmm(x, w, scales, biases, lhs_indices, rhs_indices, f, bits, group_size, transpose);
  const at::Tensor lhs = flat_indices("lhs_indices", lhs_indices, x, "x", s.x_batch, s.batch);
  const at::Tensor rhs = flat_indices("rhs_indices", rhs_indices, w, "w", s.w_batch, s.batch);
  const int64_t P = lhs.numel(), M = s.M, N = s.N, K = s.K;
  std::vector<int64_t> out_shape = s.batch;
  out_shape.push_back(M);
  out_shape.push_back(N);
  if (P == 0 || M == 0 || N == 0 || K == 0) return at::zeros(out_shape, x.options());

  std::vector<int64_t> order;
  const std::vector<Group> groups = group_pairs(rhs.data_ptr<int64_t>(), P, s.w_batch, sorted_indices, order);
  // x's rows in sorted pair order: [P * M, K] float32.
  std::vector<int64_t> lhs_sorted(P);
  const int64_t* lp = lhs.data_ptr<int64_t>();
  for (int64_t j = 0; j < P; ++j) lhs_sorted[j] = lp[order[j]];
  const at::Tensor xs = x.reshape({s.x_batch, M, K})
                            .index_select(0, at::from_blob(lhs_sorted.data(), {P}, at::kLong))
                            .to(at::kFloat)
                            .contiguous()
                            .view({P * M, K});
  const at::Tensor wc = w.contiguous(), sc = scales.contiguous();
  const at::Tensor bc = biases ? biases->contiguous() : at::Tensor();
  at::Tensor yout = at::empty({P, M, N}, x.options().dtype(at::kFloat));

  // W's matrix e, rows [r0, r0 + n) of its stored [rows, cols]: the kernel arguments.
  const int64_t rows = w.size(-2), words = w.size(-1), sgroups = scales.size(-1);
  const int64_t row_bytes = words * 4, srow_bytes = sgroups * scales.element_size();
  cpu::QmmArgs base;
  base.mode = f.mode;
  base.dtype = sc.scalar_type();
  base.K = K;
  base.bits = int(bits);
  base.group_size = int(group_size);
  base.x_bf16_terms = cpu::x_bf16_terms_for(x.scalar_type());
  base.avoid_bf16 = cpu::avoid_bf16();
  const auto* wp = static_cast<const uint8_t*>(wc.data_ptr());
  const auto* sp = static_cast<const uint8_t*>(sc.data_ptr());
  const auto* bp = biases ? static_cast<const uint8_t*>(bc.data_ptr()) : nullptr;

  // Slices of N per group (transpose=True): enough items for every thread to take several, in
  // multiples of 128 rows of W (the GEMM kernels' tile height).
  const int64_t threads = at::get_num_threads();
  const int64_t G = int64_t(groups.size());
  int64_t slice = N;
  if (transpose) {
    const int64_t per_group = (4 * threads + G - 1) / G;
    slice = std::min(N, ((N + per_group - 1) / per_group + 127) / 128 * 128);
  }
  const int64_t slices = (N + slice - 1) / slice;
  float* yp = yout.data_ptr<float>();

  // Whether each group's rows of x are in range for the chunk kernels (QmmArgs::x_in_range).
  std::vector<char> x_in_range(G);
  at::parallel_for(0, G, 1, [&](int64_t g0, int64_t g1) {
    for (int64_t g = g0; g < g1; ++g)
      x_in_range[g] = cpu::chunk::x_in_range(xs.const_data_ptr<float>() + groups[g].start * M * K, groups[g].count * M * K);
  });

  auto run_item = [&](int64_t item) {
    const Group& g = groups[item / slices];
    const int64_t n0 = (item % slices) * slice, n = std::min(slice, N - n0);
    cpu::QmmArgs a = base;
    a.M = g.count * M;
    a.N = n;
    const int64_t r0 = g.matrix * rows + (transpose ? n0 : 0);
    a.wq = wp + r0 * row_bytes;
    a.scales = sp + r0 * srow_bytes;
    a.biases = bp ? bp + r0 * srow_bytes : nullptr;
    a.x_in_range = x_in_range[item / slices];
    const at::Tensor yf = cpu::qmm_float(a, xs.narrow(0, g.start * M, a.M), transpose).contiguous();
    const float* src = yf.data_ptr<float>();
    for (int64_t j = 0; j < g.count; ++j)
      for (int64_t m = 0; m < M; ++m)
        std::memcpy(yp + (order[g.start + j] * M + m) * N + n0, src + (j * M + m) * n, sizeof(float) * n);
  };
  const int64_t items = G * slices;
  if (items < threads) {
    for (int64_t i = 0; i < items; ++i) run_item(i);
  } else {
    std::atomic<int64_t> next{0};
    at::parallel_for(0, threads, 1, [&](int64_t, int64_t) {
      for (int64_t i; (i = next.fetch_add(1, std::memory_order_relaxed)) < items;) run_item(i);
    });
  }
  return yout.to(x.scalar_type()).view(out_shape);
}

}  // namespace

TORCH_LIBRARY_IMPL(torch_qmm, CPU, m) { m.impl("gather_qmm", &gather_qmm_cpu); }

}  // namespace torch_qmm
