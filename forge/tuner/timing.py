"""Timing inside a worker. Two clocks, never mixed:

- cuda: device time. Each sample is one CUDA-graph replay of K back-to-back launches over rotating
  input/output sets, bracketed by CUDA events, divided by K. The graph removes host dispatch from
  the measurement (a Triton JIT launch costs ~17.5 µs of host time on the H200 machine, more than a
  2048x4096 rmsnorm takes on the device), and rotating over sets that together exceed 3x the L2
  means every launch reads its inputs from HBM, as it would in a model, instead of from L2. The sets
  take at most half the free memory (memory.timing_sets), at least one set.
- interpreter: host wall time of single calls (time.perf_counter); only good for comparing
  candidates on the same CPU, and labelled as such everywhere.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable

from forge.tuner import memory
from forge.tuner.validate import CandidateRaised

# One graph replay lasts about this long: long enough that event resolution (~0.5 µs) and the
# replay's own launch are <1% of a sample, short enough that 30 samples of 50 candidates take ~2 s.
TARGET_REPLAY_US = 1000.0
MAX_LAUNCHES_PER_GRAPH = 256
MAX_SETS = 256
L2_MULTIPLE = 3


class Bench:
    """Rotating input sets for one spec, and the timing methods used on them."""

    def __init__(self, opmod, spec, backend: str, seed: int):
        import torch

        self.torch = torch
        self.opmod, self.spec, self.backend = opmod, spec, backend
        self.cuda = backend == "cuda"
        # Timing inputs are normal-distributed (never zeros); the validation distributions are
        # separate and fresh, so the timing data cannot make a wrong kernel look right.
        first = opmod.make_inputs(spec, seed + 77, "normal")
        first_out = opmod.alloc_output(first, spec)
        # The real output size (matmul's M x N is not its first input's size).
        set_bytes = sum(t.span_bytes for t in spec.inputs) + first_out.numel() * first_out.element_size()
        if self.cuda:
            l2 = getattr(torch.cuda.get_device_properties(0), "L2_cache_size", 64 << 20)
            want = min(MAX_SETS, max(1, math.ceil(L2_MULTIPLE * l2 / set_bytes)))
        else:
            want = 2
        # Bounded by the free memory too (memory.timing_sets): the inputs of one set may be GiBs.
        n_sets = memory.timing_sets(set_bytes, memory.free_memory(backend)[0] if want > 1 else None, want)
        self.inputs = [first] + [opmod.make_inputs(spec, seed + 77 + i, "normal") for i in range(1, n_sets)]
        self.outputs = [first_out] + [opmod.alloc_output(inp, spec) for inp in self.inputs[1:]]
        self.n_sets = n_sets
        self.sync()

    def sync(self) -> None:
        if self.cuda:
            self.torch.cuda.synchronize()

    # -- the functions being timed: f(i) runs on input set i --------------------------------------
    def candidate_fn(self, module) -> Callable[[int], None]:
        opmod, attrs = self.opmod, self.spec.attrs

        def f(i: int) -> None:
            opmod.run(module, self.inputs[i], self.outputs[i], attrs)

        return f

    def call_fn(self, call) -> Callable[[int], None]:
        """A contestant given as a call that allocates its own result (inputs -> tensor: torch's fused op,
        forge/fused.py; torch.compile; Liger). Its results are held in a ring of n_sets, released one set
        later, so its output buffers rotate as a kernel's preallocated outputs (self.outputs) do. A result
        dropped at once would be freed and its block handed to the next call's allocation (inside a graph
        capture too: the private pool reuses blocks freed during the capture), so every launch of a sample
        would write one buffer that stays in L2 across launches while a kernel's writes go to cold ones: a
        bias against forge's kernels wherever an output fits in L2 (16 MB at rmsnorm 2048x4096 fp16). With
        one set (large tensors) both reuse one output buffer, and nothing is held beyond the call."""
        held: list = [None] * self.n_sets if self.n_sets > 1 else []

        def f(i: int) -> None:
            out = call(self.inputs[i])
            if held:
                held[i % len(held)] = out

        f.held = held  # tests look at it
        return f

    def baseline_fn(self) -> Callable[[int], None]:
        """The op's eager reference, the search's baseline: a call (call_fn says why its results are held)."""
        ref, attrs = self.opmod.reference, self.spec.attrs
        return self.call_fn(lambda inputs: ref(inputs, attrs))

    def warm(self, fn: Callable[[int], None]) -> None:
        """First calls compile/JIT; a failure here is the candidate's (CandidateRaised)."""
        for i in range(min(self.n_sets, 3)):
            try:
                fn(i)
                self.sync()
            except Exception as exc:  # noqa: BLE001 - candidate code may raise anything
                raise CandidateRaised(str(exc)) from exc

    # -- measurement ------------------------------------------------------------------------------
    def prepare(self, fn: Callable[[int], None]) -> Callable[[], float]:
        """Warm `fn` up and return a zero-argument sampler giving µs per call."""
        self.warm(fn)
        if not self.cuda:
            counter = [0]

            def host_sample() -> float:
                i = counter[0] % self.n_sets
                counter[0] += 1
                t0 = time.perf_counter()
                fn(i)
                return (time.perf_counter() - t0) * 1e6

            return host_sample
        try:
            return self._graph_sampler(fn)
        except Exception as exc:  # noqa: BLE001 - capture/replay of candidate code failed
            raise CandidateRaised(f"CUDA-graph timing failed: {exc}") from exc

    def launches_per_sample(self, fn: Callable[[int], None]) -> int:
        """K, the back-to-back launches one sample times (a graph replay, or CUDA events around plain
        launches in forge bench): ~TARGET_REPLAY_US of device time, at most MAX_LAUNCHES_PER_GRAPH."""
        torch = self.torch
        # Estimate the per-call device time with a plain loop to size the sample.
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for k in range(10):
            fn(k % self.n_sets)
        end.record()
        torch.cuda.synchronize()
        per_call_us = max(start.elapsed_time(end) * 1000.0 / 10, 0.5)
        return int(min(MAX_LAUNCHES_PER_GRAPH, max(1, round(TARGET_REPLAY_US / per_call_us))))

    def _graph_sampler(self, fn: Callable[[int], None]) -> Callable[[], float]:
        torch = self.torch
        k_launches = self.launches_per_sample(fn)
        graph = torch.cuda.CUDAGraph()
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            fn(0)  # graph capture must not be the first call on a stream (lazy init inside the op)
        torch.cuda.current_stream().wait_stream(side)
        torch.cuda.synchronize()
        with torch.cuda.graph(graph):
            for k in range(k_launches):
                fn(k % self.n_sets)
        graph.replay()
        torch.cuda.synchronize()
        events = (torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))

        def graph_sample() -> float:
            events[0].record()
            graph.replay()
            events[1].record()
            events[1].synchronize()
            return events[0].elapsed_time(events[1]) * 1000.0 / k_launches

        graph_sample.graph = graph  # keep the graph (and its memory pool) alive with the sampler
        graph_sample.launches = k_launches
        return graph_sample

    def settle(self, sampler: Callable[[], float], ms: float = 200.0) -> None:
        """Run `sampler` for ~ms so the GPU reaches its steady clock before the numbers that count."""
        t_end = time.perf_counter() + ms / 1000.0
        while time.perf_counter() < t_end:
            sampler()

