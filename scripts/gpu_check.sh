#!/usr/bin/env bash
# Runs the `cuda` tests and the benchmarks on a GPU machine against the module built on the CPU
# machine (sgl_dsv4_kernels/_C.abi3.so carried along), writes logs and the full table under $OUT (default
# ./gpu_out) and prints last the failed tests and the benchmarks' compact table (benchmarks/run.py compact_summary).
# usage: scripts/gpu_check.sh [tests|bench|all] [pytest args...]
set -u -o pipefail
mode="${1:-all}"; shift || true
out="${OUT:-$PWD/gpu_out}"
mkdir -p "$out"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
python3 -c "import torch, sgl_dsv4_kernels; print('torch', torch.__version__, torch.cuda.get_device_name())" \
  || { echo "cannot import the extension"; exit 1; }

tests_rc=0
if [[ "$mode" == tests || "$mode" == all ]]; then
  python3 -m pytest -m cuda -q -p no:cacheprovider --junitxml="$out/cuda_tests.xml" "$@" tests \
    > "$out/cuda_tests.log" 2>&1
  tests_rc=$?
fi
bench_rc=0
if [[ "$mode" == bench || "$mode" == all ]]; then
  rm -f "$out/bench_rows.json"
  python3 -m benchmarks.run --out "$out" --json "$out/bench_rows.json" > "$out/bench.log" 2>&1
  bench_rc=$?
fi

echo "==================== summary ===================="
if [[ "$mode" == tests || "$mode" == all ]]; then
  grep -E "^(FAILED|ERROR)" "$out/cuda_tests.log" | head -40
  tail -n 3 "$out/cuda_tests.log"
  echo "cuda tests exit code: $tests_rc"
fi
if [[ "$mode" == bench || "$mode" == all ]]; then
  if [[ $bench_rc -ne 0 ]]; then  # where it stopped
    echo "--- end of $out/bench.log ---"
    grep -v "^  torch baseline failed" "$out/bench.log" | tail -n 25
  fi
  n_failed=$(grep -c "^  torch baseline failed" "$out/bench.log")
  [[ ${n_failed:-0} -gt 0 ]] && echo "torch baselines failed: $n_failed (see $out/bench.log)"
  echo "full table: $(ls "$out"/*.md 2>/dev/null | tr '\n' ' ')log: $out/bench.log"
  if [[ -s "$out/bench_rows.json" ]]; then
    python3 -m benchmarks.run --compact "$out/bench_rows.json" | tee "$out/bench_compact.txt"
  else
    echo "no benchmark rows written"
  fi
  echo "benchmarks exit code: $bench_rc"
fi
[[ $tests_rc -eq 0 && $bench_rc -eq 0 ]]
