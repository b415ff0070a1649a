"""Variants of the RoPE kernel and of the cross-entropy forward, timed side by side on a GPU, to choose what ships.

Not a benchmark of the library: an experiment log (results in benchmarks/NOTES.md). Every variant's output is
compared with the shipped kernel's before it is timed. bf16; L2 wiped before every timed call.

RoPE, x of 2^27 elements, (B, H, N, D) = (4, 32, 2^27 / (4 * 32 * D), D), strided as a slice of a fused
projection (forward) or contiguous (the backward's dy):
  shipped            kernel_lib's kernel: one (batch, head) and 16 positions per program, 4 warps; every program
                     reads its own copy of its cos/sin block (float32) from L2
  ph_n{N}_w{W}       the same kernel, N positions per program, W warps
  heads_n{N}_h{H}_w{W}  N positions and H heads per program: the cos/sin block loaded once and used for H heads
Then forward + backward through autograd against torch.compile of the reference: as called, the host's time to
issue one step, and the GPU time from a CUDA graph; and where the host's time goes (--parts host): the median
host time of each layer of one call, and a cProfile of 200 steps (the timers and the profile are
explore_host_norms.py's). The run recorded in NOTES.md also timed the launch of the kernel before its arguments
were cut from 12 to 9 (commit f5931f8's kernel_lib/rope.py); it measured the same.

Cross-entropy forward, T = 8192, V = 128256:
  shipped          kernel_lib's kernel: the next block's load issued before this block's reductions
  b{B}w{W}         the same kernel with B-wide blocks and W warps
  staged{S}        no manual prefetch; Triton's software pipeliner (``tl.range(num_stages=S)``) instead
  ahead2           the loads of the next two blocks in flight
  evict            shipped, with ``eviction_policy="evict_first"`` on the streaming loads
Cross-entropy backward (reads the logits, writes the gradient): kernel_lib's kernel, bwd_b{B}w{W} settings.
"""

import argparse
import importlib
import os
import sys

import torch
import triton
import triton.language as tl

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from explore_host_norms import graph_ms, host_ms, profile_steps  # noqa: E402  (this folder is on sys.path)

from kernel_lib import bench  # noqa: E402

rope_mod = importlib.import_module("kernel_lib.rope")
ce_mod = importlib.import_module("kernel_lib.cross_entropy")
ROWS = []


def record(case, variant, fn, nbytes, peer_ms=None):
    ms = bench.time_fn(fn).median_ms
    row = {"case": case, "variant": variant, "ms": ms, "GB/s": bench.gbps(nbytes, ms)}
    if peer_ms is not None:
        row["vs peer"] = peer_ms / ms
    ROWS.append(row)
    extra = f"  {peer_ms / ms:5.2f}x" if peer_ms else ""
    print(f"{case:34s} {variant:22s} {ms:8.4f} ms {row['GB/s']:8.0f} GB/s{extra}", flush=True)
    return ms


# --------------------------------------------------------------------------------------------------
# RoPE
# --------------------------------------------------------------------------------------------------
@triton.jit
def _rope_heads(
    x_ptr, cos_ptr, sin_ptr, out_ptr, stride_b, stride_h, stride_n, cos_stride, sin_stride, H, N, HALF,
    SIN_SIGN: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_HALF: tl.constexpr, HEADS: tl.constexpr,
):  # fmt: skip
    n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    b = tl.program_id(1).to(tl.int64)
    first_head = tl.program_id(2) * HEADS
    i = tl.arange(0, BLOCK_HALF)
    mask = (n[:, None] < N) & (i[None, :] < HALF)
    c = tl.load(cos_ptr + n[:, None] * cos_stride + i[None, :], mask=mask, other=0.0).to(tl.float32)
    s = SIN_SIGN * tl.load(sin_ptr + n[:, None] * sin_stride + i[None, :], mask=mask, other=0.0).to(tl.float32)
    x_rows = x_ptr + b * stride_b + n[:, None].to(tl.int64) * stride_n + i[None, :]
    out_rows = out_ptr + (b * H * N + n[:, None].to(tl.int64)) * (2 * HALF) + i[None, :]
    for j in tl.static_range(HEADS):
        h = first_head + j
        head_mask = mask & (h < H)
        x_head = x_rows + h.to(tl.int64) * stride_h
        x1 = tl.load(x_head, mask=head_mask, other=0.0).to(tl.float32)
        x2 = tl.load(x_head + HALF, mask=head_mask, other=0.0).to(tl.float32)
        out_head = out_rows + h.to(tl.int64) * N * (2 * HALF)
        tl.store(out_head, (x1 * c - x2 * s).to(out_ptr.dtype.element_ty), mask=head_mask)
        tl.store(out_head + HALF, (x2 * c + x1 * s).to(out_ptr.dtype.element_ty), mask=head_mask)


