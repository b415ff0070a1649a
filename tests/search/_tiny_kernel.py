"""A tiny kernel spec for the evaluator's and the search's tests, and variants of it that try to game the evaluator.

The kernel doubles a float32 matrix row by row (``y = 2 x``, reference ``torch.mul(x, 2.0)``, exact in float32),
8 rows of 40 columns: one interpreted launch takes milliseconds. Every variant is a whole source file (the spec's
``launcher`` lets it do host-side tricks: caching, a side stream, sleeping) with a ``# variant: <name>`` line, so a
variant found in a run folder says which one it is. The baseline's load already streams (``.cg``) and the spec has
no ``tunable`` or ``tails``: no rule move applies, so a search with a language model expands its replies only.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from kernel_lib.search.contract import make_case
from kernel_lib.search.spec import parse_spec
from kernel_lib.search.store import RunStore
from kernel_lib.search.variant import Variant

HEADER = """import time

import torch
import triton
import triton.language as tl

# variant: {name}
"""
PLAIN_LAUNCH = """

def launch(kernel, grid, args, meta):
    kernel[grid](**args, **meta)
"""
KERNEL = """

@triton.jit
def double_rows(x, y, N, BLOCK_N: tl.constexpr):
    row = tl.program_id(0)
    cols = tl.arange(0, BLOCK_N)
    ok = cols < N
    v = tl.load(x + row * N + cols, mask=ok, other=0.0, cache_modifier=".cg")
    tl.store(y + row * N + cols, v * 2.0, mask=ok)
"""


def source(name: str, edits: dict[str, str] | None = None, launcher: str = PLAIN_LAUNCH) -> str:
    """The baseline's text with ``edits`` (old -> new) made in the kernel, and ``launcher`` as its launcher."""
    kernel = KERNEL
    for old, new in (edits or {}).items():
        assert old in kernel, old
        kernel = kernel.replace(old, new)
    return HEADER.format(name=name) + kernel + launcher


BASELINE = source("baseline")
M, N = 8, 40
SEED, FRESH_SEED = 100, 101  # the search's seeds with --seed 0: seed * 2 + 100 and + 101
SPEC = {
    "name": "double_rows",
    "kind": "triton",
    "source": BASELINE,
    "entry": "double_rows",
    "launcher": "launch",
    "sizes": {"M": M, "N": N},
    "inputs": [{"name": "x", "shape": ["M", "N"], "dtype": "float32", "init": "randn"}],
    "outputs": [{"name": "y", "shape": ["M", "N"], "dtype": "float32"}],
    "scalars": {"two": 2.0},
    "launch": {"grid": "(M,)", "num_warps": 1, "num_stages": 1, "constexprs": {"BLOCK_N": 64}},
    "reference": {"function": "torch.mul", "args": ["x", "two"]},
    "bytes": "2 * M * N * 4",
}


@dataclass(frozen=True)
class Candidate:
    """A variant (good ones too), the statuses the evaluator may give it, and where it can run."""

    name: str
    source: str
    statuses: tuple[str, ...]
    in_process: bool = True  # False: it kills, hangs or (CUDA) breaks its process; only a worker may run it
    gpu: bool = False  # needs CUDA to misbehave


CACHING_LAUNCH = """

_memo = {}


def launch(kernel, grid, args, meta):
    if "y" in _memo:  # every later call copies the first result: right on the first input only
        args["y"].copy_(_memo["y"])
        return
    kernel[grid](**args, **meta)
    _memo["y"] = args["y"].clone()
"""
STALE_INPUT_LAUNCH = """

_first = {}


def launch(kernel, grid, args, meta):
    x = _first.setdefault("x", args["x"])  # always reads the first input it saw
    kernel[grid](**{**args, "x": x}, **meta)
"""
SIDE_STREAM_LAUNCH = """

def launch(kernel, grid, args, meta):
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # the caller's stream (and a CUDA graph captured on it) never sees this work
        kernel[grid](**args, **meta)
"""
SLEEPING_LAUNCH = """

def launch(kernel, grid, args, meta):
    time.sleep(3600)
"""

