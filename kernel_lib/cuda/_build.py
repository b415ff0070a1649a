"""Build and load the C++/CUDA extension once per source version, machine and architecture.

``torch.utils.cpp_extension.load`` compiles ``csrc/ops.cpp`` with the host compiler, and the CUDA sources (one
``.cu`` per op, ``csrc/rms_norm.cu`` and ``csrc/softmax.cu``, sharing the ``.cuh`` headers) with nvcc, side by
side (ninja runs one compiler per source), when a CUDA device and nvcc are both present, into a shared library
that registers the ``kernel_lib_cuda::`` operators when loaded. The build folder's name is a hash of the sources,
torch's version and the target architecture, under ``~/.cache/kernel_lib/cuda`` (``KERNEL_LIB_CUDA_CACHE``
overrides it): a second process, or a second notebook run, finds the library and loads it without compiling
(ninja sees nothing to do).

Architecture: the device's own, ``sm_XY``. Thread-block clusters and distributed shared memory, which the
wide-row kernels use on Hopper, are part of ``sm_90``; the ``sm_90a`` target (wgmma, setmaxnreg) would tie the
library to Hopper exactly, for instructions these kernels do not use.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import sysconfig
import time
from dataclasses import dataclass
from pathlib import Path

import torch

CSRC = Path(__file__).parent / "csrc"


@dataclass
class BuildInfo:
    path: str  # the build folder
    with_cuda: bool  # CUDA kernels compiled in
    arch: str  # e.g. "sm_90a", "" without CUDA
    seconds: float  # time load() took in this process
    cached: bool  # the library was already built: nothing compiled


_INFO: BuildInfo | None = None


def _cuda_arch() -> str:
    major, minor = torch.cuda.get_device_capability()
    return f"sm_{major}{minor}"


def _can_build_cuda() -> bool:
    return torch.cuda.is_available() and torch.version.cuda is not None and shutil.which("nvcc") is not None


def load(verbose: bool = False) -> BuildInfo:
    """Build (or find) and load the extension; returns what happened. Safe to call again: loads once."""
    global _INFO
    if _INFO is not None:
        return _INFO
    from torch.utils import cpp_extension

    if shutil.which("ninja") is None:  # pip's ninja puts its binary next to this interpreter, maybe not on PATH
        scripts = sysconfig.get_path("scripts")
        os.environ["PATH"] = scripts + os.pathsep + os.environ.get("PATH", "")
        if shutil.which("ninja") is None:
            raise RuntimeError("kernel_lib.cuda builds with ninja: pip install ninja (or your system's package)")
    with_cuda = _can_build_cuda()
    arch = _cuda_arch() if with_cuda else ""
    sources = [CSRC / "ops.cpp"] + (sorted(CSRC.glob("*.cu")) if with_cuda else [])
    # No -std: cpp_extension passes the standard this torch was built with (C++20 from torch 2.10, C++17 before);
    # headers compiled under another standard than libtorch's can disagree with it on inline code.
    cflags = ["-O3"] + (["-DKL_WITH_CUDA"] if with_cuda else [])
    cuda_flags = []
    if with_cuda:
        compute = arch.replace("sm_", "compute_")
        cuda_flags = ["-O3", "--expt-relaxed-constexpr", "-DKL_WITH_CUDA", "-lineinfo",
                      f"-gencode=arch={compute},code={arch}"]  # fmt: skip
    digest = hashlib.sha256()
    for path in sorted(CSRC.iterdir()):
        if path.suffix in (".cpp", ".cu", ".h", ".cuh"):
            digest.update(path.name.encode() + path.read_bytes())
    # the folder's ninja file names the sources by absolute path: two checkouts must not share (and rebuild) one
    digest.update(f"{torch.__version__}|{arch}|{CSRC.resolve()}|{cflags}|{cuda_flags}".encode())
    name = f"kernel_lib_cuda_{digest.hexdigest()[:12]}"
    root = Path(os.environ.get("KERNEL_LIB_CUDA_CACHE", Path.home() / ".cache" / "kernel_lib" / "cuda"))
    build = root / name
    build.mkdir(parents=True, exist_ok=True)
    cached = (build / f"{name}.so").exists()
    start = time.perf_counter()
    cpp_extension.load(
        name=name,
        sources=[str(s) for s in sources],
        extra_cflags=cflags,
        extra_cuda_cflags=cuda_flags,
        extra_include_paths=[str(CSRC)],
        build_directory=str(build),
        with_cuda=with_cuda,
        is_python_module=False,  # the library registers torch.ops.kernel_lib_cuda.* when loaded
        verbose=verbose,
    )
    _INFO = BuildInfo(str(build), with_cuda, arch, time.perf_counter() - start, cached)
    return _INFO