def rope_variant(name, x, cos, sin, inverse=False):
    B, H, N, D = x.shape
    out = torch.empty((B, H, N, D), device=x.device, dtype=x.dtype)
    half = D // 2
    args = (x, cos, sin, out, x.stride(0), x.stride(1), x.stride(2), cos.stride(0), sin.stride(0), H, N, half)
    sign = -1.0 if inverse else 1.0
    if name == "shipped":
        return rope_mod._rotate(x, cos, sin, inverse)
    if name.startswith("ph_"):
        block_n, warps = (int(part[1:]) for part in name[3:].split("_"))
        rope_mod._rope_kernel[(B * H, triton.cdiv(N, block_n))](
            *args[:7], H, N, HALF=half, SIN_SIGN=sign, BLOCK_N=block_n, BLOCK_HALF=triton.next_power_of_2(half),
            num_warps=warps,
        )  # fmt: skip
        return out
    block_n, heads, warps = (int(part[1:]) for part in name[6:].split("_"))
    heads = min(heads, H)
    _rope_heads[(triton.cdiv(N, block_n), B, triton.cdiv(H, heads))](
        *args, SIN_SIGN=sign, BLOCK_N=block_n, BLOCK_HALF=triton.next_power_of_2(half), HEADS=heads,
        num_warps=warps,
    )  # fmt: skip
    return out


def explore_rope(head_dims, variants):
    B, H = 4, 32
    for D in head_dims:
        N = 2**27 // (B * H * D)
        x = torch.randn(B, N, H, D, device="cuda", dtype=torch.bfloat16).transpose(1, 2)  # (B, H, N, D), strided
        dy = torch.randn(B, H, N, D, device="cuda", dtype=torch.bfloat16)
        cos, sin = rope_mod.rope_cos_sin(N, D, device="cuda")
        nbytes = 2 * x.numel() * x.element_size()
        compiled = torch.compile(rope_mod.rope_ref, dynamic=False)
        want = compiled(x, cos, sin)
        want_back = rope_mod.rope_ref(dy, cos, -sin)
        peer = record(
            f"rope fwd D={D} strided", "compiled reference", lambda f=compiled, i=(x, cos, sin): f(*i), nbytes
        )
        for variant in variants:
            for inputs, inverse, expected, case in [((x, cos, sin), False, want, "fwd"),
                                                    ((dy, cos, sin), True, want_back, "bwd-shaped")]:  # fmt: skip
                try:
                    torch.testing.assert_close(rope_variant(variant, *inputs, inverse=inverse), expected,
                                               atol=2e-2, rtol=2e-2)  # fmt: skip
                except Exception as error:  # noqa: BLE001 - an experiment: report and go on
                    print(f"rope {variant} D={D} {case}: FAILED {type(error).__name__}: {str(error)[:120]}")
                    continue
                record(f"rope {case} D={D}", variant,
                       lambda v=variant, i=inputs, inv=inverse: rope_variant(v, *i, inverse=inv), nbytes,
                       peer if case == "fwd" else None)  # fmt: skip

    # Forward + backward through autograd at D = 128, three rounds so the host's drift shows.
    D = 128
    N = 2**27 // (B * H * D)
    x = torch.randn(B, N, H, D, device="cuda", dtype=torch.bfloat16).transpose(1, 2).requires_grad_(True)
    cos, sin = rope_mod.rope_cos_sin(N, D, device="cuda")
    dy = torch.randn(B, H, N, D, device="cuda", dtype=torch.bfloat16)
    compiled = torch.compile(rope_mod.rope_ref, dynamic=False)
    impls = {"compiled reference": compiled, "kernel_lib": rope_mod.rope}
    x64 = x.detach().double().requires_grad_(True)
    want_dx = torch.autograd.grad(rope_mod.rope_ref(x64, cos.double(), sin.double()), [x64], dy.double())[0]
    for impl, fn in impls.items():  # both gradients against float64 before anything is timed
        torch.testing.assert_close(torch.autograd.grad(fn(x, cos, sin), [x], dy)[0].double(), want_dx,
                                   atol=2e-2, rtol=2e-2, msg=f"rope fwd+bwd {impl}")  # fmt: skip
    for round_ in range(3):
        for impl, fn in impls.items():

            def step(fn=fn):
                return torch.autograd.grad(fn(x, cos, sin), [x], dy)

            as_called = bench.time_fn(step).median_ms
            row = {"case": f"rope fwd+bwd D=128 round {round_}", "variant": impl, "ms": as_called,
                   "host ms": host_ms(step), "graph ms": graph_ms(step)}  # fmt: skip
            ROWS.append(row)
            print(f"{row['case']:34s} {impl:22s} as called {as_called:.4f}  host {row['host ms']:.4f}  "
                  f"graph {row['graph ms']:.4f}", flush=True)  # fmt: skip


