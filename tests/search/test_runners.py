"""runners.py: binding a variant's kernel to the contract's tensors, and what it refuses (CPU, interpreter)."""

import os
import shutil

import pytest
import torch

from kernel_lib.search import runners
from kernel_lib.search.contract import make_case, poisoned_outputs
from kernel_lib.search.spec import parse_spec
from tests.search import _tiny_kernel as tiny


def _binder(tmp_path, spec, source=tiny.BASELINE):
    path = tmp_path / "v" / "kernel_module.py"
    path.parent.mkdir()
    path.write_text(source)
    return runners.make_binder(spec, spec.launch.model_dump(), str(path))


def _tensors(spec):
    case = make_case(spec, "cpu", 0, small=True)
    return case, {**case.inputs, **poisoned_outputs(spec, case, "cpu")}


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET", "0") != "1", reason="runs the kernel: needs the interpreter")
def test_a_bound_launch_writes_the_outputs(tmp_path):
    spec = tiny.spec()
    case, tensors = _tensors(spec)
    _binder(tmp_path, spec)(tensors, case.scope)()
    torch.testing.assert_close(tensors["y"], case.inputs["x"] * 2)


@pytest.mark.parametrize(
    "edit, message",
    [
        pytest.param({"N, BLOCK_N": "N, scale, BLOCK_N"}, "'scale'", id="an_argument_no_name_of_the_spec_binds"),
        pytest.param({"def double_rows": "def other_name"}, "no 'double_rows'", id="the_entry_is_missing"),
    ],
)
def test_what_cannot_be_bound_is_a_launch_error(tmp_path, edit, message):
    spec = tiny.spec()
    case, tensors = _tensors(spec)
    with pytest.raises(runners.LaunchError, match=message):
        _binder(tmp_path, spec, tiny.source("bad", edit))(tensors, case.scope)


def test_a_grid_of_four_dims_is_a_launch_error(tmp_path):
    data = tiny.spec().model_dump(exclude_none=True)
    data["launch"]["grid"] = "(M, 1, 1, 1)"
    spec = parse_spec(data)
    case, tensors = _tensors(spec)
    with pytest.raises(runners.LaunchError, match="one to three"):
        _binder(tmp_path, spec)(tensors, case.scope)


@pytest.mark.skipif(torch.cuda.is_available(), reason="the message of a machine without a GPU")
def test_a_cuda_kernel_without_a_gpu_is_a_launch_error(tmp_path):
    spec = parse_spec({**_cuda_spec(), "source": 'extern "C" __global__ void k(float* y) {}'})
    with pytest.raises(runners.LaunchError, match="CuPy|CUDA GPU"):
        runners.make_binder(spec, spec.launch.model_dump(), str(tmp_path / "kernel.cu"))


def test_without_nvcc_the_defines_still_come_back_for_nvrtc(monkeypatch, tmp_path):
    monkeypatch.setattr(shutil, "which", lambda name: None)
    cubin, options = runners.compile_cuda("// empty", {"BLOCK": 64, "EVEN": True}, str(tmp_path))
    assert cubin is None
    assert "-DBLOCK=64" in options and "-DEVEN=1" in options


def _cuda_spec() -> dict:
    return {
        "name": "k", "kind": "cuda", "entry": "k", "sizes": {"M": 4},
        "inputs": [], "outputs": [{"name": "y", "shape": ["M"], "dtype": "float32"}],
        "launch": {"grid": "(1,)", "block": "(M,)", "args": ["y"]},
        "reference": {"function": "torch.zeros", "args": ["M"]},
    }  # fmt: skip
