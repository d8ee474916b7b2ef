// Stand-in for the spec helper's csrc/format_spec.h (the planner needs only Mode): replaced by
// theirs when wip/spec is merged.
#pragma once

namespace torch_qmm {
enum class Mode : int { kAffine = 0, kMxfp4 = 1, kNvfp4 = 2, kMxfp8 = 3 };
}  // namespace torch_qmm
