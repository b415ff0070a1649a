"""kernel_lib.validate: the float64 comparison rule, poison, random inputs."""

import math

import pytest
import torch

from kernel_lib.validate import (
    assert_all_written,
    assert_close,
    check,
    error_stats,
    poisoned_like,
    random_inputs,
    report,
)


def test_error_stats_measures_the_difference():
    ref = torch.tensor([1.0, 2.0, -4.0], dtype=torch.float64)
    out = torch.tensor([1.0, 2.5, -4.0])
    stats = error_stats(out, ref)
    assert stats.max_abs == pytest.approx(0.5)
    assert stats.rel_l2 == pytest.approx(0.5 / math.sqrt(21))
    assert stats.n_bad == 0


def test_error_stats_counts_non_finite_outputs_as_bad():
    ref = torch.ones(4, dtype=torch.float64)
    out = torch.tensor([1.0, float("nan"), float("inf"), 1.0])
    stats = error_stats(out, ref)
    assert stats.n_bad == 2 and math.isinf(stats.max_abs)


def test_error_stats_matching_infinities_are_exact():
    ref = torch.tensor([0.0, -math.inf], dtype=torch.float64)  # e.g. a masked logit
    assert error_stats(torch.tensor([0.0, -math.inf]), ref).n_bad == 0
    assert error_stats(torch.tensor([0.0, math.inf]), ref).n_bad == 1
    assert error_stats(torch.tensor([0.0, 0.0]), ref).n_bad == 1


def test_error_stats_rejects_shape_mismatch():
    with pytest.raises(ValueError, match="shapes differ"):
        error_stats(torch.ones(3), torch.ones(4))


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_rule_accepts_a_result_rounded_like_pytorch(dtype):
    a, b = random_inputs((64, 96), (96, 48), dtype=torch.float64)
    ref = a @ b
    torch_lowp = a.to(dtype) @ b.to(dtype)
    # A different but equally good low-precision computation: accumulate in float32, round once.
    kernel = (a.to(dtype).float() @ b.to(dtype).float()).to(dtype)
    assert check(kernel, ref, torch_lowp).ok


def test_rule_rejects_a_wrong_element():
    a, b = random_inputs((64, 96), (96, 48), dtype=torch.float64)
    ref = a @ b
    torch_lowp = a.bfloat16() @ b.bfloat16()
    kernel = torch_lowp.clone()
    kernel[7, 11] += 1.0  # one wrong element among thousands
    result = check(kernel, ref, torch_lowp, name="out")
    assert not result.ok
    assert "FAIL out" in str(result)
    with pytest.raises(AssertionError, match="FAIL out"):
        assert_close(kernel, ref, torch_lowp)


def test_rule_rejects_nan_even_with_a_generous_tolerance():
    ref = torch.ones(8, dtype=torch.float64)
    out = torch.ones(8)
    out[3] = float("nan")
    assert not check(out, ref, atol=1e9).ok


def test_rule_without_baseline_is_atol_alone():
    ref = torch.zeros(3, dtype=torch.float64)
    assert check(torch.tensor([0.0, 1e-7, 0.0]), ref, atol=1e-6).ok
    assert not check(torch.tensor([0.0, 1e-5, 0.0]), ref, atol=1e-6).ok


def test_rtol_scales_with_the_reference():
    ref = torch.tensor([100.0, -200.0], dtype=torch.float64)
    out = torch.tensor([100.1, -200.0])
    assert not check(out, ref, atol=0.0).ok
    assert check(out, ref, atol=0.0, rtol=1e-3).ok  # allowed 0.2
    assert not check(out, ref, atol=0.0, rtol=1e-4).ok  # allowed 0.02


def test_report_lists_each_check():
    ref = torch.ones(2, dtype=torch.float64)
    lines = report([check(torch.ones(2), ref, name="y"), check(torch.zeros(2), ref, name="dx")]).splitlines()
    assert lines[0].startswith("ok   y") and lines[1].startswith("FAIL dx")


def test_poison_is_caught_where_nothing_was_written():
    out = poisoned_like(torch.ones(10))
    assert torch.isnan(out).all()
    out[:9] = 1.0
    with pytest.raises(AssertionError, match="1 of 10"):
        assert_all_written(out)
    out[9] = 2.0
    assert_all_written(out)


def test_poison_for_integers():
    assert (poisoned_like(torch.zeros(3, dtype=torch.int32)) == -1).all()


def test_random_inputs_are_fresh_unless_seeded():
    a1, a2 = random_inputs((100,)), random_inputs((100,))
    assert not torch.equal(a1, a2)
    assert (a1 != 0).all()
    assert torch.equal(random_inputs((100,), seed=3), random_inputs((100,), seed=3))
    x, y = random_inputs((2, 3), (4,), dtype=torch.bfloat16)
    assert x.shape == (2, 3) and y.shape == (4,) and x.dtype == torch.bfloat16
