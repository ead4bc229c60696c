"""forge.spec: the canonical form and hash of a KernelSpec (cache keys hang off them) and parse_shape."""

from __future__ import annotations

import dataclasses
import hashlib
import json

import pytest

from forge.key import cache_key
from forge.spec import (
    DTYPES,
    KernelSpec,
    TensorSpec,
    canonical_json,
    contiguous_strides,
    parse_shape,
)


def rmsnorm_spec(shape=(2048, 4096), dtype="float16", device="cuda", attrs=None) -> KernelSpec:
    return KernelSpec("rmsnorm", (TensorSpec(shape, dtype, device=device),
                                  TensorSpec((shape[-1],), dtype, device=device)),
                      {"eps": 1e-6} if attrs is None else attrs)


# Computed once from forge's canonical form and hard-coded on purpose: every cached kernel is keyed by
# this hash, so any change to the canonical form (field names, key order, separators, float spelling,
# default strides) silently orphans every user's cache. If this fails, the change must be deliberate
# (and bump the cache schema), not accidental.
FIXED_CANONICAL = (
    '{"attrs":{"eps":1e-06},"inputs":[{"device":"cuda","dtype":"float16","shape":[2048,4096],'
    '"strides":[4096,1]},{"device":"cuda","dtype":"float16","shape":[4096],"strides":[1]}],"op":"rmsnorm"}'
)
FIXED_HASH = "00950bb52a32a4824f93da2a841b7ed6fae4ab49ae24a4813da93cbe37f36cf1"


def test_hash_is_stable():
    spec = rmsnorm_spec()
    assert spec.canonical() == FIXED_CANONICAL
    assert spec.hash() == FIXED_HASH
    assert spec.hash() == hashlib.sha256(FIXED_CANONICAL.encode()).hexdigest()
    assert rmsnorm_spec().hash() == FIXED_HASH  # a fresh, equal spec


def test_attr_key_order_does_not_change_the_hash():
    a = KernelSpec("x", (TensorSpec((4, 8), "float32"),), {"alpha": 1.5, "beta": 2, "gamma": "g"})
    b = KernelSpec("x", (TensorSpec((4, 8), "float32"),), {"gamma": "g", "beta": 2, "alpha": 1.5})
    assert list(a.attrs) != list(b.attrs)
    assert a.canonical() == b.canonical()
    assert a.hash() == b.hash()
    assert hash(a) == hash(b) and a == b


def test_explicit_contiguous_strides_hash_like_the_default():
    assert rmsnorm_spec().hash() == KernelSpec(
        "rmsnorm", (TensorSpec((2048, 4096), "float16", (4096, 1)), TensorSpec((4096,), "float16", (1,))),
        {"eps": 1e-6}).hash()


def _variants_of_base() -> dict[str, KernelSpec]:
    base = rmsnorm_spec()
    x, w = base.inputs
    return {
        "op": dataclasses.replace(base, op="layernorm"),
        "shape": rmsnorm_spec(shape=(2048, 4097)),
        "leading shape": dataclasses.replace(base, inputs=(TensorSpec((2049, 4096), "float16"), w)),
        "dtype": rmsnorm_spec(dtype="bfloat16"),
        "one input's dtype": dataclasses.replace(base, inputs=(x, TensorSpec((4096,), "float32"))),
        "strides": dataclasses.replace(base, inputs=(TensorSpec(x.shape, x.dtype, (8192, 1)), w)),
        "device": rmsnorm_spec(device="cpu"),
        "attr value": rmsnorm_spec(attrs={"eps": 1e-5}),
        "attr type": rmsnorm_spec(attrs={"eps": 1}),
        "attr added": rmsnorm_spec(attrs={"eps": 1e-6, "extra": 0}),
        "attr removed": rmsnorm_spec(attrs={}),
        "input dropped": dataclasses.replace(base, inputs=(x,)),
        "inputs swapped": dataclasses.replace(base, inputs=(w, x)),
    }


