// x as every CPU kernel takes it: float32 [M, K], contiguous, with what the routes ask of its
// values (finite; in the range of the chunk kernels), found in the same pass that converts it.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>

namespace torch_qmm {
namespace cpu {

struct XRows {
  at::Tensor xf;          // [M, K] float32, contiguous (x itself where it already is that)
  bool finite = false;    // no Inf or NaN in x
  bool in_range = false;  // chunk::x_in_range (chunk_driver.h): finite, nonzero |x| in [2^-98, 2^100]
  bool in_subnormal_range = false;  // chunk::x_in_subnormal_range: finite, nonzero |x| in [2^-57, 2^48)
};

// x [..., K] with M * K elements. One pass over x split over torch's threads (16-bit x converted
// in it), so no part of it is serial past a few thousand values whatever M and K are.
XRows x_rows(const at::Tensor& x, int64_t M, int64_t K);

}  // namespace cpu
}  // namespace torch_qmm
