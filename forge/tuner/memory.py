"""The memory model of a search: what validating and timing one candidate of a spec take, from the spec
alone; how many workers may validate at once given the free memory; how many timing sets fit.

Validation (validate.check_candidate, in each worker, one input distribution at a time):

    inputs    one set of the spec's inputs (TensorSpec.span_bytes)
    generate  make_inputs' transient above the finished inputs: a float32 draw, float32 uniforms and a
              bool mask for the largest input (opkit.random_tensor), GENERATE_BYTES_PER_ELEMENT each
    output    the candidate's output, its real size (alloc_output on meta tensors: matmul's M x N)
    oracle    the float64 result (8 bytes per output element), then one chunk of the oracle's working
              set: opkit.oracle_budget(inputs) for ops whose oracle is chunked (ORACLE_CHUNK or their own,
              bounded oracle), else float64 copies of the inputs plus three output-sized temporaries
    compare   one chunk of validate.compare: min(output elements, COMPARE_CHUNK) x COMPARE_BYTES_PER_ELEMENT

    validation = (inputs + max(generate, output + oracle result + max(oracle chunk, compare))) x (1 + SLACK)
                 + SCRATCH (the candidate's own workspace: split-K partials, split-KV partials)

Timing (timing.Bench, in the timing worker): one set is inputs + output; the sets rotate to defeat the L2
(3x its size, at most timing.MAX_SETS) and take at most TIMING_SHARE of the free memory, at least one.

Admission: a worker validates while the others do; `validation_lanes` workers validate at once: as many as
the free memory (measured by a worker: torch.cuda.mem_get_info plus its own allocator's unused cache on
CUDA, the host's MemAvailable for the interpreter) holds at HEADROOM, never more than the pool, never fewer
than one. A spec that needs most of the GPU is validated by one worker at a time.
"""

from __future__ import annotations

import os
from dataclasses import asdict, dataclass

from forge import opkit
from forge.spec import KernelSpec
from forge.tuner.validate import COMPARE_BYTES_PER_ELEMENT, COMPARE_CHUNK

GiB = 2**30

GENERATE_BYTES_PER_ELEMENT = 9  # float32 draw + float32 uniforms + bool mask (the outliers distribution)
SLACK = 0.10  # allocator rounding and fragmentation
SCRATCH = 256 << 20
HEADROOM = 0.90  # the share of the free memory admission hands out
TIMING_SHARE = 0.50  # the share of the free memory the timing sets may take
EAGER_TEMPORARIES = 4  # output-sized temporaries of an eager reference (rmsnorm's five kernels)


def gib(n: float) -> str:
    return f"{n / GiB:,.1f} GiB"


@dataclass(frozen=True)
class Footprint:
    """Bytes, per worker, of what validating and timing one candidate of a spec hold (module docstring)."""

    inputs: int
    generate: int
    output: int
    oracle_result: int
    oracle_chunk: int
    compare: int

    @property
    def validation(self) -> int:
        core = self.inputs + max(self.generate, self.output + self.oracle_result + max(self.oracle_chunk,
                                                                                      self.compare))
        return int(core * (1 + SLACK)) + SCRATCH

    @property
    def timing_set(self) -> int:
        return self.inputs + self.output

    def timing(self, n_sets: int) -> int:
        """The timing worker's peak with n_sets rotating sets: the sets and eager's temporaries."""
        return n_sets * self.timing_set + EAGER_TEMPORARIES * self.output + SCRATCH

    def describe(self) -> str:
        return (f"~{gib(self.validation)} per validating worker (inputs {gib(self.inputs)}, output "
                f"{gib(self.output)}, float64 oracle {gib(self.oracle_result)} + chunks of {gib(self.oracle_chunk)}, "
                f"input generation {gib(self.generate)}); a timing set {gib(self.timing_set)}")

    def to_dict(self) -> dict[str, int]:
        return {**asdict(self), "validation": self.validation, "timing_set": self.timing_set}


