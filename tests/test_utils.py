"""kernel_lib.ops._utils: where kernels run, input checks, configs (and one real Triton kernel using them)."""

import json
import types
import warnings

import pytest
import torch
import triton
import triton.language as tl

from kernel_lib.ops import _utils
from kernel_lib.ops._utils import (
    as_rows,
    autotune_requested,
    check_same_device,
    check_same_dtype,
    check_shape,
    check_tensor,
    launch_or_op,
    meta,
    persist_choices,
    pick_config,
    prune_by_shared_memory,
    use_triton,
)


# ---------------------------------------------------------------------------------------------- checks
def test_check_tensor_accepts_and_returns():
    x = torch.randn(3, 4)
    assert check_tensor(x, "x", ndim=2) is x


@pytest.mark.parametrize(
    "value, kwargs, error, words",
    [
        ([1.0, 2.0], {}, TypeError, "x must be a torch.Tensor"),  # a list is not a tensor
        (torch.ones(3, dtype=torch.int64), {}, TypeError, "int64"),  # integer tensor
        (torch.ones(3, dtype=torch.float64), {}, TypeError, "float64"),  # float64 not among kernel dtypes
        (torch.ones(3), {"ndim": 2}, ValueError, "must have 2 dims"),  # wrong rank
        (torch.ones(3), {"ndim": (2, 4)}, ValueError, "2 or 4 dims"),  # none of several ranks
        (torch.ones(3), {"min_ndim": 2}, ValueError, "at least 2 dims"),
    ],
)
def test_check_tensor_rejects_naming_the_argument(value, kwargs, error, words):
    with pytest.raises(error, match=words) as info:
        check_tensor(value, "x", **kwargs)
    assert "x" in str(info.value)


def test_check_shape():
    check_shape(torch.ones(2, 3), "w", (2, 3))
    with pytest.raises(ValueError, match=r"w must have shape \(3,\), got \(2, 3\)"):
        check_shape(torch.ones(2, 3), "w", (3,))


def test_check_same_device_names_each_tensor():
    assert check_same_device(x=torch.ones(1), w=None) == torch.device("cpu")
    with pytest.raises(ValueError, match="x on cpu, w on meta"):
        check_same_device(x=torch.ones(1), w=torch.ones(1, device="meta"))


def test_check_same_dtype_names_each_tensor():
    assert check_same_dtype(a=torch.ones(1), b=torch.ones(1)) == torch.float32
    with pytest.raises(TypeError, match="a is float32, b is float16"):
        check_same_dtype(a=torch.ones(1), b=torch.ones(1, dtype=torch.float16))


