"""What the capstone measures, in one place for notebook 08 and ``benchmarks/bench_capstone.py``: the harness (formerly
``kernel_lib.models.capstone``, which still imports as this module).

Training, for the GPT's versions built from one set of weights (``VERSIONS``, ``build_version``)::

    step      = train_step(model, optimizer, idx, targets)    forward with the loss, backward, AdamW, grads dropped
    cost      = step_cost(step, device)                       median time, first call, peak memory
    profile   = profile_families(step, device)                GPU time per kernel family, GPU busy vs wall
    floors    = elementwise_floor_bytes(config, B, T, size)   bytes the norms and the activation must move
    best      = fusion_floor_ms(profiles, floor_ms)           the shortest step the measured kernels allow
    losses    = loss_curve(model, optimizer, batches, steps)  one loss per step
    curves    = loss_curves(source, tokens, B, T, steps, ...)  every version's, a float32 reference's, and re-runs
                                                              of native eager from re-rounded weights
    table     = compare_curves(curves)                        first step against the reference, last steps against
                                                              the re-runs' centre: 2x PyTorch's own spread

Model FLOPs utilization (MFU) is ``GPT.flops_per_token(T)`` times the tokens per second, over a ceiling: the matmul
throughput measured in the same run (``kernel_lib.bench.matmul_tflops``) or the datasheet's (``datasheet_tflops``).

Generation: the bytes a decode step must read and the tokens per second the copy bandwidth allows for them
(``decode_limit``), a generation's time and time to first token (``generation_times``), the tokens two decoders
agree on (``common_prefix``), the teacher-forced logits of the decode step (``decode_logits``, for checks against
float64), and Hugging Face's ``generate`` called the two ways the course compares against (``hf_generate``).
"""

import dataclasses
import gc
import math
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Optional

import torch
from torch import nn

from .. import bench
from ..models.data import batches as _batches
from ..models.gpt import GPT, _unwrap, kv_bucket, transfer_weights
from ..ops.quantized_linear import QuantizedLinear

__all__ = [
    "SIZES",
    "VERSIONS",
    "Version",
    "build_version",
    "make_optimizer",
    "train_step",
    "StepCost",
    "step_cost",
    "KERNEL_FAMILIES",
    "kernel_family",
    "StepProfile",
    "profile_families",
    "elementwise_floor_bytes",
    "fusion_floor_ms",
    "loss_curve",
    "REFERENCE",
    "YARDSTICK",
    "RERUNS",
    "rerun_name",
    "reround",
    "loss_curves",
    "compare_curves",
    "release",
    "datasheet_tflops",
    "decode_step_bytes",
    "decode_limit",
    "decode_logits",
    "generation_times",
    "common_prefix",
    "hf_generate",
]

# GPTConfig sizes of the capstone's models, vocabulary 32768 (the standard-library BPE tokenizer's), untied head,
# SwiGLU width 8/3 d rounded up to 256 (GPTConfig's default). Parameters counted by GPT.num_parameters.
SIZES = {
    "125m": dict(vocab_size=32768, d_model=768, n_layers=12, n_heads=12),  # 135M; head dim 64, d_ff 2048
    "350m": dict(vocab_size=32768, d_model=1024, n_layers=24, n_heads=16),  # 375M; head dim 64, d_ff 2816
    "1b": dict(vocab_size=32768, d_model=2048, n_layers=16, n_heads=16),  # 956M; head dim 128, d_ff 5632
    "7b": dict(vocab_size=32768, d_model=4096, n_layers=32, n_heads=32),  # 6.74B; head dim 128, d_ff 11008
    "tiny": dict(vocab_size=512, d_model=64, n_layers=2, n_heads=4),  # 0.1M: CPU runs, Triton interpreted
}

# The versions of the training comparison: name -> (GPTConfig.impl, torch.compile mode, None for eager). The issue's
# four levels, and version 4 twice: Triton ops cost the host more per launch than Inductor's kernels, so compiled
# alone it waits on the host; CUDA graphs (mode="reduce-overhead") replay its launches instead.
VERSIONS = {
    "naive eager": ("naive", None),
    "native eager": ("native", None),
    "native compiled": ("native", "default"),
    "kernel_lib compiled": ("kernel_lib", "default"),
    "kernel_lib CUDA graphs": ("kernel_lib", "reduce-overhead"),
}


