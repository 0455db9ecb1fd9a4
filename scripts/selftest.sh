#!/usr/bin/env bash
# The main job: set up .venv and the build, then run the self-test (GPU if present, else CPU).
set -euo pipefail
repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
bash "$repo/scripts/setup_env.sh"
cd "$repo" && exec .venv/bin/python -m sgl_dsv4_kernels selftest "$@"
