"""kernel_lib's weight-only quantized linear layers: the quantizers' round trip within half a step, the kernels
against the float64 product with the dequantized weight, the module and quantize_ on a model, bad input."""

import pytest
import torch

from kernel_lib.ops.quantized_linear import (
    QuantizedLinear,
    dequantize_int4,
    dequantize_int8,
    int4_linear,
    int8_linear,
    quantize_,
    quantize_int4,
    quantize_int8,
)
from tests._checks import TinyLM

DTYPES = [torch.float32, torch.float16, torch.bfloat16]


def test_int8_round_trip_within_half_a_step():
    w = torch.randn(37, 200) * torch.logspace(-2, 1, 37)[:, None]  # rows of very different ranges
    w[3] = 0  # an all-zero row: scale 1, q 0
    q, scale = quantize_int8(w)
    err = (dequantize_int8(q, scale) - w).abs()
    assert q.dtype == torch.int8 and (err <= scale[:, None] / 2 + 1e-7).all()
    assert (q[3] == 0).all()


@pytest.mark.parametrize("group", [32, 128])
def test_int4_round_trip_within_half_a_step(group):
    w = torch.randn(9, 256) + torch.linspace(-3, 3, 9)[:, None]  # offset rows: the zero point matters
    packed, scale, zero = quantize_int4(w, group)
    assert packed.shape == (9, 128) and scale.shape == zero.shape == (9, 256 // group)
    err = (dequantize_int4(packed, scale, zero) - w).abs().reshape(9, -1, group)
    assert (err <= scale[..., None] / 2 + 1e-6).all()


def product(x, w):
    """x @ w^T in float64, out in x's dtype's accuracy class."""
    return x.double() @ w.double().T


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", [(1, 96), (3, 5, 96), (33, 96)], ids=str)  # a decode step; batched; > 16 rows
@pytest.mark.parametrize("bias", [False, True])
def test_int8_linear_against_float64(device, dtype, shape, bias):
    w = torch.randn(70, 96, device=device)  # 70 outputs: a ragged tile
    q, scale = quantize_int8(w)
    x = torch.randn(shape, device=device).to(dtype)
    b = torch.randn(70, device=device).to(dtype) if bias else None
    with torch.no_grad():
        y = int8_linear(x, q, scale, b)
    want = product(x, dequantize_int8(q, scale)) + (b.double() if bias else 0)
    tol = {torch.float32: 1e-4, torch.float16: 2e-2, torch.bfloat16: 1e-1}[dtype]  # x's rounding of the output
    assert y.dtype == dtype and y.shape == (*shape[:-1], 70)
    torch.testing.assert_close(y.double(), want, atol=tol, rtol=tol)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("group", [32, 64])
def test_int4_linear_against_float64(device, dtype, group):
    w = torch.randn(50, 128, device=device) + 0.5
    packed, scale, zero = quantize_int4(w, group)
    x = torch.randn(4, 128, device=device).to(dtype)
    with torch.no_grad():
        y = int4_linear(x, packed, scale, zero)
    want = product(x, dequantize_int4(packed, scale, zero))
    tol = {torch.float32: 1e-4, torch.float16: 2e-2, torch.bfloat16: 1e-1}[dtype]
    torch.testing.assert_close(y.double(), want, atol=tol, rtol=tol)


@pytest.mark.parametrize("bits", [8, 4])
def test_quantize_model_in_place(device, bits):
    torch.manual_seed(0)
    model = TinyLM().to(device)
    x = torch.randn(2, 64, device=device)
    with torch.no_grad():
        before = model(x)
        quantize_(model, bits=bits, group=32)
        after = model(x)
    assert isinstance(model.up, QuantizedLinear) and isinstance(model.down, QuantizedLinear)
    assert not isinstance(model.lm_head, QuantizedLinear)  # skipped by default
    assert f"bits={bits}" in repr(model.up)
    rel = (after - before).norm() / before.norm()
    assert rel < (0.02 if bits == 8 else 0.15), rel  # the quantization error of the weights, not the kernel's


def test_compiles_without_graph_break(device):
    q, scale = quantize_int8(torch.randn(32, 64, device=device))
    x = torch.randn(2, 64, device=device)
    with torch.no_grad():
        y = torch.compile(lambda t: int8_linear(t, q, scale) + 1, fullgraph=True)(x)
    torch.testing.assert_close(y, x @ dequantize_int8(q, scale).T + 1, atol=1e-4, rtol=1e-4)


def test_opcheck(device):
    q, scale = quantize_int8(torch.randn(32, 64, device=device))
    torch.library.opcheck(torch.ops.kernel_lib.int8_linear.default, (torch.randn(2, 64, device=device), q, scale, None))
    packed, s4, z4 = quantize_int4(torch.randn(32, 64, device=device), 32)
    torch.library.opcheck(
        torch.ops.kernel_lib.int4_linear.default, (torch.randn(2, 64, device=device), packed, s4, z4, None)
    )


def test_bad_input_is_named():
    q, scale = quantize_int8(torch.randn(8, 16))
    with pytest.raises(ValueError, match="features"):
        int8_linear(torch.randn(2, 15), q, scale)
    with pytest.raises(TypeError, match="weight must have dtype"):
        int8_linear(torch.randn(2, 16), q.float(), scale)
    with pytest.raises(ValueError, match="no_grad"):
        int8_linear(torch.randn(2, 16, requires_grad=True), q, scale)
    with pytest.raises(ValueError, match="power of two >= 32"):
        quantize_int4(torch.randn(4, 100), 50)
    packed, s, z = quantize_int4(torch.randn(4, 64), 32)
    with pytest.raises(ValueError, match="one int4 weight"):
        int4_linear(torch.randn(2, 64), packed, s, z[:, :1])
    with pytest.raises(ValueError, match="bits"):
        QuantizedLinear(torch.nn.Linear(4, 4), bits=3)


@pytest.mark.gpu
@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize("M", [1, 16, 200])  # a decode step, a batch of 16, a prefill
def test_model_sized_on_gpu(bits, M):
    w = torch.randn(4096, 4096, device="cuda") * 0.02
    x = torch.randn(M, 4096, device="cuda").bfloat16()
    if bits == 8:
        q, scale = quantize_int8(w)
        with torch.no_grad():
            y = int8_linear(x, q, scale)
        want = product(x, dequantize_int8(q, scale))
    else:
        packed, scale, zero = quantize_int4(w, 128)
        with torch.no_grad():
            y = int4_linear(x, packed, scale, zero)
        want = product(x, dequantize_int4(packed, scale, zero))
    torch.testing.assert_close(y.double(), want, atol=2e-2, rtol=2e-2)


@pytest.mark.parametrize("bits", [8, 4])
def test_quantize_hugging_face_llama(bits):
    """quantize_ on a Hugging Face Llama built from a config: every projection swapped, lm_head kept, the logits
    within the weights' quantization error of the original's."""
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(vocab_size=64, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2)  # fmt: skip
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config).eval()
    ids = torch.randint(0, 64, (2, 9))
    with torch.no_grad():
        before = model(ids).logits
        quantize_(model, bits=bits, group=32)
        after = model(ids).logits
    layer = model.model.layers[0]
    projections = [layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj, layer.self_attn.o_proj,
                   layer.mlp.gate_proj, layer.mlp.up_proj, layer.mlp.down_proj]  # fmt: skip
    assert all(isinstance(p, QuantizedLinear) for p in projections)
    assert isinstance(model.lm_head, torch.nn.Linear)  # the output head is kept by default
    rel = (after - before).norm() / before.norm()
    assert rel < (0.02 if bits == 8 else 0.2), rel
