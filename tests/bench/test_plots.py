"""kernel_lib.bench.plots: palette, plots, tables and the notebook helpers."""

import os

import pytest

from kernel_lib import bench


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


def test_notebook_helpers(capsys):
    bench.show_source(bench.sync)  # a plain function; Triton kernels unwrap through .fn
    assert capsys.readouterr().out.startswith("def sync(")
    assert list(bench.progress(range(3), disable=True)) == [0, 1, 2]
    bench.sync("cpu")  # nothing to wait for, and no error
