#include "validate.h"

#include <c10/util/Exception.h>

#include <algorithm>
#include <limits>
#include <optional>
#include <string>
#include <vector>

namespace torch_qmm {

namespace {
// The largest element count or index an int64 holds.
constexpr int64_t kMaxIndex = std::numeric_limits<int64_t>::max();

// "one of 2, 3, 4" or, for a single choice, "4".
std::string choices(const IntChoices& c) { return c.size == 1 ? c.join() : "one of " + c.join(); }

// v <= limit where v is a concrete size; true for a symbolic one (torch.export, dynamic shapes):
// a comparison would put a guard on it that an unbounded dimension cannot satisfy, and the same
// check runs again on the concrete sizes of every real call.
bool at_most(const c10::SymInt& v, int64_t limit) {
  const std::optional<int64_t> n = v.maybe_as_int();
  return !n || *n <= limit;
}

const char* scale_code_name(ScaleKind s) { return s == ScaleKind::kE8M0 ? "e8m0" : "e4m3"; }

// Scales: the float dtype of the weights (affine) or uint8 codes (fp modes).
void check_scales_dtype(const char* op, const FormatSpec& f, const at::Tensor& scales) {
  if (f.scale == ScaleKind::kFloat) {
    check_float_dtype(op, "scales", scales);
    return;
  }
  TORCH_CHECK_TYPE(scales.scalar_type() == at::kByte, op, ": argument 'scales' must be uint8 (", scale_code_name(f.scale),
                   " scale codes) for mode '", f.name, "', got ", scales.scalar_type());
}

void check_biases_presence(const char* op, const FormatSpec& f, const std::optional<at::Tensor>& biases) {
  if (f.has_biases) {
    TORCH_CHECK_VALUE(biases.has_value(), op, ": argument 'biases' is required for mode '", f.name, "', got None");
  } else {
    TORCH_CHECK_VALUE(!biases.has_value(), op, ": argument 'biases' must be None for mode '", f.name,
                      "' (it has no biases), got a tensor of shape ", biases->sym_sizes());
  }
}
}  // namespace

const FormatSpec& check_mode(const char* op, std::string_view mode) {
  const FormatSpec* f = find_format(mode);
  TORCH_CHECK_VALUE(f != nullptr, op, ": argument 'mode' must be one of ", format_names(), ", got '",
                    std::string(mode), "'");
  return *f;
}

const FormatSpec& check_int8_activations_mode(const char* op, std::string_view mode) {
  const FormatSpec& f = check_mode(op, mode);
  TORCH_CHECK_VALUE(f.mode == Mode::kAffine, op, ": argument 'mode' must be 'affine' (int8 activations are ",
                    "implemented for the affine format), got '", std::string(mode), "'");
  return f;
}

void check_bits_and_group_size(const char* op, const FormatSpec& f, int64_t bits, int64_t group_size) {
  TORCH_CHECK_VALUE(f.bits.contains(bits), op, ": argument 'bits' must be ", choices(f.bits), ", got ", bits,
                    " (mode '", f.name, "')");
  TORCH_CHECK_VALUE(f.group_sizes.contains(group_size), op, ": argument 'group_size' must be ",
                    choices(f.group_sizes), ", got ", group_size, " (mode '", f.name, "')");
}

void check_float_dtype(const char* op, const char* arg, const at::Tensor& t) {
  const auto d = t.scalar_type();
  TORCH_CHECK_TYPE(d == at::kFloat || d == at::kHalf || d == at::kBFloat16, op, ": argument '", arg,
                   "' must be float32, float16 or bfloat16, got ", d);
}

namespace {
// check_packed_sym for wq [rows, words] (batched=false) or [..., rows, words] with scales and
// biases of the same leading (batch) dimensions (batched=true: gather_qmm's stacked matrices).
SymPackedShape check_packed_impl(const char* op, const FormatSpec& f, const at::Tensor& wq, const at::Tensor& scales,
                                 const std::optional<at::Tensor>& biases, int64_t bits, int64_t group_size,
                                 bool batched) {
  // The packed weights are argument 'wq' of qmm / dequantize and 'w' of gather_qmm (MLX's names).
  const char* wn = batched ? "w" : "wq";
  check_bits_and_group_size(op, f, bits, group_size);
  check_biases_presence(op, f, biases);
  TORCH_CHECK_TYPE(wq.scalar_type() == at::kUInt32, op,
                   ": argument '", wn, "' must be uint32 (packed weights), got ", wq.scalar_type(),
                   " (an int32 tensor holding the same bits can be passed as ", wn, ".view(torch.uint32))");
  if (batched) {
    TORCH_CHECK_VALUE(wq.dim() >= 2, op,
                      ": argument 'w' must have at least 2 dimensions [..., rows, cols*bits/32], got shape ",
                      wq.sym_sizes());
  } else {
    TORCH_CHECK_VALUE(wq.dim() == 2, op, ": argument 'wq' must be 2-D [rows, cols*bits/32], got shape ",
                      wq.sym_sizes());
  }
  check_scales_dtype(op, f, scales);
  if (biases) {
    TORCH_CHECK_TYPE(biases->scalar_type() == scales.scalar_type(), op,
                     ": argument 'biases' must have the dtype of 'scales' (", scales.scalar_type(), "), got ",
                     biases->scalar_type());
  }
  const c10::SymInt rows = wq.sym_size(-2);
  const c10::SymInt words = wq.sym_size(-1);
  // cols = words * 32 / bits must be a number of weights int64 can index (a stride-0 expanded wq
  // can claim any size without holding it).
  TORCH_CHECK_VALUE(at_most(words, kMaxIndex / 32) && at_most(wq.sym_numel(), kMaxIndex / 32), op, ": argument '", wn, "' of shape ",
                    wq.sym_sizes(), " holds more weights than int64 can index");
  const c10::SymInt cols = words * 32 / bits;
  TORCH_CHECK_VALUE(words * 32 % bits == 0 && cols % group_size == 0, op, ": argument '", wn, "' has ", words,
                    " words per row, which is not a whole number of groups of ", group_size, " ", bits,
                    "-bit values");
  std::vector<c10::SymInt> expected(wq.sym_sizes().begin(), wq.sym_sizes().end() - 2);
  expected.push_back(rows);
  expected.push_back(cols / group_size);
  TORCH_CHECK_VALUE(scales.sym_sizes() == c10::SymIntArrayRef(expected), op, ": argument 'scales' must have shape ",
                    c10::SymIntArrayRef(expected), " for ", wn, " of shape ", wq.sym_sizes(), " with bits=", bits,
                    " and group_size=", group_size, ", got ", scales.sym_sizes());
  if (biases) {
    TORCH_CHECK_VALUE(biases->sym_sizes() == scales.sym_sizes(), op, ": argument 'biases' must have shape ",
                      scales.sym_sizes(), " (the shape of 'scales'), got ", biases->sym_sizes());
    TORCH_CHECK_VALUE(wq.device() == scales.device() && wq.device() == biases->device(), op,
                      ": '", wn, "', 'scales' and 'biases' must be on one device, got ", wq.device(), ", ", scales.device(),
                      ", ", biases->device());
  } else {
    TORCH_CHECK_VALUE(wq.device() == scales.device(), op, ": '", wn, "' and 'scales' must be on one device, got ",
                      wq.device(), ", ", scales.device());
  }
  return {rows, cols};
}
}  // namespace

SymPackedShape check_packed_sym(const char* op, const FormatSpec& f, const at::Tensor& wq, const at::Tensor& scales,
                                const std::optional<at::Tensor>& biases, int64_t bits, int64_t group_size) {
  return check_packed_impl(op, f, wq, scales, biases, bits, group_size, false);
}

PackedShape check_packed(const char* op, const FormatSpec& f, const at::Tensor& wq, const at::Tensor& scales,
                         const std::optional<at::Tensor>& biases, int64_t bits, int64_t group_size) {
  const SymPackedShape s = check_packed_sym(op, f, wq, scales, biases, bits, group_size);
  return {s.rows.expect_int(), s.cols.expect_int()};
}

at::ScalarType check_dequantize_dtype(const char* op, const FormatSpec& f, const at::Tensor& scales,
                                      std::optional<at::ScalarType> dtype) {
  if (!dtype) return f.scale == ScaleKind::kFloat ? scales.scalar_type() : at::kBFloat16;
  const auto d = *dtype;
  TORCH_CHECK_TYPE(d == at::kFloat || d == at::kHalf || d == at::kBFloat16, op,
                   ": argument 'dtype' must be float32, float16 or bfloat16, got ", d);
  return d;
}

std::pair<c10::SymInt, c10::SymInt> check_quantize_sym(const FormatSpec& f, const at::Tensor& w, int64_t bits,
                                                       int64_t group_size) {
  const char* op = "quantize";
  check_bits_and_group_size(op, f, bits, group_size);
  check_float_dtype(op, "w", w);
  // As mlx.core.quantize: a matrix (or a stack of them), not a vector.
  TORCH_CHECK_VALUE(w.dim() >= 2, op, ": argument 'w' must have at least 2 dimensions [..., rows, K], got shape ",
                    w.sym_sizes());
  const c10::SymInt K = w.sym_size(-1);
  TORCH_CHECK_VALUE(K % group_size == 0, op, ": the last dimension of 'w' (K=", K,
                    ") must be a multiple of group_size=", group_size);
  TORCH_CHECK_VALUE(at_most(K, kMaxIndex / 8), op, ": the last dimension of 'w' (K=", K,
                    ") is too large to pack: K*bits must fit in int64");
  return {K == 0 ? c10::SymInt(0) : w.sym_numel() / K, K};
}

std::pair<int64_t, int64_t> check_quantize(const FormatSpec& f, const at::Tensor& w, int64_t bits,
                                           int64_t group_size) {
  const auto [rows, K] = check_quantize_sym(f, w, bits, group_size);
  return {rows.expect_int(), K.expect_int()};
}

void check_quantize_finite(bool all_finite) {
  TORCH_CHECK_VALUE(all_finite, "quantize: argument 'w' contains NaN or Inf; quantization needs finite ",
                    "weights (replace or clamp them first, e.g. torch.nan_to_num)");
}

void check_quantize_range(bool ranges_finite) {
  TORCH_CHECK_VALUE(ranges_finite, "quantize: argument 'w' has a group whose range max - min exceeds ",
                    "the float32 maximum 3.4028235e+38 (its affine scale would be Inf); scale or clamp the weights first");
}

namespace {
// x against the checked matrix w: dtype, dimensions ([..., K]; gather_qmm: [..., M, K]), device,
// last dimension. Returns (N, K).
std::pair<c10::SymInt, c10::SymInt> check_x_sym(const char* op, const at::Tensor& x, const at::Tensor& wq,
                                                const at::Tensor& scales, const FormatSpec& f,
                                                const SymPackedShape& w, int64_t bits, bool transpose,
                                                bool matrices) {
  check_float_dtype(op, "x", x);
  if (f.scale == ScaleKind::kFloat) {
    TORCH_CHECK_TYPE(x.scalar_type() == scales.scalar_type(), op, ": argument 'x' must have the dtype of ",
                     "'scales' and 'biases' (", scales.scalar_type(), "), got ", x.scalar_type());
  }
  if (matrices) {
    TORCH_CHECK_VALUE(x.dim() >= 2, op, ": argument 'x' must have at least 2 dimensions [..., M, K], got shape ",
                      x.sym_sizes());
  } else {
    TORCH_CHECK_VALUE(x.dim() >= 1, op, ": argument 'x' must have at least 1 dimension [..., K], got a scalar");
  }
  TORCH_CHECK_VALUE(x.device() == wq.device(), op, ": argument 'x' is on ", x.device(),
                    " but the packed weights are on ", wq.device());
  // transpose=True: W [N, K] stored row by row, quantized along K.
  // transpose=False: W [K, N] quantized along N (MLX's qvm layout).
  const c10::SymInt K = transpose ? w.cols : w.rows;
  const c10::SymInt N = transpose ? w.rows : w.cols;
  TORCH_CHECK_VALUE(x.sym_size(-1) == K, op, ": argument 'x' must have last dimension K=", K,
                    " (from ", matrices ? "w" : "wq", " of shape ", wq.sym_sizes(), ", bits=", bits, ", transpose=",
                    transpose ? "True" : "False", "), got x of shape ", x.sym_sizes());
  return {N, K};
}
}  // namespace

std::pair<c10::SymInt, c10::SymInt> check_qmm_sym(const at::Tensor& x, const at::Tensor& wq, const at::Tensor& scales,
                                                  const std::optional<at::Tensor>& biases, const FormatSpec& f,
                                                  int64_t bits, int64_t group_size, bool transpose) {
  const char* op = "qmm";
  const SymPackedShape w = check_packed_sym(op, f, wq, scales, biases, bits, group_size);
  return check_x_sym(op, x, wq, scales, f, w, bits, transpose, false);
}

std::pair<int64_t, int64_t> check_qmm(const at::Tensor& x, const at::Tensor& wq, const at::Tensor& scales,
                                      const std::optional<at::Tensor>& biases, const FormatSpec& f, int64_t bits,
                                      int64_t group_size, bool transpose) {
  const auto [N, K] = check_qmm_sym(x, wq, scales, biases, f, bits, group_size, transpose);
  return {N.expect_int(), K.expect_int()};
}

namespace {
c10::SymInt product(c10::SymIntArrayRef dims) {
  c10::SymInt n = 1;
  for (const auto& d : dims) n = n * d;
  return n;
}

// The shape of lhs_indices / rhs_indices, or for None the batch shape of x / wq (MLX's default:
// an arange over those matrices).
c10::SymIntArrayRef index_shape(const char* op, const char* arg, const std::optional<at::Tensor>& idx,
                                const at::Tensor& target, const at::Tensor& x) {
  if (!idx) return target.sym_sizes().slice(0, target.dim() - 2);
  const auto d = idx->scalar_type();
  TORCH_CHECK_TYPE(d == at::kInt || d == at::kLong || d == at::kUInt32, op, ": argument '", arg,
                   "' must be int32, int64 or uint32, got ", d);
  TORCH_CHECK_VALUE(idx->device() == x.device(), op, ": argument '", arg, "' is on ", idx->device(),
                    " but 'x' is on ", x.device());
  return idx->sym_sizes();
}

std::string index_desc(const char* arg, const std::optional<at::Tensor>& idx, const char* target) {
  return std::string("'") + arg + "' (" + (idx ? "" : std::string("None: the batch shape of '") + target + "', ");
}
}  // namespace

SymGatherShape check_gather_qmm_sym(const at::Tensor& x, const at::Tensor& wq, const at::Tensor& scales,
                                    const std::optional<at::Tensor>& biases,
                                    const std::optional<at::Tensor>& lhs_indices,
                                    const std::optional<at::Tensor>& rhs_indices, const FormatSpec& f, int64_t bits,
                                    int64_t group_size, bool transpose) {
  const char* op = "gather_qmm";
  const SymPackedShape w = check_packed_impl(op, f, wq, scales, biases, bits, group_size, true);
  const auto [N, K] = check_x_sym(op, x, wq, scales, f, w, bits, transpose, true);
  const c10::SymIntArrayRef a = index_shape(op, "lhs_indices", lhs_indices, x, x);
  const c10::SymIntArrayRef b = index_shape(op, "rhs_indices", rhs_indices, wq, x);
  // Broadcasting as torch / numpy: trailing dimensions aligned, size 1 stretched.
  const size_t n = std::max(a.size(), b.size());
  std::vector<c10::SymInt> batch(n);
  for (size_t i = 0; i < n; ++i) {
    const c10::SymInt da = i + a.size() < n ? c10::SymInt(1) : a[i + a.size() - n];
    const c10::SymInt db = i + b.size() < n ? c10::SymInt(1) : b[i + b.size() - n];
    if (TORCH_GUARD_SIZE_OBLIVIOUS(da.sym_eq(1))) {
      batch[i] = db;
    } else if (TORCH_GUARD_SIZE_OBLIVIOUS(db.sym_eq(1))) {
      batch[i] = da;
    } else {
      TORCH_CHECK_VALUE(da == db, op, ": the index shapes must broadcast: ",
                        index_desc("lhs_indices", lhs_indices, "x"), "shape ", a, ") and ",
                        index_desc("rhs_indices", rhs_indices, "w"), "shape ", b, ") differ in dimension ",
                        int64_t(i) - int64_t(n), " (", da, " vs ", db, ")");
      batch[i] = da;
    }
  }
  const c10::SymInt M = x.sym_size(-2);
  return {M, N, K, product(x.sym_sizes().slice(0, x.dim() - 2)), product(wq.sym_sizes().slice(0, wq.dim() - 2)),
          std::move(batch)};
}

GatherShape check_gather_qmm(const at::Tensor& x, const at::Tensor& wq, const at::Tensor& scales,
                             const std::optional<at::Tensor>& biases, const std::optional<at::Tensor>& lhs_indices,
                             const std::optional<at::Tensor>& rhs_indices, const FormatSpec& f, int64_t bits,
                             int64_t group_size, bool transpose) {
  const SymGatherShape s =
      check_gather_qmm_sym(x, wq, scales, biases, lhs_indices, rhs_indices, f, bits, group_size, transpose);
  GatherShape g{s.M.expect_int(), s.N.expect_int(), s.K.expect_int(), s.x_batch.expect_int(),
                s.w_batch.expect_int(), {}};
  for (const auto& d : s.batch) g.batch.push_back(d.expect_int());
  return g;
}

void check_gather_index_range(const char* arg, int64_t lo, int64_t hi, int64_t limit, const char* target,
                              at::IntArrayRef shape) {
  TORCH_CHECK_VALUE(lo >= 0 && hi < limit, "gather_qmm: argument '", arg, "' must hold indices in [0, ", limit,
                    ") (the matrices of '", target, "' of shape ", shape, "), got ", lo < 0 ? lo : hi);
}

}  // namespace torch_qmm
