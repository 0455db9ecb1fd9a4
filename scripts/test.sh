#!/usr/bin/env bash
# The test command: set up .venv and the build (scripts/setup_env.sh), then run the whole test suite
# (tests marked `cuda` skip on a machine without a GPU). Extra arguments go to pytest.
set -euo pipefail
repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
bash "$repo/scripts/setup_env.sh"
cd "$repo" && exec .venv/bin/python -m pytest -q "$@" tests
