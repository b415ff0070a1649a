"""What every kernel file in kernel_lib shares: where a kernel may run, input checks, and configs.

Three things decide how a call runs:

* CUDA tensors run the compiled Triton kernel.
* CPU tensors run the same Triton kernel under Triton's interpreter when ``TRITON_INTERPRET=1`` was set
  *before* triton was imported (that is how the tests and CPU notebook runs exercise the kernels).
* CPU tensors without the interpreter fall back to the plain PyTorch reference, and say so once.

Matmul-like kernels (attention, grouped GEMM) launch with one config that a heuristic picks from the shape, the
first call at a new shape then costs one compile, not an autotuning sweep; ``KERNEL_LIB_AUTOTUNE=1`` searches the
whole config list instead and keeps its choices on disk. Either way configs are checked against the shared memory
of the device they launch on, so a config tuned on an H100 (up to 227 KB per block, NVIDIA's Hopper tuning
guide) never reaches an RTX 4090 (99 KB, Ada tuning guide); under the interpreter the smallest config is used.
Flash attention goes one step further (``compile_fitting``): it compiles its pick before the first launch and
asks the compiled kernel for the shared memory it really needs, which an estimate can miss.

This file depends on torch alone (triton is imported lazily), so it can be copied with any kernel file.
"""

from __future__ import annotations

import collections
import functools
import hashlib
import inspect
import json
import os
import warnings
from collections.abc import Callable, Iterable, Sequence

import torch

FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)

_warned: set[str] = set()


def warn_once(key: str, message: str) -> None:
    """Emit ``message`` as a UserWarning the first time ``key`` is seen in this process."""
    if key not in _warned:
        _warned.add(key)
        warnings.warn(message, UserWarning, stacklevel=3)


# --------------------------------------------------------------------------------------------------
# Where a kernel runs
# --------------------------------------------------------------------------------------------------
def is_interpreting() -> bool:
    """True when Triton kernels run under the interpreter (``TRITON_INTERPRET=1``)."""
    return os.environ.get("TRITON_INTERPRET", "0").lower() in ("1", "true", "yes", "on")


REFERENCE_RUNS: collections.Counter = collections.Counter()  # op -> calls that ran the reference, not the kernel


def use_triton(*tensors: torch.Tensor, op: str = "kernel") -> bool:
    """Decide whether ``op`` runs its Triton kernel on these tensors (True) or the reference (False).

    CUDA tensors: always the kernel. CPU tensors: the kernel under the interpreter, else the reference,
    with a one-time warning saying so (and a count per op in ``REFERENCE_RUNS``). Any other device raises.
    """
    if all(t.is_cuda for t in tensors if isinstance(t, torch.Tensor)):  # the common case, without building a set
        return True
    devices = {t.device.type for t in tensors if isinstance(t, torch.Tensor)}
    if devices <= {"cpu"}:
        if is_interpreting():
            return True
        if not torch.compiler.is_compiling():  # Dynamo traces the reference; a warning there would break the graph
            REFERENCE_RUNS[op] += 1  # read by the assistant: a kernel swap that never ran its kernel is not credited
            warn_once(
                f"cpu-fallback-{op}",
                f"kernel_lib.{op}: CPU tensors and TRITON_INTERPRET is not set, so the plain PyTorch "
                "reference runs instead of the Triton kernel. Set TRITON_INTERPRET=1 before importing "
                "triton to run the kernel itself on the CPU.",
            )
        return False
    raise ValueError(f"kernel_lib.{op}: tensors on unsupported device(s) {sorted(devices)}; use cuda or cpu")


def launch_or_op(launcher: Callable, op: Callable) -> Callable:
    """What a kernel file's ``autograd.Function`` calls: ``launcher`` in eager mode, ``op`` under torch.compile.

    Each kernel file has one ``autograd.Function``. Eager calls go straight to the Python launcher, because the
    custom op's dispatch (Python to the C++ dispatcher and back) would add host time to every call; while
    torch.compile traces, the same Function calls the registered custom op, which Dynamo records as one opaque
    node whose fake implementation gives the output shapes.
    """
    return op if torch.compiler.is_compiling() else launcher


