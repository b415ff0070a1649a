"""The Hopper forward (kernel_lib/ops/attention_hopper.py) and how attention.py chooses it.

On the CPU: the Gluon kernel compiles for an SM90 target (Triton bundles ptxas, no GPU needed) for every class of
head dims and masks the launcher routes to it, and what the compiler allocates fits a block's shared memory; the
launcher's checks of the tensors. On an SM90 GPU: the kernel against float64 and against the portable kernel, on
the cases its code branches on; forcing the portable kernel. FlashAttention's grid (test_attention_grid.py) runs
through the library's default path, so on an H100/H200 it covers this kernel for head dims up to 128.
"""

import json
import os
import subprocess
import sys

import pytest
import torch

from kernel_lib.ops import attention as attention_module
from kernel_lib.ops import attention_hopper as hopper
from kernel_lib.ops.attention import attention_ref, flash_attention

needs_gluon = pytest.mark.skipif(not hopper.AVAILABLE, reason="this Triton has no Gluon Hopper module")
IS_SM90 = torch.cuda.is_available() and torch.cuda.get_device_capability()[0] == 9


COMPILED_CASES = [  # (D, Dv, causal, window, dtype, packed, backward)
    (128, 128, False, False, "bf16", False, False),  # q's tile stages the output (equal widths)
    (128, 128, True, True, "bf16", False, False),  # masked blocks at both ends of the key range
    (64, 64, True, False, "bf16", False, False),  # 64-wide tiles
    (128, 64, True, False, "bf16", False, False),  # Dv != D: a separate output tile
    (80, 80, False, False, "bf16", False, False),  # a padded head dim
    (128, 128, True, False, "fp16", False, False),
    (128, 128, True, True, "bf16", True, False),  # packed sequences: offsets read in the kernel, a masked store
    (128, 128, False, False, "bf16", False, True),  # the backward: the widest tiles, closest to the limit
    (128, 128, True, True, "fp16", False, True),  # masked query blocks at both ends
    (80, 64, True, False, "bf16", False, True),  # padded head dims, Dv != D
]
# Under the interpreter (these tests' CPU session) Gluon kernels cannot be compiled: a fresh process compiles them.
_COMPILE = """
import json, sys, torch
from kernel_lib.ops import attention_hopper as hopper
out = []
dtypes = {"bf16": torch.bfloat16, "fp16": torch.float16}
for D, Dv, causal, window, dtype, packed, backward in json.loads(sys.argv[1]):
    kernel = hopper.compile_for_sm90(D, Dv, dtypes[dtype], causal, window, packed, backward)
    ptx = kernel.asm["ptx"]
    out.append(dict(shared=kernel.metadata.shared, wgmma="wgmma.mma_async" in ptx,
                    tma="cp.async.bulk.tensor" in ptx, setmaxnreg="setmaxnreg" in ptx,
                    reduce="cp.reduce.async.bulk.tensor" in ptx))
print(json.dumps(out))
"""


@pytest.fixture(scope="module")
def compiled_for_sm90() -> dict:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    run = subprocess.run([sys.executable, "-c", _COMPILE, json.dumps(COMPILED_CASES)], capture_output=True,
                         text=True, env=env, cwd=os.path.dirname(os.path.dirname(__file__)), timeout=600)  # fmt: skip
    assert run.returncode == 0, run.stderr[-3000:]
    return dict(zip(map(tuple, COMPILED_CASES), json.loads(run.stdout.splitlines()[-1]), strict=True))


@needs_gluon
@pytest.mark.parametrize("case", COMPILED_CASES, ids=lambda case: "-".join(map(str, case)))
def test_kernel_compiles_for_sm90_and_fits_shared_memory(compiled_for_sm90, case):
    compiled = compiled_for_sm90[case]
    assert 0 < compiled["shared"] <= hopper.SHARED_LIMIT
    assert compiled["wgmma"]  # Hopper's warpgroup MMA, not the older mma.sync
    assert compiled["tma"]  # copies by the tensor memory accelerator
    assert compiled["setmaxnreg"]  # the warp-specialized partitions rebalance registers
    assert compiled["reduce"] == case[-1]  # the backward adds dq through the TMA's reduction, not atomics


