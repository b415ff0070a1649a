"""``python -m kernel_lib.search``: --help, a malformed spec (exit 2 and an error naming the field, never a
traceback), and a run over the shipped specs/ folder on the CPU that leaves every file kernel-search.md lists."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from kernel_lib.search.__main__ import main
from kernel_lib.search.spec import find_specs
from kernel_lib.search.variant import Variant

ROOT = Path(__file__).resolve().parents[2]
FLAGS = [
    "--input", "--outdir", "--gpus", "--budget", "--min-pred-gain", "--llm-model", "--no-llm", "--ncu-every",
    "--resume", "--seed", "--timeout",
]  # fmt: skip


def cli(*args: str, timeout: float = 300, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "kernel_lib.search", *args],
        capture_output=True, text=True, cwd=ROOT, env=dict(os.environ) if env is None else env, timeout=timeout,
    )  # fmt: skip


def test_help_lists_the_flags():
    done = cli("--help", timeout=60)
    assert done.returncode == 0 and not done.stderr
    for flag in FLAGS:
        assert flag in done.stdout
    for internal in ("--worker", "--serve", "--budget-builds"):  # the worker's own command; the budget's old name
        assert internal not in done.stdout


def test_the_worker_has_its_own_command():
    done = subprocess.run(
        [sys.executable, "-m", "kernel_lib.search.worker", "--help"], capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0 and "control.json" in done.stdout and "--serve" not in done.stdout


def _spec_file(folder: Path, change) -> Path:
    data = json.loads((ROOT / "specs" / "rms_norm.json").read_text())
    data["source_path"] = str(ROOT / "specs" / "rms_norm.py")
    change(data)
    path = folder / "spec.json"
    path.write_text(json.dumps(data) if isinstance(data, dict) else data)
    return path


MALFORMED = [
    # (id, change to specs/rms_norm.json, the words of the one error: the field first)
    ("misspelt field", lambda d: d.update(tunables=d.pop("tunable")), "field 'tunables': Extra inputs"),
    ("missing required field", lambda d: d.pop("outputs"), "field 'outputs': Field required"),
    ("grid calls __import__", lambda d: d["launch"].update(grid="__import__('os')"), "field 'launch.grid'"),
    ("wrong type", lambda d: d["launch"].update(num_warps="four"), "field 'launch.num_warps'"),
]


@pytest.mark.parametrize("change, words", [m[1:] for m in MALFORMED], ids=[m[0] for m in MALFORMED])
def test_a_malformed_spec_exits_2_naming_the_field(tmp_path, capsys, change, words):
    path = _spec_file(tmp_path, change)
    assert main(["--input", str(path), "--outdir", str(tmp_path / "out"), "--no-llm", "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"error: {path}: invalid kernel spec\n") and words in err
    assert "Traceback" not in err and len(err.splitlines()) <= 3
    assert not (tmp_path / "out").exists()  # refused before anything is written


def test_a_file_that_is_not_json_exits_2_without_a_traceback(tmp_path):
    """In a process of its own: the exit code and stderr a person sees."""
    path = tmp_path / "broken.json"
    path.write_text('{"name": "rms_norm", "kind": "triton",,}')
    done = cli("--input", str(path), "--outdir", str(tmp_path / "out"), "--no-llm", timeout=60)
    assert done.returncode == 2
    why = "Expecting property name enclosed in double quotes at line 1, column 39"
    assert done.stderr.strip() == f"error: {path}: not valid JSON: {why}"
    assert "Traceback" not in done.stderr and not done.stdout


@pytest.mark.parametrize(
    "args, words",
    [
        pytest.param(["--gpus", "zero"], "--gpus takes comma-separated integers", id="gpus not integers"),
        pytest.param(["--input", "no/such/specs"], "no such file or folder", id="input missing"),
    ],
)
def test_bad_arguments_exit_2(tmp_path, capsys, args, words):
    argv = ["--input", str(ROOT / "specs" / "rms_norm.json"), "--outdir", str(tmp_path), "--no-llm", *args]
    assert main(argv) == 2
    assert words in capsys.readouterr().err


def test_no_input_is_a_usage_error(capsys):
    with pytest.raises(SystemExit) as exited:
        main(["--no-llm"])
    assert exited.value.code == 2 and "--input is required" in capsys.readouterr().err


# --------------------------------------------------------------------------------------------------
# A run over specs/
# --------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def specs_run(tmp_path_factory):
    if torch.cuda.is_available():
        pytest.skip("the CPU run (interpreter, small sizes); on a GPU the full sizes are notebook 07's")
    out = tmp_path_factory.mktemp("cli") / "out"
    # the README's command as a user types it: TRITON_INTERPRET not set (the CLI turns the interpreter on itself)
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    done = cli("--input", "specs/", "--outdir", str(out), "--no-llm", "--budget", "8", "--no-progress", env=env)
    return out, done


def test_a_run_over_the_specs_folder_succeeds(specs_run):
    out, done = specs_run
    assert done.returncode == 0, done.stderr
    assert "Traceback" not in done.stderr
    assert done.stdout.count("No CUDA GPU: the workers run the kernels under Triton's interpreter") == 1  # said once
    for spec in find_specs(ROOT / "specs"):
        if spec.kind == "triton":
            assert f"{spec.name}: best " in done.stdout
            line = next(line for line in done.stdout.splitlines() if line.startswith(f"{spec.name}: best "))
            assert "under the interpreter: not a GPU speed-up" in line  # a CPU time is never reported as a speed-up
        else:
            assert f"{spec.name}: skipped" in done.stdout  # a CUDA C++ spec needs a GPU: said, not an error


BASELINE_FILES = ["run.json", "control.json", "result.json", "kernel_module.py", "stdout.log", "stderr.log"]
VARIANT_FILES = ["control.json", "result.json", "kernel_module.py", "candidate.diff", "stdout.log", "stderr.log"]


@pytest.mark.parametrize("name", [s.name for s in find_specs(ROOT / "specs") if s.kind == "triton"])
def test_a_run_leaves_every_file_kernel_search_md_lists(specs_run, name):
    out, _ = specs_run
    json.loads((out / "global_tactic_graph.json").read_text())
    root = out / "kernels" / name
    for f in BASELINE_FILES:
        assert (root / "baseline" / f).is_file(), f
    assert len(json.loads((root / "baseline" / "run.json").read_text())) == 1  # one start, no resume
    variants = sorted((root / "variants").iterdir())
    assert len(variants) == 7  # budget 8, the baseline included
    for folder in variants:
        for f in VARIANT_FILES:
            assert (folder / f).is_file(), (folder.name, f)
        control = json.loads((folder / "control.json").read_text())
        assert control["id"] == folder.name
        # the folder's name is the hash of its source and launch: the files are the variant
        assert Variant.make((folder / "kernel_module.py").read_text(), control["launch"]).id == folder.name
        assert "# launch configuration" in (folder / "candidate.diff").read_text()
    best = root / "best"
    assert best.is_symlink() and json.loads((best / "result.json").read_text())["status"] == "ok"
    state = json.loads((root / "search_state.json").read_text())
    incumbent = state["incumbent"]["id"]
    assert state["evaluations"] == 8
    assert os.readlink(best) == ("baseline" if incumbent == state["baseline"]["id"] else f"variants/{incumbent}")
    events = [json.loads(line) for line in (root / "events.jsonl").read_text().splitlines()]
    assert [e["type"] for e in events].count("evaluated") == 7 and events[-1]["type"] == "finished"
    trace = (root / "trace.md").read_text()
    assert trace.startswith(f"# Search: {name}") and "Finished" in trace
    assert "say nothing about a GPU" in trace
    assert (root / "spec.json").is_file() and (root / "workers" / "worker-0.log").is_file()


def test_a_second_run_into_the_same_folder_needs_resume(specs_run, capsys):
    out, _ = specs_run
    events = (out / "kernels" / "rms_norm" / "events.jsonl").read_text()
    argv = ["--input", str(ROOT / "specs" / "rms_norm.json"), "--outdir", str(out), "--no-llm", "--no-progress"]
    assert main(argv) == 1
    assert "holds a run already: pass --resume, or another --outdir" in capsys.readouterr().err
    assert (out / "kernels" / "rms_norm" / "events.jsonl").read_text() == events  # untouched


def test_resuming_a_finished_run_elsewhere_evaluates_nothing(specs_run, capsys, tmp_path):
    """The run folder alone is enough to resume, moved to another place too."""
    out, _ = specs_run
    shutil.copytree(out / "kernels" / "softmax", tmp_path / "kernels" / "softmax", symlinks=True)
    argv = ["--input", str(ROOT / "specs" / "softmax.json"), "--outdir", str(tmp_path), "--no-llm", "--no-progress"]
    assert main([*argv, "--budget-builds", "8", "--resume"]) == 0  # the budget's old name still works
    assert "softmax: best " in capsys.readouterr().out
    events = [json.loads(line) for line in (tmp_path / "kernels" / "softmax" / "events.jsonl").read_text().splitlines()]
    assert [e["type"] for e in events].count("evaluated") == 7
    assert [e["type"] for e in events][-3:] == ["finished", "resumed", "finished"]


def users_folder(tmp_path, reference: dict | None = None) -> tuple[Path, dict]:
    """A user's spec folder: specs/rms_norm.json and its kernel copied there, and ``reference`` ({module file name:
    its text, "function": dotted name}) written beside them; the folder and the spec as a dict."""
    folder = tmp_path / "my_kernels"
    folder.mkdir()
    data = json.loads((ROOT / "specs" / "rms_norm.json").read_text())
    shutil.copy(ROOT / "specs" / data["source_path"], folder / data["source_path"])
    for name, text in (reference or {}).items():
        if name == "function":
            data["reference"]["function"] = text
        else:
            (folder / name).write_text(text)
    (folder / "rms_norm.json").write_text(json.dumps(data))
    return folder, data


def run_budget_1(spec_or_folder: Path, tmp_path) -> subprocess.CompletedProcess:
    return cli("--input", str(spec_or_folder), "--outdir", str(tmp_path / "out"), "--no-llm", "--budget", "1",
               "--no-progress")  # fmt: skip


def test_a_reference_beside_the_spec_needs_no_pythonpath(tmp_path):
    # the kernel, the spec and the float64 reference side by side, nothing installed, no PYTHONPATH
    reference = "from kernel_lib.ops.norms import rms_norm_ref\n\n\ndef my_rms_norm(x, w, eps):\n"
    folder, _ = users_folder(tmp_path, {"my_reference.py": reference + "    return rms_norm_ref(x, w, eps)\n",
                                        "function": "my_reference.my_rms_norm"})  # fmt: skip
    assert not any("my_kernels" in p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep))
    done = run_budget_1(folder / "rms_norm.json", tmp_path)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "rms_norm: best " in done.stdout
    run_spec = json.loads((tmp_path / "out" / "kernels" / "rms_norm" / "spec.json").read_text())
    assert run_spec["reference"]["search_path"] == str(folder)  # the run folder's copy still finds it


def test_one_bad_spec_in_a_folder_does_not_stop_the_good_ones(tmp_path):
    folder, _ = users_folder(tmp_path)
    (folder / "a_broken.json").write_text('{"name": "broken", "kind": "triton",,}')
    done = run_budget_1(folder, tmp_path)
    assert done.returncode == 1  # something failed: said, and the exit code says so
    assert f"error: {folder / 'a_broken.json'}: not valid JSON" in done.stderr
    assert "rms_norm: best " in done.stdout  # the good spec ran anyway


def test_a_failing_baseline_names_the_kernel_once(tmp_path):
    folder, _ = users_folder(tmp_path, {"broken_reference.py": "def rms_norm(x, w, eps):\n    raise ValueError('no')\n",
                                        "function": "broken_reference.rms_norm"})  # fmt: skip
    done = run_budget_1(folder / "rms_norm.json", tmp_path)
    assert done.returncode == 1 and "rms_norm: the baseline fails" in done.stderr, done.stderr[-2000:]
    assert "rms_norm: rms_norm:" not in done.stderr
