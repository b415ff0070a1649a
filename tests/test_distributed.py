"""kernel_lib.distributed and benchmarks/train_distributed.py on the CPU: two gloo processes started by torchrun
train as one process of the same global batch does (DDP and FSDP2), and a checkpoint moves between rank counts
and strategies. The helpers' arithmetic (bytes moved, memory model, overlap of a trace) against hand counts."""

import csv
import json
import os
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

from kernel_lib import distributed as kd
from kernel_lib.bench.capstone import SIZES
from kernel_lib.models import GPT, GPTConfig

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "benchmarks" / "train_distributed.py"
STEPS = 10
# tiny GPT (2 layers, d 64, vocabulary 512), float32, 4 sequences of 32 tokens per step in all; a learning rate
# large enough that the loss moves by 3-5% in 10 steps (the corpus is this Python's library), so a wrong gradient
# average would show.
COMMON = ["--device", "cpu", "--model", "tiny", "--seq-len", "32", "--lr", "3e-3", "--warmup", "1"]


def _run(tmp: Path, name: str, ranks: int, *args: str) -> list[dict]:
    """Run the script (under torchrun when ranks > 1); its steps.csv rows, floats."""
    out = tmp / name
    args = [*COMMON, "--cache-dir", tmp / "cache", "--out", out, *args]
    # The ranks inherit this session's TRITON_INTERPRET: set on a CPU machine (conftest), so the Triton kernels run
    # interpreted in every rank; unset on a GPU machine, where CPU tensors take kernel_lib's references.
    kd.torchrun(SCRIPT, args, ranks, timeout=600, echo=False)
    with open(out / "steps.csv") as f:
        return [{k: float(v) for k, v in row.items()} for row in csv.DictReader(f)]


# The tests that share the single-process run go to one xdist worker (--dist loadgroup), which runs it once
# (about a minute on the 2-core machine) instead of once per worker.
RUNS_GROUP = pytest.mark.xdist_group("distributed-single-run")


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("distributed")
    return tmp, _run(tmp, "single", 1, "--strategy", "none", "--batch", "4", "--steps", str(STEPS))


@RUNS_GROUP
@pytest.mark.parametrize("strategy", ["ddp", "fsdp2"])
def test_two_ranks_train_like_one_process_of_the_global_batch(runs, strategy):
    tmp, single = runs
    two = _run(tmp, strategy, 2, "--strategy", strategy, "--batch", "2", "--steps", str(STEPS))
    assert single[-1]["loss"] < 0.98 * single[0]["loss"]  # the run learns, so the comparison can fail
    for a, b in zip(single, two, strict=True):
        # float32, same weights and rows: only the order of the gradient sums differs between one and two ranks
        assert b["loss"] == pytest.approx(a["loss"], rel=1e-5), (strategy, a["step"])


@RUNS_GROUP
def test_checkpoint_reshards_between_two_ranks_and_one(runs):
    """Saved by 2 FSDP2 ranks at step 5, read by 1 process (no wrapper) for steps 5-7, saved, read by 2 DDP ranks
    for steps 8-9: every loss is the uninterrupted run's."""
    tmp, single = runs
    ck2, ck1 = tmp / "ck-fsdp2", tmp / "ck-one"
    first = _run(tmp, "part1", 2, "--strategy", "fsdp2", "--batch", "2", "--steps", "5", "--save", str(ck2))
    assert (ck2 / ".metadata").is_file() and len(list(ck2.glob("*.distcp"))) == 2  # one shard file per rank
    middle = _run(tmp, "part2", 1, "--strategy", "none", "--batch", "4", "--steps", "3", "--resume", str(ck2),
                  "--save", str(ck1))  # fmt: skip
    last = _run(tmp, "part3", 2, "--strategy", "ddp", "--batch", "2", "--steps", "2", "--resume", str(ck1))
    resumed = first + middle + last
    assert [int(r["step"]) for r in resumed] == list(range(STEPS))
    for a, b in zip(single, resumed, strict=True):
        assert b["loss"] == pytest.approx(a["loss"], rel=1e-5), a["step"]
    summary = json.loads((tmp / "part3" / "summary.json").read_text())
    assert summary["world_size"] == 2 and summary["strategy"] == "ddp"


