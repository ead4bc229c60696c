"""The environment a timing is valid for. Part of every cache key: a kernel tuned on one GPU,
driver, torch or triton version, or with other templates, is never served to another.

torch/triton are imported lazily so `import forge` stays light.
"""

from __future__ import annotations

import functools
import platform
import shutil
import subprocess
from typing import Any

from forge._version import __version__

BACKENDS = ("cuda", "interpreter")


def _triton_version() -> str:
    # From package metadata: importing triton in the parent would cost ~1 s and is not needed.
    from importlib import metadata

    try:
        return metadata.version("triton")
    except metadata.PackageNotFoundError:
        return "missing"


@functools.lru_cache(maxsize=8)
def _nvidia_driver() -> str:
    # torch does not expose the driver version; nvidia-smi does and costs ~50 ms once per process.
    exe = shutil.which("nvidia-smi")
    if exe is None:
        return "unknown"
    try:
        out = subprocess.run([exe, "--query-gpu=driver_version", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=20, check=True).stdout
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    return out.strip().splitlines()[0] if out.strip() else "unknown"


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


@functools.lru_cache(maxsize=8)
def collect_env(backend: str, device_index: int = 0) -> dict[str, Any]:
    """Fingerprint of the running environment for `backend` (without the template hash, which is
    per op and added by the caller)."""
    if backend not in BACKENDS:
        raise ValueError(f"unknown backend {backend!r}")
    import torch

    env: dict[str, Any] = {
        "backend": backend,
        "torch": torch.__version__,
        "triton": _triton_version(),
        "forge": __version__,
    }
    if backend == "cuda":
        props = torch.cuda.get_device_properties(device_index)
        env.update(
            gpu=props.name,
            cc=f"{props.major}.{props.minor}",
            sm_count=props.multi_processor_count,
            driver=_nvidia_driver(),
            cuda=torch.version.cuda or "unknown",
        )
    else:
        env.update(gpu=None, cpu=_cpu_model(), machine=platform.machine())
    return env