# --------------------------------------------------------------------------------------------------
# Input checks: raise TypeError / ValueError naming the argument
# --------------------------------------------------------------------------------------------------
def check_tensor(
    x: object,
    name: str,
    *,
    dtypes: Sequence[torch.dtype] | None = FLOAT_DTYPES,
    ndim: int | Iterable[int] | None = None,
    min_ndim: int | None = None,
) -> torch.Tensor:
    """Check that ``x`` is a tensor with an allowed dtype and rank; return it unchanged."""
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
    if dtypes is not None and x.dtype not in dtypes:
        allowed = ", ".join(str(d).replace("torch.", "") for d in dtypes)
        raise TypeError(f"{name} must have dtype in ({allowed}), got {str(x.dtype).replace('torch.', '')}")
    if ndim is not None:
        allowed_ndim = (ndim,) if isinstance(ndim, int) else tuple(ndim)
        if x.dim() not in allowed_ndim:
            raise ValueError(f"{name} must have {' or '.join(map(str, allowed_ndim))} dims, got shape {tuple(x.shape)}")
    if min_ndim is not None and x.dim() < min_ndim:
        raise ValueError(f"{name} must have at least {min_ndim} dims, got shape {tuple(x.shape)}")
    return x


def check_shape(x: torch.Tensor, name: str, shape: Sequence[int]) -> None:
    """Raise ValueError unless ``x.shape == shape``."""
    if tuple(x.shape) != tuple(shape):
        raise ValueError(f"{name} must have shape {tuple(shape)}, got {tuple(x.shape)}")


def check_same_device(**tensors: torch.Tensor | None) -> torch.device:
    """Raise ValueError if the given tensors (None skipped) are not all on one device; return it."""
    devices = [t.device for t in tensors.values() if t is not None]
    if all(d == devices[0] for d in devices):
        return devices[0]
    listing = ", ".join(f"{k} on {t.device}" for k, t in tensors.items() if t is not None)
    raise ValueError(f"tensors must be on one device, got {listing}")


def check_same_dtype(**tensors: torch.Tensor | None) -> torch.dtype:
    """Raise TypeError if the given tensors (None skipped) do not share one dtype; return it."""
    named = {k: v for k, v in tensors.items() if v is not None}
    dtypes = {k: v.dtype for k, v in named.items()}
    if len(set(dtypes.values())) > 1:
        listing = ", ".join(f"{k} is {str(d).replace('torch.', '')}" for k, d in dtypes.items())
        raise TypeError(f"tensors must share one dtype, got {listing}")
    return next(iter(dtypes.values()))


def as_rows(x: torch.Tensor) -> torch.Tensor:
    """View ``x`` (..., D) as (rows, D) with unit stride along D, copying only when a view is impossible.

    Kernels take a row stride, so any layout whose last dim is contiguous and whose leading dims
    collapse into one stride is passed through without a copy.
    """
    if x.dim() == 2 and x.stride(1) == 1:  # already (rows, D) with unit stride along D
        return x
    if x.dim() == 0:
        raise ValueError("expected a tensor with at least one dim, got a scalar")
    if x.stride(-1) != 1 and x.shape[-1] != 1:
        x = x.contiguous()
    try:
        return x.view(-1, x.shape[-1])  # (rows, D)
    except RuntimeError:  # leading dims do not collapse into one stride
        return x.contiguous().view(-1, x.shape[-1])  # (rows, D)


# --------------------------------------------------------------------------------------------------
# Configs
# --------------------------------------------------------------------------------------------------
@functools.cache
def shared_memory_limit(device_index: int = 0) -> int:
    """Bytes of shared memory one program (thread block) may use on a CUDA device."""
    try:  # Triton's own view of the device, the number its compiler checks against
        from triton.runtime import driver

        return int(driver.active.utils.get_device_properties(device_index)["max_shared_mem"])
    except Exception:  # noqa: BLE001 - older triton or no driver: ask torch
        props = torch.cuda.get_device_properties(device_index)
        for attr in ("shared_memory_per_block_optin", "shared_memory_per_block"):
            if hasattr(props, attr):
                return int(getattr(props, attr))
        return 48 * 1024  # the CUDA minimum every GPU since Kepler offers


def device_index_of(args: dict) -> int | None:
    """The CUDA device index of the first CUDA tensor among ``args``' values, or None."""
    for value in args.values():
        if isinstance(value, torch.Tensor) and value.is_cuda:
            return value.device.index if value.device.index is not None else torch.cuda.current_device()
    return None


