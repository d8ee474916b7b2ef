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
//
// gather_qmm_int8_activations (the opt-in int8-activation path, transpose=True, affine) takes the
// same groups and items, with qmm_int8_activations' kernels (actq_qmm.h) in place of qmm's route.
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
#include "actq_qmm.h"
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

// One call's operands, checked, with its pairs grouped and x's rows gathered in group order; yout
// receives the kernels' results (run_items).
struct GatherCall {
  std::vector<int64_t> out_shape;
  int64_t M = 0, N = 0, K = 0;
  bool transpose = true, empty = false;
  std::vector<int64_t> order;  // order[j]: the pair at sorted position j
  std::vector<Group> groups;
  at::Tensor xs;               // x's rows in sorted pair order: [P * M, K] float32, contiguous
  at::Tensor wc, sc, bc;       // w, scales, biases, contiguous
  at::Tensor yout;             // [P, M, N] float32
  cpu::QmmArgs base;           // the kernel arguments every item shares
  int64_t rows = 0, row_bytes = 0, srow_bytes = 0;  // of W's stored matrices
};

GatherCall prepare(const at::Tensor& x, const at::Tensor& w, const at::Tensor& scales,
                   const std::optional<at::Tensor>& biases, const std::optional<at::Tensor>& lhs_indices,
                   const std::optional<at::Tensor>& rhs_indices, const FormatSpec& f, int64_t bits,
                   int64_t group_size, bool transpose, bool sorted_indices) {
  const GatherShape s =
      check_gather_qmm(x, w, scales, biases, lhs_indices, rhs_indices, f, bits, group_size, transpose);
  const at::Tensor lhs = flat_indices("lhs_indices", lhs_indices, x, "x", s.x_batch, s.batch);
  const at::Tensor rhs = flat_indices("rhs_indices", rhs_indices, w, "w", s.w_batch, s.batch);
  GatherCall c;
  const int64_t P = lhs.numel();
  c.M = s.M, c.N = s.N, c.K = s.K, c.transpose = transpose;
  c.out_shape = s.batch;
  c.out_shape.push_back(c.M);
  c.out_shape.push_back(c.N);
  c.empty = P == 0 || c.M == 0 || c.N == 0 || c.K == 0;
  if (c.empty) return c;

  c.groups = group_pairs(rhs.data_ptr<int64_t>(), P, s.w_batch, sorted_indices, c.order);
  std::vector<int64_t> lhs_sorted(P);
  const int64_t* lp = lhs.data_ptr<int64_t>();
  for (int64_t j = 0; j < P; ++j) lhs_sorted[j] = lp[c.order[j]];
  c.xs = x.reshape({s.x_batch, c.M, c.K})
             .index_select(0, at::from_blob(lhs_sorted.data(), {P}, at::kLong))
             .to(at::kFloat)
             .contiguous()
             .view({P * c.M, c.K});
  c.wc = w.contiguous();
  c.sc = scales.contiguous();
  if (biases) c.bc = biases->contiguous();
  c.yout = at::empty({P, c.M, c.N}, x.options().dtype(at::kFloat));

  c.rows = w.size(-2);
  c.row_bytes = w.size(-1) * 4;
  c.srow_bytes = scales.size(-1) * scales.element_size();
  cpu::QmmArgs& a = c.base;
  a.mode = f.mode;
  a.dtype = c.sc.scalar_type();
  a.K = c.K;
  a.bits = int(bits);
  a.group_size = int(group_size);
  a.x_bf16_terms = cpu::x_bf16_terms_for(x.scalar_type());
  a.avoid_bf16 = cpu::avoid_bf16();
  return c;
}

