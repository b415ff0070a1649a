"""The forward-and-backward check every kernel test uses: kernel against float64, allowance from PyTorch's own
low-precision result (kernel_lib.validate's rule)."""

import importlib.util
from collections.abc import Callable, Sequence
from pathlib import Path

import torch

from kernel_lib.ops._utils import is_interpreting
from kernel_lib.validate import assert_close, check, report

BF16_ROUNDS_TO_NEAREST = True  # set by round_bf16_to_nearest_in_interpreter() when the patch cannot apply


def round_bf16_to_nearest_in_interpreter() -> bool:
    """Make Triton's interpreter round float32 -> bfloat16 to nearest even, as the GPU does.

    The interpreter (seen with triton 3.7.1) converts float32 to bfloat16 by truncating the mantissa: a bf16
    store then errs by up to one ulp instead of half, and y = 0.9999 is stored as 0.996 rather than 1.0. That
    is the simulator's doing, not the kernel's, and it would fail the factor-of-2 rule on correct kernels.
    The kernels are unchanged; only the interpreter's cast is replaced by torch's correctly rounded one. If
    this triton's interpreter is laid out differently, nothing is patched and bf16 checks on the CPU get a
    factor of 4 instead (see allowed_factor).
    """
    global BF16_ROUNDS_TO_NEAREST
    try:
        import numpy as np
        import triton.language as tl
        from triton.runtime import interpreter

        builder = interpreter.InterpreterBuilder
        original = builder.cast_impl
        handle = interpreter.TensorHandle
    except (ImportError, AttributeError):
        BF16_ROUNDS_TO_NEAREST = False
        return False

    def cast_impl(self, src, dst_type):
        if src.dtype.scalar == tl.float32 and dst_type.scalar == tl.bfloat16:
            values = torch.from_numpy(np.ascontiguousarray(src.data, dtype=np.float32))
            bits = values.to(torch.bfloat16).view(torch.int16).numpy().view(np.uint16)
            return handle(bits, dst_type.scalar)
        return original(self, src, dst_type)

    builder.cast_impl = cast_impl
    return True


def allowed_factor(inputs: Sequence) -> float:
    """The rule's factor: 2; 4 for bfloat16 on an interpreter whose truncating cast could not be patched."""
    has_bf16 = any(isinstance(t, torch.Tensor) and t.dtype == torch.bfloat16 for t in inputs)
    on_cpu = any(isinstance(t, torch.Tensor) and t.device.type == "cpu" for t in inputs)
    return 4.0 if has_bf16 and on_cpu and is_interpreting() and not BF16_ROUNDS_TO_NEAREST else 2.0


def rows_input(shape, dtype, device, layout="contiguous", offset=0.0) -> torch.Tensor:
    """A random (..., D) input in one of the layouts the row kernels must handle, created in ``dtype`` so the
    layout survives (a later ``.to(dtype)`` would copy it to contiguous)."""
    D = shape[-1]
    if layout == "transposed":  # last dim strided: the launcher must copy
        return (offset + torch.randn(D, *shape[:-1], device=device)).to(dtype).movedim(0, -1)
    if layout == "sliced":  # rows with a stride larger than their width: no copy needed
        return (offset + torch.randn(*shape[:-1], D + 3, device=device)).to(dtype)[..., :D]
    return (offset + torch.randn(shape, device=device)).to(dtype)


def _like(value, dtype=None, requires_grad=False):
    if not isinstance(value, torch.Tensor):
        return value
    out = value.detach().to(dtype) if dtype is not None and value.is_floating_point() else value.detach()
    return out.requires_grad_(requires_grad and out.is_floating_point())


def check_forward_backward(
    kernel: Callable,
    reference: Callable,
    inputs: Sequence,
    *,
    atol: float,
    rtol: float = 0.0,
    grads: Sequence[int] | None = None,
    name: str = "out",
    baseline: Callable | None = None,
) -> str:
    """Run ``kernel`` and ``reference`` on ``inputs`` (low precision) and ``reference`` in float64; compare the
    output and the gradients of the inputs at positions ``grads`` (default: every floating tensor).

    ``baseline`` is PyTorch's own computation in the inputs' precision, whose error sets the allowance (default:
    ``reference`` run on the low-precision inputs). Inputs keep their layout (strides) for the kernel; the
    float64 reference gets dense copies. Returns the report; raises AssertionError listing every comparison.
    """
    if grads is None:
        grads = [i for i, t in enumerate(inputs) if isinstance(t, torch.Tensor) and t.is_floating_point()]
    lowp = [_like(t, requires_grad=i in grads) for i, t in enumerate(inputs)]
    # Same values in the same layout: the kernel and PyTorch's baseline see identical tensors.
    base_in = [_like(t, requires_grad=i in grads) for i, t in enumerate(inputs)]
    ref_in = [_like(t, torch.float64, requires_grad=i in grads) for i, t in enumerate(inputs)]

    out = kernel(*lowp)
    base = (baseline or reference)(*base_in)
    ref = reference(*ref_in)
    assert out.dtype == base.dtype, f"{name}: kernel returned {out.dtype}, PyTorch {base.dtype}"
    factor = allowed_factor(inputs)
    checks = [check(out, ref, base, name=name, atol=atol, rtol=rtol, factor=factor)]
    if grads:
        upstream = torch.randn(out.shape, dtype=torch.float64, device=out.device)
        wrt = [lowp[i] for i in grads]
        got = torch.autograd.grad(out, wrt, upstream.to(out.dtype))
        want = torch.autograd.grad(ref, [ref_in[i] for i in grads], upstream)
        have = torch.autograd.grad(base, [base_in[i] for i in grads], upstream.to(base.dtype))
        for i, g, w, h in zip(grads, got, want, have, strict=True):
            assert g.dtype == lowp[i].dtype, f"d(input {i}) came back as {g.dtype}, not {lowp[i].dtype}"
            checks.append(check(g, w, h, name=f"d(input {i})", atol=atol, rtol=rtol, factor=factor))
    text = report(checks)
    for c in checks:
        if not c.ok:
            raise AssertionError(text)
    return text


