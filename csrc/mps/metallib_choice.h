// Where a kernel's Metal code comes from: the metallib built at install time (setup.py, when
// `xcrun` exists: csrc/mps/embed_metal.py's build_metallib), else its source compiled on first
// use. Plain C++ (no Apple API) so that tests/metalsim/test_metallib_selection.py compiles and
// runs it on Linux; metal_executor.mm makes the same calls.
//
// The metallib sits next to the extension module under the name kMetallibName (metal_source.inc),
// which embed_metal.py derives from the embedded sources: a metallib built from other sources
// has another name and is never loaded.
#pragma once

#include <cstring>
#include <string>

namespace torch_qmm {
namespace mps {

enum class KernelOrigin { kMetallib, kSource };

// The metallib's path: the directory of `module_path` (the extension module's file) + `name`.
inline std::string metallib_path(const std::string& module_path, const char* name) {
  const std::string::size_type slash = module_path.rfind('/');
  const std::string dir = slash == std::string::npos ? std::string(".") : module_path.substr(0, slash);
  return dir + "/" + name;
}

// TORCH_QMM_METALLIB=0 compiles every kernel from source even when a metallib is installed.
inline bool metallib_enabled(const char* env_value) {
  return env_value == nullptr || std::strcmp(env_value, "0") != 0;
}

// The metallib when it is enabled, loaded and has the kernel's function; else the source.
inline KernelOrigin kernel_origin(bool enabled, bool library_loaded, bool has_function) {
  return enabled && library_loaded && has_function ? KernelOrigin::kMetallib : KernelOrigin::kSource;
}

}  // namespace mps
}  // namespace torch_qmm
