"""The prior: ncu output parsing, bottleneck classification, move priors and the cross-kernel tactic graph.

No GPU and no real ncu: the CSV is a fixture in ``ncu --csv --page raw`` format, and ``ncu`` is a fake script."""

from __future__ import annotations

import json
import math
import shutil
import stat
import sys

import pytest

from kernel_lib.search import prior
from kernel_lib.search.moves import CANONICAL_MOVES
from kernel_lib.search.prior import (
    ATOM_SECTORS,
    BOTTLENECKS,
    DRAM_PCT,
    GMMA_PCT,
    HMMA_PCT,
    L2_SECTORS,
    LONG_SCOREBOARD_STALL,
    MEM_PCT,
    METRICS,
    MOVE_AFFINITY,
    RED_SECTORS,
    SM_PCT,
    SMEM_WAVEFRONTS_PCT,
    XU_PCT,
    TacticGraph,
    classify,
    move_priors,
    ncu_available,
    ncu_command,
    ncu_metrics,
    parse_ncu_csv,
    run_ncu,
)

# ncu --csv --page raw: ncu's own lines, a header, a row of units, then one row per profiled launch
_FIXED = '"ID","Process ID","Process Name","Host Name","Kernel Name","Context","Stream","Block Size","Grid Size",'
_FIXED += '"Device","CC"'
_COLUMNS = (DRAM_PCT, MEM_PCT, L2_SECTORS, RED_SECTORS, ATOM_SECTORS, SM_PCT, XU_PCT, GMMA_PCT)
_LAUNCH = '"41873","python3.12","127.0.0.1","rms_norm_fwd","1","7","(128, 1, 1)","(16384, 1, 1)","0","9.0"'
NCU_RAW_CSV = "\n".join(
    [
        "==PROF== Connected to process 41873 (/usr/bin/python3.12)",
        '==PROF== Profiling "rms_norm_fwd" - 0: 0%....50%....100% - 9 passes',
        '==PROF== Profiling "rms_norm_fwd" - 1: 0%....50%....100% - 9 passes',
        "==PROF== Disconnected from process 41873",
        _FIXED + "," + ",".join(f'"{m}"' for m in _COLUMNS),
        '"","","","","","","","","","","",' + '"%","%","sector","sector","sector","%","%","%"',
        f'"0",{_LAUNCH},' + '"84.12","86.30","8,404,992","0","0","29.87","3.10","n/a"',
        f'"1",{_LAUNCH},' + '"85.47","87.02","8,405,120","0","0","30.55","3.12","n/a"',
    ]
)
NCU_RAW_CSV += "\n"


# --------------------------------------------------------------------------------------------------
# ncu output
# --------------------------------------------------------------------------------------------------
def test_parse_ncu_csv_takes_the_last_launch():
    metrics = parse_ncu_csv(NCU_RAW_CSV)
    assert metrics[DRAM_PCT] == 85.47
    assert metrics[L2_SECTORS] == 8_405_120  # thousands separators removed
    assert metrics[RED_SECTORS] == 0
    assert GMMA_PCT not in metrics  # "n/a" is no number
    assert "Kernel Name" not in metrics and "Block Size" not in metrics  # only metric columns
    assert classify(metrics) == "gmem"


def test_parse_ncu_csv_filters_by_kernel():
    other = NCU_RAW_CSV.rstrip("\n").rsplit("\n", 1)[1].replace('"1","41873"', '"2","41873"')
    other = other.replace("rms_norm_fwd", "void at::native::normal_kernel<float>(...)").replace("85.47", "12.00")
    text = NCU_RAW_CSV + other + "\n"
    assert parse_ncu_csv(text)[DRAM_PCT] == 12.0  # the last row, whatever its kernel
    assert parse_ncu_csv(text, kernel="rms_norm_fwd")[DRAM_PCT] == 85.47
    assert parse_ncu_csv(text, kernel="softmax_fwd") == {}


@pytest.mark.parametrize(
    "text",
    [
        "",
        "==PROF== Connected to process 1\n==ERROR== ERR_NVGPUCTRPERM - no permission\n",
        f'{_FIXED},"{DRAM_PCT}"\n' + '"","","","","","","","","","","","%"\n',
    ],
    ids=["empty-output", "error-lines-only", "header-and-units-but-no-launch"],
)
def test_parse_ncu_csv_without_a_launch_is_empty(text):
    assert parse_ncu_csv(text) == {}