GOOD = [
    Candidate("good_sum", source("good_sum", {"v * 2.0": "v + v"}), ("ok",)),
    Candidate("good_scale_first", source("good_scale_first", {"v * 2.0": "2.0 * v"}), ("ok",)),
]
EARLY_RETURN = (
    "    if tl.load(x + row * N) > 1.0:  # skips the rows that start above 1.0\n        return\n    v = tl.load"
)
WRITES_INPUT = "    tl.store(x + row * N + cols, v + 1.0, mask=ok)  # writes its input\n    tl.store(y"
ENDLESS_LOOP = "    while row < N:\n        tl.store(y + row * N, 0.0)\n"
BAD = [
    Candidate("wrong", source("wrong", {"v * 2.0": "v * 2.0 + 0.01"}), ("wrong",)),
    Candidate(
        "partial_write", source("partial_write", {"v * 2.0, mask=ok)": "v * 2.0, mask=cols < N - 1)"}), ("unwritten",)
    ),
    Candidate("early_return", source("early_return", {"    v = tl.load": EARLY_RETURN}), ("unwritten",)),
    Candidate("caches_result", source("caches_result", launcher=CACHING_LAUNCH), ("wrong_on_fresh_input",)),
    Candidate(
        "ignores_fresh_input", source("ignores_fresh_input", launcher=STALE_INPUT_LAUNCH), ("wrong_on_fresh_input",)
    ),
    Candidate("mutates_input", source("mutates_input", {"    tl.store(y": WRITES_INPUT}), ("mutated_input",)),
    Candidate(
        "compile_error",
        source("compile_error", {"row = tl.program_id(0)": "row = tl.program_id(0) +"}),
        ("compile_error",),
    ),
    Candidate("unbound_argument", source("unbound_argument", {"N, BLOCK_N": "N, scale, BLOCK_N"}), ("launch_error",)),
    # far out of bounds: the interpreter segfaults (the pool records a crash); a GPU raises an illegal access
    Candidate(
        "illegal_access",
        source("illegal_access", {"x + row * N + cols,": "x + row * N + cols + (1 << 40),"}),
        ("crash", "runtime_error"),
        in_process=False,
    ),
    Candidate(
        "endless_loop",
        # a runtime condition that stays true (Triton refuses a constant `while True`), a store so it is not removed
        source("endless_loop", {"    v = tl.load": ENDLESS_LOOP + "    v = tl.load"}),
        ("timeout",),
        in_process=False,
    ),
    Candidate(
        "sleeping_launcher", source("sleeping_launcher", launcher=SLEEPING_LAUNCH), ("timeout",), in_process=False
    ),
    Candidate(
        "side_stream",
        source("side_stream", launcher=SIDE_STREAM_LAUNCH),
        ("stream_escape",),
        in_process=False,  # a failed CUDA graph capture may leave the process's CUDA context unusable
        gpu=True,
    ),
]
BY_NAME = {b.name: b for b in GOOD + BAD}


def variant_name(source_text: str) -> str:
    """The name a variant's ``# variant:`` line gives."""
    for line in source_text.splitlines():
        if line.startswith("# variant: "):
            return line.removeprefix("# variant: ").strip()
    raise ValueError("no '# variant:' line")


def write_spec(folder: Path) -> Path:
    """The tiny spec as a file (workers load specs from files); its path."""
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / "double_rows.json"
    path.write_text(json.dumps(SPEC, indent=2))
    return path


def spec():
    return parse_spec(SPEC)


def control_for(outdir: Path, spec_path: Path, variant_source: str, device: str = "cpu") -> str:
    """A control file for one variant (through RunStore.write_variant, as the search writes them); its path."""
    v = Variant.make(variant_source, spec().launch.model_dump())
    control = {
        "spec": str(spec_path), "device": device, "small": False, "seed": SEED, "fresh_seed": FRESH_SEED,
        "warmup_ms": 1, "rep_ms": 5,
    }  # fmt: skip
    return RunStore(outdir, SPEC["name"]).write_variant(v, "triton", control, BASELINE)


def early_return_triggers(seed: int) -> bool:
    """Whether some row of the input made with ``seed`` starts above 1.0 (the early_return variant skips it)."""
    case = make_case(spec(), "cpu", seed, small=False)
    return bool((case.inputs["x"][:, 0] > 1.0).any())


def reply(b: Candidate, move: str = "vectorize_global_loads") -> str:
    """A language model's reply giving the variant as a full source."""
    return f"MOVE: {move}\nWider loads.\n```python\n{b.source}```\n"


def result_of(outdir: Path, variant_id: str) -> dict:
    return json.loads((Path(outdir) / "kernels" / SPEC["name"] / "variants" / variant_id / "result.json").read_text())
