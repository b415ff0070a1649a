"""RMSNorm forward, written plainly: the search's starting point (specs/rms_norm.json).

y[r, :] = x[r, :] / sqrt(mean(x[r, :]^2) + eps) * w. One program per row walks the row in narrow blocks twice
(sum of squares, then normalize), with few warps. Correct, and slow: kernel_lib.ops.norms is the hand-tuned one.
"""

import triton
import triton.language as tl


@triton.jit
def rms_norm_fwd(
    x,  # (M, N) rows to normalize, contiguous
    w,  # (N,) weight
    y,  # (M, N) output
    N,  # columns
    eps,  # added to the mean square
    BLOCK_N: tl.constexpr,  # columns per step
):
    row = tl.program_id(0).to(tl.int64)
    acc = tl.zeros([BLOCK_N], dtype=tl.float32)
    for start in range(0, N, BLOCK_N):
        cols = start + tl.arange(0, BLOCK_N)
        v = tl.load(x + row * N + cols, mask=cols < N, other=0.0).to(tl.float32)
        acc += v * v
    rstd = 1.0 / tl.sqrt(tl.sum(acc, axis=0) / N + eps)
    for start in range(0, N, BLOCK_N):
        cols = start + tl.arange(0, BLOCK_N)
        v = tl.load(x + row * N + cols, mask=cols < N, other=0.0).to(tl.float32)
        g = tl.load(w + cols, mask=cols < N, other=0.0).to(tl.float32)
        tl.store(y + row * N + cols, (v * rstd * g).to(y.dtype.element_ty), mask=cols < N)
