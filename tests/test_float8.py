"""kernel_lib's float8 linear layers: the row quantizer against PyTorch's own cast, the scaled product against float64
on the same float8 operands, the layer's three products forward and backward against a float64 recipe, the module
and convert_to_float8 on a model, the custom ops, bad input."""

import pytest
import torch
import torch.nn.functional as F

from kernel_lib.ops import float8 as f8
from kernel_lib.ops.float8 import (
    RECIPES,
    Float8Linear,
    convert_to_float8,
    float8_linear,
    float8_linear_ref,
    quantize_float8,
    quantize_float8_blocks,
    quantize_float8_blocks_ref,
    quantize_float8_both,
    quantize_float8_ref,
    scaled_mm,
    scaled_mm_blocks,
    scaled_mm_blocks_ref,
    scaled_mm_ref,
)
from tests._checks import TinyLM

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2


@pytest.mark.parametrize("dtype", [E4M3, E5M2], ids=str)
@pytest.mark.parametrize("shape", [(5, 40), (3, 2500)], ids=str)  # one step of the row loop; three, the last ragged
def test_quantize_rows_against_torch_cast(device, dtype, shape):
    x = torch.randn(shape, device=device) * torch.logspace(-3, 2, shape[0], device=device)[:, None]
    x[1] = 0  # an all-zero row: scale 1, q 0
    q, scale = quantize_float8(x, dtype)
    q_ref, scale_ref = quantize_float8_ref(x, dtype)
    assert q.dtype == dtype and scale.dtype == torch.float32
    torch.testing.assert_close(scale, scale_ref, rtol=1e-6, atol=0)
    assert (q[1].float() == 0).all() and scale[1] == 1
    # the GPU's cast rounds to nearest even like PyTorch's (under the interpreter PyTorch casts: see HOST_CAST)
    assert torch.equal(q.float(), q_ref.float())
    assert (q.float().abs().amax(dim=1)[scale != 1] == torch.finfo(dtype).max).all()  # a row's max: the format's


def test_quantize_non_contiguous_rows(device):
    x = torch.randn(64, 48, device=device).t()  # a transposed view: rows with stride 1 along the other axis
    q, scale = quantize_float8(x)
    torch.testing.assert_close(scale, quantize_float8_ref(x)[1], rtol=1e-6, atol=0)


