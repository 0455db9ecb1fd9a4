# Ahead-of-time build of the one extension module sgl_dsv4_kernels._C against the libtorch stable
# ABI (abi3): one build loads under every torch >= 2.10 and every CPython >= 3.10.
#
# Environment:
#   DSV4_CUDA_ARCHS   semicolon list of SM numbers to build cubins for (default "90;100"; the
#                     newest also ships as PTX). E.g. DSV4_CUDA_ARCHS=90 for a fast local build.
#   DSV4_CPU_ONLY=1   build the CPU implementation only, even when nvcc exists.
#   DSV4_REQUIRE_CUDA=1  fail instead of building the CPU implementation alone (CI sets it).
#   NVCC_THREADS      nvcc --threads (default 2).
#   CUDA_HOME         the toolkit; unset, /usr/local/cuda when it has nvcc, else torch's guess.
import os
import shutil

# Set before torch.utils.cpp_extension reads it: torch otherwise guesses the toolkit from the nvcc on PATH, and a
# wrapper script such as /usr/local/bin/nvcc makes it guess /usr/local, which has no CUDA headers.
if "CUDA_HOME" not in os.environ and "CUDA_PATH" not in os.environ and os.access("/usr/local/cuda/bin/nvcc", os.X_OK):
    os.environ["CUDA_HOME"] = "/usr/local/cuda"

from setuptools import find_packages, setup  # noqa: E402
from torch.utils.cpp_extension import CUDA_HOME, BuildExtension, CppExtension, CUDAExtension  # noqa: E402

ROOT = os.path.dirname(os.path.abspath(__file__))

# Torch-facing glue and CPU implementations (g++).
CPP_SOURCES = [
    "csrc/registration.cpp",
    "csrc/common/op_checks.cpp",
    "csrc/common/overlap_checks.cpp",
    "csrc/cache/layout_ops.cpp",
    "csrc/cache/cache_ops.cpp",
    "csrc/cache/store_cpu.cpp",
    "csrc/cache/dequant_cpu.cpp",
    "csrc/cache/fake_quant_cpu.cpp",
    "csrc/metadata/metadata_ops.cpp",
    "csrc/metadata/metadata_cpu.cpp",
    "csrc/cache/writers_ops.cpp",
    "csrc/cache/writers_cpu.cpp",
    "csrc/compress/low_ratio_ops.cpp",
    "csrc/compress/low_ratio_cpu.cpp",
    # c4 / c128 planners and compressor
    "csrc/compress/plan_ops.cpp",
    "csrc/compress/plan_cpu.cpp",
    "csrc/compress/forward_ops.cpp",
    "csrc/compress/forward_cpu.cpp",
]

# Kernels and their plain-C++ launchers (nvcc; no torch headers).
CUDA_SOURCES = [
    "csrc/common/launch.cu",
    "csrc/cache/store_kernels.cu",
    "csrc/cache/dequant_kernels.cu",
    "csrc/cache/fake_quant_kernels.cu",
    "csrc/metadata/page_table_kernels.cu",
    "csrc/metadata/compression_kernels.cu",
    "csrc/metadata/schedule_kernels.cu",
    "csrc/cache/writers_kernels.cu",
    "csrc/compress/low_ratio_kernels.cu",
    # c4 / c128 planners and compressor
    "csrc/compress/plan_kernels.cu",
    "csrc/compress/forward_kernels.cu",
]

# libtorch stable ABI 2.10. torch.utils.cpp_extension adds the Python limited API define itself
# (Py_LIMITED_API=0x030A0000 with py_limited_api=True): torch >= 2.10 needs Python >= 3.10 anyway.
ABI_DEFINES = ["-DTORCH_TARGET_VERSION=0x020a000000000000"]


def cuda_available() -> bool:
    if os.environ.get("DSV4_CPU_ONLY", "0") == "1":
        return False
    return (CUDA_HOME is not None and shutil.which(os.path.join(CUDA_HOME, "bin", "nvcc")) is not None
            and os.path.exists(os.path.join(CUDA_HOME, "include", "cuda_runtime_api.h")))


def gencode_flags():
    archs = [a.strip() for a in os.environ.get("DSV4_CUDA_ARCHS", "90;100").split(";") if a.strip()]
    flags = []
    for arch in archs:
        flags.append(f"-gencode=arch=compute_{arch},code=sm_{arch}")
    newest = max(archs, key=int)
    flags.append(f"-gencode=arch=compute_{newest},code=compute_{newest}")
    return flags


def make_extension():
    include_dirs = [os.path.join(ROOT, "include"), os.path.join(ROOT, "csrc")]
    cxx_flags = ["-O3", "-DNDEBUG", "-std=c++17", "-ffp-contract=off", "-fvisibility=hidden"] + ABI_DEFINES
    if not cuda_available():
        if os.environ.get("DSV4_REQUIRE_CUDA", "0") == "1":
            raise SystemExit(f"sgl_dsv4_kernels: DSV4_REQUIRE_CUDA=1 but no usable CUDA toolkit (CUDA_HOME={CUDA_HOME}, "
                             f"DSV4_CPU_ONLY={os.environ.get('DSV4_CPU_ONLY', '0')})")
        print("sgl_dsv4_kernels: no CUDA compiler found; building the CPU implementation only")
        return CppExtension(
            "sgl_dsv4_kernels._C",
            CPP_SOURCES,
            include_dirs=include_dirs,
            extra_compile_args={"cxx": cxx_flags},
            py_limited_api=True,
        )
    nvcc_flags = [
        "-O3",
        "-DNDEBUG",
        "-std=c++17",
        "-lineinfo",
        "--fmad=false",  # every rounding point of the spec is a separate fp32 operation
        "-Xcompiler=-ffp-contract=off",
        "-Xptxas=-warn-spills",
        f"--threads={os.environ.get('NVCC_THREADS', '2')}",
        "-DUSE_CUDA",
    ] + ABI_DEFINES + gencode_flags()
    return CUDAExtension(
        "sgl_dsv4_kernels._C",
        CPP_SOURCES + CUDA_SOURCES,
        include_dirs=include_dirs,
        extra_compile_args={"cxx": cxx_flags + ["-DUSE_CUDA"], "nvcc": nvcc_flags},
        py_limited_api=True,
    )


setup(
    name="sgl_dsv4_kernels",
    version="0.1.0",
    packages=find_packages(include=["sgl_dsv4_kernels", "sgl_dsv4_kernels.*"]),
    ext_modules=[make_extension()],
    cmdclass={"build_ext": BuildExtension.with_options(use_ninja=True)},
    options={"bdist_wheel": {"py_limited_api": "cp310"}},
)
