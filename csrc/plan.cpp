// The planner and its routing table (see plan.h). Geometry constants come from
// metal/qmm_params.h and metal/gguf_params.h, the headers the kernels include: each is written once.
#include "plan.h"

#include <algorithm>
#include <cstring>
#include <iterator>
#include <limits>
#include <sstream>
#include <stdexcept>

namespace torch_qmm {
namespace plan {
namespace {

constexpr int64_t kNoLimit = std::numeric_limits<int64_t>::max();

const char* op_name(Op op);  // "qmm", "gather_qmm", ... (below)

// Format's first values are the modes (format_of), and the kernels' QuantMode (metal/qmm_params.h)
// names them with the same numbers.
static_assert(int(Format::kAffine) == int(Mode::kAffine) && int(Format::kMxfp4) == int(Mode::kMxfp4) &&
                  int(Format::kNvfp4) == int(Mode::kNvfp4),
              "plan::Format must list the modes first, in Mode order");
static_assert(int(Format::kAffine) == MODE_AFFINE && int(Format::kMxfp4) == MODE_MXFP4 &&
                  int(Format::kNvfp4) == MODE_NVFP4 && int(Format::kMxfp8) == MODE_MXFP8,
              "metal/qmm_params.h QuantMode must number the modes as plan::Format does");

// ---- The routing table -----------------------------------------------------------------------
// One row per route; for an op the first row whose condition holds wins. Thresholds on M are
// written here and nowhere else. None of them has been measured on Apple hardware yet: they
// follow MLX's dispatch, adjusted so that every M works. Geometry constants: metal/qmm_params.h
// (quantized modes) and metal/gguf_params.h (GGUF), the headers the kernels include.
constexpr Geometry kQmv = Geometry::tiled(1, QMV_ROWS_PER_TG, QMV_SIMDGROUPS * SIMD_WIDTH);  // quant_qmv.h
constexpr Geometry bm(uint32_t rows) {  // quant_qmm_small.h
  return Geometry::tiled(rows, BM_COLS_PER_TG, BM_SIMDGROUPS * SIMD_WIDTH);
}
constexpr Geometry mma(uint32_t rows) {  // mma_tile.h
  return Geometry::tiled(rows, MMA_BN, uint32_t(mma_threads(int(rows))));
}
constexpr Geometry kGatherRuns =  // quant_gather.h: the qmm_t_small threadgroup over runs
    Geometry::runs(GATHER_ROWS, BM_COLS_PER_TG, BM_SIMDGROUPS * SIMD_WIDTH);
constexpr Geometry kQvm = Geometry::tiled(1, QVM_COLS_PER_TG, QVM_SIMDGROUPS * SIMD_WIDTH);  // quant_qvm.h
constexpr Geometry gguf_rows(uint32_t rows) {  // gguf_qmm.h
  return Geometry::tiled(rows, GGUF_COLS_PER_TG, GGUF_SIMDGROUPS * SIMD_WIDTH);
}

// clang-format off
const RouteRow kRoutes[] = {
  {"qmv_fast", Op::kQmm, kQuantModes, 1, 1, 1, Cond::kQmvAligned, "qmv_fast", kQmv,
   "M == 1, N % 8 == 0, K % qmv_block_k(bits) == 0",
   "decode (M = 1) is bound by weight bandwidth: 8 rows per threadgroup, x slice in registers, "
   "no bounds tests in the loop (MLX qmv_fast geometry)"},
  {"qmv_bounded", Op::kQmm, kQuantModes, 1, 1, 1, Cond::kAny, "qmv_bounded", kQmv,
   "M == 1, any N, any K % group_size == 0",
   "same geometry with row and K-tail checks, for shapes the fast path cannot take"},
  {"qmm_t_bm2", Op::kQmm, kQuantModes, 1, 2, 2, Cond::kAny, "qmm_t_bm2", bm(2), "M == 2",
   "weights decoded once per K-block, reused for 2 rows of x: W read once, no wasted rows"},
  {"qmm_t_bm4", Op::kQmm, kQuantModes, 1, 3, 4, Cond::kAny, "qmm_t_bm4", bm(4), "3 <= M <= 4",
   "one pass over W for up to 4 rows of x"},
  {"qmm_t_bm8", Op::kQmm, kQuantModes, 1, 5, 8, Cond::kAny, "qmm_t_bm8", bm(8), "5 <= M <= 8",
   "one pass over W for up to 8 rows; below 9 rows an 8x8 MMA tile would idle most lanes"},
  {"qmm_t_mma16", Op::kQmm, kQuantModes, 1, 9, 16, Cond::kAny, "qmm_t_mma16", mma(16), "9 <= M <= 16",
   "half-height simdgroup-matrix tile: W dequantized once into threadgroup memory for 16 rows, "
   "half the threads of the 32x32 tile"},
  {"qmm_t_mma32", Op::kQmm, kQuantModes, 1, 17, kNoLimit, Cond::kAny, "qmm_t_mma32", mma(32), "M >= 17",
   "full 32x32 simdgroup-matrix tile: W read ceil(M/32) times, x ceil(N/32) times"},
  {"qvm_bounded", Op::kQmm, kQuantModes, 0, 1, 3, Cond::kAny, "qvm_bounded", kQvm, "transpose=False, M <= 3",
   "W [K, N] is streamed row by row per row of x; for 1-3 rows a tile's setup and idle rows "
   "cost more than re-reading W from cache"},
  {"qmm_n_mma32", Op::kQmm, kQuantModes, 0, 4, kNoLimit, Cond::kAny, "qmm_n_mma32", mma(32), "transpose=False, M >= 4",
   "32x32 simdgroup-matrix tile over W [K, N]: W read ceil(M/32) times"},
  {"dequantize", Op::kDequantize, kQuantModes, -1, 0, kNoLimit, Cond::kAny, "dequantize_rows",
   Geometry::elementwise(DEQ_VALUES_PER_THREAD, DEQ_THREADS_PER_TG), "always",
   "elementwise: one decode unit (8 values) per thread"},
  {"quantize", Op::kQuantize, kQuantModes, -1, 0, kNoLimit, Cond::kAny, "quantize_rows",
   Geometry::elementwise(0, QUANT_THREADS_PER_TG), "always",
   "one thread per group: a group's words belong to one thread, so packing needs no atomics"},
  // gather_qmm (mixture of experts): W is read per expert, not per pair (metal/quant_gather.h).
  // The executor orders the pairs by expert whatever sorted_indices says (Launch::order), so the
  // tiles' rows are grouped by expert on this route and the next two alike.
  {"gather_qmm_mma32", Op::kGatherQmm, kQuantModes, 1, 1, kNoLimit, Cond::kManyRowsPerExpert, "gather_qmm_mma32",
   mma(32), "gather_qmm, transpose=True, pairs * M >= 4 * experts",
   "prefill: 32-row simdgroup-matrix tiles over the rows ordered by expert, one pass per expert "
   "present in a tile (MLX gather_qmm_rhs): W read about once per tile, where gather_qmv would "
   "leave each expert's whole run to one threadgroup"},
  {"gather_qmv", Op::kGatherQmm, kQuantModes, 1, 1, kNoLimit, Cond::kAny, "gather_qmv", kGatherRuns,
   "gather_qmm, transpose=True, otherwise (decode)",
   "decode: the pairs of one expert run together (sorted on the device when rhs is not): "
   "the threadgroups of a run's first pair read the expert's 8 W rows once for all its rows, "
   "8 rows of x at a time (llama.cpp mul_mv_id's per-expert row lists); the others exit"},
  {"gather_qmm_n_mma32", Op::kGatherQmm, kQuantModes, 0, 1, kNoLimit, Cond::kAny, "gather_qmm_n_mma32", mma(32),
   "gather_qmm, transpose=False",
   "W [K, N] per expert: the 32x32 tile of qmm_n_mma32 over the rows sorted by expert"},
  // GGUF K-quants (the type is part of the kernel name, not of the route). W is always [N, K];
  // K % 256 == 0 is checked before planning, so no K-tail variant is needed.
  {"gguf_qmv", Op::kGgufQmm, kGgufTypes, -1, 1, 1, Cond::kAny, "qmv", gguf_rows(1), "gguf_qmm, M == 1, any N",
   "decode is bound by the block bytes: 4 W rows per SIMD-group share the lane's x values, "
   "each super-block's bytes fetched once (llama.cpp kernel_mul_mv_q4_K/q6_K interleaving)"},
  {"gguf_qmm_bm2", Op::kGgufQmm, kGgufTypes, -1, 2, 2, Cond::kAny, "qmm_bm2", gguf_rows(2), "gguf_qmm, M == 2",
   "a super-block slice decoded once per lane, reused for 2 rows of x: W read once"},
  {"gguf_qmm_bm4", Op::kGgufQmm, kGgufTypes, -1, 3, 4, Cond::kAny, "qmm_bm4", gguf_rows(4), "gguf_qmm, 3 <= M <= 4",
   "one pass over W for up to 4 rows of x"},
  {"gguf_qmm_bm8", Op::kGgufQmm, kGgufTypes, -1, 5, 16, Cond::kAny, "qmm_bm8", gguf_rows(8), "gguf_qmm, 5 <= M <= 16",
   "one pass over W per 8 rows of x (9..16: two row blocks; below 17 rows a 32-row MMA tile "
   "would idle most of its rows, as for the affine bm8 / mma16 split)"},
  {"gguf_qmm_mma32", Op::kGgufQmm, kGgufTypes, -1, 17, kNoLimit, Cond::kAny, "qmm_mma32", mma(32), "gguf_qmm, M >= 17",
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
struct ElementCount {
  const char* operand;  // "W", "x", "y"
  const char* names;    // the product, in the problem's names
  std::vector<int64_t> factors;
};

std::vector<ElementCount> element_counts(const Problem& p) {
  if (p.op == Op::kGatherQmm)  // W [experts * N, K], x [x_batch * M, K], y [pairs * M, N]
    return {{"W", "experts * N * K", {p.experts, p.N, p.K}},
            {"x", "x_batch * M * K", {p.x_batch, p.M, p.K}},
            {"y", "pairs * M * N", {p.pairs, p.M, p.N}}};
  std::vector<ElementCount> counts{{"W", "N * K", {p.N, p.K}}};
  if (p.op == Op::kQmm || p.op == Op::kGgufQmm) {
    counts.push_back({"x", "M * K", {p.M, p.K}});
    counts.push_back({"y", "M * N", {p.M, p.N}});
  }
  return counts;
}

void check_u32_indices(const Problem& p) {
  constexpr uint64_t kMax = std::numeric_limits<uint32_t>::max();
  for (const ElementCount& c : element_counts(p)) {
    uint64_t value = 1;
    bool beyond_u64 = false;  // the product does not even fit in 64 bits
    for (int64_t f : c.factors) {
      const uint64_t u = uint64_t(std::max<int64_t>(f, 0));
      if (u != 0 && value > std::numeric_limits<uint64_t>::max() / u) beyond_u64 = true;
      value *= u;
    }
    if (!beyond_u64 && value <= kMax) continue;
    std::ostringstream o;
    o << "torch_qmm plan: " << op_name(p.op) << "'s " << c.operand << " has " << c.names << " = ";
    for (size_t i = 0; i < c.factors.size(); ++i) o << (i ? " * " : "") << c.factors[i];
    o << " = ";
    if (beyond_u64)
      o << "more than 2^64";
    else
      o << value;
    o << " elements, more than the Metal kernels' 32-bit indices address (2^32 - 1 = " << kMax
      << "): split the problem";
    throw std::invalid_argument(o.str());
  }
}

bool holds(const RouteRow& r, const Problem& p, Format f) {
  if (r.op != p.op || !(r.formats & bit(f))) return false;
  if (r.transpose >= 0 && r.transpose != int(p.transpose)) return false;
  if ((p.op == Op::kQmm || p.op == Op::kGgufQmm || p.op == Op::kGatherQmm) && (p.M < r.m_min || p.M > r.m_max))
    return false;
  if (r.cond == Cond::kQmvAligned)
    // Must match the K step and rows per threadgroup of qmv_fast (metal/quant_qmv.h).
    return p.N % QMV_ROWS_PER_TG == 0 && p.K % qmv_block_k(p.bits) == 0;
  if (r.cond == Cond::kManyRowsPerExpert)
    return p.pairs * p.M >= int64_t(GATHER_MMA_MIN_ROWS_PER_EXPERT) * p.experts;
  return true;
}

// Formats without biases bind no biases buffer (the kernels never read it).
bool has_biases(Mode m) { return m == Mode::kAffine; }

std::vector<Binding> bindings(const Problem& p) {
  std::vector<Binding> b;
  switch (p.op) {
    case Op::kQmm:
    case Op::kGatherQmm:
    case Op::kDequantize:
    case Op::kQuantize:
      b = {{BUF_WQ, Operand::kWq, 0}, {BUF_SCALES, Operand::kScales, 0}};
      if (has_biases(p.mode)) b.push_back({BUF_BIASES, Operand::kBiases, 0});
      if (p.op == Op::kQmm || p.op == Op::kGatherQmm) {
        b.push_back({BUF_DENSE, Operand::kX, 0});
        b.push_back({BUF_Y, Operand::kY, 0});
        if (p.op == Op::kGatherQmm) {
          b.push_back({BUF_LHS, Operand::kLhs, 0});
          b.push_back({BUF_RHS, Operand::kRhs, 0});
          b.push_back({BUF_ORDER, Operand::kOrder, 0});
        }
      } else {
        b.push_back({BUF_DENSE, Operand::kW, 0});
      }
      return b;
    case Op::kGgufQmm:
      return {{GGUF_BUF_BLOCKS, Operand::kBlocks, 0}, {GGUF_BUF_X, Operand::kX, 0}, {GGUF_BUF_Y, Operand::kY, 0}};
  }
  return b;
}

// The grid of a row's geometry for problem p (Geometry in plan.h).
void apply(const Geometry& g, const Problem& p, Launch& l) {
  l.threads_per_threadgroup = {g.threads, 1, 1};
  if (g.kind == Geometry::Kind::kTiled) {
    // gather_qmm tiles the rows of all pairs, taken in the pairs' order.
    const int64_t rows = p.op == Op::kGatherQmm ? p.pairs * p.M : p.M;
    l.threadgroups = {ceil_div(p.N, g.cols), ceil_div(std::max<int64_t>(rows, 1), g.rows), 1};
    l.tile_rows = g.rows;
    l.tile_cols = g.cols;
  } else if (g.kind == Geometry::Kind::kRuns) {
    l.threadgroups = {ceil_div(p.N, g.cols), u32(p.pairs), 1};
    l.tile_rows = g.rows;
    l.tile_cols = g.cols;
  } else {
    const int64_t values = g.cols ? g.cols : p.group_size;
    l.threadgroups = {ceil_div(p.N * (p.K / values), g.threads), 1, 1};
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
    case Op::kGatherQmm:
      return "gather_qmm";
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

const char* format_name(Format f) {
  switch (f) {
    case Format::kAffine:
      return "affine";
    case Format::kMxfp4:
      return "mxfp4";
    case Format::kNvfp4:
      return "nvfp4";
    case Format::kMxfp8:
      return "mxfp8";
    case Format::kQ2_K:
      return "q2_K";
    case Format::kQ3_K:
      return "q3_K";
    case Format::kQ4_K:
      return "q4_K";
    case Format::kQ5_K:
      return "q5_K";
    case Format::kQ6_K:
      return "q6_K";
    case Format::kIQ4_XS:
      return "iq4_XS";
    case Format::kIQ2_XXS:
      return "iq2_XXS";
    case Format::kIQ2_XS:
      return "iq2_XS";
    case Format::kIQ2_S:
      return "iq2_S";
    case Format::kIQ3_XXS:
      return "iq3_XXS";
    case Format::kIQ3_S:
      return "iq3_S";
    case Format::kIQ1_S:
      return "iq1_S";
    case Format::kIQ1_M:
      return "iq1_M";
  }
  return "?";
}

Format format_of(const Problem& p) {
  if (p.op != Op::kGgufQmm) return Format(int(p.mode));  // Format's first values are the modes
  switch (p.ggml_type) {
    case gguf::kTypeQ2_K:
      return Format::kQ2_K;
    case gguf::kTypeQ3_K:
      return Format::kQ3_K;
    case gguf::kTypeQ4_K:
      return Format::kQ4_K;
    case gguf::kTypeQ5_K:
      return Format::kQ5_K;
    case gguf::kTypeQ6_K:
      return Format::kQ6_K;
    case gguf::kTypeIQ4_XS:
      return Format::kIQ4_XS;
    case gguf::kTypeIQ2_XXS:
      return Format::kIQ2_XXS;
    case gguf::kTypeIQ2_XS:
      return Format::kIQ2_XS;
    case gguf::kTypeIQ2_S:
      return Format::kIQ2_S;
    case gguf::kTypeIQ3_XXS:
      return Format::kIQ3_XXS;
    case gguf::kTypeIQ3_S:
      return Format::kIQ3_S;
    case gguf::kTypeIQ1_S:
      return Format::kIQ1_S;
    case gguf::kTypeIQ1_M:
      return Format::kIQ1_M;
    default:
      throw std::invalid_argument("torch_qmm plan: no GGUF kernels for ggml_type " + std::to_string(p.ggml_type));
  }
}

std::string kernel_name(const char* kernel, const Problem& p) {
  const Format f = format_of(p);
  const bool gguf_type = (bit(f) & kGgufTypes) != 0;
  const std::string cell = gguf_type ? std::string(format_name(f))
                                     : "gs_" + std::to_string(p.group_size) + "_b_" + std::to_string(p.bits);
  return std::string(gguf_type ? "gguf" : format_name(f)) + "_" + kernel + "_" + dtype_name(p.dtype) + "_" + cell;
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
    case Operand::kLhs:
      return "lhs";
    case Operand::kRhs:
      return "rhs";
    case Operand::kOrder:
      return "order";
  }
  return "?";
}

const std::vector<RouteRow>& routes() {
  static const std::vector<RouteRow> table(std::begin(kRoutes), std::end(kRoutes));
  return table;
}

std::vector<Launch> make_plan(const Problem& p) {
  const bool has_m = p.op == Op::kQmm || p.op == Op::kGgufQmm || p.op == Op::kGatherQmm;
  const bool empty = has_m ? (p.M == 0 || p.N == 0 || p.K == 0 || (p.op == Op::kGatherQmm && p.pairs == 0))
                           : (p.N == 0 || p.K == 0);
  if (empty) return {};
  check_u32_indices(p);
  const Format f = format_of(p);
  for (const RouteRow& r : kRoutes) {
    if (!holds(r, p, f)) continue;
    Launch l;
    l.route = r.route;
    l.kernel = kernel_name(r.kernel, p);
    l.buffers = bindings(p);
    if (p.op == Op::kGgufQmm) {
      // Must match metal/gguf_qmm.h: whole super-blocks only (K % 256 == 0, checked before).
      if (p.K % gguf::kQK_K != 0) throw std::invalid_argument("torch_qmm plan: gguf_qmm needs K % 256 == 0");
      l.params_index = GGUF_BUF_PARAMS;
      l.params = param_words(GGUFParams{u32(p.M), u32(p.N), u32(p.K), u32(p.K / gguf::kQK_K)});
    } else if (p.op == Op::kGatherQmm) {
      if (p.experts <= 0 || p.x_batch <= 0)
        throw std::invalid_argument("torch_qmm plan: gather_qmm needs at least one expert and one x batch");
      l.params_index = BUF_PARAMS;
      l.params = param_words(GatherParams{u32(p.M), u32(p.N), u32(p.K), u32(p.pairs)});
      l.order = p.sorted ? Launch::Order::kAsGiven : Launch::Order::kByExpert;
    } else {
      l.params_index = BUF_PARAMS;
      l.params = param_words(AffineParams{p.op == Op::kQmm ? u32(p.M) : 0u, u32(p.N), u32(p.K), 0u});
    }
    apply(r.geometry, p, l);
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
    if (l.order != Launch::Order::kNone)
      o << ", \"order\": \"" << (l.order == Launch::Order::kAsGiven ? "as_given" : "by_expert") << "\"";
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
  for (const RouteRow& r : routes()) {
    o << (first ? "" : ", ") << "{\"route\": ";
    append_json_string(o, r.route);
    o << ", \"op\": ";
    append_json_string(o, op_name(r.op));
    o << ", \"formats\": [";
    bool first_format = true;
    for (int f = 0; f < kFormatCount; ++f) {
      if (!(r.formats & bit(Format(f)))) continue;
      o << (first_format ? "" : ", ");
      append_json_string(o, format_name(Format(f)));
      first_format = false;
    }
    o << "], \"transpose\": " << r.transpose << ", \"m_min\": " << r.m_min << ", \"m_max\": "
      << (r.m_max == kNoLimit ? -1 : r.m_max) << ", \"kernel\": ";
    append_json_string(o, r.kernel);
    const Geometry::Kind kind = r.geometry.kind;
    o << ", \"geometry\": {\"kind\": \""
      << (kind == Geometry::Kind::kTiled ? "tiled" : kind == Geometry::Kind::kRuns ? "runs" : "elementwise")
      << "\", \"rows\": " << r.geometry.rows << ", \"cols\": " << r.geometry.cols
      << ", \"threads\": " << r.geometry.threads << "}, \"when\": ";
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