@dataclass
class Version:
    """One version, ready to train: ``model`` is what a step calls (the GPT or torch.compile's wrapper of it)."""

    name: str
    model: nn.Module
    gpt: GPT
    mode: Optional[str]  # the torch.compile mode the version asks for; None: eager
    compiled: bool  # False where compilation was asked for but skipped (compile=False)

    @property
    def graphs(self) -> bool:
        """Whether steps replay CUDA graphs (and must tell torch.compile where an iteration begins)."""
        return self.compiled and self.mode == "reduce-overhead"


def build_version(name: str, source: nn.Module, device=None, dtype=None, compile: bool = True) -> Version:
    """A fresh GPT of version ``name`` (a key of VERSIONS) with ``source``'s weights (``transfer_weights``: any
    version of the same sizes, on any device), on ``device`` in ``dtype``, compiled when the version is and
    ``compile`` is true.

    Compiling resets Dynamo first (``torch._dynamo.reset()``): every version then compiles from scratch instead
    of adding entries to the forward's cache, where the versions before it would count towards Dynamo's recompile
    limit (past it, Dynamo runs the forward eagerly without failing). A model compiled earlier recompiles on its
    next call; the on-disk caches stay.
    """
    if name not in VERSIONS:
        raise ValueError(f"unknown version {name!r}; choose from {', '.join(VERSIONS)}")
    impl, mode = VERSIONS[name]
    gpt = GPT(dataclasses.replace(_unwrap(source).config, impl=impl), device=device, dtype=dtype)
    transfer_weights(source, gpt)
    compiled = mode is not None and compile
    model = gpt
    if compiled:
        torch._dynamo.reset()
        model = torch.compile(gpt, mode=None if mode == "default" else mode)
    return Version(name, model, gpt, mode, compiled)


def make_optimizer(model: nn.Module, lr: float = 3e-4) -> torch.optim.Optimizer:
    """AdamW with GPT training's usual settings (betas 0.9 and 0.95, weight decay 0.1, here on every parameter),
    in the parameters' dtype; on a GPU the fused implementation (a few kernels for all parameters)."""
    on_gpu = next(model.parameters()).is_cuda
    return torch.optim.AdamW(
        model.parameters(), lr=lr, betas=(0.9, 0.95), weight_decay=0.1, fused=True if on_gpu else None
    )


def train_step(model, optimizer, idx: torch.Tensor, targets: torch.Tensor, graphs: bool = False) -> torch.Tensor:
    """One training step: the loss (forward), backward, ``optimizer.step()``, gradients dropped (set to None, so
    they do not hold memory between steps). Returns the loss, detached.

    ``graphs``: the model was compiled with mode="reduce-overhead". The step then first tells torch.compile that
    a new iteration begins (``cudagraph_mark_step_begin``), so that its CUDA graphs may reuse the memory of the
    previous step's outputs: read the returned loss before the next step.
    """
    if graphs:
        torch.compiler.cudagraph_mark_step_begin()
    loss = model(idx, targets)
    loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return loss.detach()


StepCost, step_cost = bench.StepCost, bench.step_cost  # one timer for every step in the course


# Kernel families, by lower-cased substrings of the kernel's name; the first family that matches wins, so the order
# matters: the loss's log-softmax before attention's softmax, attention's matmul-like kernels before matmul. Names
# seen: cuBLAS (nvjet_*, sm90_xmma_gemm_*, cutlass*_gemm), PyTorch's flash attention (flash_fwd_kernel,
# flash_bwd_*), kernel_lib's Triton kernels (_attn_fwd_kernel, _norm_fwd_kernel, _gated_fwd_kernel, _ce_fwd_kernel,
# _rope_kernel), Inductor's fused kernels named after their ops (triton_red_fused__log_softmax_*,
# triton_per_fused_add_mean_mul_pow_rsqrt_*, triton_poi_fused_mul_silu_*), eager ATen kernels
# (cunn_SoftMaxForward<..., LogSoftMaxForwardEpilogue>, silu_kernel, masked_fill_kernel) and on the CPU ATen ops
# (aten::mm, aten::_softmax) and kernel_lib's autograd functions (_Norm, _GatedActivation, _LinearCrossEntropy).
KERNEL_FAMILIES = (
    ("loss", ("log_softmax", "logsoftmax", "nll_loss", "cross_entropy", "crossentropy", "_ce_fwd", "_ce_bwd")),
    ("attention", ("attn", "attention", "flash", "fmha", "sdpa", "softmax", "masked_fill", "triu")),
    ("norm", ("norm", "rsqrt", "meanops", "aten::mean", "pow")),
    ("activation", ("silu", "sigmoid", "gelu", "swiglu", "gated")),
    ("matmul", ("gemm", "gemv", "nvjet", "xmma", "cutlass", "cublas", "splitk", "matmul", "::mm", "addmm", "bmm")),
    ("optimizer", ("adam", "multi_tensor", "foreach")),
)
OTHER = "other"  # embedding, RoPE, residual adds, casts, copies, memsets


