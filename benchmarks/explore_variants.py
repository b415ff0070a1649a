"""Variants of the RMSNorm, LayerNorm and cross-entropy kernels, timed side by side on a GPU, to choose what ships.

Not a benchmark of the library: an experiment log. Each variant is checked against the shipped kernel's output
(and float64) before it is timed; the table prints the median time and GB/s of each against torch.compile of the
reference. What was learned is written up in benchmarks/NOTES.md. bf16, rows x D = 2^27 elements.

The prefetching backward kernels and the cross-entropy forward settings were adopted into kernel_lib after the
run recorded in NOTES.md: "shipped" is now the prefetching kernel, and the version without the prefetch, the
baseline of that run, is in git history (commit 6b0a795's kernel_lib/rms_norm.py and layer_norm.py).

Variants of the backward (one persistent program per few rows keeps a float32 dweight partial in registers):
  shipped        kernel_lib's kernel: one row per loop step, the next row's loads issued before this row's
                 reductions (double-buffered in registers), 4 programs per SM
  stages2/3      ``tl.range(..., num_stages=s)``: Triton's software pipeliner instead of the manual prefetch
  persm2/8       2 or 8 programs per SM, warps adjusted
  split          dx by a row-parallel kernel (many rows per program, no loop) and dweight by a column-blocked
                 reduction kernel that reads x and dy again (5 tensors moved instead of 3, but no serial loop)
Variants of the LayerNorm forward:
  shipped        mean, then the variance of the centred row: two dependent reductions
  shifted        sum and sum of squares of x - x[row, 0] in one pass (shift keeps the subtraction exact enough)
  warps/rows     the shipped kernel with other BLOCK_M and num_warps
Variants of the cross-entropy forward (T = 8192, V = 128256):
  shipped        per block: a max and a sum reduced across the whole program (two barriers per block)
  lanes          the running sum kept per lane and reduced once at the end: one reduction (the max) per block
"""

import argparse
import os
import sys

import torch
import triton
import triton.language as tl

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import importlib  # noqa: E402

from kernel_lib import bench  # noqa: E402, F401
from kernel_lib._utils import sm_count  # noqa: E402

rms_mod = importlib.import_module("kernel_lib.rms_norm")
ln_mod = importlib.import_module("kernel_lib.layer_norm")
ce_mod = importlib.import_module("kernel_lib.cross_entropy")


@triton.jit
def _rms_bwd_staged(
    dy_ptr, x_ptr, w_ptr, rstd_ptr, dx_ptr, dw_partial_ptr, dy_row_stride, x_row_stride, n_rows, D,
    rows_per_program, BLOCK_D: tl.constexpr, NUM_STAGES: tl.constexpr,
):  # fmt: skip
    pid = tl.program_id(0)
    cols = tl.arange(0, BLOCK_D)
    mask = cols < D
    w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    dw_acc = tl.zeros([BLOCK_D], dtype=tl.float32)
    row_start = pid.to(tl.int64) * rows_per_program
    for i in tl.range(0, rows_per_program, num_stages=NUM_STAGES):
        row = row_start + i
        row_mask = mask & (row < n_rows)
        x = tl.load(x_ptr + row * x_row_stride + cols, mask=row_mask, other=0.0).to(tl.float32)
        dy = tl.load(dy_ptr + row * dy_row_stride + cols, mask=row_mask, other=0.0).to(tl.float32)
        rstd = tl.load(rstd_ptr + row, mask=row < n_rows, other=0.0)
        xhat = x * rstd
        g = dy * w
        dx = (g - xhat * (tl.sum(g * xhat, axis=0) / D)) * rstd
        tl.store(dx_ptr + row * D + cols, dx.to(dx_ptr.dtype.element_ty), mask=row_mask)
        dw_acc += dy * xhat
    tl.store(dw_partial_ptr + pid * D + cols, dw_acc, mask=mask)


