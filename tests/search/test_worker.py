"""The evaluator's gates (kernel_lib.search.worker and pool) against variants built to game them: each fails with its
status and reason recorded in result.json, and the worker pool survives the ones that kill or hang their process.

The variants are in _tiny_kernel.py: a wrong result, a partial write, an early return for some input values, a
result cached across calls, an input ignored after the first call, a written input, a source that does not compile,
an unbound argument, an illegal memory access, an endless loop, a launcher that sleeps, and (on a GPU) work on a side
stream."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from kernel_lib.search.pool import WorkerPool
from kernel_lib.search.worker import FAILURES, run_one
from tests.search import _tiny_kernel as tiny

ROOT = Path(__file__).resolve().parents[2]
HAS_CUDA = torch.cuda.is_available()
DEVICE = "cuda:0" if HAS_CUDA else "cpu"
POOL_TIMEOUT = 12.0  # seconds per evaluation, counted after the worker has started (imported torch and triton)


KNOWN_BUGS: dict[str, str] = {}  # candidate name -> why it is expected to fail (none at present)


def _param(b: tiny.Candidate):
    marks = [pytest.mark.xfail(strict=True, reason=KNOWN_BUGS[b.name])] if b.name in KNOWN_BUGS else []
    return pytest.param(b, marks=marks, id=b.name)


IN_PROCESS = [_param(b) for b in tiny.GOOD + tiny.BAD if b.in_process]
IN_A_WORKER = [b for b in tiny.BAD if not b.in_process and not b.gpu]


@pytest.fixture(scope="module")
def spec_path(tmp_path_factory) -> Path:
    return tiny.write_spec(tmp_path_factory.mktemp("spec"))


def test_the_early_return_is_triggered_by_the_fixed_seeds():
    """The early_return variant skips rows that start above 1.0: the first input (seed 100) has one, so it is
    caught on the first check already, whatever the timing."""
    assert tiny.early_return_triggers(tiny.SEED)
    assert tiny.early_return_triggers(tiny.FRESH_SEED)


def test_every_status_the_tests_expect_is_a_documented_failure():
    statuses = {s for b in tiny.BAD for s in b.statuses}
    assert statuses <= set(FAILURES)
    assert statuses >= set(FAILURES) - {"unstable"}  # every failure but "unstable" has a variant that provokes it


@pytest.mark.parametrize("candidate", IN_PROCESS)
def test_run_one_records_each_variants_status_and_reason(candidate, spec_path, tmp_path):
    """In this process: run_one on a control.json written by RunStore.write_variant, as the search writes them."""
    control = tiny.control_for(tmp_path, spec_path, candidate.source, DEVICE)
    result = run_one(control)
    assert result["status"] in candidate.statuses, result
    folder = Path(control).parent
    assert json.loads((folder / "result.json").read_text()) == json.loads(json.dumps(result))  # written next to it
    assert (folder / "stdout.log").exists() and (folder / "stderr.log").exists()
    if candidate.statuses == ("ok",):
        assert result["reason"] == "" and result["ms"] > 0 and result["errors"][0]["max_abs"] == 0.0
    else:
        assert result["reason"].strip()
    if candidate.name == "mutates_input":
        assert "['x']" in result["reason"]
    if candidate.name == "unbound_argument":
        assert "['scale']" in result["reason"]
    if candidate.name in ("partial_write", "early_return"):
        assert "NaN" in result["reason"]


def test_the_pool_survives_crashes_and_hangs(spec_path, tmp_path):
    """An illegal access (the interpreter segfaults), an endless loop and a sleeping launcher, each in a worker of
    its own: crash or runtime_error, timeout, timeout; the killed workers are replaced and evaluate again."""
    pool = WorkerPool([DEVICE] * len(IN_A_WORKER), tmp_path / "workers", timeout=POOL_TIMEOUT)
    try:
        started = time.time()
        for bad in IN_A_WORKER:
            pool.submit(tiny.control_for(tmp_path, spec_path, bad.source, DEVICE), bad.name)
        results = {}
        while len(results) < len(IN_A_WORKER):
            results.update(pool.wait())
        # each cut at the timeout: side by side on the CPU; on a GPU the two hanging ones take the lock in turn
        assert time.time() - started < 3 * POOL_TIMEOUT
        for bad in IN_A_WORKER:
            result = results[bad.name]
            assert result["status"] in bad.statuses, (bad.name, result)
            assert result["reason"]
            written = tiny.result_of(tmp_path, result["id"])
            assert written["status"] == result["status"]  # the pool wrote result.json for the dead worker
        if "crash" in results["illegal_access"]["status"]:
            assert "signal 11" in results["illegal_access"]["reason"]  # SIGSEGV
        assert results["endless_loop"]["reason"] == f"no result within {POOL_TIMEOUT:g} s"
        for slot in pool.slots:
            # killed, or leaving on its own: after a CUDA error the worker writes 'done', then exits (os._exit), so
            # right after the result it may still be exiting (seen once on an H100); not left running either way
            if slot.proc is not None:
                slot.proc.wait(timeout=10)  # raises TimeoutExpired if it is still running
        # every slot again, with a correct variant: fresh processes take over
        good = tiny.GOOD[0]
        for i in range(len(pool.slots)):
            pool.submit(tiny.control_for(tmp_path / f"again{i}", spec_path, good.source, DEVICE), i)
        again = {}
        while len(again) < len(pool.slots):
            again.update(pool.wait())
        assert [r["status"] for r in again.values()] == ["ok"] * len(pool.slots)
    finally:
        pool.close()


def test_the_clock_stops_while_the_worker_waits_for_the_gpu(tmp_path):
    """Workers on one GPU take turns through a lock; one waiting behind a hanging kernel says 'wait <path>' (the clock
    stops) and 'turn <path>' once it holds the GPU (the timeout counts afresh). Before, the illegal-access variant
    waited behind the endless loop and the sleeping launcher on an H100 and was recorded as a timeout. A stand-in
    worker against a 2 s timeout: wait at 0.5 s, turn at 3 s, done at 4 s."""
    from kernel_lib.search.pool import _Slot

    script = (
        "import time\n"
        "for pause, line in ((0.5, 'wait p'), (2.5, 'turn p'), (1.0, 'done p')):\n"
        "    time.sleep(pause); print(line, flush=True)\n"
    )
    slot = _Slot(0, "cpu", tmp_path, timeout=2.0)
    slot.proc = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    assert slot._wait_for("done p", time.time() + 2.0, path="p") == ""
    slot.proc.wait()
    slot.proc = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    assert slot._wait_for("done p", time.time() + 2.0, path="other") == "timeout"  # another path's lines: cut at 2 s
    assert slot.proc is None  # killed


@pytest.mark.gpu
def test_work_on_a_side_stream_is_caught(spec_path, tmp_path):
    """A launcher that runs the kernel on a stream of its own: right when the device is synchronized, but a CUDA
    graph captured on the caller's stream does not hold it (what CUDA-event timing would not see either)."""
    pool = WorkerPool([DEVICE], tmp_path / "workers", timeout=120)
    try:
        pool.submit(tiny.control_for(tmp_path, spec_path, tiny.BY_NAME["side_stream"].source, DEVICE), "side")
        [(_, result)] = pool.wait()
    finally:
        pool.close()
    assert result["status"] == "stream_escape" and result["reason"], result


