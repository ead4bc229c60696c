"""What a kernel is asked to compute: the op, its input tensors and its scalar attributes.

Import-light on purpose (stdlib only): the runtime shim builds a KernelSpec on every first call
of a new signature, and the cache key is derived from it (forge/key.py).
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from typing import Any

DTYPES = ("float16", "bfloat16", "float32")  # compute dtypes: what `--dtype` and an op's main input take
# Every dtype a spec's tensor may have: index tensors (cross-entropy targets) are integers.
TENSOR_DTYPES = (*DTYPES, "int64", "int32")
ITEMSIZE = {"float16": 2, "bfloat16": 2, "float32": 4, "int64": 8, "int32": 4}


def dtype_name(dtype) -> str:
    """A torch dtype's name as specs spell it (torch.float16 -> 'float16'); other dtypes keep their name."""
    name = str(dtype)
    return name[len("torch."):] if name.startswith("torch.") else name


def canonical_json(obj: Any) -> str:
    """One spelling per value: sorted keys, no whitespace, floats by repr. Hashes are taken of this."""
    return json.dumps(obj, sort_keys=True, separators=(",", ":"), allow_nan=False)


def contiguous_strides(shape: tuple[int, ...]) -> tuple[int, ...]:
    strides, acc = [], 1
    for size in reversed(shape):
        strides.append(acc)
        acc *= max(size, 1)
    return tuple(reversed(strides))


def storage_elements(shape: tuple[int, ...], strides: tuple[int, ...]) -> int:
    """Elements of the storage a tensor of this shape and these strides spans (shape's product when
    contiguous)."""
    return 1 + sum((n - 1) * st for n, st in zip(shape, strides, strict=True))


def same_layout(shape: tuple[int, ...], a: tuple[int, ...], b: tuple[int, ...]) -> bool:
    """Strides a and b address a tensor of `shape` alike (a dimension of size 1 has no stride that matters)."""
    return all(n == 1 or x == y for n, x, y in zip(shape, a, b, strict=True))


@dataclass(frozen=True)
class TensorSpec:
    shape: tuple[int, ...]
    dtype: str
    strides: tuple[int, ...] | None = None  # None means contiguous
    device: str = "cuda"  # device *type*; the GPU model is part of the environment, not the spec

    def __post_init__(self) -> None:
        object.__setattr__(self, "shape", tuple(int(s) for s in self.shape))
        if self.strides is None:
            object.__setattr__(self, "strides", contiguous_strides(self.shape))
        else:
            object.__setattr__(self, "strides", tuple(int(s) for s in self.strides))
        if self.dtype not in TENSOR_DTYPES:
            raise ValueError(f"unsupported dtype {self.dtype!r}; expected one of {', '.join(TENSOR_DTYPES)}")
        if any(s < 1 for s in self.shape):
            raise ValueError(f"every dimension must be >= 1, got shape {self.shape}")
        if len(self.strides) != len(self.shape):
            raise ValueError(f"strides {self.strides} do not match shape {self.shape}")

    @property
    def contiguous(self) -> bool:
        return same_layout(self.shape, self.strides, contiguous_strides(self.shape))

    @property
    def numel(self) -> int:
        n = 1
        for s in self.shape:
            n *= s
        return n

    @property
    def itemsize(self) -> int:
        return ITEMSIZE[self.dtype]

    @property
    def nbytes(self) -> int:
        """The bytes of its elements (what a kernel moves: bytes_moved, the roofline)."""
        return self.numel * self.itemsize

    @property
    def span_bytes(self) -> int:
        """The bytes one tensor of this spec occupies: its elements plus the gaps of a strided layout (the
        memory model, timing sets, the fits check). nbytes when contiguous."""
        return storage_elements(self.shape, self.strides) * self.itemsize

    def to_dict(self) -> dict[str, Any]:
        return {"shape": list(self.shape), "dtype": self.dtype, "strides": list(self.strides),
                "device": self.device}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> TensorSpec:
        return cls(tuple(d["shape"]), d["dtype"], tuple(d["strides"]), d.get("device", "cuda"))


@dataclass(frozen=True)
class KernelSpec:
    op: str
    inputs: tuple[TensorSpec, ...]
    attrs: dict[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return {"op": self.op, "inputs": [t.to_dict() for t in self.inputs], "attrs": dict(self.attrs)}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> KernelSpec:
        return cls(d["op"], tuple(TensorSpec.from_dict(t) for t in d["inputs"]), dict(d.get("attrs", {})))

    def canonical(self) -> str:
        return canonical_json(self.to_dict())

    def hash(self) -> str:
        return hashlib.sha256(self.canonical().encode()).hexdigest()

    # Convenience for display: the first input's shape and dtype describe most ops.
    @property
    def shape_str(self) -> str:
        return "x".join(str(s) for s in self.inputs[0].shape)

    @property
    def dtype(self) -> str:
        return self.inputs[0].dtype

    @property
    def device(self) -> str:
        return self.inputs[0].device

    def __hash__(self) -> int:  # attrs is a dict, so the dataclass default would fail
        return hash(self.canonical())


def parse_shape(text: str) -> tuple[int, ...]:
    """'2048x4096' -> (2048, 4096). Raises ValueError with a message fit for a user."""
    parts = text.strip().lower().replace("×", "x").split("x")
    if not all(p.isdigit() and p.isascii() for p in parts):
        raise ValueError(f"malformed shape {text!r}: expected integers joined by 'x', e.g. 2048x4096")
    shape = tuple(int(p) for p in parts)
    if any(s < 1 for s in shape):
        raise ValueError(f"malformed shape {text!r}: every dimension must be >= 1")
    return shape
