"""The worker process: compiles, validates and times candidates sent by the parent.

Started as `python -m forge.tuner.worker FD BACKEND` by forge/tuner/pool.py (a fresh interpreter, never
forked from a parent that may hold a CUDA context). Protocol: the parent sends dicts over a
Connection on inherited fd FD, the worker answers one dict per request.
Everything a candidate does wrong comes back as a value: {"status": ..., "reason": ...}. A CUDA error
poisons the context, so after reporting one the worker exits and the parent starts a fresh one; so does
an out-of-memory, whose reply says where it happened ("stage": the candidate's code, or forge's own).
Memory goes back between requests: garbage collected (large specs, failures) and the CUDA caching
allocator emptied after every validate and time request; the timing sets and graphs at the next setup.
Requests: setup, validate, time, memory (the free bytes as this worker sees them), exit.

Nothing heavy is imported at module level: TRITON_INTERPRET must be set before triton is imported.
"""

from __future__ import annotations

import os
import sys
import time
import traceback
from typing import Any

from forge.tuner.status import Status

CUDA_ERROR_MARKERS = ("CUDA error", "cudaError", "CUDA_ERROR", "illegal memory access",
                      "unspecified launch failure", "device-side assert")


def _is_cuda_error(exc: BaseException) -> bool:
    while exc is not None:
        name = type(exc).__name__
        if name == "AcceleratorError" or any(m in str(exc) for m in CUDA_ERROR_MARKERS):
            return True
        exc = exc.__cause__ or exc.__context__
    return False


def _is_compile_error(exc: BaseException) -> bool:
    names = {cls.__name__ for cls in type(exc).__mro__}
    return bool(names & {"CompilationError", "CompileTimeAssertionFailure", "OutOfResources",
                         "PTXASError", "SyntaxError"})


def _short(exc: BaseException, limit: int = 600) -> str:
    if isinstance(exc, SyntaxError):
        return f"SyntaxError: {exc.msg} (rendered source line {exc.lineno})"
    text = "".join(traceback.format_exception_only(type(exc), exc)).strip()
    return text if len(text) <= limit else text[: limit - 3] + "..."


# The worker protocol's own replies besides outcomes: started, and a forge bug inside the worker. A
# timing request one of whose candidates fails gets that candidate's outcome plus "failed": its path.
READY, INTERNAL = "ready", "internal"


def _is_oom(exc: BaseException | None) -> bool:
    """Out of host or device memory: MemoryError, torch.OutOfMemoryError (CUDA), or the CPU allocator's
    RuntimeError, itself or as the cause of what was raised (timing wraps failures in CandidateRaised)."""
    from forge.tuner.memory import is_oom

    return is_oom(exc)


# Where an out-of-memory happened ("stage" of an oom reply): in the candidate's own code (its outcome), or
# in forge's: the validation inputs, float64 oracle or comparison; the eager baseline; the timing sets.
# Only the first is the candidate's; the engine fails the search (exit 3) with the numbers for the others.
# "forge": somewhere else in forge's handling of a request.
CANDIDATE, VALIDATION, EAGER, TIMING, FORGE = "candidate", "validation", "eager", "timing", "forge"
# Inputs at least this large: garbage is collected after every request (below it, reference counting
# frees the tensors; gc.collect costs ~30-70 ms with torch and triton loaded).
COLLECT_BYTES = 64 << 20


def _oom_reply(exc: BaseException, stage: str = CANDIDATE) -> dict:
    # The worker exits after replying: a fresh one does not carry the fragmented allocator.
    return {"status": Status.OOM, "reason": f"out of memory: {_short(exc)}", "poisoned": True, "stage": stage}


