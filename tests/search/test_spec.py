"""kernel_lib.search.spec: the shipped specs load, and each kind of bad spec is refused on load with an error that
names the bad field (never a traceback, never a run that fails later); expressions can do arithmetic and nothing
else."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest

from kernel_lib.search.spec import SpecError, evaluate, find_specs, load_spec, parse_spec, resolve_constexprs

ROOT = Path(__file__).resolve().parents[2]
SPECS = ROOT / "specs"
SPEC_FILES = sorted(SPECS.glob("*.json"))
SOURCE = """import triton
import triton.language as tl


@triton.jit
def scale(x, y, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    tl.store(y + offs, tl.load(x + offs, mask=offs < n) * 2.0, mask=offs < n)
"""
GOOD = {
    "name": "scale",
    "kind": "triton",
    "source": SOURCE,
    "entry": "scale",
    "sizes": {"n": 1000},
    "inputs": [{"name": "x", "shape": ["n"]}],
    "outputs": [{"name": "y", "shape": ["n"]}],
    "scalars": {"two": 2.0},
    "launch": {"grid": "(cdiv(n, BLOCK),)", "constexprs": {"BLOCK": 128}},
    "reference": {"function": "torch.mul", "args": ["x", "two"]},
}


def edited(change) -> dict:
    data = copy.deepcopy(GOOD)
    change(data)
    return data


def test_the_good_spec_loads():
    spec = parse_spec(GOOD)
    assert spec.name == "scale" and spec.launch.num_warps == 4 and spec.source_text() == SOURCE


@pytest.mark.parametrize("path", SPEC_FILES, ids=[p.stem for p in SPEC_FILES])
def test_shipped_specs_load(path):
    spec = load_spec(path)
    assert spec.name == path.stem and spec.source_text().strip()
    assert spec.path == str(path)


def test_find_specs_takes_a_folder_in_name_order():
    assert [s.name for s in find_specs(SPECS)] == [p.stem for p in SPEC_FILES]


BAD = [
    # (id, change to the good spec, words the error must hold: the field first)
    ("misspelt top-level field", lambda d: d.update(lauch=d.pop("launch")), ["'lauch'", "Extra inputs"]),
    ("misspelt nested field", lambda d: d["inputs"][0].update(dtyp="float32"), ["'inputs.0.dtyp'"]),
    ("missing required field", lambda d: d.pop("entry"), ["'entry'", "Field required"]),
    ("grid calls __import__", lambda d: d["launch"].update(grid="__import__('os')"), ["'launch.grid'", "only cdiv"]),
    ("grid reads an attribute", lambda d: d["launch"].update(grid="(x.shape,)"), ["'launch.grid'", "Attribute"]),
    ("grid is not an expression", lambda d: d["launch"].update(grid="(n,"), ["'launch.grid'", "not an expression"]),
    ("shape holds a lambda", lambda d: d["inputs"][0].update(shape=["(lambda: 1)()"]), ["'inputs.0.shape'"]),
    ("negative dimension", lambda d: d["inputs"][0].update(shape=[-1]), ["'inputs.0.shape'", "negative"]),
    ("unknown dtype", lambda d: d["outputs"][0].update(dtype="bf16"), ["'outputs.0.dtype'", "'bfloat16'"]),
    ("unknown init", lambda d: d["inputs"][0].update(init="normal"), ["'inputs.0.init'"]),
    ("full without a value", lambda d: d["inputs"][0].update(init="full"), ["'inputs.0'", "needs a 'value'"]),
    ("num_warps not a power of two", lambda d: d["launch"].update(num_warps=3), ["'launch.num_warps'", "got 3"]),
    ("tunable bounds reversed", lambda d: d.update(tunable={"BLOCK": [256, 64]}), ["'tunable'", "BLOCK"]),
    ("both source and source_path", lambda d: d.update(source_path="k.py"), ["exactly one of 'source'"]),
    ("neither source nor source_path", lambda d: d.pop("source"), ["exactly one of 'source'"]),
    ("name with a slash", lambda d: d.update(name="../evil"), ["'name'", "'../evil'"]),
    ("kind neither triton nor cuda", lambda d: d.update(kind="opencl"), ["'kind'"]),
    ("no outputs", lambda d: d.update(outputs=[]), ["at least one output"]),
    ("a name used twice", lambda d: d["outputs"][0].update(name="x"), ["used twice", "'x'"]),
    ("small_sizes with other symbols", lambda d: d.update(small_sizes={"m": 10}), ["small_sizes", "['n']"]),
    ("reference not a dotted path", lambda d: d["reference"].update(function="mul"), ["'reference.function'"]),
    ("reference argument unknown", lambda d: d["reference"].update(args=["x", "three"]), ["'three'"]),
    ("CUDA launch without block and args", lambda d: d.update(kind="cuda"), ["'block' and 'args'"]),
]


@pytest.mark.parametrize("change, words", [b[1:] for b in BAD], ids=[b[0] for b in BAD])
def test_a_bad_spec_is_refused_naming_the_field(change, words):
    with pytest.raises(SpecError) as raised:
        parse_spec(edited(change), "bad.json")
    message = str(raised.value)
    assert message.startswith("bad.json: ")
    for word in words:
        assert word in message
    assert "Traceback" not in message and len(message.splitlines()) <= 4


def test_a_file_that_is_not_json_names_the_line(tmp_path):
    path = tmp_path / "broken.json"
    path.write_text('{"name": "scale",\n  "kind": }\n')
    with pytest.raises(SpecError, match=r"broken.json: not valid JSON: .* at line 2, column 11"):
        load_spec(path)


@pytest.mark.parametrize(
    "text, got",
    [
        pytest.param("[1, 2]", "list", id="JSON array"),
        pytest.param('"rms_norm"', "str", id="JSON string"),
    ],
)
def test_a_spec_file_must_hold_an_object(tmp_path, text, got):
    path = tmp_path / "odd.json"
    path.write_text(text)
    with pytest.raises(SpecError, match=f"a kernel spec is a JSON object, got {got}$"):
        load_spec(path)


def test_a_missing_source_file_is_named(tmp_path):
    data = edited(lambda d: (d.pop("source"), d.update(source_path="nowhere.py")))
    path = tmp_path / "spec.json"
    path.write_text(json.dumps(data))
    with pytest.raises(SpecError, match=r"field 'source_path': no file .*nowhere.py"):
        load_spec(path)


def test_a_missing_path_or_empty_folder_is_an_error(tmp_path):
    with pytest.raises(SpecError, match="no such file or folder"):
        find_specs(tmp_path / "absent.json")
    with pytest.raises(SpecError, match=r"no \*.json spec files"):
        find_specs(tmp_path)


# --------------------------------------------------------------------------------------------------
# Expressions
# --------------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "text, value",
    [
        ("(cdiv(M, BLOCK),)", (3,)),
        ("next_pow2(N)", 256),
        ("next_pow2(256)", 256),  # a power of two is its own
        ("N % BLOCK == 0 and M > 1", False),  # pad_tail_and_mask's EVEN_TAIL
        ("max(min(M, 4), 1) * 2", 8),
        (7, 7),  # numbers pass through
    ],
)
def test_evaluate_does_arithmetic(text, value):
    assert evaluate(text, {"M": 300, "N": 200, "BLOCK": 128}) == value


@pytest.mark.parametrize(
    "text, words",
    [
        pytest.param("__import__('os').system('true')", "only cdiv", id="import then call an attribute"),
        pytest.param("open('/etc/passwd')", "only cdiv", id="a builtin"),
        pytest.param("(lambda: 1)()", "only cdiv", id="a lambda called"),
        pytest.param("lambda: 1", "Lambda is not allowed", id="a lambda"),
        pytest.param("[x for x in (1, 2)]", "ListComp is not allowed", id="a comprehension"),
        pytest.param("M.bit_length", "Attribute is not allowed", id="an attribute"),
        pytest.param("M.bit_length()", "only cdiv", id="a method"),
        pytest.param("(M,)[0]", "Subscript is not allowed", id="a subscript"),
        pytest.param("UNKNOWN + 1", "known names: M", id="an unknown name"),
    ],
)
def test_evaluate_refuses_anything_else(text, words):
    with pytest.raises(ValueError, match=words):
        evaluate(text, {"M": 300})


def test_constexprs_may_use_each_other_in_any_order():
    constexprs = {"EVEN_TAIL": "N % BLOCK_N == 0", "BLOCK_N": "next_pow2(N)", "ROWS": 2}
    assert resolve_constexprs(constexprs, {"N": 200}) == {"EVEN_TAIL": False, "BLOCK_N": 256, "ROWS": 2}
    with pytest.raises(ValueError, match="'NOPE'"):
        resolve_constexprs({"A": "NOPE + 1", "B": "A"}, {"N": 200})


# --------------------------------------------------------------------------------------------------
# Every expression is checked on load, not at the baseline's first evaluation
# --------------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "change",
    [
        pytest.param(lambda d: d["scalars"].update(two="__import__('os')"), id="scalar"),
        pytest.param(lambda d: d["launch"]["constexprs"].update(BLOCK="open('x')"), id="constexpr"),
        pytest.param(lambda d: d.update(bytes="__import__('os')"), id="bytes"),
    ],
)
def test_every_expression_is_checked_on_load(change):
    with pytest.raises(SpecError, match="only cdiv"):
        parse_spec(edited(change), "bad.json")
