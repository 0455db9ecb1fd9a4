"""One op call per case inside an NVTX range "prof", for Nsight Compute on the GPU machine (Firecracker runtime):

    ncu --clock-control none --nvtx --nvtx-include "prof/" --section SpeedOfLight --section WarpStateStats \
        --metrics regex:smsp__average_warps_issue_stalled_.*_per_issue_active.ratio \
        python3 -m benchmarks.ncu_cases CASE [SIZE]

CASE: a name of benchmarks/cases.py (its docstring lists them); SIZE replaces the case's row / request count.
Two warm-up calls precede the profiled one.
"""
import sys

import torch

from benchmarks import cases

fn = cases.build(sys.argv[1], int(sys.argv[2]) if len(sys.argv) > 2 else 0)
for _ in range(2):
    fn()
torch.cuda.synchronize()
torch.cuda.nvtx.range_push("prof")
fn()
torch.cuda.nvtx.range_pop()
torch.cuda.synchronize()
