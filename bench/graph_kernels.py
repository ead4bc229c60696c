"""Which node of a model's captured graph launches which kernels, and what they cost on the device.

    PYTHONPATH=. python3 bench/graph_kernels.py --models gpt2,llama [--top 25] [--out DIR]

For each model of bench/models.py: TorchDynamo captures its graphs (the graphs the forge backend sees), each
is run as captured (no forge, no Inductor) through a torch.fx Interpreter that wraps every node in a profiler
range, and torch.profiler attributes every kernel's own device time to the node that launched it. Prints
per model the nodes with the most device time (node, its target, kernels) and writes DIR/graph_kernels.json.
A diagnostic: it says where the device time of the work the backend leaves outside its regions comes from
(GPT-2's boolean kernels and KV-cache concatenations, issue 14).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402

PREFIX = "fxnode::"


def captured(name: str) -> tuple[list, callable]:
    """(the GraphModules Dynamo captured for one forward of the model, a callable running that forward
    with each graph run node by node in profiler ranges)."""
    import models
    import torch.fx as fx
    from torch.profiler import record_function

    model, args, step, _ = models.build(name)
    graphs = []

    class Ranged(fx.Interpreter):
        def run_node(self, n):
            target = n.target if isinstance(n.target, str) else getattr(n.target, "__name__", n.target)
            with record_function(f"{PREFIX}{self.tag}:{n.name}:{target}"):
                return super().run_node(n)

    def backend(gm, example_inputs):
        tag = f"g{len(graphs)}"
        graphs.append(gm)

        def run(*a):
            it = Ranged(gm)
            it.tag = tag
            return it.run(*a)
        return run

    torch._dynamo.reset()
    compiled = torch.compile(model, backend=backend, dynamic=False)

    def fwd():
        kw = args()
        return step(compiled, kw)
    return graphs, fwd


def profile(fwd, iters: int = 3) -> dict:
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity

    with torch.no_grad():
        fwd()
        fwd()
        torch.cuda.synchronize()
        with torch.profiler.profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            for _ in range(iters):
                fwd()
            torch.cuda.synchronize()
    per: dict[str, dict] = {}
    for e in prof.events():
        if e.device_type != DeviceType.CPU or not e.name.startswith(PREFIX):
            continue
        node = e.name[len(PREFIX):]
        d = per.setdefault(node, {"us": 0.0, "kernels": {}})
        stack = [e]
        while stack:  # the kernels launched by any op inside the node's range
            x = stack.pop()
            for k in x.kernels:
                d["us"] += k.duration / iters
                d["kernels"][k.name[:80]] = d["kernels"].get(k.name[:80], 0.0) + k.duration / iters
            stack.extend(x.cpu_children)
    import models

    return {"total_us": models.kernel_times(prof, iters)["total"] * 1e3, "nodes": per}  # every kernel, once


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", default="gpt2")
    ap.add_argument("--top", type=int, default=25)
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    a = ap.parse_args(argv)
    import datetime as dt
    import subprocess

    import triton

    drv = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                         capture_output=True, text=True).stdout.strip()
    out = {"gpu": torch.cuda.get_device_name(), "driver": drv, "torch": torch.__version__,
           "triton": triton.__version__, "date": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
           "command": "PYTHONPATH=. python3 " + " ".join(sys.argv), "models": {}}
    try:
        import transformers
        out["transformers"] = transformers.__version__
    except ImportError:
        pass
    for name in a.models.split(","):
        graphs, fwd = captured(name)
        res = profile(fwd)
        res["graphs"] = len(graphs)
        out["models"][name] = res
        inside = sum(d["us"] for d in res["nodes"].values())
        print(f"\n== {name}: {len(graphs)} graph(s), device {res['total_us']:.1f} us per forward, "
              f"{inside:.1f} us inside graph nodes")
        for node, d in sorted(res["nodes"].items(), key=lambda kv: -kv[1]["us"])[:a.top]:
            ks = "; ".join(f"{k} {v:.1f}" for k, v in sorted(d["kernels"].items(), key=lambda kv: -kv[1])[:2])
            print(f"{d['us']:9.1f} us  {node[:70]:70s} {ks}")
    Path(a.out).mkdir(parents=True, exist_ok=True)
    (Path(a.out) / "graph_kernels.json").write_text(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