def kernel_family(name: str) -> str:
    """The family of a kernel (or, on the CPU, an operator) named ``name``: one of KERNEL_FAMILIES' or "other".
    A fused kernel belongs to the first family whose substring it contains: the split is approximate."""
    low = name.lower()
    for family, needles in KERNEL_FAMILIES:
        if any(needle in low for needle in needles):
            return family
    return OTHER


@dataclass
class StepProfile:
    families: dict[str, float]  # ms per step spent in each family (kernel time on a GPU, operator time on the CPU)
    busy_ms: float  # GPU time in kernels per step (nan on the CPU)
    wall_ms: float  # host time per step, under the profiler
    kernels_per_step: int  # kernels (GPU) or operators (CPU) per step
    clock: str  # "gpu kernels" or "cpu operators (self time)"
    top: list[tuple[str, float, int]] = dataclasses.field(default_factory=list)  # (name, ms/step, calls/step)


def profile_families(step: Callable[[], object], device, steps: int = 3) -> StepProfile:
    """:func:`kernel_lib.bench.profile_kernels` with each kernel's time summed into its family (``kernel_family``).
    On the CPU the operators' self time stands in for kernels (the families of the same code, another machine)."""
    prof = bench.profile_kernels(step, device, steps)
    families = {family: 0.0 for family, _ in KERNEL_FAMILIES} | {OTHER: 0.0}
    for name, (ms, _calls) in prof.by_name.items():
        families[kernel_family(name)] += ms
    return StepProfile(families, prof.busy_ms, prof.wall_ms, prof.kernels_per_step, prof.clock, prof.top[:12])


def elementwise_floor_bytes(config, batch: int, seq_len: int, element_size: int) -> dict[str, int]:
    """Bytes that a training step's norm and activation families must move at least, whatever fuses them, for a
    GPT of ``config`` on ``batch`` x ``seq_len`` tokens in a dtype of ``element_size`` bytes. N tokens, width d,
    SwiGLU width F, L layers (with experts: each token's top_k rows through the experts)::

        norm        (2 L + 1) RMSNorms: forward reads x, writes y; backward reads dy and x, writes dx:
                    5 N d elements each, plus the weight read twice and its gradient written (3 d)
        activation  L SwiGLUs: forward reads gate and up, writes h; backward reads dh, gate and up, writes
                    dgate and dup: 8 N F elements each (keeping h, or computing it again, is on top)

    What is left out can cost nothing in principle: the loss fused into the head's matmuls, RoPE and the layout
    copies fused into the attention kernels, the residual adds into the norms. Attention's time is FLOPs, not
    bytes: ``fusion_floor_ms`` takes the fastest measured attention for it."""
    c = config
    tokens = batch * seq_len
    rows = tokens * c.top_k if c.n_experts else tokens
    norm = (2 * c.n_layers + 1) * (5 * tokens * c.d_model + 3 * c.d_model)
    activation = c.n_layers * 8 * rows * c.d_ff
    return {"norm": norm * element_size, "activation": activation * element_size}


def fusion_floor_ms(profiles: dict[str, StepProfile], floor_ms: dict[str, float]) -> float:
    """The shortest step that ``profiles`` (version -> ``profile_families``) allow: matmul, optimizer and attention
    at the fastest of the profiled versions (the first two are cuBLAS and PyTorch's AdamW in every version), the
    families of ``floor_ms`` (ms, e.g. ``elementwise_floor_bytes`` over the copy bandwidth) at their floors, and
    everything else (loss, RoPE, residual adds, layout copies) free. A step no choice of those kernels can beat.
    A kernel that ``kernel_family`` puts in "other" counts as free too (cuDNN's SDPA backward helpers
    ``compute_dot_do_o`` and ``convert_dq_to_16bits``, about 1.1 ms a step of the 350m model on an H100,
    ``benchmarks/NOTES.md``, 2026-11-25): the bound is then looser, not wrong."""
    if not profiles:
        raise ValueError("fusion_floor_ms needs at least one profile")
    measured = ("matmul", "optimizer", "attention")
    clash = set(measured) & set(floor_ms)
    if clash:
        raise ValueError(f"families {sorted(clash)} are taken as measured; give floors for the others only")
    best = sum(min(p.families.get(f, 0.0) for p in profiles.values()) for f in measured)
    return best + sum(floor_ms.values())