@pytest.mark.parametrize("field", list(_variants_of_base()))
def test_any_field_change_changes_the_hash(field):
    changed = _variants_of_base()[field]
    assert changed.hash() != FIXED_HASH
    assert changed != rmsnorm_spec()


def test_all_changed_hashes_are_distinct():
    hashes = [s.hash() for s in _variants_of_base().values()]
    assert len(set(hashes)) == len(hashes)


@pytest.mark.parametrize("spec", [
    rmsnorm_spec(),
    rmsnorm_spec(shape=(2, 3, 33), dtype="float32", device="cpu"),
    KernelSpec("softmax", (TensorSpec((4, 8), "bfloat16", (16, 2)),), {"dim": -1}),
    KernelSpec("noattrs", (TensorSpec((1,), "float32"),)),
])
def test_to_dict_from_dict_round_trip(spec):
    d = spec.to_dict()
    back = KernelSpec.from_dict(d)
    assert back == spec
    assert back.hash() == spec.hash()
    via_json = KernelSpec.from_dict(json.loads(json.dumps(d)))  # lists, not tuples
    assert via_json == spec and via_json.hash() == spec.hash()
    assert isinstance(via_json.inputs, tuple) and isinstance(via_json.inputs[0].shape, tuple)
    for t in spec.inputs:
        assert TensorSpec.from_dict(t.to_dict()) == t


def test_to_dict_is_a_copy():
    spec = rmsnorm_spec()
    spec.to_dict()["attrs"]["eps"] = 1.0
    assert spec.attrs == {"eps": 1e-6}


def test_from_dict_defaults():
    t = TensorSpec.from_dict({"shape": [3, 4], "dtype": "float32", "strides": [4, 1]})
    assert t.device == "cuda"
    s = KernelSpec.from_dict({"op": "softmax", "inputs": [t.to_dict()]})
    assert s.attrs == {}


def test_spec_properties():
    spec = rmsnorm_spec(shape=(2, 3, 33), dtype="bfloat16", device="cpu")
    assert spec.shape_str == "2x3x33"
    assert spec.dtype == "bfloat16"
    assert spec.device == "cpu"
    assert {spec: 1}[rmsnorm_spec(shape=(2, 3, 33), dtype="bfloat16", device="cpu")] == 1  # hashable


@pytest.mark.parametrize(("shape", "strides"), [
    ((), ()),
    ((7,), (1,)),
    ((2, 3), (3, 1)),
    ((2, 3, 4), (12, 4, 1)),
    ((5, 1, 6), (6, 6, 1)),
    ((2048, 4096), (4096, 1)),
])
def test_contiguous_strides(shape, strides):
    assert contiguous_strides(shape) == strides
    t = TensorSpec(shape, "float32")
    assert t.strides == strides
    assert t.contiguous


def test_tensor_spec_fields():
    t = TensorSpec([2, 3, 4], "float16")  # any sequence of ints
    assert t.shape == (2, 3, 4) and isinstance(t.shape, tuple)
    assert t.numel == 24 and t.itemsize == 2 and t.nbytes == 48
    assert TensorSpec((2, 3), "float32").nbytes == 24
    assert TensorSpec((2, 3), "bfloat16").itemsize == 2
    nc = TensorSpec((2, 3), "float32", (1, 2))
    assert nc.strides == (1, 2) and not nc.contiguous
    assert TensorSpec((2, 3), "float32").device == "cuda"
    with pytest.raises(dataclasses.FrozenInstanceError):
        t.dtype = "float32"  # type: ignore[misc]


@pytest.mark.parametrize("dtype", ["float64", "fp16", "int8", "", "Float32"])
def test_invalid_dtype_raises(dtype):
    with pytest.raises(ValueError, match="unsupported dtype"):
        TensorSpec((2, 3), dtype)


