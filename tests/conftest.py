"""Shared fixtures. Without a GPU, Triton kernels run under the interpreter, which must be switched on
before triton is first imported: that is why this happens here, at the top of the test session."""

import os
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


def pytest_collection_modifyitems(config, items):
    skip_gpu = pytest.mark.skip(reason="needs a CUDA GPU (run with `make test-gpu` on a GPU machine)")
    for item in items:
        if "gpu" in item.keywords and not HAS_CUDA:
            item.add_marker(skip_gpu)