def test_torchrun_reports_a_failed_run(tmp_path):
    with pytest.raises(RuntimeError, match=r"exited with 2:[\s\S]*--steps must be at least 1"):
        kd.torchrun(SCRIPT, ["--steps", "0"], 1, echo=False)


def test_torchrun_kills_a_run_past_its_timeout(tmp_path):
    sleeper = tmp_path / "sleep.py"
    sleeper.write_text("import time\nprint('started', flush=True)\ntime.sleep(60)\n")
    with pytest.raises(RuntimeError, match=r"still running after 2 s; killed:\s+started"):
        kd.torchrun(sleeper, [], 1, timeout=2, echo=False)


def test_resume_from_a_folder_that_is_no_checkpoint_is_refused(tmp_path):
    model = nn.Linear(2, 2)
    with pytest.raises(FileNotFoundError, match="no .metadata"):
        kd.load_checkpoint(tmp_path, model, torch.optim.AdamW(model.parameters()))


@pytest.mark.parametrize(
    "args, words",
    [
        (["--steps", "0"], "--steps must be at least 1"),
        (["--batch", "-1"], "--batch must be at least 1"),
        (["--steps", "3", "--profile-step", "3"], "--profile-step must be within 0..2"),
        (["--strategy", "zero3"], "invalid choice"),
    ],
)
def test_script_names_bad_arguments(args, words, capsys):
    sys.path.insert(0, str(SCRIPT.parent))
    try:
        import train_distributed
    finally:
        sys.path.pop(0)
    with pytest.raises(SystemExit):
        train_distributed.parse_args(args)
    assert words in capsys.readouterr().err


# --------------------------------------------------------------------------------------------------
# One process: a process group of one, as the script makes without torchrun
# --------------------------------------------------------------------------------------------------
@pytest.fixture
def group_of_one(monkeypatch):
    for key in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(key, raising=False)
    env = kd.init("cpu")
    for key in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.setenv(key, os.environ[key])  # restored (removed) after the test
    yield env
    kd.shutdown()


def test_init_without_torchrun_is_a_group_of_one(group_of_one):
    env = group_of_one
    assert (env.rank, env.world_size, env.backend, env.device.type, env.is_main) == (0, 1, "gloo", "cpu", True)
    assert torch.distributed.get_world_size() == 1


class _TwoLayers(nn.Module):
    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList([nn.Linear(8, 16), nn.Linear(16, 4)])

    def forward(self, x):
        return self.blocks[1](torch.tanh(self.blocks[0](x)))


def test_ddp_fp32_hook_leaves_one_rank_gradients_unchanged(group_of_one):
    """A bfloat16 model under DDP with the float32 all-reduce hook: with one rank the average is the gradient."""
    plain, inner = _TwoLayers().to(torch.bfloat16), _TwoLayers().to(torch.bfloat16)
    inner.load_state_dict(plain.state_dict())
    ddp = kd.wrap(inner, "ddp", group_of_one)
    x = torch.randn(5, 8, dtype=torch.bfloat16)
    plain(x).float().square().mean().backward()
    ddp(x).float().square().mean().backward()
    for p, q in zip(plain.parameters(), inner.parameters(), strict=True):
        torch.testing.assert_close(q.grad, p.grad, rtol=0, atol=0)


