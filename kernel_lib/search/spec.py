"""The kernel spec: what to optimize, how to launch it, what it reads and writes, and how to check it.

A spec is one JSON file (schema below, validated on load by pydantic; a bad field is named in the error)::

    {
      "name": "rms_norm",                      # folder name under out/kernels/
      "kind": "triton",                        # or "cuda"
      "source_path": "rms_norm.py",            # or "source": "<inline text>"; a path is relative to the spec
      "entry": "rms_norm_fwd",                 # the kernel's name in the source
      "sizes": {"M": 16384, "N": 4096},        # symbols used by shapes, grid and scalars
      "small_sizes": {"M": 24, "N": 200},      # used instead on a CPU (Triton interpreter): same code, small data
      "inputs":  [{"name": "x", "shape": ["M", "N"], "dtype": "bfloat16", "init": "randn"}, ...],
      "outputs": [{"name": "y", "shape": ["M", "N"], "dtype": "bfloat16"}],
      "scalars": {"eps": 1e-6, "stride": "N"}, # numbers, or expressions over sizes
      "launch": {"grid": "(M,)", "num_warps": 1, "num_stages": 1, "constexprs": {"BLOCK_N": 128}},
      "tunable": {"BLOCK_N": [64, 4096], "num_warps": [1, 16]},   # bounds of change_block_sizes (powers of two)
      "tails": {"BLOCK_N": "N"},               # which size each block tiles: pad_tail_and_mask's EVEN_TAIL
      "reference": {"function": "kernel_lib.ops.norms.rms_norm_ref", "args": ["x", "w", "eps"]},
                                               # or "my_ref.rms_norm_ref" with my_ref.py beside the spec
      "bytes": "2 * M * N * 2", "flops": null  # for GB/s and TFLOP/s in the results (optional)
    }

Kernel arguments are bound by name: a tensor of ``inputs``/``outputs``, a symbol of ``sizes``, a ``scalars`` entry,
or a constexpr of ``launch``. A kernel argument none of them names fails the evaluation (``launch_error``), the
baseline's first of all. For a CUDA kernel, ``launch`` has ``grid`` and ``block`` (expressions giving up
to three dims) and ``shared_mem`` bytes, and ``args`` lists the kernel's parameters in order (CUDA has no names to
bind by).

Expressions (grid, scalars, constexprs, bytes, flops, shapes) are Python arithmetic over the sizes, scalars and
constexprs, with ``cdiv``, ``min``, ``max`` and ``next_pow2``; nothing else is callable.
"""

from __future__ import annotations

import ast
import json
import math
import os
from pathlib import Path
from typing import Annotated, Any, Literal, TypeVar, Union

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

DTYPES = ("float32", "float16", "bfloat16", "float64", "int32", "int64", "int8", "uint8", "bool")
INITS = ("randn", "uniform", "zeros", "ones", "full", "arange", "randint", "file")


class SpecError(ValueError):
    """A spec that cannot be used; the message names the file and the field."""


# --------------------------------------------------------------------------------------------------
# Expressions
# --------------------------------------------------------------------------------------------------
def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def next_pow2(n: int) -> int:
    return 1 << max(0, int(n) - 1).bit_length()


FUNCTIONS = {"cdiv": cdiv, "min": min, "max": max, "next_pow2": next_pow2}
_ALLOWED_NODES = (
    ast.Expression, ast.BinOp, ast.UnaryOp, ast.BoolOp, ast.Compare, ast.IfExp, ast.Call, ast.Name, ast.Load,
    ast.Constant, ast.Tuple, ast.List, ast.operator, ast.unaryop, ast.boolop, ast.cmpop,
)  # fmt: skip


