"""kernel_lib.search.moves on the shipped specs: the size of the space the rule moves reach, transpositions (two
orders, one node), and that every child a rule writes still parses, still compiles for an H100 (sm_90, compiled on
this machine without a GPU), and still computes the right thing (under the interpreter, at the small sizes)."""

from __future__ import annotations

import ast
import json
import os
import random
import subprocess
import sys
from pathlib import Path

import pytest

from kernel_lib.search import contract
from kernel_lib.search.moves import RULES, reachable, rule_actions
from kernel_lib.search.spec import load_spec, pow2_range, resolve_constexprs
from kernel_lib.search.store import RunStore
from kernel_lib.search.variant import Variant
from kernel_lib.search.worker import evaluate_control

ROOT = Path(__file__).resolve().parents[2]
SIZES = {"rms_norm": 240, "softmax": 384, "matmul": 384, "grouped_mm": 288}  # variants reachable by rule moves
SPECS = {name: load_spec(ROOT / "specs" / f"{name}.json") for name in SIZES}
SPACES: dict[str, list[Variant]] = {}


def space(name: str) -> list[Variant]:
    if name not in SPACES:
        SPACES[name] = reachable(SPECS[name])
    return SPACES[name]


def step(v: Variant, name: str, key: str) -> Variant | None:
    """The child of ``v`` by the action ``key`` ("move:label"), None where the action is not offered."""
    return next((a.child for a in rule_actions(v, SPECS[name]) if a.key == key), None)


@pytest.mark.parametrize("name, size", SIZES.items())
def test_the_rule_moves_reach_enough_variants(name, size):
    variants = space(name)
    assert len(variants) >= 200  # the floor: an exhaustive run has a real space to measure
    assert len(variants) == size
    assert len({v.id for v in variants}) == len(variants)
    assert variants[0] == Variant.baseline(SPECS[name])


def test_cache_policy_then_block_size_is_block_size_then_cache_policy():
    root = Variant.baseline(SPECS["rms_norm"])
    one = step(step(root, "rms_norm", "cache_policy_cg:loads .cg"), "rms_norm", "change_block_sizes:BLOCK_N=1024")
    two = step(step(root, "rms_norm", "change_block_sizes:BLOCK_N=1024"), "rms_norm", "cache_policy_cg:loads .cg")
    assert one is not None and two is not None
    assert one.id == two.id and one.source == two.source and one.launch == two.launch


@pytest.mark.parametrize("name", SIZES)
def test_any_two_moves_at_the_baseline_commute(name):
    """Every pair of actions of different moves, applied in both orders, gives one variant (one node)."""
    root = Variant.baseline(SPECS[name])
    actions = rule_actions(root, SPECS[name])
    pairs = [(a, b) for a in actions for b in actions if a.move < b.move]
    tried = 0
    for a, b in pairs:
        ab, ba = step(a.child, name, b.key), step(b.child, name, a.key)
        if ab is None or ba is None:
            continue  # one move takes the other's opportunity away (none do on the shipped specs)
        tried += 1
        assert ab.id == ba.id, f"{a.key} then {b.key} differs from the reverse order"
    assert tried == len(pairs) and tried >= 15


@pytest.mark.parametrize("name", SIZES)
def test_every_child_parses_and_keeps_its_knobs_in_bounds(name):
    spec = SPECS[name]
    for v in space(name):
        assert v.source.isascii()
        tree = ast.parse(v.source)  # a SyntaxError here is a rule that wrote broken text
        if f"def {spec.entry}(" in v.source:  # grouped_mm imports its kernel: no def to look at
            defs = [n for n in ast.walk(tree) if isinstance(n, ast.FunctionDef) and n.name == spec.entry]
            assert len(defs) == 1
            params = [a.arg for a in defs[0].args.args]
            for added in ("EVEN_TAIL", "GROUP_M"):  # a move-added constexpr is a parameter exactly when launched
                assert (added in params) == (added in v.launch["constexprs"]), (v.id, added)
        for knob, (low, high) in spec.tunable.items():
            value = v.launch[knob] if knob in ("num_warps", "num_stages") else v.launch["constexprs"].get(knob)
            if value is None:
                continue
            allowed = range(low, high + 1) if knob == "num_stages" else pow2_range(low, high)
            assert value in allowed or v is space(name)[0], (v.id, knob, value)
        labels = [a.key for a in rule_actions(v, spec)]
        assert len(labels) == len(set(labels))


def test_each_rule_generator_fires_on_some_shipped_spec():
    fired = {a.move for name in SIZES for v in space(name)[:40] for a in rule_actions(v, SPECS[name])}
    assert fired == set(RULES)


# --------------------------------------------------------------------------------------------------
# A sample of each space: compiled for sm_90, and evaluated under the interpreter
# --------------------------------------------------------------------------------------------------
FEATURES = {  # what a rule move leaves in a variant
    "pad_tail_and_mask": lambda v: "EVEN_TAIL" in v.launch["constexprs"],
    "grouped_gemm_colmajor": lambda v: "GROUP_M" in v.launch["constexprs"],
    "softmax_math_fusion": lambda v: "tl.exp2(" in v.source or "tl.rsqrt(" in v.source,
    "cache_policy_cg": lambda v: '".cg"' in v.source,
    "enable_async_pipeline": lambda v: v.launch["num_stages"] > 2,
}


