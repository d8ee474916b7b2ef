// Runtime (bits, scale dtype) -> compile-time template arguments, shared by the kernel files.
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Exception.h>
#include <c10/util/Half.h>

#include <type_traits>

namespace torch_qmm {
namespace cpu {

template <int B>
using Bits = std::integral_constant<int, B>;

// Calls f(Bits<b>{}, T{}) with T the C++ type of `dtype` (float, c10::Half, c10::BFloat16).
template <typename F>
void dispatch_bits_dtype(int bits, at::ScalarType dtype, F&& f) {
  auto with_type = [&](auto bits_c) {
    switch (dtype) {
      case at::kFloat: return f(bits_c, float{});
      case at::kHalf: return f(bits_c, c10::Half{});
      case at::kBFloat16: return f(bits_c, c10::BFloat16{});
      default: TORCH_CHECK(false, "affine_qmm: unsupported scales dtype ", dtype);
    }
  };
  switch (bits) {
    case 2: return with_type(Bits<2>{});
    case 3: return with_type(Bits<3>{});
    case 4: return with_type(Bits<4>{});
    case 5: return with_type(Bits<5>{});
    case 6: return with_type(Bits<6>{});
    case 8: return with_type(Bits<8>{});
    default: TORCH_CHECK(false, "affine_qmm: unsupported bits ", bits);
  }
}

// log2(group_size / 32): shifts a block index (32 codes) to its group index.
inline int block_to_group_shift(int group_size) { return group_size == 32 ? 0 : group_size == 64 ? 1 : 2; }

}  // namespace cpu
}  // namespace torch_qmm
