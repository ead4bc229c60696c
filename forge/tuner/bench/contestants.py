"""The reference contestants of `forge bench`: the fused torch op per op family (FUSED, from forge/fused.py),
the Liger-Kernel adapters (LIGER), and the torch.compile helpers."""

from __future__ import annotations

import importlib
import os
import shutil
import types
from collections.abc import Callable

from forge import fused as fused_ops
from forge.tuner.bench._common import _short

CONTESTANTS = ("forge", "eager", "fused", "compile", "compile-max-autotune", "liger")


# The fused torch op per family lives in the runtime (forge/fused.py): the search times it as a candidate
# and the shim serves it; bench reads the same table.
FUSED = fused_ops.FUSED
Fused = fused_ops.Fused


class _Unavailable(Exception):
    """A contestant that cannot run here; the message says why (shown in the table and in --json)."""


def _liger_api(functional_name: str, ops_module: str, function_class: str) -> Callable:
    """liger_kernel.transformers.functional.<name> (the stable functional API), else <ops_module>.<Class>.apply."""
    try:
        functional = importlib.import_module("liger_kernel.transformers.functional")
        fn = getattr(functional, functional_name, None)
    except Exception:  # noqa: BLE001 - a broken liger install must not stop the bench
        fn = None
    if fn is None:
        try:
            fn = getattr(importlib.import_module(ops_module), function_class).apply
        except Exception as exc:  # noqa: BLE001
            raise _Unavailable(f"this liger_kernel has neither transformers.functional.{functional_name} nor "
                               f"{ops_module}.{function_class} ({type(exc).__name__})") from None
    return fn


def _last_dim_only(a: dict, what: str) -> None:
    """Liger's norms normalize the last dim: a spec over another dim or several trailing dims is not theirs
    (seen on the H200: an assertion / ValueError from inside Liger, reported as an error before)."""
    if a.get("dim", -1) != -1 or a.get("dims", 1) != 1:
        raise _Unavailable(f"Liger-Kernel's {what} normalizes the last dim only")


def _liger_rmsnorm():
    fn = _liger_api("liger_rms_norm", "liger_kernel.ops.rms_norm", "LigerRMSNormFunction")

    def call(i, a):
        _last_dim_only(a, "rms_norm")
        return fn(i[0], i[1], a["eps"])

    return "liger_rms_norm", call


def _liger_add_norm():
    # LigerFusedAddRMSNormFunction (liger_kernel >= 0.6): (x, r, w, eps) -> (y, h), rmsnorm only. The pair
    # is returned as it is (bench stacks it into forge's (2, ...) layout only to validate it, untimed).
    fn = _liger_api("liger_fused_add_rms_norm", "liger_kernel.ops.fused_add_rms_norm", "LigerFusedAddRMSNormFunction")

    def call(i, a):
        if a.get("norm") != "rmsnorm":
            raise _Unavailable("Liger-Kernel fuses the residual add with rmsnorm only, not layer_norm")
        return tuple(fn(i[0], i[1], i[2], a["eps"]))

    return "liger_fused_add_rms_norm", call


def _liger_softmax():
    fn = _liger_api("liger_softmax", "liger_kernel.ops.softmax", "LigerSoftmaxFunction")
    return "liger_softmax", lambda i, a: fn(i[0])


def _liger_layer_norm():
    fn = _liger_api("liger_layer_norm", "liger_kernel.ops.layer_norm", "LigerLayerNormFunction")

    def call(i, a):
        _last_dim_only(a, "layer_norm")
        return fn(i[0], i[1], i[2], a["eps"])

    return "liger_layer_norm", call


def _liger_swiglu():
    fn = _liger_api("liger_swiglu", "liger_kernel.ops.swiglu", "LigerSiLUMulFunction")
    return "liger_swiglu", lambda i, a: fn(i[0], i[1])


def _liger_cross_entropy():
    try:
        fn = importlib.import_module("liger_kernel.transformers.functional").liger_cross_entropy
    except Exception:  # noqa: BLE001 - the Function's positional signature changed across versions
        raise _Unavailable("this liger_kernel has no transformers.functional.liger_cross_entropy") from None

    def call(i, a):
        loss = fn(i[0], i[1], ignore_index=a["ignore_index"], reduction=a["reduction"])
        return loss[0] if isinstance(loss, tuple) else loss  # some versions return (loss, z_loss)

    return "liger_cross_entropy", call


LIGER: dict[str, Callable[[], tuple[str, Callable]] | str] = {
    "rmsnorm": _liger_rmsnorm,
    "add_norm": _liger_add_norm,
    "softmax": _liger_softmax,
    "layer_norm": _liger_layer_norm,
    "silu_mul": _liger_swiglu,
    "cross_entropy": _liger_cross_entropy,
    "rope": ("Liger's rope rotates q and k in one call and reads only the first half of cos/sin (the Hugging "
             "Face layout, halves equal); forge's rope takes any (S, D) cos/sin"),
    "gelu": "Liger-Kernel has GeGLU (gelu(a) * b), not a plain gelu",
    "matmul": "Liger-Kernel has no matmul",
    "linear": "Liger-Kernel has no linear with a fused epilogue",
    "swiglu": "Liger-Kernel's SwiGLU fuses only silu(g) * u, not the two projections",
    "pointwise": "Liger-Kernel has no generated elementwise kernels",
    "sdpa": "Liger-Kernel has no attention forward kernel",
    "reduce": "Liger-Kernel has no row reductions",
    "log_softmax": "Liger-Kernel has no log_softmax kernel",
    "cat": "Liger-Kernel has no concatenation kernel",
}


def _liger(op: str) -> tuple[str, Callable]:
    what = LIGER.get(op, f"Liger-Kernel has no {op} kernel")
    if isinstance(what, str):
        raise _Unavailable(what)
    try:
        importlib.import_module("liger_kernel")
    except ImportError:
        raise _Unavailable("liger_kernel is not installed (pip install liger-kernel)") from None
    except Exception as exc:  # noqa: BLE001 - installed but broken (e.g. built for another triton)
        raise _Unavailable(f"liger_kernel failed to import: {_short(exc)}") from None
    return what()


def _cpp_compiler() -> str | None:
    """The C++ compiler torch.compile's CPU backend (inductor) would use, if one exists."""
    for name in (os.environ.get("CXX"), "g++", "clang++", "c++"):
        if name and shutil.which(name):
            return name
    return None


def _fresh_function(fn: Callable, tag: str) -> Callable:
    """A copy of `fn` with its own code object. Dynamo caches compiled code per code object, so two
    torch.compile modes (or many specs of one op in a manifest, past dynamo's recompile limit) on the same
    function would share (or exhaust) one cache."""
    code = fn.__code__.replace(co_name=f"{fn.__code__.co_name}_{tag}")
    new = types.FunctionType(code, fn.__globals__, f"{fn.__name__}_{tag}", fn.__defaults__, fn.__closure__)
    new.__kwdefaults__ = fn.__kwdefaults__
    return new