class Session:
    def __init__(self, backend: str):
        self.backend = backend
        self.op = None
        self.spec = None
        self.bench = None
        self.modules: dict[str, Any] = {}
        self.large = False  # the spec's inputs are large enough to collect garbage after every request

    # -- requests ---------------------------------------------------------------------------------
    def setup(self, msg: dict) -> dict:
        from forge import ops
        from forge.spec import KernelSpec
        from forge.tuner import memory

        # The previous spec's timing sets, CUDA graphs and modules go, and their memory back to the device.
        self.bench = None
        self.modules.clear()
        memory.give_back(self.backend)
        if self.backend == "cuda":  # the peak each reply reports is this spec's
            import torch

            torch.cuda.reset_peak_memory_stats()
        self.op = ops.get(msg["op"]).module
        self.spec = KernelSpec.from_dict(msg["spec"])
        self.seed = int(msg.get("seed", 0))
        self.large = sum(t.span_bytes for t in self.spec.inputs) >= COLLECT_BYTES
        return {"status": Status.OK}

    def memory(self, msg: dict) -> dict:
        """The free and total bytes of the memory candidates run in, as this worker sees them now."""
        from forge.tuner import memory

        memory.give_back(self.backend, collect=False)
        free, total = memory.free_memory(self.backend)
        return {"status": Status.OK, "free": free, "total": total}

    def peak(self) -> int | None:
        """Bytes the CUDA caching allocator reserved at most since this spec's setup (None off CUDA)."""
        if self.backend != "cuda":
            return None
        import torch

        return int(torch.cuda.max_memory_reserved())

    def give_back(self, reply: dict) -> None:
        """After a request: what it allocated goes back (the timing sets stay until the next setup)."""
        from forge.tuner import memory

        memory.give_back(self.backend, collect=self.large or reply.get("status") != Status.OK)

    def _load(self, path: str):
        from forge.loader import load_module

        if path not in self.modules:
            self.modules[path] = load_module(path)
        return self.modules[path]

    def _sync(self) -> None:
        if self.backend == "cuda":
            import torch

            torch.cuda.synchronize()

    def _torch_op(self):
        """torch's fused op for this spec as a call (the engine sends TORCH_OP_PATH only where there is one)."""
        from forge import fused

        f = fused.candidate(self.spec.op, self.spec.attrs, self.spec)
        if f is None:
            raise ValueError(f"{self.spec.op} has no torch-op candidate for {self.spec.attrs}")
        attrs = self.spec.attrs
        return lambda inputs: f.fn(inputs, attrs)

    def validate(self, msg: dict) -> dict:
        from forge.tuner.validate import TORCH_OP_PATH, CandidateRaised, check_candidate

        call, module = None, None
        if msg["path"] == TORCH_OP_PATH:
            call = self._torch_op()
        else:
            try:
                module = self._load(msg["path"])
            except Exception as exc:  # noqa: BLE001 - a rendered module that fails to import
                return {"status": Status.COMPILE_ERROR, "reason": _short(exc)}
        try:
            reason = check_candidate(self.op, module, self.spec, self.seed, self._sync, call=call)
        except CandidateRaised as exc:
            return self._failure(exc.__cause__ or exc)
        except Exception as exc:  # noqa: BLE001 - forge's inputs, oracle or comparison
            if _is_oom(exc):  # not the candidate's: the engine decides (fewer lanes, or exit 3)
                return _oom_reply(exc, VALIDATION)
            raise
        if reason is not None:
            return {"status": Status.MISMATCH, "reason": reason}
        return {"status": Status.OK}

    def _failure(self, exc: BaseException) -> dict:
        if _is_oom(exc):
            return _oom_reply(exc)
        if _is_cuda_error(exc):
            return {"status": Status.CUDA_ERROR, "reason": _short(exc), "poisoned": True}
        if _is_compile_error(exc):
            return {"status": Status.COMPILE_ERROR, "reason": _short(exc)}
        return {"status": Status.ERROR, "reason": _short(exc)}

    def time(self, msg: dict) -> dict:
        """Time the listed candidates (and the eager baseline if asked). With rounds > 1 the
        contestants are sampled in alternation (A B C A B C ...) so drift affects all equally."""
        from forge.tuner.timing import Bench
        from forge.tuner.validate import TORCH_OP_PATH, CandidateRaised

        if self.bench is None:
            try:
                self.bench = Bench(self.op, self.spec, self.backend, self.seed)
            except Exception as exc:  # noqa: BLE001 - forge's timing sets
                if _is_oom(exc):
                    return _oom_reply(exc, TIMING)
                raise
        bench = self.bench
        samplers = {}
        if msg.get("baseline"):
            try:
                samplers["eager"] = bench.prepare(bench.baseline_fn())
            except CandidateRaised as exc:  # eager failed: forge's problem, never a candidate's
                if _is_oom(exc):
                    return _oom_reply(exc.__cause__ or exc, EAGER)
                raise
        for path in msg["paths"]:
            try:
                fn = bench.call_fn(self._torch_op()) if path == TORCH_OP_PATH else bench.candidate_fn(self._load(path))
                samplers[path] = bench.prepare(fn)
            except CandidateRaised as exc:
                return {**self._failure(exc.__cause__ or exc), "failed": path}
        if msg.get("settle_ms"):
            bench.settle(next(iter(samplers.values())), msg["settle_ms"])
        samples: dict[str, list[float]] = {name: [] for name in samplers}
        for _ in range(int(msg.get("rounds", 1))):
            for name, sampler in samplers.items():
                for _ in range(int(msg.get("reps", 1))):
                    try:
                        samples[name].append(sampler())
                    except Exception as exc:  # noqa: BLE001 - a candidate's replay failed: name it, the
                        if name == "eager":  # engine times the others without it; eager's is forge's problem
                            raise
                        return {**self._failure(exc), "failed": name}
        launches = {name: getattr(s, "launches", 1) for name, s in samplers.items()}
        return {"status": Status.OK, "samples": samples, "launches": launches}


