"""The optimization assistant's goals, measured: the naive GPT made fast, Llama against Liger-Kernel, a fast model left
alone.

Phases (``--phase``, comma-separated):

* ``gpt``: the course's naive GPT (d 1024, 8 layers, 16 heads, T 1024, vocabulary 32768, batch 8, bf16). The
  assistant analyzes it and applies every fix that validates and helps; the table gives training-step tokens/s of
  the original and of the result (goal: at least 3x), each fix's speedup alone, and the waterfall. For context the
  hand-written versions of the same model (``impl="native"`` compiled, ``impl="kernel_lib"`` compiled) are timed
  with the same weights.
* ``again``: the assistant's own output from ``gpt`` through the assistant again: nothing that makes it slower
  may be applied (the report says so).
* ``llama``: a Hugging Face ``LlamaForCausalLM`` from a config (8 layers, d 2048, 32 heads / 8 KV heads, d_ff 8192,
  vocabulary 128256, sequence 2048, batch ``--llama-batch``, bf16, random weights, no download): Hugging Face eager,
  Hugging Face compiled, Liger-Kernel's ``apply_liger_kernel_to_llama`` (its defaults: RoPE, RMSNorm, SwiGLU,
  fused linear cross-entropy) and the assistant's patch, each a fresh model from one seed; training tokens/s and
  peak memory of a step (goal: the assistant's patch at least Liger's throughput with at most its memory).

A step is forward + loss + backward (no optimizer). Timing: ``kernel_lib.bench.time_fn`` (CUDA events, median),
memory: ``bench.peak_memory_bytes`` above the model and inputs. Writes ``<out>/assistant.csv`` and prints tables.
``--tiny`` runs every phase at toy sizes on any device (a smoke test of the script itself, not a measurement).
"""

import argparse
import math
import os
import sys
import time

import torch

from kernel_lib import bench
from kernel_lib.assistant import CompilerOptimizationAssistant
from kernel_lib.assistant.measure import step_cost
from kernel_lib.models import GPT, GPTConfig, transfer_weights
from kernel_lib.models.zoo import hf_llama


def gpt_setup(tiny: bool, device):
    if tiny:
        cfg = GPTConfig(vocab_size=4096, d_model=64, n_layers=2, n_heads=4, max_seq_len=64)
        B, T = 2, 32
    else:
        cfg = GPTConfig(vocab_size=32768, d_model=1024, n_layers=8, n_heads=16, max_seq_len=1024)
        B, T = 8, 1024
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    torch.manual_seed(0)
    model = GPT(cfg, device=device, dtype=dtype)
    g = torch.Generator(device=device).manual_seed(1)
    idx = torch.randint(0, cfg.vocab_size, (B, T), device=device, generator=g)
    targets = torch.randint(0, cfg.vocab_size, (B, T), device=device, generator=g)
    return cfg, model, (idx, targets), B * T


def row(phase, name, cost, tokens, **extra):
    return {"phase": phase, "variant": name, "step_ms": cost.ms, "spread": cost.spread,
            "tokens_per_s": tokens / cost.ms * 1e3, "peak_gib": cost.peak_gib, **extra}  # fmt: skip


def phase_gpt(args, device, rows, state):
    cfg, model, inputs, tokens = gpt_setup(args.tiny, device)
    assistant = CompilerOptimizationAssistant(progress=True, rep_ms=args.rep_ms)
    start = time.perf_counter()
    result = assistant.optimize_model(model, inputs)
    elapsed = time.perf_counter() - start
    print(result.report())
    print(f"assistant run: {elapsed:,.0f} s")
    rows.append(row("gpt", "naive (original)", result.baseline, tokens))
    final = result.final or result.baseline
    rows.append(row("gpt", "assistant's result", final, tokens, speedup=result.speedup,
                    validation=result.final_validation.summary() if result.final_validation else ""))  # fmt: skip
    for o in result.optimization_opportunities:
        if o.cost is not None:
            rows.append(row("gpt", f"alone: {o.technique}", o.cost, tokens, speedup=o.estimated_speedup))
    for s in result.waterfall:
        rows.append({"phase": "gpt", "variant": f"waterfall: {s.technique}", "step_ms": s.step_ms,
                     "tokens_per_s": tokens / s.step_ms * 1e3 if s.step_ms == s.step_ms else math.nan,
                     "peak_gib": s.peak_bytes / 2**30, "kept": s.kept, "note": s.reason})  # fmt: skip
    for impl in ("native", "kernel_lib"):  # the hand-written levels of the same model, same weights
        other = GPT(GPTConfig(**{**vars(cfg), "impl": impl}), device=device, dtype=model.head.weight.dtype)
        transfer_weights(model, other)
        compiled = torch.compile(other)
        cost = step_cost(compiled, inputs, {}, rep_ms=args.rep_ms)
        rows.append(row("gpt", f"hand-written {impl}, compiled", cost, tokens, speedup=result.baseline.ms / cost.ms))
        if args.profile:
            print_profile(f"hand-written {impl}, compiled", compiled, inputs)
    if args.profile:
        print_profile("assistant's result", result.optimized_model, inputs)
    state["gpt"] = (result, inputs, tokens)


