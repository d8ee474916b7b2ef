// The planner: (op, format, M, N, K, bits, group_size, dtype, transpose) -> the Metal launches that
// compute it. Portable C++17 (no torch, no Apple headers), so CI runs it everywhere: the MPS
// executor (csrc/mps/) and metalsim's executor (torch_qmm/metalsim_backend.py) both execute
// exactly these launches. Arguments are validated before planning (csrc/validate.*,
// csrc/gguf_validate.*; see plan_torch.h).
//
// The routing table (plan.cpp) is data: each RouteRow names the formats it serves, the M range
// and transpose it takes, the kernel (its part of the host name) and the launch geometry. A row
// cannot be written without a Geometry (it has no default), so a route without a grid does not
// compile. Adding a route: one row; adding a format: its bit in FormatSet and its host-name
// prefix/cell (format_prefix, format_cell below), then the kernels' instantiations (metal/).
#pragma once

#include <array>
#include <cstdint>
#include <string>
#include <vector>

#include "../metal/gguf_params.h"
#include "../metal/qmm_params.h"
#include "format_spec.h"

namespace torch_qmm {
namespace plan {

// kQmm / kQuantize / kDequantize: the quantized modes (Mode: affine, mxfp4, nvfp4, mxfp8).
// kGgufQmm: W as GGUF K-quant blocks (always [N, K]), the type in Problem::ggml_type.
// kGatherQmm: gather_qmm, Problem::pairs products x[lhs[i]] @ W[rhs[i]] (.T) of M rows each
// against Problem::experts stacked W (see metal/quant_gather.h for the pair order).
enum class Op { kQuantize, kDequantize, kQmm, kGgufQmm, kGatherQmm };
enum class DType { kFloat32, kFloat16, kBFloat16 };

// Which tensor of the op a buffer index is bound to.
//   qmm: x, wq, scales, biases -> y      dequantize: wq, scales, biases -> w
//   quantize: w -> wq, scales, biases                gguf_qmm: x, blocks -> y
//   gather_qmm: x, wq, scales, biases, lhs, rhs, order -> y   (lhs / rhs: the broadcast indices,
//     flattened, int32; order: the pairs' order, Launch::order says how the executor makes it)
// Formats without biases (the fp modes) bind no biases buffer.
enum class Operand { kX, kWq, kScales, kBiases, kY, kW, kBlocks, kLhs, kRhs, kOrder };
constexpr int kOperandCount = 10;

struct Problem {
  Op op;
  int64_t M;  // rows of x (qmm, gguf_qmm); unused otherwise
  int64_t N;  // qmm: columns of y; (de)quantize: rows of W
  int64_t K;  // qmm: inner dimension; (de)quantize: columns of W (the quantized axis)
  int bits;        // quantized modes only
  int group_size;  // quantized modes only
  DType dtype;     // of x and y (qmm, gguf_qmm), of w ((de)quantize)
  bool transpose;  // qmm only
  int ggml_type = 0;          // gguf_qmm only: a native gguf::GGMLType (metal/gguf_format.h)
  Mode mode = Mode::kAffine;  // quantized modes (csrc/format_spec.h)
  // gather_qmm only (M is then the rows of x per pair): the pairs (broadcast indices' elements),
  // the experts (W's batch), x's batch, and whether rhs is sorted (the caller's sorted_indices).
  int64_t pairs = 0;
  int64_t experts = 0;
  int64_t x_batch = 0;
  bool sorted = false;
};

// The formats a route row serves: the quantized modes (bit = Mode) and the GGUF types after them.
enum class Format : int {
  kAffine, kMxfp4, kNvfp4, kMxfp8,
  kQ2_K, kQ3_K, kQ4_K, kQ5_K, kQ6_K, kIQ4_XS,
  kIQ2_XXS, kIQ2_XS, kIQ2_S, kIQ3_XXS, kIQ3_S, kIQ1_S, kIQ1_M
};
constexpr int kFormatCount = 17;
using FormatSet = uint32_t;
constexpr FormatSet bit(Format f) { return FormatSet(1) << int(f); }
// The quantized modes with Metal kernels (metal/quant.metal instantiates each).
constexpr FormatSet kQuantModes =
    bit(Format::kAffine) | bit(Format::kMxfp4) | bit(Format::kNvfp4) | bit(Format::kMxfp8);
// Whether the planner has kernels for mode m.
constexpr bool serves(Mode m) { return (kQuantModes & bit(Format(int(m)))) != 0; }
constexpr FormatSet kGgufTypes =
    bit(Format::kQ2_K) | bit(Format::kQ3_K) | bit(Format::kQ4_K) | bit(Format::kQ5_K) | bit(Format::kQ6_K) |
    bit(Format::kIQ4_XS) | bit(Format::kIQ2_XXS) | bit(Format::kIQ2_XS) | bit(Format::kIQ2_S) |
    bit(Format::kIQ3_XXS) | bit(Format::kIQ3_S) | bit(Format::kIQ1_S) | bit(Format::kIQ1_M);

// How a route's launch grid follows from the problem. Only the two factories make one (no
// default constructor): every RouteRow states its geometry, checked by the compiler.
class Geometry {
 public:
  enum class Kind { kTiled, kElementwise, kRuns };
  // Threadgroups of `rows` rows of x by `cols` columns of y: grid (ceil(N/cols), ceil(M/rows)),
  // `threads` threads each. The kernel reads W about ceil(M/rows) times and x ceil(N/cols) times.
  static constexpr Geometry tiled(uint32_t rows, uint32_t cols, uint32_t threads) {
    return Geometry(Kind::kTiled, rows, cols, threads);
  }
  // One thread per `values` consecutive values of W [N, K] (0: per quantization group), 1-D grid
  // of `threads`-thread threadgroups.
  static constexpr Geometry elementwise(uint32_t values, uint32_t threads) {
    return Geometry(Kind::kElementwise, 0, values, threads);
  }
  // gather_qmm over runs of pairs of one expert: grid (ceil(N/cols), pairs), the threadgroups of
  // the first pair of each run compute the run's rows, `rows` at a time (metal/quant_gather.h).
  static constexpr Geometry runs(uint32_t rows, uint32_t cols, uint32_t threads) {
    return Geometry(Kind::kRuns, rows, cols, threads);
  }
  Geometry() = delete;

