"""Workloads the notebooks and the benchmark scripts share (MoE routing skews, expert counts, the per-expert
loop baseline, attention's visible pairs), so that both measure the same thing."""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch


# --------------------------------------------------------------------------------------------------
# Workloads the notebooks and the scripts share
# --------------------------------------------------------------------------------------------------
def expert_counts(n_rows: int, E: int, hot_odds: float = 1.0, n_hot: int = 1, seed: int = 0) -> torch.Tensor:
    """Rows per expert as a router deals them: an int64 tensor of E counts summing to ``n_rows``.

    Each of the ``n_rows`` assignments (T tokens times top_k) picks an expert at random, the first ``n_hot``
    experts ``hot_odds`` times as likely as the others: 1 is uniform routing, ``math.inf`` sends every row to
    the hot experts. The course's skewed routing is ``hot_odds=9, n_hot=max(1, E // 4)`` (a quarter of the
    experts take three quarters of the rows). Drawn on the CPU from ``seed``: the same seed, the same counts.
    """
    finite = math.isfinite(hot_odds)
    odds = torch.ones(E) if finite else torch.zeros(E)
    odds[:n_hot] = hot_odds if finite else 1.0
    generator = torch.Generator().manual_seed(seed)
    picks = torch.multinomial(odds / odds.sum(), n_rows, replacement=True, generator=generator)
    return torch.bincount(picks, minlength=E)


def imbalance(counts: torch.Tensor) -> float:
    """The largest group over the mean group: 1.0 is perfect balance."""
    return float(counts.max() / counts.float().mean())


def group_bounds(offs: torch.Tensor) -> list[tuple[int, int]]:
    """(start, end) rows of every group from grouped_mm's cumulative ends ``offs``, on the host.

    ``offs.tolist()`` waits until the GPU has computed ``offs``: call it once, outside a timed loop, unless the
    synchronization is what is measured.
    """
    ends = offs.tolist()
    return list(zip([0, *ends[:-1]], ends, strict=True))


def loop_mm(x: torch.Tensor, w: torch.Tensor, bounds: Sequence[tuple[int, int]]) -> torch.Tensor:
    """The per-expert loop that a grouped GEMM replaces: out[start:end] = x[start:end] @ w[e] for each group.

    x (rows, K) sorted by group, w (E, K, N), ``bounds`` from :func:`group_bounds`, already on the host (which
    flatters the loop: a real one reads them from the device). One matmul launch per non-empty group, written
    straight into the output.
    """
    out = x.new_empty(x.shape[0], w.shape[2])
    for e, (start, end) in enumerate(bounds):
        if end > start:
            torch.mm(x[start:end], w[e], out=out[start:end])
    return out


def skew_router(layer, x: torch.Tensor, n_hot: int, strength: float = 4.0, seed: int = 7) -> torch.Tensor:
    """Tilt an MoE layer's router toward its first ``n_hot`` experts; return the tokens to route.

    Adds one random unit direction (drawn from ``seed`` on x's device), times ``strength``, to those experts'
    router rows (in place, without gradient), and returns ``x`` plus that direction: every token then scores
    the hot experts higher. ``layer`` is anything with a ``router.weight`` of shape (E, d), e.g.
    ``kernel_lib.MoE``.
    """
    generator = torch.Generator(device=x.device).manual_seed(seed)
    direction = torch.randn(x.shape[-1], device=x.device, generator=generator)
    direction = direction / direction.norm()
    with torch.no_grad():
        layer.router.weight[:n_hot] += (strength * direction).to(layer.router.weight.dtype)
    return x + direction.to(x.dtype)


def _pairs_up_to(n: int, window: int | None) -> int:
    """Keys seen by the queries at positions 0 .. n-1 of a causal mask: sum over p of min(p + 1, window)."""
    if window is None or n <= window:
        return n * (n + 1) // 2
    return window * (window + 1) // 2 + (n - window) * window


def visible_pairs(N: int, M: int | None = None, *, causal: bool = False, window: int | None = None) -> int:
    """Query-key pairs an attention mask keeps, for N queries over M keys (M = N by default).

    The masks of :func:`kernel_lib.flash_attention`, bottom-right aligned (query i sits at key position
    i + M - N, so the last query sees the last key): causal keeps keys j <= i + M - N, a window of W (which
    needs causal) keeps the last W of those. Attention's FLOPs are 4 D per visible pair forward.
    """
    M = N if M is None else M
    if window is not None:
        if not causal:
            raise ValueError("window needs causal=True (a sliding window looks back from each query)")
        if window < 1:
            raise ValueError(f"window must be a positive number of keys, got {window}")
    if not causal:
        return N * M
    # Queries sit at key positions M - N .. M - 1; a position p < 0 (N > M) sees no key.
    return _pairs_up_to(M, window) - _pairs_up_to(max(0, M - N), window)
