// The planner: (op, M, N, K, bits, group_size, dtype, transpose; ggml_type for GGUF) -> the Metal
// launches that compute it. Portable C++17 (no torch, no Apple headers), so CI runs it everywhere: the MPS
// executor (csrc/mps/) and metalsim's executor (torch_qmm/metalsim/backend.py) both execute
// exactly these launches. Arguments are validated before planning (csrc/validate.*,
// csrc/gguf_validate.*; see plan_torch.h).
#pragma once

#include <array>
#include <cstdint>
#include <string>
#include <vector>

#include "../metal/gguf_params.h"
#include "../metal/qmm_params.h"

namespace torch_qmm {
namespace plan {

// kQmm: affine_qmm; kGgufQmm: gguf_qmm (W as GGUF K-quant blocks, always [N, K]).
enum class Op { kQuantize, kDequantize, kQmm, kGgufQmm };
enum class DType { kFloat32, kFloat16, kBFloat16 };

// Which tensor of the op a buffer index is bound to.
//   qmm: x, wq, scales, biases -> y      dequantize: wq, scales, biases -> w
//   quantize: w -> wq, scales, biases                gguf_qmm: x, blocks -> y
enum class Operand { kX, kWq, kScales, kBiases, kY, kW, kBlocks };
constexpr int kOperandCount = 7;

struct Problem {
  Op op;
  int64_t M;  // rows of x (qmm, gguf_qmm); unused otherwise
  int64_t N;  // qmm: columns of y; (de)quantize: rows of W
  int64_t K;  // qmm: inner dimension; (de)quantize: columns of W (the quantized axis)
  int bits;        // affine only
  int group_size;  // affine only
  DType dtype;     // of x and y (qmm, gguf_qmm), of w / scales ((de)quantize)
  bool transpose;  // qmm only
  int ggml_type = 0;  // gguf_qmm only: gguf::kTypeQ4_K or kTypeQ6_K (metal/gguf_format.h)
};

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
};

// Kernel host name {family}_{variant}_{dtype}_gs_{G}_b_{B}, e.g.
// affine_qmv_fast_float16_t_gs_64_b_4. Must match AFFINE_NAME in metal/affine_common.h.
std::string kernel_name(const char* family, const char* variant, DType dtype, int group_size, int bits);
const char* dtype_name(DType dtype);  // "float", "float16_t", "bfloat16_t"

// GGUF kernel host name gguf_{qmv|qmm}_{type}[_{variant}]_{dtype}, e.g. gguf_qmv_q4_K_float,
// gguf_qmm_q6_K_bm8_float16_t (variant may be empty). Must match GGUF_NAME in metal/gguf_qmm.h.
std::string gguf_kernel_name(const char* family, const char* variant, int ggml_type, DType dtype);
const char* ggml_type_name(int ggml_type);  // "q4_K", "q6_K"

// One row of the routing table (csrc/plan.cpp): exposed so that tests can check that every
// route is exercised and every kernel a plan can name exists.
struct RouteInfo {
  const char* route;
  const char* op;  // "qmm", "dequantize", "quantize", "gguf_qmm"
  const char* family;
  const char* variant;
  const char* when;  // human-readable condition
  const char* why;
};
const std::vector<RouteInfo>& routes();

// The launches of one op. Problems with an empty output plan no launch; a qmm with K == 0
// plans none either (the executor returns zeros). gguf_qmm problems must have a native
// ggml_type (std::invalid_argument otherwise; the op's checks reject it first).
std::vector<Launch> make_plan(const Problem& problem);

const char* operand_name(Operand operand);
std::string to_json(const std::vector<Launch>& launches);
std::string routes_json();

}  // namespace plan
}  // namespace torch_qmm