def sample(name: str, n: int = 6, seed: int = 0) -> dict[str, Variant]:
    """The baseline, one variant per feature the space has, one with all of them, then random ones: ``n`` or more."""
    variants, rng = space(name), random.Random(seed)
    chosen = {"baseline": variants[0]}
    present = [f for f, has in FEATURES.items() if any(has(v) for v in variants)]
    for feature in present:
        chosen[feature] = rng.choice([v for v in variants if FEATURES[feature](v)])
    every = [v for v in variants if all(FEATURES[f](v) for f in present)]
    if len(present) > 1 and every:
        chosen["all of " + "+".join(present)] = rng.choice(every)
    others = [v for v in variants if v not in chosen.values()]
    for v in rng.sample(others, max(0, n - len(chosen))):
        chosen[f"random {v.id}"] = v
    return chosen


COMPILE = """
import importlib.util, json, sys
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

out = []
for job in json.load(open(sys.argv[1])):
    try:
        spec = importlib.util.spec_from_file_location(job["module"], job["path"])
        module = importlib.util.module_from_spec(spec)
        sys.modules[job["module"]] = module
        spec.loader.exec_module(module)
        fn = getattr(module, job["entry"])
        signature = {}
        for name in fn.arg_names:
            if name in job["constexprs"]:
                signature[name] = "constexpr"
            elif name in job["pointers"]:
                signature[name] = job["pointers"][name]
            else:
                value = job["scalars"][name]
                signature[name] = "i1" if isinstance(value, bool) else "i32" if isinstance(value, int) else "fp32"
        options = {"num_warps": job["num_warps"], "num_stages": job["num_stages"]}
        compiled = triton.compile(ASTSource(fn, signature, job["constexprs"]), target=GPUTarget("cuda", 90, 32),
                                  options=options)
        out.append({"label": job["label"], "cubin": len(compiled.asm["cubin"]), "warps": compiled.metadata.num_warps})
    except Exception as exc:
        out.append({"label": job["label"], "error": f"{type(exc).__name__}: {exc}"[-1500:]})
print(json.dumps(out))
"""
POINTER = {"bfloat16": "*bf16", "float16": "*fp16", "float32": "*fp32", "int32": "*i32", "int64": "*i64"}


def compile_jobs(name: str, folder: Path) -> list[dict]:
    """One job per sampled variant at the spec's full sizes; EVEN_TAIL variants at the small sizes too (its other
    branch: the full sizes divide the blocks, the small ones do not)."""
    spec, jobs = SPECS[name], []
    pointers = {t.name: POINTER[t.dtype] for t in spec.inputs + spec.outputs}
    for label, v in sample(name).items():
        path = folder / f"{name}_{v.id}.py"
        path.write_text(v.source)
        for small in (False, True) if "EVEN_TAIL" in v.launch["constexprs"] else (False,):
            scope = contract.names(spec, small=small)
            scope["INTERPRET"] = False  # compiled for a GPU: DOT_FP32 and the like take their GPU values
            jobs.append({
                "label": f"{label} ({'small' if small else 'full'} sizes)", "module": f"_compile_{name}_{v.id}",
                "path": str(path), "entry": spec.entry, "pointers": pointers, "scalars": scope,
                "constexprs": resolve_constexprs(v.launch["constexprs"], scope),
                "num_warps": v.launch["num_warps"], "num_stages": v.launch["num_stages"],
            })  # fmt: skip
    return jobs


@pytest.mark.parametrize("name", SIZES)
def test_sampled_variants_compile_for_sm90(name, tmp_path):
    """triton.compile for GPUTarget("cuda", 90, 32) runs on a machine without a GPU; not under the interpreter
    (it replaces triton.jit), so in a subprocess with TRITON_INTERPRET unset and a fresh Triton cache."""
    jobs = compile_jobs(name, tmp_path)
    (tmp_path / "jobs.json").write_text(json.dumps(jobs))
    (tmp_path / "compile.py").write_text(COMPILE)
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.update(TRITON_CACHE_DIR=str(tmp_path / "cache"), PYTHONPATH=str(ROOT))
    done = subprocess.run(
        [sys.executable, str(tmp_path / "compile.py"), str(tmp_path / "jobs.json")],
        capture_output=True, text=True, env=env, cwd=ROOT, timeout=300,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    results = json.loads(done.stdout.strip().splitlines()[-1])
    failed = [f"{r['label']}: {r['error']}" for r in results if "error" in r]
    assert not failed, "\n\n".join(failed)
    assert len(results) == len(jobs) >= 6
    for r, job in zip(results, jobs, strict=True):
        assert r["cubin"] > 1000 and r["warps"] == job["num_warps"], r


@pytest.mark.parametrize("name", SIZES)
def test_sampled_variants_are_correct_under_the_interpreter(name, tmp_path):
    """The evaluator's gates (reference, poison, fresh input) pass for each sampled variant at the small sizes."""
    if not contract.interpreting():
        pytest.skip("the interpreter's small sizes; a GPU search evaluates the full ones")
    spec_path = ROOT / "specs" / f"{name}.json"
    store = RunStore(tmp_path, name)
    control = {"spec": str(spec_path), "device": "cpu", "small": True, "seed": 3, "fresh_seed": 4}
    control.update(warmup_ms=0, rep_ms=0)
    for label, v in sample(name).items():
        path = store.write_variant(v, "triton", control, v.source)
        result = evaluate_control(json.loads(Path(path).read_text()))
        assert result["status"] == "ok", f"{label} ({v.id}): {result['status']}: {result['reason']}"
