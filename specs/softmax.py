"""Softmax forward over rows, written plainly: the search's starting point (specs/softmax.json).

y[r, :] = exp(x[r, :] - max x[r, :]) / sum exp(x[r, :] - max x[r, :]). One program handles ROWS rows, each
loaded whole (BLOCK_N >= N) and reduced in registers; the baseline has one row per program and one warp, so each
thread holds a long strip of the row. kernel_lib.ops.softmax is the hand-tuned one.
"""

import triton
import triton.language as tl


@triton.jit
def softmax_fwd(
    x,  # (M, N) logits, contiguous
    y,  # (M, N) probabilities
    M,  # rows
    N,  # columns
    BLOCK_N: tl.constexpr,  # a power of two >= N: the whole row
    ROWS: tl.constexpr,  # rows per program
):
    cols = tl.arange(0, BLOCK_N)
    for r in range(0, ROWS):
        row = tl.program_id(0) * ROWS + r
        ok = (cols < N) & (row < M)
        v = tl.load(x + row.to(tl.int64) * N + cols, mask=ok, other=-float("inf")).to(tl.float32)
        num = tl.exp(v - tl.max(v, axis=0))
        out = num / tl.sum(num, axis=0)
        tl.store(y + row.to(tl.int64) * N + cols, out.to(y.dtype.element_ty), mask=ok)
