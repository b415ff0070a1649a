"""Train a GPT of kernel_lib's parts on one or many GPUs (or gloo processes on a CPU) with DDP or FSDP2.

    torchrun --nproc-per-node N benchmarks/train_distributed.py --strategy fsdp2 --model 1b --compile --steps 50
    python benchmarks/train_distributed.py --strategy none --model 1b --compile        # one GPU, no wrapper
    torchrun --nproc-per-node 2 benchmarks/train_distributed.py --device cpu --model tiny --steps 10   # gloo

The model: ``kernel_lib.models.GPT`` with ``--impl kernel_lib`` (RMSNorm, RoPE, flash attention, SwiGLU and the
fused linear cross-entropy as Triton kernels), ``native`` (the same model in plain PyTorch), or ``hf``: that GPT
converted to a Hugging Face ``LlamaForCausalLM`` of the same shape and weights (``to_hf_llama``), trained through
its own forward and loss (labels = the inputs, shifted inside by one). Sizes (``--model``): the capstone's
``SIZES`` (tiny, 125m, 350m, 1b; vocabulary 32,768 except tiny's 512).

The data: Python's standard-library sources, a byte-level BPE tokenizer of the model's vocabulary trained on them
(``kernel_lib.models.data``; rank 0 trains and caches it, the others then load it). Every rank draws the same global
batch of ``N x --batch`` random windows from one seeded generator and trains on its own rows
(``kernel_lib.distributed.shard_batch``): N ranks train on exactly what one process of the global batch would.

Each step prints ``step``, the loss (mean over ranks), the step's milliseconds and the tokens/s of all ranks. The
summary: the median step after ``--warmup`` steps, tokens/s in all and per rank, MFU against the bf16 matmul
ceiling measured at the start of the run on each GPU and against the datasheet's (H100/H200 SXM: 989 TFLOP/s),
peak memory of every rank, and for impl kernel_lib the memory model's prediction (``memory_model``).

Files, with ``--out DIR`` (rank 0 writes them):
* ``DIR/steps.csv``: step, loss, ms, tokens_per_s, one row per step of this run;
* ``DIR/runs.csv``: one row per run (appended): device, versions, world size, strategy, model, impl, options,
  the summary's numbers and the memory model's terms;
* ``DIR/trace-rank<r>.json`` with ``--profile-step K``: a Chrome trace (chrome://tracing, Perfetto) of step K
  from every rank, and a line on how much of the collectives' time overlapped compute.

Checkpoints: ``--save DIR`` writes model, optimizer and step after the last step (torch.distributed.checkpoint,
one folder, each rank its shards); ``--resume DIR`` reads one, from any number of ranks and either strategy, and
goes on from its step with the batches an uninterrupted run would have drawn there, so the losses continue the
same curve.
"""

import argparse
import csv
import json
import math
import os
import sys
import time
from pathlib import Path

import torch

from kernel_lib import bench
from kernel_lib import distributed as kd
from kernel_lib.bench.capstone import SIZES, datasheet_tflops
from kernel_lib.models import GPT, GPTConfig, batches, encode_corpus, to_hf_llama, train_tokenizer

DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0], formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--strategy", choices=kd.STRATEGIES, default="fsdp2")
    p.add_argument("--model", choices=list(SIZES), default="1b", help="sizes: kernel_lib.bench.capstone.SIZES")
    p.add_argument("--impl", choices=["kernel_lib", "native", "hf"], default="kernel_lib")
    p.add_argument("--compile", action="store_true", help="torch.compile each transformer block")
    p.add_argument("--checkpointing", action="store_true", help="activation checkpointing per block")
    p.add_argument("--no-reshard", action="store_true", help="FSDP2: keep gathered parameters after forward")
    p.add_argument("--steps", type=int, default=50, help="steps to run (after --resume's step, if any)")
    p.add_argument("--batch", type=int, default=None, help="sequences per rank (default 4 on a GPU, 2 on the CPU)")
    p.add_argument("--seq-len", type=int, default=None, help="tokens per sequence (default 2048 GPU, 32 CPU)")
    p.add_argument("--lr", type=float, default=3e-4, help="AdamW learning rate (betas 0.9, 0.95; decay 0.1)")
    p.add_argument("--lr-warmup", type=int, default=10, help="steps of linear learning-rate warm-up from lr/N")
    p.add_argument("--adamw", choices=["fused", "foreach"], default="fused", help="AdamW implementation on a GPU")
    p.add_argument("--seed", type=int, default=0, help="weights and batches")
    p.add_argument("--dtype", choices=list(DTYPES), default=None, help="compute dtype (default bf16 GPU, fp32 CPU)")
    p.add_argument("--device", choices=["cuda", "cpu"], default=None, help="default: cuda when there is one")
    p.add_argument("--warmup", type=int, default=None, help="steps left out of the timing (default min(5, steps/2))")
    p.add_argument("--save", type=Path, help="write a distributed checkpoint to this folder after the last step")
    p.add_argument("--resume", type=Path, help="read a distributed checkpoint from this folder and go on")
    p.add_argument("--out", type=Path, help="folder for steps.csv, runs.csv and traces (rank 0 writes)")
    p.add_argument("--profile-step", type=int, help="write a profiler trace of this step (0-based, this run)")
    p.add_argument("--cache-dir", type=Path, help="tokenizer and corpus cache (default ~/.cache/kernel_lib)")
    p.add_argument("--label", default="", help="free text stored in runs.csv")
    args = p.parse_args(argv)
    for name in ("steps", "batch", "seq_len"):
        value = getattr(args, name)
        if value is not None and value < 1:
            p.error(f"--{name.replace('_', '-')} must be at least 1, got {value}")
    if args.profile_step is not None and not 0 <= args.profile_step < args.steps:
        p.error(f"--profile-step must be within 0..{args.steps - 1}")
    if args.impl == "hf" and args.strategy == "fsdp2" and args.checkpointing:
        p.error("--impl hf with fsdp2 and --checkpointing is not wired (Hugging Face's checkpointing wraps layers)")
    return args


def load_tokens(vocab_size: int, cache_dir, env: kd.DistEnv) -> torch.Tensor:
    """The corpus encoded with a tokenizer of ``vocab_size`` entries: rank 0 trains and caches, then the rest load."""
    if env.is_main:
        tokens = encode_corpus(train_tokenizer(vocab_size, cache_dir=cache_dir), cache_dir=cache_dir)
    if env.world_size > 1:
        torch.distributed.barrier()
    if not env.is_main:
        tokens = encode_corpus(train_tokenizer(vocab_size, cache_dir=cache_dir), cache_dir=cache_dir)
    return tokens


def build(args, env: kd.DistEnv, dtype: torch.dtype):
    """The GPT (every rank draws the same weights from --seed), converted for --impl hf, in the dtype the
    strategy holds its parameters in, wrapped; and its AdamW."""
    config = GPTConfig(**SIZES[args.model], impl="native" if args.impl == "hf" else args.impl)
    held = torch.float32 if args.strategy == "fsdp2" else dtype  # FSDP2 keeps float32 and casts to dtype
    torch.manual_seed(args.seed)
    gpt = GPT(config, device=env.device, dtype=held)
    model = to_hf_llama(gpt).train() if args.impl == "hf" else gpt
    if args.impl == "hf":
        del gpt
    wrapped = kd.wrap(
        model, args.strategy, env, param_dtype=dtype if args.strategy == "fsdp2" else None,
        compile=args.compile, checkpointing=args.checkpointing, reshard_after_forward=not args.no_reshard,
    )  # fmt: skip
    gpu = env.device.type == "cuda"
    kind = {"fused": True} if gpu and args.adamw == "fused" else {"foreach": True} if gpu else {}
    optimizer = torch.optim.AdamW(wrapped.parameters(), lr=args.lr, betas=(0.9, 0.95), weight_decay=0.1, **kind)
    return config, model, wrapped, optimizer


