"""kernel_lib.equivalence: whole components against their original, outputs and gradients, on the CPU.

Every module here is small (a few thousand parameters), so the file runs in seconds on a laptop. A test that
expects a failure also names the check that must fail, and where it matters one that must still pass: a bug in
the backward alone must fail a gradient, not the output."""

import copy
import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from kernel_lib import equivalence
from kernel_lib.equivalence import ComponentValidator, ValidationReport, ValidationResult


def by_name(report: ValidationReport) -> dict[str, ValidationResult]:
    return {r.name: r for r in report}


# ---- small modules: an original and its "optimized" rewrites ----------------------------------------------


class Affine(nn.Module):
    """y = x W^T + b: the original of the bug table."""

    def __init__(self, d_in=24, d_out=16):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(d_out, d_in) / d_in**0.5)
        self.bias = nn.Parameter(torch.randn(d_out))

    def forward(self, x):
        return x @ self.weight.T + self.bias


class WrongScale(Affine):
    def forward(self, x):
        return (x @ self.weight.T + self.bias) * 1.001  # 0.1% too large: far above float32's rounding


class MissingBias(Affine):
    def forward(self, x):
        return x @ self.weight.T


class NaNOutput(Affine):
    def forward(self, x):
        poison = torch.zeros(x.shape[0], self.weight.shape[0], dtype=x.dtype)
        poison[0, 0] = math.nan  # one element, as a kernel that forgot a tail would leave it
        return x @ self.weight.T + self.bias + poison


