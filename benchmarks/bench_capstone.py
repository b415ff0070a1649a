"""The capstone's goals, measured: one GPT class four ways, trained and timed; the largest batch each version fits;
generation against Hugging Face's ``generate`` and against the bandwidth limit.

Phases (``--phase``, comma-separated). Each writes ``<out>/capstone.csv`` (all rows so far, with the device and
versions) as soon as it finishes, so a run killed later keeps what finished, and prints a short table.

* ``train``: the versions of one GPT class (``VERSIONS``: naive eager, native eager, native compiled, kernel_lib
  compiled, and kernel_lib compiled with CUDA graphs, ``mode="reduce-overhead"``), the same weights copied into
  each (``transfer_weights`` from one seeded GPT), one fixed batch of the corpus. A step is forward + loss +
  backward + the AdamW step (fused on a GPU), gradients dropped: what a training loop does per batch. Per version:
  step time (``bench.time_fn``: CUDA events, median), tokens/s, the first step's time (compilation, capture),
  peak memory above the weights and the batch (optimizer states, gradients, activations), MFU
  (``GPT.flops_per_token``: 6 N + attention, forward and backward) over the bf16 matmul ceiling measured in the same
  run and over the datasheet's dense bf16 peak (H100 and H200 SXM: 989 TFLOP/s; other GPUs: not reported), and
  from torch.profiler the GPU-busy time per step, its share of the step, and its split by kernel family. Then the
  fusion floor (``fusion_floor_ms``): native compiled's and kernel_lib's matmuls, optimizer and attention at the
  faster of the two, the norms and the SwiGLU at their bytes (``elementwise_floor_bytes``) over the copy bandwidth
  measured in the same run, everything else free: a step no kernels of version 4 can beat with those matmuls, so
  native compiled's kernel time over it bounds version 4's speed-up over version 3.
* ``loss``: ``--steps`` steps of each version from the same weights on the same stream of batches (the standard
  library's sources, a byte-level BPE tokenizer with the model's vocabulary). Curves go to
  ``<out>/loss_curves.csv`` (step, version, loss), with a reference, native eager in float32, and ``--reruns``
  more runs of native eager from the same weights rounded once more (``reround``). Each curve is judged by the
  course's rule (``compare_curves``): the first step against the float32 reference, at most 2x native eager's own
  difference and at least ``--first-rtol`` (0.5%); the mean of the last 20 steps against the centre of native
  eager and its re-runs, at most 2x their largest distance from it and at least ``--last-rtol`` (3%): bf16 runs
  drift apart step by step, so only an ensemble shows how far PyTorch's own roundings move the curve. Also each
  curve's distance from float32 late (what bf16 itself changes) and the largest difference at any step.
* ``batch``: the largest batch each version trains on at ``--seq-len``: sizes doubled from 1, then bisected between
  the last fit and the first failure, up to ``--max-batch``. A size fits when two steps run (the second with the
  optimizer states allocated) without torch.cuda.OutOfMemoryError; after each try the allocator's cache is
  emptied, and after a failure of the CUDA-graph version Dynamo is reset (no half-captured graph is replayed; it
  recompiles, which makes this phase slow for that version).
* ``decode``: a Llama-shaped GPT, 16 layers, d 2048, d_ff 8192, vocabulary 32768, bf16, ``--decode-heads``
  query heads sharing ``--decode-kv-heads`` key/value heads. Default 16 and 16 (heads of 128, each with its own keys
  and values), as in the stored runs: 1.21B parameters. 32 and 8 is the 1.1B Llama of the goal (heads of 64,
  grouped-query attention): 1.11B, and a quarter of the KV cache per token. Converted with ``to_hf_llama``. For
  batches ``--decode-batches`` (1 and 16), 128 new tokens after a 64-token prompt of the corpus: our
  GraphedDecoder (kernel_lib and native, and kernel_lib with its linears in int8 or int4 weights by
  ``kernel_lib.quantize_``, group 128, the output head kept bf16: ``--decode-quantized``), our eager ``greedy`` with
  the cache (kernel_lib and native), Hugging Face ``generate`` with its dynamic cache (eager) and with
  ``cache_implementation="static"`` (it compiles its decode step itself); ``--decoders`` runs a subset. A
  generation is timed whole with ``bench.time_fn`` after an untimed first one (compile, capture); time to first
  token (TTFT) is a generation of one token; decode tokens/s = batch x 127 / (generation - TTFT), against the
  bandwidth limit: the copy ceiling measured in the same run over the bytes each step must read (every weight once,
  in its stored format, the KV cache up to the position). Token identity: the first 64 new tokens of each decoder
  against its reference (graphed against eager of the same version, HF against our native eager), as the shortest
  common prefix over the batch. Prefill: tokens/s of a ``--prefill-len`` prompt at batch 1. The weights are random
  here, so near-equal logits make tokens part for no reason; the quality phase checks tokens on trained weights.
* ``quality``: the training model (``--size``) trained ``--quality-steps`` steps (kernel_lib, eager, AdamW) and
  saved to ``--trained`` (default ``<out>/trained_<size>.pt``; a checkpoint of the same recipe is reused, so a
  killed run retrains nothing it finished), then for bf16 and the ``--decode-quantized`` formats: perplexity on
  ``--eval-batches`` windows of the held-out split, and the greedy tokens (``--new-tokens`` after a
  ``--prompt-len`` prompt of held-out text, 4 sequences) that each format shares with bf16's.

``--size`` picks the training model (``SIZES``: 125m, 350m, 1b; vocabulary 32768). ``--tiny`` runs every phase at
toy sizes (float32, a 2-layer d 64 model, a few steps) on the GPU or, with Triton interpreted, on the CPU, where
torch.compile is skipped (Inductor builds C++ for longer than the whole run takes): the compiled versions then
run eagerly, and the output says so. It is a smoke test of this script, not a measurement.

    python benchmarks/bench_capstone.py --size 350m --out results
    python benchmarks/bench_capstone.py --tiny --out /tmp/capstone
"""

