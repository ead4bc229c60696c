"""One CUDA graph per captured graph of the TorchDynamo backend (`Backend(cudagraphs=True)`): the whole
graph, forge's kernels and the nodes around them, replayed with one launch instead of hundreds.

Why: on the H200 the backend was host-bound on real models (HF GPT-2 prefill, run e: 2.18 ms of device
time for 3.75 ms per call; Llama 3.67 for 4.45): Python and the launch of every op of the graph cost more
than the GPU work. A replay costs one launch plus a copy of each input that changed storage.

The rule (GraphedRun):
- call 1 runs as usual and notes where each tensor input lives; call 2 finds the inputs whose storage did
  not move (parameters, buffers, a static KV cache: read in place by the graph) and the others (token ids,
  activations: copied into static buffers before each replay), warms up on a side stream and captures;
  later calls copy the moving inputs and replay.
- TorchDynamo's guards already fixed every input's shape, stride and dtype for this graph (static shapes);
  the graph bakes in the storage of the inputs read in place, so a call where one of them moved is run
  without the graph and the next call captures again; non-tensor inputs must equal the captured values.
- Never replayed (the reason is kept): a graph that writes into one of its inputs in place (into a moving
  input the write would land in the static copy; into any, the warm-up and capture runs would repeat it:
  HF's StaticCache index_copy_ is such a graph), CPU tensor inputs, a capture that fails (CPU work or a sync
  inside: the graph then runs as it did before).
- Outputs are copied out of the graph's static buffers (clone_outputs, the default): a replay overwrites
  them, and a caller holding the previous call's logits must not see them change.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

# fx targets that write into their first argument (or, for setitem, into the indexed tensor): names with a
# trailing underscore (add_, copy_, index_copy_), setitem and the augmented assignments (x += y on a tensor)
_INPLACE_EXCEPTIONS = frozenset({"requires_grad_"})
_AUGMENTED = frozenset({"iadd", "isub", "imul", "itruediv", "ifloordiv", "imod", "ipow", "iand", "ior", "ixor",
                        "ilshift", "irshift", "imatmul", "setitem"})
_VIEW_OPS = frozenset({"view", "reshape", "transpose", "permute", "unsqueeze", "squeeze", "expand", "getitem",
                       "narrow", "select", "as_strided", "t", "flatten", "unflatten", "contiguous", "view_as",
                       "expand_as", "split", "chunk", "unbind", "detach", "alias"})


def _name(node) -> str:
    t = node.target
    return t if isinstance(t, str) else getattr(t, "__name__", str(t))


def mutated_inputs(gm) -> set[int]:
    """Indices of the placeholders of `gm` that some node writes into in place (an op named with a trailing
    underscore, setitem, or an out= argument), directly or through views of them."""
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    root: dict = {n: i for i, n in enumerate(placeholders)}
    out: set[int] = set()
    for n in gm.graph.nodes:
        if n.op not in ("call_function", "call_method"):
            continue
        name = _name(n)
        first = n.args[0] if n.args else None
        if name in _VIEW_OPS and first in root:
            root[n] = root[first]  # a view (or, conservatively, a copy) of an input: writes to it count
        written = []
        if (name.endswith("_") and not name.startswith("_") and name not in _INPLACE_EXCEPTIONS) or name in _AUGMENTED:
            written.append(first)
        if "out" in n.kwargs:
            written.append(n.kwargs["out"])
        for w in written:
            for t in (w if isinstance(w, (tuple, list)) else (w,)):
                if t in root:
                    out.add(root[t])
    return out


def _torch_capture(fn: Callable, args: list, device_index: int):
    """Warm `fn` up on a side stream (lazy initialisations, first launches stay out of the graph), then
    capture one call: (replay, the captured call's outputs)."""
    import torch

    side = torch.cuda.Stream(device_index)
    side.wait_stream(torch.cuda.current_stream(device_index))
    with torch.cuda.stream(side):
        for _ in range(2):
            fn(*args)
    torch.cuda.current_stream(device_index).wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fn(*args)
    return graph.replay, out


class GraphedRun:
    """`run` (a captured graph's forward) replayed from a CUDA graph from its third call on; see the module
    docstring. `capture(fn, args, device_index) -> (replay, outputs)` is swappable (tests use a fake)."""

    def __init__(self, run: Callable, mutated: set[int], device_index: int = 0, clone_outputs: bool = True,
                 capture: Callable = _torch_capture, first_args: tuple | None = None, require_cuda: bool = True):
        self.run, self.mutated, self.device_index = run, frozenset(mutated), device_index
        self.require_cuda = require_cuda  # False only with a capture that is not CUDA's (tests' fake)
        self.clone_outputs, self._capture = clone_outputs, capture
        self.reason: str | None = None  # why this graph is never replayed
        if self.mutated:
            self.reason = (f"the graph writes in place into its input(s) {sorted(self.mutated)} (a warm-up or "
                           "capture run would repeat the write)")
        self.calls = self.replays = self.captures = self.moved = 0
        self._first: list | None = None  # call 1: each input's storage (or value, for non-tensors)
        if first_args is not None:  # the backend's planning call ran the graph on these: call 1 was that
            self._first = self._check_first(first_args)
        self._replay: Callable | None = None
        self._static: list = []  # the graph's inputs: the caller's tensor (read in place) or a static copy
        self._moving: list[int] = []
        self._pinned: list[tuple[int, int]] = []  # (input index, storage pointer) read in place
        self._values: list[tuple[int, Any]] = []  # non-tensor inputs and their captured values
        self._out: Any = None

    @staticmethod
    def _where(a) -> Any:
        import torch

        return a.data_ptr() if isinstance(a, torch.Tensor) else ("value", a)

    def __call__(self, *args):
        self.calls += 1
        if self.reason is not None:
            return self.run(*args)
        if self._replay is not None:
            if any(args[i].data_ptr() != p for i, p in self._pinned) or any(args[i] != v for i, v in self._values):
                self.moved += 1  # an input read in place moved (or a value changed): capture again next call
                self._replay, self._first = None, [self._where(a) for a in args]
                return self.run(*args)
            for i in self._moving:
                self._static[i].copy_(args[i])
            self._replay()
            self.replays += 1
            return self._outputs()
        if self._first is None:
            self._first = self._check_first(args)
            return self.run(*args)
        return self._capture_now(args)

    def _check_first(self, args) -> list | None:
        import torch

        if (self.reason is None and self.require_cuda
                and any(isinstance(a, torch.Tensor) and not a.is_cuda for a in args)):
            self.reason = "a CPU tensor input"
        return [self._where(a) for a in args]

    def _capture_now(self, args: tuple):
        import torch

        now = [self._where(a) for a in args]
        tensor = [isinstance(a, torch.Tensor) for a in args]
        moving = [i for i, a in enumerate(args) if tensor[i] and now[i] != self._first[i]]
        static = []
        for i, a in enumerate(args):
            if i in moving:
                s = torch.empty_strided(a.size(), a.stride(), dtype=a.dtype, device=a.device)
                s.copy_(a)
                static.append(s)
            else:
                static.append(a)
        try:
            replay, out = self._capture(self.run, static, self.device_index)
        except RuntimeError as exc:  # CPU work, a host sync or an uncapturable op inside the graph
            self.reason = f"CUDA graph capture failed: {str(exc).strip().splitlines()[0][:200] if str(exc) else exc}"
            if self.require_cuda:
                torch.cuda.synchronize(self.device_index)
            return self.run(*args)
        self.captures += 1
        self._replay, self._static, self._moving, self._out = replay, static, moving, out
        self._pinned = [(i, args[i].data_ptr()) for i in range(len(args)) if tensor[i] and i not in moving]
        self._values = [(i, a) for i, a in enumerate(args) if not tensor[i]]
        # a capture records the launches without running them: replay once for this call's outputs
        replay()
        self.replays += 1
        return self._outputs()

    def _outputs(self):
        import torch

        if not self.clone_outputs:
            return self._out
        if isinstance(self._out, (tuple, list)):
            return type(self._out)(o.clone() if isinstance(o, torch.Tensor) else o for o in self._out)
        return self._out.clone() if isinstance(self._out, torch.Tensor) else self._out

    def describe(self) -> str:
        if self.reason is not None:
            return f"not replayed: {self.reason}"
        return (f"{self.captures} capture(s), {self.replays} replay(s) of {self.calls} call(s)"
                + (f", {self.moved} run without it (an input read in place moved)" if self.moved else ""))