def meta(config) -> dict:
    """A ``triton.Config`` as launch keywords: its block sizes, num_warps and num_stages."""
    return {**config.kwargs, "num_warps": config.num_warps, "num_stages": config.num_stages}


def configs_that_fit(preferred: Sequence, smallest, smem_bytes: Callable[[object, dict], int], args: dict) -> list:
    """Launch keywords of the configs of ``preferred`` whose estimate fits the device's shared memory, best first,
    then ``smallest``: the candidates :func:`compile_fitting` tries in order. Under the interpreter, ``smallest``
    alone, where small tiles keep the CPU run short."""
    if is_interpreting():
        return [meta(smallest)]
    index = device_index_of(args)
    limit = shared_memory_limit(index if index is not None else 0)
    fitting = [meta(c) for c in preferred if smem_bytes(c, args) <= limit]
    return fitting + [meta(smallest)] if meta(smallest) not in fitting else fitting


def pick_config(preferred: Sequence, smallest, smem_bytes: Callable[[object, dict], int], args: dict) -> dict:
    """Launch keywords for a matmul-like kernel: the first of ``preferred`` that fits the device's shared memory.

    ``preferred`` comes from a kernel file's heuristic, best first for the shape at hand (chosen against Triton's
    full autotune on an H100: benchmarks/bench_autotune.py). ``smallest`` runs anywhere; it is the one
    used under the interpreter, where small tiles keep the CPU run short.
    """
    return configs_that_fit(preferred, smallest, smem_bytes, args)[0]


def autotune_requested() -> bool:
    """True when ``KERNEL_LIB_AUTOTUNE=1``: kernels search their whole config list instead of the heuristic's pick.

    The search costs seconds at each new shape (every config is compiled and timed), once per machine: its
    choices are kept on disk.
    """
    return os.environ.get("KERNEL_LIB_AUTOTUNE", "0").lower() in ("1", "true", "yes", "on")


_compile_threads = None


def _compile_side_by_side(launches: Sequence[tuple]) -> list | None:
    """Compile (never launch) ``(kernel, grid, args, kwargs)`` launches in threads through Triton's
    ``AsyncCompileMode`` (Triton 3.4 and later) and return the compiled kernels; None where this Triton has no
    such mode or another one is active (the caller then compiles one by one, or at launch)."""
    global _compile_threads
    try:  # private API, so a Triton without it just compiles at launch
        from triton.runtime._async_compile import AsyncCompileMode
    except ImportError:
        return None
    if _compile_threads is None:
        from concurrent.futures import ThreadPoolExecutor

        _compile_threads = ThreadPoolExecutor(max_workers=4, thread_name_prefix="kernel_lib-compile")
    try:
        mode = AsyncCompileMode(_compile_threads)
    except TypeError:  # a signature this file does not know
        return None
    compiled = []
    try:
        with mode:
            for kernel, grid, args, kwargs in launches:
                compiled.append(kernel.warmup(*args, grid=grid, **kwargs))
    except RuntimeError as error:  # another AsyncCompileMode is active (a caller of ours compiles too)
        if "already active" not in str(error):
            raise
        return None
    return [k.result() if hasattr(k, "result") else k for k in compiled]  # futures, resolved by now


def _load_side_by_side(kernels: Sequence, launches: Sequence[tuple]) -> None:
    """A kernel is loaded at its first launch, and some Triton releases first build its C launcher there (a call
    of the system's C compiler, about 0.3 s): side by side too, on the launches' device."""
    index = device_index_of(dict(enumerate(launches[0][2]))) if launches else None

    def load(kernel) -> None:
        with torch.cuda.device(index or 0):
            kernel._init_handles()

    loads = [_compile_threads.submit(load, k) for k in kernels if hasattr(k, "_init_handles")]  # private: may be absent
    for future in loads:
        try:
            future.result()
        except Exception:  # noqa: BLE001, S110 - the launch raises it again, with Triton's own message
            pass


def _shared_bytes(compiled) -> int | None:
    """The shared memory Triton allocated for a compiled kernel (``metadata.shared``), None if not reported."""
    shared = getattr(getattr(compiled, "metadata", None), "shared", None)
    return int(shared) if isinstance(shared, int) else None


_fitting_choices: dict = {}