def test_a_worker_process_serves_many_evaluations(spec_path, tmp_path):
    """The pool's worker is long-lived: torch and triton load once. (PR_SET_PDEATHSIG fires when the thread that
    started the process ends, so a worker started from an evaluation's thread died after each evaluation, and an
    evaluation handed to it meanwhile was recorded as a crash.)"""
    pool = WorkerPool([DEVICE], tmp_path / "workers", timeout=60)
    try:
        pids = []
        for i, good in enumerate(tiny.GOOD * 2):
            pool.submit(tiny.control_for(tmp_path / str(i), spec_path, good.source, DEVICE), i)
            [(_, result)] = pool.wait()
            assert result["status"] == "ok", result
            time.sleep(0.2)  # a worker doomed to die with its thread is dead by now
            pids.append(pool.slots[0].proc.pid)
            assert pool.slots[0].proc.poll() is None
        assert len(set(pids)) == 1
    finally:
        pool.close()
    assert (tmp_path / "workers" / "worker-0.log").exists()


@pytest.mark.parametrize(
    "bad, code",
    [
        pytest.param(tiny.GOOD[0], 0, id="correct: exit 0"),
        pytest.param(tiny.BY_NAME["caches_result"], 1, id="cached result: exit 1"),
    ],
)
def test_the_worker_command_reproduces_one_evaluation(bad, code, spec_path, tmp_path):
    """``python -m kernel_lib.search.worker control.json``: one evaluation by hand, its result as one JSON line."""
    control = tiny.control_for(tmp_path, spec_path, bad.source, DEVICE)
    done = subprocess.run(
        [sys.executable, "-m", "kernel_lib.search.worker", control],
        capture_output=True, text=True, cwd=ROOT, env=dict(os.environ), timeout=120,
    )  # fmt: skip
    assert done.returncode == code, done.stderr
    printed = json.loads(done.stdout.strip().splitlines()[-1])
    assert printed["status"] == bad.statuses[0] and printed["id"] == Path(control).parent.name
    assert tiny.result_of(tmp_path, printed["id"])["status"] == printed["status"]