// Runs kernel(group index, args, rows of x) -> y [args.M, args.N] float32 for every work item
// (group, slice of N) and writes each pair's rows of y to their place in c.yout. The args are
// c.base with M, N and W's pointers set for the item's matrix and rows.
template <typename Kernel>
void run_items(GatherCall& c, Kernel&& kernel) {
  const int64_t M = c.M, N = c.N;
  const auto* wp = static_cast<const uint8_t*>(c.wc.data_ptr());
  const auto* sp = static_cast<const uint8_t*>(c.sc.data_ptr());
  const auto* bp = c.bc.defined() ? static_cast<const uint8_t*>(c.bc.data_ptr()) : nullptr;

  // Slices of N per group (transpose=True): enough items for every thread to take several, in
  // multiples of 128 rows of W (the GEMM kernels' tile height). The threads follow the call's
  // work (work_split.h): every pair's rows of x times N x K.
  const int64_t threads = cpu::threads_for_work(c.xs.size(0), N, c.K);
  const int64_t G = int64_t(c.groups.size());
  int64_t slice = N;
  if (c.transpose) {
    const int64_t per_group = (4 * threads + G - 1) / G;
    slice = std::min(N, ((N + per_group - 1) / per_group + 127) / 128 * 128);
  }
  const int64_t slices = (N + slice - 1) / slice;
  float* yp = c.yout.data_ptr<float>();

  auto run_item = [&](int64_t item) {
    const Group& g = c.groups[item / slices];
    const int64_t n0 = (item % slices) * slice, n = std::min(slice, N - n0);
    cpu::QmmArgs a = c.base;
    a.M = g.count * M;
    a.N = n;
    const int64_t r0 = g.matrix * c.rows + (c.transpose ? n0 : 0);
    a.wq = wp + r0 * c.row_bytes;
    a.scales = sp + r0 * c.srow_bytes;
    a.biases = bp ? bp + r0 * c.srow_bytes : nullptr;
    const at::Tensor yf = kernel(item / slices, a, c.xs.narrow(0, g.start * M, a.M)).contiguous();
    const float* src = yf.data_ptr<float>();
    for (int64_t j = 0; j < g.count; ++j)
      for (int64_t m = 0; m < M; ++m)
        std::memcpy(yp + (c.order[g.start + j] * M + m) * N + n0, src + (j * M + m) * n, sizeof(float) * n);
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
}

// The exact kernels: qmm's own route for each group's rows (qmm_kernels.h, qmm_float).
void run_exact(GatherCall& c) {
  // Whether each group's rows of x are in range for the chunk kernels (QmmArgs::x_in_range).
  const int64_t G = int64_t(c.groups.size()), M = c.M, K = c.K;
  std::vector<char> x_in_range(G);
  for (int64_t g = 0; g < G; ++g) {
    const Group& gr = c.groups[g];
    x_in_range[g] = cpu::chunk::x_in_range(c.xs.const_data_ptr<float>() + gr.start * M * K, gr.count * M * K);
  }
  run_items(c, [&](int64_t g, cpu::QmmArgs a, const at::Tensor& xg) {
    a.x_in_range = x_in_range[g];
    return cpu::qmm_float(a, xg, c.transpose);
  });
}

at::Tensor gather_qmm_cpu(const at::Tensor& x, const at::Tensor& w, const at::Tensor& scales,
                          const std::optional<at::Tensor>& biases, const std::optional<at::Tensor>& lhs_indices,
                          const std::optional<at::Tensor>& rhs_indices, std::string_view mode, int64_t bits,
                          int64_t group_size, bool transpose, bool sorted_indices) {
  const FormatSpec& f = check_mode("gather_qmm", mode);
  GatherCall c = prepare(x, w, scales, biases, lhs_indices, rhs_indices, f, bits, group_size, transpose, sorted_indices);
  if (c.empty) return at::zeros(c.out_shape, x.options());
  run_exact(c);
  return c.yout.to(x.scalar_type()).view(c.out_shape);
}

// gather_qmm_int8_activations: the same groups and items, each group's rows of x through
// qmm_int8_activations' kernels (actq_qmm.h) instead of qmm's route, so that every pair's rows
// are quantized and multiplied as that op would (transpose=True, affine). As there, rows of x
// holding Inf or NaN (among those the pairs use) send the call to the exact kernels, and so does
// a result that is not finite (block sums past float32).
at::Tensor gather_qmm_int8x_cpu(const at::Tensor& x, const at::Tensor& w, const at::Tensor& scales,
                                const std::optional<at::Tensor>& biases, const std::optional<at::Tensor>& lhs_indices,
                                const std::optional<at::Tensor>& rhs_indices, std::string_view mode, int64_t bits,
                                int64_t group_size, bool sorted_indices) {
  const FormatSpec& f = check_int8_activations_mode("gather_qmm_int8_activations", mode);
  GatherCall c = prepare(x, w, scales, biases, lhs_indices, rhs_indices, f, bits, group_size, true, sorted_indices);
  if (c.empty) return at::zeros(c.out_shape, x.options());
  bool done = false;
  if (cpu::all_finite(c.xs.const_data_ptr<float>(), c.xs.numel())) {
    run_items(c, [](int64_t, cpu::QmmArgs a, const at::Tensor& xg) {
      a.x = xg.const_data_ptr<float>();
      at::Tensor yf = at::empty({a.M, a.N}, xg.options());
      cpu::actq::qmm_t_int8x(a, yf.data_ptr<float>());
      return yf;
    });
    done = cpu::all_finite(c.yout.data_ptr<float>(), c.yout.numel());
  }
  if (!done) run_exact(c);
  return c.yout.to(x.scalar_type()).view(c.out_shape);
}

}  // namespace

TORCH_LIBRARY_IMPL(torch_qmm, CPU, m) {
  m.impl("gather_qmm", &gather_qmm_cpu);
  m.impl("gather_qmm_int8_activations", &gather_qmm_int8x_cpu);
}

}  // namespace torch_qmm