def compile_fitting(key: tuple, launches: Sequence[tuple]) -> list[dict]:
    """Compile each launch's first candidate config and keep the first that Triton's own count says fits.

    ``launches`` holds ``(kernel, grid, args, kwargs, candidates)``: ``candidates`` are launch keywords, best
    first (:func:`configs_that_fit` gives them from a kernel file's estimate). The estimate can miss what the
    compiler adds (a layout-conversion scratch, one more pipeline buffer); the compiled kernel's
    ``metadata.shared`` is the number Triton checks at launch, so a config over the device's limit moves to the
    next candidate here instead of failing there with ``OutOfResources``. The launches compile side by side in
    threads (a backward's three kernels at once, through Triton's ``AsyncCompileMode``, 3.4 and later; one by one
    before) and are loaded side by side too; nothing is launched. Returns the chosen keywords, one per launch,
    remembered under ``key`` (which must change whenever Triton would compile anew: constexprs, dtypes, which ints
    are 1 or multiples of 16); raises ValueError when no candidate of a launch fits.
    """
    if is_interpreting():
        return [candidates[0] for *_, candidates in launches]
    if key in _fitting_choices:
        return _fitting_choices[key]
    index = device_index_of(dict(enumerate(launches[0][2]))) if launches else None
    limit = shared_memory_limit(index if index is not None else 0)
    position = [0] * len(launches)
    while True:
        trying = [(kernel, grid, args, {**kwargs, **candidates[i]})
                  for i, (kernel, grid, args, kwargs, candidates) in zip(position, launches, strict=True)]  # fmt: skip
        compiled = _compile_side_by_side(trying)
        if compiled is None:  # one after another, on this thread
            compiled = [_warmup_or_none(kernel, grid, args, kwargs) for kernel, grid, args, kwargs in trying]
        over = [j for j, c in enumerate(compiled) if c is None or (_shared_bytes(c) or 0) > limit]
        if not over:
            break
        for j in over:
            kernel, _, _, _, candidates = launches[j]
            if position[j] + 1 >= len(candidates):
                need = _shared_bytes(compiled[j]) if compiled[j] is not None else None
                name = getattr(getattr(kernel, "fn", kernel), "__name__", "kernel")
                raise ValueError(
                    f"{name}: no config fits this GPU's shared memory ({limit:,} bytes a block); the smallest "
                    f"needs {need if need is not None else 'more'} bytes. Use smaller head dims or another GPU."
                )
            position[j] += 1
    if _compile_threads is not None:
        _load_side_by_side(compiled, trying)
    choice = [candidates[i] for i, (*_, candidates) in zip(position, launches, strict=True)]
    _fitting_choices[key] = choice
    return choice


def _warmup_or_none(kernel, grid, args, kwargs):
    """Compile one launch without running it; None when Triton already refuses it for its resources."""
    try:
        return kernel.warmup(*args, grid=grid, **kwargs)
    except Exception as error:  # noqa: BLE001 - triton's OutOfResources moved between modules across releases
        if type(error).__name__ == "OutOfResources":
            return None
        raise


def autotuned(kernel, configs: Sequence, key: list[str], smem_bytes: Callable[[object, dict], int]):
    """``kernel`` under ``triton.autotune`` over all ``configs``, for ``KERNEL_LIB_AUTOTUNE=1``.

    Its choices persist across processes: through Triton's own ``cache_results`` where this Triton has it, else
    through a JSON file per kernel under :func:`cache_dir` (:func:`persist_choices`).
    """
    import triton

    kwargs = dict(
        configs=list(configs), key=key, prune_configs_by={"early_config_prune": prune_by_shared_memory(smem_bytes)}
    )
    if "cache_results" in inspect.signature(triton.autotune).parameters:
        return triton.autotune(**kwargs, cache_results=True)(kernel)
    return persist_choices(triton.autotune(**kwargs)(kernel))


def cache_dir() -> str:
    """Where kernel_lib keeps files between processes: ``$KERNEL_LIB_CACHE_DIR``, else ``~/.cache/kernel_lib``."""
    default = os.path.join(os.environ.get("XDG_CACHE_HOME", os.path.expanduser("~/.cache")), "kernel_lib")
    return os.environ.get("KERNEL_LIB_CACHE_DIR", default)