def die_with_parent() -> None:
    """Ask the kernel to SIGKILL this worker when the parent thread that started it ends (Linux), so a
    killed forge never leaves a worker running a hanging candidate; and exit now if the parent is
    already gone (it died between fork and this call)."""
    parent = os.environ.get("FORGE_WORKER_PARENT")
    if sys.platform.startswith("linux"):
        import ctypes
        import signal

        pr_set_pdeathsig = 1
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(pr_set_pdeathsig, signal.SIGKILL, 0, 0, 0)
    if parent is not None and os.getppid() != int(parent):
        os._exit(0)


def main(conn, backend: str) -> None:
    die_with_parent()
    if backend == "interpreter":
        os.environ["TRITON_INTERPRET"] = "1"
    import torch
    import triton  # noqa: F401 - import now so start-up cost is paid before the first timeout

    if backend == "cuda":
        torch.cuda.init()
        torch.zeros(1, device="cuda")  # create the context now, not inside the first candidate
    session = Session(backend)
    conn.send({"status": READY, "pid": os.getpid()})
    handlers = {"setup": session.setup, "validate": session.validate, "time": session.time,
                "memory": session.memory}
    while True:
        try:
            msg = conn.recv()
        except EOFError:  # the parent went away
            break
        if msg["cmd"] == "exit":
            break
        started = time.monotonic()
        try:
            reply = handlers[msg["cmd"]](msg)
        except Exception as exc:  # noqa: BLE001 - forge's own failure: report it with the traceback
            if _is_oom(exc):  # allocating inputs, outputs or the oracle: an outcome, not a bug in forge
                reply = _oom_reply(exc, FORGE)
            elif _is_cuda_error(exc):
                reply = {"status": Status.CUDA_ERROR, "reason": _short(exc), "poisoned": True}
            else:
                reply = {"status": INTERNAL, "reason": traceback.format_exc()}
        if not reply.get("poisoned") and msg["cmd"] in ("validate", "time"):
            session.give_back(reply)
            reply["peak"] = session.peak()
        reply["seconds"] = time.monotonic() - started  # this request's cost in the worker (compile included)
        conn.send(reply)
        if reply.get("poisoned"):
            sys.stdout.flush()
            os._exit(70)  # a CUDA error poisons this context: the parent replaces us


if __name__ == "__main__":
    from multiprocessing.connection import Connection

    main(Connection(int(sys.argv[1])), sys.argv[2])