def test_fp32_hook_averages_in_float32_and_writes_back(monkeypatch):
    """The hook on a bfloat16 bucket, with a stand-in all-reduce that adds another rank's share: the bucket ends
    holding the float32 average rounded once to bfloat16 (a hook that forgot to write back would leave it as it was)."""
    mine = torch.randn(64).to(torch.bfloat16)
    other = torch.randn(64)  # the other rank's gradient, as its float32 share arrives

    def all_reduce(tensor, group=None, async_op=False):
        tensor.add_(other / 2)
        future = torch.futures.Future()
        future.set_result([tensor])
        return type("Work", (), {"get_future": lambda self: future})()

    monkeypatch.setattr(kd.dist, "all_reduce", all_reduce)
    monkeypatch.setattr(kd.dist, "get_world_size", lambda group=None: 2)
    buffer = mine.clone()
    bucket = type("Bucket", (), {"buffer": lambda self: buffer})()
    out = kd.fp32_allreduce_hook("group", bucket).wait()
    expected = (mine.float() / 2 + other / 2).to(torch.bfloat16)
    assert out is buffer
    torch.testing.assert_close(buffer, expected, rtol=0, atol=0)


@pytest.mark.parametrize(
    "strategy, kwargs, error, words",
    [
        ("zero", {}, ValueError, "strategy must be one of"),
        ("fsdp2", {}, ValueError, "fsdp2 keeps float32 parameters"),  # the model below is bfloat16
        ("none", {"param_dtype": torch.float32}, ValueError, "computes in the parameters' dtype"),
    ],
)
def test_wrap_names_bad_input(group_of_one, strategy, kwargs, error, words):
    model = GPT(GPTConfig(**SIZES["tiny"], impl="native"), dtype=torch.bfloat16)
    with pytest.raises(error, match=words):
        kd.wrap(model, strategy, group_of_one, **kwargs)


def test_wrap_refuses_a_model_on_another_device(group_of_one):
    model = GPT(GPTConfig(**SIZES["tiny"], impl="native"), device="meta")
    with pytest.raises(ValueError, match="this rank's device is cpu"):
        kd.wrap(model, "none", group_of_one)


def test_checkpointing_keeps_loss_and_gradients(group_of_one):
    """Activation checkpointing recomputes each block in backward: same loss and gradients, parameter names."""
    torch.manual_seed(1)
    config = GPTConfig(**SIZES["tiny"], impl="native")
    a, b = GPT(config), GPT(config)
    b.load_state_dict(a.state_dict())
    kd.wrap(b, "none", group_of_one, checkpointing=True)
    assert b.checkpoint_blocks and [n for n, _ in a.named_parameters()] == [n for n, _ in b.named_parameters()]
    idx = torch.randint(0, config.vocab_size, (2, 16))
    la, lb = a(idx, idx), b(idx, idx)
    la.backward()
    lb.backward()
    assert lb.item() == la.item()
    for (name, p), q in zip(a.named_parameters(), b.parameters(), strict=True):
        torch.testing.assert_close(q.grad, p.grad, rtol=0, atol=0, msg=name)


# --------------------------------------------------------------------------------------------------
# Arithmetic
# --------------------------------------------------------------------------------------------------
def test_shard_batch_takes_this_ranks_rows():
    idx = torch.arange(12).view(6, 2)
    env = kd.DistEnv(rank=2, world_size=3, local_rank=2, device=torch.device("cpu"), backend="gloo")
    part, _ = kd.shard_batch(idx, idx + 100, env)
    assert part.tolist() == [[8, 9], [10, 11]]
    with pytest.raises(ValueError, match="does not split over 4 ranks"):
        kd.shard_batch(idx, idx, kd.DistEnv(0, 4, 0, torch.device("cpu"), "gloo"))


@pytest.mark.parametrize("world", [1, 2, 8])
def test_comm_bytes_by_hand(world):
    P = 1_000_000
    share = (world - 1) / world * P
    assert kd.comm_bytes("ddp", P, world) == 2 * share * 4
    assert kd.comm_bytes("fsdp2", P, world) == 2 * share * 2 + share * 4  # two gathers of bf16, one fp32 scatter
    assert kd.comm_bytes("fsdp2", P, world, reshard_after_forward=False) == share * 2 + share * 4
    assert kd.comm_bytes("none", P, world) == 0.0


