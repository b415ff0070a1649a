"""kernel_lib.models.GPT: each version forward and backward, the versions against each other from the same weights
(logits, loss, the gradient of every parameter), the loss protocol, torch.compile, and bad input.

The versions are compared in the naive layout (``naive_layout`` maps fused and stacked weights, and their gradients,
to the naive names), so one comparison covers every parameter of every version. In float32 they agree to rounding;
in bfloat16 the kernel_lib version is held to the kernel tests' rule against a float64 run of the native version,
with the native version in bfloat16 as PyTorch's own error."""

import dataclasses

import pytest
import torch
import torch.nn.functional as F

from kernel_lib.models import GPT, GPTConfig, naive_layout, transfer_weights
from kernel_lib.models.gpt import IMPLS, _naive_shapes
from kernel_lib.validate import check, report

TINY = dict(vocab_size=128, d_model=64, n_layers=2, n_heads=4, max_seq_len=32)  # head dim 16, d_ff 256
MOE = dict(TINY, n_experts=4, top_k=2, d_ff=64)  # d_ff 64: the interpreted grouped GEMMs stay quick
GQA = dict(TINY, n_kv_heads=2)  # grouped-query attention: two query heads per key/value head
B, T = 2, 16


def _model(impl: str, device, dtype=torch.float32, **sizes) -> GPT:
    return GPT(GPTConfig(**(sizes or TINY), impl=impl), device=device, dtype=dtype)


