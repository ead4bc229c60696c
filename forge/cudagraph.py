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

Outputs made by a last GEMM or forge region (GPT-2's and Llama's logits) are not copied out: `split_tail` takes
such a node out of the graph, the graph returns its inputs instead (static buffers, not copied), and the node
runs after each replay on them, allocating its output as it does outside a graph: one launch instead of a
device copy of the whole output (GPT-2's 412 MB of logits: ~0.27 ms, an estimate from the 3.0 TB/s copy
bandwidth measured on the H100 for 824 MB read and written).

`Backend(cudagraphs="auto")` (GraphedRun(auto=True)) keeps a graph only where it measurably pays. A replay
saves the host's dispatch but adds the copies of the moving inputs and of the outputs split_tail leaves in
the graph, and holds the graph's memory pool for good. So the graph's own calls decide: AUTO_SAMPLES calls
run as captured, each timed from an idle GPU to its end (host dispatch and device time together: what the
call costs its caller), then the graph is captured and AUTO_SAMPLES replays (copies included) are timed the
same way. The graph is kept only if the best replay beats the best run by
AUTO_MARGIN and its capture grew the reserved CUDA memory by at most AUTO_MAX_POOL_SHARE of the device's;
otherwise it is released and every later call runs as captured (the reason is kept, with both times).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

# cudagraphs="auto": calls timed on each side (the best counts: a single synchronised call's latency moves by a
# few percent between calls), the lead a replay needs (forge's own decision margin, p80 < p20 / 1.03, as a
# ratio of bests), and the memory a kept graph may hold (its capture's growth of the reserved CUDA memory).
AUTO_SAMPLES = 3
AUTO_MARGIN = 0.97
AUTO_MAX_POOL_SHARE = 0.10
# split_tail: an output under this size is left in the graph and copied out (the copy costs about what a
# launch outside the graph does, a few µs; 1 MiB copies in ~1 µs on an H100 at ~3 TB/s)
TAIL_MIN_BYTES = 1 << 20

# fx targets that write into their first argument (or, for setitem, into the indexed tensor): names with a
# trailing underscore (add_, copy_, index_copy_), setitem and the augmented assignments (x += y on a tensor)
_VIEW_OPS = frozenset({"view", "reshape", "transpose", "permute", "unsqueeze", "squeeze", "expand", "getitem",
                       "narrow", "select", "as_strided", "t", "flatten", "unflatten", "contiguous", "view_as",
                       "expand_as", "split", "chunk", "unbind", "detach", "alias"})


def _tail_funcs() -> frozenset:
    """torch calls that may run after a replay instead of inside the graph: pure functions of their inputs
    (no in-place write, no randomness) that allocate their output."""
    import operator

    import torch

    return frozenset({torch._C._nn.linear, torch.nn.functional.linear, torch.matmul, torch.mm, torch.addmm,
                      torch.bmm, operator.matmul})


