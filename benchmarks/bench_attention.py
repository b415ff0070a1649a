"""kernel_lib.flash_attention against PyTorch's SDPA backends, compiled FlexAttention and FlashAttention-4, on a GPU.

Sections (``--sections``, all by default):

* sweep: bf16, 16k tokens per batch (B = 16384 / N), 2048 / D heads, N from 1k to 16k, D 64 and 128, causal and
  not, plus a sliding window of 1024 at N = 8192.
* head-dims: the head dims real models use (80, 96, 192 for q/k with 128 for v, 256) at N = 4096, same budget.
* packed: 8 documents of random lengths summing to 16k tokens, D 128, 16 heads, causal: flash_attention_varlen
  against FA4's flash_attn_varlen_func, FlexAttention with a document mask (block mask built outside the timing),
  SDPA on nested (jagged) tensors, and SDPA over the batch padded to the longest document (the padded SDPA call
  alone is timed, its best case).
* memory: peak memory of forward + backward against the eager reference that materializes the N x N scores.
* variants: masks from a function (kernel_lib's ``compile_attention_kernel``, ops/attention_variants.py) against
  compiled FlexAttention with the same mask (both block masks built outside the timing), N 4096 and 16384, D 128,
  bf16: causal, a sliding window of 1024, documents of random lengths (causal within each), a prefix LM (a
  quarter of the sequence bidirectional); kernel_lib's flash_attention too where it has the mask built in.

TFLOP/s counts 4 B H N M D for the forward (only the visible part of the matrix: half when causal, the band for a
window, the documents' own triangles when packed) and 2.5x that for the backward. Every implementation's output
is compared with kernel_lib's and, on the last 128 queries of one head, with float64. FA4 (the flash-attn-4
package, FlashAttention's CuTe-DSL kernels) runs when ``flash_attn.cute`` imports. Writes <out>/attention.csv and
prints a table.
"""

import argparse
import os
import sys

import torch
import torch.nn.functional as F

from kernel_lib import attention_ref, bench, flash_attention
from kernel_lib.ops.attention import attention_varlen_ref, flash_attention_varlen


def fa4_module():
    """FlashAttention-4's interface, or None when the flash-attn-4 package is not installed."""
    try:
        import flash_attn.cute as fa4
    except Exception as error:  # not installed, or its CUTLASS DSL missing
        print(f"FA4 not measured: {type(error).__name__}: {error}")
        return None
    return fa4


def fa4_runner(fa4):
    def run(q, k, v, causal, window):
        # FA4 takes (B, N, H, D): transposed views of our (B, H, N, D) tensors, no copy
        left = None if window is None else window - 1
        out = fa4.flash_attn_func(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), causal=causal,
                                  window_size=(left, 0 if window is not None else None))  # fmt: skip
        out = out[0] if isinstance(out, tuple) else out
        return out.transpose(1, 2)

    return run


def sdpa_with(backend):
    from torch.nn.attention import sdpa_kernel

    def run(q, k, v, causal, window):
        if window is not None:
            raise NotImplementedError("no sliding window in SDPA without an explicit mask")
        with sdpa_kernel(backend):
            return F.scaled_dot_product_attention(q, k, v, is_causal=causal)

    return run


def flex_attention_runner():
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    # One compiled function serves every shape, mask and requires_grad setting of the sweep: more recompilations
    # than Dynamo's default limit of 8, after which it silently runs the unfused eager flex_attention (measured:
    # 2 TFLOP/s for the sliding window, the last case). Raise the limit (named cache_size_limit before torch 2.6).
    for name in ("recompile_limit", "cache_size_limit"):
        if hasattr(torch._dynamo.config, name):
            setattr(torch._dynamo.config, name, 64)
    compiled = torch.compile(flex_attention, dynamic=False)
    masks = {}

    def run(q, k, v, causal, window):
        key = (q.shape[2], causal, window)
        if key not in masks:
            if window is not None:

                def mask_mod(b, h, i, j):
                    return (j <= i) & (j > i - window)
            elif causal:

                def mask_mod(b, h, i, j):
                    return j <= i
            else:
                mask_mod = None
            masks[key] = (
                create_block_mask(mask_mod, None, None, q.shape[2], k.shape[2], device="cuda") if mask_mod else None
            )
        return compiled(q, k, v, block_mask=masks[key])

    return run


