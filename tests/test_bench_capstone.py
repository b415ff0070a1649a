"""benchmarks/bench_capstone.py: the batch-size search against a known limit, the kernel families of the profile
breakdown, and the whole script at --tiny sizes (on the CPU: Triton interpreted, compile skipped), a smoke test of
every phase: the rows are written, the loss curves agree, the decoders repeat their references' tokens.

The script is loaded from its file (benchmarks/ is not a package). Its --tiny run takes about 40 s on a loaded
2-core machine."""

import csv
import importlib.util
from pathlib import Path

import pytest

from kernel_lib.models.capstone import KERNEL_FAMILIES, kernel_family

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "bench_capstone.py"


@pytest.fixture(scope="module")
def script():
    spec = importlib.util.spec_from_file_location("bench_capstone", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


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
        ("_rope_kernel", "other"),
        ("Memcpy DtoD (Device -> Device)", "other"),
    ],
)
def test_kernel_family(name, family):
    assert kernel_family(name) == family


def test_tiny_run_writes_every_phase(script, tmp_path):
    assert script.main(["--tiny", "--out", str(tmp_path), "--cache-dir", str(tmp_path / "cache")]) == 0
    with open(tmp_path / "capstone.csv") as handle:
        rows = list(csv.DictReader(handle))
    phase = {name: [r for r in rows if r["phase"] == name] for name in ("train", "loss", "batch", "decode", "prefill")}
    versions = list(script.VERSIONS)

    assert [r["version"] for r in phase["train"]] == versions
    for row in phase["train"]:
        assert float(row["step_ms"]) > 0 and float(row["tokens_per_s"]) > 0, row
        families = [float(row[f"ms_{name}"]) for name, _ in KERNEL_FAMILIES]
        assert sum(families) > 0, row  # the profile saw the step

    assert [r["version"] for r in phase["loss"]] == versions
    assert all(r["within_tolerance"] == "True" for r in phase["loss"]), phase["loss"]
    with open(tmp_path / "loss_curves.csv") as handle:
        curves = list(csv.DictReader(handle))
    assert len(curves) == len(versions) * script.TINY["steps"]

    cap = str(script.TINY["max_batch"])
    assert [(r["version"], r["max_batch"]) for r in phase["batch"]] == [(v, cap) for v in versions]

    decoders = {(r["decoder"], r["batch"]) for r in phase["decode"]}
    assert len(decoders) == 6 * len(script.TINY["decode_batches"].split(","))
    for row in phase["decode"]:  # float32 on the CPU: every decoder repeats its reference exactly
        assert row["identical_prefix"] == row["identical_goal"] == str(script.TINY["new_tokens"]), row
        assert float(row["tokens_per_s"]) > 0 and float(row["limit_tokens_per_s"]) > 0, row
    assert {r["decoder"] for r in phase["prefill"]} == {"ours: kernel_lib", "ours: native", "HF"}