import argparse
import copy
import dataclasses
import math
import os
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from typing import Optional

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton's first import: kernels run on the CPU

from kernel_lib import bench  # noqa: E402
from kernel_lib.bench.capstone import (  # noqa: E402
    REFERENCE,
    RERUNS,
    SIZES,
    VERSIONS,
    YARDSTICK,
    Version,
    build_version,
    common_prefix,
    compare_curves,
    datasheet_tflops,
    decode_limit,
    elementwise_floor_bytes,
    fusion_floor_ms,
    generation_times,
    hf_generate,
    loss_curve,
    loss_curves,
    make_optimizer,
    profile_families,
    release,
    step_cost,
    train_step,
)
from kernel_lib.models import (  # noqa: E402
    GPT,
    GPTConfig,
    GraphedDecoder,
    batches,
    encode_corpus,
    fixed_batch,
    greedy,
    stdlib_files,
    to_hf_llama,
    train_tokenizer,
    train_val_split,
    transfer_weights,
)
from kernel_lib.ops.quantized_linear import quantize_  # noqa: E402

# --------------------------------------------------------------------------------------------------
# Sizes and setup
# --------------------------------------------------------------------------------------------------
# Run sizes: the measurement, and --tiny's smoke test. Arguments left unset on the command line come from here.
FULL = dict(batch=8, seq_len=1024, steps=200, max_batch=256, prompt_len=64, new_tokens=128, prefill_len=1024,
            decode_batches="1,16", rep_ms=500.0, profile_steps=3, reruns=RERUNS, quality_steps=1000,
            eval_batches=8)  # fmt: skip
TINY = dict(batch=2, seq_len=8, steps=4, max_batch=2, prompt_len=4, new_tokens=4, prefill_len=16,
            decode_batches="1,2", rep_ms=10.0, profile_steps=1, reruns=2, quality_steps=4, eval_batches=1)  # fmt: skip
TINY_FILES = 40  # --tiny trains its tokenizer on the first 40 files of the standard library: about a second
IDENTICAL_TOKENS = 64  # the token-identity check covers the first 64 new tokens
DECODE = dict(vocab_size=32768, d_model=2048, n_layers=16, n_heads=16, d_ff=8192)  # see the module docstring


@dataclass
class Context:
    """What the phases share: where they run, the corpus, and the training model's weights (built once)."""

    args: argparse.Namespace
    device: torch.device
    dtype: torch.dtype
    compile: bool
    env: dict
    tokens: torch.Tensor  # the corpus' training split, int32 on the CPU
    val_tokens: torch.Tensor  # its held-out split (the last 1%), never trained on
    _source: Optional[GPT] = None

    @property
    def config(self) -> GPTConfig:
        sizes = SIZES["tiny" if self.args.tiny else self.args.size]
        return GPTConfig(**sizes, max_seq_len=self.args.seq_len, impl="native")

    @property
    def source(self) -> GPT:
        """The training model's weights: one GPT from --seed, kept on the CPU (every version copies from it, and a
        GPU's memory then holds only the version being measured)."""
        if self._source is None:
            torch.manual_seed(self.args.seed)
            self._source = GPT(self.config, device="cpu", dtype=self.dtype)
        return self._source

    @property
    def compile_note(self) -> str:
        return "" if self.compile else "compile skipped on the CPU: runs eagerly"