@pytest.mark.parametrize(
    "D, stride_ok",
    [(64, True), (80, True), (59, False)],  # rows of 59 bf16 are 118 bytes: not a multiple of 16
)
def test_descriptor_ready_needs_16_byte_strides(D, stride_ok):
    t = torch.empty(2, 3, 5, D, dtype=torch.bfloat16)
    assert attention_module._descriptor_ready(t) == stride_ok
    assert not attention_module._descriptor_ready(t.transpose(-1, -2))  # the head dim must have unit stride
    assert not attention_module._descriptor_ready(t[:, :, :0])  # empty: no descriptor to make


def test_unknown_path_is_an_error(monkeypatch):
    monkeypatch.setenv("KERNEL_LIB_ATTENTION", "fast")
    q = torch.randn(1, 1, 4, 16, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="KERNEL_LIB_ATTENTION"):
        attention_module.uses_hopper_forward(q, q, q, q, 1.0)


def test_cpu_tensors_take_the_portable_kernel():
    q = torch.randn(1, 2, 64, 64, dtype=torch.bfloat16)
    assert not attention_module.uses_hopper_forward(q, q, q, q, 0.125)
    assert attention_module.forward_config(q, q, q)["path"] == "portable"


sm90 = pytest.mark.skipif(not IS_SM90, reason="needs an SM90 GPU (H100, H200)")


# Odd cases for both directions; head dims the backward takes (65 to 128 for q and k), which the forward takes too
ODD_CASES = [
    (2, 4, 2, 1000, 1000, 128, 128, True, None, torch.bfloat16),  # GQA, a ragged last block
    (1, 4, 1, 300, 700, 128, 128, True, None, torch.float16),  # MQA, M > N: bottom-right causal
    (1, 2, 2, 700, 300, 128, 128, True, None, torch.bfloat16),  # N > M: queries that see no key
    (2, 3, 3, 513, 513, 80, 80, False, None, torch.bfloat16),  # padded head dim, ragged key block
    (1, 4, 4, 1024, 1024, 96, 96, True, 200, torch.bfloat16),  # window: masked blocks at both ends
    (1, 2, 1, 129, 1, 128, 128, False, None, torch.float16),  # one key
    (1, 2, 2, 2048, 2048, 128, 64, True, 1000, torch.bfloat16),  # Dv != D, long window
    (3, 2, 2, 1, 77, 72, 72, True, None, torch.bfloat16),  # one query
    (1, 2, 2, 333, 333, 104, 128, False, None, torch.float16),  # Dv > D
]
ODD_CASE_NAMES = "B, Hq, Hkv, N, M, D, Dv, causal, window, dtype"


@pytest.mark.gpu
@sm90
@pytest.mark.parametrize(
    ODD_CASE_NAMES,
    ODD_CASES
    + [
        (1, 4, 1, 300, 700, 64, 64, True, None, torch.float16),  # head dim 64: a tile the backward does not take
        (1, 2, 1, 129, 1, 40, 40, False, None, torch.float16),  # head dim 40, padded to 64
        (1, 2, 2, 4096, 4096, 128, 64, True, 1000, torch.bfloat16),  # a longer sequence than the backward's
        (1, 2, 2, 333, 333, 64, 128, False, None, torch.float16),  # Dv > D, D 64
    ],
)
def test_hopper_forward_against_float64(B, Hq, Hkv, N, M, D, Dv, causal, window, dtype):
    q = torch.randn(B, Hq, N, D, device="cuda", dtype=dtype)
    k = torch.randn(B, Hkv, M, D, device="cuda", dtype=dtype)
    v = torch.randn(B, Hkv, M, Dv, device="cuda", dtype=dtype)
    assert attention_module.forward_config(q, k, v, causal, window)["path"] == "hopper"
    out, lse = flash_attention(q, k, v, causal=causal, window=window, return_lse=True)
    ref, ref_lse = attention_ref(q.double(), k.double(), v.double(), causal, window, return_lse=True)
    own = attention_ref(q, k, v, causal, window)  # fp32 math, rounded to q's dtype: the rounding alone
    tol = 2 * (own.double() - ref).abs().max().item() + (1e-3 if dtype == torch.float16 else 1e-2)
    assert (out.double() - ref).abs().max().item() <= tol
    seen = torch.isfinite(ref_lse)
    assert torch.equal(torch.isfinite(lse), seen)  # -inf exactly where a query sees no key
    torch.testing.assert_close(lse[seen].double(), ref_lse[seen], atol=1e-4, rtol=1e-4)


def test_backward_path_choice_on_the_cpu(monkeypatch):
    q = torch.randn(1, 2, 64, 128)
    assert not attention_module.uses_hopper_backward(q, q, q, q, 0.1, packed=False)  # CPU tensors: portable


