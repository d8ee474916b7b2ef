// The Metal source of one kernel, from the tables embed_metal.py generates: its library's headers
// (kMetalPreludes) + "\n" + its instantiation line + "\n", the same text as
// torch_qmm/metal_source.py's kernel_source(name). Plain C++ (no Apple API) so that
// tests/test_metal_mps_syntax.py compiles it on Linux and compares every kernel's text.
#pragma once

#include <string>

#include "metal_source.inc"  // kMetalPreludes, kMetalKernels: written by embed_metal.py

namespace torch_qmm {
namespace mps {

// "" when no kernel has that name.
inline std::string kernel_source(const std::string& name) {
  for (const MetalKernelSource& k : kMetalKernels) {
    if (name == k.name) return std::string(kMetalPreludes[k.library]) + "\n" + k.line + "\n";
  }
  return std::string();
}

}  // namespace mps
}  // namespace torch_qmm
