"""Workers: one long-lived process per ``--gpus`` entry, each evaluating one variant at a time.

A worker says ``ready`` once it has imported torch and triton (allowed ``START_LIMIT`` seconds: a loaded machine
can take many seconds for that, which is not the variant's time). The orchestrator then hands it the path of a
control file on its stdin and reads ``done <path>`` back; the result itself is the ``result.json`` the worker
wrote. The timeout counts from the hand-over. Workers sharing a GPU take turns through a lock file, and a variant
waiting behind another's hanging kernel (which holds the GPU until the pool kills it) is not charged for the wait:
the worker says ``wait <path>`` before it blocks on the lock (the clock stops, up to ``LOCK_WAIT_LIMIT``) and
``turn <path>`` once it holds it (the timeout counts afresh). A worker that hangs past the timeout is killed (its
process group, so a compiler it started goes too); one that dies is recorded as a crash, marked ``"died": true``
(the search then retries that evaluation once on another worker: a ``kill -9`` or a lost GPU is not the variant's
fault). Either way the pool writes the failed result.json itself and starts a fresh process for the next
evaluation: the search goes on. Every result the pool returns names its ``worker`` (the slot's index).

Workers die with the orchestrator (``PR_SET_PDEATHSIG`` on Linux), so a ``kill -9`` of the search leaves no
evaluation running that a resume would not know about.

``TableEvaluator`` has the same interface and answers from a table of measurements (an exhaustive run's CSV):
strategies compared on it see exactly the same numbers.
"""

from __future__ import annotations

import json
import os
import queue
import select
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

from .store import write_json

START_LIMIT = 120.0  # seconds for a fresh worker to import torch and triton before its first evaluation
LOCK_WAIT_LIMIT = 3600.0  # seconds a worker may wait for the GPU's lock (every holder is cut at its own timeout)


def devices_for(gpus: list[int]) -> list[str]:
    """``cuda:<i>`` per entry on a GPU machine; on a CPU machine each entry is one CPU worker (the interpreter)."""
    import torch

    if torch.cuda.is_available():
        return [f"cuda:{i}" for i in gpus]
    return ["cpu" for _ in gpus]


def _exit_why(code: int) -> str:
    return f"signal {-code}" if code < 0 else f"exit code {code}"