@pytest.mark.gpu
@sm90
@pytest.mark.parametrize(ODD_CASE_NAMES, ODD_CASES)
def test_hopper_backward_against_float64(B, Hq, Hkv, N, M, D, Dv, causal, window, dtype):
    q = torch.randn(B, Hq, N, D, device="cuda", dtype=dtype, requires_grad=True)
    k = torch.randn(B, Hkv, M, D, device="cuda", dtype=dtype, requires_grad=True)
    v = torch.randn(B, Hkv, M, Dv, device="cuda", dtype=dtype, requires_grad=True)
    g = torch.randn(B, Hq, N, Dv, device="cuda", dtype=dtype)
    assert attention_module.uses_hopper_backward(q, k, v, g, D**-0.5, packed=False)
    got = torch.autograd.grad(flash_attention(q, k, v, causal=causal, window=window), (q, k, v), g)
    inputs64 = [t.detach().double().requires_grad_() for t in (q, k, v)]
    ref = torch.autograd.grad(attention_ref(*inputs64, causal, window), inputs64, g.double())
    own = torch.autograd.grad(attention_ref(q, k, v, causal, window), (q, k, v), g)  # PyTorch's own rounding
    slack = 1e-3 if dtype == torch.float16 else 1e-2
    for name, ours, theirs, exact in zip("dq dk dv".split(), got, own, ref, strict=True):
        tol = 2 * (theirs.double() - exact).abs().max().item() + slack
        assert (ours.double() - exact).abs().max().item() <= tol, name


@pytest.mark.gpu
@sm90
def test_deterministic_algorithms_take_the_portable_backward():
    q = torch.randn(1, 2, 256, 128, device="cuda", dtype=torch.bfloat16)
    assert attention_module.uses_hopper_backward(q, q, q, q, 0.1, packed=False)
    previous = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True)
    try:
        assert not attention_module.uses_hopper_backward(q, q, q, q, 0.1, packed=False)  # dq's adds: no order
    finally:
        torch.use_deterministic_algorithms(previous)
    small = torch.randn(1, 2, 256, 64, device="cuda", dtype=torch.bfloat16)
    assert not attention_module.uses_hopper_backward(small, small, small, small, 0.1, packed=False)  # D <= 64