def identity_with_backward(backward):
    """The identity as an autograd function whose backward is ``backward(grad)``: a right output, a chosen gradient."""

    class Identity(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            return x.view_as(x)

        @staticmethod
        def backward(ctx, grad):
            return backward(grad)

    return Identity.apply


flip_backward = identity_with_backward(lambda grad: -grad)  # the input gradient is wrong
# averages over the batch: right only when every row's gradient is the same
batch_mean_backward = identity_with_backward(lambda grad: grad.mean(0, keepdim=True).expand_as(grad))


class SignFlipBackward(Affine):
    def forward(self, x):
        return flip_backward(x) @ self.weight.T + self.bias


class BatchMeanBackward(Affine):
    def forward(self, x):
        return batch_mean_backward(x @ self.weight.T + self.bias)


class WritesIntoItsInput(Affine):
    def forward(self, x):
        x.mul_(2)  # legal on a tensor without gradient; the caller's tensor would change
        return super().forward(x)


class Wrapper(nn.Module):
    """What an optimizer that wraps the model produces: the same parameters, names prefixed with ``model.``."""

    def __init__(self, model):
        super().__init__()
        self.model = model

    def forward(self, *args, **kwargs):
        return self.model(*args, **kwargs)


class CausalSelfAttention(nn.Module):
    """nanoGPT's manual attention: the original. ``causal`` False: the mask is left out."""

    def __init__(self, d=32, n_heads=2, causal=True):
        super().__init__()
        self.qkv, self.proj, self.n_heads, self.causal = nn.Linear(d, 3 * d), nn.Linear(d, d), n_heads, causal

    def heads(self, x):
        B, T, C = x.shape
        q, k, v = self.qkv(x).split(C, dim=2)
        return [t.view(B, T, self.n_heads, C // self.n_heads).transpose(1, 2) for t in (q, k, v)]  # (B, H, T, D)

    def forward(self, x):
        B, T, C = x.shape
        q, k, v = self.heads(x)
        att = (q @ k.transpose(-2, -1)) * k.shape[-1] ** -0.5
        if self.causal:
            att = att.masked_fill(torch.ones(T, T, dtype=torch.bool).triu(1), float("-inf"))
        y = att.softmax(dim=-1) @ v
        return self.proj(y.transpose(1, 2).reshape(B, T, C))


class SDPAttention(CausalSelfAttention):
    """The same module through F.scaled_dot_product_attention; ``causal`` is its is_causal."""

    def forward(self, x):
        B, T, C = x.shape
        q, k, v = self.heads(x)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=self.causal)
        return self.proj(y.transpose(1, 2).reshape(B, T, C))


def rewrite(cls, original, **kwargs):
    """An instance of ``cls`` holding ``original``'s weights (a rewrite of the same component)."""
    new = cls(**kwargs).to(next(original.parameters()).dtype)
    new.load_state_dict(original.state_dict())
    return new


class ManualRMSNorm(nn.Module):
    """RMSNorm in float32 whatever the input's dtype, weight included, rounded once at the end."""

    def __init__(self, d, eps=1e-6, out_dtype=None):
        super().__init__()
        self.weight, self.eps, self.out_dtype = nn.Parameter(torch.ones(d)), eps, out_dtype

    def forward(self, x):
        x32 = x.float()
        y = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight.float()
        return y.to(self.out_dtype or x.dtype)


# ---- passing comparisons ---------------------------------------------------------------------------------


def test_a_linear_against_itself_in_bfloat16_passes():
    linear = nn.Linear(64, 32).bfloat16()
    x = torch.randn(8, 64).bfloat16()
    report = ComponentValidator().validate_model(copy.deepcopy(linear), linear, x)
    assert report.passed, str(report)
    assert {"output", "output dtype/shape/device", "grad input 0", "grad weight", "grad bias"} <= set(by_name(report))
    out = by_name(report)["output"]
    # the original's own bfloat16 error against float64 is what the allowance is built from
    assert out.reference_dtype == "float64" and 0 < out.baseline_error < out.tolerance


def test_an_equally_good_rounding_passes():
    """float32 accumulation rounded once to bfloat16 differs from PyTorch's bfloat16 linear, but is no worse."""

    class Float32Linear(nn.Linear):
        def forward(self, x):
            return F.linear(x.float(), self.weight.float(), self.bias.float()).to(x.dtype)

    linear = nn.Linear(64, 32).bfloat16()
    report = ComponentValidator().validate_mlp_component(
        rewrite(Float32Linear, linear, in_features=64, out_features=32), linear, torch.randn(8, 64).bfloat16()
    )
    assert report.passed, str(report)


@pytest.mark.parametrize(
    "bug, failing, passing",
    [
        (WrongScale, "output", None),
        (MissingBias, "grad bias", "grad weight"),  # the bias exists but gets no gradient
        (NaNOutput, "output", None),
        (SignFlipBackward, "grad input 0", "output"),  # right forward, wrong backward
        (BatchMeanBackward, "grad weight", "output"),  # invisible to an all-ones upstream gradient: it is random
    ],
)
def test_a_bug_fails_on_the_right_check(bug, failing, passing):
    original = Affine()
    x = torch.randn(6, 24)
    report = ComponentValidator().validate_model(rewrite(bug, original), original, x)
    results = by_name(report)
    assert not report.passed
    assert not results[failing].passed, str(report)
    if passing is not None:
        assert results[passing].passed, str(report)


def test_nan_is_named_in_the_description():
    original = Affine()
    report = ComponentValidator(atol=1e9).validate_model(rewrite(NaNOutput, original), original, torch.randn(6, 24))
    assert "1 NaN/inf where the reference is finite" in by_name(report)["output"].description


def test_loss_fn_is_compared_and_differentiated():
    original = Affine()
    x = torch.randn(6, 24)
    loss_fn = lambda y: y.pow(2).mean()
    good = ComponentValidator().validate_model(copy.deepcopy(original), original, x, loss_fn=loss_fn)
    assert good.passed and "loss" in by_name(good), str(good)
    bad = ComponentValidator().validate_model(rewrite(WrongScale, original), original, x, loss_fn=loss_fn)
    assert not by_name(bad)["loss"].passed and not by_name(bad)["grad weight"].passed
    with pytest.raises(TypeError, match="loss_fn must return a floating scalar"):
        ComponentValidator().validate_model(original, original, x, loss_fn=lambda y: y)


# ---- outputs of any structure ----------------------------------------------------------------------------


class Several(Affine):
    """A dict of a tensor, a tuple and integer indices: what models return."""

    def forward(self, x):
        y = super().forward(x)
        return {"y": y, "pair": (y.relu(), y.sum()), "top": y.argmax(-1)}


class WrongIndex(Several):
    def forward(self, x):
        out = super().forward(x)
        return {**out, "top": out["y"].argmin(-1)}  # floats right, indices wrong


def test_nested_outputs_are_named_and_indices_compared_exactly():
    original = Several()
    x = torch.randn(6, 24)
    report = ComponentValidator().validate_model(copy.deepcopy(original), original, x)
    assert report.passed, str(report)
    assert {"output.y", "output.pair[0]", "output.pair[1]", "output.top"} <= set(by_name(report))
    wrong = by_name(ComponentValidator().validate_model(rewrite(WrongIndex, original), original, x))
    assert not wrong["output.top"].passed and "elements differ" in wrong["output.top"].description
    assert wrong["output.y"].passed


class TwoOutputs(Affine):
    def forward(self, x):
        y = super().forward(x)
        return y, y


class Shorter(Affine):
    def forward(self, x):
        return super().forward(x)[:, :-1]


class Float64Out(Affine):
    def forward(self, x):
        return super().forward(x).double()


@pytest.mark.parametrize(
    "cls, failing, words",
    [
        (TwoOutputs, "output structure", "optimized returns output[0], output[1]; the original returns output"),
        (Shorter, "output dtype/shape/device", "shape (6, 15) where the original's is (6, 16)"),
        (Float64Out, "output dtype/shape/device", "optimized returns float64 where the original returns float32"),
    ],
)
def test_a_different_structure_is_a_failed_result_not_an_exception(cls, failing, words):
    original = Affine()
    report = ComponentValidator().validate_model(rewrite(cls, original), original, torch.randn(6, 24))
    assert not by_name(report)[failing].passed
    assert words in by_name(report)[failing].description


def test_an_optimized_module_that_raises_is_a_failed_result():
    class Raises(Affine):
        def forward(self, x):
            raise RuntimeError("kernel launch failed")

    original = Affine()
    optimized = rewrite(Raises, original)
    report = ComponentValidator().validate_model(optimized, original, torch.randn(6, 24))
    assert not report.passed
    assert "optimized module raised RuntimeError: kernel launch failed" in report.failures[0].description
    assert original.training and optimized.training  # given back in train mode, the exception notwithstanding


# ---- parameters matched by name -------------------------------------------------------------------------


def test_a_wrapped_model_matches_parameters_by_suffix():
    original = nn.Sequential(nn.Linear(24, 16), nn.GELU(), nn.Linear(16, 8))
    report = ComponentValidator().validate_model(Wrapper(copy.deepcopy(original)), original, torch.randn(6, 24))
    results = by_name(report)
    assert report.passed, str(report)
    assert "optimized: model.0.weight" in results["grad 0.weight"].description
    assert {"grad 0.weight", "grad 0.bias", "grad 2.weight", "grad 2.bias"} <= set(results)
    assert "unmatched parameters" not in results


def test_unmatched_parameters_are_listed_and_none_compared_fails():
    class Extra(Affine):
        def __init__(self):
            super().__init__()
            self.gate = nn.Parameter(torch.ones(16))  # used, but the original has no counterpart

        def forward(self, x):
            return super().forward(x) * self.gate

    class Renamed(nn.Module):
        def __init__(self, original):
            super().__init__()
            self.w_fused = nn.Parameter(torch.cat([original.weight, original.bias[:, None]], 1).detach().clone())

        def forward(self, x):
            return x @ self.w_fused[:, :-1].T + self.w_fused[:, -1]

    original = Affine()
    x = torch.randn(6, 24)
    extra = Extra()
    extra.load_state_dict(original.state_dict(), strict=False)  # everything but the gate
    results = by_name(ComponentValidator().validate_model(extra, original, x))
    assert results["unmatched parameters"].passed
    assert "no counterpart in the original: gate" in results["unmatched parameters"].description
    assert results["grad weight"].passed
    renamed = by_name(ComponentValidator().validate_model(Renamed(original), original, x))
    assert renamed["output"].passed  # the fused module is right, but no gradient could be compared
    assert not renamed["parameter gradients"].passed


def test_a_frozen_parameter_in_the_rewrite_is_a_missing_gradient():
    original = Affine()
    optimized = copy.deepcopy(original)
    optimized.bias.requires_grad_(False)
    results = by_name(ComponentValidator().validate_model(optimized, original, torch.randn(6, 24)))
    assert not results["grad bias"].passed and "none in the optimized module" in results["grad bias"].description


# ---- attention and its causal mask -----------------------------------------------------------------------


@pytest.mark.parametrize(
    "original_causal, optimized_causal, causal, failing",
    [
        (True, True, True, None),
        (True, False, True, "causal mask"),  # the mask forgotten: later tokens leak into earlier outputs
        (False, False, False, None),
        (False, True, False, "causal mask"),  # a mask where there should be none
    ],
)
def test_attention_against_sdpa_in_bfloat16(original_causal, optimized_causal, causal, failing):
    original = CausalSelfAttention(causal=original_causal).bfloat16()
    optimized = rewrite(SDPAttention, original, causal=optimized_causal)
    x = torch.randn(2, 16, 32).bfloat16()
    report = ComponentValidator().validate_attention_component(optimized, original, x, causal=causal)
    results = by_name(report)
    if failing is None:
        assert report.passed, str(report)
        assert "causal mask" in results
    else:
        assert not results[failing].passed, str(report)
    if failing and causal:
        assert "causal mask: output at position" in results["causal mask"].description
        assert "changed when only later positions changed" in results["causal mask"].description


class Jittery(CausalSelfAttention):
    """Causal, but adds 1e-6 noise of its own on every call, like a kernel that is not bitwise reproducible."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.gen = torch.Generator().manual_seed(1)

    def forward(self, x):
        y = super().forward(x)
        return y + 1e-6 * torch.randn(y.shape, generator=self.gen)


def test_a_module_that_is_not_bitwise_reproducible_is_judged_by_its_own_noise():
    original = CausalSelfAttention()
    report = ComponentValidator().validate_attention_component(
        rewrite(Jittery, original), original, torch.randn(2, 8, 32), causal=True
    )
    assert report.passed, str(report)
    assert "within 2x its run-to-run difference" in by_name(report)["causal mask"].description


def test_causal_none_skips_the_mask_check_and_bad_seq_dim_raises():
    original = CausalSelfAttention()
    x = torch.randn(2, 8, 32)
    report = ComponentValidator().validate_attention_component(copy.deepcopy(original), original, x)
    assert report.passed and "causal mask" not in by_name(report)
    with pytest.raises(ValueError, match="seq_dim=5"):
        ComponentValidator().validate_attention_component(original, original, x, causal=True, seq_dim=5)


# ---- norms -----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_manual_rms_norm_against_torch(dtype):
    original = nn.RMSNorm(48, eps=1e-6).to(dtype)  # eps given: None would take it from the dtype, float64's in the ref
    with torch.no_grad():
        original.weight.add_(0.1 * torch.randn(48).to(dtype))  # not all ones: the weight's gradient means something
    optimized = ManualRMSNorm(48).to(dtype)
    optimized.load_state_dict(original.state_dict())
    x = (torch.randn(4, 5, 48) * 3 + 1).to(dtype)  # (B, T, D) with a mean, as activations have
    report = ComponentValidator().validate_norm_component(optimized, original, x)
    assert report.passed, str(report)
    assert by_name(report)["norm output"].passed


def test_a_norm_returning_float32_for_bfloat16_fails():
    original = nn.RMSNorm(48, eps=1e-6).bfloat16()
    optimized = ManualRMSNorm(48, out_dtype=torch.float32).bfloat16()
    report = ComponentValidator().validate_norm_component(optimized, original, torch.randn(4, 48).bfloat16())
    assert not by_name(report)["norm output"].passed
    assert by_name(report)["norm output"].description == "optimized returns float32 where the original returns bfloat16"


# ---- the reference's precision ---------------------------------------------------------------------------


def test_reference_falls_back_to_float32_when_float64_fails():
    class Float32Only(Affine):
        def forward(self, x):
            return x @ self.weight.T.float() + self.bias.float()  # float64 x meets a float32 weight: an error

    original = Float32Only()
    report = ComponentValidator().validate_model(copy.deepcopy(original), original, torch.randn(6, 24))
    assert report.passed, str(report)
    out = by_name(report)["output"]
    assert out.reference_dtype == "float32" and "reference in float32: float64 failed" in out.description


def test_reference_falls_back_to_float32_when_float64_would_not_fit(monkeypatch):
    monkeypatch.setattr(equivalence, "_free_bytes", lambda device: 1000)  # as if a GPU had 1 kB free
    original = Affine()
    report = ComponentValidator().validate_model(copy.deepcopy(original), original, torch.randn(6, 24))
    assert all(r.reference_dtype == "float32" for r in report if r.kind == "output")
    assert "reference in float32: a float64 copy needs" in by_name(report)["output"].description


# ---- misuse raises, the caller's state survives -----------------------------------------------------------


def test_bad_arguments_raise_clear_errors():
    original = Affine()
    x = torch.randn(6, 24)
    v = ComponentValidator()
    with pytest.raises(TypeError, match="optimized must be a torch.nn.Module, got function"):
        v.validate_model(lambda x: x, original, x)
    with pytest.raises(TypeError, match="inputs must be a tensor"):
        v.validate_model(original, original, 3)
    with pytest.raises(ValueError, match="inputs are on meta, the model's parameters on cpu"):
        v.validate_model(original, original, torch.randn(6, 24, device="meta"))  # a device without a GPU
    with pytest.raises(ValueError, match="the original module fails on these inputs: RuntimeError"):
        v.validate_model(original, original, torch.randn(6, 25))  # one feature too many


def test_inputs_as_a_dict_and_integer_inputs_pass_through():
    class Embed(nn.Module):
        def __init__(self):
            super().__init__()
            self.emb, self.head = nn.Embedding(50, 16), nn.Linear(16, 50)

        def forward(self, ids, scale):
            return self.head(self.emb(ids) * scale)

    original = Embed()
    inputs = {"ids": torch.randint(0, 50, (2, 7)), "scale": torch.rand(2, 7, 1) + 0.5}
    report = ComponentValidator().validate_model(copy.deepcopy(original), original, inputs)
    assert report.passed, str(report)
    assert "grad input scale" in by_name(report) and "grad input ids" not in by_name(report)


class OwnDropout(nn.Dropout):
    """Dropout drawing its mask another way: in train mode it differs from nn.Dropout, in eval both are x."""

    def forward(self, x):
        return x * (torch.rand_like(x) > self.p) / (1 - self.p) if self.training else x


def test_the_callers_modules_and_rng_are_left_as_they_were():
    original = nn.Sequential(nn.Linear(24, 16), nn.Dropout(0.5), nn.Linear(16, 8))
    original[2].eval()  # mixed modes: each submodule's must come back
    original[0].bias.requires_grad_(False)
    optimized = copy.deepcopy(original)
    optimized[1] = OwnDropout(0.5)
    x = torch.randn(6, 24)
    rng = torch.get_rng_state()
    # the two dropouts would differ in train mode: passing shows the runs were in eval()
    report = ComponentValidator().validate_model(optimized, original, x)
    assert report.passed, str(report)
    for module in (original, optimized):
        assert [m.training for m in module] == [True, True, False] and module.training
        assert not module[0].bias.requires_grad and module[0].weight.requires_grad
        assert all(p.grad is None for p in module.parameters())
    assert not x.requires_grad and x.grad is None
    assert torch.equal(torch.get_rng_state(), rng)


def test_a_module_writing_into_its_input_gets_its_own_copy():
    original = WritesIntoItsInput()
    x = torch.randn(6, 24)
    before = x.clone()
    report = ComponentValidator().validate_model(copy.deepcopy(original), original, x)
    assert report.passed, str(report)  # each run doubled its own copy, so the three saw the same values
    assert torch.equal(x, before)


# ---- the report --------------------------------------------------------------------------------------------


def test_report_renders_and_summarizes():
    original = Affine()
    report = ComponentValidator().validate_model(rewrite(SignFlipBackward, original), original, torch.randn(6, 24))
    n = len(report)
    assert report.summary().startswith(f"{n - 1} of {n} checks passed; failed: grad input 0 (worst: grad input 0 ")
    frame = report.to_dataframe()
    assert len(frame) == n and {"name", "passed", "max_abs_error", "tolerance", "ratio"} <= set(frame.columns)
    page = report._repr_html_()
    assert page.startswith("<table") and page.count('style="background:#fdd"') == 1  # the one failure
    assert "FAIL grad input 0" in str(report)
    assert [r.name for r in report.failures] == ["grad input 0"]


def test_an_empty_report_does_not_pass():
    empty = ValidationReport()
    assert not empty.passed and "does not pass" in empty.summary()
    assert len(empty.to_dataframe().columns) == len(ValidationResult.__dataclass_fields__)


def test_compiled_model_parameters_match_by_name():
    # torch.compile wraps the module as _orig_mod: its gradients must still be compared with the original's
    lin = torch.nn.Linear(8, 8)
    report = ComponentValidator().validate_model(torch.compile(lin, backend="eager"), lin, torch.randn(4, 8))
    assert report.passed
    assert {r.name for r in report} >= {"grad weight", "grad bias"}
    assert not any(r.name == "unmatched parameters" for r in report)


_SHARED_OUT = {}  # one output buffer for every module below: the memory a CUDA-graph tree shares between runs


class SharedOut(Affine):
    """Returns its output in a buffer shared with other modules, as a model compiled with CUDA graphs does: the
    next run of any of them overwrites what this one returned."""

    scale = 1.0

    def forward(self, x):
        y = (x @ self.weight.T + self.bias) * self.scale
        buf = _SHARED_OUT.setdefault(y.dtype, torch.empty_like(y)).detach()  # same memory, no earlier history
        return buf.copy_(y)


class SharedOutWrong(SharedOut):
    scale = 1.001


def test_outputs_in_shared_memory_are_copied_before_the_next_run():
    # Without a copy, the original's outputs would be the optimized run's by the time they are compared: both
    # errors would be the wrong model's, and the 0.1% error would pass as "2x the original's".
    torch.manual_seed(0)
    base = SharedOut()
    wrong = SharedOutWrong()
    wrong.load_state_dict(base.state_dict())
    report = ComponentValidator().validate_model(wrong, base, (torch.randn(8, 24),))
    assert not by_name(report)["output"].passed
    fine = SharedOut()
    fine.load_state_dict(base.state_dict())
    assert ComponentValidator().validate_model(fine, base, (torch.randn(8, 24),)).passed


def test_the_former_module_name_still_imports():
    # kernel_lib.validation was this module's name: code written against it gets the same objects
    from kernel_lib import validation

    assert validation.ComponentValidator is ComponentValidator
    assert validation.ValidationReport is ValidationReport and validation.ValidationResult is ValidationResult


def test_a_hugging_face_cache_is_left_out_and_said_so():
    # A causal LM called without labels returns its key/value cache beside the logits (transformers 5 names it
    # "cache", 4 "past_key_values"): state for the next call, not a result. It must not fail the comparison; the
    # report says it was left out, and why.
    pytest.importorskip("transformers")
    from kernel_lib.models.zoo import hf_llama

    torch.manual_seed(0)
    model = hf_llama(tiny=True).eval()
    inputs = {"input_ids": torch.randint(0, 4096, (2, 16))}
    assert any(type(v).__name__.endswith("Cache") for v in model(**inputs).values())  # the case this test is about
    report = ComponentValidator().validate_model(copy.deepcopy(model), model, inputs)
    assert report.passed, report.summary()
    left_out = [r for r in report if r.kind == "info" and "key/value cache" in r.description]
    assert len(left_out) == 1 and left_out[0].name in ("output.cache", "output.past_key_values")
    assert any(r.name == "output.logits" and r.kind == "output" and r.passed for r in report)