def load_corpus(args, vocab_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    files = stdlib_files()[:TINY_FILES] if args.tiny else None
    start = time.perf_counter()
    tokenizer = train_tokenizer(vocab_size, files=files, cache_dir=args.cache_dir)
    tokens = encode_corpus(tokenizer, files=files, cache_dir=args.cache_dir)
    train, val = train_val_split(tokens)
    print(
        f"corpus: {len(tokens):,} tokens of the standard library's sources, BPE vocabulary "
        f"{tokenizer.get_vocab_size():,} (model: {vocab_size:,}); {time.perf_counter() - start:.1f} s"
    )
    return train, val


def _step_fn(version: Version, optimizer, idx, targets) -> Callable[[], torch.Tensor]:
    return lambda: train_step(version.model, optimizer, idx, targets, version.graphs)


def _show(rows: list[dict], columns: list[str]) -> None:
    frame = bench.to_frame(rows)
    print(frame[[c for c in columns if c in frame.columns]].to_string(index=False, float_format=lambda v: f"{v:,.3g}"))


# --------------------------------------------------------------------------------------------------
# Phases
# --------------------------------------------------------------------------------------------------
def phase_train(ctx: Context, rows: list[dict]) -> None:
    args, device = ctx.args, ctx.device
    B, T = args.batch, args.seq_len
    idx, targets = fixed_batch(ctx.tokens, B, T, seed=args.seed, device=device)
    ceiling = bench.matmul_tflops(ctx.dtype, device=device.type)  # 8192^3 on a GPU, 512^3 on the CPU
    datasheet = datasheet_tflops(ctx.env["device"]) if device.type == "cuda" else None
    flops = ctx.source.flops_per_token(T) * B * T
    print(
        f"\ntrain: {ctx.source.num_parameters() / 1e6:,.1f}M parameters, batch {B} x {T}, {ctx.dtype}; "
        f"{flops / 1e12:,.3f} TFLOP per step (forward + backward); matmul ceiling {ceiling:,.1f} TFLOP/s measured, "
        f"datasheet {datasheet or 'not listed'}"
    )
    phase_rows, profiles = [], {}
    for name in VERSIONS:
        version = build_version(name, ctx.source, device, ctx.dtype, compile=ctx.compile)
        optimizer = make_optimizer(version.model, args.lr)
        step = _step_fn(version, optimizer, idx, targets)
        cost = step_cost(step, device, warmup_ms=4 * args.rep_ms / 10, rep_ms=args.rep_ms)
        profile = profiles[name] = profile_families(step, device, steps=args.profile_steps)
        achieved = flops / cost.ms / 1e9
        row = {
            "phase": "train", "version": name, "impl": version.gpt.config.impl,
            "compile": version.mode if version.compiled else "eager", "batch": B, "seq_len": T,
            "step_ms": cost.ms, "spread": cost.spread, "first_step_s": cost.first_ms / 1e3,
            "tokens_per_s": B * T / cost.ms * 1e3, "peak_gib": cost.peak_gib, "tflops": achieved,
            "matmul_ceiling_tflops": ceiling, "mfu_measured": achieved / ceiling,
            "datasheet_tflops": datasheet, "mfu_datasheet": achieved / datasheet if datasheet else None,
            "gpu_busy_ms": profile.busy_ms, "busy_share": profile.busy_ms / cost.ms,
            "profiled_wall_ms": profile.wall_ms, "kernels_per_step": profile.kernels_per_step,
            "profile_clock": profile.clock, **{f"ms_{family}": ms for family, ms in profile.families.items()},
            "note": ctx.compile_note if version.mode else "",
        }  # fmt: skip
        phase_rows.append(row)
        print(
            f"  {name:<24} {cost.ms:9.2f} ms  {row['tokens_per_s']:12,.0f} tokens/s  {cost.peak_gib:7.2f} GiB  "
            f"MFU {row['mfu_measured']:6.1%}  GPU busy {profile.busy_ms:8.2f} ms  first step "
            f"{row['first_step_s']:6.1f} s  {row['note']}",
            flush=True,
        )
        del version, optimizer, step
        release(device)
    by_name = {r["version"]: r for r in phase_rows}
    for row in phase_rows:  # the goals read off these ratios (version 4 against versions 2 and 3)
        row["speedup_vs_native_eager"] = row["tokens_per_s"] / by_name["native eager"]["tokens_per_s"]
        row["speedup_vs_native_compiled"] = row["tokens_per_s"] / by_name["native compiled"]["tokens_per_s"]
        row["peak_vs_native_eager"] = row["peak_gib"] / by_name["native eager"]["peak_gib"]
    rows += phase_rows
    _show(phase_rows, ["version", "step_ms", "tokens_per_s", "peak_gib", "mfu_measured", "mfu_datasheet",
                       "busy_share", "speedup_vs_native_eager", "speedup_vs_native_compiled",
                       "peak_vs_native_eager"])  # fmt: skip
    print("goals for version 4: >= 1.3x native eager's tokens/s, >= 1.1x native compiled's, <= 0.7x its peak memory")
    # How fast version 4 could be against version 3 with the same matmuls and optimizer
    copy = bench.copy_bandwidth(device=device.type)
    size = torch.empty((), dtype=ctx.dtype).element_size()
    floor_ms = {f: b / copy / 1e6 for f, b in elementwise_floor_bytes(ctx.config, B, T, size).items()}
    pair = ("native compiled", "kernel_lib CUDA graphs")
    best = fusion_floor_ms({n: profiles[n] for n in pair}, floor_ms)
    spent = sum(profiles[pair[0]].families.values())  # its kernels' time, family by family (CPU: operators')
    bound = spent / best
    for row in phase_rows:
        row.update(copy_gbps=copy, fusion_floor_ms=best, fusion_bound_vs_native_compiled=bound)
    print(
        f"fusion floor: {best:,.2f} ms of kernels a step (matmul, optimizer and attention at the faster of {pair[0]} "
        f"and {pair[1]}, norm {floor_ms['norm']:,.2f} ms and activation {floor_ms['activation']:,.2f} ms at "
        f"{copy:,.0f} GB/s, the rest free) against {spent:,.2f} ms for {pair[0]}: version 4 "
        f"can be at most {bound:.2f}x version 3 ({profiles[pair[1]].clock})"
    )


def phase_loss(ctx: Context, rows: list[dict]) -> None:
    args, device = ctx.args, ctx.device
    B, T = args.batch, args.seq_len
    print(f"\nloss: {args.steps} steps per version, batch {B} x {T}, AdamW lr {args.lr}, seed {args.seed}")

    def progress(name, curve, seconds):
        note = ctx.compile_note if name not in (REFERENCE, "naive eager", "native eager") else ""
        print(f"  {name:<24} loss {curve[0]:.4f} -> {curve[-1]:.4f}  ({seconds:,.1f} s) {note}", flush=True)

    curves = loss_curves(ctx.source, ctx.tokens, B, T, args.steps, device, ctx.dtype, compile=ctx.compile,
                         lr=args.lr, seed=args.seed, reruns=args.reruns, progress=progress)  # fmt: skip
    table = compare_curves(curves, first_rtol=args.first_rtol, last_rtol=args.last_rtol)
    rows += [{"phase": "loss", "steps": args.steps, "batch": B, "seq_len": T, "lr": args.lr, **r} for r in table]
    curve_rows = [{"step": i, "version": name, "loss": loss} for name, c in curves.items() for i, loss in enumerate(c)]
    path = bench.write_csv(curve_rows, os.path.join(args.out, "loss_curves.csv"), env=ctx.env)
    print(f"wrote {path}")
    _show(table, ["version", "first_loss", "first_rel_diff", "last_rel_diff", "last_vs_reference", "max_abs_diff",
                  "within_tolerance"])  # fmt: skip
    print(
        f"allowed: first step {table[0]['allowed_first']:.2%} from {REFERENCE} (2x {YARDSTICK}'s own difference, at "
        f"least {args.first_rtol:.1%}); mean of the last 20 steps {table[0]['allowed_last']:.2%} from the centre of "
        f"{YARDSTICK} and its {args.reruns} re-runs (2x their spread, at least {args.last_rtol:.1%})"
    )


def largest_batch(fits: Callable[[int], bool], cap: int, tried: Optional[list] = None) -> int:
    """The largest batch size b <= cap with fits(b): doubling from 1 until a size fails (or the cap), then bisecting
    between the last size that fit and the first that failed; 0 when batch 1 fails. Assumes that fitting is
    monotonic. Each (size, fits) is appended to ``tried``."""
    tried = [] if tried is None else tried

    def check(b: int) -> bool:
        ok = fits(b)
        tried.append((b, ok))
        return ok

    fit, fail, b = 0, None, 1
    while b <= cap:
        if not check(b):
            fail = b
            break
        fit, b = b, 2 * b
    if fail is None:  # every power of two up to the cap fit
        if fit == cap or check(cap):
            return cap
        fail = cap
    while fail - fit > 1:
        mid = (fit + fail) // 2
        if check(mid):
            fit = mid
        else:
            fail = mid
    return fit


def _is_oom(exc: BaseException) -> bool:
    # cuBLAS reports a failed workspace allocation as a RuntimeError of its own
    return isinstance(exc, torch.cuda.OutOfMemoryError) or any(
        s in str(exc) for s in ("out of memory", "CUBLAS_STATUS_ALLOC_FAILED")
    )


def _fits_fn(ctx: Context, version: Version, optimizer) -> Callable[[int], bool]:
    cuda = ctx.device.type == "cuda"

    def fits(b: int) -> bool:
        idx = targets = None
        try:
            idx, targets = fixed_batch(ctx.tokens, b, ctx.args.seq_len, seed=ctx.args.seed, device=ctx.device)
            for _ in range(2 if cuda else 1):  # the second step runs with the optimizer states allocated
                train_step(version.model, optimizer, idx, targets, version.graphs)
            if cuda:
                torch.cuda.synchronize()
            return True
        except RuntimeError as exc:  # torch.cuda.OutOfMemoryError is a RuntimeError
            if not _is_oom(exc):
                raise
            if version.graphs:  # a capture the error interrupted must not be replayed: compile and capture again
                torch._dynamo.reset()
            return False
        finally:
            optimizer.zero_grad(set_to_none=True)
            del idx, targets
            release(ctx.device)

    return fits


def phase_batch(ctx: Context, rows: list[dict]) -> None:
    args, device = ctx.args, ctx.device
    print(f"\nbatch: the largest batch of {args.seq_len} tokens each version trains on (cap {args.max_batch})")
    if device.type != "cuda":
        print("  no GPU: no memory limit to find; the search runs up to the cap")
    for name in VERSIONS:
        version = build_version(name, ctx.source, device, ctx.dtype, compile=ctx.compile)
        optimizer = make_optimizer(version.model, args.lr)
        tried, error = [], ""
        start = time.perf_counter()
        try:
            best = largest_batch(_fits_fn(ctx, version, optimizer), args.max_batch, tried)
        except Exception as exc:  # recorded, and the other versions still run
            best, error = None, f"{type(exc).__name__}: {str(exc)[:300]}"
        row = {
            "phase": "batch", "version": name, "seq_len": args.seq_len, "max_batch": best,
            "capped": best == args.max_batch, "tries": " ".join(f"{b}:{'ok' if ok else 'OOM'}" for b, ok in tried),
            "search_s": time.perf_counter() - start, "error": error, "note": ctx.compile_note if version.mode else "",
        }  # fmt: skip
        rows.append(row)
        print(f"  {name:<24} {best!s:>5}  ({row['tries']}) {error} {row['note']}", flush=True)
        del version, optimizer
        release(device)


def phase_decode(ctx: Context, rows: list[dict]) -> None:
    args, device, dtype = ctx.args, ctx.device, ctx.dtype
    P, N = args.prompt_len, args.new_tokens
    sizes = SIZES["tiny"] if args.tiny else dict(DECODE, n_heads=args.decode_heads, n_kv_heads=args.decode_kv_heads)
    config = GPTConfig(**sizes, max_seq_len=max(P + N, args.prefill_len), impl="native")
    torch.manual_seed(args.seed)
    source = GPT(config, device="cpu", dtype=dtype)
    models = {}
    for impl in ("kernel_lib", "native"):
        models[impl] = GPT(dataclasses.replace(config, impl=impl), device=device, dtype=dtype)
        transfer_weights(source, models[impl])
    del source
    hf = to_hf_llama(models["native"])
    quantized = {}  # bits -> a copy of the kernel_lib model with int8 / int4 linears (the output head kept bf16)
    for bits in [int(b) for b in args.decode_quantized.split(",") if b]:
        quantized[bits] = quantize_(copy.deepcopy(models["kernel_lib"]), bits=bits, group=128, skip=("head",))
    copy_gbps = bench.copy_bandwidth(device=device.type)
    timing = dict(warmup_ms=args.rep_ms / 5, rep_ms=args.rep_ms, flush_l2=False, device=device.type)
    graphs_note = "" if device.type == "cuda" else "no GPU: the graph's step runs eagerly"
    print(
        f"\ndecode: {models['native'].num_parameters() / 1e6:,.1f}M parameters, {dtype}, prompt {P} + {N} new "
        f"tokens; copy ceiling {copy_gbps:,.0f} GB/s measured"
    )
    for B in args.decode_batches:
        prompt = fixed_batch(ctx.tokens, B, P, seed=args.seed, device=device)[0]
        limit = decode_limit(models["kernel_lib"], B, P, N, copy_gbps)
        graphed = {impl: GraphedDecoder(models[impl], B, P + N) for impl in models}
        limits = {}  # decoder -> its own bandwidth limit, where its weights are not bf16
        for bits, model in quantized.items():
            graphed[f"int{bits}"] = GraphedDecoder(model, B, P + N)
            limits[f"ours: kernel_lib int{bits}, CUDA graphs"] = decode_limit(model, B, P, N, copy_gbps)
        decoders = {  # name -> (generate(prompt, new_tokens), the decoder whose tokens it must repeat)
            "ours: kernel_lib, CUDA graphs": (graphed["kernel_lib"].generate, "ours: kernel_lib, eager"),
            **{
                f"ours: kernel_lib int{bits}, CUDA graphs": (
                    graphed[f"int{bits}"].generate,
                    "ours: kernel_lib, CUDA graphs",
                )
                for bits in quantized
            },
            "ours: native, CUDA graphs": (graphed["native"].generate, "ours: native, eager"),
            "ours: kernel_lib, eager": (partial(greedy, models["kernel_lib"]), "ours: native, eager"),
            "ours: native, eager": (partial(greedy, models["native"]), "HF: dynamic cache, eager"),
            "HF: dynamic cache, eager": (partial(hf_generate, hf, static=False), "ours: native, eager"),
            "HF: static cache, compiled": (partial(hf_generate, hf, static=True), "HF: dynamic cache, eager"),
        }
        if args.decoders:  # a subset, by parts of their names; identity is checked where the reference ran too
            wanted = [w.strip() for w in args.decoders.split(",")]
            decoders = {name: d for name, d in decoders.items() if any(w in name for w in wanted)}
        outputs, batch_rows = {}, []
        for name, (generate, _) in decoders.items():
            outputs[name] = generate(prompt, N)  # the first call compiles and captures: not timed
            total, ttft = generation_times(generate, prompt, N, **timing)
            decode_tps = B * (N - 1) / (total - ttft) * 1e3 if total > ttft else math.nan
            note = graphs_note if "graphs" in name else ""
            if name.startswith("HF: static") and device.type != "cuda":
                note = "no GPU: generate does not compile"
            batch_rows.append({
                "phase": "decode", "decoder": name, "kv_heads": config.n_kv_heads, "batch": B, "prompt_len": P,
                "new_tokens": N,
                "generation_ms": total, "tokens_per_s": B * N / total * 1e3, "ttft_ms": ttft,
                "decode_tokens_per_s": decode_tps, "limit_tokens_per_s": limits.get(name, limit),
                "pct_of_limit": decode_tps / limits.get(name, limit),
                "copy_gbps": copy_gbps, "note": note,
            })  # fmt: skip
            print(f"  batch {B:3d}  {name:<30} {B * N / total * 1e3:10,.0f} tokens/s  TTFT {ttft:8.2f} ms", flush=True)
        hf_static = next((r["tokens_per_s"] for r in batch_rows if r["decoder"] == "HF: static cache, compiled"), None)
        n_check = min(IDENTICAL_TOKENS, N)
        for row in batch_rows:
            reference = decoders[row["decoder"]][1]
            row["vs_hf_static"] = row["tokens_per_s"] / hf_static if hf_static else math.nan
            row["compared_with"] = reference
            row["identical_prefix"] = (common_prefix(outputs[row["decoder"]], outputs[reference], P, n_check)
                                       if reference in outputs else None)  # fmt: skip
            row["identical_goal"] = n_check
        rows += batch_rows
        _show(batch_rows, ["decoder", "batch", "tokens_per_s", "decode_tokens_per_s", "pct_of_limit", "ttft_ms",
                           "vs_hf_static", "identical_prefix", "compared_with"])  # fmt: skip
        print(f"  bandwidth limit at batch {B}: {limit:,.0f} tokens/s")
        del graphed, decoders, outputs
        release(device)
    print("goals: graphed kernel_lib at batch 1 >= 60% of the limit and >= 5x HF static; at batch 16 >= 1.5x it")

    rows += prefill_rows(ctx, models, hf, timing)
    del models, hf
    release(device)


def prefill_rows(ctx: Context, models: dict[str, GPT], hf, timing: dict) -> list[dict]:
    """Prefill throughput: one --prefill-len prompt at batch 1 through our forward_step (into a cache allocated
    beforehand) and through Hugging Face's forward (its dynamic cache filled)."""
    length = ctx.args.prefill_len
    long = fixed_batch(ctx.tokens, 1, length, seed=ctx.args.seed + 1, device=ctx.device)[0]
    prefills = {}
    for impl, model in models.items():
        prefills[f"ours: {impl}"] = partial(model.forward_step, long, model.init_cache(1, length), 0)

    @torch.no_grad()
    def hf_prefill():
        return hf(input_ids=long)

    prefills["HF"] = hf_prefill
    rows = []
    for name, fn in prefills.items():
        fn()
        ms = bench.time_fn(fn, **timing).median_ms
        rows.append({"phase": "prefill", "decoder": name, "batch": 1, "prompt_len": length, "prefill_ms": ms,
                     "tokens_per_s": length / ms * 1e3})  # fmt: skip
        print(f"  prefill of {length} tokens, {name:<16} {ms:9.2f} ms  {length / ms * 1e3:12,.0f} tokens/s")
    return rows


def trained_model(ctx: Context) -> GPT:
    """The quality phase's model: the training model (``--size``) from ``ctx.source``, trained ``--quality-steps``
    steps of AdamW at ``--batch`` x ``--seq-len`` on the training split (kernel_lib version, eager), saved to
    ``--trained`` (a temporary file renamed into place: a killed run leaves the old file or none). A checkpoint of
    the same configuration, seed and steps is loaded instead of training again."""
    args, device = ctx.args, ctx.device
    config = dataclasses.replace(ctx.config, impl="kernel_lib")
    path = args.trained or os.path.join(args.out, f"trained_{'tiny' if args.tiny else args.size}.pt")
    recipe = {"config": dataclasses.asdict(config), "steps": args.quality_steps, "batch": args.batch,
              "seq_len": args.seq_len, "lr": args.lr, "seed": args.seed, "dtype": str(ctx.dtype),
              "corpus_tokens": len(ctx.tokens) + len(ctx.val_tokens)}  # fmt: skip
    model = GPT(config, device=device, dtype=ctx.dtype)
    if os.path.exists(path):
        saved = torch.load(path, map_location=device, weights_only=True)
        if saved.get("recipe") != recipe:
            raise SystemExit(f"{path} holds a model trained otherwise ({saved.get('recipe')}); this run needs "
                             f"{recipe}: pass another --trained path or remove it")  # fmt: skip
        model.load_state_dict(saved["model"])
        print(f"  trained model loaded from {path} ({args.quality_steps} steps)")
        return model
    transfer_weights(ctx.source, model)
    optimizer = make_optimizer(model, args.lr)
    stream = batches(ctx.tokens, args.batch, args.seq_len, torch.Generator().manual_seed(args.seed), device)
    start = time.perf_counter()
    losses = []
    for chunk in bench.progress(range(0, args.quality_steps, 50), desc="quality: training"):
        losses += loss_curve(model, optimizer, stream, min(50, args.quality_steps - chunk))
    del optimizer
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    tmp = f"{path}.tmp"
    torch.save({"recipe": recipe, "model": model.state_dict(), "losses": losses}, tmp)
    os.replace(tmp, path)
    print(f"  trained {args.quality_steps} steps: loss {losses[0]:.3f} -> {losses[-1]:.3f} "
          f"({time.perf_counter() - start:,.0f} s); wrote {path}")  # fmt: skip
    return model


@torch.no_grad()
def perplexity(model: GPT, tokens: torch.Tensor, n_batches: int, batch: int, seq_len: int, seed: int, device) -> float:
    """exp of the mean next-token cross-entropy over ``n_batches`` fixed windows of ``tokens`` (seeds seed..)."""
    losses = [float(model(*fixed_batch(tokens, batch, seq_len, seed=seed + i, device=device)))
              for i in range(n_batches)]  # fmt: skip
    return math.exp(sum(losses) / len(losses))


def phase_quality(ctx: Context, rows: list[dict]) -> None:
    """What the weight formats cost in quality, on trained weights (random ones make near-equal logits, so greedy
    tokens part for no reason): perplexity on the held-out split for bf16, int8 and int4 (``quantize_``, the output
    head kept bf16), and how many of the greedy tokens each format generates match bf16's."""
    args, device = ctx.args, ctx.device
    print(f"\nquality: the {'tiny' if args.tiny else args.size} model trained {args.quality_steps} steps, "
          f"perplexity over {args.eval_batches} held-out batches of {args.batch} x {args.seq_len}")  # fmt: skip
    model = trained_model(ctx).eval()
    group = 128 if model.config.d_model % 128 == 0 else 32
    formats = {"bf16" if ctx.dtype == torch.bfloat16 else str(ctx.dtype).removeprefix("torch."): model}
    for bits in [int(b) for b in args.decode_quantized.split(",") if b]:
        formats[f"int{bits}"] = quantize_(copy.deepcopy(model), bits=bits, group=group, skip=("head",))
    P, N = args.prompt_len, args.new_tokens
    prompt = fixed_batch(ctx.val_tokens, 4, P, seed=args.seed, device=device)[0]
    outputs, reference = {}, next(iter(formats))
    for name, m in formats.items():
        ppl = perplexity(m, ctx.val_tokens, args.eval_batches, args.batch, args.seq_len, args.seed, device)
        outputs[name] = greedy(m, prompt, N)
        new, ref = outputs[name][:, P:], outputs[reference][:, P:]
        rows.append({
            "phase": "quality", "format": name, "steps": args.quality_steps, "val_perplexity": ppl,
            "group": group if name.startswith("int4") else None,
            "greedy_equal_share": float((new == ref).float().mean()), "greedy_prefix": common_prefix(
                outputs[name], outputs[reference], P, N), "greedy_tokens": N, "compared_with": reference,
        })  # fmt: skip
        print(f"  {name:<6} perplexity {ppl:9.3f}   greedy tokens equal to {reference}'s: "
              f"{rows[-1]['greedy_equal_share']:.1%} (first {rows[-1]['greedy_prefix']} of {N} in a row)")  # fmt: skip
    release(device)


PHASES = {"train": phase_train, "loss": phase_loss, "batch": phase_batch, "decode": phase_decode,
          "quality": phase_quality}  # fmt: skip


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--phase", default=",".join(PHASES), help="comma-separated: " + ", ".join(PHASES))
    parser.add_argument("--out", default="results")
    parser.add_argument("--tiny", action="store_true", help="toy sizes, any device (smoke test, not a measurement)")
    parser.add_argument("--size", default="350m", choices=[s for s in SIZES if s != "tiny"])
    parser.add_argument("--batch", type=int, help=f"training batch (default {FULL['batch']})")
    parser.add_argument("--seq-len", type=int, help=f"training sequence length (default {FULL['seq_len']})")
    parser.add_argument("--steps", type=int, help=f"steps per loss curve (default {FULL['steps']})")
    parser.add_argument("--reruns", type=int, help=f"native eager again from re-rounded weights (default {RERUNS})")
    parser.add_argument("--lr", type=float, default=3e-4, help="AdamW learning rate")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--first-rtol", type=float, default=0.005, help="loss at step 0 against float32, floor")
    parser.add_argument("--last-rtol", type=float, default=0.03, help="mean of the last 20 against the re-runs, floor")
    parser.add_argument("--max-batch", type=int, help=f"cap of the batch search (default {FULL['max_batch']})")
    parser.add_argument("--decode-batches", help=f"comma-separated (default {FULL['decode_batches']})")
    parser.add_argument("--decode-heads", type=int, default=16, help="query heads of the decode model (16)")
    parser.add_argument("--decode-kv-heads", type=int, help="its key/value heads (default: as many as query heads)")
    parser.add_argument("--decode-quantized", default="8,4", help="weight-only int8 / int4 decoders ('' for none)")
    parser.add_argument("--decoders", help="comma-separated parts of decoder names to run (default: all)")
    parser.add_argument("--prompt-len", type=int, help=f"decode prompt (default {FULL['prompt_len']})")
    parser.add_argument("--new-tokens", type=int, help=f"tokens generated (default {FULL['new_tokens']})")
    parser.add_argument("--prefill-len", type=int, help=f"prefill throughput prompt (default {FULL['prefill_len']})")
    parser.add_argument("--rep-ms", type=float, help=f"timing window per measurement (default {FULL['rep_ms']})")
    parser.add_argument("--profile-steps", type=int, help=f"steps profiled (default {FULL['profile_steps']})")
    parser.add_argument("--cache-dir", help="tokenizer and corpus cache (default ~/.cache/kernel_lib)")
    parser.add_argument("--quality-steps", type=int, help=f"training steps of the quality phase's model "
                        f"(default {FULL['quality_steps']})")  # fmt: skip
    parser.add_argument("--eval-batches", type=int,
                        help=f"held-out batches for perplexity (default {FULL['eval_batches']})")  # fmt: skip
    parser.add_argument("--trained", help="the quality phase's checkpoint (default <out>/trained_<size>.pt): reused "
                        "when its recipe (model, steps, batch, lr, seed, corpus) is this run's, refused when it "
                        "differs, trained and written when absent")  # fmt: skip
    args = parser.parse_args(argv)
    for key, value in (TINY if args.tiny else FULL).items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    args.decode_batches = [int(b) for b in str(args.decode_batches).split(",")]
    phases = args.phase.split(",")
    for name in phases:
        if name not in PHASES:
            parser.error(f"unknown phase {name!r}; choose from {', '.join(PHASES)}")
    if args.reruns < 0:
        parser.error("--reruns must be 0 or more")
    if args.quality_steps < 1:
        parser.error("--quality-steps must be at least 1")
    if args.new_tokens < 2:
        parser.error("--new-tokens must be at least 2 (one prefill token, then decode steps)")

    if args.tiny:
        device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
        env = bench.environment(device.type)
        print(f"{env['device']} | torch {env['torch']} | triton {env['triton']} | --tiny: a smoke test")
    else:
        env = bench.require_gpu("bench_capstone")
        device = torch.device("cuda")
    dtype = torch.float32 if args.tiny else torch.bfloat16  # the interpreter's bf16 matmul is wrong: fp32 when tiny
    compile_ = device.type == "cuda"
    if not compile_:
        print("torch.compile skipped on the CPU (Inductor's C++ build takes longer than this run): compiled versions "
              "run eagerly")  # fmt: skip
    vocab = SIZES["tiny" if args.tiny else args.size]["vocab_size"]
    ctx = Context(args, device, dtype, compile_, env, *load_corpus(args, vocab))
    rows: list[dict] = []
    for name in phases:
        start = time.perf_counter()
        PHASES[name](ctx, rows)
        path = bench.write_csv(rows, os.path.join(args.out, "capstone.csv"), env=env)  # after each phase: kept
        print(f"{name}: {time.perf_counter() - start:,.1f} s; wrote {path}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