def test_ncu_command_profiles_one_launch_of_the_entry():
    cmd = ncu_command("/venv/bin/python", "out/v/control.json", "out/v/ncu.csv", "rms_norm_fwd")
    assert cmd[0] == "ncu"
    assert cmd[cmd.index("--metrics") + 1].split(",") == list(METRICS)
    assert cmd[cmd.index("--kernel-name") + 1] == "regex:^rms_norm_fwd$"
    assert cmd[cmd.index("--launch-count") + 1] == "1"
    assert cmd[cmd.index("--log-file") + 1] == "out/v/ncu.csv"
    assert cmd[-5:] == [
        "/venv/bin/python",
        "-m",
        "kernel_lib.search.worker",
        "out/v/control.json",
        "--profile-only",
    ]
    assert {"--csv", "raw"} <= set(cmd)


def test_ncu_metrics_drop_gmma_before_hopper():
    assert GMMA_PCT in ncu_metrics((9, 0)) and GMMA_PCT in ncu_metrics()
    assert GMMA_PCT not in ncu_metrics((8, 0)) and HMMA_PCT in ncu_metrics((8, 0))


def test_ncu_available_without_ncu(monkeypatch):
    monkeypatch.setattr(shutil, "which", lambda name, *a, **k: None)
    ok, message = ncu_available()
    assert not ok
    assert "ncu" in message and "\n" not in message