@pytest.mark.gpu
@sm90
def test_portable_kernel_can_be_forced(monkeypatch):
    q, k, v = (torch.randn(2, 4, 512, 128, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    fast = flash_attention(q, k, v, causal=True)
    monkeypatch.setenv("KERNEL_LIB_ATTENTION", "portable")
    assert attention_module.forward_config(q, k, v, causal=True)["path"] == "portable"
    torch.testing.assert_close(flash_attention(q, k, v, causal=True), fast, atol=1e-2, rtol=0)


@pytest.mark.gpu
@sm90
def test_layouts_the_tma_refuses_fall_back():
    q = torch.randn(1, 2, 64, 59, device="cuda", dtype=torch.bfloat16)  # 118-byte rows
    assert attention_module.forward_config(q, q, q)["path"] == "portable"
    wide = torch.randn(1, 2, 64, 160, device="cuda", dtype=torch.bfloat16)  # beyond the kernel's 128
    assert attention_module.forward_config(wide, wide, wide)["path"] == "portable"
    x = torch.randn(1, 64, 2, 128, device="cuda", dtype=torch.bfloat16).transpose(1, 2)  # (B, N, H, D) view
    assert attention_module.forward_config(x, x, x)["path"] == "hopper"  # any 16-byte strides work
    torch.testing.assert_close(flash_attention(x, x, x), attention_ref(x, x, x), atol=1e-2, rtol=0)


@pytest.mark.gpu
@sm90
@pytest.mark.parametrize(
    "lengths, Hq, Hkv, D, Dv, causal, window",
    [
        ([300, 0, 1, 700, 129], 4, 2, 128, 128, True, None),  # an empty and a one-token document, ragged ends
        ([1000, 24, 513], 2, 1, 64, 64, False, None),  # no mask: a tile spans the next document's rows
        ([2000, 77, 640], 4, 4, 96, 96, True, 100),  # windows restart per document
        ([128, 256, 384], 2, 2, 128, 64, True, None),  # lengths on tile boundaries, Dv != D
    ],
)
def test_hopper_forward_packed_against_float64(lengths, Hq, Hkv, D, Dv, causal, window):
    total = sum(lengths)
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], device="cuda", dtype=torch.int32)
    q = torch.randn(total, Hq, D, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(total, Hkv, D, device="cuda", dtype=torch.bfloat16)
    v = torch.randn(total, Hkv, Dv, device="cuda", dtype=torch.bfloat16)
    out_buf = torch.empty(total, Hq, Dv, device="cuda", dtype=torch.bfloat16)
    assert attention_module.uses_hopper_forward(q, k, v, out_buf, D**-0.5)
    out, lse = attention_module.flash_attention_varlen(q, k, v, cu, cu, max(lengths), max(lengths), causal=causal,
                                                       window=window, return_lse=True)  # fmt: skip
    ref, ref_lse = attention_module.attention_varlen_ref(q.double(), k.double(), v.double(), cu, cu, causal, window,
                                                         return_lse=True)  # fmt: skip
    own = attention_module.attention_varlen_ref(q, k, v, cu, cu, causal, window)
    tol = 2 * (own.double() - ref).abs().max().item() + 1e-2
    assert (out.double() - ref).abs().max().item() <= tol
    seen = torch.isfinite(ref_lse)
    assert torch.equal(torch.isfinite(lse), seen)
    torch.testing.assert_close(lse[seen].double(), ref_lse[seen], atol=1e-4, rtol=1e-4)


def test_a_backward_that_does_not_build_falls_back_once(monkeypatch):
    """The Gluon backward uses an op Gluon builds but does not name: where it fails to build, the backward warns
    once and runs the portable kernels, with the same gradients."""
    from kernel_lib.ops import _utils

    monkeypatch.setattr(_utils, "_warned", set())
    monkeypatch.setattr(attention_module, "_hopper_bwd_failed", None)
    monkeypatch.setattr(attention_module, "uses_hopper_forward", lambda *a: False)
    monkeypatch.setattr(attention_module, "uses_hopper_backward",
                        lambda *a: attention_module._hopper_bwd_failed is None)  # fmt: skip
    calls = []

    def broken(*args):
        calls.append(1)
        raise AttributeError("'GluonOpBuilder' object has no attribute 'create_async_tma_reduce'")

    monkeypatch.setattr(attention_module, "_hopper_backward", broken)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    q, k, v = (torch.randn(1, 2, 40, 32, dtype=torch.float16, device=device, requires_grad=True) for _ in range(3))
    g = torch.randn(1, 2, 40, 32, dtype=torch.float16, device=device)
    with pytest.warns(UserWarning, match="backward did not build"):
        got = torch.autograd.grad(flash_attention(q, k, v, causal=True), (q, k, v), g)
    want = torch.autograd.grad(attention_ref(q, k, v, causal=True), (q, k, v), g)
    for ours, theirs in zip(got, want, strict=True):
        torch.testing.assert_close(ours, theirs, atol=2e-3, rtol=0)
    assert "AttributeError" in attention_module._hopper_bwd_failed
    torch.autograd.grad(flash_attention(q, k, v), (q, k, v), g)  # later calls go straight to the portable kernels
    assert len(calls) == 1


def test_a_kernel_that_does_not_build_falls_back_once(monkeypatch):
    """Gluon is experimental: a Triton whose Gluon differs raises while building the kernel. The forward then warns
    once and runs the portable kernel, here and on every later call."""
    from kernel_lib.ops import _utils

    monkeypatch.setattr(_utils, "_warned", set())  # a fresh process, as far as warn_once knows
    monkeypatch.setattr(attention_module, "_hopper_failed", None)
    monkeypatch.setattr(attention_module, "uses_hopper_forward", lambda *a: attention_module._hopper_failed is None)
    calls = []

    def broken(*args):
        calls.append(1)
        raise TypeError("warp_specialize() got an unexpected keyword argument")

    monkeypatch.setattr(attention_module, "_hopper_forward", broken)
    device = "cuda" if torch.cuda.is_available() else "cpu"  # where the Triton kernels run in this session
    q, k, v = (torch.randn(1, 2, 40, 32, dtype=torch.float16, device=device) for _ in range(3))
    with pytest.warns(UserWarning, match="did not build"):
        out = flash_attention(q, k, v, causal=True)
    torch.testing.assert_close(out, attention_ref(q, k, v, causal=True), atol=2e-3, rtol=0)
    assert "TypeError" in attention_module._hopper_failed
    flash_attention(q, k, v)  # later calls go straight to the portable kernel
    assert len(calls) == 1
