// The int8-activation affine kernels (actq_qmm.cpp), for the ops that run them on operands they
// prepare themselves: qmm_int8_activations (actq_qmm.cpp) and gather_qmm_int8_activations
// (gather_qmm.cpp).
#pragma once

#include <string>

#include "qmm_kernels.h"

namespace torch_qmm {
namespace cpu {
namespace actq {

// y [a.M, a.N] float32, row-major = x @ W.T with each row of x (a.x: float32 [a.M, a.K] in natural
// order, contiguous, finite) quantized to int8 per block of 32 (actq_x.h); affine, transpose=True,
// bits of the affine format, group sizes 32 / 64 / 128. Threads over the rows of W (at::parallel_for;
// serially inside a parallel region). y may hold Inf or NaN where the block sums overflow float32.
void qmm_t_int8x(const QmmArgs& a, float* y);
// The kernel qmm_t_int8x runs for `a`: "<isa>-<codes>" (256-bit), "<isa>-512-<codes>" (512-bit)
// or "scalar".
std::string int8x_kernel(const QmmArgs& a);

}  // namespace actq
}  // namespace cpu
}  // namespace torch_qmm
