"""The machine: what it is (:func:`environment`: GPU, torch and triton versions, the time) and its two roofs
(:func:`measure_ceilings`: device-to-device copy bandwidth, bytes read + bytes written, and dense matmul TFLOP/s
per dtype), against which every throughput in the course is drawn."""

from __future__ import annotations

import datetime as _dt
import os
import platform
from collections.abc import Callable, Iterable
from dataclasses import dataclass

import torch

from .timing import _default_device, _device_type, gbps, tflops, time_fn


# --------------------------------------------------------------------------------------------------
# The machine: environment and ceilings
# --------------------------------------------------------------------------------------------------
def _triton_version() -> str:
    try:
        import triton

        return triton.__version__
    except ImportError:
        return "not installed"


def device_name(device: str | torch.device | None = None) -> str:
    """'NVIDIA H100 80GB HBM3' for a GPU, the processor's name for the CPU."""
    device_type = _device_type(device)
    if device_type == "cuda":
        return torch.cuda.get_device_name(torch.device(device) if device is not None else None)
    return f"CPU ({platform.processor() or platform.machine()}, {os.cpu_count()} cores)"


def environment(device: str | torch.device | None = None) -> dict[str, str]:
    """What every measurement must be reported with: device, versions, and when."""
    info = {
        "device": device_name(device),
        "torch": torch.__version__,
        "triton": _triton_version(),
        "cuda": str(torch.version.cuda),
        "python": platform.python_version(),
        "timestamp": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
    }
    return info


def full_sizes() -> bool:
    """Whether a notebook runs its full, published problem sizes: on a CUDA GPU, unless ``KERNEL_COURSE_SIZES=small``.

    ``make test-gpu`` sets it for its pass over the notebooks: every kernel, check and plot runs on the GPU at the
    sizes the CPU uses, which proves the notebooks work in minutes but times nothing worth reading. ``make execute``
    leaves it unset and stores the full runs the book shows.
    """
    size = os.environ.get("KERNEL_COURSE_SIZES", "full")
    if size not in ("full", "small"):
        raise ValueError(f"KERNEL_COURSE_SIZES must be 'full' or 'small', got {size!r}")
    return torch.cuda.is_available() and size == "full"


def require_gpu(script: str) -> dict[str, str]:
    """For benchmark scripts: exit with one line without a CUDA GPU; else print and return :func:`environment`."""
    if not torch.cuda.is_available():
        raise SystemExit(f"{script} needs a CUDA GPU")
    env = environment()
    print(f"{env['device']} | torch {env['torch']} | triton {env['triton']}", flush=True)
    return env


def l2_cache_bytes(device: int = 0) -> int | None:
    """The GPU's L2 cache size in bytes, or None when unknown (e.g. no GPU)."""
    if not torch.cuda.is_available():
        return None
    return getattr(torch.cuda.get_device_properties(device), "L2_cache_size", None)


def copy_bandwidth(nbytes: int | None = None, device: str | None = None, **timing_kwargs) -> float:
    """Device-to-device copy bandwidth in GB/s, counting bytes read plus bytes written.

    ``nbytes`` is the size of one buffer (default 1 GiB on a GPU, far beyond any L2; 64 MiB on the CPU).
    """
    device = device or _default_device()
    if nbytes is None:
        nbytes = 2**30 if device.startswith("cuda") else 2**26
    n = nbytes // 4
    src = torch.randn(n, device=device)
    dst = torch.empty_like(src)
    timing = time_fn(lambda: dst.copy_(src), device=device, **timing_kwargs)
    if not torch.equal(dst, src):
        raise RuntimeError("copy_bandwidth: the copy is wrong; refusing to report its speed")
    return gbps(2 * n * 4, timing.median_ms)


def peak_memory_bytes(fn: Callable[[], object], device: str | torch.device | None = None) -> int:
    """Peak CUDA memory ``fn()`` allocates above what was allocated when it started, in bytes.

    What a step costs in memory beyond its inputs: activations, temporaries, gradients. CUDA only (the CPU
    allocator keeps no such statistics).
    """
    device = torch.device(device) if device is not None else torch.device("cuda")
    if device.type != "cuda":
        raise ValueError(f"peak_memory_bytes measures CUDA memory; got device {device}")
    torch.cuda.synchronize(device)
    torch.cuda.reset_peak_memory_stats(device)
    base = torch.cuda.memory_allocated(device)
    fn()
    torch.cuda.synchronize(device)
    return torch.cuda.max_memory_allocated(device) - base


def matmul_tflops(
    dtype: torch.dtype = torch.bfloat16, n: int | None = None, device: str | None = None, **timing_kwargs
) -> float:
    """Dense n×n×n matmul throughput in TFLOP/s (2·n³ operations) through PyTorch (cuBLAS on a GPU).

    ``torch.float32`` is measured in strict fp32; pass the string ``"tf32"`` for the tensor-core mode.
    """
    device = device or _default_device()
    if n is None:
        n = 8192 if device.startswith("cuda") else 512
    use_tf32 = dtype == "tf32"
    torch_dtype = torch.float32 if use_tf32 else dtype
    a = torch.randn(n, n, device=device, dtype=torch_dtype)
    b = torch.randn(n, n, device=device, dtype=torch_dtype)
    previous = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision("high" if use_tf32 else "highest")
    try:
        timing = time_fn(lambda: a @ b, device=device, **timing_kwargs)
        # The timed product must be a real one: check a few entries against float64.
        rows = torch.randint(0, n, (4,), device=device)
        got = (a[rows] @ b).double()
        want = a[rows].double() @ b.double()
        rel = ((got - want).norm() / want.norm()).item()
        if not rel < 5e-2:
            raise RuntimeError(f"matmul_tflops: product off by {rel:.2e} relative; refusing to report its speed")
    finally:
        torch.set_float32_matmul_precision(previous)
    return tflops(2 * n**3, timing.median_ms)


@dataclass
class Ceilings:
    """The roofs of one machine, measured in one run."""

    device: str
    copy_gbps: float
    matmul_tflops: dict[str, float]

    def rows(self) -> list[dict]:
        out = [{"ceiling": "copy (read + write)", "value": self.copy_gbps, "unit": "GB/s"}]
        out += [{"ceiling": f"matmul {k}", "value": v, "unit": "TFLOP/s"} for k, v in self.matmul_tflops.items()]
        return out


def measure_ceilings(
    device: str | None = None,
    dtypes: Iterable = (torch.bfloat16, torch.float16, "tf32", torch.float32),
    matmul_n: int | None = None,
) -> Ceilings:
    """Measure copy bandwidth and matmul TFLOP/s for each dtype on ``device``."""
    device = device or _default_device()
    peaks = {}
    for dtype in dtypes:
        if device == "cpu" and dtype in (torch.float16, "tf32"):
            continue  # no tensor cores, and fp16 matmul on CPU measures an emulation, not a ceiling
        name = dtype if isinstance(dtype, str) else str(dtype).replace("torch.", "")
        peaks[name] = matmul_tflops(dtype, n=matmul_n, device=device)
    return Ceilings(device=device_name(device), copy_gbps=copy_bandwidth(device=device), matmul_tflops=peaks)
