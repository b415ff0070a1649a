"""kernel_lib.bench: timing, ceilings, CSV rows and plots."""

import csv
import math
import os
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


def test_result_row_and_csv(tmp_path):
    timing = bench.Timing(median_ms=2.0, p20_ms=1.5, p80_ms=2.5)
    row = bench.result_row("copy", timing, nbytes=4e9, flops=None, shape="1x2")
    assert row["gbps"] == pytest.approx(2000.0) and row["tflops"] is None
    path = bench.write_csv([row], tmp_path / "sub" / "out.csv", env={"device": "test-gpu", "torch": "x"})
    with open(path) as handle:
        rows = list(csv.DictReader(handle))
    assert rows[0]["name"] == "copy" and rows[0]["device"] == "test-gpu" and rows[0]["shape"] == "1x2"
    with pytest.raises(ValueError, match="no rows"):
        bench.write_csv([], tmp_path / "empty.csv")


def test_frames_and_plots():
    import matplotlib

    matplotlib.use("Agg")
    frame = bench.to_frame(
        [{"op": "a", "n": 2**k, "gbps": k} for k in range(4)]
        + [{"op": "b", "n": 2**k, "gbps": 2 * k} for k in range(4)]
    )
    ax = bench.plot_throughput(frame, "n", "gbps", "op", ceiling=10.0)
    assert len(ax.get_lines()) == 3  # two ops and the ceiling
    points = [
        {"name": "add", "intensity": 0.08, "tflops": 0.3},
        {"name": "mm", "intensity": 500, "tflops": 600},
    ]
    ax = bench.plot_roofline(points, peak_tflops=700, peak_gbps=3000)
    assert ax.get_xscale() == "log" and len(ax.collections) == 2
    ax = bench.plot_speedup(["eager", "compiled"], [1.0, 2.5])
    assert len(ax.patches) == 2
    timings = {"x": bench.Timing(1.0, 0.9, 1.1, samples_ms=[1.0])}
    assert list(bench.timing_frame(timings).columns[:2]) == ["name", "median_ms"]


def test_plot_style_keeps_legend_off_the_data_and_labels_the_ceiling():
    import matplotlib

    matplotlib.use("Agg")
    frame = bench.to_frame(
        [{"impl": i, "n": 2**k, "gbps": k} for i in ("kernel_lib", "torch.compile") for k in range(4)]
    )
    ax = bench.plot_throughput(frame, "n", "gbps", "impl", ceiling=10.0)
    ax.figure.canvas.draw()
    legend = ax.get_legend().get_window_extent()
    assert legend.x0 >= ax.get_window_extent().x1  # outside the axes, to the right
    assert any("measured ceiling: 10" in t.get_text() for t in ax.texts)
    colours = {line.get_label(): line.get_color() for line in ax.get_lines()}
    assert colours["kernel_lib"] == bench.color("kernel_lib") != colours["torch.compile"]


@pytest.mark.parametrize(
    "label, same_as",
    [
        ("kernel_lib (Triton)", "kernel_lib"),  # ours keeps its colour whatever follows the name
        ("torch.compile max-autotune", "torch.compile"),
        ("Liger-Kernel", "liger"),
    ],
)
def test_color_is_stable_per_implementation(label, same_as):
    assert bench.color(label) == bench.color(same_as)


def test_spare_colour_is_the_same_in_another_process():
    import subprocess
    import sys

    code = "from kernel_lib import bench; print(bench.color('an unknown peer'))"
    env = {**os.environ, "PYTHONHASHSEED": "12345"}  # hash() would differ between these processes
    other = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    assert other.stdout.strip() == bench.color("an unknown peer") and other.stdout.strip() in bench._SPARE


def test_table_formats_numbers_for_reading():
    rows = [
        {"name": "eager", "tokens/s": 5489.2347, "n": 32.0, "err": float("nan")},
        {"name": "ours", "tokens/s": 12.345, "n": 7, "err": 1e-4},
    ]
    t = bench.table(rows, {"name": "impl", "tokens/s": "tokens/s", "err": "error"}, formats={"error": ".1e"})
    assert t.columns == ["impl", "tokens/s", "error"]  # picked, renamed, n left out
    assert t.rows == [["eager", "5,489", "—"], ["ours", "12.3", "1.0e-04"]]
    assert "<th>tokens/s</th>" in t._repr_html_() and "5,489" in repr(t)
    assert bench.table([{"n": 32.0}]).rows == [["32"]]  # no 32.0000


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


def _scale(x, s):
    return x * s


def _make_scale_inputs(n):
    return [torch.randn(n, n), 3.0]


def test_sweep_checks_then_times_and_returns_a_frame():
    impls = {"twice": lambda x, s: _scale(x, s), "mul": torch.mul}
    frame = bench.sweep(
        impls,
        [{"n": 8}, {"n": 32}],
        _make_scale_inputs,
        _scale,
        baseline="twice",
        nbytes=lambda n: 2 * n * n * 4,
        flops=lambda n: n * n,
        name="scale",
        progress=False,
        warmup_ms=1,
        rep_ms=2,
    )
    assert list(frame.columns) == [
        "name", "n", "impl", "median_ms", "p20_ms", "p80_ms", "gbps", "tflops", "max_abs_err", "ratio_to_baseline",
    ]  # fmt: skip
    assert list(zip(frame["n"], frame["impl"], strict=True)) == [(8, "twice"), (8, "mul"), (32, "twice"), (32, "mul")]
    assert (frame["name"] == "scale").all() and (frame["median_ms"] > 0).all() and (frame["gbps"] > 0).all()
    assert (frame.loc[frame.impl == "twice", "ratio_to_baseline"] == 1.0).all()
    assert (frame["max_abs_err"] < 1e-5).all()