# --------------------------------------------------------------------------------------------------
# Cross-entropy forward
# --------------------------------------------------------------------------------------------------
@triton.jit
def _ce_fwd_variant(
    logits_ptr, target_ptr, loss_ptr, stats_ptr, logits_row_stride, V, ignore_index,
    BLOCK_V: tl.constexpr, MODE: tl.constexpr, NUM_STAGES: tl.constexpr,
):  # fmt: skip
    # MODE 0: Triton's pipeliner; 1: two blocks ahead; 2: one block ahead with evict_first
    row = tl.program_id(0).to(tl.int64)
    row_ptr = logits_ptr + row * logits_row_stride
    target = tl.load(target_ptr + row)
    cols = tl.arange(0, BLOCK_V)
    m = -float("inf")
    s = 0.0
    if MODE == 0:
        for start in tl.range(0, V, BLOCK_V, num_stages=NUM_STAGES):
            x = tl.load(row_ptr + start + cols, mask=start + cols < V, other=-float("inf")).to(tl.float32)
            m_new = tl.maximum(m, tl.max(x, axis=0))
            shift = tl.where(m_new == -float("inf"), 0.0, m_new)
            s = s * tl.exp(m - shift) + tl.sum(tl.exp(x - shift), axis=0)
            m = m_new
    elif MODE == 1:
        x_a = tl.load(row_ptr + cols, mask=cols < V, other=-float("inf"))
        x_b = tl.load(row_ptr + BLOCK_V + cols, mask=BLOCK_V + cols < V, other=-float("inf"))
        for start in range(0, V, BLOCK_V):
            x = x_a.to(tl.float32)
            x_a = x_b
            ahead = start + 2 * BLOCK_V + cols
            x_b = tl.load(row_ptr + ahead, mask=ahead < V, other=-float("inf"))
            m_new = tl.maximum(m, tl.max(x, axis=0))
            shift = tl.where(m_new == -float("inf"), 0.0, m_new)
            s = s * tl.exp(m - shift) + tl.sum(tl.exp(x - shift), axis=0)
            m = m_new
    else:
        x_next = tl.load(row_ptr + cols, mask=cols < V, other=-float("inf"), eviction_policy="evict_first")
        for start in range(0, V, BLOCK_V):
            x = x_next.to(tl.float32)
            ahead = start + BLOCK_V + cols
            x_next = tl.load(row_ptr + ahead, mask=ahead < V, other=-float("inf"), eviction_policy="evict_first")
            m_new = tl.maximum(m, tl.max(x, axis=0))
            shift = tl.where(m_new == -float("inf"), 0.0, m_new)
            s = s * tl.exp(m - shift) + tl.sum(tl.exp(x - shift), axis=0)
            m = m_new
    log_s = tl.log(s)
    in_range = (target >= 0) & (target < V)
    x_t = tl.load(row_ptr + tl.where(in_range, target, 0)).to(tl.float32)
    loss = tl.where(in_range, m - x_t + log_s, float("nan"))
    tl.store(loss_ptr + row, tl.where(target == ignore_index, 0.0, loss))
    tl.store(stats_ptr + 2 * row, m)
    tl.store(stats_ptr + 2 * row + 1, log_s)


