"""C = A @ B in bfloat16 with float32 accumulation, written plainly: the search's starting point (specs/matmul.json).

Small tiles (32 x 32 x 32), tiles visited row by row (no grouping), one pipeline stage: correct, and far from
cuBLAS. 2*M*N*K FLOPs; each program reads a BLOCK_M x K strip of A and a K x BLOCK_N strip of B.
"""

import triton
import triton.language as tl


@triton.jit
def matmul(
    a,  # (M, K) bfloat16, contiguous
    b,  # (K, N) bfloat16, contiguous
    c,  # (M, N) output
    M, N, K,  # sizes
    DOT_FP32: tl.constexpr,  # upcast before tl.dot: Triton's interpreter (CPU) has no exact bfloat16 dot
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):  # fmt: skip
    pid = tl.program_id(0)
    num_pid_m = tl.cdiv(M, BLOCK_M)  # noqa: F841 - the grouped tile order (a move) uses it
    num_pid_n = tl.cdiv(N, BLOCK_N)
    pid_m = pid // num_pid_n
    pid_n = pid % num_pid_n
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    ks = tl.arange(0, BLOCK_K)
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k_ok = k0 + ks < K
        at = tl.load(a + rows[:, None] * K + (k0 + ks)[None, :], mask=(rows[:, None] < M) & k_ok[None, :], other=0.0)
        bt = tl.load(b + (k0 + ks)[:, None] * N + cols[None, :], mask=k_ok[:, None] & (cols[None, :] < N), other=0.0)
        if DOT_FP32:
            at = at.to(tl.float32)
            bt = bt.to(tl.float32)
        acc = tl.dot(at, bt, acc)
    out_ok = (rows[:, None] < M) & (cols[None, :] < N)
    tl.store(c + rows[:, None] * N + cols[None, :], acc.to(c.dtype.element_ty), mask=out_ok)