def print_profile(name, model, inputs):
    """Where a step's GPU time goes: the top kernels (a GPU only)."""
    from kernel_lib.assistant.measure import profile_step

    p = profile_step(model, inputs, {})
    if p is None:
        return
    print(f"{name}: {p.kernels_per_step} kernels, GPU busy {p.busy_ms:.2f} of {p.wall_ms:.2f} ms per step")
    for kernel, ms, calls in p.top[:8]:
        print(f"    {ms:8.3f} ms  {calls:5d} x  {kernel[:110]}")


def phase_again(args, device, rows, state):
    if "gpt" not in state:
        phase_gpt(args, device, [], state)
    result, inputs, tokens = state["gpt"]
    again = CompilerOptimizationAssistant(progress=True, rep_ms=args.rep_ms).optimize_model(
        result.optimized_model, inputs
    )
    print(again.report())
    final = again.final or again.baseline
    rows.append(row("again", "assistant's result, as given", again.baseline, tokens))
    rows.append(row("again", "after a second pass", final, tokens, speedup=again.speedup, note=again.verdict()))
    kept = [s for s in again.waterfall if s.kept]
    worse = [b.technique for a, b in zip(kept, kept[1:], strict=False) if b.step_ms >= a.step_ms]
    print(f"second pass: {again.speedup:.2f}x; kept fixes that did not cut the step time: {worse or 'none'}")


def llama_model(tiny: bool, device, seed=0):
    return hf_llama(tiny, device=device, dtype=torch.bfloat16 if device.type == "cuda" else torch.float32, seed=seed)


def phase_llama(args, device, rows, state):
    import transformers

    B, T = (2, 32) if args.tiny else (args.llama_batch, 2048)
    g = torch.Generator(device=device).manual_seed(1)
    vocab = 4096 if args.tiny else 128256
    ids = torch.randint(0, vocab, (B, T), device=device, generator=g)
    inputs = {"input_ids": ids, "labels": ids}
    tokens = B * T
    results = {}

    def measure(name, model):
        cost = step_cost(model, (), inputs, rep_ms=args.rep_ms)
        results[name] = cost
        rows.append(row("llama", name, cost, tokens, transformers=transformers.__version__))
        print(f"  {name:<34} {cost.ms:9.2f} ms  {tokens / cost.ms * 1e3:12,.0f} tokens/s  {cost.peak_gib:7.2f} GiB")

    print(f"Llama, batch {B} x {T} tokens, transformers {transformers.__version__}")
    measure("Hugging Face eager", llama_model(args.tiny, device))
    torch.cuda.empty_cache() if device.type == "cuda" else None
    measure("Hugging Face compiled", torch.compile(llama_model(args.tiny, device)))
    assistant = CompilerOptimizationAssistant(progress=True, rep_ms=args.rep_ms)
    result = assistant.optimize_model(llama_model(args.tiny, device), inputs)
    print(result.report())
    final = result.final or result.baseline
    results["assistant"] = final
    rows.append(row("llama", "assistant's patch", final, tokens, speedup=result.speedup,
                    validation=result.final_validation.summary() if result.final_validation else ""))  # fmt: skip
    print(
        f"  {'assistant patch':<34} {final.ms:9.2f} ms  {tokens / final.ms * 1e3:12,.0f} tokens/s  "
        f"{final.peak_gib:7.2f} GiB"
    )
    # Liger patches transformers' Llama classes and functions for the whole process: measured last, so the
    # models above are Hugging Face's own.
    try:
        from liger_kernel.transformers import apply_liger_kernel_to_llama

        liger = llama_model(args.tiny, device)
        apply_liger_kernel_to_llama(model=liger)  # patches the classes' forward and this instance's modules
        measure("Liger-Kernel", liger)
        del liger
    except ImportError as exc:
        print(f"  Liger-Kernel not measured: {exc}")


PHASES = {"gpt": phase_gpt, "again": phase_again, "llama": phase_llama}


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--phase", default="gpt,again,llama", help="comma-separated: " + ", ".join(PHASES))
    parser.add_argument("--out", default="results")
    parser.add_argument("--tiny", action="store_true", help="toy sizes, any device (smoke test, not a measurement)")
    parser.add_argument("--llama-batch", type=int, default=2)
    parser.add_argument("--rep-ms", type=float, default=None, help="timing window per measured step")
    parser.add_argument("--profile", action="store_true", help="print each version's top kernels (GPU)")
    args = parser.parse_args(argv)
    if args.tiny:
        device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
        env = bench.environment(device.type)
    else:
        env = bench.require_gpu("bench_assistant")
        device = torch.device("cuda")
    print(f"{env['device']} | torch {env['torch']} | triton {env['triton']}")
    rows, state = [], {}
    for name in args.phase.split(","):
        if name not in PHASES:
            parser.error(f"unknown phase {name!r}; choose from {', '.join(PHASES)}")
        PHASES[name](args, device, rows, state)
        path = bench.write_csv(rows, os.path.join(args.out, "assistant.csv"), env=env)  # after each phase: kept
        print(f"wrote {path}")
    print(bench.to_frame(rows).to_string())
    return 0


if __name__ == "__main__":
    sys.exit(main())
