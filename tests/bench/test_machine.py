"""kernel_lib.bench.machine: environment, sizes switch, ceilings and peak memory."""

import pytest
import torch

from kernel_lib import bench


def test_ceilings_on_cpu_are_positive_and_named():
    ceilings = bench.measure_ceilings(device="cpu", matmul_n=128)
    assert ceilings.copy_gbps > 0
    assert set(ceilings.matmul_tflops) == {"bfloat16", "float32"}
    assert all(v > 0 for v in ceilings.matmul_tflops.values())
    assert [r["unit"] for r in ceilings.rows()] == ["GB/s", "TFLOP/s", "TFLOP/s"]
    assert ceilings.device.startswith("CPU")


def test_environment_names_versions_and_time():
    env = bench.environment("cpu")
    assert env["torch"] == torch.__version__
    assert env["triton"][0].isdigit()
    assert env["timestamp"][:2] == "20"


@pytest.mark.gpu
def test_gpu_timing_and_ceilings():
    x = torch.randn(2**26, device="cuda")  # 256 MB, beyond any L2
    y = torch.empty_like(x)
    flushed = bench.time_fn(lambda: y.copy_(x))
    assert flushed.timer == "cuda-events" and flushed.flushed_l2
    assert 100 < bench.gbps(2 * x.numel() * 4, flushed.median_ms) < 20000
    warm = bench.time_fn(lambda: y.copy_(x), flush_l2=False)
    assert not warm.flushed_l2 and warm.median_ms > 0
    assert bench.copy_bandwidth(nbytes=2**28) > 100
    assert bench.matmul_tflops(torch.bfloat16, n=4096) > 10
    assert bench.l2_cache_bytes() > 0


def test_peak_memory_refuses_the_cpu():
    with pytest.raises(ValueError, match="CUDA"):
        bench.peak_memory_bytes(lambda: None, device="cpu")


@pytest.mark.gpu
def test_peak_memory_counts_a_temporary():
    x = torch.empty(2**20, device="cuda")  # 4 MiB already allocated: not counted
    peak = bench.peak_memory_bytes(lambda: torch.empty(2**22, device="cuda").add_(1.0))  # a 16 MiB temporary
    assert 2**24 <= peak < 2**24 + 2**21
    del x


@pytest.mark.parametrize("value, gpu, expected", [("full", True, True), ("small", True, False), ("full", False, False)])
def test_full_sizes_follows_the_gpu_and_the_switch(monkeypatch, value, gpu, expected):
    monkeypatch.setenv("KERNEL_COURSE_SIZES", value)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: gpu)
    assert bench.full_sizes() is expected


def test_full_sizes_rejects_a_typo(monkeypatch):
    monkeypatch.setenv("KERNEL_COURSE_SIZES", "smal")
    with pytest.raises(ValueError, match="'full' or 'small'"):
        bench.full_sizes()
