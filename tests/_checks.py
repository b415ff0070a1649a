"""The forward-and-backward check every kernel test uses: kernel against float64, allowance from PyTorch's own
low-precision result (kernel_lib.validate's rule)."""

from collections.abc import Callable, Sequence

import torch

from kernel_lib.validate import assert_close, check, report


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
) -> str:
    """Run ``kernel`` and ``reference`` on ``inputs`` (low precision) and ``reference`` in float64; compare the
    output and the gradients of the inputs at positions ``grads`` (default: every floating tensor).

    Inputs keep their layout (strides) for the kernel; the float64 reference gets dense copies. Returns the
    report; raises AssertionError naming the first quantity that breaks the rule.
    """
    if grads is None:
        grads = [i for i, t in enumerate(inputs) if isinstance(t, torch.Tensor) and t.is_floating_point()]
    lowp = [_like(t, requires_grad=i in grads) for i, t in enumerate(inputs)]
    # Same values in the same layout: the kernel and PyTorch's baseline see identical tensors.
    base_in = [_like(t, requires_grad=i in grads) for i, t in enumerate(inputs)]
    ref_in = [_like(t, torch.float64, requires_grad=i in grads) for i, t in enumerate(inputs)]

    out = kernel(*lowp)
    base = reference(*base_in)
    ref = reference(*ref_in)
    assert out.dtype == base.dtype, f"{name}: kernel returned {out.dtype}, PyTorch {base.dtype}"
    checks = [check(out, ref, base, name=name, atol=atol, rtol=rtol)]
    if grads:
        upstream = torch.randn(out.shape, dtype=torch.float64, device=out.device)
        wrt = [lowp[i] for i in grads]
        got = torch.autograd.grad(out, wrt, upstream.to(out.dtype))
        want = torch.autograd.grad(ref, [ref_in[i] for i in grads], upstream)
        have = torch.autograd.grad(base, [base_in[i] for i in grads], upstream.to(base.dtype))
        for i, g, w, h in zip(grads, got, want, have, strict=True):
            assert g.dtype == lowp[i].dtype, f"d(input {i}) came back as {g.dtype}, not {lowp[i].dtype}"
            checks.append(check(g, w, h, name=f"d(input {i})", atol=atol, rtol=rtol))
    text = report(checks)
    for c in checks:
        if not c.ok:
            raise AssertionError(text)
    return text


__all__ = ["check_forward_backward", "assert_close"]
