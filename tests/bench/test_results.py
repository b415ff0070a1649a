"""kernel_lib.bench.results: rows, CSV, and sweep (check against float64, then time)."""

import csv

import pytest
import torch

from kernel_lib import bench


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
    with pytest.raises(AssertionError, match=r"before timing .*off by one at \{'n': 16\}"):
        bench.sweep(impls, [{"n": 16}], _make_scale_inputs, _scale, progress=False)
    assert not timed
    with pytest.raises(ValueError, match="baseline"):
        bench.sweep(impls, [{"n": 16}], _make_scale_inputs, _scale, baseline="missing", progress=False)


def test_sweep_checks_again_after_timing():
    calls = []

    def goes_wrong(x, s):  # right on its first call, wrong once it has been called many times
        calls.append(1)
        return x * s + (len(calls) > 1)

    with pytest.raises(AssertionError, match=r"after timing it: .*goes wrong at \{'n': 16\}"):
        bench.sweep({"goes wrong": goes_wrong}, [{"n": 16}], _make_scale_inputs, _scale, progress=False, rep_ms=1)
    assert len(calls) > 2  # it was timed before the second check caught it


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