def check_expression(text: str) -> ast.Expression:
    """Parse ``text`` as an arithmetic expression; raise ValueError on anything else (attributes, lambdas...)."""
    try:
        tree = ast.parse(str(text), mode="eval")
    except SyntaxError as exc:
        raise ValueError(f"not an expression: {text!r} ({exc.msg})") from None
    for node in ast.walk(tree):
        if not isinstance(node, _ALLOWED_NODES):
            raise ValueError(f"{text!r}: {type(node).__name__} is not allowed in an expression")
        if isinstance(node, ast.Call) and not (isinstance(node.func, ast.Name) and node.func.id in FUNCTIONS):
            raise ValueError(f"{text!r}: only {', '.join(FUNCTIONS)} can be called")
    return tree


def check_expressions(value: Any) -> Any:
    """Check every string in ``value`` (a string, a number, None, or a dict of them) as an expression; return it."""
    for item in value.values() if isinstance(value, dict) else [value]:
        if isinstance(item, str):
            check_expression(item)
    return value


def evaluate(text: Any, names: dict[str, Any]) -> Any:
    """The value of an expression (numbers pass through) with ``names`` and the allowed functions in scope."""
    if isinstance(text, (int, float, bool)) or text is None:
        return text
    tree = check_expression(text)
    try:
        return eval(compile(tree, "<spec>", "eval"), {"__builtins__": {}}, {**FUNCTIONS, **names})  # noqa: S307
    except NameError as exc:
        raise ValueError(f"{text!r}: {exc}; known names: {', '.join(sorted(names))}") from None


def resolve_constexprs(constexprs: dict[str, Any], scope: dict[str, Any]) -> dict[str, Any]:
    """Evaluate constexpr expressions; one may use another (EVEN_TAIL uses BLOCK_N), in any order."""
    todo, done = dict(constexprs), {}
    while todo:
        progress = False
        for key, value in list(todo.items()):
            try:
                done[key] = evaluate(value, {**scope, **done})
            except ValueError:
                continue
            del todo[key]
            progress = True
        if not progress:
            key, value = next(iter(todo.items()))
            evaluate(value, {**scope, **done})  # raises the error that names the unknown name
    return done


# --------------------------------------------------------------------------------------------------
# The schema
# --------------------------------------------------------------------------------------------------
class _Model(BaseModel):
    model_config = ConfigDict(extra="forbid")  # a misspelt field is an error, not silently ignored


Dim = Union[int, str]
_V = TypeVar("_V")
Exprs = Annotated[_V, AfterValidator(check_expressions)]  # a field whose strings are expressions, checked on load


class TensorSpec(_Model):
    """One tensor of the IO contract."""

    name: str
    shape: list[Dim]
    dtype: Literal[DTYPES] = "float32"  # type: ignore[valid-type]
    init: Literal[INITS] = "randn"  # type: ignore[valid-type]  # outputs are always poisoned instead
    scale: float = 1.0  # randn: standard deviation
    low: float = 0.0  # uniform and randint bounds
    high: float = 1.0
    value: float | None = None  # full
    start: Exprs[Union[float, str]] = 0.0  # arange: start + step * i, flattened (numbers or expressions over sizes)
    step: Exprs[Union[float, str]] = 1.0
    file: str | None = None  # init "file": a tensor saved by save_tensors (zlib), relative to the spec

    @field_validator("shape")
    @classmethod
    def _shape(cls, shape):
        for dim in shape:
            if isinstance(dim, str):
                check_expression(dim)
            elif dim < 0:
                raise ValueError(f"negative dimension {dim}")
        return shape

    @model_validator(mode="after")
    def _init_args(self):
        if self.init == "full" and self.value is None:
            raise ValueError("init 'full' needs a 'value'")
        if self.init == "file" and not self.file:
            raise ValueError("init 'file' needs a 'file'")
        return self


