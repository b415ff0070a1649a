"""Shared fixtures. Without a GPU, Triton kernels run under the interpreter, which must be switched on
before triton is first imported: that is why this happens here, at the top of the test session."""

import contextlib
import fcntl
import gc
import os
import sys
import tempfile
import zlib

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

if os.environ.get("TRITON_INTERPRET") == "1":
    from tests._checks import round_bf16_to_nearest_in_interpreter

    round_bf16_to_nearest_in_interpreter()

HAS_CUDA = torch.cuda.is_available()


@pytest.fixture
def device() -> str:
    """Where kernels run in this session: the GPU when there is one, else the CPU (interpreted)."""
    return "cuda" if HAS_CUDA else "cpu"


@pytest.fixture(autouse=True)
def _seed_per_test(request):
    """Each test draws from its own fixed seed: a failure reproduces alone, whatever ran before it."""
    torch.manual_seed(zlib.crc32(request.node.nodeid.encode()))


@pytest.fixture(autouse=True)
def _share_the_gpu(request):
    """`make test-gpu` runs several pytest workers on one GPU. A test marked ``gpu_memory`` (tens of GB at its
    peak) holds a lock file while it runs, so two of them never overlap; after every test the memory it left in
    PyTorch's cache goes back to the driver, where another worker can have it (a run of six workers ran out of
    memory with two workers' caches holding 30 and 39 GiB)."""
    if not HAS_CUDA:
        yield
        return
    with contextlib.ExitStack() as stack:
        if request.node.get_closest_marker("gpu_memory"):
            path = os.path.join(tempfile.gettempdir(), f"kernel_lib_gpu_memory_{os.getuid()}.lock")
            lock = stack.enter_context(open(path, "w"))
            fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes
        if torch.cuda.is_initialized():  # a CPU test creates no CUDA context here
            torch.cuda.reset_peak_memory_stats()
        yield
        if not torch.cuda.is_initialized():
            return
        log = os.environ.get("KERNEL_LIB_TEST_MEMORY_LOG")  # one line per test above 4 GiB: which tests to mark
        peak = torch.cuda.max_memory_reserved()
        if log and peak > 4 * 2**30:
            with open(log, "a") as f:
                f.write(f"{peak / 2**30:.1f} GiB {request.node.nodeid}\n")
        # a failed test's traceback (kept for post-mortem debugging) would keep its tensors alive
        for name in ("last_exc", "last_value", "last_traceback"):
            if hasattr(sys, name):
                setattr(sys, name, None)
        if torch.cuda.memory_reserved() > 2**30:
            gc.collect()  # tensors in reference cycles, freed only by the collector
        torch.cuda.empty_cache()


def pytest_configure(config):
    # `make test` and `make test-gpu` spread tests one at a time over workers (--dist loadgroup); tests marked with
    # one xdist_group run on one worker. pytest-xdist registers the mark; a machine may run without xdist.
    config.addinivalue_line("markers", "xdist_group(name): tests that run on one worker under --dist loadgroup")


def pytest_collection_modifyitems(config, items):
    skip_gpu = pytest.mark.skip(reason="needs a CUDA GPU (run with `make test-gpu` on a GPU machine)")
    for item in items:
        if "gpu" in item.keywords and not HAS_CUDA:
            item.add_marker(skip_gpu)
