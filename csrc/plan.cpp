// The planner and its routing table (see plan.h). Geometry constants come from
// metal/qmm_params.h and metal/gguf_params.h, the headers the kernels include: each is written once.
#include "plan.h"

#include <cstring>
#include <limits>
#include <sstream>
#include <stdexcept>

namespace torch_qmm {
namespace plan {
namespace {

constexpr int64_t kNoLimit = std::numeric_limits<int64_t>::max();

// ---- The routing table -----------------------------------------------------------------------
// One row per route; for an op the first row whose condition holds wins. Thresholds on M are
// written here and nowhere else. None of them has been measured on Apple hardware yet: they
// follow the seed's selector (mt_qmm_for) and MLX's dispatch, adjusted so that every M works.
enum class Cond { kAny, kQmvAligned };
struct Route {
  const char* route;
  Op op;
  int transpose;  // 1 / 0, or -1 when the op has no transpose
  int64_t m_min, m_max;
  Cond cond;
  const char* family;
  const char* variant;
  const char* when;
  const char* why;
};

// clang-format off
const Route kRoutes[] = {
  {"qmv_fast", Op::kQmm, 1, 1, 1, Cond::kQmvAligned, "affine_qmv", "fast",
   "M == 1, N % 8 == 0, K % qmv_block_k(bits) == 0",
   "decode (M = 1) is bound by weight bandwidth: 8 rows per threadgroup, x slice in registers, "
   "no bounds tests in the loop (MLX qmv_fast geometry)"},
  {"qmv_bounded", Op::kQmm, 1, 1, 1, Cond::kAny, "affine_qmv", "bounded",
   "M == 1, any N, any K % group_size == 0",
   "same geometry with row and K-tail checks, for shapes the fast path cannot take"},
  {"qmm_t_bm2", Op::kQmm, 1, 2, 2, Cond::kAny, "affine_qmm_t", "bm2", "M == 2",
   "weights decoded once per K-block, reused for 2 rows of x: W read once, no wasted rows"},
  {"qmm_t_bm4", Op::kQmm, 1, 3, 4, Cond::kAny, "affine_qmm_t", "bm4", "3 <= M <= 4",
   "one pass over W for up to 4 rows of x (seed: bm4 beats MLX 1.5-2.6x at small M)"},
  {"qmm_t_bm8", Op::kQmm, 1, 5, 8, Cond::kAny, "affine_qmm_t", "bm8", "5 <= M <= 8",
   "one pass over W for up to 8 rows; below 9 rows an 8x8 MMA tile would idle most lanes"},
  {"qmm_t_mma16", Op::kQmm, 1, 9, 16, Cond::kAny, "affine_qmm_t", "mma16", "9 <= M <= 16",
   "half-height simdgroup-matrix tile: W dequantized once into threadgroup memory for 16 rows "
   "(seed: mma_m16 beats bm4 at M = 16), half the threads of the 32x32 tile"},
  {"qmm_t_mma32", Op::kQmm, 1, 17, kNoLimit, Cond::kAny, "affine_qmm_t", "mma32", "M >= 17",
   "full 32x32 simdgroup-matrix tile: W read ceil(M/32) times, x ceil(N/32) times"},
  {"qvm_bounded", Op::kQmm, 0, 1, 3, Cond::kAny, "affine_qvm", "bounded", "transpose=False, M <= 3",
   "W [K, N] is streamed row by row per row of x; for 1-3 rows a tile's setup and idle rows "
   "cost more than re-reading W from cache"},
  {"qmm_n_mma32", Op::kQmm, 0, 4, kNoLimit, Cond::kAny, "affine_qmm_n", "mma32", "transpose=False, M >= 4",
   "32x32 simdgroup-matrix tile over W [K, N]: W read ceil(M/32) times"},
  {"dequantize", Op::kDequantize, -1, 0, kNoLimit, Cond::kAny, "affine_dequantize", "rows", "always",
   "elementwise: one decode unit (8 values) per thread"},
  {"quantize", Op::kQuantize, -1, 0, kNoLimit, Cond::kAny, "affine_quantize", "rows", "always",
   "one thread per group: a group's words belong to one thread, so packing needs no atomics"},
  // GGUF K-quants (Q4_K, Q6_K; the type is part of the kernel name, not of the route). W is
  // always [N, K]; K % 256 == 0 is checked before planning, so no K-tail variant is needed.
  {"gguf_qmv", Op::kGgufQmm, -1, 1, 1, Cond::kAny, "gguf_qmv", "", "gguf_qmm, M == 1, any N",
   "decode is bound by the block bytes: 4 W rows per SIMD-group share the lane's x values, "
   "each super-block's bytes fetched once (llama.cpp kernel_mul_mv_q4_K/q6_K interleaving)"},
  {"gguf_qmm_bm2", Op::kGgufQmm, -1, 2, 2, Cond::kAny, "gguf_qmm", "bm2", "gguf_qmm, M == 2",
   "a super-block slice decoded once per lane, reused for 2 rows of x: W read once"},
  {"gguf_qmm_bm4", Op::kGgufQmm, -1, 3, 4, Cond::kAny, "gguf_qmm", "bm4", "gguf_qmm, 3 <= M <= 4",
   "one pass over W for up to 4 rows of x"},
  {"gguf_qmm_bm8", Op::kGgufQmm, -1, 5, 16, Cond::kAny, "gguf_qmm", "bm8", "gguf_qmm, 5 <= M <= 16",
   "one pass over W per 8 rows of x (9..16: two row blocks; below 17 rows a 32-row MMA tile "
   "would idle most of its rows, as for the affine bm8 / mma16 split)"},
  {"gguf_qmm_mma32", Op::kGgufQmm, -1, 17, kNoLimit, Cond::kAny, "gguf_qmm", "mma32", "gguf_qmm, M >= 17",
   "32x32 simdgroup-matrix tile with W dequantized into threadgroup memory (the affine mma32 "
   "tile with a K-quant loader): W read ceil(M/32) times, x ceil(N/32) times"},
};
// clang-format on

uint32_t ceil_div(int64_t a, int64_t b) {
  const int64_t q = (a + b - 1) / b;
  if (q > int64_t(std::numeric_limits<uint32_t>::max())) throw std::invalid_argument("torch_qmm plan: grid too large");
  return uint32_t(q);
}

uint32_t u32(int64_t v) {
  if (v < 0 || v > int64_t(std::numeric_limits<uint32_t>::max()))
    throw std::invalid_argument("torch_qmm plan: dimension does not fit in 32 bits");
  return uint32_t(v);
}

// The kernels index x, y and W with 32-bit unsigned arithmetic (e.g. y[m * N + n], w[row * K + c]
// in metal/*.h): every element count of an operand must fit, or indices silently wrap.
void check_u32_indices(const Problem& p) {
  constexpr int64_t kMax = int64_t(std::numeric_limits<uint32_t>::max());
  auto fits = [&](int64_t a, int64_t b) { return a == 0 || b <= kMax / a; };
  const bool has_m = p.op == Op::kQmm || p.op == Op::kGgufQmm;
  if (!fits(p.N, p.K) || (has_m && (!fits(p.M, p.K) || !fits(p.M, p.N)))) {
    std::ostringstream o;
    o << "torch_qmm plan: operands too large for the Metal kernels' 32-bit indices (M=" << p.M << ", N=" << p.N
      << ", K=" << p.K << "; M*K, M*N and N*K must each be at most 2^32 - 1): split the problem";
    throw std::invalid_argument(o.str());
  }
}

bool holds(const Route& r, const Problem& p) {
  if (r.op != p.op) return false;
  if (r.transpose >= 0 && r.transpose != int(p.transpose)) return false;
  if ((p.op == Op::kQmm || p.op == Op::kGgufQmm) && (p.M < r.m_min || p.M > r.m_max)) return false;
  if (r.cond == Cond::kQmvAligned)
    // Must match the K step and rows per threadgroup of affine_qmv_fast (metal/affine_qmv.h).
    return p.N % QMV_ROWS_PER_TG == 0 && p.K % qmv_block_k(p.bits) == 0;
  return true;
}

std::vector<Binding> bindings(Op op) {
  switch (op) {
    case Op::kQmm:
      return {{BUF_WQ, Operand::kWq, 0}, {BUF_SCALES, Operand::kScales, 0}, {BUF_BIASES, Operand::kBiases, 0},
              {BUF_DENSE, Operand::kX, 0}, {BUF_Y, Operand::kY, 0}};
    case Op::kDequantize:
    case Op::kQuantize:
      return {{BUF_WQ, Operand::kWq, 0}, {BUF_SCALES, Operand::kScales, 0}, {BUF_BIASES, Operand::kBiases, 0},
              {BUF_DENSE, Operand::kW, 0}};
    case Op::kGgufQmm:
      return {{GGUF_BUF_BLOCKS, Operand::kBlocks, 0}, {GGUF_BUF_X, Operand::kX, 0}, {GGUF_BUF_Y, Operand::kY, 0}};
  }
  return {};
}

// Geometry of each route. Must match the thread mapping in the kernel's header.
void geometry(const std::string& route, const Problem& p, Launch& l) {
  const int64_t M = p.M, N = p.N, K = p.K;
  if (route == "qmv_fast" || route == "qmv_bounded") {  // metal/affine_qmv.h
    l.threadgroups = {ceil_div(N, QMV_ROWS_PER_TG), 1, 1};
    l.threads_per_threadgroup = {QMV_SIMDGROUPS * SIMD_WIDTH, 1, 1};
    l.tile_rows = 1;
    l.tile_cols = QMV_ROWS_PER_TG;
  } else if (route == "qmm_t_bm2" || route == "qmm_t_bm4" || route == "qmm_t_bm8") {  // affine_qmm_small.h
    const int rows = route == "qmm_t_bm2" ? 2 : route == "qmm_t_bm4" ? 4 : 8;
    l.threadgroups = {ceil_div(N, BM_COLS_PER_TG), ceil_div(M, rows), 1};
    l.threads_per_threadgroup = {BM_SIMDGROUPS * SIMD_WIDTH, 1, 1};
    l.tile_rows = uint32_t(rows);
    l.tile_cols = BM_COLS_PER_TG;
  } else if (route == "qmm_t_mma16" || route == "qmm_t_mma32" || route == "qmm_n_mma32") {  // affine_mma.h
    const int bm = route == "qmm_t_mma16" ? 16 : 32;
    l.threadgroups = {ceil_div(N, MMA_BN), ceil_div(M, bm), 1};
    l.threads_per_threadgroup = {uint32_t(mma_threads(bm)), 1, 1};
    l.tile_rows = uint32_t(bm);
    l.tile_cols = MMA_BN;
  } else if (route == "qvm_bounded") {  // affine_qvm.h
    l.threadgroups = {ceil_div(N, QVM_COLS_PER_TG), ceil_div(M, 1), 1};
    l.threads_per_threadgroup = {QVM_SIMDGROUPS * SIMD_WIDTH, 1, 1};
    l.tile_rows = 1;
    l.tile_cols = QVM_COLS_PER_TG;
  } else if (route == "dequantize") {  // affine_quant.h
    l.threadgroups = {ceil_div(N * (K / DEQ_VALUES_PER_THREAD), DEQ_THREADS_PER_TG), 1, 1};
    l.threads_per_threadgroup = {DEQ_THREADS_PER_TG, 1, 1};
  } else if (route == "quantize") {
    l.threadgroups = {ceil_div(N * (K / p.group_size), QUANT_THREADS_PER_TG), 1, 1};
    l.threads_per_threadgroup = {QUANT_THREADS_PER_TG, 1, 1};
  } else if (route == "gguf_qmm_mma32") {  // metal/gguf_mma.h: the affine tile's geometry
    l.threadgroups = {ceil_div(N, MMA_BN), ceil_div(M, 32), 1};
    l.threads_per_threadgroup = {uint32_t(mma_threads(32)), 1, 1};
    l.tile_rows = 32;
    l.tile_cols = MMA_BN;
  } else if (route == "gguf_qmv" || route == "gguf_qmm_bm2" || route == "gguf_qmm_bm4" ||
             route == "gguf_qmm_bm8") {  // metal/gguf_qmm.h
    const int rows = route == "gguf_qmv" ? 1 : route == "gguf_qmm_bm2" ? 2 : route == "gguf_qmm_bm4" ? 4 : 8;
    l.threadgroups = {ceil_div(N, GGUF_COLS_PER_TG), ceil_div(M, rows), 1};
    l.threads_per_threadgroup = {GGUF_SIMDGROUPS * SIMD_WIDTH, 1, 1};
    l.tile_rows = uint32_t(rows);
    l.tile_cols = GGUF_COLS_PER_TG;
  } else {
    throw std::logic_error("torch_qmm plan: route without geometry: " + route);
  }
}

// The words of a constant-argument struct (Launch::params).
template <typename P>
std::vector<uint32_t> param_words(const P& params) {
  static_assert(sizeof(P) % sizeof(uint32_t) == 0, "constant-argument structs are made of 32-bit fields");
  std::vector<uint32_t> words(sizeof(P) / sizeof(uint32_t));
  std::memcpy(words.data(), &params, sizeof(P));
  return words;
}

const char* op_name(Op op) {
  switch (op) {
    case Op::kQuantize:
      return "quantize";
    case Op::kDequantize:
      return "dequantize";
    case Op::kQmm:
      return "qmm";
    case Op::kGgufQmm:
      return "gguf_qmm";
  }
  return "?";
}

void append_json_string(std::ostringstream& o, const char* s) {
  o << '"';
  for (const char* c = s; *c; ++c) {
    if (*c == '"' || *c == '\\') o << '\\';
    o << *c;
  }
  o << '"';
}

}  // namespace

const char* dtype_name(DType dtype) {
  switch (dtype) {
    case DType::kFloat32:
      return "float";
    case DType::kFloat16:
      return "float16_t";
    case DType::kBFloat16:
      return "bfloat16_t";
  }
  return "?";
}

std::string kernel_name(const char* family, const char* variant, DType dtype, int group_size, int bits) {
  return std::string(family) + "_" + variant + "_" + dtype_name(dtype) + "_gs_" + std::to_string(group_size) +
         "_b_" + std::to_string(bits);
}

const char* ggml_type_name(int ggml_type) {
  switch (ggml_type) {
    case gguf::kTypeQ4_K:
      return "q4_K";
    case gguf::kTypeQ6_K:
      return "q6_K";
    default:
      throw std::invalid_argument("torch_qmm plan: no GGUF kernels for ggml_type " + std::to_string(ggml_type));
  }
}

std::string gguf_kernel_name(const char* family, const char* variant, int ggml_type, DType dtype) {
  std::string name = std::string(family) + "_" + ggml_type_name(ggml_type);
  if (*variant) name += std::string("_") + variant;
  return name + "_" + dtype_name(dtype);
}

const char* operand_name(Operand operand) {
  switch (operand) {
    case Operand::kX:
      return "x";
    case Operand::kWq:
      return "wq";
    case Operand::kScales:
      return "scales";
    case Operand::kBiases:
      return "biases";
    case Operand::kY:
      return "y";
    case Operand::kW:
      return "w";
    case Operand::kBlocks:
      return "blocks";
  }
  return "?";
}

const std::vector<RouteInfo>& routes() {
  static const std::vector<RouteInfo> table = [] {
    std::vector<RouteInfo> t;
    for (const Route& r : kRoutes) t.push_back({r.route, op_name(r.op), r.family, r.variant, r.when, r.why});
    return t;
  }();
  return table;
}

std::vector<Launch> make_plan(const Problem& p) {
  const bool has_m = p.op == Op::kQmm || p.op == Op::kGgufQmm;
  const bool empty = has_m ? (p.M == 0 || p.N == 0 || p.K == 0) : (p.N == 0 || p.K == 0);
  if (empty) return {};
  check_u32_indices(p);
  for (const Route& r : kRoutes) {
    if (!holds(r, p)) continue;
    Launch l;
    l.route = r.route;
    l.buffers = bindings(p.op);
    if (p.op == Op::kGgufQmm) {
      l.kernel = gguf_kernel_name(r.family, r.variant, p.ggml_type, p.dtype);
      l.params_index = GGUF_BUF_PARAMS;
      // Must match metal/gguf_qmm.h: whole super-blocks only (K % 256 == 0, checked before).
      if (p.K % gguf::kQK_K != 0) throw std::invalid_argument("torch_qmm plan: gguf_qmm needs K % 256 == 0");
      l.params = param_words(GGUFParams{u32(p.M), u32(p.N), u32(p.K), u32(p.K / gguf::kQK_K)});
    } else {
      l.kernel = kernel_name(r.family, r.variant, p.dtype, p.group_size, p.bits);
      l.params_index = BUF_PARAMS;
      l.params = param_words(AffineParams{p.op == Op::kQmm ? u32(p.M) : 0u, u32(p.N), u32(p.K), 0u});
    }
    geometry(l.route, p, l);
    return {l};
  }
  throw std::logic_error("torch_qmm plan: no route for this problem (the routing table has a gap)");
}

std::string to_json(const std::vector<Launch>& launches) {
  std::ostringstream o;
  o << "[";
  for (size_t i = 0; i < launches.size(); ++i) {
    const Launch& l = launches[i];
    o << (i ? ", " : "") << "{\"kernel\": ";
    append_json_string(o, l.kernel.c_str());
    o << ", \"route\": ";
    append_json_string(o, l.route.c_str());
    o << ", \"threadgroups\": [" << l.threadgroups[0] << ", " << l.threadgroups[1] << ", " << l.threadgroups[2]
      << "], \"threads_per_threadgroup\": [" << l.threads_per_threadgroup[0] << ", " << l.threads_per_threadgroup[1]
      << ", " << l.threads_per_threadgroup[2] << "], \"buffers\": [";
    for (size_t b = 0; b < l.buffers.size(); ++b) {
      o << (b ? ", " : "") << "{\"index\": " << l.buffers[b].index << ", \"operand\": \""
        << operand_name(l.buffers[b].operand) << "\", \"byte_offset\": " << l.buffers[b].byte_offset << "}";
    }
    o << "], \"tile\": [" << l.tile_rows << ", " << l.tile_cols << "]";
    o << ", \"bytes\": [{\"index\": " << l.params_index << ", \"u32\": [";
    for (size_t w = 0; w < l.params.size(); ++w) o << (w ? ", " : "") << l.params[w];
    o << "]}]}";
  }
  o << "]";
  return o.str();
}

std::string routes_json() {
  std::ostringstream o;
  o << "[";
  bool first = true;
  for (const RouteInfo& r : routes()) {
    o << (first ? "" : ", ") << "{\"route\": ";
    append_json_string(o, r.route);
    o << ", \"op\": ";
    append_json_string(o, r.op);
    o << ", \"family\": ";
    append_json_string(o, r.family);
    o << ", \"variant\": ";
    append_json_string(o, r.variant);
    o << ", \"when\": ";
    append_json_string(o, r.when);
    o << ", \"why\": ";
    append_json_string(o, r.why);
    o << "}";
    first = false;
  }
  o << "]";
  return o.str();
}

}  // namespace plan
}  // namespace torch_qmm
