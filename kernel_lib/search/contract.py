"""The IO contract: tensors made from a spec, the reference they are checked against, and tensors saved to disk.

One contract drives Triton and CUDA runs alike. Inputs come from a seeded generator (the same seed gives the same
bits on one device kind), outputs start poisoned (NaN, or -1 for integers) so an element a kernel forgot fails
the check. ``save_tensors``/``load_tensors`` keep tensors as zlib-compressed ``torch.save`` bytes, so a run can be
reproduced bit for bit on another machine.
"""

from __future__ import annotations

import importlib
import io
import os
import sys
import zlib
from dataclasses import dataclass
from typing import Any

import torch

from ..validate import Check, check, poisoned_like
from .spec import KernelSpec, TensorSpec, evaluate, resolve_constexprs
from .store import replace_atomically

DTYPES = {
    "float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16, "float64": torch.float64,
    "int32": torch.int32, "int64": torch.int64, "int8": torch.int8, "uint8": torch.uint8, "bool": torch.bool,
}  # fmt: skip


INTERPRETER_ULP = {"bfloat16": 2.0**-7, "float16": 2.0**-10}  # one ulp relative to the largest |reference|


def interpreting() -> bool:
    from ..ops._utils import is_interpreting  # one reading of TRITON_INTERPRET for the whole package

    return is_interpreting()


def names(spec: KernelSpec, small: bool, constexprs: dict[str, Any] | None = None) -> dict[str, Any]:
    """Every name an expression may use: sizes, scalars, constexprs, and INTERPRET (Triton's CPU interpreter)."""
    scope: dict[str, Any] = {"INTERPRET": interpreting(), **spec.sizes_for(small)}
    for key, value in spec.scalars.items():
        scope[key] = evaluate(value, scope)
    scope.update(resolve_constexprs(constexprs or {}, scope))
    return scope


def shape_of(t: TensorSpec, scope: dict[str, Any]) -> tuple[int, ...]:
    return tuple(int(evaluate(d, scope)) for d in t.shape)


def make_tensor(t: TensorSpec, spec: KernelSpec, scope: dict, device: str, gen: torch.Generator) -> torch.Tensor:
    shape, dtype = shape_of(t, scope), DTYPES[t.dtype]
    if t.init == "randn":
        x = torch.randn(shape, generator=gen, device=device, dtype=torch.float32) * t.scale
    elif t.init == "uniform":
        x = torch.rand(shape, generator=gen, device=device, dtype=torch.float32) * (t.high - t.low) + t.low
    elif t.init == "randint":
        x = torch.randint(int(t.low), int(t.high), shape, generator=gen, device=device)
    elif t.init == "zeros":
        x = torch.zeros(shape, device=device)
    elif t.init == "ones":
        x = torch.ones(shape, device=device)
    elif t.init == "full":
        x = torch.full(shape, float(t.value), device=device)
    elif t.init == "arange":
        n = 1
        for d in shape:
            n *= d
        start, step = float(evaluate(t.start, scope)), float(evaluate(t.step, scope))
        x = (start + step * torch.arange(n, device=device, dtype=torch.float64)).reshape(shape)
    else:  # file
        x = load_tensors(spec.resolve(t.file))[t.name]
        if tuple(x.shape) != shape:
            raise ValueError(f"{t.file}: tensor {t.name} has shape {tuple(x.shape)}, the spec says {shape}")
        x = x.to(device)
    return x.to(dtype).contiguous()


@dataclass
class Case:
    """One set of inputs with its truth: float64 reference outputs and the low-precision PyTorch baseline."""

    inputs: dict[str, torch.Tensor]
    pristine: dict[str, torch.Tensor]  # copies to prove the kernel did not write its inputs
    ref64: dict[str, torch.Tensor]
    lowp: dict[str, torch.Tensor]
    scope: dict[str, Any]