def _meta_output(opmod, spec: KernelSpec) -> tuple[int, int]:
    """(bytes, elements) of the op's output for `spec`: alloc_output on meta tensors (no memory)."""
    try:
        import torch

        meta = tuple(torch.empty(t.shape, dtype=opkit.torch_dtype(t.dtype), device="meta") for t in spec.inputs)
        out = opmod.alloc_output(meta, spec)
        return out.numel() * out.element_size(), out.numel()
    except Exception:  # noqa: BLE001 - an op whose alloc_output needs data: assume input 0's size
        first = spec.inputs[0]
        return first.span_bytes, first.numel


def oracle_is_bounded(opmod) -> bool:
    """Whether the op's oracle keeps its working set within opkit.oracle_budget: the default oracle with
    an ORACLE_CHUNK declaration, or an op's own oracle (the built-in ones are; see kernels/)."""
    defaulted = getattr(opmod, "_forge_defaults", frozenset())
    return getattr(opmod, "ORACLE_CHUNK", None) is not None or "oracle" not in defaulted


def estimate(opmod, spec: KernelSpec) -> Footprint:
    inputs = sum(t.span_bytes for t in spec.inputs)
    out_bytes, out_elems = _meta_output(opmod, spec)
    if oracle_is_bounded(opmod):
        chunk = opkit.oracle_budget(inputs)
    else:  # the whole reference in float64: copies of the inputs and a few output-sized temporaries
        chunk = sum(8 * t.numel for t in spec.inputs) + 3 * 8 * out_elems
    return Footprint(
        inputs=inputs,
        generate=GENERATE_BYTES_PER_ELEMENT * max(t.numel for t in spec.inputs),
        output=out_bytes,
        oracle_result=8 * out_elems,
        oracle_chunk=chunk,
        compare=min(out_elems, COMPARE_CHUNK) * COMPARE_BYTES_PER_ELEMENT,
    )


def validation_lanes(footprint: int, free: int | None, workers: int) -> int:
    """How many of `workers` may validate at once: the free memory at HEADROOM over one validation's
    footprint, at least one, at most all (free unknown: all)."""
    workers = max(1, workers)
    if free is None:
        return workers
    return max(1, min(workers, int(free * HEADROOM) // max(1, footprint)))


def timing_sets(set_bytes: int, free: int | None, want: int) -> int:
    """Timing sets to hold: `want` (the L2 rule), as far as TIMING_SHARE of the free memory holds them,
    at least one. `free` is measured with the first set already made (it is counted in)."""
    want = max(1, want)
    if free is None:
        return want
    return max(1, min(want, 1 + int(free * TIMING_SHARE) // max(1, set_bytes)))


def is_oom(exc: BaseException | None) -> bool:
    """Out of host or device memory: MemoryError, torch.OutOfMemoryError (CUDA), or the CPU allocator's
    RuntimeError, itself or as the cause of what was raised (timing wraps failures in CandidateRaised)."""
    while exc is not None:
        text = str(exc).lower()
        if (isinstance(exc, MemoryError) or type(exc).__name__ == "OutOfMemoryError"
                or (isinstance(exc, RuntimeError) and ("out of memory" in text or "can't allocate memory" in text))):
            return True
        exc = exc.__cause__
    return False


def available_host_memory() -> int | None:
    """MemAvailable of /proc/meminfo (Linux), None where unknown."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def total_host_memory() -> int:
    return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def free_memory(backend: str) -> tuple[int | None, int | None]:
    """(free, total) bytes of the memory this process's tensors live in, as it sees it now: the GPU's
    free memory plus what its own caching allocator holds unused (CUDA), or the host's available memory
    (the interpreter's tensors are CPU tensors)."""
    if backend == "cuda":
        import torch

        free, total = torch.cuda.mem_get_info()
        return free + torch.cuda.memory_reserved() - torch.cuda.memory_allocated(), total
    return available_host_memory(), total_host_memory()


def give_back(backend: str, collect: bool = True) -> None:
    """Return what this process no longer uses: collect garbage (tensors held by reference cycles, e.g.
    a failed candidate's traceback) and empty the CUDA caching allocator."""
    if collect:
        import gc

        gc.collect()
    if backend == "cuda":
        import torch

        torch.cuda.empty_cache()
