#!/usr/bin/env bash
# Creates (or reuses) the virtual environment .venv, installs the build and test requirements and
# builds the extension in place. Run by the README's commands (scripts/test.sh, scripts/selftest.sh), and so by
# .ci/run.
set -euo pipefail
repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
export CUDA_HOME="${CUDA_HOME:-/usr/local/cuda}"
if [[ ! -x "$repo/.venv/bin/python" ]]; then
  python3 -m venv "$repo/.venv"
fi
py="$repo/.venv/bin/python"
if ! "$py" -c "import torch, pytest, ninja, expecttest" 2>/dev/null; then
  "$py" -m pip install -q --upgrade pip
  "$py" -m pip install -q "torch==2.14.1" numpy pytest ninja setuptools wheel expecttest
fi
(cd "$repo" && "$py" setup.py -q build_ext --inplace)