  Kind kind;
  uint32_t rows;     // kTiled: rows of x per threadgroup
  uint32_t cols;     // kTiled: columns of y per threadgroup; kElementwise: values per thread (0: a group)
  uint32_t threads;  // threads per threadgroup

 private:
  constexpr Geometry(Kind k, uint32_t r, uint32_t c, uint32_t t) : kind(k), rows(r), cols(c), threads(t) {}
};

// Extra conditions of a row beyond op, format, transpose and M.
// kManyRowsPerExpert (gather_qmm): on average GATHER_MMA_MIN_ROWS_PER_EXPERT (metal/qmm_params.h)
// rows per expert, whether rhs is sorted or not (the executor orders the pairs, Launch::order).
enum class Cond { kAny, kQmvAligned, kManyRowsPerExpert };

// One row of the routing table: for an op the first row whose conditions hold wins.
struct RouteRow {
  const char* route;   // the row's name (tests, selftest, Launch::route)
  Op op;
  FormatSet formats;   // the formats it serves
  int transpose;       // 1 / 0, or -1 when the op has no transpose (or W is always [N, K])
  int64_t m_min, m_max;
  Cond cond;
  const char* kernel;  // host name = {format prefix}_{kernel}_{dtype}_{format cell} (kernel_name)
  Geometry geometry;
  const char* when;    // human-readable condition
  const char* why;
};
const std::vector<RouteRow>& routes();

struct Binding {
  int index;            // setBuffer index (AffineBuffer in metal/qmm_params.h, GGUFBuffer in gguf_params.h)
  Operand operand;
  int64_t byte_offset;  // relative to the tensor's first element
};

struct Launch {
  std::string kernel;  // host name in the Metal library
  std::string route;   // row of the routing table that chose it
  std::array<uint32_t, 3> threadgroups;
  std::array<uint32_t, 3> threads_per_threadgroup;
  std::vector<Binding> buffers;
  int params_index;    // setBytes index of `params`
  // The kernel family's constant-argument struct (AffineParams or GGUFParams, all uint32
  // fields) as 32-bit words: executors pass it to setBytes without knowing the family.
  std::vector<uint32_t> params;
  // Rows of x and columns of y one threadgroup computes (qmm; 0 otherwise): W is read about
  // ceil(M / tile_rows) times and x ceil(N / tile_cols) times (tests/test_metal_cost.py).
  uint32_t tile_rows = 0;
  uint32_t tile_cols = 0;
  // gather_qmm: how the executor fills the kOrder operand (int32 [pairs], a permutation of the
  // pairs in which those of one expert are adjacent): kAsGiven = 0, 1, ..., pairs - 1 (rhs is
  // sorted); kByExpert = a stable argsort of rhs. Other ops: kNone.
  enum class Order { kNone, kAsGiven, kByExpert };
  Order order = Order::kNone;
};

// The format of a problem: its mode, or its GGUF type for gguf_qmm (std::invalid_argument for a
// type without kernels).
Format format_of(const Problem& p);
// Host name of the kernel `kernel` (a RouteRow's) for problem p, the one spelling of every
// name: {prefix}_{kernel}_{dtype}_{cell} with prefix = the mode's name ("affine", "mxfp4", ...) or
// "gguf", cell = "gs_{G}_b_{B}" or the GGUF type ("q4_K"); e.g. affine_qmv_fast_float16_t_gs_64_b_4,
// gguf_qmm_bm8_float16_t_q6_K. Metal side: KERNEL_NAME in metal/kernel_names.h.
std::string kernel_name(const char* kernel, const Problem& p);
const char* dtype_name(DType dtype);  // "float", "float16_t", "bfloat16_t"
const char* format_name(Format f);    // "affine", "mxfp4", "nvfp4", "mxfp8", "q4_K", "q6_K"

// The launches of one op. Problems with an empty output plan no launch; a qmm with K == 0
// plans none either (the executor returns zeros). gguf_qmm problems must have a native
// ggml_type (std::invalid_argument otherwise; the op's checks reject it first).
std::vector<Launch> make_plan(const Problem& problem);

const char* operand_name(Operand operand);
std::string to_json(const std::vector<Launch>& launches);
std::string routes_json();

}  // namespace plan
}  // namespace torch_qmm