def _tokens(config: GPTConfig, device, ignored: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """idx and targets (B, T); the first ``ignored`` targets of each row are -100."""
    idx = torch.randint(0, config.vocab_size, (B, T), device=device)
    targets = torch.randint(0, config.vocab_size, (B, T), device=device)
    targets[:, :ignored] = -100
    return idx, targets


def _loss_and_grads(model: GPT, idx, targets) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    model.zero_grad(set_to_none=True)
    loss = model(idx, targets)
    loss.backward()
    return loss.detach(), naive_layout(model, grads=True)


@pytest.mark.parametrize(
    "impl, dtype",
    [
        ("naive", torch.float32),
        ("native", torch.float32),
        ("kernel_lib", torch.float32),  # flash_attention takes 16-bit inputs: its float32 fallback, SDPA
        ("naive", torch.bfloat16),
        ("native", torch.bfloat16),
        ("kernel_lib", torch.bfloat16),  # flash_attention itself (interpreted on the CPU)
    ],
    ids=str,
)
def test_forward_backward(device, impl, dtype):
    model = _model(impl, device, dtype)
    idx, targets = _tokens(model.config, device)
    logits = model(idx)
    assert logits.shape == (B, T, model.config.vocab_size) and logits.dtype == dtype
    loss = model(idx, targets)
    assert loss.shape == () and loss.dtype == torch.float32 and torch.isfinite(loss)
    # near log V at initialization: the logits are small
    assert abs(loss.item() - torch.log(torch.tensor(128.0)).item()) < 0.5
    loss.backward()
    for name, param in model.named_parameters():
        assert param.grad is not None and param.grad.dtype == dtype, name
        assert torch.isfinite(param.grad).all(), name


@pytest.mark.parametrize(
    "sizes",
    [
        pytest.param(TINY, id="dense"),
        pytest.param(GQA, id="gqa"),
        pytest.param(dict(TINY, n_kv_heads=1), id="mqa"),  # one key/value head for all: multi-query attention
        pytest.param(MOE, id="moe-top2"),
        pytest.param(dict(MOE, top_k=1, n_layers=1), id="moe-top1"),  # each token to one expert: weight 1
    ],
)
def test_versions_agree_from_the_same_weights(device, sizes):
    ref = "naive" if sizes.get("n_kv_heads") is None else "native"  # the naive model has no grouped-query attention
    others = [impl for impl in ("native", "kernel_lib") if impl != ref]
    models = {impl: _model(impl, device, **sizes) for impl in [ref, *others]}
    for impl in others:
        transfer_weights(models[ref], models[impl])
    idx, targets = _tokens(models[ref].config, device, ignored=3)
    want_logits = models[ref](idx)
    want_loss, want_grads = _loss_and_grads(models[ref], idx, targets)
    for impl in others:
        torch.testing.assert_close(models[impl](idx), want_logits, atol=1e-4, rtol=1e-4, msg=f"{impl} logits")
        loss, grads = _loss_and_grads(models[impl], idx, targets)
        torch.testing.assert_close(loss, want_loss, atol=1e-5, rtol=1e-5, msg=f"{impl} loss")
        assert grads.keys() == want_grads.keys()
        for name, grad in grads.items():
            torch.testing.assert_close(grad, want_grads[name], atol=1e-5, rtol=1e-4, msg=lambda m, n=name: f"{n}: {m}")


def test_kernel_lib_in_bfloat16_is_within_twice_pytorchs_error(device):
    # baseline: the native version in bfloat16, PyTorch's own error; reference: the same bfloat16 weights in a
    # float64 native model (its RoPE and loss run in float32, far below bfloat16's error)
    base = _model("native", device, torch.bfloat16)
    models = {
        "base": base,
        "ref": _model("native", device, torch.float64),
        "kernel": _model("kernel_lib", device, torch.bfloat16),
    }
    idx, targets = _tokens(base.config, device, ignored=2)
    runs = {}
    for name, model in models.items():
        transfer_weights(base, model)
        runs[name] = (model(idx), *_loss_and_grads(model, idx, targets))
    (ref_logits, ref_loss, ref_grads), (base_logits, base_loss, base_grads) = runs["ref"], runs["base"]
    logits, loss, grads = runs["kernel"]
    checks = [
        check(logits, ref_logits, base_logits, name="logits", atol=1e-3),
        check(loss, ref_loss, base_loss, name="loss", atol=1e-4),
    ]
    scale = max(g.abs().max().item() for g in ref_grads.values())  # each gradient's atol: 0.1% of the largest
    checks += [check(grads[n], ref_grads[n], base_grads[n], name=f"d {n}", atol=1e-3 * scale) for n in grads]
    assert all(c.ok for c in checks), report(checks)


@pytest.mark.parametrize("sizes", [pytest.param(TINY, id="dense"), pytest.param(MOE, id="moe")])
def test_same_seed_gives_every_version_the_same_weights(device, sizes):
    weights = {}
    for impl in IMPLS:
        torch.manual_seed(1234)
        weights[impl] = naive_layout(_model(impl, device, **sizes))
    for impl in ("native", "kernel_lib"):
        for name, w in weights[impl].items():
            assert torch.equal(w, weights["naive"][name]), f"{impl}: {name}"


def test_initialization_scales():
    config = GPTConfig(**dict(TINY, d_model=256, n_layers=8, n_heads=4))
    weights = naive_layout(GPT(config))
    residual = 0.02 / (2 * config.n_layers) ** 0.5
    for name, w in weights.items():
        if name.endswith("norm.weight") or name == "norm_f.weight":
            assert torch.equal(w, torch.ones_like(w)), name
        else:
            std = residual if name.endswith((".o.weight", ".down.weight")) else 0.02
            assert abs(w.std().item() - std) < 0.1 * std and abs(w.mean().item()) < 0.1 * std, name


def test_naive_layout_is_the_naive_models_own():
    for sizes in (TINY, MOE):
        model = _model("naive", "cpu", **sizes)
        shapes = [(name, tuple(p.shape)) for name, p in model.named_parameters()]
        assert shapes == list(_naive_shapes(model.config))
        assert all(w is not None for w in naive_layout(model).values())


def test_grouped_query_weights_split_by_kv_dim():
    native, kernel = _model("native", "cpu", **GQA), _model("kernel_lib", "cpu", **GQA)
    assert dict((n, tuple(w.shape)) for n, w in naive_layout(native).items()) == dict(_naive_shapes(native.config))
    assert naive_layout(native)["blocks.0.attn.k.weight"].shape == (32, 64)  # 2 key/value heads of 16
    transfer_weights(native, kernel)
    for (name, a), b in zip(naive_layout(native).items(), naive_layout(kernel).values(), strict=True):
        assert torch.equal(a, b), name


@pytest.mark.parametrize("sizes", [pytest.param(TINY, id="dense"), pytest.param(MOE, id="moe")])
def test_transfer_weights_round_trip_and_dtype(sizes):
    naive, native, kernel = (_model(impl, "cpu", **sizes) for impl in IMPLS)
    transfer_weights(naive, native)
    start = {n: w.clone() for n, w in naive_layout(naive).items()}
    for p in naive.parameters():
        torch.nn.init.normal_(p)  # different weights, so the round trip must carry every one back
    transfer_weights(native, kernel)
    transfer_weights(kernel, naive)
    for name, w in naive_layout(naive).items():
        assert torch.equal(w, start[name]), name
    half = GPT(dataclasses.replace(naive.config, impl="native"), dtype=torch.bfloat16)
    transfer_weights(naive, half)  # float32 -> bfloat16: each weight rounded once
    for name, w in naive_layout(half).items():
        assert w.dtype == torch.bfloat16 and torch.equal(w, start[name].bfloat16()), name


@pytest.mark.parametrize("change", [{"d_model": 128}, {"n_experts": 4}, {"vocab_size": 64}, {"n_kv_heads": 2}], ids=str)
def test_transfer_weights_between_different_sizes_is_refused(change):
    src = _model("naive", "cpu")
    with pytest.raises(ValueError, match="configs differ beyond impl, in: " + next(iter(change))):
        transfer_weights(src, GPT(GPTConfig(**dict(TINY, **change), impl="native")))


@pytest.mark.parametrize("impl", IMPLS)
def test_loss_protocol_and_ignore_index(device, impl):
    model = _model(impl, device)
    idx, targets = _tokens(model.config, device, ignored=5)
    logits = model(idx)
    torch.testing.assert_close(model.head(model.forward_hidden(idx)), logits, atol=0, rtol=0)
    loss = model(idx, targets)
    flat_logits, flat_targets = logits.float().flatten(0, 1), targets.flatten()
    torch.testing.assert_close(loss, F.cross_entropy(flat_logits, flat_targets), atol=1e-5, rtol=1e-5)
    kept = flat_targets != -100  # the mean runs over the kept targets alone
    torch.testing.assert_close(loss, F.cross_entropy(flat_logits[kept], flat_targets[kept]), atol=1e-5, rtol=1e-5)


def test_parameter_count_and_flops():
    for sizes in (dict(impl="native"), dict(n_experts=8, top_k=2, impl="native")):  # the default sizes, dense and MoE
        config = GPTConfig(**sizes)
        model = GPT(config, device="meta")  # no memory for 170M parameters, and no initialization
        d, V, L, E, d_ff = config.d_model, config.vocab_size, config.n_layers, config.n_experts, config.d_ff
        assert d_ff == 2816  # 8/3 * 1024 = 2730.7, rounded up to a multiple of 256
        mlp = E * (3 * d * d_ff + d) if E else 3 * d * d_ff
        assert model.num_parameters() == 2 * V * d + d + L * (4 * d * d + 2 * d + mlp)  # the docstring's N
        active = L * (4 * d * d + 3 * d * d_ff * (config.top_k if E else 1) + d * E) + V * d
        assert model.flops_per_token(2048) == 6 * active + 12 * L * d * 2048
    config = GPTConfig(n_kv_heads=4, impl="native")  # 16 heads of 64, 4 key/value heads: k and v 256 wide
    model, d, L = GPT(config, device="meta"), config.d_model, config.n_layers
    assert config.kv_dim == 256 and model.blocks[0].attn.qkv.weight.shape == (d + 2 * 256, d)
    attention = 2 * d * d + 2 * d * 256
    mlp = 3 * d * config.d_ff
    assert model.num_parameters() == 2 * config.vocab_size * d + d + L * (attention + 2 * d + mlp)
    assert model.flops_per_token(2048) == 6 * (L * (attention + mlp) + config.vocab_size * d) + 12 * L * d * 2048


@pytest.mark.parametrize(
    "impl, sizes, fullgraph",
    [
        pytest.param("naive", TINY, True, id="naive-dense"),  # the dense naive model has no graph break either
        pytest.param("native", TINY, True, id="native-dense"),
        pytest.param("kernel_lib", TINY, True, id="kernel_lib-dense"),  # every kernel a torch.library op
        pytest.param("native", GQA, True, id="native-gqa"),  # SDPA's enable_gqa traced without a break
        pytest.param("kernel_lib", GQA, True, id="kernel_lib-gqa"),
        pytest.param("naive", MOE, False, id="naive-moe"),  # nonzero per expert: data-dependent shapes, breaks
        pytest.param("native", MOE, False, id="native-moe"),  # the group sizes' .tolist(): a graph break
    ],
)
def test_compiles(device, impl, sizes, fullgraph):
    # backend aot_eager: Dynamo's graph (fullgraph raises on any break) and AOTAutograd's backward trace, without
    # Inductor's code generation, which takes about 10 s per model on a CPU and is tested with each kernel
    model = _model(impl, device, **sizes)
    idx, targets = _tokens(model.config, device, ignored=1)
    want_loss, want_grads = _loss_and_grads(model, idx, targets)
    torch._dynamo.reset()
    compiled = torch.compile(model, fullgraph=fullgraph, backend="aot_eager")
    loss, grads = _loss_and_grads(compiled, idx, targets)
    torch.testing.assert_close(loss, want_loss, atol=1e-5, rtol=1e-5)
    for name, grad in grads.items():
        torch.testing.assert_close(grad, want_grads[name], atol=1e-6, rtol=1e-5, msg=lambda m, n=name: f"{n}: {m}")


BAD_INPUTS = [  # (idx, targets, words)
    (torch.zeros(2, 8, dtype=torch.int32), None, "idx must be an int64 tensor"),  # int32 token ids
    (torch.zeros(2, 8), None, "idx must be an int64 tensor"),  # float
    ([[1, 2, 3]], None, "idx must be an int64 tensor"),  # a list, not a tensor
    (torch.zeros(2, 8, 1, dtype=torch.int64), None, r"idx must have shape \(B, T\)"),  # 3-D
    (torch.zeros(8, dtype=torch.int64), None, r"idx must have shape \(B, T\)"),  # 1-D
    (torch.zeros(1, 33, dtype=torch.int64), None, "longer than max_seq_len"),  # T = max_seq_len + 1
    (torch.zeros(2, 8, dtype=torch.int64), torch.zeros(2, 7, dtype=torch.int64), "targets must have idx's shape"),
    (torch.zeros(2, 8, dtype=torch.int64), torch.zeros(16, dtype=torch.int64), "targets must have idx's shape"),
    (torch.zeros(2, 8, dtype=torch.int64), torch.zeros(2, 8, dtype=torch.int32), "targets must be an int64"),
]


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("idx, targets, words", BAD_INPUTS)
def test_bad_input_is_named(impl, idx, targets, words):
    model = _model(impl, "cpu")
    with pytest.raises(ValueError, match=words):
        model(idx, targets)


BAD_CONFIGS = [  # (changes to TINY, words)
    ({"d_model": 60, "n_heads": 7}, "must be a multiple of n_heads"),
    ({"d_model": 60, "n_heads": 4}, "must be even for RoPE"),  # head dim 15
    ({"impl": "fast"}, "impl must be one of"),
    ({"n_experts": 4, "top_k": 5}, "top_k must be between 1 and n_experts"),
    ({"n_experts": 4, "top_k": 0}, "top_k must be between 1 and n_experts"),
    ({"n_experts": -1}, "n_experts must be 0"),
    ({"vocab_size": 0}, "vocab_size must be a positive integer"),
    ({"n_layers": -1}, "n_layers must be a positive integer"),
    ({"n_kv_heads": 3}, "must be a multiple of n_kv_heads"),  # 4 query heads cannot share 3 key/value heads
    ({"n_kv_heads": 0}, "n_kv_heads must be a positive integer"),
    ({"n_kv_heads": 2, "impl": "naive"}, "impl 'naive' has no grouped-query attention"),
    ({"d_ff": 0}, "d_ff must be a positive integer"),
    ({"max_seq_len": 16.0}, "max_seq_len must be a positive integer"),  # a float, not an int
    ({"rope_base": 0.0}, "rope_base must be > 0"),
    ({"norm_eps": -1e-6}, "norm_eps >= 0"),
    ({"d_model": 1040, "impl": "kernel_lib"}, "head dim of at most 256"),  # head dim 260: past flash_attention's
]


@pytest.mark.parametrize("changes, words", BAD_CONFIGS, ids=str)
def test_bad_config_is_named(changes, words):
    with pytest.raises(ValueError, match=words):
        GPTConfig(**dict(TINY, **changes))


def test_top_k_is_checked_only_with_experts():
    assert GPTConfig(**TINY, top_k=99).n_experts == 0  # a dense MLP ignores top_k


@pytest.mark.gpu
def test_kernel_lib_matches_native_on_gpu():
    sizes = dict(vocab_size=32768, d_model=512, n_layers=4, n_heads=8, max_seq_len=1024)
    torch.manual_seed(0)
    native = _model("native", "cuda", torch.bfloat16, **sizes)
    kernel = _model("kernel_lib", "cuda", torch.bfloat16, **sizes)
    transfer_weights(native, kernel)
    idx = torch.randint(0, sizes["vocab_size"], (4, 1024), device="cuda")
    targets = torch.randint(0, sizes["vocab_size"], (4, 1024), device="cuda")
    torch.testing.assert_close(kernel(idx, targets), native(idx, targets), atol=2e-2, rtol=0)