def ce_forward_variant(name, logits, target):
    T, V = logits.shape
    loss = torch.empty(T, device=logits.device, dtype=torch.float32)
    stats = torch.empty((T, 2), device=logits.device, dtype=torch.float32)
    if name == "shipped":
        return ce_mod._forward(logits, target, -100, 0.0)
    if name.startswith("b"):  # b{block}w{warps}: the shipped kernel, other settings
        block_v, warps = (int(v) for v in name[1:].split("w"))
        ce_mod._ce_fwd_kernel[(T,)](
            logits, target, loss, stats, logits.stride(0), V, -100, 0.0, HAS_SMOOTHING=False, BLOCK_V=block_v,
            num_warps=warps,
        )  # fmt: skip
        return loss, stats
    settings = {"staged2": (0, 2, 2048, 4), "staged3": (0, 3, 2048, 4), "staged4": (0, 4, 2048, 4),
                "staged3b4096w8": (0, 3, 4096, 8), "ahead2": (1, 1, 2048, 4), "ahead2b1024w2": (1, 1, 1024, 2),
                "evict": (2, 1, 2048, 4), "evictb4096w4": (2, 1, 4096, 4),
                "ahead2b4096w4": (1, 1, 4096, 4)}  # fmt: skip
    mode, stages, block_v, warps = settings[name]
    _ce_fwd_variant[(T,)](
        logits, target, loss, stats, logits.stride(0), V, -100, BLOCK_V=block_v, MODE=mode, NUM_STAGES=stages,
        num_warps=warps,
    )  # fmt: skip
    return loss, stats


def explore_cross_entropy(T=8192, V=128256):
    logits = torch.randn(T, V, device="cuda", dtype=torch.bfloat16) * 4
    target = torch.randint(0, V, (T,), device="cuda")
    want_loss, want_stats = ce_mod._forward(logits, target, -100, 0.0)
    nbytes = logits.numel() * logits.element_size()
    compiled = torch.compile(lambda x, t: torch.nn.functional.cross_entropy(x.float(), t, reduction="none"))
    peer = record(f"ce fwd V={V}", "compiled F.cross_entropy", lambda: compiled(logits, target), nbytes)
    variants = ["shipped", "b4096w8", "b2048w4", "b4096w4", "b2048w2", "b4096w2", "b1024w1", "b2048w1",
                "b4096w1", "b512w1", "evictb4096w4"]  # fmt: skip
    for variant in variants:
        try:
            loss, stats = ce_forward_variant(variant, logits, target)
            torch.testing.assert_close(loss, want_loss, atol=1e-4, rtol=1e-5)
            torch.testing.assert_close(stats, want_stats, atol=1e-4, rtol=1e-5)
        except Exception as error:  # noqa: BLE001 - an experiment: report and go on
            print(f"ce fwd {variant}: FAILED {type(error).__name__}: {str(error)[:120]}")
            continue
        record(f"ce fwd V={V}", variant, lambda v=variant: ce_forward_variant(v, logits, target), nbytes, peer)

    dloss = torch.rand(T, device="cuda")
    want_grad = ce_mod._backward(dloss, logits, target, want_stats, -100, 0.0)
    grad = torch.empty_like(logits)
    for block_v, warps in [(4096, 8), (4096, 4), (16384, 16), (2048, 2), (1024, 1), (2048, 1), (8192, 4)]:

        def backward(block_v=block_v, warps=warps):
            ce_mod._ce_bwd_kernel[(T,)](
                logits, target, want_stats, dloss, grad, logits.stride(0), V, -100, 0.0, BLOCK_V=block_v,
                num_warps=warps,
            )  # fmt: skip

        grad.fill_(float("nan"))
        backward()
        torch.testing.assert_close(grad, want_grad, atol=0, rtol=0)
        record(f"ce bwd V={V}", f"bwd_b{block_v}w{warps}", backward, 2 * nbytes)