def loss_curve(
    model, optimizer, batches: Iterator[tuple[torch.Tensor, torch.Tensor]], steps: int, graphs: bool = False
) -> list[float]:
    """Train ``steps`` steps on the next batches of ``batches`` (``kernel_lib.models.batches``); the loss of each
    step, read before the next (a host sync per step: fine for a curve, not for timing)."""
    losses = []
    for _ in range(steps):
        idx, targets = next(batches)
        losses.append(float(train_step(model, optimizer, idx, targets, graphs)))
    return losses


def release(device=None) -> None:
    """Drop what the last version left: Python cycles, then the CUDA allocator's cached blocks."""
    gc.collect()
    if torch.device(device or "cpu").type == "cuda":
        torch.cuda.empty_cache()


REFERENCE = "native eager, float32"  # the first step's reference: PyTorch's own ops without low-precision rounding
YARDSTICK = "native eager"  # PyTorch's own ops in the run's dtype: how far its roundings alone move the curve
RERUNS = 3  # re-runs of YARDSTICK from weights rounded once more: the ensemble the late steps are judged against


def rerun_name(i: int, yardstick: str = YARDSTICK) -> str:
    """The curve name of the yardstick's ``i``-th re-run (1-based) from re-rounded weights (``reround``)."""
    return f"{yardstick} #{i}"


@torch.no_grad()
def reround(model: nn.Module, seed: int) -> None:
    """Move every parameter by a random relative amount below its dtype's machine epsilon and round it again: the
    same weights up to one rounding each, as a different order of operations could have left them. Drawn on the
    CPU from ``seed`` (the same perturbation on any device)."""
    generator = torch.Generator().manual_seed(seed)
    for p in model.parameters():
        noise = torch.rand(p.shape, generator=generator).mul_(2).sub_(1).mul_(torch.finfo(p.dtype).eps)
        p.copy_(p.float() * (1 + noise.to(p.device)))


def loss_curves(
    source: nn.Module,
    tokens: torch.Tensor,
    batch: int,
    seq_len: int,
    steps: int,
    device=None,
    dtype=None,
    compile: bool = True,
    lr: float = 3e-4,
    seed: int = 0,
    versions=None,
    reruns: int = RERUNS,
    progress: Optional[Callable[[str, list[float], float], None]] = None,
) -> dict[str, list[float]]:
    """Loss curves from one set of weights and one stream of batches: ``REFERENCE`` (native eager in float32)
    first, then each of ``versions`` (default ``VERSIONS``) in ``dtype``, then ``reruns`` more runs of
    ``YARDSTICK`` (``rerun_name(i)``), each from the weights re-rounded with seed ``i`` (``reround``); one run on
    the device at a time. ``progress(name, curve, seconds)`` is called after each curve."""
    if YARDSTICK not in (versions or VERSIONS) and reruns:
        raise ValueError(f"re-runs repeat {YARDSTICK!r}: include it in versions, or pass reruns=0")
    curves = {}
    plan = [(REFERENCE, YARDSTICK, torch.float32, None)]
    plan += [(name, name, dtype, None) for name in (versions or VERSIONS)]
    plan += [(rerun_name(i), YARDSTICK, dtype, i) for i in range(1, reruns + 1)]
    for label, name, dt, rerun in plan:
        version = build_version(name, source, device, dt, compile=compile)
        if rerun is not None:
            reround(version.gpt, rerun)
        optimizer = make_optimizer(version.model, lr)
        stream = _batches(tokens, batch, seq_len, generator=torch.Generator().manual_seed(seed), device=device)
        start = time.perf_counter()
        curves[label] = loss_curve(version.model, optimizer, stream, steps, version.graphs)
        if progress is not None:
            progress(label, curves[label], time.perf_counter() - start)
        del version, optimizer
        release(device)  # one version on the device at a time
    return curves