def persist_choices(tuner):
    """Keep a ``triton.autotune`` object's choices in a JSON file, for Triton releases without ``cache_results``.

    The file, ``<cache_dir>/autotune/<kernel>-<hash>.json``, lists one entry per tuning key: the key's values and
    the chosen config's block sizes, warps and stages. The hash covers the Triton version, the device name, the
    kernel's source and its config list, so a changed kernel or a different GPU starts afresh. Written atomically
    (a temporary file renamed over the old one), so a killed process leaves the previous file whole.
    """
    import triton

    run = tuner.run
    state = {"path": None}

    def path() -> str:
        if state["path"] is None:
            device = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
            source = getattr(getattr(tuner, "fn", None), "src", "") or ""
            digest = hashlib.sha256(repr((triton.__version__, device, source, tuner.configs)).encode()).hexdigest()
            name = getattr(getattr(tuner, "fn", None), "__name__", "kernel")
            state["path"] = os.path.join(cache_dir(), "autotune", f"{name}-{digest[:16]}.json")
            try:
                with open(state["path"]) as f:
                    for entry in json.load(f):
                        config = triton.Config(
                            entry["kwargs"], num_warps=entry["num_warps"], num_stages=entry["num_stages"]
                        )
                        tuner.cache.setdefault(tuple(entry["key"]), config)
            except (OSError, ValueError, KeyError, TypeError):  # no file yet, or one that is not ours: tune afresh
                pass
        return state["path"]

    def run_and_keep(*args, **kwargs):
        target = path()
        known = len(tuner.cache)
        result = run(*args, **kwargs)
        if len(tuner.cache) != known:
            entries = [
                {"key": list(key), "kwargs": c.kwargs, "num_warps": c.num_warps, "num_stages": c.num_stages}
                for key, c in tuner.cache.items()
            ]
            os.makedirs(os.path.dirname(target), exist_ok=True)
            tmp = f"{target}.{os.getpid()}.tmp"
            with open(tmp, "w") as f:
                json.dump(entries, f, indent=1)
            os.replace(tmp, target)
        return result

    tuner.run = run_and_keep
    return tuner


def prune_by_shared_memory(smem_bytes: Callable[[object, dict], int]) -> Callable:
    """An ``early_config_prune`` hook for ``triton.autotune`` dropping configs too large for the device.

    ``smem_bytes(config, named_args)`` estimates a config's shared memory. If none fits, the smallest is
    kept so the launch fails with Triton's own message rather than an empty config list.
    """

    def prune(configs: list, named_args: dict, **kwargs) -> list:
        index = device_index_of({**named_args, **kwargs})
        if index is None:
            return configs
        limit = shared_memory_limit(index)
        fitting = [c for c in configs if smem_bytes(c, {**named_args, **kwargs}) <= limit]
        return fitting or [min(configs, key=lambda c: smem_bytes(c, {**named_args, **kwargs}))]

    return prune


@functools.cache
def sm_count(device_index: int = 0) -> int:
    """Number of streaming multiprocessors of a CUDA device."""
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def persistent_programs(device: torch.device, work_items: int, per_sm: int = 4) -> int:
    """How many programs a persistent kernel (each looping over many rows) should launch.

    A few per SM on a GPU, so every SM stays busy; a handful on the CPU, where the interpreter runs programs
    one after another and fewer programs mean less interpreter overhead.
    """
    if device.type == "cuda":
        index = device.index if device.index is not None else torch.cuda.current_device()
        target = per_sm * sm_count(index)
    else:
        target = 4
    return max(1, min(target, work_items))


@functools.cache  # called on every launch with a handful of distinct widths
def row_block_settings(width: int, element_bytes: int, max_width: int = 65536) -> tuple[int, int, int]:
    """(BLOCK_D, BLOCK_M, num_warps) for a kernel that holds whole rows of ``width`` elements in registers.

    BLOCK_D is the next power of two of the width; narrow rows are packed BLOCK_M to a program so that each
    program still moves about 16 KB; wider rows get more warps so each thread holds a bounded slice.
    """
    if width > max_width:
        raise ValueError(f"last dim {width} is wider than this kernel supports ({max_width})")
    block_d = 1 << max(0, (width - 1).bit_length())
    block_m = max(1, min(64, 16384 // (block_d * element_bytes)))
    elements = block_d * block_m
    num_warps = 4 if elements <= 2048 else 8 if elements <= 8192 else 16 if elements <= 32768 else 32
    return block_d, block_m, num_warps
