"""``python -m kernel_lib.assistant``: the report for a Hugging Face GPT-2 built from a config, help, bad input."""

import json
import os
import subprocess
import sys
import textwrap

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def run(*args, timeout=600):
    env = {**os.environ, "PYTHONPATH": ROOT, "TRITON_INTERPRET": os.environ.get("TRITON_INTERPRET", "1")}
    return subprocess.run(
        [sys.executable, "-m", "kernel_lib.assistant", *args],
        capture_output=True,
        text=True,
        env=env,
        timeout=timeout,
        cwd=ROOT,
    )


def test_help():
    out = run("--help")
    assert out.returncode == 0 and "--input-shape" in out.stdout and "make_model" in out.stdout


def test_gpt2_from_a_config(tmp_path):
    pytest.importorskip("transformers")
    file = tmp_path / "my_model.py"
    file.write_text(
        textwrap.dedent("""
        from transformers import GPT2Config, GPT2LMHeadModel

        def make_model():
            return GPT2LMHeadModel(GPT2Config(vocab_size=8192, n_embd=64, n_layer=2, n_head=4, n_positions=64))
    """)
    )
    out = run(f"{file}:make_model", "--input-shape", "2,16", "--labels", "--json", "--device", "cpu",
              "--compare-seconds", "0")  # fmt: skip
    assert out.returncode == 0, out.stderr[-2000:]
    report = json.loads(out.stdout)
    kinds = {f["kind"] for f in report["findings"]}
    assert {"not_compiled", "unfused_cross_entropy"} <= kinds  # 8192 outputs: a vocabulary head
    assert report["model"] == "GPT2LMHeadModel" and "verdict" in report


@pytest.mark.parametrize(
    "args, message",
    [
        (["nofile.py:make", "--input-shape", "2,4"], "no such file"),
        (["just_a_name", "--input-shape", "2,4"], "path/to/file.py:function"),
        ([__file__ + ":missing", "--input-shape", "2,4"], "no function 'missing'"),
        ([__file__ + ":run", "--input-shape", "2,x"], "--input-shape"),
        ([__file__ + ":run", "--input-shape", "2,4", "--plan", "p.json"], "pass --apply too"),  # nothing decided
    ],
)
def test_bad_arguments_exit_2(args, message):
    out = run(*args)
    assert out.returncode == 2 and message in out.stderr


MADE = {  # what make_model returns, and the words of the one error line
    "a dict": ("return {'w': 1}", "returned dict, not a torch.nn.Module"),
    "an encoder-decoder without labels": (
        "from transformers import T5Config, T5ForConditionalGeneration\n"
        "    return T5ForConditionalGeneration(T5Config(vocab_size=256, d_model=32, d_kv=8, d_ff=64, num_layers=1,"
        " num_heads=4))",
        "is an encoder-decoder model: its decoder reads labels, pass --labels",
    ),
}


@pytest.mark.parametrize("made", MADE)
def test_a_model_the_tool_cannot_run_is_named(tmp_path, made):
    body, words = MADE[made]
    if "transformers" in body:
        pytest.importorskip("transformers")
    file = tmp_path / "my_model.py"
    file.write_text(f"def make_model():\n    {body}\n")
    out = run(f"{file}:make_model", "--input-shape", "2,8", "--device", "cpu", timeout=300)
    assert out.returncode == 2 and words in out.stderr, out.stderr[-2000:]
    assert "Traceback" not in out.stderr