def _fake_ncu(tmp_path, monkeypatch, body: str) -> None:
    """An executable ``ncu`` (a Python script) first on PATH."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    script = bin_dir / "ncu"
    script.write_text(f"#!{sys.executable}\nimport sys, time\n{body}\n")
    script.chmod(script.stat().st_mode | stat.S_IXUSR)
    monkeypatch.setenv("PATH", f"{bin_dir}:/usr/bin:/bin")


PERMISSION_ERROR = (
    "==ERROR== ERR_NVGPUCTRPERM - The user does not have permission to access NVIDIA GPU Performance Counters on "
    "the target device 0. For instructions on enabling permissions, see https://developer.nvidia.com/ERR_NVGPUCTRPERM"
)


@pytest.mark.parametrize(
    "body",
    [
        f"print({PERMISSION_ERROR!r}); sys.exit(1)",
        "log = sys.argv[sys.argv.index('--log-file') + 1]\n"
        f"open(log, 'w').write('==PROF== Connected to process 7\\n' + {PERMISSION_ERROR!r} + '\\n'); sys.exit(1)",
    ],
    ids=["error-on-stdout", "error-in-the-log-file"],
)
def test_run_ncu_reports_missing_counter_permission(tmp_path, monkeypatch, body):
    _fake_ncu(tmp_path, monkeypatch, body)
    reason = run_ncu(ncu_command(sys.executable, "control.json", str(tmp_path / "ncu.csv"), "k"), timeout=30)
    assert reason == "ncu cannot read performance counters on this machine (ERR_NVGPUCTRPERM)"


def test_run_ncu_reads_metrics_from_the_log_file(tmp_path, monkeypatch):
    body = f"open(sys.argv[sys.argv.index('--log-file') + 1], 'w').write({NCU_RAW_CSV!r}); print('worker: ok')"
    _fake_ncu(tmp_path, monkeypatch, body)
    metrics = run_ncu(ncu_command(sys.executable, "control.json", str(tmp_path / "ncu.csv"), "rms_norm_fwd"), 30)
    assert isinstance(metrics, dict) and metrics[SM_PCT] == 30.55


@pytest.mark.parametrize(
    "body, timeout, expected",
    [
        ("print('==ERROR== Failed to access the following 1 metrics: x__y.sum'); sys.exit(1)", 30, "ncu failed:"),
        ("sys.exit(3)", 30, "ncu exited with status 3"),
        ("pass", 30, "ncu profiled no launch"),
        ("time.sleep(30)", 0.5, "ncu timed out"),
    ],
    ids=["unknown-metric-error-line", "nonzero-exit-no-output", "kernel-name-matched-nothing", "hang-past-timeout"],
)
def test_run_ncu_gives_one_line_reasons(tmp_path, monkeypatch, body, timeout, expected):
    _fake_ncu(tmp_path, monkeypatch, body)
    reason = run_ncu(ncu_command(sys.executable, "control.json", str(tmp_path / "ncu.csv"), "k"), timeout)
    assert isinstance(reason, str) and reason.startswith(expected) and "\n" not in reason


def test_run_ncu_without_ncu(monkeypatch):
    monkeypatch.setattr(shutil, "which", lambda name, *a, **k: None)
    assert run_ncu(ncu_command(sys.executable, "c.json", "r.csv", "k"), timeout=5) == "ncu not found"


# --------------------------------------------------------------------------------------------------
# Classification
# --------------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "metrics, expected",
    [
        ({DRAM_PCT: 85, MEM_PCT: 87, SM_PCT: 30, LONG_SCOREBOARD_STALL: 70}, "gmem"),
        ({HMMA_PCT: 70, SM_PCT: 80, MEM_PCT: 55, DRAM_PCT: 30}, "compute"),
        ({GMMA_PCT: 65, SM_PCT: 70, MEM_PCT: 50, DRAM_PCT: 25, SMEM_WAVEFRONTS_PCT: 75}, "compute"),
        ({SM_PCT: 88, MEM_PCT: 35, DRAM_PCT: 20}, "compute"),
        ({SM_PCT: 72, XU_PCT: 68, MEM_PCT: 50, DRAM_PCT: 48}, "sfu"),
        ({SM_PCT: 55, MEM_PCT: 80, DRAM_PCT: 20, SMEM_WAVEFRONTS_PCT: 78}, "smem"),
        ({SM_PCT: 35, MEM_PCT: 60, DRAM_PCT: 40, RED_SECTORS: 2e6, ATOM_SECTORS: 0, L2_SECTORS: 1e7}, "atomics"),
        ({SM_PCT: 35, MEM_PCT: 60, DRAM_PCT: 40, ATOM_SECTORS: 5e5}, "atomics"),
        ({SM_PCT: 35, MEM_PCT: 60, DRAM_PCT: 58, RED_SECTORS: 1e3, L2_SECTORS: 1e7}, "gmem"),
        ({SM_PCT: 20, MEM_PCT: 25, DRAM_PCT: 25}, "overlap"),
        ({SM_PCT: 45, MEM_PCT: 52, DRAM_PCT: 50, LONG_SCOREBOARD_STALL: 75}, "overlap"),
        ({SM_PCT: 45, MEM_PCT: 52, DRAM_PCT: 50, LONG_SCOREBOARD_STALL: 20}, "gmem"),
    ],
    ids=[
        "rms-norm-like-dram-85-sm-30",
        "matmul-mma-sync-tensor-70",
        "matmul-wgmma-busy-smem-still-compute",
        "fma-bound-no-tensor-cores",
        "softmax-like-xu-68",
        "smem-wavefronts-78-above-dram",
        "split-k-reductions-20pct-of-l2",
        "atomics-without-l2-total",
        "few-reductions-stay-gmem",
        "both-sides-under-40pct",
        "under-60pct-and-stalled-on-memory",
        "under-60pct-not-stalled",
    ],
)
def test_classify(metrics, expected):
    assert classify(metrics) == expected


def test_classify_needs_throughput():
    with pytest.raises(ValueError, match="no throughput metrics"):
        classify({XU_PCT: 90})


# --------------------------------------------------------------------------------------------------
# Move priors
# --------------------------------------------------------------------------------------------------
def test_affinity_covers_every_move_with_positive_weights():
    assert set(MOVE_AFFINITY) == set(BOTTLENECKS)
    for weights in MOVE_AFFINITY.values():
        assert set(weights) == set(CANONICAL_MOVES) and min(weights.values()) > 0


@pytest.mark.parametrize("bottleneck", [None, *BOTTLENECKS])
def test_move_priors_sum_to_one(bottleneck):
    p = move_priors(bottleneck)
    assert list(p) == list(CANONICAL_MOVES) and math.isclose(sum(p.values()), 1.0) and min(p.values()) > 0


@pytest.mark.parametrize("tactics", [None, TacticGraph()], ids=["no-graph", "empty-graph"])
def test_move_priors_uniform_without_information(tactics):
    p = move_priors(None, tactics)
    assert all(math.isclose(v, 1 / len(CANONICAL_MOVES)) for v in p.values())


def test_move_priors_follow_the_bottleneck():
    gmem, compute = move_priors("gmem"), move_priors("compute")
    assert gmem["cache_policy_cg"] > gmem["switch_to_mma_or_wgmma"]
    assert compute["switch_to_mma_or_wgmma"] > compute["cache_policy_cg"]
    assert max(move_priors("sfu"), key=move_priors("sfu").get) == "softmax_math_fusion"
    assert max(move_priors("atomics"), key=move_priors("atomics").get) == "avoid_atomics_reduce"


def test_move_priors_over_a_subset():
    p = move_priors("gmem", moves=["cache_policy_cg", "change_block_sizes"])
    assert set(p) == {"cache_policy_cg", "change_block_sizes"} and math.isclose(sum(p.values()), 1.0)
    assert math.isclose(p["cache_policy_cg"], 0.6)  # affinities 3 and 2


def test_move_priors_learn_from_tactics():
    tactics = TacticGraph()
    for _ in range(4):
        tactics.record("gmem", "pad_tail_and_mask", 0.2)
        tactics.record("gmem", "cache_policy_cg", -0.1)
    before, after = move_priors("gmem"), move_priors("gmem", tactics)
    assert after["pad_tail_and_mask"] > before["pad_tail_and_mask"]
    assert after["cache_policy_cg"] < before["cache_policy_cg"]
    assert after["cache_policy_cg"] > 0  # never ruled out
    assert move_priors("compute", tactics) == move_priors("compute")  # learned on gmem only
    pooled = move_priors(None, tactics)  # no profile: gains pooled over bottlenecks
    assert pooled["pad_tail_and_mask"] > pooled["change_block_sizes"] > pooled["cache_policy_cg"]


@pytest.mark.parametrize(
    "bottleneck, moves",
    [("latency", None), ("gmem", ["unroll_loops"]), ("gmem", [])],
    ids=["unknown-bottleneck", "non-canonical-move", "no-moves"],
)
def test_move_priors_reject_bad_arguments(bottleneck, moves):
    with pytest.raises(ValueError):
        move_priors(bottleneck, moves=moves)


# --------------------------------------------------------------------------------------------------
# Tactic graph
# --------------------------------------------------------------------------------------------------
def test_tactic_gain_is_shrunk_and_failures_cost():
    g = TacticGraph()
    assert g.gain("gmem", "cache_policy_cg") == 0.0
    g.record("gmem", "cache_policy_cg", 0.3)
    assert math.isclose(g.gain("gmem", "cache_policy_cg"), 0.3 / 3)  # one lucky try counts a third
    g.record("gmem", "cache_policy_cg", None)
    assert g.gain("gmem", "cache_policy_cg") < 0.3 / 3


def test_tactic_graph_round_trip(tmp_path):
    g = TacticGraph()
    g.record("gmem", "cache_policy_cg", 0.04)
    g.record("gmem", "cache_policy_cg", -0.02)
    g.record("gmem", "cache_policy_cg", None)
    g.record("sfu", "softmax_math_fusion", 0.25)
    path = tmp_path / "out" / "global_tactic_graph.json"
    g.save(path)
    data = json.loads(path.read_text())
    assert data["about"]
    assert data["bottlenecks"]["gmem"]["cache_policy_cg"] == {"tries": 3, "failed": 1, "wins": 1, "mean_gain": 0.01}
    back = TacticGraph.load(path)
    assert back.to_json() == data
    for b, m in [("gmem", "cache_policy_cg"), ("sfu", "softmax_math_fusion"), ("smem", "change_block_sizes")]:
        assert math.isclose(back.gain(b, m), g.gain(b, m))
    assert [p.name for p in path.parent.iterdir()] == [path.name]  # atomic save left no temporary file


def test_tactic_graph_save_failure_keeps_the_old_file(tmp_path, monkeypatch):
    path = tmp_path / "global_tactic_graph.json"
    TacticGraph().save(path)
    old = path.read_text()
    g = TacticGraph()
    g.record("gmem", "cache_policy_cg", 0.1)

    def disk_full(*args):
        raise OSError("disk full")

    monkeypatch.setattr(prior.os, "replace", disk_full)
    with pytest.raises(OSError, match="disk full"):
        g.save(path)
    assert path.read_text() == old and [p.name for p in tmp_path.iterdir()] == [path.name]


def test_tactic_graph_missing_file_is_empty(tmp_path):
    g = TacticGraph.load(tmp_path / "nothing_here.json")
    assert g.stats == {} and move_priors(None, g) == move_priors(None)


@pytest.mark.parametrize(
    "text",
    [
        "{not json",
        "[]",
        '{"about": "x"}',
        '{"bottlenecks": {"latency": {}}}',
        '{"bottlenecks": {"gmem": {"unroll_loops": {"tries": 1, "wins": 0, "mean_gain": 0.0}}}}',
        '{"bottlenecks": {"gmem": {"cache_policy_cg": {"tries": 1, "wins": 2, "mean_gain": 0.1}}}}',
        '{"bottlenecks": {"gmem": {"cache_policy_cg": {"tries": 1, "wins": 0}}}}',
        '{"bottlenecks": {"gmem": {"cache_policy_cg": "three tries"}}}',
    ],
    ids=[
        "not-json",
        "a-list",
        "no-bottlenecks-key",
        "unknown-bottleneck",
        "unknown-move",
        "more-wins-than-tries",
        "no-mean-gain",
        "cell-not-an-object",
    ],
)
def test_tactic_graph_malformed_file_names_it(tmp_path, text):
    path = tmp_path / "global_tactic_graph.json"
    path.write_text(text)
    with pytest.raises(ValueError, match="global_tactic_graph.json"):
        TacticGraph.load(path)


@pytest.mark.parametrize(
    "bottleneck, move, gain",
    [("latency", "cache_policy_cg", 0.1), ("gmem", "unroll_loops", 0.1), ("gmem", "cache_policy_cg", math.nan)],
    ids=["unknown-bottleneck", "non-canonical-move", "nan-gain"],
)
def test_tactic_graph_record_rejects_bad_entries(bottleneck, move, gain):
    with pytest.raises(ValueError):
        TacticGraph().record(bottleneck, move, gain)