def compare_curves(
    curves: dict[str, list[float]],
    reference: str = REFERENCE,
    first_rtol: float = 0.005,
    last_rtol: float = 0.03,
    last: int = 20,
    yardstick: Optional[str] = YARDSTICK,
    factor: float = 2.0,
) -> list[dict]:
    """Each curve by the course's rule, ``factor`` times what PyTorch's own ops do, with floors. Two numbers per
    curve:

    * the **first step** (same weights, same batch: only rounding differs) against ``reference``'s: allowed
      ``factor`` times ``yardstick``'s own difference, at least ``first_rtol``;
    * the **mean of the last** ``last`` steps against the centre of the yardstick's ensemble (``yardstick`` and its
      re-runs ``rerun_name(i)`` from re-rounded weights, see ``loss_curves``): allowed ``factor`` times the largest
      distance of a member from that centre, at least ``last_rtol``. Training amplifies one rounding into curves
      that wander apart, so one pair of runs says little; the ensemble shows how far PyTorch's own ops wander in
      the same dtype from roundings alone. ``reference`` is not judged on the late steps (``within_tolerance`` is
      None for it): its distance from the centre is what the low-precision dtype itself changes, the same for
      every version (``last_vs_reference`` gives each curve's).

    Runs with a non-finite loss are left out of the ensemble (and fail themselves). Without ``yardstick`` the late
    steps are compared with ``reference`` and ``last_rtol`` alone. One row per
    curve, with the largest absolute difference from ``reference`` at any step."""
    ref = curves[reference]
    n_last = min(last, len(ref))
    for name, curve in curves.items():
        if len(curve) != len(ref):
            raise ValueError(f"{name}: {len(curve)} steps, the reference {reference!r} has {len(ref)}")

    def mean_last(curve):
        return sum(curve[-n_last:]) / n_last

    def first_diff(curve):
        return abs(curve[0] - ref[0]) / abs(ref[0])

    members = [] if yardstick is None else [yardstick]
    if members:
        members += [name for i in range(1, len(curves)) if (name := rerun_name(i, yardstick)) in curves]
    finite = [m for m in members if all(math.isfinite(v) for v in curves[m])]  # a diverged run fails alone
    if members and not finite:
        raise ValueError(f"every run of {yardstick!r} and its re-runs has a non-finite loss: no yardstick")
    centre = sum(mean_last(curves[m]) for m in finite) / len(finite) if finite else mean_last(ref)
    allowed_first, allowed_last = first_rtol, last_rtol
    if finite:
        allowed_first = max(first_rtol, factor * first_diff(curves[finite[0]]))
        spread = max(abs(mean_last(curves[m]) - centre) for m in finite) / abs(centre)
        allowed_last = max(last_rtol, factor * spread)
    rows = []
    for name, curve in curves.items():
        first, end = first_diff(curve), abs(mean_last(curve) - centre) / abs(centre)
        ok = all(math.isfinite(v) for v in curve) and first <= allowed_first and end <= allowed_last
        rows.append({
            "version": name,
            "first_loss": curve[0],
            "first_rel_diff": first,
            "last_steps": n_last,
            "mean_last": mean_last(curve),
            "last_rel_diff": end,
            "last_vs_reference": abs(mean_last(curve) - mean_last(ref)) / abs(mean_last(ref)),
            "max_abs_diff": max(abs(a - b) for a, b in zip(curve, ref, strict=True)),
            "allowed_first": allowed_first,
            "allowed_last": allowed_last,
            "within_tolerance": None if (name == reference and members) else ok,
        })  # fmt: skip
    return rows


def datasheet_tflops(device_name: str) -> Optional[float]:
    """Dense bfloat16 tensor-core TFLOP/s from NVIDIA's datasheet for the SXM H100 and H200: 989 (the datasheets
    list 1,979 "with sparsity", twice the dense rate). None for other GPUs, including the PCIe and NVL boards,
    whose clocks and power limits differ: their MFU is reported against the measured ceiling only."""
    name = device_name.upper()
    if "PCIE" in name or "NVL" in name:
        return None
    if "H100" in name or "H200" in name:
        return 989.0
    return None


def decode_step_bytes(model, batch: int, pos: int) -> int:
    """Bytes that one decode step of ``batch`` sequences, each at position ``pos``, must move at least: every
    parameter but the embedding table once (each is read once whatever the batch), one embedding row, the cached
    keys and values of positions 0..pos and the new key and value written, per sequence. RoPE tables and the
    activations are left out (a few KB). A layer quantized by ``kernel_lib.quantize_`` counts its stored bytes
    (integers, scales and zero points)."""
    gpt = _unwrap(model)
    c = gpt.config
    size = gpt.head.weight.element_size()
    weights = sum(p.numel() for name, p in gpt.named_parameters() if name != "embed.weight") * size
    weights += sum(b.numel() * b.element_size() for m in gpt.modules() if isinstance(m, QuantizedLinear)
                   for b in m.buffers())  # fmt: skip
    per_position = 2 * c.n_layers * c.kv_dim * size  # a key and a value per layer (n_kv_heads of them)
    return weights + batch * (c.d_model * size + (pos + 1) * per_position + per_position)


