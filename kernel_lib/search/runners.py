"""Runners: turn a variant's files into a callable that launches the kernel on the contract's tensors.

Triton: ``kernel_module.py`` is imported under a unique module name (``package`` of the spec lets its relative
imports resolve); the entry is a ``@triton.jit`` function launched as ``entry[grid](**bound, num_warps=...,
num_stages=..., **constexprs)``; arguments are bound by name. A module may define its own launcher (the spec's
``launcher``): ``launcher(kernel, grid, args, meta)``, called instead; it must launch on the current stream.

CUDA: ``kernel.cu`` is compiled with nvcc to a cubin (and PTX and SASS next to it, for a person to read) into a
content-hashed cache (``$KERNEL_LIB_CACHE_DIR/cuda`` or ``~/.cache/kernel_lib/cuda``: same source, options and
architecture, same file), then loaded by CuPy's ``RawModule``; without nvcc CuPy compiles it with NVRTC. Constexprs
become ``-D`` defines; ``launch.args`` gives the parameters in order (ints pass as int32, floats as float32).
"""

from __future__ import annotations

import hashlib
import importlib.util
import os
import shutil
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from .spec import KernelSpec, evaluate, resolve_constexprs


class LaunchError(RuntimeError):
    """The variant cannot be launched as the spec says (unbound argument, bad grid): the variant's fault."""


class CudaCompileError(RuntimeError):
    """nvcc rejected the source (recorded as ``compile_error``, its log as the reason)."""


def _grid(launch: dict, scope: dict) -> tuple[int, ...]:
    grid = evaluate(launch["grid"], scope)
    grid = tuple(grid) if isinstance(grid, (tuple, list)) else (grid,)
    if not 1 <= len(grid) <= 3 or any(int(g) < 0 for g in grid):
        raise LaunchError(f"grid {launch['grid']!r} gave {grid}: one to three non-negative dims")
    return tuple(int(g) for g in grid)


def import_module(path: str, name: str, package: str | None) -> Any:
    mod_name = f"{package}.{name}" if package else name
    module_spec = importlib.util.spec_from_file_location(mod_name, path)
    module = importlib.util.module_from_spec(module_spec)
    sys.modules[mod_name] = module  # triton reads the source through inspect, which needs the module registered
    module_spec.loader.exec_module(module)
    return module


def triton_binder(spec: KernelSpec, launch: dict, module_path: str) -> Callable[[dict, dict], Callable[[], None]]:
    module = import_module(module_path, f"_kernel_search_{Path(module_path).parent.name}", spec.package)
    kernel = getattr(module, spec.entry, None)
    if kernel is None:
        raise LaunchError(f"the source defines no {spec.entry!r}")
    custom = getattr(module, spec.launcher, None) if spec.launcher else None
    if spec.launcher and custom is None:
        raise LaunchError(f"the source defines no launcher {spec.launcher!r}")
    params = list(getattr(kernel, "arg_names", []))

    def bind(tensors: dict, scope: dict, compile_only: bool = False) -> Callable[[], None]:
        constexprs = resolve_constexprs(launch["constexprs"], scope)
        scope = {**scope, **constexprs}
        grid = _grid(launch, scope)
        values = {**scope, **tensors}
        missing = [p for p in params if p not in values]
        if missing:
            raise LaunchError(f"kernel arguments not named by the spec (inputs, outputs, scalars, sizes): {missing}")
        args = {p: values[p] for p in params if p not in constexprs}
        meta = {"num_warps": launch["num_warps"], "num_stages": launch["num_stages"], **constexprs}
        if compile_only:  # build the binary for these arguments, launch nothing (JITFunction.warmup)
            return (lambda: None) if custom is not None else (lambda: kernel.warmup(**args, grid=grid, **meta))
        if custom is not None:
            return lambda: custom(kernel, grid, args, meta)
        return lambda: kernel[grid](**args, **meta)

    return bind


# --------------------------------------------------------------------------------------------------
# CUDA C++
# --------------------------------------------------------------------------------------------------
def cache_dir() -> Path:
    root = os.environ.get("KERNEL_LIB_CACHE_DIR") or os.path.join(os.path.expanduser("~"), ".cache", "kernel_lib")
    return Path(root) / "cuda"


def _arch() -> str:
    major, minor = torch.cuda.get_device_capability()
    return f"sm_{major}{minor}" + ("a" if major >= 9 else "")  # 'a': Hopper's wgmma/setmaxnreg need sm_90a


