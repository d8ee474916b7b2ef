// The quantization formats: one table (format_spec.cpp) read by validation, the CPU kernels, the
// Meta kernels, the planner and, through the `_formats` op (JSON), by torch_qmm/formats.py.
// Portable C++17 without torch, so the planner and tools can include it.
//
// Every format of the table stores W [rows, cols] quantized along cols in groups of `group_size`
// consecutive values (docs/formats.md):
//   wq      uint32 [rows, cols * bits / 32]   each row one little-endian bit stream of codes
//                                            (csrc/format.h)
//   scales  [rows, cols / group_size]        ScaleKind::kFloat: the float dtype of the weights;
//                                            otherwise uint8 codes (fp_codec.h)
//   biases  [rows, cols / group_size]        only where has_biases (affine): w = s * q + b;
//                                            otherwise w = s * element(q)
#pragma once

#include <cstdint>
#include <string>
#include <string_view>

namespace torch_qmm {

// The value is the format's index in the table and is part of no file format.
enum class Mode : int { kAffine = 0, kMxfp4 = 1, kNvfp4 = 2, kMxfp8 = 3 };
// How a code decodes: an unsigned integer (affine), or a small float (fp_codec.h).
enum class Element { kUint, kE2M1, kE4M3 };
// How a scale is stored: in the weights' float dtype, or as a uint8 code (fp_codec.h).
enum class ScaleKind { kFloat, kE8M0, kE4M3 };

// A short list of allowed integers (bit widths, group sizes).
struct IntChoices {
  int values[8];
  int size;
  bool contains(int64_t v) const {
    for (int i = 0; i < size; ++i)
      if (values[i] == v) return true;
    return false;
  }
  // "2, 3, 4" (for messages and JSON).
  std::string join(const char* sep = ", ") const;
};

struct FormatSpec {
  Mode mode;
  const char* name;  // MLX's mode string
  Element element;
  ScaleKind scale;
  bool has_biases;
  IntChoices bits;          // allowed bit widths (MLX's)
  IntChoices group_sizes;   // allowed group sizes (MLX's)
  int default_bits;         // MLX's defaults (mx.quantize with bits / group_size None)
  int default_group_size;
  float element_max;        // largest |element value| (0 for kUint: the codes are not values)
};

// Every format, in Mode order.
const FormatSpec* formats_begin();
const FormatSpec* formats_end();
const FormatSpec& format_spec(Mode m);
const FormatSpec* find_format(std::string_view name);  // nullptr when unknown
// "'affine', 'mxfp4', ..." (for messages).
std::string format_names();
// The table as JSON: [{"mode": "affine", "index": 0, "element": "uint", ...}, ...].
std::string formats_json();

const char* element_name(Element e);
const char* scale_name(ScaleKind s);

}  // namespace torch_qmm
