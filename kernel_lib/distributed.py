"""Training on many GPUs with PyTorch's own engine: ``torch.distributed``, DDP and FSDP2, launched by ``torchrun``.

Small helpers around PyTorch's engine, never a replacement for it. One step on N ranks (one process a GPU, or
gloo processes on a CPU), each rank holding B of the G = N B sequences of the global batch::

    env = init()                      process group from torchrun's variables (RANK, WORLD_SIZE, LOCAL_RANK,
                                      MASTER_ADDR/PORT); NCCL on GPUs, gloo on the CPU; one process without torchrun
    model = wrap(gpt, "fsdp2", env)   "none": as is; "ddp": DistributedDataParallel, a full copy per rank, gradients
                                      all-reduced in buckets during backward; "fsdp2": fully_shard per block and on
                                      the root, each parameter split 1/N across ranks, all-gathered before a block's
                                      forward and again before its backward, gradients reduce-scattered. Optional:
                                      activation checkpointing per block, torch.compile per block
    idx, targets = shard_batch(...)   rank r trains on rows r B .. (r+1) B - 1 of the global batch
    loss = model(idx, targets); loss.backward(); optimizer.step()
    StepTimer                         tokens/s (all ranks and per GPU), MFU, peak memory of every rank
    save_checkpoint / load_checkpoint torch.distributed.checkpoint: each rank writes its own shards, any number
                                      of ranks reads them back (resharding)

Mixed precision. FSDP2 keeps float32 parameters (sharded) and optimizer states, computes in ``param_dtype``
(bfloat16: the all-gather casts) and reduces gradients in float32 (``MixedPrecisionPolicy``). DDP and "none" hold
the parameters in ``param_dtype`` itself, as the capstone does; DDP then all-reduces the bfloat16 gradients in
float32 (``fp32_allreduce_hook``, a DDP communication hook).

Bytes each rank sends per step for P parameters (ring algorithms; ``comm_bytes``), with b_p the compute dtype's
size and b_r the reduction's::

    DDP     all-reduce of the gradients                         2 (N-1)/N P b_r
    FSDP2   all-gather forward + all-gather backward             2 (N-1)/N P b_p
            + reduce-scatter of the gradients                   + (N-1)/N P b_r

with bfloat16 compute and float32 reduction both come to 8 (N-1)/N P bytes; FSDP2 pays it to hold 1/N of the
parameters, gradients and optimizer states (``memory_model``).

Model FLOPs utilization (MFU): model FLOPs per token (``GPT.flops_per_token``: 6 x the parameters each token is
multiplied by, embedding excluded, plus the attention's 12 L d T) times tokens/s per GPU, over a ceiling: the bf16
matmul throughput measured in the same run (``kernel_lib.bench.matmul_tflops``) and the datasheet's
(``kernel_lib.bench.capstone.datasheet_tflops``), both reported.

Sources: PyTorch's FSDP2 (``torch.distributed.fsdp.fully_shard``) and DDP documentation; torchtitan
(``parallelize_llama``: checkpoint, compile, then shard each block); Rajbhandari et al., "ZeRO" (2020) for the
memory terms.
"""

import gc
import json
import math
import os
import socket
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Optional

import torch
import torch.distributed as dist
from torch import nn

__all__ = [
    "STRATEGIES",
    "DistEnv",
    "init",
    "shutdown",
    "wrap",
    "blocks_of",
    "fp32_allreduce_hook",
    "shard_batch",
    "mean_over_ranks",
    "comm_bytes",
    "MemoryModel",
    "memory_model",
    "StepTimer",
    "RunSummary",
    "save_checkpoint",
    "load_checkpoint",
    "torchrun",
    "profile_step",
    "trace_kernels",
    "overlap",
]

STRATEGIES = ("none", "ddp", "fsdp2")


def _fsdp():
    """FSDP2's entry points: public in torch.distributed.fsdp from torch 2.6, under _composable before."""
    try:
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    except ImportError:  # torch < 2.6
        from torch.distributed._composable.fsdp import MixedPrecisionPolicy, fully_shard
    return fully_shard, MixedPrecisionPolicy