def compile_cuda(source: str, defines: dict[str, Any], out_dir: str) -> tuple[str | None, list[str]]:
    """nvcc -> cubin in the content-hashed cache, plus kernel.ptx and kernel.sass in ``out_dir``.

    Returns (cubin path or None when nvcc is absent, the options used). Raises RuntimeError with nvcc's log.
    """
    options = [f"-D{k}={int(v) if isinstance(v, bool) else v}" for k, v in sorted(defines.items())]
    options += ["-O3", "-std=c++17", "-lineinfo"]
    nvcc = shutil.which("nvcc")
    if nvcc is None:
        return None, options
    arch = _arch()
    key = hashlib.sha256("\n".join([source, arch, *options]).encode()).hexdigest()[:20]
    cache = cache_dir()
    cache.mkdir(parents=True, exist_ok=True)
    cubin, ptx = cache / f"{key}.cubin", cache / f"{key}.ptx"
    src = Path(out_dir) / "kernel.cu"
    if not src.exists():
        src.write_text(source)
    if not cubin.exists():
        for kind, target in (("-cubin", cubin), ("-ptx", ptx)):
            tmp = f"{target}.{os.getpid()}.tmp"
            cmd = [nvcc, kind, f"-arch={arch}", *options, "-o", tmp, str(src)]
            done = subprocess.run(cmd, capture_output=True, text=True)
            if done.returncode != 0:
                raise CudaCompileError(f"nvcc failed:\n{done.stderr.strip()}")
            os.replace(tmp, target)  # atomic: a concurrent worker sees a whole file or none
    shutil.copyfile(ptx, Path(out_dir) / "kernel.ptx")
    cuobjdump = shutil.which("cuobjdump")
    if cuobjdump:
        sass = subprocess.run([cuobjdump, "-sass", str(cubin)], capture_output=True, text=True).stdout
        (Path(out_dir) / "kernel.sass").write_text(sass)
    return str(cubin), options


def cuda_binder(spec: KernelSpec, launch: dict, source_path: str) -> Callable[[dict, dict], Callable[[], None]]:
    try:
        import cupy
        import numpy as np
    except ImportError:
        raise LaunchError("CUDA kernels need CuPy: pip install cupy-cuda12x (or cupy-cuda13x)") from None
    if not torch.cuda.is_available():
        raise LaunchError("CUDA kernels need a CUDA GPU; this machine has none")
    source = Path(source_path).read_text()
    constexprs_text = launch["constexprs"]
    compiled: dict[tuple, Any] = {}

    def bind(tensors: dict, scope: dict, compile_only: bool = False) -> Callable[[], None]:
        constexprs = resolve_constexprs(constexprs_text, scope)
        key = tuple(sorted(constexprs.items()))
        if key not in compiled:
            cubin, options = compile_cuda(source, constexprs, str(Path(source_path).parent))
            if cubin is not None:
                module = cupy.RawModule(path=cubin)
            else:
                module = cupy.RawModule(code=source, options=tuple(options[:-2]))  # NVRTC: no -O3, -lineinfo
            compiled[key] = module.get_function(spec.entry)
        fn = compiled[key]
        if compile_only:
            return lambda: None
        full = {**scope, **constexprs}
        grid, block = _grid(launch, full), _grid({"grid": launch["block"]}, full)
        shared = int(evaluate(launch["shared_mem"], full))
        values = {**full, **tensors}
        missing = [a for a in launch["args"] if a not in values]
        if missing:
            raise LaunchError(f"kernel arguments not named by the spec: {missing}")

        def convert(value):
            if isinstance(value, torch.Tensor):
                return cupy.asarray(value)  # zero-copy through __cuda_array_interface__
            if isinstance(value, (bool, int)):
                return np.int32(value)
            return np.float32(value)

        args = tuple(convert(values[a]) for a in launch["args"])

        def run():
            with cupy.cuda.ExternalStream(torch.cuda.current_stream().cuda_stream):
                fn(grid, block, args, shared_mem=shared)

        return run

    return bind


def make_binder(spec: KernelSpec, launch: dict, path: str) -> Callable[[dict, dict], Callable[[], None]]:
    """Load (and for CUDA compile) a variant; the result binds it to one set of tensors as a no-argument call."""
    if spec.kind == "cuda":
        return cuda_binder(spec, launch, path)
    return triton_binder(spec, launch, path)
