"""kernel_lib.bench.timing: time_fn, host and CUDA-graph time, step cost and kernel profiles."""

import math
import time

import pytest
import torch

from kernel_lib import bench


def test_throughput_units():
    assert bench.gbps(2e9, 1.0) == pytest.approx(2000.0)  # 2 GB in 1 ms
    assert bench.tflops(1e12, 1000.0) == pytest.approx(1.0)  # 1e12 FLOP in 1 s


@pytest.mark.parametrize("q, expected", [(0.0, 1.0), (0.5, 2.5), (1.0, 4.0), (0.2, 1.6)])
def test_quantile_interpolates(q, expected):
    assert bench._quantile([1.0, 2.0, 3.0, 4.0], q) == pytest.approx(expected)


def test_time_fn_on_cpu_measures_a_known_duration():
    timing = bench.time_fn(lambda: time.sleep(0.002), warmup_ms=5, rep_ms=60, device="cpu")
    assert timing.timer == "cpu-perf-counter"
    assert 1.9 <= timing.median_ms <= 30  # sleep never returns early; a loaded machine may be late
    assert timing.p20_ms <= timing.median_ms <= timing.p80_ms
    assert len(timing.samples_ms) >= 3


def test_time_fn_orders_work_by_size():
    small, large = torch.randn(64, 64), torch.randn(512, 512)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # a thread pool contended by other processes stalls for milliseconds, even on 64x64
    try:
        t_small = bench.time_fn(lambda: small @ small, warmup_ms=5, rep_ms=50, device="cpu")
        t_large = bench.time_fn(lambda: large @ large, warmup_ms=5, rep_ms=50, device="cpu")
    finally:
        torch.set_num_threads(threads)
    assert t_large.median_ms > 10 * t_small.median_ms  # 512x the FLOPs


def test_time_fn_rejects_unknown_device():
    with pytest.raises(ValueError, match="cuda or cpu"):
        bench.time_fn(lambda: None, device="meta")


def test_repeat_in_graph_runs_fn_that_many_times_on_cpu():
    calls = []
    run = bench.repeat_in_graph(lambda: calls.append(1), 7, device="cpu")
    run()
    assert len(calls) == 7
    with pytest.raises(ValueError, match="at least 1"):
        bench.repeat_in_graph(lambda: None, 0, device="cpu")


@pytest.mark.gpu
def test_repeat_in_graph_replays_every_call():
    x = torch.zeros(1024, device="cuda")
    replay = bench.repeat_in_graph(lambda: x.add_(1.0), 10)  # the warm-up adds 3 before capture
    before = x[0].item()
    replay()
    replay()
    torch.cuda.synchronize()
    assert x[0].item() == before + 20


def test_host_ms_is_a_positive_median_on_cpu():
    calls = []
    ms = bench.host_ms(lambda: (calls.append(1), time.sleep(0.001)), reps=15, warmup=3, device="cpu")
    assert len(calls) == 18  # warm-up calls, then the timed ones
    assert 0.9 <= ms <= 50  # sleep never returns early; a loaded machine may be late
    with pytest.raises(ValueError, match="at least 1"):
        bench.host_ms(lambda: None, reps=0, device="cpu")


def test_graph_ms_on_cpu_is_time_per_call_of_the_loop():
    calls = []
    ms = bench.graph_ms(lambda: (calls.append(1), time.sleep(0.001)), repeats=4, device="cpu", warmup_ms=1, rep_ms=5)
    assert len(calls) % 4 == 0 and len(calls) >= 12  # whole loops of 4, at least 3 timed
    assert 0.9 <= ms <= 50


@pytest.mark.gpu
def test_host_and_graph_ms_on_gpu():
    x = torch.zeros(2**20, device="cuda")
    assert 0 < bench.host_ms(lambda: x.add_(1.0), reps=50) < 5  # one launch: microseconds, not milliseconds
    assert 0 < bench.graph_ms(lambda: x.add_(1.0), repeats=10, flush_l2=False) < 1


def test_step_cost_and_kernel_profile_on_the_cpu():
    # the one timer and profiler every whole-step measurement uses (the assistant, the capstone)
    w = torch.randn(64, 64, requires_grad=True)

    def step():
        (torch.randn(32, 64) @ w).square().mean().backward()

    cost = bench.step_cost(step, "cpu", warmup_ms=1, rep_ms=5)
    assert cost.ms > 0 and cost.first_ms > 0 and math.isnan(cost.peak_bytes) and cost.timer == "cpu-perf-counter"
    prof = bench.profile_kernels(step, "cpu", steps=2)
    assert prof.clock.startswith("cpu") and math.isnan(prof.busy_ms) and prof.kernels_per_step > 0
    assert any("mm" in name for name, _, _ in prof.top)
