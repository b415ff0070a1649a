"""A decoding step's attention over a long KV cache: kernel_lib.decode_attention (keys split across programs)
against the library's flash_attention (what the decoder called before), SDPA's backends and FlexAttention.

bf16, one query a sequence (or ``--queries``), 32 query heads over 8 key/value heads of 128 (the 1.1B and 7B GQA
shapes), batch 1 and 8, contexts 8k to 128k keys. The step must read the used part of both caches, so GB/s counts
2 x B x Hkv x kv_len x D x 2 bytes (queries and output are negligible) against the copy ceiling measured in the
same run. Every implementation is checked against float64 (decode_attention_ref) before and after timing
(``kernel_lib.bench.sweep``), L2 wiped between calls, each call replayed from a CUDA graph (as a decoder runs it:
the host's microseconds per launch would otherwise be timed). SDPA (grouped heads by ``enable_gqa``, no copies)
and FlexAttention see a cache of exactly kv_len keys, as decode_attention does (a decoder would slice its cache
to kv_len, a new shape and a new graph per length, while decode_attention takes kv_len as a tensor).
Writes <out>/decode_attention.csv and prints % of copy by context.
"""

import argparse
import os
import sys

import torch
import torch.nn.functional as F

from kernel_lib import bench, decode_attention, decode_attention_ref, flash_attention

HQ, HKV, D = 32, 8, 128


def implementations(n: int) -> dict:
    """name -> fn(q, k, v, lengths): every one sees the same caches and lengths (one length for the batch). SDPA
    and FlexAttention only for one query a step (without a mask a single last query sees every key)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    def ours(q, k, v, lengths):
        return decode_attention(q, k, v, lengths)

    def used(k, v, lengths):  # the benchmark's caches hold exactly kv_len keys (no host read: graph capture)
        return k, v

    def library_flash(q, k, v, lengths):  # the decoder before decode_attention (models/gpt.py, flash_over_cache)
        k, v = used(k, v, lengths)
        return flash_attention(q, k, v, causal=True)

    def sdpa(backend):
        def call(q, k, v, lengths):
            k, v = used(k, v, lengths)
            with sdpa_kernel(backend):  # one query at the end sees every key: no mask
                return F.scaled_dot_product_attention(q, k, v, enable_gqa=True)

        return call

    impls = {"decode_attention": ours, "flash_attention": library_flash}
    if n > 1:
        return impls
    q = torch.randn(1, HQ, 1, D, device="cuda", dtype=torch.bfloat16)
    kv = torch.randn(1, HKV, 256, D, device="cuda", dtype=torch.bfloat16)
    for name, backend in (("SDPA flash", SDPBackend.FLASH_ATTENTION), ("SDPA cuDNN", SDPBackend.CUDNN_ATTENTION),
                          ("SDPA efficient", SDPBackend.EFFICIENT_ATTENTION)):  # fmt: skip
        try:  # a backend that refuses grouped heads (enable_gqa) on this build is left out, and said so
            sdpa(backend)(q, kv, kv, torch.tensor([256], device="cuda"))
            impls[name] = sdpa(backend)
        except RuntimeError as error:
            print(f"{name} not measured ({str(error).splitlines()[0][:100]})")
    try:
        from torch.nn.attention.flex_attention import flex_attention

        flex = torch.compile(flex_attention, dynamic=False)

        def flex_decode(q, k, v, lengths):
            k, v = used(k, v, lengths)
            return flex(q, k, v, enable_gqa=True)

        impls["FlexAttention (compiled)"] = flex_decode
    except ImportError as error:
        print(f"FlexAttention not measured ({error})")
    return impls


def graphed(fn):
    """fn replayed from a CUDA graph captured on its first inputs (again when they change; ``bench.repeat_in_graph``
    warms it up and captures it): a decoding step runs in a graph, and the host's time to issue these microsecond
    kernels would otherwise be what is timed. Returns the graph's output tensor, rewritten by each replay."""
    captured = {}

    def call(*args):
        key = tuple(id(a) for a in args)
        if key not in captured:
            captured.clear()
            out = {}
            captured[key] = (bench.repeat_in_graph(lambda: out.update(y=fn(*args)), 1), out)
        replay, out = captured[key]
        replay()
        return out["y"]

    return call


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="results")
    parser.add_argument("--contexts", default="8192,32768,131072", help="keys in the cache, comma-separated")
    parser.add_argument("--batches", default="1,8")
    parser.add_argument("--queries", type=int, default=1, help="queries a step (speculative decoding: a few)")
    args = parser.parse_args()
    env = bench.require_gpu("bench_decode_attention")
    copy_gbps = bench.copy_bandwidth()
    print(f"copy ceiling {copy_gbps:,.0f} GB/s")
    n = args.queries

    def make(B, M):
        q = torch.randn(B, HQ, n, D, device="cuda", dtype=torch.bfloat16)
        k = torch.randn(B, HKV, M, D, device="cuda", dtype=torch.bfloat16)
        v = torch.randn(B, HKV, M, D, device="cuda", dtype=torch.bfloat16)
        return [q, k, v, torch.full((B,), M, device="cuda", dtype=torch.int32)]

    cases = [{"B": int(b), "M": int(m)} for b in args.batches.split(",") for m in args.contexts.split(",")]
    with torch.no_grad():
        frame = bench.sweep(
            {name: graphed(fn) for name, fn in implementations(n).items()}, cases, make, decode_attention_ref,
            baseline="decode_attention",
            nbytes=lambda B, M: 2 * B * HKV * M * D * 2, name="decode attention", atol=1e-2,
        )  # fmt: skip
    frame["pct_of_copy"] = 100 * frame["gbps"] / copy_gbps
    path = bench.write_csv(frame.to_dict("records"), os.path.join(args.out, "decode_attention.csv"),
                           env={**env, "copy_gbps": copy_gbps})  # fmt: skip
    print(frame.pivot_table(index=["B", "impl"], columns="M", values="pct_of_copy").to_string(
        float_format=lambda v: f"{v:.1f}"))  # fmt: skip
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
