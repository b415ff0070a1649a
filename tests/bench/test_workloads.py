"""kernel_lib.bench.workloads: MoE routing workloads and attention's visible pairs."""

import pytest
import torch

from kernel_lib import bench


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
