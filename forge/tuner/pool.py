"""Worker pool in the parent: spawned subprocesses, per-request timeouts, kill-and-replace.

Workers are fresh interpreters started with `python -m forge.tuner.worker` (never forked from a parent
that may hold a CUDA context) and talk to the parent over a socketpair wrapped in a
multiprocessing Connection. Not multiprocessing's spawn method: that re-imports the parent's
`__main__`, so a user script calling a `@forge.optimize` function at top level (no `__main__` guard)
was re-run inside every worker and the workers died on start (seen with a script piped to python).

Workers die with their parent: each asks the kernel for SIGKILL when the thread that started it ends
(PR_SET_PDEATHSIG, forge/tuner/worker.py), so a parent killed by SIGKILL/SIGTERM (`timeout`, Slurm,
docker) leaves no worker running a hanging candidate behind. Their output goes to unlinked temporary
files, so a killed run leaves no log directory behind either.

The parent never dies because of a candidate: a worker that times out is killed, one that dies
(segfault, os._exit) is noticed through its closed pipe, one that reports a CUDA error exits; in every
case the failure is recorded against the candidate and a fresh worker takes its place. Healthy workers
are reused so Python/torch start-up (~2 s on CPU) is not paid per candidate. How many workers validate at
once is the engine's call (map's `lanes`: engine.Admission, the free memory over the spec's footprint,
forge/tuner/memory.py); the others wait idle, holding no tensors.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
import time
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from multiprocessing.connection import Pipe, wait
from pathlib import Path
from typing import Any

from forge.errors import EnvironmentProblem, ForgeError
from forge.tuner import memory
from forge.tuner.status import Status
from forge.tuner.worker import INTERNAL, READY

# Importing torch + triton + creating a CUDA context: 8 workers started in 5.5 s on the H200 machine
# and one in ~2 s on the 2-core CPU machine; 180 s leaves room for a cold disk or a loaded host.
STARTUP_TIMEOUT_S = 180.0


class WorkerInternalError(ForgeError):
    """forge's own code failed inside a worker (a bug, not a candidate's fault)."""


def _log_tail(log, limit: int = 1500) -> str:
    """The last `limit` bytes a worker wrote to its log (an unlinked temporary file). pread leaves the
    file offset, which the worker shares, where it is."""
    try:
        fd = log.fileno()
        size = os.fstat(fd).st_size
        data = os.pread(fd, limit, max(0, size - limit))
    except (OSError, ValueError):  # ValueError: already closed
        return ""
    return data.decode(errors="replace").strip()


def _describe_exit(code: int | None) -> str:
    if code is None:
        return "still running"
    if code < 0:
        try:
            return f"killed by signal {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exited with status {code}"


_ROOT = Path(__file__).resolve().parents[2]  # the directory holding forge/ and forge_cli/


def worker_env(base, gpu: int | None) -> dict[str, str]:
    env = dict(base)
    # The worker imports forge from wherever this process did (installed, or a source tree).
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(_ROOT), env.get("PYTHONPATH")]))
    if gpu is not None:
        # gpu is an index into the parent's view of the GPUs, so it composes with an outer
        # CUDA_VISIBLE_DEVICES (a Slurm allocation, Ray) instead of overriding it.
        outer = [d.strip() for d in env.get("CUDA_VISIBLE_DEVICES", "").split(",") if d.strip()]
        env["CUDA_VISIBLE_DEVICES"] = outer[gpu] if gpu < len(outer) else str(gpu)
    return env


class _Proc:
    """subprocess.Popen with the few multiprocessing.Process methods the pool uses."""

    def __init__(self, popen: subprocess.Popen):
        self.popen = popen
        self.pid = popen.pid

    def is_alive(self) -> bool:
        return self.popen.poll() is None

    def kill(self) -> None:
        self.popen.kill()

    def join(self, timeout: float | None = None) -> None:
        try:
            self.popen.wait(timeout)
        except subprocess.TimeoutExpired:
            pass

    @property
    def exitcode(self) -> int | None:
        return self.popen.poll()


@dataclass
class Worker:
    index: int
    proc: Any
    conn: Any
    log: Any  # the unlinked temporary file holding its stdout/stderr
    ready: bool = False
    task: Any = None
    deadline: float = 0.0
    started: float = field(default_factory=time.monotonic)


class Pool:
    def __init__(self, backend: str, size: int, setup: dict, gpu: int | None = None):
        self.backend = backend
        self.gpu = gpu  # workers see only this GPU (as cuda:0); None: whatever the parent sees
        self.size = max(1, size)
        self.setup_msg = setup
        self.workers: list[Worker] = []
        self._serial = 0
        self.replaced = 0
        # The largest device memory (bytes the CUDA caching allocator reserved) any worker reported since
        # reset_peak(): what one worker needed at most for the current spec (issue 15's report).
        self.peak: int | None = None

    def reset_peak(self) -> None:
        self.peak = None

    # -- lifecycle --------------------------------------------------------------------------------
    def _spawn(self) -> Worker:
        self._serial += 1
        parent_conn, child_conn = Pipe()
        fd = child_conn.fileno()
        env = worker_env(os.environ, self.gpu)
        env["FORGE_WORKER_PARENT"] = str(os.getpid())
        # The worker's stdout/stderr (incl. C-level output: a segfault message, Triton's compiler)
        # go to an unlinked temporary file the parent reads when the worker dies.
        log = tempfile.TemporaryFile(prefix="forge-worker-")
        popen = subprocess.Popen(
            [sys.executable, "-m", "forge.tuner.worker", str(fd), self.backend],
            pass_fds=(fd,), stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT, env=env)
        child_conn.close()
        return Worker(self._serial, _Proc(popen), parent_conn, log)

    def _await_ready(self, workers: list[Worker]) -> None:
        deadline = time.monotonic() + STARTUP_TIMEOUT_S
        waiting = {w.conn: w for w in workers if not w.ready}
        while waiting:
            ready = wait(list(waiting), timeout=max(0.0, deadline - time.monotonic()))
            if not ready:
                for w in waiting.values():
                    self._kill(w)
                raise EnvironmentProblem(
                    f"worker did not start within {STARTUP_TIMEOUT_S:.0f} s; log: {_log_tail(w.log)}")
            for conn in ready:
                w = waiting.pop(conn)
                try:
                    msg = conn.recv()
                except EOFError:
                    w.proc.join(5)
                    raise EnvironmentProblem(
                        f"worker failed to start ({_describe_exit(w.proc.exitcode)}):\n{_log_tail(w.log)}"
                    ) from None
                if msg.get("status") != READY:
                    raise EnvironmentProblem(f"worker sent {msg!r} instead of ready")
                w.ready = True
                w.conn.send(self.setup_msg)
                reply = w.conn.recv()
                if reply.get("status") != Status.OK:
                    raise WorkerInternalError(f"worker setup failed: {reply.get('reason')}")

    def reconfigure(self, setup: dict, timeout: float = STARTUP_TIMEOUT_S) -> None:
        """Point every worker at a new spec (a manifest's next entry) without restarting it."""
        self.setup_msg = setup  # replacements started from now on get it at start
        for w in list(self.workers):
            try:
                w.conn.send(setup)
                reply = w.conn.recv() if w.conn.poll(timeout) else None
            except (BrokenPipeError, EOFError, OSError):
                reply = None
            if reply is None:  # died or hung since its last task: a fresh one gets the new setup
                self._replace(w)
            elif reply.get("status") != Status.OK:
                raise WorkerInternalError(f"worker setup failed: {reply.get('reason')}")

    def start(self) -> Pool:
        self.workers = [self._spawn() for _ in range(self.size)]
        self._await_ready(self.workers)
        return self

    def _kill(self, w: Worker) -> None:
        if w.proc.is_alive():
            w.proc.kill()
        w.proc.join(10)
        w.conn.close()
        w.log.close()

    def _replace(self, w: Worker) -> Worker:
        self._kill(w)
        self.replaced += 1
        fresh = self._spawn()
        self.workers[self.workers.index(w)] = fresh
        self._await_ready([fresh])
        return fresh

    def close(self) -> None:
        for w in self.workers:
            try:
                if w.proc.is_alive():
                    w.conn.send({"cmd": "exit"})
            except (BrokenPipeError, OSError):
                pass
        for w in self.workers:
            w.proc.join(5)
            if w.proc.is_alive():
                w.proc.kill()
                w.proc.join(5)
            w.conn.close()
            w.log.close()
        self.workers = []

    def __enter__(self) -> Pool:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.close()

    # -- work -------------------------------------------------------------------------------------
    def _outcome_of_death(self, w: Worker) -> dict:
        w.proc.join(10)
        tail = _log_tail(w.log, 600)
        reason = f"worker {_describe_exit(w.proc.exitcode)}"
        if tail:
            reason += f"; last output: {tail}"
        return {"status": Status.CRASHED, "reason": reason}

    def map(self, tasks: Iterable[tuple[Any, dict]], timeout: float,
            on_result: Callable[[Any, dict], None] | None = None, lanes: int | None = None) -> dict[Any, dict]:
        """Run (tag, request) pairs on the first `lanes` workers (default: all) in parallel; returns
        tag -> reply. Replies for failures forge detects from outside: timeout, crashed (and
        cuda-error from inside)."""
        lanes = len(self.workers) if lanes is None else lanes
        queue = deque(tasks)
        results: dict[Any, dict] = {}

        def finish(tag: Any, reply: dict) -> None:
            results[tag] = reply
            if on_result is not None:
                on_result(tag, reply)

        while queue or any(w.task is not None for w in self.workers):
            for w in self.workers[:lanes]:
                if w.task is None and queue:
                    tag, req = queue.popleft()
                    try:
                        w.conn.send(req)
                    except (BrokenPipeError, OSError):
                        queue.appendleft((tag, req))
                        self._replace(w)
                        break
                    w.task, w.deadline = (tag, req), time.monotonic() + timeout
            busy = [w for w in self.workers if w.task is not None]
            if not busy:
                continue
            next_deadline = min(w.deadline for w in busy)
            ready = wait([w.conn for w in busy], timeout=max(0.0, next_deadline - time.monotonic()))
            for w in list(busy):
                if w.conn not in ready:
                    continue
                tag = w.task[0]
                try:
                    reply = w.conn.recv()
                except (EOFError, OSError):
                    w.task = None
                    finish(tag, self._outcome_of_death(w))
                    self._replace(w)
                    continue
                w.task = None
                if isinstance(reply.get("peak"), int):
                    self.peak = max(self.peak or 0, reply["peak"])
                if reply.get("status") == INTERNAL:
                    raise WorkerInternalError(f"forge failed inside a worker:\n{reply['reason']}")
                finish(tag, reply)
                if reply.get("poisoned"):
                    self._replace(w)
            now = time.monotonic()
            for w in list(self.workers):
                if w.task is not None and now >= w.deadline and w.conn not in ready:
                    tag = w.task[0]
                    w.task = None
                    finish(tag, {"status": Status.TIMEOUT, "reason": f"no answer within {timeout:g} s; worker killed"})
                    self._replace(w)
        return results

    def call(self, request: dict, timeout: float) -> dict:
        """One request on the first worker (the timing lane; the others stay idle meanwhile)."""
        return self.map([("call", request)], timeout, lanes=1)["call"]


def default_size(backend: str) -> int:
    cores = os.cpu_count() or 1
    # On the H200 machine (16 cores) 8 workers validated 50 candidates in 1.7 s but took 5.5 s to
    # start, so more workers would mostly add start-up. The interpreter is CPU-bound: one per core.
    return max(1, min(8, cores)) if backend == "cuda" else max(1, min(2, cores))


# Host memory one worker may take: torch + triton imported is ~290 MiB RSS on the CPU machine
# (measured 2026-12-03); validating and timing a candidate adds its inputs, outputs and the float64
# oracle. 1 GiB per worker leaves room for that at the shapes a host-side worker holds.
WORKER_HOST_BYTES = 1 << 30


def _available_host_memory() -> int | None:
    return memory.available_host_memory()


def capped_size(requested: int, backend: str) -> tuple[int, str | None]:
    """The worker count to start for `requested`: at most one per CPU core and as many as the available
    host memory admits at WORKER_HOST_BYTES each (never below one). Returns (size, why it was capped)."""
    cores = os.cpu_count() or 1
    size, why = requested, None
    if size > cores:
        size, why = cores, f"{cores} CPU core{'s' if cores != 1 else ''}"
    avail = _available_host_memory()
    if avail is not None and size > max(1, avail // WORKER_HOST_BYTES):
        size = max(1, avail // WORKER_HOST_BYTES)
        why = f"{avail / 2**30:.1f} GiB of available host memory at {WORKER_HOST_BYTES / 2**30:.0f} GiB per worker"
    return size, (f"{requested} workers requested; starting {size} ({why})" if size != requested else None)