@triton.jit
def _rms_dx_rows(
    dy_ptr, x_ptr, w_ptr, rstd_ptr, dx_ptr, n_rows, D, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr,
):  # fmt: skip
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.arange(0, BLOCK_D)
    mask = (rows < n_rows)[:, None] & (cols < D)[None, :]
    offsets = rows.to(tl.int64)[:, None] * D + cols[None, :]
    x = tl.load(x_ptr + offsets, mask=mask, other=0.0).to(tl.float32)
    dy = tl.load(dy_ptr + offsets, mask=mask, other=0.0).to(tl.float32)
    w = tl.load(w_ptr + cols, mask=cols < D, other=0.0).to(tl.float32)
    rstd = tl.load(rstd_ptr + rows, mask=rows < n_rows, other=0.0)
    xhat = x * rstd[:, None]
    g = dy * w[None, :]
    dx = (g - xhat * (tl.sum(g * xhat, axis=1) / D)[:, None]) * rstd[:, None]
    tl.store(dx_ptr + offsets, dx.to(dx_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _rms_dw_columns(
    dy_ptr, x_ptr, rstd_ptr, dw_partial_ptr, n_rows, D, rows_per_split, BLOCK_R: tl.constexpr,
    BLOCK_C: tl.constexpr,
):  # fmt: skip
    cols = tl.program_id(0) * BLOCK_C + tl.arange(0, BLOCK_C)
    split = tl.program_id(1)
    acc = tl.zeros([BLOCK_R, BLOCK_C], dtype=tl.float32)
    start = split * rows_per_split
    for r in range(start, start + rows_per_split, BLOCK_R):
        rows = r + tl.arange(0, BLOCK_R)
        mask = (rows < n_rows)[:, None] & (cols < D)[None, :]
        offsets = rows.to(tl.int64)[:, None] * D + cols[None, :]
        x = tl.load(x_ptr + offsets, mask=mask, other=0.0).to(tl.float32)
        dy = tl.load(dy_ptr + offsets, mask=mask, other=0.0).to(tl.float32)
        rstd = tl.load(rstd_ptr + rows, mask=rows < n_rows, other=0.0)
        acc += dy * x * rstd[:, None]
    tl.store(dw_partial_ptr + split * D + cols, tl.sum(acc, axis=0), mask=cols < D)


@triton.jit
def _ln_fwd_shifted(
    x_ptr, w_ptr, b_ptr, y_ptr, mean_ptr, rstd_ptr, x_row_stride, n_rows, D, inv_D, eps,
    BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr,
):  # fmt: skip
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.arange(0, BLOCK_D)
    row_mask = rows < n_rows
    mask = row_mask[:, None] & (cols[None, :] < D)
    rows64 = rows.to(tl.int64)
    shift = tl.load(x_ptr + rows64 * x_row_stride, mask=row_mask, other=0.0).to(tl.float32)
    x = tl.load(x_ptr + rows64[:, None] * x_row_stride + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    xs = tl.where(mask, x - shift[:, None], 0.0)
    mean_s = tl.sum(xs, axis=1) * inv_D
    var = tl.maximum(tl.sum(xs * xs, axis=1) * inv_D - mean_s * mean_s, 0.0)
    mean = mean_s + shift
    rstd = 1.0 / tl.sqrt(var + eps)
    w = tl.load(w_ptr + cols, mask=cols < D, other=0.0).to(tl.float32)
    b = tl.load(b_ptr + cols, mask=cols < D, other=0.0).to(tl.float32)
    y = (x - mean[:, None]) * rstd[:, None] * w[None, :] + b[None, :]
    tl.store(y_ptr + rows64[:, None] * D + cols[None, :], y.to(y_ptr.dtype.element_ty), mask=mask)
    tl.store(mean_ptr + rows, mean, mask=row_mask)
    tl.store(rstd_ptr + rows, rstd, mask=row_mask)


@triton.jit
def _ce_fwd_lanes(
    logits_ptr, target_ptr, loss_ptr, lse_ptr, logits_row_stride, V, ignore_index, BLOCK_V: tl.constexpr,
):  # fmt: skip
    row = tl.program_id(0).to(tl.int64)
    row_ptr = logits_ptr + row * logits_row_stride
    target = tl.load(target_ptr + row)
    cols = tl.arange(0, BLOCK_V)
    m = -float("inf")
    s = tl.zeros([BLOCK_V], dtype=tl.float32)
    for start in range(0, V, BLOCK_V):
        mask = start + cols < V
        x = tl.load(row_ptr + start + cols, mask=mask, other=-float("inf")).to(tl.float32)
        m_new = tl.maximum(m, tl.max(x, axis=0))
        s = s * tl.where(m_new == -float("inf"), 0.0, tl.exp(m - m_new)) + tl.where(
            mask & (x > -float("inf")), tl.exp(x - m_new), 0.0
        )
        m = m_new
    lse = m + tl.log(tl.sum(s, axis=0))
    in_range = (target >= 0) & (target < V)
    x_t = tl.load(row_ptr + tl.where(in_range, target, 0)).to(tl.float32)
    loss = tl.where(in_range, lse - x_t, float("nan"))
    tl.store(loss_ptr + row, tl.where(target == ignore_index, 0.0, loss))
    tl.store(lse_ptr + row, lse)


def ce_forward_variant(name, logits, target):
    T, V = logits.shape
    loss = torch.empty(T, device=logits.device, dtype=torch.float32)
    lse = torch.empty_like(loss)
    block_v, warps = {"lanes4096w8": (4096, 8), "lanes8192w16": (8192, 16), "lanes2048w4": (2048, 4)}.get(name, (0, 0))
    if block_v:
        _ce_fwd_lanes[(T,)](logits, target, loss, lse, logits.stride(0), V, -100, block_v, num_warps=warps)
    else:
        block_v, warps = {"shipped": (4096, 8), "shipped8192w16": (8192, 16), "shipped2048w4": (2048, 4)}[name]
        ce_mod._ce_fwd_kernel[(T,)](
            logits, target, loss, lse, logits.stride(0), V, -100, 0.0, HAS_SMOOTHING=False, BLOCK_V=block_v,
            num_warps=warps,
        )  # fmt: skip
    return loss, lse


def explore_cross_entropy(record, T=8192, V=128256):
    logits = torch.randn(T, V, device="cuda", dtype=torch.bfloat16) * 4
    target = torch.randint(0, V, (T,), device="cuda")
    want_loss, want_lse = ce_mod._forward(logits, target, -100, 0.0)
    compiled = torch.compile(lambda x, t: torch.nn.functional.cross_entropy(x.float(), t))
    nbytes = logits.numel() * logits.element_size()
    compiled_ms = record(f"ce fwd V={V}", "compiled F.cross_entropy", lambda: compiled(logits, target), 1, nbytes)
    variants = ("shipped", "shipped8192w16", "shipped2048w4", "lanes4096w8", "lanes8192w16", "lanes2048w4")
    for variant in variants:
        try:
            loss, lse = ce_forward_variant(variant, logits, target)
            torch.testing.assert_close(lse, want_lse, atol=1e-4, rtol=1e-5)
            torch.testing.assert_close(loss, want_loss, atol=1e-4, rtol=1e-5)
        except Exception as error:
            print(f"ce fwd {variant}: FAILED {type(error).__name__}: {str(error).splitlines()[0][:120]}")
            continue
        record(
            f"ce fwd V={V}", variant, lambda v=variant: ce_forward_variant(v, logits, target), 1, nbytes, compiled_ms
        )


def rms_backward_variant(name, dy, x, w, rstd):
    n_rows, D = x.shape
    block_d = triton.next_power_of_2(D)
    dx = torch.empty_like(x)
    if name == "split":
        block_m = max(1, 16384 // (block_d * x.element_size()))
        warps = 8 if block_d * block_m <= 8192 else 16
        _rms_dx_rows[(triton.cdiv(n_rows, block_m),)](dy, x, w, rstd, dx, n_rows, D, block_d, block_m, num_warps=warps)
        block_c, block_r = 128, 32
        col_blocks = triton.cdiv(D, block_c)
        splits = max(1, min(triton.cdiv(n_rows, block_r), 4 * sm_count() // col_blocks))
        rows_per_split = triton.cdiv(triton.cdiv(n_rows, splits), block_r) * block_r
        splits = triton.cdiv(n_rows, rows_per_split)
        partial = torch.empty((splits, D), device=x.device, dtype=torch.float32)
        _rms_dw_columns[(col_blocks, splits)](
            dy, x, rstd, partial, n_rows, D, rows_per_split, block_r, block_c, num_warps=4
        )
        return dx, partial.sum(0).to(w.dtype)
    per_sm, warps = 4, 8
    if name.startswith("persm"):
        per_sm = int(name[5:])
        warps = {2: 16, 8: 4}[per_sm]
    programs = min(per_sm * sm_count(), n_rows)
    rows_per_program = triton.cdiv(n_rows, programs)
    programs = triton.cdiv(n_rows, rows_per_program)
    partial = torch.empty((programs, D), device=x.device, dtype=torch.float32)
    common = (dy, x, w, rstd, dx, partial, dy.stride(0), x.stride(0), n_rows, D, rows_per_program, block_d)
    if name.startswith("stages"):
        _rms_bwd_staged[(programs,)](*common, int(name[6:]), num_warps=warps)
    else:
        rms_mod._rms_norm_bwd_kernel[(programs,)](
            *common[:-1], HAS_WEIGHT=True, WEIGHT_GRAD=True, BLOCK_D=block_d, num_warps=warps
        )
    return dx, partial.sum(0).to(w.dtype)


def ln_forward_variant(name, x, w, b, eps=1e-5):
    n_rows, D = x.shape
    block_d = triton.next_power_of_2(D)
    y = torch.empty_like(x)
    mean = torch.empty(n_rows, device=x.device, dtype=torch.float32)
    rstd = torch.empty_like(mean)
    if name == "shifted":
        block_m = max(1, 16384 // (block_d * x.element_size()))
        _ln_fwd_shifted[(triton.cdiv(n_rows, block_m),)](
            x, w, b, y, mean, rstd, x.stride(0), n_rows, D, 1.0 / D, eps, block_d, block_m, num_warps=8
        )
        return y, mean, rstd
    block_m, warps = {"rows1w4": (1, 4), "rows1w8": (1, 8), "rows2w4": (2, 4), "rows4w8": (4, 8), "rows4w16": (4, 16)}[
        name
    ]
    ln_mod._layer_norm_fwd_kernel[(triton.cdiv(n_rows, block_m),)](
        x, w, b, y, mean, rstd, x.stride(0), n_rows, D, 1.0 / D, eps,
        HAS_WEIGHT=True, HAS_BIAS=True, BLOCK_D=block_d, BLOCK_M=block_m, num_warps=warps,
    )  # fmt: skip
    return y, mean, rstd


def ln_backward_with(dy, x, w, mean, rstd, per_sm=4, warps=8):
    """kernel_lib's LayerNorm backward kernel with another number of programs per SM and of warps."""
    n_rows, D = x.shape
    block_d = triton.next_power_of_2(D)
    dx = torch.empty_like(x)
    programs = min(per_sm * sm_count(), n_rows)
    rows_per_program = triton.cdiv(n_rows, programs)
    programs = triton.cdiv(n_rows, rows_per_program)
    partial = torch.empty((2, programs, D), device=x.device, dtype=torch.float32)  # dweight's, then dbias's
    ln_mod._layer_norm_bwd_kernel[(programs,)](
        dy, x, w, mean, rstd, dx, partial, dy.stride(0), x.stride(0), n_rows, D, 1.0 / D, rows_per_program,
        HAS_WEIGHT=True, WEIGHT_GRAD=True, BIAS_GRAD=True, BLOCK_D=block_d, num_warps=warps,
    )  # fmt: skip
    dw, db = partial.sum(1).to(w.dtype)
    return dx, dw, db


def explore_width(D, n_rows, record):
    x = torch.randn(n_rows, D, device="cuda", dtype=torch.bfloat16)
    dy = torch.randn_like(x)
    w = torch.rand(D, device="cuda", dtype=torch.bfloat16) + 0.5
    b = torch.randn(D, device="cuda", dtype=torch.bfloat16)
    nbytes = x.numel() * x.element_size()

    # ---- RMSNorm backward
    y, rstd = rms_mod._forward(x, w, 1e-6)
    want_dx, want_dw = rms_mod._backward(dy, x, w, rstd)
    xr = x.detach().requires_grad_()
    wr = w.detach().requires_grad_()
    compiled = torch.compile(rms_mod.rms_norm_ref)
    out = compiled(xr, wr)
    compiled_ms = record(
        f"rms bwd D={D}",
        "compiled ref (f+b)",
        lambda: torch.autograd.grad(compiled(xr, wr), (xr, wr), dy),
        5,
        nbytes,
    )
    fwd_ms = record(f"rms fwd D={D}", "shipped", lambda: rms_mod._forward(x, w, 1e-6), 2, nbytes)
    del out
    for variant in ("shipped", "stages2", "stages3", "persm2", "persm8", "split"):
        try:
            dx, dw = rms_backward_variant(variant, dy, x, w, rstd)
            torch.testing.assert_close(dx, want_dx, atol=2e-2, rtol=2e-2)
            torch.testing.assert_close(dw.float(), want_dw.float(), atol=0.5, rtol=2e-2)
        except Exception as error:  # a variant that fails to compile or is wrong is reported, not fatal
            print(f"rms bwd {variant}: FAILED {type(error).__name__}: {str(error).splitlines()[0][:120]}")
            continue
        ms = record(f"rms bwd D={D}", variant, lambda v=variant: rms_backward_variant(v, dy, x, w, rstd), 3, nbytes)
        print(f"{'':28s} {'  fwd+bwd':22s} {fwd_ms + ms:8.4f} ms  vs compiled {compiled_ms / (fwd_ms + ms):.2f}x")

    # ---- LayerNorm forward
    want_y, want_mean, want_rstd = ln_mod._forward(x, w, b, 1e-5)
    compiled_ln = torch.compile(ln_mod.layer_norm_ref)
    compiled_ms = record(f"ln fwd D={D}", "compiled ref", lambda: compiled_ln(x, w, b), 2, nbytes)
    record(f"ln fwd D={D}", "torch layer_norm", lambda: torch.nn.functional.layer_norm(x, (D,), w, b), 2, nbytes)
    record(f"ln fwd D={D}", "shipped", lambda: ln_mod._forward(x, w, b, 1e-5), 2, nbytes, compiled_ms)
    for variant in ("shifted", "rows1w4", "rows1w8", "rows2w4", "rows4w8", "rows4w16"):
        try:
            got_y, got_mean, got_rstd = ln_forward_variant(variant, x, w, b)
            torch.testing.assert_close(got_y, want_y, atol=2e-2, rtol=2e-2)
            torch.testing.assert_close(got_rstd, want_rstd, atol=1e-4, rtol=1e-4)
        except Exception as error:
            print(f"ln fwd {variant}: FAILED {type(error).__name__}: {str(error).splitlines()[0][:120]}")
            continue
        record(f"ln fwd D={D}", variant, lambda v=variant: ln_forward_variant(v, x, w, b), 2, nbytes, compiled_ms)

    # ---- LayerNorm backward
    _, mean, rstd_ln = ln_mod._forward(x, w, b, 1e-5)
    want = ln_mod._backward(dy, x, w, b, mean, rstd_ln)
    xr = x.detach().requires_grad_()
    wr, br = w.detach().requires_grad_(), b.detach().requires_grad_()
    compiled_ms = record(
        f"ln bwd D={D}",
        "compiled ref (f+b)",
        lambda: torch.autograd.grad(compiled_ln(xr, wr, br), (xr, wr, br), dy),
        5,
        nbytes,
    )
    record(f"ln bwd D={D}", "shipped", lambda: ln_mod._backward(dy, x, w, b, mean, rstd_ln), 3, nbytes)
    for per_sm, warps in ((4, 8), (8, 4), (2, 16)):
        try:
            got = ln_backward_with(dy, x, w, mean, rstd_ln, per_sm, warps)
            torch.testing.assert_close(got[0], want[0], atol=2e-2, rtol=2e-2)
            torch.testing.assert_close(got[1].float(), want[1].float(), atol=0.5, rtol=2e-2)
            torch.testing.assert_close(got[2].float(), want[2].float(), atol=0.5, rtol=2e-2)
        except Exception as error:
            print(
                f"ln bwd {per_sm}/SM {warps} warps: FAILED {type(error).__name__}: {str(error).splitlines()[0][:120]}"
            )
            continue
        record(
            f"ln bwd D={D}",
            f"shipped, persm{per_sm} w{warps}",
            lambda p=per_sm, nw=warps: ln_backward_with(dy, x, w, mean, rstd_ln, p, nw),
            3,
            nbytes,
        )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--widths", default="4096")
    parser.add_argument("--elements", type=int, default=2**27)
    parser.add_argument("--parts", default="ce,norms")
    args = parser.parse_args()
    env = bench.environment()
    print(f"{env['device']} | torch {env['torch']} | triton {env['triton']}")
    copy = bench.copy_bandwidth()
    print(f"copy ceiling {copy:,.0f} GB/s", flush=True)
    results = []

    def record(op, variant, fn, tensors, nbytes_per_tensor, reference_ms=None):
        timing = bench.time_fn(fn)
        gbps = bench.gbps(tensors * nbytes_per_tensor, timing.median_ms)
        ratio = f"{reference_ms / timing.median_ms:.2f}x" if reference_ms else ""
        results.append((op, variant, timing.median_ms, gbps, ratio))
        print(f"{op:28s} {variant:22s} {timing.median_ms:8.4f} ms {gbps:8,.0f} GB/s {100 * gbps / copy:5.1f}%  {ratio}")
        return timing.median_ms

    if "ce" in args.parts:
        explore_cross_entropy(record)
    if "norms" in args.parts:
        for D in (int(v) for v in args.widths.split(",")):
            explore_width(D, args.elements // D, record)
    return 0


if __name__ == "__main__":
    sys.exit(main())