class Launch(_Model):
    """How to launch: Triton grid and meta-parameters, or CUDA grid, block and dynamic shared memory."""

    grid: Exprs[str]
    num_warps: int = 4
    num_stages: int = 1
    constexprs: Exprs[dict[str, Union[int, bool, str]]] = Field(default_factory=dict)  # str: an expression
    block: Exprs[str | None] = None  # CUDA: threads per block, e.g. "(BLOCK,)"
    shared_mem: Exprs[Union[int, str]] = 0  # CUDA: dynamic shared memory bytes
    args: list[str] | None = None  # CUDA: the kernel's parameters in order

    @field_validator("num_warps")
    @classmethod
    def _warps(cls, n):
        if n < 1 or n > 32 or n & (n - 1):
            raise ValueError(f"num_warps must be a power of two from 1 to 32, got {n}")
        return n


class Tolerance(_Model):
    """The course's rule: max|out - ref64| <= factor * max|torch_lowp - ref64| + atol + rtol * max|ref64|."""

    factor: float = 2.0
    atol: float = 1e-6
    rtol: float = 0.0


class Reference(_Model):
    """A PyTorch function from inputs to outputs, run in float64 (the truth) and in the inputs' dtype (the
    low-precision baseline of the tolerance rule)."""

    function: str  # dotted path: package.module.function (an installed module, or one in search_path)
    # a folder to import the function's module from when it is not installed: default the spec's own folder, so a
    # reference module beside the spec needs no PYTHONPATH (the run folder's spec.json records it, absolute)
    search_path: str | None = None
    args: list[str] | None = None  # names of inputs/scalars/sizes passed positionally; default: the inputs
    kwargs: dict[str, str] = Field(default_factory=dict)  # parameter -> name of an input/scalar/size
    tolerance: Tolerance = Field(default_factory=Tolerance)
    tolerances: dict[str, Tolerance] = Field(default_factory=dict)  # per output, overriding `tolerance`

    @field_validator("function")
    @classmethod
    def _dotted(cls, path):
        if "." not in path:
            raise ValueError(f"a dotted path such as kernel_lib.ops.norms.rms_norm_ref, got {path!r}")
        return path


class KernelSpec(_Model):
    name: str
    kind: Literal["triton", "cuda"]
    source: str | None = None
    source_path: str | None = None
    entry: str
    launcher: str | None = None  # a function of the source that launches the kernel itself (see worker.py)
    sizes: dict[str, int] = Field(default_factory=dict)
    small_sizes: dict[str, int] = Field(default_factory=dict)
    inputs: list[TensorSpec]
    outputs: list[TensorSpec]
    scalars: Exprs[dict[str, Union[int, float, bool, str]]] = Field(default_factory=dict)
    launch: Launch
    tunable: dict[str, list[int]] = Field(default_factory=dict)
    tails: dict[str, str] = Field(default_factory=dict)  # block constexpr -> the size it tiles (pad_tail_and_mask)
    package: str | None = None  # the package the source's relative imports refer to (e.g. kernel_lib.ops)
    reference: Reference
    bytes: Exprs[str | None] = None
    flops: Exprs[str | None] = None
    description: str = ""
    path: str | None = Field(default=None, exclude=True)  # where it was loaded from (set by load_spec)

    @field_validator("name")
    @classmethod
    def _name(cls, name):
        if not name or not all(c.isalnum() or c in "_-." for c in name):
            raise ValueError(f"use letters, digits, '_', '-' or '.', got {name!r}")
        return name

    @field_validator("tunable")
    @classmethod
    def _bounds(cls, tunable):
        for knob, bounds in tunable.items():
            if len(bounds) != 2 or bounds[0] > bounds[1] or bounds[0] < 1:
                raise ValueError(f"{knob}: bounds are [low, high] with 1 <= low <= high, got {bounds}")
        return tunable

    @model_validator(mode="after")
    def _consistent(self):
        if (self.source is None) == (self.source_path is None):
            raise ValueError("give exactly one of 'source' and 'source_path'")
        names = [t.name for t in self.inputs + self.outputs] + list(self.scalars) + list(self.sizes)
        dup = sorted({n for n in names if names.count(n) > 1})
        if dup:
            raise ValueError(f"names used twice among inputs, outputs, scalars and sizes: {dup}")
        if not self.outputs:
            raise ValueError("a kernel needs at least one output")
        if self.small_sizes and set(self.small_sizes) != set(self.sizes):
            raise ValueError(f"small_sizes must give the same symbols as sizes ({sorted(self.sizes)})")
        if self.kind == "cuda" and (self.launch.block is None or self.launch.args is None):
            raise ValueError("a CUDA kernel's launch needs 'block' and 'args' (its parameters in order)")
        known = set(names) | set(self.launch.constexprs)
        for name in (self.reference.args or []) + list(self.reference.kwargs.values()):
            if name not in known:
                raise ValueError(f"reference argument {name!r} is not an input, scalar or size")
        return self

    # ---------------------------------------------------------------- helpers
    def source_text(self) -> str:
        if self.source is not None:
            return self.source
        return Path(self.resolve(self.source_path)).read_text()

    def resolve(self, relative: str) -> str:
        """A path of the spec (source, tensor file) made absolute against the spec's folder."""
        if os.path.isabs(relative) or self.path is None:
            return relative
        return str(Path(self.path).parent / relative)

    def sizes_for(self, small: bool) -> dict[str, int]:
        return dict(self.small_sizes) if small and self.small_sizes else dict(self.sizes)