@pytest.mark.parametrize(
    "make, copies",
    [
        (lambda: torch.randn(2, 3, 8), False),  # contiguous: a pure view
        (lambda: torch.randn(4, 16)[:, :8], False),  # sliced columns: rows keep their own stride
        (lambda: torch.randn(8, 5).t(), True),  # transposed: the last dim is strided, must copy
        (lambda: torch.randn(3, 4, 8).transpose(0, 1), True),  # leading dims do not collapse
        (lambda: torch.randn(6, 1).expand(6, 1), False),  # width 1: any stride works
    ],
)
def test_as_rows(make, copies):
    x = make()
    rows = as_rows(x)
    assert rows.shape == (x.numel() // x.shape[-1], x.shape[-1])
    assert rows.stride(-1) == 1 or rows.shape[-1] == 1
    torch.testing.assert_close(rows, x.reshape(-1, x.shape[-1]), rtol=0, atol=0)
    assert (rows.data_ptr() != x.data_ptr()) == copies


def test_as_rows_rejects_scalars():
    with pytest.raises(ValueError, match="at least one dim"):
        as_rows(torch.tensor(1.0))


# ------------------------------------------------------------------------------------ where kernels run
def test_use_triton_falls_back_on_cpu_without_interpreter_and_warns_once(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    monkeypatch.setattr(_utils, "_warned", set())
    x = torch.ones(2)
    with pytest.warns(UserWarning, match="reference runs instead"):
        assert use_triton(x, op="demo") is False
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a second warning would raise here
        assert use_triton(x, op="demo") is False


def test_use_triton_on_cpu_under_interpreter(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert use_triton(torch.ones(2)) is True


def test_use_triton_rejects_other_devices():
    with pytest.raises(ValueError, match="meta"):
        use_triton(torch.ones(2, device="meta"), op="demo")


def _smem(config, args):
    return config.kwargs["BLOCK"] * 4 * config.num_stages


def test_pick_config_takes_the_first_preferred_that_fits(monkeypatch):
    big, mid, small = (
        triton.Config({"BLOCK": b}, num_warps=w, num_stages=2) for b, w in ((16384, 8), (4096, 4), (64, 1))
    )
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    monkeypatch.setattr(_utils, "device_index_of", lambda args: 0)
    monkeypatch.setattr(_utils, "shared_memory_limit", lambda index: 99 * 1024)  # a consumer GPU's 99 KB
    assert pick_config([big, mid], small, _smem, {}) == {"BLOCK": 4096, "num_warps": 4, "num_stages": 2}
    monkeypatch.setattr(_utils, "shared_memory_limit", lambda index: 227 * 1024)  # an H100's
    assert pick_config([big, mid], small, _smem, {})["BLOCK"] == 16384
    monkeypatch.setattr(_utils, "shared_memory_limit", lambda index: 1024)  # nothing preferred fits
    assert pick_config([big, mid], small, _smem, {})["BLOCK"] == 64


def test_pick_config_interpreted_takes_the_smallest(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    small = triton.Config({"BLOCK": 64}, num_warps=1, num_stages=1)
    assert pick_config([triton.Config({"BLOCK": 4096})], small, _smem, {}) == meta(small)


@pytest.mark.parametrize("value, expected", [("1", True), ("on", True), ("0", False), ("", False)])
def test_autotune_requested(monkeypatch, value, expected):
    monkeypatch.setenv("KERNEL_LIB_AUTOTUNE", value)
    assert autotune_requested() is expected


def test_launch_or_op_is_the_launcher_in_eager_mode():
    launcher, op = (lambda: "launcher"), (lambda: "op")
    assert launch_or_op(launcher, op) is launcher


class _FakeTuner:
    """What persist_choices touches of a triton.autotune object: fn, configs, cache, run (which tunes once per key)."""

    def __init__(self, configs):
        self.fn = types.SimpleNamespace(__name__="_demo_kernel", src="def _demo_kernel(): pass")
        self.configs, self.cache, self.tunings = configs, {}, 0

    def run(self, *args, key=(1024, "torch.float16"), **kwargs):
        if key not in self.cache:
            self.tunings += 1
            self.cache[key] = self.configs[-1]
        return self.cache[key]


def test_persist_choices_survives_a_new_process(monkeypatch, tmp_path):
    monkeypatch.setenv("KERNEL_LIB_CACHE_DIR", str(tmp_path))
    configs = [
        triton.Config({"BLOCK": 64}, num_warps=4, num_stages=2),
        triton.Config({"BLOCK": 256}, num_warps=8, num_stages=3),
    ]
    first = persist_choices(_FakeTuner(configs))
    first.run(key=(1024, "torch.float16"))
    files = list((tmp_path / "autotune").glob("_demo_kernel-*.json"))
    assert len(files) == 1 and json.loads(files[0].read_text())[0]["kwargs"] == {"BLOCK": 256}
    second = persist_choices(_FakeTuner(configs))  # a fresh tuner, as in a new process
    chosen = second.run(key=(1024, "torch.float16"))
    assert second.tunings == 0 and chosen.kwargs == {"BLOCK": 256} and chosen.num_warps == 8
    second.run(key=(2048, "torch.float16"))  # a new key is tuned and added to the same file
    assert second.tunings == 1 and len(json.loads(files[0].read_text())) == 2


def test_persist_choices_ignores_a_file_that_is_not_ours(monkeypatch, tmp_path):
    monkeypatch.setenv("KERNEL_LIB_CACHE_DIR", str(tmp_path))
    configs = [triton.Config({"BLOCK": 64})]
    tuner = persist_choices(_FakeTuner(configs))
    tuner.run()
    path = next((tmp_path / "autotune").glob("*.json"))
    path.write_text("{not json")
    fresh = persist_choices(_FakeTuner(configs))
    fresh.run()
    assert fresh.tunings == 1


def test_prune_by_shared_memory_keeps_what_fits(monkeypatch):
    configs = [triton.Config({"BLOCK": b}, num_stages=s) for b in (1024, 4096, 16384) for s in (2, 4)]
    monkeypatch.setattr(_utils, "device_index_of", lambda args: 0)
    monkeypatch.setattr(_utils, "shared_memory_limit", lambda index: 99 * 1024)  # a consumer GPU's 99 KB
    kept = prune_by_shared_memory(_smem)(configs, {})
    assert kept and all(_smem(c, {}) <= 99 * 1024 for c in kept)
    assert len(kept) == 4  # the 16384-wide blocks need 128 and 256 KB
    monkeypatch.setattr(_utils, "shared_memory_limit", lambda index: 1024)  # nothing fits: keep the smallest
    assert prune_by_shared_memory(_smem)(configs, {}) == [configs[0]]


def test_prune_by_shared_memory_leaves_cpu_alone():
    configs = [triton.Config({"BLOCK": 1 << 20})]
    assert prune_by_shared_memory(_smem)(configs, {"x": torch.ones(1)}) == configs


@pytest.mark.gpu
def test_shared_memory_limit_on_this_gpu():
    limit = _utils.shared_memory_limit(torch.cuda.current_device())
    assert 48 * 1024 <= limit <= 256 * 1024


# ------------------------------------------------------------- a real kernel built with these helpers
@triton.jit
def _scaled_add_kernel(
    x_ptr,  # first input, n elements
    y_ptr,  # second input, n elements
    out_ptr,  # output, n elements
    alpha,  # scale applied to y
    n,  # number of elements
    BLOCK: tl.constexpr,  # elements per program
):
    offsets = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offsets < n
    x = tl.load(x_ptr + offsets, mask=mask)
    y = tl.load(y_ptr + offsets, mask=mask)
    tl.store(out_ptr + offsets, x + alpha * y, mask=mask)


@pytest.mark.parametrize("n", [1, 1000, 4097])  # one element; not a multiple of any block
def test_a_triton_kernel_runs_through_the_helpers(device, n):
    from kernel_lib.validate import assert_all_written, poisoned_like, random_inputs

    x, y = random_inputs((n,), (n,), device=device)
    assert use_triton(x, y, op="scaled_add")
    out = poisoned_like(x)
    small, large = triton.Config({"BLOCK": 128}, num_warps=4, num_stages=1), triton.Config({"BLOCK": 1024})
    config = pick_config([large], small, lambda c, a: c.kwargs["BLOCK"] * 8, {"x": x})
    _scaled_add_kernel[(triton.cdiv(n, config["BLOCK"]),)](x, y, out, 0.5, n, **config)
    assert_all_written(out)
    torch.testing.assert_close(out, x + 0.5 * y)


@triton.jit
def _store_as_kernel(x_ptr, out_ptr, n, BLOCK: tl.constexpr):
    offsets = tl.arange(0, BLOCK)
    mask = offsets < n
    tl.store(out_ptr + offsets, tl.load(x_ptr + offsets, mask=mask).to(out_ptr.dtype.element_ty), mask=mask)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_low_precision_stores_round_to_nearest(device, dtype):
    # On a GPU this is the hardware's conversion; under the interpreter, tests/conftest.py patches its
    # truncating float32 -> bfloat16 cast so CPU tests see the GPU's rounding.
    x = torch.randn(1000, device=device)
    out = torch.empty(1000, device=device, dtype=dtype)
    _store_as_kernel[(1,)](x, out, 1000, BLOCK=1024)
    assert torch.equal(out, x.to(dtype))


# ------------------------------------------------------------------------- compile_fitting
@triton.jit
def _double_kernel(x_ptr, n, BLOCK: tl.constexpr):  # a kernel of its own, so no other test has compiled it
    offsets = tl.arange(0, BLOCK)
    mask = offsets < n
    tl.store(x_ptr + offsets, tl.load(x_ptr + offsets, mask=mask) * 2, mask=mask)


@pytest.mark.gpu
def test_compile_fitting_compiles_without_launching():
    x = torch.ones(100, device="cuda")
    cache = _double_kernel.device_caches[torch.cuda.current_device()][0]  # Triton's compiled-kernel cache
    before = len(cache)
    launches = [
        (_double_kernel, (1,), (x, 100), {}, [{"BLOCK": 128}]),
        (_double_kernel, (1,), (x, 100), {}, [{"BLOCK": 256}]),
    ]
    assert _utils.compile_fitting(("test", "double"), launches) == [{"BLOCK": 128}, {"BLOCK": 256}]
    assert len(cache) == before + 2  # both specializations compiled
    torch.cuda.synchronize()
    assert torch.equal(x, torch.ones_like(x))  # and nothing ran
    _utils.compile_fitting(("test", "double"), launches)  # the key is known: nothing more happens
    assert len(cache) == before + 2
    _double_kernel[(1,)](x, 100, BLOCK=128)
    assert torch.equal(x, torch.full_like(x, 2.0))


def _fake_kernel(shared_by_block: dict, compiled: list):
    """A stand-in for a JIT kernel whose compiled shared memory depends on its BLOCK."""

    def warmup(*args, grid, **kwargs):
        compiled.append(kwargs["BLOCK"])
        return types.SimpleNamespace(metadata=types.SimpleNamespace(shared=shared_by_block[kwargs["BLOCK"]]))

    return types.SimpleNamespace(warmup=warmup, __name__="fake_kernel")


@pytest.fixture
def compiled_shared_memory(monkeypatch):
    """compile_fitting as on a GPU of 1,000 bytes of shared memory, compiling one launch after another."""
    monkeypatch.setattr(_utils, "is_interpreting", lambda: False)
    monkeypatch.setattr(_utils, "shared_memory_limit", lambda index=0: 1000)
    monkeypatch.setattr(_utils, "_compile_side_by_side", lambda launches: None)
    monkeypatch.setattr(_utils, "_fitting_choices", {})


def test_compile_fitting_skips_a_config_the_compiler_made_too_large(compiled_shared_memory):
    compiled = []
    # the estimate let BLOCK 64 through, but its compiled kernel asks 1,200 bytes: the next candidate runs
    kernel = _fake_kernel({64: 1200, 32: 900, 16: 400}, compiled)
    candidates = [{"BLOCK": 64}, {"BLOCK": 32}, {"BLOCK": 16}]
    other = _fake_kernel({8: 100}, compiled)
    choice = _utils.compile_fitting(
        ("k",), [(kernel, (1,), (4,), {}, candidates), (other, (1,), (4,), {}, [{"BLOCK": 8}])]
    )
    assert choice == [{"BLOCK": 32}, {"BLOCK": 8}]
    assert compiled == [64, 8, 32, 8]
    assert _utils.compile_fitting(("k",), []) == choice  # remembered: nothing compiles again
    assert len(compiled) == 4


def test_compile_fitting_names_the_limit_when_nothing_fits(compiled_shared_memory):
    kernel = _fake_kernel({64: 4096, 32: 2048}, [])
    with pytest.raises(ValueError, match=r"no config fits this GPU's shared memory \(1,000 bytes.*needs 2048 bytes"):
        _utils.compile_fitting(("none",), [(kernel, (1,), (4,), {}, [{"BLOCK": 64}, {"BLOCK": 32}])])


def test_compile_fitting_takes_the_first_candidate_under_the_interpreter(monkeypatch):
    monkeypatch.setattr(_utils, "is_interpreting", lambda: True)
    kernel = _fake_kernel({}, compiled := [])
    assert _utils.compile_fitting(("i",), [(kernel, (1,), (4,), {}, [{"BLOCK": 64}])]) == [{"BLOCK": 64}]
    assert compiled == []