@pytest.mark.parametrize("out_dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("M, N, K", [(33, 70, 96), (1, 16, 32), (40, 48, 200)], ids=str)  # ragged tiles; one row
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("fast_accum", [False, True], ids=["promoted", "fast"])
def test_scaled_mm_against_float64(device, out_dtype, M, N, K, bias, fast_accum):
    qa, sa = quantize_float8_ref(torch.randn(M, K, device=device))
    qb, sb = quantize_float8_ref(torch.randn(N, K, device=device))
    b = torch.randn(N, device=device).to(out_dtype) if bias else None
    y = scaled_mm(qa, qb, sa, sb, b, out_dtype, fast_accum=fast_accum)
    want = scaled_mm_ref(qa, qb, sa, sb, b, torch.float64)
    tol = 1e-5 if out_dtype == torch.float32 else 2**-7  # float32 accumulation; bf16's rounding of the output
    tol += 2 * _cublas_error(qa, qb, sa, sb, b, want, fast_accum)  # 2x cuBLAS's own, accumulating alike
    assert y.dtype == out_dtype and y.shape == (M, N)
    torch.testing.assert_close(y.double(), want, rtol=tol, atol=tol * want.abs().max().item())


def _cublas_product(qa, qb, fast_accum=False) -> torch.Tensor:
    """qa @ qb^T by ``torch._scaled_mm`` (cuBLAS) with unit scales and a float32 output, in float64: PyTorch's own
    float8 accumulation. cuBLAS takes sizes that are multiples of 16: zeros pad the operands (zeros along K add
    nothing)."""
    M, N = qa.shape[0], qb.shape[0]
    one = torch.ones((), device=qa.device)
    qa, qb = (F.pad(t.view(torch.uint8), (0, -t.shape[1] % 16, 0, -t.shape[0] % 16)).view(t.dtype) for t in (qa, qb))
    return torch._scaled_mm(qa, qb.t(), one, one, out_dtype=torch.float32, use_fast_accum=fast_accum)[:M, :N].double()


def _has_cublas_float8(t: torch.Tensor) -> bool:
    return t.device.type == "cuda" and hasattr(torch, "_scaled_mm")


def _cublas_error(qa, qb, sa, sb, bias, want, fast_accum=False) -> float:
    """PyTorch's own accumulation error on this float8 product relative to the largest output (the row scales and
    bias applied after, in float64), on a GPU that has it; else 0 (the CPU path accumulates in float32)."""
    if not _has_cublas_float8(qa):
        return 0.0
    y = _cublas_product(qa, qb, fast_accum) * sa.double()[:, None] * sb.double()[None, :]
    y = y + (0 if bias is None else bias.double())
    return ((y - want).abs().max() / want.abs().max()).item()


def _recipe64(x, w, b, dy, grad_dtype):
    """The float8 recipe of the module docstring in float64: every operand quantized as the kernels quantize it."""

    def mm(a, bt):  # a (M, K) @ bt (N, K)^T, each quantized by rows
        qa, sa = quantize_float8_ref(a, grad_dtype if a is dy or a is dyt else E4M3)
        qb, sb = quantize_float8_ref(bt)
        return scaled_mm_ref(qa, qb, sa, sb, None, torch.float64)

    dyt = dy.t()
    y = mm(x, w) + (b.double() if b is not None else 0)
    return y, mm(dy, w.t()), mm(dyt, x.t()), (dy.double().sum(0) if b is not None else None)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("grad_dtype", [E4M3, E5M2], ids=str)
@pytest.mark.parametrize("bias", [False, True])
def test_float8_linear_forward_backward_against_the_recipe(device, dtype, grad_dtype, bias):
    torch.manual_seed(0)
    x = torch.randn(3, 11, 64, device=device).to(dtype).requires_grad_()  # 33 rows: a ragged tile
    w = (torch.randn(40, 64, device=device) * 0.1).to(dtype).requires_grad_()
    b = torch.randn(40, device=device).to(dtype).requires_grad_() if bias else None
    dy = torch.randn(3, 11, 40, device=device).to(dtype)
    y = float8_linear(x, w, b, grad_dtype)
    y.backward(dy)
    want_y, want_dx, want_dw, want_db = _recipe64(x.detach().reshape(-1, 64), w.detach(), b, dy.reshape(-1, 40),
                                                  grad_dtype)  # fmt: skip
    tol = 1e-5 if dtype == torch.float32 else 2**-7
    x2, dy2 = x.detach().reshape(-1, 64), dy.reshape(-1, 40)

    def allowed(a, bt, a_dtype, bias_, want, fast_accum):  # tol plus 2x cuBLAS's error on the same float8 operands
        (qa, sa), (qb, sb) = quantize_float8_ref(a, a_dtype), quantize_float8_ref(bt)
        return tol + 2 * _cublas_error(qa, qb, sa, sb, bias_, want, fast_accum)

    checks = (
        (y.reshape(-1, 40), want_y, allowed(x2, w.detach(), E4M3, b, want_y, True)),  # the output: fast
        (x.grad.reshape(-1, 64), want_dx, allowed(dy2, w.detach().t(), grad_dtype, None, want_dx, False)),
        (w.grad, want_dw, allowed(dy2.t(), x2.t(), grad_dtype, None, want_dw, False)),
    )
    for got, want, tol_k in checks:
        torch.testing.assert_close(got.double(), want, rtol=tol_k, atol=tol_k * want.abs().max().item())
    if bias:
        torch.testing.assert_close(b.grad.double(), want_db, rtol=tol, atol=tol * want_db.abs().max().item())


def test_float8_linear_is_close_to_the_linear(device):
    """The format's own error: e4m3 operands put the output within a few percent of the bf16 product."""
    x, w = torch.randn(64, 128, device=device), torch.randn(96, 128, device=device) * 0.1
    y = float8_linear(x, w)
    want = x.double() @ w.double().T
    assert ((y.double() - want).norm() / want.norm()).item() < 0.05


def test_convert_to_float8_trains(device):
    torch.manual_seed(0)
    model = convert_to_float8(TinyLM().to(device))
    assert isinstance(model.up, Float8Linear) and isinstance(model.down, Float8Linear)
    assert type(model.lm_head) is torch.nn.Linear  # the output projection is kept
    assert "float8" in repr(model.up)
    x, target = torch.randn(64, 64, device=device), torch.randn(64, 10, device=device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    losses = []
    for _ in range(15):
        loss = torch.nn.functional.mse_loss(model(x), target)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    assert losses[-1] < 0.7 * losses[0], losses


# the schema check compares outputs with arithmetic PyTorch's CPU build lacks for float8: the other checks run
OPCHECKS = ("test_faketensor", "test_aot_dispatch_dynamic")


def test_opcheck(device):
    x = torch.randn(6, 40, device=device)
    torch.library.opcheck(torch.ops.kernel_lib.float8_quantize.default, (x, E4M3), test_utils=OPCHECKS)
    torch.library.opcheck(torch.ops.kernel_lib.float8_quantize_both.default, (x, E4M3), test_utils=OPCHECKS)
    qa, sa = quantize_float8_ref(x)
    qb, sb = quantize_float8_ref(torch.randn(8, 40, device=device))
    torch.library.opcheck(torch.ops.kernel_lib.float8_scaled_mm.default, (qa, qb, sa, sb, None, torch.float32, False),
                          test_utils=OPCHECKS)  # fmt: skip


def test_bad_input_is_named():
    x, w = torch.randn(4, 16), torch.randn(8, 16)
    with pytest.raises(ValueError, match="features"):
        float8_linear(torch.randn(4, 15), w)
    with pytest.raises(TypeError, match="one dtype"):
        float8_linear(x.half(), w)
    with pytest.raises(ValueError, match="grad_dtype"):
        float8_linear(x, w, grad_dtype=torch.float16)
    with pytest.raises(ValueError, match="dtype must be one of"):
        quantize_float8(x, torch.int8)
    qa, sa = quantize_float8_ref(x)
    with pytest.raises(ValueError, match="do not make"):
        scaled_mm(qa, qa[:, :8].contiguous(), sa, sa)
    with pytest.raises(ValueError, match="unit stride"):
        scaled_mm(qa, quantize_float8_ref(torch.randn(16, 8))[0].t(), sa, sa)


@pytest.mark.gpu
@pytest.mark.parametrize("M", [1, 4096])
def test_model_sized_on_gpu(M):
    if torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("float8 products need an Ada or Hopper GPU (compute capability 8.9+)")
    x = torch.randn(M, 4096, device="cuda").bfloat16().requires_grad_()
    w = (torch.randn(4096, 4096, device="cuda") * 0.02).bfloat16().requires_grad_()
    dy = torch.randn(M, 4096, device="cuda").bfloat16()
    y = float8_linear(x, w)
    y.backward(dy)
    want_y, want_dx, want_dw, _ = _recipe64(x.detach(), w.detach(), None, dy, E4M3)
    for got, want in ((y, want_y), (x.grad, want_dx), (w.grad, want_dw)):
        torch.testing.assert_close(got.double(), want, rtol=2**-7, atol=2**-7 * want.abs().max().item())
    assert f8._mm_config(M, 4096)["BLOCK_M"] == 128


def test_quantize_a_row_of_tiny_values(device):
    """A row whose largest magnitude is ~1e-37 has a subnormal scale: dividing by it keeps zeros zero (its inverse
    would overflow to infinity and turn 0 into NaN)."""
    x = torch.zeros(2, 8, device=device)
    x[0, 0], x[0, 3] = 1e-37, -5e-38
    x[1] = 1.0
    q, scale = quantize_float8(x)
    assert torch.isfinite(q.float()).all()
    torch.testing.assert_close((q.float() * scale[:, None])[0], x[0], rtol=2**-3, atol=0)


def test_convert_a_kernel_lib_gpt_reaches_every_projection(device):
    """The kernel_lib GPT's MLP fuses its down projection with SwiGLU unless the layer was swapped: a Float8Linear
    (a subclass of nn.Linear) must run its own float8 product, like every other projection."""
    from kernel_lib.models import GPT, GPTConfig

    config = GPTConfig(vocab_size=64, d_model=64, n_layers=1, n_heads=4, max_seq_len=16, impl="kernel_lib")
    model = convert_to_float8(GPT(config, device=device))
    ran = []
    for name, module in model.named_modules():
        if isinstance(module, Float8Linear):
            module.register_forward_hook(lambda m, args, out, name=name: ran.append(name))
    model(torch.randint(0, 64, (2, 8), device=device)).sum().backward()
    assert sorted(ran) == ["blocks.0.attn.o", "blocks.0.attn.qkv", "blocks.0.mlp.down", "blocks.0.mlp.gate_up"]


@pytest.mark.parametrize("dtype", [E4M3, E5M2], ids=str)
@pytest.mark.parametrize("shape", [(5, 40), (70, 130), (1, 3)], ids=str)  # a tile; ragged tiles both ways; one row
def test_quantize_both_ways_equals_each_way_alone(device, dtype, shape):
    x = torch.randn(shape, device=device) * torch.logspace(-3, 2, shape[0], device=device)[:, None]
    x[0] = 0  # an all-zero row: scale 1; its column maxima come from the other rows
    q, s, qt, st = quantize_float8_both(x.bfloat16(), dtype)
    q_ref, s_ref = quantize_float8(x.bfloat16(), dtype)
    qt_ref, st_ref = quantize_float8(x.bfloat16().t(), dtype)
    assert q.dtype == qt.dtype == dtype and qt.shape == shape[::-1] and qt.is_contiguous()
    for got, want in ((s, s_ref), (st, st_ref)):
        torch.testing.assert_close(got, want, rtol=0, atol=0)
    assert torch.equal(q.float(), q_ref.float()) and torch.equal(qt.float(), qt_ref.float())


@pytest.mark.parametrize("needs", ["x", "weight", "both"])
def test_float8_linear_quantizes_what_the_backward_needs(device, needs):
    """A frozen weight (or input) skips its transposed copy; the gradients that are asked for are still right."""
    x = torch.randn(33, 64, device=device, requires_grad=needs != "weight")
    w = (torch.randn(40, 64, device=device) * 0.1).requires_grad_(needs != "x")
    dy = torch.randn(33, 40, device=device)
    float8_linear(x, w).backward(dy)
    _, want_dx, want_dw, _ = _recipe64(x.detach(), w.detach(), None, dy, E4M3)
    for t, want in ((x, want_dx), (w, want_dw)):
        if t.requires_grad:
            torch.testing.assert_close(t.grad.double(), want, rtol=0.02, atol=0.02 * want.abs().max().item())
        else:
            assert t.grad is None


# --------------------------------------------------------------------------------------------------
# Block scales (DeepSeek-V3's 1 x 128 / 128 x 128)
# --------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("transposed", [False, True], ids=["rows", "transposed-view"])  # dy^T and x^T are views
@pytest.mark.parametrize("block_rows", [1, 128])
@pytest.mark.parametrize("shape", [(3, 128), (130, 300), (1, 5)], ids=str)  # one block; ragged blocks; one row
def test_quantize_blocks_against_the_reference(device, block_rows, shape, transposed):
    x = torch.randn(shape, device=device)
    x[:, :128] *= 100  # a block of outliers: it must not cost the next blocks their precision
    xb = x.bfloat16().t().contiguous().t() if transposed else x.bfloat16()  # same values, unit stride along rows
    q, scales = quantize_float8_blocks(xb, block_rows)
    q_ref, scales_ref = quantize_float8_blocks_ref(x.bfloat16(), block_rows)
    assert scales.shape == ((shape[0] if block_rows == 1 else -(-shape[0] // 128)), -(-shape[1] // 128))
    torch.testing.assert_close(scales, scales_ref, rtol=0, atol=0)
    assert torch.equal(q.float(), q_ref.float())
    if shape[1] > 128:  # the second block's scale follows its own values, 100x smaller than the first's
        assert (scales[:, 1] < scales[:, 0] / 20).all()


@pytest.mark.parametrize("b_rows", [1, 128], ids=["b-by-rows", "b-by-tiles"])
@pytest.mark.parametrize("M, N, K", [(33, 70, 300), (1, 16, 128), (20, 130, 40)], ids=str)  # ragged; one row; K < 128
def test_scaled_mm_blocks_against_float64(device, M, N, K, b_rows):
    qa, sa = quantize_float8_blocks_ref(torch.randn(M, K, device=device), 1)
    qb, sb = quantize_float8_blocks_ref(torch.randn(N, K, device=device), b_rows)
    y = scaled_mm_blocks(qa, qb, sa, sb, torch.float32)
    want = scaled_mm_blocks_ref(qa, qb, sa, sb, torch.float64)
    tol = 1e-5 + 2 * _cublas_error_blocks(qa, qb, sa, sb, want)  # 2x cuBLAS's own, 128 deep a step
    torch.testing.assert_close(y.double(), want, rtol=tol, atol=tol * want.abs().max().item())


def _cublas_error_blocks(qa, qb, sa, sb, want) -> float:
    """cuBLAS's accumulation error on the block-scaled product: each 128-deep step through ``torch._scaled_mm``,
    scaled and summed in float64, relative to the largest output; 0 without a GPU."""
    if not _has_cublas_float8(qa):
        return 0.0
    total = torch.zeros_like(want)
    for kb in range(sa.shape[1]):
        part = slice(kb * 128, (kb + 1) * 128)
        sb_k = f8._expand_scales(sb[:, kb : kb + 1], qb.shape[0], 1).double()[:, 0]
        product = _cublas_product(qa[:, part].contiguous(), qb[:, part].contiguous())
        total += product * sa[:, kb].double()[:, None] * sb_k[None, :]
    return ((total - want).abs().max() / want.abs().max()).item()


def _recipe64_blocks(x, w, b, dy, grad_dtype):
    """The blockwise recipe of the module docstring in float64, every operand quantized as the kernels do."""

    def mm(a, a_dtype, bt, b_rows):  # a (M, K) in 1 x 128 blocks @ bt (N, K)^T in b_rows x 128 blocks
        (qa, sa), (qb, sb) = quantize_float8_blocks_ref(a, 1, a_dtype), quantize_float8_blocks_ref(bt, b_rows, E4M3)
        return scaled_mm_blocks_ref(qa, qb, sa, sb, torch.float64)

    qw, sw = quantize_float8_blocks_ref(w, 128)
    w_blocks = qw.double() * f8._expand_scales(sw, *w.shape).double()  # W as its 128 x 128 blocks give it back
    y = mm(x, E4M3, w, 128) + (b.double() if b is not None else 0)
    qdy, sdy = quantize_float8_blocks_ref(dy, 1, grad_dtype)
    dx = (qdy.double() * f8._expand_scales(sdy, *dy.shape).double()) @ w_blocks  # W^T's blocks are W's
    dw = mm(dy.t(), grad_dtype, x.t(), 1)
    return y, dx, dw


@pytest.mark.parametrize("grad_dtype", [E4M3, E5M2], ids=str)
@pytest.mark.parametrize("bias", [False, True])
def test_blockwise_linear_forward_backward_against_the_recipe(device, grad_dtype, bias):
    torch.manual_seed(0)
    x = torch.randn(3, 70, 300, device=device).bfloat16().requires_grad_()  # 210 tokens: ragged token blocks
    w = (torch.randn(200, 300, device=device) * 0.05).bfloat16().requires_grad_()  # ragged weight blocks
    b = torch.randn(200, device=device).bfloat16().requires_grad_() if bias else None
    dy = torch.randn(3, 70, 200, device=device).bfloat16()
    y = float8_linear(x, w, b, grad_dtype, recipe="blockwise")
    y.backward(dy)
    want_y, want_dx, want_dw = _recipe64_blocks(x.detach().reshape(-1, 300), w.detach(), b, dy.reshape(-1, 200),
                                                grad_dtype)  # fmt: skip
    for got, want in ((y.reshape(-1, 200), want_y), (x.grad.reshape(-1, 300), want_dx), (w.grad, want_dw)):
        torch.testing.assert_close(got.double(), want, rtol=2**-7, atol=2**-7 * want.abs().max().item())
    torch.testing.assert_close(y, float8_linear_ref(x.detach(), w.detach(), b, recipe="blockwise"), rtol=2**-7,
                               atol=2**-7 * want_y.abs().max().item())  # fmt: skip


def test_blockwise_is_closer_than_rowwise_with_an_outlier(device):
    """The point of blocks: one large activation spoils only its own block of 128 channels, not its whole row. The
    weight's columns under that block are zero, so the error left is what the other channels lost. (e4m3 is a
    floating-point format: a row scaled by an outlier 1,000x its other values keeps their relative precision; at
    10^5x they fall below e4m3's smallest normal, 2^-6 of the scale, and lose it.)"""
    x = torch.randn(64, 512, device=device)
    x[:, 5] = 1e5  # an outlier channel
    w = torch.randn(96, 512, device=device) * 0.05
    w[:, :128] = 0
    want = x.double() @ w.double().T
    err = {r: (float8_linear(x, w, recipe=r).double() - want).norm().item() / want.norm().item() for r in RECIPES}
    assert err["blockwise"] < 0.05 and err["rowwise"] > 3 * err["blockwise"], err


def test_blockwise_module_and_conversion(device):
    model = convert_to_float8(TinyLM().to(device), recipe="blockwise")
    assert model.up.recipe == "blockwise" and "blockwise" in repr(model.up)
    model(torch.randn(8, 64, device=device)).sum().backward()
    assert model.up.weight.grad is not None
    with pytest.raises(ValueError, match="recipe"):
        convert_to_float8(TinyLM(), recipe="tensorwise")


def test_blockwise_bad_input_is_named():
    qa, sa = quantize_float8_blocks_ref(torch.randn(4, 256), 1)
    qb, sb = quantize_float8_blocks_ref(torch.randn(8, 256), 128)
    with pytest.raises(ValueError, match="block_rows"):
        quantize_float8_blocks(torch.randn(4, 8), 64)
    with pytest.raises(ValueError, match="want"):
        scaled_mm_blocks(qa, qb, sa[:, :1].contiguous(), sb)
    with pytest.raises(ValueError, match="recipe"):
        float8_linear(torch.randn(4, 16), torch.randn(8, 16), recipe="tensorwise")


def test_blockwise_opcheck(device):
    x = torch.randn(6, 200, device=device)
    for rows in (1, 128):
        torch.library.opcheck(torch.ops.kernel_lib.float8_quantize_blocks.default, (x, rows, E4M3),
                              test_utils=OPCHECKS)  # fmt: skip
    qa, sa = quantize_float8_blocks_ref(x, 1)
    qb, sb = quantize_float8_blocks_ref(torch.randn(8, 200, device=device), 128)
    torch.library.opcheck(torch.ops.kernel_lib.float8_scaled_mm_blocks.default, (qa, qb, sa, sb, torch.float32),
                          test_utils=OPCHECKS)  # fmt: skip


def test_blockwise_compiles_without_graph_break(device):
    x = torch.randn(16, 256, device=device, requires_grad=True)
    w = torch.randn(64, 256, device=device, requires_grad=True)
    compiled = torch.compile(lambda x, w: float8_linear(x, w, recipe="blockwise"), fullgraph=True)
    torch.testing.assert_close(compiled(x, w), float8_linear(x, w, recipe="blockwise"))
    compiled(x, w).sum().backward()
    assert x.grad is not None and w.grad is not None


@pytest.mark.gpu
def test_blockwise_model_sized_on_gpu():
    if torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("float8 products need an Ada or Hopper GPU (compute capability 8.9+)")
    x = torch.randn(4096, 4096, device="cuda").bfloat16().requires_grad_()
    w = (torch.randn(4096, 4096, device="cuda") * 0.02).bfloat16().requires_grad_()
    dy = torch.randn(4096, 4096, device="cuda").bfloat16()
    y = float8_linear(x, w, recipe="blockwise")
    y.backward(dy)
    want_y, want_dx, want_dw = _recipe64_blocks(x.detach(), w.detach(), None, dy, E4M3)
    for got, want in ((y, want_y), (x.grad, want_dx), (w.grad, want_dw)):
        torch.testing.assert_close(got.double(), want, rtol=2**-7, atol=2**-7 * want.abs().max().item())
