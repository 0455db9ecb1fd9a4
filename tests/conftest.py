"""Shared pytest setup for the test suite: exact fp32 arithmetic (no denormal flushing), the device
parametrization (CPU always, CUDA marked `cuda` and skipped without a GPU) and the reference oracle."""
import pytest
import torch

torch.set_flush_denormal(False)

import samples  # noqa: E402  (tests/ is on sys.path: rootdir-style conftest)


def pytest_configure(config):
    config.addinivalue_line("markers", "cuda: needs a CUDA GPU (skipped without one)")


@pytest.fixture(params=samples.DEVICES)
def device(request):
    """"cpu", and "cuda" (marked `cuda`; skipped where torch.cuda.is_available() is False)."""
    return request.param


@pytest.fixture(scope="session")
def ref():
    """The pure-torch oracle sgl_dsv4_kernels.reference (kv-layouts-and-quant.md section 7)."""
    from sgl_dsv4_kernels import reference

    return reference


@pytest.fixture(autouse=True)
def _exact_float_mode():
    torch.set_flush_denormal(False)
    yield


@pytest.fixture(scope="module")
def single_thread():
    """Runs a module with one intra-op thread: the KV I/O tests use many small tensors, for which torch's
    thread pool costs more than it gains (several times slower on a loaded 2-core machine)."""
    old = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(old)