def _reference_fn(spec: KernelSpec):
    """The reference function: from an installed module, else from a module in the reference's search_path (by
    default the spec's folder)."""
    module_name, _, fn_name = spec.reference.function.rpartition(".")
    folder = spec.reference.search_path or (os.path.dirname(spec.path) if spec.path else None)
    if folder is not None and spec.path is not None:
        folder = spec.resolve(folder)
    try:
        try:
            module = importlib.import_module(module_name)
        except ModuleNotFoundError:
            if folder is None or not os.path.isdir(folder):
                raise
            if folder not in sys.path:
                sys.path.append(folder)  # after the installed packages: a module beside the spec never shadows them
            module = importlib.import_module(module_name)
        return getattr(module, fn_name)
    except (ImportError, AttributeError) as exc:
        where = f" (looked in the installed packages and in {folder})" if folder else ""
        raise ValueError(f"reference {spec.reference.function!r} cannot be imported{where}: {exc}") from None


def _as_tuple(result) -> tuple:
    return tuple(result) if isinstance(result, (tuple, list)) else (result,)


def run_reference(spec: KernelSpec, values: dict[str, Any]) -> dict[str, torch.Tensor]:
    fn = _reference_fn(spec)
    arg_names = spec.reference.args or [t.name for t in spec.inputs]
    outs = _as_tuple(fn(*(values[n] for n in arg_names), **{k: values[v] for k, v in spec.reference.kwargs.items()}))
    if len(outs) != len(spec.outputs):
        raise ValueError(f"reference returned {len(outs)} outputs, the spec lists {len(spec.outputs)}")
    return {t.name: o for t, o in zip(spec.outputs, outs, strict=True)}


def make_case(spec: KernelSpec, device: str, seed: int, small: bool) -> Case:
    scope = names(spec, small)
    gen = torch.Generator(device=device)
    gen.manual_seed(seed)
    inputs = {t.name: make_tensor(t, spec, scope, device, gen) for t in spec.inputs}
    up = {k: v.double() if v.is_floating_point() else v for k, v in inputs.items()}
    ref64 = run_reference(spec, {**scope, **up})
    lowp = run_reference(spec, {**scope, **inputs})
    for t in spec.outputs:
        expected = shape_of(t, scope)
        if tuple(ref64[t.name].shape) != expected:
            raise ValueError(f"reference output {t.name} has shape {tuple(ref64[t.name].shape)}, spec {expected}")
    pristine = {k: v.clone() for k, v in inputs.items()}
    return Case(inputs, pristine, ref64, lowp, scope)


def poisoned_outputs(spec: KernelSpec, case: Case, device: str) -> dict[str, torch.Tensor]:
    shapes = {t.name: torch.empty(shape_of(t, case.scope), device=device, dtype=DTYPES[t.dtype]) for t in spec.outputs}
    return {name: poisoned_like(x) for name, x in shapes.items()}


def compare(spec: KernelSpec, case: Case, outs: dict[str, torch.Tensor]) -> list[Check]:
    """The course's rule per output (validate.check): at most factor x PyTorch's own low-precision error + atol."""
    checks = []
    for t in spec.outputs:
        tol = spec.reference.tolerances.get(t.name, spec.reference.tolerance)
        exact = not outs[t.name].is_floating_point()
        # Triton's interpreter truncates float32 -> bfloat16/float16 (one ulp, not half): allowed on the CPU only
        ulp = INTERPRETER_ULP.get(t.dtype, 0.0) if interpreting() else 0.0
        checks.append(
            check(
                outs[t.name],
                case.ref64[t.name],
                None if exact else case.lowp[t.name],
                name=t.name,
                factor=tol.factor,
                atol=tol.atol,
                rtol=tol.rtol + ulp,
            )
        )
    return checks


def mutated_inputs(case: Case) -> list[str]:
    return [k for k, v in case.inputs.items() if not torch.equal(v, case.pristine[k])]


# --------------------------------------------------------------------------------------------------
# Tensors on disk
# --------------------------------------------------------------------------------------------------
def save_tensors(path: str | os.PathLike, tensors: dict[str, torch.Tensor]) -> None:
    """zlib-compressed ``torch.save`` of CPU copies: the same bits come back on any machine."""
    buffer = io.BytesIO()
    torch.save({k: v.detach().cpu() for k, v in tensors.items()}, buffer)
    replace_atomically(path, lambda f: f.write(zlib.compress(buffer.getvalue(), 6)), binary=True)


def load_tensors(path: str | os.PathLike) -> dict[str, torch.Tensor]:
    with open(path, "rb") as f:
        data = zlib.decompress(f.read())
    return torch.load(io.BytesIO(data), weights_only=True)