def test_memory_model_terms():
    gpt = GPT(GPTConfig(**SIZES["1b"], impl="kernel_lib"), device="meta")
    P = sum(p.numel() for p in gpt.parameters())
    one = kd.memory_model(gpt, "none", 1, batch=4, seq_len=2048)
    assert (one.parameters, one.gradients, one.optimizer) == (2 * P, 2 * P, 4 * P)  # bf16 states, AdamW's two
    assert one.total == one.parameters + one.optimizer + max(one.gradients, one.activations)
    ddp = kd.memory_model(gpt, "ddp", 2, batch=4, seq_len=2048)
    assert ddp.gradients == 2 * P + 4 * P  # the float32 copies of the buckets, in flight
    assert ddp.total == ddp.parameters + ddp.optimizer + ddp.gradients + ddp.activations  # buckets persist
    c = gpt.config
    per_block = (8 * c.d_model + 3 * c.d_ff) * 2 + (2 + c.n_heads) * 4
    assert one.detail["saved_per_token"] == c.n_layers * per_block
    eight = kd.memory_model(gpt, "fsdp2", 8, batch=4, seq_len=2048)
    assert eight.optimizer == 8 * P / 8 and eight.activations == one.activations
    ckpt = kd.memory_model(gpt, "none", 1, batch=4, seq_len=2048, checkpointing=True)
    assert ckpt.activations < one.activations / 5
    with pytest.raises(ValueError, match="experts"):
        kd.memory_model(GPT(GPTConfig(**SIZES["tiny"], n_experts=4), device="meta"), "none", 1, 1, 8)


def test_overlap_of_a_trace(tmp_path):
    """Two streams: a collective 10-30 us against compute 0-20 and 25-40: 15 of its 20 us overlap."""
    events = [
        {"ph": "X", "cat": "kernel", "name": "ncclDevKernel_AllGather_RING_LL", "ts": 10, "dur": 20, "tid": 2},
        {"ph": "X", "cat": "kernel", "name": "nvjet_tst_128x256", "ts": 0, "dur": 20, "tid": 1},
        {"ph": "X", "cat": "kernel", "name": "_attn_fwd_kernel", "ts": 25, "dur": 15, "tid": 1},
        {"ph": "X", "cat": "cpu_op", "name": "aten::mm", "ts": 0, "dur": 100, "tid": 0},  # not a kernel
    ]
    path = tmp_path / "trace.json"
    path.write_text(json.dumps({"traceEvents": events}))
    kernels = kd.trace_kernels(path)
    assert [k["comm"] for k in kernels] == [False, True, False]
    o = kd.overlap(kernels)
    assert o["comm_ms"] == pytest.approx(0.020) and o["overlapped_ms"] == pytest.approx(0.015)
    assert o["overlapped_fraction"] == pytest.approx(0.75) and o["compute_ms"] == pytest.approx(0.035)


def test_step_timer_summary():
    env = kd.DistEnv(0, 1, 0, torch.device("cpu"), "gloo")
    timer = kd.StepTimer(env, tokens_per_step=1000, flops_per_token=1e9, ceilings={"peak": 20.0, "none": None})
    timer.times_ms = [500.0, 100.0, 200.0, 100.0]  # the first is compilation: skipped
    s = timer.summary("none", skip=1)
    assert (s.step_ms, s.tokens_per_s, s.steps_timed) == (100.0, 10_000.0, 3)
    assert s.tflops_per_gpu == pytest.approx(10.0) and s.mfu == {"peak": pytest.approx(0.5)}  # 1e9 x 1e4 / s
    assert "MFU 50.0% of peak" in "\n".join(s.lines())
    with pytest.raises(ValueError, match="no steps to summarize"):
        timer.summary("none", skip=4)