def split_tail(gm, outputs, is_region: Callable[[Any], bool], min_bytes: int | None = None):
    """(head GraphModule, finish, no_clone) or None. Each output of `gm` made by a node that nothing else reads,
    which is a forge region's call (`is_region(target)`) or a GEMM (_tail_funcs), with positional node or
    scalar arguments and an output (by `outputs`, the graph's recorded outputs) of at least `min_bytes`
    (TAIL_MIN_BYTES), is taken out: the head returns None in its place and that node's argument nodes after
    the graph's own outputs; finish(head outputs) runs the taken nodes on them and returns the graph's outputs.
    no_clone: the positions of those arguments in the head's outputs (a replay's static buffers, read at once
    by finish: not copied out)."""
    import torch
    import torch.fx as fx

    from forge.fold import eliminate_dead_code

    min_bytes = TAIL_MIN_BYTES if min_bytes is None else min_bytes
    out_node = next((n for n in gm.graph.nodes if n.op == "output"), None)
    if out_node is None or not isinstance(out_node.args[0], (tuple, list)):
        return None
    outs = list(out_node.args[0])
    if not isinstance(outputs, (tuple, list)) or len(outputs) != len(outs):
        return None
    funcs = _tail_funcs()
    picked: list[tuple[int, fx.Node]] = []
    for i, n in enumerate(outs):
        if (not isinstance(n, fx.Node) or n.op != "call_function" or n.kwargs or len(n.users) != 1
                or sum(o is n for o in outs) != 1):
            continue
        if not (is_region(n.target) or n.target in funcs):
            continue
        v = outputs[i]
        if not isinstance(v, torch.Tensor) or v.numel() * v.element_size() < min_bytes:
            continue
        if not all(isinstance(a, fx.Node) or a is None or isinstance(a, (bool, int, float)) for a in n.args):
            continue
        picked.append((i, n))
    if not picked:
        return None
    new = fx.GraphModule(gm, gm.graph.__deepcopy__())
    by_name = {n.name: n for n in new.graph.nodes}
    new_out = next(n for n in new.graph.nodes if n.op == "output")
    flat = list(new_out.args[0])
    n_out, extra, plan = len(flat), [], []
    for i, n in picked:
        node = by_name[n.name]
        spec = []  # per argument: ("out", position in the head's outputs) or ("value", the literal)
        for a in node.args:
            if isinstance(a, fx.Node):
                spec.append(("out", n_out + len(extra)))
                extra.append(a)
            else:
                spec.append(("value", a))
        plan.append((i, node.target, tuple(spec)))
        flat[i] = None
    new_out.args = (tuple(flat + extra),)
    for _, n in picked:
        new.graph.erase_node(by_name[n.name])
    eliminate_dead_code(new.graph)  # not fx's own: it drops in-place method calls (forge/fold.py)
    new.recompile()

    def finish(res):
        res = list(res)
        for i, target, spec in plan:
            res[i] = target(*(res[v] if kind == "out" else v for kind, v in spec))
        return tuple(res[:n_out])

    finish.taken = [i for i, _, _ in plan]  # the graph's output positions finish computes
    return new, finish, frozenset(range(n_out, n_out + len(extra)))


def _name(node) -> str:
    t = node.target
    return t if isinstance(t, str) else getattr(t, "__name__", str(t))


def mutated_inputs(gm) -> set[int]:
    """Indices of the placeholders of `gm` that some node writes into in place (forge/fold.py written_by: an op
    named with a trailing underscore, setitem, an augmented assignment, out=, inplace=True), directly or through
    views of them."""
    from forge.fold import written_by

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
        for t in written_by(n):
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


def _cuda_latency(thunk: Callable, device_index: int) -> tuple[Any, float]:
    """(thunk(), seconds from an idle GPU to the end of the work it queued): a call's latency to its caller,
    host dispatch and device time together."""
    import torch

    torch.cuda.synchronize(device_index)
    t0 = time.perf_counter()
    out = thunk()
    torch.cuda.synchronize(device_index)
    return out, time.perf_counter() - t0


def _cuda_reserved(device_index: int) -> tuple[int, int]:
    """(bytes the caching allocator holds on the device, the device's total memory)."""
    import torch

    return torch.cuda.memory_reserved(device_index), torch.cuda.get_device_properties(device_index).total_memory


