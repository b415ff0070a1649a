"""One evaluation of one variant, in a worker process that a crash may take down without harming the search.

What an evaluation does, in order (each step can fail it, with the reason recorded in ``result.json``):

1. load: import ``kernel_module.py`` (Triton) or compile ``kernel.cu`` (CUDA), bind the kernel's arguments;
2. run on the contract's inputs, the outputs poisoned first: every output within the tolerance of the float64
   reference (``wrong``), nothing left unwritten (``unwritten``), the inputs bit-identical afterwards
   (``mutated_input``);
3. on CUDA, capture one launch in a CUDA graph and replay it on poisoned outputs: work launched on another
   stream, which the timing below would not see, leaves the poison in place (``stream_escape``);
4. time with CUDA events (``kernel_lib.bench.time_fn``: warm-up, median of many, L2 flushed before each call);
5. check again after timing (``unstable``) and on a second, fresh random input (``wrong_on_fresh_input``: catches
   a kernel that caches its result or ignores its input).

A variant that fails any step is never faster than anything: the search gives it a fixed penalty.

Two ways to run it: ``python -m kernel_lib.search.worker control.json`` evaluates once (to reproduce one
evaluation by hand); the search's pool keeps one long-lived process per ``--gpus`` entry that reads control file
paths from stdin, so Python and torch start once. On CUDA an error may leave the context unusable, so after one the
process writes its result and exits, and the pool starts a fresh one. Several processes on one GPU compile in
parallel but take turns on the GPU (a lock file per device), so timings never overlap.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from ..bench import timing as clock  # the timing module alone: no pandas, plots or ceilings
from .contract import DTYPES, Case, compare, make_case, mutated_inputs, poisoned_outputs, shape_of
from .runners import LaunchError, make_binder
from .spec import KernelSpec, evaluate, load_spec
from .store import write_json

FAILURES = {
    "compile_error": "the source does not import or compile",
    "launch_error": "the variant cannot be launched as the spec says",
    "runtime_error": "the launch raised (illegal memory access, bad argument...)",
    "wrong": "an output is outside the tolerance of the float64 reference",
    "unwritten": "an output still holds its NaN poison",
    "mutated_input": "an input changed",
    "stream_escape": "the work is not on the caller's stream (a CUDA graph capture misses it)",
    "unstable": "wrong when checked again after timing",
    "wrong_on_fresh_input": "wrong on a second, fresh random input (cached or ignored input)",
    "timeout": "no result within the timeout (a hang)",
    "crash": "the worker process died",
}


class Failed(Exception):
    def __init__(self, status: str, reason: str):
        super().__init__(reason)
        self.status, self.reason = status, reason


@contextlib.contextmanager
def device_turn(device: str, signal: Callable[[str], None] | None = None):
    """Hold the device's lock file: processes sharing a GPU never run or time kernels at the same time.

    ``signal("wait")`` is called before blocking on a lock another process holds, ``signal("turn")`` once the lock
    is held: the pool stops the evaluation's clock while it waits (a hanging kernel of another worker holds the GPU
    until the pool kills it) and starts it afresh with the turn."""
    if not device.startswith("cuda"):
        yield
        return
    index = torch.device(device).index or 0
    with open(os.path.join(tempfile.gettempdir(), f"kernel_lib_search_gpu{index}.lock"), "w") as f:
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            if signal is not None:
                signal("wait")
            fcntl.flock(f, fcntl.LOCK_EX)
        try:
            if signal is not None:
                signal("turn")
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


_CASES: dict[tuple, Case] = {}


def cached_case(spec: KernelSpec, device: str, seed: int, small: bool) -> Case:
    """Inputs and references per (spec, device, seed): made once per process, reused by every evaluation."""
    key = (spec.path, os.path.getmtime(spec.path) if spec.path else 0, device, seed, small)
    if key not in _CASES:
        if len(_CASES) >= 4:
            _CASES.pop(next(iter(_CASES)))
        _CASES[key] = make_case(spec, device, seed, small)
    return _CASES[key]


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def _checked(spec, case, outs, status: str) -> list[dict]:
    checks = compare(spec, case, outs)
    for c in checks:
        if not c.ok:
            if c.kernel.n_bad and outs[c.name].is_floating_point() and bool(torch.isnan(outs[c.name]).any()):
                raise Failed("unwritten" if status == "wrong" else status, f"{c} (NaN: poison left or produced)")
            raise Failed(status, str(c))
    return [{"output": c.name, "max_abs": c.kernel.max_abs, "allowed": c.allowed} for c in checks]


def _run_case(bind, spec, case, device, status):
    outs = poisoned_outputs(spec, case, device)
    run = bind({**case.inputs, **outs}, case.scope)
    run()
    _sync(device)
    changed = mutated_inputs(case)
    if changed:
        for k in changed:  # restore, so the next evaluation starts from the true inputs
            case.inputs[k].copy_(case.pristine[k])
        raise Failed("mutated_input", f"inputs written by the kernel: {changed}")
    return run, outs, _checked(spec, case, outs, status)


def _graph_check(bind, spec, case, device):
    outs = poisoned_outputs(spec, case, device)
    run = bind({**case.inputs, **outs}, case.scope)
    graph = torch.cuda.CUDAGraph()
    try:
        with torch.cuda.graph(graph):
            run()
    except Exception as exc:  # noqa: BLE001 - any capture failure means the launch is not a plain stream launch
        why = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        raise Failed("stream_escape", f"capturing one launch in a CUDA graph failed: {why}") from None
    _poison(outs)
    torch.cuda.synchronize()
    graph.replay()
    torch.cuda.synchronize()
    try:
        _checked(spec, case, outs, "stream_escape")
    except Failed as failed:
        why = f"a captured launch replayed does not produce the outputs: {failed.reason}"
        raise Failed("stream_escape", why) from None


def evaluate_control(control: dict, signal: Callable[[str], None] | None = None) -> dict:
    """Evaluate one variant as ``control`` says; never raises (failures are results). ``signal``: see
    :func:`device_turn`."""
    started = time.time()
    result: dict[str, Any] = {"id": control["id"], "status": "ok", "reason": "", "device": control["device"]}
    device = control["device"]
    try:
        spec = load_spec(control["spec"])
        try:
            bind = make_binder(spec, control["launch"], control["kernel_file"])
        except LaunchError as exc:
            raise Failed("launch_error", str(exc)) from None
        except Exception as exc:  # noqa: BLE001 - anything the source does on import is the variant's fault
            raise Failed("compile_error", _short(exc)) from None
        small = control.get("small", False)
        seed = control.get("seed", 0)
        with device_turn(device, signal):  # the float64 reference runs on the GPU: not while another worker times
            case = cached_case(spec, device, seed, small)
        if device.startswith("cuda"):
            _warm_compile(bind, spec, case, device)  # compile (no launch) outside the GPU turn
        with device_turn(device, signal):
            try:
                run, outs, errors = _run_case(bind, spec, case, device, "wrong")
            except Failed:
                raise
            except LaunchError as exc:
                raise Failed("launch_error", str(exc)) from None
            except Exception as exc:  # noqa: BLE001
                kind = "compile_error" if "compil" in type(exc).__name__.lower() else "runtime_error"
                raise Failed(kind, _short(exc)) from None
            result["errors"] = errors
            if device.startswith("cuda"):
                _graph_check(bind, spec, case, device)
            if control.get("profile_only"):
                for _ in range(3):
                    run()
                _sync(device)
                result["status"] = "profiled"
                return result
            timing = clock.time_fn(
                run, warmup_ms=control.get("warmup_ms", 10), rep_ms=control.get("rep_ms", 50), device=device
            )
            result.update(ms=timing.median_ms, p20_ms=timing.p20_ms, p80_ms=timing.p80_ms)
            result["samples"] = len(timing.samples_ms)
            result["timer"] = timing.timer
            _poison(outs)
            run()
            _sync(device)
            _checked(spec, case, outs, "unstable")
            fresh = cached_case(spec, device, control.get("fresh_seed", 1), small)
            _run_case(bind, spec, fresh, device, "wrong_on_fresh_input")
        scope = case.scope
        if spec.bytes:
            result["gbps"] = clock.gbps(float(evaluate(spec.bytes, scope)), result["ms"])
        if spec.flops:
            result["tflops"] = clock.tflops(float(evaluate(spec.flops, scope)), result["ms"])
    except Failed as failed:
        result.update(status=failed.status, reason=failed.reason)
    except Exception as exc:  # noqa: BLE001 - the worker reports, the search decides
        result.update(status="runtime_error", reason=_short(exc))
    result["seconds"] = round(time.time() - started, 3)
    if device.startswith("cuda") and not is_cuda_error(result):  # after a CUDA error, no CUDA call may return
        try:
            torch.cuda.empty_cache()  # several workers share the GPU: give back what this evaluation cached
        except Exception as exc:  # noqa: BLE001 - a broken context the status did not name: the worker must go
            why = f"CUDA failed after the evaluation ({result['status']}: {result['reason']}): {_short(exc)}"
            result.update(status="runtime_error", reason=why)
    return result


def _poison(outs: dict) -> None:
    for t in outs.values():
        t.fill_(float("nan")) if t.is_floating_point() else t.fill_(-1)


def _warm_compile(bind, spec, case, device) -> None:
    """Compile without launching anything (Triton's ``warmup``), before taking the GPU turn: compiles overlap,
    GPU work doesn't. A kernel whose compile fails here fails again at its first launch, with the same message."""
    outs = {t.name: torch.empty(shape_of(t, case.scope), device=device, dtype=DTYPES[t.dtype]) for t in spec.outputs}
    try:
        bind({**case.inputs, **outs}, case.scope, compile_only=True)()
    except Exception:  # noqa: BLE001, S110 - the launch under the GPU turn reports it
        pass


def _short(exc: BaseException, lines: int = 12) -> str:
    """The exception's type and message, and the last lines of its traceback (compiler errors say where)."""
    text = "".join(traceback.format_exception_only(type(exc), exc)).strip()
    return "\n".join(text.splitlines()[-lines:])


def is_cuda_error(result: dict) -> bool:
    """After these the CUDA context may be broken: the process must not evaluate anything else."""
    reason = result.get("reason", "")
    return (
        result["device"].startswith("cuda")
        and result["status"] in ("runtime_error", "stream_escape")
        and ("CUDA" in reason or "cuda" in reason or "illegal" in reason)
    )


@contextlib.contextmanager
def captured_output(folder: str):
    """Send this process's stdout and stderr (file descriptors, so compilers' output too) to the variant's logs."""
    sys.stdout.flush()
    sys.stderr.flush()
    saved = os.dup(1), os.dup(2)
    with open(os.path.join(folder, "stdout.log"), "ab") as out, open(os.path.join(folder, "stderr.log"), "ab") as err:
        os.dup2(out.fileno(), 1)
        os.dup2(err.fileno(), 2)
        try:
            yield
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
            os.dup2(saved[0], 1)
            os.dup2(saved[1], 2)
            os.close(saved[0])
            os.close(saved[1])


def run_one(control_path: str, signal: Callable[[str], None] | None = None) -> dict:
    """Evaluate the control file's variant; write result.json next to it; return the result."""
    control = json.loads(Path(control_path).read_text())
    folder = os.path.dirname(os.path.abspath(control_path))
    if control["device"].startswith("cuda"):
        torch.cuda.set_device(torch.device(control["device"]))
    with captured_output(folder):
        result = evaluate_control(control, signal)
    write_json(control.get("result") or os.path.join(folder, "result.json"), result)
    return result


def serve(protocol_fd: int) -> int:
    """The pool's long-lived worker: 'ready' on ``protocol_fd`` once imported, then one control path per stdin line,
    'wait <path>' when it waits for the GPU's lock, 'turn <path>' when it holds it, and 'done <path>' at the end."""
    channel = os.fdopen(protocol_fd, "w", buffering=1)
    channel.write("ready\n")  # torch and triton are imported: the pool starts the first evaluation's clock now
    channel.flush()
    for line in sys.stdin:
        path = line.strip()
        if not path:
            continue
        result = run_one(path, signal=lambda event, path=path: (channel.write(f"{event} {path}\n"), channel.flush()))
        channel.write(f"done {path}\n")
        channel.flush()
        if is_cuda_error(result):
            # the pool starts a fresh process for the next evaluation; leave without the interpreter's teardown,
            # which frees CUDA memory in a context the error may have broken
            os._exit(3)
    return 0


def main(argv: list[str] | None = None) -> int:
    """``python -m kernel_lib.search.worker``: one evaluation by hand, or (``--serve``) the pool's worker process."""
    import argparse

    p = argparse.ArgumentParser(
        prog="python -m kernel_lib.search.worker",
        description="Evaluate one variant of a kernel search run from its control.json (check, time, write "
        "result.json beside it) and print the result as one JSON line; exit 0 if it is correct.",
    )
    p.add_argument(
        "control", nargs="?", metavar="CONTROL_JSON", help="e.g. out/kernels/<name>/variants/<id>/control.json"
    )
    p.add_argument("--profile-only", action="store_true", help="launch a few times for a profiler, no timing")
    p.add_argument("--serve", action="store_true", help=argparse.SUPPRESS)  # the search's pool: paths on stdin
    args = p.parse_args(argv)
    if args.serve:
        from .pool import die_with_parent

        die_with_parent()
        protocol = os.dup(1)
        os.dup2(2, 1)  # stray prints go to the worker's log, not into the protocol channel
        return serve(protocol)
    if not args.control:
        p.error("give the control.json of the variant to evaluate")
    path = args.control
    if args.profile_only:  # a copy of the control file that asks for profiling, its result beside it
        folder = os.path.dirname(os.path.abspath(path))
        control = json.loads(Path(path).read_text())
        control["profile_only"] = True
        control["result"] = os.path.join(folder, "profile_result.json")
        path = os.path.join(folder, "profile_control.json")
        Path(path).write_text(json.dumps(control))
    result = run_one(path)
    print(json.dumps({k: v for k, v in result.items() if k != "errors"}))
    return 0 if result["status"] in ("ok", "profiled") else 1


if __name__ == "__main__":
    sys.exit(main())