def test_supported_dtypes():
    assert set(DTYPES) == {"float16", "bfloat16", "float32"}
    for d in DTYPES:
        assert TensorSpec((1,), d).dtype == d


@pytest.mark.parametrize("shape", [(0,), (2, 0), (0, 4), (-1, 3), (3, -2)])
def test_invalid_shape_raises(shape):
    with pytest.raises(ValueError, match="every dimension must be >= 1"):
        TensorSpec(shape, "float32")


def test_mismatched_strides_raise():
    with pytest.raises(ValueError, match="do not match shape"):
        TensorSpec((2, 3), "float32", (1,))


# --- cache_key --------------------------------------------------------------------------------------

ENV = {"backend": "cuda", "gpu": "NVIDIA H200", "triton": "3.9.0", "torch": "2.13.0", "templates": "abc"}


def test_cache_key_depends_on_env():
    spec = rmsnorm_spec()
    k = cache_key(spec, ENV)
    assert len(k) == 64 and int(k, 16) >= 0
    assert k == cache_key(rmsnorm_spec(), dict(ENV))
    assert k == cache_key(spec, dict(reversed(list(ENV.items()))))  # env key order does not matter
    assert k != cache_key(spec, {**ENV, "backend": "interpreter"})
    assert k != cache_key(spec, {**ENV, "triton": "3.9.1"})
    assert k != cache_key(spec, {**ENV, "extra": None})
    assert k != cache_key(rmsnorm_spec(dtype="float32"), ENV)
    assert k != spec.hash()  # the key covers more than the spec


def test_cache_key_literal():
    # Hard-coded for the same reason as FIXED_HASH: a change here orphans every cache entry.
    env = {"backend": "cuda", "triton": "3.9.0"}
    assert cache_key(rmsnorm_spec(), env) == "743842ebcebec125e7a2c3e12ac6fc7dc4509bc480a27d336675aca79b0fae06"
    assert cache_key(rmsnorm_spec(), env) == hashlib.sha256(
        canonical_json({"spec": rmsnorm_spec().to_dict(), "env": env}).encode()).hexdigest()


def test_canonical_json():
    assert canonical_json({"b": [1, 2.5], "a": {"d": None, "c": True}}) == '{"a":{"c":true,"d":null},"b":[1,2.5]}'
    with pytest.raises(ValueError):
        canonical_json({"x": float("nan")})
    with pytest.raises(ValueError):
        rmsnorm_spec(attrs={"eps": float("inf")}).hash()


# --- parse_shape ------------------------------------------------------------------------------------


@pytest.mark.parametrize(("text", "shape"), [
    ("2048x4096", (2048, 4096)),
    ("7", (7,)),
    ("2x3x4", (2, 3, 4)),
    ("1x1", (1, 1)),
    ("2048X4096", (2048, 4096)),
    ("2048×4096", (2048, 4096)),
])
def test_parse_shape_accepts(text, shape):
    assert parse_shape(text) == shape


@pytest.mark.parametrize(("text", "message"), [
    ("", "expected integers joined by 'x'"),
    ("axb", "expected integers joined by 'x'"),
    ("2048*4096", "expected integers joined by 'x'"),
    ("2048,4096", "expected integers joined by 'x'"),
    ("2x", "expected integers joined by 'x'"),
    ("x", "expected integers joined by 'x'"),
    ("2.5x3", "expected integers joined by 'x'"),
    ("0x4", "every dimension must be >= 1"),
    ("4x0", "every dimension must be >= 1"),
    ("-1x3", "expected integers joined by"),
    ("+3x4", "expected integers joined by"),
    (" 7 x 1_000", "expected integers joined by"),
])
def test_parse_shape_rejects(text, message):
    with pytest.raises(ValueError, match="malformed shape") as exc:
        parse_shape(text)
    assert message in str(exc.value)
    assert repr(text) in str(exc.value)  # the message quotes what the user typed