def _grad_leaves(inputs: Sequence) -> list:
    """Fresh copies of ``inputs`` (same layout), each tensor requiring grad exactly when the original does."""
    return [_like(t, requires_grad=isinstance(t, torch.Tensor) and t.requires_grad) for t in inputs]


def check_compiled_matches_eager(fn: Callable, inputs: Sequence, *, atol: float = 1e-5, rtol: float = 1e-5):
    """``torch.compile(fn, fullgraph=True)`` (any graph break raises) against ``fn`` in eager mode, forward and
    backward: the outputs and the gradients of every input that requires grad must match. Returns the compiled
    output, for further checks."""
    eager_in, compiled_in = _grad_leaves(inputs), _grad_leaves(inputs)
    want = fn(*eager_in)
    got = torch.compile(fn, fullgraph=True)(*compiled_in)
    torch.testing.assert_close(got, want, atol=atol, rtol=rtol)
    wrt = [i for i, t in enumerate(inputs) if isinstance(t, torch.Tensor) and t.requires_grad]
    dy = torch.randn_like(want)
    want_grads = torch.autograd.grad(want, [eager_in[i] for i in wrt], dy)
    got_grads = torch.autograd.grad(got, [compiled_in[i] for i in wrt], dy)
    for i, g, w in zip(wrt, got_grads, want_grads, strict=True):
        torch.testing.assert_close(g, w, atol=atol, rtol=rtol, msg=lambda m, i=i: f"d(input {i}), compiled: {m}")
    return got


def check_frozen_inputs_get_no_gradient(
    fn: Callable, reference: Callable, inputs: Sequence, *, compiled: bool, atol: float = 1e-4, rtol: float = 1e-4
) -> None:
    """Backward through ``fn`` (eager, or compiled with fullgraph=True) leaves ``.grad`` None on every input that
    does not require grad (a frozen parameter), and matches ``reference``'s gradients on the others."""
    fn = torch.compile(fn, fullgraph=True) if compiled else fn
    inputs = _grad_leaves(inputs)
    out = fn(*inputs)
    dy = torch.randn_like(out)
    out.backward(dy)
    leaves = _grad_leaves(inputs)
    reference(*leaves).backward(dy)
    for i, (got, want) in enumerate(zip(inputs, leaves, strict=True)):
        if not isinstance(got, torch.Tensor):
            continue
        assert (got.grad is None) == (want.grad is None), f"input {i}: grad {got.grad is not None} vs reference"
        if want.grad is not None:
            torch.testing.assert_close(got.grad, want.grad, atol=atol, rtol=rtol)


def check_cpu_fallback(monkeypatch, fn: Callable, reference: Callable, inputs: Sequence, **tolerances) -> None:
    """On CPU tensors without ``TRITON_INTERPRET``, ``fn`` warns once that the reference runs instead, returns
    the reference's result, and its gradients pass ``check_forward_backward`` (autograd through the reference)."""
    import pytest

    from kernel_lib.ops import _utils

    monkeypatch.setenv("TRITON_INTERPRET", "0")
    monkeypatch.setattr(_utils, "_warned", set())
    with pytest.warns(UserWarning, match="reference runs instead"):
        out = fn(*inputs)
    torch.testing.assert_close(out, reference(*inputs), atol=1e-6, rtol=1e-6)
    check_forward_backward(fn, reference, inputs, **tolerances)


__all__ = [
    "check_forward_backward",
    "check_compiled_matches_eager",
    "check_frozen_inputs_get_no_gradient",
    "check_cpu_fallback",
    "rows_input",
    "assert_close",
]


def load_script(name: str):
    """``benchmarks/<name>.py`` imported as a module (the scripts are not a package)."""
    path = Path(__file__).resolve().parents[1] / "benchmarks" / f"{name}.py"
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def saved_storages(fn: Callable, exclude: Sequence[torch.Tensor] = ()) -> tuple[dict[int, int], object]:
    """What autograd keeps for the backward while ``fn()`` runs, as {storage pointer: elements}, each storage once
    (views of one tensor count once), the storages of ``exclude`` (weights, parameters) left out; and fn's result."""
    skip = {t.untyped_storage().data_ptr() for t in exclude}
    seen: dict[int, int] = {}

    def pack(t):
        ptr = t.untyped_storage().data_ptr()
        if ptr not in skip:
            seen[ptr] = t.untyped_storage().nbytes() // t.element_size()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = fn()
    return seen, out


class TinyLM(torch.nn.Module):
    """Three linear layers with an output projection named like a language model's (``lm_head``): what the tests of
    the layer-swapping helpers (``quantize_``, ``convert_to_float8``) convert."""

    def __init__(self):
        super().__init__()
        self.up, self.down, self.lm_head = torch.nn.Linear(64, 128), torch.nn.Linear(128, 64), torch.nn.Linear(64, 10)

    def forward(self, x):
        return self.lm_head(self.down(torch.relu(self.up(x))))
