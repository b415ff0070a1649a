"""benchmarks/bench_capstone.py: the batch-size search against a known limit, the kernel families of the profile
breakdown, and the whole script at --tiny sizes (on the CPU: Triton interpreted, compile skipped), a smoke test of
every phase: the rows are written, the loss curves agree, the decoders repeat their references' tokens.

The script is loaded from its file (benchmarks/ is not a package). Its --tiny run takes about 40 s on a loaded
2-core machine."""

import csv

import pytest
import torch

from kernel_lib.bench.capstone import (
    KERNEL_FAMILIES,
    REFERENCE,
    SIZES,
    StepProfile,
    compare_curves,
    elementwise_floor_bytes,
    fusion_floor_ms,
    kernel_family,
    reround,
    rerun_name,
)
from kernel_lib.models import GPTConfig
from tests._checks import load_script


@pytest.fixture(scope="module")
def script():
    return load_script("bench_capstone")


@pytest.mark.parametrize(
    "limit, cap, expected",
    [
        (37, 256, 37),  # bisected between 32 and 64
        (63, 100, 63),  # a cap that is not a power of two, limit just under a power of two
        (100, 100, 100),  # the cap itself fits: tried after 64
        (300, 256, 256),  # everything fits: the cap
        (1, 256, 1),
        (0, 256, 0),  # not even one sequence
    ],
)
def test_largest_batch_finds_the_limit(script, limit, cap, expected):
    tried = []
    assert script.largest_batch(lambda b: b <= limit, cap, tried) == expected
    sizes = [b for b, _ in tried]
    assert len(sizes) == len(set(sizes)), f"a size was tried twice: {tried}"
    assert all(1 <= b <= cap for b in sizes)
    assert all(ok == (b <= limit) for b, ok in tried)
    assert len(tried) <= 2 * cap.bit_length() + 1  # doubling, then bisection: logarithmic


@pytest.mark.parametrize(
    "name, family",
    [
        ("nvjet_tst_128x256_64x4_2x1_v_bz_coopA_TNT", "matmul"),  # cuBLAS on Hopper
        ("sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x128x64", "matmul"),
        ("aten::mm", "matmul"),  # the CPU's operators
        ("void pytorch_flash::flash_fwd_kernel<Flash_fwd_kernel_traits<64, 128>, true>", "attention"),
        ("fmha_cutlassF_bf16_aligned_64x64_rf_sm80", "attention"),  # cutlass, but attention first
        ("_attn_bwd_dkdv_kernel", "attention"),  # kernel_lib
        ("cunn_SoftMaxForward<4, float, float, float, SoftMaxForwardEpilogue>", "attention"),
        ("cunn_SoftMaxForward<4, float, float, float, LogSoftMaxForwardEpilogue>", "loss"),  # loss before softmax
        ("triton_red_fused__log_softmax_nll_loss_forward_0", "loss"),  # Inductor
        ("_ce_fwd_kernel", "loss"),
        ("triton_per_fused__to_copy_add_mean_mul_pow_rsqrt_1", "norm"),
        ("_norm_bwd_kernel", "norm"),
        ("triton_poi_fused_mul_silu_2", "activation"),
        ("_gated_fwd_kernel", "activation"),
        ("multi_tensor_apply_kernel<TensorListMetadata<4>, FusedAdamMathFunctor<float, 4>>", "optimizer"),
        ("cudnn_generated_fort_native_sdpa_sm90_flash_bprop_wgmma_f16_knob_26_64x64x64", "attention"),
        ("_rope_kernel", "other"),
        ("Memcpy DtoD (Device -> Device)", "other"),
    ],
)
def test_kernel_family(name, family):
    assert kernel_family(name) == family


def test_elementwise_floor_bytes_of_the_350m_model():
    # 8,192 tokens, d 1,024, d_ff 2,816, 24 layers, bf16: 49 norms x (5 x 8,192 x 1,024 + 3 x 1,024) elements and
    # 24 SwiGLUs x 8 x 8,192 x 2,816 elements, 2 bytes each
    config = GPTConfig(**SIZES["350m"], max_seq_len=1024)
    floors = elementwise_floor_bytes(config, 8, 1024, 2)
    assert floors == {"norm": 4_110_718_976, "activation": 8_858_370_048}


def test_elementwise_floor_bytes_scales_with_tokens_and_routes_experts():
    dense = GPTConfig(**SIZES["tiny"], max_seq_len=64)
    one, two = elementwise_floor_bytes(dense, 1, 64, 4), elementwise_floor_bytes(dense, 2, 64, 4)
    assert two["activation"] == 2 * one["activation"]  # every term is per token
    weight_terms = (2 * dense.n_layers + 1) * 3 * dense.d_model * 4  # the norms' weights: once per step
    assert two["norm"] - weight_terms == 2 * (one["norm"] - weight_terms)
    moe = GPTConfig(**SIZES["tiny"], max_seq_len=64, n_experts=4, top_k=2)
    assert elementwise_floor_bytes(moe, 1, 64, 4)["activation"] == 2 * one["activation"]  # each token to 2 experts
    assert elementwise_floor_bytes(moe, 1, 64, 4)["norm"] == one["norm"]