def loss_of(model, impl: str, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    if impl == "hf":  # Hugging Face's own loss: labels shifted by one inside, the last position has none
        return model(input_ids=idx, labels=idx).loss
    return model(idx, targets)


def overlap_line(trace_path: Path) -> str:
    kernels = kd.trace_kernels(trace_path)
    o = kd.overlap(kernels)
    return (
        f"trace {trace_path.name}: collectives {o['comm_ms']:.2f} ms, of which {o['overlapped_ms']:.2f} ms "
        f"({100 * o['overlapped_fraction']:.0f}%) ran while a compute kernel ran; compute {o['compute_ms']:.2f} ms"
    )


def main(argv=None) -> int:
    args = parse_args(argv)
    env = kd.init(args.device)
    code = train(args, env)  # returns with its model, optimizer and collectives gone: shutdown frees the group
    kd.shutdown()
    return code


def train(args, env) -> int:
    dtype = DTYPES[args.dtype or ("bf16" if env.device.type == "cuda" else "fp32")]
    batch = args.batch or (4 if env.device.type == "cuda" else 2)
    seq_len = args.seq_len or (2048 if env.device.type == "cuda" else 32)
    warmup = args.warmup if args.warmup is not None else min(5, args.steps // 2)
    say = print if env.is_main else (lambda *a, **k: None)

    tokens = load_tokens(SIZES[args.model]["vocab_size"], args.cache_dir, env)
    config, model, wrapped, optimizer = build(args, env, dtype)
    gpt_like = GPT(config, device="meta")  # sizes only: FLOPs per token, memory model
    start_step = kd.load_checkpoint(args.resume, wrapped, optimizer) if args.resume else 0
    if args.resume:
        say(f"resumed from {args.resume} at step {start_step}")

    ceilings = {}
    if env.device.type == "cuda":
        ceilings["measured bf16 matmul"] = bench.matmul_tflops(torch.bfloat16, device=str(env.device))
        ceilings["datasheet bf16"] = datasheet_tflops(torch.cuda.get_device_name(env.device))
    global_batch = batch * env.world_size
    timer = kd.StepTimer(env, global_batch * seq_len, gpt_like.flops_per_token(seq_len), ceilings)
    say(
        f"{bench.device_name(env.device)} x {env.world_size} ({env.backend}), torch {torch.__version__}; "
        f"{args.strategy}, model {args.model} ({gpt_like.num_parameters():,} parameters), impl {args.impl}, {dtype}, "
        f"compile {args.compile}, checkpointing {args.checkpointing}; batch {batch} x {seq_len} per rank"
    )

    stream = batches(tokens, global_batch, seq_len, generator=torch.Generator().manual_seed(args.seed))
    for _ in range(start_step):  # the batches an uninterrupted run drew before this step
        next(stream)
    rows = []
    for i in range(args.steps):
        step = start_step + i
        idx, targets = kd.shard_batch(*next(stream), env)
        idx, targets = idx.to(env.device, non_blocking=True), targets.to(env.device, non_blocking=True)
        for group in optimizer.param_groups:  # a function of the step alone: a resumed run continues the schedule
            group["lr"] = args.lr * min(1.0, (step + 1) / max(args.lr_warmup, 1))
        profiler = kd.profile_step(env) if i == args.profile_step else None
        timer.start()
        if profiler is not None:
            profiler.__enter__()
        loss = loss_of(wrapped, args.impl, idx, targets)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if profiler is not None:
            profiler.__exit__(None, None, None)
        ms = timer.stop()
        mean = float(kd.mean_over_ranks(loss))
        if not torch.isfinite(torch.tensor(mean)):
            say(f"step {step}: loss is {mean}; stopping")  # the mean is all-reduced: every rank stops here
            return 1
        rows.append({"step": step, "loss": mean, "ms": ms, "tokens_per_s": global_batch * seq_len / (ms * 1e-3)})
        say(f"step {step:4d}  loss {mean:.4f}  {ms:8.1f} ms  {rows[-1]['tokens_per_s']:>10,.0f} tokens/s", flush=True)
        if profiler is not None and args.out:
            args.out.mkdir(parents=True, exist_ok=True)
            path = args.out / f"trace-rank{env.rank}.json"
            profiler.export_chrome_trace(str(path))
            say(overlap_line(path))

    summary = timer.summary(args.strategy, skip=min(warmup, args.steps - 1))
    for line in summary.lines():
        say(line)
    prediction = None
    if args.impl == "kernel_lib" and not config.n_experts:
        prediction = kd.memory_model(
            gpt_like, args.strategy, env.world_size, batch, seq_len, dtype, args.checkpointing,
            reshard_after_forward=not args.no_reshard,
        )  # fmt: skip
        predicted = prediction.total / 2**30
        measured = max(summary.peak_gib_per_rank)
        terms = ", ".join(f"{k.removesuffix('_gib')} {v:.2f}" for k, v in prediction.to_dict().items())
        if math.isfinite(measured):
            terms += f"; measured peak {measured:.2f} ({100 * (measured / predicted - 1):+.1f}%)"
        say(f"memory model (GiB per rank): {terms}")
    if args.save:
        kd.save_checkpoint(args.save, wrapped, optimizer, start_step + args.steps)
        say(f"saved step {start_step + args.steps} to {args.save}")
    if args.out and env.is_main:
        write_files(args, env, dtype, batch, seq_len, rows, summary, prediction)
    return 0


def write_files(args, env, dtype, batch, seq_len, rows, summary, prediction) -> None:
    args.out.mkdir(parents=True, exist_ok=True)
    with open(args.out / "steps.csv", "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)
    run = bench.environment(env.device) | {
        "label": args.label, "world_size": env.world_size, "strategy": args.strategy, "model": args.model,
        "impl": args.impl, "dtype": str(dtype).removeprefix("torch."), "compile": args.compile,
        "checkpointing": args.checkpointing, "reshard": not args.no_reshard, "adamw": args.adamw,
        "batch_per_rank": batch, "seq_len": seq_len, "steps": args.steps,
        "first_loss": rows[0]["loss"], "last_loss": rows[-1]["loss"],
        "step_ms": summary.step_ms, "tokens_per_s": summary.tokens_per_s,
        "tokens_per_s_per_gpu": summary.tokens_per_s_per_gpu, "tflops_per_gpu": summary.tflops_per_gpu,
        "peak_gib_max": max(summary.peak_gib_per_rank),
        "peak_gib_per_rank": " ".join(f"{v:.3f}" for v in summary.peak_gib_per_rank),
    }  # fmt: skip
    run |= {f"mfu {k}": v for k, v in summary.mfu.items()}
    run |= {f"ceiling {k}": v for k, v in summary.ceilings_tflops.items()}
    if prediction is not None:
        run |= {f"model {k}": v for k, v in prediction.to_dict().items()}
    path = args.out / "runs.csv"
    old = list(csv.DictReader(open(path))) if path.exists() else []
    fields = list(dict.fromkeys([k for r in old for k in r] + list(run)))
    with open(path, "w", newline="") as f:  # rewritten whole: a run with new columns keeps the old rows
        writer = csv.DictWriter(f, fieldnames=fields)
        writer.writeheader()
        writer.writerows(old + [run])
    (args.out / "summary.json").write_text(json.dumps(run, indent=1, default=str) + "\n")


if __name__ == "__main__":
    t0 = time.perf_counter()
    code = main()
    if os.environ.get("RANK", "0") == "0":
        print(f"done in {time.perf_counter() - t0:.1f} s")
    sys.exit(code)
