"""Flash attention in Triton: tiled attention with the online softmax, forward and backward, with causal,
sliding-window and grouped-query attention.

For q (B, Hq, N, D), k (B, Hkv, M, D) and v (B, Hkv, M, Dv) with Hq a multiple of Hkv (query head h reads
key/value head h // (Hq / Hkv)), any head dims up to 256 (Dv may differ from D), and scale s (default
1/sqrt(D))::

    out[i] = sum_j softmax_j(s * q_i . k_j over visible j) v_j          lse[i] = log sum_j exp(s * q_i . k_j)

Visibility, with the bottom-right alignment of FlashAttention (offset = M - N, so the last query sees the last
key; equal to PyTorch's ``is_causal`` when N = M):

* causal:          j <= i + offset
* window W:        i + offset - W < j <= i + offset         (requires causal)

A query that sees no key (N > M, causal) gets out = 0 and lse = -inf, and no gradient.

Forward: each program owns a block of BLOCK_M queries of one head, streams the visible key/value blocks through
shared memory, and keeps a running maximum, a running sum and an unnormalized output in registers (online
softmax, in base 2 for the hardware's exp2). It writes out and lse; nothing of size N x M ever reaches memory.
Backward recomputes the probabilities blockwise from lse. A small kernel first reads out and dout once to form
delta = rowsum(dout * out) (minus any gradient of lse) and lse in base 2. Then one kernel owns a key/value block
and loops over the query blocks of every query head of its group (dK, dV, summed over the group in registers;
computed transposed, s^T = k q^T, so no register tile is transposed); a second owns a query block and loops over
key blocks (dQ). Only tiles on the edge of the causal or window mask apply it; rows past N and keys past M load
as zeros, which contribute nothing. No atomics, so these kernels' results are deterministic (the Hopper backward
below is not). A head dim that is not a power of two is padded to one inside the kernels (the padding columns load
as zeros, so the scores do not change).

Configs come from a heuristic per shape, and each must fit the GPU's shared memory: the estimate prunes the list,
then the compiled kernel's own count (Triton's ``metadata.shared``) has the last word, so a config the compiler
makes larger than estimated moves to the next one instead of failing at launch.

The Triton kernels live in the sibling ``attention_kernels.py``; on Hopper GPUs (SM90) the forward runs the Gluon
kernel of ``attention_hopper.py`` instead where it applies (head dims up to 128, strides the TMA accepts; see
``uses_hopper_forward``), and so does the backward for fixed-length tensors with q/k head dims of 65 to 128 (see
``uses_hopper_backward``): one kernel that adds dq through the TMA's reductions, so not run to run identical,
and left for the portable kernels under ``torch.use_deterministic_algorithms(True)``.
``KERNEL_LIB_ATTENTION=portable`` keeps the Triton kernels everywhere. Registered as the
``kernel_lib::flash_attention_fwd`` / ``kernel_lib::flash_attention_bwd`` custom ops with fake implementations,
which the one ``autograd.Function`` calls under torch.compile, so ``torch.compile(fullgraph=True)`` traces
through it. Sources: Dao et al., FlashAttention (2022) and FlashAttention-2 (2023); Triton's
fused-attention tutorial.
"""

import math
import os
import weakref
from typing import Optional

import torch
import triton

from . import attention_hopper as hopper
from . import attention_kernels as kernels
from ._utils import (
    autotune_requested,
    check_same_device,
    check_same_dtype,
    check_tensor,
    compile_fitting,
    configs_that_fit,
    launch_or_op,
    use_triton,
    warn_once,
)
from .attention_kernels import LOG2E, _attn_bwd_prep_kernel

__all__ = [
    "flash_attention",
    "flash_attention_varlen",
    "attention_ref",
    "attention_varlen_ref",
    "MultiHeadAttention",
    "MAX_HEAD_DIM",
]

MAX_HEAD_DIM = 256  # FlashAttention's limit too; any head dim up to it, q/k and v apart


def _visible(N: int, M: int, causal: bool, window: Optional[int], device) -> torch.Tensor:
    """(N, M) boolean mask: which keys each query sees."""
    i = torch.arange(N, device=device)[:, None] + (M - N)  # query positions aligned to the keys' end
    j = torch.arange(M, device=device)[None, :]
    mask = torch.ones(N, M, dtype=torch.bool, device=device)
    if causal:
        mask &= j <= i
    if window is not None:
        mask &= j > i - window
    return mask