def time_case(rows: list, name: str, fn, inputs: tuple, fwd_flops: float, ok: bool, **fields) -> None:
    """Time fn(*inputs) forward, and forward + backward (gradients of the floating inputs), into rows."""
    leaves = [t.detach().requires_grad_() if t.is_floating_point() else t for t in inputs]
    wrt = [t for t in leaves if t.requires_grad]
    dout = torch.randn_like(fn(*inputs))
    forward = bench.time_fn(lambda: fn(*inputs))
    both = bench.time_fn(lambda: torch.autograd.grad(fn(*leaves), wrt, dout))
    base = dict(impl=name, **fields, correct=ok)
    rows.append({**bench.result_row("attention", forward, flops=fwd_flops, **base), "pass": "forward"})
    rows.append({**bench.result_row("attention", both, flops=3.5 * fwd_flops, **base), "pass": "forward+backward"})
    print(f"{fields} {name}: forward {rows[-2]['tflops']:.0f} TFLOP/s, forward+backward {rows[-1]['tflops']:.0f} "
          f"TFLOP/s, correct={ok}", flush=True)  # fmt: skip


def fixed_length(rows: list, impls: dict, cases: list) -> None:
    """(B, H, N, D) cases: (N, D, Dv, causal, window), 16k tokens a batch, 2048 / D heads."""
    for N, D, Dv, causal, window in cases:
        B, H = max(1, 16384 // N), 2048 // D
        q, k = (torch.randn(B, H, N, D, device="cuda", dtype=torch.bfloat16) for _ in range(2))
        v = torch.randn(B, H, N, Dv, device="cuda", dtype=torch.bfloat16)
        pairs = bench.visible_pairs(N, causal=causal, window=window)
        fwd_flops = 2 * B * H * (D + Dv) * pairs
        ours = flash_attention(q, k, v, causal=causal, window=window)
        tail = slice(N - 128, N)
        want = attention_ref(q[:1, :1, tail].double(), k[:1, :1].double(), v[:1, :1].double(), causal, window)
        for name, fn in impls.items():
            try:
                out = fn(q, k, v, causal, window)
            except Exception as error:  # a backend that does not support this case
                print(f"N={N} D={D}/{Dv} causal={causal} window={window} {name}: unsupported "
                      f"({type(error).__name__}: {str(error)[:120]})")  # fmt: skip
                continue
            ok = bool((out[:1, :1, tail].double() - want).abs().max() < 2e-2) and bool((out - ours).abs().max() < 5e-2)
            run = lambda q, k, v, fn=fn, flags=(causal, window): fn(q, k, v, *flags)  # noqa: E731
            time_case(rows, name, run, (q, k, v), fwd_flops, ok, B=B, H=H, N=N, D=D, Dv=Dv, causal=causal,
                      window=window)  # fmt: skip
        del q, k, v
        torch.cuda.empty_cache()


def packed_documents(rows: list, fa4, documents: int = 8, total: int = 16384, H: int = 16, D: int = 128) -> None:
    """Documents of random lengths packed into one (total, H, D) batch, causal within each document."""
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    gen = torch.Generator().manual_seed(0)
    cuts = torch.randperm(total - 1, generator=gen)[: documents - 1].add(1).sort().values.tolist()
    lengths = [b - a for a, b in zip([0, *cuts], [*cuts, total], strict=True)]
    print(f"packed documents: lengths {lengths}")
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32, device="cuda")
    longest = max(lengths)
    q, k, v = (torch.randn(total, H, D, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    fwd_flops = 4 * H * D * sum(bench.visible_pairs(n, causal=True) for n in lengths)
    fields = dict(B=documents, H=H, N=total, D=D, Dv=D, causal=True, window=None, packed=True)

    # Flex: one (1, H, total, D) sequence with a document-and-causal mask
    document = torch.repeat_interleave(torch.arange(documents, device="cuda"), torch.tensor(lengths, device="cuda"))
    block_mask = create_block_mask(lambda b, h, i, j: (document[i] == document[j]) & (j <= i), None, None, total,
                                   total, device="cuda")  # fmt: skip
    flex = torch.compile(flex_attention, dynamic=False)
    as_one = lambda t: t.transpose(0, 1)[None]  # noqa: E731  (T, H, D) -> (1, H, T, D)
    # SDPA over the padded batch: (documents, H, longest, D), is_causal (padding sits after each document)
    padded = [torch.zeros(documents, H, longest, D, device="cuda", dtype=torch.bfloat16) for _ in range(3)]
    for t, p in zip((q, k, v), padded, strict=True):
        for i, (a, n) in enumerate(zip(cu.tolist(), lengths, strict=False)):
            p[i, :, :n] = t[a : a + n].transpose(0, 1)

    def nested(t):
        return torch.nested.nested_tensor_from_jagged(t, cu.long()).transpose(1, 2)  # (B, H, j, D)

    impls = {
        "kernel_lib": lambda q, k, v: flash_attention_varlen(q, k, v, cu, cu, longest, longest, causal=True),
        "FlexAttention (document mask)": lambda q, k, v: flex(as_one(q), as_one(k), as_one(v),
                                                              block_mask=block_mask)[0].transpose(0, 1),
        "SDPA (nested jagged)": lambda q, k, v: F.scaled_dot_product_attention(
            nested(q), nested(k), nested(v), is_causal=True).transpose(1, 2).values(),
    }  # fmt: skip
    if fa4 is not None:

        def fa4_varlen(q, k, v):
            out = fa4.flash_attn_varlen_func(q, k, v, cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=longest,
                                             max_seqlen_k=longest, causal=True)  # fmt: skip
            return out[0] if isinstance(out, tuple) else out

        impls["FA4 varlen"] = fa4_varlen
    ours = impls["kernel_lib"](q, k, v)
    first = slice(0, lengths[0])
    want = attention_varlen_ref(q[first].double(), k[first].double(), v[first].double(), cu[:2], cu[:2], True)
    assert (ours[first].double() - want).abs().max() < 2e-2, "kernel_lib's packed result is off"
    for name, fn in impls.items():
        try:
            out = fn(q, k, v)
        except Exception as error:
            print(f"packed {name}: unsupported ({type(error).__name__}: {str(error)[:160]})")
            continue
        ok = bool((out.float() - ours.float()).abs().max() < 5e-2)
        time_case(rows, name, fn, (q, k, v), fwd_flops, ok, **fields)
    sdpa = lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=True)  # noqa: E731
    time_case(rows, "SDPA (padded batch)", sdpa, tuple(padded), fwd_flops, True, **fields)


def variants(rows: list, lengths=(4096, 16384), D: int = 128, H: int = 16) -> None:
    """Masks written as functions: ours (block-sparse Triton kernels) against compiled FlexAttention, same masks."""
    from torch.nn.attention.flex_attention import create_block_mask as torch_block_mask
    from torch.nn.attention.flex_attention import flex_attention as torch_flex

    from kernel_lib import compile_attention_kernel, flex_attention_ref
    from kernel_lib.ops.attention_variants import softcap

    # one compiled graph per mask and score function: past dynamo's default of 8 recompiles, FlexAttention falls
    # back to its unfused eager path (7-9 TFLOP/s on the H200), which would be no comparison
    for limit in ("cache_size_limit", "recompile_limit"):
        if hasattr(torch._dynamo.config, limit):
            setattr(torch._dynamo.config, limit, max(64, getattr(torch._dynamo.config, limit)))
    flex = torch.compile(torch_flex, dynamic=False)
    for N in lengths:
        B = max(1, 16384 // N)
        gen = torch.Generator().manual_seed(N)
        doc = torch.cumsum(torch.rand(B, N, generator=gen) < 1 / 1024, dim=1).to(torch.int32).cuda()
        patterns = {  # name: (our params, FlexAttention's mask_mod, whether the mask depends on the sequence)
            "causal": ({}, lambda b, h, i, j: j <= i, False),
            "sliding_window": ({"window_size": 1024}, lambda b, h, i, j: (j <= i) & (j > i - 1024), False),
            "document": ({"document_ids": doc}, lambda b, h, i, j, d=doc: (j <= i) & (d[b, i] == d[b, j]), True),
            "prefix_lm": ({"prefix_length": N // 4}, lambda b, h, i, j, p=N // 4: (j <= i) | (j < p), False),
            "causal + softcap 50": ({"score_mod": softcap(50.0)}, lambda b, h, i, j: j <= i, False),
        }
        q, k, v = (torch.randn(B, H, N, D, device="cuda", dtype=torch.bfloat16) for _ in range(3))
        for pattern, (params, mask_mod, per_sequence) in patterns.items():
            theirs_mask = torch_block_mask(mask_mod, B if per_sequence else None, None, N, N, device="cuda")
            ours_fn = compile_attention_kernel(pattern.split(" + ")[0], **params)
            their_mod = (lambda score, b, h, i, j: 50.0 * torch.tanh(score / 50.0)) if "softcap" in pattern else None
            impls = {
                "kernel_lib flex_attention": ours_fn,
                "FlexAttention (compiled)": lambda q, k, v, m=theirs_mask, f=their_mod: flex(
                    q, k, v, score_mod=f, block_mask=m
                ),
            }
            if pattern in ("causal", "sliding_window"):
                window = params.get("window_size")
                impls["kernel_lib flash_attention"] = lambda q, k, v, w=window: flash_attention(q, k, v, True, w)
            i = torch.arange(N, device="cuda")[:, None]
            j = torch.arange(N, device="cuda")[None, :]
            dense = mask_mod(torch.arange(B, device="cuda")[:, None, None, None], 0, i, j) if per_sequence else (
                mask_mod(0, 0, i, j)[None, None])  # fmt: skip
            pairs = int(dense.expand(B, 1, N, N).sum().item())
            fwd_flops = 4 * H * D * pairs
            tail = slice(N - 128, N)
            want = flex_attention_ref(q[:1, :1, tail].double(), k[:1, :1].double(), v[:1, :1].double(),
                                      dense[:1, :1, tail], score_mod=params.get("score_mod"))  # fmt: skip
            ours = ours_fn(q, k, v)
            for name, fn in impls.items():
                out = fn(q, k, v)
                ok = bool((out[:1, :1, tail].double() - want).abs().max() < 2e-2) and bool(
                    (out - ours).abs().max() < 5e-2)  # fmt: skip
                time_case(rows, name, fn, (q, k, v), fwd_flops, ok, B=B, H=H, N=N, D=D, pattern=pattern)
        del q, k, v
        torch.cuda.empty_cache()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="results")
    parser.add_argument("--lengths", default="1024,2048,4096,8192,16384")
    parser.add_argument("--head-dims", default="64,128")
    parser.add_argument(
        "--sections", default="sweep,head-dims,packed,memory,variants", help="comma-separated, see above"
    )
    parser.add_argument("--impls", default="", help="names to keep in sweep and head-dims, comma-separated (all)")
    args = parser.parse_args()
    env = bench.require_gpu("bench_attention")
    from torch.nn.attention import SDPBackend

    sections = set(args.sections.split(","))
    peak = bench.matmul_tflops(torch.bfloat16)
    print(f"bf16 matmul ceiling: {peak:,.0f} TFLOP/s")
    fa4 = fa4_module()
    impls = {
        "kernel_lib": lambda q, k, v, causal, window: flash_attention(q, k, v, causal=causal, window=window),
        "SDPA FLASH": sdpa_with(SDPBackend.FLASH_ATTENTION),
        "SDPA CUDNN": sdpa_with(SDPBackend.CUDNN_ATTENTION),
        "SDPA EFFICIENT": sdpa_with(SDPBackend.EFFICIENT_ATTENTION),
        "FlexAttention (compiled)": flex_attention_runner(),
    }
    if fa4 is not None:
        impls["FA4"] = fa4_runner(fa4)
    if args.impls:
        impls = {name: fn for name, fn in impls.items() if name in args.impls.split(",")}
    rows = []
    if "packed" in sections:
        packed_documents(rows, fa4)
    if "sweep" in sections:
        lengths = [int(n) for n in args.lengths.split(",")]
        head_dims = [int(d) for d in args.head_dims.split(",")]
        cases = [(N, D, D, causal, None) for D in head_dims for N in lengths for causal in (False, True)]
        fixed_length(rows, impls, [*cases, (8192, 128, 128, True, 1024)])
    if "head-dims" in sections:
        fixed_length(rows, impls, [(4096, D, Dv, causal, None) for D, Dv in ((80, 80), (96, 96), (192, 128),
                                   (256, 256)) for causal in (False, True)])  # fmt: skip
    if "variants" in sections:
        variants(rows)
    # Peak memory of forward + backward: kernel_lib against the eager reference that stores N x N scores.
    for N in (1024, 2048, 4096, 8192) if "memory" in sections else ():
        q, k, v = (
            torch.randn(1, 16, N, 128, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(3)
        )
        for name, fn in (("kernel_lib", flash_attention), ("eager reference", attention_ref)):
            peak = bench.peak_memory_bytes(lambda fn=fn, qkv=(q, k, v): fn(*qkv, True).float().sum().backward())
            rows.append({"name": "attention peak memory", "impl": name, "N": N, "D": 128, "causal": True,
                         "peak_mib": peak / 2**20})  # fmt: skip
            q.grad = k.grad = v.grad = None
    frame = bench.to_frame(rows)
    print(frame.to_string(index=False, float_format=lambda value: f"{value:,.2f}"))
    print(f"wrote {bench.write_csv(rows, os.path.join(args.out, 'attention.csv'), env=env)}")
    return 0 if frame["correct"].dropna().all() else 1


if __name__ == "__main__":
    sys.exit(main())
