// The table of formats (format_spec.h). The allowed bit widths and group sizes and the defaults
// are MLX's (mlx.core.quantize); docs/formats.md describes each format.
#include "format_spec.h"

#include <iterator>
#include <sstream>

namespace torch_qmm {

namespace {

// clang-format off
constexpr FormatSpec kFormats[] = {
  // mode           name      element          scale             biases  bits                    group sizes        bits gs  element max
  {Mode::kAffine, "affine", Element::kUint,  ScaleKind::kFloat, true,  {{2, 3, 4, 5, 6, 8}, 6}, {{32, 64, 128}, 3}, 4,  64, 0.0f},
  {Mode::kMxfp4,  "mxfp4",  Element::kE2M1,  ScaleKind::kE8M0,  false, {{4}, 1},               {{32}, 1},          4,  32, 6.0f},
  {Mode::kNvfp4,  "nvfp4",  Element::kE2M1,  ScaleKind::kE4M3,  false, {{4}, 1},               {{16}, 1},          4,  16, 6.0f},
  {Mode::kMxfp8,  "mxfp8",  Element::kE4M3,  ScaleKind::kE8M0,  false, {{8}, 1},               {{32}, 1},          8,  32, 448.0f},
};
// clang-format on

constexpr bool table_in_mode_order() {
  for (size_t i = 0; i < std::size(kFormats); ++i)
    if (static_cast<size_t>(kFormats[i].mode) != i) return false;
  return true;
}
static_assert(table_in_mode_order(), "kFormats[i].mode must be Mode(i)");

}  // namespace

std::string IntChoices::join(const char* sep) const {
  std::string out;
  for (int i = 0; i < size; ++i) {
    if (i) out += sep;
    out += std::to_string(values[i]);
  }
  return out;
}

const FormatSpec* formats_begin() { return std::begin(kFormats); }
const FormatSpec* formats_end() { return std::end(kFormats); }

const FormatSpec& format_spec(Mode m) { return kFormats[static_cast<int>(m)]; }

const FormatSpec* find_format(std::string_view name) {
  for (const FormatSpec& f : kFormats)
    if (name == f.name) return &f;
  return nullptr;
}

std::string format_names() {
  std::string out;
  for (const FormatSpec& f : kFormats) {
    if (!out.empty()) out += ", ";
    out += std::string("'") + f.name + "'";
  }
  return out;
}

const char* element_name(Element e) {
  switch (e) {
    case Element::kUint: return "uint";
    case Element::kE2M1: return "e2m1";
    case Element::kE4M3: return "e4m3";
  }
  return "?";
}

const char* scale_name(ScaleKind s) {
  switch (s) {
    case ScaleKind::kFloat: return "float";
    case ScaleKind::kE8M0: return "e8m0";
    case ScaleKind::kE4M3: return "e4m3";
  }
  return "?";
}

std::string formats_json() {
  std::ostringstream o;
  o << "[";
  for (const FormatSpec& f : kFormats) {
    if (&f != kFormats) o << ", ";
    o << "{\"mode\": \"" << f.name << "\", \"index\": " << static_cast<int>(f.mode) << ", \"element\": \""
      << element_name(f.element) << "\", \"scale\": \"" << scale_name(f.scale)
      << "\", \"has_biases\": " << (f.has_biases ? "true" : "false") << ", \"bits\": [" << f.bits.join()
      << "], \"group_sizes\": [" << f.group_sizes.join() << "], \"default_bits\": " << f.default_bits
      << ", \"default_group_size\": " << f.default_group_size << ", \"element_max\": " << f.element_max << "}";
  }
  o << "]";
  return o.str();
}

}  // namespace torch_qmm
