"""The two build descriptions stay in step (ARCHITECTURE §2): CMakeLists.txt lists exactly setup.py's C++ and CUDA
sources, and every source file under csrc/ is built by both."""
from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _setup_py_list(name: str) -> list[str]:
    tree = ast.parse((ROOT / "setup.py").read_text())
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(getattr(t, "id", None) == name for t in node.targets):
            return ast.literal_eval(node.value)
    raise AssertionError(f"setup.py has no {name}")


def _cmake_list(name: str) -> list[str]:
    m = re.search(rf"set\({name}\s+(.*?)\)", (ROOT / "CMakeLists.txt").read_text(), re.S)
    assert m, f"CMakeLists.txt has no set({name} ...)"
    return m.group(1).split()


def test_cmake_and_setup_py_build_the_same_sources():
    assert _cmake_list("DSV4_CPP_SOURCES") == _setup_py_list("CPP_SOURCES")
    assert _cmake_list("DSV4_CUDA_SOURCES") == _setup_py_list("CUDA_SOURCES")


def test_every_source_file_is_built():
    on_disk = {str(p.relative_to(ROOT)) for p in (ROOT / "csrc").rglob("*") if p.suffix in (".cpp", ".cu")}
    assert on_disk == set(_setup_py_list("CPP_SOURCES")) | set(_setup_py_list("CUDA_SOURCES"))