def test_fusion_floor_ms_takes_the_fastest_measured_and_the_floors():
    def profile(**families):
        return StepProfile(families, busy_ms=sum(families.values()), wall_ms=0.0, kernels_per_step=1, clock="gpu")

    profiles = {
        "a": profile(matmul=20.0, optimizer=5.0, attention=6.0, norm=2.0, activation=3.0, other=4.0),
        "b": profile(matmul=21.0, optimizer=4.5, attention=7.0, norm=1.5, activation=3.2, other=6.0),
    }
    # matmul 20 (a), optimizer 4.5 (b), attention 6 (a), then the floors; norm's and other's measured times unused
    assert fusion_floor_ms(profiles, {"norm": 1.0, "activation": 2.5}) == pytest.approx(20 + 4.5 + 6 + 1 + 2.5)
    with pytest.raises(ValueError, match="attention"):
        fusion_floor_ms(profiles, {"attention": 1.0})  # a measured family cannot also have a floor
    with pytest.raises(ValueError, match="at least one"):
        fusion_floor_ms({}, {})


def test_tiny_run_writes_every_phase(script, tmp_path):
    assert script.main(["--tiny", "--out", str(tmp_path), "--cache-dir", str(tmp_path / "cache")]) == 0
    with open(tmp_path / "capstone.csv") as handle:
        rows = list(csv.DictReader(handle))
    names = ("train", "loss", "batch", "decode", "prefill", "quality")
    phase = {name: [r for r in rows if r["phase"] == name] for name in names}
    versions = list(script.VERSIONS)

    assert [r["version"] for r in phase["train"]] == versions
    for row in phase["train"]:
        assert float(row["step_ms"]) > 0 and float(row["tokens_per_s"]) > 0, row
        families = [float(row[f"ms_{name}"]) for name, _ in KERNEL_FAMILIES]
        assert sum(families) > 0, row  # the profile saw the step
        # the fusion floor and the bound it gives are written to every training row
        assert 0 < float(row["fusion_floor_ms"]) and float(row["fusion_bound_vs_native_compiled"]) > 0, row

    reruns = [rerun_name(i) for i in range(1, script.TINY["reruns"] + 1)]
    assert [r["version"] for r in phase["loss"]] == [REFERENCE, *versions, *reruns]
    assert phase["loss"][0]["within_tolerance"] == ""  # the float32 reference is not judged on its late steps
    assert all(r["within_tolerance"] == "True" for r in phase["loss"][1:]), phase["loss"]
    with open(tmp_path / "loss_curves.csv") as handle:
        curves = list(csv.DictReader(handle))
    assert len(curves) == (1 + len(versions) + len(reruns)) * script.TINY["steps"]

    cap = str(script.TINY["max_batch"])
    assert [(r["version"], r["max_batch"]) for r in phase["batch"]] == [(v, cap) for v in versions]

    decoders = {(r["decoder"], r["batch"]) for r in phase["decode"]}
    assert len(decoders) == 8 * len(script.TINY["decode_batches"].split(","))  # six, and int8 and int4 weights
    for row in phase["decode"]:  # float32 on the CPU: every unquantized decoder repeats its reference exactly
        if " int" in row["decoder"]:  # quantized weights change the logits: agreement is measured, not required
            assert 0 <= int(row["identical_prefix"]) <= int(row["identical_goal"]), row
        else:
            assert row["identical_prefix"] == row["identical_goal"] == str(script.TINY["new_tokens"]), row
        assert float(row["tokens_per_s"]) > 0 and float(row["limit_tokens_per_s"]) > 0, row
    assert {r["decoder"] for r in phase["prefill"]} == {"ours: kernel_lib", "ours: native", "HF"}

    # the quality phase: a trained checkpoint written, each format's held-out perplexity, tokens against the first
    assert [r["format"] for r in phase["quality"]] == ["float32", "int8", "int4"]
    assert (tmp_path / "trained_tiny.pt").exists()
    for row in phase["quality"]:
        assert 1.0 < float(row["val_perplexity"]) < 2 * 512, row  # finite, and no worse than twice chance
    assert float(phase["quality"][0]["greedy_equal_share"]) == 1.0  # the reference against itself


def test_quality_phase_reuses_a_matching_checkpoint_and_refuses_another(script, tmp_path, capsys):
    args = ["--tiny", "--phase", "quality", "--out", str(tmp_path), "--cache-dir", str(tmp_path / "cache"),
            "--decode-quantized", ""]  # fmt: skip
    assert script.main(args) == 0
    assert "trained 4 steps" in capsys.readouterr().out
    assert script.main(args) == 0  # a killed or repeated run trains nothing it finished
    assert "trained model loaded" in capsys.readouterr().out
    with pytest.raises(SystemExit, match="trained otherwise"):  # another recipe never reads this checkpoint
        script.main([*args, "--quality-steps", "5"])