class GraphedRun:
    """`run` (a captured graph's forward) replayed from a CUDA graph from its third call on (auto: from the
    call after its AUTO_SAMPLES timed calls, and kept only where the timed replays pay); see the module
    docstring. `capture(fn, args, device_index) -> (replay, outputs)` is swappable (tests use a fake)."""

    def __init__(self, run: Callable, mutated: set[int], device_index: int = 0, clone_outputs: bool = True,
                 capture: Callable = _torch_capture, first_args: tuple | None = None, require_cuda: bool = True,
                 auto: bool = False, latency: Callable | None = None, reserved: Callable | None = None,
                 no_clone: frozenset = frozenset(), after: str = ""):
        self.run, self.mutated, self.device_index = run, frozenset(mutated), device_index
        self.require_cuda = require_cuda  # False only with a capture that is not CUDA's (tests' fake)
        self.clone_outputs, self._capture = clone_outputs, capture
        # output positions handed out as the replay left them (split_tail's arguments of what runs after it)
        self.no_clone, self.after = frozenset(no_clone), after
        # auto: keep the graph only where its replays are measured faster (module docstring). latency(thunk)
        # -> (result, seconds) and reserved() -> (bytes held, device bytes) are swappable for tests.
        self.auto = auto
        self._latency = latency or (lambda thunk: _cuda_latency(thunk, device_index))
        self._reserved = reserved or (lambda: _cuda_reserved(device_index))
        self.run_s: list[float] = []  # auto: the timed calls as captured (seconds each)
        self.replay_s: list[float] = []  # auto: the timed replays, copies included
        self.verdict: str | None = None  # auto: why the graph was kept (a dropped one's reason is self.reason)
        self._ever_moved: set[int] = set()  # auto: inputs whose storage moved during the timed calls
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
            if self.auto and self.verdict is None:
                out, seconds = self._latency(lambda: self._replayed(args))
                self.replay_s.append(seconds)
                if len(self.replay_s) >= AUTO_SAMPLES:
                    self._decide()
                return out
            return self._replayed(args)
        if self._first is None:
            self._first = self._check_first(args)
            return self.run(*args)
        if self.auto and self.verdict is None and len(self.run_s) < AUTO_SAMPLES:
            now = [self._where(a) for a in args]
            self._ever_moved |= {i for i, w in enumerate(now) if w != self._first[i]}
            out, seconds = self._latency(lambda: self.run(*args))
            self.run_s.append(seconds)
            return out
        return self._capture_now(args)

    def _replayed(self, args: tuple):
        for i in self._moving:
            self._static[i].copy_(args[i])
        self._replay()
        self.replays += 1
        return self._outputs()

    def _decide(self) -> None:
        """auto: keep the graph or release it, from the timed calls (module docstring)."""
        best_run, best_replay = min(self.run_s), min(self.replay_s)
        times = (f"best replay {best_replay * 1e3:.3f} ms per call, best run as captured {best_run * 1e3:.3f} ms "
                 f"(of {len(self.replay_s)} and {len(self.run_s)}, each from an idle GPU)")
        if best_replay <= AUTO_MARGIN * best_run:
            self.verdict = f"auto: kept, {times}"
            return
        self.reason = f"auto: released, not {1 / AUTO_MARGIN:.2f}x faster: {times}"
        self._release()

    def _release(self) -> None:
        """Drop the graph and what it holds (its pool goes back to the allocator with the last reference)."""
        self._replay, self._static, self._out, self._moving, self._pinned, self._values = None, [], None, [], [], []

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
        moving = [i for i, a in enumerate(args) if tensor[i] and (now[i] != self._first[i] or i in self._ever_moved)]
        static = []
        for i, a in enumerate(args):
            if i in moving:
                s = torch.empty_strided(a.size(), a.stride(), dtype=a.dtype, device=a.device)
                s.copy_(a)
                static.append(s)
            else:
                static.append(a)
        held = self._reserved()[0] if self.auto else 0
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
        if self.auto and self.verdict is None:
            after, total = self._reserved()
            if after - held > AUTO_MAX_POOL_SHARE * total:
                self.reason = (f"auto: released, its capture holds {(after - held) / 2**20:.0f} MiB, more than "
                               f"{AUTO_MAX_POOL_SHARE:.0%} of the device's memory")
                self._release()
                return self.run(*args)
        # a capture records the launches without running them: replay once for this call's outputs
        replay()
        self.replays += 1
        return self._outputs()

    def _outputs(self):
        import torch

        if not self.clone_outputs:
            return self._out
        if isinstance(self._out, (tuple, list)):
            return type(self._out)(o.clone() if isinstance(o, torch.Tensor) and i not in self.no_clone else o
                                   for i, o in enumerate(self._out))
        return self._out.clone() if isinstance(self._out, torch.Tensor) else self._out

    def describe(self) -> str:
        if self.reason is not None:
            return f"not replayed: {self.reason}"
        return (f"{self.captures} capture(s), {self.replays} replay(s) of {self.calls} call(s)"
                + (f", {self.moved} run without it (an input read in place moved)" if self.moved else "")
                + (f"; {self.after}" if self.after else "")
                + (f"; {self.verdict}" if self.verdict else ""))