def test_sweep_refuses_a_wrong_implementation_before_timing(monkeypatch):
    timed = []
    monkeypatch.setattr(bench.timing, "time_fn", lambda *args, **kwargs: timed.append(1))  # what sweep calls
    impls = {"right": _scale, "off by one": lambda x, s: x * s + 1}
    with pytest.raises(AssertionError, match=r"off by one at \{'n': 16\}"):
        bench.sweep(impls, [{"n": 16}], _make_scale_inputs, _scale, progress=False)
    assert not timed
    with pytest.raises(ValueError, match="baseline"):
        bench.sweep(impls, [{"n": 16}], _make_scale_inputs, _scale, baseline="missing", progress=False)


def test_sweep_checks_tuples_of_gradients_against_float64():
    def step(fn):
        def run(x, dy):
            return torch.autograd.grad(fn(x), x, dy)

        return run

    def make(n):
        return [torch.randn(n, n, dtype=torch.float16).requires_grad_(), torch.randn(n, n, dtype=torch.float16)]

    impls = {"tanh": step(torch.tanh), "sigmoid (wrong)": step(torch.sigmoid)}
    frame = bench.sweep({"tanh": impls["tanh"]}, [{"n": 8}], make, step(torch.tanh), progress=False, rep_ms=2)
    assert frame["max_abs_err"].iloc[0] <= 1e-2
    with pytest.raises(AssertionError, match="sigmoid"):
        bench.sweep(impls, [{"n": 8}], make, step(torch.tanh), progress=False, rep_ms=2)


def _brute_force_pairs(N, M, causal, window):
    # the mask of kernel_lib.flash_attention's reference, counted
    from kernel_lib.ops.attention import _visible

    return int(_visible(N, M, causal, window, "cpu").sum())


@pytest.mark.parametrize("N, M", [(1, 1), (7, 7), (64, 64), (5, 13), (13, 5), (100, 37), (37, 100)])
@pytest.mark.parametrize("causal, window", [(False, None), (True, None), (True, 1), (True, 4), (True, 16), (True, 500)])
def test_visible_pairs_counts_the_mask(N, M, causal, window):
    assert bench.visible_pairs(N, M, causal=causal, window=window) == _brute_force_pairs(N, M, causal, window)


def test_visible_pairs_defaults_and_rejections():
    assert bench.visible_pairs(8) == 64 and bench.visible_pairs(8, causal=True) == 36
    assert bench.visible_pairs(10, causal=True, window=3) == 1 + 2 + 3 * 8
    with pytest.raises(ValueError, match="causal"):
        bench.visible_pairs(8, window=4)
    with pytest.raises(ValueError, match="positive"):
        bench.visible_pairs(8, causal=True, window=0)


@pytest.mark.parametrize("hot_odds", [1.0, 9.0, float("inf")])
def test_expert_counts_sum_and_seed(hot_odds):
    counts = bench.expert_counts(1000, 16, hot_odds=hot_odds, n_hot=4, seed=5)
    assert counts.shape == (16,) and int(counts.sum()) == 1000
    assert torch.equal(counts, bench.expert_counts(1000, 16, hot_odds=hot_odds, n_hot=4, seed=5))
    if hot_odds == float("inf"):
        assert int(counts[4:].sum()) == 0
    if hot_odds == 9.0:
        assert int(counts[:4].sum()) > 600  # 36 of 48 odds: three quarters of the rows, on average
    assert not torch.equal(bench.expert_counts(1000, 16, seed=1), bench.expert_counts(1000, 16, seed=2))


def test_loop_mm_and_group_bounds_match_a_grouped_product():
    counts = torch.tensor([3, 0, 5, 2])
    offs = counts.cumsum(0).to(torch.int32)
    bounds = bench.group_bounds(offs)
    assert bounds == [(0, 3), (3, 3), (3, 8), (8, 10)]
    x, w = torch.randn(10, 6), torch.randn(4, 6, 5)
    want = torch.cat([x[s:e] @ w[g] for g, (s, e) in enumerate(bounds)])
    torch.testing.assert_close(bench.loop_mm(x, w, bounds), want)
    assert bench.imbalance(counts) == pytest.approx(5 / 2.5)


def test_skew_router_tilts_routing_toward_the_hot_experts():
    from kernel_lib import MoE

    torch.manual_seed(0)
    layer = MoE(32, 8, 8, 2)
    x = torch.randn(512, 32)
    before = torch.bincount((x @ layer.router.weight.T).topk(2).indices.reshape(-1), minlength=8)
    tilted = bench.skew_router(layer, x, n_hot=2)
    after = torch.bincount((tilted @ layer.router.weight.T).topk(2).indices.reshape(-1), minlength=8)
    assert int(after[:2].sum()) > int(before[:2].sum()) and int(after[:2].sum()) > 512


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


@pytest.mark.parametrize("value, gpu, expected", [("full", True, True), ("small", True, False), ("full", False, False)])
def test_full_sizes_follows_the_gpu_and_the_switch(monkeypatch, value, gpu, expected):
    monkeypatch.setenv("KERNEL_COURSE_SIZES", value)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: gpu)
    assert bench.full_sizes() is expected


def test_full_sizes_rejects_a_typo(monkeypatch):
    monkeypatch.setenv("KERNEL_COURSE_SIZES", "smal")
    with pytest.raises(ValueError, match="'full' or 'small'"):
        bench.full_sizes()


def test_notebook_helpers(capsys):
    bench.show_source(bench.sync)  # a plain function; Triton kernels unwrap through .fn
    assert capsys.readouterr().out.startswith("def sync(")
    assert list(bench.progress(range(3), disable=True)) == [0, 1, 2]
    bench.sync("cpu")  # nothing to wait for, and no error
