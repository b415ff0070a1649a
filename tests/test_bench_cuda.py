"""benchmarks/bench_cuda.py on the CPU: the --tiny smoke run end to end, and the pieces its GPU run relies on.

The GPU measurements themselves (CUDA kernels, CUDA graphs, Nsight Compute) cannot run here; --tiny runs every part
with the C++ CPU operator, Triton interpreted and torch.compile's eager backend, and this checks that each part
checked, timed and recorded what it should.
"""

import csv
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import triton

from tests._checks import load_script

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "benchmarks" / "bench_cuda.py"


@pytest.fixture(scope="module")
def script():
    return load_script("bench_cuda")


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("bench_cuda")
    done = subprocess.run([sys.executable, str(SCRIPT), "--tiny", "--ncu", "--out", str(out)], capture_output=True,
                          text=True, timeout=300, cwd=ROOT)  # fmt: skip
    old_interpreter = tuple(int(part) for part in triton.__version__.split(".")[:2]) < (3, 7)
    if old_interpreter and done.returncode != 0 and "only 0-dimensional arrays" in done.stdout + done.stderr:
        # Triton 3.6's interpreter calls int() on a 1-element array to index a loop over a runtime bound, which NumPy
        # 2.4 refuses; 3.7 squeezes it first. Seen on the GPU machine (triton 3.6), where --tiny interprets too.
        pytest.skip(f"Triton {triton.__version__}'s interpreter cannot loop over a runtime bound with this NumPy")
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    with open(out / "cuda_ladder.csv", newline="") as handle:
        return list(csv.DictReader(handle)), done.stdout


def test_tiny_run_builds_then_loads_from_the_cache(tiny_run):
    rows, _ = tiny_run
    build = {r["impl"]: r for r in rows if r["part"] == "build"}
    first, again = build["first build (empty cache, new process)"], build["cached load (second process)"]
    assert first["cached"] == "False" and again["cached"] == "True"  # the second process compiled nothing
    assert first["path"] == again["path"] == build["this process"]["path"]
    assert float(first["seconds"]) > 0 and float(again["seconds"]) >= 0


def test_tiny_run_checks_and_times_every_implementation(tiny_run, script):
    rows, _ = tiny_run
    sweep = [r for r in rows if r["part"] == "sweep"]
    widths = [int(w) for w in script.TINY["widths"].split(",")]
    for op, pass_name in script.PASSES:
        for D in widths:
            got = {r["impl"]: r for r in sweep if (r["op"], r["pass"], int(r["D"])) == (op, pass_name, D)}
            assert list(got) == [*script.VARIANTS[op], *script.PEERS], (op, pass_name, D)
            for impl, r in got.items():
                assert (r["check_before"], r["check_after"], r["error"]) == ("ok", "ok", ""), (op, pass_name, D, impl)
                assert float(r["median_ms"]) > 0 and float(r["gbps"]) > 0 and float(r["pct_of_copy"]) > 0
                rows_ = int(r["rows"])
                assert int(r["bytes"]) == script.elements_moved(op, pass_name, rows_, D) * 4  # float32 in --tiny
            assert float(got["triton"]["vs_triton"]) == pytest.approx(1.0)
            assert float(got["torch.compile"]["vs_compile"]) == pytest.approx(1.0)


def test_tiny_run_records_the_gpu_only_parts_as_skipped(tiny_run):
    rows, stdout = tiny_run
    graph = [r for r in rows if r["part"] == "graph"]
    assert {r["mode"] for r in graph} == {"as called", "cuda graph"}
    assert all(r["check_after"] == "ok" for r in graph if r["mode"] == "as called")
    assert all(r["error"] == "CUDA graph: needs a GPU" for r in graph if r["mode"] == "cuda graph")
    ncu = [r for r in rows if r["part"] == "ncu"]
    assert sorted(r["role"] for r in ncu) == ["best", "worst"] and all("GPU" in r["error"] for r in ncu)
    assert "ncu: skipped" in stdout
    assert "rms_norm forward: % of the copy ceiling" in stdout and "softmax forward: % of the copy ceiling" in stdout


def test_bytes_counted(script):
    R, D = 3, 5
    assert script.elements_moved("rms_norm", "forward", R, D) == 2 * R * D + D  # x, y, weight
    assert script.elements_moved("softmax", "forward", R, D) == 2 * R * D  # x, y
    assert script.elements_moved("rms_norm", "forward+backward", R, D) == 5 * R * D + 3 * D  # + dy, x, dx; w, dw


def test_a_wrong_result_is_not_timed(script):
    x = torch.randn(4, 8)
    inputs = [x, torch.ones(8)]
    want, lowp = script.truth("rms_norm", "forward", inputs)
    timing = {"warmup_ms": 0, "rep_ms": 1, "device": "cpu"}
    row = script.check_then_time(lambda x, w: x, inputs, want, lowp, "rms_norm", "identity", timing)
    assert row["check_before"].startswith("FAIL") and "median_ms" not in row
    assert script.problem(row).startswith("before timing: FAIL")


def test_ratios_to_the_peers(script):
    rows = [{"part": "sweep", "op": "softmax", "pass": "forward", "D": 8, "impl": impl, "median_ms": ms}
            for impl, ms in [("best", 1.0), ("triton", 1.5), ("torch.compile", 3.0)]]  # fmt: skip
    script.add_ratios(rows)
    assert (rows[0]["vs_triton"], rows[0]["vs_compile"]) == (1.5, 3.0)


def test_ncu_kernel_name_from_a_report(script):
    report = "\n".join([
        "==PROF== Connected to process 1",
        '"ID","Process ID","Process Name","Host Name","Kernel Name","dram__throughput.avg.pct_of_peak_sustained_'
        'elapsed"',
        '"","","","","","%"',
        '"0","1","python","h","rms_norm_fwd_registers_kernel","91.5"',
    ])  # fmt: skip
    assert script._ncu_kernel_name(report) == "rms_norm_fwd_registers_kernel"
    assert script._ncu_kernel_name("no report") == ""


def test_single_launch_mode_runs_on_the_cpu(script, capsys):
    assert script.main(["--tiny", "--single", "softmax:online:64"]) == 0
    assert "single: softmax online D=64" in capsys.readouterr().out
    with pytest.raises(SystemExit, match="unknown op or variant"):
        script.main(["--tiny", "--single", "rms_norm:online:64"])  # RMSNorm has no online step of its own