def attention_ref(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    causal: bool = False,
    window: Optional[int] = None,
    scale: Optional[float] = None,
    return_lse: bool = False,
):
    """The definition with an explicit (N, M) mask, in float32 (float64 for float64 input), out in q's dtype."""
    compute = torch.promote_types(q.dtype, torch.float32)
    B, Hq, N, D = q.shape
    Hkv, M = k.shape[1], k.shape[2]
    scale = 1.0 / math.sqrt(D) if scale is None else scale
    kf = k.to(compute).repeat_interleave(Hq // Hkv, dim=1)  # (B, Hq, M, D)
    vf = v.to(compute).repeat_interleave(Hq // Hkv, dim=1)
    scores = (q.to(compute) @ kf.transpose(-1, -2)) * scale  # (B, Hq, N, M)
    scores = scores.masked_fill(~_visible(N, M, causal, window, q.device), float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)  # (B, Hq, N); -inf where a query sees nothing
    probs = torch.exp(scores - lse[..., None].clamp_min(torch.finfo(compute).min)).nan_to_num(0.0)
    out = (probs @ vf).to(q.dtype)
    return (out, lse.float() if compute != torch.float64 else lse) if return_lse else out


def attention_varlen_ref(q, k, v, cu_seqlens_q, cu_seqlens_k, causal=False, window=None, scale=None,
                         return_lse=False):  # fmt: skip
    """Packed sequences one at a time through :func:`attention_ref`: out (total_q, Hq, Dv), lse (Hq, total_q)."""
    outs, lses = [], []
    cq, ck = cu_seqlens_q.tolist(), cu_seqlens_k.tolist()
    for q0, q1, k0, k1 in zip(cq, cq[1:], ck, ck[1:], strict=False):
        as_batch = lambda t, a, b: t[a:b].transpose(0, 1)[None]  # noqa: E731  (rows, H, D) -> (1, H, rows, D)
        out, lse = attention_ref(as_batch(q, q0, q1), as_batch(k, k0, k1), as_batch(v, k0, k1), causal, window,
                                 scale, return_lse=True)  # fmt: skip
        outs.append(out[0].transpose(0, 1))
        lses.append(lse[0])
    out = torch.cat(outs) if outs else q.new_empty((0, q.shape[1], v.shape[-1]))
    lse = torch.cat(lses, dim=1) if lses else q.new_empty((q.shape[1], 0), dtype=torch.float32)
    return (out, lse) if return_lse else out


# --------------------------------------------------------------------------------------------------
# Launchers (inputs already checked by the functional API)
# --------------------------------------------------------------------------------------------------
def _unit_stride(t: torch.Tensor) -> torch.Tensor:
    return t if t.stride(-1) == 1 else t.contiguous()


def _shapes(q, k, v, cu_q, max_q, max_k):
    """B, Hq, Hkv, N, M, D, Dv; packed (``cu_q`` given), B counts the sequences and N, M are the longest ones."""
    if cu_q is None:
        B, Hq, N, D = q.shape
        return B, Hq, k.shape[1], N, k.shape[2], D, v.shape[-1]
    return cu_q.numel() - 1, q.shape[1], k.shape[1], max_q, max_k, q.shape[-1], v.shape[-1]


def _bhn_strides(t: torch.Tensor, packed: bool) -> tuple:
    """Strides along batch, head and position: (B, H, N, ...) tensors, or packed (tokens, H, ...) with a batch
    stride of 0 (the kernels add each sequence's first row instead)."""
    return (0, t.stride(1), t.stride(0)) if packed else tuple(t.stride()[:3])


def _stat_strides(t: torch.Tensor, packed: bool) -> tuple:
    """Strides along batch and head of a per-query float32 statistic: (B, H, N), or packed (H, tokens)."""
    return (0, t.stride(0)) if packed else (t.stride(0), t.stride(1))


def _dims(D: int, Dv: int) -> dict:
    """The head-dim constexprs: the true dims and their power-of-two tile widths."""
    return dict(D_QK=D, D_V=Dv, BLOCK_DQK=kernels.padded_head_dim(D), BLOCK_DV=kernels.padded_head_dim(Dv))


def _int_key(*ints: int) -> tuple:
    """What Triton specializes int arguments on (1, multiples of 16), for compile keys (the forward is not
    specialized on N, M and the window: ``attention_kernels._VARYING``)."""
    return tuple((i == 1, i % 16 == 0) for i in ints)


def _forward_launch(q, k, v, out, lse, causal, window, scale, cu_q=None, cu_k=None, max_q=0, max_k=0):
    """The forward's grid, arguments, constexpr flags and launch config for these tensors (q, k, v of unit stride
    along the head dim; packed when ``cu_q`` is given); the config is the heuristic's pick that fits this GPU,
    compiled to check it."""
    B, Hq, Hkv, N, M, D, Dv = _shapes(q, k, v, cu_q, max_q, max_k)
    packed = cu_q is not None

    def grid(meta):
        return (triton.cdiv(N, meta["BLOCK_M"]), B * Hq)

    strides = (*(_bhn_strides(t, packed) for t in (q, k, v, out)),)
    strides = (*sum(strides, ()), *_stat_strides(lse, packed))
    offsets = (cu_q, cu_k) if packed else (q, q)  # unused pointers when not packed
    args = (q, k, v, out, lse, *offsets, *strides, Hq, N, M, Hq // Hkv, scale * LOG2E, window or 0)
    dims = _dims(D, Dv)
    flags = dict(**dims, CAUSAL=causal, WINDOW=window is not None, DOT_FP32=q.device.type == "cpu", VARLEN=packed)
    if autotune_requested():
        return grid, args, flags, None
    width = dims["BLOCK_DQK"] + dims["BLOCK_DV"]
    preferred = kernels.fwd_preferred(N, width, causal, window is not None)
    candidates = configs_that_fit(preferred, kernels._FWD_CONFIGS[0], kernels._smem_bytes, {**dims, "q": q})
    key = ("fwd", q.device, q.dtype, *flags.values(), *(tuple(c.items()) for c in candidates),
           *_int_key(*strides, Hq, Hq // Hkv))  # fmt: skip
    (config,) = compile_fitting(key, [(kernels._attn_fwd_kernel, grid, args, flags, candidates)])
    return grid, args, flags, config


# --------------------------------------------------------------------------------------------------
# Hopper forward path: the Gluon kernel of attention_hopper.py on SM90, where the tensors suit the TMA
# --------------------------------------------------------------------------------------------------
PATHS = ("auto", "portable")  # KERNEL_LIB_ATTENTION: auto takes the Hopper kernel wherever it applies
_hopper_failed: Optional[str] = None  # why the Gluon kernel could not be built with this Triton: portable since
# What a Triton whose Gluon differs from the one attention_hopper.py was written for raises while building it
_BUILD_ERRORS = tuple(
    e for e in (getattr(getattr(triton, "compiler", None), "CompilationError", None), TypeError, AttributeError,
                NotImplementedError) if isinstance(e, type)
)  # fmt: skip


def _requested_path() -> str:
    path = os.environ.get("KERNEL_LIB_ATTENTION", "auto").lower()
    if path not in PATHS:
        raise ValueError(f"KERNEL_LIB_ATTENTION must be one of {', '.join(PATHS)}, got {path!r}")
    return path


def _descriptor_ready(t: torch.Tensor) -> bool:
    """What the tensor memory accelerator needs: a 16-byte aligned base, unit stride along the head dim, every
    other stride a multiple of 16 bytes (a head dim of 80 qualifies, 59 does not)."""
    size = t.element_size()
    return (t.numel() > 0 and t.stride(-1) == 1 and t.data_ptr() % 16 == 0
            and all(st * size % 16 == 0 for st in t.stride()[:-1]))  # fmt: skip


def uses_hopper_forward(q, k, v, out, scale: float) -> bool:
    """Whether the forward runs the Gluon kernel of ``attention_hopper.py``: an SM90 GPU, a Triton with Gluon's
    Hopper module, (B, H, N, D) or packed (tokens, H, D) tensors whose strides the TMA accepts, head dims up to
    128 and a positive scale. ``KERNEL_LIB_ATTENTION=portable`` keeps the portable kernel everywhere."""
    if _requested_path() == "portable" or not hopper.AVAILABLE or _hopper_failed is not None or not scale > 0:
        return False
    if q.device.type != "cuda" or torch.cuda.get_device_capability(q.device)[0] != 9:
        return False
    if max(q.shape[-1], v.shape[-1]) > hopper.MAX_BLOCK_D:
        return False
    return all(_descriptor_ready(t) for t in (q, k, v, out))


def _give_up_hopper(error: Exception) -> None:
    """The Gluon kernel failed to build: say so once, and use the portable kernel from now on in this process."""
    global _hopper_failed
    _hopper_failed = f"{type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''}"
    warn_once(
        "attention-hopper-failed",
        f"kernel_lib.flash_attention: the Hopper (Gluon) forward did not build with triton {triton.__version__} "
        f"({_hopper_failed[:300]}); the portable Triton kernel runs instead.",
    )


def _hopper_forward(q, k, v, out, lse, causal, window, scale, cu_q=None, cu_k=None, max_q=0, max_k=0) -> None:
    """Launch the Hopper forward (attention_hopper.py) into out and lse; packed when ``cu_q`` is given."""
    B, Hq, Hkv, N, M, D, Dv = _shapes(q, k, v, cu_q, max_q, max_k)
    packed = cu_q is not None
    config = hopper.config(D, Dv)
    descriptors = hopper.descriptors(q, k, v, out, config["BLOCK_N"], packed)
    flags = dict(CAUSAL=causal, WINDOW=window is not None, VARLEN=packed, BLOCK_M=hopper.BLOCK_M,
                 BLOCK_DQK=hopper.padded(D), BLOCK_DV=hopper.padded(Dv), **config)  # fmt: skip
    grid = (triton.cdiv(N, hopper.BLOCK_M), B * Hq)
    stores = (out, out.stride(1), out.stride(0)) if packed else (out, 0, 0)  # packed: a masked store per row
    offsets = (cu_q, cu_k) if packed else (lse, lse)  # unused pointers when not packed
    with torch.cuda.device(q.device):
        hopper._attn_fwd_hopper_kernel[grid](*descriptors, *stores, Dv, lse, *_stat_strides(lse, packed), *offsets,
                                             Hq, N, M, Hq // Hkv, scale * LOG2E, window or 0, **flags)  # fmt: skip


def uses_hopper_backward(q, k, v, do, scale: float, packed: bool) -> bool:
    """Whether the backward runs the Gluon kernel of ``attention_hopper.py``: where the forward would (an SM90
    GPU, Gluon, strides the TMA accepts, ``KERNEL_LIB_ATTENTION`` not ``portable``), for fixed-length tensors
    whose q/k head dim pads to 128 (65 to 128; it splits dq's columns between its warpgroups) and a v head dim up
    to 128, unless PyTorch is asked for deterministic algorithms (it adds dq with atomics, in no fixed order)."""
    if packed or torch.are_deterministic_algorithms_enabled() or _hopper_bwd_failed is not None:
        return False
    if hopper.padded(q.shape[-1]) != 128:
        return False
    return hopper.BWD_AVAILABLE and uses_hopper_forward(q, k, v, do, scale)


_hopper_bwd_failed: Optional[str] = None  # why the Gluon backward could not be built: portable since


def _hopper_backward(do, q, k, v, lse2, delta, stat_strides, dq, dk, dv, causal, window, scale) -> None:
    """Launch the Hopper backward (attention_hopper.py) into dq, dk and dv, from the prep kernel's statistics."""
    B, Hq, N, D = q.shape
    Hkv, M, Dv = k.shape[1], k.shape[2], v.shape[-1]
    block_m, block_n = hopper.BWD_BLOCK_M, hopper.BWD_BLOCK_N
    dq_acc = torch.zeros(B, Hq, N, 128, device=q.device, dtype=torch.float32)  # 128 wide: 16-byte rows, any D
    flags = dict(CAUSAL=causal, WINDOW=window is not None, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_DQK=128,
                 BLOCK_DV=hopper.padded(Dv), ds_layout=hopper.ds_layout(q.dtype == torch.float16),
                 **hopper.bwd_config(D, Dv))  # fmt: skip
    grid = (triton.cdiv(M, block_n), B * Hkv)
    with torch.cuda.device(q.device):
        hopper._attn_bwd_hopper_kernel[grid](
            *hopper.backward_descriptors(q, k, v, do, dq_acc), lse2, delta, *stat_strides, dk, *dk.stride()[:3], dv,
            *dv.stride()[:3], Hkv, N, M, Hq // Hkv, scale * LOG2E,
            scale, window or 0, D, Dv, **flags,
        )  # fmt: skip
    dq.copy_(dq_acc[:, :, :N, :D])


def forward_config(q, k, v, causal: bool = False, window: Optional[int] = None) -> dict:
    """The kernel ("path": "portable" or "hopper"), tiles, warps and pipeline stages the forward launches with for
    these (B, H, N, D) inputs on their device (the smallest tiles when interpreted), as the launcher picks them.
    The Hopper kernel's warps are its two consumer warpgroups and its producer warp; its stages, the ring slots."""
    q, k, v = _unit_stride(q), _unit_stride(k), _unit_stride(v)
    out = q.new_empty((*q.shape[:3], v.shape[-1]))
    lse = q.new_empty(q.shape[:3], dtype=torch.float32)
    if uses_hopper_forward(q, k, v, out, 1.0):
        config = hopper.config(q.shape[-1], v.shape[-1])
        return dict(path="hopper", BLOCK_M=hopper.BLOCK_M, BLOCK_N=config["BLOCK_N"], num_warps=9,
                    num_stages=config["STAGES"])  # fmt: skip
    config = _forward_launch(q, k, v, out, lse, causal, window, 1.0)[3]
    if config is None:
        raise RuntimeError("KERNEL_LIB_AUTOTUNE=1: the forward's config is Triton's autotuner's choice")
    return {"path": "portable", **config}


def _output_shapes(q, v, packed: bool) -> tuple:
    """out's and lse's shapes: (B, Hq, N, Dv) and (B, Hq, N), or packed (tokens, Hq, Dv) and (Hq, tokens)."""
    if packed:
        return (*q.shape[:2], v.shape[-1]), (q.shape[1], q.shape[0])
    return (*q.shape[:3], v.shape[-1]), tuple(q.shape[:3])


def _forward(q, k, v, causal, window, scale, cu_q=None, cu_k=None, max_q=0, max_k=0):
    packed = cu_q is not None
    cu_k = cu_q if cu_k is None else cu_k  # packed self-attention passes its offsets once
    B, Hq, Hkv, N, M, D, Dv = _shapes(q, k, v, cu_q, max_q, max_k)
    out_shape, lse_shape = _output_shapes(q, v, packed)
    out = torch.empty(out_shape, device=q.device, dtype=q.dtype)
    lse = torch.empty(lse_shape, device=q.device, dtype=torch.float32)
    if out.numel() == 0 or N == 0 or B == 0:
        return out, lse.fill_(float("-inf"))
    q, k, v = _unit_stride(q), _unit_stride(k), _unit_stride(v)
    if uses_hopper_forward(q, k, v, out, scale):
        try:
            _hopper_forward(q, k, v, out, lse, causal, window, scale, cu_q, cu_k, max_q, max_k)
            return out, lse
        except _BUILD_ERRORS as error:  # Gluon is experimental: a Triton it does not build with runs the portable one
            _give_up_hopper(error)
    grid, args, flags, config = _forward_launch(q, k, v, out, lse, causal, window, scale, cu_q, cu_k, max_q, max_k)
    if config is None:
        kernels._attn_fwd_tuned[grid](*args, **flags)
    else:
        kernels._attn_fwd_kernel[grid](*args, **flags, **config)
    return out, lse


def _backward(do, q, k, v, out, lse, dlse, causal, window, scale, cu_q=None, cu_k=None, max_q=0, max_k=0):
    packed = cu_q is not None
    cu_k = cu_q if cu_k is None else cu_k
    B, Hq, Hkv, N, M, D, Dv = _shapes(q, k, v, cu_q, max_q, max_k)
    do, out, lse = do.contiguous(), out.contiguous(), lse.contiguous()
    q, k, v = _unit_stride(q), _unit_stride(k), _unit_stride(v)
    dk = torch.empty(k.shape, device=k.device, dtype=k.dtype)
    dv = torch.empty(v.shape, device=v.device, dtype=v.dtype)
    dq = torch.empty(q.shape, device=q.device, dtype=q.dtype)
    if dq.numel() == 0 or dk.numel() == 0 or N == 0 or M == 0 or B == 0:
        return dq.zero_(), dk.zero_(), dv.zero_()
    # One pass over out and dout: delta = rowsum(dout * out) - dlse, and lse in base 2 (+inf for a query that
    # sees nothing, so its probabilities recompute as 0), float32, each head's row padded to a multiple of 16
    # so the backward kernels load them aligned whatever N is (N is not specialized on).
    rows = q.shape[0] if packed else N
    stat_stride = triton.cdiv(rows, 16) * 16
    stats = torch.empty((2, Hq if packed else B * Hq, stat_stride), device=q.device, dtype=torch.float32)
    delta, lse2 = stats[0], stats[1]
    stat_strides = (0, stat_stride) if packed else (Hq * stat_stride, stat_stride)
    dims = _dims(D, Dv)
    offsets = (cu_q, cu_k) if packed else (q, q)  # unused pointers when not packed
    do_strides, lse_strides = _bhn_strides(do, packed), _stat_strides(lse, packed)
    block_r = max(1, 4096 // dims["BLOCK_DV"])
    prep_grid = (triton.cdiv(N, block_r), B * Hq)
    prep_args = (out, do, lse, dlse.float().contiguous() if dlse is not None else lse, delta, lse2, offsets[0],
                 *do_strides, *lse_strides, *stat_strides, Hq, N)  # fmt: skip
    prep_flags = dict(D_V=Dv, BLOCK_DV=dims["BLOCK_DV"], HAS_DLSE=dlse is not None, VARLEN=packed, BLOCK_R=block_r)
    flags = dict(**dims, CAUSAL=causal, WINDOW=window is not None, DOT_FP32=q.device.type == "cpu", VARLEN=packed)
    strides = sum((_bhn_strides(t, packed) for t in (q, k, v, do)), ())
    if uses_hopper_backward(q, k, v, do, scale, packed):
        try:
            _attn_bwd_prep_kernel[prep_grid](*prep_args, **prep_flags)
            _hopper_backward(do, q, k, v, lse2, delta, stat_strides, dq, dk, dv, causal, window, scale)
            return dq, dk, dv
        except _BUILD_ERRORS as error:  # a Triton whose Gluon this file does not fit: portable from now on
            global _hopper_bwd_failed
            _hopper_bwd_failed = f"{type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''}"
            warn_once("attention-hopper-bwd-failed", f"kernel_lib.flash_attention: the Hopper (Gluon) backward "
                      f"did not build with triton {triton.__version__} ({_hopper_bwd_failed[:300]}); the portable "
                      "Triton kernels run instead.")  # fmt: skip
    dkdv_grid = lambda meta: (triton.cdiv(M, meta["BLOCK_N"]), B * Hkv)  # noqa: E731
    dkdv_args = (q, k, v, do, lse2, delta, dk, dv, *offsets, *strides, *_bhn_strides(dk, packed),
                 *_bhn_strides(dv, packed), *stat_strides, Hq, Hkv, N, M, Hq // Hkv, scale, window or 0)  # fmt: skip
    dq_grid = lambda meta: (triton.cdiv(N, meta["BLOCK_M"]), B * Hq)  # noqa: E731
    dq_args = (q, k, v, do, lse2, delta, dq, *offsets, *strides, *_bhn_strides(dq, packed), *stat_strides,
               Hq, N, M, Hq // Hkv, scale, window or 0)  # fmt: skip
    if autotune_requested():
        _attn_bwd_prep_kernel[prep_grid](*prep_args, **prep_flags)
        kernels._attn_bwd_dkdv_tuned[dkdv_grid](*dkdv_args, **flags)
        kernels._attn_bwd_dq_tuned[dq_grid](*dq_args, **flags)
        return dq, dk, dv
    width = dims["BLOCK_DQK"] + dims["BLOCK_DV"]
    smem_args = {**dims, "q": q}
    dkdv_candidates = configs_that_fit(
        kernels.dkdv_preferred(N, width, causal, window), kernels._DKDV_CONFIGS[0], kernels._smem_bytes_dkdv, smem_args
    )
    dq_candidates = configs_that_fit(
        kernels.dq_preferred(width, causal), kernels._DQ_CONFIGS[0], kernels._smem_bytes_dq, smem_args
    )
    # The first backward at a new specialization compiles three kernels: side by side, not one after another;
    # each keeps the first candidate whose compiled shared memory fits the device.
    ints = _int_key(*strides, *stat_strides, Hq, Hkv, Hq // Hkv, N, M)
    key = (q.device, q.dtype, dlse is not None, *flags.values(), *(tuple(c.items()) for c in dkdv_candidates),
           *(tuple(c.items()) for c in dq_candidates), *ints)  # fmt: skip
    _, dkdv, dq_config = compile_fitting(key, [
        (_attn_bwd_prep_kernel, prep_grid, prep_args, prep_flags, [{}]),
        (kernels._attn_bwd_dkdv_kernel, dkdv_grid, dkdv_args, flags, dkdv_candidates),
        (kernels._attn_bwd_dq_kernel, dq_grid, dq_args, flags, dq_candidates),
    ])  # fmt: skip
    _attn_bwd_prep_kernel[prep_grid](*prep_args, **prep_flags)
    kernels._attn_bwd_dkdv_kernel[dkdv_grid](*dkdv_args, **flags, **dkdv)
    kernels._attn_bwd_dq_kernel[dq_grid](*dq_args, **flags, **dq_config)
    return dq, dk, dv


# --------------------------------------------------------------------------------------------------
# torch.library registration: opaque ops with fake implementations, what torch.compile records
# --------------------------------------------------------------------------------------------------
@torch.library.custom_op("kernel_lib::flash_attention_fwd", mutates_args=())
def _attn_fwd_op(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    causal: bool,
    window: Optional[int],
    scale: float,
    cu_seqlens_q: Optional[torch.Tensor] = None,
    cu_seqlens_k: Optional[torch.Tensor] = None,
    max_seqlen_q: int = 0,
    max_seqlen_k: int = 0,
) -> tuple[torch.Tensor, torch.Tensor]:
    return _forward(q, k, v, causal, window, scale, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k)


@_attn_fwd_op.register_fake
def _(q, k, v, causal, window, scale, cu_seqlens_q=None, cu_seqlens_k=None, max_seqlen_q=0, max_seqlen_k=0):
    out_shape, lse_shape = _output_shapes(q, v, cu_seqlens_q is not None)
    return q.new_empty(out_shape), q.new_empty(lse_shape, dtype=torch.float32)


@torch.library.custom_op("kernel_lib::flash_attention_bwd", mutates_args=())
def _attn_bwd_op(
    do: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    dlse: Optional[torch.Tensor],
    causal: bool,
    window: Optional[int],
    scale: float,
    cu_seqlens_q: Optional[torch.Tensor] = None,
    cu_seqlens_k: Optional[torch.Tensor] = None,
    max_seqlen_q: int = 0,
    max_seqlen_k: int = 0,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return _backward(
        do, q, k, v, out, lse, dlse, causal, window, scale, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k
    )


@_attn_bwd_op.register_fake
def _(do, q, k, v, out, lse, dlse, causal, window, scale, *packing):
    return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape)


# --------------------------------------------------------------------------------------------------
# Autograd: the launchers in eager mode, the ops under torch.compile (see _utils.launch_or_op)
# --------------------------------------------------------------------------------------------------
class _FlashAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, causal, window, scale, cu_q, cu_k, max_q, max_k):
        out, lse = launch_or_op(_forward, _attn_fwd_op)(q, k, v, causal, window, scale, cu_q, cu_k, max_q, max_k)
        ctx.causal, ctx.window, ctx.scale, ctx.max_q, ctx.max_k = causal, window, scale, max_q, max_k
        ctx.save_for_backward(q, k, v, out, lse, cu_q, cu_k)
        return out, lse

    @staticmethod
    def backward(ctx, dout, dlse):
        q, k, v, out, lse, cu_q, cu_k = ctx.saved_tensors
        args = (dout, q, k, v, out, lse, dlse, ctx.causal, ctx.window, ctx.scale, cu_q, cu_k, ctx.max_q, ctx.max_k)
        dq, dk, dv = launch_or_op(_backward, _attn_bwd_op)(*args)
        return dq, dk, dv, None, None, None, None, None, None, None


# --------------------------------------------------------------------------------------------------
# Functional API
# --------------------------------------------------------------------------------------------------
def _check_qkv(q, k, v, ndim: int, heads_dim: int) -> None:
    """dtype, device, rank, head dims and head counts: what both layouts share."""
    for name, t in (("q", q), ("k", k), ("v", v)):
        check_tensor(t, name, dtypes=(torch.float16, torch.bfloat16), ndim=ndim)
    check_same_dtype(q=q, k=k, v=v)
    check_same_device(q=q, k=k, v=v)
    if k.shape[heads_dim] != v.shape[heads_dim]:
        raise ValueError(f"k and v must have the same number of heads, got {tuple(k.shape)} and {tuple(v.shape)}")
    if q.shape[-1] != k.shape[-1]:
        raise ValueError(f"q and k must have the same head dim, got {q.shape[-1]} and {k.shape[-1]}")
    for name, t in (("q and k", q), ("v", v)):
        if not 1 <= t.shape[-1] <= MAX_HEAD_DIM:
            raise ValueError(f"head dim of {name} must be between 1 and {MAX_HEAD_DIM}, got {t.shape[-1]}")
    if q.shape[heads_dim] % k.shape[heads_dim]:
        raise ValueError(
            f"query heads ({q.shape[heads_dim]}) must be a multiple of key/value heads ({k.shape[heads_dim]})"
        )


def _check_window(causal: bool, window: Optional[int]) -> Optional[int]:
    if window is None:
        return None
    if not causal:
        raise ValueError("window needs causal=True (a sliding window looks back from each query)")
    if int(window) < 1:
        raise ValueError(f"window must be a positive number of keys, got {window}")
    return int(window)


def flash_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    causal: bool = False,
    window: Optional[int] = None,
    scale: Optional[float] = None,
    return_lse: bool = False,
):
    """Attention of q (B, Hq, N, D) over k (B, Hkv, M, D) and v (B, Hkv, M, Dv), Hq a multiple of Hkv, float16
    or bfloat16, any head dims D and Dv up to 256 (Dv may differ from D, as in multi-head latent attention).

    ``causal`` aligns the mask bottom-right (query i sees keys j <= i + M - N; PyTorch's ``is_causal`` when
    N = M); ``window=W`` (with causal) also hides keys j <= i + M - N - W. ``scale`` defaults to 1/sqrt(D).
    Returns out (B, Hq, N, Dv) in q's dtype, and with ``return_lse`` also the float32 log-sum-exp (B, Hq, N).
    """
    _check_qkv(q, k, v, ndim=4, heads_dim=1)
    if k.shape[2] != v.shape[2]:
        raise ValueError(f"k and v must have the same length, got {tuple(k.shape)} and {tuple(v.shape)}")
    if not q.shape[0] == k.shape[0] == v.shape[0]:
        raise ValueError(f"q, k and v must have the same batch size, got {q.shape[0]}, {k.shape[0]}, {v.shape[0]}")
    window = _check_window(causal, window)
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else float(scale)
    if use_triton(q, k, v, op="flash_attention"):
        out, lse = _FlashAttention.apply(q, k, v, bool(causal), window, scale, None, None, 0, 0)
    else:  # CPU without the interpreter: the reference, differentiated by autograd
        out, lse = attention_ref(q, k, v, bool(causal), window, scale, return_lse=True)
    return (out, lse) if return_lse else out


# Offsets tensors already checked, by id: a weak reference (the id of a freed tensor can come back), the version
# counter (bumped by any in-place write) and what they were checked against. The layers of a model share one
# cu_seqlens per batch, so only the first reads it to the host.
_checked_offsets: dict[int, tuple] = {}


def _host_offsets(cu: torch.Tensor) -> list:
    """The offsets as Python ints: a copy to the host, which waits for the GPU."""
    return cu.tolist()


def _check_offsets(cu: torch.Tensor, name: str, total: int, max_seqlen: int, device) -> None:
    """cu_seqlens: int32 on q's device, (B + 1,), from 0 up to ``total`` without decreasing, no sequence longer
    than ``max_seqlen``. The values are read on the host (one small copy, which waits for the GPU) the first time
    a tensor is seen, and again after any in-place change to it; not while torch.compile traces or a CUDA graph
    captures, where a copy to the host is not allowed: there the caller vouches for them."""
    check_tensor(cu, name, dtypes=(torch.int32,), ndim=1)
    if cu.device != device:
        raise ValueError(f"{name} must be on q's device ({device}), got {cu.device}")
    if cu.numel() < 1:
        raise ValueError(f"{name} must hold at least one offset (0), got an empty tensor")
    if torch.compiler.is_compiling() or (cu.is_cuda and torch.cuda.is_current_stream_capturing()):
        return
    seen = _checked_offsets.get(id(cu))
    if seen is not None and seen[0]() is cu and seen[1:3] == (cu._version, total) and seen[3] <= max_seqlen:
        return
    offsets = _host_offsets(cu)
    if offsets[0] != 0:
        raise ValueError(f"{name} must start at 0, got {offsets[0]}")
    lengths = [b - a for a, b in zip(offsets, offsets[1:], strict=False)]
    if any(n < 0 for n in lengths):
        i = next(i for i, n in enumerate(lengths) if n < 0)
        raise ValueError(f"{name} must not decrease, got {offsets[i]} then {offsets[i + 1]} at index {i}")
    if offsets[-1] != total:
        raise ValueError(f"{name} must end at the number of tokens ({total}), got {offsets[-1]}")
    if lengths and max(lengths) > max_seqlen:
        raise ValueError(f"a sequence of {max(lengths)} tokens is longer than max_seqlen ({max_seqlen}) for {name}")
    if len(_checked_offsets) > 256:  # forget the freed ones
        for key in [key for key, entry in _checked_offsets.items() if entry[0]() is None]:
            del _checked_offsets[key]
    _checked_offsets[id(cu)] = (weakref.ref(cu), cu._version, total, max(lengths, default=0))


def flash_attention_varlen(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_k: torch.Tensor,
    max_seqlen_q: int,
    max_seqlen_k: int,
    causal: bool = False,
    window: Optional[int] = None,
    scale: Optional[float] = None,
    return_lse: bool = False,
):
    """Attention over packed sequences, FlashAttention's ``flash_attn_varlen_func``: q (total_q, Hq, D), k
    (total_k, Hkv, D), v (total_k, Hkv, Dv), sequence b at rows ``cu_seqlens_q[b]:cu_seqlens_q[b + 1]`` of q and
    ``cu_seqlens_k[b]:cu_seqlens_k[b + 1]`` of k and v; its queries see its keys only.

    ``cu_seqlens_*``: int32 (B + 1,) offsets from 0 to the token count; ``max_seqlen_*``: the longest sequence
    (bounds the grid). Masks are per sequence, as in :func:`flash_attention`. Returns out (total_q, Hq, Dv), and
    with ``return_lse`` also the float32 log-sum-exp (Hq, total_q), FlashAttention's layout.
    """
    _check_qkv(q, k, v, ndim=3, heads_dim=1)
    if k.shape[0] != v.shape[0]:
        raise ValueError(f"k and v must have the same number of tokens, got {k.shape[0]} and {v.shape[0]}")
    if cu_seqlens_q.shape != cu_seqlens_k.shape:
        raise ValueError(
            f"cu_seqlens_q and cu_seqlens_k must count the same sequences, got {tuple(cu_seqlens_q.shape)} "
            f"and {tuple(cu_seqlens_k.shape)}"
        )
    max_q, max_k = int(max_seqlen_q), int(max_seqlen_k)
    if max_q < 0 or max_k < 0:
        raise ValueError(f"max_seqlen_q and max_seqlen_k must not be negative, got {max_q} and {max_k}")
    _check_offsets(cu_seqlens_q, "cu_seqlens_q", q.shape[0], max_q, q.device)
    _check_offsets(cu_seqlens_k, "cu_seqlens_k", k.shape[0], max_k, q.device)
    window = _check_window(causal, window)
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else float(scale)
    if use_triton(q, k, v, op="flash_attention_varlen"):
        # one tensor for both offsets (self-attention) goes in once: Dynamo refuses a tensor twice in apply()
        cu_k = None if cu_seqlens_k is cu_seqlens_q else cu_seqlens_k
        args = (bool(causal), window, scale, cu_seqlens_q, cu_k, max_q, max_k)
        out, lse = _FlashAttention.apply(q, k, v, *args)
    else:  # CPU without the interpreter: the reference, differentiated by autograd
        out, lse = attention_varlen_ref(q, k, v, cu_seqlens_q, cu_seqlens_k, causal, window, scale, return_lse=True)
    return (out, lse) if return_lse else out


# --------------------------------------------------------------------------------------------------
# Module
# --------------------------------------------------------------------------------------------------
class MultiHeadAttention(torch.nn.Module):
    """Self-attention with one fused QKV projection, optional rotary embedding, flash attention and an output
    projection. ``n_kv_heads`` < ``n_heads`` gives grouped-query attention (1: multi-query)."""

    def __init__(
        self,
        dim: int,
        n_heads: int,
        n_kv_heads: Optional[int] = None,
        causal: bool = True,
        window: Optional[int] = None,
        rope: bool = False,
        device=None,
        dtype=None,
    ):
        super().__init__()
        n_kv_heads = n_heads if n_kv_heads is None else n_kv_heads
        if dim % n_heads or n_heads % n_kv_heads:
            raise ValueError(
                f"dim ({dim}) must divide into n_heads ({n_heads}), a multiple of n_kv_heads ({n_kv_heads})"
            )
        self.n_heads, self.n_kv_heads, self.head_dim = n_heads, n_kv_heads, dim // n_heads
        self.causal, self.window, self.rope = causal, window, rope
        qkv_out = (n_heads + 2 * n_kv_heads) * self.head_dim
        self.qkv = torch.nn.Linear(dim, qkv_out, bias=False, device=device, dtype=dtype)
        self.proj = torch.nn.Linear(dim, dim, bias=False, device=device, dtype=dtype)

    def forward(
        self, x: torch.Tensor, cu_seqlens: Optional[torch.Tensor] = None, max_seqlen: Optional[int] = None
    ) -> torch.Tensor:
        """x (B, N, dim); or packed documents (tokens, dim) with their int32 offsets ``cu_seqlens`` (B + 1,) and
        longest length ``max_seqlen`` (read from the offsets if not given): each document attends to itself
        only, and its rotary positions start at 0."""
        if cu_seqlens is not None:
            return self._forward_packed(x, cu_seqlens, max_seqlen)
        B, N, _ = x.shape
        H, Hkv, D = self.n_heads, self.n_kv_heads, self.head_dim
        q, k, v = self.qkv(x).split([H * D, Hkv * D, Hkv * D], dim=-1)
        q = q.view(B, N, H, D).transpose(1, 2)  # (B, H, N, D)
        k = k.view(B, N, Hkv, D).transpose(1, 2)  # (B, Hkv, N, D)
        v = v.view(B, N, Hkv, D).transpose(1, 2)
        if self.rope:
            from .rope import rope, rope_cos_sin  # imported here: without rope this file needs only _utils.py

            cos, sin = rope_cos_sin(N, D, device=x.device)
            q, k = rope(q, cos, sin), rope(k, cos, sin)
        out = flash_attention(q, k, v, causal=self.causal, window=self.window)  # (B, H, N, D)
        return self.proj(out.transpose(1, 2).reshape(B, N, H * D))

    def _forward_packed(self, x: torch.Tensor, cu_seqlens: torch.Tensor, max_seqlen: Optional[int]) -> torch.Tensor:
        if x.dim() != 2:
            raise ValueError(f"with cu_seqlens, x must be packed (tokens, dim), got {tuple(x.shape)}")
        T = x.shape[0]
        H, Hkv, D = self.n_heads, self.n_kv_heads, self.head_dim
        if max_seqlen is None:
            max_seqlen = int(cu_seqlens.diff().max()) if cu_seqlens.numel() > 1 else 0
        q, k, v = self.qkv(x).split([H * D, Hkv * D, Hkv * D], dim=-1)
        q, k, v = q.view(T, H, D), k.view(T, Hkv, D), v.view(T, Hkv, D)
        if self.rope:
            from .rope import rope, rope_cos_sin

            # each token's position within its document: its row minus its document's first row
            starts = torch.repeat_interleave(cu_seqlens[:-1], cu_seqlens.diff(), output_size=T)
            position = torch.arange(T, device=x.device) - starts
            cos, sin = rope_cos_sin(max(int(max_seqlen), 1), D, device=x.device)
            cos, sin = cos[position], sin[position]  # (T, D/2)
            as_batch = lambda t: t.transpose(0, 1)[None]  # noqa: E731  (T, H, D) viewed as (1, H, T, D)
            q, k = rope(as_batch(q), cos, sin)[0].transpose(0, 1), rope(as_batch(k), cos, sin)[0].transpose(0, 1)
        out = flash_attention_varlen(
            q, k, v, cu_seqlens, cu_seqlens, max_seqlen, max_seqlen, causal=self.causal, window=self.window
        )  # (T, H, D)
        return self.proj(out.reshape(T, H * D))