class _Slot:
    def __init__(self, index: int, device: str, log_dir: Path, timeout: float):
        self.index, self.device, self.timeout = index, device, timeout
        self.log_path = log_dir / f"worker-{index}.log"
        self.proc: subprocess.Popen | None = None
        self.busy = False
        self.jobs: queue.Queue | None = None

    def _start(self) -> str:
        """Start the worker process and wait for its 'ready'; return "" or why it did not start."""
        env = dict(os.environ)
        env["KERNEL_SEARCH_PARENT_PID"] = str(os.getpid())
        if self.device == "cpu":  # no GPU: Triton has no driver to launch on, only its interpreter
            env["TRITON_INTERPRET"] = "1"
        log = open(self.log_path, "a")  # noqa: SIM115 - the child owns it for its lifetime
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "kernel_lib.search.worker", "--serve"],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=log,
            env=env,
            text=True,
            bufsize=1,
            start_new_session=True,  # its own process group: a timeout kills compilers it started too
        )
        log.close()
        why = self._wait_for("ready", time.time() + START_LIMIT)
        if why == "timeout":
            return f"the worker process did not start within {START_LIMIT:g} s"
        return f"{why} while starting" if why else ""

    def _wait_for(self, expected: str, deadline: float, path: str | None = None) -> str:
        """Read the worker's protocol lines until ``expected``: "" then, "timeout" (worker killed) or why it died.
        With ``path``, 'wait <path>' moves the deadline to ``LOCK_WAIT_LIMIT`` from now and 'turn <path>' to one
        timeout from now. Other lines are skipped (a stray print of an import, before stdout went to the log)."""
        while (left := deadline - time.time()) > 0:
            ready, _, _ = select.select([self.proc.stdout], [], [], left)
            if not ready:
                continue
            line = self.proc.stdout.readline()
            if not line:  # EOF: the process died
                why = f"the worker process died ({_exit_why(self.proc.wait())})"
                self.proc = None
                return why
            if line.strip() == expected:
                return ""
            if path is not None and line.strip() == f"wait {path}":
                deadline = time.time() + LOCK_WAIT_LIMIT
            elif path is not None and line.strip() == f"turn {path}":
                deadline = time.time() + self.timeout
        self._kill()
        return "timeout"

    def _kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            self.proc.wait()
        self.proc = None

    def evaluate(self, control_path: str) -> dict:
        """Blocking: hand over one control file, wait for its result (or the timeout, or the worker's death)."""
        control = json.loads(Path(control_path).read_text())
        result_path = control["result"]
        if self.proc is None or self.proc.poll() is not None:
            started = time.time()
            why = self._start()
            if why:
                return self._failed(control, result_path, "crash", why, started, died=True)
        started = time.time()
        try:
            self.proc.stdin.write(control_path + "\n")
            self.proc.stdin.flush()
        except BrokenPipeError:
            self._kill()
            return self._failed(control, result_path, "crash", "the worker process had exited", started, died=True)
        why = self._wait_for(f"done {control_path}", started + self.timeout, path=control_path)
        if why == "timeout":
            return self._failed(control, result_path, "timeout", f"no result within {self.timeout:g} s", started)
        if why:
            return self._failed(control, result_path, "crash", why, started, died=True)
        try:
            return {**json.loads(Path(result_path).read_text()), "worker": self.index}
        except (OSError, json.JSONDecodeError) as exc:
            return self._failed(control, result_path, "crash", f"unreadable result.json: {exc}", started)

    def _failed(self, control: dict, path: str, status: str, reason: str, started: float, died=False) -> dict:
        result = {"id": control["id"], "status": status, "reason": reason, "device": self.device}
        result |= {"worker": self.index, "died": True} if died else {"worker": self.index}
        result["seconds"] = round(time.time() - started, 3)
        write_json(path, result)
        return result

    def close(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            try:
                self.proc.stdin.close()
                self.proc.wait(timeout=10)
            except (OSError, subprocess.TimeoutExpired):
                self._kill()
        self.proc = None


class WorkerPool:
    """Evaluations in parallel, one per worker; ``submit`` while ``free()``, then ``wait`` for finished ones."""

    def __init__(self, devices: list[str], log_dir: str | os.PathLike, timeout: float = 300.0):
        log_dir = Path(log_dir)
        log_dir.mkdir(parents=True, exist_ok=True)
        self.slots = [_Slot(i, d, log_dir, timeout) for i, d in enumerate(devices)]
        self.done: queue.Queue = queue.Queue()
        for slot in self.slots:
            # One long-lived thread per worker, which also starts its process: Linux's parent-death signal
            # (die_with_parent) fires when the starting *thread* exits, so it must outlive the worker.
            slot.jobs = queue.Queue()
            threading.Thread(target=self._serve_slot, args=(slot,), daemon=True).start()

    def _serve_slot(self, slot: _Slot) -> None:
        while True:
            job = slot.jobs.get()
            if job is None:
                slot.close()
                return
            control_path, tag = job
            try:
                result = slot.evaluate(control_path)
            except Exception as exc:  # noqa: BLE001 - a bug here must not hang the search
                result = {"status": "crash", "reason": f"pool error: {exc}", "device": slot.device}
                result["worker"] = slot.index
            slot.busy = False
            self.done.put((tag, result))

    def _free_slots(self, avoid: int | None = None, worker: int | None = None) -> list[_Slot]:
        return [s for s in self.slots if not s.busy and s.index != avoid and worker in (None, s.index)]

    def free(self, avoid: int | None = None, worker: int | None = None) -> int:
        """Free workers; ``avoid``: not counting that one; ``worker``: that one alone (0 or 1)."""
        return len(self._free_slots(avoid, worker))

    def in_flight(self) -> int:
        return sum(s.busy for s in self.slots)

    def device(self, avoid: int | None = None, worker: int | None = None) -> str:
        return self._free_slots(avoid, worker)[0].device

    def submit(self, control_path: str, tag, avoid: int | None = None, worker: int | None = None) -> None:
        """Hand ``control_path`` to a free worker (not ``avoid``; exactly ``worker`` if given)."""
        slot = self._free_slots(avoid, worker)[0]
        slot.busy = True
        control = json.loads(Path(control_path).read_text())
        if control.get("device") != slot.device:  # a slot freed since the control file was written
            write_json(control_path, {**control, "device": slot.device})
        slot.jobs.put((control_path, tag))

    def wait(self) -> list[tuple]:
        """At least one finished (tag, result); all that are ready."""
        out = [self.done.get()]
        while True:
            try:
                out.append(self.done.get_nowait())
            except queue.Empty:
                return out

    def close(self) -> None:
        for s in self.slots:
            s.jobs.put(None)
        for s in self.slots:  # wait until each thread closed its worker (stdin EOF, then exit)
            deadline = time.time() + 15
            while s.proc is not None and time.time() < deadline:
                time.sleep(0.05)


class TableEvaluator:
    """The pool's interface, answered from measured rows keyed by variant id (``id``, ``status``, ``ms``)."""

    def __init__(self, rows: dict[str, dict], parallel: int = 1):
        self.rows, self.parallel = rows, parallel
        self.pending: list[tuple] = []
        self.slots = [None] * parallel

    def free(self) -> int:
        return self.parallel - len(self.pending)

    def in_flight(self) -> int:
        return len(self.pending)

    def device(self) -> str:
        return "table"

    def submit(self, control_path: str, tag) -> None:
        control = json.loads(Path(control_path).read_text())
        row = self.rows.get(control["id"])
        if row is None:
            result = {"id": control["id"], "status": "crash", "reason": "not in the table", "device": "table"}
        else:
            result = {**row, "id": control["id"], "device": "table"}
        write_json(control["result"], result)
        self.pending.append((tag, result))

    def wait(self) -> list[tuple]:
        out, self.pending = self.pending, []
        return out

    def close(self) -> None:
        pass


def die_with_parent() -> None:
    """Linux: this process gets SIGKILL when its parent dies (a killed search leaves no worker behind)."""
    if not sys.platform.startswith("linux"):
        return
    try:
        import ctypes

        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except OSError:
        return
    parent = os.environ.get("KERNEL_SEARCH_PARENT_PID")
    if parent and os.getppid() != int(parent):  # the parent died before prctl took effect
        os._exit(1)