def _field_path(loc: tuple) -> str:
    return ".".join(str(p) for p in loc) or "(top level)"


def parse_spec(data: dict, path: str | None = None) -> KernelSpec:
    """Validate a spec given as a dict; SpecError names each bad field."""
    where = path or "spec"
    try:
        spec = KernelSpec.model_validate(data)
    except ValidationError as exc:
        lines = [f"  field '{_field_path(e['loc'])}': {e['msg']}" for e in exc.errors()]
        raise SpecError(f"{where}: invalid kernel spec\n" + "\n".join(lines)) from None
    spec.path = os.path.abspath(path) if path else None
    if spec.source_path is not None and not os.path.exists(spec.resolve(spec.source_path)):
        raise SpecError(f"{where}: field 'source_path': no file {spec.resolve(spec.source_path)}")
    try:
        spec.source_text()
    except OSError as exc:
        raise SpecError(f"{where}: field 'source_path': {exc}") from None
    return spec


def load_spec(path: str | os.PathLike) -> KernelSpec:
    """Read and validate one spec file."""
    path = str(path)
    try:
        with open(path) as f:
            data = json.load(f)
    except json.JSONDecodeError as exc:
        raise SpecError(f"{path}: not valid JSON: {exc.msg} at line {exc.lineno}, column {exc.colno}") from None
    except OSError as exc:
        raise SpecError(f"{path}: {exc.strerror}") from None
    if not isinstance(data, dict):
        raise SpecError(f"{path}: a kernel spec is a JSON object, got {type(data).__name__}")
    return parse_spec(data, path)


def find_specs(path: str | os.PathLike, errors: list[str] | None = None) -> list[KernelSpec]:
    """One spec file, or every ``*.json`` of a folder (sorted by name). With ``errors``, a folder's bad specs are
    skipped and their messages appended there (the good ones still run); without it the first bad one raises."""
    path = Path(path)
    if path.is_dir():
        files = sorted(path.glob("*.json"))
        if not files:
            raise SpecError(f"{path}: no *.json spec files in this folder")
        specs = []
        for f in files:
            try:
                specs.append(load_spec(f))
            except SpecError as exc:
                if errors is None:
                    raise
                errors.append(str(exc))
        return specs
    if not path.exists():
        raise SpecError(f"{path}: no such file or folder")
    return [load_spec(path)]


def pow2_range(low: int, high: int) -> list[int]:
    return [1 << i for i in range(int(math.log2(low)), int(math.log2(high)) + 1) if low <= 1 << i <= high]