class _NoKernel(torch.autograd.Function):
    """Autograd's own cost: a forward that allocates its output and a backward that passes dy through."""

    @staticmethod
    def forward(ctx, x):
        return torch.empty_like(x)

    @staticmethod
    def backward(ctx, dy):
        return dy


def explore_host():
    """Where the host's time goes in one RoPE forward + backward (4, 32, 8192, 128), layer by layer."""
    B, H, D = 4, 32, 128
    N = 2**27 // (B * H * D)
    x_plain = torch.randn(B, N, H, D, device="cuda", dtype=torch.bfloat16).transpose(1, 2)  # strided
    x = x_plain.detach().requires_grad_(True)
    cos, sin = rope_mod.rope_cos_sin(N, D, device="cuda")
    dy = torch.randn(B, H, N, D, device="cuda", dtype=torch.bfloat16)
    out = torch.empty(B, H, N, D, device="cuda", dtype=torch.bfloat16)
    grid = (B * H, triton.cdiv(N, rope_mod.BLOCK_N))

    def launch():
        rope_mod._rope_kernel[grid](
            x_plain, cos, sin, out, x_plain.stride(0), x_plain.stride(1), x_plain.stride(2), H, N, HALF=D // 2,
            SIN_SIGN=1.0, BLOCK_N=rope_mod.BLOCK_N, BLOCK_HALF=D // 2, num_warps=4,
        )  # fmt: skip

    def step():
        return torch.autograd.grad(rope_mod.rope(x, cos, sin), [x], dy)

    layers = {
        "an empty Python call": lambda: None,
        "torch.empty of the output": lambda: torch.empty(B, H, N, D, device="cuda", dtype=torch.bfloat16),
        "the kernel launch alone": launch,
        "_rotate (allocation, checks, launch)": lambda: rope_mod._rotate(x_plain, cos, sin, False),
        "rope(), x without grad": lambda: rope_mod.rope(x_plain, cos, sin),
        "rope(), x with grad (forward only)": lambda: rope_mod.rope(x, cos, sin),
        "autograd.Function, no kernel, fwd + bwd": lambda: torch.autograd.grad(_NoKernel.apply(x), [x], dy),
        "rope() forward + backward": step,
    }
    for name, fn in layers.items():
        micros = 1e3 * host_ms(fn, reps=300)
        ROWS.append({"case": "rope host", "variant": name, "host us": micros})
        print(f"rope host  {name:42s} {micros:8.1f} us", flush=True)
    profile_steps(step, top=18)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="results")
    parser.add_argument("--parts", default="host,rope,ce")
    parser.add_argument("--head-dims", default="64,128,256")
    parser.add_argument(
        "--rope-variants",
        default="shipped,ph_n32_w4,ph_n16_w2,heads_n16_h8_w4",
    )
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("explore_rope_ce.py needs a CUDA GPU")
        return 0
    env = bench.environment()
    print(env, flush=True)
    copy = bench.copy_bandwidth()
    ROWS.append({"case": "copy", "variant": "ceiling", "GB/s": copy})
    print(f"copy ceiling {copy:,.0f} GB/s", flush=True)
    parts = args.parts.split(",")
    if "rope" in parts:
        explore_rope([int(d) for d in args.head_dims.split(",")], args.rope_variants.split(","))
    if "host" in parts:
        explore_host()
    if "ce" in parts:
        explore_cross_entropy()
    for row in ROWS:
        if "GB/s" in row and row["case"] != "copy":
            row["% of copy"] = 100 * row["GB/s"] / copy
    print(bench.to_frame(ROWS).to_string(), flush=True)
    path = bench.write_csv(ROWS, os.path.join(args.out, "explore_rope_ce.csv"), env)
    print("wrote", path)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