@pytest.mark.parametrize(
    "version_last, ok",
    [
        (5.68, True),  # 3.3% above the ensemble's centre: within twice its own spread (1.8%)
        (5.75, False),  # 4.5% above: past twice the spread
        (5.32, True),  # 3.3% below: the rule is symmetric
    ],
)
def test_compare_curves_allows_twice_the_ensembles_own_spread(version_last, ok):
    steps = 30
    curves = {
        "ref": [10.0] + [5.0] * (steps - 1),  # float32: 10% below every bf16 run, which no bf16 version can help
        "own": [10.01] + [5.5] * (steps - 1),  # PyTorch in bf16: 0.1% off at step 0
        rerun_name(1, "own"): [10.0] + [5.6] * (steps - 1),
        rerun_name(2, "own"): [10.0] + [5.4] * (steps - 1),  # centre 5.5, farthest member 0.1 away (1.8%)
        "version": [10.0] + [version_last] * (steps - 1),
    }
    rows = {r["version"]: r for r in compare_curves(curves, "ref", yardstick="own", first_rtol=0.0, last_rtol=0.0)}
    assert rows["version"]["allowed_last"] == pytest.approx(2 * 0.1 / 5.5)
    assert rows["version"]["allowed_first"] == pytest.approx(0.002)
    assert rows["version"]["within_tolerance"] is ok
    assert all(rows[m]["within_tolerance"] for m in ("own", rerun_name(1, "own"), rerun_name(2, "own")))
    assert rows["ref"]["within_tolerance"] is None  # not judged on the late steps: its distance is bf16's own
    assert rows["own"]["last_vs_reference"] == pytest.approx(0.1)


def test_compare_curves_first_step_against_the_reference():
    curves = {"ref": [10.0, 5.0], "own": [10.01, 5.5], "version": [10.03, 5.5]}  # 0.3% off, twice own's is 0.2%
    rows = {r["version"]: r for r in compare_curves(curves, "ref", yardstick="own", first_rtol=0.0, last=1)}
    assert rows["version"]["first_rel_diff"] == pytest.approx(0.003)
    assert rows["version"]["within_tolerance"] is False


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_reround_moves_each_weight_by_about_one_rounding(dtype):
    torch.manual_seed(0)
    layer = torch.nn.Linear(64, 64, dtype=dtype)
    before = layer.weight.detach().clone()
    reround(layer, seed=1)
    after = layer.weight.detach()
    eps = torch.finfo(dtype).eps  # moved by < eps relative, then rounded: at most half a spacing (eps / 2) more
    assert ((after.float() - before.float()).abs() <= 1.5 * eps * before.float().abs() * (1 + eps)).all()
    assert 0.2 < (after != before).float().mean() < 0.9  # a different rounding of many weights, not of all
    again = layer.weight.detach().clone()
    layer.weight.data.copy_(before)
    reround(layer, seed=1)
    assert torch.equal(layer.weight, again)  # the seed decides


def test_compare_curves_leaves_a_diverged_rerun_out():
    nan = float("nan")
    curves = {"ref": [10.0, 5.0], "own": [10.0, 5.5], rerun_name(1, "own"): [10.0, nan], "v": [10.0, 5.6]}
    rows = {r["version"]: r for r in compare_curves(curves, "ref", yardstick="own", last=1)}
    assert rows[rerun_name(1, "own")]["within_tolerance"] is False  # fails itself
    assert rows["v"]["within_tolerance"] and rows["v"]["last_rel_diff"] == pytest.approx(0.1 / 5.5)  # not everyone
    with pytest.raises(ValueError, match="non-finite"):
        compare_curves({"ref": [10.0, 5.0], "own": [10.0, nan]}, "ref", yardstick="own", last=1)


def test_compare_curves_floor_and_errors():
    curves = {"ref": [2.0, 1.0], "own": [2.0, 1.0], "v": [2.0, 1.02]}
    rows = compare_curves(curves, "ref", yardstick="own", last=1)  # no re-runs, no spread: the 3% floor applies
    assert rows[-1]["allowed_last"] == 0.03 and rows[-1]["within_tolerance"]
    rows = compare_curves({"ref": [2.0, 1.0], "v": [2.0, 1.05]}, "ref", yardstick=None, last=1)  # against ref
    assert rows[-1]["last_rel_diff"] == pytest.approx(0.05) and not rows[-1]["within_tolerance"]
    with pytest.raises(ValueError, match="steps"):
        compare_curves({"ref": [1.0, 1.0], "v": [1.0]}, "ref", yardstick=None)