def decode_limit(model, batch: int, prompt_len: int, new_tokens: int, copy_gbps: float) -> float:
    """Tokens per second that decode steps cannot beat when they move ``decode_step_bytes`` at the copy bandwidth
    ``copy_gbps`` (GB/s, ``kernel_lib.bench.copy_bandwidth``: bytes read + written): batch x steps over the time of
    the steps of one generation, which feed positions prompt_len .. prompt_len + new_tokens - 2 (the prefill
    produces the first new token)."""
    steps = range(prompt_len, prompt_len + new_tokens - 1)
    if len(steps) < 1:
        raise ValueError(f"new_tokens must be at least 2 for a decode step, got {new_tokens}")
    total = sum(decode_step_bytes(model, batch, pos) for pos in steps)
    return batch * len(steps) * copy_gbps * 1e9 / total


@torch.no_grad()
def decode_logits(model, seq: torch.Tensor, prompt_len: int, graph_step: bool = True) -> torch.Tensor:
    """Logits (B, L - prompt_len, V) predicting tokens prompt_len .. L - 1 of ``seq`` (B, L), as decoding computes
    them: a prefill of the prompt, then one ``forward_step`` per token of ``seq`` (teacher forcing), on a cache of
    L positions. ``graph_step``: positions as a tensor and kv_len = kv_bucket, the step GraphedDecoder captures
    (run eagerly here); else Python int positions, the step of eager ``greedy``."""
    gpt = _unwrap(model)
    B, L = seq.shape
    cache = gpt.init_cache(B, L)
    out = [gpt.forward_step(seq[:, :prompt_len], cache, 0)[:, -1:]]
    pos = torch.zeros(1, dtype=torch.int64, device=seq.device)
    for p in range(prompt_len, L - 1):
        token = seq[:, p : p + 1]
        if graph_step:
            pos.fill_(p)
            out.append(gpt.forward_step(token, cache, pos, kv_bucket(p + 1, L)))
        else:
            out.append(gpt.forward_step(token, cache, p))
    return torch.cat(out, dim=1)


def generation_times(generate: Callable, prompt: torch.Tensor, new_tokens: int, **timing) -> tuple[float, float]:
    """(generation_ms, ttft_ms): medians (``bench.time_fn``; ``timing``: its keywords) of ``generate(prompt,
    new_tokens)`` and of ``generate(prompt, 1)``, the prefill and the first token: the time to first token. Call
    ``generate`` once before: ``time_fn`` leaves one call untimed, but a first generation may compile or capture
    for longer than a timing window. Decode tokens/s follows as batch (new_tokens - 1) / (generation - TTFT)."""
    total = bench.time_fn(lambda: generate(prompt, new_tokens), **timing).median_ms
    ttft = bench.time_fn(lambda: generate(prompt, 1), **timing).median_ms
    return total, ttft


def common_prefix(a: torch.Tensor, b: torch.Tensor, start: int, n: int) -> int:
    """How many tokens two generations (B, L) agree on from position ``start``, at most n: for each sequence the
    run of equal tokens from ``start`` on, the shortest over the batch (n: the first n new tokens all agree)."""
    same = (a[:, start : start + n] == b[:, start : start + n]).int()
    return int(same.cumprod(dim=1).sum(dim=1).min())


def hf_generate(hf_model, prompt: torch.Tensor, max_new_tokens: int, static: bool = False) -> torch.Tensor:
    """Greedy tokens (B, T0 + max_new_tokens) from Hugging Face's ``generate`` on the prompt (B, T0), no padding.

    ``static=False``: its default dynamic cache (grown with each token), eager. ``static=True``:
    ``cache_implementation="static"``, a cache allocated once at full length; on a GPU ``generate`` then compiles
    its decode step by itself (transformers' automatic compile, with its default CompileConfig; the prefill stays
    eager). On the CPU it does not compile. The model converted by ``to_hf_llama`` has no end-of-sequence token, so
    every sequence runs to max_new_tokens."""
    kwargs = dict(max_new_tokens=max_new_tokens, do_sample=False, attention_mask=torch.ones_like(prompt))
    if static:
        kwargs["cache_implementation"] = "static"
    return hf_model.generate(prompt, **kwargs)