# --------------------------------------------------------------------------------------------------
# Process group
# --------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class DistEnv:
    """This process's place: ``rank`` of ``world_size``, its GPU (``local_rank`` on this host) or the CPU."""

    rank: int
    world_size: int
    local_rank: int
    device: torch.device
    backend: str

    @property
    def is_main(self) -> bool:
        """Rank 0: the one that prints and writes the run's files."""
        return self.rank == 0


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def init(device: Optional[str] = None, backend: Optional[str] = None) -> DistEnv:
    """Join the process group that torchrun describes in the environment, or start a group of one process when
    the script runs without torchrun (WORLD_SIZE unset), so the same code runs both ways.

    ``device``: "cuda" (one GPU per process: cuda:LOCAL_RANK) or "cpu"; default cuda when there is one.
    ``backend``: default "nccl" on GPUs, "gloo" on the CPU.
    """
    device_type = device or ("cuda" if torch.cuda.is_available() else "cpu")
    if device_type not in ("cuda", "cpu"):
        raise ValueError(f"device must be 'cuda' or 'cpu', got {device!r}")
    if "WORLD_SIZE" not in os.environ:  # not started by torchrun: a group of one on this host
        os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1")
        os.environ.setdefault("MASTER_PORT", str(_free_port()))
    rank, world, local = (int(os.environ[k]) for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK"))
    if device_type == "cuda":
        if not torch.cuda.is_available():
            raise RuntimeError("device 'cuda' asked for, but torch sees no GPU")
        if local >= torch.cuda.device_count():
            raise RuntimeError(
                f"LOCAL_RANK {local} but only {torch.cuda.device_count()} GPUs: start at most one process per GPU"
            )
        torch.cuda.set_device(local)
        dev = torch.device("cuda", local)
    else:
        dev = torch.device("cpu")
    backend = backend or ("nccl" if device_type == "cuda" else "gloo")
    if not dist.is_initialized():
        if dev.type == "cuda":  # bound to its GPU from the start: NCCL need not guess the device from the rank
            dist.init_process_group(backend, rank=rank, world_size=world, device_id=dev)
        else:
            dist.init_process_group(backend, rank=rank, world_size=world)
    return DistEnv(rank, world, local, dev, backend)


def shutdown() -> None:
    """Leave the process group (every rank must call it, after its last collective, with its model and optimizer
    already dropped). The barrier makes every rank tear the group down together, not one while another still
    writes its files; the collection frees anything still holding the group while the interpreter is whole. Both
    answer a rank that aborted at exit on a 2-core CI machine ("terminate called without an active exception"),
    after every step had finished; reruns under load did not repeat it, so its cause is not pinned down."""
    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()
    gc.collect()


# --------------------------------------------------------------------------------------------------
# Strategies
# --------------------------------------------------------------------------------------------------
def blocks_of(model: nn.Module) -> nn.ModuleList:
    """The transformer blocks: a kernel_lib GPT's ``blocks`` or a Hugging Face causal LM's ``model.layers``."""
    if isinstance(getattr(model, "blocks", None), nn.ModuleList):
        return model.blocks
    inner = getattr(model, "model", None)
    if isinstance(getattr(inner, "layers", None), nn.ModuleList):
        return inner.layers
    raise TypeError(f"{type(model).__name__} has neither .blocks nor .model.layers (a list of transformer blocks)")


def fp32_allreduce_hook(process_group, bucket):
    """DDP communication hook: average a bucket of low-precision gradients in float32, then write them back.
    Each rank's gradient is rounded once (to its dtype) instead of once per addition of the ring."""
    group = process_group if process_group is not None else dist.group.WORLD
    buffer = bucket.buffer()
    wide = buffer.to(torch.float32).div_(dist.get_world_size(group))
    future = dist.all_reduce(wide, group=group, async_op=True).get_future()

    def narrow(fut):
        buffer.copy_(fut.value()[0])
        return buffer

    return future.then(narrow)


def wrap(
    model: nn.Module,
    strategy: str,
    env: DistEnv,
    param_dtype: Optional[torch.dtype] = None,
    compile: bool = False,
    checkpointing: bool = False,
    reshard_after_forward: bool = True,
) -> nn.Module:
    """``model`` ready to train with ``strategy`` (one of STRATEGIES), in torchtitan's order: activation
    checkpointing, then torch.compile of each block (``Module.compile``: in place, names unchanged), then the
    strategy's wrapper. Returns the module a step calls (for "none" and "fsdp2" ``model`` itself).

    ``model``: a kernel_lib GPT, or a Hugging Face causal LM (blocks in ``model.model.layers``), on env.device.
    ``param_dtype``: the compute dtype. "fsdp2" wants float32 parameters and casts them to it when gathering
    (None: no cast); "none" and "ddp" compute in the parameters' own dtype, and ``param_dtype``, if given, must
    equal it. ``reshard_after_forward``: FSDP2 frees each block's gathered parameters after its forward and gathers
    them again in backward (less memory, one more all-gather); the last block keeps them, its backward is next.
    """
    if strategy not in STRATEGIES:
        raise ValueError(f"strategy must be one of {STRATEGIES}, got {strategy!r}")
    params = list(model.parameters())
    if not params:
        raise ValueError("model has no parameters")
    devices = {p.device for p in params}
    if devices != {env.device}:
        raise ValueError(f"model's parameters are on {sorted(map(str, devices))}; this rank's device is {env.device}")
    held = params[0].dtype
    if strategy != "fsdp2" and param_dtype is not None and param_dtype != held:
        raise ValueError(
            f"strategy {strategy!r} computes in the parameters' dtype ({held}); build the model in {param_dtype}"
        )
    blocks = blocks_of(model)
    if checkpointing:
        if hasattr(model, "checkpoint_blocks"):
            model.checkpoint_blocks = True
        elif hasattr(model, "gradient_checkpointing_enable"):  # Hugging Face's own switch
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        else:
            raise TypeError(f"no activation checkpointing known for {type(model).__name__}")
    if compile:
        for block in blocks:
            block.compile()
    if strategy == "ddp":
        # The bucket views spare a copy of every gradient; the hook reduces low-precision gradients in float32.
        ddp = nn.parallel.DistributedDataParallel(
            model,
            device_ids=[env.device.index] if env.device.type == "cuda" else None,
            gradient_as_bucket_view=True,
        )
        if held != torch.float32:
            ddp.register_comm_hook(None, fp32_allreduce_hook)
        return ddp
    if strategy == "fsdp2":
        if held != torch.float32:
            raise ValueError(f"fsdp2 keeps float32 parameters (it casts them to param_dtype); the model is {held}")
        fully_shard, MixedPrecisionPolicy = _fsdp()
        from torch.distributed.device_mesh import init_device_mesh

        mesh = init_device_mesh(env.device.type, (env.world_size,))
        policy = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=torch.float32)
        for i, block in enumerate(blocks):
            last = i == len(blocks) - 1
            fully_shard(block, mesh=mesh, mp_policy=policy, reshard_after_forward=reshard_after_forward and not last)
        fully_shard(model, mesh=mesh, mp_policy=policy, reshard_after_forward=reshard_after_forward)
    return model


def shard_batch(idx: torch.Tensor, targets: torch.Tensor, env: DistEnv) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's rows of a global batch (G, T): rows rank B .. (rank+1) B - 1, B = G / world_size. Every rank
    draws the same global batch (same seed), so N ranks together train on exactly what one process of G would."""
    rows = idx.shape[0]
    if rows % env.world_size:
        raise ValueError(f"global batch of {rows} rows does not split over {env.world_size} ranks")
    b = rows // env.world_size
    part = slice(env.rank * b, (env.rank + 1) * b)
    return idx[part], targets[part]


def mean_over_ranks(value: torch.Tensor) -> torch.Tensor:
    """The mean of a scalar over all ranks (an all-reduce: every rank must call it)."""
    value = value.detach().float().clone()
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(value)
        value /= dist.get_world_size()
    return value


# --------------------------------------------------------------------------------------------------
# What a step moves and holds
# --------------------------------------------------------------------------------------------------
def comm_bytes(
    strategy: str, n_params: int, world_size: int, param_bytes: int = 2, reduce_bytes: int = 4,
    reshard_after_forward: bool = True,
) -> float:  # fmt: skip
    """Bytes one rank sends per step (the module docstring's table; ring all-reduce = reduce-scatter + all-gather).
    Without ``reshard_after_forward`` FSDP2 gathers each parameter once, not twice."""
    if world_size == 1 or strategy == "none":
        return 0.0
    share = (world_size - 1) / world_size * n_params
    if strategy == "ddp":
        return 2 * share * reduce_bytes
    if strategy == "fsdp2":
        return (2 if reshard_after_forward else 1) * share * param_bytes + share * reduce_bytes
    raise ValueError(f"strategy must be one of {STRATEGIES}, got {strategy!r}")


@dataclass
class MemoryModel:
    """Predicted bytes held per rank at the peak of a training step (``memory_model``).

    ``total``: parameters and optimizer states are held throughout; gradients and activations trade places during
    the backward (each block's gradients appear as its saved activations are freed), so the peak holds the larger of
    the two, unless ``gradients_persist`` (DDP: its gradient buckets are allocated once and kept, and their float32
    copies are made while earlier blocks' activations still wait), when it holds both."""

    parameters: float  # the rank's parameters, plus FSDP2's gathered copies of the layers in use
    gradients: float
    optimizer: float  # AdamW's two moments
    activations: float  # saved for backward, plus the largest temporary
    gradients_persist: bool = False
    detail: dict = field(default_factory=dict)

    @property
    def total(self) -> float:
        both = self.gradients + self.activations if self.gradients_persist else max(self.gradients, self.activations)
        return self.parameters + self.optimizer + both

    def to_dict(self) -> dict:
        gib = 2**30
        return {
            "parameters_gib": self.parameters / gib,
            "gradients_gib": self.gradients / gib,
            "optimizer_gib": self.optimizer / gib,
            "activations_gib": self.activations / gib,
            "total_gib": self.total / gib,
        }


def memory_model(
    gpt,
    strategy: str,
    world_size: int,
    batch: int,
    seq_len: int,
    compute_dtype: torch.dtype = torch.bfloat16,
    checkpointing: bool = False,
    chunk_bytes: int = 2**29,
    reshard_after_forward: bool = True,
) -> MemoryModel:
    """Bytes per rank at the peak of a step of a kernel_lib GPT (impl "kernel_lib", dense), ``batch`` sequences of
    ``seq_len`` tokens per rank, AdamW.

    States: "none" and "ddp" hold parameters, gradients and both moments in the compute dtype (b bytes each, 4 P b
    in all), and DDP in low precision the float32 copies of its gradient buckets (4 P: ``fp32_allreduce_hook``
    reduces them asynchronously, so the copies of all buckets are alive when backward ends); "fsdp2" holds them
    in float32, 1/N each (16 P / N), plus the gathered compute-dtype copies of the root (embedding, head, final
    norm: gathered for the whole forward and backward) and of two blocks (the one running and the one
    prefetched), and the gradients of those before their reduce-scatter; without ``reshard_after_forward``
    every block's gathered copy stays from its forward to its backward.

    Activations saved per token and block, in elements of the compute dtype (every tensor the block's autograd
    keeps; equal tensors counted once): the block's input and the attention's normed input (2 d), q, k, v (d + 2 kv,
    kv = n_kv_heads * head_dim, d without grouped-query attention), the attention's output (d), the residual after
    attention and its normed copy (2 d), the gate/up product (2 d_ff, kept by SwiGLU) and SwiGLU's output (d_ff):
    6 d + 2 kv + 3 d_ff, plus float32 statistics (two RMSNorm
    1/rms, H log-sum-exps). With checkpointing a block keeps its input (d) and one block's full set is rebuilt at
    a time. Outside the blocks: the final norm's input and output (2 d per token) and linear_cross_entropy's
    gradients computed in the forward (d per token, and V d for the head). Largest temporary: a chunk of logits
    (``chunk_bytes``, or all of them if fewer) with its float32 statistics.
    """
    c = gpt.config
    if strategy not in STRATEGIES:
        raise ValueError(f"strategy must be one of {STRATEGIES}, got {strategy!r}")
    if c.n_experts:
        raise ValueError("memory_model counts a dense GPT's activations; this one has experts")
    b = torch.empty((), dtype=compute_dtype).element_size()
    P = sum(p.numel() for p in gpt.parameters())
    root = sum(p.numel() for name, p in gpt.named_parameters() if not name.startswith("blocks."))
    block = (P - root) / c.n_layers
    if strategy == "fsdp2":
        gathered = root + (2 if reshard_after_forward else c.n_layers) * block
        parameters = 4 * P / world_size + b * gathered
        gradients = 4 * P / world_size + b * (root + 2 * block)
        optimizer = 8 * P / world_size
    else:
        parameters, gradients, optimizer = b * P, b * P, 2 * b * P
        if strategy == "ddp" and b < 4:  # fp32_allreduce_hook: every bucket's float32 copy is in flight at the end
            gradients += 4 * P
    tokens = batch * seq_len
    per_block = (6 * c.d_model + 2 * c.kv_dim + 3 * c.d_ff) * b + (2 + c.n_heads) * 4  # q, k, v: d + 2 kv_dim
    saved = c.n_layers * c.d_model * b + per_block if checkpointing else c.n_layers * per_block
    loss_side = 3 * c.d_model * b * tokens + c.vocab_size * c.d_model * b
    chunk = min(chunk_bytes, tokens * c.vocab_size * b) + 2 * 4 * tokens
    activations = saved * tokens + loss_side + chunk
    detail = {"saved_per_token": saved, "loss_side": loss_side, "logits_chunk": chunk}
    return MemoryModel(parameters, gradients, optimizer, activations, strategy == "ddp", detail)


# --------------------------------------------------------------------------------------------------
# Timing, throughput, MFU and memory per rank
# --------------------------------------------------------------------------------------------------
@dataclass
class RunSummary:
    """A run's throughput and memory (``StepTimer.summary``); per-GPU figures divide by world_size."""

    strategy: str
    world_size: int
    steps_timed: int
    step_ms: float  # median over the timed steps
    tokens_per_s: float  # all ranks together
    tokens_per_s_per_gpu: float
    tflops_per_gpu: float
    mfu: dict  # ceiling name -> fraction of it, e.g. {"measured matmul": 0.61, "datasheet": 0.48}
    ceilings_tflops: dict  # the same names -> TFLOP/s
    peak_gib_per_rank: list  # max_memory_allocated of each rank (nan on the CPU)
    extra: dict = field(default_factory=dict)

    def to_dict(self) -> dict:
        return asdict(self)

    def to_dataframe(self):
        import pandas as pd

        row = {k: v for k, v in self.to_dict().items() if k not in ("mfu", "ceilings_tflops", "extra")}
        row["peak_gib_per_rank"] = max(self.peak_gib_per_rank)
        row |= {f"mfu {k}": v for k, v in self.mfu.items()} | self.extra
        return pd.DataFrame([row])

    def _repr_html_(self) -> str:
        return self.to_dataframe().to_html(index=False, float_format=lambda v: f"{v:,.3f}")

    def lines(self) -> list[str]:
        """The summary as the training script prints it."""
        out = [
            f"step {self.step_ms:.1f} ms (median of {self.steps_timed}), {self.tokens_per_s:,.0f} tokens/s on "
            f"{self.world_size} rank(s), {self.tokens_per_s_per_gpu:,.0f} per rank, "
            f"{self.tflops_per_gpu:.1f} TFLOP/s per rank"
        ]
        for name, frac in self.mfu.items():
            out.append(f"MFU {100 * frac:.1f}% of {name} ({self.ceilings_tflops[name]:.0f} TFLOP/s)")
        peaks = ", ".join(f"{v:.2f}" for v in self.peak_gib_per_rank)
        out.append(f"peak memory per rank (GiB): {peaks}")
        return out


class StepTimer:
    """Wall time of each step, ended by a device synchronization, and the run's summary.

    ``tokens_per_step``: tokens of the global batch (all ranks); ``flops_per_token``: model FLOPs
    (``GPT.flops_per_token``); ``ceilings``: name -> TFLOP/s of one GPU, for MFU (empty on the CPU)."""

    def __init__(self, env: DistEnv, tokens_per_step: int, flops_per_token: float, ceilings: Optional[dict] = None):
        self.env, self.tokens, self.flops = env, tokens_per_step, flops_per_token
        self.ceilings = {k: v for k, v in (ceilings or {}).items() if v}
        self.times_ms: list[float] = []
        self._start = None

    def _sync(self):
        if self.env.device.type == "cuda":
            torch.cuda.synchronize(self.env.device)

    def start(self) -> None:
        self._sync()
        self._start = time.perf_counter()

    def stop(self) -> float:
        """End the step begun by ``start``; returns its milliseconds."""
        if self._start is None:
            raise RuntimeError("StepTimer.stop() without start()")
        self._sync()
        ms = (time.perf_counter() - self._start) * 1e3
        self.times_ms.append(ms)
        self._start = None
        return ms

    def summary(self, strategy: str, skip: int) -> RunSummary:
        """Median over the steps after the first ``skip`` (compilation, allocator warm-up), and every rank's peak
        memory (an all-gather: every rank must call it)."""
        timed = self.times_ms[skip:]
        if not timed:
            raise ValueError(f"no steps to summarize: {len(self.times_ms)} timed, {skip} skipped")
        ms = sorted(timed)[len(timed) // 2]
        tps = self.tokens / (ms * 1e-3)
        per_gpu = tps / self.env.world_size
        tflops = self.flops * per_gpu / 1e12
        mfu = {name: tflops / peak for name, peak in self.ceilings.items()}
        return RunSummary(
            strategy, self.env.world_size, len(timed), ms, tps, per_gpu, tflops, mfu, dict(self.ceilings),
            peak_memory_per_rank(self.env),
        )  # fmt: skip


def peak_memory_per_rank(env: DistEnv) -> list[float]:
    """Every rank's ``torch.cuda.max_memory_allocated`` in GiB, gathered (nan on the CPU)."""
    mine = torch.cuda.max_memory_allocated(env.device) / 2**30 if env.device.type == "cuda" else math.nan
    if env.world_size == 1:
        return [mine]
    out = [None] * env.world_size
    dist.all_gather_object(out, mine)
    return [float(v) for v in out]


# --------------------------------------------------------------------------------------------------
# Distributed checkpoints
# --------------------------------------------------------------------------------------------------
def save_checkpoint(path, model: nn.Module, optimizer: torch.optim.Optimizer, step: int) -> None:
    """Write the model's and optimizer's state and the step count to the folder ``path`` with
    torch.distributed.checkpoint: each rank writes its own shards (FSDP2) or, with replicated states, rank 0
    writes them; ``.metadata`` says which file holds what, so any number of ranks can read it back."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    model_state, optim_state = get_state_dict(model, optimizer)
    state = {"model": model_state, "optimizer": optim_state, "step": torch.tensor(step)}
    dcp.save(state, checkpoint_id=str(path))


def load_checkpoint(path, model: nn.Module, optimizer: torch.optim.Optimizer) -> int:
    """Read a checkpoint written by ``save_checkpoint``, with any number of ranks and any strategy, into
    ``model`` and ``optimizer`` (built and wrapped as for training; the optimizer needs no step first). Returns
    the step count it was saved at."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    if not (Path(path) / ".metadata").is_file():
        raise FileNotFoundError(f"{path} is not a torch.distributed.checkpoint folder (no .metadata in it)")
    model_state, optim_state = get_state_dict(model, optimizer)
    state = {"model": model_state, "optimizer": optim_state, "step": torch.tensor(0)}
    dcp.load(state, checkpoint_id=str(path))
    set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optimizer"])
    return int(state["step"])


# --------------------------------------------------------------------------------------------------
# Launching
# --------------------------------------------------------------------------------------------------
def torchrun(script, args, nproc: int = 1, env: Optional[dict] = None, timeout: float = 1800, echo: bool = True):
    """Run ``script`` with ``args`` as torchrun would from a shell (``python -m torch.distributed.run --standalone
    --nproc-per-node nproc``; plain ``python`` for one process) and return its output (stdout and stderr, the
    ranks' lines interleaved), printed line by line as it comes when ``echo``. ``env``: variables to set or, with
    value None, to remove, on top of this process's (a caller's own torchrun variables are removed: the child
    starts its own group; ``PYTHONPATH`` leads with this kernel_lib's folder). Raises ``RuntimeError`` with the
    output's tail when the run fails or is still running after ``timeout`` seconds (then the launcher and every
    rank are killed)."""
    import signal
    import subprocess
    import sys
    import threading

    cmd = [sys.executable]
    if nproc > 1:
        cmd += ["-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(nproc)]
    cmd += [str(script), *map(str, args)]
    child = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_PORT")}
    # the ranks import the kernel_lib this process imported, installed or not
    here = str(Path(__file__).resolve().parents[1])
    child["PYTHONPATH"] = os.pathsep.join(p for p in (here, child.get("PYTHONPATH")) if p)
    for key, value in (env or {}).items():
        if value is None:
            child.pop(key, None)
        else:
            child[key] = str(value)
    lines = []
    # its own process group, so that a timeout kills the ranks torchrun started too
    proc = subprocess.Popen(
        cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=child, start_new_session=True
    )

    def pump():
        for line in proc.stdout:
            lines.append(line)
            if echo:
                print(line, end="", flush=True)

    reader = threading.Thread(target=pump, daemon=True)
    reader.start()
    try:
        code = proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        reader.join(5)
        tail = "".join(lines)[-4000:]
        raise RuntimeError(f"{' '.join(cmd)}: still running after {timeout:g} s; killed:\n{tail}") from None
    reader.join()
    out = "".join(lines)
    if code != 0:
        raise RuntimeError(f"{' '.join(cmd)} exited with {code}:\n{out[-4000:]}")
    return out


# --------------------------------------------------------------------------------------------------
# Does communication overlap compute? One step's profiler trace
# --------------------------------------------------------------------------------------------------
def profile_step(env: DistEnv):
    """A torch.profiler context for one step: GPU kernels (and CPU operators) with their streams and times."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if env.device.type == "cuda" else [])
    return profile(activities=activities)


_COMM = ("nccl", "allgather", "all_gather", "reducescatter", "reduce_scatter", "allreduce", "all_reduce")


def trace_kernels(path) -> list[dict]:
    """The GPU kernels of a Chrome trace written by torch.profiler: name, start and end (microseconds), stream,
    and whether it is a collective (NCCL's kernels: ncclDevKernel_AllGather_..., ..._ReduceScatter_...)."""
    events = json.loads(Path(path).read_text())["traceEvents"]
    out = []
    for e in events:
        if e.get("ph") == "X" and e.get("cat") == "kernel":
            name = e["name"]
            low = name.lower()
            out.append({
                "name": name, "start": float(e["ts"]), "end": float(e["ts"]) + float(e.get("dur", 0)),
                "stream": e.get("args", {}).get("stream", e.get("tid")),
                "comm": any(word in low for word in _COMM),
            })  # fmt: skip
    return sorted(out, key=lambda k: k["start"])


def _union(intervals):
    merged = []
    for a, b in sorted(intervals):
        if merged and a <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], b)
        else:
            merged.append([a, b])
    return merged


def overlap(kernels: list[dict]) -> dict:
    """How much of the collectives' time ran while a compute kernel ran: the union of the collectives' intervals
    against the union of the others', in milliseconds, and the overlapped fraction of the collectives' time."""
    comm = _union([(k["start"], k["end"]) for k in kernels if k["comm"]])
    compute = _union([(k["start"], k["end"]) for k in kernels if not k["comm"]])
    both, j = 0.0, 0
    for a, b in comm:
        while j < len(compute) and compute[j][1] <= a:
            j += 1
        m = j
        while m < len(compute) and compute[m][0] < b:
            both += max(0.0, min(b, compute[m][1]) - max(a, compute[m][0]))
            m += 1
    comm_us = sum(b - a for a, b in comm)
    return {
        "comm_ms": comm_us / 1e3,
        "compute_ms": sum(b - a for a, b in compute) / 1e3,
        "overlapped_ms": both / 1e3,
        "overlapped_fraction": both / comm_us if comm_us else float("nan"),
    }
